"""The vocabulary of moe-place, defined once: `TERMS` (term -> meaning) and `ALIASES` (another spelling
the code or the commands' output uses -> term). Names follow vLLM and SGLang. docs/glossary.md is
generated from these (docs/gen_reference.py); tests/test_glossary.py checks that every column and label
the commands' tables print is one of them.
"""

from __future__ import annotations

__all__ = ["explain"]

# The status words a plan's report prints, each with the short meaning printed beside them (`explain`).
STATUS_MEANINGS = (
    ("optimal", "proved best (busiest = lower bound)"),
    ("feasible", "stopped at the time limit before a proof"),
    ("heuristic", "not proved; the gap bounds the loss"),
)
GROUPING_STRENGTH = ("swaps of two experts between nodes taken to put experts that tokens choose together on "
                     "one node (0: none)")

TERMS: dict[str, str] = {
    # ------------------------------------------------------------------ experts, slots, GPUs
    "logical expert": "One of the `E` experts a layer's router chooses from (ids `0..E-1`). A token picks `k` "
                      "distinct logical experts per MoE layer (top-k).",
    "dispatch": "One (token, logical expert) pair: a batch of `n` tokens makes `n*k` dispatches per layer, and a "
                "dispatch becomes one *row* of its expert's grouped GEMM. Also the phase of the MoE layer that "
                "sends the tokens to the GPUs of their chosen replicas (`dispatch us`; `predict`'s `dispatch`: "
                "its time as formula 3 bounds it, its bytes and what binds it), see dispatch style.",
    "combine": "The phase after the experts' compute that sends each dispatch's result back to its token's home "
               "GPU: the dispatch's rows in the opposite direction (`combine us`; `predict`'s `combine`).",
    "compute": "The MoE layer's expert compute: the busiest GPU's grouped-GEMM time over the rows its slots "
               "received (formula 11 by default, [the model](MODEL.md)); `compute us` per layer, `predict`'s "
               "`compute` with what bounds it.",
    "expert load": "Dispatches routed to a logical expert, summed over a step, window or trace.",
    "physical expert": "A copy of a logical expert's weights in GPU memory, in a *slot*. A layer has `P >= E` "
                       "of them, `P = E + R`. Example: DeepSeek-V3 has 256 logical experts; with 32 redundant "
                       "experts it has 256 + 32 = 288 physical experts, 9 per GPU at EP32.",
    "redundant experts": "`R`, the slots beyond one per expert: extra replicas of hot experts (vLLM's "
                             "`num_redundant_experts`, SGLang's `--ep-num-redundant-experts`).",
    "replica": "Any physical expert of a logical expert; an expert with `logcnt[e] = 3` has three replicas.",
    "GPU": "One expert-parallel (EP) rank. `G` ranks hold `S = P/G` slots each; slot `p` lives on GPU `p // S` "
           "(the engines' convention). In `predict`: the GPU part (its FLOP/s, memory bytes/s, efficiency).",
    "EP size": "`G`, the GPUs (EP ranks) of a layer; the `EP` column of `analyze`'s EP sweep.",
    "EP`n`": "`analyze`'s per-layer column for EP size `n`: busiest/mean GPU of the summed loads under the "
             "contiguous placement.",
    "slots/GPU": "`S = P/G`, the slots each GPU holds in every layer (engines need one count on every layer; "
                 "budget mode chooses it per layer).",
    "experts/GPU": "`E/G`, the experts each GPU holds under the contiguous placement.",
    "node": "One of `N` servers of `G/N` GPUs joined by NVLink; GPU `g` is on node `g // (G/N)`. Nodes are "
            "joined by NICs and a fabric.",
    "NIC": "A GPU's network card to other nodes. `predict`'s `nic`: its bandwidth against its message rate, "
           "and the message size where one stops binding and the other starts.",
    "home GPU": "The GPU that holds a token before and after its MoE layer (data-parallel attention puts a "
                "batch's tokens on the `G` GPUs: contiguous `blocks`, or `round-robin`).",
    "`phy2log`": "int64 `[layers, P]`: the logical expert held by each physical slot.",
    "`log2phy`": "int64 `[layers, E, max(logcnt)]`: the slots holding each logical expert, padded with -1.",
    "`logcnt`": "int64 `[layers, E]`: replicas per logical expert (>= 1).",
    "contiguous placement": "Expert `e` on GPU `e // (E/G)`, the engines' default start (`contig` in "
                            "`analyze`'s EP sweep: per window, mean over layers and transitions).",
    "layer": "One MoE layer, by its id in the model. With a time unit (`layer us`, `layer ms`): its layer time.",
    "step": "One forward pass (one recorded batch) of a trace; `steps` in `replay`: the steps replayed.",
    "window": "A run of consecutive steps whose loads are summed, as engines do before they re-plan; in "
              "`cadence`, the steps of load each rebalance plans on.",
    "in sample": "Judged on the steps a plan was made on; *held out*: judged on others.",
    "model": "On a command's `model` line: the layer-time model it priced with (expert time formula, dispatch "
             "style, replica choice; `replay` and `cadence` add how a policy call is priced). In `predict`: "
             "the MoE model's expert shape (name, bytes per expert).",
    # ------------------------------------------------------------------ balance
    "busiest/mean GPU": "Rows of the busiest GPU over the mean rows per GPU; 1 is perfect balance "
                        "(`s_expert` in [the model](MODEL.md)).",
    "balancedness": "Mean over max GPU load, in `(0, 1]` (vLLM's and SGLang's metric, the inverse of "
                    "busiest/mean GPU; 1 = even); `balanced` in the plan table, `mean balancedness` averaged "
                    "over layers (and steps).",
    "max/mean": "`analyze`: the hottest expert's load over the mean expert's, summed over the trace.",
    "CV": "`analyze`: coefficient of variation (std / mean) of the layer's expert loads.",
    "zero": "`analyze`: experts of the layer that received no dispatch in the whole trace.",
    "top`n` share": "`analyze`: share of the layer's dispatches that went to its `n` hottest experts "
                    "(`--top-n`).",
    "hot kept": "`analyze`: share of a window's top-`n` experts still top-`n` in the next window (mean over "
                "transitions).",
    "hot run": "`analyze`: mean number of consecutive windows an expert stays top-`n`.",
    "pair lift": "`analyze`: how much more often than independent picks one token takes the layer's most "
                 "frequent expert pair (1: independent).",
    "mean": "In `analyze`'s EP sweep: busiest/mean GPU of the contiguous placement, averaged over layers.",
    "worst": "In `analyze`'s EP sweep: the largest busiest/mean GPU over layers; `(layer)` beside it names "
             "that layer.",
    "vLLM bal": "Balancedness as vLLM logs it: mean GPU load summed over layers / busiest GPU load summed.",
    "SGLang bal": "Balancedness as SGLang logs it: each layer's mean / busiest GPU load, averaged over layers.",
    "TRT imb": "TensorRT-LLM's imbalance: (max - mean) / mean GPU load per step, averaged over steps and layers "
               "(0 = even).",
    "same": "`analyze`'s EP sweep: busiest/mean GPU of contiguous placement plus one replica per GPU of the "
            "hottest experts, planned on the window it is judged on (mean over layers and transitions).",
    "previous": "`analyze`'s EP sweep: the same plan made on the previous window, judged on the next: what a "
                "plan made on past load keeps.",
    # ------------------------------------------------------------------ splitting a batch's rows
    "split policy": "How a logical expert's dispatches are shared by its replicas: `even` (each replica takes "
                    "`1/logcnt`, what EPLB assumes), `local` (a token uses a replica on its own GPU when there "
                    "is one, SGLang's `static`), `optimal` (the per-batch split that minimises the busiest GPU, "
                    "exactly) and `per-batch` (the same by the fast method engines run).",
    "replica choice": "Which replica of an expert a (token, expert) pair is sent to: vLLM 0.33 hashes the "
                      "token's index `t` in its rank's batch (Knuth: `((t * 2654435769) mod 2^32) mod "
                      "replicas`); SGLang 0.5.23's `static` dispatch takes a replica on the token's GPU, else "
                      "its node, else a fair draw per rank, `dynamic` a random replica per pair, `lp` a draw with "
                      "the probabilities of a linear program solved on the batch's counts all-reduced over the EP "
                      "group (where moe-place's per-batch split runs in SGLang); `node-aware` is ours (home GPU, "
                      "home node, a node the token visits anyway, the least loaded). Every rule: `moe_place.cost.replicas`.",
    "per-batch split": "moe-place's replica choice that shares each batch's rows of an expert among its "
                       "replicas so that the busiest GPU is least, from the batch's counts all-reduced over the "
                       "EP group (`MOE_PLACE_SPLIT=per-batch`, `moe_place.split`, [split](split.md)); each "
                       "layer that uses it pays the all-reduce and the solve, so a per-layer choice turns it on "
                       "only where it pays (`replay`: the layer-steps it ran on).",
    # ------------------------------------------------------------------ time at multi-node EP
    "dispatch style": "How dispatch and combine move tokens at multi-node EP. `deepep` (DeepEP): one RDMA send "
                      "per token and remote node, then NVLink fan-out inside the node; `all-to-all`: one send "
                      "per token and destination GPU.",
    "distinct nodes per token": "The nodes a token's chosen replicas are on, a mean over all tokens.",
    "RDMA": "Dispatch-phase bytes sent between nodes over the NICs (combine sends the same rows back).",
    "NVLink": "Dispatch-phase bytes moved between GPUs of a node (combine moves the same rows back).",
    "layer time": "Dispatch + busiest-GPU expert compute + combine of one MoE layer, phases separated by "
                  "barriers (+ the per-batch split's all-reduce and solve where it runs), summed over steps.",
    "grouping strength": f"With `plan --objective time` at multi-node EP: {GROUPING_STRENGTH}; at 0 the nodes "
                         "are balanced by load alone (`moe_place.solvers.comm`).",
    # ------------------------------------------------------------------ plans and their quality
    "busiest GPU load": "The busiest GPU's rows (dispatches its slots receive) in a layer, on the loads the plan "
                        "is judged on: the steps summed, or each window's or step's busiest combined as the "
                        "report's header says.",
    "mean GPU load": "The mean GPU's rows: the layer's dispatches / `G`, on the same loads as the busiest.",
    "lower bound": "A load no plan of the layer can beat (e.g. the mean GPU's load, or the heaviest expert split "
                   "over all its replicas).",
    "gap": "How far the plan's busiest GPU may be above the best plan's: `(busiest - lower bound) / busiest`; "
           "0 proves the plan optimal.",
    "status": "What is known of a layer's plan: "
              + "; ".join(f"`{word}`: {meaning}" for word, meaning in STATUS_MEANINGS)
              + ". `feasible` is CP-SAT's time limit ending its search before a proof; without a proof the gap "
                "bounds how far the busiest GPU can be above the best plan's.",
    "solver": "The placement algorithm: `eplb` (DeepSeek's EPLB), `fast`, `cpsat` (OR-Tools CP-SAT, proves "
              "optimality), `trtllm` (TensorRT-LLM's), `auto` (fast, then CP-SAT where the time limit leaves "
              "room).",
    "wall_s": "A solver's wall-clock seconds.",
    "mean max/bound": "`compare`: busiest GPU over the best lower bound any solver certified, mean over layers "
                      "(1: proved optimal).",
    "worst max/bound": "`compare`: busiest GPU over the best lower bound any solver certified, on the worst "
                       "layer.",
    "budget mode": "`plan --expert-memory-budget`: slots per GPU chosen per layer within the budget "
                   "(`slots/GPU`, its busiest GPU load), beside the even plan engines run, one slot count on "
                   "every layer (`even: slots`, its busiest GPU load).",
    # ------------------------------------------------------------------ sizing R (plan --redundant auto)
    "held-out busiest/mean": "`plan --redundant auto`: busiest/mean GPU of plans judged on held-out steps, "
                             "summed over layers, mean over the held-out steps.",
    "worst fold": "`plan --redundant auto`: the largest held-out busiest/mean of one fold.",
    "vs first": "`plan --redundant auto`: held-out busiest/mean against the first candidate's (the fewest "
                "redundant experts).",
    "replica GiB/GPU": "The memory redundant experts take per GPU: `R / G` replicas in each MoE layer.",
    "KV tokens lost/GPU": "The KV-cache tokens the replica memory would hold on one GPU.",
    # ------------------------------------------------------------------ online: replay and cadence
    "controller": "`replay`'s online policy: `static` (the start map, never moved), `engine-default` (the "
                  "engine's own rebalance), `ours` (moe-place's rule), at the engine's cadence.",
    "default policy": "The engine's own rebalance policy as replayed: the engine's code where importable, else "
                      "moe-place's numpy copy of DeepSeek's EPLB.",
    "rebalances": "How often the map in use changed.",
    "bytes moved": "Expert weights copied between GPUs by the rebalances (slots changed: every slot whose "
                   "expert changed, a copy within a GPU included).",
    "expert-layer time": "The busiest GPU's expert time of every layer, summed over layers and steps.",
    "dispatch + combine": "Each step's expected dispatch and combine time (formula 3), summed over steps.",
    "migration time": "What serving pays for the copies: their time (`stall`) or the delay they cause beside "
                      "dispatch and combine (`async`).",
    "policy time": "The policy's own time that serving pays: all of it where it waits (SGLang, vLLM sync), "
                   "nothing in vLLM's async worker; the CPU seconds measured are beside it.",
    "split choice CPU": "With `--split per-batch`: the CPU seconds of the split's per-layer choice in moe-place's "
                        "policy calls, on this machine's clock; a priced total pays its committed price instead "
                        "(per slot of the layers it screens and prices; each call's at most 0.2% of the layers' "
                        "time until the next call).",
    "total time": "Expert-layer time + dispatch + combine + migration time + policy time.",
    "cadence sweep": "`cadence`: the engine's protocol and the trace replayed at each rebalance interval.",
    "interval": "Steps between two calls of the rebalance policy (the engine's `step_interval`).",
    "default": "`cadence`: the engine's default policy at that interval: its total time (s) and the bytes it "
               "moved (GiB).",
    "moe-place": "`cadence`: moe-place's rule at that interval: its total time (s) and bytes moved (GiB).",
    "ratio": "`cadence`: moe-place's total time over the default's at the same interval (< 1: moe-place is "
             "faster).",
    "hindsight": "A reference no policy reaches, planned on the load it is judged on: in `cadence`, plans made "
                 "on the next interval's load and moved for free; in `offload`, the set planned on the judged step.",
    "best": "`cadence`: each policy at its best interval, and moe-place's gain with the cadence's taken out.",
    "advice": "`cadence`: the policy and interval to run, with the engine's settings for it.",
    # ------------------------------------------------------------------ offload
    "judged": "`offload`: the held-out step (fold) the sets are judged on.",
    "set": "`offload`: the experts kept on the GPU: moe-place's plan, sglang-kt's rules (`uniform`, "
           "`frequency`, `front-loading`, `random`), llama.cpp's whole layers, or the hindsight plan.",
    "decode`n`": "`offload`: predicted time of a decode step of `n` tokens through every MoE layer, the mean "
                 "over the drawn batches.",
    "prefill": "`offload`: predicted time of the step's prefill batch.",
    "weighted": "`offload`: the step times added, the prefill's weighted by `--prefill-weight` (default 1).",
    "vs uniform": "`offload`: weighted time against sglang-kt's default `uniform` set's.",
    # ------------------------------------------------------------------ predict and payback
    "scenario": "A scenario file of `predict` and `payback` (hardware, topology, model, workload); its name.",
    "topology": "The GPUs, nodes and links a scenario prices on.",
    "padding": "Rows after a grouped GEMM rounds each expert's rows up to `BLOCK_M` (formula 4).",
    "stages": "The phases of the layer and their times: dispatch, compute, combine.",
    "barrier_total": "The stages' times added: the layer with a barrier between phases.",
    "binds": "The stage that takes longest.",
    "pipeline": "The layer in `q` micro-batches whose stages overlap (formula 6): serial against pipelined "
                "time, and how much slower a stage may get before pipelining stops paying.",
    "payback": "Whether copying replicas pays (formula 7): the saving per batch, each case's copy time, the "
               "batches until it pays (`n_min`) and the net gain after some batches.",
    "offload": "Experts in host memory: running one on the CPU against copying it to the GPU (formula 8), "
               "per CPU kernel, and the rows from which the GPU is faster.",
    "capacity": "`predict`'s expert memory: the bytes of one more replica per layer over some layers, of `n` "
                "resident experts per layer, whether they fit the GPU memory, and the most that do.",
}

# Other spellings under which the code or a command's output shows a term: spelling -> term.
ALIASES: dict[str, str] = {
    "slot": "physical expert", "P": "physical expert", "R": "redundant experts", "rank": "GPU",
    "EP": "EP size", "s_expert": "busiest/mean GPU", "balanced": "balancedness",
    "mean balancedness": "balancedness", "contig": "contiguous placement", "held out": "in sample",
    "steps": "step", "token home": "home GPU", "max_gpu_load": "busiest GPU load", "mean_gpu_load": "mean GPU load",
    "lower_bound": "lower bound", "even: slots": "budget mode", "nodes/token": "distinct nodes per token",
    "split": "split policy", "policy CPU time": "policy time",
}


def explain(statuses) -> str:
    """One line defining the status words among `statuses` (in `STATUS_MEANINGS` order), e.g. for a table's legend."""
    shown = set(statuses)
    return "; ".join(f"{word} = {meaning}" for word, meaning in STATUS_MEANINGS if word in shown)
