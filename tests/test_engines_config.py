"""The engine adapters' rule settings: a config file, then environment variables on top."""

import pytest

from moe_place.engines.config import CONFIG_ENV, EngineConfig, load_engine_config
from moe_place.errors import InputError


def test_defaults_file_and_environment(tmp_path):
    assert load_engine_config({}) == EngineConfig()
    path = tmp_path / "moe-place.toml"
    path.write_text('model = "DeepSeek-V3"\nmigration = "stall"\nmax_moved_slots = 4\n')
    config = load_engine_config({CONFIG_ENV: str(path), "MOE_PLACE_MAX_MOVED_SLOTS": "1", "MOE_PLACE_NIC_GBIT": "200"})
    assert (config.model, config.migration, config.max_moved_slots, config.nic_gbit) == ("DeepSeek-V3", "stall", 1, 200.0)
    assert config.expert_shape().expert_bytes == 42 * 2**20
    rule = config.rule(num_gpus=16, num_nodes=2, num_layers=3, num_experts=256, num_groups=8)
    cost = rule.cost
    assert (cost.num_gpus, cost.topology.num_servers, cost.migration, rule.max_moved_slots, rule.num_groups) == \
        (16, 2, "stall", 1, 8)
    assert load_engine_config({CONFIG_ENV: str(path), "MOE_PLACE_MAX_MOVED_SLOTS": "none"}).max_moved_slots is None
    capped = load_engine_config({"MOE_PLACE_MAX_MIB": "64", "MOE_PLACE_MIN_GAIN": "0.01"})
    assert capped.rule(8, 1, 2, 64).max_bytes == 64 * 2**20 and capped.rule(8, 1, 2, 64).min_gain == 0.01
    assert config.rule(8, 1, 2, 64).estimate == "adaptive"
    assert load_engine_config({"MOE_PLACE_ESTIMATE": "window"}).rule(8, 1, 2, 64).estimate == "window"
    custom = tmp_path / "custom.json"
    custom.write_text('{"model": {"preset": "Qwen3-30B-A3B", "dtype": "fp8"}}')
    assert load_engine_config({CONFIG_ENV: str(custom)}).expert_shape().dtype_bytes == 1


@pytest.mark.parametrize("env, field", [
    ({"MOE_PLACE_MIGRATION": "later"}, "migration"),
    ({"MOE_PLACE_MAX_MOVED_SLOTS": "two"}, "MOE_PLACE_MAX_MOVED_SLOTS"),
    ({"MOE_PLACE_MIN_GAIN": "-1"}, "min_gain"),
    ({"MOE_PLACE_ESTIMATE": "hindsight"}, "estimate.*adaptive, window"),
    ({"MOE_PLACE_STEP_INTERVAL": "0"}, "step_interval"),
    ({"MOE_PLACE_MODEL": "GPT-9"}, "GPT-9"),
    ({CONFIG_ENV: "/no/such/moe-place.toml"}, "moe-place.toml"),
])
def test_bad_settings_are_one_input_error_naming_the_field(env, field):
    with pytest.raises(InputError, match=field):
        load_engine_config(env)


def test_unknown_key_in_the_file_is_named(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("max_moves = 3\n")
    with pytest.raises(InputError, match="max_moves.*did you mean max_moved_slots"):
        load_engine_config({CONFIG_ENV: str(path)})
