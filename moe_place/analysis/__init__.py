"""moe_place.analysis: what a routing trace says about expert skew and what it does to GPUs.

Pure functions on numpy arrays; results are frozen dataclasses. One concept per module:
    profile            per-layer expert loads: max/mean, CV, idle experts, top-N share
    balance            a placement's rows per GPU, busiest/mean GPU, vLLM/SGLang balancedness
    ep_sweep           the same loads at EP sizes 8, 16, 32, ... (contiguous placement by default)
    windows            steps summed into windows
    persistence        how long hot experts stay hot from window to window
    replicate_hottest  a baseline plan: contiguous blocks + extra slots for the hottest experts
    out_of_sample      a plan made on one window judged on the next
    active             distinct experts per batch against E[U] = E*(1-(1-K/E)^M)
    coactivation       experts picked together by the same tokens
    dispatch           the dispatch matrix a[i][j] from where tokens live to where experts live
    report             everything above for one trace, and the JSON of `moe-place analyze`
    plot               the PNG of `moe-place analyze --plot`
"""

# the package's modules
__all__ = ["active", "balance", "coactivation", "dispatch", "ep_sweep", "imbalance", "out_of_sample", "persistence",
           "plot", "profile", "replicate_hottest", "report", "windows"]
