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
    # everything is out: a fourth worker gets a backup of the oldest lease, and no more than one
    backup, _, again = book.lease("w4", 3, 8, 0.0)
    assert [p.id for p in again] == [p.id for p in got]
    assert [p.id for p in book.lease("w5", 3, 8, 0.0)[2]] == [p.id for p in got2]
    with pytest.raises(Rejected, match="not outstanding for this worker"):
        book.submit("w2", lid, 3, {p.id: 1.0 for p in got}, now=1.0)
    with pytest.raises(Rejected, match="one reward for each"):
        book.submit("w1", lid, 3, {got[0].id: 1.0}, now=1.0)
    with pytest.raises(Rejected, match="evaluates v3"):
        book.submit("w1", lid, 2, {p.id: 1.0 for p in got}, now=1.0)
    with pytest.raises(Rejected, match=r"in \[0, 1\]"):
        book.submit("w1", lid, 3, {p.id: 7.0 for p in got}, now=1.0)
    assert book.submit("w1", lid, 3, {p.id: 1.0 for p in got}, now=1.0) is None
    # the backup's late answer: its slot was answered, which is no fault ("answered", not "unknown-lease")
    with pytest.raises(Rejected, match="another worker answered its prompts first") as refused:
        book.submit("w4", backup, 3, {p.id: 0.0 for p in again}, now=1.2)
    assert refused.value.reason == "answered"
    assert book.submit("w2", lid2, 3, {p.id: 0.0 for p in got2}, now=1.5) is None
    result = book.submit("w3", lid3, 3, {p.id: 1.0 for p in got3}, now=2.0)
    assert (result.version, result.prompts, result.workers, result.restarts, result.backups) == (3, 10, 3, 0, 2)
    assert result.accuracy == pytest.approx(6 / 10) and result.seconds == 2.0
    assert book.round is None and not hasattr(book, "results")  # every round's completions were kept, forever


def test_a_dead_workers_eval_lease_expires_and_its_prompts_go_to_another():
    book = EvalBook(PROMPTS, ttl=5.0, per_lease=10)
    book.open(1, now=0.0)
    lid, _, got = book.lease("dead", 1, 10, now=0.0)
    book.renew("dead", now=4.0)  # heartbeats keep it alive...
    assert not book.expire(now=8.0, live={"dead": 1, "w": 1}, newest=1)
    book.expire(now=9.5, live={"w": 1}, newest=1)  # ...until they stop
    assert "dead" not in book.barred  # a lease that lapsed with its heartbeats is no evidence
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
    assert not book.expire(now=1.0, live={"a": 2}, newest=4)  # v4 still on its way to the workers
    assert not book.expire(now=2.0, live={"a": 4, "b": 8}, newest=8)  # someone still holds v4
    assert book.expire(now=3.0, live={"a": 8, "b": 8}, newest=8)  # everyone moved on
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
    book.expire(now=12.5, live={"sitter": 1, "honest": 1}, newest=1)
    assert lid not in book.round.leased and {p.id for p in got} <= set(book.round.pending)
    assert set(book.barred) == {"sitter"} and book.lease("sitter", 1, 2, now=13.0) is None  # kept alive, never answered


def test_a_round_an_identity_sits_on_is_finished_by_a_backup_from_an_honest_worker():
    """One identity took an eval lease and sat on it, heartbeating: every round was held up for
    ~60 s and the rounds due meanwhile never opened (an API-only tester, 2026-11-30). Once
    nothing is pending, a worker on the round's version gets a backup of the outstanding lease;
    the first answer counts."""
    book = EvalBook(PROMPTS[:4], ttl=5.0, per_lease=2, lifetime=60.0)
    book.open(1, now=0.0)
    sat, _, held = book.lease("sitter", 1, 2, now=0.0)
    lid, _, got = book.lease("honest", 1, 2, now=0.0)
    assert book.submit("honest", lid, 1, {p.id: 1.0 for p in got}, now=1.0) is None
    backup, _, same = book.lease("honest", 1, 2, now=1.0)  # nothing pending: the sitter's prompts again
    assert [p.id for p in same] == [p.id for p in held]
    assert book.lease("other", 1, 2, now=1.0) is None  # one backup per lease: at most twice the work
    result = book.submit("honest", backup, 1, {p.id: 0.0 for p in same}, now=2.0)
    assert result is not None and result.prompts == 4 and result.seconds == 2.0 and result.backups == 1
    assert result.answered_by == {"honest"}


def test_an_eval_lease_is_never_larger_than_the_worker_asked_for():
    """A worker asking one prompt at a time was handed a round's per_lease (the route passed
    per_lease for its ask), and a backup of a larger slot whatever it asked."""
    book = EvalBook(PROMPTS[:6], ttl=5.0, per_lease=4)
    book.open(1, now=0.0)
    _, _, big = book.lease("a", 1, 4, now=0.0)
    _, _, small = book.lease("b", 1, 1, now=0.0)
    assert (len(big), len(small)) == (4, 1)
    lid, _, rest = book.lease("c", 1, 4, now=0.0)
    book.submit("c", lid, 1, {p.id: 1.0 for p in rest}, now=1.0)  # nothing pending now: backups only
    assert book.lease("d", 1, 2, now=5.0)[2] == small  # a's slot of 4 is too big for an ask of 2
    assert len(book.lease("e", 1, 4, now=5.0)[2]) == 4


def test_sitters_are_barred_and_a_round_only_they_could_answer_is_abandoned():
    """Two identities hold both copies of a lease to its lifetime: each is barred from eval
    leases for the run, their prompts go back, and with no live worker that may answer left on
    the round's version it is abandoned for the next the learner opens: they cost one round."""
    book = EvalBook(PROMPTS[:2], ttl=5.0, per_lease=2, lifetime=12.0)
    book.open(1, now=0.0)
    assert book.lease("s1", 1, 2, now=0.0) and book.lease("s2", 1, 2, now=0.0)  # the lease and its backup
    for t in range(0, 14, 2):
        book.renew("s1", now=float(t))
        book.renew("s2", now=float(t))
    assert not book.expire(now=11.0, live={"s1": 1, "s2": 1}, newest=3)
    assert book.expire(now=13.0, live={"s1": 1, "s2": 1}, newest=3)  # both barred: nobody left to answer v1
    assert set(book.barred) == {"s1", "s2"} and book.abandoned.version == 1
    book.open(3, now=14.0)
    assert book.lease("s1", 3, 2, now=14.0) is None and book.lease("honest", 3, 2, now=14.0) is not None


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


def test_only_a_worker_that_delivered_accepted_work_gets_eval_leases():
    """A fresh identity that never generated anything could take a round's lease and sit on it;
    one must first deliver training work the learner accepted (`groups_accepted > 0`)."""
    book = EvalBook(PROMPTS, ttl=5.0, per_lease=4)
    book.open(1, now=0.0)
    assert book.lease("fresh", 1, 4, now=0.0, proven=False) is None
    assert book.lease("worker", 1, 4, now=0.0, proven=True) is not None


def test_a_lease_lives_a_few_of_the_runs_answer_times_and_a_stalled_learner_bars_nobody():
    book = EvalBook(PROMPTS, ttl=5.0, per_lease=2, lifetime=60.0)
    book.open(1, now=0.0)
    for i, worker in enumerate(("a", "b", "c")):
        lid, _, got = book.lease(worker, 1, 2, now=0.0)
        book.submit(worker, lid, 1, {p.id: 1.0 for p in got}, now=1.0 + i)  # answered in 1-3 s
    lid, _, _ = book.lease("sitter", 1, 2, now=10.0)
    assert book.round.leased[lid].latest == 10.0 + max(5.0, 4 * 2.0)  # not 60 s
    for t in (12.0, 16.0, 18.0):
        book.renew("sitter", now=t)
    book.expire(now=18.5, live={"sitter": 1, "a": 1}, newest=1)
    assert "sitter" in book.barred
    # A learner whose loop stalled renewed nobody's lease: it lapses, and its holder is not barred.
    lid, _, _ = book.lease("a", 1, 2, now=20.0)
    book.expire(now=40.0, live={"a": 1}, newest=1)
    assert lid not in book.round.leased and "a" not in book.barred


def test_a_backup_outliving_the_lease_it_backed_up_can_itself_be_backed_up():
    """The slot's first lease expired while its backup held on: a third worker asking must get
    the slot's prompts (it looked them up by the first lease's id, gone by then)."""
    book = EvalBook(PROMPTS[:2], ttl=5.0, per_lease=2, lifetime=60.0)
    book.open(1, now=0.0)
    book.lease("gone", 1, 2, now=0.0)
    backup, _, got = book.lease("slow", 1, 2, now=0.0)
    book.renew("slow", now=4.0)
    book.expire(now=6.0, live={"slow": 1, "third": 1}, newest=1)  # "gone" stopped heartbeating
    third, _, again = book.lease("third", 1, 2, now=6.0)
    assert [p.id for p in again] == [p.id for p in got]
    result = book.submit("third", third, 1, {p.id: 1.0 for p in again}, now=7.0)
    assert result is not None and not book.round


def test_an_outpaced_holders_answer_after_the_round_completed_is_answered_not_unknown():
    # The CPU demo's first eval: a backup completed the round, then the late first holder's answer
    # came and was refused as an unknown lease, counted among the run's rejected uploads.
    book = EvalBook(PROMPTS[:2], ttl=5.0, per_lease=2)
    book.open(0, now=0.0)
    late, _, got = book.lease("slow", 0, 8, now=0.0)
    backup, _, again = book.lease("quick", 0, 8, now=0.0)
    assert book.submit("quick", backup, 0, {p.id: 1.0 for p in again}, now=1.0) is not None  # the round is done
    with pytest.raises(Rejected, match="another worker answered its prompts first") as refused:
        book.check("slow", late, 0, [p.id for p in got])
    assert refused.value.reason == "answered"
    with pytest.raises(Rejected) as stranger:  # only its holder is told so
        book.check("quick", late, 0, [p.id for p in got])
    assert stranger.value.reason == "unknown-lease"


def test_a_rounds_time_says_how_much_of_it_waited_for_a_worker_on_its_version():
    """`eval v0: 0.165 (200 prompts on 1 worker, 20.1 s)` where later rounds of the same prompts
    took 0.5 s: v0's round opens before any worker holds v0 (a new user, 2026-12-07). The result
    says what part of its time was that wait, also after its forged answers are asked again."""
    book = EvalBook(PROMPTS, ttl=5.0, per_lease=10)
    book.open(0, now=0.0)
    assert book.lease("w1", worker_version=-1, max_prompts=10, now=5.0) is None  # still installing
    lid, _, got = book.lease("w1", worker_version=0, max_prompts=10, now=19.5)
    result = book.submit("w1", lid, 0, {p.id: 1.0 for p in got}, now=20.0)
    assert result.seconds == 20.0 and result.waited == 19.5
    book.reask(result, [got[0].id], {p.id: 1.0 for p in got[1:]}, {"w1"}, now=21.0)
    lid, _, again = book.lease("w2", worker_version=0, max_prompts=10, now=21.0)
    assert book.submit("w2", lid, 0, {again[0].id: 0.0}, now=21.5).waited == 19.5
