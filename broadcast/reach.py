"""Reachability: can the learner open a connection to a worker's relay?

Workers behind NAT (most home connections, many marketplace hosts) cannot accept inbound
connections, so nobody can push to them. The learner probes each relay's advertised URL when
it first hears of it (`probe_relay`) and plans unreachable workers as leaves that pull their
share from a reachable parent over their own outbound connection (`broadcast.planner`,
`PeerLink.reachable`; the relay follows the learner's route feed, `Relay.follow`).

The ladder, cheapest first: push (reachable) → pull from a reachable parent (this module says
which) → the learner's full-version fallback (`[broadcast] fallback_s`). py-libp2p 0.x has no
circuit relay v2 or hole punching that works over its trio host here (see the README), so
there is no rung between.
"""

from __future__ import annotations

from broadcast.transport import scheme_of, transport_class


async def probe_relay(url: str, timeout_s: float) -> bool:
    """True if a relay at `url` (http(s):// or p2p:<multiaddr>) accepts a connection and answers
    within `timeout_s` seconds: its health route over HTTP, a manifest request over libp2p
    (each transport's `probe`)."""
    try:
        return await transport_class(scheme_of(url)).probe(url, timeout_s)
    except Exception:  # noqa: BLE001 - an unknown scheme, a timeout, dial errors of every kind: not reachable
        return False
