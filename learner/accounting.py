"""Accounting: what each step cost, and the measured times the scheduler plans with.

Each step: dollars (ECHO-2 §3, formulas.md §1: `scheduler.cost.CostMeter`), the bytes of what
was published, T_bcast (publication until `[broadcast] done_fraction` of the active workers
received a version), τ (the workers' install time), and the fleet's capacity. With a scheduler
(`fleet`), T_train, T_bcast and τ also feed its capacity rule.

Nothing here is a worker's word alone: prices are the pool's or the provider's (without a
scheduler, workers are billed at nothing rather than at what they declare); "delivered" is what
the learner accepted; install and reception times count only from workers that have delivered
accepted work, one vote each (a few fresh identities cannot move a median), and are bounded.
"""

from __future__ import annotations

import math
from collections import deque
import statistics
import time

from learner.api.workers import WorkerRegistry
from learner.metrics import LearnerMetrics
from scheduler.cost import Budget, CostMeter, bandwidth_dollars
from scheduler.market import version_traffic


MAX_INSTALL_S = 3600.0  # an install claimed longer than this is not an install time
UNMEASURED_KEEP = 32  # published versions whose broadcast time is still awaited


#: A plan with more members is logged as its summary: a 1,000-worker plan's chains, parents and
#: links were ~50 KB of every step record, half a gigabyte of run log over a week.
PLAN_LOG_MEMBERS = 64


def logged_plan(plan: dict) -> dict:
    """A version's plan as the run log keeps it: whole for a few workers, else without the
    per-worker lists (the members, trees and pulling members are counted; the routes themselves
    are the source's route feed's)."""
    members = {w for chain in plan.get("chains", ()) for w in chain}
    if len(members) <= PLAN_LOG_MEMBERS:
        return plan
    return {**{k: v for k, v in plan.items() if k not in ("chains", "parents", "links_mbit", "pull")},
            "members": len(members), "trees": len(plan.get("chains", ())), "pulling": len(plan.get("pull", ()))}


class Accounting:
    def __init__(self, cost: CostMeter, done_fraction: float, *, registry: WorkerRegistry,
                 publisher, metrics: LearnerMetrics, fleet=None, budget: Budget = Budget(), group_size: int = 1):
        self.cost, self.budget, self.group_size = cost, budget, group_size
        self._accepted: deque[tuple[float, int]] = deque(maxlen=20)  # (when, groups the buffer had accepted)
        self.recent_steps: deque[float] = deque(maxlen=20)  # $ of the last steps (time + bandwidth)
        self.hourly = cost.learner_price  # $/h of the fleet at the last step
        self.done_fraction, self.registry, self.publisher = done_fraction, registry, publisher
        self.metrics, self.fleet = metrics, fleet
        self.published_at: dict[int, float] = {}  # versions whose T_bcast is not measured yet

    def published(self, version: int) -> None:
        self.published_at[version] = time.monotonic()
        # Versions a few wedged workers never report are given up on: each step walks them all
        # against every worker's installs (3,000 versions held cost 23 ms a step with 10 workers).
        while len(self.published_at) > UNMEASURED_KEEP:
            del self.published_at[min(self.published_at)]

    def step(self, *, wait: float, train: float, useful_share: float = 1.0) -> dict:
        """Cost of the step and the fleet's view of capacity (run-log fields)."""
        fleet = self.fleet
        if fleet is not None:
            fleet.trained(train, useful_share)
            prices = fleet.active_prices()
        else:  # no pool, no provider: nobody the learner could take a price from (a worker's own is a claim)
            prices = []
        bandwidth, wires = 0.0, {}
        for version in sorted(self.publisher.wire_bytes):  # bytes on the wire of what was published
            wires[version] = self.publisher.wire_bytes.pop(version)
            bandwidth += self.bandwidth(wires[version])
        cost = self.cost.step(train, wait, prices, bandwidth)
        self.recent_steps.append(cost.dollars)
        self.hourly = cost.learner_price + cost.workers_price
        out = {"dollars_step": round(cost.dollars, 8), "dollars_total": round(cost.cumulative, 6),
               "workers_price_per_hour": round(cost.workers_price, 4), "bubble": round(cost.bubble, 4)}
        if bandwidth:
            out["dollars_bandwidth"] = round(bandwidth, 8)
        for version, wire in wires.items():
            plans = {k: logged_plan(v) for k, v in wire.get("plans", {}).items()}
            out["snapshot_bytes"] = {"version": version, **wire, "plans": plans}
        bcast = self.broadcast_times()
        if bcast:
            out["t_bcast"] = round(max(bcast.values()), 4)
            self.metrics.t_bcast.set(out["t_bcast"])
            if fleet is not None:
                for t in bcast.values():
                    fleet.broadcast(t)
        install = self.install_time()
        if install is not None:
            out["install_s"] = round(install, 4)
            if fleet is not None:
                fleet.installed(install)
        active = self.registry.active(time.monotonic())
        out.update(capacity=round(sum(w.capacity_per_s for w in active), 3),  # rollouts per engine-busy second
                   delivered=round(self.delivered(), 3))  # accepted rollouts per wall second
        if fleet is not None and fleet.status is not None:
            st = fleet.status
            out.update(r_req=round(st.r_req, 3), r_eff=round(st.r_eff, 3), active_workers=len(st.active),
                       binding=st.binding)
        return out

    def delivered(self) -> float:
        """Rollouts per second the learner accepted over the last steps (its count, not the workers')."""
        self._accepted.append((time.monotonic(), self.registry.buffer.buffer.stats.accepted))
        (t0, a0), (t1, a1) = self._accepted[0], self._accepted[-1]
        return self.group_size * (a1 - a0) / (t1 - t0) if t1 > t0 else 0.0

    def _proven(self) -> list:
        """Active workers that delivered accepted work: the only ones whose reports are counted."""
        return [w for w in self.registry.active(time.monotonic()) if w.groups_accepted > 0]

    def bandwidth(self, wire: dict) -> float:
        """$ the market bills for one published version's traffic (`scheduler.market.version_traffic`:
        every worker downloads it, relays upload it again); star mode: every active worker downloads it whole."""
        fleet = self.fleet
        if fleet is None:
            return 0.0
        rates = fleet.gb_rates()
        if not rates:
            return 0.0
        keys = {w.id: w.fleet_key for w in self.registry.workers.values()}
        traffic = version_traffic(wire)
        if not traffic:
            traffic = {w.id: (float(wire.get("raw") or 0), 0.0) for w in self.registry.active(time.monotonic())}
        by_key = {keys.get(w, w): t for w, t in traffic.items()}
        sizes = [d for d, _ in traffic.values() if d]
        if sizes:
            fleet.published(max(sizes))
        return bandwidth_dollars(by_key, rates)

    def exhausted(self) -> str:
        """Why the run must stop now for its budget ('' = it may go on)."""
        return self.budget.exhausted(self.cost.dollars, self.recent_steps)

    def affordable_wait_s(self) -> float | None:
        """How long the learner may wait for its next batch within the budget (None: no limit)."""
        wait = self.budget.affordable_wait_s(self.cost.dollars, self.recent_steps, self.hourly)
        return None if math.isinf(wait) else wait

    def broadcast_times(self) -> dict[int, float]:
        """T_bcast of each version that `done_fraction` of the active workers have received
        (whole and verified): publication until the last of that fraction had it (or a newer
        one). Reception, not install: a worker installs between two batches, and the batch it
        drains meanwhile is rollout time, not broadcast time. Each version is reported once."""
        active = [w for w in self._proven() if w.installs]
        done = {}
        for version, published in list(self.published_at.items()):
            # Workers that joined after the publication, or whose engine was still starting (no install
            # before it: a vLLM worker's 12 s start read as the first T_bcast, and the scheduler called
            # the run infeasible), measure their start-up, not the broadcast.
            present = [w for w in active if w.joined <= published and w.installs[0][1] <= published]
            arrivals = sorted(r - published for r in (next((r for v, _, r, _ in w.installs if v >= version), None)
                                                      for w in present) if r is not None)
            need = math.ceil(self.done_fraction * len(present) - 1e-9)
            if not present and time.monotonic() - published > 60:
                del self.published_at[version]  # nobody to measure it on
            elif present and len(arrivals) >= need:
                done[version] = max(0.0, arrivals[need - 1])
                del self.published_at[version]
        return done

    def install_time(self) -> float | None:
        """τ: the median over proven workers of each one's median recent install time (seconds)."""
        per_worker = [statistics.median(times) for w in self._proven()
                      if (times := [d for _, _, _, d in w.installs[-5:] if 0 < d <= MAX_INSTALL_S])]
        return statistics.median(per_worker) if per_worker else None
