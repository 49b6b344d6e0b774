"""Routes: the broadcast plan of one version, signed by the learner and published with it.

A `Route` names the version it routes (its key and root, so it can never be replayed for
another version), the source, the K chains as ordered hops (learner side first; a star is N
chains of one), the rate the plan feeds each chain at (and whether relays pace to it), and a
summary of the plan that chose them (kind, predicted and lower-bound seconds, the alternatives
considered). Receivers compare their measured goodput with their chain's rate to tell a slow
link from a paced sender (`broadcast.links`). The learner signs it like a
manifest (ed25519, its own signature context) and every push stream carries it verbatim.

Why sign routes and not just manifests: a relay derives everything it does from the route —
its child (where to forward), its ancestors (where to repair from) and the pacing rate — so a
malicious relay cannot redirect a stream, name itself as everyone's repair peer, or throttle a
chain by rewriting any of these. Chunks are verified against the manifest either way; the route
protects availability, the manifest integrity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack

from broadcast.manifest import BroadcastError, Buffer, Manifest
from broadcast.signing import ROUTE_CONTEXT, SigningKey, VerifyKey, pack_signed, unpack_signed
from broadcast.transport import Hop

FORMAT = 1


class RouteError(BroadcastError, ValueError):
    """A route is malformed, names another version, or does not include the node reading it."""


@dataclass(frozen=True)
class Route:
    """Who forwards version `key` to whom, at what rate; see the module docstring."""

    key: str
    root: bytes
    source: Hop
    chains: tuple[tuple[Hop, ...], ...]
    rates: tuple[float | None, ...]  # the planned feed rate per chain (bytes/s); None: unplanned
    paced: bool = False  # whether every member forwards at its chain's rate (else as fast as TCP goes)
    plan: dict = field(default_factory=dict)  # kind, predicted_s, lower_bound_s, alternatives

    def __post_init__(self) -> None:
        if not self.chains or any(not c for c in self.chains):
            raise RouteError(f"route of {self.key}: needs at least one chain and no empty chain")
        if len(self.rates) != len(self.chains):
            raise RouteError(f"route of {self.key}: {len(self.rates)} rates for {len(self.chains)} chains")
        for r in self.rates:
            if r is not None and not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
                raise RouteError(f"route of {self.key}: a chain rate must be a positive number of bytes/s or None")
        if self.paced and None in self.rates:
            raise RouteError(f"route of {self.key}: a paced route needs a rate for every chain")
        ids = [h.id for c in self.chains for h in c]
        if len(set(ids)) != len(ids) or self.source.id in ids:
            raise RouteError(f"route of {self.key}: every node may appear once")

    # -- a node's view --------------------------------------------------------------------------
    def locate(self, node_id: str) -> tuple[int, int]:
        """(chain index, position) of `node_id`; `RouteError` if the route does not include it."""
        for k, chain in enumerate(self.chains):
            for pos, hop in enumerate(chain):
                if hop.id == node_id:
                    return k, pos
        raise RouteError(f"the route of {self.key} does not include {node_id}")

    def below(self, chain: int, pos: int) -> list[Hop]:
        """The hops after `pos` in `chain`, nearest first: where that node forwards."""
        return list(self.chains[chain][pos + 1:])

    def above(self, chain: int, pos: int) -> list[Hop]:
        """The hops before `pos` in `chain`, nearest first, ending at the source: where it repairs from."""
        return [*reversed(self.chains[chain][:pos]), self.source]

    def pace(self, chain: int) -> float | None:
        """The rate members of `chain` forward at (bytes/s), or None: unpaced."""
        return self.rates[chain] if self.paced else None

    def check(self, manifest: Manifest) -> None:
        """Raise `RouteError` unless this route is for exactly `manifest`."""
        if self.key != manifest.key or self.root != manifest.root:
            raise RouteError(f"route for {self.key} does not match manifest {manifest.key}")

    def to_dict(self) -> dict:
        """Readable form for logs, status pages and the run log."""
        return {"key": self.key, "source": self.source.id, "chains": [[h.id for h in c] for c in self.chains],
                "rates": list(self.rates), "paced": self.paced, **self.plan}

    # -- canonical bytes ----------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        return msgpack.packb({
            "format": FORMAT, "key": self.key, "root": self.root, "source": self.source.to_wire(),
            "chains": [[h.to_wire() for h in c] for c in self.chains], "rates": list(self.rates),
            "paced": self.paced, "plan": self.plan,
        }, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: Buffer) -> "Route":
        try:
            doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
            if doc["format"] != FORMAT:
                raise RouteError(f"route format {doc['format']} unsupported (this code reads {FORMAT}); "
                                 "upgrade the worker to the learner's echo version")
            plan = doc["plan"]
            if not isinstance(plan, dict):
                raise TypeError("plan must be a map")
            return cls(key=str(doc["key"]), root=bytes(doc["root"]), source=Hop.from_wire(doc["source"]),
                       chains=tuple(tuple(Hop.from_wire(h) for h in c) for c in doc["chains"]),
                       rates=tuple(None if r is None else float(r) for r in doc["rates"]),
                       paced=bool(doc["paced"]), plan=plan)
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
              plan: dict | None = None) -> Route:
    """The route of `manifest` along `chains` (non-empty), fed at `rates` (None: unplanned)."""
    return Route(key=manifest.key, root=manifest.root, source=source, chains=tuple(tuple(c) for c in chains),
                 rates=tuple(rates) if rates is not None else (None,) * len(chains), paced=paced,
                 plan=dict(plan or {}))
