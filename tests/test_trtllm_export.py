"""`moe-place export PLAN --engine trtllm`: the load-balancer YAML loads as TensorRT-LLM loads it.

TensorRT-LLM does not install here (its PyPI package downloads the real wheel from elsewhere), so
`MoeLoadBalancerConfig` is stood in for from its fields and checks as read in its sources (NVIDIA/TensorRT-LLM,
read with the search tools):
- the fields and `setup`/`num_local_slots`/`get_layer_initial_global_assignments`:
  `tensorrt_llm/_torch/model_config.py` (1a0dc5f), with the LLM API's stricter version of the class in
  `tensorrt_llm/llmapi/llm_args.py` (a pydantic model that forbids unknown keys; `setup` raises when
  `num_slots` is missing or not divisible by `ep_size`; a missing layer is a KeyError, a list of another
  length a ValueError);
- how the file is read: `TorchLlmArgs.validate_load_balancer` (llm_args.py) opens the path given as
  `moe_config.load_balancer`, `yaml.safe_load`s it and builds `MoeLoadBalancerConfig(**config)`;
- what each MoE layer asserts on its list: `fused_moe_wide_ep.py` (99bca89): a list, `len == num_slots`,
  `num_slots >= num_experts`, and `set(list) == set(range(num_experts))`; rank `r` runs the experts of slots
  `r * num_local_slots` to `(r + 1) * num_local_slots - 1`.
The validators below are written from that reading, not copied.
"""

import json
from typing import Dict, List, Optional

import numpy as np
import pytest
import yaml
from pydantic import BaseModel, ConfigDict, PrivateAttr

from moe_place.cli.main import main
from moe_place.engines.trtllm import check_load_balancer, load_balancer_config, load_balancer_yaml, model_layer_keys
from moe_place.errors import InputError
from moe_place.placement import Placement
from moe_place.planfile import PlanFile, write_plan


class MoeLoadBalancerConfig(BaseModel):
    """Stand-in for TensorRT-LLM's class: its three fields, unknown keys refused, its runtime checks."""

    model_config = ConfigDict(extra="forbid")
    num_slots: Optional[int] = None
    initial_global_assignments: Optional[Dict[int, List[int]]] = None
    layer_updates_per_iter: int = 0
    _ep_rank: Optional[int] = PrivateAttr(default=None)
    _ep_size: Optional[int] = PrivateAttr(default=None)

    def setup(self, ep_rank: int, ep_size: int) -> None:
        self._ep_rank, self._ep_size = ep_rank, ep_size
        if self.num_slots is None:
            raise ValueError("num_slots cannot be None when calling setup()")
        if self.num_slots % ep_size != 0:
            raise ValueError(f"num_slots ({self.num_slots}) must be divisible by ep_size ({ep_size})")

    @property
    def num_local_slots(self) -> int:
        return self.num_slots // self._ep_size

    @property
    def slot_start(self) -> int:
        return self._ep_rank * self.num_local_slots

    def get_layer_initial_global_assignments(self, layer_idx: int) -> Optional[List[int]]:
        if self.initial_global_assignments is None:
            return None
        if layer_idx not in self.initial_global_assignments:
            raise KeyError(f"layer_idx {layer_idx} not found in initial_global_assignments")
        assignments = self.initial_global_assignments[layer_idx]
        if len(assignments) != self.num_slots:
            raise ValueError(f"assignment length {len(assignments)} for layer {layer_idx} != num_slots")
        return assignments


def load_like_trtllm(path) -> MoeLoadBalancerConfig:
    """What `TorchLlmArgs.validate_load_balancer` does with `moe_config.load_balancer: PATH`."""
    with open(path) as fh:
        return MoeLoadBalancerConfig(**yaml.safe_load(fh))


def moe_layer_init(config: MoeLoadBalancerConfig, layer_idx: int, num_experts: int) -> List[int]:
    """The MoE layer's checks of its list (fused_moe_wide_ep.py); returns the list."""
    loaded = config.get_layer_initial_global_assignments(layer_idx)
    assert isinstance(loaded, list)
    assert len(loaded) == config.num_slots
    assert config.num_slots >= num_experts
    assert set(loaded) == set(range(num_experts))
    return loaded


def serve(path, ep_size: int, moe_layers, num_experts: int) -> dict:
    """Every rank sets the config up and every MoE layer loads its list: {(rank, layer): its experts}."""
    config = load_like_trtllm(path)
    local = {}
    for rank in range(ep_size):
        config.setup(ep_rank=rank, ep_size=ep_size)
        for layer in moe_layers:
            row = moe_layer_init(config, layer, num_experts)
            local[rank, layer] = row[config.slot_start:config.slot_start + config.num_local_slots]
    return local


# ---------------------------------------------------------------------- the export loads
PHY2LOG = np.array([[0, 1, 2, 3, 0, 2], [3, 2, 1, 0, 1, 3], [0, 3, 1, 2, 0, 3]])


@pytest.fixture
def plan_path(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(path, PlanFile(Placement(PHY2LOG, 4, 2), layer_ids=(3, 4, 5)))
    return path


def test_the_export_loads_on_every_rank_and_layer_with_the_plans_slots(tmp_path, plan_path, capsys):
    out = tmp_path / "moe_load_balancer.yaml"
    assert main(["export", str(plan_path), "--engine", "trtllm", "--out", str(out), "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["layer_keys"] == "3-5" and summary["num_local_slots"] == 3
    assert f"moe_config: {{load_balancer: {out}}}" in summary["launch"] and "--ep_size 2" in summary["launch"]
    local = serve(out, ep_size=2, moe_layers=(3, 4, 5), num_experts=4)
    for pos, layer in enumerate((3, 4, 5)):
        for rank in range(2):  # GPU r of the plan holds slots r*3 .. r*3+2: the same experts, same order
            assert local[rank, layer] == PHY2LOG[pos, rank * 3:(rank + 1) * 3].tolist()
    config = load_like_trtllm(out)
    assert config.layer_updates_per_iter == 0  # a static map
    assert out.read_text().startswith("# moe-place plan for TensorRT-LLM")


def test_a_plan_on_moe_layers_only_is_keyed_by_model_layer_with_dense_layers(tmp_path, capsys):
    plan = tmp_path / "positions.json"  # ids 0-2: a trace that kept MoE layers only (vLLM window, synth)
    write_plan(plan, PlanFile(Placement(PHY2LOG, 4, 2), layer_ids=(0, 1, 2)))
    out = tmp_path / "lb.yaml"
    assert main(["export", str(plan), "--engine", "trtllm", "--out", str(out), "--dense-layers", "0-2"]) == 0
    assert "i-th model layer that is not dense" in capsys.readouterr().err
    local = serve(out, ep_size=2, moe_layers=(3, 4, 5), num_experts=4)  # DeepSeek-V3-like: 0-2 dense
    assert local[1, 5] == PHY2LOG[2, 3:].tolist()
    assert main(["export", str(plan), "--engine", "trtllm", "--out", str(tmp_path / "as_is.yaml")]) == 0
    assert "pass --dense-layers (DeepSeek-V3: 0-2)" in capsys.readouterr().err  # ids used as they are: said
    with pytest.raises(KeyError):  # and what TensorRT-LLM would do with them on DeepSeek-V3's layer 5
        serve(tmp_path / "as_is.yaml", ep_size=2, moe_layers=(3, 4, 5), num_experts=4)


def test_model_layer_keys():
    assert model_layer_keys((0, 1, 2)) == (0, 1, 2)
    assert model_layer_keys((0, 1, 2), (0, 1, 2)) == (3, 4, 5)
    assert model_layer_keys((0, 1, 2, 3), (1,)) == (0, 2, 3, 4)
    assert model_layer_keys((3, 4, 5), (0, 1, 2)) == (3, 4, 5)  # model ids already: kept


def test_yaml_is_generate_eplb_configs_form(plan_path):
    config = load_balancer_config(Placement(PHY2LOG, 4, 2), (3, 4, 5))
    text = load_balancer_yaml(config)
    assert "  3: [0, 1, 2, 3, 0, 2]\n" in text  # one flow list per layer
    assert yaml.safe_load(text) == config


def test_options_that_do_not_apply_to_trtllm_are_refused(tmp_path, plan_path, capsys):
    assert main(["export", str(plan_path), "--engine", "trtllm", "--out", str(tmp_path / "x.yaml"),
                 "--num-model-layers", "8"]) == 2
    assert "--num-model-layers: expected only with --engine sglang" in capsys.readouterr().err
    assert main(["export", str(plan_path), "--engine", "vllm", "--out", str(tmp_path / "x.json"),
                 "--dense-layers", "0-2"]) == 2
    assert "--dense-layers: expected only with --engine sglang or trtllm" in capsys.readouterr().err
    assert main(["export", str(plan_path), "--engine", "trtllm", "--out", str(tmp_path / "x.json")]) == 2
    assert ".yaml or .yml for trtllm" in capsys.readouterr().err


# ---------------------------------------------------------------------- the checks agree with TensorRT-LLM's
def _good() -> dict:
    return {"num_slots": 6, "initial_global_assignments": {3: [0, 1, 2, 3, 0, 2], 4: [3, 2, 1, 0, 1, 3]},
            "layer_updates_per_iter": 0}


BROKEN = {  # case: (change, the field our one line names)
    "slots not divisible by EP": (lambda c: c.update(num_slots=5, initial_global_assignments={
        3: [0, 1, 2, 3, 0], 4: [3, 2, 1, 0, 1]}), "num_slots"),
    "fewer slots than experts": (lambda c: c.update(num_slots=2, initial_global_assignments={
        3: [0, 1], 4: [3, 2]}), "num_slots"),
    "a layer without its list": (lambda c: c["initial_global_assignments"].pop(4), "initial_global_assignments[4]"),
    "a list of another length": (lambda c: c["initial_global_assignments"][3].append(1), "initial_global_assignments[3]"),
    "an expert with no slot": (lambda c: c["initial_global_assignments"].update({3: [0, 1, 2, 2, 0, 2]}),
                               "initial_global_assignments[3]"),
    "an expert id out of range": (lambda c: c["initial_global_assignments"].update({3: [0, 1, 2, 3, 4, 2]}),
                                  "initial_global_assignments[3]"),
    "an unknown key": (lambda c: c.update(ep_size=2), "ep_size"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_every_config_trtllm_refuses_we_refuse_naming_the_field(tmp_path, case):
    good = tmp_path / "good.yaml"
    good.write_text(load_balancer_yaml(_good()))
    serve(good, ep_size=2, moe_layers=(3, 4), num_experts=4)
    check_load_balancer(_good(), 4, 2, (3, 4))
    config = _good()
    change, field = BROKEN[case]
    change(config)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    with pytest.raises((ValueError, KeyError, AssertionError)):  # pydantic's ValidationError is a ValueError
        serve(bad, ep_size=2, moe_layers=(3, 4), num_experts=4)
    with pytest.raises(InputError) as exc:
        check_load_balancer(config, 4, 2, (3, 4))
    assert exc.value.where == field and "\n" not in str(exc.value)
