"""Marketplace providers: machines rented from live offers (Vast.ai, SkyPilot), and the
bandwidth they are billed for.

A `Market` is the four calls a marketplace SDK answers (`search`, `create`, `destroy`,
`states`); `MarketProvider` turns it into a `Provider` the fleet drives:

- its offers are the fleet's candidates (`offers()`), machine id `<market>-<offer id>`, priced
  at the offer's $/h (never what the machine later says), rated at the `[scheduler.provider]
  gpus` table's rollouts/s for the offer's GPU, with the offer's inet down/up and $/GB;
- `launch` creates an instance from the offer with an on-start command that runs
  `echo-worker join URL --token <machine token>`; the token binds the worker to the offer;
- `release` destroys the instance; `close` destroys every instance it still holds;
- `poll()` says what happened on the market since the last call: an offer that vanished between
  search and create, an instance that stopped by itself (an interruptible one outbid, a host
  gone): the fleet forgets the machine and the learner re-issues its leases at once;
- `abandon` (a launched machine that never joined) destroys the instance and remembers the
  offer as bad: it is never offered again in this run.

Every SDK call runs on the provider's own thread (they block on HTTP); the fleet only reads
snapshots and queues actions, so the learner's event loop never waits for the market.
"""

from __future__ import annotations

import logging
import queue
from collections import deque
import shlex
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from scheduler.providers import Machine, Provider, machine_token


log = logging.getLogger("echo.market")
GB = 1e9


class OfferGone(Exception):
    """The offer was taken (or withdrawn) between search and create."""


@dataclass(frozen=True)
class Offer:
    """One machine on the market, as its search answered (the fields the scheduler uses)."""

    id: str
    gpu: str
    num_gpus: int
    price_per_hour: float  # $/h all-in (compute + storage), or the bid for an interruptible one
    reliability: float = 1.0
    down_mbps: float = 0.0
    up_mbps: float = 0.0
    dollars_per_gb_down: float = 0.0
    dollars_per_gb_up: float = 0.0
    location: str = ""
    verified: bool = False
    interruptible: bool = False

    def row(self) -> dict:
        return {"id": self.id, "gpu": self.gpu, "num_gpus": self.num_gpus, "price_per_hour": self.price_per_hour,
                "reliability": self.reliability, "down_mbps": self.down_mbps, "up_mbps": self.up_mbps,
                "dollars_per_gb_down": self.dollars_per_gb_down, "dollars_per_gb_up": self.dollars_per_gb_up,
                "location": self.location, "verified": self.verified, "interruptible": self.interruptible}


class Market(Protocol):
    name: str  # machine ids are `<name>-<offer id>`

    def search(self) -> list[Offer]:
        """The offers that match the configured query now."""

    def create(self, offer: Offer, label: str, onstart: str) -> str:
        """Rent `offer`, running `onstart` when it boots; returns the instance id. Raises
        `OfferGone` when the offer is no longer there."""

    def destroy(self, instance_id: str) -> None:
        """Stop paying for the instance (idempotent)."""

    def states(self) -> dict[str, str]:
        """Every instance of ours: id → 'starting' | 'running' | 'stopped' (ended by itself)."""


def rate_for(gpus: dict[str, float], offer: Offer) -> float:
    """Expected rollouts/s of an offer's machine: the `gpus` table's rate of its GPU (case and
    spaces ignored) times its GPU count; 0 when the table does not list it (not a candidate)."""
    norm = {k.lower().replace(" ", "").replace("_", ""): v for k, v in gpus.items()}
    return norm.get(offer.gpu.lower().replace(" ", "").replace("_", ""), 0.0) * max(1, offer.num_gpus)


def offer_machine(market: str, offer: Offer, gpus: dict[str, float]) -> Machine:
    return Machine(f"{market}-{offer.id}", offer.gpu, offer.price_per_hour, rate_for(gpus, offer),
                   down_mbps=offer.down_mbps, up_mbps=offer.up_mbps, dollars_per_gb_down=offer.dollars_per_gb_down,
                   dollars_per_gb_up=offer.dollars_per_gb_up, interruptible=offer.interruptible)


def bandwidth_per_hour(machine: Machine, version_bytes: float, versions_per_hour: float, relays: float = 1.0) -> float:
    """$/h a machine's traffic costs: it downloads each version once and, as a relay, uploads it
    `relays` times (the broadcast plan decides; 1 plans for a chain member), plus nothing else
    worth billing (rollout uploads are kilobytes)."""
    per_version = version_bytes / GB * (machine.dollars_per_gb_down + relays * machine.dollars_per_gb_up)
    return per_version * versions_per_hour


def version_traffic(wire: dict) -> dict[str, tuple[float, float]]:
    """Bytes each worker downloaded and uploaded for one published version, from the learner's
    `wire_bytes` record of it (the broadcast plans): every member of a chain downloads the
    version's wire size (delta or full) and uploads it to the next member; in a tree (`parents`)
    a member uploads once per child; pulling workers only download. Star mode has no plans
    (every worker downloads `raw` from the learner; the caller knows who)."""
    out: dict[str, tuple[float, float]] = {}
    for plan in (wire.get("plans") or {}).values():
        size = float(plan.get("bytes") or wire.get("full") or wire.get("raw") or 0)
        shares, all_parents = plan.get("shares") or [], plan.get("parents") or []
        for k, chain in enumerate(plan.get("chains", [])):
            share = float(shares[k]) if k < len(shares) and plan.get("kind") == "stripes" else 1.0
            parents = all_parents[k] if k < len(all_parents) else None
            for i, member in enumerate(chain):
                children = (sum(1 for p in parents if p == i) if parents is not None
                            else (1 if i + 1 < len(chain) else 0))
                down, up = out.get(member, (0.0, 0.0))
                out[member] = (down + size * share, up + size * share * children)
        for member in plan.get("pull", []):
            down, up = out.get(member, (0.0, 0.0))
            out[member] = (max(down, size), up)
    return out


@dataclass
class _Rented:
    machine: Machine
    offer: Offer
    instance: str | None = None  # None until create answered
    created_at: float = 0.0
    destroying: bool = False


class MarketProvider(Provider):
    """A `Provider` over a `Market`; see the module docstring. `background=False` runs no thread
    (tests call `step()`)."""

    kind = "market"
    launches_machines = True
    releases_machines = True

    def __init__(self, market: Market, *, url: str, machine_key: str, gpus: dict[str, float], onstart: str,
                 refresh_s: float = 30.0, background: bool = True, clock=time.monotonic):
        if not gpus:
            raise ValueError("a market provider needs [scheduler.provider] gpus: GPU name → expected rollouts/s")
        self.market, self.url, self.machine_key, self.gpus = market, url, machine_key, gpus
        self.onstart_template, self.refresh_s, self.clock = onstart, refresh_s, clock
        self._lock = threading.Lock()
        self._offers: dict[str, tuple[Machine, Offer]] = {}  # machine id → offered now
        self._rented: dict[str, _Rented] = {}  # machine id → what we rent (or asked to)
        self._bad: set[str] = set()  # offer ids that never joined or vanished: not offered again
        self._events: list[tuple[str, str]] = []
        self._actions: queue.Queue = queue.Queue()
        self._searched_at = -float("inf")
        self.destroyed: list[str] = []  # instance ids, in order (the run log and tests read it)
        self.errors: deque[str] = deque(maxlen=64)  # the latest: a day's outage retried every second was 86,400
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name=f"market-{market.name}", daemon=True)
            self._thread.start()

    # --- what the fleet calls (never blocks on the market) -----------------------------------

    def offers(self) -> list[Machine]:
        with self._lock:
            return [m for m, o in self._offers.values() if o.id not in self._bad]

    def offer(self, machine_id: str) -> Offer | None:
        with self._lock:
            got = self._offers.get(machine_id) or (
                (self._rented[machine_id].machine, self._rented[machine_id].offer) if machine_id in self._rented else None)
        return got[1] if got else None

    def launch(self, machine: Machine) -> None:
        self._actions.put(("create", machine.id))

    def release(self, machine: Machine) -> None:
        self._actions.put(("destroy", machine.id))

    def abandon(self, machine: Machine, reason: str) -> bool:
        with self._lock:
            got = self._rented.get(machine.id) or (self._offers.get(machine.id) and _Rented(*self._offers[machine.id]))
            if got is not None:
                self._bad.add(got.offer.id)
        log.warning("market: giving up on %s (%s); destroying it, its offer is not used again", machine.id, reason)
        self._actions.put(("destroy", machine.id))
        return True

    def poll(self) -> list[tuple[str, str]]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def onstart(self, machine: Machine) -> str:
        fields = {"url": self.url, "token": machine_token(self.machine_key, machine.id), "id": machine.id,
                  "gpu": machine.gpu}
        return self.onstart_template.format(**{k: shlex.quote(str(v)) for k, v in fields.items()})

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            held = [mid for mid, r in self._rented.items() if r.instance is not None]
        for mid in held:
            self._destroy(mid)

    # --- the provider's thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step(block_s=0.2)
            except Exception as e:  # a market hiccup must not end the thread
                if not self.errors or self.errors[-1] != str(e):  # an outage is one line, not one a second
                    log.warning("market %s: %s (retrying every second)", self.market.name, e)
                self.errors.append(str(e))
                time.sleep(1.0)

    def step(self, block_s: float = 0.0) -> None:
        """One round: the queued actions, then (every `refresh_s`) search and instance states."""
        try:
            while True:
                what, mid = self._actions.get(timeout=block_s) if block_s else self._actions.get_nowait()
                block_s = 0.0
                self._create(mid) if what == "create" else self._destroy(mid)
        except queue.Empty:
            pass
        if self.clock() - self._searched_at >= self.refresh_s:
            self._searched_at = self.clock()
            self.refresh()

    def refresh(self) -> None:
        offers = self.market.search()
        found = {}
        for o in offers:
            m = offer_machine(self.market.name, o, self.gpus)
            if m.rollouts_per_s > 0:
                found[m.id] = (m, o)
        states = self.market.states()
        with self._lock:
            self._offers = found
            for mid, r in list(self._rented.items()):
                if r.instance is None or r.destroying:
                    continue
                state = states.get(r.instance, "gone")
                if state in ("stopped", "gone"):
                    why = "preempted (outbid)" if r.offer.interruptible else f"instance {state} by itself"
                    self._events.append((mid, why))
                    self._actions.put(("destroy", mid))  # a stopped instance still bills its disk

    def _create(self, mid: str) -> None:
        with self._lock:
            got = self._offers.get(mid)
            if mid in self._rented or got is None:
                if got is None and mid not in self._rented:
                    self._events.append((mid, "offer vanished before it was rented"))
                return
            machine, offer = got
            rented = self._rented[mid] = _Rented(machine, offer, created_at=self.clock())
        try:
            instance = self.market.create(offer, mid, self.onstart(machine))
        except OfferGone as e:
            with self._lock:
                self._rented.pop(mid, None)
                self._offers.pop(mid, None)
                self._bad.add(offer.id)
                self._events.append((mid, f"offer vanished between search and create ({e})"))
            return
        with self._lock:
            rented.instance = instance
        log.info("market: rented %s as instance %s at $%.3f/h", mid, instance, offer.price_per_hour)

    def _destroy(self, mid: str) -> None:
        with self._lock:
            r = self._rented.get(mid)
            if r is None or r.instance is None:
                self._rented.pop(mid, None)
                return
            r.destroying = True
        self.market.destroy(r.instance)
        with self._lock:
            self._rented.pop(mid, None)
            self.destroyed.append(r.instance)
        log.info("market: destroyed instance %s (%s)", r.instance, mid)

    def rented(self) -> dict[str, str | None]:
        """machine id → instance id of what is rented now (None: create not answered yet)."""
        with self._lock:
            return {mid: r.instance for mid, r in self._rented.items()}
