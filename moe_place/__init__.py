"""moe-place: place Mixture-of-Experts replicas so the busiest GPU waits less.

Layers (each imports only the ones before it):
    errors, glossary -> traces -> placement -> analysis -> cost -> problem -> solvers
    -> kernels, engines, online -> cli
See `moe_place.glossary` for the vocabulary.
"""

__version__ = "0.1.0"
