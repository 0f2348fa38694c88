"""moe_place.engines"""

# the package's modules
__all__ = ["batch_split", "config", "export", "guard", "launch", "llama_cpp", "session", "sglang", "sglang_kt",
           "sglang_managers", "sglang_split", "sglang_startup", "tensors", "trtllm", "vllm", "vllm_policy",
           "vllm_split"]
