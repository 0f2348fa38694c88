"""Micro-batch pipeline (formula 6) and the break-even slowdowns of C7.

Stages `t_1..t_S` run on independent resources (e.g. dispatch on the NIC, expert GEMM on the SMs,
combine on the NIC again); `q` equal micro-batches each take `t_s / q` per stage. With a barrier
between phases the batch takes `sum_s t_s`; pipelined it takes
`T = sum_s t_s/q + (q-1) * max_s t_s/q`.
"""

from __future__ import annotations

import numpy as np

from moe_place.errors import InputError

__all__ = ["breakeven_slowdown", "pipeline_time_s", "split_pipeline_time_s"]


def _stages(stage_times_s) -> np.ndarray:
    t = np.asarray(stage_times_s, dtype=np.float64)
    if t.ndim != 1 or t.size == 0 or not np.isfinite(t).all() or (t < 0).any():
        raise InputError("stage times", "a non-empty list of seconds >= 0", stage_times_s)
    return t


def _micro_batches(q) -> int:
    if isinstance(q, bool) or not isinstance(q, (int, np.integer)) or q < 1:
        raise InputError("micro_batches", "an integer >= 1", q)
    return int(q)


def pipeline_time_s(micro_batch_stage_times_s, micro_batches: int) -> float:
    """Formula 6: `sum_s t_s + (q-1) * max_s t_s` for `q` micro-batches of stage times `t_s` each."""
    t = _stages(micro_batch_stage_times_s)
    q = _micro_batches(micro_batches)
    return float(t.sum() + (q - 1) * t.max())


def split_pipeline_time_s(batch_stage_times_s, micro_batches: int) -> float:
    """A whole batch's stage times split into `q` equal micro-batches, then pipelined."""
    q = _micro_batches(micro_batches)
    return pipeline_time_s(_stages(batch_stage_times_s) / q, q)


def breakeven_slowdown(batch_stage_times_s, micro_batches: int, slowed: list[int],
                       target_s: float | None = None) -> float:
    """Factor `x` by which the stages `slowed` (indices) may slow down before the pipelined batch
    takes `target_s` (default: the serial time `sum_s t_s`, i.e. the pipeline stops paying).

    Solves `A + x*B + (q-1)*max(M_u, x*M_s) = target` exactly, where `A`/`M_u` are the sum/max of the
    other stages and `B`/`M_s` those of the slowed stages (all per micro-batch). Returns `inf` when
    the slowed stages take no time.
    C7: C6 balanced, q=2: dispatch+combine 1.489x (49% slower), compute 3.147x.
    """
    t = _stages(batch_stage_times_s)
    q = _micro_batches(micro_batches)
    idx = sorted(set(int(i) for i in slowed))
    if not idx or idx[0] < 0 or idx[-1] >= t.size:
        raise InputError("slowed stages", f"stage indices in [0, {t.size})", slowed)
    target = float(t.sum()) if target_s is None else float(target_s)
    per = t / q
    mask = np.zeros(t.size, dtype=bool)
    mask[idx] = True
    a, m_u = per[~mask].sum(), (per[~mask].max() if (~mask).any() else 0.0)
    b, m_s = per[mask].sum(), per[mask].max()
    if b == 0:
        return float("inf")
    if split_pipeline_time_s(t, q) > target:
        raise InputError("target time", f"at least the unslowed pipeline time {split_pipeline_time_s(t, q)} s", target)
    x = (target - a - (q - 1) * m_u) / b  # regime where the unslowed stages set the beat
    if x * m_s <= m_u:
        return float(x)
    return float((target - a) / (b + (q - 1) * m_s))  # the slowed stages set the beat

