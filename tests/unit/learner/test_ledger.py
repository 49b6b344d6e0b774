"""The custody ledger keeps what an episode starts from: a re-issued or recovered prompt is the
same hand (its seed), not the seed-0 hand every prompt would otherwise become."""

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
