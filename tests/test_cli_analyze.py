"""`moe-place analyze` on the bundled Qwen3 trace: JSON contract against plain numpy, table, plot, errors."""

import json

import numpy as np
import pytest

from moe_place.cli.main import main
from moe_place.traces.bundled import bundled_path

QWEN = bundled_path("qwen3-30b-a3b_prefill_topk.npz")
OLMOE = bundled_path("olmoe-1b-7b_expert_counts_L0_L7_L15.npz")
STEPS = ("ep_states", "token_distri_8", "token_distri_16")


def run(capsys, *argv):
    """(exit code, stdout, stderr) of `moe-place *argv`."""
    try:
        code = main(list(map(str, argv)))
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def qwen_counts():
    """int64 [steps, 48, 128]: per-step dispatches per expert, straight from the npz with numpy."""
    with np.load(QWEN) as npz:
        steps = [npz[key] for key in STEPS]
    return np.stack([np.stack([np.bincount(ids[:, layer].ravel(), minlength=128) for layer in range(48)])
                     for ids in steps])


@pytest.fixture(scope="module")
def qwen_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("analyze") / "qwen.json"
    assert main(["analyze", str(QWEN), "--ep", "8,16,32", "--format", "json", "--output", str(out)]) == 0
    return json.loads(out.read_text())


def test_json_header(qwen_json):
    assert qwen_json["num_layers"] == 48 and qwen_json["num_experts"] == 128 and qwen_json["top_k"] == 8
    assert qwen_json["tokens"] == 1960 + 2050 + 2080 and qwen_json["steps"] == 3
    assert qwen_json["step_names"] == list(STEPS) and qwen_json["top_n"] == 8
    assert "Qwen3-30B-A3B" in qwen_json["model"]
    assert [layer["layer"] for layer in qwen_json["layers"]] == list(range(48))


def test_json_per_layer_values_match_numpy(qwen_json, qwen_counts):
    total = qwen_counts.sum(axis=0)
    for layer, ref in zip(qwen_json["layers"], total):
        assert layer["expert_load"] == ref.tolist()
        assert layer["max_over_mean"] == pytest.approx(ref.max() / ref.mean(), abs=1e-6)
        assert layer["cv"] == pytest.approx(ref.std() / ref.mean(), abs=1e-6)
        assert layer["zero_load_experts"] == int((ref == 0).sum())
        assert layer["top_n_share"] == pytest.approx(np.sort(ref)[-8:].sum() / ref.sum(), abs=1e-6)
        assert sorted(ref[layer["hot_experts"]]) == sorted(np.sort(ref)[-8:])
    # active experts per step; the expected count uses each step's own token count
    assert [layer["active_experts"] for layer in qwen_json["layers"]] == (qwen_counts > 0).sum(-1).T.tolist()
    tokens = np.array([1960, 2050, 2080])
    np.testing.assert_allclose(qwen_json["layers"][0]["expected_active_experts"],
                               128 * (1 - (1 - 8 / 128) ** tokens), atol=1e-6)


def test_json_top_coactivated_pair_matches_numpy(qwen_json):
    with np.load(QWEN) as npz:
        ids = np.concatenate([npz[key] for key in STEPS])[:, 5, :].astype(np.int64)  # layer 5, [tokens, 8]
    together = np.zeros((128, 128), dtype=np.int64)
    for i in range(8):
        for j in range(8):
            if i != j:
                np.add.at(together, (ids[:, i], ids[:, j]), 1)
    pair = qwen_json["layers"][5]["top_pair"]
    a, b = pair["experts"]
    assert pair["tokens"] == together.max() == together[a, b]
    load = np.bincount(ids.ravel(), minlength=128)
    assert pair["lift"] == pytest.approx(len(ids) * together[a, b] / (load[a] * load[b]), abs=1e-6)


def test_json_persistence_matches_hot_sets_computed_here(qwen_json, qwen_counts):
    for pos in (0, 17, 47):
        hot = [set(np.argsort(-qwen_counts[s, pos], kind="stable")[:8].tolist()) for s in range(3)]
        overlap = np.mean([len(hot[s] & hot[s + 1]) / 8 for s in range(2)])
        assert qwen_json["layers"][pos]["persistence"]["mean_hot_overlap"] == pytest.approx(overlap, abs=1e-6)
        runs = qwen_json["layers"][pos]["persistence"]
        assert 1 <= runs["median_run_windows"] <= runs["max_run_windows"] <= 3


def test_json_ep_sweep_matches_numpy(qwen_json, qwen_counts):
    total = qwen_counts.sum(axis=0)
    assert [ep["ep_size"] for ep in qwen_json["ep"]] == [8, 16, 32]
    for ep in qwen_json["ep"]:
        gpus = total.reshape(48, ep["ep_size"], -1).sum(-1)
        np.testing.assert_allclose(ep["gpu_max_over_mean"], gpus.max(1) / gpus.mean(1), atol=1e-6)
        np.testing.assert_allclose(ep["balancedness"], gpus.mean(1) / gpus.max(1), atol=1e-6)
        np.testing.assert_allclose(ep["gpu_rows"], gpus, atol=1e-6)
        assert ep["vllm_balancedness"] == pytest.approx(gpus.mean(1).sum() / gpus.max(1).sum(), abs=1e-6)
        assert ep["experts_per_gpu"] == 128 // ep["ep_size"]
        assert ep["worst_layer"] == int(np.argmax(gpus.max(1) / gpus.mean(1)))
        shift = ep["out_of_sample"]
        assert shift["transitions"] == 2
        # contiguous per window, judged on windows 1 and 2, averaged over the two transitions
        per_window = qwen_counts[1:].reshape(2, 48, ep["ep_size"], -1).sum(-1)
        np.testing.assert_allclose(shift["contiguous"], (per_window.max(-1) / per_window.mean(-1)).mean(0), atol=1e-6)
        # hindsight plans are never worse than no plan (the Qwen layers all have idle-ish experts)
        assert np.mean(shift["planned_on_same"]) < np.mean(shift["contiguous"])


def test_default_ep_sizes_and_layer_selection(capsys):
    code, out, err = run(capsys, "analyze", QWEN, "--format", "json", "--layers", "0-3,10")
    assert code == 0 and err == ""
    report = json.loads(out)
    assert [ep["ep_size"] for ep in report["ep"]] == [8, 16, 32, 64, 128]
    assert [layer["layer"] for layer in report["layers"]] == [0, 1, 2, 3, 10]
    assert all(len(ep["gpu_max_over_mean"]) == 5 for ep in report["ep"])


def test_count_level_trace_with_windows(capsys):
    code, out, _ = run(capsys, "analyze", OLMOE, "--format", "json", "--window", "2", "--top-n", "4")
    assert code == 0
    report = json.loads(out)
    assert report["windows"] == 3 and report["window_steps"] == 2 and report["top_n"] == 4
    assert [layer["layer"] for layer in report["layers"]] == [0, 7, 15]
    assert report["ep"][0]["out_of_sample"]["transitions"] == 2


def test_table_output(capsys, qwen_json):
    code, out, err = run(capsys, "analyze", QWEN, "--ep", "8,16,32")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert "Qwen3-30B-A3B" in lines[0] and "48 layers, 128 experts, top-8, 6,090 tokens, 3 steps" in lines[1]
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["layer", "max/mean"])
    assert lines[header].split()[-3:] == ["EP8", "EP16", "EP32"]
    rows = lines[header + 2: header + 2 + 48]
    for row, layer in zip(rows, qwen_json["layers"]):
        cells = row.split()
        assert int(cells[0]) == layer["layer"]
        assert cells[1] == f"{layer['max_over_mean']:.2f}"
        assert cells[7] == f"{layer['top_pair']['lift']:.1f}"
        assert cells[-3:] == [f"{ep['gpu_max_over_mean'][layer['layer']]:.2f}" for ep in qwen_json["ep"]]
    start = next(i for i, line in enumerate(lines) if line.startswith("EP sweep"))
    sweep = [line.split() for line in lines[start:] if line.split() and line.split()[0].isdigit()]
    assert [cells[0] for cells in sweep] == ["8", "16", "32"]
    for cells, ep in zip(sweep, qwen_json["ep"]):
        assert cells[2] == f"{ep['mean_gpu_max_over_mean']:.2f}" and cells[3] == f"{ep['worst_gpu_max_over_mean']:.2f}"


def test_plot_and_output_files(capsys, tmp_path):
    png, table = tmp_path / "sub" / "qwen.png", tmp_path / "table.txt"
    code, out, err = run(capsys, "analyze", QWEN, "--ep", "8,32", "--plot", png, "--output", table)
    assert code == 2 and "--plot" in err and "a missing folder" in err and not table.exists()
    png.parent.mkdir()
    code, out, err = run(capsys, "analyze", QWEN, "--ep", "8,32", "--plot", png, "--output", table)
    assert code == 0 and out == ""
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "EP sweep" in table.read_text()
    assert str(png) in err
    assert not list(png.parent.glob(".*.tmp"))  # atomic write left no temporary file


@pytest.mark.parametrize("argv, needle", [
    (["--ep", "0"], "--ep"),
    (["--ep", "abc"], "--ep"),
    (["--ep", "8,,16"], "--ep"),
    (["--ep", "7"], "divide the 128 experts"),
    (["--layers", "99"], "--layers"),
    (["--layers", "x"], "--layers"),
    (["--top-n", "0"], "--top-n"),
    (["--top-n", "500"], "--top-n"),
    (["--window", "4"], "--window"),
    (["--format", "xml"], "--format"),
])
def test_bad_options_exit_2_with_one_line(capsys, argv, needle):
    code, out, err = run(capsys, "analyze", QWEN, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err


def test_missing_trace_and_directory_exit_2(capsys, tmp_path):
    for path in (tmp_path / "nope.npz", tmp_path):
        code, _, err = run(capsys, "analyze", path)
        assert code == 2 and len(err.strip().splitlines()) == 1 and str(path) in err
