"""Which relays may forward: blame from the pulls a plan did not ask for, and demotion to a leaf.

A relay is trusted with children only on evidence. The planner places relays by their links,
and a relay that accepts pushes and forwards nothing (or a trickle) leaves its children with no
measurement of it: they wait `fallback_s`, pull the version from the learner, and are a version
late each time, every version (a tester's 8 such identities took a run from 58 to 13 steps per
40 s). What the learner does see is who pulls from its source, by read ticket.

- A member of a version's plan whose parent is not the source should get the version from its
  parent. If it pulls it from the source instead, its nearest ancestor in that tree that did
  *not* pull is blamed (everyone below a relay that forwards nothing pulls; only the relay
  itself does not). One blame per worker per version.
- A blamed worker is planned as a leaf (pushed to, as a chain's tail or a stripe's receiver, and
  forwarding to nobody) for 2, 4, 8, ... versions, up to 64, doubling with each blame. A leaf
  has no children, so it cannot be blamed again while it is one: a relay that never forwards
  costs its children one version per demotion, not every version.

The learner cannot tell a relay that forwarded nothing from a child that pulled anyway to frame
its parent. So only pulls by workers whose work the learner accepted are counted (the publisher
filters them); a framing child pays a full download from the learner for each demotion it
causes, and a demoted honest relay only stops forwarding for a while (docs/untrusted-workers.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from broadcast.node import key_version
from broadcast.planner import Plan

#: Versions a first blame makes a worker a leaf for; each further blame doubles it, up to `MAX_LEAF_VERSIONS`.
FIRST_LEAF_VERSIONS = 2
MAX_LEAF_VERSIONS = 64
#: Versions whose plans are remembered for blame: pulls of older ones no longer matter.
KEEP_VERSIONS = 8


def blamed(plan: Plan, pulled: set[str]) -> set[str]:
    """The members of `plan` that did not pull, nearest above each member that did."""
    out = set()
    for t, chain in enumerate(plan.chains):
        parents = plan.parents[t] if plan.parents else tuple(range(-1, len(chain) - 1))
        for pos, member in enumerate(chain):
            if member not in pulled:
                continue
            p = parents[pos]
            while p != -1 and chain[p] in pulled:
                p = parents[p]
            if p != -1:
                out.add(chain[p])
    return out


@dataclass
class Record:
    blames: int = 0
    leaf_until: int = 0  # a leaf while the version being planned is below this


class Forwarding:
    """The learner's record of which workers forwarded what they were given (module docstring)."""

    def __init__(self) -> None:
        self.records: dict[str, Record] = {}
        # version -> its plans (a delta's and the full version's), who pulled it, who was blamed for it
        self._versions: OrderedDict[int, tuple[list[Plan], set[str], set[str]]] = OrderedDict()

    def planned(self, key: str, plan: Plan) -> None:
        """Remember a plan version `key` is pushed by (call before its push begins)."""
        version = key_version(key)
        if version is None:
            return
        self._versions.setdefault(version, ([], set(), set()))[0].append(plan)
        while len(self._versions) > KEEP_VERSIONS:
            self._versions.popitem(last=False)

    def pulled(self, key: str, holder: str) -> None:
        """`holder` pulled (some of) `key` from the source: a worker planned for the version's
        delta pulls the full version when the push misses it, so pulls count by version."""
        known = self._versions.get(key_version(key))
        if known is not None:
            known[1].add(holder)

    def pulls(self, version: int) -> set[str]:
        """Who pulled `version` from the source (of the workers its plans name or not)."""
        known = self._versions.get(version)
        return set(known[1]) if known is not None else set()

    def settle(self, version: int) -> list[tuple[str, int]]:
        """Blame what the remembered plans' pulls say, as of planning `version`; returns the
        newly demoted workers, each with the version it is a leaf until."""
        demoted = []
        for plans, pulled, done in self._versions.values():
            for worker in sorted(set().union(*(blamed(plan, pulled) for plan in plans)) - done):
                done.add(worker)
                r = self.records.setdefault(worker, Record())
                r.blames += 1
                r.leaf_until = version + min(MAX_LEAF_VERSIONS, FIRST_LEAF_VERSIONS << (r.blames - 1))
                demoted.append((worker, r.leaf_until))
        return demoted

    def may_forward(self, worker: str, version: int) -> bool:
        r = self.records.get(worker)
        return r is None or version >= r.leaf_until

    def leaves(self, version: int) -> dict[str, int]:
        """The workers that are leaves for `version` for failing to forward, each with the version it is one until."""
        return {w: r.leaf_until for w, r in self.records.items() if r.leaf_until > version}
