"""The start-up advice: a line for each allowed configuration that costs more than its user
likely expects, and nothing otherwise."""

from __future__ import annotations

from pathlib import Path


def test_spawned_workers_beside_a_pool_are_said_to_idle_unless_the_pool_falls_short():
    """`--workers.spawn 6` with the demo's pool: the six joined as self-joined workers and got no
    work, and nothing said why (a new user)."""
    from learner.config import load_learner_config
    from learner.advice import spawn_note

    pooled = load_learner_config(Path("configs/demo.toml"), ["--workers.spawn", "6"])
    assert "activates only when its pool's machines fall short" in spawn_note(pooled)
    assert spawn_note(load_learner_config(Path("configs/demo.toml"), ["--workers.spawn", "0"])) is None
    static = load_learner_config(Path("configs/demo.toml"), ["--workers.spawn", "6", "--scheduler.pool", '""',
                                                            "--scheduler.provider", "static"])
    assert spawn_note(static) is None


def test_publishing_every_s_plus_one_is_said_to_stall_and_the_filter_off_is_not_bounded():
    """I = S + 1 is allowed but never overlapped: a new user's run rented the whole pool for it
    silently; with the filter off nothing is dropped for age, so the scheduler has no S to meet."""
    from learner.config import load_learner_config
    from learner.advice import period_note

    demo = Path("configs/demo.toml")
    note = period_note(load_learner_config(demo, ["--buffer.max_staleness", "5", "--publish.every", "6"]))
    assert "every = 6 = S + 1" in note and "activates every worker" in note and "every <= 4" in note
    assert period_note(load_learner_config(demo, ["--buffer.max_staleness", "5", "--publish.every", "4"])) is None
    assert period_note(load_learner_config(demo, ["--buffer.max_staleness", "0"])) is None  # synchronous by choice
    unfiltered = load_learner_config(demo, ["--buffer.max_staleness", "5", "--publish.every", "8",
                                            "--buffer.staleness_filter", "false"])
    assert unfiltered.staleness_bound is None and period_note(unfiltered) is None


def test_half_precision_on_a_cpu_without_its_instructions_is_said_to_be_slow(tmp_path):
    from learner.advice import dtype_note
    from learner.config import load_learner_config

    plain, avx512 = tmp_path / "plain", tmp_path / "bf16"
    plain.write_text("flags\t\t: fpu sse2 avx2 fma\n")
    avx512.write_text("flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16\n")
    demo = Path("configs/demo.toml")
    bf16 = load_learner_config(demo, ["--trainer.compute_dtype", "bfloat16"])
    assert "emulates it" in dtype_note(bf16, plain)
    assert dtype_note(bf16, avx512) is None
    assert dtype_note(load_learner_config(demo, []), plain) is None
    on_gpu = load_learner_config(demo, ["--trainer.compute_dtype", "bfloat16", "--model.device", "cuda"])
    assert dtype_note(on_gpu, plain) is None
