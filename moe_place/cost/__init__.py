"""moe_place.cost: the time model of docs/MODEL.md, one concept per module.

units      GB vs GiB, Gbit/s; every other quantity carries its unit in its name
hardware   catalog of GPUs, CPUs and NICs (datasheet peaks x efficiency), user parts from TOML/JSON
models     expert-shape presets (DeepSeek-V3/R1, Qwen3, Mixtral, OLMoE, GPT-OSS)
topology   networkx graph of GPUs, NVLink switches, NICs, fabric, host PCIe; routes, cuts, max-flow
gemm       padding (formula 4), tile traffic (formula 5), per-GPU `max(F/C, W/B)` (formula 1)
traffic    dispatch/combine volumes and the lower bound of formula 3; NIC message rate (C13)
comm       a plan's MoE layer time on a token-level trace: replica choice, DeepEP / all-to-all traffic,
           dispatch + busiest-GPU compute + combine
pipeline   micro-batch pipeline (formula 6) and break-even slowdowns (C7)
migration  what a re-plan moves (one copy per moved slot, cheapest source) and costs (serial/parallel, stall/async)
payback    memory check, N_min and net gain of a replica move (formula 7)
offload    CPU vs GPU for host-memory experts (formula 8), capacity (C11, C12), pool stability (formula 9)
scenario   scenario files behind `moe-place predict` / `moe-place payback`
"""

# the package's modules
__all__ = ["cluster", "comm", "expected_traffic", "files", "gemm", "gemm_profile", "hardware", "migration",
           "model_layers", "models", "offload", "payback", "pipeline", "plot", "replicas", "report", "scenario",
           "topology", "traffic", "units"]
