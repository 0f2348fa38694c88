"""Names the dead-code check (vulture, configured in pyproject.toml) must not report: each is used
by something vulture cannot see. Keep the reason beside every name."""

# bench/microbench.py: sections are found by name (getattr(module, "section_" + name))
section_padding
section_gemm
section_skew
section_payback
section_dispatch
section_split

# moe_place/cost/hardware.py: a field of the GPU part tables (parsed and validated, shown in `--help` parts)
fp8_flops_per_s

# engine interfaces: parameters the engines pass by name, which our implementations do not need
algorithm  # SGLang's eplb algorithm argument (moe_place/engines/sglang.py)
layer_idx  # vLLM's on_layer_committed(policy_state, plan, layer_idx) (moe_place/engines/vllm.py, tests)
cpu_group  # vLLM's process-group argument (tests/test_engines_vllm.py)

# OR-Tools parameters and variable attributes: set on objects OR-Tools reads (solvers/cpsat.py, comm.py, bounds.py)
_.is_integer
_.random_seed
_.max_deterministic_time
_.max_time_in_seconds
_.interleave_search
_.search_branching
_.log_search_progress

# solver classes registered by the `register` decorator (solvers/cpsat.py, solvers/deepseek.py, solvers/trtllm.py)
CpSatSolver
EplbSolver
TrtllmSolver

# a field of the per-layer figures, written to the plan and evaluate JSON by to_dict() (solvers/evaluate.py)
mean_gpu_load

# pytest: hooks, autouse fixtures and markers are found by name
pytest_collection_modifyitems
pytestmark
_no_thread_env
_no_env
no_vllm
_.__getattr__  # a module-level __getattr__ on a stand-in vllm module (tests/test_engines_vllm.py)

# bench/inengine/harness.py: what vLLM's EplbState and SGLang's EPLBManager read or call on the harness's
# stand-in objects (the MoE model, its layers, the group coordinator, the communicator, the recorder, the
# device module, the weight updater); vulture cannot see the engines' code
device_group
world_size
set_stream
get_expert_weights
set_eplb_state
compute_hash
num_expert_groups
num_routed_experts
num_redundant_experts
num_shared_experts
start_record
dump_record
empty_cache
update_weights_from_disk

# moe_place/online/cadence.py: CadenceRun fields written to the record (to_json via __dict__), read by bench_replay.py
# and bench_split.py
slots_after_first
split_layer_steps
# bench/inengine/standins.py: SGLang 0.5.23's names, which its code looks up by name (EplbAlgorithm[name]) or
# passes by keyword (EPLBManager(...)), kept as SGLang has them
deepseek_vec
deepseek_vec_hierarchical
get_expert_backup_client
get_expert_location_updater
get_weight_updater
