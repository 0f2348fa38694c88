"""The time planner's lower bound on a layer's time (`layer_lower_bound_s`)."""

from __future__ import annotations

import numpy as np

from moe_place.analysis.dispatch import token_sources
from moe_place.cost.comm import CommModel

__all__ = ["layer_lower_bound_s"]


def layer_lower_bound_s(steps: list[np.ndarray], model: CommModel, num_experts: int, num_gpus: int, num_nodes: int,
                        num_physical: int) -> float:
    """A lower bound on `layer_cost(...).layer_time_s` over every plan of one layer (the package docstring).

    steps: one int `[tokens, k]` array per step.
    """
    gpn, slots = num_gpus // num_nodes, num_physical // num_gpus
    total = 0.0
    per_row_dispatch = per_row_combine = 0.0
    ports = [d["capacity"] for _, _, d in model.topology.graph.edges(data=True) if d["kind"] == "nic"]
    if ports and model.dispatch == "deepep" and num_physical == num_experts and num_nodes > 1:
        per_row_dispatch = model.dispatch_row_bytes / max(ports)
        per_row_combine = model.combine_row_bytes / max(ports)
    for ids in steps:
        ids = np.asarray(ids, dtype=np.int64)
        tokens = ids.shape[0]
        used = np.unique(ids).size
        # the GPU with the most rows: at least the mean, in at least one slot (FLOPs, padding, tiles: all grow)
        mean_rows = np.zeros((1, slots))
        mean_rows[0, 0] = tokens * ids.shape[1] / num_gpus
        # the GPU touching the most experts reads at least ceil(used / G) experts' weights
        weights_only = np.zeros((1, slots))
        weights_only[0, :min(-(-used // num_gpus), slots)] = 1e-9
        total += max(float(model.compute_times_s(mean_rows, 1)[0, 0]),
                     float(model.compute_times_s(weights_only, 1)[0, 0]))
        if per_row_dispatch:
            home = token_sources(tokens, num_gpus, model.token_home)
            rank, home_node = home % gpn, home // gpn
            # uses[e, node, rank]: tokens of that home node and rank using expert e
            uses = np.zeros((num_experts, num_nodes, gpn))
            np.add.at(uses, (ids, np.repeat(home_node[:, None], ids.shape[1], axis=1),
                             np.repeat(rank[:, None], ids.shape[1], axis=1)), 1.0)
            from_others = uses.sum(axis=1, keepdims=True) - uses                    # [E, node, rank]
            rows = float(from_others.max(axis=2).min(axis=1).max())
            total += rows * (per_row_dispatch + per_row_combine)
    return total
