"""Leases: expiry re-issues prompts, heartbeats keep them alive, the outstanding cap holds."""

import itertools

import pytest

from echo.tasks import Prompt
from learner.leases import LeaseBook, UnknownLease


def prompts():
    return (Prompt(f"p{i}", f"{i}+0=", str(i)) for i in itertools.count())


def test_expired_lease_prompts_are_reissued_first():
    book = LeaseBook(prompts(), ttl=5, max_outstanding=10)
    a = book.lease("w1", 2, now=0)
    book.complete(a.id, "p0")
    assert [lease.id for lease in book.expire(now=6)] == [a.id]
    with pytest.raises(UnknownLease):
        book.complete(a.id, "p1")  # a late submission for an expired lease is refused
    b = book.lease("w2", 2, now=6)
    assert list(b.prompts) == ["p1", "p2"]  # the lost prompt comes back before fresh ones
    s = book.stats
    assert s.issued == s.completed + s.reissued + book.outstanding


def test_upcoming_names_what_the_next_leases_issue_re_issues_first():
    book = LeaseBook(prompts(), ttl=5, max_outstanding=10)
    assert [p.id for p in book.upcoming(3)] == ["p0", "p1", "p2"]
    a = book.lease("w1", 2, now=0)
    assert list(a.prompts) == ["p0", "p1"] and [p.id for p in book.upcoming(2)] == ["p2", "p3"]
    book.give_back(a.id, "p1")
    assert [p.id for p in book.upcoming(3)] == ["p1", "p2", "p3"]
    assert list(book.lease("w2", 4, now=0).prompts) == ["p1", "p2", "p3", "p4"]  # as foretold, then fresh ones
    assert [p.id for p in book.upcoming(1)] == ["p5"]


def test_heartbeat_renews_only_that_workers_leases():
    book = LeaseBook(prompts(), ttl=5, max_outstanding=10)
    a, b = book.lease("w1", 1, now=0), book.lease("w2", 1, now=0)
    book.renew("w1", now=4)
    assert [lease.id for lease in book.expire(now=6)] == [b.id]
    assert book.prompt_of(a.id, "p0").text == "0+0="


def test_outstanding_cap_and_give_back():
    book = LeaseBook(prompts(), ttl=5, max_outstanding=3)
    a = book.lease("w1", 5, now=0)
    assert len(a.prompts) == 3 and book.lease("w2", 1, now=0) is None
    book.give_back(a.id, "p0")
    assert list(book.lease("w2", 4, now=0).prompts) == ["p0"]


def test_release_hands_a_whole_lease_back():
    book = LeaseBook(prompts(), ttl=5, max_outstanding=10)
    a = book.lease("w1", 2, now=0)
    with pytest.raises(UnknownLease):
        book.release(a.id, "w2")  # only the holder can
    assert book.release(a.id, "w1") == 2
    assert list(book.lease("w2", 3, now=0).prompts) == ["p0", "p1", "p2"]
    s = book.stats
    assert s.issued == s.completed + s.reissued + book.outstanding


def capped(first=2, lifetime=100.0, ttl=5, max_outstanding=40):
    from learner.leases import WorkerCap
    return LeaseBook(prompts(), ttl=ttl, max_outstanding=max_outstanding, per_worker=WorkerCap(first, lifetime))


def test_a_new_worker_cannot_take_every_prompt():
    book = capped(first=2)
    hoard = book.lease("hoarder", 40, now=0)
    assert len(hoard.prompts) == 2 and book.lease("hoarder", 40, now=0) is None  # it holds its whole window
    honest = book.lease("honest", 4, now=0)
    assert len(honest.prompts) == 2  # the rest is still there for others


def test_the_window_grows_with_measured_delivery_and_never_past_the_book():
    book = capped(first=2, ttl=5)
    t = 0.0
    for _ in range(6):  # the worker keeps coming back with everything, 1 s per lease
        lease = book.lease("w", 40, now=t)
        t += 1.0
        for pid in list(lease.prompts):
            book.complete(lease.id, pid, "w", now=t)
    # It delivers its whole window every second: 2x its rate over the 5 s ttl is past the book's 40.
    assert book.worker_room("w") == 40
    assert book.worker_room("newcomer") == 2


def test_heartbeats_cannot_keep_a_lease_past_its_lifetime():
    book = capped(first=2, lifetime=30.0, ttl=5)
    lease = book.lease("w", 2, now=0)
    for t in range(0, 40, 2):
        book.renew("w", now=t)  # a worker that heartbeats and never answers
    assert [d.id for d in book.expire(now=31)] == [lease.id]
    assert book.expired_unanswered("w") == 1


def test_an_unanswered_expiry_starts_the_window_over():
    book = capped(first=2, ttl=5)
    for t in (0.0, 1.0, 2.0):
        lease = book.lease("w", 40, now=t)
        for pid in list(lease.prompts):
            book.complete(lease.id, pid, "w", now=t + 0.5)
    assert book.worker_room("w") > 2
    held = book.lease("w", 40, now=3.0)
    assert held is not None
    book.expire(now=100.0)
    assert book.expired_unanswered("w") == 1 and book.worker_room("w") == 1  # over, and halved


def test_hoarders_that_never_deliver_are_held_to_a_share_and_a_short_lease():
    """Issue #18's hoarders (measured by `echo-rl bench control-plane --hostile`): workers that
    heartbeat and never answer. Together they hold at most `unproven_share` of what is in flight;
    each of their leases dies after a few of the fleet's median turnarounds, and every unanswered
    expiry halves what the hoarder may take next."""
    from learner.leases import WorkerCap

    book = LeaseBook(prompts(), ttl=5, max_outstanding=40, per_worker=WorkerCap(4, 600.0, unproven_share=0.25))
    honest = book.lease("honest", 4, now=0)
    for pid in list(honest.prompts):
        book.complete(honest.id, pid, "honest", now=2.0)  # a 2 s turnaround: the fleet's median
    held = [book.lease(f"h{i}", 40, now=3.0) for i in range(10)]
    assert sum(len(lease.prompts) for lease in held if lease) == 10  # 0.25 of 40, however many hoarders
    assert book.lease("honest", 40, now=3.0) is not None  # the proven worker still gets prompts
    assert all(lease.latest == 3.0 + 8.0 for lease in held if lease)  # 4 median turnarounds (2 s), not 600 s
    book.renew("h0", now=10.0)
    assert {lease.worker_id for lease in book.expire(now=11.5)} >= {"h0", "h1", "h2"}
    assert book.worker_room("h0") == 2  # 4, halved after its unanswered expiry


def test_a_newcomer_holds_no_more_than_its_share_of_the_prompts_in_flight():
    """50 sybils among 1,000 workers each taking `first` = 8 held 400 of the 768 prompts in
    flight (`echo-rl bench control-plane --hostile 0.05`: honest throughput -11%). Before it
    delivers, a worker holds at most its share among the workers alive (at least one prompt); a
    small fleet keeps the whole first window; a proven worker's window is its own."""
    from learner.leases import WorkerCap

    book = LeaseBook(prompts(), ttl=20, max_outstanding=768, per_worker=WorkerCap(8, 600.0))
    book.alive = 1000
    assert [book.lease(f"s{i}", 8, now=0.0).size for i in range(50)] == [1] * 50
    assert book.outstanding == 50
    book.alive = 3  # the demo's fleet: 256 each is more than the first window
    assert book.lease("newcomer", 64, now=0.0).size == 8
    proven = book.lease("proven", 1, now=0.0)
    book.complete(proven.id, next(iter(proven.prompts)), "proven", now=1.0)
    book.alive = 1000
    assert book.worker_room("proven", now=1.0) == 8  # delivered: its window is what it proved, not the share


def test_one_upload_of_many_groups_does_not_open_the_window():
    """The groups of one upload are completed microseconds apart: a rate measured between the
    first and the last delivery would read 10^5 prompts/s and open the window to the whole book."""
    book = capped(first=8, ttl=20)
    lease = book.lease("w", 2, now=0.0)
    for i, pid in enumerate(list(lease.prompts)):
        book.complete(lease.id, pid, "w", now=5.0 + i * 1e-6)
    assert book.worker_room("w", now=5.0) == 8  # twice the 2 it delivered is below the first window
    assert book.lease("w", 1024, now=5.0).size == 8


def test_a_dead_workers_overdue_lease_does_not_hold_a_versions_room():
    """A version trainable for one more batch is leased what the batch still needs, less the
    groups coming (`StalenessBuffer.version_room`): a dead worker's lease would hold that room
    until it expired, every worker on the version told to install. Overdue leases (3 median
    turnarounds out) are not counted as coming."""
    import time

    from broadcast.star import BlobStore
    from learner.api.leases import LeaseRoom
    from learner.api.run import Run
    from learner.buffer import AsyncBuffer, StalenessBuffer
    from learner.config import ServerSection
    from learner.metrics import LearnerMetrics

    book = LeaseBook(prompts(), ttl=600, max_outstanding=16)
    room = LeaseRoom(book, AsyncBuffer(StalenessBuffer("queue-drop", 1, 4, 2)), Run(BlobStore(keep=2)), ServerSection(),
                     backpressure=True, encode=lambda p: [1], metrics=LearnerMetrics())
    now = time.monotonic()
    a = book.lease("a", 1, now=now - 12)
    book.complete(a.id, "p0", "a", now=now - 11)  # turnarounds of a second
    live = book.lease("b", 1, now=now - 0.5)
    dead = book.lease("dead", 3, now=now - 10)  # out ten turnarounds
    assert live and dead and book.outstanding == 4
    assert room._coming() == 1  # the live lease only
