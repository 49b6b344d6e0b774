"""The learner says so when workers joined and none installed a snapshot (a LoRA run on a bf16
learner waited ten silent minutes while both fp32 workers refused every adapter)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from learner.stalls import NoInstalls


def worker(version: int, joined: float = 0.0, quarantined: str = ""):
    return SimpleNamespace(version=version, joined=joined, quarantined=quarantined)


def test_workers_that_installed_nothing_are_noted_once_and_again_after_a_recovery():
    notes: list[str] = []
    stalls = NoInstalls(60.0, notes.append, Path("runs/r/workers"))
    refusing = [worker(-1), worker(-1, joined=5.0)]
    assert not stalls.check(refusing, published=0, now=30.0)  # too soon: loading takes time
    assert stalls.check(refusing, published=0, now=70.0)
    assert "2 workers joined" in notes[0] and "none has installed" in notes[0] and "runs/r/workers/*.log" in notes[0]
    assert not stalls.check(refusing, published=0, now=200.0)  # once per stall
    assert not stalls.check([worker(3), worker(-1)], published=3, now=300.0)  # one installed: not a stall
    assert stalls.check(refusing, published=3, now=400.0) and len(notes) == 2


def test_no_note_without_workers_a_publication_or_with_only_quarantined_ones():
    notes: list[str] = []
    stalls = NoInstalls(60.0, notes.append, Path("w"))
    assert not stalls.check([], published=0, now=1e6)
    assert not stalls.check([worker(-1)], published=-1, now=1e6)
    assert not stalls.check([worker(-1, quarantined="forged")], published=0, now=1e6)
    assert not notes


def test_no_signal_notes_once_when_every_group_is_skipped_and_again_after_progress():
    from learner.buffer import BufferStats
    from learner.stalls import NoSignal

    notes = []
    watch, stats = NoSignal(after=16, note=notes.append), BufferStats()
    stats.accepted = stats.skipped_uniform = 15
    assert not watch.check(stats)
    stats.accepted = stats.skipped_uniform = 16
    assert watch.check(stats) and "equal rewards" in notes[0] and "dynamic_sampling = false" in notes[0]
    assert "rollout.temperature" in notes[0]  # a poker policy that stopped exploring was told "too hard"
    stats.accepted = stats.skipped_uniform = 40
    assert not watch.check(stats)  # once per stall
    stats.accepted, stats.trained = 41, 1  # a group with signal came, a batch was taken: a new stall may be noted
    assert not watch.check(stats)
    stats.accepted = stats.skipped_uniform = stats.skipped_uniform + 16
    stats.accepted += 1
    assert watch.check(stats) and len(notes) == 2


def test_notes_print_config_sections_as_written(capsys):
    """rich read `[buffer]` in "set [buffer] dynamic_sampling = false" as a style tag and printed
    the advice without its section (a new user, 2026-11-28)."""
    from learner.status import StatusDisplay

    display = StatusDisplay(10)
    display.banner("banner: [buffer] dynamic_sampling")
    display.note("note: set [buffer] dynamic_sampling = false")
    out = capsys.readouterr().out
    assert "banner: [buffer] dynamic_sampling" in out and "note: set [buffer] dynamic_sampling = false" in out


def test_an_infeasible_schedule_is_said_once_not_each_time_its_measured_numbers_move():
    """At S = 0 the scheduler's note repeated whenever the measured T_train in it changed: 14
    times in a 20-step run (a new user). Another condition is news again."""
    import asyncio
    import itertools

    from learner.scheduling import schedule

    messages = [f"infeasible at S = 0, I = 1: T_train {t:.2f} s" for t in (0.31, 0.29, 0.33)] + ["another condition: 4 s"]
    ticks = itertools.chain(messages, itertools.repeat(messages[3]))
    fleet = SimpleNamespace(tick=lambda now: SimpleNamespace(lost=[], infeasible=next(ticks), decisions=[]),
                            is_active=lambda key: True)
    notes: list[str] = []

    async def run():
        task = asyncio.ensure_future(schedule(fleet, SimpleNamespace(workers={}), 0.001, lambda r: None, notes.append))
        while len(notes) < 2 and not task.done():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # more ticks of the same
        task.cancel()

    asyncio.run(run())
    assert notes == [f"scheduler: {messages[0]}; activating every available worker",
                     f"scheduler: {messages[3]}; activating every available worker"]


def test_the_banner_defines_every_status_column():
    """The status line's `reward` was defined in the README only (a new user)."""
    from learner.config import load_learner_config
    from learner.status import banner

    for sampling, where in (("true", "workers"), ("false", "learner")):
        cfg = load_learner_config(None, ["--buffer.dynamic_sampling", sampling, "--eval.where", where])
        text = banner(cfg, "http://127.0.0.1:1", "runs/x", "t" * 32, 300_000, 1, 10)
        for column in ("v =", "reward =", "eval =", "idle =", "recycled =", "queue =", "length ="):
            assert column in text, (column, text)
        assert ("signal =" in text) == (sampling == "true")
        # a learner-side eval is of weights not yet published: `eval 0.280@v3` beside `v0` (a new user)
        assert ("newer than v" in text) == (where == "learner")
    # replay on is said beside the buffer (a new user did not see `reuse = 2` anywhere)
    cfg = load_learner_config(None, ["--buffer.reuse", "2"])
    assert "buffer queue-drop with replay (reuse = 2)," in banner(cfg, "http://127.0.0.1:1", "runs/x", "t" * 32, 1, 1, 10)


def test_a_thin_signal_under_dynamic_sampling_is_noted_once_per_run():
    """The poker demo, with dynamic sampling, trained 480 groups of 2,016 in 60 steps (24%) and
    its policy collapsed with nothing said: each update averaged over that share alone."""
    from learner.buffer import BufferStats
    from learner.stalls import ThinSignal

    notes = []
    watch, stats = ThinSignal(window=100, note=notes.append), BufferStats()
    assert not watch.check(stats)
    stats.accepted, stats.skipped_uniform = 99, 90
    assert not watch.check(stats)  # the window is not full
    stats.accepted, stats.skipped_uniform = 100, 70
    assert not watch.check(stats)  # 30% with signal: nothing to say; a new window begins
    stats.accepted, stats.skipped_uniform = 200, 170
    assert not watch.check(stats)  # 100 skipped of 100: NoSignal's to say
    stats.accepted, stats.skipped_uniform = 300, 250
    assert watch.check(stats) and "20% of the last 100 groups" in notes[0] and "[trainer] lr" in notes[0]
    stats.accepted, stats.skipped_uniform = 500, 450
    assert not watch.check(stats) and len(notes) == 1  # once per run


def test_groups_dropped_as_too_stale_are_said_once_with_what_to_change():
    """A new user's S = 1, I = 1 demo dropped 304 of 944 accepted groups as too stale, and the
    learner said nothing; S = 2 dropped 12. A share of a fifth or more is said, once."""
    from types import SimpleNamespace

    from learner.stalls import AgedOut

    said = []
    watch = AgedOut(64, said.append, staleness=1, every=1)
    assert not watch.check(SimpleNamespace(accepted=0, dropped_stale=0))
    assert not watch.check(SimpleNamespace(accepted=64, dropped_stale=6))  # under a fifth: nothing said
    assert watch.check(SimpleNamespace(accepted=128, dropped_stale=6 + 20))
    assert len(said) == 1 and "20 of the last 64" in said[0] and "S = 2, keeping [publish] every = 1" in said[0]
    assert "publish more often" not in said[0]  # I = 1 already
    assert not watch.check(SimpleNamespace(accepted=1000, dropped_stale=900))  # once per run
    said.clear()
    watch = AgedOut(64, said.append, staleness=3, every=3)
    watch.check(SimpleNamespace(accepted=0, dropped_stale=0))
    assert watch.check(SimpleNamespace(accepted=64, dropped_stale=30)) and "[publish] every = 2" in said[0]
