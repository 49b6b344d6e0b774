"""Errors in a tagged-union section name the user's key and the keys of the variant chosen,
not pydantic's internal location (`broadcast.chain.foo`)."""

from pathlib import Path

import pytest

from echo.config import ConfigError
from learner.config import load_learner_config

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("overrides,key,allowed", [
    (["--broadcast.foo", "1"], "broadcast.foo", "chunk_mib, deltas"),
    (["--broadcast.mode", "star", "--broadcast.foo", "1"], "broadcast.foo", "done_fraction, mode, uplink_mbit"),
    (["--scheduler.provider.type", "command", "--scheduler.provider.launch_commandx", "x"],
     "scheduler.provider.launch_commandx", "launch_command, release_command, type"),
])
def test_an_unknown_key_in_a_variant_names_the_key_and_the_variants_keys(overrides, key, allowed):
    with pytest.raises(ConfigError) as e:
        load_learner_config(ROOT / "configs/demo.toml", overrides)
    assert f"  {key}: unknown key" in str(e.value) and f"allowed keys here: {allowed}" in str(e.value)
    assert ".chain." not in str(e.value) and ".command." not in str(e.value)
