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
