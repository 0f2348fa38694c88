"""TensorRT-LLM's expert-statistics folder read as a trace (`moe_place.traces.trtllm`).

The folders here are written the way TensorRT-LLM writes them (`tensorrt_llm/_torch/expert_statistic.py`,
c85e872 and its later raw-id version: `meta_info.json` from rank 0, `rank{r}.safetensors` holding one
int64 `torch.bincount` per key "{iteration}_{layer}" of the rank's own tokens, `rank{r}_raw.safetensors`
holding those tokens' int32 ids), with the `safetensors` project's own library: moe-place's numpy reader is
checked against the files it writes. The data is the bundled real trace (Qwen3-30B-A3B, three prefill
batches recorded on vLLM: traces/data/PROVENANCE.md): each batch is an iteration, its tokens split into 4
contiguous blocks as attention data parallelism gives each rank its own requests. Folders of DeepSeek-V3's
layer numbering are synthetic and say so.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as reference  # the format's own library (test extra): the oracle

from moe_place.cli.main import main
from moe_place.errors import InputError
from moe_place.traces.load import load_trace
from moe_place.traces.safetensors_file import read_safetensors, safetensors_bytes
from moe_place.traces.trtllm import read_statistics, write_statistics

BUNDLED = Path(__file__).resolve().parents[1] / "traces" / "data" / "qwen3-30b-a3b_prefill_topk.npz"
FIRST_ITERATION = 100
RANKS = 4


@pytest.fixture(scope="module")
def bundled():
    return load_trace(BUNDLED)


def _write_like_trtllm(folder: Path, trace, ranks: int = RANKS, first: int = FIRST_ITERATION, raw: bool = True,
                       raw_name: str = "rank{r}_raw.safetensors") -> Path:
    """What TensorRT-LLM's ExpertStatistic._save leaves in EXPERT_STATISTIC_PATH, written with the reference
    library: per rank a bincount (int64, torch.bincount's dtype) and the raw ids (int32) of each key."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": trace.num_experts,
                                                       "num_experts_per_token": trace.top_k}))
    for rank in range(ranks):
        counts, ids = {}, {}
        for step, tokens in enumerate(trace.topk_ids):
            mine = np.array_split(tokens, ranks, axis=0)[rank]
            for pos, layer in enumerate(trace.meta.layer_ids):
                key = f"{first + step}_{layer}"
                selected = np.ascontiguousarray(mine[:, pos, :], dtype=np.int32)
                ids[key] = selected
                counts[key] = np.bincount(selected.ravel(), minlength=trace.num_experts).astype(np.int64)
        reference.save_file(counts, str(folder / f"rank{rank}.safetensors"))
        if raw:
            reference.save_file(ids, str(folder / raw_name.format(r=rank)))
    return folder


@pytest.fixture(scope="module")
def stats_folder(tmp_path_factory, bundled):
    return _write_like_trtllm(tmp_path_factory.mktemp("stats") / "expert_statistic", bundled)


# ---------------------------------------------------------------------- reading the engine's layout
def test_raw_folder_is_the_bundled_trace_token_for_token(stats_folder, bundled):
    trace = load_trace(stats_folder)
    assert trace.is_token_level
    assert trace.meta.layer_ids == bundled.meta.layer_ids == tuple(range(48))
    assert (trace.num_experts, trace.top_k) == (128, 8)
    assert trace.step_names == ("iter100", "iter101", "iter102")
    for got, want in zip(trace.topk_ids, bundled.topk_ids):  # ranks' blocks in rank order = the batch
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(trace.step_counts(), bundled.step_counts())


def test_count_folder_sums_the_ranks(tmp_path, bundled):
    folder = _write_like_trtllm(tmp_path / "counts", bundled, raw=False)
    trace = load_trace(folder)
    assert not trace.is_token_level
    np.testing.assert_array_equal(trace.counts, bundled.step_counts())
    assert trace.meta.source == "trtllm-stats:counts"


def test_cooccurrence_variant_names_its_raw_files_otherwise(tmp_path, bundled):
    folder = _write_like_trtllm(tmp_path / "cooc", bundled, ranks=2,
                                raw_name="token_selected_experts_rank{r}.safetensors")
    trace = load_trace(folder)
    assert trace.is_token_level
    np.testing.assert_array_equal(trace.topk_ids[1], bundled.topk_ids[1])


def test_our_writer_gives_what_the_reference_library_reads(tmp_path, bundled, stats_folder):
    written = write_statistics(bundled, tmp_path / "ours", ranks=RANKS, first_iteration=FIRST_ITERATION)
    assert sorted(p.name for p in written) == sorted(p.name for p in stats_folder.iterdir())
    for path in written[1:]:
        ours, theirs = reference.load_file(str(path)), reference.load_file(str(stats_folder / path.name))
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert ours[key].dtype == theirs[key].dtype
            np.testing.assert_array_equal(ours[key], theirs[key])
    assert json.loads(written[0].read_text()) == json.loads((stats_folder / "meta_info.json").read_text())
    with pytest.raises(InputError, match="already there"):  # a stale rank file would be summed in
        write_statistics(bundled, tmp_path / "ours", ranks=2)


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64",
                                   "uint64", "float16", "float32", "float64"])
def test_numpy_reader_and_writer_agree_with_the_reference_library(tmp_path, dtype):
    rng = np.random.default_rng(7)
    arrays = {"a": (rng.random((3, 5)) * 100).astype(dtype), "scalar": np.array(3, dtype=dtype),
              "empty": np.zeros((0, 4), dtype=dtype), "z_last": (rng.random(7) * 9).astype(dtype)}
    theirs = tmp_path / "theirs.safetensors"
    reference.save_file(arrays, str(theirs))
    for key, value in read_safetensors(theirs).items():
        assert value.dtype == arrays[key].dtype and value.shape == arrays[key].shape
        np.testing.assert_array_equal(value, arrays[key])
    ours = tmp_path / "ours.safetensors"
    ours.write_bytes(safetensors_bytes(arrays))
    for key, value in reference.load_file(str(ours)).items():
        np.testing.assert_array_equal(value, arrays[key])


# ---------------------------------------------------------------------- analyze / plan / evaluate on it
def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_analyze_of_the_folder_equals_analyze_of_the_bundled_file(stats_folder, capsys):
    folder = _json(capsys, ["analyze", str(stats_folder), "--ep", "8,32", "--format", "json"])
    npz = _json(capsys, ["analyze", str(BUNDLED), "--ep", "8,32", "--format", "json"])
    for report in (folder, npz):
        for key in ("source", "model", "step_names"):
            report.pop(key)
    assert folder == npz  # pair lifts included: the raw ids make the folder token level


def test_plan_on_the_folder_equals_plan_on_the_bundled_file_and_steps_are_iterations(stats_folder, tmp_path, capsys):
    plans = {}
    for name, trace, steps in (("folder", stats_folder, "iter100,iter101"), ("positions", stats_folder, "0-1"),
                               ("npz", BUNDLED, "0,1")):
        out = tmp_path / f"{name}.json"
        assert main(["plan", str(trace), "--gpus", "32", "--redundant", "32", "--steps", steps, "--out", str(out),
                     "--no-progress"]) == 0
        plans[name] = json.loads(out.read_text())
    capsys.readouterr()
    assert plans["folder"]["phy2log"] == plans["npz"]["phy2log"] == plans["positions"]["phy2log"]
    assert plans["folder"]["inputs"]["options"]["steps"] == [0, 1]
    report = _json(capsys, ["evaluate", str(tmp_path / "folder.json"), str(stats_folder), "--steps", "iter102",
                            "--format", "json"])
    assert report["sample"].startswith("out of sample: the plan was made on steps 0,1 of this trace")


def test_a_deepseek_layer_numbering_goes_through_to_the_export(tmp_path, capsys):
    """Synthetic counts (random, not a recording) in DeepSeek-V3's numbering: TensorRT-LLM keys its MoE
    layers 3-60 (layers 0-2 are dense and record nothing); the plan and the export keep those keys."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "synthetic_dsv3"
    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": 16, "num_experts_per_token": 2}))
    for rank in range(2):
        reference.save_file({f"{i}_{layer}": rng.integers(0, 50, 16).astype(np.int64)
                             for i in range(7, 9) for layer in range(3, 61)}, str(folder / f"rank{rank}.safetensors"))
    trace = load_trace(folder)
    assert trace.meta.layer_ids == tuple(range(3, 61))
    plan, out = tmp_path / "plan.json", tmp_path / "lb.yaml"
    assert main(["plan", str(folder), "--gpus", "4", "--redundant", "4", "--out", str(plan), "--no-progress"]) == 0
    # a plan of 16 experts names no served model: the layers it serves are given (a served model's preset knows them)
    assert main(["export", str(plan), "--engine", "trtllm", "--out", str(out)]) == 2
    assert "--moe-layers" in capsys.readouterr().err
    assert main(["export", str(plan), "--engine", "trtllm", "--moe-layers", "3-60", "--out", str(out)]) == 0
    assert "layer_keys                3-60" in capsys.readouterr().out
    keys = [line.split(":")[0].strip() for line in out.read_text().splitlines() if line.startswith("  ")]
    assert keys == [str(layer) for layer in range(3, 61)]


# ---------------------------------------------------------------------- bad folders: one line, exit 2
def _drop_key(path: Path, key: str) -> None:
    arrays = reference.load_file(str(path))
    del arrays[key]
    reference.save_file(arrays, str(path))


def _replace(path: Path, key: str, value: np.ndarray) -> None:
    arrays = reference.load_file(str(path))
    arrays[key] = value
    reference.save_file(arrays, str(path))


BAD_FOLDERS = {
    # case: (what to break, the words of the one line)
    "no meta_info": (lambda f: (f / "meta_info.json").unlink(),
                     ["meta_info.json", "expected TensorRT-LLM's meta_info.json", "no such file"]),
    "meta_info without num_experts": (lambda f: (f / "meta_info.json").write_text('{"num_experts_per_token": 8}'),
                                      ["meta_info.json: num_experts", "got missing"]),
    "a rank's key missing": (lambda f: _drop_key(f / "rank2.safetensors", "101_1"),
                             ["rank2.safetensors: 101_1", "every key the other ranks' files hold", "got missing"]),
    "a rank file missing": (lambda f: (f / "rank1.safetensors").unlink(),
                            ["rank1.safetensors", "one file per rank 0-3", "no such file"]),
    "iterations with a gap": (lambda f: [_drop_key(f / f"rank{r}.safetensors", f"101_{layer}")
                                         for r in range(2) for layer in range(3)],
                              ["rank*.safetensors: 101_0", "contiguous iterations 100-102", "no iteration 101"]),
    "a shape that disagrees": (lambda f: _replace(f / "rank1.safetensors", "102_1", np.zeros(127, np.int64)),
                               ["rank1.safetensors: 102_1", "num_experts=128 counts", "shape (127,)"]),
    "a key that is not iteration_layer": (lambda f: _replace(f / "rank0.safetensors", "layer4", np.zeros(128, np.int64)),
                                          ["rank0.safetensors: layer4", "keys '{iteration}_{layer}'"]),
    "raw ids that do not count to the bincount": (
        lambda f: _replace(f / "rank3_raw.safetensors", "100_2",
                           reference.load_file(str(f / "rank3_raw.safetensors"))["100_2"][1:]),
        ["rank3_raw.safetensors: 100_2", "count to the rank's bincount", "move the raw files away"]),
    "a file cut short": (lambda f: (f / "rank0.safetensors").write_bytes((f / "rank0.safetensors").read_bytes()[:-5]),
                         ["rank0.safetensors", "cut short or padded"]),
}


@pytest.fixture
def small_folder(tmp_path, bundled):
    """Two ranks, the first 3 layers: small enough to break and rewrite per case."""
    return _write_like_trtllm(tmp_path / "small", bundled.select_layers([0, 1, 2]).select_steps([0, 1, 2]), ranks=2)


@pytest.mark.parametrize("case", sorted(BAD_FOLDERS))
def test_a_bad_folder_gets_one_line_naming_the_file_and_key(small_folder, tmp_path, capsys, case):
    if case in ("a rank file missing", "a rank's key missing", "raw ids that do not count to the bincount"):
        small_folder = _write_like_trtllm(tmp_path / "four", load_trace(small_folder))  # 4 ranks
    assert load_trace(small_folder).num_steps == 3  # readable before it is broken
    breaking, words = BAD_FOLDERS[case]
    breaking(small_folder)
    for command in (["analyze", str(small_folder)],
                    ["plan", str(small_folder), "--gpus", "4", "--out", str(tmp_path / "p.json")]):
        assert main(command) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1, lines
        assert str(small_folder) in lines[0]
        for word in words:
            assert word in lines[0], (word, lines[0])


def test_an_empty_folder_is_not_a_trace(tmp_path, capsys):
    assert main(["analyze", str(tmp_path)]) == 2
    assert "meta_info.json" in capsys.readouterr().err
    with pytest.raises(InputError, match="--top-k"):
        read_statistics(_write_like_trtllm(tmp_path / "s", load_trace(BUNDLED).select_layers([0]), ranks=1), top_k=4)
