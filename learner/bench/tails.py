"""Is one arm's tail latency within a bound of another's, given how much a p99 moves by chance?
(`echo-rl bench control-plane --hostile F --pairs N`: the honest p99, attacked against benign.)

A p99 from a few thousand requests is set by its few dozen slowest, and those come in bursts
(a publish waking many long-polls, a garbage collection): two benign runs back to back differed
1.5-4x. So the requests of all runs of an arm are pooled, and the ratio of the pooled p99s gets
a confidence interval from a two-stage bootstrap: the runs resampled with replacement (each
run's learner process has its own luck: alternate benign runs' p99s differ more than
windows of one run do), then each drawn run's `BLOCK_S` windows resampled (a burst stays
inside its window, so the interval carries the bursts' chance, not only the single
requests'). With one run per arm only the second stage is left, and the interval is too
narrow: use `--pairs` 3 or more for a verdict. A verdict needs the interval: `met` when all of
it is within the bound, `missed` when all of it is beyond, `not settled` otherwise; a route
with fewer than `MIN_SAMPLES` requests per arm is not judged at all (its p99 would be its
ten slowest).

The arms run in the order B H H B B H H B ... (`hostile_turns`), not B H B H: the machine
drifts over a sitting (another tenant, its clock), and with every hostile run after its benign
one, a drift falls on the hostile arm alone. Counterbalanced, a linear drift falls on both
alike; the A/A check splits the benign runs the same way (`halves`).

Each benign run and the hostile run beside it make a pair, run within minutes of each other on
a machine that drifts 25-50% over a sitting: `paired=True` draws the pairs, not each arm's runs
on their own, so the machine's state at a pair's time is shared by both arms in every draw (a
block bootstrap of a blocked design) and only what differs within the pairs widens the interval.
"""

from __future__ import annotations

import numpy as np

BLOCK_S = 10.0
MIN_SAMPLES = 1000
LEVEL = 0.90  # two-sided: the bound is judged against the upper 95% limit


def hostile_turns(pairs: int) -> list[bool]:
    """Which of `2 * pairs` runs are hostile: B H, H B, B H, H B, ... (each pair's mean place
    in time is the same for both arms over every two pairs)."""
    return [(i % 4) in (1, 2) for i in range(2 * pairs)]


def halves(runs: list) -> tuple[list, list]:
    """`runs` (in the order they ran) split into two by the same pattern: 0 3 4 7 ... and 1 2 5 6 ...,
    for an A/A check that a drift does not decide."""
    second = hostile_turns((len(runs) + 1) // 2)
    return [r for r, s in zip(runs, second) if not s], [r for r, s in zip(runs, second) if s]


def blocks(runs: list[tuple[list[float], list[float]]]) -> list[list[np.ndarray]]:
    """Each run's latencies (`(at, seconds)`: when each request ended, from the run's start,
    and how long it took) cut into `BLOCK_S` windows; runs without any left out."""
    out = []
    for at, lat in runs:
        at, lat = np.asarray(at, dtype=float), np.asarray(lat, dtype=float)
        window = (at // BLOCK_S).astype(int)
        run = [lat[window == w] for w in np.unique(window)]
        if run:
            out.append(run)
    return out


def _draw(runs: list[list[np.ndarray]], rng: np.random.Generator, picks: np.ndarray | None = None) -> np.ndarray:
    """Runs with replacement (or the runs `picks` names), then each drawn run's windows with
    replacement, pooled."""
    drawn = []
    for r in rng.integers(0, len(runs), len(runs)) if picks is None else picks:
        windows = runs[r]
        drawn += [windows[w] for w in rng.integers(0, len(windows), len(windows))]
    return np.concatenate(drawn)


def ratio(base: list[tuple[list, list]], test: list[tuple[list, list]], q: float = 0.99, reps: int = 2000,
          seed: int = 0, paired: bool = False) -> dict:
    """The pooled q-quantile of `test` over that of `base`, with its `LEVEL` interval; `paired`:
    `base[i]` and `test[i]` ran side by side, and are drawn together (a pair where either run has
    no requests is left out)."""
    if paired:
        if len(base) != len(test):
            raise ValueError(f"paired arms need as many runs each, not {len(base)} and {len(test)}")
        kept = [(x, y) for x, y in zip(base, test) if len(x[1]) and len(y[1])]
        base, test = [x for x, _ in kept], [y for _, y in kept]
    a, b = blocks(base), blocks(test)
    n = min(sum(x.size for run in a for x in run), sum(x.size for run in b for x in run))
    if not a or not b:
        return {"samples": n, "base": None, "test": None, "ratio": None, "low": None, "high": None}
    qa = np.quantile(np.concatenate([x for run in a for x in run]), q)
    qb = np.quantile(np.concatenate([x for run in b for x in run]), q)
    rng = np.random.default_rng(seed)
    draws = np.empty(reps)
    for i in range(reps):
        picks = rng.integers(0, len(a), len(a)) if paired else None
        draws[i] = np.quantile(_draw(b, rng, picks), q) / np.quantile(_draw(a, rng, picks), q)
    low, high = np.quantile(draws, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return {"samples": n, "base": float(qa), "test": float(qb), "ratio": float(qb / qa), "low": float(low),
            "high": float(high), "paired": paired}


def verdict(r: dict, bound: float) -> str:
    if r["ratio"] is None or r["samples"] < MIN_SAMPLES:
        return "too few samples"
    if r["high"] <= bound:
        return "met"
    return "missed" if r["low"] > bound else "not settled"
