"""Config loading: every shipped TOML loads, overrides apply, mistakes name the key and file."""

from pathlib import Path

import pytest

from echo.config import ConfigError, dump_toml, load_config, parse_overrides, read_toml
from learner.config import LearnerConfig, load_learner_config
from worker.config import load_worker_config

ROOT = Path(__file__).resolve().parents[3]


def test_overrides_parse_as_toml_literals():
    assert parse_overrides(["--trainer.lr", "3e-4", "--task.name=arith", "--run.steps", "7",
                            "--workers.overrides", '["--a", "b"]']) == {
        "trainer": {"lr": 3e-4}, "task": {"name": "arith"}, "run": {"steps": 7},
        "workers": {"overrides": ["--a", "b"]}}


def test_an_unknown_flag_last_is_named_as_one():
    """`echo-learner --bogus` said "override --bogus needs a value"."""
    with pytest.raises(ConfigError, match=r"unknown option --bogus; overrides look like --section.key VALUE"):
        parse_overrides(["--run.steps", "3", "--bogus"])
    with pytest.raises(ConfigError, match=r"unknown option --bogus"):  # it blamed '3'
        parse_overrides(["--bogus", "--run.steps", "3"])
    with pytest.raises(ConfigError, match=r"override --run.steps needs a value"):
        parse_overrides(["--run.steps"])


def test_learner_configs_shipped_load():
    for path in ["configs/demo.toml", "configs/learner-gpu.toml", "configs/learner-8b.toml"]:
        cfg = load_learner_config(ROOT / path)
        assert cfg.batch_rollouts == cfg.trainer.batch_prompts * cfg.rollout.group_size
    assert load_worker_config(ROOT / "configs/worker.toml").engine.type == "auto"


def test_override_beats_file_and_dry_run_output_round_trips(tmp_path):
    cfg = load_learner_config(ROOT / "configs/demo.toml", ["--trainer.lr", "1e-3", "--buffer.max_staleness", "5"])
    assert cfg.trainer.lr == 1e-3 and cfg.buffer.max_staleness == 5
    assert cfg.publish_every == 4  # S - 1 by default
    (tmp_path / "resolved.toml").write_text(dump_toml(cfg))
    assert load_learner_config(tmp_path / "resolved.toml") == cfg


def test_default_publication_period_is_s_minus_one():
    assert load_config(LearnerConfig, None, ["--buffer.max_staleness", "4"]).publish_every == 3


def test_a_publication_period_no_version_can_be_trained_in_is_refused():
    """S = 2, I = 5 loaded, trained 3 steps on v0, then waited forever for a group within S of
    version 3 (the next snapshot comes at 5), saying nothing. I = S + 1 still trains (each
    version's rollouts at staleness 0 wait for it); the pure queue-drop (no filter) never waits."""
    with pytest.raises(ConfigError, match=r"\[publish\] every = 5 > max_staleness \+ 1 = 3.*wait forever"):
        load_config(LearnerConfig, None, ["--buffer.max_staleness", "2", "--publish.every", "5"])
    assert load_config(LearnerConfig, None, ["--buffer.max_staleness", "2", "--publish.every", "3"]).publish_every == 3
    assert load_config(LearnerConfig, None, ["--buffer.max_staleness", "2", "--publish.every", "5",
                                             "--buffer.staleness_filter", "false"]).publish_every == 5


def test_a_missing_pool_file_is_a_config_error_not_a_traceback(tmp_path):
    """It was a 28-line `PoolError` traceback once the model had loaded, and `--dry-run` passed."""
    with pytest.raises(ConfigError, match=r"\[scheduler\] pool: pool file .*nope.toml does not exist; shipped pools"):
        load_config(LearnerConfig, None, ["--scheduler.pool", str(tmp_path / "nope.toml")])


def test_unknown_key_names_key_file_and_allowed_keys(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_learner_config(bad)
    msg = str(e.value)
    assert "trainer.learning_rate" in msg and str(bad) in msg and "lr" in msg


def test_an_error_says_where_the_key_was_written_and_what_to_write():
    """A typo or a bad value typed on the command line was reported 'in configs/demo.toml', a
    typo got no suggestion, and a check of keys together (nproc with float16) printed the whole
    resolved config before its message."""
    demo = ROOT / "configs/demo.toml"
    with pytest.raises(ConfigError) as e:
        load_learner_config(demo, ["--trainer.minibatch", "2"])
    line = str(e.value).splitlines()[1]
    assert "trainer.minibatch: unknown key (given as --trainer.minibatch on the command line)" in line
    assert "did you mean 'minibatches'?" in line and str(demo) not in line
    # an unknown table made by a flag (a worker's key given to the learner): the flag, not the file (a new user, 2026-12-07)
    for flag in ("--foo.bar", "--worker.max_rollouts_per_s"):
        with pytest.raises(ConfigError) as e:
            load_learner_config(demo, [flag, "1"])
        line = str(e.value).splitlines()[1]
        assert f"unknown key (given as {flag} on the command line)" in line and str(demo) not in line
    with pytest.raises(ConfigError, match=r"trainer.kl_coef = 'high': .*valid number.*given as --trainer.kl_coef"):
        load_learner_config(demo, ["--trainer.kl_coef", "high"])
    with pytest.raises(ConfigError, match=r"did you mean 'alpha'"):
        load_learner_config(demo, ["--trainer.lora", "{rank = 4, alpa = 16}"])
    # the README's "buffer policy" is the buffer's `type` (a new user typed --buffer.policy)
    with pytest.raises(ConfigError, match=r"buffer.policy: unknown key .*did you mean 'type'\?"):
        load_learner_config(demo, ["--buffer.policy", "queue-max"])
    # a key inside a table given whole is named by the flag the user typed, not one they did not
    with pytest.raises(ConfigError, match=r"dropout = 0.1: .*\(given as --trainer.lora on the command line\)"):
        load_learner_config(demo, ["--trainer.lora", "{rank = 4, alpha = 8, dropout = 0.1}"])
    with pytest.raises(ConfigError, match=r"given as --trainer.lora.dropout on the command line"):
        load_learner_config(demo, ["--trainer.lora", "{rank = 4, alpha = 8}", "--trainer.lora.dropout", "0.1"])
    with pytest.raises(ConfigError) as e:
        load_learner_config(demo, ["--run.nproc", "2", "--trainer.compute_dtype", "float16"])
    line = str(e.value).splitlines()[1]
    assert line.startswith("  [trainer] compute_dtype = 'float16'") and "'run':" not in line and len(line) < 200


def test_bad_value_lists_allowed_values():
    with pytest.raises(ConfigError, match="buffer.type.*'queue-drop' or 'queue-max'"):
        load_learner_config(ROOT / "configs/demo.toml", ["--buffer.type", "fifo"])
    # A table's kind, as a key: pydantic's "Input tag 'stripes' found using 'mode'" (a new user, 2026-12-07)
    with pytest.raises(ConfigError, match=r"broadcast.mode = 'stripes': must be one of 'chain', 'star' \(given as "
                                          r"--broadcast.mode on the command line\)"):
        load_learner_config(ROOT / "configs/demo.toml", ["--broadcast.mode", "stripes"])
    with pytest.raises(ConfigError, match=r"eval.where = 'gpu': must be one of 'workers', 'learner'"):
        load_learner_config(ROOT / "configs/demo.toml", ["--eval.where", "gpu"])
    with pytest.raises(ConfigError, match="trainer.lr"):
        load_learner_config(None, ["--trainer.lr", "-1"])


def test_task_options_are_validated_by_the_task():
    with pytest.raises(ConfigError, match="digits"):
        load_learner_config(None, ["--task.digits", "99"])
    with pytest.raises(ConfigError, match="unknown task 'nope'"):
        load_learner_config(None, ["--task.name", "nope"])
    # a misspelt option is named with the closest one, as every other key (a new user, 2026-12-07)
    with pytest.raises(ConfigError, match=r"digitz: unknown option; did you mean 'digits'\?; this task's options: digits"):
        load_learner_config(None, ["--task.digitz", "3"])


def test_a_switch_that_would_change_nothing_is_refused():
    """queue-max always filters: `staleness_filter = false` with it was accepted silently (a new user)."""
    with pytest.raises(ConfigError, match="does nothing with type = 'queue-max'.*type = 'queue-drop'"):
        load_learner_config(None, ["--buffer.type", "queue-max", "--buffer.staleness_filter", "false"])
    load_learner_config(None, ["--buffer.type", "queue-drop", "--buffer.staleness_filter", "false"])


def test_broken_toml_and_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        read_toml("/nonexistent/x.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_learner_config(Path(__file__))  # a Python file is not TOML


def test_dry_run_prints_resolved_config():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "learner.main", "--config", "configs/demo.toml", "--dry-run",
                          "--trainer.lr", "0.002"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "lr = 0.002" in out and "[buffer]" in out
    # what the file leaves to be derived is said too (a new user could not see I or dynamic sampling)
    assert "# derived: [publish] every = " in out and "[buffer] dynamic_sampling = true" in out
    # ...and what the user set is not said to be derived (a new user's --publish.every 2 was)
    out = subprocess.run([sys.executable, "-m", "learner.main", "--config", "configs/demo.toml", "--dry-run",
                          "--publish.every", "2"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "[publish] every = 2 (I; unset" not in out and "# derived: [buffer] dynamic_sampling = true" in out
    bad = subprocess.run([sys.executable, "-m", "worker.main", "join", "http://x", "--token", "t",
                          "--config", "configs/worker.toml", "--engine.type", "tpu"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "engine.type" in bad.stderr and "'transformers'" in bad.stderr


def test_broadcast_design_is_a_tagged_union_on_mode(tmp_path):
    """`[broadcast] mode` picks the variant; chain-only keys live on the chain variant only, and
    old files keep loading: no `mode` means chain, and a star keeps a shared file's chain keys
    (they mean nothing to a star). Unknown keys and modes are still errors."""
    from learner.config import ChainBroadcast, StarBroadcast

    chain = load_learner_config(None, ["--broadcast.chunk_mib", "2"]).broadcast
    assert isinstance(chain, ChainBroadcast) and chain.mode == "chain" and chain.chunk_mib == 2
    star = load_learner_config(ROOT / "configs/learner-gpu.toml", ["--broadcast.mode", "star"]).broadcast
    assert isinstance(star, StarBroadcast) and star.mode == "star" and not hasattr(star, "chunk_mib")
    (tmp_path / "resolved.toml").write_text(dump_toml(load_learner_config(None, ["--broadcast.mode", "star"])))
    assert isinstance(load_learner_config(tmp_path / "resolved.toml").broadcast, StarBroadcast)
    for bad in (["--broadcast.mode", "ring"], ["--broadcast.mode", "star", "--broadcast.chunk_size", "1"]):
        with pytest.raises(ConfigError, match="broadcast"):
            load_learner_config(None, bad)


def test_the_configuration_page_lists_every_key_in_its_section():
    """docs/configuration.md says its tables are every key; five were missing (`[trainer] lora`,
    `[scheduler] max_dollars_per_hour`, `max_total_dollars`, `snapshot_gb`, `[engine] base_dir`),
    found by a new user in `--dry-run` (2026-12-07). Each section's table, every variant's keys."""
    import typing

    from pydantic import BaseModel

    from worker.config import WorkerConfig

    page = (ROOT / "docs/configuration.md").read_text()

    def models(annotation) -> list[type[BaseModel]]:  # a section, or each variant of a tagged union
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [annotation]
        return [m for arg in typing.get_args(annotation) for m in models(arg)]

    missing = []
    for config in (LearnerConfig, WorkerConfig):
        for section, field in config.model_fields.items():
            start = page.find(f"**[{section}]**")
            assert start >= 0, f"no table for [{section}]"
            table = page[start:page.find("\n\n**[", start + 1)]
            for model in models(field.annotation):
                missing += [f"[{section}] {key}" for key in model.model_fields
                            if key not in ("mode", "type", "where") and f"| `{key}` |" not in table]
    assert not missing, f"docs/configuration.md lacks: {', '.join(sorted(set(missing)))}"
