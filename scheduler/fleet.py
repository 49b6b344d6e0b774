"""The thin adapter between the learner and the controller: which workers generate.

The learner tells it who joined, who beat and what the trainer measured; it answers whether a
worker should generate (`is_active`) and, on each `tick`, turns the controller's decisions
into provider actions. Candidates come from the pool file (machines a provider can bring up,
identified by the pool ids `name-k`, which a worker proves with its machine token) and from
workers that joined by themselves. Nothing a self-joined worker declares is believed: it is
known by the worker id the learner gave it (not the name it chose), priced like the dearest
machine the operator listed (not at what it declared), and counted at `UNPROVEN_RATE` until
the learner measured its capacity.

Invariant (asserted): a worker is active only if the controller lists it as active.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from scheduler.capacity import requirement
from scheduler.controller import INFEASIBLE, Controller, ControllerParams, Decision
from scheduler.errors import InfeasibleOverlap
from scheduler.pool import Pool
from scheduler.market import bandwidth_per_hour
from scheduler.providers import Machine, Provider


UNPROVEN_RATE = 1.0  # rollouts/s a self-joined worker counts for before it was measured
UNPRICED = 1.0  # $/h of a self-joined worker when no pool names a price
SYNCHRONOUS = ("S = 0 is synchronous: each step waits for the rollouts of its own version, which the capacity "
               "rule (for overlapped, asynchronous runs) does not describe, and more workers make steps shorter")


@dataclass
class _Candidate:
    machine: Machine
    launched_at: float | None = None  # by our provider
    joined: bool = False
    offered: bool = False  # a market's live offer (it may vanish); else a pool entry
    last_seen: float = -math.inf


@dataclass
class FleetStatus:
    r_req: float
    target: float
    r_eff: float  # Σ capacity of the active workers (rollouts per engine-busy second)
    active: list[str]
    active_price: float
    t_train: float
    t_bcast: float
    install_s: float
    binding: str = ""  # which condition of the rule sets R_req
    infeasible: str = ""
    decisions: list[Decision] = field(default_factory=list)
    lost: list[tuple[str, str]] = field(default_factory=list)  # (machine id, why): the learner re-issues their leases


class Fleet:
    def __init__(self, pool: Pool | None, provider: Provider, params: ControllerParams, *, batch: int,
                 publish_every: int, max_staleness: int | None, t_train_prior: float, t_bcast_prior: float,
                 launch_timeout_s: float, rule: str = "overlapped", install_prior: float = 0.0,
                 version_bytes: float = 0.0):
        self.provider = provider
        self.controller = Controller(params)
        self.batch, self.publish_every, self.max_staleness, self.rule = batch, publish_every, max_staleness, rule
        self.t_train_prior, self.t_bcast_prior, self.install_prior = t_train_prior, t_bcast_prior, install_prior
        self.launch_timeout_s = launch_timeout_s
        self.candidates: dict[str, _Candidate] = {}
        self._self_joined: set[str] = set()  # candidates that are a worker's own id (no pool entry, no offer)
        self._train_times: deque[float] = deque(maxlen=20)
        self._bcast_times: deque[float] = deque(maxlen=5)
        self._install_times: deque[float] = deque(maxlen=5)
        self.status: FleetStatus | None = None
        self.version_bytes = version_bytes  # one published version on the wire (prior, then measured)
        self.useful_share = 1.0  # trainable share of generated groups (learner.buffer.useful_share)
        self.stopped = ""  # why every machine was released for good (the budget)
        if pool is not None:  # a static provider's pool entries become available when they join
            for c in pool.candidates():
                kind = pool.kind_of(c.id)
                self._add(0.0, Machine(c.id, kind.gpu, kind.price_per_hour, kind.rollouts_per_s,
                                       down_mbps=kind.download_mbps, up_mbps=kind.upload_mbps,
                                       dollars_per_gb_down=kind.dollars_per_gb_down,
                                       dollars_per_gb_up=kind.dollars_per_gb_up))
        self._refresh_offers(0.0)

    def _add(self, now: float, machine: Machine, offered: bool = False) -> None:
        self.candidates[machine.id] = _Candidate(machine, offered=offered)
        self.controller.join(now, machine.id, self.effective_price(machine), machine.rollouts_per_s)

    def _forget(self, key: str) -> None:
        self._self_joined.discard(key)
        self.candidates.pop(key, None)
        self.controller.forget(key)

    # --- the bill -----------------------------------------------------------------------------

    @property
    def versions_per_hour(self) -> float:
        return 3600.0 / (self.publish_every * max(self.t_train, 1e-3))

    def effective_price(self, machine: Machine) -> float:
        """$/h the controller ranks a machine by: its rent plus its bandwidth bill (it downloads
        every version, and may relay it once)."""
        return machine.price_per_hour + bandwidth_per_hour(machine, self.version_bytes, self.versions_per_hour)

    def published(self, wire_bytes: float) -> None:
        """A version went out: `wire_bytes` is what one worker downloads of it."""
        if wire_bytes > 0:
            self.version_bytes = float(wire_bytes)

    def gb_rates(self) -> dict[str, tuple[float, float]]:
        """Fleet key → ($/GB down, $/GB up) of every candidate that is billed for traffic."""
        return {k: (c.machine.dollars_per_gb_down, c.machine.dollars_per_gb_up) for k, c in self.candidates.items()
                if c.machine.dollars_per_gb_down or c.machine.dollars_per_gb_up}

    def link_of(self, key: str) -> tuple[float, float] | None:
        """The (down, up) Mbit/s a market's offer (or the pool) says for a machine; None = unknown.
        The learner seeds its broadcast link table with it instead of the worker's own word."""
        cand = self.candidates.get(key)
        if cand is None or not (cand.machine.down_mbps or cand.machine.up_mbps):
            return None
        return cand.machine.down_mbps, cand.machine.up_mbps

    # --- the market ---------------------------------------------------------------------------

    def _refresh_offers(self, now: float) -> None:
        """A market's candidates follow its live offers: new ones join the pool, vanished ones
        that we neither launched nor use leave it."""
        offered = self.provider.offers()
        if offered is None:
            return
        ids = set()
        for m in offered:
            ids.add(m.id)
            if m.id not in self.candidates:
                self._add(now, m, offered=True)
        for key, cand in list(self.candidates.items()):
            if (cand.offered and key not in ids and cand.launched_at is None and not cand.joined
                    and key not in self.controller.active):
                self._forget(key)

    def _lost(self, now: float) -> list[tuple[str, str]]:
        """Machines the provider lost (preempted, offer vanished): forgotten at once, so the
        controller replaces them at this tick and the learner re-issues their leases."""
        lost = [(key, why) for key, why in self.provider.poll() if key in self.candidates]
        for key, _ in lost:
            self._forget(key)
        return lost

    def release_all(self, now: float, reason: str) -> list[Decision]:
        """Release every machine for good (the budget is spent): nothing is activated after."""
        self.stopped = reason
        decisions = self.controller.release_all(reason)
        for cand in self.candidates.values():
            if cand.launched_at is not None or cand.joined:
                if self.provider.releases_machines:
                    self.provider.release(cand.machine)
                cand.joined, cand.launched_at = False, None
        return decisions

    # --- what the learner reports --------------------------------------------------------

    def joined(self, now: float, worker_id: str, machine_id: str | None = None) -> str:
        """A worker joined: as the pool machine its machine token proved (`machine_id`), or by
        itself. Returns the id the fleet knows it by (`is_active`, `heartbeat`)."""
        key = machine_id if machine_id in self.candidates else worker_id
        cand = self.candidates.get(key)
        if cand is None:
            self._add(now, Machine(key, "", self.unproven_price, UNPROVEN_RATE))
            self._self_joined.add(key)
            cand = self.candidates[key]
        cand.joined, cand.last_seen = True, now
        self.controller.observe(now, key, alive=True)
        return key

    def left(self, key: str) -> None:
        """The learner forgot the worker known by `key` (silent too long, or its machine joined
        again under a new identity). A pool machine or a market's offer stays a candidate (its
        machine may join again, by the same key); a worker that joined by itself goes with its id,
        so the controller stops counting it at once."""
        if key in self._self_joined:
            self._forget(key)

    @property
    def unproven_price(self) -> float:
        """What a self-joined worker costs for the controller: the dearest listed machine, so a
        claim of $0/h cannot make it the first choice."""
        listed = [c.machine.price_per_hour for c in self.candidates.values() if c.machine.rollouts_per_s > 0]
        return max(listed, default=UNPRICED)

    def heartbeat(self, now: float, name: str, capacity_per_s: float) -> None:
        """A worker beat, reporting its capacity: rollouts per engine-busy second. Not what it
        delivered: with back-pressure that is capped by what the learner consumes, and a
        controller fed demand would never see a surplus to release."""
        cand = self.candidates.get(name)
        if cand is not None:
            cand.last_seen = now
            self.controller.observe(now, name, alive=True, rollouts_per_s=capacity_per_s if capacity_per_s > 0 else None)

    def trained(self, seconds: float, useful_share: float = 1.0) -> None:
        """A step took `seconds`; of the groups generated lately, `useful_share` were trainable
        (dynamic sampling skips the rest), so a step needs `batch / useful_share` rollouts."""
        self._train_times.append(seconds)
        self.useful_share = min(1.0, max(useful_share, 1e-3))

    def broadcast(self, seconds: float) -> None:
        self._bcast_times.append(seconds)

    def installed(self, seconds: float) -> None:
        self._install_times.append(seconds)

    # --- decisions -----------------------------------------------------------------------

    @property
    def t_train(self) -> float:
        return statistics.median(self._train_times) if self._train_times else self.t_train_prior

    @property
    def t_bcast(self) -> float:
        return statistics.median(self._bcast_times) if self._bcast_times else self.t_bcast_prior

    @property
    def install_s(self) -> float:
        return statistics.median(self._install_times) if self._install_times else self.install_prior

    def is_active(self, name: str) -> bool:
        return name in self.controller.active

    def tick(self, now: float) -> FleetStatus:
        """Refresh offers and availability, re-evaluate the capacity rule, act on the decisions."""
        self._refresh_offers(now)
        lost = self._lost(now)
        for key, cand in list(self.candidates.items()):
            self.controller.set_price(key, self.effective_price(cand.machine))
            if cand.joined:
                continue  # heartbeats speak for it; the controller times it out
            waiting = cand.launched_at is not None and now - cand.launched_at > self.launch_timeout_s
            if waiting and self.provider.abandon(cand.machine, f"did not join within {self.launch_timeout_s:g} s"):
                lost.append((key, f"never joined within {self.launch_timeout_s:g} s: destroyed"))
                self._forget(key)
                continue
            # A machine the provider can still bring up is available; one that never joined is not.
            self.controller.observe(now, cand.machine.id,
                                    alive=self.provider.launches_machines and not waiting and not self.stopped)
        infeasible, binding = "", ""
        if self.max_staleness == 0:  # no rule to meet (it was told as "infeasible: dropped whatever"; a new user)
            infeasible, r_req = SYNCHRONOUS, math.inf
        else:
            try:  # learner-visible broadcast: reception by the workers, then their install
                req = requirement(self.rule, batch=self.batch / self.useful_share, t_train=self.t_train,
                                  t_bcast=self.t_bcast + self.install_s, publish_every=self.publish_every,
                                  max_staleness=self.max_staleness, install_s=self.install_s)
                r_req, binding = req.r_req, req.binding
            except InfeasibleOverlap as e:  # says what to change: I, S and the broadcast time together
                infeasible, r_req = str(e), math.inf
        # After release_all (the budget) nothing is activated again: the target is zero.
        decisions = self.controller.tick(now, 0.0 if self.stopped else r_req if math.isfinite(r_req) else INFEASIBLE)
        for d in decisions:
            cand = self.candidates[d.worker_id]
            if d.action == "activate" and not cand.joined and self.provider.launches_machines:
                if cand.launched_at is None or now - cand.launched_at > self.launch_timeout_s:
                    cand.launched_at = now
                    self.provider.launch(cand.machine)
            elif d.action == "release" and self.provider.releases_machines:
                self.provider.release(cand.machine)
                cand.joined, cand.launched_at = False, None
        st = self.controller.status()
        active = list(self.controller.active)
        assert all(a in self.candidates for a in active)
        self.status = FleetStatus(r_req=r_req, target=st.target, r_eff=st.r_eff, active=active,
                                  active_price=st.active_price, t_train=self.t_train, t_bcast=self.t_bcast,
                                  install_s=self.install_s, binding=binding, infeasible=infeasible,
                                  decisions=decisions, lost=lost)
        return self.status

    def active_prices(self) -> list[float]:
        return [self.candidates[a].machine.price_per_hour for a in self.controller.active]
