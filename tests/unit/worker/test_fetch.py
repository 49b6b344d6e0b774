"""A chain-mode worker pulls a version the push missed only when it would install it: not while
the learner's scheduler has it idled (an idled fleet pulled every version whole from the
learner's uplink, and failed: the source keeps the last two), and not a version older than one
it installed meanwhile (a worker activated at v384 pulled v348). A real relay; the source is a
port nobody listens on, so a pull that is tried fails and says so."""

import asyncio
import logging
import socket
from types import SimpleNamespace

from broadcast.relay import Relay
from broadcast.signing import SigningKey
from echo import protocol as P
from worker.config import load_worker_config
from worker.rollout import Worker


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pulls(installed: int, announced: int, active: bool, caplog, joined_at: int | None = None,
           fallback_s: float = 0.2, on_route: bool | None = None) -> list[str]:
    async def run() -> None:
        key = SigningKey.generate()
        worker = Worker(load_worker_config(None, []), "http://127.0.0.1:1", "token")
        worker.broadcast = P.BroadcastInfo(mode="chain", public_key=key.public_key().to_text(), fallback_s=fallback_s)
        worker.engine = SimpleNamespace(version=installed)  # all `_fetch` asks of an engine
        if joined_at is not None:  # the version the learner announced when this identity joined
            worker.joined = SimpleNamespace(snapshot=SimpleNamespace(version=joined_at))
        worker.relay = Relay("w", key.public_key(), host="127.0.0.1", port=0)
        await worker.relay.start()
        if not active:
            worker.active.clear()
        try:
            await worker._fetch(None, P.PushAnnouncement(version=announced, key=f"v{announced}",
                                                         source=f"http://127.0.0.1:{_closed_port()}"), on_route)
        finally:
            await worker.relay.stop()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="echo.worker"):
        asyncio.run(run())
    return [r.getMessage() for r in caplog.records if "pulling" in r.getMessage() or "did not arrive" in r.getMessage()]


def test_an_active_worker_pulls_a_newer_version_the_push_missed(caplog):
    said = _pulls(installed=3, announced=5, active=True, caplog=caplog)
    assert any("pulling v5" in m for m in said) and any("v5 did not arrive" in m for m in said)


def test_a_version_published_before_the_worker_joined_is_pulled_without_waiting_for_a_push(caplog):
    """Its push was planned before this identity existed: waiting `fallback_s` (here 60 s) for
    it is waiting for nothing. A version published after the join still waits for its push."""
    import time

    start = time.monotonic()
    said = _pulls(installed=-1, announced=5, active=True, caplog=caplog, joined_at=5, fallback_s=60.0)
    assert any("pulling v5" in m for m in said) and time.monotonic() - start < 10
    start = time.monotonic()
    said = _pulls(installed=5, announced=6, active=True, caplog=caplog, joined_at=5, fallback_s=0.5)
    assert any("pulling v6" in m for m in said) and time.monotonic() - start >= 0.5


def test_a_version_the_learner_says_is_not_pushed_to_the_worker_is_pulled_without_waiting(caplog):
    """A worker joined idle before v0 was published, so v0's push was planned without it; activated,
    it waited `fallback_s` for that push (600 s in a fresh-clone CI run, which timed out). The
    learner's reply says whether the announced version is pushed to this worker."""
    import time

    start = time.monotonic()
    said = _pulls(installed=-1, announced=0, active=True, caplog=caplog, joined_at=-1, fallback_s=60.0, on_route=False)
    assert any("pulling v0" in m for m in said) and time.monotonic() - start < 10
    start = time.monotonic()  # on the route: the push is waited for
    said = _pulls(installed=-1, announced=0, active=True, caplog=caplog, joined_at=-1, fallback_s=0.5, on_route=True)
    assert any("pulling v0" in m for m in said) and time.monotonic() - start >= 0.5


def test_an_idled_worker_or_one_already_past_the_version_pulls_nothing(caplog):
    assert _pulls(installed=3, announced=5, active=False, caplog=caplog) == []
    assert _pulls(installed=8, announced=5, active=True, caplog=caplog) == []


def test_the_worker_reports_the_engine_and_device_that_run_not_auto():
    """/v1/status showed `engine: auto` (the config) for a worker running transformers on a CPU."""
    worker = Worker(load_worker_config(None, []), "http://127.0.0.1:1", "token")
    before = worker._info()
    assert (before.engine, before.device) == ("auto", "auto")  # nothing built yet: what was asked
    worker.engine = SimpleNamespace(version=3, name="transformers", device="cpu")
    after = worker._info()
    assert (after.engine, after.device, after.version) == ("transformers", "cpu", 3)


def test_a_worker_a_push_began_for_waits_for_its_relays_repair_before_pulling_the_whole_version(caplog):
    """A stripe co-owner pushed its own tree (the store is open) but not another owner's pulled
    the whole version at `fallback_s`, and the learner took that pull for a lie about the tree it
    had: its relay repairs the missing spans itself, so the worker waits once more first."""
    import time as clock

    from broadcast.manifest import build_manifest
    from broadcast.signing import sign_manifest

    async def run(stall_s: float) -> float:
        key = SigningKey.generate()
        worker = Worker(load_worker_config(None, []), "http://127.0.0.1:1", "token")
        worker.broadcast = P.BroadcastInfo(mode="chain", public_key=key.public_key().to_text(), fallback_s=0.3)
        worker.engine = SimpleNamespace(version=3)
        worker.relay = Relay("w", key.public_key(), host="127.0.0.1", port=0, stall_timeout=stall_s)
        await worker.relay.start()
        try:
            await worker.relay._new_store(sign_manifest(key, build_manifest(bytes(1 << 18), 5, chunk_size=1 << 16)))
            start = clock.monotonic()
            # (the open store stands for the pushed delta: v6's, keyed "v5" here, whole key "v6")
            await worker._fetch(None, P.PushAnnouncement(version=6, key="v6", delta_key="v5",
                                                         source=f"http://127.0.0.1:{_closed_port()}"))
            return clock.monotonic() - start
        finally:
            await worker.relay.stop()

    with caplog.at_level(logging.INFO, logger="echo.worker"):
        waited = asyncio.run(run(stall_s=0.1))
    assert waited >= 2 * 0.3  # the push's wait, then the repair's, before the whole pull
    assert any("pulling v6" in r.getMessage() for r in caplog.records)
    # A relay gives a stalled parent up within twice its stall timeout, and repairs only then:
    # a leaf whose stripe owner stalled pulled whole before its repair could, and every honest
    # owner was blamed with the staller (an API-only tester, 2026-12-07).
    with caplog.at_level(logging.INFO, logger="echo.worker"):
        waited = asyncio.run(run(stall_s=0.5))
    assert waited >= 0.3 + 2 * 0.5


def test_a_workers_heartbeat_reports_its_relays_pushes_with_the_childs_receipt():
    """Two real relays, keyed as `echo-worker` keys them (the hash of the credential's secret): the
    parent pushes a version to the child, the child answers with its receipt, and the parent
    worker's next report carries it, valid for the learner (`broadcast.receipts`)."""
    import numpy as np

    from broadcast.receipts import receipt_key, valid
    from broadcast.source import Source
    from broadcast.transport import Hop

    blob = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()

    async def run() -> P.Report:
        key = SigningKey.generate()
        worker = Worker(load_worker_config(None, []), "http://127.0.0.1:1", "token")
        worker.broadcast = P.BroadcastInfo(mode="chain", public_key=key.public_key().to_text())
        await worker._start_relay("w1", "w1.parent-secret")
        child = Relay("w2", key.public_key(), host="127.0.0.1", port=0, receipt_key=receipt_key("child-secret"))
        await child.start()
        source = Source(key, host="127.0.0.1", port=0)
        await source.start()
        try:
            full, _ = await source.publish(blob, 1, chunk_size=256 << 10)
            await source.push(full.manifest.key, [[Hop("w1", worker.relay.url), Hop("w2", child.url)]])
            await child.wait("v1", 30)
            await worker.relay.wait_settled("v1", 30)
            return worker._info()
        finally:
            await child.stop()
            await worker.relay.stop()
            await source.stop()

    report = asyncio.run(run())
    [d] = report.deliveries
    assert (d.key, d.child, d.tree) == ("v1", "w2", 0)
    assert valid(receipt_key("child-secret"), d.receipt, "v1", 0, "w1", "w2")


def test_a_pull_on_a_relay_stopped_meanwhile_fails_as_a_broadcast_error_the_worker_handles():
    """A worker joining again stops its relay and starts another; a pull begun on the old one made
    a transport on a thread, where aiohttp found no event loop: an uncaught RuntimeError killed
    the pull ("Task exception was never retrieved"; a new user, 2026-12-07)."""
    import pytest

    from broadcast.manifest import BroadcastError
    from broadcast.transport import Hop

    async def run() -> None:
        relay = Relay("w", SigningKey.generate().public_key(), host="127.0.0.1", port=0)
        await relay.start()
        await relay.stop()
        with pytest.raises(BroadcastError):  # what `Worker._fetch` catches and logs
            await relay.fetch("v1", [Hop("source", f"http://127.0.0.1:{_closed_port()}")])

    asyncio.run(run())


def test_a_learner_that_does_not_answer_is_said_once_then_every_half_minute(caplog, monkeypatch):
    """While the learner was down a worker logged two lines a second, ~1,000 over its 600 s
    timeout (a new user, 2026-12-07): now once, then every UNANSWERED_EVERY_S, and once more
    when it answers again."""
    import worker.rollout as rollout

    now = [100.0]
    monkeypatch.setattr(rollout.time, "monotonic", lambda: now[0])
    worker = Worker(load_worker_config(None, []), "http://127.0.0.1:1", "token")
    with caplog.at_level(logging.INFO, logger="echo.worker"):
        for _ in range(60):  # 30 s of retries, two a second
            worker._unanswered_now("heartbeats", ConnectionRefusedError("refused"))
            now[0] += 0.5
        worker._unanswered_now("heartbeats", ConnectionRefusedError("refused"))
        worker._answered("heartbeats")
        worker._answered("heartbeats")  # already said
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3, said
    assert "did not answer heartbeats (refused)" in said[0] and "for 30 s" in said[1]
    assert "answers heartbeats again" in said[2]
