"""Say so when the run cannot go on, and why, instead of waiting in silence.

`NoSignal`: every group comes back with equal rewards (all wrong: a task too hard for the
model; all right: too easy) and dynamic sampling skips them all, so no batch fills.

`NoInstalls`: workers joined, and none has installed a snapshot.

`AgedOut`: the run goes on, but a large share of the groups accepted grow too stale in the
queue before a batch takes them (a new user's S = 1, I = 1 demo dropped a third, unsaid).

`ThinSignal`: the run goes on, but dynamic sampling trains only a small share of what arrives,
and each update, a mean over that share alone, is as large as a full batch of signal's: the
poker demo's policy collapsed by step 60 that way with nothing said (2026-11-29).

A worker that refuses every version (an adapter probe it cannot match, a snapshot of another
shape) takes no leases and logs why on its own machine; the learner then waits for rollouts
with nothing on its console, indefinitely. `NoInstalls` notes it once per stall, pointing at
the workers' logs; the loop runs on without it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from pathlib import Path


class NoInstalls:
    def __init__(self, after_s: float, note: Callable[[str], None], logs: Path):
        self.after_s, self.note, self.logs = after_s, note, logs
        self.said = False

    def check(self, workers: Iterable, published: int, now: float) -> bool:
        """Note once (until a worker installs) when every worker joined `after_s` ago or more
        still holds no version while one was published; returns whether it noted now."""
        workers = [w for w in workers if not w.quarantined]
        if published < 0 or not workers or any(w.version >= 0 for w in workers):
            self.said = False
            return False
        waited = now - max(w.joined for w in workers)
        if self.said or waited < self.after_s:
            return False
        self.said = True
        self.note(f"waiting: {len(workers)} worker{'s' if len(workers) > 1 else ''} joined {waited:.0f} s ago or more "
                  f"and none has installed a snapshot (v{published} is published): each refused it or is still "
                  f"loading. A worker logs why it refused an install ({self.logs}/*.log for the ones this learner "
                  "spawned; a remote worker's own output)")
        return True

    async def watch(self, registry, run, every_s: float = 5.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            self.check(registry.alive(time.monotonic()), run.published_version, time.monotonic())


async def watch_buffer(buffer, notes: list, every_s: float = 5.0) -> None:
    """Read the buffer's counters (`BufferStats`) every few seconds, for each of `notes` (each a
    `check(stats)`)."""
    while True:
        await asyncio.sleep(every_s)
        for note in notes:
            note.check(buffer.stats)


class NoSignal:
    """Note once per stall when the last `after` groups all had equal rewards and so were skipped
    (`[buffer] dynamic_sampling`) while no batch was taken."""

    def __init__(self, after: int, note: Callable[[str], None]):
        self.after, self.note = after, note
        self.seen = (0, 0)  # (groups with signal queued, groups trained) at the last check
        self.since = 0  # skipped groups counted when either last changed
        self.said = False

    def check(self, stats) -> bool:
        """`stats`: the buffer's `BufferStats`. Returns whether it noted now."""
        seen = (stats.accepted - stats.skipped_uniform, stats.trained)
        if seen != self.seen:  # a group with signal arrived, or a batch was taken: not stalled
            self.seen, self.since, self.said = seen, stats.skipped_uniform, False
        skipped = stats.skipped_uniform - self.since
        if self.said or skipped < self.after:
            return False
        self.said = True
        self.note(f"waiting: the last {skipped} groups all had equal rewards within each group, and "
                  "no batch filled: under GRPO such a group has no advantage, so [buffer] dynamic_sampling skips it. "
                  "The task is too hard (every answer wrong) or too easy for this model, or the policy stopped "
                  "exploring (every sample of a group plays out alike: raise rollout.temperature or top_p, or "
                  "trainer.kl_coef to hold it near the start): warm-start the model "
                  "(echo-rl build-model --warmup-steps), use a larger rollout.group_size, or set "
                  "[buffer] dynamic_sampling = false to take steps without a gradient")
        return True


class WindowNote:
    """Note once per run, judging each window of `window` groups accepted in a row by how many of
    them a `BufferStats` counter (`counter`) counted; `judge` says what to note, or None."""

    counter = ""

    def __init__(self, window: int, note: Callable[[str], None]):
        self.window, self.note = window, note
        self.start: tuple[int, int] | None = None  # (accepted, counted) when the window began
        self.said = False

    def judge(self, accepted: int, counted: int) -> str | None:
        raise NotImplementedError

    def check(self, stats) -> bool:
        """`stats`: the buffer's `BufferStats`. Returns whether it noted now."""
        now = (stats.accepted, getattr(stats, self.counter))
        if self.said:
            return False
        if self.start is None:
            self.start = now
        accepted, counted = now[0] - self.start[0], now[1] - self.start[1]
        if accepted < self.window:
            return False
        self.start = now
        said = self.judge(accepted, counted)
        if said is None:
            return False
        self.said = True
        self.note(said)
        return True


class ThinSignal(WindowNote):
    """Of `window` groups accepted in a row, fewer than `below` of them had rewards that differ
    (`[buffer] dynamic_sampling` skipped the rest). None at all is `NoSignal`'s to say."""

    counter = "skipped_uniform"

    def __init__(self, window: int, note: Callable[[str], None], below: float = 0.25):
        super().__init__(window, note)
        self.below = below

    def judge(self, accepted: int, skipped: int) -> str | None:
        share = 1 - skipped / accepted
        if not 0 < share < self.below:
            return None
        return (f"dynamic sampling: {share:.0%} of the last {accepted} groups had rewards that differ, the rest "
                "were skipped: each update is a mean over that share alone, a step as large as a full batch of "
                "signal would take. If the eval falls or every sample of a group starts to play out alike, lower "
                "[trainer] lr, or set [buffer] dynamic_sampling = false with [trainer] kl_coef > 0 "
                "(the poker demo collapsed by step 60 with it: docs/poker.md)")

class AgedOut(WindowNote):
    """Of `window` groups accepted, `above` or more were dropped as too stale while queued: work
    paid for and thrown away (S = 1 with I = 1 on the demo: 304 of 944; S = 2 with I = 1: 12)."""

    counter = "dropped_stale"

    def __init__(self, window: int, note: Callable[[str], None], staleness: int, every: int, above: float = 0.2):
        super().__init__(window, note)
        self.staleness, self.every, self.above = staleness, every, above

    def judge(self, accepted: int, dropped: int) -> str | None:
        if dropped < self.above * accepted:
            return None
        S, I = self.staleness, self.every
        fixes = [f"raise [buffer] max_staleness (S = {S + 1}, keeping [publish] every = {I})"]
        if I > max(1, S - 1):
            fixes.append(f"publish more often ([publish] every = {max(1, S - 1)})")
        fixes.append("run fewer workers")
        return (f"staleness: {dropped} of the last {accepted} groups accepted were dropped as too stale before a "
                f"batch took them (S = {S}, I = {I}): workers generate more than the learner trains, and what "
                f"queues behind a batch outlives the {S}-update bound. To waste less: " + ", or ".join(fixes))
