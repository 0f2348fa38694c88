"""moe_place.online"""

# the package's modules
__all__ = ["cadence", "controller", "engine_default", "estimate", "offload", "plot", "policy", "policy_cpu", "replay",
           "splitting", "switch", "window"]
