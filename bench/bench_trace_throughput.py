"""Throughput of `moe-place analyze` on a token-level trace file, against plain numpy.bincount.

Routing decisions per second (one decision = one (token, layer, expert) id). The headline rows time
the command a user runs, end to end:
- analyze:    `moe-place analyze TRACE --output FILE` called in-process as
  `moe_place.cli.main.main([...])` (so process start and imports are excluded: one untimed call
  first): read the npz, validate every id (in range, no expert twice in a token's top-k), count,
  compute every column of the table (skew, persistence over the steps' windows, pair lift on the
  token sample, EP sweep, out-of-sample loss) and write the table. Files whose `topk_ids` exceed
  `moe_place.traces.load.DEFAULT_MAX_TOKEN_BYTES` (256 MiB) are streamed (bounded memory), smaller
  ones read whole: the header line says which path this run took. `--threads` threads
  (MOE_PLACE_THREADS; default: the library's, min(2, cores));
- analyze-1t: the same on one thread (MOE_PLACE_THREADS=1);
- analyze-no-crc: `analyze` with the CRC-32 check of the stored `topk_ids` member turned off
  (`IdsReader.check_crc_meanwhile` patched for the call): what the check costs, in the same run.
Below them, the counting alone:
- baseline: `np.bincount` per layer on contiguous in-memory int64 ids `[layers, tokens * k]`
  (no file, no validation) - the reference, in its fastest form (bincount's own index type, so
  it converts nothing);
- base-int16: the same on the int16 ids as stored (np.bincount copies them to int64 first, so
  on long rows it is partly memory-bound);
- chunked:  the same per-layer bincount, on the same cache-sized token chunks the stream uses
  (no file, no validation): the cost of validation alone is stream vs chunked;
- stream:   `moe_place.traces.stream.stream_npz_counts` end to end: open the uncompressed `.npz`,
  read `topk_ids` chunk by chunk, validate every chunk and count per step and layer, with memory
  bounded by one chunk per thread (plus the token sample), on `--threads` threads;
- stream-1t: the same on one thread (the sequential path), so the single-core figure stays visible;
- memory:   the same validation and counting on the in-memory array (no file), `--threads` threads;
- sorted:   the straightforward alternative: full `np.sort` along k to find repeats, then count.
The ratio column is each method's rate over the baseline's, measured in the same run: the
methods run round-robin --repeats times and each keeps its best time (fair on a busy machine).
The reference uses ONE core; the threaded rows use the machine's cores (`threads` in the header
and the JSON), so their ratio is a wall-clock comparison of what a user gets, not of work per
core - the `-1t` rows are the like-for-like one-core figures. On a machine whose other core is
busy the threads cannot help. The peak memory line traces one more `analyze` call (tracemalloc).
The file is read warm from the page cache (it was just written). The ids are synthetic: per
token-layer a random expert plus k fixed distinct offsets (mod experts), so every token's ids
are distinct; tokens are split into `--steps` consecutive steps (a `step` array), so persistence
and out-of-sample loss have windows to compare.

    python bench/bench_trace_throughput.py --tokens 130000 --layers 48 --experts 128   # 100 MB, read whole
    python bench/bench_trace_throughput.py --tokens 360000 --layers 48 --experts 128   # 276 MB, streamed
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from moe_place.traces.count import THREADS_ENV, DispatchCounter, chunk_tokens_for, resolve_workers
from moe_place.traces.load import DEFAULT_MAX_TOKEN_BYTES
from moe_place.traces.npz_member import IdsReader
from moe_place.traces.stream import stream_npz_counts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_record_options, refuse_overwrite, write_record  # noqa: E402  (bench/ is not a package)


def make_ids(tokens: int, layers: int, experts: int, k: int, seed: int) -> np.ndarray:
    """int16 `[tokens, layers, k]`, k distinct experts per token-layer."""
    rng = np.random.default_rng(seed)
    offsets = rng.choice(experts, k, replace=False).astype(np.int32)
    ids = np.empty((tokens, layers, k), dtype=np.int16)
    step = 1 << 16
    for start in range(0, tokens, step):
        n = min(step, tokens - start)
        base = rng.integers(0, experts, (n, layers, 1), dtype=np.int32)
        ids[start:start + n] = (base + offsets) % experts
    return ids


def round_robin(methods: dict, repeats: int) -> tuple[dict, dict]:
    """Best wall time (s) and last result of each method, running them in turn `repeats` times."""
    best = {name: float("inf") for name in methods}
    results = {}
    for _ in range(repeats):
        for name, fn in methods.items():
            start = time.perf_counter()
            results[name] = fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best, results


def chunked_bincount(ids: np.ndarray, experts: int, chunk_tokens: int) -> np.ndarray:
    """Per-layer np.bincount over cache-sized token chunks, no validation."""
    out = np.zeros((ids.shape[1], experts), dtype=np.int64)
    for start in range(0, ids.shape[0], chunk_tokens):
        chunk = ids[start:start + chunk_tokens]
        for layer in range(ids.shape[1]):
            out[layer] += np.bincount(chunk[:, layer].ravel(), minlength=experts)
    return out


def sorted_check_count(ids: np.ndarray, experts: int, chunk_tokens: int) -> np.ndarray:
    """The naive alternative: sort every token's k ids to find repeats, then count."""
    out = np.zeros((ids.shape[1], experts), dtype=np.int64)
    for start in range(0, ids.shape[0], chunk_tokens):
        chunk = ids[start:start + chunk_tokens]
        if chunk.min() < 0 or chunk.max() >= experts:
            raise ValueError("id out of range")
        ordered = np.sort(chunk, axis=2)
        if (ordered[:, :, 1:] == ordered[:, :, :-1]).any():
            raise ValueError("repeat")
        for layer in range(ids.shape[1]):
            out[layer] += np.bincount(chunk[:, layer].ravel(), minlength=experts)
    return out


def _without_crc(run, *args):
    """`run(*args)` with `moe_place.traces.npz`'s CRC-32 check of a stored `topk_ids` member turned off."""
    saved = IdsReader.check_crc_meanwhile
    IdsReader.check_crc_meanwhile = lambda self: None
    try:
        return run(*args)
    finally:
        IdsReader.check_crc_meanwhile = saved


def analyze_command(path: Path, out: Path, threads: int, output_format: str = "table") -> None:
    """`moe-place analyze path --output out` in this process on `threads` threads (its stderr note dropped)."""
    # the CLI imported here, not at the top: the user's command is what is timed, not record plumbing (the untimed
    # first call pays for the import)
    from moe_place.cli.main import main as cli_main

    saved = os.environ.get(THREADS_ENV)
    os.environ[THREADS_ENV] = str(threads)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            code = cli_main(["analyze", str(path), "--output", str(out), "--format", output_format])
    finally:
        if saved is None:
            del os.environ[THREADS_ENV]
        else:
            os.environ[THREADS_ENV] = saved
    assert code == 0, f"moe-place analyze exited with {code}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16, help="consecutive steps the tokens are split into")
    parser.add_argument("--chunk-tokens", type=int, help="tokens per chunk (default: about 256K ids)")
    parser.add_argument("--threads", type=int, help="threads for analyze, stream and memory (default: "
                        "MOE_PLACE_THREADS, else min(2, cores))")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    add_record_options(parser)
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args)
    threads = resolve_workers(args.threads)
    load_before = os.getloadavg()  # other jobs on the machine slow the long rows more than the baseline

    ids = make_ids(args.tokens, args.layers, args.experts, args.top_k, args.seed)
    step = np.arange(args.tokens, dtype=np.int64) * args.steps // args.tokens
    decisions = ids.size
    streamed = ids.nbytes > DEFAULT_MAX_TOKEN_BYTES
    by_layer = np.ascontiguousarray(ids.transpose(1, 0, 2)).reshape(args.layers, -1)
    by_layer_intp = by_layer.astype(np.intp)  # bincount's own index type: no conversion inside
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.npz"
        table = Path(tmp) / "analysis.txt"
        np.savez(path, format_version=1, num_experts=args.experts, top_k=args.top_k, topk_ids=ids, step=step)
        file_bytes = os.path.getsize(path)

        chunk = chunk_tokens_for(args.layers, args.top_k, args.chunk_tokens)
        counter = DispatchCounter(args.layers, args.experts, args.top_k, "ids")
        methods = {
            "analyze": lambda: analyze_command(path, table, threads),
            "analyze-1t": lambda: analyze_command(path, table, 1),
            "analyze-no-crc": lambda: _without_crc(analyze_command, path, table, threads),
            "baseline": lambda: np.stack([np.bincount(row, minlength=args.experts) for row in by_layer_intp]),
            "base-int16": lambda: np.stack([np.bincount(row, minlength=args.experts) for row in by_layer]),
            "chunked": lambda: chunked_bincount(ids, args.experts, chunk),
            "stream": lambda: stream_npz_counts(path, chunk, threads).counts.sum(axis=0),
            "stream-1t": lambda: stream_npz_counts(path, chunk, 1).counts.sum(axis=0),
            "memory": lambda: counter.count(ids, chunk, threads),
            "sorted": lambda: sorted_check_count(ids, args.experts, chunk),
        }
        analyze_command(path, table, threads)  # imports and first-call setup, not timed
        seconds, results = round_robin(methods, args.repeats)
        for name, counts in results.items():
            if counts is not None:
                assert np.array_equal(counts, results["baseline"]), f"{name} counts differ from the baseline"

        report_path = Path(tmp) / "analysis.json"
        tracemalloc.start()
        analyze_command(path, report_path, threads, "json")
        _, analyze_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        report = json.loads(report_path.read_text())
        loads = np.array([layer["expert_load"] for layer in report["layers"]])
        assert np.array_equal(loads, results["baseline"]), "analyze's expert loads differ from the baseline"
        tracemalloc.start()
        stream_npz_counts(path, chunk, threads)
        _, stream_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()

    what = {
        "analyze": f"moe-place analyze (every column), {'streamed' if streamed else 'read whole'}, "
                   f"{threads} thread(s)",
        "analyze-1t": "the same on 1 thread",
        "analyze-no-crc": "analyze without the CRC-32 check of the topk_ids member (what the check costs)",
        "baseline": "np.bincount per layer, contiguous int64 in memory, no validation (the reference)",
        "base-int16": "the same on the int16 ids (bincount converts them to int64 first)",
        "chunked": "np.bincount per layer on token chunks, in memory, no validation",
        "stream": f"npz file -> chunks -> range + repeat check -> counts, {threads} thread(s)",
        "stream-1t": "the same on 1 thread",
        "memory": f"same validation + counting, in-memory array, {threads} thread(s)",
        "sorted": "np.sort repeat check + per-layer bincount, in memory",
    }
    base_rate = decisions / seconds["baseline"]
    for name in methods:
        rate = decisions / seconds[name]
        rows.append({"method": name, "seconds": seconds[name], "decisions_per_s": rate,
                     "ratio_vs_baseline": rate / base_rate, "what": what[name]})

    pair_sample = report["pair_sample"]
    print(f"{args.tokens:,} tokens x {args.layers} layers x top-{args.top_k} ({args.experts} experts), "
          f"{args.steps} steps = {decisions:,} decisions; int16 ids; npz {file_bytes / 1e6:.1f} MB "
          f"({'over' if streamed else 'under'} the {DEFAULT_MAX_TOKEN_BYTES >> 20} MiB streaming threshold: "
          f"{'streamed' if streamed else 'read whole'}); chunk {chunk} tokens; threads {threads} (baseline: 1); "
          f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"{'method':<15}{'seconds':>10}{'M decisions/s':>15}{'x baseline':>12}  what")
    for row in rows:
        print(f"{row['method']:<15}{row['seconds']:>10.4f}{row['decisions_per_s'] / 1e6:>15.1f}"
              f"{row['ratio_vs_baseline']:>12.2f}  {row['what']}")
    print(f"analyze peak traced memory ({threads} thread(s)): {analyze_peak / 1e6:.2f} MB "
          f"({analyze_peak / ids.nbytes:.3f} of the {ids.nbytes / 1e6:.1f} MB ids array); "
          f"stream alone {stream_peak / 1e6:.2f} MB")
    print("pair lift: " + ("every token" if pair_sample is None else
                           f"chosen on {pair_sample['chosen_on_tokens']:,} sampled tokens, estimated on "
                           f"{pair_sample['estimated_on_tokens']:,} others"))
    if args.output_json:
        write_record(args.output_json, {
            "tokens": args.tokens, "layers": args.layers, "experts": args.experts, "top_k": args.top_k,
            "steps": args.steps, "decisions": decisions, "chunk_tokens": chunk, "repeats": args.repeats,
            "threads": threads, "file_bytes": file_bytes, "ids_bytes": int(ids.nbytes), "streamed": streamed,
            "max_token_bytes": DEFAULT_MAX_TOKEN_BYTES, "analyze_peak_bytes": int(analyze_peak),
            "stream_peak_bytes": int(stream_peak), "pair_sample": pair_sample,
            "load_average": {"before": load_before[0], "after": os.getloadavg()[0]}, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
