"""Everything `echo-rl plan` predicts for one configuration, as plain data.

`make_plan(PlanInputs, Pool)` chains the pieces: capacity rule (`overlapped` or the paper's)
→ activation (greedy and exact), or the fleet given with `active` (machines already chosen,
counts per pool entry) → utilization, bubble and $/step of that set → staleness bound
(App. A), closed form (PQS, IQS) and the simulator in ECHO-2's pipeline mode, blocking when
the learner's back-pressure is on (as it is by default) → warnings. `echo/plan.py` parses the
command line and prints; this module only computes, so tests call it directly.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Literal

from scheduler import activation as act
from scheduler import capacity as cap
from scheduler import staleness as st
from scheduler.cost import dollars_per_step
from scheduler.errors import SchedulerError
from scheduler.pool import Pool
from scheduler.simulator import SimResult, pipeline_config, simulate


@dataclass(frozen=True, slots=True)
class PlanInputs:
    batch: int = 512  # B rollouts per update
    group_size: int = 16  # n
    max_staleness: int = 3  # S
    publish_every: int | None = None  # I; None = S − 1 (at least 1)
    t_train: float = 120.0  # s per update
    t_bcast: float = 60.0  # learner-visible broadcast time, s (reception + install)
    install_s: float = 0.0  # τ: install downtime of a worker per version, s
    rule: Literal["overlapped", "paper"] = "overlapped"  # which capacity rule R_req comes from
    active: tuple[tuple[str, int], ...] = ()  # a given fleet: (pool entry, count) pairs; () = activate
    blocking: bool = True  # the learner's back-pressure: no new prompts while the queue is full
    learner_price: float = 3.06  # $/h
    alpha: float = 1.2
    queue_factor: float = 1.0  # q
    buffer: Literal["queue-drop", "queue-max"] = "queue-drop"
    length_sigma: float = 0.6  # σ of the response-length model
    activation: Literal["greedy", "exact"] = "exact"  # which choice the predictions use
    snapshot_gb: float = 0.0  # one published version on the wire (GB): the bandwidth bill
    simulate: bool = True
    sim_steps: int = 600
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch < 1 or self.group_size < 1 or self.batch % self.group_size:
            raise SchedulerError(
                f"batch B = {self.batch} rollouts must be a positive multiple of the group size n = "
                f"{self.group_size} (B = groups per step × n)"
            )
        if self.max_staleness < 1:
            raise SchedulerError(
                f"the staleness budget S must be ≥ 1 to plan, got {self.max_staleness}: S = 0 is the synchronous "
                "baseline (generate, then train, then publish), which waits for every batch by design, so there is no "
                "overlap to size a fleet for; the learner runs it as it is (--buffer.max_staleness 0)")
        if self.publish_every is not None and self.publish_every < 1:
            raise SchedulerError(f"the publication period I must be ≥ 1, got {self.publish_every}")
        if self.queue_factor < 1:
            raise SchedulerError(f"the queue factor q must be ≥ 1, got {self.queue_factor}")
        if any(count < 0 for _, count in self.active):
            raise SchedulerError("--active counts must be ≥ 0")

    @property
    def period(self) -> int:
        return self.publish_every if self.publish_every is not None else cap.default_publish_every(self.max_staleness)


def describe(chosen: list[act.Candidate], pool: Pool) -> str:
    """'3 × rtx4080 + 1 × rtx4090' in unit-cost order."""
    counts = Counter(pool.kind_of(c.id).name for c in chosen)
    order = sorted(counts, key=lambda name: next(w.unit_cost for w in pool.workers if w.name == name))
    return " + ".join(f"{counts[name]} × {name}" for name in order) or "(none)"


def _activation_dict(a: act.Activation, pool: Pool) -> dict:
    return {
        "workers": a.ids, "summary": describe(list(a.chosen), pool), "count": len(a.chosen),
        "rate": a.capacity, "cost_per_hour": a.cost, "solve_s": a.solve_s, "optimal": a.optimal,
    }


def make_plan(inp: PlanInputs, pool: Pool) -> dict:
    """The whole prediction as a JSON-able dict. Raises `InfeasibleOverlap` or
    `InsufficientCapacity` (typed, with what to do) when there is nothing to plan."""
    I = inp.period
    B, T, Tb = inp.batch, inp.t_train, inp.t_bcast
    req, infeasible = _requirement(inp)
    traffic = bandwidth_per_version(inp, pool)  # $ per version by candidate id
    per_hour = 3600.0 / (I * T)  # versions per hour
    # Activation ranks by rent + traffic ($/GB × what each machine moves per version × versions/h).
    priced = [act.Candidate(c.id, c.rate, c.price + traffic[c.id] * per_hour) for c in pool.candidates()]
    cmp = act.compare(priced, inp.alpha * req.r_req) if req is not None else None
    if inp.active:
        used = given_fleet(pool, inp.active)
    else:
        used = cmp.exact if inp.activation == "exact" else cmp.greedy
    R = used.capacity
    rent = {c.id: c.price for c in pool.candidates()}
    workers_rent = sum(rent[c.id] for c in used.chosen)
    bandwidth = sum(traffic[c.id] for c in used.chosen)
    slots = [pool.kind_of(c.id).slots for c in used.chosen]
    concurrency = sum(slots)
    rho = R * T / B
    if inp.rule == "paper":
        wait, bub = cap.bubble(B, T, Tb, I, R)
    else:  # training goes on during the broadcast: only installs and generation can leave it waiting
        wait, bub = cap.bubble(B, T, inp.install_s, I, R)
    m_tail = st.tail_multiplier(inp.length_sigma, inp.group_size)
    closed = st.predict(rho, concurrency / B, inp.queue_factor, m_tail)
    t_eff = T + wait / I
    snapshot_lag = (I - 1) / 2 + Tb / t_eff
    out: dict = {
        "inputs": {**asdict(inp), "publish_every": I, "pool": pool.name, "pool_size": pool.size,
                   "active": dict(inp.active)},
        "capacity": _capacity_section(inp, req, infeasible),
        "activation": _activation_section(inp, cmp, used, pool),
        "pipeline": {
            "rate": R, "rho": rho, "regime": closed.regime, "concurrency": concurrency,
            "c_over_b": concurrency / B, "overlap_holds": cap.overlap_holds(B, T, Tb, I, R),
            "wait_per_period_s": wait, "bubble": bub, "t_eff_s": t_eff,
        },
        "staleness": {
            "bound": cap.staleness_bound(B, T, Tb, I, R),
            "bound_under_overlap": cap.staleness_bound_under_overlap(T, Tb, I), "budget": inp.max_staleness,
            "closed_form": {**closed.as_dict(), "note": "blog closed form: publication every step, instant sync"},
            "snapshot_lag": snapshot_lag,
            "closed_form_with_lag": closed.total + snapshot_lag,
        },
        "cost": {
            "learner_per_hour": inp.learner_price, "workers_per_hour": workers_rent,
            "bandwidth_per_version": bandwidth, "bandwidth_per_hour": bandwidth * 3600.0 / (I * t_eff),
            "dollars_per_hour": inp.learner_price + workers_rent + bandwidth * 3600.0 / (I * t_eff),
            "dollars_per_step": dollars_per_step(T, wait, I, inp.learner_price, [rent[c.id] for c in used.chosen],
                                                 bandwidth_per_version=bandwidth),
        },
    }
    sim = _simulate_fleet(inp, [c.rate for c in used.chosen], slots) if inp.simulate else None
    if sim is not None:
        out["staleness"]["simulator"] = sim.as_dict()
    out["warnings"] = warnings(inp, out, sim)
    return out


def _requirement(inp: PlanInputs) -> tuple[cap.Requirement | None, str]:
    """R_req by the chosen rule, or (None, why) when it is infeasible but a given fleet is
    still predicted (how bad is it?); infeasible with nothing given raises."""
    try:
        return cap.requirement(inp.rule, batch=inp.batch, t_train=inp.t_train, t_bcast=inp.t_bcast,
                               publish_every=inp.period, max_staleness=inp.max_staleness,
                               install_s=inp.install_s), ""
    except cap.InfeasibleOverlap as e:
        if not inp.active:
            raise
        return None, str(e)


def _capacity_section(inp: PlanInputs, req: cap.Requirement | None, infeasible: str) -> dict:
    return {"rule": inp.rule, "r_req": req.r_req if req else None,
            "target": inp.alpha * req.r_req if req else None, "alpha": inp.alpha,
            "conditions": req.conditions if req else {}, "binding": req.binding if req else None,
            "infeasible": infeasible}


def _activation_section(inp: PlanInputs, cmp: act.Comparison | None, used: act.Activation, pool: Pool) -> dict:
    return {
        "greedy": _activation_dict(cmp.greedy, pool) if cmp else None,
        "exact": _activation_dict(cmp.exact, pool) if cmp else None,
        "gap_per_hour": cmp.gap if cmp else None, "gap_rel": cmp.gap_rel if cmp else None,
        "used": "given" if inp.active else inp.activation,
        "given": _activation_dict(used, pool) if inp.active else None,
    }


def _simulate_fleet(inp: PlanInputs, rates: list[float], slots: list[int]) -> SimResult:
    """The simulator on this fleet: ECHO-2's pipeline with the plan's I, T_bcast, buffer and,
    unless `blocking` is off, the learner's back-pressure."""
    groups = inp.batch // inp.group_size
    return simulate(pipeline_config(
        rates, slots, inp.batch, inp.group_size, inp.t_train,
        publish_every=inp.period, t_bcast=inp.t_bcast,
        queue_factor=inp.queue_factor if inp.buffer == "queue-drop" else None,
        max_staleness=inp.max_staleness, sigma=inp.length_sigma,
        steps=inp.sim_steps, warmup_steps=max(10, inp.sim_steps // 10), seed=inp.seed,
        blocking_groups=max(groups, round(inp.queue_factor * inp.batch / inp.group_size)) if inp.blocking else None,
    ))


def bandwidth_per_version(inp: PlanInputs, pool: Pool) -> dict[str, float]:
    """$ each candidate's traffic costs per published version: it downloads the snapshot and,
    as a relay in a chain, uploads it once (the planner's chains; a leaf uploads nothing, so
    this errs dear by one upload)."""
    return {c.id: inp.snapshot_gb * (pool.kind_of(c.id).dollars_per_gb_down + pool.kind_of(c.id).dollars_per_gb_up)
            for c in pool.candidates()}


def given_fleet(pool: Pool, counts: tuple[tuple[str, int], ...]) -> act.Activation:
    """The first `count` machines of each named pool entry, as an activation of them."""
    by_kind: dict[str, list[act.Candidate]] = {}
    for c in pool.candidates():
        by_kind.setdefault(pool.kind_of(c.id).name, []).append(c)
    chosen: list[act.Candidate] = []
    for name, count in counts:
        if name not in by_kind:
            raise SchedulerError(f"--active names {name!r}, which is not in pool {pool.name!r} "
                                 f"(entries: {', '.join(by_kind)})")
        if count > len(by_kind[name]):
            raise SchedulerError(f"--active asks for {count} × {name} but pool {pool.name!r} has {len(by_kind[name])}")
        chosen += by_kind[name][:count]
    if not chosen:
        raise SchedulerError("--active chose no machine; give at least one NAME=COUNT with COUNT ≥ 1")
    rate = sum(c.rate for c in chosen)
    return act.Activation("greedy", tuple(chosen), target=rate)


def warnings(inp: PlanInputs, plan: dict, sim) -> list[str]:
    """What the user should know before launching this configuration."""
    msgs: list[str] = []
    I, S = plan["inputs"]["publish_every"], inp.max_staleness
    stale = plan["staleness"]
    if stale["bound"] > S:
        msgs.append(
            f"worst-case staleness bound {stale['bound']} exceeds the budget S = {S}: rollouts older than S "
            f"will be discarded and the learner may wait; lower I (now {I}), speed up the broadcast, or raise S"
        )
    if inp.t_bcast > inp.t_train:
        msgs.append(
            f"T_bcast = {inp.t_bcast:g} s exceeds T_train = {inp.t_train:g} s, so the corollary s_max ≤ I + 1 "
            "does not apply and I = S − 1 no longer guarantees s_max ≤ S"
        )
    rho, q = plan["pipeline"]["rho"], inp.queue_factor
    if rho > 1 and inp.learner_price > 0:
        # Blog's fixed-budget frontier in dollars: r = rollout $/h at balance / learner $/h.
        r = plan["cost"]["workers_per_hour"] / rho / inp.learner_price
        if r >= st.r_star(q):
            rho_rb = st.matching_rollout_bound_rho(rho, r)
            gap = st.iqs(rho, q) - st.iqs(rho_rb, q)
            if gap > 0:
                msgs.append(
                    f"train-bound (ρ = {rho:.2f} > 1) with rollouts not cheap relative to the learner "
                    f"(r = rollout $/h at balance ÷ learner $/h = {r:.2f} ≥ r*(q={q:g}) = {st.r_star(q):.3f}): "
                    f"a rollout-bound split with the same step time (ρ' = {rho_rb:.2f}) would be {gap:.2f} "
                    "steps less stale; fewer workers or a smaller α moves toward it (the learner then waits)"
                )
    if sim is not None and sim.max_staleness > stale["bound"]:
        msgs.append(
            f"the simulated max staleness {sim.max_staleness} exceeds the App. A bound {stale['bound']}: the "
            "bound assumes rollouts appear at rate R as soon as a snapshot lands and ignores generation "
            f"latency (groups take ~{stale['closed_form']['pqs']:.2f} train steps to generate here)"
        )
    pipe = plan["pipeline"]
    if sim is not None and sim.bubble > pipe["bubble"] + 0.05:
        # The headline's wait is the capacity rule's, which counts rates only: a user sized a fleet
        # by its "bubble 0.0%" above the simulator's 41.9% (a new user, 2026-12-07).
        latency = pipe["concurrency"] / pipe["rate"]  # Little's law: slots busy ÷ rollouts/s
        group = st.tail_multiplier(inp.length_sigma, inp.group_size) * latency
        msgs.append(
            f"the simulator's bubble is {sim.bubble:.1%} where the capacity rule's is {pipe['bubble']:.1%}: the rule "
            f"counts rates, the simulator also each rollout's time on its slot (~{latency:.0f} s here, and a group "
            f"waits for its longest of {inp.group_size}: ~{group:.0f} s, {group / inp.t_train:.1f} train steps) and "
            f"drops what arrives staler than S = {S}. Plan by the simulator's figures: more capacity does not "
            f"shorten a rollout; a larger S published every update does (try -S {math.ceil(group / inp.t_train) + 3} "
            "-I 1), as do faster GPUs per slot or shorter responses"
        )
    if plan["capacity"]["infeasible"]:
        msgs.append(plan["capacity"]["infeasible"])
    if plan["pipeline"]["bubble"] > 0:
        msgs.append(f"the capacity rule fails for these workers: predicted bubble {plan['pipeline']['bubble']:.1%}")
    r_req = plan["capacity"]["r_req"]
    if inp.active and r_req and plan["pipeline"]["rate"] < r_req:
        msgs.append(f"the given fleet supplies {plan['pipeline']['rate']:.3g} rollouts/s, below R_req = {r_req:.3g}")
    return msgs


# --- sweeps (data for `echo-rl plan sweep`) ----------------------------------------------------

def frontier(r: float, c_over_b: float, m_tail: float, q: float, rhos: list[float]) -> list[dict]:
    """Staleness vs step time under a fixed GPU budget (`r = θ_T/θ_R`), one point per ρ.

    Concurrency scales with the rollout share, so `PQS = PQS(1)/T_eff ratio` (`c_over_b` is
    C/B at ρ = 1): the PQS is the same at equal step times, as in the blog's appendix."""
    out = []
    for rho in rhos:
        ratio = st.t_eff_ratio(rho, r)
        p = m_tail * c_over_b / ratio
        out.append({"rho": rho, "t_eff_ratio": ratio, "pqs": p, "iqs": st.iqs(rho, q), "total": p + st.iqs(rho, q)})
    return out


def bubble_by_pool_size(pool: Pool, batch: int, t_train: float, t_bcast: float, period: int) -> list[dict]:
    """Overlap-model bubble as the cheapest-first pool grows one machine at a time."""
    order = act.unit_cost_order(pool.candidates())
    out, rate, price = [], 0.0, 0.0
    for k, c in enumerate(order, start=1):
        rate += c.rate
        price += c.price
        wait, bub = cap.bubble(batch, t_train, t_bcast, period, rate)
        out.append({"workers": k, "rate": rate, "cost_per_hour": price, "wait_per_period_s": wait, "bubble": bub})
    return out


def smallest_pool_without_bubble(rows: list[dict]) -> int | None:
    return next((r["workers"] for r in rows if r["bubble"] <= 0), None)
