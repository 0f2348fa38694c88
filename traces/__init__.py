"""Routing traces: load, stream and synthesize (imported as `moe_place.traces`)."""

from moe_place.traces.model import Trace, TraceMeta, check_counts, check_topk_ids, count_dispatches
from moe_place.traces.load import load_trace

__all__ = ["Trace", "TraceMeta", "check_counts", "check_topk_ids", "count_dispatches", "load_trace"]
