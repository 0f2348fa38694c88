"""The vocabulary of moe-place, defined once. Names follow vLLM and SGLang.

logical expert
    One of the `E` experts a layer's router chooses from (ids `0..E-1`). A token picks `k`
    distinct logical experts per MoE layer (top-k).
dispatch
    One (token, logical expert) pair. A batch of `n` tokens makes `n*k` dispatches per layer.
    A dispatch becomes one *row* of the expert's grouped GEMM.
physical expert / slot
    A copy of a logical expert's weights in GPU memory. A layer has `P >= E` physical experts,
    `P = E + R` with `R` redundant experts (vLLM's `num_redundant_experts`). Example: DeepSeek-V3
    has 256 logical experts; with 32 redundant experts it has 256 + 32 = 288 physical experts,
    9 per GPU at EP32.
replica
    Any physical expert of a logical expert; an expert with `logcnt[e] = 3` has three replicas.
GPU / rank
    One expert-parallel (EP) rank. `G` ranks hold `S = P/G` slots each; slot `p` lives on GPU
    `p // S` (the engines' convention). EP size means `G`.
node
    A server of `G/N` GPUs joined by NVLink; nodes are joined by NICs and a fabric.
phy2log
    int64 `[layers, P]`: the logical expert held by each physical slot.
log2phy
    int64 `[layers, E, max(logcnt)]`: the slots holding each logical expert, padded with -1.
logcnt
    int64 `[layers, E]`: replicas per logical expert (>= 1).
expert load
    Dispatches routed to a logical expert, summed over a step, window or trace.
step / window
    A step is one forward pass (a batch). A window is a run of consecutive steps whose loads
    are summed, as engines do before they re-plan.
split policy
    How a logical expert's dispatches are shared by its replicas: `even` (each replica takes
    `1/logcnt`, what EPLB assumes), `local` (a token uses a replica on its own GPU when there
    is one, SGLang's `static`), `optimal` (a per-batch split that minimises the busiest GPU).
busiest/mean GPU (s_expert)
    Rows of the busiest GPU over the mean rows per GPU; 1 is perfect balance.
balancedness
    Mean over max GPU load, in `(0, 1]` (vLLM/SGLang's metric, the inverse of s_expert).
home GPU (token home)
    The GPU that holds a token before and after its MoE layer (data-parallel attention puts a
    batch's tokens on the `G` GPUs: contiguous `blocks`, or `round-robin`).
replica choice
    Which replica of an expert a (token, expert) pair is sent to: vLLM 0.33 hashes the token's index in its
    rank's batch (`((t * 2654435769) mod 2^32) mod replicas`); SGLang's `static` dispatch uses a replica on
    the token's GPU, else its node, else a fair draw per rank; `dynamic` a random replica per pair;
    `node-aware` is ours (home GPU, home node, a node the token visits anyway, the least loaded).
per-batch split
    moe-place's replica choice that shares each batch's rows of an expert among its replicas so that the
    busiest GPU is least, from the batch's counts all-reduced over the EP group (`moe_place.split`); it
    costs each layer that all-reduce and the solve, so a per-layer choice turns it on only where it pays.
dispatch / combine (at multi-node EP)
    Sending tokens to their experts' GPUs and the results back. DeepEP style: one RDMA send per
    token and remote node, then NVLink fan-out inside the node; all-to-all: one send per token
    and destination GPU. Distinct nodes per token: the nodes a token's chosen replicas are on.
layer time
    Dispatch + busiest-GPU expert compute + combine of one MoE layer (phases separated by barriers).
lower bound, gap
    A lower bound is a load no plan of the layer can beat (e.g. the mean GPU's load, or the heaviest
    expert split over all its replicas). The gap is how far the plan's busiest GPU may be above the
    best plan: `(busiest - lower bound) / busiest`; 0 proves the plan optimal.
status (of a layer's plan)
    What is known of the plan's quality; `STATUS_MEANINGS` below holds the words and what `plan` prints
    beside them: `optimal` (proved), `feasible` (a solver stopped at its time limit before a proof),
    `heuristic` (no proof: the gap says how far from optimal it may be).
grouping strength
    With `plan --objective time` at multi-node EP: how many swaps of two experts between nodes the
    plan took to put experts that tokens choose together on one node (0: none, nodes balanced by
    load alone; `moe_place.solvers.comm`).
"""

# The status words a plan's report prints, each with the short meaning printed beside them (`explain`).
STATUS_MEANINGS = (
    ("optimal", "proved best (busiest = lower bound)"),
    ("feasible", "stopped at the time limit before a proof"),
    ("heuristic", "not proved; the gap bounds the loss"),
)
GROUPING_STRENGTH = ("swaps of two experts between nodes taken to put experts that tokens choose together on "
                     "one node (0: none)")


def explain(statuses) -> str:
    """One line defining the status words among `statuses` (in `STATUS_MEANINGS` order), e.g. for a table's legend."""
    shown = set(statuses)
    return "; ".join(f"{word} = {meaning}" for word, meaning in STATUS_MEANINGS if word in shown)
