"""What the learner tells the operator at start-up about a configuration that is allowed but
costs more than its user likely expects: each a line, or None when there is nothing to say."""

from __future__ import annotations

from pathlib import Path

from learner.config import LearnerConfig


def spawn_note(cfg: LearnerConfig) -> str | None:
    """What to tell the operator who spawns workers beside a scheduler's pool: they join as
    self-joined workers, priced like the dearest pool machine, so the controller activates them
    only when the pool's machines fall short (a new user's six extra workers got no work)."""
    if not cfg.workers.spawn or not cfg.scheduled:
        return None
    return (f"[workers] spawn = {cfg.workers.spawn}: they join as self-joined workers, which the scheduler "
            "activates only when its pool's machines fall short (priced like the dearest of them); to have every "
            "spawned worker generate, run with --scheduler.pool '\"\"' --scheduler.provider static")


def period_note(cfg: LearnerConfig) -> str | None:
    """What to tell the operator who publishes every S + 1 updates (allowed, never overlapped): a
    new user's run at I = S + 1 rented the whole pool, twice what the run needed."""
    S, I = cfg.staleness_bound, cfg.publish_every
    if S is None or S < 1 or I != S + 1:
        return None
    return (f"[publish] every = {I} = S + 1: a snapshot's rollouts are admissible only until the next one is "
            "published, so every period the learner waits for the new snapshot to reach the workers and for "
            "their first rollouts" + (", and the scheduler, whose capacity rule cannot hold, activates every "
                                       "worker it has" if cfg.scheduled else "")
            + f"; [publish] every <= {max(1, S - 1)} (the default, S - 1) overlaps training with the broadcast")


def dtype_note(cfg: LearnerConfig, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """Half precision on a CPU without bf16 matrix instructions is emulated: a new user's bf16 demo
    trained 4x slower than float32 (1.6 s a step against 0.4), with no word why."""
    dtype = cfg.trainer.compute_dtype
    if dtype == "float32" or not cfg.model.device.startswith("cpu"):
        return None
    try:
        flags = cpuinfo.read_text()
    except OSError:
        return None
    if dtype == "bfloat16" and ("avx512_bf16" in flags or "amx_bf16" in flags):
        return None
    return (f"[trainer] compute_dtype = {dtype!r} on a CPU without {'bf16' if dtype == 'bfloat16' else 'fp16'} "
            "matrix instructions: torch emulates it, several times slower than 'float32' (4x on a 2-core VM); "
            "half precision pays on GPUs")


def startup_notes(cfg: LearnerConfig) -> list[str]:
    return [said for said in (spawn_note(cfg), period_note(cfg), dtype_note(cfg)) if said is not None]
