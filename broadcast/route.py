"""Routes: the broadcast plan of one version, signed by the learner and published with it.

A `Route` names the version it routes (its key and root, so it can never be replayed for
another version), the source, and a list of **trees**. Tree `t` carries the chunks of its span
`spans[t]` (all chunks unless given) to its members `chains[t]` (hops, learner side first);
member `i`'s parent is member `parents[t][i]` (-1: the source; unless given, a chain: each
member's parent is the one before it). Every node must receive every chunk exactly once: the
spans of the trees it belongs to tile the version. The shapes the planner uses:

- K chains: K trees, each spanning every chunk, members in a row;
- the star: one tree, every member's parent the source;
- stripes: one tree per stripe (its span sized to its owner's upload) in which the source
  sends the stripe to its owner and the owner to everyone else, plus optionally a stripe the
  source sends to everyone; in groups, the owners of a stripe form a chain between groups.

`rates[t]` is the rate every edge of tree `t` runs at (bytes/s; None: unplanned) and `paced`
whether senders pace to it. `pull` names members that cannot accept inbound connections (NAT):
they are leaves of every tree and pull their spans from their parents over outbound
connections. `plan` summarises the plan that chose the route (kind, predicted and lower-bound
seconds, the alternatives). Receivers compare their goodput with the rates to tell a slow link
from a paced sender (`broadcast.links`).

Why sign routes and not just manifests: a relay derives everything it does from the route —
its children (where to forward), its ancestors (where to repair from), the pacing rate and, on
libp2p, which peer may push to it — so a malicious relay cannot redirect a stream, name itself
as everyone's repair peer, or throttle a tree by rewriting any of these. Chunks are verified
against the manifest either way; the route protects availability, the manifest integrity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack

from broadcast.manifest import BroadcastError, Manifest
from broadcast.signing import ROUTE_CONTEXT, SigningKey, VerifyKey, pack_signed, unpack_signed
from broadcast.transport import Hop

FORMAT = 2
SOURCE = -1  # a parent index: the source


class RouteError(BroadcastError, ValueError):
    """A route is malformed, names another version, or does not include the node reading it."""


@dataclass(frozen=True)
class Place:
    """One node's place in one tree of a route."""

    tree: int
    pos: int
    span: tuple[int, int]  # chunks [first, end)
    ancestors: tuple[Hop, ...]  # parent first, ending at the source: where it repairs from
    children: tuple[int, ...]  # member indices whose parent it is


@dataclass(frozen=True)
class Route:
    """Who forwards which chunks of version `key` to whom, at what rate; see the module docstring."""

    key: str
    root: bytes
    source: Hop
    chains: tuple[tuple[Hop, ...], ...]  # each tree's members, learner side first
    rates: tuple[float | None, ...]  # per tree: the rate of each of its edges (bytes/s); None: unplanned
    paced: bool = False  # whether every sender paces its streams to its tree's rate
    plan: dict = field(default_factory=dict)  # kind, predicted_s, lower_bound_s, alternatives
    spans: tuple[tuple[int, int], ...] | None = None  # per tree: chunks [first, end); None: all
    parents: tuple[tuple[int, ...], ...] | None = None  # per tree: each member's parent; None: chains
    pull: tuple[str, ...] = ()  # members that pull from their parents (not reachable)

    def __post_init__(self) -> None:
        bad = lambda msg: RouteError(f"route of {self.key}: {msg}")  # noqa: E731
        if not self.chains or any(not c for c in self.chains):
            raise bad("needs at least one tree and no empty tree")
        if len(self.rates) != len(self.chains):
            raise bad(f"{len(self.rates)} rates for {len(self.chains)} trees")
        for r in self.rates:
            if r is not None and not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
                raise bad("a tree's rate must be a positive number of bytes/s or None")
        if self.paced and None in self.rates:
            raise bad("a paced route needs a rate for every tree")
        if self.spans is not None:
            if len(self.spans) != len(self.chains):
                raise bad(f"{len(self.spans)} spans for {len(self.chains)} trees")
            if any(not (0 <= a < b) for a, b in self.spans):
                raise bad("a span is a non-empty chunk range [first, end)")
        if self.parents is not None:
            if len(self.parents) != len(self.chains):
                raise bad(f"{len(self.parents)} parent lists for {len(self.chains)} trees")
            for chain, parents in zip(self.chains, self.parents):
                # A parent comes before its child: no cycles, and every member hangs off the source.
                if len(parents) != len(chain) or any(not SOURCE <= p < i for i, p in enumerate(parents)):
                    raise bad("each member's parent must be the source (-1) or a member before it")
        for chain in self.chains:
            ids = [h.id for h in chain]
            if len(set(ids)) != len(ids) or self.source.id in ids:
                raise bad("a node may appear once per tree, and the source in none")
        members = {h.id for c in self.chains for h in c}
        if not set(self.pull) <= members:
            raise bad(f"pulling nodes {sorted(set(self.pull) - members)} are in no tree")
        for t, chain in enumerate(self.chains):
            if any(chain[i].id in self.pull for i in self.parent_list(t) if i != SOURCE):
                raise bad("a pulling node cannot accept pushes, so it must be a leaf")

    # -- structure ------------------------------------------------------------------------------
    def parent_list(self, tree: int) -> tuple[int, ...]:
        n = len(self.chains[tree])
        return self.parents[tree] if self.parents is not None else tuple(range(-1, n - 1))

    def span(self, tree: int, num_chunks: int) -> tuple[int, int]:
        return self.spans[tree] if self.spans is not None else (0, num_chunks)

    def roots(self, tree: int) -> list[int]:
        """Members the source sends tree `tree` to."""
        return [i for i, p in enumerate(self.parent_list(tree)) if p == SOURCE]

    def children(self, tree: int, pos: int) -> list[int]:
        return [i for i, p in enumerate(self.parent_list(tree)) if p == pos]

    def ancestors(self, tree: int, pos: int) -> list[Hop]:
        """Parent first, then its parent, ..., ending at the source."""
        out, parents, p = [], self.parent_list(tree), self.parent_list(tree)[pos]
        while p != SOURCE:
            out.append(self.chains[tree][p])
            p = parents[p]
        return [*out, self.source]

    def places(self, node_id: str, num_chunks: int) -> list[Place]:
        """Every tree `node_id` is in, with its span, ancestors and children; `RouteError` if none."""
        out = []
        for t, chain in enumerate(self.chains):
            for pos, hop in enumerate(chain):
                if hop.id == node_id:
                    out.append(Place(t, pos, self.span(t, num_chunks), tuple(self.ancestors(t, pos)),
                                     tuple(self.children(t, pos))))
        if not out:
            raise RouteError(f"the route of {self.key} does not include {node_id}")
        covered = sorted(p.span for p in out)
        if covered[0][0] != 0 or covered[-1][1] != num_chunks or any(
                a[1] != b[0] for a, b in zip(covered, covered[1:])):
            raise RouteError(f"the route of {self.key} does not give {node_id} every chunk once: spans {covered}")
        return out

    # -- a chain's view (kept for chain routes) ---------------------------------------------------
    def locate(self, node_id: str) -> tuple[int, int]:
        """(tree index, position) of the first tree containing `node_id`."""
        for k, chain in enumerate(self.chains):
            for pos, hop in enumerate(chain):
                if hop.id == node_id:
                    return k, pos
        raise RouteError(f"the route of {self.key} does not include {node_id}")

    def below(self, chain: int, pos: int) -> list[Hop]:
        """The hops after `pos` in a chain, nearest first."""
        return list(self.chains[chain][pos + 1:])

    def above(self, chain: int, pos: int) -> list[Hop]:
        return self.ancestors(chain, pos)

    def pace(self, tree: int) -> float | None:
        """The rate members of `tree` send at (bytes/s), or None: unpaced."""
        return self.rates[tree] if self.paced else None

    def check(self, manifest: Manifest) -> None:
        """Raise `RouteError` unless this route is for exactly `manifest` (and fits its chunks)."""
        if self.key != manifest.key or self.root != manifest.root:
            raise RouteError(f"route for {self.key} does not match manifest {manifest.key}")
        if self.spans is not None and any(b > manifest.num_chunks for _, b in self.spans):
            raise RouteError(f"route of {self.key}: a span ends past the manifest's {manifest.num_chunks} chunks")

    def to_dict(self) -> dict:
        """Readable form for logs, status pages and the run log."""
        d = {"key": self.key, "source": self.source.id, "chains": [[h.id for h in c] for c in self.chains],
             "rates": list(self.rates), "paced": self.paced, **self.plan}
        if self.spans is not None:
            d["spans"] = [list(s) for s in self.spans]
        if self.pull:
            d["pull"] = list(self.pull)
        return d

    # -- canonical bytes ----------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        # Each hop once, trees as indices into that table: a striped route names every worker in
        # every tree (N² hops), so 32 workers in 25 stripes take 2 KB instead of 30.
        table: dict[Hop, int] = {}
        for c in self.chains:
            for h in c:
                table.setdefault(h, len(table))
        return msgpack.packb({
            "format": FORMAT, "key": self.key, "root": self.root, "source": self.source.to_wire(),
            "hops": [h.to_wire() for h in table], "chains": [[table[h] for h in c] for c in self.chains],
            "rates": list(self.rates),
            "paced": self.paced, "plan": self.plan,
            "spans": None if self.spans is None else [list(s) for s in self.spans],
            "parents": None if self.parents is None else [list(p) for p in self.parents],
            "pull": list(self.pull),
        }, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: Any) -> "Route":
        try:
            doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
            if doc["format"] != FORMAT:
                raise RouteError(f"route format {doc['format']} unsupported (this code reads {FORMAT}); "
                                 "upgrade the worker to the learner's echo version")
            plan = doc["plan"]
            if not isinstance(plan, dict):
                raise TypeError("plan must be a map")
            spans, parents = doc["spans"], doc["parents"]
            hops = [Hop.from_wire(h) for h in doc["hops"]]
            if any(not (isinstance(i, int) and 0 <= i < len(hops)) for c in doc["chains"] for i in c):
                raise RouteError("a tree names a hop outside the route's hop table")
            return cls(key=str(doc["key"]), root=bytes(doc["root"]), source=Hop.from_wire(doc["source"]),
                       chains=tuple(tuple(hops[int(i)] for i in c) for c in doc["chains"]),
                       rates=tuple(None if r is None else float(r) for r in doc["rates"]),
                       paced=bool(doc["paced"]), plan=plan,
                       spans=None if spans is None else tuple((int(a), int(b)) for a, b in spans),
                       parents=None if parents is None else tuple(tuple(int(i) for i in p) for p in parents),
                       pull=tuple(str(p) for p in doc["pull"]))
        except RouteError:
            raise
        except Exception as e:  # msgpack, KeyError, TypeError, ProtocolError from Hop
            raise RouteError(f"malformed route: {type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class SignedRoute:
    """A route with the exact bytes that were signed; forwarded verbatim by relays."""

    route: Route
    body: bytes
    signature: bytes

    def to_wire(self) -> bytes:
        return pack_signed(self.body, self.signature)

    @classmethod
    def from_wire(cls, data: Any, key: VerifyKey) -> "SignedRoute":
        """Verify the signature, then parse; raises `SignatureError` (tampered) or `RouteError`."""
        body, signature = unpack_signed(data, "route")
        key.verify(body, signature, ROUTE_CONTEXT)
        return cls(Route.from_bytes(body), body, signature)


def sign_route(key: SigningKey, route: Route) -> SignedRoute:
    body = route.to_bytes()
    return SignedRoute(route, body, key.sign(body, ROUTE_CONTEXT))


def route_for(manifest: Manifest, source: Hop, chains: Sequence[Sequence[Hop]],
              rates: Sequence[float | None] | None = None, *, paced: bool = False,
              plan: dict | None = None, spans: Sequence[tuple[int, int]] | None = None,
              parents: Sequence[Sequence[int]] | None = None, pull: Sequence[str] = ()) -> Route:
    """The route of `manifest` along `chains` (trees; chains unless `parents`), fed at `rates`."""
    return Route(key=manifest.key, root=manifest.root, source=source, chains=tuple(tuple(c) for c in chains),
                 rates=tuple(rates) if rates is not None else (None,) * len(chains), paced=paced,
                 plan=dict(plan or {}), spans=None if spans is None else tuple(tuple(s) for s in spans),
                 parents=None if parents is None else tuple(tuple(p) for p in parents), pull=tuple(pull))


def chunk_spans(num_chunks: int, shares: Sequence[float]) -> list[tuple[int, int]]:
    """Cut `num_chunks` chunks into consecutive spans in proportion to `shares` (cumulative
    rounding, so spans tile the version); a share too small for one chunk gets an empty span."""
    total = sum(shares)
    if total <= 0 or any(s < 0 for s in shares):
        raise RouteError(f"stripe shares must be >= 0 with a positive sum, got {list(shares)}")
    out, acc, start = [], 0.0, 0
    for s in shares:
        acc += s
        end = round(num_chunks * acc / total)
        out.append((start, end))
        start = end
    return out
