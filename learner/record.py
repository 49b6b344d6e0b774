"""What a run leaves behind: one record per step (run log, Prometheus gauges, the console's
status line, `--json`), the events between them, and the summary at the end.

It also keeps the run's clock: when serving started and how long the trainer waited for data,
whose ratio is the learner's idle share.
"""

from __future__ import annotations

import time

from learner.api.workers import WorkerRegistry
from learner.buffer import AsyncBuffer, BatchInfo
from learner.leases import LeaseBook
from learner.metrics import LearnerMetrics, RunLog, dumps
from learner.status import StatusDisplay


def logged(x: float) -> float:
    """A step statistic as the run log keeps it: six significant digits, not six decimals (an
    8B run's lr of 5e-7 was logged as 1e-6, a small KL as 0)."""
    return float(f"{x:.6g}")


class RunRecord:
    def __init__(self, log: RunLog, display: StatusDisplay, as_json: bool, *, metrics: LearnerMetrics,
                 buffer: AsyncBuffer, leases: LeaseBook, registry: WorkerRegistry):
        self.log, self.display, self.as_json = log, display, as_json
        self.metrics, self.buffer, self.leases, self.registry = metrics, buffer, leases, registry
        self.started = time.monotonic()
        self.waited = 0.0  # seconds the trainer waited for a batch
        self.stepped = self.started  # when the last step ended: the idle share's clock stops there

    def event(self, record: dict) -> None:
        self.log.write(record)

    def start(self, version: int) -> None:
        self.started, self.waited = time.monotonic(), 0.0
        self.stepped = self.started
        self.display.start(version)

    def stop(self) -> None:
        """Training is over: the progress bar goes."""
        self.display.stop()

    def idle_ratio(self) -> float:
        """The trainer's waits over the time from the start to the last step: what the status line
        shows. The whole wall time would count the final eval and checkpoint as work (a run's
        summary said 45% where its last status line and its cost's bubble said 58%)."""
        return self.waited / max(1e-9, self.stepped - self.started)

    def step(self, updates: int, version: int, published_version: int, batch: BatchInfo, stats: dict, *,
             wait: float, train: float) -> dict:
        """The step's run-log record (the gauges of /metrics set alongside)."""
        self.waited += wait
        self.stepped = time.monotonic()
        idle = self.idle_ratio()
        buf = self.buffer.buffer.metrics()
        m = self.metrics
        m.version.set(version)
        m.queue.set(buf["queue_size"])
        m.recycled.set(buf["recycled"])
        m.overflow.set(buf["dropped_overflow"])
        m.uniform.set(buf["skipped_uniform"])
        m.staleness_avg.set(batch.avg_staleness)
        m.staleness_max.set(batch.max_staleness)
        m.mismatch_kl.set(stats["mismatch_kl"])
        m.reward.set(stats["reward_mean"])
        m.idle.set(idle)
        return {
            "step": updates, "time": round(time.time(), 3), "version": version,
            "published_version": published_version,
            **{k: logged(v) if isinstance(v, float) else v for k, v in stats.items()},
            "avg_staleness": batch.avg_staleness, "max_staleness": batch.max_staleness,
            "staleness": batch.staleness, **batch.reuse_fields(), "recycled": buf["recycled"],
            "queue_size": buf["queue_size"], "dropped_overflow": buf["dropped_overflow"],
            "skipped_uniform": buf["skipped_uniform"],
            **({"signal_share": round(_signal(batch), 4)} if self.buffer.buffer.skip_uniform else {}),
            "sampled_mean_length": round(buf["sampled_mean_length"], 4),
            "trained_mean_length": round(buf["trained_mean_length"], 4),
            "wait_s": round(wait, 4), "train_s": round(train, 4), "idle_ratio": round(idle, 4),
            # Active (the scheduler's) and joined: a released worker heartbeats on, and counted as
            # one the line read "workers 4" while one generated.
            "workers": len(self.registry.active(time.monotonic())),
            "workers_joined": len(self.registry.alive(time.monotonic())), "leases_reissued": self.leases.stats.reissued,
            "dropped_reissued": self.leases.stats.dropped_reissued,
        }

    def show(self, record: dict, last_eval) -> None:
        """Write the step's record and show its status line (`last_eval`: the newest eval result)."""
        self.log.write(record)
        self.display.step(record, last_eval)
        if self.as_json:
            print(dumps(record), flush=True)

    def summary(self, run_dir, steps: int, first_accuracy, last_eval, cost: dict) -> dict:
        buf = self.buffer.buffer.metrics()
        wall = time.monotonic() - self.started
        rejected = {s.labels["reason"]: int(s.value) for m in self.metrics.rejected.collect()
                    for s in m.samples if s.name.endswith("_total")}
        workers, verifier = self.registry.workers.values(), self.registry.verifier
        return {
            "run_dir": str(run_dir), "steps": steps, "version_end": self.registry.run.version,
            "eval_accuracy_start": first_accuracy,
            "eval_accuracy_end": last_eval.accuracy if last_eval else None,
            "eval_version_end": last_eval.version if last_eval else None,
            "wall_s": round(wall, 1), "learner_idle_ratio": round(self.idle_ratio(), 3),
            "groups_trained": buf["trained"], "groups_replayed": buf["replayed"],
            "replay_aged_out": buf["replay_aged_out"], "recycled": buf["recycled"],
            "dropped_overflow": buf["dropped_overflow"], "skipped_uniform": buf["skipped_uniform"], "rejected": rejected,
            "leases_reissued": self.leases.stats.reissued, "dropped_reissued": self.leases.stats.dropped_reissued,
            "sampled_mean_length": round(buf["sampled_mean_length"], 3),
            "trained_mean_length": round(buf["trained_mean_length"], 3),
            "workers": [{"id": w.id, "name": w.name, "groups": w.groups_accepted} for w in workers],  # accepted, not trained
            "quarantined": [{"id": w.id, "name": w.name, "address": w.address, "why": w.quarantined}
                            for w in workers if w.quarantined],
            "rewards_checked": verifier.checked, "rewards_mismatched": verifier.mismatched,
            "cost": cost,
        }

    def finish(self, run_dir, summary: dict) -> None:
        """summary.json, the run log's last event, and the summary on the console (or as JSON)."""
        (run_dir / "summary.json").write_text(dumps(summary, indent=2))
        self.log.write({"event": "summary", **summary})
        self.log.close()
        if self.as_json:
            print(dumps(summary))
        else:
            self.display.summary(summary)


def _signal(batch: BatchInfo) -> float:
    """The share of the groups accepted since the previous batch that carried signal (dynamic
    sampling skipped the rest): low late in a run, when most prompts are always answered right."""
    fresh = len(batch.fresh)
    return fresh / max(1, fresh + batch.skipped)
