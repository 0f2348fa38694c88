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
  `r * num_local_slots` to `(r + 1) * num_local_slots - 1`; with no map given, its own map
  (`fused_moe_wide_ep.py` 01303b3, `interface.py` 567239f: rank `r`, local slot `i` holds expert
  `(r * num_experts // ep_size + i) % num_experts`);
- which layers look a list up (`server_moe_layers`): DeepSeek-V3's decoder layer builds its MoE for
  `layer_idx >= first_k_dense_replace and layer_idx % moe_layer_freq == 0` (`modeling_deepseekv3.py` 000561d),
  its MTP layers are such decoder layers numbered from `num_hidden_layers`, `min(max_draft_len,
  num_nextn_predict_layers)` of them (`modeling_speculative.py` 00679c6); Qwen3-MoE builds a MoE in every
  decoder layer (`modeling_qwen3_moe.py` 03441af). The models' numbers are their Hugging Face `config.json`s'.
The validators below are written from that reading, not copied; the layers a server builds come from the
config numbers here, not from moe-place's presets.
"""

import json
import shlex
from typing import Dict, List, Optional

import numpy as np
import pytest
import yaml
from pydantic import BaseModel, ConfigDict, PrivateAttr

from moe_place.cli.main import main
from moe_place.cost.model_layers import moe_layer_ids
from moe_place.cost.models import get_model
from moe_place.engines.trtllm import (check_load_balancer, default_assignments, load_balancer_config, load_balancer_yaml,
                                      model_layer_keys)
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


def wide_ep_default_map(num_experts: int, num_slots: int, ep_size: int) -> List[int]:
    """What a WideEP MoE layer runs with no map given (see the module docstring)."""
    local = num_slots // ep_size
    return [(rank * num_experts // ep_size + slot) % num_experts for rank in range(ep_size) for slot in range(local)]


def server_moe_layers(num_hidden_layers: int, first_k_dense_replace: int = 0, moe_layer_freq: int = 1,
                      num_nextn_predict_layers: int = 0, max_draft_len: int = 0) -> List[int]:
    """The `layer_idx` of every MoE layer a server builds for a model config (see the module docstring)."""
    decoder = [i for i in range(num_hidden_layers) if i >= first_k_dense_replace and i % moe_layer_freq == 0]
    mtp = min(max_draft_len, num_nextn_predict_layers)
    return decoder + [num_hidden_layers + j for j in range(mtp)]


# DeepSeek-V3 / R1's config.json, served with MTP (max_draft_len 1 or more), and the two Qwen3-MoE models
DEEPSEEK_V3_MTP = server_moe_layers(61, first_k_dense_replace=3, moe_layer_freq=1, num_nextn_predict_layers=1,
                                    max_draft_len=3)
DEEPSEEK_V3 = server_moe_layers(61, first_k_dense_replace=3, moe_layer_freq=1, num_nextn_predict_layers=1)
QWEN3_30B = server_moe_layers(48)
QWEN3_235B = server_moe_layers(94)


def options_file(launch: str) -> dict:
    """The options file the launch hint writes (`echo '...' > FILE && trtllm-serve ...`), as TensorRT-LLM reads it."""
    words = shlex.split(launch)
    assert words[0] == "echo" and words[2] == ">" and words[4] == "&&" and words[5] == "trtllm-serve"
    assert words[words.index("--extra_llm_api_options") + 1] == words[3]
    return yaml.safe_load(words[1])


# ---------------------------------------------------------------------- the export loads
PHY2LOG = np.array([[0, 1, 2, 3, 0, 2], [3, 2, 1, 0, 1, 3], [0, 3, 1, 2, 0, 3]])


@pytest.fixture
def plan_path(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(path, PlanFile(Placement(PHY2LOG, 4, 2), layer_ids=(3, 4, 5)))
    return path


def test_the_export_loads_on_every_rank_and_layer_with_the_plans_slots(tmp_path, plan_path, capsys):
    out = tmp_path / "moe_load_balancer.yaml"
    assert main(["export", str(plan_path), "--engine", "trtllm", "--out", str(out), "--format", "json",
                 "--moe-layers", "3-5"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["layer_keys"] == "3-5" and summary["num_local_slots"] == 3
    words = shlex.split(summary["launch"])  # the whole command: options file, EP size, attention DP, WideEP
    assert words[words.index("--ep_size") + 1] == "2" and words[words.index("--tp_size") + 1] == "2"
    assert options_file(summary["launch"]) == {"enable_attention_dp": True,
                                               "moe_config": {"backend": "WideEP", "load_balancer": str(out)}}
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
    assert main(["export", str(plan), "--engine", "trtllm", "--out", str(out), "--dense-layers", "0-2",
                 "--moe-layers", "3-5"]) == 0
    assert "i-th model layer that is not dense" in capsys.readouterr().err
    local = serve(out, ep_size=2, moe_layers=(3, 4, 5), num_experts=4)  # DeepSeek-V3-like: 0-2 dense
    assert local[1, 5] == PHY2LOG[2, 3:].tolist()
    # the served MoE layers alone say it: the layers below the first one are dense, the rows are positions
    assert main(["export", str(plan), "--engine", "trtllm", "--out", str(tmp_path / "as_is.yaml"),
                 "--moe-layers", "3-5"]) == 0
    assert "taken as positions" in capsys.readouterr().err
    assert serve(tmp_path / "as_is.yaml", ep_size=2, moe_layers=(3, 4, 5), num_experts=4) == local


# ---------------------------------------------------------------------- every MoE layer the server builds
def _full_plan(tmp_path, name, layer_ids, experts, gpus, redundant, model=None):
    """A valid plan of `layer_ids` (each row a different rotation), optionally naming `model` as `plan` records it."""
    base = [np.roll(np.arange(experts), 3 * i) for i in range(len(layer_ids))]
    rows = [np.r_[b, b[:redundant]] for b in base]  # replica j sits `experts` slots after its original: other GPU
    path = tmp_path / f"{name}.json"
    inputs = {"options": {"model": model}} if model else {}
    write_plan(path, PlanFile(Placement(np.array(rows), experts, gpus), tuple(layer_ids), {}, inputs))
    return path, np.array(rows)


def _export_trtllm(plan, out, *argv):
    return main(["export", str(plan), "--engine", "trtllm", "--out", str(out), *argv])


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_the_presets_know_the_moe_layers_a_server_builds():
    assert moe_layer_ids(get_model("DeepSeek-V3")) == tuple(DEEPSEEK_V3_MTP)      # 3-60 and MTP layer 61
    assert moe_layer_ids(get_model("deepseek-r1")) == tuple(DEEPSEEK_V3) + (61,)
    assert moe_layer_ids(get_model("Qwen3-30B-A3B")) == tuple(QWEN3_30B)
    assert moe_layer_ids(get_model("Qwen3-235B-A22B")) == tuple(QWEN3_235B)
    assert moe_layer_ids(get_model("Kimi-K2")) == tuple(server_moe_layers(61, first_k_dense_replace=1))
    assert get_model("DeepSeek-V3").num_moe_layers == 58  # the preset's figures are unchanged


@pytest.mark.parametrize("case, layer_ids, missing", [
    ("a plan of layers 3-60, served with MTP", range(3, 61), "layer 61"),
    ("a plan made with --layers 3-10", range(3, 11), "layers 11-61"),
    ("a plan numbered from 0 (a trace of MoE layers only)", range(58), "layer 61"),
])
def test_deepseek_v3_a_plan_that_misses_a_served_layer_is_refused_or_filled_with_the_engines_map(
        tmp_path, capsys, case, layer_ids, missing):
    plan, rows = _full_plan(tmp_path, "ds", layer_ids, experts=256, gpus=32, redundant=32)
    out = tmp_path / "moe_load_balancer.yaml"
    assert _export_trtllm(plan, out, "--model", "DeepSeek-V3") == 2          # what TensorRT-LLM would do, said first
    err = _one_line(capsys)
    assert err.endswith(f"got no row for {missing}") and "--fill-missing default" in err, case
    assert not out.exists()
    assert _export_trtllm(plan, out, "--model", "DeepSeek-V3", "--fill-missing", "default") == 0
    local = serve(out, ep_size=32, moe_layers=DEEPSEEK_V3_MTP, num_experts=256)  # every layer, every rank
    config = load_like_trtllm(out)
    keys = [i + 3 for i in range(len(rows))] if layer_ids[0] == 0 else list(layer_ids)
    for row, key in zip(rows, keys):
        assert config.initial_global_assignments[key] == row.tolist()
    for layer in set(DEEPSEEK_V3_MTP) - set(keys):  # the layers the plan lacks run the engine's own map
        assert config.initial_global_assignments[layer] == wide_ep_default_map(256, 288, 32)
    assert local[31, 61] == wide_ep_default_map(256, 288, 32)[31 * 9:]


def test_deepseek_v3_served_without_mtp_takes_the_layer_list(tmp_path, capsys):
    plan, _ = _full_plan(tmp_path, "ds", range(3, 61), experts=256, gpus=32, redundant=32)
    out = tmp_path / "lb.yaml"
    assert _export_trtllm(plan, out, "--moe-layers", "3-60", "--format", "json") == 0
    assert json.loads(capsys.readouterr().out)["default_map_layers"] == "none"
    serve(out, ep_size=32, moe_layers=DEEPSEEK_V3, num_experts=256)
    with pytest.raises(KeyError):  # the same file on a server with MTP: the engine's KeyError
        serve(out, ep_size=32, moe_layers=DEEPSEEK_V3_MTP, num_experts=256)


@pytest.mark.parametrize("model, layers", [("Qwen3-30B-A3B", QWEN3_30B), ("Qwen3-235B-A22B", QWEN3_235B)])
def test_qwen3_moe_plans_from_the_model_the_plan_names(tmp_path, capsys, model, layers):
    plan, rows = _full_plan(tmp_path, "q", range(len(layers)), experts=128, gpus=16, redundant=16, model=model)
    out = tmp_path / "lb.yaml"
    assert _export_trtllm(plan, out, "--format", "json") == 0  # no --model: the plan's own
    summary = json.loads(capsys.readouterr().out)
    assert summary["model"] == model and summary["layer_keys"] == f"0-{len(layers) - 1}"
    local = serve(out, ep_size=16, moe_layers=layers, num_experts=128)
    assert local[15, layers[-1]] == rows[-1][15 * 9:].tolist()
    partial, _ = _full_plan(tmp_path, "half", range(10), experts=128, gpus=16, redundant=16, model=model)
    assert _export_trtllm(partial, out) == 2
    assert _one_line(capsys).endswith(f"got no row for layers 10-{len(layers) - 1}")


def test_a_plan_that_names_no_model_needs_the_served_layers(tmp_path, capsys):
    plan, _ = _full_plan(tmp_path, "anon", range(3, 61), experts=256, gpus=32, redundant=32)
    assert _export_trtllm(plan, tmp_path / "lb.yaml") == 2
    err = _one_line(capsys)
    assert "--model: expected the served model" in err and "--moe-layers" in err
    assert _export_trtllm(plan, tmp_path / "lb.yaml", "--model", "Qwen3-30B-A3B") == 2  # 128 experts, not 256
    assert "--model: expected a model with the plan's 256 experts" in _one_line(capsys)
    assert _export_trtllm(plan, tmp_path / "lb.yaml", "--model", "no-such-model") == 2
    assert _one_line(capsys).startswith("moe-place export: error: --model: expected one of DeepSeek-V3")


def test_plan_rows_of_layers_without_experts_are_left_out(tmp_path, capsys):
    plan, _ = _full_plan(tmp_path, "all", range(61), experts=256, gpus=32, redundant=32)  # dense rows 0-2 too
    out = tmp_path / "lb.yaml"
    assert _export_trtllm(plan, out, "--model", "DeepSeek-V3", "--fill-missing", "default") == 0
    err = capsys.readouterr().err
    assert "plan rows for layers 0-2 are not MoE layers of DeepSeek-V3 (3-61): left out" in err
    assert sorted(load_like_trtllm(out).initial_global_assignments) == DEEPSEEK_V3_MTP


def test_the_engines_own_map_is_trtllms():
    for experts, slots, ep in ((256, 288, 32), (128, 160, 32), (4, 6, 2), (8, 8, 8)):
        row = default_assignments(experts, slots, ep)
        assert row == wide_ep_default_map(experts, slots, ep) and set(row) == set(range(experts))


def test_the_trtllm_options_are_refused_with_other_engines(tmp_path, plan_path, capsys):
    for option, value in (("--model", "DeepSeek-V3"), ("--moe-layers", "3-5"), ("--fill-missing", "default")):
        assert main(["export", str(plan_path), "--engine", "sglang", "--out", str(tmp_path / "x.json"),
                     option, value]) == 2
        assert f"{option}: expected only with --engine trtllm" in _one_line(capsys)


def test_model_layer_keys():
    assert model_layer_keys((0, 1, 2)) == (0, 1, 2)
    assert model_layer_keys((0, 1, 2), (0, 1, 2)) == (3, 4, 5)
    assert model_layer_keys((0, 1, 2, 3), (1,)) == (0, 2, 3, 4)
    assert model_layer_keys((3, 4, 5), (0, 1, 2)) == (3, 4, 5)  # model ids already: kept


def test_yaml_is_generate_eplb_configs_form(plan_path):
    config = load_balancer_config(Placement(PHY2LOG, 4, 2), (3, 4, 5))
    assert config == load_balancer_config(Placement(PHY2LOG, 4, 2), (3, 4, 5), moe_layers=(3, 4, 5))
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
    assert main(["export", str(plan_path), "--engine", "trtllm", "--out", str(tmp_path / "x.json"),
                 "--moe-layers", "3-5"]) == 2
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
