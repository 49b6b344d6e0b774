"""Link estimates: each peer's download, upload and latency, declared at join and then refreshed
by the transfers themselves. What the planner plans with (`PeerLink`s and the source uplink).

Evidence, weakest first:
- a *declared* rate (the worker's config) — a prior, used until a transfer measures the link;
- the round trip of the worker's heartbeats (one-way latency = RTT / 2);
- a transfer's *goodput* (`link_sample`): a relay's download rate over one version, and its
  upload rate while forwarding it (the source's upload over all its chains).

A goodput sample is *link-limited* when the link was the bottleneck — then the estimate moves to
the sample, down as well as up — or *app-limited* when something else set the pace: the sender
paced the chain below the link (the planner's headroom), or a relay forwarded exactly as fast as
it received. An app-limited sample proves only that the link is at least that fast, so it can
only raise the estimate. Without the distinction a paced chain would ratchet its own estimates
down: measured at the pace, planned at 95% of that, paced lower the next time, and so on.

A hop's goodput is min(sender's upload, receiver's download), and in a chain every member
after a slow one receives slowly too, so a slow download is blamed by looking at the sender's
sample of the same version:
- the sender itself received no faster: the slowness came from further up (not this link);
- the sender fell behind its own inbound stream at about this rate (a link-limited upload):
  the sender's upload takes the blame — consumer links are asymmetric, upload being the scarce
  direction — and the planner moves it to a chain's tail, where its upload no longer matters;
- otherwise the receiver's own download was the limit.
A receiver wrongly spared is measured again at its next position.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from broadcast.planner import PeerLink

MBIT = 1e6 / 8  # bytes/s per Mbit/s
MAX_SAMPLE = 1e5 * MBIT  # 100 Gbit/s: a sample beyond it is not a measurement (echo.protocol.Mbit)
#: Goodput below this share of the rate the sender offered means the link, not the sender, was the limit.
LIMITED_SHARE = 0.9
#: Shorter transfers measure TCP slow start, setup and a busy CPU, not the link: a 1.2 MB demo
#: snapshot on loopback "measured" a 1 Gbit/s uplink at 83 Mbit/s while the trainer held the CPU.
MIN_SAMPLE_BYTES = 4 << 20
#: Samples waiting for the next plan before they are counted anyway.
MAX_PENDING = 4096
MIN_SAMPLE_SECONDS = 0.2
#: A relay whose forwarding ends more than this share of its receive time after its receive
#: ended was held back by its uplink (or its child), not by its inbound stream.
FORWARD_LAG_SHARE = 0.1

Source = Literal["default", "declared", "measured"]


@dataclass(frozen=True)
class LinkSample:
    """One version's evidence about a node's links (bytes/s); see the module docstring."""

    key: str
    down: float | None = None
    down_limited: bool = False
    up: float | None = None
    up_limited: bool = False
    parent: str | None = None  # who sent this node the version (to pair a slow hop's two ends)

    def to_dict(self) -> dict:
        return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Any) -> "LinkSample":
        """Parse a peer's report; `ValueError` naming the field on anything malformed."""
        if not isinstance(d, dict) or not isinstance(d.get("key"), str) or not d["key"]:
            raise ValueError("a link sample is a map whose `key` names the version it measured (e.g. \"v12\"), "
                             f"got {'a map without one' if isinstance(d, dict) else type(d).__name__}")
        out: dict[str, Any] = {"key": d["key"][:64]}
        parent = d.get("parent")
        if parent is not None and not isinstance(parent, str):
            raise ValueError(f"link sample parent must be a node id, got {parent!r:.40}")
        out["parent"] = parent[:64] if parent else None
        for name in ("down", "up"):
            v = d.get(name)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                    raise ValueError(f"link sample {name} must be a positive number of bytes/s, got {v!r}")
                if v > MAX_SAMPLE:
                    raise ValueError(f"link sample {name} of {v:.3g} bytes/s is beyond any rented link "
                                     f"({MAX_SAMPLE / MBIT:.0f} Mbit/s)")
                out[name] = float(v)
            flag = d.get(f"{name}_limited", False)
            if not isinstance(flag, bool):
                raise ValueError(f"link sample {name}_limited must be true or false, got {flag!r}")
            out[f"{name}_limited"] = flag
        return cls(**out)


def link_sample(stats: Any, wire_size: int, offered_up: float | None = None) -> LinkSample | None:
    """What one version's `broadcast.relay.TransferStats` says about this node's links.

    Download: bytes received over first chunk to completion; link-limited unless it ran at the
    chain's pacing rate. Upload: bytes sent over first to last forwarded chunk; link-limited
    when it was not paced (or ran below the pace) and, for a relay, when forwarding fell behind
    receiving. `offered_up` is what the source offered its chains in all (sum of their rates;
    None: unpaced). None when the transfer was too small to measure anything.
    """
    down = up = None
    down_limited = up_limited = False
    t_in = None
    if stats.t_first_chunk is not None and stats.t_complete is not None:
        t_in = stats.t_complete - stats.t_first_chunk
        if stats.bytes_in >= MIN_SAMPLE_BYTES and t_in >= MIN_SAMPLE_SECONDS:
            down = stats.bytes_in / t_in
            down_limited = stats.offered_rate is None or down < LIMITED_SHARE * stats.offered_rate
    if stats.t_first_forward is not None and stats.t_last_forward is not None:
        t_out = stats.t_last_forward - stats.t_first_forward
        if stats.bytes_out >= MIN_SAMPLE_BYTES and t_out >= MIN_SAMPLE_SECONDS:
            up = stats.bytes_out / t_out
            offered = stats.offered_rate if stats.offered_rate is not None else offered_up
            up_limited = offered is None or up < LIMITED_SHARE * offered
            if t_in is not None:  # a relay: was it its uplink, or its own inbound, that set the pace?
                up_limited = up_limited and stats.t_last_forward - stats.t_complete > FORWARD_LAG_SHARE * t_in
    if down is None and up is None:
        return None
    return LinkSample(stats.key, down, down_limited, up, up_limited, stats.parent)


def uplink_sample(stats: Any, rates: Any) -> LinkSample | None:
    """The source's upload over one version's head streams (`TransferStats.pushes`).

    Goodput is the sum of the head streams' rates (they run concurrently). It is link-limited
    when *every* chain ran below its planned feed (`rates`, the route's): a shared uplink slows
    them all, while one slow chain is its head's download, which that head's sample reports.
    """
    heads = [p for p in stats.pushes if p["seconds"] > 0 and p["bytes"] > 0]
    if sum(p["bytes"] for p in heads) < MIN_SAMPLE_BYTES or max((p["seconds"] for p in heads),
                                                                 default=0) < MIN_SAMPLE_SECONDS:
        return None
    per_chain = [(p["bytes"] / p["seconds"], rates[p["chain"]] if p["chain"] < len(rates) else None) for p in heads]
    limited = all(r is None or got < LIMITED_SHARE * r for got, r in per_chain)
    return LinkSample(stats.key, up=sum(got for got, _ in per_chain), up_limited=limited)


@dataclass
class Estimate:
    """One direction of one link: the current rate (bytes/s) and where it came from."""

    rate: float
    source: Source = "default"
    samples: int = 0

    def declare(self, rate: float) -> None:
        if self.source != "measured" and rate > 0:
            self.rate, self.source = rate, "declared"

    def observe(self, rate: float, limited: bool, alpha: float) -> None:
        if limited:  # the link itself: follow it (the first measurement replaces any prior)
            self.rate = rate if self.source != "measured" else (1 - alpha) * self.rate + alpha * rate
            self.source = "measured"
        elif rate > self.rate:  # a lower bound above the estimate: raise to it
            self.rate, self.source = rate, "measured"
        self.samples += 1


@dataclass
class PeerEstimate:
    down: Estimate
    up: Estimate
    rtt: float | None = None
    seen: tuple[str, ...] = ()  # sample keys already counted (peers repeat them)


class LinkTable:
    """The learner's view of every peer's links and of its own uplink.

    `default` (bytes/s) stands in for a direction nobody declared or measured yet; `alpha` is
    the weight of a new link-limited sample against the running estimate.
    """

    def __init__(self, uplink: float, default: float, alpha: float = 0.5) -> None:
        if uplink <= 0 or default <= 0 or not 0 < alpha <= 1:
            raise ValueError("uplink and default must be positive bytes/s and 0 < alpha <= 1")
        self.uplink = Estimate(uplink, "declared")
        self.default, self.alpha = default, alpha
        self.peers: dict[str, PeerEstimate] = {}
        self._uplink_seen: tuple[str, ...] = ()
        self._pending: list[tuple[str, LinkSample]] = []  # counted at the next `settle`

    def _peer(self, peer: str) -> PeerEstimate:
        if peer not in self.peers:
            self.peers[peer] = PeerEstimate(Estimate(self.default), Estimate(self.default))
        return self.peers[peer]

    def declare(self, peer: str, down: float = 0.0, up: float = 0.0) -> None:
        """A peer's declared rates (bytes/s; 0 = unknown); ignored once measured."""
        p = self._peer(peer)
        p.down.declare(down)
        p.up.declare(up)

    def observe(self, peer: str, sample: LinkSample) -> bool:
        """Take one sample (once per version key); returns whether it was new. It counts at the
        next `settle` (planning does that), so both ends of a hop can be paired first, or at once
        when `MAX_PENDING` wait: in star mode nothing plans, and one worker's heartbeats of fresh
        keys queued 1,600 samples a second."""
        p = self._peer(peer)
        if sample.key in p.seen:
            return False
        p.seen = (*p.seen, sample.key)[-8:]
        self._pending.append((peer, sample))
        if len(self._pending) >= MAX_PENDING:
            self.settle()
        return True

    def settle(self) -> None:
        """Count the pending samples, blaming each slow download as the module docstring says."""
        pending, self._pending = self._pending, []
        by_node = {(peer, s.key): s for peer, s in pending}
        for peer, s in pending:
            p = self.peers.get(peer)
            if p is None:  # forgotten meanwhile: not brought back (its series stayed in /metrics forever)
                continue
            if s.down is not None:
                p.down.observe(s.down, s.down_limited and not self._not_own(s, by_node.get((s.parent, s.key))),
                               self.alpha)
            if s.up is not None:
                p.up.observe(s.up, s.up_limited, self.alpha)

    def observe_uplink(self, sample: LinkSample) -> None:
        """The source's own upload sample (`link_sample` of the source's stats)."""
        if sample.up is not None and sample.key not in self._uplink_seen:
            self._uplink_seen = (*self._uplink_seen, sample.key)[-8:]
            self.uplink.observe(sample.up, sample.up_limited, self.alpha)

    def observe_rtt(self, peer: str, rtt: float) -> None:
        """A round trip (s) between the learner and the peer; kept as a moving average."""
        if rtt >= 0 and math.isfinite(rtt):
            p = self._peer(peer)
            p.rtt = rtt if p.rtt is None else (1 - self.alpha) * p.rtt + self.alpha * rtt

    def forget(self, peer: str) -> None:
        self.peers.pop(peer, None)
        self._pending = [(q, s) for q, s in self._pending if q != peer]

    @staticmethod
    def _not_own(s: LinkSample, sender: LinkSample | None) -> bool:
        """Whether a slow download `s` is explained by its sender's sample of the same version."""
        if sender is None:
            return False
        about = s.down / LIMITED_SHARE  # "no faster than this download", with measurement slack
        inherited = sender.down is not None and sender.down <= about
        sender_slow_up = sender.up is not None and sender.up_limited and sender.up <= about
        return inherited or sender_slow_up

    def link(self, peer: str) -> PeerLink:
        """What the planner uses for `peer` (latency: half the round trip)."""
        self.settle()
        p = self._peer(peer)
        return PeerLink(peer, p.down.rate, p.up.rate, (p.rtt or 0.0) / 2)

    def to_dict(self) -> dict:
        """Mbit/s and milliseconds, with the source of each number (status pages, run log)."""
        self.settle()

        def mbit(e: Estimate) -> dict:
            return {"mbit": round(e.rate * 8 / 1e6, 2), "source": e.source, "samples": e.samples}

        return {"uplink": mbit(self.uplink),
                "peers": {k: {"down": mbit(p.down), "up": mbit(p.up),
                              "rtt_ms": None if p.rtt is None else round(p.rtt * 1e3, 2)}
                          for k, p in self.peers.items()}}
