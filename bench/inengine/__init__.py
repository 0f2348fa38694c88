"""The in-engine bench kit, imported with `bench/` on `sys.path` (as the bench scripts put it there, and the tests'
`bench_modules`): `harness` drives vLLM 0.33's and SGLang 0.5.23's own rebalance code (or `standins`, their
stand-ins for CI) and judges what a policy does there; the engines' own default policies are
`moe_place.online.engine_default`."""

__all__ = ["harness", "standins", "torch_threads"]


def torch_threads(threads: int) -> int:
    """Sets torch's intra-op threads for the engines' own policies (torch code) and returns the threads in force.
    The benches run them on 1: their tensors are a few thousand counts, too small to split, and a second thread only
    spin-waits, which the calling thread's CPU time counts on a busy machine."""
    import torch

    torch.set_num_threads(threads)
    return torch.get_num_threads()
