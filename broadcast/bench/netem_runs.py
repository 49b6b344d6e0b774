"""`echo-rl bench broadcast`: chains, stripes and the star against the bound, on emulated WAN links.

For each fleet (`--fleets`: `sym` upload = download; `asym` upload = download / 4; `mixed` 25%
of the workers upload at download / 20, the rest symmetric) and each fleet size N it builds a
netem topology (one namespace per host: the learner with uplink U, N workers with their own
download and upload caps, every hop delayed by the userspace delay relay), calibrates the
links as the *measured* goodput share of one TCP stream (tc's overhead), then moves one
signed snapshot of `--size-mib` random bytes with the real `Source`/`Relay` code, once along
the best chains and once along stripes sized to uploads, and prints against `T*`
(`broadcast.planner.lower_bound`, with the measured rates) which design the planner picks and
what each measured. Chunk sizes are the planner's (`choose_chunk`) unless `--chunk-mib`.

Then: a stripe owner SIGKILLed 40% into the transfer (survivors repair its stripe per stripe),
a delta of a bf16 update the size of one real step (fp32 masters, lr 1e-6, cast to bf16) and
the synthetic 3% float32 update, and a worker behind NAT (its namespace drops inbound SYNs):
the learner probes every relay (`broadcast.reach.probe_relay`, from the learner's namespace),
plans the unreachable one as a pulling leaf, and it follows the route feed. `--links` adds
the misdeclared-links scenario (two workers upload at b/4 though they declared b; one version
planned from the declarations, the next from what it measured). Time is learner-visible: from
publication until the last worker holds the whole verified version (`complete` event of its
relay; one machine, one clock). Every survivor's bytes are checked against the source's blake3.

Needs root for the namespaces; without it the command says why and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from echo.table import fmt, table
from broadcast.manifest import MIB, chunk_hash
from broadcast.planner import PeerLink, Plan, lower_bound, plan_broadcast

PORT = 9100  # every relay (and the source) listens here inside its own namespace
MBIT = 1e6 / 8  # bytes/s in one Mbit/s
DELTA_FRACTION = 0.03  # share of float32 elements the synthetic update changes
FLEETS = ("sym", "asym", "mixed")
_DONE = itertools.count()  # names of the files that end each run's processes


class BenchError(RuntimeError):
    """The benchmark could not run or a transfer did not finish; the message says why."""


def fleet_links(fleet: str, n: int, down_mbit: float) -> dict[str, tuple[float, float]]:
    """Nominal (download, upload) Mbit/s per worker of a fleet."""
    if fleet == "sym":
        return {f"w{i}": (down_mbit, down_mbit) for i in range(1, n + 1)}
    if fleet == "asym":
        return {f"w{i}": (down_mbit, down_mbit / 4) for i in range(1, n + 1)}
    if fleet == "mixed":  # every 4th worker a slow uploader: 25% of the fleet
        return {f"w{i}": (down_mbit, down_mbit / 20 if i % 4 == 0 else down_mbit) for i in range(1, n + 1)}
    raise BenchError(f"unknown fleet {fleet!r}: one of {', '.join(FLEETS)}")


# -- what runs inside the namespaces (module level: it travels to the child by pickle) ----------
def _say(record: dict) -> None:
    """One JSON line on stdout, read by the benchmark from the child's output file.

    One write call: with unbuffered stdout, `print` writes the newline separately, and a
    warning on stderr (the same file) could land between the two and break the line.
    """
    sys.stdout.write(json.dumps(record, default=str) + "\n")
    sys.stdout.flush()


async def _wait_for_file(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def serve_relay(node_id: str, public_key: str, port: int, public_url: str, done_path: str,
                      timeout_s: float, stall_timeout: float = 5.0, up_rate: float | None = None,
                      source_url: str | None = None) -> dict:
    """A worker's relay: serve until `done_path` exists, then report each version it holds.

    Prints every relay event as a JSON line (the benchmark watches for `complete`). Returns,
    per version key, whether it is complete, blake3 of the received wire bytes, and the stats.
    With `source_url` it follows the learner's route feed (a worker nobody can connect to).
    """
    from broadcast.relay import Relay
    from broadcast.signing import VerifyKey

    relay = Relay(node_id, VerifyKey.from_text(public_key), host="0.0.0.0", port=port,
                  public_url=public_url, stall_timeout=stall_timeout, keep_versions=1, on_event=_say,
                  up_rate=up_rate, source_url=source_url)
    await relay.start()
    cpu0 = time.process_time()
    await _wait_for_file(done_path, timeout_s)
    out: dict[str, Any] = {"cpu_s": time.process_time() - cpu0, "versions": {}}
    for key, store in relay.stores.items():
        digest = await asyncio.to_thread(chunk_hash, store.buffer) if store.complete else b""
        out["versions"][key] = {"complete": store.complete, "have": store.have, "blake3": digest.hex(),
                                "stats": asdict(store.stats)}
    await relay.stop()
    return out


def probe_all(urls: dict[str, str], timeout_s: float) -> dict[str, bool]:
    """`broadcast.reach.probe_relay` of every relay URL, run in the learner's namespace."""
    from broadcast.reach import probe_relay

    async def run() -> dict[str, bool]:
        results = await asyncio.gather(*(probe_relay(u, timeout_s) for u in urls.values()))
        return dict(zip(urls, results))

    return asyncio.run(run())


def synthetic_update(size: int, seed: int, fraction: float = DELTA_FRACTION) -> tuple[bytes, bytes]:
    """(base, new): float32 weights ~N(0, 0.02) and the same with `fraction` of the elements
    nudged by a relative 1e-3 step (what one optimizer step does to the weights it changes)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(size // 4, dtype=np.float32) * np.float32(0.02))
    new = base.copy()
    mask = rng.random(base.size, dtype=np.float32) < fraction
    new[mask] *= np.float32(1) + np.float32(1e-3) * rng.standard_normal(int(mask.sum()), dtype=np.float32)
    return base.tobytes(), new.tobytes()


def bf16_update(size: int, seed: int, lr: float = 1e-6) -> tuple[bytes, bytes]:
    """(base, new): two consecutive bf16 snapshots of fp32 master weights ~N(0, 0.02) that one
    Adam step at learning rate `lr` moved (each element by ~lr: Adam's normalised step), i.e.
    what the learner publishes (`[publish] dtype = "bfloat16"`). Most elements keep their bf16
    value: a step of 1e-6 moves a weight of 0.02 by 1/60 of a bf16 ulp."""
    import numpy as np

    rng = np.random.default_rng(seed)
    master = rng.standard_normal(size // 2, dtype=np.float32) * np.float32(0.02)
    step = np.float32(lr) * rng.standard_normal(master.size, dtype=np.float32)

    def to_bf16(x: "np.ndarray") -> bytes:  # round to nearest even, as torch's cast does
        u = x.view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).tobytes()

    return to_bf16(master), to_bf16(master + step)


UPDATES = {"bf16": bf16_update, "f32-3%": synthetic_update}


def random_blob(size: int, seed: int) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).bytes(size)


async def run_source(key_path: str, port: int, public_url: str, job: dict, done_path: str,
                     timeout_s: float) -> dict:
    """The learner: publish one version, push it along `job["plan"]`, serve until `done_path`.

    Prints `{"event": "published", "t": ...}` the moment the version is pushed (the clock's
    zero). With `job["delta"]` (an `UPDATES` name), publishes a base version first, then the
    update as a delta against it, pushes the delta, and reports encode/decode times and sizes.
    """
    from broadcast.delta import decode
    from broadcast.relay import Source
    from broadcast.signing import SigningKey
    from broadcast.transport import Hop

    src = Source(SigningKey.load(key_path), host="0.0.0.0", port=port, public_url=public_url)
    await src.start()
    try:
        version, size, chunk = job["version"], job["size"], job["chunk"]
        info: dict[str, Any] = {}
        if job.get("delta"):
            base, blob = await asyncio.to_thread(UPDATES[job["delta"]], size, job["seed"])
            base_full, _ = await src.publish(base, version - 1, chunk_size=chunk)
            t = time.perf_counter()
            _, delta = await src.publish(blob, version, chunk_size=chunk, base=(base, base_full.manifest))
            info["publish_s"] = time.perf_counter() - t  # hashing + XOR + zstd
            if delta is None:
                raise BenchError("the update did not compress enough to publish a delta")
            signed = delta
            t = time.perf_counter()
            decoded = await asyncio.to_thread(decode, delta.manifest, src.stores[delta.manifest.key].buffer,
                                              base, base_full.manifest)
            info["decode_s"] = time.perf_counter() - t
            info["decoded_ok"] = bytes(decoded) == blob
            import numpy as np

            a, b = np.frombuffer(base, np.uint16), np.frombuffer(blob, np.uint16)
            info["changed_share"] = float(np.mean(a != b)) if job["delta"] == "bf16" else job.get("fraction")
        else:
            blob = await asyncio.to_thread(random_blob, size, job["seed"])
            t = time.perf_counter()
            signed, _ = await src.publish(blob, version, chunk_size=chunk)
            info["publish_s"] = time.perf_counter() - t
        key = signed.manifest.key
        wire = src.stores[key].buffer
        info.update(key=key, wire_bytes=signed.manifest.wire_size, total_bytes=signed.manifest.total_size,
                    chunks=signed.manifest.num_chunks, blake3=(await asyncio.to_thread(chunk_hash, wire)).hex())
        plan = Plan.from_dict(job["plan"])
        hops = {w: Hop(w, url) for w, url in job["hops"].items()}
        cpu0 = time.process_time()
        t0 = time.time()
        _say({"event": "published", "t": t0, "key": key})
        info["heads_ok"] = await src.push_plan(key, plan, hops, pace=plan.kind != "star")
        info["t_published"] = t0
        info["t_heads_done"] = time.time()
        await _wait_for_file(done_path, timeout_s)
        info["cpu_s"] = time.process_time() - cpu0
        info["bytes_out"] = src.stores[key].stats.bytes_out
        info["stats"] = asdict(src.stores[key].stats)
        return info
    finally:
        await src.stop()


# -- the driver ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """One sweep: fleets and sizes, snapshot, links (nominal caps; re-measured per topology)."""

    workers: tuple[int, ...] = (8, 16, 32)
    fleets: tuple[str, ...] = FLEETS
    size_mib: float = 64
    chunk_mib: float | None = None  # None: each plan's own (`broadcast.planner.choose_chunk`)
    uplink_mbit: float = 100
    link_mbit: float = 50  # every worker's download; uploads per fleet
    rtt_ms: float = 40  # per hop (A -> hub -> B and back)
    fault: bool = True
    delta: bool = True
    nat: bool = True
    links: bool = False
    star: bool = False
    designs: tuple[str, ...] = ("chains", "stripes")  # measured side by side (the star: `star`)
    stall_timeout: float = 5.0
    # The planner's headroom: trees are paced at this share of the measured uploads (1 = none).
    # Why: a relay whose uplink queue is full delays the ACKs of its own download, which then
    # runs below its cap; the lag adds up per hop.
    headroom: float = 0.95

    @property
    def size(self) -> int:
        return int(self.size_mib * MIB)

    @property
    def chunk(self) -> int | None:
        return None if self.chunk_mib is None else int(self.chunk_mib * MIB)


@dataclass
class Run:
    """One measured transfer."""

    name: str
    n: int
    plan: dict
    predicted_s: float
    measured_s: float | None = None
    arrivals: dict[str, float] = field(default_factory=dict)
    ok: bool = False
    wire_bytes: int = 0
    bytes_in: int = 0
    repairs: int = 0
    cpu_busy: float = 0.0  # share of both cores busy during the transfer (all processes)
    relay_cpu_s: float = 0.0
    killed: str | None = None
    killed_at_s: float | None = None
    source: dict = field(default_factory=dict)
    stats: dict[str, dict] = field(default_factory=dict)  # each survivor's TransferStats of the version
    error: str = ""
    events: dict[str, list[dict]] = field(default_factory=dict)  # relays' events (failures, repairs)


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [float(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def _events(output: str) -> list[dict]:
    out = []
    for line in output.splitlines():
        start = line.find('{"event"')  # tolerate stray text before a record
        if start >= 0:
            try:
                out.append(json.loads(line[start:]))
            except ValueError:
                pass
    return out


class Bench:
    """Topology-level helpers for one fleet and N: calibration, relays, one transfer."""

    def __init__(self, settings: Settings, n: int, tmp: Path, log: Callable[[str], None], fleet: str = "sym",
                 behind_nat: Sequence[str] = ()) -> None:
        from broadcast.signing import SigningKey

        self.s, self.n, self.tmp, self.log, self.fleet = settings, n, tmp, log, fleet
        self.links = fleet_links(fleet, n, settings.link_mbit)
        self.workers = list(self.links)
        self.behind_nat = set(behind_nat)
        self.reachable = {w: True for w in self.workers}  # until probed (`probe`)
        self.key_path = str(tmp / "learner.key")
        if not os.path.exists(self.key_path):
            SigningKey.generate().save(self.key_path)
        self.public_key = SigningKey.load(self.key_path).public_key().to_text()
        self._runs = 0

    def topology(self):  # -> netem.Topology (imported lazily: netem needs echo.config)
        from netem import HostSpec, Topology

        d = self.s.rtt_ms / 4  # a hop A -> hub -> B is delay_A + delay_B one way
        hosts = [HostSpec(name="learner", up_mbit=self.s.uplink_mbit, down_mbit=self.s.uplink_mbit, delay_ms=d)]
        hosts += [HostSpec(name=w, down_mbit=down, up_mbit=up, delay_ms=d, accept_inbound=w not in self.behind_nat)
                  for w, (down, up) in self.links.items()]
        return Topology(hosts)

    def calibrate(self, topo) -> dict:
        """Measured goodput of one stream learner -> worker (its download cap) and worker ->
        worker (an upload cap), and the RTT: the share of the nominal caps TCP gets through tc."""
        from netem.measure import goodput_mbit, rtt_ms

        nbytes = int(max(4e6, min(16e6, self.s.size / 8)))
        w1, w2 = self.workers[0], self.workers[1] if self.n > 1 else self.workers[0]
        down = goodput_mbit(topo, "learner", w1, nbytes, port=9500)
        peer = goodput_mbit(topo, w1, w2, nbytes, port=9502) if self.n > 1 else down
        rtt = rtt_ms(topo, w1, "learner", port=9501)
        share = down / self.links[w1][0]
        return {"share": share, "down_mbit": down, "peer_mbit": peer,
                "peer_share": peer / min(self.links[w1][1], self.links[w2][0]), "u_mbit": self.s.uplink_mbit * share,
                "b_mbit": self.s.link_mbit * share, "rtt_ms": rtt, "calibration_bytes": nbytes}

    def peers(self, cal: dict) -> list[PeerLink]:
        """The planner's view: nominal caps at the measured goodput share, measured latency."""
        k = cal["share"] * MBIT
        return [PeerLink(w, down * k, up * k, cal["rtt_ms"] / 2000, self.reachable[w])
                for w, (down, up) in self.links.items()]

    def urls(self, topo) -> dict[str, str]:
        out = {}
        for w in self.workers:
            host, port = topo.address("learner", w, PORT)  # same delay from every host: one relay serves all
            out[w] = f"http://{host}:{port}"
        return out

    def probe(self, topo, timeout_s: float = 2.0) -> dict[str, bool]:
        """Probe every worker's relay from the learner's namespace, as the learner does at join;
        the planner then sees unreachable workers as pulling leaves. Needs relays listening: a
        throwaway relay per worker answers the probe."""
        done = str(self.tmp / f"done-{next(_DONE)}")
        urls = self.urls(topo)
        relays = {w: topo[w].call_async(serve_relay, w, self.public_key, PORT, urls[w], done, 60.0)
                  for w in self.workers}
        for h in relays.values():
            h.wait_listening(PORT, timeout_s=30)
        try:
            self.reachable = topo["learner"].call(probe_all, urls, timeout_s, timeout_s=60)
        finally:
            Path(done).touch()
            for h in relays.values():
                h.result(60)
        return self.reachable

    def transfer(self, topo, name: str, plan: Plan, *, delta: str | None = None, kill: str | None = None,
                 kill_after_s: float = 0.0, timeout_s: float = 600.0,
                 relay_up_rates: dict[str, float] | None = None) -> Run:
        """Start fresh relays, run the source, wait until every survivor completes (or fails)."""
        self._runs += 1
        version = 2 * self._runs  # a delta run publishes version - 1 as its base
        run = Run(name, self.n, plan.to_dict(), plan.predicted_s)
        done = str(self.tmp / f"done-{next(_DONE)}")  # unique in the sweep: a file ends each run
        host, port = topo.address(self.workers[0], "learner", PORT)
        source_url = f"http://{host}:{port}"
        urls = self.urls(topo)
        relays = {w: topo[w].call_async(serve_relay, w, self.public_key, PORT, urls[w], done, timeout_s,
                                        self.s.stall_timeout, (relay_up_rates or {}).get(w),
                                        source_url if w in plan.pull else None)
                  for w in self.workers}
        for h in relays.values():
            h.wait_listening(PORT, timeout_s=30)
        job = {"version": version, "size": self.s.size, "chunk": plan.chunk_bytes, "seed": self._runs,
               "plan": plan.to_dict(), "hops": urls, "delta": delta, "fraction": DELTA_FRACTION}
        source = topo["learner"].call_async(run_source, self.key_path, PORT, source_url, job, done, timeout_s)
        survivors = [w for w in self.workers if w != kill]
        t0: float | None = None
        key: str | None = None
        completed: dict[str, float] = {}
        failed: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        cpu0 = cpu1 = _cpu_times()
        try:
            while time.monotonic() < deadline:
                if t0 is None:
                    for e in _events(source.process.output()):
                        if e.get("event") == "published":
                            t0, key = float(e["t"]), e["key"]
                            cpu0 = _cpu_times()  # the transfer only, not process start-up
                    if source.process.poll() is not None:
                        raise BenchError(f"source exited early:\n{source.process.output()[-3000:]}")
                else:
                    if kill and run.killed is None and time.time() - t0 >= kill_after_s:
                        relays[kill].process.popen.send_signal(signal.SIGKILL)  # a crash, not a goodbye
                        run.killed, run.killed_at_s = kill, time.time() - t0
                        self.log(f"    killed {kill} at {run.killed_at_s:.1f} s")
                    for w in survivors:
                        if w in completed or w in failed:
                            continue
                        for e in _events(relays[w].process.output()):
                            if e.get("key") == key and e.get("event") == "complete":
                                completed[w] = float(e["t"]) - t0
                            elif e.get("key") == key and e.get("event") == "failed":
                                failed[w] = e.get("error", "failed")
                    if len(completed) + len(failed) == len(survivors):
                        break
                time.sleep(0.05)
            cpu1 = _cpu_times()
        finally:
            Path(done).touch()
        run.cpu_busy = (cpu1[0] - cpu0[0]) / max(1.0, cpu1[1] - cpu0[1])
        run.source = source.result(60)
        results = {w: relays[w].result(60) for w in survivors}
        if kill and relays[kill].process.poll() is None:
            relays[kill].process.stop()
        run.arrivals = completed
        run.wire_bytes = run.source["wire_bytes"]
        digests_ok = True
        for w, r in results.items():
            v = r["versions"].get(key or "", {})
            t_done = v.get("stats", {}).get("t_complete")
            if w not in completed and v.get("complete") and t_done and t0 is not None:
                completed[w] = t_done - t0  # its `complete` line was lost; the relay's own stats say when
                run.events.setdefault(w, []).append({"event": "note", "text": "complete event not seen"})
            run.stats[w] = v.get("stats", {})
            run.bytes_in += v.get("stats", {}).get("bytes_in", 0)
            run.repairs += len(v.get("stats", {}).get("repairs", []))
            run.relay_cpu_s += r["cpu_s"]
            if w in completed and v.get("blake3") != run.source["blake3"]:
                digests_ok = False
                failed[w] = "bytes differ from the source's"
        missing = [w for w in survivors if w not in completed]
        for w in survivors:  # keep what explains a failure or a repair
            evs = [e for e in _events(relays[w].process.output()) if e.get("event") != "complete"]
            if evs or w in missing:
                run.events[w] = evs[-20:] + run.events.get(w, [])
        run.ok = not missing and digests_ok and not failed
        if run.ok:
            run.measured_s = max(completed.values())
        else:
            run.error = f"incomplete: {missing} failed={failed}" if missing or failed else "digest mismatch"
        return run




def _shape(plan: Plan | dict) -> str:
    p = plan if isinstance(plan, dict) else plan.to_dict()
    if p["kind"] == "star":
        return f"star({len(p['chains'])})"
    if p["kind"] == "stripes":
        first = p["parents"][0] if p["parents"] else []
        groups = 1 + sum(1 for i, par in enumerate(first) if par != -1 and i in first)  # owners after the first
        direct = " + direct" if p["parents"] and all(x == -1 for x in p["parents"][-1]) else ""
        owners = len(p["chains"]) - (1 if direct else 0)
        return f"{owners} stripes{direct}" + (f" in {groups} groups" if groups > 1 else "")
    return f"{len(p['chains'])}x{max(len(c) for c in p['chains'])}"


def _plan(settings: Settings, M: int, U: float, peers: list[PeerLink], designs: Sequence[str]) -> Plan:
    return plan_broadcast(M, U, peers, settings.chunk, headroom=settings.headroom, designs=designs)


def sweep(settings: Settings, log: Callable[[str], None] = print) -> dict:
    """Run every measurement of `settings`; returns the results as plain data (see `cli`)."""
    from netem.capability import probe

    caps = probe()
    if not caps.namespaces:
        raise BenchError(f"network namespaces are unavailable here: {caps.reason}")
    results: dict[str, Any] = {"settings": asdict(settings), "latency": "netem" if caps.netem else "relay",
                               "sizes": [], "extra": {}}
    biggest = max(settings.workers)
    M = settings.size
    with tempfile.TemporaryDirectory(prefix="echo-bench-") as tmp:
        for fleet in settings.fleets:
            for n in settings.workers:
                bench = Bench(settings, n, Path(tmp), log, fleet)
                with bench.topology() as topo:
                    cal = bench.calibrate(topo)
                    log(f"{fleet} N={n}: goodput share {cal['share']:.3f} of the caps (worker-to-worker "
                        f"{cal['peer_share']:.3f}), RTT {cal['rtt_ms']:.1f} ms")
                    U, peers = cal["u_mbit"] * MBIT, bench.peers(cal)
                    bound = lower_bound(M, U, peers)
                    choice = _plan(settings, M, U, peers, ("star", "chains", "stripes"))
                    entry: dict[str, Any] = {"fleet": fleet, "n": n, "calibration": cal, "t_star": bound,
                                             "choice": choice.kind, "choice_shape": _shape(choice),
                                             "alternatives": choice.alternatives, "runs": {}}
                    designs = {d: (d,) for d in settings.designs}
                    if settings.star:
                        designs["star"] = ("star",)
                    for name, only in designs.items():
                        plan = _plan(settings, M, U, peers, only)
                        if name == "star":  # unpaced: TCP shares U, so predicted at the full rates
                            plan = plan_broadcast(M, U, peers, settings.chunk, designs=only)
                        log(f"  {name}: {_shape(plan)}, {plan.chunk_bytes / MIB:.2f} MiB chunks, "
                            f"predicted {plan.predicted_s:.1f} s (T* {bound:.1f} s)")
                        entry["runs"][name] = asdict(bench.transfer(topo, name, plan, timeout_s=_budget(plan)))
                        _log_run(log, entry["runs"][name])
                    if n == biggest and settings.fault and fleet == settings.fleets[-1]:
                        plan = _plan(settings, M, U, peers, ("stripes",))
                        victim = plan.chains[0][0]  # the owner of the largest stripe
                        log(f"  fault: killing stripe owner {victim} at 40% of the predicted time")
                        entry["runs"]["fault"] = asdict(bench.transfer(
                            topo, "fault", plan, kill=victim, kill_after_s=0.4 * plan.predicted_s,
                            timeout_s=_budget(plan)))
                        _log_run(log, entry["runs"]["fault"])
                    if n == biggest and settings.delta and fleet == settings.fleets[0]:
                        for update in UPDATES:
                            entry["runs"][f"delta-{update}"] = _run_delta(bench, topo, settings, U, peers, update, log)
                    if n == biggest and settings.links and fleet == settings.fleets[0]:
                        entry["links"] = _run_links(bench, topo, settings, U, peers, log)
                        entry["runs"].update(entry["links"].pop("runs"))
                    results["sizes"].append(entry)
        if settings.nat:
            results["extra"]["nat"] = _run_nat(settings, Path(tmp), log)
    return results


def _budget(plan: Plan) -> float:
    return 3 * plan.predicted_s + 60


def _run_delta(bench: Bench, topo, settings: Settings, U: float, peers: list[PeerLink], update: str, log) -> dict:
    """A delta along the planner's choice for the full version; the prediction is recomputed
    for the delta's wire size, known only once the source has encoded it."""
    plan = _plan(settings, settings.size, U, peers, ("star", "chains", "stripes"))
    run = bench.transfer(topo, f"delta-{update}", plan, delta=update, timeout_s=_budget(plan))
    wire = run.wire_bytes or settings.size
    run.predicted_s = _plan(settings, wire, U, peers, (plan.kind,)).predicted_s if run.ok else plan.predicted_s
    src = run.source
    log(f"  delta ({update}): {wire / MIB:.2f} MiB on the wire of {settings.size / MIB:.0f} MiB "
        f"({settings.size / wire:.1f}x smaller), {100 * (src.get('changed_share') or 0):.2f}% of elements changed")
    d = asdict(run)
    _log_run(log, d)
    return d


def _run_nat(settings: Settings, tmp: Path, log) -> dict:
    """One worker of a symmetric fleet behind NAT (its namespace drops inbound SYNs): the learner
    probes every relay, plans the unreachable one as a pulling leaf, and pushes one version."""
    n = min(settings.workers)
    nat = f"w{n}"
    bench = Bench(settings, n, tmp, log, "sym", behind_nat=[nat])
    with bench.topology() as topo:
        cal = bench.calibrate(topo)
        reachable = bench.probe(topo)
        log(f"nat N={n}: {nat} behind NAT; probes: {sum(reachable.values())}/{n} reachable "
            f"({', '.join(w for w, ok in reachable.items() if not ok) or 'none'} not)")
        U, peers = cal["u_mbit"] * MBIT, bench.peers(cal)
        plan = _plan(settings, settings.size, U, peers, ("star", "chains", "stripes"))
        log(f"  planned {_shape(plan)}, pulling: {', '.join(plan.pull) or 'none'}")
        run = asdict(bench.transfer(topo, "nat", plan, timeout_s=_budget(plan)))
        _log_run(log, run)
    stats = run["stats"].get(nat, {})
    return {"n": n, "worker": nat, "reachable": reachable, "t_star": lower_bound(settings.size, U, peers),
            "plan": _shape(plan), "pull": list(plan.pull), "run": run, "nat_arrival_s": run["arrivals"].get(nat),
            "nat_parent": stats.get("parent"), "nat_repairs": len(stats.get("repairs", []))}


def _run_links(bench: Bench, topo, settings: Settings, U: float, peers: list[PeerLink], log) -> dict:
    """Two workers upload at b/4 though they declared b: one version planned from the
    declarations, the next from the `LinkTable` its transfers refreshed (what the learner does).
    Chains only: the scenario is about who heads a chain."""
    from types import SimpleNamespace

    from broadcast.links import LinkTable, link_sample, uplink_sample

    M = settings.size
    declared = _plan(settings, M, U, peers, ("chains",))
    slow = [chain[0] for chain in declared.chains if len(chain) > 1][:2]  # relays in the declared plan
    if not slow:
        return {"skipped": "the declared plan has no relays", "runs": {}}
    b = peers[0].up
    up_rates = {w: b / 4 for w in slow}
    truth = [replace(p, up=up_rates.get(p.id, p.up)) for p in peers]
    table_ = LinkTable(uplink=U, default=b)
    for p in peers:
        table_.declare(p.id, p.down, p.up)
        table_.observe_rtt(p.id, 2 * p.latency)
    log(f"  links: {', '.join(slow)} declared {b / MBIT:.1f} Mbit/s up but upload {b / 4 / MBIT:.1f}; "
        f"planned from the declarations: {_shape(declared)}")
    first = bench.transfer(topo, "links-declared", declared, relay_up_rates=up_rates,
                           timeout_s=6 * declared.predicted_s + 60)
    _log_run(log, asdict(first))
    for w, stats in first.stats.items():
        sample = link_sample(SimpleNamespace(**stats), first.wire_bytes) if stats else None
        if sample is not None:
            table_.observe(w, sample)
    if first.source.get("stats"):
        sample = uplink_sample(SimpleNamespace(**first.source["stats"]), declared.rates)
        if sample is not None:
            table_.observe_uplink(sample)
    measured = {p.id: table_.link(p.id) for p in peers}
    replanned = _plan(settings, M, table_.uplink.rate, list(measured.values()), ("chains",))
    at_tails = all(any(ch[-1] == w for ch in replanned.chains) for w in slow)
    log(f"  links: re-planned from the measured links: {_shape(replanned)} (slow workers at the tails: {at_tails})")
    second = bench.transfer(topo, "links-measured", replanned, relay_up_rates=up_rates,
                            timeout_s=6 * replanned.predicted_s + 60)
    _log_run(log, asdict(second))
    return {"slow": slow, "declared_mbit": b / MBIT, "true_up_mbit": b / 4 / MBIT,
            "t_star_true": lower_bound(M, U, truth), "plan_declared": _shape(declared),
            "plan_measured": _shape(replanned), "slow_at_tails": at_tails,
            "measured_up_mbit": {w: measured[w].up / MBIT for w in slow},
            "table": table_.to_dict(), "runs": {"links-declared": asdict(first), "links-measured": asdict(second)}}


def _victim(plan: Plan) -> str:
    """A relay whose death forces repair: the middle of the longest chain (else a head); the
    owner of the first (largest) stripe in a striped plan."""
    if plan.kind == "stripes":
        return plan.chains[0][0]
    chain = max(plan.chains, key=len)
    return chain[len(chain) // 2 - (1 if len(chain) % 2 == 0 else 0)] if len(chain) >= 3 else chain[0]


def _log_run(log: Callable[[str], None], r: dict) -> None:
    if r["ok"]:
        log(f"    {r['name']}: {r['measured_s']:.2f} s (predicted {r['predicted_s']:.2f} s), "
            f"CPU busy {100 * r['cpu_busy']:.0f}%, repairs {r['repairs']}")
    else:
        log(f"    {r['name']}: FAILED {r['error']}")


# -- tables ------------------------------------------------------------------------------------
def hop_lag(run: dict) -> float | None:
    """The worst lag of a relay behind its parent (completion times), over all chains."""
    a = run["arrivals"]
    lags = [a[c] - a[p] for chain in run["plan"]["chains"] for p, c in itertools.pairwise(chain) if p in a and c in a]
    return max(lags) if lags else None


def _ratio(r: dict | None, t_star: float) -> float | None:
    return None if not r or r.get("measured_s") is None else r["measured_s"] / t_star


def render(results: dict) -> str:
    s = results["settings"]
    chunk = "the planner's chunk sizes" if s.get("chunk_mib") is None else f"{s['chunk_mib']:g} MiB chunks"
    out = [(f"broadcast: {s['size_mib']:g} MiB in {chunk}; learner uplink U = {s['uplink_mbit']:g} Mbit/s, worker "
            f"downloads {s['link_mbit']:g} Mbit/s, uploads per fleet (sym = download, asym = download/4, mixed = 25% "
            f"at download/20); {s['rtt_ms']:g} ms RTT per hop (latency: {results['latency']}); rates below are "
            f"the caps at the measured goodput share; planned and paced at {s.get('headroom', 1):g} x the uploads"), ""]
    rows = []
    for e in results["sizes"]:
        c, st, t = e["runs"].get("chains"), e["runs"].get("stripes"), e["t_star"]
        chosen = {"chains": c, "stripes": st}.get(e["choice"], e["runs"].get("star"))
        cpu = max((r["cpu_busy"] for r in (c, st) if r), default=0)
        t_c = c["predicted_s"] / t if c else None
        rows.append([e["fleet"], str(e["n"]), fmt(t, ".1f"), f"{e['choice']} ({e['choice_shape']})",
                     fmt(c and _shape(c["plan"])), fmt(t_c, ".2f"), fmt(_ratio(c, t), ".2f"),
                     fmt(st and st["predicted_s"] / t, ".2f"), fmt(_ratio(st, t), ".2f"),
                     fmt(_ratio(chosen, t), ".2f"), f"{100 * cpu:.0f}%"])
    out.append(table(["fleet", "N", "T* s", "planner's choice", "chains", "chains pred/T*", "chains meas/T*",
                      "stripes pred/T*", "stripes meas/T*", "choice meas/T*", "CPU busy"], rows))
    for e in results["sizes"]:
        f, st = e["runs"].get("fault"), e["runs"].get("stripes")
        if f:
            head = (f"fault ({e['fleet']}, N={e['n']}): stripe owner {f['killed']} SIGKILLed at "
                    f"{fmt(f['killed_at_s'])} s; {len(f['arrivals'])}/{e['n'] - 1} survivors complete")
            if not f["ok"]:
                out += ["", f"{head} -- FAILED: {f['error']}"]
            else:
                base = st and st["measured_s"]
                vs = f" = {f['measured_s'] / base:.2f}x the fault-free {base:.2f} s" if base else ""
                out += ["", (f"{head} with verified bytes in {f['measured_s']:.2f} s{vs}; {f['repairs']} repair(s), "
                             f"{f['bytes_in'] / MIB:.0f} MiB received in all ({(e['n'] - 1) * s['size_mib']:g} MiB needed)")]
        for name in ("delta-bf16", "delta-f32-3%"):
            d = e["runs"].get(name)
            if not d:
                continue
            src = d["source"]
            what = ("a bf16 snapshot after one Adam step at lr 1e-6 (fp32 masters)" if name == "delta-bf16"
                    else "the synthetic update: 3% of float32 elements changed")
            changed = src.get("changed_share")
            out += ["", f"delta at N={e['n']}, {what}: "
                    + (f"{100 * changed:.2f}% of elements changed; " if changed is not None else "")
                    + (f"{src['wire_bytes'] / MIB:.2f} MiB on the wire vs {src['total_bytes'] / MIB:.0f} MiB full "
                       f"({src['total_bytes'] / src['wire_bytes']:.1f}x); publish (hash+XOR+zstd) {src['publish_s']:.2f} s, "
                       f"decode {src['decode_s']:.2f} s (decoded bytes {'match' if src['decoded_ok'] else 'DIFFER'}); "
                       if src else "")
                    + (f"transfer {d['measured_s']:.2f} s (predicted {d['predicted_s']:.2f} s)" if d["ok"]
                       else f"FAILED: {d['error']}")]
        lk, r1, r2 = e.get("links"), e["runs"].get("links-declared"), e["runs"].get("links-measured")
        if lk and r1 and r2:
            ups = ", ".join(f"{w} {v:.1f}" for w, v in lk["measured_up_mbit"].items())
            t1, t2 = r1["measured_s"], r2["measured_s"]
            out += ["", f"links at N={e['n']}: {', '.join(lk['slow'])} declared {lk['declared_mbit']:.1f} Mbit/s up, "
                    f"really upload {lk['true_up_mbit']:.1f}; T* with the true links {lk['t_star_true']:.2f} s",
                    f"  planned from declarations: {lk['plan_declared']}, predicted {r1['predicted_s']:.2f} s, "
                    f"measured {fmt(t1, '.2f')} s",
                    f"  re-planned from measured links (up: {ups} Mbit/s; slow workers at tails: "
                    f"{'yes' if lk['slow_at_tails'] else 'no'}): {lk['plan_measured']}, predicted "
                    f"{r2['predicted_s']:.2f} s, measured {fmt(t2, '.2f')} s"
                    + (f" = {t2 / lk['t_star_true']:.2f}x T*, {t1 / t2:.1f}x faster" if t1 and t2 else "")]
    nat = results.get("extra", {}).get("nat")
    if nat:
        r = nat["run"]
        probes = ", ".join(w for w, ok in nat["reachable"].items() if not ok) or "none"
        out += ["", f"NAT (sym, N={nat['n']}): {nat['worker']}'s namespace drops inbound SYNs; the learner's probes "
                f"found unreachable: {probes}; plan {nat['plan']}, pulling: {', '.join(nat['pull']) or 'none'}; "
                + (f"{nat['worker']} complete at {nat['nat_arrival_s']:.2f} s (its largest span from "
                   f"{nat['nat_parent']}, {nat['nat_repairs']} repairs), everyone at {r['measured_s']:.2f} s = "
                   f"{r['measured_s'] / nat['t_star']:.2f}x T*, no fallback" if r["ok"] else f"FAILED: {r['error']}")]
    out.append("")
    out.append("pred/T*, meas/T*: predicted and measured time to the last worker holding the verified version, over T*.")
    out.append("CPU busy = both cores, every process on the machine (relays, the delay relay, other jobs), "
               "during the transfer (the larger of the two runs).")
    return "\n".join(out)


# -- command line ---------------------------------------------------------------------------------
def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 2:
        raise argparse.ArgumentTypeError("worker counts must be >= 2")
    return vals


def _fleets(text: str) -> tuple[str, ...]:
    vals = tuple(x.strip() for x in text.split(",") if x.strip())
    if not vals or set(vals) - set(FLEETS):
        raise argparse.ArgumentTypeError(f"fleets are a comma-separated subset of {','.join(FLEETS)}, got {text!r}")
    return vals


def _designs(text: str) -> tuple[str, ...]:
    vals = tuple(x.strip() for x in text.split(",") if x.strip())
    if not vals or set(vals) - {"chains", "stripes"}:
        raise argparse.ArgumentTypeError(f"designs are chains and/or stripes, got {text!r}")
    return vals


def cli(argv: Sequence[str]) -> int:
    """`echo-rl bench broadcast [transports] [options]`; returns the exit status."""
    argv = list(argv)
    if argv and argv[0] == "transports":
        from broadcast.bench.transports import cli as transports_cli

        return transports_cli(argv[1:])
    p = argparse.ArgumentParser(prog="echo-rl bench broadcast", description=__doc__.split("\n\n")[0],
                                epilog="`echo-rl bench broadcast transports --help`: the loopback transport benchmark")
    p.add_argument("--workers", type=_ints, default=None, help="fleet sizes N (default 8,16,32; quick: 4)")
    p.add_argument("--fleets", type=_fleets, default=None, help="sym,asym,mixed (default all three; quick: mixed)")
    p.add_argument("--size-mib", type=float, default=None, help="snapshot size (default 64; quick: 8)")
    p.add_argument("--chunk-mib", type=float, default=None, help="fixed chunk size (default: the planner's per plan)")
    p.add_argument("--link-mbit", type=float, default=50.0, help="every worker's download cap (default 50)")
    p.add_argument("--uplink-mbit", type=float, default=None, help="learner uplink U (default 2x the download)")
    p.add_argument("--rtt-ms", type=float, default=40.0, help="round-trip time of one hop (default 40)")
    p.add_argument("--headroom", type=float, default=0.95,
                   help="plan (and pace) uploads at this share of the measured rates (1 = off; default 0.95)")
    p.add_argument("--designs", type=_designs, default=("chains", "stripes"),
                   help="designs measured side by side (default chains,stripes; the planner still picks among all)")
    p.add_argument("--star", action="store_true", help="also measure the star (grows linearly with N)")
    p.add_argument("--links", action="store_true", help="add the misdeclared-links run (two versions, chains)")
    p.add_argument("--no-fault", action="store_true", help="skip the killed stripe owner")
    p.add_argument("--no-delta", action="store_true", help="skip the delta runs")
    p.add_argument("--no-nat", action="store_true", help="skip the worker behind NAT")
    p.add_argument("--quick", action="store_true", help="smoke test: mixed fleet, N=4, 8 MiB, and the NAT run")
    p.add_argument("--json", action="store_true", help="print the results as JSON (progress goes to stderr)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("echo-rl bench broadcast: needs root for network namespaces (tc caps, veth); "
              "run it as root. No loopback fallback: without caps the numbers would mean nothing.",
              file=sys.stderr)
        return 2
    q = args.quick
    settings = Settings(
        workers=args.workers or ((4,) if q else (8, 16, 32)),
        fleets=args.fleets or (("mixed",) if q else FLEETS),
        size_mib=args.size_mib or (8 if q else 64),
        chunk_mib=args.chunk_mib,
        link_mbit=args.link_mbit,
        uplink_mbit=args.uplink_mbit or 2 * args.link_mbit,
        rtt_ms=args.rtt_ms,
        star=args.star, links=args.links, designs=args.designs, fault=not (args.no_fault or q), delta=not (args.no_delta or q),
        nat=not args.no_nat, headroom=args.headroom,
    )
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    try:
        results = sweep(settings, log)
    except BenchError as e:
        print(f"echo-rl bench broadcast: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(results, indent=1, default=str))
    else:
        print()
        print(render(results))
    runs = [r for e in results["sizes"] for r in e["runs"].values()]
    if "nat" in results["extra"]:
        runs.append(results["extra"]["nat"]["run"])
    return 0 if all(r["ok"] for r in runs) else 1


def main() -> None:
    raise SystemExit(cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
