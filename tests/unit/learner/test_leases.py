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
