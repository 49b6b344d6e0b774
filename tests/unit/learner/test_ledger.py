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
