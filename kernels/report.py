"""Microbenchmark results (`bench/microbench.py --output-json`): load, render as markdown, draw as PNGs.

For each result: the environment, the calibration, and predicted vs measured tables (padding
staircase, grouped GEMM vs dense, skew, replica payback, dispatch/combine), every ratio outside
+-15% flagged; the per-batch split's kernels against their copy baselines and their 10 us goal;
PNGs of the padding staircase, skew bars per rank (measured vs predicted), the payback curve and
a predicted-vs-measured scatter. `moe-place report` and the microbenchmark's
own console output both render through here.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_place.errors import InputError
from moe_place.io import read_input_text, write_atomic
from moe_place.plotting import new_figure, png_bytes

__all__ = ["load_result", "render_markdown", "render_plots", "render_report"]

KIND = "moe-place-microbench"
TOLERANCE = 0.15
SECTIONS = ("padding", "gemm", "skew", "payback", "dispatch", "split")  # the microbenchmark's sections, in run order


def render_report(results: list[tuple[Path, dict]], out: Path, plots: bool = True) -> str:
    """The markdown of several results (PNGs written into `out` unless `plots` is False); a result
    whose sections have the wrong shape is an InputError naming its file."""
    sections = []
    for path, result in results:
        try:  # a section of the wrong shape fails somewhere in the rendering: name the file, not the line
            drawn = render_plots(result, out, path.stem) if plots else {}
            sections.append(render_markdown(result, path, drawn))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise InputError(str(path), "a microbenchmark result as bench/microbench.py writes it",
                             f"a malformed section ({type(exc).__name__}: {exc})") from None
    return "# moe-place microbenchmarks: predicted vs measured\n\n" + "\n\n".join(sections) + "\n"


# ---------------------------------------------------------------------------------------- input
def load_result(path: str | Path) -> dict:
    """A microbenchmark result JSON, checked for the keys and types the report reads."""
    path = Path(path)
    text = read_input_text(path, "a result JSON file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(str(path), "a JSON file", f"unreadable JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise InputError(str(path), f"a microbenchmark result (\"kind\": \"{KIND}\")",
                         repr(data.get("kind")) if isinstance(data, dict) else type(data).__name__)
    for key in ("env", "calibration", "sections"):
        if key not in data:
            raise InputError(f"{path}: {key}", "present in a microbenchmark result", "missing")
        if not isinstance(data[key], dict):
            raise InputError(f"{path}: {key}", "a JSON object", type(data[key]).__name__)
    for name, section in data["sections"].items():
        if not isinstance(section, dict):
            raise InputError(f"{path}: sections.{name}", "a JSON object", type(section).__name__)
    return data


# ---------------------------------------------------------------------------------------- markdown
def _ratio_cell(ratio) -> str:
    if ratio is None:
        return "-"
    flag = "" if abs(ratio - 1) <= TOLERANCE else " **!**"
    return f"{ratio:.2f}{flag}"


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4f}"


#: Columns of a row's predictions against its measured time: formula 5, the L2 model at the
#: measured rates, the L2 model at the catalog rates (`_prediction_cells`).
PREDICTION_HEADERS = ["formula 5 ms", "ratio", "L2 ms", "ratio L2", "catalog L2 ms", "ratio"]


def _prediction_cells(r: dict) -> list[str]:
    """The `PREDICTION_HEADERS` cells of a padding or GEMM row."""
    return [f"{r['predicted_s'] * 1e3:.4f}", _ratio_cell(r["ratio"]), _ms(r.get("predicted_l2_s")),
            _ratio_cell(r.get("ratio_l2")), _ms(r.get("predicted_l2_catalog_s")),
            _ratio_cell(_div(r["measured_s"], r.get("predicted_l2_catalog_s")))]


def _div(a, b):
    return a / b if a is not None and b else None


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(result: dict, path: Path, plots: dict[str, str]) -> str:
    env, cal, sec = result["env"], result["calibration"], result["sections"]
    device = env.get("gpu_name", env.get("device", "?"))
    parts = [f"## {path.name}: {device}", f"Timing: **{env.get('timing')}**. Ratios are measured / predicted; "
             f"**!** marks a ratio outside +-{TOLERANCE:.0%}. `predicted` uses the rates measured in this run "
             f"(dense BF16 matmul, device copy); `catalog` uses {env.get('gpu_part')} datasheet peaks x 0.5. "
             f"`formula 5` re-reads weights per M-tile and activations per N-tile from HBM (no cache reuse: the "
             f"upper end); `L2` serves those re-reads from L2 (compulsory traffic: the lower end). GPU times are "
             f"CUDA-graph replays with L2 flushed; `eager` adds the host's launch overhead."]
    keys = ("gpu_name", "sm_count", "compute_capability", "torch", "triton", "cuda", "python", "cpu_count")
    env_rows = [[k, env[k]] for k in keys if k in env]
    env_rows += [[f"nvidia-smi {k}", v] for k, v in (env.get("nvidia_smi") or {}).items()]
    parts.append(_table(["environment", "value"], env_rows))
    parts.append(_table(["calibration", "value"], [
        ["dense matmul", f"{cal['dense_flops_per_s'] / 1e12:.3g} TFLOP/s (n={cal['matmul_n']}, {cal['matmul_dtype']})"],
        ["device copy", f"{cal['copy_bytes_per_s'] / 1e9:.3g} GB/s ({cal['hbm_bytes_per_s'] / 1e9:.3g} GB/s HBM read+write)"],
        ["alpha (tiny copy)", f"{cal['alpha_s'] * 1e6:.2f} us"],
        ["catalog part", f"{cal['catalog_flops_per_s'] / 1e12:.1f} TFLOP/s, {cal['catalog_hbm_bytes_per_s'] / 1e9:.0f} GB/s"]]))
    if "padding" in sec:
        p = sec["padding"]
        parts.append(f"### Padding staircase (h={p['hidden']}, I={p['intermediate']}, BLOCK_N={p['block_n']}, BLOCK_K={p['block_k']})")
        parts.append(_table(
            ["BLOCK_M", "rows/expert", "padded rows (kernel)", "padded rows (model)", "padding x", "useful TFLOP/s",
             "executed TFLOP/s", "measured ms", "eager ms", *PREDICTION_HEADERS],
            [[r["block_m"], r["rows_per_expert"], r["padded_rows_kernel"], r["padded_rows_predicted"],
              f"{r['padding_ratio']:.2f}", f"{r['useful_tflops']:.2f}", f"{r['executed_tflops']:.2f}",
              f"{r['measured_s'] * 1e3:.4f}", _ms(r.get("measured_eager_s")), *_prediction_cells(r)]
             for r in p["rows"]]))
    if "gemm" in sec:
        g = sec["gemm"]
        parts.append(f"### Grouped GEMM vs dense torch.matmul, BF16 (h={g['hidden']}, I={g['intermediate']})")
        parts.append(_table(
            ["rows/expert", "BLOCK_M", "grouped TFLOP/s", "dense TFLOP/s", "grouped / dense", "measured ms",
             *PREDICTION_HEADERS, "FP8 grouped TFLOP/s"],
            [[r["rows_per_expert"], r["block_m"], f"{r['grouped_tflops']:.2f}", f"{r['dense_tflops']:.2f}",
              f"{r['grouped_over_dense']:.2f}", f"{r['measured_s'] * 1e3:.4f}", *_prediction_cells(r),
              f"{r['fp8_grouped_tflops']:.2f}" if "fp8_grouped_tflops" in r else "-"]
             for r in g["rows"]]))
        parts.append("Target: grouped / dense >= 0.70 at >= 512 rows per expert.")
    if "skew" in sec:
        s = sec["skew"]
        parts.append(f"### Skew at equal total rows ({s['total_rows']} rows, {s['experts']} experts, EP{s['gpus']}, "
                     f"BLOCK_M={s['block_m']}; ranks run one after another)")
        parts.append(_table(
            ["load", "placement", "max rows/rank", "busiest measured ms", "busiest formula 5 ms", "busiest L2 ms",
             "skew measured", "skew formula 5", "ratio", "skew L2", "ratio L2"],
            [[c["load"], c["placement"], max(c["rows_per_gpu"]), f"{c['busiest_measured_s'] * 1e3:.4f}",
              f"{c['busiest_predicted_s'] * 1e3:.4f}", _ms(c.get("busiest_predicted_l2_s")),
              f"{c['skew_measured']:.3f}", f"{c['skew_predicted']:.3f}", _ratio_cell(c["ratio"]),
              f"{c['skew_predicted_l2']:.3f}" if "skew_predicted_l2" in c else "-", _ratio_cell(c.get("ratio_l2"))]
             for c in s["cases"]]))
        parts.append("Skew = busiest rank's time / the uniform load's busiest rank's time.")
    if "payback" in sec:
        b = sec["payback"]
        parts.append(f"### Replica payback (row C9 shape: h={b['hidden']}, I={b['intermediate']}, "
                     f"{b['expert_bytes'] / 2**20:.1f} MiB experts, rows {b['rows_before'][0]} -> GPU 0 keeps "
                     f"{b['rows_after'][0]} + 7x{b['rows_after'][1]})")
        parts.append(_table(["quantity", "measured", "predicted", "ratio"], [
            ["saving per batch (ms), formula 5", f"{b['saving_measured_s'] * 1e3:.4f}",
             f"{b['saving_predicted_s'] * 1e3:.4f}", _ratio_cell(b["saving_ratio"])],
            ["saving per batch (ms), L2", f"{b['saving_measured_s'] * 1e3:.4f}", _ms(b.get("saving_predicted_l2_s")),
             _ratio_cell(_div(b["saving_measured_s"], b.get("saving_predicted_l2_s")))],
            ["GPU 0 before / after (ms)", f"{b['t_before_s'] * 1e3:.4f} / {b['t_after_s'] * 1e3:.4f}",
             f"{_ms(b.get('t_before_predicted_s'))} / {_ms(b.get('t_after_predicted_s'))} (formula 5), "
             f"{_ms(b.get('t_before_predicted_l2_s'))} / {_ms(b.get('t_after_predicted_l2_s'))} (L2)", "-"],
            ["copy 7 experts (ms)", f"{b['copy_measured_s'] * 1e3:.4f}", f"{b['copy_predicted_s'] * 1e3:.4f}",
             _ratio_cell(b.get("copy_ratio"))],
            ["copy bandwidth (GB/s)", f"{b['copy_bytes_per_s'] / 1e9:.1f}", f"{b.get('copy_model_bytes_per_s', 0) / 1e9:.1f}", "-"],
            ["N_min", b["n_min_measured"], b["n_min_predicted"], "-"],
            ["N_min, model with the measured saving", "-", b["n_min_model_with_measured_saving"], "-"],
            ["N_min, catalog over NVLink 450 GB/s", "-", b["nvlink_catalog"]["n_min"], "-"]]))
        parts.append(f"Copy path: {b['copy_path']}.")
    if "dispatch" in sec:
        d = sec["dispatch"]
        parts.append(f"### Dispatch/combine per rank (Qwen3 layer {d['layer']}, {d['tokens']} tokens x top-{d['top_k']}, "
                     f"EP{d['gpus']}, {d['placement']} placement, {d['split_policy']} split)")
        parts.append(f"Send plans match the traffic matrix of `moe_place.analysis.dispatch`: "
                     f"**{d['traffic_matches_model']}**. {d['transfer_note']}: "
                     f"{d['dispatch_transfer_predicted_s'] * 1e6:.1f} us. Pack and combine are predicted as alpha "
                     f"(one small device operation) + HBM bytes / the measured copy bandwidth.")
        parts.append(_table(
            ["rank", "send MiB", "off-rank send MiB", "off-rank recv MiB", "pack us (meas / pred)", "ratio",
             "combine us (meas / pred)", "ratio"],
            [[r["rank"], f"{r['send_bytes'] / 2**20:.3f}", f"{r['send_bytes_off_rank'] / 2**20:.3f}",
              f"{r['recv_bytes_off_rank'] / 2**20:.3f}",
              f"{r['pack_measured_s'] * 1e6:.1f} / {r['pack_predicted_s'] * 1e6:.1f}", _ratio_cell(r["pack_ratio"]),
              f"{r['combine_measured_s'] * 1e6:.1f} / {r['combine_predicted_s'] * 1e6:.1f}", _ratio_cell(r["combine_ratio"])]
             for r in d["per_rank"]]))
    if "split" in sec:
        parts.extend(_split_markdown(sec["split"], env))
    for name, why in result.get("skipped", {}).items():
        parts.append(f"Section `{name}` was skipped: {why}.")
    checks = result.get("checks", [])
    if checks:
        ok = sum(1 for c in checks if c.get("ok"))
        parts.append(f"Kernel checks against the torch reference: {ok}/{len(checks)} passed.")
    for title, name in plots.items():
        parts.append(f"![{title}]({name})")
    return "\n\n".join(parts)


def _split_markdown(split: dict, env: dict) -> list[str]:
    """The per-batch split's section: the kernels' times per layer beside their copy baselines and the goal."""
    on_gpu = env.get("timing") == "gpu"
    goal_us, lplb_us = split["goal_per_layer_s"] * 1e6, split["lplb_cited_s"] * 1e6
    lines = [f"### Per-batch split kernels ({split['experts']} experts top-{split['top_k']}, "
             f"{split['sweeps']} sweeps, rank {split['rank']}'s tokens)",
             f"Per layer: count (the rank's dispatches per expert, the all-reduce's input), solve (whole rows per slot "
             f"from the global counts), map (the rank's dispatches to slots) and all three in one graph (`layer`; the "
             f"all-reduce between them needs the EP group and is not timed). Each beside its baseline (`base`): the "
             f"same launches as torch elementwise kernels moving the bytes it reads. Goal: layer at most "
             f"{goal_us:.0f} us on an H200. Cited for comparison, not measured: about {lplb_us:.0f} us per layer and "
             f"batch for {split['lplb_source']}."
             + ("" if on_gpu else " CPU timings are of the torch references, not the kernels."),
             _table(["EP", "slots", "tokens (rank)", "classes x K x M", "count us (base)", "solve us (base)",
                     "map us (base)", "layer us (base)", "layer eager us", "layer / base", "goal",
                     "busiest: even / kernel / numpy / LP", f"{split['more_sweeps']} sweeps: solve us, busiest"],
                    [[c["gpus"], c["slots"], f"{c['tokens']} ({c['tokens_per_rank']})",
                      " x ".join(str(v) for v in [c["classes"], *c["class_tile"][1:]]),
                      *(f"{c[f'{n}_s'] * 1e6:.1f} ({c[f'{n}_baseline_s'] * 1e6:.1f})" for n in ("count", "solve", "map",
                                                                                                "layer")),
                      f"{c['layer_eager_s'] * 1e6:.1f}", f"{c['layer_s'] / c['layer_baseline_s']:.2f}",
                      {True: "met", False: "**missed**", None: "-"}[c["goal_met"]],
                      f"{c['busiest_even']} / {c['busiest_kernel']} / {c['busiest_numpy']} / "
                      f"{'-' if c['busiest_lp'] is None else c['busiest_lp']}",
                      f"{c['solve_more_sweeps_s'] * 1e6:.1f}, {c['busiest_kernel_more_sweeps']}"]
                     for c in split["cases"]])]
    return lines


# ---------------------------------------------------------------------------------------- plots
def render_plots(result: dict, out: Path, stem: str) -> dict[str, str]:
    """Write the PNGs for one result into `out`; returns {title: file name}."""
    sec = result["sections"]
    written = {}
    label = "CPU timings" if "CPU" in str(result["env"].get("timing")) else result["env"].get("gpu_name", "GPU")

    def save(fig, title: str, name: str) -> None:
        fig.tight_layout()
        write_atomic(out / f"{stem}_{name}.png", png_bytes(fig))
        written[title] = f"{stem}_{name}.png"

    if "padding" in sec:
        fig = new_figure((12, 4.2))
        ax1, ax2 = fig.subplots(1, 2)
        by_bm: dict[int, list] = {}
        for r in sec["padding"]["rows"]:
            by_bm.setdefault(r["block_m"], []).append(r)
        for bm, rows in sorted(by_bm.items()):
            x = [r["rows_per_expert"] for r in rows]
            line, = ax1.plot(x, [r["useful_tflops"] for r in rows], marker="o", label=f"BLOCK_M={bm} useful")
            ax1.plot(x, [r["executed_tflops"] for r in rows], ls="--", color=line.get_color(), label=f"BLOCK_M={bm} executed")
            ax2.step(x, [r["padding_ratio"] for r in rows], where="post", color=line.get_color(), label=f"BLOCK_M={bm}")
        ax1.set(xscale="log", yscale="log", xlabel="rows per expert", ylabel="TFLOP/s", title=f"Grouped GEMM throughput ({label})")
        ax2.set(xscale="log", yscale="log", xlabel="rows per expert", ylabel="padded / valid rows", title="Padding staircase")
        ax1.legend(fontsize=7, ncol=2)
        ax2.legend(fontsize=8)
        save(fig, "padding staircase", "padding")
    if "skew" in sec:
        cases = sec["skew"]["cases"]
        cols = min(3, len(cases))
        rows_n = -(-len(cases) // cols)
        fig = new_figure((4.3 * cols, 3.2 * rows_n))
        axes = fig.subplots(rows_n, cols, squeeze=False)
        balanced = max(cases[0]["measured_per_gpu_s"]) or 1.0
        balanced_pred = max(cases[0]["predicted_per_gpu_s"]) or 1.0
        for ax, c in zip(axes.flat, cases):
            ranks = range(len(c["measured_per_gpu_s"]))
            ax.bar([g - 0.2 for g in ranks], [t / balanced for t in c["measured_per_gpu_s"]], 0.4, label="measured")
            ax.bar([g + 0.2 for g in ranks], [t / balanced_pred for t in c["predicted_per_gpu_s"]], 0.4, label="predicted")
            ax.axhline(1.0, color="grey", lw=0.8, ls=":")
            ax.set_title(f"{c['load']}\n{c['placement']}", fontsize=8)
            ax.set_xlabel("EP rank", fontsize=8)
            ax.set_ylabel("time / balanced busiest", fontsize=8)
        for ax in list(axes.flat)[len(cases):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(f"Expert time per rank at equal total rows ({label})", fontsize=10)
        fig.tight_layout()
        save(fig, "skew per rank", "skew")
    if "payback" in sec:
        b = sec["payback"]
        curve = b["curve"]
        fig = new_figure((6.5, 4))
        ax = fig.subplots()
        ms = lambda v: [x * 1e3 for x in v]  # noqa: E731
        ax.plot(curve["batches"], ms(curve["measured_net_s"]), label=f"measured (N_min={b['n_min_measured']})")
        ax.plot(curve["batches"], ms(curve["predicted_net_s"]), ls="--", label=f"model, measured rates (N_min={b['n_min_predicted']})")
        ax.plot(curve["batches"], ms(curve["nvlink_catalog_net_s"]), ls=":",
                label=f"model, catalog NVLink (N_min={b['nvlink_catalog']['n_min']})")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set(xlabel="batches after the copy", ylabel="net gain (ms)", title=f"Replica payback, C9 shape ({label})")
        ax.legend(fontsize=8)
        save(fig, "payback curve", "payback")
    points = _prediction_points(sec)
    if points:
        fig = new_figure((5.5, 5))
        ax = fig.subplots()
        for name, pts in points.items():
            ax.scatter([p[0] * 1e3 for p in pts], [p[1] * 1e3 for p in pts], s=14, label=name)
        lo = min(min(p) for pts in points.values() for p in pts) * 1e3
        hi = max(max(p) for pts in points.values() for p in pts) * 1e3
        ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
        ax.fill_between([lo, hi], [lo * (1 - TOLERANCE), hi * (1 - TOLERANCE)], [lo * (1 + TOLERANCE), hi * (1 + TOLERANCE)],
                        color="grey", alpha=0.2, label="+-15%")
        ax.set(xscale="log", yscale="log", xlabel="predicted (ms)", ylabel="measured (ms)",
               title=f"Predicted vs measured ({label})")
        ax.legend(fontsize=8)
        save(fig, "predicted vs measured", "predicted_vs_measured")
    return written


def _prediction_points(sec: dict) -> dict[str, list[tuple[float, float]]]:
    points: dict[str, list] = {}
    for r in sec.get("padding", {}).get("rows", []):
        points.setdefault("padding", []).append((r["predicted_s"], r["measured_s"]))
    for r in sec.get("gemm", {}).get("rows", []):
        points.setdefault("grouped GEMM", []).append((r["predicted_s"], r["measured_s"]))
    for c in sec.get("skew", {}).get("cases", []):
        points.setdefault("skew (busiest rank)", []).append((c["busiest_predicted_s"], c["busiest_measured_s"]))
    for r in sec.get("dispatch", {}).get("per_rank", []):
        points.setdefault("pack/combine", []).extend([(r["pack_predicted_s"], r["pack_measured_s"]),
                                                      (r["combine_predicted_s"], r["combine_measured_s"])])
    return {k: [p for p in v if p[0] > 0 and p[1] > 0] for k, v in points.items() if any(p[0] > 0 and p[1] > 0 for p in v)}
