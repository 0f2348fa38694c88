"""vLLM routed experts and Megatron router_trace files: exact counts, every malformed case (exit 2 with
one line naming the file and field), and `analyze` / `plan` end to end.

The fixtures are written the way the engines write them:
- vLLM's OpenAI server: a `CompletionResponse` serialised by pydantic (`model_dump_json`: compact JSON,
  fields in declaration order), `prompt_routed_experts` at the response level and `routed_experts`
  in each choice; newer vLLM: `routed_experts` a base64 `.npy` of prompt + generated - 1 rows;
- vLLM offline: one `RequestOutput` per line with the same field names (`outputs[i].routed_experts`);
- Megatron: `RouterTracer._flush_records_to_disk`, `json.dumps(record) + "\\n"` per record, the keys in
  the order `_make_index_record` builds them, `top_indices` last.
"""

import base64
import io
import json

import numpy as np
import pytest

from moe_place.cli.main import main
from moe_place.traces import load_trace
from moe_place.traces.jsonl import parse_object, parse_with_id_lists
from moe_place.traces.megatron import read_router_trace
from moe_place.traces.vllm_routed import ID_FIELDS, parse_request, read_routed_experts, request_ids

LAYERS, TOP_K, EXPERTS = 4, 2, 8
PROMPTS, GENERATED = (5, 7, 4), (3, 2, 6)


def _routes(rng, tokens, dense_layers=(0,)):
    """int16 `[tokens, LAYERS, TOP_K]`: distinct experts per token, dense layers all 0 (early capturer)."""
    ids = np.argsort(rng.random((tokens, LAYERS, EXPERTS)), axis=2)[:, :, :TOP_K].astype(np.int16)
    ids[:, list(dense_layers), :] = 0
    return ids


def _requests(seed=0):
    rng = np.random.default_rng(seed)
    out = [(_routes(rng, p), _routes(rng, g)) for p, g in zip(PROMPTS, GENERATED)]
    out[0][0][0, 1, :] = [EXPERTS - 1, 0]  # the largest expert appears: num_experts is largest + 1
    return out


def _compact(obj):
    return json.dumps(obj, separators=(",", ":"))


def _server_response(i, prompt, generated):
    """A /v1/completions response as vLLM's serving layer returns it (non-streaming)."""
    return {"id": f"cmpl-{i}", "object": "text_completion", "created": 1700000000 + i, "model": "Qwen/Qwen3-30B-A3B",
            "choices": [{"index": 0, "text": " hello", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                         "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                         "routed_experts": generated.tolist()}],
            "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(generated),
                      "completion_tokens": len(generated), "prompt_tokens_details": None},
            "prompt_routed_experts": prompt.tolist(), "kv_transfer_params": None}


def _write_lines(path, objects):
    path.write_text("".join(_compact(obj) + "\n" for obj in objects))
    return path


def _server_file(tmp_path, requests=None, name="responses.jsonl"):
    requests = _requests() if requests is None else requests
    return _write_lines(tmp_path / name, [_server_response(i, p, g) for i, (p, g) in enumerate(requests)])


def _npy_b64(arr):
    buffer = io.BytesIO()
    np.save(buffer, arr, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def _expected_counts(arrays, layers=(1, 2, 3)):
    ids = np.concatenate(arrays)[:, list(layers), :]
    return np.stack([np.bincount(ids[:, i, :].ravel(), minlength=EXPERTS) for i in range(len(layers))])


# ---------------------------------------------------------------------- vLLM: good files
def test_server_responses_read_token_level_with_exact_counts(tmp_path):
    requests = _requests()
    trace = load_trace(_server_file(tmp_path, requests))
    assert trace.is_token_level and trace.num_tokens == sum(PROMPTS) + sum(GENERATED) == 27
    assert (trace.num_experts, trace.top_k, trace.meta.layer_ids) == (EXPERTS, TOP_K, (1, 2, 3))  # dense layer 0 dropped
    assert trace.step_names == ("r0-2",) and trace.meta.model == "Qwen/Qwen3-30B-A3B"
    tokens = [part for pair in requests for part in pair]  # prompt, then generated, request by request
    np.testing.assert_array_equal(trace.topk_ids[0], np.concatenate(tokens)[:, 1:, :])
    np.testing.assert_array_equal(trace.total_counts(), _expected_counts(tokens))


def test_steps_group_whole_requests_until_step_tokens(tmp_path):
    trace = read_routed_experts(_server_file(tmp_path), step_tokens=10)
    # requests of 8, 9 and 10 tokens: 8 < 10, 8 + 9 >= 10 closes r0-1; r2 alone
    assert trace.step_names == ("r0-1", "r2") and [ids.shape[0] for ids in trace.topk_ids] == [17, 10]
    assert read_routed_experts(_server_file(tmp_path), step_tokens=1).step_names == ("r0", "r1", "r2")


def test_a_large_file_is_counted_with_the_same_counts_and_sample(tmp_path):
    path = _server_file(tmp_path)
    whole = read_routed_experts(path, step_tokens=10)
    counted = read_routed_experts(path, step_tokens=10, max_token_bytes=1)
    assert not counted.is_token_level and counted.step_names == whole.step_names
    np.testing.assert_array_equal(counted.step_counts(), whole.step_counts())
    np.testing.assert_array_equal(counted.token_sample().ids, whole.token_sample().ids)


def test_newer_vllm_base64_routes_and_offline_outputs_read_the_same(tmp_path):
    requests = _requests()
    reference = load_trace(_server_file(tmp_path, requests))
    # newer vLLM: one base64 .npy per choice, prompt + generated rows, no prompt_routed_experts
    newer = []
    for i, (prompt, generated) in enumerate(requests):
        response = _server_response(i, prompt, generated)
        del response["prompt_routed_experts"]
        response["choices"][0]["routed_experts"] = _npy_b64(np.concatenate([prompt, generated]).astype(np.uint8))
        newer.append(response)
    offline = [{"request_id": str(i), "prompt_routed_experts": p.tolist(), "outputs": [{"index": 0, "routed_experts": g.tolist()}]}
               for i, (p, g) in enumerate(requests)]
    for objects, name in ((newer, "newer.jsonl"), (offline, "offline.jsonl")):
        trace = load_trace(_write_lines(tmp_path / name, objects))
        np.testing.assert_array_equal(trace.step_counts(), reference.step_counts())


def test_n_completions_share_the_prompt_rows(tmp_path):
    rng = np.random.default_rng(3)
    prompt, first, second = _routes(rng, 4, ()), _routes(rng, 3, ()), _routes(rng, 2, ())
    response = _server_response(0, prompt, first)
    response["choices"].append({**response["choices"][0], "index": 1, "routed_experts": second.tolist()})
    trace = load_trace(_write_lines(tmp_path / "n2.jsonl", [response]))
    assert trace.num_tokens == 9 and trace.meta.layer_ids == (0, 1, 2, 3)
    np.testing.assert_array_equal(trace.topk_ids[0], np.concatenate([prompt, first, second]))


# ---------------------------------------------------------------------- vLLM: the fast reading of id lists
def _slow_request(line):
    obj = parse_object(line, "line")
    return obj, request_ids(obj, "line")


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])  # pydantic's compact JSON, json.dumps' default
def test_fast_id_lists_read_what_json_reads(separators):
    rng = np.random.default_rng(11)
    for tokens, layers, k, experts in ((1, 1, 1, 2), (3, 2, 1, 9), (5, 4, 2, 11), (7, 3, 8, 10000), (2, 61, 8, 384)):
        prompt = np.argsort(rng.random((tokens, layers, experts)), axis=2)[:, :, :k]
        prompt[0, 0, 0] = experts - 1
        response = _server_response(0, prompt, prompt[:1])
        line = json.dumps(response, separators=separators).encode() + b"\n"
        obj, lists = parse_with_id_lists(line, ID_FIELDS)
        ids = request_ids(obj, "line", lists)
        assert lists.all_taken and ids.dtype == np.uint16
        slow_obj, slow_ids = _slow_request(line)
        np.testing.assert_array_equal(ids, slow_ids)
        np.testing.assert_array_equal(parse_request(line, "line")[1], slow_ids)
        assert obj["model"] == slow_obj["model"] and obj["usage"] == slow_obj["usage"]


@pytest.mark.parametrize("value", ["[[[1,2]],[[3]]]", "[[[01,2]]]", "[[[1,-2]]]", "[[[1,,2]]]", "[[[1,2]3]]", "[[1,2]]",
                                   "[[[1.0,2]]]", "[[[1 ,2]]]", "[[[12345,1]]]", "[[[1,2]],3,[[4,5]]]", '[[[1,"2"]]]'])
def test_lists_the_fast_path_cannot_prove_are_left_to_json(value):
    line = b'{"prompt_routed_experts":' + value.encode() + b',"choices":[]}'
    assert parse_with_id_lists(line, ID_FIELDS) is None


def test_field_names_elsewhere_in_the_line_read_as_json_reads_them():
    routes = [[[1, 2], [3, 4]]]
    # the field's name inside a string, in another object, and twice in one object (json keeps the last)
    line = json.dumps({"text": 'say "routed_experts": [[[7, 7]]]', "usage": {"routed_experts": [[[5, 6]]]},
                       "prompt_routed_experts": routes, "choices": [{"routed_experts": [[[8, 9], [1, 0]]]}]}).encode()
    np.testing.assert_array_equal(parse_request(line, "line")[1], _slow_request(line)[1])
    twice = b'{"prompt_routed_experts":[[[1,2]]],"prompt_routed_experts":[[[3,4]]],"choices":[]}'
    np.testing.assert_array_equal(parse_request(twice, "line")[1], [[[3, 4]]])
    escaped = b'{"note":"\\u0000moe-place ids 0","prompt_routed_experts":[[[1,2]]],"choices":[]}'
    assert parse_with_id_lists(escaped, ID_FIELDS) is None
    np.testing.assert_array_equal(parse_request(escaped, "line")[1], [[[1, 2]]])


# ---------------------------------------------------------------------- Megatron: good files
def _record(step, layer, rank, ids, block="decoder", mtp_idx=None):
    """A record as RouterTracer writes it: the keys of _make_index_record, top_indices appended at flush."""
    record = {"step": step, "stage": "pre_dispatch", "block": block, "layer": layer, "rank": rank,
              "num_tokens": len(ids), "topk": TOP_K}
    if mtp_idx is not None:
        record["mtp_idx"] = mtp_idx
    record["top_indices"] = np.asarray(ids).tolist()
    return record


def _megatron_folder(tmp_path, steps=2, ranks=2, layers=(1, 2, 3), tokens=(5, 3), seed=0, extra=()):
    """router_trace_rank{r}.jsonl per rank; returns the folder and ids[(step, rank)] `[n, layers, k]`."""
    rng = np.random.default_rng(seed)
    folder = tmp_path / "router_trace"
    folder.mkdir()
    ids = {}
    for rank in range(ranks):
        lines = []
        for step in range(steps):
            ids[step, rank] = np.argsort(rng.random((tokens[rank], len(layers), EXPERTS)), axis=2)[:, :, :TOP_K]
            for i, layer in enumerate(layers):  # a step's records in the order the layers fire
                lines.append(_record(step, layer, rank, ids[step, rank][:, i, :]))
            lines.append(_record(step, 0, rank, ids[step, rank][:, 0, :], block="mtp", mtp_idx=0))  # left out
        lines += [line for line in extra if line["rank"] == rank]
        (folder / f"router_trace_rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder, ids


def test_megatron_folder_reads_token_level_in_rank_order(tmp_path):
    folder, ids = _megatron_folder(tmp_path)
    trace = load_trace(folder)
    assert trace.is_token_level and trace.step_names == ("step0", "step1") and trace.meta.layer_ids == (1, 2, 3)
    assert trace.num_tokens == 2 * (5 + 3) and trace.top_k == TOP_K and trace.meta.source == "megatron:router_trace_rank0.jsonl"
    for step in range(2):
        np.testing.assert_array_equal(trace.topk_ids[step], np.concatenate([ids[step, 0], ids[step, 1]]))
    one = load_trace(folder / "router_trace_rank1.jsonl")
    np.testing.assert_array_equal(one.topk_ids[1], ids[1, 1])


def test_megatron_micro_batches_of_one_step_give_exact_counts(tmp_path):
    rng = np.random.default_rng(5)
    more = np.argsort(rng.random((4, EXPERTS)), axis=1)[:, :TOP_K]
    folder, ids = _megatron_folder(tmp_path, extra=[_record(1, 2, 0, more)])  # a second micro-batch, layer 2
    trace = read_router_trace(folder)
    assert not trace.is_token_level
    expected = np.stack([np.stack([np.bincount(np.concatenate([ids[s, 0], ids[s, 1]])[:, i, :].ravel(), minlength=EXPERTS)
                                   for i in range(3)]) for s in range(2)])
    expected[1, 1] += np.bincount(more.ravel(), minlength=EXPERTS)
    np.testing.assert_array_equal(trace.step_counts(), expected)
    np.testing.assert_array_equal(read_router_trace(folder, max_token_bytes=1).step_counts(), expected)


# ---------------------------------------------------------------------- malformed files: exit 2, one line
def _vllm_bad(mutate, text=None):
    def make(tmp_path):
        path = tmp_path / "bad.jsonl"
        if text is not None:
            path.write_text(text)
            return path
        objects = [_server_response(i, p, g) for i, (p, g) in enumerate(_requests())]
        mutate(objects)
        return _write_lines(path, objects)
    return make


def _set(objects, line, key, value, choice=None):
    (objects[line]["choices"][choice] if choice is not None else objects[line])[key] = value


def _megatron_bad(mutate):
    def make(tmp_path):
        path = tmp_path / "router_trace_rank0.jsonl"
        rng = np.random.default_rng(0)
        records = [_record(0, layer, 0, np.argsort(rng.random((3, EXPERTS)), axis=1)[:, :TOP_K]) for layer in range(3)]
        mutate(records)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path
    return make


BAD = {
    "vllm invalid json": (_vllm_bad(None, text='{"choices": [{"routed_experts": [[[1, 2]]]}\n'), "line 1: expected one JSON object"),
    "vllm no routes": (_vllm_bad(lambda o: (_set(o, 1, "prompt_routed_experts", None),
                                            _set(o, 1, "routed_experts", None, choice=0))),
                       "line 2: expected routed experts"),
    "vllm negative id": (_vllm_bad(lambda o: o[2]["choices"][0]["routed_experts"][0][1].__setitem__(0, -3)),
                         "line 3: choices[0].routed_experts: expected expert ids in [0, 65536), got -3"),
    "vllm id too large": (_vllm_bad(lambda o: o[0]["prompt_routed_experts"][0][1].__setitem__(0, 70000)),
                          "line 1: prompt_routed_experts: expected expert ids in [0, 65536), got 70000"),
    "vllm nan": (_vllm_bad(lambda o: o[1]["prompt_routed_experts"][2][2].__setitem__(1, float("nan"))),
                 "line 2: prompt_routed_experts: expected integer expert ids, got NaN"),
    "vllm ragged": (_vllm_bad(lambda o: o[0]["prompt_routed_experts"][1][2].append(3)),
                    "line 1: prompt_routed_experts: expected a regular nested list"),
    "vllm wrong ndim": (_vllm_bad(lambda o: _set(o, 1, "routed_experts", [1, 2, 3], choice=0)),
                        "line 2: choices[0].routed_experts: expected a 3-D list"),
    "vllm top_k differs": (_vllm_bad(lambda o: (_set(o, 2, "prompt_routed_experts", [[[1, 2, 3]] * LAYERS] * 2),
                                                _set(o, 2, "routed_experts", None, choice=0))),
                           "line 3: top_k: expected [tokens, 4 layers, top_k = 2] as in line 1"),
    "vllm repeated expert": (_vllm_bad(lambda o: o[1]["choices"][0]["routed_experts"][1].__setitem__(2, [5, 5])),
                             "line 2: expected top_k = 2 distinct experts per token"),
    "vllm bad base64": (_vllm_bad(lambda o: _set(o, 0, "routed_experts", "not base64!", choice=0)),
                        "line 1: choices[0].routed_experts: expected a base64 string of .npy bytes"),
    "megatron missing top_indices": (_megatron_bad(lambda r: r[1].pop("top_indices")), "line 2: top_indices: expected"),
    "megatron num_tokens": (_megatron_bad(lambda r: r[0].__setitem__("num_tokens", 4)),
                            "line 1: top_indices: expected [num_tokens = 4, topk = 2]"),
    "megatron topk differs": (_megatron_bad(lambda r: r[2].update(topk=3, top_indices=[[0, 1, 2]] * 3)),
                              "line 3: topk: expected 2, the top-k of every record"),
    "megatron negative id": (_megatron_bad(lambda r: r[1]["top_indices"][0].__setitem__(1, -1)),
                             "line 2: top_indices: expected expert ids in [0, 65536), got -1"),
    "megatron nan": (_megatron_bad(lambda r: r[0]["top_indices"][2].__setitem__(0, float("nan"))),
                     "line 1: top_indices: expected integer expert ids, got NaN"),
    "megatron step not int": (_megatron_bad(lambda r: r[2].__setitem__("step", "0")),
                              "line 3: step: expected an integer >= 0, got '0'"),
    "megatron repeated expert": (_megatron_bad(lambda r: r[0]["top_indices"].__setitem__(1, [4, 4])),
                                 "line 1: top_indices: expected topk = 2 distinct experts per token"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_file_exits_2_with_one_line_naming_file_and_field(tmp_path, capsys, case):
    make, fragment = BAD[case]
    path = make(tmp_path)
    code = main(["analyze", str(path)])
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2 and len(lines) == 1, captured.err
    assert str(path) in lines[0] and fragment in lines[0], lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_a_jsonl_file_of_neither_engine_is_named(tmp_path, capsys):
    path = tmp_path / "other.jsonl"
    path.write_text('{"hello": 1}\n')
    assert main(["analyze", str(path)]) == 2
    assert "neither's field names on line 1" in capsys.readouterr().err


# ---------------------------------------------------------------------- analyze and plan end to end
@pytest.mark.parametrize("kind", ["vllm", "megatron"])
def test_analyze_and_plan_end_to_end(tmp_path, capsys, kind):
    path = _server_file(tmp_path) if kind == "vllm" else _megatron_folder(tmp_path)[0]
    assert main(["analyze", str(path), "--ep", "2", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == (27 if kind == "vllm" else 16) and report["num_experts"] == EXPERTS
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--gpus", "2", "--redundant", "2", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert (plan["num_gpus"], plan["num_logical_experts"], plan["num_physical_experts"]) == (2, EXPERTS, EXPERTS + 2)
    assert plan["layer_ids"] == [1, 2, 3]
