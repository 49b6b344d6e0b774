"""Eval rounds on workers (learner.evals): one version per round, every prompt answered once,
nothing lost to a dead worker, and a round nobody can finish restarts at the newest version."""

import pytest

from echo.tasks import Prompt
from echo.wire import Rejected
from learner.evals import EvalBook, EvalResult

PROMPTS = [Prompt(f"e{i}", f"{i}+1=", str(i + 1)) for i in range(10)]


def test_a_round_goes_only_to_workers_on_its_version_and_completes_once():
    book = EvalBook(PROMPTS, ttl=5.0, per_lease=4)
    book.open(3, now=0.0)
    assert book.lease("w1", worker_version=2, max_prompts=8, now=0.0) is None  # not on v3 yet
    lid, version, got = book.lease("w1", worker_version=3, max_prompts=8, now=0.0)
    assert version == 3 and len(got) == 4  # per_lease caps the worker's ask
    lid2, _, got2 = book.lease("w2", worker_version=3, max_prompts=100, now=0.0)
    lid3, _, got3 = book.lease("w3", worker_version=3, max_prompts=100, now=0.0)
    assert book.lease("w4", 3, 8, 0.0) is None  # everything is out
    with pytest.raises(Rejected, match="not outstanding for this worker"):
        book.submit("w2", lid, 3, {p.id: 1.0 for p in got}, now=1.0)
    with pytest.raises(Rejected, match="one reward for each"):
        book.submit("w1", lid, 3, {got[0].id: 1.0}, now=1.0)
    with pytest.raises(Rejected, match="evaluates v3"):
        book.submit("w1", lid, 2, {p.id: 1.0 for p in got}, now=1.0)
    with pytest.raises(Rejected, match=r"in \[0, 1\]"):
        book.submit("w1", lid, 3, {p.id: 7.0 for p in got}, now=1.0)
    assert book.submit("w1", lid, 3, {p.id: 1.0 for p in got}, now=1.0) is None
    assert book.submit("w2", lid2, 3, {p.id: 0.0 for p in got2}, now=1.5) is None
    result = book.submit("w3", lid3, 3, {p.id: 1.0 for p in got3}, now=2.0)
    assert (result.version, result.prompts, result.workers, result.restarts) == (3, 10, 3, 0)
    assert result.accuracy == pytest.approx(6 / 10) and result.seconds == 2.0
    assert book.round is None and not hasattr(book, "results")  # every round's completions were kept, forever


def test_a_dead_workers_eval_lease_expires_and_its_prompts_go_to_another():
    book = EvalBook(PROMPTS, ttl=5.0, per_lease=10)
    book.open(1, now=0.0)
    lid, _, got = book.lease("dead", 1, 10, now=0.0)
    book.renew("dead", now=4.0)  # heartbeats keep it alive...
    assert not book.expire(now=8.0, live_versions={1}, newest=1) and book.lease("w", 1, 10, 8.0) is None
    book.expire(now=9.5, live_versions={1}, newest=1)  # ...until they stop
    lid2, _, again = book.lease("w", 1, 10, now=10.0)
    assert [p.id for p in again] == [p.id for p in got]
    with pytest.raises(Rejected):
        book.submit("dead", lid, 1, {p.id: 1.0 for p in got}, now=10.0)
    assert book.submit("w", lid2, 1, {p.id: 1.0 for p in again}, now=11.0).accuracy == 1.0


def test_a_round_nobody_can_finish_is_abandoned_for_the_next_one_the_learner_opens():
    """Not restarted at the newest version by itself: the learner holds no copy of that version
    to check the answers against, and an unchecked accuracy is what a forger would write."""
    book = EvalBook(PROMPTS, ttl=5.0, per_lease=10)
    book.open(4, now=0.0)
    assert not book.expire(now=1.0, live_versions={2}, newest=4)  # v4 still on its way to the workers
    assert not book.expire(now=2.0, live_versions={4, 8}, newest=8)  # someone still holds v4
    assert book.expire(now=3.0, live_versions={8}, newest=8)  # everyone moved on
    assert book.round is None and book.abandoned.version == 4
    assert book.lease("w", 8, 10, now=3.0) is None  # nothing to answer until the learner opens a round
    book.open(8, now=3.5)  # the learner, holding v8 aside
    lid, version, got = book.lease("w", 8, 10, now=3.5)
    result = book.submit("w", lid, 8, {p.id: 0.0 for p in got}, now=4.0)
    assert (result.version, result.restarts) == (8, 1) and book.abandoned is None


def test_a_worker_holds_one_eval_lease_at_a_time_and_not_past_its_lifetime():
    book = EvalBook(PROMPTS, ttl=5.0, per_lease=2, lifetime=12.0)
    book.open(1, now=0.0)
    lid, _, got = book.lease("sitter", 1, 2, now=0.0)
    assert book.lease("sitter", 1, 2, now=0.0) is None  # one at a time: it cannot take the round
    assert book.lease("honest", 1, 2, now=0.0) is not None
    for t in range(0, 20, 2):
        book.renew("sitter", now=float(t))  # heartbeats, never an answer
    book.expire(now=12.5, live_versions={1}, newest=1)
    assert lid not in book.round.leased and {p.id for p in got} <= set(book.round.pending)


def test_forged_answers_are_asked_again_and_the_result_covers_every_prompt():
    book = EvalBook(PROMPTS[:4], ttl=5.0, per_lease=4)
    first = EvalResult(2, 0.5, 4, 3.0, 3, 1, answered_by=frozenset({"a", "b", "liar"}), opened=-3.0)
    # e1, e3 were forged by "liar"; e0, e2 checked, answered by "a" and "b"
    book.reask(first, ["e1", "e3"], {"e0": 1.0, "e2": 0.0}, {"a", "b"}, now=0.0)
    lid, version, got = book.lease("honest", worker_version=2, max_prompts=8, now=0.0)
    assert version == 2 and [p.id for p in got] == ["e1", "e3"]
    result = book.submit("honest", lid, 2, {"e1": 1.0, "e3": 1.0}, now=1.0, completions={"e1": [5], "e3": [6]})
    assert result.prompts == 4 and result.accuracy == 0.75
    assert set(result.answers) == {"e1", "e3"}  # only the new answers are left to check
    # the whole round's workers and time (it said "on 1 worker" in 1 s), its restarts kept
    assert result.answered_by == {"a", "b", "honest"} and result.workers == 3
    assert result.seconds == 4.0 and result.restarts == 1
