"""`echo-rl bench broadcast`: chains against the bound and the star, on emulated wide-area links.

For each fleet size N it builds a netem topology (one namespace per host: the learner with
upload cap U, N workers with links of b each way, every hop delayed by the userspace delay
relay), calibrates b as the *measured* goodput of one TCP stream, then moves one signed
snapshot of `--size-mib` random bytes with the real `Source`/`Relay` code and prints:

- `T*`: the fluid lower bound (`broadcast.planner.lower_bound`) with the measured b;
- the planner's choice (K chains of length h) with its predicted and measured time;
- the star: the same `Source` pushing to all N at once (K = N chains of length 1, unpaced, so
  TCP shares the capped uplink), predicted and measured.

Then, at the largest N, the planned chains once more with one relay SIGKILLed mid-transfer
(survivors repair around it), once with deltas on (a synthetic update changing 3% of the
float32 elements of the blob), and the links scenario: two workers the declared links make
relays really upload at b/4 (a userspace cap on their relays); one version is planned from the
declarations, then the next from the links that version's transfers measured
(`broadcast.links`), and both are timed. Time is learner-visible: from publication (the moment the signed
version is pushed) until the last worker holds the whole verified version (`complete` event of
its relay; clocks are shared, every process runs on this machine). Every survivor's bytes are
checked against the source's blake3 at the end.

`echo-rl bench broadcast transports` is a separate sub-benchmark: MB/s on loopback through
aiohttp and (when installed) py-libp2p, in the same run: one stream each, then a chain of three
relays each.

Needs root for the namespaces; without it the command says why and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from broadcast.manifest import MIB, chunk_hash
from broadcast.planner import (
    PeerLink,
    Plan,
    lower_bound,
    plan_broadcast,
    predict_chains,
    predict_star,
)

PORT = 9100  # every relay (and the source) listens here inside its own namespace
MBIT = 1e6 / 8  # bytes/s in one Mbit/s
DELTA_FRACTION = 0.03  # share of float32 elements a synthetic update changes


class BenchError(RuntimeError):
    """The benchmark could not run or a transfer did not finish; the message says why."""


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
                      timeout_s: float, stall_timeout: float = 5.0, up_rate: float | None = None) -> dict:
    """A worker's relay: serve until `done_path` exists, then report each version it holds.

    Prints every relay event as a JSON line (the benchmark watches for `complete`). Returns,
    per version key, whether it is complete, blake3 of the received wire bytes, and the stats.
    """
    from broadcast.relay import Relay
    from broadcast.signing import VerifyKey

    relay = Relay(node_id, VerifyKey.from_text(public_key), host="0.0.0.0", port=port,
                  public_url=public_url, stall_timeout=stall_timeout, keep_versions=1, on_event=_say,
                  up_rate=up_rate)
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


def random_blob(size: int, seed: int) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).bytes(size)


async def run_source(key_path: str, port: int, public_url: str, job: dict, done_path: str,
                     timeout_s: float) -> dict:
    """The learner: publish one version, push it along `job["plan"]`, serve until `done_path`.

    Prints `{"event": "published", "t": ...}` the moment the version is pushed (the clock's
    zero). With `job["delta"]`, publishes a base version first, then the update as a delta
    against it, pushes the delta, and reports encode/decode times and sizes.
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
            base, blob = await asyncio.to_thread(synthetic_update, size, job["seed"])
            base_full, _ = await src.publish(base, version - 1, chunk_size=chunk)
            t = time.perf_counter()
            _, delta = await src.publish(blob, version, chunk_size=chunk, base=(base, base_full.manifest))
            info["publish_s"] = time.perf_counter() - t  # hashing + XOR + zstd
            if delta is None:
                raise BenchError("the synthetic update did not compress enough to publish a delta")
            signed = delta
            t = time.perf_counter()
            decoded = await asyncio.to_thread(decode, delta.manifest, src.stores[delta.manifest.key].buffer,
                                              base, base_full.manifest)
            info["decode_s"] = time.perf_counter() - t
            info["decoded_ok"] = bytes(decoded) == blob
        else:
            blob = await asyncio.to_thread(random_blob, size, job["seed"])
            t = time.perf_counter()
            signed, _ = await src.publish(blob, version, chunk_size=chunk)
            info["publish_s"] = time.perf_counter() - t
        key = signed.manifest.key
        wire = src.stores[key].buffer
        info.update(key=key, wire_bytes=signed.manifest.wire_size, total_bytes=signed.manifest.total_size,
                    blake3=(await asyncio.to_thread(chunk_hash, wire)).hex())
        plan = Plan.from_dict(job["plan"])
        hops = {w: Hop(w, url) for w, url in job["hops"].items()}
        cpu0 = time.process_time()
        t0 = time.time()
        _say({"event": "published", "t": t0, "key": key})
        info["heads_ok"] = await src.push_plan(key, plan, hops)
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
    """One sweep: fleet sizes, snapshot, links (nominal caps; b is re-measured per topology)."""

    workers: tuple[int, ...] = (4, 8, 16)
    size_mib: float = 256
    chunk_mib: float = 4
    uplink_mbit: float = 200
    link_mbit: float = 50
    rtt_ms: float = 40  # per hop (A -> hub -> B and back)
    fault: bool = True
    delta: bool = True
    links: bool = True
    star: bool = True
    stall_timeout: float = 5.0
    # The planner's headroom: chains are paced at this share of the measured uploads (1 = none).
    # Why: a relay whose uplink queue is full delays the ACKs of its own download, which then
    # runs below b; in a chain every member but the tail uploads, so the lag adds up per hop.
    headroom: float = 0.95

    @property
    def size(self) -> int:
        return int(self.size_mib * MIB)

    @property
    def chunk(self) -> int:
        return int(self.chunk_mib * MIB)


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
    """Topology-level helpers for one N: calibration, relays, one transfer."""

    def __init__(self, settings: Settings, n: int, tmp: Path, log: Callable[[str], None]) -> None:
        from broadcast.signing import SigningKey

        self.s, self.n, self.tmp, self.log = settings, n, tmp, log
        self.workers = [f"w{i}" for i in range(1, n + 1)]
        self.key_path = str(tmp / "learner.key")
        if not os.path.exists(self.key_path):
            SigningKey.generate().save(self.key_path)
        self.public_key = SigningKey.load(self.key_path).public_key().to_text()
        self._runs = 0

    def topology(self):  # -> netem.Topology (imported lazily: netem needs echo.config)
        from netem import HostSpec, Topology

        d = self.s.rtt_ms / 4  # a hop A -> hub -> B is delay_A + delay_B one way
        hosts = [HostSpec(name="learner", up_mbit=self.s.uplink_mbit, down_mbit=self.s.uplink_mbit, delay_ms=d)]
        hosts += [HostSpec(name=w, up_mbit=self.s.link_mbit, down_mbit=self.s.link_mbit, delay_ms=d)
                  for w in self.workers]
        return Topology(hosts)

    def calibrate(self, topo) -> dict:
        """Measured goodput of one stream learner -> worker and worker -> worker, and the RTT."""
        from netem.measure import goodput_mbit, rtt_ms

        nbytes = int(max(4e6, min(32e6, self.s.size / 8)))
        down = goodput_mbit(topo, "learner", "w1", nbytes, port=9500)
        peer = goodput_mbit(topo, "w1", "w2", nbytes, port=9502) if self.n > 1 else down
        rtt = rtt_ms(topo, "w1", "learner", port=9501)
        b = min(down, peer)
        # One stream cannot fill U (the receiver's b caps it); tc's overhead is a fixed share of
        # the nominal rate, so U's goodput is taken at the same share as b's.
        u = self.s.uplink_mbit * b / self.s.link_mbit
        return {"b_mbit": b, "down_mbit": down, "peer_mbit": peer, "u_mbit": u, "rtt_ms": rtt,
                "calibration_bytes": nbytes}

    def peers(self, cal: dict) -> list[PeerLink]:
        b = cal["b_mbit"] * MBIT
        return [PeerLink(w, b, b, cal["rtt_ms"] / 2000) for w in self.workers]

    def transfer(self, topo, name: str, plan: Plan, *, delta: bool = False, kill: str | None = None,
                 kill_after_s: float = 0.0, timeout_s: float = 600.0,
                 relay_up_rates: dict[str, float] | None = None) -> Run:
        """Start fresh relays, run the source, wait until every survivor completes (or fails)."""
        self._runs += 1
        version = 2 * self._runs  # a delta run publishes version - 1 as its base
        run = Run(name, self.n, plan.to_dict(), plan.predicted_s)
        done = str(self.tmp / f"done-{self.n}-{self._runs}")
        host, port = topo.address("w1", "learner", PORT)
        source_url = f"http://{host}:{port}"
        urls = {}
        for w in self.workers:
            host, port = topo.address("learner", w, PORT)  # same delay from every host: one relay serves all
            urls[w] = f"http://{host}:{port}"
        relays = {w: topo[w].call_async(serve_relay, w, self.public_key, PORT, urls[w], done, timeout_s,
                                        self.s.stall_timeout, (relay_up_rates or {}).get(w))
                  for w in self.workers}
        for h in relays.values():
            h.wait_listening(PORT, timeout_s=30)
        job = {"version": version, "size": self.s.size, "chunk": self.s.chunk, "seed": self._runs,
               "plan": plan.to_dict(), "hops": urls, "delta": delta}
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


def _chain_shape(plan: Plan) -> str:
    if plan.kind == "star":
        return f"star({plan.k})"
    return f"{plan.k}x{max(len(c) for c in plan.chains)}"


def sweep(settings: Settings, log: Callable[[str], None] = print) -> dict:
    """Run every measurement of `settings`; returns the results as plain data (see `cli`)."""
    from netem.capability import probe

    caps = probe()
    if not caps.namespaces:
        raise BenchError(f"network namespaces are unavailable here: {caps.reason}")
    results: dict[str, Any] = {"settings": asdict(settings), "latency": "netem" if caps.netem else "relay",
                               "sizes": []}
    biggest = max(settings.workers)
    with tempfile.TemporaryDirectory(prefix="echo-bench-") as tmp:
        for n in settings.workers:
            bench = Bench(settings, n, Path(tmp), log)
            with bench.topology() as topo:
                cal = bench.calibrate(topo)
                log(f"N={n}: b = {cal['b_mbit']:.1f} Mbit/s measured (down {cal['down_mbit']:.1f}, "
                    f"peer {cal['peer_mbit']:.1f}), RTT {cal['rtt_ms']:.1f} ms")
                M, U, peers = settings.size, cal["u_mbit"] * MBIT, bench.peers(cal)
                bound = lower_bound(M, U, peers)
                plan = plan_broadcast(M, U, peers, settings.chunk, headroom=settings.headroom)
                # The star runs unpaced (TCP shares U), so it is predicted at the full measured rates.
                star = plan_broadcast(M, U, peers, settings.chunk, ks=[])
                budget = lambda p: 3 * p.predicted_s + 60
                entry: dict[str, Any] = {"n": n, "calibration": cal, "t_star": bound, "plan": _chain_shape(plan),
                                         "runs": {}}
                log(f"  chain: {_chain_shape(plan)} predicted {plan.predicted_s:.1f} s (T* {bound:.1f} s)")
                entry["runs"]["chain"] = asdict(bench.transfer(topo, "chain", plan, timeout_s=budget(plan)))
                _log_run(log, entry["runs"]["chain"])
                if settings.star:
                    log(f"  star: predicted {star.predicted_s:.1f} s")
                    entry["runs"]["star"] = asdict(bench.transfer(topo, "star", star, timeout_s=budget(star)))
                    _log_run(log, entry["runs"]["star"])
                if n == biggest and settings.fault:
                    victim = _victim(plan)
                    log(f"  fault: killing {victim} at 40% of the predicted time")
                    entry["runs"]["fault"] = asdict(bench.transfer(
                        topo, "fault", plan, kill=victim, kill_after_s=0.4 * plan.predicted_s,
                        timeout_s=budget(plan)))
                    _log_run(log, entry["runs"]["fault"])
                if n == biggest and settings.delta:
                    delta = _run_delta(bench, topo, settings, U, peers, budget, log)
                    entry["runs"]["delta"] = delta
                if n == biggest and settings.links:
                    entry["links"] = _run_links(bench, topo, settings, U, peers, log)
                    entry["runs"].update(entry["links"].pop("runs"))
                results["sizes"].append(entry)
    return results


def _run_delta(bench: Bench, topo, settings: Settings, U: float, peers: list[PeerLink], budget, log) -> dict:
    """Deltas on, along the same chains as the full version; the prediction is recomputed for
    the delta's wire size, known only once the source has encoded it."""
    plan = plan_broadcast(settings.size, U, peers, settings.chunk, headroom=settings.headroom)
    run = bench.transfer(topo, "delta", plan, delta=True, timeout_s=budget(plan))
    wire = run.wire_bytes or settings.size
    h = settings.headroom
    U, peers = U * h, [PeerLink(p.id, p.down, p.up * h, p.latency) for p in peers]  # as the planner did
    chains = [[next(p for p in peers if p.id == w) for w in c] for c in plan.chains]
    if plan.kind == "chains":
        pred = predict_chains(wire, U, chains, wire / math.ceil(settings.size / settings.chunk))  # mean wire chunk
    else:
        pred = predict_star(wire, U, peers)
    run.predicted_s = pred.makespan
    log(f"  delta: {wire / MIB:.1f} MiB on the wire of {settings.size / MIB:.0f} MiB "
        f"({settings.size / wire:.1f}x smaller)")
    d = asdict(run)
    _log_run(log, d)
    return d


def _run_links(bench: Bench, topo, settings: Settings, U: float, peers: list[PeerLink], log) -> dict:
    """Two workers upload at b/4 though they declared b: one version planned from the
    declarations, the next from the `LinkTable` its transfers refreshed (what the learner does)."""
    from types import SimpleNamespace

    from broadcast.links import LinkTable, link_sample, uplink_sample

    M, c, h = settings.size, settings.chunk, settings.headroom
    declared = plan_broadcast(M, U, peers, c, headroom=h)
    slow = [chain[0] for chain in declared.chains if len(chain) > 1][:2]  # relays in the declared plan
    if not slow:
        return {"skipped": "the declared plan has no relays (a star)", "runs": {}}
    b = peers[0].up
    up_rates = {w: b / 4 for w in slow}
    truth = [PeerLink(p.id, p.down, up_rates.get(p.id, p.up), p.latency) for p in peers]
    table = LinkTable(uplink=U, default=b)
    for p in peers:
        table.declare(p.id, p.down, p.up)
        table.observe_rtt(p.id, 2 * p.latency)
    log(f"  links: {', '.join(slow)} declared {b / MBIT:.1f} Mbit/s up but upload {b / 4 / MBIT:.1f}; "
        f"planned from the declarations: {_chain_shape(declared)}")
    first = bench.transfer(topo, "links-declared", declared, relay_up_rates=up_rates,
                           timeout_s=6 * declared.predicted_s + 60)
    _log_run(log, asdict(first))
    for w, stats in first.stats.items():
        sample = link_sample(SimpleNamespace(**stats), first.wire_bytes) if stats else None
        if sample is not None:
            table.observe(w, sample)
    if first.source.get("stats"):
        sample = uplink_sample(SimpleNamespace(**first.source["stats"]), declared.rates)
        if sample is not None:
            table.observe_uplink(sample)
    measured = {p.id: table.link(p.id) for p in peers}
    replanned = plan_broadcast(M, table.uplink.rate, list(measured.values()), c, headroom=h)
    log(f"  links: re-planned from the measured links: {_chain_shape(replanned)} "
        f"(slow workers at the tails: {all(any(ch[-1] == w for ch in replanned.chains) for w in slow)})")
    second = bench.transfer(topo, "links-measured", replanned, relay_up_rates=up_rates,
                            timeout_s=6 * replanned.predicted_s + 60)
    _log_run(log, asdict(second))
    return {"slow": slow, "declared_mbit": b / MBIT, "true_up_mbit": b / 4 / MBIT,
            "t_star_true": lower_bound(M, U, truth), "plan_declared": _chain_shape(declared),
            "plan_measured": _chain_shape(replanned),
            "slow_at_tails": all(any(ch[-1] == w for ch in replanned.chains) for w in slow),
            "measured_up_mbit": {w: measured[w].up / MBIT for w in slow},
            "table": table.to_dict(), "runs": {"links-declared": asdict(first), "links-measured": asdict(second)}}


def _victim(plan: Plan) -> str:
    """A relay whose death forces repair: the middle of the longest chain (else a head)."""
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


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def _table(header: list[str], rows: list[list[str]]) -> str:
    cells = [header] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render(results: dict) -> str:
    s = results["settings"]
    out = [(f"broadcast: {s['size_mib']:g} MiB in {s['chunk_mib']:g} MiB chunks; learner uplink U = "
            f"{s['uplink_mbit']:g} Mbit/s, worker links b = {s['link_mbit']:g} Mbit/s each way, "
            f"{s['rtt_ms']:g} ms RTT per hop (latency: {results['latency']}); b below is the measured goodput; "
            f"chains planned and paced at {s.get('headroom', 1):g} x the measured uploads"), ""]

    def ratio(r: dict | None, t_star: float) -> float | None:
        return None if not r or r["measured_s"] is None else r["measured_s"] / t_star

    rows = []
    for e in results["sizes"]:
        c, st = e["runs"]["chain"], e["runs"].get("star")
        rows.append([str(e["n"]), _fmt(e["calibration"]["b_mbit"]), _fmt(e["t_star"], ".2f"), e["plan"],
                     _fmt(c["predicted_s"], ".2f"), _fmt(c["measured_s"], ".2f"), _fmt(ratio(c, e["t_star"]), ".3f"),
                     _fmt(st and st["predicted_s"], ".2f"), _fmt(st and st["measured_s"], ".2f"),
                     _fmt(ratio(st, e["t_star"]), ".2f"), _fmt(hop_lag(c), ".2f"),
                     _fmt(s["chunk_mib"] * MIB / (e["calibration"]["b_mbit"] * MBIT), ".2f"),
                     f"{100 * c['cpu_busy']:.0f}%"])
    out.append(_table(["N", "b Mbit/s", "T* s", "plan", "chain pred s", "chain meas s", "chain/T*",
                       "star pred s", "star meas s", "star/T*", "worst hop lag s", "model c/b s", "CPU busy"], rows))
    for e in results["sizes"]:
        f, d, c = e["runs"].get("fault"), e["runs"].get("delta"), e["runs"]["chain"]
        if f:
            base = c["measured_s"]
            head = (f"fault at N={e['n']}: {f['killed']} SIGKILLed at {_fmt(f['killed_at_s'])} s; "
                    f"{len(f['arrivals'])}/{e['n'] - 1} survivors complete")
            if not f["ok"]:
                out += ["", f"{head} -- FAILED: {f['error']}"]
            else:
                vs = (f" = {f['measured_s'] / base:.2f}x the fault-free {base:.2f} s" if base
                      else " (the fault-free run failed: no ratio)")
                out += ["", (f"{head} with verified bytes in {f['measured_s']:.2f} s{vs}; {f['repairs']} repair(s), "
                             f"{f['bytes_in'] / MIB:.0f} MiB received in all "
                             f"({(e['n'] - 1) * s['size_mib']:g} MiB needed)")]
        if d:
            src = d["source"]
            out += ["", f"delta at N={e['n']} (3% of float32 elements changed): "
                    f"{src['wire_bytes'] / MIB:.1f} MiB on the wire vs {src['total_bytes'] / MIB:.0f} MiB full "
                    f"({src['total_bytes'] / src['wire_bytes']:.1f}x); publish (hash+XOR+zstd) "
                    f"{src['publish_s']:.2f} s, decode {src['decode_s']:.2f} s (decoded bytes "
                    f"{'match' if src['decoded_ok'] else 'DIFFER'}); transfer "
                    + (f"{d['measured_s']:.2f} s (predicted {d['predicted_s']:.2f} s) vs {_fmt(c['measured_s'], '.2f')} s full"
                       if d["ok"] else f"FAILED: {d['error']}")]
        lk, r1, r2 = e.get("links"), e["runs"].get("links-declared"), e["runs"].get("links-measured")
        if lk and r1 and r2:
            ups = ", ".join(f"{w} {v:.1f}" for w, v in lk["measured_up_mbit"].items())
            t1, t2 = r1["measured_s"], r2["measured_s"]
            out += ["", f"links at N={e['n']}: {', '.join(lk['slow'])} declared {lk['declared_mbit']:.1f} Mbit/s up, "
                    f"really upload {lk['true_up_mbit']:.1f}; T* with the true links {lk['t_star_true']:.2f} s",
                    f"  planned from declarations: {lk['plan_declared']}, predicted {r1['predicted_s']:.2f} s, "
                    f"measured {_fmt(t1, '.2f')} s",
                    f"  re-planned from measured links (up: {ups} Mbit/s; slow workers at tails: "
                    f"{'yes' if lk['slow_at_tails'] else 'no'}): {lk['plan_measured']}, predicted "
                    f"{r2['predicted_s']:.2f} s, measured {_fmt(t2, '.2f')} s"
                    + (f" = {t2 / lk['t_star_true']:.2f}x T*, {t1 / t2:.1f}x faster" if t1 and t2 else "")]
    out.append("")
    out.append("star = the same Source/Relay code with K = N chains of length 1 (unpaced: TCP shares U).")
    out.append("worst hop lag = max over chain links of (child's completion - parent's); the model's is c/b + L.")
    out.append("CPU busy = both cores, every process on the machine, during the chain transfer.")
    return "\n".join(out)


# -- transports sub-benchmark ----------------------------------------------------------------------
def transports_cli(argv: Sequence[str]) -> int:
    """`echo-rl bench broadcast transports`: MB/s on loopback, aiohttp vs libp2p: one stream, and a
    3-relay chain."""
    p = argparse.ArgumentParser(prog="echo-rl bench broadcast transports", description=transports_cli.__doc__)
    p.add_argument("--size-mib", type=float, default=128, help="bytes to stream per transport")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    args = p.parse_args(list(argv))
    from broadcast.transports_bench import compare_transports

    rows = compare_transports(int(args.size_mib * MIB))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"loopback, {args.size_mib:g} MiB in 1 MiB frames (the broadcast framing): one stream per transport, "
          "then a relay chain (`broadcast.relay`) per transport; every node in one process, so CPU is the sum "
          "of all of them")
    print(_table(["transport", "MB/s", "CPU s/GiB", "note"],
                 [[r["transport"], _fmt(r.get("mb_s")), _fmt(r.get("cpu_s_per_gib"), ".2f"), r.get("note", "")]
                  for r in rows]))
    return 0


# -- command line ---------------------------------------------------------------------------------
def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("worker counts must be >= 1")
    return vals


def cli(argv: Sequence[str]) -> int:
    """`echo-rl bench broadcast [transports] [options]`; returns the exit status."""
    argv = list(argv)
    if argv and argv[0] == "transports":
        return transports_cli(argv[1:])
    p = argparse.ArgumentParser(prog="echo-rl bench broadcast", description=__doc__.split("\n\n")[0],
                                epilog="`echo-rl bench broadcast transports --help`: the loopback transport benchmark")
    p.add_argument("--workers", type=_ints, default=None, help="fleet sizes N (default 4,8,16; quick: 2,4)")
    p.add_argument("--size-mib", type=float, default=None, help="snapshot size (default 256; quick: 16)")
    p.add_argument("--chunk-mib", type=float, default=None, help="chunk size (default 4; quick: 1)")
    p.add_argument("--link-mbit", type=float, default=50.0, help="per-worker cap b, each way (default 50)")
    p.add_argument("--uplink-mbit", type=float, default=None, help="learner uplink U (default 4b; quick: 2b)")
    p.add_argument("--rtt-ms", type=float, default=40.0, help="round-trip time of one hop (default 40)")
    p.add_argument("--headroom", type=float, default=0.95,
                   help="plan (and pace) uploads at this share of the measured rates (1 = off; default 0.95)")
    p.add_argument("--no-star", action="store_true", help="skip the star baseline (the longest runs)")
    p.add_argument("--no-fault", action="store_true", help="skip the killed-relay run")
    p.add_argument("--no-delta", action="store_true", help="skip the delta run")
    p.add_argument("--no-links", action="store_true", help="skip the misdeclared-links run (two versions)")
    p.add_argument("--quick", action="store_true", help="smoke test: N=2,4, 16 MiB, 1 MiB chunks, U=2b")
    p.add_argument("--json", action="store_true", help="print the results as JSON (progress goes to stderr)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("echo-rl bench broadcast: needs root for network namespaces (tc caps, veth); "
              "run it as root. No loopback fallback: without caps the numbers would mean nothing.",
              file=sys.stderr)
        return 2
    q = args.quick
    settings = Settings(
        workers=args.workers or ((2, 4) if q else (4, 8, 16)),
        size_mib=args.size_mib or (16 if q else 256),
        chunk_mib=args.chunk_mib or (1 if q else 4),
        link_mbit=args.link_mbit,
        uplink_mbit=args.uplink_mbit or (2 if q else 4) * args.link_mbit,
        rtt_ms=args.rtt_ms,
        star=not args.no_star, fault=not args.no_fault, delta=not args.no_delta, links=not args.no_links,
        headroom=args.headroom,
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
    ok = all(r["ok"] for e in results["sizes"] for r in e["runs"].values())
    return 0 if ok else 1


def main() -> None:
    raise SystemExit(cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
