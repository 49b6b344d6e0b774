"""`echo-rl bench control-plane`: the learner's control API under a thousand workers.

Two processes, one core each. The **learner** is the real control plane (`learner.api`:
credentials, typed bodies, long-poll leases, uploads decoded and their rewards recomputed off
the loop, the custody ledger, the reaper) whose trainer is replaced by a loop that consumes one
batch every `1 / step_rate` seconds and publishes a snapshot each update: the benchmark
measures the control plane, not torch. The **workers** are simulated in the other process with
the real client (`worker.client.LearnerClient`): join, heartbeat at the configured interval,
long-poll a lease, "generate" for `gen_s`, upload real zstd-msgpack groups whose rewards are
right (the learner recomputes them). Every `churn_every` seconds a `churn` share of them is
killed without a word (their leases expire and are re-issued) and replaced by new joins.

Reported: p50/p99 latency per route (a lease's intentional long-poll wait, which the learner
reports, is subtracted: what remains is the route's own time), the learner's CPU, its largest
event-loop lag, memory, and the ledger: every group a worker saw acknowledged was trained,
dropped with a reason, or is still queued; none lost.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_TOKEN = "control-plane-bench-token"  # a run token of the strength the learner requires
GOALS = {"p99_ms": 250.0, "loop_lag_ms": 100.0}


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="echo-rl bench control-plane", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1000, help="simulated workers (default 1000)")
    p.add_argument("--seconds", type=float, default=60.0, help="measured duration (default 60)")
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="heartbeat interval (default 2, the learner's default)")
    p.add_argument("--churn", type=float, default=0.1, help="share of workers killed and replaced (default 0.1)")
    p.add_argument("--churn-every", type=float, default=10.0, help="seconds between kills (default 10)")
    p.add_argument("--step-rate", type=float, default=0.25,
                   help="batches the stand-in trainer consumes per second (default 0.25: a step every 4 s)")
    p.add_argument("--batch-prompts", type=int, default=256,
                   help="groups per batch (default 256 of 4 samples: 64 groups/s, what 1000 workers supply)")
    p.add_argument("--gen-s", type=float, default=12.0,
                   help="modelled generation time of one single-prompt lease (default 12 s, +-50%%)")
    p.add_argument("--ramp-s", type=float, default=5.0, help="the first workers join spread over this many seconds")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # internal: run the learner side in DIR
    args = p.parse_args(argv)
    _more_files()
    if args.serve:
        return asyncio.run(_serve(args))
    return asyncio.run(_drive(args))


# --- the learner side ----------------------------------------------------------------------------


async def _serve(args) -> int:
    from aiohttp import web

    from echo.config import load_config
    from echo import protocol as P
    from echo.tasks import load_task
    from learner.buffer import AsyncBuffer, StalenessBuffer
    from learner.config import LearnerConfig
    from learner.leases import LeaseBook, WorkerCap
    from learner.ledger import Ledger
    from broadcast.star import BlobStore
    from learner.api import ControlApi, Run
    from learner.ledger import unique_ids as _unique_ids
    from learner.verify import Rescorer

    d: Path = args.serve
    tokenizer = _tokenizer()
    cfg = load_config(LearnerConfig, None, [
        "--server.token", BENCH_TOKEN, "--server.heartbeat_interval", str(args.heartbeat_s),
        "--server.join_rate", str(max(20.0, args.workers / 10)), "--server.join_burst", str(args.workers),
        "--server.max_workers", str(4 * args.workers), "--rollout.group_size", "4", "--rollout.max_new_tokens", "4",
        # The simulated fleet shares one address (loopback): per-address limits would count it as one machine.
        "--server.max_workers_per_address", str(4 * args.workers),
        "--trainer.batch_prompts", str(args.batch_prompts), "--buffer.max_staleness", "2", "--publish.every", "1"])
    task = load_task("arith", {})
    ledger = Ledger(d / "ledger.jsonl")
    S, G = cfg.buffer.max_staleness, cfg.trainer.batch_prompts
    leases = LeaseBook(_unique_ids(task.train_prompts(0)), cfg.server.lease_ttl, (S + 1) * G, on_lease=ledger.leased,
                       per_worker=WorkerCap.of(cfg.server))
    buffer = AsyncBuffer(StalenessBuffer.from_section(cfg.buffer, G, on_drop=lambda g, why: leases.recycle(g.prompt)))
    run = Run(BlobStore(keep=cfg.publish.keep))
    api = ControlApi(cfg, BENCH_TOKEN, run=run, buffer=buffer, lease_book=leases,
                     encode=lambda prompt: tokenizer(prompt.text)["input_ids"], vocab_size=len(tokenizer), model_dir=d,
                     rescore=Rescorer(task, tokenizer, cfg.verify.reward_tolerance))
    blob = os.urandom(1 << 16)

    def publish(version: int) -> None:
        info = run.blobs.add(version, blob)
        run.announcement = P.Announcement(version=version, size=info.size, sha256=info.sha256)
        ledger.published(version)
        api.leases.changed()

    publish(0)
    runner = web.AppRunner(api.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    (d / "url").write_text(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    lags: list[float] = []

    async def lag_monitor() -> None:  # how late a 20 ms sleep wakes up = how long something held the loop
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.02)
            lags.append(time.perf_counter() - t - 0.02)

    steps = 0

    async def trainer() -> None:
        nonlocal steps
        while True:
            t0 = time.monotonic()
            batch = await buffer.get_batch(run.version)
            steps += 1
            run.version += 1
            ledger.trained(run.version, [g.prompt_id for g in batch.groups])
            publish(run.version)
            await asyncio.sleep(max(0.0, 1 / args.step_rate - (time.monotonic() - t0)))

    from echo import loopwatch

    loopwatch.watch("control-plane learner")  # with $ECHO_SLOW_CALLBACK_MS: name what holds the loop
    gc.freeze()  # as echo-learner does once serving: start-up's objects stay out of full collections
    tasks = [asyncio.create_task(c) for c in (api.reaper(1.0), lag_monitor(), trainer())]
    cpu0, wall0 = _cpu(), time.monotonic()
    await stop.wait()
    cpu, wall = _cpu() - cpu0, time.monotonic() - wall0
    for t in tasks:
        t.cancel()
    buf = buffer.buffer.metrics()
    workers = api.registry.workers
    rejected = {s.labels["reason"]: int(s.value) for m in api.metrics.rejected.collect() for s in m.samples
                if s.name.endswith("_total")}
    (d / "learner.json").write_text(json.dumps({
        "cpu_cores": cpu / wall, "loop_lag_max_ms": 1e3 * max(lags, default=0.0),
        "loop_lag_p99_ms": 1e3 * _pct(lags, 0.99), "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "steps": steps, "buffer": buf, "leases": vars(leases.stats), "workers_known": len(workers),
        "quarantined": sum(bool(w.quarantined) for w in workers.values()), "rejected": rejected,
        "joins_refused": {s.labels["reason"]: int(s.value) for m in api.metrics.joins_refused.collect()
                          for s in m.samples if s.name.endswith("_total")}}))
    await runner.cleanup()
    api.close()
    return 0


# --- the simulated workers -------------------------------------------------------------------------


class Fleet:
    def __init__(self, url: str, args, tokenizer):
        self.url, self.args, self.tokenizer = url, args, tokenizer
        self.latency: dict[str, list[float]] = {}
        self.acked = self.killed = self.errors = 0
        self.refused: dict[str, int] = {}
        self.tasks: list[asyncio.Task] = []
        self.stopping = False

    def timed(self, route: str, seconds: float) -> None:
        self.latency.setdefault(route, []).append(seconds)

    async def worker(self, session, name: str, delay: float = 0.0) -> None:
        from echo.wire import GroupMsg, SampleMsg, Submission
        from worker.client import LearnerClient, LearnerError

        from echo import protocol as P

        client = LearnerClient(session, self.url, BENCH_TOKEN)
        await asyncio.sleep(delay)
        while True:
            t = time.perf_counter()
            try:
                joined = await client.join(P.Report(name=name))
                self.timed("join", time.perf_counter() - t)
                break
            except LearnerError as e:
                if e.status not in (429, 503):
                    raise
                await asyncio.sleep(max(1.0, e.retry_after) * random.uniform(1, 1.5))
        version = joined.snapshot.version if joined.snapshot is not None else 0

        async def beat() -> None:
            await asyncio.sleep(random.uniform(0, joined.heartbeat_interval))
            while True:
                t = time.perf_counter()
                await client.heartbeat(P.Report(name=name, version=version))
                self.timed("heartbeat", time.perf_counter() - t)
                await asyncio.sleep(joined.heartbeat_interval)

        beats = asyncio.create_task(beat())
        try:
            while True:
                t = time.perf_counter()
                lease = await client.lease(1, version, wait_s=joined.long_poll_s)
                self.timed("lease" if lease.lease_id else "lease (empty)", time.perf_counter() - t - lease.waited_s)
                if lease.snapshot is not None:
                    version = lease.snapshot.version
                if lease.lease_id is None:
                    if lease.empty == "install":  # "download and install" the announced version
                        await asyncio.sleep(random.uniform(0.5, 1.5))
                    continue
                await asyncio.sleep(self.args.gen_s * random.uniform(0.5, 1.5))  # "generating"
                groups = []
                for p in lease.prompts:
                    right = self.tokenizer(p.answer, add_special_tokens=False)["input_ids"]
                    wrong = self.tokenizer("+", add_special_tokens=False)["input_ids"]
                    groups.append(GroupMsg(p.id, lease.snapshot.version, [
                        SampleMsg(ids, [-0.5] * len(ids), reward) for ids, reward in
                        ((right, 1.0), (wrong, 0.0), (right, 1.0), (wrong, 0.0))]))
                t = time.perf_counter()
                try:
                    reply = await client.submit(Submission(client.worker_id, lease.lease_id, groups))
                    self.acked += reply.accepted
                except LearnerError as e:  # e.g. a group gone stale while "generating": counted by reason
                    self.refused[e.reason] = self.refused.get(e.reason, 0) + 1
                self.timed("trajectories", time.perf_counter() - t)
        finally:
            beats.cancel()

    async def run(self) -> None:
        import aiohttp

        a = self.args
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            def start(i: int, delay: float = 0.0) -> None:
                task = asyncio.create_task(self.worker(session, f"sim-{i}", delay))
                task.add_done_callback(self._done)
                self.tasks.append(task)

            for i in range(a.workers):  # a fleet comes up over seconds, not in one millisecond
                start(i, random.uniform(0, a.ramp_s))
            end, next_kill, n = time.monotonic() + a.seconds, time.monotonic() + a.churn_every, a.workers
            while time.monotonic() < end:
                await asyncio.sleep(min(0.5, max(0.0, end - time.monotonic())))
                if time.monotonic() >= next_kill:
                    next_kill += a.churn_every
                    alive = [t for t in self.tasks if not t.done()]
                    for t in random.sample(alive, int(a.churn * len(alive))):
                        t.cancel()  # killed mid-whatever: no goodbye, its leases expire
                        self.killed += 1
                        start(n)
                        n += 1
            self.stopping = True
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)

    def _done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and not self.stopping:
            self.errors += 1
            print(f"simulated worker failed: {task.exception()!r}", file=sys.stderr)


async def _drive(args) -> int:
    with tempfile.TemporaryDirectory(prefix="echo-control-bench-") as tmp:
        d = Path(tmp)
        (d / "config.json").write_text("{}")
        log = d / "learner.log"
        learner = subprocess.Popen([sys.executable, "-m", "learner.bench.control_plane", "--serve", str(d),
                                    *_forward(args)], stderr=log.open("w"))
        while not (d / "url").exists():
            if learner.poll() is not None:
                print(f"echo-rl bench control-plane: the learner side failed:\n{log.read_text()}", file=sys.stderr)
                return 1
            await asyncio.sleep(0.1)
        fleet = Fleet((d / "url").read_text(), args, _tokenizer())
        print(f"{args.workers} simulated workers for {args.seconds:.0f} s against the control plane "
              f"(the trainer is a stand-in consuming {args.step_rate:g} batches/s of {args.batch_prompts} groups)...",
              file=sys.stderr, flush=True)
        cpu0 = _cpu()
        await fleet.run()
        client_cpu = (_cpu() - cpu0) / args.seconds
        learner.send_signal(signal.SIGTERM)
        await asyncio.to_thread(learner.wait, 60)
        server = json.loads((d / "learner.json").read_text())
        slow = [line for line in log.read_text().splitlines() if line.startswith(("SLOW", "preempted"))]
        if slow:
            print("\n".join(slow[:20]), file=sys.stderr)
    out = _results(args, fleet, server, client_cpu)
    print(json.dumps(out, indent=2) if args.json else _table(out))
    return 0


def _forward(args) -> list[str]:
    return ["--workers", str(args.workers), "--heartbeat-s", str(args.heartbeat_s), "--step-rate", str(args.step_rate),
            "--batch-prompts", str(args.batch_prompts)]


def _results(args, fleet: Fleet, server: dict, client_cpu: float) -> dict:
    buf = server["buffer"]
    dropped = buf["recycled"] + buf["dropped_overflow"] + buf.get("dropped_untrusted", 0)
    accounted = buf["trained"] + dropped + buf["queue_size"]
    routes = {route: {"requests": len(xs), "p50_ms": 1e3 * _pct(xs, 0.5), "p99_ms": 1e3 * _pct(xs, 0.99),
                      "max_ms": 1e3 * max(xs)} for route, xs in sorted(fleet.latency.items())}
    return {
        "workers": args.workers, "seconds": args.seconds, "heartbeat_s": args.heartbeat_s,
        "killed_and_replaced": fleet.killed, "routes": routes,
        "learner": {k: server[k] for k in ("cpu_cores", "loop_lag_max_ms", "loop_lag_p99_ms", "max_rss_mb", "steps",
                                            "workers_known", "quarantined", "rejected", "joins_refused")},
        "client_cpu_cores": client_cpu, "client_errors": fleet.errors, "uploads_refused": fleet.refused,
        "ledger": {"acknowledged_to_workers": fleet.acked, "accepted_by_learner": buf["accepted"],
                   "trained": buf["trained"], "dropped": dropped, "queued": buf["queue_size"],
                   "lost": buf["accepted"] - accounted, "unacknowledged_beyond_learner": fleet.acked - buf["accepted"],
                   "leases_expired_prompts": server["leases"]["expired_prompts"]},
        "goals": GOALS,
    }


def _table(out: dict) -> str:
    from echo.table import fmt, table

    rows = [[route, str(r["requests"]), fmt(r["p50_ms"]), fmt(r["p99_ms"]), fmt(r["max_ms"]),
             "yes" if r["p99_ms"] < GOALS["p99_ms"] else "NO"] for route, r in out["routes"].items()]
    lr, lg = out["learner"], out["ledger"]
    lines = [f"control plane: {out['workers']} workers, {out['seconds']:.0f} s, heartbeats every {out['heartbeat_s']:g} s, "
             f"{out['killed_and_replaced']} killed and replaced; the trainer is a stand-in consuming batches at a fixed rate",
             table(["route", "requests", "p50 ms", "p99 ms", "max ms", f"p99 < {GOALS['p99_ms']:.0f} ms"], rows),
             "  (lease: the route's own time; the long-poll wait the learner reports is subtracted)",
             f"learner: {lr['cpu_cores']:.2f} cores, event-loop lag max {lr['loop_lag_max_ms']:.0f} ms "
             f"(p99 {lr['loop_lag_p99_ms']:.0f} ms; goal < {GOALS['loop_lag_ms']:.0f}), max RSS {lr['max_rss_mb']:.0f} MB, "
             f"{lr['steps']} batches trained, {lr['workers_known']} workers known, {lr['quarantined']} quarantined",
             f"simulated workers: {out['client_cpu_cores']:.2f} cores, {out['client_errors']} errors, "
             f"uploads refused: {out['uploads_refused'] or 'none'}",
             f"ledger: {lg['acknowledged_to_workers']} groups acknowledged to workers, {lg['accepted_by_learner']} accepted "
             f"= {lg['trained']} trained + {lg['dropped']} dropped + {lg['queued']} queued; lost: {lg['lost']}; "
             f"{lg['leases_expired_prompts']} prompts of killed workers' leases re-issued"]
    return "\n".join(lines)


def _tokenizer():
    from learner.tinymodel import build_tokenizer

    return build_tokenizer()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    return statistics.quantiles(xs, n=100, method="inclusive")[min(98, int(q * 100) - 1)] if len(xs) > 1 else xs[0]


def _more_files() -> None:
    """A thousand connections need more descriptors than the usual soft limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
