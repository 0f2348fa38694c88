"""The `time` objective: plans for the predicted MoE layer time (dispatch + compute + combine).

At multi-node EP the dispatch/combine of DeepEP-style kernels sends a token over RDMA once per
remote node holding one of its experts (`moe_place.cost.comm`), so experts that tokens pick
together belong on one node. Out of sample the two terms behave differently (docs/MODEL.md,
"Multi-node EP: the layer-time plan out of sample"): which experts fire together carries over
to other batches, which experts are hot does not. So co-activation decides the nodes, the
balance-only plan bounds the compute (the hedge), and held-out windows judge which layers to group.

Per layer (tokens of the training steps, homes as `CommModel.token_home` says):
1. Node split, equal numbers of experts per node (`E/N`, the first `E % N` nodes one more).
   Default (`communities`, `community_nodes`): the co-activation graph of the training tokens
   (networkx) is split into Louvain communities, which fill the nodes heaviest first, each
   expert to the node holding most of its community among those with room. The other start,
   `balanced` (`balanced_nodes`), ignores co-activation: heaviest expert first to the lightest
   node.
2. Node cap (`NodeSearch.within_cap`): on every training step no node may carry more rows than
   the balance-only plan's busiest node carries on that step (`balance_caps`, replicas splitting
   evenly; or `FLOOR_HEADROOM` of the rows at which its GPUs would leave the weight-read floor,
   if that is more): swaps of two experts between nodes, the one that lowers the rows over the
   cap most first (ties: the best first-order NIC change). Experts that fire together are hot
   together, so a node of one community can take a batch's new hot experts all at once: the cap
   keeps the grouped plan's nodes as loaded as the balance-only plan's, not more.
   Then, if `strength` > 0, grouping (`NodeSearch.search`): swaps of two experts between nodes,
   best first, each lowering a surrogate of the layer time on the training tokens without
   raising the rows over the cap: per step, the busiest NIC's RDMA rows (sent, or received: the
   DeepEP rule of `moe_place.cost.comm`) over the NIC bandwidth, for dispatch and combine, plus
   the compute time of a GPU holding the busiest node's rows spread over its GPUs, plus
   `MEAN_WEIGHT` x the mean NIC's term. Candidates are ranked by the first-order change of that
   surrogate (`NodeSearch.move_gains`: each visit of a token to a remote node priced by a
   softmax over the NICs' loads) and the first that lowers the exact surrogate is taken. The
   *strength* is the number of swaps taken. The time plan uses `GROUP_STRENGTH` = 0: the
   surrogate's busiest NIC and compute are those of the training batches, which is what does
   not carry over (bench/bench_comm.py: `grouped`, the largest strength, against `ungated`).
3. Replica nodes (`replica_nodes`, OR-Tools CP-SAT). Spare slots (`P/N` minus the node's
   experts) take replicas. With a dispatcher that prefers a replica on the token's own node
   (`sglang-static`, `node-aware`) a replica of `e` on node `n` serves the tokens homed on `n`,
   so CP-SAT chooses, for every node, which other nodes' experts get a replica there: the
   traffic it saves (tokens for which `e` was the only reason to visit `e`'s node, priced like
   step 2) against the compute of the busiest node (`max(floor, rows * F/C)`), with at most the
   node's spare slots. Deterministic time, one worker, fixed seed, the node-closed plan as hint.
   With `vllm` or `sglang-dynamic` (replica chosen without regard to the token's node) a remote
   replica only adds traffic: replicas stay on their expert's node.
4. GPUs inside each node: `quick_plan` (replica counts and GPUs, vectorised over the nodes and
   strengths) on the rows each expert serves on that node, then `spread_within_nodes`: swaps of
   slots between the GPUs of a node, first while they lower the rows over the GPU cap (the
   balance-only plan's busiest GPU per training step, or `FLOOR_HEADROOM` of the floor), then
   while they lower the co-activation affinity (`LayerTokens.affinity`, cosine of the experts'
   token sets) of the experts sharing a GPU without going over it: the experts a new batch makes
   hot together land on different GPUs of their node.
5. The decision, over the layers (`expected_savings`, the default): the training steps form
   `W <= MAX_WINDOWS` windows of consecutive steps (one step: its two halves); for each window and
   layer, steps 1-4 on the other windows (greedy replicas), judged by `layer_cost` on the held-out
   window beside the balance-only plan of the same steps (`quick_plan`, `fast`'s anytime start).
   Each window measures two savings of the layer, as shares of the balance-only plan's layer time
   there: its dispatch + combine (`traffic_savings`) and its compute (`compute_savings`, the
   compute risk: a plan whose GPUs hold other experts than the balance-only plan's may lose there).
   A layer's own windows measure its expected saving with noise: a new batch's hot experts land
   where they land (on the bundled Qwen3 trace the windows' compute difference does not predict
   the held-out one, docs/MODEL.md). So each part is estimated from all the layers together: the
   layer's mean over its windows is shrunk toward the mean over the layers by the positive-part
   James-Stein factor (`shrunk_means`), `1 - (L - 3) * noise / spread`, where `noise` is the
   variance of a layer's window mean (the spread of each layer's windows around their mean, pooled
   over the layers) and `spread` the squared deviations of the layers' means from their mean: a
   part whose layers differ no more than their windows' noise is the same for every layer (its mean
   over the layers); one whose layers differ far more keeps each layer's own mean. Nothing in it is
   chosen: the data set both the mean and the factor. A layer is grouped where its expected saving
   (traffic plus compute) is positive; then steps 1-4 on all training steps. Otherwise it keeps the
   balance-only plan (`fast` on all the training loads). That minimises the expected whole-model
   layer time held out, for plans with these two rows per layer to choose from. With fewer than
   four layers each layer's own means decide (the factor needs four).
   The per-layer guard (`decision="guard"`, `guard`): a layer is grouped only if its dispatch +
   combine save more than `min_saving` of the balance-only plan's layer time on every window; it
   keeps each part of the model close to the balance-only plan and gives up most of the
   whole-model gain (docs/multinode.md). Each layer's rows depend on its own tokens only; under the
   default decision, whether a layer is grouped depends on the other planned layers' windows too.

Lower bound (`layer_lower_bound_s`, reported per layer on the training tokens): busiest-GPU
compute is at least the mean GPU's rows (`F/C`) and at least `ceil(experts used / G)` expert
weight reads (`W/B`) per step; with one slot per expert (`P = E`) and DeepEP dispatch, some
node holds each expert, so the NIC of local rank `r` on that node receives at least the tokens
of rank `r` on other nodes that use it: per step, the largest over experts of the smallest over
nodes of that count is a bound on the busiest NIC's rows, for dispatch and for combine.

Determinism: no randomness and no wall-clock decisions; a time limit is a safety stop only
(`notes` say when it cut the plan: the layers not reached keep the balance-only plan).
"""

from __future__ import annotations

from moe_place.solvers.comm.tokens import LayerTokens
from moe_place.solvers.comm.node_split import COMMUNITY_NEIGHBOURS, balanced_nodes, community_nodes
from moe_place.solvers.comm.grouping import (GROUP_STRENGTH, MEAN_WEIGHT, NodeSearch, PRICE_TEMPERATURE,
                                             SEARCH_CANDIDATES, STRENGTHS, SWAPS_PER_ROUND)
from moe_place.solvers.comm.replicas import (HOME_FIRST, REPLICA_CANDIDATES, REPLICA_DET_S, ReplicaNodes, local_demand,
                                             replica_nodes, served_per_step)
from moe_place.solvers.comm.gpus import (FLOOR_HEADROOM, SPREAD_SWAPS, assemble, balance_caps, node_closed_feasible,
                                         spread_within_nodes)
from moe_place.solvers.comm.bounds import layer_lower_bound_s
from moe_place.solvers.comm.decision import (DECISIONS, HeldOut, JUDGES, MAX_WINDOWS, MIN_SAVING, Pooled, comm_gains,
                                             compute_savings, cv_windows, expected_savings, guard, layer_gains,
                                             shrunk_means, traffic_savings)
from moe_place.solvers.comm.planner import TimeLayer, TimePlan, plan_layer, plan_time

__all__ = ["COMMUNITY_NEIGHBOURS", "DECISIONS", "FLOOR_HEADROOM", "GROUP_STRENGTH", "HOME_FIRST", "HeldOut", "JUDGES", "LayerTokens", "MAX_WINDOWS", "MEAN_WEIGHT", "MIN_SAVING", "NodeSearch", "PRICE_TEMPERATURE", "Pooled", "REPLICA_CANDIDATES", "REPLICA_DET_S", "ReplicaNodes", "SEARCH_CANDIDATES", "SPREAD_SWAPS", "STRENGTHS", "SWAPS_PER_ROUND", "TimeLayer", "TimePlan", "assemble", "balance_caps", "balanced_nodes", "comm_gains", "community_nodes", "compute_savings", "cv_windows", "expected_savings", "guard", "layer_gains", "layer_lower_bound_s", "local_demand", "node_closed_feasible", "plan_layer", "plan_time", "replica_nodes", "served_per_step", "shrunk_means", "spread_within_nodes", "traffic_savings"]
