"""`echo-rl plan`: predict capacity, cost and staleness of a configuration before renting.

    echo-rl plan [--config learner.toml] [--pool configs/pools/consumer-gpus.toml] [flags] [--json]
    echo-rl plan staleness --concurrency 64 --batch 128 --queue-factor 1 --utilization 0.8 \\
        --tailness-multiplier 1.5 [--simulate]
    echo-rl plan sweep --out DIR

The main form prints R_req (by the `overlapped` rule, or `--rule paper`), the workers greedy
and exact activation choose and their cost — or, with `--active rtx4090=3,rtx3090=2`, predicts
the fleet you already chose — the worst-case staleness bound, mean staleness by closed form
(PQS and IQS) and by the simulator (ECHO-2 pipeline: publication every I steps, broadcast
delay, the learner's blocking back-pressure), utilization ρ, the predicted bubble, $/step,
and warnings. Values come from, in increasing priority: built-in defaults (a large run: B = 512,
S = 3, q = 1, T_train = 120 s), the `--config` TOML, command-line flags. Keys read from
`--config` (all optional; one it leaves out is echo-learner's default, as the learner would run
the file):

    [trainer]   batch_prompts          groups per step G (B = G · group_size)
    [rollout]   group_size             n
    [buffer]    max_staleness          S
                queue_factor           q
                type                   "queue-drop" | "queue-max"
                backpressure           blocking queue (default true)
    [publish]   every                  I (default S − 1, at least 1)
    [scheduler] pool, alpha, activation, learner_price_per_hour, t_train_s, t_bcast_s,
                length_sigma, ...      (scheduler.config.SchedulerSection; unknown keys are errors)

Other tables and keys of a learner config are ignored, so the learner's file can be passed as is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from echo.config import ConfigError, read_toml
from scheduler import capacity as cap
from scheduler import staleness as st
from scheduler.activation import unit_cost_order
from scheduler.config import SchedulerSection
from scheduler.cost import dollars_per_step
from scheduler.errors import InfeasibleOverlap, SchedulerError
from scheduler.planner import PlanInputs, bubble_by_pool_size, frontier, make_plan
from scheduler.pool import Pool, load_pool
from scheduler.simulator import blog_config, pipeline_config, simulate

REPO = Path(__file__).resolve().parent.parent
DEFAULT_POOL = Path("configs/pools/consumer-gpus.toml")


def _bounded(kind=float, low: float = 0.0, above: bool = True, high: float = float("inf")):
    """An argparse type: a finite number above `low` (at or above it when `above` is False) and
    at most `high`; argparse names the flag and exits 2 on anything else."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < low or (above and value == low) or value > high:
            bound = f"{'>' if above else '≥'} {low:g}" + (f" and ≤ {high:g}" if math.isfinite(high) else "")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


POSITIVE, NON_NEGATIVE, COUNT = _bounded(), _bounded(above=False), _bounded(int, 1, above=False)


def cli(argv: list[str]) -> int:
    """Entry point of `echo-rl plan`; returns the exit code (2 for an impossible configuration)."""
    if argv and argv[0] == "staleness":
        return _staleness_cli(argv[1:])
    if argv and argv[0] == "sweep":
        return _sweep_cli(argv[1:])
    return _plan_cli(argv)


# --- shared helpers ---------------------------------------------------------------------------

def _resolve(path: str | Path, base: Path | None = None) -> Path:
    """A path as given if it exists; else relative to `base` (a config's folder) or the repo."""
    path = Path(path)
    if path.is_absolute() or path.exists():
        return path
    for root in (base, REPO):
        if root is not None and (root / path).exists():
            return root / path
    return path


def _fail(message: str, as_json: bool, **extra: Any) -> int:
    if as_json:
        print(json.dumps({"error": message, **extra}, indent=2, ensure_ascii=False))
    else:
        print(f"echo-rl plan: {message}", file=sys.stderr)
    return 2


def _int_key(data: dict, table: str, key: str, source: str) -> int | None:
    value = data.get(table, {}).get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"[{table}] {key} = {value!r} in {source}: expected a non-negative integer")
    return value


# What echo-learner runs where its config leaves a key out (learner.config; a unit test holds
# the two together): a learner config given to plan is planned as the learner would run it, not
# with plan's own defaults, which describe a large run (B = 512, S = 3, q = 1).
LEARNER_DEFAULTS = {("trainer", "batch_prompts"): 8, ("rollout", "group_size"): 8, ("buffer", "max_staleness"): 2,
                    ("buffer", "queue_factor"): 2.0, ("buffer", "type"): "queue-drop", ("buffer", "backpressure"): True}


def _from_config(path: str) -> tuple[dict[str, Any], Path | None]:
    """Plan inputs from a learner-style TOML (see the module docstring for the keys); a key it
    leaves out is the learner's default."""
    data = read_toml(path)
    for table in ("trainer", "rollout", "buffer", "publish", "scheduler"):
        if not isinstance(data.setdefault(table, {}), dict):
            raise ConfigError(f"{table} = {data[table]!r} in {path}: [{table}] must be a table (a [{table}] header "
                              "followed by its keys)")
    for (table, key), value in LEARNER_DEFAULTS.items():
        data[table].setdefault(key, value)
    values: dict[str, Any] = {}
    n = _int_key(data, "rollout", "group_size", path)
    values["group_size"] = n
    values["batch"] = _int_key(data, "trainer", "batch_prompts", path) * n
    values["max_staleness"] = _int_key(data, "buffer", "max_staleness", path)
    if (i := _int_key(data, "publish", "every", path)) is not None:
        values["publish_every"] = i
    buffer = data["buffer"]
    q = buffer["queue_factor"]
    if isinstance(q, bool) or not isinstance(q, (int, float)) or q < 1:
        raise ConfigError(f"[buffer] queue_factor = {q!r} in {path}: expected a number ≥ 1 (q: queue-drop capacity in batches)")
    if buffer["type"] not in ("queue-drop", "queue-max"):
        raise ConfigError(f"[buffer] type = {buffer['type']!r} in {path}: expected \"queue-drop\" or \"queue-max\"")
    if not isinstance(buffer["backpressure"], bool):
        raise ConfigError(f"[buffer] backpressure = {buffer['backpressure']!r} in {path}: expected true or false")
    values["queue_factor"] = float(q)
    values["buffer"] = buffer["type"]
    values["blocking"] = buffer["backpressure"]
    try:
        sched = SchedulerSection.model_validate(data["scheduler"])
    except ValidationError as e:
        bad = "; ".join(f"[scheduler] {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"{path}: {bad}") from None
    values.update(
        alpha=sched.alpha, activation=sched.activation, learner_price=sched.learner_price_per_hour,
        t_train=sched.t_train_s, t_bcast=sched.t_bcast_s, length_sigma=sched.length_sigma,
        rule=sched.rule, install_s=sched.install_s, snapshot_gb=sched.snapshot_gb,
    )
    pool = _resolve(sched.pool, Path(path).parent) if sched.pool else None
    return values, pool


def _fmt_rate(x: float) -> str:
    return f"{x:.3g}"


# --- echo-rl plan -----------------------------------------------------------------------------

def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="echo-rl plan",
        description="Predict capacity (R_req), activation, cost and staleness of a configuration. "
        "Subcommands: 'echo-rl plan staleness --help' (closed form for one operating point), "
        "'echo-rl plan sweep --help' (PNG plots).",
        epilog="Flags override --config, which overrides the defaults shown.",
    )
    p.add_argument("--config", help="learner TOML to read [trainer]/[rollout]/[buffer]/[publish]/[scheduler] from")
    p.add_argument("--pool", help=f"pool file of candidate workers (default {DEFAULT_POOL})")
    p.add_argument("--batch", type=COUNT, help="B: rollouts per learner update (default 512)")
    p.add_argument("--group-size", type=COUNT, help="n: samples per prompt (default 16)")
    p.add_argument("-S", "--max-staleness", type=int, help="S: staleness budget in updates (default: --config's, echo-learner's 2 where it has none; without --config 3)")
    p.add_argument("-I", "--publish-every", type=int, help="I: publish a snapshot every I updates (default S − 1)")
    p.add_argument("--t-train", type=POSITIVE, help="T_train: seconds per update (default 120)")
    p.add_argument("--t-bcast", type=NON_NEGATIVE, help="T_bcast: learner-visible broadcast seconds (default 60)")
    p.add_argument("--version-mb", type=POSITIVE,
                   help="bytes of one version in MB (a LoRA run's adapter, or the full weights): T_bcast is then "
                        "predicted from it over the pool's links (see predict_t_bcast) unless --t-bcast is given")
    p.add_argument("--uplink-mbit", type=POSITIVE, default=1000.0,
                   help="the learner's upload (Mbit/s), with --version-mb (default 1000)")
    p.add_argument("--install-s", type=NON_NEGATIVE, help="τ: seconds a worker's engine is down installing a version (default 0)")
    p.add_argument("--rule", choices=["overlapped", "paper"],
                   help="capacity rule: 'overlapped' (training continues during the broadcast; default) or 'paper'")
    p.add_argument("--active", metavar="NAME=COUNT,...",
                   help="predict this fleet instead of choosing one: counts per pool entry, e.g. rtx4090=3,rtx3090=2")
    p.add_argument("--non-blocking", action="store_true",
                   help="simulate slots that never wait (the blog's model); default: the learner's back-pressure")
    p.add_argument("--learner-price", type=NON_NEGATIVE, help="learner node $/h (default 3.06)")
    p.add_argument("--snapshot-gb", type=NON_NEGATIVE,
                   help="GB of one published version on the wire, for the bandwidth bill (default 0: none)")
    p.add_argument("--offers", choices=["vast"],
                   help="price the live market instead of a pool file: search its offers (needs [scheduler.provider] "
                        "gpus, or --gpus) and plan over them")
    p.add_argument("--gpus", metavar="NAME=RATE,...",
                   help="with --offers: GPU model = expected rollouts/s of one, e.g. 'RTX 4090=3.0,RTX 3090=1.8'")
    p.add_argument("--vast-url", help="with --offers vast: the API server (default the SDK's; a test server)")
    p.add_argument("--query", help="with --offers vast: search filters (default [scheduler.provider] query)")
    p.add_argument("--alpha", type=_bounded(low=1.0, above=False, high=10.0), help="safety factor α: activation covers α·R_req (default 1.2)")
    p.add_argument("--queue-factor", type=POSITIVE, help="q: queue-drop capacity in batches (default: --config's, echo-learner's 2 where it has none; without --config 1)")
    p.add_argument("--buffer", choices=["queue-drop", "queue-max"], help="buffer policy (default queue-drop)")
    p.add_argument("--length-sigma", type=NON_NEGATIVE, help="σ of the lognormal response-length model (default 0.6)")
    p.add_argument("--activation", choices=["greedy", "exact"], help="which choice the predictions use (default exact)")
    p.add_argument("--sim-steps", type=COUNT, help="simulated learner updates (default 600)")
    p.add_argument("--no-simulate", action="store_true", help="skip the simulator")
    p.add_argument("--seed", type=int, help="simulator seed (default 0)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


_FLAG_TO_INPUT = {
    "batch": "batch", "group_size": "group_size", "max_staleness": "max_staleness",
    "publish_every": "publish_every", "t_train": "t_train", "t_bcast": "t_bcast",
    "learner_price": "learner_price", "alpha": "alpha", "queue_factor": "queue_factor",
    "buffer": "buffer", "length_sigma": "length_sigma", "activation": "activation",
    "sim_steps": "sim_steps", "seed": "seed", "install_s": "install_s", "rule": "rule",
    "snapshot_gb": "snapshot_gb",
}


def predict_t_bcast(version_bytes: float, pool: Pool, uplink_mbit: float = 1000.0) -> float:
    """T_bcast of one version for the capacity rule: a pipelined chain delivers at its slowest hop,
    so every worker has the version after about bytes / min(learner uplink, slowest worker
    download, slowest relaying upload). Deltas and the planner's stripes only make it faster;
    `broadcast.planner` refines it at run time from measured links. A LoRA version is the
    adapter (`echo.lora`): its bytes, not the model's, go in here."""
    down = min(w.download_mbps for w in pool.workers)
    up = min(w.upload_mbps for w in pool.workers)
    return 8 * version_bytes / (min(uplink_mbit, down, up) * 1e6)


def _parse_active(text: str) -> tuple[tuple[str, int], ...]:
    pairs = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, count = item.partition("=")
        if not eq or not count.strip().isdigit():
            raise ConfigError(f"--active {text!r}: expected NAME=COUNT pairs separated by commas, e.g. rtx4090=3")
        pairs.append((name.strip(), int(count)))
    return tuple(pairs)


def _plan_cli(argv: list[str]) -> int:
    args = _plan_parser().parse_args(argv)
    values: dict[str, Any] = {}
    pool_path: Path | None = None
    provider: dict = {}
    try:
        if args.config:
            values, pool_path = _from_config(args.config)
            provider = read_toml(args.config).get("scheduler", {}).get("provider", {})
            provider = provider if isinstance(provider, dict) else {}
        for flag, key in _FLAG_TO_INPUT.items():
            if getattr(args, flag) is not None:
                values[key] = getattr(args, flag)
        if args.version_mb is not None and args.t_bcast is None:
            pool_for_links = load_pool(_resolve(args.pool) if args.pool else pool_path or _resolve(DEFAULT_POOL))
            values["t_bcast"] = predict_t_bcast(args.version_mb * 1e6, pool_for_links, args.uplink_mbit)
            if not args.json:
                print(f"version {args.version_mb:,.1f} MB: T_bcast ≈ {values['t_bcast']:.2f} s over "
                      f"{pool_for_links.name} (pipelined chains at the slowest hop, before deltas)")
        if args.no_simulate:
            values["simulate"] = False
        if args.non_blocking:
            values["blocking"] = False
        if args.active:
            values["active"] = _parse_active(args.active)
        pool_path = _resolve(args.pool) if args.pool else pool_path or _resolve(DEFAULT_POOL)
        inputs = PlanInputs(**values)
        offers = None
        if args.offers:
            pool, offers = market_pool(args, provider)
            pool_path = f"live {args.offers} offers"
        else:
            pool = load_pool(pool_path)
        plan = make_plan(inputs, pool)
        if offers is not None:
            plan["offers"] = offers_section(plan, offers)
    except InfeasibleOverlap as e:
        return _fail(str(e), args.json, condition=e.condition, smallest_feasible_period=e.smallest_feasible_period,
                     largest_feasible_period=e.largest_feasible_period,
                     smallest_feasible_staleness=e.smallest_feasible_staleness)
    except (SchedulerError, ConfigError) as e:
        return _fail(str(e), args.json)
    except ImportError as e:
        return _fail(str(e), args.json)
    plan["inputs"]["pool_file"] = str(pool_path)
    out = render_plan(plan)
    if "offers" in plan and not args.json:
        out = render_offers(plan["offers"]) + "\n\n" + out
    print(json.dumps(plan, indent=2, ensure_ascii=False) if args.json else out)
    return 0


def _parse_gpus(text: str) -> dict[str, float]:
    gpus = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, rate = item.partition("=")
        try:
            gpus[name.strip()] = float(rate)
        except ValueError:
            raise ConfigError(f"--gpus {text!r}: expected NAME=RATE pairs, e.g. 'RTX 4090=3.0'") from None
    return gpus


def market_pool(args: argparse.Namespace, provider: dict) -> tuple[Pool, list[dict]]:
    """The live market as a pool: one entry per offer (its $/h, links and $/GB; the rate of
    its GPU from `gpus`). Returns the pool and the offers considered."""
    from scheduler.market import offer_machine
    from scheduler.pool import parse_pool
    from scheduler.vast import VastMarket

    gpus = _parse_gpus(args.gpus) if args.gpus else dict(provider.get("gpus") or {})
    if not gpus:
        raise ConfigError("--offers needs the GPUs to consider and their expected rollouts/s: --gpus "
                          "'RTX 4090=3.0,RTX 3090=1.8' or [scheduler.provider] gpus in --config")
    market = VastMarket(gpus=gpus, query=args.query if args.query is not None else
                        provider.get("query", "reliability>0.98 num_gpus=1 inet_down>=200 verified=true"),
                        image="", interruptible=bool(provider.get("interruptible", False)),
                        api_url=args.vast_url or provider.get("api_url", ""),
                        api_key=os.environ.get(provider.get("api_key_env", "VAST_API_KEY")))
    offers = market.search()
    workers, rows = [], []
    for o in offers:
        m = offer_machine(market.name, o, gpus)
        if m.rollouts_per_s <= 0:
            continue
        rows.append({**o.row(), "machine": m.id, "rollouts_per_s": m.rollouts_per_s})
        workers.append({"name": m.id, "gpu": o.gpu, "price_per_hour": o.price_per_hour,
                        "rollouts_per_s": m.rollouts_per_s, "download_mbps": max(o.down_mbps, 1.0),
                        "upload_mbps": max(o.up_mbps, 1.0), "dollars_per_gb_down": o.dollars_per_gb_down,
                        "dollars_per_gb_up": o.dollars_per_gb_up})
    if not workers:
        raise ConfigError(f"the market offers no machine with the GPUs asked for ({', '.join(gpus)})")
    return parse_pool({"name": f"{market.name}-offers", "description": market.query, "workers": workers}), rows


def offers_section(plan: dict, offers: list[dict]) -> dict:
    chosen = plan["activation"][plan["activation"]["used"]]["workers"]
    return {"considered": offers, "chosen": sorted(chosen)}


def render_offers(section: dict) -> str:
    lines = [f"offers     {len(section['considered'])} considered (* chosen)",
             f"  {'':2}{'machine':<16}{'gpu':<12}{'$/h':>7}{'r/s':>7}{'down':>7}{'up':>7}{'$/GB↓':>7}{'$/GB↑':>7}"
             f"{'rel':>7}  location"]
    for o in section["considered"]:
        mark = "*" if o["machine"] in section["chosen"] else " "
        lines.append(f"  {mark} {o['machine']:<16}{o['gpu']:<12}{o['price_per_hour']:>7.3f}{o['rollouts_per_s']:>7.2f}"
                     f"{o['down_mbps']:>7.0f}{o['up_mbps']:>7.0f}{o['dollars_per_gb_down']:>7.3f}"
                     f"{o['dollars_per_gb_up']:>7.3f}{o['reliability']:>7.3f}  {o['location']}")
    return "\n".join(lines)


def render_plan(plan: dict) -> str:
    inp, capd, actd = plan["inputs"], plan["capacity"], plan["activation"]
    pipe, stale, cost = plan["pipeline"], plan["staleness"], plan["cost"]
    B, n, I, S = inp["batch"], inp["group_size"], inp["publish_every"], inp["max_staleness"]
    cf = stale["closed_form"]
    lines = [
        f"echo-rl plan: pool {inp['pool']} ({inp['pool_size']} machines), learner ${inp['learner_price']:.2f}/h",
        (f"  B = {B} rollouts/update ({B // n} groups × {n}), T_train = {inp['t_train']:g} s, "
         f"T_bcast = {inp['t_bcast']:g} s, I = {I}, S = {S}, α = {inp['alpha']:g}, q = {inp['queue_factor']:g} "
         f"({inp['buffer']}), length σ = {inp['length_sigma']:g} (M_tail = {cf['m_tail']:.2f})"),
        "",
        _capacity_line(capd, inp),
        "",
    ]
    shown = [m for m in ("greedy", "exact", "given") if actd.get(m)]
    width = max(9, *(len(actd[m]["summary"]) + 2 for m in shown))
    lines.append(f"  {'activation':<12}{'workers':<{width}}{'rollouts/s':>11}{'$/h':>8}{'solve':>10}")
    for name in shown:
        a = actd[name]
        mark = " ← used" if actd["used"] == name else ""
        opt = "" if a["optimal"] else " (time limit)"
        lines.append(f"  {name:<12}{a['summary']:<{width}}{a['rate']:>11.3f}{a['cost_per_hour']:>8.3f}"
                     f"{a['solve_s'] * 1e3:>8.1f}ms{opt}{mark}")
    if actd["gap_per_hour"] is not None:
        lines.append(f"  gap: greedy costs ${actd['gap_per_hour']:.3f}/h ({actd['gap_rel']:.1%}) more than the exact optimum")
    lines += [
        "",
        (f"pipeline   R = {pipe['rate']:.3f} rollouts/s, ρ = R·T/B = {pipe['rho']:.2f} ({pipe['regime']}), "
         f"C = {pipe['concurrency']} slots (C/B = {pipe['c_over_b']:.2f})"),
        (f"           paper's overlap I·B/R + T_b ≤ I·T: {'holds' if pipe['overlap_holds'] else 'fails'}; predicted "
         f"wait ({capd['rule']} rule, rates alone) {pipe['wait_per_period_s']:.3g} s per period, bubble {pipe['bubble']:.1%}"
         + (" (the simulator's, with each rollout's time: below)" if stale.get("simulator") else "")),
        (f"cost       ${cost['dollars_per_step']:.4f}/step = (T + wait/I)·${cost['learner_per_hour'] + cost['workers_per_hour']:.3f}/h / 3600 "
         f"(learner {cost['learner_per_hour']:.2f} + workers {cost['workers_per_hour']:.3f})"
         + (f" + bandwidth ${cost['bandwidth_per_version']:.4f}/version / I"
            f" (${cost['bandwidth_per_hour']:.3f}/h at {inp['snapshot_gb']:g} GB a version)" if inp["snapshot_gb"] else
            "; bandwidth not counted: give a version's size on the wire (--snapshot-gb, [scheduler] snapshot_gb)")),
        "",
        (f"staleness  worst case s_max ≤ I − 1 + ⌈(T_b + B/R)/T⌉ = {stale['bound']} "
         f"(under overlap: I + ⌈(1 − 1/I)·T_b/T⌉ = {stale['bound_under_overlap']}; budget S = {S}; "
         "ECHO-2 App. A: a group trained as soon as it is generated, no queue)"),
        f"  {'mean staleness':<34}{'PQS':>7}{'IQS':>7}{'total':>7}{'max':>5}",
        f"  {'closed form (I = 1, instant sync)':<34}{cf['pqs']:>7.2f}{cf['iqs']:>7.2f}{cf['total']:>7.2f}",
        (f"  {'  + snapshot lag (I−1)/2 + T_b/T_eff':<34}{'':>14}{stale['closed_form_with_lag']:>7.2f}"
         f"   (lag ≈ {stale['snapshot_lag']:.2f}, an approximation"
         # It adds the lag to every group and drops none; the learner trains nothing staler than S.
         + (f" with no staleness filter: above S = {S}, groups that stale are dropped, see the simulator)"
            if stale['closed_form_with_lag'] > S else ")")),
    ]
    if cf["total"] > stale["bound"]:
        lines.append(f"  (the mean is above the worst case because the two models differ: the mean's keeps C = "
                     f"{pipe['concurrency']} slots busy and queues what training cannot take yet (IQS), App. A's "
                     "bound counts no queue; the learner's lease window and staleness filter keep what it trains "
                     f"within S = {S})")
    sim = stale.get("simulator")
    if sim:
        lines += [
            (f"  {'simulator (I, T_bcast, S applied)':<34}{sim['pqs']:>7.2f}{sim['iqs']:>7.2f}{sim['total']:>7.2f}"
             f"{sim['max_staleness']:>5}   ({'blocking back-pressure, as the learner' if inp['blocking'] else 'slots never wait'})"),
            (f"  simulator: bubble {sim['bubble']:.1%}, dropped {sim['dropped_overflow']} overflow + "
             f"{sim['dropped_stale']} stale of {sim['started']} groups, mean length sampled "
             f"{sim['sampled_mean_length']:.0f} / trained {sim['trained_mean_length']:.0f} tokens "
             "(the model's own lengths, mean 1000 at σ: staleness is in steps and does not depend on them; "
             f"{sim['steps']} steps simulated at {sim['rollouts_per_s'] / 1e6:.2f} M rollouts/s)"),
        ]
    if plan["warnings"]:
        lines.append("")
        lines += [f"warning: {w}" for w in plan["warnings"]]
    return "\n".join(lines)


def _capacity_line(capd: dict, inp: dict) -> str:
    if capd["r_req"] is None:
        return f"capacity   infeasible ({capd['rule']} rule): {capd['infeasible']}"
    if capd["rule"] == "paper":
        formula = "I·B/(I·T − T_b)"
    else:
        c = capd["conditions"]
        formula = (f"max(I·B/(I·T − τ) = {c['throughput']:.3f}, B/((S − I + 1)·T − T_b) = {c['admissibility']:.3f}),"
                   f" {capd['binding']} binds; τ = {inp['install_s']:g} s")
    return (f"capacity   R_req = {formula} = {capd['r_req']:.3f} rollouts/s ({capd['rule']} rule); "
            f"target α·R_req = {capd['target']:.3f}")


# --- echo-rl plan staleness -------------------------------------------------------------------

def _staleness_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="echo-rl plan staleness",
        description="Mean staleness of fully async RL with a queue-drop buffer (closed form: "
        "PQS = M_tail·(C/B)·min(1, 1/ρ); IQS = ρ if ρ ≤ 1 else (2q − 1)/(2ρ) + 1/2).",
    )
    p.add_argument("--concurrency", type=int, default=64, help="C: concurrent generation slots (default 64)")
    p.add_argument("--batch", type=int, default=128, help="B: rollouts per update (default 128)")
    p.add_argument("--queue-factor", type=float, default=1.0, help="q = Q/B (default 1)")
    p.add_argument("--utilization", type=float, default=0.8, help="ρ = Θ_R/Θ_T (default 0.8)")
    tail = p.add_mutually_exclusive_group()
    tail.add_argument("--tailness-multiplier", type=float, help="M_tail = E[max of a group]/E[length] (default: from --sigma)")
    tail.add_argument("--sigma", type=float, help="lognormal σ of lengths (default 0.6 when M_tail is not given)")
    p.add_argument("--group-size", type=int, default=16, help="n: samples per group (for M_tail from σ and the simulator; default 16)")
    p.add_argument("--simulate", action="store_true", help="also run the event-driven simulator")
    p.add_argument("--steps", type=int, default=2000, help="simulated updates (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="simulator seed")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def _staleness_cli(argv: list[str]) -> int:
    args = _staleness_parser().parse_args(argv)
    try:
        if args.tailness_multiplier is not None:
            m_tail = args.tailness_multiplier
            sigma = st.sigma_for_tail_multiplier(m_tail, args.group_size) if args.simulate else None
        else:
            sigma = 0.6 if args.sigma is None else args.sigma
            m_tail = st.tail_multiplier(sigma, args.group_size)
        pred = st.predict(args.utilization, args.concurrency / args.batch, args.queue_factor, m_tail)
        out: dict[str, Any] = {"closed_form": pred.as_dict(), "sigma": sigma, "group_size": args.group_size}
        if args.simulate:
            sim = simulate(blog_config(args.utilization, args.concurrency, args.batch, args.group_size,
                                       args.queue_factor, sigma, steps=args.steps,
                                       warmup_steps=max(20, args.steps // 10), seed=args.seed))
            out["simulator"] = sim.as_dict()
    except SchedulerError as e:
        return _fail(str(e), args.json)
    if args.json:
        print(json.dumps(out, indent=2, ensure_ascii=False))
        return 0
    print(f"ρ = {pred.rho:g} ({pred.regime}), C/B = {pred.c_over_b:g}, q = {pred.q:g}, M_tail = {pred.m_tail:.3f}"
          + (f" (σ = {sigma:.3f}, n = {args.group_size})" if sigma is not None else ""))
    print(f"  {'':<12}{'PQS':>7}{'IQS':>7}{'total':>7}")
    print(f"  {'closed form':<12}{pred.pqs:>7.3f}{pred.iqs:>7.3f}{pred.total:>7.3f}")
    if args.simulate:
        s = out["simulator"]
        print(f"  {'simulator':<12}{s['pqs']:>7.3f}{s['iqs']:>7.3f}{s['total']:>7.3f}   max {s['max_staleness']}, "
              f"trainer busy {s['trainer_busy']:.1%}, {s['steps']} steps, {s['rollouts_per_s'] / 1e6:.2f} M rollouts/s")
    return 0


# --- echo-rl plan sweep -----------------------------------------------------------------------

def _sweep_cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="echo-rl plan sweep",
        description="Write PNGs: the staleness vs step-time frontier under a fixed GPU budget "
        "(frontier.png) and bubble ratio and $/step vs pool size (bubble_vs_pool.png).",
    )
    p.add_argument("--out", required=True, help="directory for the PNGs (created)")
    p.add_argument("--pool", default=str(DEFAULT_POOL), help=f"pool file (default {DEFAULT_POOL})")
    p.add_argument("--batch", type=int, default=512, help="B rollouts per update (default 512)")
    p.add_argument("--group-size", type=int, default=16, help="n (default 16)")
    p.add_argument("--t-train", type=float, default=120.0, help="T_train seconds (default 120)")
    p.add_argument("--t-bcast", type=float, default=60.0, help="T_bcast seconds (default 60)")
    p.add_argument("--learner-price", type=float, default=3.06, help="learner $/h (default 3.06)")
    p.add_argument("--c-over-b", type=float, default=0.5, help="C/B at ρ = 1 for the frontier (default 0.5)")
    p.add_argument("--sigma", type=float, default=0.6, help="lognormal σ of lengths (default 0.6)")
    p.add_argument("--r", default="0.25,1,4", help="comma-separated r = θ_T/θ_R values (default 0.25,1,4)")
    p.add_argument("--no-simulate", action="store_true", help="skip the simulated markers")
    p.add_argument("--json", action="store_true", help="print the data and file names as JSON")
    args = p.parse_args(argv)
    try:
        rs = [float(x) for x in args.r.split(",") if x.strip()]
        pool = load_pool(_resolve(args.pool))
        m_tail = st.tail_multiplier(args.sigma, args.group_size)
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        data = {
            "frontier": _plot_frontier(out_dir / "frontier.png", rs, args, m_tail),
            "pool": _plot_pool(out_dir / "bubble_vs_pool.png", pool, args),
        }
    except (SchedulerError, ConfigError, ValueError) as e:
        return _fail(str(e), args.json)
    files = [str(out_dir / "frontier.png"), str(out_dir / "bubble_vs_pool.png")]
    if args.json:
        print(json.dumps({"files": files, **data}, indent=2, ensure_ascii=False))
    else:
        print("\n".join(f"wrote {f}" for f in files))
    return 0


def _pyplot():
    """matplotlib, drawing to files; imported here because only `plan sweep` draws (it costs
    about half a second to import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_frontier(path: Path, rs: list[float], args: argparse.Namespace, m_tail: float) -> dict:
    plt = _pyplot()
    rhos = [float(x) for x in np.geomspace(0.3, 3.0, 121)]
    data: dict[str, Any] = {"m_tail": m_tail, "c_over_b": args.c_over_b, "curves": {}, "simulated": []}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, q in zip(axes, (1.0, 2.0)):
        for k, r in enumerate(rs):
            pts = frontier(r, args.c_over_b, m_tail, q, rhos)
            data["curves"][f"q={q:g},r={r:g}"] = pts
            color = f"C{k}"
            lo = [p for p in pts if p["rho"] <= 1]
            hi = [p for p in pts if p["rho"] >= 1]
            ax.plot([p["t_eff_ratio"] for p in lo], [p["total"] for p in lo], color=color, label=f"r = {r:g}, ρ ≤ 1")
            ax.plot([p["t_eff_ratio"] for p in hi], [p["total"] for p in hi], color=color, ls="--", label=f"r = {r:g}, ρ ≥ 1")
        if not args.no_simulate and 1.0 in rs:
            # Simulated points for r = 1: concurrency scales with the rollout share of the budget.
            B, n = args.batch, args.group_size
            c1 = args.c_over_b * B
            for rho in (0.4, 0.6, 0.8, 1.25, 1.6, 2.2):
                c = max(1, round(c1 * rho * 2 / (1 + rho)))
                sim = simulate(blog_config(rho, c, B, n, q, args.sigma, mu0=1000.0, speed=50.0,
                                           steps=600, warmup_steps=60))
                x = sim.t_eff / (B * st.length_mean(1000.0, args.sigma) / (c1 * 50.0))  # ÷ T_eff at ρ = 1
                data["simulated"].append({"q": q, "rho": rho, "t_eff_ratio": x, "total": sim.total})
                ax.plot([x], [sim.total], "ko", ms=4, label="simulator (r = 1)" if rho == 0.4 else None)
        ax.set_title(f"queue factor q = {q:g}")
        ax.set_xlabel("step time T_eff / T_eff(ρ = 1)")
        ax.set_xlim(1, 3)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean staleness (steps)")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"Staleness vs step time, fixed GPU budget (C/B = {args.c_over_b:g} at ρ = 1, M_tail = {m_tail:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return data


def _plot_pool(path: Path, pool: Pool, args: argparse.Namespace) -> dict:
    plt = _pyplot()
    B, T, Tb = args.batch, args.t_train, args.t_bcast
    data: dict[str, Any] = {"series": {}, "simulated": []}
    fig, (ax_b, ax_c) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {}
    for S in (2, 3, 4, 5):
        I = cap.default_publish_every(S)
        if I * T > Tb:
            series[S] = (I, bubble_by_pool_size(pool, B, T, Tb, I))
    # Show up to 3× the largest pool that still has a bubble: the transition is the story.
    last_bubble = max((r["workers"] for _, rows in series.values() for r in rows if r["bubble"] > 0), default=1)
    limit = min(pool.size, 3 * last_bubble + 1)
    for k, (S, (I, rows)) in enumerate(series.items()):
        rows = rows[:limit]
        for r in rows:
            r["dollars_per_step"] = dollars_per_step(T, r["wait_per_period_s"], I, args.learner_price, [r["cost_per_hour"]])
        data["series"][f"S={S}"] = rows
        xs = [r["workers"] for r in rows]
        ax_b.plot(xs, [r["bubble"] for r in rows], f"C{k}-", label=f"S = {S} (I = {I}), R_req = {cap.required_rate(B, T, Tb, I):.2f}/s")
        ax_c.plot(xs, [r["dollars_per_step"] for r in rows], f"C{k}-", label=f"S = {S}")
    if not args.no_simulate and 3 in series:
        S, I = 3, series[3][0]
        order = unit_cost_order(pool.candidates())
        for k in range(1, limit + 1, max(1, limit // 12)):
            chosen = order[:k]
            slots = [pool.kind_of(c.id).slots for c in chosen]
            sim = simulate(pipeline_config([c.rate for c in chosen], slots, B, args.group_size, T, publish_every=I,
                                           t_bcast=Tb, max_staleness=S, sigma=args.sigma, steps=150, warmup_steps=20))
            data["simulated"].append({"S": S, "workers": k, "bubble": sim.bubble})
            ax_b.plot([k], [sim.bubble], "ko", ms=4, label="simulator (S = 3)" if k == 1 else None)
    ax_b.set_xlabel("active workers (cheapest unit cost first)")
    ax_b.set_ylabel("learner bubble ratio")
    ax_b.set_title(f"Bubble vs pool size (T = {T:g} s, T_bcast = {Tb:g} s, B = {B})")
    ax_b.legend(fontsize=7)
    ax_b.grid(alpha=0.3)
    ax_c.set_xlabel("active workers (cheapest unit cost first)")
    ax_c.set_ylabel("\\$ per learner step")
    ax_c.set_title(f"\\$/step (learner \\${args.learner_price:g}/h + workers)")
    ax_c.legend(fontsize=7)
    ax_c.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return data
