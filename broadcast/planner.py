"""Broadcast planning: predict star and chain times from measured links, pick the fastest.

Pure functions of plain numbers (bytes, bytes/s, seconds); no I/O. See
`/work/shared/spec/broadcast.md` for the physics. Symbols: snapshot `M` bytes, learner uplink
`U`, worker `i` download `d_i`, upload `u_i`, one-way latency `l_i` of the hop into it, chunk `c`.

- Star (learner pushes to every worker, links shared fairly):
  `T_star = max(M / min_i d_i, N·M / U) + max_i l_i`. Per-worker arrival times come from
  max-min fair sharing of `U` capped by each `d_i` (the last finisher reproduces the formula).
- K disjoint pipelined chains, each carrying the whole snapshot. The source feeds chain `k` at
  `s_k` (`chain_feed_rates`: a max-min fair share of `U`, capped first at the chain's bottleneck
  `b_k` = min of every member's `d` and every non-tail member's `u`). Member `p` (1-based)
  receives at the prefix rate `r_p = min(s_k, d_1..d_p, u_1..u_{p-1})` — relays write into a
  buffer of the whole snapshot, so a slow member delays only those after it — and finishes at
  `M/r_p + Σ_{q≤p} l_q + Σ_{1<q≤p} c/r_q` (store-and-forward per chunk: a relay forwards a
  chunk once it is whole and verified). For identical workers this is the spec's
  `M/r + h·L + (h − 1)·c/r` with `r = min(U/K, d, u)`.
- Fluid lower bound: `T* = max(M/U, M/min_i d_i, N·M/(U + Σ_i u_i)) + min_i l_i`.

Chain formation for a given K (bandwidth-sorted): the K workers with the lowest upload become
the tails (a tail's upload is never used); the others are sorted by `min(d, u)`, fastest first,
and cut into K contiguous groups, so workers of similar bandwidth share a chain (one slow worker
slows one chain, not all) and faster workers sit nearer the learner; faster chains get the
larger groups and the faster tails.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable, Literal, Sequence

from broadcast.manifest import BroadcastError


class PlanError(BroadcastError, ValueError):
    """Planner input is invalid (no workers, non-positive bandwidth, bad fraction)."""


@dataclass(frozen=True)
class PeerLink:
    """A worker's measured links: bytes/s down and up, one-way latency (s) of the hop into it."""

    id: str
    down: float
    up: float
    latency: float = 0.0
    reachable: bool = True  # False: behind NAT, accepts no connections; a leaf, its upload unused


@dataclass(frozen=True)
class Prediction:
    """Predicted dissemination of one design: per-worker arrival times and the makespan."""

    name: str
    chains: tuple[tuple[str, ...], ...]
    rates: tuple[float, ...]
    arrivals: dict[str, float]
    shares: tuple[float, ...] = ()  # stripes: each tree's share of the bytes (else every tree carries all)
    parents: tuple[tuple[int, ...], ...] = ()  # each member's parent per tree (-1 source); () = chains
    pull: tuple[str, ...] = ()  # unreachable workers: they pull from their parent
    chunk: float = 0.0  # the chunk size the prediction assumed
    groups: tuple[int, ...] = ()  # stripes: each tree's group; a group's shares split the chunks ()=one

    @property
    def makespan(self) -> float:
        return max(self.arrivals.values())

    def time_to_fraction(self, fraction: float) -> float:
        """Time until `fraction` of the workers hold the snapshot (the paper's target fraction)."""
        if not 0.0 < fraction <= 1.0:
            raise PlanError(f"fraction {fraction} must be in (0, 1]")
        times = sorted(self.arrivals.values())
        return times[max(0, math.ceil(fraction * len(times)) - 1)]


@dataclass(frozen=True)
class Plan:
    """The chosen design, serialisable to publish with a version.

    `chains` are the trees' members (worker ids, learner side first); a star is N chains of one
    worker. `rates` are the pacing rates per tree (bytes/s). Stripes (and chains with pulling
    leaves) add `parents` (per tree, each member's parent: -1 the source, else a member index),
    stripes `shares` (each tree's share of the bytes). `pull` names unreachable workers, which
    pull from their parents. `alternatives` maps every design considered ("star", "chains:K",
    "stripes:G") to its predicted time for the same objective; `chunk_bytes` is the chunk size
    chosen for it (`choose_chunk`).
    """

    kind: Literal["star", "chains", "stripes"]
    chains: tuple[tuple[str, ...], ...]
    rates: tuple[float, ...]
    predicted_s: float
    lower_bound_s: float
    fraction: float
    snapshot_bytes: int
    chunk_bytes: int
    arrivals: dict[str, float] = field(default_factory=dict)
    alternatives: dict[str, float] = field(default_factory=dict)
    shares: tuple[float, ...] = ()
    parents: tuple[tuple[int, ...], ...] = ()
    pull: tuple[str, ...] = ()
    groups: tuple[int, ...] = ()  # stripes fed group by group: the shares of each group split all chunks

    @property
    def k(self) -> int:
        return len(self.chains)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["chains"] = [list(c) for c in self.chains]
        d["rates"] = list(self.rates)
        d["shares"], d["parents"], d["pull"] = list(self.shares), [list(p) for p in self.parents], list(self.pull)
        d["groups"] = list(self.groups)
        return d

    def summary(self) -> dict:
        """What is published with the version (signed into its route): no per-worker arrivals."""
        return {"kind": self.kind, "predicted_s": round(self.predicted_s, 4),
                "lower_bound_s": round(self.lower_bound_s, 4), "fraction": self.fraction, "chunk_bytes": self.chunk_bytes,
                "alternatives": {k: round(v, 4) for k, v in self.alternatives.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        d = dict(d)
        d["chains"] = tuple(tuple(c) for c in d["chains"])
        d["rates"] = tuple(d["rates"])
        d["shares"] = tuple(d.get("shares", ()))
        d["parents"] = tuple(tuple(p) for p in d.get("parents", ()))
        d["pull"] = tuple(d.get("pull", ()))
        d["groups"] = tuple(d.get("groups", ()))
        return cls(**d)


def _check(M: float, U: float, peers: Sequence[PeerLink]) -> None:
    if M <= 0 or U <= 0:
        raise PlanError(f"snapshot size ({M}) and learner uplink ({U}) must be positive")
    if not peers:
        raise PlanError("no workers to plan for")
    if len({p.id for p in peers}) != len(peers):
        raise PlanError("worker ids must be unique")
    for p in peers:
        if p.down <= 0 or p.up < 0 or p.latency < 0:
            raise PlanError(f"worker {p.id}: download must be > 0, upload and latency >= 0 (got {p})")


def water_fill(capacity: float, caps: Sequence[float]) -> list[float]:
    """Max-min fair shares of `capacity` among flows each capped at `caps[i]`."""
    shares = [0.0] * len(caps)
    left, remaining = capacity, sorted(range(len(caps)), key=lambda i: caps[i])
    while remaining:
        fair = left / len(remaining)
        i = remaining[0]
        if caps[i] <= fair:
            shares[i] = caps[i]
            left -= caps[i]
            remaining.pop(0)
        else:
            for j in remaining:
                shares[j] = fair
            break
    return shares


def lower_bound(M: float, U: float, peers: Sequence[PeerLink]) -> float:
    """Fluid lower bound T* for peer-assisted distribution (Kumar & Ross 2006)."""
    _check(M, U, peers)
    n = len(peers)
    up = sum(p.up for p in peers if p.reachable)  # an unreachable worker uploads to nobody
    return max(M / U, M / min(p.down for p in peers), n * M / (U + up)) + min(p.latency for p in peers)


def predict_star(M: float, U: float, peers: Sequence[PeerLink]) -> Prediction:
    """Star push under max-min fair sharing of `U`: as workers finish, the rest speed up."""
    _check(M, U, peers)
    left = {p.id: float(M) for p in peers}
    caps = {p.id: p.down for p in peers}
    lat = {p.id: p.latency for p in peers}
    arrivals: dict[str, float] = {}
    t = 0.0
    while left:
        ids = list(left)
        rates = dict(zip(ids, water_fill(U, [caps[i] for i in ids])))
        dt = min(left[i] / rates[i] for i in ids)
        t += dt
        for i in ids:
            left[i] -= rates[i] * dt
            if left[i] <= 1e-9 * M:
                arrivals[i] = t + lat[i]
                del left[i]
    initial = water_fill(U, [p.down for p in peers])
    return Prediction("star", tuple((p.id,) for p in peers), tuple(initial), arrivals)


def star_time(M: float, U: float, peers: Sequence[PeerLink]) -> float:
    """Closed form of the star makespan: `max(M / min d, N·M / U) + max l`."""
    _check(M, U, peers)
    return max(M / min(p.down for p in peers), len(peers) * M / U) + max(p.latency for p in peers)


def form_chains(peers: Sequence[PeerLink], k: int) -> list[list[PeerLink]]:
    """Bandwidth-sorted K chains (see the module docstring); learner side first in each chain."""
    n = len(peers)
    if not 1 <= k <= n:
        raise PlanError(f"K={k} chains for {n} workers: need 1 <= K <= N")
    by_upload = sorted(peers, key=lambda p: (p.up, p.down, p.id))
    tails = sorted(by_upload[:k], key=lambda p: (-p.down, p.id))
    relays = sorted(by_upload[k:], key=lambda p: (-min(p.down, p.up), -p.down, p.id))
    sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]  # larger groups first
    chains, pos = [], 0
    for size, tail in zip(sizes, tails):
        chains.append(relays[pos:pos + size - 1] + [tail])
        pos += size - 1
    return chains


def predict_chains(M: float, U: float, chains: Sequence[Sequence[PeerLink]], chunk: float,
                   name: str | None = None) -> Prediction:
    """Pipelined chains fed by a pacing source; see the module docstring for the model."""
    flat = [p for c in chains for p in c]
    _check(M, U, flat)
    if chunk <= 0 or any(not c for c in chains):
        raise PlanError("chunk size must be positive and chains non-empty")
    feeds = chain_feed_rates(U, chains)
    arrivals: dict[str, float] = {}
    for chain, s in zip(chains, feeds):
        for p, rate, lat, lag in _pipeline(chain, s, chunk):
            arrivals[p.id] = M / rate + lat + lag if rate > 0 else math.inf
    return Prediction(name or f"chains:{len(chains)}", tuple(tuple(p.id for p in c) for c in chains),
                      tuple(feeds), arrivals)


def chain_feed_rates(U: float, chains: Sequence[Sequence[PeerLink]]) -> list[float]:
    """The source's pacing rate per chain (bytes/s).

    First every chain gets its max-min fair share of `U` capped at its bottleneck `b_k` (what
    its last member can use: this minimises the makespan). Uplink left over then goes, again
    max-min fair, to chains whose head can take more (it speeds up the members before the
    bottleneck, since relays buffer the whole snapshot).
    """
    bottlenecks = [min(min(p.down for p in c), min((p.up for p in c[:-1]), default=math.inf)) for c in chains]
    feeds = water_fill(U, bottlenecks)
    left = U - sum(feeds)
    if left > 1e-9 * U:
        extra = water_fill(left, [max(0.0, c[0].down - f) for c, f in zip(chains, feeds)])
        feeds = [f + e for f, e in zip(feeds, extra)]
    return feeds


def candidate_ks(n: int, dense_up_to: int = 64) -> list[int]:
    """Every K up to `dense_up_to`, then a geometric ladder, always including N (cheap for big N)."""
    ks = set(range(1, min(n, dense_up_to) + 1))
    k = float(dense_up_to)
    while k < n:
        k *= 1.25
        ks.add(min(n, int(k)))
    ks.add(n)
    return sorted(ks)


#: Pipeline fill allowed by the chunk size, as a share of the transfer (`choose_chunk`).
FILL_SHARE = 0.02
#: The smallest chunk worth its per-chunk cost (a frame, a hash, a wake-up of every forwarder):
#: 32 striped workers moving 64 MiB on this 2-core VM took 1.59x T* in 64 KiB chunks and 1.30x
#: in 256 KiB ones (relays' CPU 32 s vs 25 s), though the model favours the smaller.
MIN_CHUNK = 256 << 10
MAX_CHUNK = 16 << 20
MAX_CHUNKS = 1 << 16  # a manifest of ~100 B per chunk travels in every stream header
DEFAULT_GROUP_SIZE = 32  # stripes inside groups of at most this many workers: fan-out stays bounded
DESIGNS = ("star", "chains", "stripes")
#: Stripes must be predicted this much faster than the best star or chains to be chosen. The
#: model counts bytes, not streams: stripes open N² streams (each with its own stream header),
#: handle N times more chunks per relay and pace N - 1 streams per owner, which on the 2-core
#: test VM cost 32 symmetric workers 1.4x where chains predicted within 1% of them took 1.1x.
STRIPES_MARGIN = 0.05


def choose_chunk(M: float, span_bytes: float, depth: int) -> int:
    """The chunk size for a transfer whose smallest span (a stripe, or the whole snapshot down a
    chain) is `span_bytes` and crosses `depth` store-and-forward hops.

    Each hop holds a chunk until it is whole and verified, so the last byte is late by
    `depth·c/r` after `span/r`: keeping that below `FILL_SHARE` of the transfer gives
    `c = FILL_SHARE·span/depth`. Bounded below by per-chunk overhead (`MIN_CHUNK`) and the
    manifest's size (at most 65,536 chunks), above by 16 MiB; a whole number of 64 KiB.
    """
    c = FILL_SHARE * span_bytes / depth if depth > 0 else MAX_CHUNK
    c = max(MIN_CHUNK, math.ceil(M / MAX_CHUNKS), min(MAX_CHUNK, c))
    return int(math.ceil(c / (64 << 10)) * (64 << 10))


def _leaf_parents(chains: Sequence[Sequence[PeerLink]], leaves: Sequence[PeerLink]) -> list[list[PeerLink]]:
    """Unreachable workers hang off chain tails (whose upload a chain never uses), fastest
    chains first, round robin: `result[k]` are chain k's leaves."""
    out: list[list[PeerLink]] = [[] for _ in chains]
    for i, leaf in enumerate(leaves):
        out[i % len(chains)].append(leaf)
    return out


def predict_chains_with_leaves(M: float, U: float, chains: Sequence[Sequence[PeerLink]],
                               leaves: Sequence[PeerLink], chunk: float) -> Prediction:
    """K chains of reachable workers, each unreachable worker a leaf pulling from a tail."""
    base = predict_chains(M, U, chains, chunk)
    if not leaves:
        return replace(base, chunk=chunk)
    per_chain = _leaf_parents(chains, leaves)
    arrivals = dict(base.arrivals)
    trees, parents = [], []
    for chain, feed, mine in zip(chains, base.rates, per_chain):
        tail, rate, lat, lag = list(_pipeline(chain, feed, chunk))[-1]
        for leaf in mine:
            r = min(rate, tail.up / len(mine), leaf.down)
            arrivals[leaf.id] = M / r + lat + leaf.latency + lag + chunk / r if r > 0 else math.inf
        trees.append(tuple(p.id for p in chain) + tuple(p.id for p in mine))
        parents.append(tuple(range(-1, len(chain) - 1)) + (len(chain) - 1,) * len(mine))
    return Prediction(base.name, tuple(trees), base.rates, arrivals, parents=tuple(parents),
                      pull=tuple(p.id for p in leaves), chunk=chunk)


def _pipeline(chain: Sequence[PeerLink], feed: float, chunk: float):
    """Each node of a pipelined chain fed at `feed`: (node, the rate it receives at, the latency
    to it, the chunk-forwarding lag to it)."""
    rate, lat, lag = feed, 0.0, 0.0
    for pos, p in enumerate(chain):
        if pos > 0:
            rate = min(rate, chain[pos - 1].up)
            lag += chunk / rate if rate > 0 else math.inf
        rate = min(rate, p.down)
        lat += p.latency
        yield p, rate, lat, lag


def stripe_groups(peers: Sequence[PeerLink], group_size: int) -> list[list[PeerLink]]:
    """Workers dealt into `ceil(N / group_size)` groups, by upload, round robin: every group
    gets a like mix of fast and slow uploaders, and unreachable workers are spread too."""
    g = max(1, math.ceil(len(peers) / group_size))
    order = sorted(peers, key=lambda p: (not p.reachable, -p.up, p.id))
    return [order[j::g] for j in range(g)]


def predict_stripes(M: float, U: float, peers: Sequence[PeerLink], chunk: float | None = None,
                    group_size: int = DEFAULT_GROUP_SIZE) -> Prediction | None:
    """Stripes sized to uploads (Mutualcast; SplitStream's groups beyond `group_size` workers).

    One group (N <= group_size): stripe `i` belongs to reachable worker `i`; the source sends
    it to `i`, which sends it to the N - 1 others. Its rate `r_i` is `U·u_i/Σu` while the uplink
    is the limit, else `u_i/(N - 1)` with the uplink left over sent to everyone directly as one
    more stripe (`r_0` each): the broadcast rate `R = Σr_i + r_0 = min(U, (U + Σu)/N)`, capped at
    the slowest download. In groups, the groups' owners of stripe `s` form a chain between
    groups, each sending the stripe to its own group and the next owner; `r_s` is the smallest
    `u/fan-out` of its owners (scaled down to fit `U` and the downloads). Stripe `s` carries
    `r_s/R` of the bytes, so all end together at `M/R`; the last byte is late by one chunk per
    store-and-forward hop at the stripe's rate — a slow uploader's stripe is so slow that its
    one-chunk lag can outweigh its upload, so the owners are the fastest `m` uploaders of each
    group for the `m` predicted fastest. `chunk=None` picks it (`choose_chunk`). None if no
    worker can upload.
    """
    _check(M, U, peers)
    if len(peers) < 2:
        return None
    groups = stripe_groups(peers, group_size)
    owners = [[p for p in g if p.reachable and p.up > 0] for g in groups]  # fastest first
    k = min(len(o) for o in owners)
    if k == 0:
        return None
    best = _best_owners(M, U, peers, groups, owners, chunk)
    if len(groups) > 1:
        # Or every group its own Mutualcast, fed by the source with U/G: better when the
        # uplink can feed every group at the rate its uploads sustain (U large, as a datacenter's).
        parallel = _parallel_groups(M, U, groups, owners, chunk)
        if parallel.makespan < best.makespan * (1 - 1e-9):
            best = parallel
    return best


def _best_owners(M: float, U: float, peers: Sequence[PeerLink], groups: list[list[PeerLink]],
                 owners: list[list[PeerLink]], chunk: float | None) -> Prediction:
    """Stripes owned by the fastest `m` uploaders of each group, for the best `m`."""
    k = min(len(o) for o in owners)
    best: Prediction | None = None
    for m in sorted({max(1, k * i // 8) for i in range(1, 9)} | set(range(1, min(k, 8) + 1))):
        pred = _stripes(M, U, peers, groups, [o[:m] for o in owners], chunk)
        if best is None or pred.makespan < best.makespan * (1 - 1e-9):
            best = pred
    assert best is not None
    return best


def _parallel_groups(M: float, U: float, groups: list[list[PeerLink]], owners: list[list[PeerLink]],
                     chunk: float | None) -> Prediction:
    """Each group striped on its own with U / G of the uplink; one chunk size for all."""
    G = len(groups)
    preds = [_best_owners(M, U / G, g, [g], [o], chunk) for g, o in zip(groups, owners)]
    if chunk is None:  # one manifest: the smallest chunk any group wants
        c = min(p.chunk for p in preds)
        preds = [_best_owners(M, U / G, g, [g], [o], c) for g, o in zip(groups, owners)]
    trees, parents, rates, shares, tags, arrivals = [], [], [], [], [], {}
    for j, p in enumerate(preds):
        trees += p.chains
        parents += p.parents
        rates += p.rates
        shares += p.shares
        tags += [j] * len(p.chains)
        arrivals.update(p.arrivals)
    pull = tuple(x for p in preds for x in p.pull)
    return Prediction(f"stripes:{G}p", tuple(trees), tuple(rates), arrivals, shares=tuple(shares),
                      parents=tuple(parents), pull=pull, chunk=preds[0].chunk, groups=tuple(tags))


def _stripes(M: float, U: float, peers: Sequence[PeerLink], groups: list[list[PeerLink]],
             owners: list[list[PeerLink]], chunk: float | None) -> Prediction:
    n, G, k = len(peers), len(groups), len(owners[0])
    fan = [len(g) - 1 + (1 if j < G - 1 else 0) for j, g in enumerate(groups)]
    rates = [min(owners[j][s].up / fan[j] if fan[j] else math.inf for j in range(G)) for s in range(k)]
    direct = 0.0
    if sum(rates) > U:  # the uplink is the limit: stripes in proportion to what the owners can take
        rates = [U * r / sum(rates) for r in rates]
    elif G == 1:  # uplink to spare: one more stripe, straight from the source to everyone
        direct = (U - sum(rates)) / n
    R = sum(rates) + direct
    d_min = min(p.down for p in peers)
    if R > d_min:
        rates, direct = [r * d_min / R for r in rates], direct * d_min / R
        R = d_min
    if chunk is None:
        smallest = min(rates + ([direct] if direct > 0 else [])) / R * M
        chunk = choose_chunk(M, smallest, G)
    trees, parents, shares = [], [], []
    arrivals = {p.id: 0.0 for p in peers}
    for s in range(k):
        members, par, at = [], [], {}
        prev, lat_prev = -1, 0.0
        for j, g in enumerate(groups):
            owner = owners[j][s]
            o_idx = len(members)
            members.append(owner.id)
            par.append(prev)
            lat_o = lat_prev + owner.latency
            at[owner.id] = (lat_o, j)
            for p in g:
                if p.id != owner.id:
                    members.append(p.id)
                    par.append(o_idx)
                    at[p.id] = (lat_o + p.latency, j + 1)
            prev, lat_prev = o_idx, lat_o
        for pid, (lat, depth) in at.items():
            arrivals[pid] = max(arrivals[pid], M / R + lat + depth * chunk / rates[s])
        trees.append(tuple(members))
        parents.append(tuple(par))
        shares.append(rates[s] / R)
    tree_rates = list(rates)
    if direct > 0:
        trees.append(tuple(p.id for p in peers))
        parents.append((-1,) * n)
        tree_rates.append(direct)
        shares.append(direct / R)
        for p in peers:
            arrivals[p.id] = max(arrivals[p.id], M / R + p.latency)
    pull = tuple(p.id for p in peers if not p.reachable)
    return Prediction(f"stripes:{G}", tuple(trees), tuple(tree_rates), arrivals, shares=tuple(shares),
                      parents=tuple(parents), pull=pull, chunk=chunk)


def _predict_designs(M: float, U: float, peers: list[PeerLink], chunk: int | None, designs: set[str],
                     ks: Iterable[int] | None, group_size: int) -> tuple[Prediction, list[Prediction]]:
    """The predictions of `designs` (the star, K chains for every sensible K or `ks`, stripes)
    and, apart, the star's: the caller asks whether it won."""
    pull = tuple(p.id for p in peers if not p.reachable)
    star = replace(predict_star(M, U, peers), pull=pull, chunk=chunk or choose_chunk(M, M, 0))
    reach = [p for p in peers if p.reachable]
    leaves = [p for p in peers if not p.reachable]
    candidates = [star] if "star" in designs else []
    if reach and "chains" in designs:
        for k in ks if ks is not None else candidate_ks(len(reach)):
            if not 1 <= k <= len(reach):
                continue
            chains = form_chains(reach, k)
            depth = max(len(c) for c in chains) - 1 + (1 if leaves else 0)
            c = chunk or choose_chunk(M, M, depth)
            candidates.append(predict_chains_with_leaves(M, U, chains, leaves, c))
    if "stripes" in designs:
        pred = predict_stripes(M, U, peers, chunk, group_size)
        if pred is not None:
            candidates.append(pred)
    if not candidates:
        raise PlanError(f"none of {sorted(designs)} applies to these workers (chains and stripes need an uploader)")
    return star, candidates


def _fastest(candidates: list[Prediction], fraction: float) -> tuple[Prediction, float, dict[str, float]]:
    """The candidate first to reach `fraction` of the workers, its time, and every candidate's
    time by name. Earlier candidates win ties; stripes must win by `STRIPES_MARGIN`."""
    best, best_t, alternatives = None, math.inf, {}
    for pred in candidates:
        t = pred.time_to_fraction(fraction)
        alternatives[pred.name] = t
        striped = pred.name.startswith("stripes") and best is not None
        if best is None or t < best_t * (1 - (STRIPES_MARGIN if striped else 1e-9)):
            best, best_t = pred, t
    assert best is not None
    return best, best_t, alternatives


def plan_broadcast(
    M: int,
    U: float,
    peers: Iterable[PeerLink],
    chunk: int | None = None,
    *,
    fraction: float = 1.0,
    ks: Iterable[int] | None = None,
    headroom: float = 1.0,
    designs: Iterable[str] = DESIGNS,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> Plan:
    """Predict the star, K chains for every sensible K and stripes (those of `designs`); return
    the fastest as a `Plan`.

    The objective is the time until `fraction` of the workers hold the snapshot (1.0 = all).
    Ties go to the star (fewest hops, nothing to repair), then to fewer chains; stripes must win
    by `STRIPES_MARGIN`. `chunk=None` picks each design's chunk size (`choose_chunk`; the plan's
    `chunk_bytes`), else every design is predicted with `chunk`. Unreachable workers
    (`PeerLink.reachable`) are leaves in every design and pull; their upload is not counted.

    `headroom` (0 < h <= 1) plans every upload (the learner's `U`, each worker's `up`) at that
    share of its measured rate, so trees are paced a little below their links' capacity.
    Why: a link driven at exactly its capacity has no room for the ACKs of the traffic coming
    the other way (a relay's full uplink queue slows its own download) and loses every dip for
    good. Measured on netem (16 workers, 4x4 chains, U = 4b): 1.31x the bound unpaced, 1.17x
    paced at exactly b, 1.10x with 0.95 (= the prediction). `lower_bound_s` uses the measured
    rates.
    """
    peers = list(peers)
    _check(M, U, peers)
    if not 0.0 < headroom <= 1.0:
        raise PlanError(f"headroom {headroom} must be in (0, 1]")
    bound = lower_bound(M, U, peers)
    if headroom < 1.0:
        U, peers = U * headroom, [replace(p, up=p.up * headroom) for p in peers]
    designs = set(designs)
    if not designs or designs - set(DESIGNS):
        raise PlanError(f"designs must be a non-empty subset of {DESIGNS}, got {sorted(designs)}")
    star, candidates = _predict_designs(M, U, peers, chunk, designs, ks, group_size)
    best, best_t, alternatives = _fastest(candidates, fraction)
    kind = "star" if best is star else "stripes" if best.name.startswith("stripes") else "chains"
    return Plan(
        kind=kind,
        chains=best.chains,
        rates=best.rates,
        predicted_s=best_t,
        lower_bound_s=bound,
        fraction=fraction,
        snapshot_bytes=int(M),
        chunk_bytes=int(best.chunk),
        arrivals=dict(best.arrivals),
        alternatives=alternatives,
        shares=best.shares,
        parents=best.parents,
        pull=best.pull,
        groups=best.groups,
    )
