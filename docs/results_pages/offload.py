"""The offloaded serving page."""

from __future__ import annotations

import re

from .common import RECORD_LINK, bench_module, f, page, pct, record, records, source, table

OFFLOAD_METHODS = ["moe-place", "sglang-kt uniform", "sglang-kt frequency", "sglang-kt front-loading",
                   "sglang-kt random", "llama.cpp --n-cpu-moe", "llama.cpp -ot (layers from the trace)"]


def _offload_rows(data: dict) -> list[list]:
    memory = data["memory"]
    share = f"{memory['capacity_experts']} ({memory['capacity_experts'] / memory['all_experts'] * 100:.1f}%)"
    held = data["held_out"]
    judged = [(str(fold["judged_step"]), fold["total_s"]) for fold in held["folds"]] + [("mean", held["mean_total_s"])]
    rows = []
    for label, totals in judged:
        best_rule = min(totals[m] for m in OFFLOAD_METHODS if m.startswith("sglang-kt"))
        ours = totals["moe-place"]
        ratios = [ours / totals["sglang-kt uniform"] - 1, ours / best_rule - 1,
                  ours / totals["llama.cpp --n-cpu-moe"] - 1]
        cells = [pct(ratios[0]), pct(ratios[1], 3), pct(ratios[2])]
        if label == "mean":
            cells = [f"**{cells[0]}**", cells[1], f"**{cells[2]}**"]
        rows.append([share, label] + [f"{totals[m] * 1e3:.1f}" for m in OFFLOAD_METHODS] + cells)
    return rows


def _offload_sweep(data: dict) -> str:
    """The sweep's tables and its target lines (an item each): what `bench_offload_sweep.py --table-from` prints."""
    sweep = bench_module("bench_offload_sweep")
    return sweep.render_tables(data).rstrip("\n") + "\n\n" + "\n".join(f"- {line}" for line in sweep.targets(data)[0])


def offload() -> str:
    names = sorted(records("offload_heldout_*.json"), key=lambda n: float(re.search(r"[\d.]+(?=GiB)", n)[0]))
    held = [record(n) for n in names]
    rows = [row for data in held for row in _offload_rows(data)]
    cpu = record("cpu_expert.json")
    cpu_rows = []
    for dtype, d in cpu["dtypes"].items():
        for r in d["rows"]:
            cpu_rows.append([dtype, r["rows"], f(r["measured_s"] * 1e3, 3), f(r["predicted_s"] * 1e3, 3),
                             f(r["ratio"], 2), r["bound"], "> 25%" if r["flagged"] else ""])
    rates = [[dtype, f"{d['flops_per_s'] / 1e9:.1f} GFLOP/s", f"{d['dram_bytes_per_s'] / 1e9:.1f} GB/s",
              f"{d['expert_bytes'] / 2**20:.0f} MiB"] for dtype, d in cpu["dtypes"].items()]
    online = record("offload_replay.json")
    online_rows = []
    for case, c in online["cases"].items():
        static = c["policies"]["static"]["total_s"]
        for name, p in c["policies"].items():
            online_rows.append([case, c["threshold_tokens"], name, f(p["total_s"], 3), pct(p["total_s"] / static - 1),
                                f"{p['link_copies']:,}", f"{p['gpu_copies']:,}"])
    machine = cpu["machine"]
    published = record("offload_published.json")["readings"]["from the 100% row"]
    published_rows = [[f"{j['percent']}%", " > ".join(j["model_order"]), " > ".join(j["published_order"]),
                       "yes" if j["order_ok"] else "no",
                       ", ".join(f"{name} {f(m, 3)} vs {f(p, 3)}" for name, (m, p) in j["ratios"].items())]
                      for j in published["judged"]]
    return page("offload",
                "Every figure here is the cost model's prediction (no engine ran), except the CPU expert timings "
                "below.",
                "## Every budget, held out\n\nThe plan against sglang-kt's rules (the best of `uniform`, "
                "`frequency`, `front-loading`), llama.cpp and all-GPU at budgets from one expert per layer to all "
                "experts, each recorded step judged with the plan made on the other two; then each set's mean "
                "held-out step time (ms). [Offloaded serving](../offload.md) explains the plan, its [design notes]"
                "(../design/offload.md) what the sweep says. "
                + source("offload_sweep.json", "offload_sweep.png"),
                _offload_sweep(record("offload_sweep.json")),
                f"![step time over GPU memory]({RECORD_LINK}offload_sweep.png)",
                "## The published KTransformers table\n\nThe model configured for kt-kernel's published setup "
                "(Qwen3-Next-80B-A3B-FP8, 4 x RTX 4090, Xeon 6454S; the non-expert time per token from the table's "
                "100% row), the order of the three strategies and each one's ratio to `uniform`, model vs table "
                f"(order reproduced at every ratio: {'yes' if published['order_reproduced'] else 'no'}). "
                + source("offload_published.json"),
                table(["experts on the GPU", "model's order", "published order", "same", "ratio to uniform: model vs "
                       "published"], published_rows),
                "## Held out against the engines' rules\n\n`moe-place offload` on the real Qwen3-30B-A3B trace at "
                "three GPU memory budgets, each with `--kv-reserve 4GiB`: plan on two recorded batches, judge on the "
                "third; predicted weighted step time (decode 8 + decode 32 + prefill, ms) of the plan against "
                "sglang-kt's placement rules and llama.cpp's at the same memory. `random` is a seeded numpy draw of "
                "the same rule, not sglang-kt's torch draw; `frequency` reads the planning batches' counts, as a "
                "stats file recorded on them would give it. " + source(*names),
                table(["GPU experts", "judged step"] + OFFLOAD_METHODS
                      + ["plan vs uniform", "vs best sglang-kt rule", "vs `--n-cpu-moe`"], rows),
                "## The CPU half of formula 8, measured\n\n"
                f"One {cpu['model']} expert (gate+up, SiLU*up, down; {cpu['hidden']} x {cpu['intermediate']}) in "
                f"torch {machine['torch']} on {machine['torch_threads']} thread of a {machine['cores']}-core "
                f"{machine['cpu']} "
                f"machine (load average {machine['load_average_1min']:.1f}), the experts cycled from a "
                f"{cpu['bank_mib']} MiB bank so that the weights come from DRAM; the CPU's rates calibrated in the "
                f"same run (least of {cpu['reps']} calls each). " + source("cpu_expert.json", "cpu_this_machine.toml"),
                table(["dtype", "calibrated compute", "calibrated DRAM", "expert bytes"], rates),
                table(["dtype", "rows", "measured ms", "predicted ms", "measured / predicted", "bound", ""], cpu_rows),
                "## Online: swap resident experts over PCIe only when it pays back\n\n"
                f"Seeded drifting serving runs ({online['model']} shape, {online['layers']} layers, "
                f"{online['capacity']} experts on the GPU, {online['steps']} steps), every policy from the same plan "
                "made on the first steps: `static` (that plan), `sglang-kt dynamic` (after each full-GPU prefill "
                "pass, the batch's most frequent experts), `payback` (ours: a hot expert replaces the least valuable "
                "resident one over PCIe when the copy pays back) and the plan made on the whole run (hindsight, a "
                "reference). " + source("offload_replay.json"),
                table(["case", "full-GPU prefill from (tokens)", "policy", "total s", "vs static", "link copies",
                       "GPU copies"], online_rows))
