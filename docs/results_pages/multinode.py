"""The multi-node EP page and the calibration of the model against published measurements."""

from __future__ import annotations

from .common import RECORD_LINK, RecordError, bench_module, f, page, record, source, table


def multinode() -> str:
    data = record("comm.json")
    timing = record("comm_plan_time.json")
    if "verdicts" not in data or not all("whole_model" in v for v in data["verdicts"]):
        raise RecordError("bench/results/comm.json: expected the record of bench_comm.py with verdicts[].whole_model "
                          "(teach docs/gen_results.py the record's new shape)")
    times = [[t["command"], f"{t['wall_s']:.1f}", f"{t['cpu_s']:.1f}", t["cores"], t["exit_code"]]
             for t in timing["plan_time"]]
    return page("multinode",
                "The real Qwen3-30B-A3B trace (three recorded prefill batches), all 48 layers, planned with "
                "`--objective time` on two batches and judged on the third (each fold), layer time predicted by the "
                "default model of the time objective, over the balance-only plan `fast`; then the synthetic test bed "
                "of known co-activation. [Multi-node EP](../multinode.md) explains the decision, its [design notes]"
                "(../design/multinode.md) what these tables say.",
                source("comm.json", "comm_plan_time.json", "comm.png"),
                bench_module("bench_comm").results_table(data),
                "## Plan time\n\n" + table(["command", "wall s", "CPU s", "cores", "exit"], times),
                f"![layer time per method]({RECORD_LINK}comm.png)")


def calibration() -> str:
    data = record("published_comm.json")
    rows = [[r["table"], r["ep"], r["phase"], r["tokens_per_rank"], f"{r['published_s'] * 1e6:.1f}",
             f"{r['model_s'] * 1e6:.1f}", f(r["model_over_published"], 3),
             f"[{r['source']['path']}](https://github.com/{r['source']['repo']}/blob/{r['source']['commit']}/"
             f"{r['source']['path']})"] for r in data["rows"]]
    fits = [[fit["fitted_on"], f"{fit['latency_s']['dispatch'] * 1e6:.1f}", f"{fit['latency_s']['combine'] * 1e6:.1f}"]
            for fit in data["latency_fits"]]
    return page("calibration",
                "Formula 3 (dispatch and combine, the bottleneck of each phase's bytes, no start-up) against DeepEP's "
                "published kernel times, in the published settings (H800 nodes of 8 GPUs, one 400 Gb/s NIC per GPU, "
                "DeepSeek-V3's hidden size, top-8 of 256 experts, DeepEP's own routing recipe, seeded). "
                "[Calibration](../calibration.md) says how each row is set up and what the model leaves out.",
                source("published_comm.json"),
                table(["table", "EP", "phase", "tokens per rank", "published us", "model us", "model / published",
                       "source"], rows),
                "## A fixed start-up per phase, fitted on one table\n\n"
                + table(["fitted on", "dispatch us", "combine us"], fits))
