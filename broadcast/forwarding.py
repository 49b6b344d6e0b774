"""Which relays may forward: blame from the pulls a plan did not ask for, and demotion to a leaf.

A relay is trusted with children only on evidence. The planner places relays by their links,
and a relay that accepts pushes and forwards nothing (or a trickle) leaves its children with no
measurement of it: they wait `fallback_s`, pull the version from the learner, and are a version
late each time, every version (a tester's 8 such identities took a run from 58 to 13 steps per
40 s). What the learner does see is who pulls from its source, by read ticket.

- A member of a version's route whose parent in a tree is not the source should get that
  tree's chunks from its parent. If it pulls them from the source instead, its nearest ancestor
  in that tree that did *not* is blamed (everyone below a relay that forwards nothing pulls;
  only the relay itself does not). Pulls are matched to trees by their chunk ranges: a stripe
  member's planned pull of another tree's span from the source blames nobody. A worker routed
  by a version's delta that pulls the full version took every tree. One blame per worker per
  version.
- A blamed worker is planned as a leaf (pushed to, as a chain's tail or a stripe's receiver, and
  forwarding to nobody) for 2, 4, 8, ... versions, up to 64, doubling with each blame. A leaf
  has no children, so it cannot be blamed again while it is one: a relay that never forwards
  costs its children one version per demotion, not every version. Blames are forgotten after
  `FORGIVE_VERSIONS` versions without one: an honest relay whose link fails now and then over a
  week of versions starts again at 2, not at 64 (a relay that forwards nothing once in so many
  versions costs its children one version in as many).

A relay that pulls a tree's chunks itself would pass for a child of the relay above it, and its
children's pulls would blame nobody (a tester's relay with accepted work swallowed every push,
pulled each version from the learner, and cut the fleet's rollouts 40-58% over 34 versions with
no demotion). So a member the source pushed a tree to, which acknowledged it whole, and which
then pulled that tree's chunks, is blamed itself: it said it had them.

The learner cannot tell a relay that forwarded nothing from a child that pulled anyway to frame
its parent. So only pulls by workers whose work the learner accepted are counted (the publisher
filters them); a framing child pays a full download from the learner for each demotion it
causes, and a demoted honest relay only stops forwarding for a while (docs/untrusted-workers.md).
And a worker on record for not forwarding (until its blames are forgiven) is no witness at all:
demoted to a tail, a black hole that swallowed its parents' pushes and pulled had every honest
parent above it demoted with it, version after version.

Relays' pushes to each other are evidence too (`broadcast.receipts`): a relay reports each push
a child took whole, with the child's receipt. A child that pulls a tree it gave a receipt for is
blamed itself, as one that acknowledged the source's push. A report without a valid receipt is
the relay's word against the child's pull: a *dispute*, which blames neither at first; the one
of the two in disputes with more distinct workers (within `FORGIVE_VERSIONS`) is blamed. A
framing child disputes with each parent it frames and an honest parent with the one framer; a
black hole that claims deliveries disputes with each child it starves. Before these, a tail that
pulled one chunk of each version demoted both honest relays above it 44 times over 1,000
versions once its own record was forgiven (a tester, 2026-11-28). A pull is judged only
`grace_s` after it was made, so its parent's report of the push (a heartbeat away) is heard first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from broadcast.node import key_version
from broadcast.route import SOURCE, Route

#: Versions a first blame makes a worker a leaf for; each further blame doubles it, up to `MAX_LEAF_VERSIONS`.
FIRST_LEAF_VERSIONS = 2
MAX_LEAF_VERSIONS = 64
#: Versions without a blame after which a worker's earlier blames are forgotten.
FORGIVE_VERSIONS = 2 * MAX_LEAF_VERSIONS
#: Versions whose routes are remembered for blame: pulls of older ones no longer matter (kept
#: longer, up to `MAX_KEEP_VERSIONS`, while they are younger than `Forwarding.keep_s`).
KEEP_VERSIONS = 8
MAX_KEEP_VERSIONS = 64
#: Pulls remembered per member of a version's routes (a worker may pull one range many times).
MAX_PULLS = 8

Ranges = Sequence["tuple[int, int] | None"]  # chunk ranges pulled from the source; None: the whole version


def blamed(route: Route, pulled: Mapping[str, Ranges], acked: Set[tuple[int, str]] = frozenset(),
           unheard: Set[str] = frozenset(), disputed: Set[tuple[int, str, str]] = frozenset(),
           contested: set[tuple[str, str]] | None = None) -> set[str]:
    """The members of `route` that did not pull a tree's chunks from the source, nearest above
    each member that did (`pulled`: member id -> the ranges it pulled); and a member that pulled
    a tree's chunks after acknowledging a push of that tree whole (`acked`: (tree, member id)),
    in the place of any below it. The pulls of `unheard` members blame nobody above them
    (workers already on record for not forwarding). A pull the member above says it delivered
    without a receipt (`disputed`: (tree, sender, member)) blames nobody: the pair goes into
    `contested` (sender, member)."""
    def took(member: str, tree: int) -> bool:
        ranges = pulled.get(member, ())
        if route.spans is None:
            return bool(ranges)
        a, b = route.spans[tree]
        return any(r is None or (r[0] < b and a < r[1]) for r in ranges)

    owners = {member for _, member in acked}
    out = set()
    for t, chain in enumerate(route.chains):
        parents = route.parent_list(t)
        for pos, hop in enumerate(chain):
            if not took(hop.id, t):
                continue
            if (t, hop.id) in acked:  # it had the tree whole: its own pull is the lie
                out.add(hop.id)
                continue
            if hop.id in unheard:
                # On record for not forwarding: a black hole demoted to a tail swallowed its honest
                # parents' pushes, pulled as its software does, and had both demoted, again and again
                continue
            if hop.id in owners and all(r is None for r in pulled[hop.id]):
                # A member that had a tree whole and pulled the whole version anyway (an honest one
                # repairs the spans it missed, under the pushed key) is no witness against its parents
                # in the others: a swallowing stripe owner's own pull framed its honest co-owner.
                continue
            p = parents[pos]
            while p != SOURCE and took(chain[p].id, t) and (t, chain[p].id) not in acked:
                p = parents[p]
            if p == SOURCE:
                continue
            if (t, chain[p].id, hop.id) in disputed:  # its word against the pull: weighed by the caller
                if contested is not None:
                    contested.add((chain[p].id, hop.id))
                continue
            out.add(chain[p].id)
    return out


def _intervals(parents: Sequence[int]) -> list[tuple[int, int]]:
    """Each member's (entry, exit) in a depth-first walk of a tree given as its parent list."""
    children: list[list[int]] = [[] for _ in parents]
    roots = []
    for i, p in enumerate(parents):
        (roots if p == SOURCE else children[p]).append(i)
    out = [(0, 0)] * len(parents)
    clock, stack = 0, [(r, False) for r in reversed(roots)]
    entered = [0] * len(parents)
    while stack:
        node, done = stack.pop()
        if done:
            out[node] = (entered[node], clock)
            continue
        clock += 1
        entered[node] = clock
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(children[node]))
    return out


@dataclass
class Record:
    blames: int = 0
    leaf_until: int = 0  # a leaf while the version being planned is below this
    blamed_at: int = 0  # the version being planned at its last blame


@dataclass
class _Version:
    routes: dict[str, Route]  # by key: the full version's and its delta's
    members: set[str]  # every worker the routes name
    pulls: dict[str, list[tuple[str, int, int, float]]]  # member -> (key, first chunk, end, when) of its pulls from the source
    blamed: set[str]
    acked: dict[str, set[tuple[int, str]]] = field(default_factory=dict)  # key -> (tree, member) with a push taken whole
    disputed: dict[str, set[tuple[int, str, str]]] = field(default_factory=dict)  # key -> (tree, sender, member): no receipt
    contested: set[tuple[str, str]] = field(default_factory=set)  # (sender, member) disputes already counted
    planned_at: float = 0.0  # `Forwarding.clock` when its first route was planned
    # key -> member -> (its parents, whether it forwards): built once a route, looked up per link sample
    places: dict[str, dict[str, tuple[set[str], bool]]] = field(default_factory=dict)
    positions: dict[str, dict[tuple[int, str], int]] = field(default_factory=dict)  # key -> (tree, member) -> its index
    # key -> per tree, each index's (entry, exit) in a depth-first walk: `a` is above `b` iff its
    # interval holds b's (a walk up from a tail of 1,000 per reported push was a relay's way to
    # spend the learner's loop)
    intervals: dict[str, list[list[tuple[int, int]]]] = field(default_factory=dict)


class Forwarding:
    """The learner's record of which workers forwarded what they were given (module docstring)."""

    def __init__(self, grace_s: float = 0.0, keep_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 every: int = 1) -> None:
        """`grace_s`: how long after a pull it is judged (a relay's report of its pushes may take
        that long); `keep_s`: how long a version's routes are kept at least (its children pull
        up to `fallback_s` after its push began, and are judged `grace_s` after that); `every`:
        the updates between published versions (`[publish] every`). Version numbers count
        updates, and demotions and forgiveness count published versions: at `every` = 4 a first
        demotion for "2 versions" kept a worker out of one plan, not two (an API-only tester)."""
        self.every = every
        self.records: dict[str, Record] = {}
        self._versions: OrderedDict[int, _Version] = OrderedDict()
        self.grace_s, self.keep_s, self.clock = grace_s, keep_s, clock
        self.disputes: dict[str, dict[str, int]] = {}  # worker -> the workers it disputed with -> the version planned then

    def planned(self, route: Route) -> None:
        """Remember a route a version is pushed by (call before its push begins)."""
        version = key_version(route.key)
        if version is None:
            return
        known = self._versions.setdefault(version, _Version({}, set(), {}, set(), planned_at=self.clock()))
        known.routes[route.key] = route
        known.members.update(hop.id for chain in route.chains for hop in chain)
        places: dict[str, tuple[set[str], bool]] = {}
        known.positions[route.key] = {(t, hop.id): pos for t, chain in enumerate(route.chains)
                                      for pos, hop in enumerate(chain)}
        known.intervals[route.key] = [_intervals(route.parent_list(t)) for t in range(len(route.chains))]
        for t, chain in enumerate(route.chains):
            tree = route.parent_list(t)
            has_children = set(tree)  # walking each member's ancestors and children was O(n²) for a chain of n
            for pos, hop in enumerate(chain):
                parents, forwards = places.get(hop.id, (set(), False))
                parents.add(chain[tree[pos]].id if tree[pos] != SOURCE else route.source.id)
                places[hop.id] = (parents, forwards or pos in has_children)
        known.places[route.key] = places
        # Kept until judged: versions published faster than `keep_s` went out of memory before their
        # pulls were judged, and a black hole was never blamed (a tester, 2026-11-29); bounded still.
        while len(self._versions) > KEEP_VERSIONS and (
                len(self._versions) > MAX_KEEP_VERSIONS
                or next(iter(self._versions.values())).planned_at < self.clock() - self.keep_s):
            self._versions.popitem(last=False)

    def hops(self, key: str, member: str) -> tuple[set[str], bool] | None:
        """`member`'s parents in the route of `key` (the source's id for a head), and whether it
        forwards to anyone there; None when `key` is no route remembered here, or `member` is
        not in it: what a link sample about `key` from `member` may speak of."""
        known = self._versions.get(key_version(key))
        return known.places.get(key, {}).get(member) if known is not None else None

    def pulled(self, key: str, holder: str, start: int, end: int) -> None:
        """`holder` pulled chunks [start, end) of `key` from the source."""
        known = self._versions.get(key_version(key))
        if known is not None and holder in known.members:  # bounded: members only, a few pulls each
            mine = known.pulls.setdefault(holder, [])
            if len(mine) < MAX_PULLS:
                mine.append((key, start, end, self.clock()))

    def pushed(self, key: str, holder: str, tree: int) -> None:
        """The source's push of `tree` of `key` to `holder` was acknowledged whole."""
        known = self._versions.get(key_version(key))
        if known is not None and holder in known.members:
            known.acked.setdefault(key, set()).add((tree, holder))

    def delivered(self, key: str, sender: str, holder: str, tree: int, receipt: bool) -> bool:
        """Worker `sender` says its push of `tree` of `key` reached `holder` whole, with `holder`'s
        valid receipt or without one. Heard only where the route has `sender` above `holder` in
        that tree (it may have pushed past a failed member); returns whether it was."""
        known = self._versions.get(key_version(key))
        if known is None or key not in known.routes:
            return False
        at, above = known.positions[key].get((tree, holder)), known.positions[key].get((tree, sender))
        if at is None or above is None:
            return False
        (a_in, a_out), (h_in, h_out) = known.intervals[key][tree][above], known.intervals[key][tree][at]
        if not a_in < h_in <= h_out <= a_out:  # its parent, or further up where that one was pushed past
            return False
        if receipt:
            known.acked.setdefault(key, set()).add((tree, holder))
        else:
            known.disputed.setdefault(key, set()).add((tree, sender, holder))
        return True

    def pulls(self, version: int) -> set[str]:
        """Who of `version`'s routes pulled (some of) it from the source."""
        known = self._versions.get(version)
        return set(known.pulls) if known is not None else set()

    def settle(self, version: int) -> list[tuple[str, int]]:
        """Blame what the remembered routes' pulls say, as of planning `version`; returns the
        newly demoted workers, each with the version it is a leaf until. Records whose blames
        are forgotten are dropped (one per worker ever blamed, kept for good, was a week's growth)."""
        forgive = FORGIVE_VERSIONS * self.every  # in updates, as version numbers count
        self.records = {w: r for w, r in self.records.items()
                        if r.leaf_until > version or version - r.blamed_at <= forgive}
        self.disputes = {w: kept for w, seen in self.disputes.items()
                         if (kept := {o: v for o, v in seen.items() if version - v <= forgive})}
        demoted, unheard, judged_before = [], set(self.records), self.clock() - self.grace_s
        for known in self._versions.values():
            guilty: set[str] = set()
            contested: set[tuple[str, str]] = set()
            for key, route in known.routes.items():
                pulled = {holder: ranges for holder, mine in known.pulls.items()
                          if (ranges := [(a, b) if k == key else None  # another key: the whole version
                                         for k, a, b, t in mine if t <= judged_before])}
                guilty |= blamed(route, pulled, known.acked.get(key, set()), unheard,
                                 known.disputed.get(key, set()), contested)
            guilty |= self._weigh(contested - known.contested, version)
            known.contested |= contested
            for worker in sorted(guilty - known.blamed):
                known.blamed.add(worker)
                r = self.records.setdefault(worker, Record())
                if version - r.blamed_at > forgive:
                    r.blames = 0
                r.blames, r.blamed_at = r.blames + 1, version
                r.leaf_until = version + self.every * min(MAX_LEAF_VERSIONS, FIRST_LEAF_VERSIONS << (r.blames - 1))
                demoted.append((worker, r.leaf_until))
        return demoted

    def _weigh(self, contested: set[tuple[str, str]], version: int) -> set[str]:
        """Record each (sender, member) dispute; the one of each pair in disputes with more
        distinct workers is blamed (neither on a tie: one dispute is one word against another)."""
        for sender, member in contested:
            self.disputes.setdefault(sender, {})[member] = version
            self.disputes.setdefault(member, {})[sender] = version
        out = set()
        for sender, member in contested:
            a, b = len(self.disputes[sender]), len(self.disputes[member])
            if a != b:
                out.add(sender if a > b else member)
        return out

    def may_forward(self, worker: str, version: int) -> bool:
        r = self.records.get(worker)
        return r is None or version >= r.leaf_until

    def leaves(self, version: int) -> dict[str, int]:
        """The workers that are leaves for `version` for failing to forward, each with the version it is one until."""
        return {w: r.leaf_until for w, r in self.records.items() if r.leaf_until > version}
