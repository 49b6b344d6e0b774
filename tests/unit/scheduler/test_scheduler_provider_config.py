"""`[scheduler.provider]`: a tagged union, its old flat spelling, and the one factory."""

import pytest

from echo.config import ConfigError, dump_toml, load_config
from scheduler.config import CommandProviderConfig, LocalProviderConfig, SchedulerSection, StaticProviderConfig
from scheduler.providers import CommandProvider, LocalProvider, Provider, make_provider


def test_the_table_spelling_picks_a_variant_by_type():
    sc = SchedulerSection(provider={"type": "command", "launch_command": "up {id}", "release_command": "down {id}"})
    assert sc.provider == CommandProviderConfig(launch_command="up {id}", release_command="down {id}")
    assert isinstance(SchedulerSection().provider, StaticProviderConfig)


def test_the_old_flat_spelling_still_loads():
    sc = SchedulerSection(provider="command", launch_command="up {id}", release_command="down {id}")
    assert sc.provider == CommandProviderConfig(launch_command="up {id}", release_command="down {id}")
    assert isinstance(SchedulerSection(provider="local").provider, LocalProviderConfig)
    # flat command keys beside another provider were accepted and unused before; they still are
    assert SchedulerSection(provider="local", launch_command="up").provider == LocalProviderConfig()


def test_a_provider_compares_equal_to_its_name():
    assert SchedulerSection().provider == "static" and SchedulerSection(provider="local").provider != "static"


def test_command_line_overrides_and_the_resolved_config_round_trip(tmp_path):
    cfg = load_config(SchedulerSection, None, ["--provider", "command", "--launch_command", "up {id}"])
    assert cfg.provider == CommandProviderConfig(launch_command="up {id}")
    toml = tmp_path / "resolved.toml"
    toml.write_text(dump_toml(cfg))  # what --dry-run prints and a run directory keeps
    assert load_config(SchedulerSection, toml) == cfg
    with pytest.raises(ConfigError, match="cloud"):
        load_config(SchedulerSection, None, ["--provider", "cloud"])


def test_make_provider_builds_the_named_variant(tmp_path):
    env = dict(url="http://x", machine_key="t", log_dir=tmp_path, worker_config=tmp_path / "w.toml", worker_overrides=[])
    assert type(make_provider(StaticProviderConfig(), **env)) is Provider
    local = make_provider(LocalProviderConfig(), **env, python="py")
    assert isinstance(local, LocalProvider) and local.python == "py" and local.launches_machines
    command = make_provider(CommandProviderConfig(launch_command="up {id}"), **env)
    assert isinstance(command, CommandProvider) and command.releases_machines and command.launch_command == "up {id}"
    with pytest.raises(ValueError, match="launch_command"):
        make_provider(CommandProviderConfig(), **env)


def test_a_local_machine_gets_its_token_in_the_environment_not_on_the_command_line(tmp_path):
    """Any user of the machine reads a command line (`ps`): the machine token was on it."""
    from scheduler.providers import Machine, machine_token

    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\necho "$ECHO_TOKEN" > {tmp_path}/token\n')
    fake.chmod(0o755)
    p = LocalProvider("http://x:1", "key", tmp_path / "w.toml", tmp_path / "logs", [], python=str(fake))
    p.launch(Machine("box-0", "cpu", 0.1, 10.0))
    assert p.procs["box-0"].wait(10) == 0
    assert "machine:" not in (tmp_path / "argv").read_text()
    assert (tmp_path / "token").read_text().strip() == machine_token("key", "box-0")
