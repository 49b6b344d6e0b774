"""The scheduler in the learner: its provider, its fleet, and the tick loop that (de)activates workers.

`make_provider` picks how machines are obtained (`[scheduler] provider`); `make_fleet` wraps it
in the closed-loop controller (`scheduler.fleet.Fleet`) with the measured priors; `schedule`
re-evaluates the capacity rule every `[scheduler] tick_s` and tells each worker whether it is active.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from pathlib import Path

from learner.api.workers import WorkerRegistry
from learner.config import LearnerConfig
from scheduler.fleet import Fleet
from scheduler.pool import Pool, load_pool
from scheduler import providers
from scheduler.providers import Provider


def make_provider(cfg: LearnerConfig, url: str, machine_key: str, run_dir: Path) -> Provider:
    """The `[scheduler.provider]` of this run, given the learner's address (`scheduler.providers.make_provider`)."""
    w = cfg.workers
    return providers.make_provider(cfg.scheduler.provider, url=url, machine_key=machine_key, log_dir=run_dir / "workers",
                                   worker_config=w.config, worker_overrides=w.overrides,
                                   python=w.python or sys.executable)


def machine_tokens(pool: Pool, machine_key: str, path: Path) -> None:
    """The token each machine of a pool the operator brings up joins with (`--token`): it binds the
    worker to its pool entry, whose price and rate are the operator's word (a provider that
    launches machines hands theirs out itself)."""
    lines = ["# echo-worker join URL --token <this machine's token>: the pool entry it joins as", "[tokens]"]
    lines += [f'"{c.id}" = "{providers.machine_token(machine_key, c.id)}"' for c in pool.candidates()]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)


def version_bytes_prior(cfg: LearnerConfig) -> float:
    """Bytes of one version on the wire until measured: `[scheduler] snapshot_gb`, else the
    model's weights on disk (a full version; deltas are smaller, so this errs dear)."""
    if cfg.scheduler.snapshot_gb:
        return cfg.scheduler.snapshot_gb * 1e9
    model = Path(cfg.model.path)
    return float(sum(p.stat().st_size for p in model.glob("*.safetensors"))) if model.is_dir() else 0.0


def make_fleet(cfg: LearnerConfig, provider: Provider, machine_key: str, run_dir: Path) -> Fleet:
    sc = cfg.scheduler
    market = provider.offers() is not None  # a market's live offers are the candidates, not a pool file
    pool = load_pool(sc.pool) if sc.pool and not market else None
    if pool is not None and not provider.launches_machines:
        machine_tokens(pool, machine_key, run_dir / "machine-tokens.toml")
    return Fleet(pool, provider, sc.controller_params(), batch=cfg.batch_rollouts,
                 publish_every=cfg.publish_every, max_staleness=cfg.staleness_bound,
                 t_train_prior=sc.t_train_s, t_bcast_prior=sc.t_bcast_s, install_prior=sc.install_s,
                 launch_timeout_s=sc.launch_timeout_s, rule=sc.rule, version_bytes=version_bytes_prior(cfg))


async def schedule(fleet: Fleet, registry: WorkerRegistry, tick_s: float, log, note) -> None:
    """The closed loop: every tick, re-evaluate the capacity rule and (de)activate workers.
    `log(record)` takes the run-log event of each decision, `note(text)` what the operator should read."""
    said = ""
    while True:
        now = time.monotonic()
        try:
            st = fleet.tick(now)
        except Exception as e:  # a broken scheduler must not stop training; say so, keep going
            note(f"scheduler error: {e}")
            await asyncio.sleep(tick_s)
            continue
        for key, why in st.lost:  # preempted, vanished, never joined: its leases go back at once
            reissued = registry.lost(key, why)
            log({"event": "scheduler", "action": "lost", "worker": key, "reason": why, "reissued": reissued})
            note(f"scheduler: lost {key} ({why}); {reissued} leased prompts re-issued")
        for w in registry.workers.values():
            w.active = fleet.is_active(w.fleet_key)
        # Said once, not again each time the measured T_train in it moves (14 times in a 20-step run).
        if st.infeasible and _numberless(st.infeasible) != said:
            said = _numberless(st.infeasible)
            note(f"scheduler: {st.infeasible}; activating every available worker")
        for d in st.decisions:
            log({"event": "scheduler", "action": d.action, "worker": d.worker_id, "reason": d.reason,
                 "r_req": st.r_req, "r_eff": st.r_eff, "t_train": st.t_train, "t_bcast": st.t_bcast})
            note(f"scheduler: {d.action} {d.worker_id} ({d.reason})")
        await asyncio.sleep(tick_s)


def _numberless(text: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "#", text)
