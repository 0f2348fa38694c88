"""`moe-place analyze` gives the same answer for a token-level file read whole and streamed (over the
streaming threshold), on any number of threads: counts, every column, and the pair lift."""

import json

import numpy as np
import pytest

from moe_place import cores
from moe_place.cli.main import main
from moe_place.traces import load as load_module
from moe_place.traces import load_trace
from moe_place.traces.count import THREADS_ENV
from moe_place.traces.sample import SAMPLE_TOKENS


def _trace_file(path, tokens, step_kind, compress=False):
    rng = np.random.default_rng(tokens)
    weights = np.log(np.arange(40, 0, -1.0))  # skewed: some experts hot, some pairs frequent
    ids = np.argsort(-(rng.gumbel(size=(tokens, 3, 40)) + weights), axis=2)[:, :, :5].astype(np.int16)
    fields = {"num_experts": 40, "top_k": 5, "topk_ids": ids, "model": "test"}
    if step_kind == "sorted":
        fields["step"] = np.arange(tokens) * 6 // tokens
    elif step_kind == "interleaved":
        fields["step"] = rng.integers(0, 6, tokens)
    (np.savez_compressed if compress else np.savez)(path, **fields)
    return path


def _analyze(tmp_path, *argv):
    out = tmp_path / "out.txt"
    assert main(["analyze", *map(str, argv), "--output", str(out)]) == 0
    return out.read_text()


@pytest.fixture(autouse=True)
def _no_thread_env(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)


@pytest.mark.parametrize("tokens", [3000, SAMPLE_TOKENS + 1500])  # every token; a sample of them
@pytest.mark.parametrize("step_kind", ["none", "sorted", "interleaved"])
def test_streamed_file_gives_the_same_analysis(tmp_path, monkeypatch, tokens, step_kind):
    path = _trace_file(tmp_path / "t.npz", tokens, step_kind)
    whole_json = _analyze(tmp_path, path, "--format", "json")
    whole_table = _analyze(tmp_path, path)
    report = json.loads(whole_json)
    assert all(layer["top_pair"] is not None for layer in report["layers"])
    assert (report["pair_sample"] is None) == (tokens <= SAMPLE_TOKENS)
    monkeypatch.setattr(load_module, "DEFAULT_MAX_TOKEN_BYTES", 0)  # every token file is streamed now
    assert not load_trace(path).is_token_level
    monkeypatch.setattr(cores, "usable_cores", lambda: 4)  # 3 threads are allowed on 4 cores, whatever this has
    for threads in ("1", "3"):
        monkeypatch.setenv(THREADS_ENV, threads)
        assert _analyze(tmp_path, path, "--format", "json") == whole_json
        assert _analyze(tmp_path, path) == whole_table


def test_streamed_compressed_file_and_layer_selection(tmp_path, monkeypatch):
    path = _trace_file(tmp_path / "t.npz", SAMPLE_TOKENS + 99, "interleaved", compress=True)
    whole = _analyze(tmp_path, path, "--format", "json", "--layers", "2,0", "--top-n", "3")
    monkeypatch.setattr(load_module, "DEFAULT_MAX_TOKEN_BYTES", 0)
    assert _analyze(tmp_path, path, "--format", "json", "--layers", "2,0", "--top-n", "3") == whole
    assert [layer["layer"] for layer in json.loads(whole)["layers"]] == [0, 2]


def test_sampled_pair_lift_is_stated_in_the_table(tmp_path):
    path = _trace_file(tmp_path / "t.npz", SAMPLE_TOKENS + 1500, "sorted")
    report = json.loads(_analyze(tmp_path, path, "--format", "json"))
    chosen, rest = SAMPLE_TOKENS // 4, SAMPLE_TOKENS - SAMPLE_TOKENS // 4
    assert report["pair_sample"] == {"chosen_on_tokens": chosen, "estimated_on_tokens": rest}
    errors = [layer["top_pair"]["lift_stderr"] for layer in report["layers"]]
    assert all(0 < error < 0.2 * layer["top_pair"]["lift"] for error, layer in zip(errors, report["layers"]))
    table = _analyze(tmp_path, path)
    assert f"pair chosen on {chosen:,} tokens, its lift counted on {rest:,} others (of {SAMPLE_TOKENS + 1500:,})" in table
    assert f"standard error {min(errors):.2f} to {max(errors):.2f} by layer" in table
