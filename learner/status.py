"""The learner's console: one status line per step above a progress bar, and the summary."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text


def status_line(r: dict, last_eval=None) -> str:
    """One line per step; the `Staleness stats:` part keeps the format other async RL stacks log.
    `last_eval` (a `learner.evals.EvalResult`) shows as accuracy@version."""
    acc = f"{last_eval.accuracy:.3f}@v{last_eval.version}" if last_eval is not None else "-"
    return (f"step {r['step']:>4} v{r['published_version']:<4} reward {r['reward_mean']:.3f} eval {acc} "
            f"idle {100 * r['idle_ratio']:3.0f}% "
            + (f"signal {100 * r['signal_share']:3.0f}% " if "signal_share" in r else "")
            + f"workers {r['workers']}" + (f"/{r['workers_joined']} joined" if r.get("workers_joined", r["workers"]) != r["workers"] else "")
            + " | "
            f"Staleness stats: recycled={r['recycled']}, avg_staleness={r['avg_staleness']:.2f}, "
            f"max_staleness={r['max_staleness']} | queue {r['queue_size']} | "
            f"length sampled {r['sampled_mean_length']:.2f} trained {r['trained_mean_length']:.2f} | "
            f"${r['dollars_step']:.5f}/step" + (f" R_eff {r['r_eff']:.0f}/{r['r_req']:.0f}" if "r_req" in r else "")
            + (f" capacity {r['capacity']:.0f} delivered {r['delivered']:.0f} rollouts/s" if "capacity" in r else ""))


def banner(cfg, url: str, run_dir, token: str, params: int, ranks: int, eval_prompts: int) -> str:
    """What the learner prints at start-up: where it listens, how to join, and the run's derived quantities."""
    G, S = cfg.trainer.batch_prompts, cfg.buffer.max_staleness
    fsdp = f", {ranks} ranks (FSDP2)" if ranks > 1 else ""
    return (f"echo-learner at {url}  run dir {run_dir}\n"
            f"  join: echo-worker join {url} --token {token}\n"
            f"  model {cfg.model.path} ({params / 1e6:.2f}M params{fsdp}), "
            f"task {cfg.task.name}, B = {G}×{cfg.rollout.group_size} = {cfg.batch_rollouts} rollouts/step, "
            f"S = {S}, I = {cfg.publish_every}, buffer {cfg.buffer.type}"
            + (f" with replay (reuse = {cfg.buffer.reuse})" if cfg.buffer.reuse > 1 else "")
            + f", eval on {cfg.eval.where} ({eval_prompts} prompts)\n"
            f"  status: v = newest published snapshot, reward = mean reward of the groups the step trained"
            + (" (those whose rewards differ: above what workers sample)" if cfg.dynamic_sampling else "")
            + ", eval = the newest greedy eval @ the version it evaluated"
            + (" (the learner's own weights: newer than v between publications)" if cfg.eval.where == "learner" else "")
            + ", idle = share of wall time the trainer waited for data, workers = those generating (/ those "
              "joined, where the scheduler holds some idle), "
            + ("signal = share of the groups since the last step whose rewards differ (the rest are skipped: "
               "[buffer] dynamic_sampling), " if cfg.dynamic_sampling else "")
            + "recycled = groups dropped as staler than S, queue = groups waiting, length = mean response tokens "
              "(an episode's: the policy's turns, not the environment's) of what workers sampled vs what was trained")


class StatusDisplay:
    def __init__(self, total_steps: int, enabled: bool = True):
        self.enabled = enabled
        # Plain text: what it prints names config keys as `[buffer] dynamic_sampling`, and rich
        # read `[buffer]` as a style tag and dropped it, from the very advice a stuck user needs.
        self.console = Console(stderr=False, highlight=False, markup=False)
        self.progress = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                 console=self.console, transient=True, disable=not enabled)
        self.total = total_steps
        self.task = None

    def banner(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, soft_wrap=True)

    def start(self, done: int) -> None:
        self.task = self.progress.add_task("train", total=self.total, completed=done)
        self.progress.start()

    def step(self, record: dict, last_eval=None) -> None:
        if not self.enabled:
            return
        self.progress.console.print(status_line(record, last_eval), soft_wrap=True)
        self.progress.update(self.task, completed=record["step"])

    def note(self, text: str) -> None:
        if self.enabled:
            self.progress.console.print(text, soft_wrap=True)
        else:  # --json: stdout is the run log's records; an operator's note goes to stderr
            print(text, file=sys.stderr, flush=True)

    def stop(self) -> None:
        self.progress.stop()

    def summary(self, s: dict) -> None:
        table = Table(title="run summary", show_header=False)
        rows = [
            (f"eval {s.get('eval_metric', 'accuracy')}", f"{_acc(s['eval_accuracy_start'])} -> {_acc(s['eval_accuracy_end'])}"
             + (f" (v{s['eval_version_end']})" if s.get("eval_version_end") is not None else "")),
            ("steps / wall time", f"{s['steps']} in {s['wall_s']} s" if s.get("resumed_after_update") is None else
             # A resumed run's steps are the whole run's; what this process measured is its own share.
             f"{s['steps']}, of which {s['steps'] - s['resumed_after_update']} after resuming at update "
             f"{s['resumed_after_update']} in {s['wall_s']} s (this row's time and the counts below: since the resume)"),
            ("learner idle", f"{100 * s['learner_idle_ratio']:.1f}%"),
            # A replayed group is trained again: counted once in groups_trained, its replays beside it.
            ("groups trained / recycled / overflow", f"{s['groups_trained']}"
             + _replays(s)
             + f" / {s['recycled']} / {s['dropped_overflow']}"
             + (f"; {s['skipped_uniform']} of equal rewards skipped" if s.get("skipped_uniform") else "")),
            ("uploads rejected", ", ".join(f"{k}={v}" for k, v in s["rejected"].items()) or "none"),
            ("prompts re-issued", f"{s['leases_reissued']} (leases lost or refused), {s.get('dropped_reissued', 0)} (groups dropped)"
             + (f", {s['resume_reissued']} (in flight or rolled back at the resume)" if "resume_reissued" in s else "")),
            ("mean length sampled / trained", f"{s['sampled_mean_length']} / {s['trained_mean_length']}"),
            ("cost", f"${s['cost']['dollars']:.4f} total, ${s['cost']['dollars_per_step']:.6f}/step"
                     + (f", ${s['cost']['dollars_per_improvement']:.4f} per unit of eval improvement"
                        if s['cost'].get('dollars_per_improvement') else "")),
            ("groups accepted, by worker", ", ".join(f"{worker_label(w, s['workers'])}: {w['groups']}" for w in s["workers"])),
            *([("quarantined", "; ".join(f"{q['name']} ({q['id']}): {q['why']}" for q in s["quarantined"]))]
              if s.get("quarantined") else []),
            ("run directory", s["run_dir"]),
        ]
        for k, v in rows:
            table.add_row(Text(k), Text(v))  # plain: worker names and reasons are not markup
        self.console.print(table)


def _replays(s: dict) -> str:
    """Replays beside the groups trained, and those replay could not use: trained too close to S
    to be trained again (the log said why, once)."""
    said = [f"+{s['groups_replayed']} replays"] if s.get("groups_replayed") else []
    said += [f"{s['replay_aged_out']} too stale to replay"] if s.get("replay_aged_out") else []
    return f" ({', '.join(said)})" if said else ""


def _acc(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def worker_label(w: dict, workers: list[dict]) -> str:
    """A worker's name, with its id where another (a rejoined identity, a look-alike) has the same name."""
    return w["name"] if sum(o["name"] == w["name"] for o in workers) == 1 else f"{w['name']} ({w['id']})"
