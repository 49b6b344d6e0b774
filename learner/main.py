"""`echo-learner --config configs/demo.toml`: serve workers, train, publish, log.

The training loop in one sitting:

    preflight (parameters, dtypes, predicted memory per rank: stop if it cannot fit)
    publish v0, evaluate it (on workers, or here for tiny models)
    for each step:  wait for a batch (bounded staleness)  ->  GRPO update (trainer thread)
                    -> publish every I updates (+ an eval round) -> status line + run log -> checkpoint
    final publish, eval of the last version, checkpoint, model export, tell workers the run finished

The event loop stays responsive to workers throughout: torch work runs on the trainer thread.
With `--nproc N` (or `[run] nproc`) the learner relaunches itself under torchrun: rank 0 runs
this loop, ranks 1..N-1 replay its trainer calls (`learner.train.dist.Lockstep`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from aiohttp import web

from echo import loopwatch
from echo.config import ConfigError, add_config_args, dump_toml
from echo.tasks import Prompt
from learner.buffer import AsyncBuffer, StalenessBuffer
from learner.config import LearnerConfig, load_learner_config
from learner.train.dist import Lockstep, World, close, init_world, under_torchrun
from learner.evals import EvalBook, EvalResult
from learner.leases import LeaseBook
from learner.ledger import Ledger, Recovery
from learner.metrics import RunLog
from learner.train.preflight import PreflightError, check_fits, preflight
from learner.publisher import Publisher
from learner.server import LearnerState, build_app, reaper
from learner.status import StatusDisplay
from learner.verify import Rescorer
from scheduler.cost import CostMeter
from scheduler.fleet import Fleet
from scheduler.pool import load_pool
from scheduler.providers import CommandProvider, LocalProvider, Provider

DEFAULT_CONFIG = "configs/demo.toml"
LAUNCHED = "ECHO_LEARNER_LAUNCHED"  # set by the launcher for its torchrun ranks: preflight was printed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="echo-learner",
        description="Run the echo learner: serve prompts to workers, train on their rollouts with "
                    "bounded staleness, publish versioned snapshots. Any other --section.key VALUE "
                    "overrides the config, e.g. --trainer.lr 3e-4 --workers.spawn 0.",
    )
    add_config_args(parser, DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    parser.add_argument("--resume", type=Path, metavar="RUN_DIR",
                        help="continue a run from its latest checkpoint (its config.toml is the base config)")
    parser.add_argument("--nproc", type=int, metavar="N",
                        help="trainer ranks on this node (FSDP2 under torchrun; same as --run.nproc N)")
    parser.add_argument("--preflight", action="store_true",
                        help="print the model, dtypes and predicted memory per rank, check they fit, and exit "
                             "(reads config.json and the tokenizer only: no weights)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per step and a JSON summary")
    args, overrides = parser.parse_known_args(argv)
    if args.nproc is not None:
        overrides += ["--run.nproc", str(args.nproc)]
    config_path = args.resume / "config.toml" if args.resume else args.config
    try:
        cfg = load_learner_config(config_path, overrides)
    except ConfigError as e:
        print(f"echo-learner: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dump_toml(cfg), end="")
        return 0
    if not (cfg.model.path / "config.json").exists():
        print(f"echo-learner: {cfg.model.path} is not a Hugging Face model directory. Build the demo model "
              f"with `echo-rl build-model --config {config_path}` or set [model] path.", file=sys.stderr)
        return 2
    if args.preflight or (cfg.run.nproc > 1 and not under_torchrun()):
        return _launch(cfg, argv, args.json, check_only=args.preflight)
    world = init_world(cfg.model.device)
    try:
        pf = preflight(cfg, world.size, str(world.device))
        if world.is_main and not os.environ.get(LAUNCHED) and not args.json:
            print("\n".join(pf.lines), flush=True)
        check_fits(pf, cfg, world.size)
    except PreflightError as e:
        print(f"echo-learner: {e}", file=sys.stderr)
        close(world)
        return 2
    if not world.is_main:
        return _follow(cfg, world, args.resume)
    learner = Learner(cfg, world, resume=args.resume, as_json=args.json)
    signal.signal(signal.SIGTERM, _interrupt)  # a polite kill stops the run like Ctrl-C
    try:
        return asyncio.run(learner.run())
    except KeyboardInterrupt:
        print(f"echo-learner: interrupted; the run directory {learner.run_dir} keeps the last checkpoint "
              f"(continue with --resume {learner.run_dir})", file=sys.stderr)
        return 130
    finally:
        learner.kill_workers()
        close(world)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _launch(cfg: LearnerConfig, argv: list[str], as_json: bool, check_only: bool) -> int:
    """Check the plan here (`--preflight` stops there), then run this same command as
    `[run] nproc` torchrun ranks."""
    try:
        pf = preflight(cfg, cfg.run.nproc, cfg.model.device if not cfg.model.device.startswith("cuda") else "cuda:0",
                       need_tokenizer=not check_only)
        if as_json and check_only:
            print(json.dumps({"parameters": pf.shape.params, "ranks": cfg.run.nproc, "available_bytes": pf.available,
                              "predicted_bytes": pf.plan.total, "predicted": vars(pf.plan)}))
        elif not as_json:
            print("\n".join(pf.lines), flush=True)
        check_fits(pf, cfg, cfg.run.nproc)
    except PreflightError as e:
        print(f"echo-learner: {e}", file=sys.stderr)
        return 2
    if check_only:
        return 0
    # --nproc would reach torchrun's own parser (a prefix of its --nproc-per-node): pass the config key.
    args = [a for i, a in enumerate(argv) if not (a.startswith("--nproc") or (i and argv[i - 1] == "--nproc"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cfg.run.nproc),
           "-m", "learner.main", *args, "--run.nproc", str(cfg.run.nproc)]
    env = {**os.environ, LAUNCHED: "1", "OMP_NUM_THREADS": str(cfg.run.threads), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # torchrun got the same Ctrl-C and stops its ranks
        return proc.wait()


def _follow(cfg: LearnerConfig, world: World, resume: Path | None) -> int:
    """Ranks 1..N-1: build the same trainer, then replay rank 0's calls until it says stop."""
    import torch

    from learner.train.trainer import Trainer

    torch.set_num_threads(cfg.run.threads)
    checkpoint = _latest_checkpoint(resume) if resume else None
    trainer = Trainer(cfg, world, checkpoint)
    Lockstep(trainer, world).follow()
    close(world)
    return 0


class Learner:
    def __init__(self, cfg: LearnerConfig, world: World | None = None, resume: Path | None = None,
                 as_json: bool = False):
        self.cfg = cfg
        self.world = world or World()
        self.as_json = as_json
        self.run_dir = resume or cfg.run.dir / f"{cfg.run.name}-{datetime.now():%Y%m%d-%H%M%S}"
        self.resume = resume
        # A resumed run keeps its token, so running workers can join it again by themselves.
        saved = self.run_dir / "token"
        self.token = cfg.server.token or os.environ.get("ECHO_TOKEN", "") or (
            saved.read_text().strip() if resume and saved.exists() else cfg.resolve_token())
        self.procs: list[subprocess.Popen] = []
        self.published_at: dict[int, float] = {}
        # One thread runs every trainer call, in order (collectives must not interleave), with the
        # rank's CUDA device current (a fresh thread would start on cuda:0).
        self.trainer_thread = ThreadPoolExecutor(1, thread_name_prefix="trainer", initializer=self.world.use_device)
        self.last_eval: EvalResult | None = None

    async def _on_trainer(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.trainer_thread, fn, *args)

    async def run(self) -> int:
        import torch

        from learner.train.trainer import Trainer

        cfg = self.cfg
        torch.set_num_threads(cfg.run.threads)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(dump_toml(cfg))
        token_file = self.run_dir / "token"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        checkpoint = _latest_checkpoint(self.run_dir) if self.resume else None
        trainer = await self._on_trainer(Trainer, cfg, self.world, checkpoint)
        drive = Lockstep(trainer, self.world)
        resumed = trainer.resumed
        task = cfg.task.build()
        evals = task.eval_prompts()[: cfg.eval.limit or None]

        # The custody record: a resumed run re-issues what was in flight and never reuses a version.
        recovery = Ledger.replay(self.run_dir / "ledger.jsonl", trainer.version) if self.resume else Recovery()
        self.ledger = Ledger(self.run_dir / "ledger.jsonl")
        if self.resume:
            self.ledger.resumed(trainer.version)
            # The checkpoint's own version was published with these very weights; later ones were lost.
            if recovery.newest_published > trainer.version:
                await self._on_trainer(drive.call, "skip_to", recovery.newest_published + 1)
        S, G = cfg.buffer.max_staleness, cfg.trainer.batch_prompts
        leases = LeaseBook(_unique_ids(task.train_prompts(cfg.run.seed + trainer.version), recovery.starts),
                           cfg.server.lease_ttl, cfg.server.max_inflight_prompts or (S + 1) * G,
                           retry=recovery.pending, on_lease=self.ledger.leased)
        buffer = AsyncBuffer(StalenessBuffer.from_section(
            cfg.buffer, G, seed=cfg.run.seed,
            on_drop=lambda group, reason: group.prompt and leases.recycle(group.prompt)))  # dropped: issue it again
        rescore = Rescorer(task, trainer.tokenizer, cfg.verify.reward_tolerance) if cfg.verify.rescore_fraction else None
        state = LearnerState(cfg, self.token, buffer, leases, trainer.encode, trainer.vocab_size, cfg.model.path,
                             rescore=rescore)
        state.learner_version = trainer.version
        log = RunLog(self.run_dir / "metrics.jsonl")
        on_workers = cfg.eval.where == "workers"

        runner = web.AppRunner(build_app(state), access_log=None)
        await runner.setup()
        port = cfg.server.port
        if self.resume and port == 0 and (self.run_dir / "url").exists():  # same address: workers come back
            port = int((self.run_dir / "url").read_text().strip().rsplit(":", 1)[1])
        site = web.TCPSite(runner, cfg.server.host, port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        url = f"http://{cfg.server.host}:{port}"
        reap = asyncio.create_task(reaper(state, min(1.0, cfg.server.lease_ttl / 4)))
        self.cost = CostMeter(cfg.scheduler.learner_price_per_hour)
        self.provider = self._make_provider(url) if cfg.scheduled else None
        if self.provider is not None:
            pool = load_pool(cfg.scheduler.pool) if cfg.scheduler.pool else None
            sc = cfg.scheduler
            state.fleet = Fleet(pool, self.provider, sc.controller_params(), batch=cfg.batch_rollouts,
                                publish_every=cfg.publish_every, max_staleness=cfg.buffer.max_staleness,
                                t_train_prior=sc.t_train_s, t_bcast_prior=sc.t_bcast_s, install_prior=sc.install_s,
                                launch_timeout_s=sc.launch_timeout_s, rule=sc.rule)

        b = cfg.broadcast
        self.publisher = Publisher(state.blobs, b.mode, chunk_bytes=int(b.chunk_mib * (1 << 20)), deltas=b.deltas,
                                   links=state.links, key_file=b.key_file or self.run_dir / "learner.key",
                                   host=cfg.server.host)
        source_url = await self.publisher.start()
        state.broadcast = {"mode": b.mode, "public_key": self.publisher.public_key, "source": source_url,
                           "fallback_s": b.fallback_s}

        I = cfg.publish_every
        display = StatusDisplay(cfg.run.steps, enabled=not self.as_json)
        ranks = f", {self.world.size} ranks (FSDP2)" if self.world.distributed else ""
        display.banner(
            f"echo-learner at {url}  run dir {self.run_dir}\n"
            f"  join: echo-worker join {url} --token {self.token}\n"
            f"  model {cfg.model.path} ({trainer.num_parameters / 1e6:.2f}M params{ranks}), "
            f"task {cfg.task.name}, B = {G}×{cfg.rollout.group_size} = {cfg.batch_rollouts} rollouts/step, "
            f"S = {S}, I = {I}, buffer {cfg.buffer.type}, eval on {cfg.eval.where} ({len(evals)} prompts)\n"
            f"  status: v = newest published snapshot, idle = share of wall time the trainer waited for data, "
            f"recycled = groups dropped as staler than S, queue = groups waiting, length = mean response tokens "
            f"of what workers sampled vs what was trained")
        (self.run_dir / "url").write_text(url + "\n")
        state.on_note = display.note
        if self.resume:
            display.note(f"resumed at update {trainer.version} (checkpoint {checkpoint.name if checkpoint else 'none'}): "
                         f"{len(recovery.pending)} prompts in flight or rolled back re-issued"
                         + (f", versions continue after v{recovery.newest_published}" if recovery.newest_published >= 0
                            else ""))

        first_acc = resumed.get("first_eval_accuracy")
        if on_workers:
            state.evals = EvalBook(evals, cfg.server.lease_ttl, cfg.eval.prompts_per_lease)

            def finished_round(result: EvalResult) -> None:
                nonlocal first_acc
                self.last_eval = result
                first_acc = result.accuracy if first_acc is None else first_acc
                self.cost.record_eval(result.accuracy)
                log.write({"event": "eval", "step": result.version, "eval_accuracy": result.accuracy,
                           "where": "workers", "prompts": result.prompts, "seconds": round(result.seconds, 3),
                           "workers": result.workers, "restarts": result.restarts})
                display.note(f"eval v{result.version}: {result.accuracy:.3f} ({result.prompts} prompts on "
                             f"{result.workers} worker{'s' if result.workers != 1 else ''}, {result.seconds:.1f} s"
                             + (f", {result.restarts} restarts" if result.restarts else "") + ")")

            state.on_eval = finished_round
        await self._publish(state, drive)
        if on_workers:
            state.evals.open(trainer.version, time.monotonic())
        else:
            acc0 = resumed.get("eval_accuracy")
            if acc0 is None:
                acc0 = await self._on_trainer(trainer.evaluate, task, evals)
            first_acc = resumed.get("first_eval_accuracy", acc0)
            self._learner_eval(trainer.version, acc0, state, log)
        last_eval_opened = trainer.version
        self._spawn_workers(url, cfg)
        watch = asyncio.create_task(self._watch_workers())
        schedule = asyncio.create_task(self._schedule(state, log, display)) if state.fleet else None

        t_start, waited = time.monotonic(), 0.0
        display.start(trainer.version)
        # Serving from here on: what start-up built (the model, torch, tokenizers: millions of
        # objects) stays out of the cyclic collector, whose full passes over it held the event
        # loop 100-160 ms (measured by `echo-rl bench control-plane`).
        gc.freeze()
        loopwatch.watch("echo-learner")
        try:
            while trainer.version < cfg.run.steps:
                t0 = time.monotonic()
                batch = await buffer.get_batch(trainer.version)
                t1 = time.monotonic()
                stats = await self._on_trainer(drive.call, "step", batch)
                t2 = time.monotonic()
                waited += t1 - t0
                state.learner_version = trainer.version
                self.ledger.trained(trainer.version, [g.prompt_id for g in batch.groups])
                self._check_logprobs(state, batch, stats.pop("group_gaps"))
                state.stepped()  # room in the buffer, and a new version to judge staleness by
                last = trainer.version == cfg.run.steps
                if trainer.version % I == 0 or last:
                    await self._publish(state, drive)
                    due = cfg.run.eval_every and trainer.version - last_eval_opened >= cfg.run.eval_every
                    if on_workers and (last or (due and state.evals.round is None)):
                        state.evals.open(trainer.version, time.monotonic())
                        state.changed()  # waiting workers holding this version can evaluate it
                        last_eval_opened = trainer.version
                record = self._record(trainer, batch, stats, state, wait=t1 - t0, train=t2 - t1,
                                      idle=waited / max(1e-9, time.monotonic() - t_start))
                record.update(self._account(state, wait=t1 - t0, train=t2 - t1))
                if not on_workers and (last or (cfg.run.eval_every and trainer.version % cfg.run.eval_every == 0)):
                    acc = record["eval_accuracy"] = await self._on_trainer(trainer.evaluate, task, evals)
                    self._learner_eval(trainer.version, acc, state, None)
                log.write(record)
                display.step(record, self.last_eval)
                if self.as_json:
                    print(json.dumps(record), flush=True)
                if cfg.run.checkpoint_every and trainer.version % cfg.run.checkpoint_every == 0 and not last:
                    await self._on_trainer(drive.call, "save_checkpoint", self.run_dir / "checkpoints",
                                           self._checkpoint_state(first_acc))
            if on_workers:  # the last version's eval: workers generate nothing else meanwhile
                state.training_done = True
                state.changed()
                await self._final_eval(state, trainer.version, display)
        finally:
            display.stop()
            state.finished = True
            state.changed()
            reap.cancel()
            watch.cancel()
            if schedule is not None:
                schedule.cancel()
        await self._on_trainer(drive.call, "save_checkpoint", self.run_dir / "checkpoints",
                               self._checkpoint_state(first_acc))
        await self._on_trainer(drive.call, "export", self.run_dir / "model")
        await self._on_trainer(drive.stop)
        await self._stop_workers(state, grace=2 * cfg.server.heartbeat_interval + 3)
        if self.provider is not None:
            await asyncio.to_thread(self.provider.close)  # waits for processes: not on the event loop
        await self.publisher.stop()
        await runner.cleanup()
        self.trainer_thread.shutdown()
        summary = self._summary(state, first_acc, time.monotonic() - t_start, waited)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        log.write({"event": "summary", **summary})
        log.close()
        if self.as_json:
            print(json.dumps(summary))
        else:
            display.summary(summary)
        return 0

    def _check_logprobs(self, state: LearnerState, batch, group_gaps: list[list[float]]) -> None:
        """Judge each worker's fresh groups by how far its μ lies from the trainer's π (learner.verify)."""
        per_worker: dict[str, list[float]] = {}
        for g, (gap, tokens) in zip(batch.groups, group_gaps):
            if tokens and g.worker_id:
                acc = per_worker.setdefault(g.worker_id, [0.0, 0])
                acc[0] += gap
                acc[1] += int(tokens)
        for wid, (gap, tokens) in per_worker.items():
            verdict = state.verifier.logprobs_checked(wid, gap, tokens)
            worker = state.workers.get(wid)
            if verdict is not None and worker is not None:
                state.quarantine(worker, verdict)

    def _learner_eval(self, version: int, accuracy: float, state: LearnerState, log: RunLog | None) -> None:
        """[eval] where = 'learner': an accuracy computed here between steps."""
        self.last_eval = EvalResult(version, accuracy, 0, 0.0, 0, 0)
        self.cost.record_eval(accuracy)
        state.metrics.eval_accuracy.set(accuracy)
        if log is not None:
            log.write({"event": "eval", "step": version, "eval_accuracy": accuracy, "where": "learner"})

    def _checkpoint_state(self, first_acc) -> dict:
        last = self.last_eval
        return {"eval_accuracy": last.accuracy if last else None, "eval_version": last.version if last else None,
                "first_eval_accuracy": first_acc}

    async def _final_eval(self, state: LearnerState, version: int, display) -> None:
        """Serve the workers until the last version's eval round is answered (or the timeout)."""
        deadline = time.monotonic() + self.cfg.eval.final_timeout_s
        while (self.last_eval is None or self.last_eval.version < version) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.last_eval is None or self.last_eval.version < version:
            r = state.evals.round
            answered = len(r.rewards) if r else 0
            display.note(f"eval of v{version} incomplete after {self.cfg.eval.final_timeout_s:.0f} s "
                         f"({answered}/{len(state.evals.prompts)} answered; are workers holding v{version}?)")

    async def _publish(self, state: LearnerState, drive: Lockstep) -> None:
        blob = await self._on_trainer(drive.call, "snapshot")
        version = drive.target.version
        self.published_at[version] = time.monotonic()
        self.ledger.published(version)
        workers = [w for w in state.alive_workers(time.monotonic()) if w.active]
        state.announcement = await self.publisher.publish(version, blob, workers)
        state.metrics.published.set(version)

    def _broadcast_times(self, state: LearnerState) -> dict[int, float]:
        """T_bcast of each version that `[broadcast] done_fraction` of the active workers have
        received (whole and verified): publication until the last of that fraction had it (or a
        newer one). Reception, not install: a worker installs between two batches, and the batch
        it drains meanwhile is rollout time, not broadcast time. Each version is reported once."""
        active = [w for w in state.alive_workers(time.monotonic()) if w.active and w.installs]
        fraction = self.cfg.broadcast.done_fraction
        done = {}
        for version, published in list(self.published_at.items()):
            # Workers that joined after the publication measure their start-up, not the broadcast.
            present = [w for w in active if w.joined <= published]
            arrivals = sorted(r - published for r in (next((r for v, _, r, _ in w.installs if v >= version), None)
                                                      for w in present) if r is not None)
            need = math.ceil(fraction * len(present) - 1e-9)
            if not present and time.monotonic() - published > 60:
                del self.published_at[version]  # nobody to measure it on
            elif present and len(arrivals) >= need:
                done[version] = max(0.0, arrivals[need - 1])
                del self.published_at[version]
        return done

    @staticmethod
    def _install_time(state: LearnerState) -> float | None:
        """τ: the median engine install time of the active workers' recent installs (seconds)."""
        times = [d for w in state.alive_workers(time.monotonic()) if w.active for _, _, _, d in w.installs[-5:] if d > 0]
        return statistics.median(times) if times else None

    def _account(self, state: LearnerState, *, wait: float, train: float) -> dict:
        """Cost of the step and the fleet's view of capacity (ECHO-2 §3, formulas.md §1)."""
        if state.fleet is not None:
            state.fleet.trained(train)
            prices = state.fleet.active_prices()
        else:
            prices = [w.price_per_hour for w in state.alive_workers(time.monotonic()) if w.active]
        cost = self.cost.step(train, wait, prices)
        out = {"dollars_step": round(cost.dollars, 8), "dollars_total": round(cost.cumulative, 6),
               "workers_price_per_hour": round(cost.workers_price, 4), "bubble": round(cost.bubble, 4)}
        for version in sorted(self.publisher.wire_bytes):  # bytes on the wire of what was published
            out["snapshot_bytes"] = {"version": version, **self.publisher.wire_bytes.pop(version)}
        bcast = self._broadcast_times(state)
        if bcast:
            out["t_bcast"] = round(max(bcast.values()), 4)
            state.metrics.t_bcast.set(out["t_bcast"])
            if state.fleet is not None:
                for t in bcast.values():
                    state.fleet.broadcast(t)
        install = self._install_time(state)
        if install is not None:
            out["install_s"] = round(install, 4)
            if state.fleet is not None:
                state.fleet.installed(install)
        active = [w for w in state.alive_workers(time.monotonic()) if w.active]
        out.update(capacity=round(sum(w.capacity_per_s for w in active), 3),  # rollouts per engine-busy second
                   delivered=round(sum(w.rollouts_per_s for w in active), 3))  # accepted rollouts per wall second
        if state.fleet is not None and state.fleet.status is not None:
            st = state.fleet.status
            out.update(r_req=round(st.r_req, 3), r_eff=round(st.r_eff, 3), active_workers=len(st.active),
                       binding=st.binding)
        return out

    def _make_provider(self, url: str):
        sc = self.cfg.scheduler
        if sc.provider == "local":
            return LocalProvider(url, self.token, self.cfg.workers.config, self.run_dir / "workers",
                                 self.cfg.workers.overrides, python=self.cfg.workers.python or sys.executable)
        if sc.provider == "command":
            return CommandProvider(sc.launch_command, sc.release_command, url, self.token, self.run_dir / "workers")
        return Provider()

    async def _schedule(self, state: LearnerState, log: RunLog, display) -> None:
        """The closed loop: every tick, re-evaluate the capacity rule and (de)activate workers."""
        while True:
            now = time.monotonic()
            try:
                st = state.fleet.tick(now)
            except Exception as e:  # a broken scheduler must not stop training; say so, keep going
                display.note(f"scheduler error: {e}")
                await asyncio.sleep(self.cfg.scheduler.tick_s)
                continue
            for w in state.workers.values():
                w.active = state.fleet.is_active(w.name)
            if st.infeasible and st.infeasible != getattr(self, "_said", ""):
                self._said = st.infeasible
                display.note(f"scheduler: {st.infeasible}; activating every available worker")
            for d in st.decisions:
                log.write({"event": "scheduler", "action": d.action, "worker": d.worker_id, "reason": d.reason,
                           "r_req": st.r_req, "r_eff": st.r_eff, "t_train": st.t_train, "t_bcast": st.t_bcast})
                display.note(f"scheduler: {d.action} {d.worker_id} ({d.reason})")
            await asyncio.sleep(self.cfg.scheduler.tick_s)

    def _record(self, trainer, batch, stats, state: LearnerState, *, wait, train, idle) -> dict:
        buf = state.buffer.buffer.metrics()
        now = time.monotonic()
        state.metrics.version.set(trainer.version)
        state.metrics.queue.set(buf["queue_size"])
        state.metrics.recycled.set(buf["recycled"])
        state.metrics.overflow.set(buf["dropped_overflow"])
        state.metrics.staleness_avg.set(batch.avg_staleness)
        state.metrics.staleness_max.set(batch.max_staleness)
        state.metrics.mismatch_kl.set(stats["mismatch_kl"])
        state.metrics.reward.set(stats["reward_mean"])
        state.metrics.idle.set(idle)
        return {
            "step": trainer.version, "time": round(time.time(), 3), "version": trainer.version,
            "published_version": state.published_version,
            **{k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items()},
            "avg_staleness": batch.avg_staleness, "max_staleness": batch.max_staleness,
            "staleness": batch.staleness, **batch.reuse_fields(), "recycled": buf["recycled"], "queue_size": buf["queue_size"],
            "dropped_overflow": buf["dropped_overflow"],
            "sampled_mean_length": round(buf["sampled_mean_length"], 4),
            "trained_mean_length": round(buf["trained_mean_length"], 4),
            "wait_s": round(wait, 4), "train_s": round(train, 4), "idle_ratio": round(idle, 4),
            "workers": len(state.alive_workers(now)), "leases_reissued": state.leases.stats.reissued,
            "dropped_reissued": state.leases.stats.dropped_reissued,
        }

    def _spawn_workers(self, url: str, cfg: LearnerConfig) -> None:
        logs = self.run_dir / "workers"
        logs.mkdir(exist_ok=True)
        for i in range(cfg.workers.spawn):
            cmd = [cfg.workers.python or sys.executable, "-m", "worker.main", "join", url, f"--token={self.token}",
                   "--config", str(cfg.workers.config), "--worker.name", f"local-{i}",
                   "--worker.seed", str(cfg.run.seed * 100 + i), *cfg.workers.overrides]
            out = open(logs / f"local-{i}.log", "w")
            self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                               env={**os.environ, "PYTHONUNBUFFERED": "1"}))

    async def _stop_workers(self, state: LearnerState, grace: float) -> None:
        """Keep serving until every live worker was told the run finished (410 or heartbeat), then
        terminate spawned stragglers."""
        deadline = time.monotonic() + grace

        def pending() -> bool:
            untold = any(not w.told_finished for w in state.alive_workers(time.monotonic()))
            return untold or any(p.poll() is None for p in self.procs)

        while pending() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

        def reap() -> None:  # waits on processes: a thread's job, not the event loop's
            for p in self.procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()

        await asyncio.to_thread(reap)

    def kill_workers(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    async def _watch_workers(self) -> None:
        """Say so when a spawned worker dies, with where to look."""
        reported: set[int] = set()
        while True:
            await asyncio.sleep(1.0)
            for i, p in enumerate(self.procs):
                if p.poll() not in (None, 0) and i not in reported:
                    reported.add(i)
                    print(f"echo-learner: local worker {i} exited with code {p.returncode}; "
                          f"see {self.run_dir / 'workers' / f'local-{i}.log'}", file=sys.stderr)

    def _summary(self, state: LearnerState, first_acc, wall, waited) -> dict:
        buf = state.buffer.buffer.metrics()
        rejected = {s.labels["reason"]: int(s.value) for m in state.metrics.rejected.collect()
                    for s in m.samples if s.name.endswith("_total")}
        return {
            "run_dir": str(self.run_dir), "steps": state.learner_version,
            "eval_accuracy_start": first_acc,
            "eval_accuracy_end": self.last_eval.accuracy if self.last_eval else None,
            "eval_version_end": self.last_eval.version if self.last_eval else None,
            "wall_s": round(wall, 1), "learner_idle_ratio": round(waited / max(wall, 1e-9), 3),
            "groups_trained": buf["trained"], "recycled": buf["recycled"],
            "dropped_overflow": buf["dropped_overflow"], "rejected": rejected,
            "leases_reissued": state.leases.stats.reissued, "dropped_reissued": state.leases.stats.dropped_reissued,
            "sampled_mean_length": round(buf["sampled_mean_length"], 3),
            "trained_mean_length": round(buf["trained_mean_length"], 3),
            "workers": [{"id": w.id, "name": w.name, "groups": w.groups_accepted} for w in state.workers.values()],
            "quarantined": [{"id": w.id, "name": w.name, "address": w.address, "why": w.quarantined}
                            for w in state.workers.values() if w.quarantined],
            "rewards_checked": state.verifier.checked, "rewards_mismatched": state.verifier.mismatched,
            "cost": self.cost.summary(),
        }


def _unique_ids(prompts, start: int = 0):
    """A task may repeat a prompt (epochs over a file); each issue gets its own id in this run
    (and in each of its starts, so a resumed run's ids never meet those it re-issues)."""
    prefix = f"r{start}." if start else ""
    for i, p in enumerate(prompts):
        yield Prompt(f"{prefix}{i}:{p.id}", p.text, p.answer)


def _latest_checkpoint(run_dir: Path) -> Path | None:
    latest = run_dir / "checkpoints" / "latest"
    return latest.resolve() if latest.exists() else None


if __name__ == "__main__":
    sys.exit(main())
