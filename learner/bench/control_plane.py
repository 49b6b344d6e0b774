"""`echo-rl bench control-plane`: the learner's control API under a thousand workers.

The learner on a core of its own, the clients on the others, every process started anew for
each run (none inherits another run's state). The **learner** is the real control plane
(`learner.api`: credentials, typed bodies, long-poll leases, uploads decoded and their rewards
recomputed off the loop, the custody ledger, the reaper) whose trainer is replaced by a loop
that consumes one batch every `1 / step_rate` seconds and publishes a snapshot each update: the
benchmark measures the control plane, not torch. The **workers** are simulated in two processes
(the big fleet, and `--probes` light ones whose latency is the one judged) with the real client
(`worker.client.LearnerClient`): join, heartbeat at the configured interval, long-poll a lease,
"generate" for `gen_s`, upload real zstd-msgpack groups whose rewards are right (the learner
recomputes them). A `churn` share of them dies every `churn_every` seconds, one at a time as
machines do, without a word (their leases expire and are re-issued), each replaced by a new
join.

Reported: p50/p99 latency per route (a lease's intentional long-poll wait, which the learner
reports, is subtracted: what remains is the route's own time), the learner's CPU, its largest
event-loop lag, memory, and the ledger: every group a worker saw acknowledged was trained,
dropped with a reason, or is still queued; none lost.

`--hostile F` (issue #18): a benign run, then the same run with a share `F` of the workers
attacking the learner instead of training (`learner.bench.attacks`, a third process, each
attacker from loopback addresses of its own as a rented machine would be). Versions are then
served in chain mode in both runs, so the broadcast source's routes are there to be attacked.
The table compares the honest fleet's p99 per route and the trained groups per minute with the
benign run's, and the learner's peak RSS; and judges the attacks' outcomes: refused, never a
5xx, no weight byte without the read right, hoarders held to their window, forgers quarantined.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

from echo.procs import more_files
from learner.bench import tails

_CORES = sorted(os.sched_getaffinity(0))  # the machine's, before any pinning

BENCH_TOKEN = "control-plane-bench-token"  # a run token of the strength the learner requires
GOALS = {"p99_ms": 250.0, "loop_lag_ms": 100.0}
# --hostile: what the honest fleet may lose to the attackers, against the benign runs beside them (issue #18)
HOSTILE_GOALS = {"p99_ratio": 1.10, "groups_ratio": 0.90, "rss_growth": 0.02}


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="echo-rl bench control-plane", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1000, help="simulated workers (default 1000)")
    p.add_argument("--seconds", type=float, default=60.0, help="measured duration (default 60)")
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="heartbeat interval (default 2, the learner's default)")
    p.add_argument("--churn", type=float, default=0.1,
                   help="share of workers killed and replaced every --churn-every seconds, one at a time (default 0.1)")
    p.add_argument("--churn-every", type=float, default=10.0,
                   help="seconds in which a --churn share of the workers dies (default 10)")
    p.add_argument("--step-rate", type=float, default=0.25,
                   help="batches the stand-in trainer consumes per second (default 0.25: a step every 4 s)")
    p.add_argument("--batch-prompts", type=int, default=256,
                   help="groups per batch (default 256 of 4 samples: 64 groups/s, what 1000 workers supply)")
    p.add_argument("--gen-s", type=float, default=12.0,
                   help="modelled generation time of one single-prompt lease (default 12 s, +-50%%)")
    p.add_argument("--ramp-s", type=float, default=5.0, help="the first workers join spread over this many seconds")
    p.add_argument("--hostile", type=float, default=0.0,
                   help="share of the workers that attack the learner (learner.bench.attacks) instead of training, "
                        "e.g. 0.05; a benign run of the same size comes first, and the table compares the two")
    p.add_argument("--attacks", default="all",
                   help="with --hostile: the attack classes to run, comma-separated (default all: "
                        "see learner/bench/attacks.py), e.g. to tell what one of them costs")
    p.add_argument("--broadcast", choices=("star", "chain"),
                   help="how versions are served: star (the default) or chain, where the broadcast source runs "
                        "too (the default with --hostile, so that its routes are attacked)")
    p.add_argument("--pairs", type=int, default=1,
                   help="with --hostile: this many pairs of a benign and a hostile run, in the order B H H B B H ... (a "
                        "drift of the machine over the runs falls on both arms alike); the ratios "
                        "are the median over pairs, and the benign runs against each other give the machine's own noise")
    p.add_argument("--interleave", type=float, metavar="W",
                   help="with --hostile: instead of benign and hostile runs, one run in which the attackers' process "
                        "is paused and resumed every W seconds (SIGSTOP/SIGCONT, windows B H H B ...), e.g. 30: both "
                        "arms share one learner process and the same minutes, so the machine's drift from run to "
                        "run is out of the comparison. A pair of windows stands for a pair of runs; the probes "
                        "churn too, so that joins come all along")
    p.add_argument("--guard", type=float, default=5.0,
                   help="with --interleave: the probes' requests that end in the first GUARD seconds after a "
                        "switch are left out (an attack's aftermath, or a resumed attacker's backlog; default 5)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin the learner to a core of its own (default: pinned, the clients on the others, "
                        "so that what the attackers' processes burn is not taken from the learner)")
    p.add_argument("--probes", type=int, default=100,
                   help="of the honest workers, how many run in a light process of their own (default 100, at most a "
                        "quarter of the honest fleet): their "
                        "latency is the one judged, as a worker on its own machine sees it; the big fleet's process "
                        "adds its own queueing to what it measures")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="keep each run's raw data in DIR/<n>-<benign|hostile>/: every probe request's end time and "
                        "latency, the learner's loop stalls and steps in time, the logs (to look for what sets a tail)")
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # internal: run the learner side in DIR
    p.add_argument("--probe", help=argparse.SUPPRESS)  # internal: run the probes against URL, results to --out
    p.add_argument("--fleet", help=argparse.SUPPRESS)  # internal: run the big fleet against URL, results to --out
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)  # internal: how many workers --probe/--fleet runs
    p.add_argument("--churn-probes", action="store_true", help=argparse.SUPPRESS)  # internal: --interleave's probes
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from learner.bench.attacks import CLASSES

    unknown = set(args.attacks.split(",")) - {*CLASSES, "all"}
    if unknown:
        p.error(f"--attacks: unknown classes {sorted(unknown)}; choose from {', '.join(CLASSES)}")
    if args.interleave is not None:
        if not args.hostile:
            p.error("--interleave switches attackers on and off: give --hostile too, e.g. --hostile 0.05")
        if args.pairs > 1:
            p.error("--interleave is one run whose pairs of windows stand for pairs of runs: leave out --pairs")
        if not 0 <= args.guard < args.interleave:
            p.error(f"--guard must be at least 0 and shorter than a window (--interleave {args.interleave:g} s)")
        if args.seconds < 6 * args.interleave:
            p.error(f"--interleave {args.interleave:g}: give --seconds at least {6 * args.interleave:g} "
                    "(the first two windows are the ramp, left out; two pairs at least are judged)")
    more_files()
    if args.serve:
        from echo import serving

        return serving.run(_serve(args))  # as echo-learner runs
    if args.probe or args.fleet:
        return asyncio.run(_clients(args, args.probe or args.fleet, "probe" if args.probe else "sim"))
    return asyncio.run(_drive(args))


# --- the learner side ----------------------------------------------------------------------------


async def _serve(args) -> int:
    from aiohttp import web

    from echo.config import load_config
    from echo.tasks import load_task
    from learner.buffer import AsyncBuffer, StalenessBuffer
    from learner.config import LearnerConfig
    from learner.leases import LeaseBook, WorkerCap
    from learner.ledger import Ledger
    from broadcast.star import BlobStore
    from learner.api import ControlApi, Run, link_table
    from learner.ledger import unique_ids as _unique_ids
    from learner.publisher import make_publisher
    from learner.verify import Rescorer

    d: Path = args.serve
    tokenizer = _tokenizer()
    cfg = load_config(LearnerConfig, None, [
        "--server.token", BENCH_TOKEN, "--server.heartbeat_interval", str(args.heartbeat_s),
        "--server.join_rate", str(max(20.0, args.workers / 10)), "--server.join_burst", str(args.workers),
        "--server.max_workers", str(4 * args.workers), "--rollout.group_size", "4",
        # A real run's token budget, so that what an upload may inflate to (and an attacker's bomb costs) is a real one's
        "--rollout.max_new_tokens", "2048",
        # The honest simulated fleet shares one address (127.0.0.1): per-address limits would count it as one
        # machine. Attackers (--hostile) come from addresses of their own, where the defaults apply.
        "--server.max_workers_per_address", str(4 * args.workers),
        "--trainer.batch_prompts", str(args.batch_prompts), "--buffer.max_staleness", "2", "--publish.every", "1",
        "--broadcast.mode", args.broadcast])
    task = load_task("arith", {})
    ledger = Ledger(d / "ledger.jsonl")
    S, G = cfg.buffer.max_staleness, cfg.trainer.batch_prompts
    leases = LeaseBook(_unique_ids(task.train_prompts(0)), cfg.server.lease_ttl, (S + 1) * G, on_lease=ledger.leased,
                       per_worker=WorkerCap.of(cfg.server))
    buffer = AsyncBuffer(StalenessBuffer.from_section(cfg.buffer, G, on_drop=lambda g, why: leases.recycle(g.prompt),
                                                      skip_uniform=cfg.dynamic_sampling,  # as echo-learner's
                                                      on_skip=lambda g: ledger.trained(run.version, [g.prompt_id])))
    run = Run(BlobStore(keep=cfg.publish.keep))
    # chain (with --hostile): the broadcast source runs too, so its routes are there to be attacked
    links = link_table(cfg.broadcast)
    publisher = make_publisher(cfg.broadcast, run.blobs, links, key_file=d / "learner.key", host="127.0.0.1")
    await publisher.start()
    api = ControlApi(cfg, BENCH_TOKEN, run=run, buffer=buffer, lease_book=leases, links=links,
                     encode=lambda prompt: tokenizer(prompt.text)["input_ids"], vocab_size=len(tokenizer), model_dir=d,
                     rescore=Rescorer(task, tokenizer, cfg.verify.reward_tolerance), broadcast=publisher.info,
                     tickets=publisher.tickets, placements=getattr(publisher, "forwarding", None))

    async def publish(version: int) -> None:
        blob = os.urandom(1 << 16)  # each version its own bytes, as weights are
        run.announcement = await publisher.publish(version, blob, list(api.registry.workers.values()))
        run.routed = getattr(publisher, "routed", None)  # as `learner.publishing` does
        ledger.published(version)

    await publish(0)
    runner = api.runner()
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    (d / "url").write_text(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    lags = array("d")
    t_start = time.monotonic()
    events: dict[str, list] = {"stall": [], "step": []}  # (s from the start, ...) for --keep

    async def lag_monitor() -> None:  # how late a 20 ms sleep wakes up = how long something held the loop
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.02)
            lags.append(time.perf_counter() - t - 0.02)
            if lags[-1] > 0.005:
                events["stall"].append((round(time.monotonic() - t_start, 3), round(1e3 * lags[-1], 1)))

    rss: list[float] = []

    most_held: dict[str, int] = {}

    async def rss_monitor() -> None:  # resident memory once a second: does an attack make it grow?
        page = os.sysconf("SC_PAGE_SIZE")
        while True:
            with open("/proc/self/statm") as f:
                rss.append(int(f.read().split()[1]) * page / (1 << 20))
            for wid, n in leases.outstanding_by_worker().items():  # the most each worker held at once, sampled
                most_held[wid] = max(most_held.get(wid, 0), n)
            await asyncio.sleep(1.0)

    steps = 0

    async def trainer() -> None:
        nonlocal steps
        while True:
            t0 = time.monotonic()
            batch = await buffer.get_batch(run.version)
            steps += 1
            run.version += 1
            ledger.trained(run.version, [g.prompt_id for g in batch.groups])
            api.leases.stepped()  # as echo-learner's loop: the room freed, and who must install
            t1 = time.monotonic()
            await publish(run.version)
            api.leases.published()
            events["step"].append((round(t1 - t_start, 3), round(1e3 * (time.monotonic() - t1), 1)))
            await asyncio.sleep(max(0.0, 1 / args.step_rate - (time.monotonic() - t0)))

    from echo import collector, serving

    tasks = [serving.start("control-plane learner")]  # as echo-learner's loop does once serving
    pauses = collector.Pauses()  # how long collections held the loop, reported with its lag
    tasks += [asyncio.create_task(c) for c in (api.reaper(1.0), lag_monitor(), rss_monitor(), trainer())]
    cpu0, wall0 = _cpu(), time.monotonic()
    traced = None
    if os.environ.get("ECHO_TRACE_MEMORY"):  # where memory grows after the first minute (slow: diagnosis only)
        import tracemalloc

        tracemalloc.start(8)
        await asyncio.sleep(60.0)
        traced = tracemalloc.take_snapshot()
    await stop.wait()
    if traced is not None:
        grown = tracemalloc.take_snapshot().compare_to(traced, "traceback")[:12]
        print("\n".join(f"GROWN {s.size_diff / 1024:+.0f} KiB in {s.count_diff:+d} blocks at\n  "
                        + "\n  ".join(s.traceback.format()[-6:]) for s in grown), file=sys.stderr)
    cpu, wall = _cpu() - cpu0, time.monotonic() - wall0
    for t in tasks:
        t.cancel()
    buf = buffer.buffer.metrics()
    workers = api.registry.workers
    (d / "learner.json").write_text(json.dumps({
        "cpu_cores": cpu / wall, "loop_lag_max_ms": 1e3 * max(lags, default=0.0),
        "loop_lag_p99_ms": 1e3 * _pct(lags, 0.99), "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "steps": steps, "buffer": buf, "leases": vars(leases.stats), "workers_known": len(workers),
        "quarantined": sum(bool(w.quarantined) for w in workers.values()),
        "rejected": _counts(api.metrics.rejected, "reason"), "joins_refused": _counts(api.metrics.joins_refused, "reason"),
        **_by_kind(workers.values(), leases.outstanding_by_worker(), most_held),
        "max_inflight_prompts": leases.max_outstanding, "lease_first_prompts": cfg.server.lease_first_prompts,
        "relays_probed": _counts(api.metrics.relays_probed, "result"),  # a relay URL that made the learner connect
        "auth_refused": _counts(api.metrics.auth_refused, "credential"),
        "rss_mb": {"first": rss[0] if rss else 0.0, "peak": max(rss, default=0.0), "last": rss[-1] if rss else 0.0,
                   "half": rss[len(rss) // 2] if rss else 0.0},
        "gc": pauses.summary(), "events": events, "t0": t_start}))
    await publisher.stop()
    await runner.cleanup()
    api.close()
    return 0


def _counts(counter, label: str) -> dict[str, int]:
    return {s.labels[label]: int(s.value) for m in counter.collect() for s in m.samples if s.name.endswith("_total")}


def _by_kind(workers, held: dict[str, int], most_held: dict[str, int]) -> dict[str, dict[str, int]]:
    """What the hostile run is judged by, per kind of simulated worker (named `<kind>-<n>`: sim,
    the honest; hostile; forger): who was quarantined (an honest one is a false alarm), the
    prompts each kind holds in leases at the end, and the most one worker of it held at once
    (`most_held`: sampled every second over the run)."""
    out: dict[str, dict[str, int]] = {"quarantined_by_kind": {}, "leased_by_kind": {}, "max_leased_by_kind": {}}
    for w in workers:
        kind, n = w.name.rsplit("-", 1)[0], held.get(w.id, 0)
        out["quarantined_by_kind"][kind] = out["quarantined_by_kind"].get(kind, 0) + bool(w.quarantined)
        out["leased_by_kind"][kind] = out["leased_by_kind"].get(kind, 0) + n
        out["max_leased_by_kind"][kind] = max(out["max_leased_by_kind"].get(kind, 0), n, most_held.get(w.id, 0))
    return out


# --- the simulated workers -------------------------------------------------------------------------


async def _clients(args, url: str, prefix: str) -> int:
    """Simulated workers in a process of their own, a new one for every run: the probes
    (`--probes` of them, no churn: what they measure is the learner's answer, not the big fleet's
    queueing) or the big fleet. Fresh per run, so that no run inherits another's state: with the
    fleet in the long-lived driver, every later run's fleet-side p99 was 10-15x the first run's,
    and the learner's loop stalled over 5 ms twice as often as in the first run, benign or not.
    Starts when the driver says "go" (after "ready"); results: JSON to --out."""
    from echo import collector

    probe = prefix == "probe"
    if probe and not args.churn_probes:
        args.churn = 0.0
    fleet = Fleet(url, args, _tokenizer(), args.size, prefix=prefix)
    collector.serve()  # as a worker's machine would, its own collector: passes on a clock, not on the fleet's allocations
    collecting = asyncio.create_task(collector.collections())
    print("ready", flush=True)
    if await asyncio.to_thread(sys.stdin.readline) != "go\n":
        return 1
    cpu0 = _cpu()
    await fleet.run()
    collecting.cancel()
    args.out.write_text(json.dumps({"size": fleet.size, "latency": fleet.latency, "at": fleet.at, "t0": fleet.t0,
                                    "acked": fleet.acked, "errors": fleet.errors, "refused": fleet.refused,
                                    "killed": fleet.killed, "cpu_cores": (_cpu() - cpu0) / args.seconds}))
    return 0


class Fleet:
    def __init__(self, url: str, args, tokenizer, size: int, prefix: str = "sim"):
        self.url, self.args, self.tokenizer, self.size = url, args, tokenizer, size  # size: honest workers at once
        self.prefix = prefix  # the workers' names: <prefix>-<n>
        self.latency: dict[str, list[float]] = {}
        self.at: dict[str, list[float]] = {}  # per route, when each timed request ended (s from the start)
        self.t0 = time.monotonic()
        self.acked = self.killed = self.errors = 0
        self.refused: dict[str, int] = {}
        self.tasks: list[asyncio.Task] = []
        self.stopping = False

    def timed(self, route: str, seconds: float) -> None:
        self.latency.setdefault(route, []).append(seconds)
        self.at.setdefault(route, []).append(time.monotonic() - self.t0)

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
            self.t0 = time.monotonic()

            def start(i: int, delay: float = 0.0) -> None:
                task = asyncio.create_task(self.worker(session, f"{self.prefix}-{i}", delay))
                task.add_done_callback(self._done)
                self.tasks.append(task)

            for i in range(self.size):  # a fleet comes up over seconds, not in one millisecond
                start(i, random.uniform(0, a.ramp_s))
            # Machines fail one by one, not a tenth of the fleet in the same millisecond: kills
            # come at the rate `churn` per `churn_every` asks, spread over time (a kill every
            # 0.1 s or so for a thousand workers), each replaced by a join at once.
            end, last, due, n = time.monotonic() + a.seconds, time.monotonic(), 0.0, self.size
            while time.monotonic() < end:
                await asyncio.sleep(min(0.1, max(0.0, end - time.monotonic())))
                now = time.monotonic()
                alive = [t for t in self.tasks if not t.done()] if a.churn else []
                due += a.churn * len(alive) * (now - last) / a.churn_every
                last = now
                for t in random.sample(alive, min(int(due), len(alive))):
                    t.cancel()  # killed mid-whatever: no goodbye, its leases expire
                    self.killed += 1
                    due -= 1
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


@dataclass
class Measured:
    """One run: the honest fleet's view, the learner's, and the attackers' (None in a benign run)."""

    fleet: dict  # the big fleet's latencies and counts (`_clients`)
    server: dict
    attacks: dict | None
    load: float  # the machine's 1-minute load average at the end
    probes: dict  # the probe workers' (`_clients`)
    windows: list[tuple[float, bool]]  # --interleave: each window's start (time.monotonic) and whether attacked


async def _measure(args, hostile: int, broadcast: str, switch: float | None = None) -> Measured | None:
    """Serve a learner, run the honest fleet, the probes (and `hostile` attackers) against it, each
    a process of its own started for this run alone; `switch`: the attackers paused and resumed
    every `switch` seconds (`--interleave`)."""
    learner_core, client_cores = _placement(args)
    with tempfile.TemporaryDirectory(prefix="echo-control-bench-") as tmp:
        d = Path(tmp)
        (d / "config.json").write_text("{}")
        procs: dict[str, subprocess.Popen] = {}

        def start(role: str, argv: list[str], cores: set[int] | None, *, nice: int = 0, realtime: bool = False,
                  pipe: bool = True) -> subprocess.Popen:
            def placed() -> None:  # in the child, before it starts: every thread it makes inherits it
                if cores:
                    os.sched_setaffinity(0, cores)
                if nice:
                    os.nice(nice)
                if realtime:
                    _first_in_line()

            procs[role] = subprocess.Popen([sys.executable, "-m", *argv], preexec_fn=placed, text=True,
                                           stdin=subprocess.PIPE if pipe else None,
                                           stdout=subprocess.PIPE if pipe else None,
                                           stderr=(d / f"{role}.log").open("w"))
            return procs[role]

        def failed(role: str) -> None:
            print(f"echo-rl bench control-plane: the {role} side failed:\n{(d / f'{role}.log').read_text()}",
                  file=sys.stderr)
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()

        learner = start("learner", ["learner.bench.control_plane", "--serve", str(d), "--broadcast", broadcast,
                                    *_forward(args)], learner_core, pipe=False)
        while not (d / "url").exists():
            if learner.poll() is not None:
                failed("learner")
                return None
            await asyncio.sleep(0.1)
        url = (d / "url").read_text()
        probes = max(1, min(args.probes, (args.workers - hostile) // 4))
        run = [*_forward(args), "--seconds", str(args.seconds), "--ramp-s", str(args.ramp_s), "--gen-s",
               str(args.gen_s), "--churn", str(args.churn), "--churn-every", str(args.churn_every),
               *(["--churn-probes"] if switch else [])]
        start("fleet", ["learner.bench.control_plane", "--fleet", url, "--size", str(args.workers - hostile - probes),
                        "--out", str(d / "fleet.json"), *run], client_cores)
        # The probes are woken the moment a reply lands, as a worker alone on its machine is
        start("probes", ["learner.bench.control_plane", "--probe", url, "--size", str(probes),
                         "--out", str(d / "probes.json"), *run], client_cores, realtime=bool(client_cores))
        if hostile:
            # Rented attackers are other machines: here they share the honest fleet's core, and must
            # not take its CPU, or the honest latency would be the client's own queueing behind them.
            start("attacks", ["learner.bench.attacks", "--url", url, "--token", BENCH_TOKEN, "--workers", str(hostile),
                              "--seconds", str(args.seconds), "--ramp-s", str(args.ramp_s),
                              "--out", str(d / "attacks.json"),
                              *([] if args.attacks == "all" else ["--classes", args.attacks])],
                  client_cores, nice=19 if client_cores else 0)
        print(f"{args.workers - hostile} honest simulated workers{f' and {hostile} hostile ones' if hostile else ''} "
              f"for {args.seconds:.0f} s against the control plane (the trainer is a stand-in consuming "
              f"{args.step_rate:g} batches/s of {args.batch_prompts} groups)...", file=sys.stderr, flush=True)
        clients = {role: proc for role, proc in procs.items() if role != "learner"}
        for role, proc in clients.items():  # each says when it is ready: start-ups would load the ramp
            if await asyncio.to_thread(proc.stdout.readline) != "ready\n":
                failed(role)
                return None
        for proc in clients.values():
            proc.stdin.write("go\n")
            proc.stdin.flush()
        windows: list[tuple[float, bool]] = []
        switching = asyncio.create_task(_switch(procs["attacks"], args.seconds, switch, windows)) \
            if switch and hostile else None
        out = {}
        for role, proc in clients.items():  # the learner's counts are read once every client is done
            await asyncio.to_thread(proc.wait, args.seconds + 120)
            if proc.returncode != 0:
                failed(role)
                return None
            out[role] = json.loads((d / f"{role}.json").read_text())
        if switching:
            await switching
        load = os.getloadavg()[0]  # the machine's, others' work included: a busy one moves every latency
        learner.send_signal(signal.SIGTERM)
        await asyncio.to_thread(learner.wait, 60)
        server = json.loads((d / "learner.json").read_text())
        text = (d / "learner.log").read_text()
        slow = [line for line in text.splitlines() if line.startswith(("SLOW", "preempted"))]
        if slow:
            print("\n".join(slow[:20]), file=sys.stderr)
        if "GROWN" in text:  # ECHO_TRACE_MEMORY
            print(text[text.index("GROWN"):], file=sys.stderr)
        if args.keep:
            kept = args.keep / f"{len(list(args.keep.glob('*-*')))}-{'hostile' if hostile else 'benign'}"
            shutil.copytree(d, kept, ignore=shutil.ignore_patterns("*.key", "url"))
            print(f"raw data kept in {kept}", file=sys.stderr)
    return Measured(out["fleet"], server, out.get("attacks"), load, out["probes"], windows)


async def _switch(attackers: subprocess.Popen, seconds: float, every: float, windows: list) -> None:
    """Pause the attackers' process and resume it every `every` seconds, B H H B B H ... (as runs
    are ordered: a drift within the run falls on both arms alike), noting each window's start."""
    end = time.monotonic() + seconds
    try:
        for attacked in tails.hostile_turns(int(seconds // (2 * every)) + 1):
            now = time.monotonic()
            if now >= end - 1e-3:
                break
            attackers.send_signal(signal.SIGCONT if attacked else signal.SIGSTOP)
            windows.append((now, attacked))
            await asyncio.sleep(min(every, end - now))
    finally:
        if attackers.poll() is None:
            attackers.send_signal(signal.SIGCONT)  # to finish its run and write its counts


def interleaved(probes: dict, windows: list[tuple[float, bool]], seconds: float, guard: float) -> list[tuple[dict, dict]]:
    """The probes' requests of an `--interleave` run as pairs of runs for `pool_tails`: each window
    (its first `guard` seconds left out) one run, its times from the window's start; windows
    2k and 2k+1 (one benign, one attacked: `tails.hostile_turns`) a pair. The first pair, the
    fleet's ramp and the attackers' first joins, is left out, and a last window without its
    partner."""
    t0 = probes["t0"]
    bounds = [(start - t0, nxt - t0, attacked)
              for (start, attacked), nxt in zip(windows, [w for w, _ in windows[1:]] + [t0 + seconds])]
    runs = []
    for start, end, attacked in bounds:
        run = {"at": {}, "latency": {}}
        for route, ats in probes["at"].items():  # each route's requests in the order they ended
            lo, hi = bisect.bisect_left(ats, start + guard), bisect.bisect_left(ats, end)
            run["at"][route] = [a - start for a in ats[lo:hi]]
            run["latency"][route] = probes["latency"][route][lo:hi]
        runs.append((attacked, run))
    pairs = []
    for (a1, r1), (a2, r2) in zip(runs[2::2], runs[3::2]):
        if a1 == a2:
            raise ValueError("an interleaved pair of windows needs one benign and one attacked window")
        pairs.append((r2, r1) if a1 else (r1, r2))
    return pairs


async def _drive(args) -> int:
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    hostile = round(args.hostile * args.workers)
    if hostile and args.interleave:
        return await _drive_interleaved(args, hostile)
    if not hostile:
        measured = await _measure(args, 0, args.broadcast or "star")
        if measured is None:
            return 1
        out = _results(args, measured)
        print(json.dumps(out, indent=2) if args.json else _table(out))
        return 0
    # The same fleet benign, and with a share of it hostile: same machine, same settings, pairs of runs.
    broadcast = args.broadcast or "chain"
    arms: dict[bool, list[Measured]] = {False: [], True: []}  # benign, hostile runs
    for is_hostile in tails.hostile_turns(max(1, args.pairs)):  # B H H B ...: a drift falls on both arms
        measured = await _measure(args, hostile if is_hostile else 0, broadcast)
        if measured is None:
            return 1
        arms[is_hostile].append(measured)
    pairs = [compare(args, _results(args, b), _results(args, h)) for b, h in zip(arms[False], arms[True])]
    probed = [(b.probes, h.probes) for b, h in zip(arms[False], arms[True])]
    out = pairs[-1] if len(pairs) == 1 else over_pairs(pairs)
    pool_tails(out, probed)
    print(json.dumps(out, indent=2) if args.json else compared_table(out))
    return 0


async def _drive_interleaved(args, hostile: int) -> int:
    """`--interleave`: one run, the attackers switched on and off; the honest p99 judged over the
    pairs of windows (`interleaved`, `pool_tails`), the attacks' outcomes as in a hostile run."""
    from learner.bench.attacks import safety

    m = await _measure(args, hostile, args.broadcast or "chain", switch=args.interleave)
    if m is None:
        return 1
    run = _results(args, m)
    probed = interleaved(m.probes, m.windows, args.seconds, args.guard)
    out = {"workers": args.workers, "hostile_share": args.hostile, "hostile_workers": hostile, "seconds": args.seconds,
           "interleave_s": args.interleave, "guard_s": args.guard, "pairs": len(probed),
           # each switch, in s from the probes' start (their requests' `at`): to judge again with another guard
           "windows": [(round(start - m.probes["t0"], 4), attacked) for start, attacked in m.windows],
           "routes": {route: {} for route in run["routes"]}, "run": run,
           "goals": {**HOSTILE_GOALS, "checks": safety(m.attacks, run["learner"])}}
    pool_tails(out, probed)
    out["other_guards"] = {g: guarded(m.probes, m.windows, args.seconds, g, list(out["routes"]))
                           for g in (0.0, 2 * args.guard) if g < args.interleave}
    print(json.dumps(out, indent=2) if args.json else interleaved_table(out))
    return 0


def guarded(probes: dict, windows: list[tuple[float, bool]], seconds: float, guard: float, routes: list[str]) -> dict:
    """The paired ratio per route with another guard: does what the switches leave behind decide it?"""
    pairs = interleaved(probes, windows, seconds, guard)
    return {route: tails.ratio(_route_runs([b for b, _ in pairs], route), _route_runs([h for _, h in pairs], route),
                               paired=True)
            for route in routes}


def _route_runs(arm: list[dict], route: str) -> list[tuple[list, list]]:
    """One route's requests of each run (or window) of an arm, as `tails.ratio` takes them."""
    return [(p.get("at", {}).get(route, []), p["latency"].get(route, [])) for p in arm]


def interleaved_table(out: dict) -> str:
    run, yes = out["run"], {True: "yes", False: "NO"}
    lr, a = run["learner"], run["attacks"]
    checks = out["goals"]["checks"]
    lines = [
        f"control plane under a hostile fleet, interleaved: one run of {out['seconds']:.0f} s, {out['workers']} workers "
        f"of whom {out['hostile_workers']} attackers ({out['hostile_share']:.0%}), whose process is paused and resumed "
        f"every {out['interleave_s']:g} s (B H H B ...); {out['pairs']} pairs of windows judged (the first pair, the ramp, "
        f"left out), each window less its first {out['guard_s']:g} s",
        *_pooled_lines(out, "windows"),
        "with another guard (ratio [90%]): " + "; ".join(
            f"{g:g} s: " + ", ".join(f"{route} {r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"
                                     for route, r in by_route.items() if r["ratio"] is not None)
            for g, by_route in out["other_guards"].items()),
        f"learner: {lr['cpu_cores']:.2f} cores, event-loop lag max {lr['loop_lag_max_ms']:.0f} ms, RSS MB at start, half "
        f"time and end {_rss(run)}; {lr['quarantined']} quarantined",
        f"attacks: {sum(v['sent'] for v in a['classes'].values())} requests; weight bytes served without the read "
        f"right: {a['weight_bytes_without_credential']}",
        "goals: " + "; ".join(f"{k} {yes[c['ok']]} ({c['detail']})" for k, c in checks.items()),
        "PASS" if out["passed"] else "FAIL",
    ]
    return "\n".join(lines)


def _gc_line(gc: dict) -> str:
    return (f"{gc['collections']}, {gc['total_ms']:.0f} ms in all, longest {gc['longest_ms']:.0f} ms, "
            f"{gc['over_5ms']} over 5 ms")


def _first_in_line() -> None:
    """This process woken the moment its reply lands, not after the big fleet's process (a core's
    worth of work on the same core) yields: a real-time policy where allowed (root; the probes are
    light: ~0.05 cores), else nice -5."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (PermissionError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, -5)
        except (PermissionError, OSError):
            pass


def _placement(args) -> tuple[set[int] | None, set[int] | None]:
    """The learner's core and the clients' (the others), or None, None (`--no-pin`, one core)."""
    if not args.pin or len(_CORES) < 2:
        return None, None
    return {_CORES[-1]}, set(_CORES[:-1])


def pool_tails(out: dict, probed: list[tuple[dict, dict]]) -> None:
    """Judge the honest p99 on the probes' requests pooled over every run of each arm, with the
    interval a two-stage bootstrap gives (the pairs of a benign run and the hostile one beside it,
    then 10 s windows; `learner.bench.tails`); with 2+ pairs, the benign runs split into two
    (`tails.halves`, paired the same way) and compared alike: an A/A test of the method, whose
    interval should hold 1. The interval of each arm's runs drawn on their own (`unpaired`, how
    sittings before 2026-11-28 were judged) is kept beside it."""
    benign, hostile = [b for b, _ in probed], [h for _, h in probed]
    bound = HOSTILE_GOALS["p99_ratio"]
    pooled = {}
    for route in out["routes"]:
        r = tails.ratio(_route_runs(benign, route), _route_runs(hostile, route), paired=True)
        r["verdict"] = tails.verdict(r, bound)
        r["unpaired"] = tails.ratio(_route_runs(benign, route), _route_runs(hostile, route))
        if len(benign) >= 2:
            a, b = tails.halves(benign)
            r["benign_a_vs_b"] = tails.ratio(_route_runs(a, route), _route_runs(b, route), paired=len(a) == len(b))
            r["benign_a_vs_b_unpaired"] = tails.ratio(_route_runs(a, route), _route_runs(b, route))
        pooled[route] = r
    out["pooled_p99"] = pooled
    judged = {k: r for k, r in pooled.items() if r["verdict"] != "too few samples"}
    out["goals"]["checks"]["p99_within_10pct"] = {
        "ok": bool(judged) and all(r["verdict"] == "met" for r in judged.values()),
        "detail": "pooled over the runs, 90% interval over the pairs: " + ", ".join(
            f"{k} {r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}] {r['verdict']}" for k, r in judged.items())
        + "".join(f"; {k}: {r['samples']} requests, not judged" for k, r in pooled.items() if k not in judged)}
    out["passed"] = all(c["ok"] for c in out["goals"]["checks"].values())


def over_pairs(pairs: list[dict]) -> dict:
    """Several benign/hostile pairs: each ratio the median over the pairs, judged against the
    goals; the benign runs' p99 against the first benign run's is the machine's own noise."""
    med = statistics.median
    out = dict(pairs[-1])
    routes = {r: dict(x) for r, x in out["routes"].items()}
    for r, x in routes.items():
        ratios = [p["routes"][r]["p99_ratio"] for p in pairs if r in p["routes"] and p["routes"][r]["p99_ratio"]]
        client = [p["routes"][r]["client_p99_ratio"] for p in pairs
                  if r in p["routes"] and p["routes"][r]["client_p99_ratio"]]
        noise = [p["benign"]["routes"][r]["probe_p99_ms"] / pairs[0]["benign"]["routes"][r]["probe_p99_ms"]
                 for p in pairs[1:] if r in p["benign"]["routes"] and pairs[0]["benign"]["routes"][r]["probe_p99_ms"]]
        client_noise = [p["benign"]["routes"][r]["p99_ms"] / pairs[0]["benign"]["routes"][r]["p99_ms"]
                        for p in pairs[1:] if r in p["benign"]["routes"] and pairs[0]["benign"]["routes"][r]["p99_ms"]]
        x.update(p99_ratio=med(ratios) if ratios else None, p99_ratios=ratios, benign_noise=noise,
                 client_p99_ratio=med(client) if client else None, client_benign_noise=client_noise)
    out["routes"] = routes
    for key in ("trained_groups_per_min", "honest_groups_acknowledged_per_min", "learner_rss_peak_mb"):
        ratios = [p[key]["ratio"] for p in pairs if p[key]["ratio"] is not None]
        out[key] = {**out[key], "ratio": med(ratios) if ratios else None, "ratios": ratios}
    g, checks = HOSTILE_GOALS, {k: dict(v) for k, v in out["goals"]["checks"].items()}
    checks["groups_within_10pct"]["ok"] = (out["trained_groups_per_min"]["ratio"] or 0) >= g["groups_ratio"]
    checks["rss_bounded"]["ok"] = all(p["goals"]["checks"]["rss_bounded"]["ok"] for p in pairs)
    for name in [k for k in checks if k not in ("groups_within_10pct", "rss_bounded")]:
        checks[name]["ok"] = all(p["goals"]["checks"][name]["ok"] for p in pairs)  # safety: in every pair
    out["goals"] = {**out["goals"], "checks": checks}
    out["passed"] = all(c["ok"] for c in checks.values())
    out["pairs"] = len(pairs)
    return out


def _forward(args) -> list[str]:
    return ["--workers", str(args.workers), "--heartbeat-s", str(args.heartbeat_s), "--step-rate", str(args.step_rate),
            "--batch-prompts", str(args.batch_prompts)]


def _results(args, m: Measured) -> dict:
    fleet, server = m.fleet, m.server
    buf = server["buffer"]
    dropped = buf["recycled"] + buf["dropped_overflow"] + buf.get("dropped_untrusted", 0)
    accounted = buf["trained"] + dropped + buf.get("skipped_uniform", 0) + buf["queue_size"]
    probed = m.probes["latency"]
    routes = {route: {"requests": len(xs), "p50_ms": 1e3 * _pct(xs, 0.5), "p99_ms": 1e3 * _pct(xs, 0.99),
                      "max_ms": 1e3 * max(xs), "probe_requests": len(probed.get(route, [])),
                      "probe_p50_ms": 1e3 * _pct(probed.get(route, []), 0.5),
                      "probe_p99_ms": 1e3 * _pct(probed.get(route, []), 0.99)}
              for route, xs in sorted(fleet["latency"].items())}
    return {
        "workers": fleet["size"] + m.probes["size"], "seconds": args.seconds, "heartbeat_s": args.heartbeat_s,
        "killed_and_replaced": fleet["killed"], "routes": routes,
        "learner": {k: server[k] for k in ("cpu_cores", "loop_lag_max_ms", "loop_lag_p99_ms", "max_rss_mb", "rss_mb", "gc",
                                            "steps", "workers_known", "quarantined", "rejected", "joins_refused",
                                            "quarantined_by_kind", "leased_by_kind", "max_leased_by_kind",
                                            "max_inflight_prompts", "lease_first_prompts", "relays_probed",
                                            "auth_refused")},
        "client_cpu_cores": fleet["cpu_cores"], "machine_load_1min": m.load, "client_errors": fleet["errors"],
        "uploads_refused": fleet["refused"],
        "probe_errors": m.probes["errors"],
        "ledger": {"acknowledged_to_workers": fleet["acked"] + m.probes["acked"], "accepted_by_learner": buf["accepted"],
                   "trained": buf["trained"], "dropped": dropped, "skipped_uniform": buf.get("skipped_uniform", 0),
                   "queued": buf["queue_size"],
                   "lost": buf["accepted"] - accounted, "unacknowledged_beyond_learner": fleet["acked"] + m.probes["acked"] - buf["accepted"],
                   "leases_expired_prompts": server["leases"]["expired_prompts"]},
        **({"attacks": m.attacks} if m.attacks is not None else {}),
        "goals": GOALS,
    }


def compare(args, benign: dict, hostile: dict) -> dict:
    """The honest fleet's latency and throughput, the learner's memory, benign against hostile;
    the attackers' outcomes judged (`learner.bench.attacks.safety`)."""
    from learner.bench.attacks import safety

    def per_min(run: dict, groups: int) -> float:
        return 60.0 * groups / run["seconds"]

    # Judged on the probes (`--probes`); what the big fleet's own process measured is shown beside.
    routes = {r: {"benign_p50_ms": benign["routes"][r]["probe_p50_ms"], "benign_p99_ms": benign["routes"][r]["probe_p99_ms"],
                  "hostile_p50_ms": x["probe_p50_ms"], "hostile_p99_ms": x["probe_p99_ms"],
                  "p99_ratio": _ratio([benign["routes"][r]["probe_p99_ms"], x["probe_p99_ms"]]),
                  "client_p99_ratio": _ratio([benign["routes"][r]["p99_ms"], x["p99_ms"]])}
              for r, x in hostile["routes"].items() if r in benign["routes"]}
    trained = [per_min(run, run["ledger"]["trained"]) for run in (benign, hostile)]
    acked = [per_min(run, run["ledger"]["acknowledged_to_workers"]) for run in (benign, hostile)]
    rss = [run["learner"]["rss_mb"]["peak"] for run in (benign, hostile)]
    growth = [run["learner"]["rss_mb"]["last"] - run["learner"]["rss_mb"]["half"] for run in (benign, hostile)]
    g = HOSTILE_GOALS
    checks = {  # (the p99 is judged over all pairs at once: `pool_tails`)
        "groups_within_10pct": {"ok": trained[1] >= g["groups_ratio"] * trained[0],
                                "detail": f"{trained[1]:.0f} / {trained[0]:.0f} trained groups/min"},
        # Bounded: over the second half it grows no faster than the benign run's (+2% of its peak);
        # what the attackers' state costs once (tables, quarantined identities) is the peak ratio.
        "rss_bounded": {"ok": growth[1] <= growth[0] + g["rss_growth"] * rss[0],
                        "detail": f"second half +{growth[1]:.1f} MB vs benign +{growth[0]:.1f}; "
                                  f"peak {rss[1]:.0f} / {rss[0]:.0f} MB"},
        **safety(hostile["attacks"], hostile["learner"]),
    }
    return {"workers": args.workers, "hostile_share": args.hostile, "hostile_workers": hostile["attacks"]["hostile_workers"],
            "seconds": args.seconds, "routes": routes,
            "trained_groups_per_min": {"benign": trained[0], "hostile": trained[1], "ratio": _ratio(trained)},
            "honest_groups_acknowledged_per_min": {"benign": acked[0], "hostile": acked[1], "ratio": _ratio(acked)},
            "learner_rss_peak_mb": {"benign": rss[0], "hostile": rss[1], "ratio": _ratio(rss)},
            "learner_rss_second_half_growth_mb": {"benign": growth[0], "hostile": growth[1]},
            "goals": {**HOSTILE_GOALS, "checks": checks}, "passed": all(c["ok"] for c in checks.values()),
            "benign": benign, "hostile": hostile}


def _rss(run: dict) -> str:
    r = run["learner"]["rss_mb"]
    return f"{r['first']:.0f} / {r['half']:.0f} / {r['last']:.0f}"


def _ratio(pair: list[float]) -> float | None:
    return pair[1] / pair[0] if pair[0] else None


def compared_table(out: dict) -> str:
    from echo.table import fmt, table

    from learner.bench.attacks import CLASSES, REFUSED

    b, h = out["benign"], out["hostile"]
    a, lh = h["attacks"], h["learner"]
    n = out["hostile_workers"]
    yes = {True: "yes", False: "NO"}
    checks = out["goals"]["checks"]
    rows = [[route, fmt(r["benign_p50_ms"]), fmt(r["benign_p99_ms"]), fmt(r["hostile_p50_ms"]), fmt(r["hostile_p99_ms"]),
             fmt(r["p99_ratio"], ".2f"), yes[(r["p99_ratio"] or 0.0) <= HOSTILE_GOALS["p99_ratio"]],
             fmt(r["client_p99_ratio"], ".2f")]
            for route, r in out["routes"].items()]

    def pair(key: str, spec: str = ".0f") -> str:
        x = out[key]
        return f"benign {x['benign']:{spec}}, hostile {x['hostile']:{spec}} (ratio {fmt(x['ratio'], '.2f')})"

    attack_rows = [[c, str(v["sent"]), " ".join(f"{o}x{k}" for o, k in v["outcomes"].items()) or "-",
                    str(v["longest_reply"]), "4xx" if c in REFUSED else "a pulling leaf, never probed" if c == "relay-url"
                    else "served until capped/caught"]
                   for c, v in a["classes"].items()]
    forgers = a["forgers"]
    caught = sorted(f["seconds"] for f in forgers if f["caught"] and f["seconds"] is not None)
    acked = [f["acknowledged"] for f in forgers if f["caught"]]
    lines = [
        f"control plane under a hostile fleet: {out['workers']} workers, {out['seconds']:.0f} s per run, benign and hostile "
        f"runs on this machine ({'B H H B ...' if out.get('pairs', 1) > 1 else 'B H'}); hostile: {out['workers'] - n} honest + {n} attackers "
        f"({out['hostile_share']:.0%}), one attack each every 1-2 s, and a forger each"
        + (f" (only these attacks: {', '.join(a['classes_run'])})" if len(a["classes_run"]) < len(CLASSES) else ""),
        "honest fleet, per route, as the probe workers measured it (a light process of their own: a worker on its "
        "own machine; ms; lease: the route's own time, the long-poll wait subtracted); the last column: the same "
        "ratio as the big fleet's process saw it, its own queueing included:",
        table(["route", "benign p50", "benign p99", "hostile p50", "hostile p99", "p99 ratio", "≤ 1.10 unpooled",
               "fleet-side ratio"], rows),
        *([f"over {out['pairs']} benign/hostile pairs (the p50/p99 columns: the last pair): p99 ratio per pair "
           + "; ".join(f"{r} {' '.join(f'{v:.2f}' for v in x['p99_ratios'])}" for r, x in out["routes"].items())
           + ". The machine's own noise, each later benign run's p99 / the first's: "
           + "; ".join(f"{r} {' '.join(f'{v:.2f}' for v in x['benign_noise'])}" for r, x in out["routes"].items())
           + " (fleet-side: "
           + "; ".join(f"{r} {' '.join(f'{v:.2f}' for v in x['client_benign_noise'])}" for r, x in out["routes"].items())
           + ")"]
          if out.get("pairs", 1) > 1 else []),
        *_pooled_lines(out),
        f"trained groups/min: {pair('trained_groups_per_min')}  {yes[checks['groups_within_10pct']['ok']]}",
        f"groups acknowledged to honest workers/min: {pair('honest_groups_acknowledged_per_min')}",
        f"learner peak RSS MB: {pair('learner_rss_peak_mb')}; at start, half time and end: benign {_rss(b)}, "
        f"hostile {_rss(h)}; bounded (the second half grows no faster than the benign run's): "
        f"{yes[checks['rss_bounded']['ok']]}",
        f"learner CPU cores: benign {b['learner']['cpu_cores']:.2f}, hostile {lh['cpu_cores']:.2f}; event-loop lag max "
        f"ms: benign {b['learner']['loop_lag_max_ms']:.0f}, hostile {lh['loop_lag_max_ms']:.0f}; the machine's load "
        f"(1-min average, all its work) at the end: benign {b['machine_load_1min']:.1f}, hostile {h['machine_load_1min']:.1f}",
        f"garbage collections on the loop: benign {_gc_line(b['learner']['gc'])}; hostile {_gc_line(lh['gc'])}",
        "attacks (outcomes: HTTP status x count, or the client error's name):",
        table(["class", "sent", "outcomes", "longest reply B", "required"], attack_rows),
        f"weight bytes served without the read right: {a['weight_bytes_without_credential']}  "
        f"{yes[checks['zero_weight_bytes']['ok']]}",
        f"hoarding: {a['hoard']['requests']} requests for 1024 prompts, at most {a['hoard']['most_per_request']} given at "
        f"once; the {n} hoarders held {lh['leased_by_kind'].get('hostile', 0)} of the {lh['max_inflight_prompts']} "
        f"prompts in flight at the end, at most {lh['max_leased_by_kind'].get('hostile', 0)} each at once over the run "
        f"(lease_first_prompts = {lh['lease_first_prompts']})",
        f"forgers: {len(forgers)} identities, {len(caught)} quarantined "
        + (f"{_pct(caught, 0.5):.1f} s (median; max {max(caught):.1f} s) after their first forged upload, "
           f"{_pct(acked, 0.5):.0f} forged groups acknowledged each before (their rewards recomputed all the same)"
           if caught else "")
        + f"; honest workers quarantined: {lh['quarantined_by_kind'].get('sim', 0) + lh['quarantined_by_kind'].get('probe', 0)}",
        f"relay URLs the learner probed: {sum(lh['relays_probed'].values())}; the attackers' process: "
        f"{a['cpu_cores']:.2f} cores, {len(a['failures'])} failures",
        "goals: " + "; ".join(f"{k} {yes[c['ok']]} ({c['detail']})" for k, c in checks.items()),
        "PASS" if out["passed"] else "FAIL",
    ]
    return "\n".join(lines)


def _pooled_lines(out: dict, runs: str = "runs") -> list[str]:
    from echo.table import fmt, table

    pooled = out.get("pooled_p99")
    if not pooled:
        return []

    def ci(r: dict | None) -> str:
        return "-" if not r or r["ratio"] is None else f"{r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"

    n = out.get("pairs", 1)
    rows = [[route, str(r["samples"]), fmt(r["base"] and 1e3 * r["base"]), fmt(r["test"] and 1e3 * r["test"]), ci(r),
             r["verdict"], ci(r.get("benign_a_vs_b")), ci(r.get("unpaired")), ci(r.get("benign_a_vs_b_unpaired"))]
            for route, r in pooled.items()]
    return [f"the judged p99: the probes' requests pooled over the {n} benign and {n} hostile {runs}, the ratio's 90% "
            f"interval from a two-stage bootstrap (the pairs of {runs} side by side, then 10 s windows of each: "
            f"learner.bench.tails); met = the whole interval within {HOSTILE_GOALS['p99_ratio']:.2f}; A/A = the benign "
            f"{runs} in two halves (1, 4, 5, 8, ... against 2, 3, 6, 7, ...), the method's own check (its interval "
            f"should hold 1); unpaired = each arm's {runs} drawn on their own"
            + (", as sittings before 2026-11-28 were judged:" if runs == "runs" else ":"),
            table(["route", "requests/arm", "benign p99 ms", "hostile p99 ms", "ratio [90%]", "verdict", "A/A [90%]",
                   "unpaired", "A/A unpaired"], rows)]


def _table(out: dict) -> str:
    from echo.table import fmt, table

    rows = [[route, str(r["requests"]), fmt(r["p50_ms"]), fmt(r["p99_ms"]), fmt(r["max_ms"]),
             "yes" if r["p99_ms"] < GOALS["p99_ms"] else "NO", fmt(r["probe_p50_ms"]), fmt(r["probe_p99_ms"])]
            for route, r in out["routes"].items()]
    lr, lg = out["learner"], out["ledger"]
    lines = [f"control plane: {out['workers']} workers, {out['seconds']:.0f} s, heartbeats every {out['heartbeat_s']:g} s, "
             f"{out['killed_and_replaced']} killed and replaced; the trainer is a stand-in consuming batches at a fixed rate",
             table(["route", "requests", "p50 ms", "p99 ms", "max ms", f"p99 < {GOALS['p99_ms']:.0f} ms",
                    "probes p50", "p99"], rows),
             "  (lease: the route's own time; the long-poll wait the learner reports is subtracted. Probes: the "
             "honest workers of a light process of their own, without the big fleet's process's queueing)",
             f"learner: {lr['cpu_cores']:.2f} cores, event-loop lag max {lr['loop_lag_max_ms']:.0f} ms "
             f"(p99 {lr['loop_lag_p99_ms']:.0f} ms; goal < {GOALS['loop_lag_ms']:.0f}), max RSS {lr['max_rss_mb']:.0f} MB, "
             f"{lr['steps']} batches trained, {lr['workers_known']} workers known, {lr['quarantined']} quarantined",
             f"garbage collections on the loop: {_gc_line(lr['gc'])}",
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


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
