"""The custody ledger keeps what an episode starts from (a re-issued or recovered prompt is the
same hand, its seed, not the seed-0 hand every prompt would otherwise become), and a resume
owes exactly the prompts leased and not trained by an update it keeps, holding no more."""

from __future__ import annotations

from echo.tasks import Prompt
from learner.ledger import Ledger, unique_ids


def test_unique_ids_keep_each_prompts_seed():
    prompts = [Prompt("a", "", "", seed=11), Prompt("a", "", "", seed=12)]
    out = list(unique_ids(iter(prompts), start=3))
    assert [p.seed for p in out] == [11, 12] and len({p.id for p in out}) == 2


def test_a_recovered_lease_keeps_its_seed(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.leased([Prompt("p1", "t", "x", seed=7), Prompt("p2", "u", "y", seed=9)])
    ledger.trained(1, ["p1"])
    ledger.close()
    _, recovery = Ledger.open_run(tmp_path / "ledger.jsonl", 1, resumed=True)
    assert [(p.id, p.seed) for p in recovery.pending] == [("p2", 9)]


def test_the_resume_note_counts_updates_not_versions(tmp_path):
    """A 40-step run checkpointed after 10 updates, killed after publishing v15: the note said
    'resumed at update 16' (the next version), which is not what the run counts or will redo."""
    from pathlib import Path

    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.leased([Prompt("p1", "t", "x")])
    ledger.published(15)
    ledger.close()
    _, recovery = Ledger.open_run(tmp_path / "ledger.jsonl", 10, resumed=True)
    note = recovery.note(10, 40, Path("checkpoints/step-000010"))
    assert note.startswith("resumed after update 10 of 40 (checkpoint step-000010)")
    assert "versions continue after v15" in note


def test_a_prompt_leased_again_before_it_is_trained_is_written_once(tmp_path):
    """Lease-and-release churn (16 identities on one address) wrote each prompt again on every
    lease: 120 KB/s of ledger, bounded only by the request rate. Replay keeps the first line."""
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    p1, p2 = Prompt("p1", "t" * 500, "x"), Prompt("p2", "u", "y")
    ledger.leased([p1])
    before = path.stat().st_size
    for _ in range(100):  # released and leased again
        ledger.leased([p1])
    assert path.stat().st_size == before
    ledger.leased([p1, p2])
    ledger.trained(1, ["p1"])
    ledger.leased([p1])  # trained, then leased again (a recycled prompt): written again
    ledger.close()
    assert path.read_text().count('"p1","t') == 2 and path.read_text().count('"p2"') == 1
    _, recovery = Ledger.open_run(path, 0, resumed=True)
    assert [p.id for p in recovery.pending] == ["p1", "p2"]


def _replay_holding_everything(path, checkpoint_step: int) -> list[str]:
    """The replay as it was (every prompt ever leased held to the end): the reference."""
    import json

    leased, trained = {}, {}
    for line in path.read_text().splitlines():
        ev = json.loads(line)
        if ev["e"] == "L":
            for pid, *_ in ev["p"]:
                leased.setdefault(pid, pid)
        elif ev["e"] == "T":
            for pid in ev["p"]:
                trained[pid] = ev["s"]
        elif ev["e"] == "R":
            trained = {pid: s for pid, s in trained.items() if s <= ev["from"]}
    return [pid for pid in leased if trained.get(pid) is None or trained[pid] > checkpoint_step]


def test_replay_drops_final_trainings_as_it_reads_and_owes_what_it_did():
    """A resume held every prompt ever leased until the end of the ledger: a week's. Trainings no
    later resume rolls back are dropped as read; what is owed is the same, over random runs of
    leases, trainings and resumes from older checkpoints."""
    import random
    import tempfile
    from pathlib import Path

    rng = random.Random(0)
    for trial in range(200):
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "ledger.jsonl"
            ledger = Ledger(path)
            step, untrained, n = 0, [], 0
            for _ in range(rng.randint(1, 40)):
                r = rng.random()
                if r < 0.4:
                    new = [Prompt(f"p{n + i}", "t", "a") for i in range(rng.randint(1, 3))]
                    n += len(new)
                    ledger.leased(new)
                    untrained += [p.id for p in new]
                elif r < 0.8 and untrained:
                    step += 1
                    done = rng.sample(untrained, rng.randint(1, len(untrained)))
                    ledger.trained(step, done)
                    untrained = [p for p in untrained if p not in done]
                elif r < 0.9 and step:
                    step = rng.randint(0, step)  # resumed from an older checkpoint
                    ledger.resumed(step)
            ledger.close()
            checkpoint = rng.randint(0, step)
            got = [p.id for p in Ledger.replay(path, checkpoint).pending]
            assert got == _replay_holding_everything(path, checkpoint), (trial, path.read_text())


def test_replaying_a_long_ledger_holds_only_what_is_owed(tmp_path):
    import tracemalloc

    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    for step in range(1, 2001):
        batch = [Prompt(f"s{step}.{i}", "x" * 1000, "a") for i in range(10)]
        ledger.leased(batch)
        ledger.trained(step, [p.id for p in batch])
    ledger.leased([Prompt("owed", "y", "b")])
    ledger.close()
    tracemalloc.start()
    recovery = Ledger.replay(path, 2000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [p.id for p in recovery.pending] == ["owed"]
    assert peak < 2 << 20, peak  # 20,000 prompts of 1 KB read: ~30 MB when all were held
