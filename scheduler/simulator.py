"""Event-driven simulator of asynchronous RL staleness (formulas.md §2, the blog's appendix),
extended with ECHO-2's overlapped pipeline (publication every `I` steps, broadcast delay,
heterogeneous workers).

Model:
- worker `w` has `slots[w]` slots decoding at `speed[w]` tokens/s each; slots never idle;
- lengths are capped lognormal: `L = round(min(cap·μ₀, μ₀·exp(σz − σ²/2)))` (σ = 0: all μ₀);
- each worker fills one open group of `n` samples at a time: a freed slot takes the next
  sample of its worker's open group, or opens a new group stamped with the snapshot version
  the worker has installed (the trainer version when sync is instant);
- a group enters the queue when its `n` samples finish. Queue-drop: at capacity
  `queue_groups` the oldest queued group is dropped. Staleness filter (queue-max, or queue-drop
  with the filter on): when the trainer takes a batch, every queued group staler than
  `max_staleness` is discarded first (as `learner.buffer` does). Both may be on;
- blocking (the learner's back-pressure, `blocking_groups`): while that many groups are
  queued, no slot opens a new group (a group already open keeps getting its samples); idle
  slots start again when the trainer takes a batch. Off, slots never idle (the blog's model);
- the trainer, idle with ≥ G groups queued, takes the oldest G admissible groups, trains for
  `t_train` seconds, then increments its version; every `publish_every` versions a snapshot
  is published and workers generate with it `sync_delay` seconds later.

Staleness of a trained group = trainer version at the start of the consuming step − stamp,
split into PQS (trainer version at enqueue − stamp) and IQS (the rest).

Invariants (asserted at the end of every run): staleness ≥ 0; trained staleness ≤
`max_staleness` when set; conservation `started = trained + dropped + queued + in_flight`.

`record=True` keeps the run's events (`SimResult.events`: group completions with their stamp,
batches with the groups they took, drops), so a trace can be replayed through the live
learner's buffer and both compared (tests/unit/scheduler/test_scheduler_simulator.py).

The hot loop handles one sample completion per iteration with one `heapreplace` on a heap of
`(finish_time, slot)`; trainer and install events are rare and are compared against a single
cached "next other event" time. Lengths come from numpy in chunks, consumed through a C-level
iterator. A group is a 5-element list, the only allocation besides the heap tuple.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from itertools import chain

import numpy as np

from scheduler.errors import SchedulerError
from scheduler.staleness import length_mean


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A rollout worker: `slots` concurrent generations, each at `speed` tokens/s."""

    slots: int
    speed: float

    def rate(self, mean_length: float) -> float:
        """Rollouts/s this worker completes when its slots are always busy."""
        return self.slots * self.speed / mean_length


@dataclass(frozen=True, slots=True)
class SimConfig:
    workers: tuple[WorkerSpec, ...]
    group_size: int  # n
    groups_per_batch: int  # G; B = G·n
    t_train: float  # seconds per trainer step
    mu0: float = 1000.0  # length scale (tokens); the mean is length_mean(mu0, sigma, cap)
    sigma: float = 0.0  # tailness: lognormal σ (0 = deterministic lengths)
    cap: float = 8.0  # lengths are capped at cap·μ₀
    queue_groups: int | None = None  # queue-drop capacity in groups (q·G); None = unbounded
    max_staleness: int | None = None  # queue-max threshold; None = no limit
    publish_every: int = 1  # I
    sync_delay: float = 0.0  # seconds from publication to workers generating with it (T_b)
    blocking_groups: int | None = None  # back-pressure: no new group while this many are queued
    record: bool = False  # keep the event trace (SimResult.events)
    steps: int = 2000  # measured trainer steps
    warmup_steps: int = 200  # trainer steps ignored before measuring
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.workers or any(w.slots < 1 or not w.speed > 0 for w in self.workers):
            raise SchedulerError("the simulator needs ≥ 1 worker, each with ≥ 1 slot and speed > 0")
        if self.group_size < 1 or self.groups_per_batch < 1:
            raise SchedulerError("group_size and groups_per_batch must be ≥ 1")
        if not self.t_train > 0 or self.sync_delay < 0 or self.publish_every < 1:
            raise SchedulerError("t_train must be > 0, sync_delay ≥ 0 and publish_every ≥ 1")
        if self.queue_groups is not None and self.queue_groups < self.groups_per_batch:
            raise SchedulerError(
                f"queue capacity {self.queue_groups} groups is below a batch of {self.groups_per_batch}: "
                "the trainer would never start; use a queue factor q ≥ 1"
            )
        if self.max_staleness is not None and self.max_staleness < 0:
            raise SchedulerError("max_staleness must be ≥ 0")
        if self.steps < 1 or self.warmup_steps < 0:
            raise SchedulerError("steps must be ≥ 1 and warmup_steps ≥ 0")

    @property
    def batch(self) -> int:
        return self.group_size * self.groups_per_batch

    @property
    def mean_length(self) -> float:
        return length_mean(self.mu0, self.sigma, self.cap)

    @property
    def rollout_rate(self) -> float:
        return sum(w.rate(self.mean_length) for w in self.workers)

    @property
    def rho(self) -> float:
        """Utilization `Θ_R/Θ_T = R·T/B`."""
        return self.rollout_rate * self.t_train / self.batch


@dataclass(frozen=True, slots=True)
class SimResult:
    steps: int  # measured trainer steps
    pqs: float  # mean over trained groups
    iqs: float
    max_staleness: int
    histogram: tuple[int, ...]  # trained groups by staleness 0, 1, 2, ...
    trainer_busy: float  # fraction of wall time the trainer computes (measured window)
    t_eff: float  # mean seconds between trainer versions
    sampled_mean_length: float  # over every completed sample (measured window)
    trained_mean_length: float
    sampled_max_length: float
    trained_max_length: float
    started: int  # groups, whole run (warm-up included)
    trained: int
    dropped_overflow: int
    dropped_stale: int
    queued: int
    in_flight: int
    rollouts: int  # samples completed, whole run
    wall_s: float  # host seconds the run took
    events: tuple = ()  # record=True: ("done", t, gid, stamp), ("evict", t, version), ("drop", reason, gid), ("batch", t, version, gids)

    @property
    def total(self) -> float:
        return self.pqs + self.iqs

    @property
    def bubble(self) -> float:
        return 1.0 - self.trainer_busy

    @property
    def rollouts_per_s(self) -> float:
        """Simulated rollouts per host second: the simulator's speed."""
        return self.rollouts / self.wall_s if self.wall_s > 0 else math.inf

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(total=self.total, bubble=self.bubble, rollouts_per_s=self.rollouts_per_s)
        d["histogram"] = list(self.histogram)
        del d["events"]
        return d


def _length_chunks(seed: int, mu0: float, sigma: float, cap: float, chunk: int = 1 << 16) -> Iterator[list[float]]:
    """Endless chunks of lengths (whole tokens ≥ 1), generated by numpy; flattened by the caller."""
    if sigma == 0:
        while True:
            yield [float(max(1, round(min(mu0, cap * mu0))))] * chunk
    rng = np.random.default_rng(seed)
    shift = -sigma * sigma / 2
    top = cap * mu0
    while True:
        z = rng.standard_normal(chunk)
        lengths = np.maximum(1.0, np.rint(np.minimum(top, mu0 * np.exp(sigma * z + shift))))
        yield lengths.tolist()


class _Slots:
    """Every generation slot of every worker, and the group each one is filling.

    A group is `[remaining, stamp, length_sum, max_length, enqueue_version, id]`. `simulate`'s
    hot path reads these lists through locals and inlines `start` (see there why)."""

    def __init__(self, cfg: SimConfig, draw) -> None:
        self.n, self.draw = cfg.group_size, draw
        self.inv_speed = [1.0 / w.speed for w in cfg.workers]
        nw = len(cfg.workers)
        self.wver = [0] * nw  # snapshot version each worker generates with
        self.left = [0] * nw  # samples of the worker's open group not yet started
        self.open_group: list[list] = [[0, 0, 0.0, 0.0, 0, -1]] * nw
        self.slot_w = [w for w, spec in enumerate(cfg.workers) for _ in range(spec.slots)]
        self.slot_group: list[list] = [[]] * len(self.slot_w)
        self.started = 0  # groups opened
        self.heap = [self.start(s, 0.0) for s in range(len(self.slot_w))]  # (finish time, slot)
        self.heap.append((math.inf, -1))  # sentinel: when every slot idles, the next event is the trainer's
        heapq.heapify(self.heap)

    def start(self, s: int, t: float) -> tuple[float, int]:
        """Slot `s` starts a sample at `t`: of its worker's open group, else of a new one.
        Returns the sample's finish event for the heap."""
        w = self.slot_w[s]
        if self.left[w]:
            self.left[w] -= 1
            g = self.open_group[w]
        else:
            g = [self.n, self.wver[w], 0.0, 0.0, 0, self.started]
            self.open_group[w] = g
            self.left[w] = self.n - 1
            self.started += 1
        self.slot_group[s] = g
        length = self.draw()
        g[2] += length
        g[3] = max(g[3], length)
        return t + length * self.inv_speed[w], s


@dataclass
class _Window:
    """What the measured window (after warm-up) tallies about the groups it trains on."""

    groups: int = 0
    pqs_sum: int = 0
    iqs_sum: int = 0
    length_sum: float = 0.0
    max_length: float = 0.0
    hist: list[int] = field(default_factory=list)  # trained groups by staleness

    def trained(self, batch: list[list], version: int) -> None:
        self.groups += len(batch)
        for g in batch:
            p = g[4] - g[1]
            st = version - g[1]
            self.pqs_sum += p
            self.iqs_sum += st - p
            while len(self.hist) <= st:
                self.hist.append(0)
            self.hist[st] += 1
            self.length_sum += g[2]
            self.max_length = max(self.max_length, g[3])


def _evict_stale(queue: deque[list], version: int, smax: int, t: float,
                 events: list[tuple] | None) -> tuple[deque[list], int]:
    """queue-max at `t`: the queue without its groups staler than `smax`, and how many were dropped."""
    if events is not None:
        events.append(("evict", t, version))
    kept: deque[list] = deque()
    for g in queue:
        if version - g[1] > smax:
            if events is not None:
                events.append(("drop", "stale", g[5]))
        else:
            kept.append(g)
    return kept, len(queue) - len(kept)


def simulate(cfg: SimConfig) -> SimResult:
    """Run until `warmup_steps + steps` trainer versions; see the module docstring."""
    # Long on purpose: one event loop over locals. The hot path (a sample finishes) runs
    # millions of times per run, and a call or attribute lookup per event costs a large share
    # of `echo-rl bench simspeed`; the rare events (a step ends, a snapshot installs, the
    # trainer starts) share its locals.
    t_start = time.perf_counter()
    n = cfg.group_size
    G = cfg.groups_per_batch
    T = cfg.t_train
    qcap = cfg.queue_groups if cfg.queue_groups is not None else 1 << 62
    smax = cfg.max_staleness if cfg.max_staleness is not None else 1 << 62
    I = cfg.publish_every
    delay = cfg.sync_delay
    warm = cfg.warmup_steps
    last = cfg.warmup_steps + cfg.steps
    inf = math.inf
    draw = chain.from_iterable(_length_chunks(cfg.seed, cfg.mu0, cfg.sigma, cfg.cap)).__next__
    heapreplace = heapq.heapreplace

    slots = _Slots(cfg, draw)
    nw = len(cfg.workers)
    inv_speed, wver, left, open_group = slots.inv_speed, slots.wver, slots.left, slots.open_group
    slot_w, slot_group, heap = slots.slot_w, slots.slot_group, slots.heap
    started = slots.started  # the hot path counts here; handed back to `slots` around `slots.start`
    block = cfg.blocking_groups if cfg.blocking_groups is not None else 1 << 62
    idle: list[int] = []  # slots waiting for back-pressure to lift
    record = cfg.record
    events: list[tuple] = []

    queue: deque[list] = deque()
    version = 0
    busy = False
    t_train_end = inf
    installs: deque[tuple[float, int]] = deque()  # (time, version) publications in flight
    t_other = inf  # next rare event (trainer end, install, or "trainer may start now"): the only hot-path test
    rollouts = 0
    completed = 0
    trained = dropped_overflow = dropped_stale = 0
    window = _Window()  # measured-window tallies of trained groups; of sampled ones:
    t_warm = 0.0
    sampled_len = 0.0
    sampled_groups = 0
    sampled_max = 0.0

    while True:
        t, s = heap[0]
        if t >= t_other:
            # --- rare events at t_other: trainer step end, snapshot install, trainer start ---
            t = t_other
            if t_train_end <= t:
                version += 1
                busy = False
                t_train_end = inf
                if version == warm:
                    t_warm = t
                if version >= last:
                    break
                if version % I == 0:
                    if delay == 0:
                        for w in range(nw):
                            wver[w] = version
                    else:
                        installs.append((t + delay, version))
            elif installs and installs[0][0] <= t:
                v = installs.popleft()[1]
                for w in range(nw):
                    wver[w] = v
            if not busy and len(queue) >= G:
                # every group staler than the bound is discarded, then the oldest G are taken
                if smax < 1 << 62 and any(version - g[1] > smax for g in queue):
                    queue, dropped = _evict_stale(queue, version, smax, t, events if record else None)
                    dropped_stale += dropped
                if len(queue) >= G:
                    batch = [queue.popleft() for _ in range(G)]
                    if record:
                        events.append(("batch", t, version, [g[5] for g in batch]))
                    busy = True
                    t_train_end = t + T
                    trained += G
                    if version >= warm:
                        window.trained(batch, version)
            if idle and len(queue) < block:  # back-pressure lifted: idle slots start again
                slots.started = started
                for s in idle:
                    heapq.heappush(heap, slots.start(s, t))
                started = slots.started
                idle.clear()
            t_other = min(t_train_end, installs[0][0] if installs else inf)
            if t_other == inf and heap[0][1] == -1:
                raise SchedulerError("the simulated pipeline deadlocked: every slot idles and the trainer waits")
            continue

        # --- hot path: the sample in slot s finishes at t ----------------------------------
        rollouts += 1
        g = slot_group[s]
        g[0] -= 1
        if not g[0]:
            completed += 1
            g[4] = version
            if version >= warm:
                sampled_len += g[2]
                sampled_groups += 1
                if g[3] > sampled_max:  # noqa: PLR1730
                    sampled_max = g[3]
            if len(queue) >= qcap:
                dropped = queue.popleft()
                dropped_overflow += 1
                if record:
                    events.append(("drop", "overflow", dropped[5]))
            queue.append(g)
            if record:
                events.append(("done", t, g[5], g[1]))
            if not busy and len(queue) >= G:
                t_other = t  # the trainer can start now: handled as a rare event
        w = slot_w[s]
        if left[w]:  # from here on, `_Slots.start` inlined
            left[w] -= 1
            g = open_group[w]
        elif len(queue) >= block:  # back-pressure: this slot waits for the trainer
            heapq.heappop(heap)
            idle.append(s)
            continue
        else:
            g = [n, wver[w], 0.0, 0.0, 0, started]
            open_group[w] = g
            left[w] = n - 1
            started += 1
        slot_group[s] = g
        length = draw()
        g[2] += length
        if length > g[3]:  # noqa: PLR1730 (an if is cheaper than max() in the hot loop)
            g[3] = length
        heapreplace(heap, (t + length * inv_speed[w], s))

    in_flight = started - completed
    queued = len(queue)
    assert completed == trained + dropped_overflow + dropped_stale + queued, "conservation of completed groups"
    assert started == trained + dropped_overflow + dropped_stale + queued + in_flight
    assert window.groups == G * cfg.steps
    assert cfg.max_staleness is None or len(window.hist) <= cfg.max_staleness + 1, "queue-max let a stale group through"
    span = t - t_warm
    return SimResult(
        steps=cfg.steps,
        pqs=window.pqs_sum / window.groups,
        iqs=window.iqs_sum / window.groups,
        max_staleness=len(window.hist) - 1,
        histogram=tuple(window.hist),
        trainer_busy=cfg.steps * T / span if span > 0 else 1.0,
        t_eff=span / cfg.steps,
        sampled_mean_length=sampled_len / (sampled_groups * n) if sampled_groups else math.nan,
        trained_mean_length=window.length_sum / (window.groups * n),
        sampled_max_length=sampled_max,
        trained_max_length=window.max_length,
        started=started,
        trained=trained,
        dropped_overflow=dropped_overflow,
        dropped_stale=dropped_stale,
        queued=queued,
        in_flight=in_flight,
        rollouts=rollouts,
        wall_s=time.perf_counter() - t_start,
        events=tuple(events),
    )


def blog_config(
    rho: float,
    concurrency: int,
    batch: int,
    group_size: int = 16,
    queue_factor: float = 1.0,
    sigma: float = 0.6,
    *,
    max_staleness: int | None = None,
    mu0: float = 1000.0,
    cap: float = 8.0,
    speed: float = 50.0,
    steps: int = 2000,
    warmup_steps: int = 200,
    seed: int = 0,
) -> SimConfig:
    """The blog's fully-async setup: `concurrency` slots at `speed`, queue-drop with `q·G`
    groups, instant sync, and `T_train = ρ·B·μ/(C·v)` so the utilization is exactly `ρ`."""
    if batch % group_size:
        raise SchedulerError(f"batch {batch} must be a multiple of the group size {group_size}")
    groups = batch // group_size
    mean = length_mean(mu0, sigma, cap)
    return SimConfig(
        workers=(WorkerSpec(concurrency, speed),),
        group_size=group_size,
        groups_per_batch=groups,
        t_train=rho * batch * mean / (concurrency * speed),
        mu0=mu0,
        sigma=sigma,
        cap=cap,
        queue_groups=max(groups, round(queue_factor * groups)),
        max_staleness=max_staleness,
        steps=steps,
        warmup_steps=warmup_steps,
        seed=seed,
    )


def pipeline_config(
    rates: Sequence[float],
    slots: Sequence[int],
    batch: int,
    group_size: int,
    t_train: float,
    *,
    publish_every: int = 1,
    t_bcast: float = 0.0,
    queue_factor: float | None = 1.0,
    max_staleness: int | None = None,
    sigma: float = 0.6,
    mu0: float = 1000.0,
    cap: float = 8.0,
    steps: int = 1000,
    warmup_steps: int = 100,
    seed: int = 0,
    blocking_groups: int | None = None,
    record: bool = False,
) -> SimConfig:
    """ECHO-2's pipeline: heterogeneous workers given by their rollout rates (rollouts/s) and
    slot counts; each slot's speed is chosen so the worker completes exactly `rate` rollouts/s."""
    if len(rates) != len(slots) or not rates:
        raise SchedulerError("rates and slots must be non-empty and of equal length")
    if batch % group_size:
        raise SchedulerError(f"batch {batch} must be a multiple of the group size {group_size}")
    groups = batch // group_size
    mean = length_mean(mu0, sigma, cap)
    return SimConfig(
        workers=tuple(WorkerSpec(c, r * mean / c) for r, c in zip(rates, slots)),
        group_size=group_size,
        groups_per_batch=groups,
        t_train=t_train,
        mu0=mu0,
        sigma=sigma,
        cap=cap,
        queue_groups=None if queue_factor is None else max(groups, round(queue_factor * groups)),
        max_staleness=max_staleness,
        publish_every=publish_every,
        sync_delay=t_bcast,
        blocking_groups=blocking_groups,
        record=record,
        steps=steps,
        warmup_steps=warmup_steps,
        seed=seed,
    )
