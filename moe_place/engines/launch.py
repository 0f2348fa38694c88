"""The lines that run moe-place's rule in an engine at a given cadence, as `moe-place cadence` prints them,
and the command that serves an exported plan, as `moe-place export` prints it (`export_launch`).

vLLM takes its cadence in `--eplb-config` (`step_interval`, `window_size`) and loads the policy through
its plugin (`MOE_PLACE_VLLM_POLICY=default`, `moe_place.engines.vllm.register_plugin`); SGLang takes
`--eplb-rebalance-num-iterations` and the recorder's buffer, and loads the hook with `MOE_PLACE_SGLANG=1`
(`moe_place.engines.sglang_startup`). The rule's settings travel as the variables the adapters read
(`moe_place.engines.config.ENV_VARIABLES`), only where they differ from the rule's defaults.

An exported plan is served by (`export_launch`; MODEL stands for the model's name or path, EP size = the
plan's GPUs):
- vLLM: the plugin's variable (`MOE_PLACE_VLLM_POLICY=default`) and the plan file
  (`MOE_PLACE_STATIC_PLAN`), EPLB on (`--enable-expert-parallel --enable-eplb`: the policy is only called
  by vLLM's EPLB) with the plan's redundant experts; vLLM moves to the plan at its first rebalance.
- SGLang: `--ep-size`, `--ep-num-redundant-experts` and `--init-expert-location FILE` (docs/sglang.md).
- TensorRT-LLM: the options file its wide-EP README uses, `enable_attention_dp: true` and
  `moe_config: {backend: WideEP, load_balancer: FILE}` (the load balancer runs only in the WideEP backend
  with attention data parallelism), named by `--extra_llm_api_options`, with `--tp_size` = `--ep_size`.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import fields
from pathlib import Path

from moe_place.engines import sglang_startup
from moe_place.engines.batch_split import SPLIT_ENV
from moe_place.engines.config import ENV_VARIABLES
from moe_place.engines.vllm import PLUGIN_ENV
from moe_place.engines.vllm_policy import STATIC_PLAN_ENV
from moe_place.errors import InputError
from moe_place.online.policy import RebalanceRule

__all__ = ["engine_settings", "export_launch", "rule_env"]

RULE_KEYS = ("min_gain", "noise_margin", "estimate", "max_moved_slots")   # the adapters' keys named as the rule's


def rule_env(rule: dict) -> list[str]:
    """The adapters' variables (`moe_place.engines.config`, the names it reads) for the rule settings `rule`
    (keyword arguments of `RebalanceRule`) that differ from its defaults; `max_bytes` as `max_mib`,
    `num_groups` left out (the engine passes its own)."""
    defaults = {f.name: f.default for f in fields(RebalanceRule)}
    env = [f"{ENV_VARIABLES[key]}={rule[key]}" for key in RULE_KEYS if rule.get(key, defaults[key]) != defaults[key]]
    if rule.get("max_bytes") is not None:
        env.append(f"{ENV_VARIABLES['max_mib']}={rule['max_bytes'] / 2**20:g}")
    return env


def engine_settings(engine: str, step_interval: int, window: int, redundant: int, use_async: bool = True,
                    model: str | None = None, rule: dict | None = None, split: bool = False,
                    ours: bool = True) -> list[str]:
    """The lines that give a cadence in the engine (shell-quoted): with moe-place's rule running it (`ours`), its
    settings `rule` (keyword arguments of `RebalanceRule`) as the adapters read them (`rule_env`) and the
    per-batch split where `split` (`MOE_PLACE_SPLIT=per-batch`, and in SGLang the `lp` dispatch it runs in);
    or, not `ours`, the engine's own default policy at that cadence, nothing of moe-place's set."""
    if engine not in ("vllm", "sglang"):
        raise InputError("--engine", "vllm or sglang", engine)
    env = [f"{ENV_VARIABLES['step_interval']}={step_interval}", f"{ENV_VARIABLES['window_steps']}={window}"]
    if model:
        env.append(f"{ENV_VARIABLES['model']}={shlex.quote(model)}")
    env += rule_env(rule or {}) + ([f"{SPLIT_ENV}=per-batch"] if split else [])
    migration = ENV_VARIABLES["migration"]
    if engine == "vllm":
        config = (f'{{"step_interval": {step_interval}, "window_size": {window}, '
                  f'"num_redundant_experts": {redundant}, "use_async": {"true" if use_async else "false"}}}')
        serve = f"vllm serve MODEL --enable-expert-parallel --enable-eplb --eplb-config {shlex.quote(config)}"
        if not ours:
            return [serve]
        return [f"{PLUGIN_ENV}=default {' '.join(env)} {migration}={'async' if use_async else 'stall'} \\",
                f"  {serve}"]
    serve = (f"python -m sglang.launch_server --model-path MODEL --enable-eplb --ep-num-redundant-experts {redundant} "
             f"--eplb-rebalance-num-iterations {step_interval} --expert-distribution-recorder-buffer-size {window}"
             + (" --ep-dispatch-algorithm lp" if ours and split else ""))
    if not ours:
        return [serve]
    return [f"{sglang_startup.ENV}=1 {' '.join(env)} {migration}=stall \\", f"  {serve}"]


TRTLLM_OPTIONS_FILE = "extra_llm_api_options.yaml"   # the name TensorRT-LLM's wide-EP README gives it


def export_launch(engine: str, out: str | Path, num_gpus: int, redundant: int) -> str:
    """The whole command that serves the plan exported to `out` for `engine` at EP size `num_gpus` with
    `redundant` slots beyond one per expert (module docstring), one shell line."""
    path = shlex.quote(str(out))
    if engine == "vllm":
        config = json.dumps({"num_redundant_experts": redundant})
        return (f"{PLUGIN_ENV}=default {STATIC_PLAN_ENV}={path} vllm serve MODEL --tensor-parallel-size {num_gpus} "
                f"--enable-expert-parallel --enable-eplb --eplb-config {shlex.quote(config)}")
    if engine == "sglang":
        return (f"python -m sglang.launch_server --model-path MODEL --tp {num_gpus} --ep-size {num_gpus} "
                f"--ep-num-redundant-experts {redundant} --init-expert-location {path}")
    if engine == "trtllm":
        options = (f"{{enable_attention_dp: true, moe_config: {{backend: WideEP, load_balancer: "
                   f"{json.dumps(str(out))}}}}}")
        return (f"echo {shlex.quote(options)} > {TRTLLM_OPTIONS_FILE} && trtllm-serve MODEL --tp_size {num_gpus} "
                f"--ep_size {num_gpus} --extra_llm_api_options {TRTLLM_OPTIONS_FILE}")
    if engine == "eplb":
        loader = "numpy.load" if Path(out).suffix == ".npz" else "torch.load"
        return f"no server: {loader}({str(out)!r}) holds phy2log, log2phy, logcnt for code that calls DeepSeek EPLB"
    raise InputError("--engine", "vllm, sglang, trtllm or eplb", engine)
