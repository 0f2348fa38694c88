"""Multi-rank dispatch/combine over gloo (local processes) on a real Qwen3 trace layer.

Each rank runs `ep_moe_layer` on its share of the tokens; the parent checks the outputs against
a single-process reference and the rows/bytes each rank moved against a traffic matrix computed
independently here with plain python (`reference_slots`).
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from moe_place.placement import Placement
from moe_place.traces.bundled import bundled_path
from moe_place.traces.load import load_trace

HIDDEN, TOKENS, LAYER = 32, 96, 17


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def batch(num_gpus: int):
    """Tokens, routing, weights and placement shared by the ranks and the reference."""
    trace = load_trace(bundled_path("qwen3-30b-a3b_prefill_topk.npz"))
    ids = torch.from_numpy(trace.topk_ids[0][:TOKENS, LAYER, :].astype(np.int64))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    weights = torch.softmax(torch.randn(TOKENS, ids.shape[1], generator=gen), dim=1)
    # one redundant slot per GPU: the hottest expert not yet on that GPU (replicas off their home GPU)
    loads = np.bincount(ids.numpy().ravel(), minlength=128)
    home = np.arange(128).reshape(num_gpus, -1)
    extra = []
    for gpu in range(num_gpus):
        extra.append(next(int(e) for e in np.argsort(-loads, kind="stable") if e not in home[gpu] and e not in extra))
    phy2log = np.concatenate([home, np.array(extra)[:, None]], axis=1).reshape(-1)
    placement = Placement(phy2log[None, :], 128, num_gpus)
    return x, ids, weights, placement


def scale_expert(phy2log: torch.Tensor):
    """Expert e multiplies a row by (e + 1) / 128: replicas give identical results."""
    return lambda rows, slots: rows * ((phy2log[slots] + 1).float() / 128)[:, None]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from moe_place.kernels.alltoall import ep_moe_layer
    from moe_place.kernels.dispatch import split_tokens

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x, ids, weights, placement = batch(world)
        phy2log = torch.from_numpy(placement.phy2log[0])
        lo, hi = split_tokens(TOKENS, world)[rank:rank + 2]
        for policy in ("even", "local"):
            out, traffic = ep_moe_layer(x[lo:hi], ids[lo:hi], weights[lo:hi], phy2log, scale_expert(phy2log), policy)
            torch.save({"out": out, "send": traffic.send_rows, "recv": traffic.recv_rows,
                        "send_bytes": traffic.dispatch_send_bytes, "recv_bytes": traffic.dispatch_recv_bytes},
                       os.path.join(out_dir, f"{policy}_{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [4])
def test_ep_layer_over_gloo_matches_reference_and_traffic(world, tmp_path):
    from test_kernels_dispatch import reference_slots  # here, so the spawned ranks do not import it

    mp.spawn(_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    x, ids, weights, placement = batch(world)
    phy2log = placement.phy2log[0]
    expected = (weights[:, :, None] * x[:, None, :] * ((ids + 1).float() / 128)[:, :, None]).sum(dim=1)
    from moe_place.kernels.dispatch import split_tokens
    bounds = split_tokens(TOKENS, world)
    slots_per_gpu = len(phy2log) // world
    for policy in ("even", "local"):
        results = [torch.load(tmp_path / f"{policy}_{r}.pt") for r in range(world)]
        torch.testing.assert_close(torch.cat([r["out"] for r in results]), expected, atol=1e-5, rtol=1e-5)
        # traffic matrix a[s][d] from the plain-python split policy
        a = np.zeros((world, world), dtype=np.int64)
        for s in range(world):
            slots = reference_slots(ids[bounds[s]:bounds[s + 1]].numpy(), phy2log, world, s, policy)
            np.add.at(a[s], slots.ravel() // slots_per_gpu, 1)
        assert a.sum() == TOKENS * ids.shape[1]
        for r, res in enumerate(results):
            assert res["send"] == a[r].tolist() and res["recv"] == a[:, r].tolist()
            assert res["send_bytes"] == a[r].sum() * HIDDEN * 4
            assert res["recv_bytes"] == a[:, r].sum() * HIDDEN * 4
        if policy == "local":
            local_rows = np.trace(a)
        else:
            even_local_rows = np.trace(a)
    assert local_rows > even_local_rows  # the replicas on the source's own GPU keep rows off the wire
