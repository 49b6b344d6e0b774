"""The rollout loop of one worker: join, install snapshots, lease → play episodes → push.

Snapshots download in the background while the engine generates; a new version is installed
between two generation batches, so groups already in flight keep the version that generated
them and every later group is stamped with the new one.

Leases are long-polled: with nothing to hand out the learner holds the request until there is.
A learner that stops answering is waited for (`[worker] learner_timeout_s`); one that restarted or forgot this
worker answers `Forgotten`, and the worker joins again by itself. A request it refuses for now
(429, 503: busy, or this worker past its request rate) is sent again after its `Retry-After`.
Generation, scoring and encoding run on threads: the event loop only moves messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import random
import socket
import time
from collections import deque
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from broadcast.star import BlobError, BlobInfo
from echo import collector, dirfiles, loopwatch
from echo import protocol as P
from echo.chat import ChatError
from echo.episodes import EpisodeError, Episodes
from echo.tasks import Prompt, load_task
from echo.wire import GroupMsg, SampleMsg, Submission
from worker.client import Forgotten, LearnerClient, LearnerError, RunFinished
from worker.config import WorkerConfig
from worker.engines import Engine, EngineError, GenerationParams, make_engine

QUARANTINED = 3  # the exit code of a worker the learner quarantined (docs/workers.md)
log = logging.getLogger("echo.worker")

# A request the learner refuses for now (429, 503: it is busy, or this worker is past its request
# rate) is sent again after the Retry-After it gave, at most this long (a default when it gave none).
RETRY_AFTER_MAX_S = 30.0
RETRY_AFTER_DEFAULT_S = 2.0
RESENDS = 8  # times one upload (an eval answer, a release) is sent again before it is given up
UNANSWERED_EVERY_S = 30.0  # a learner that does not answer is said so once in this long


def retry_wait(e: LearnerError) -> float:
    """Seconds to wait before resending a request refused with 429/503: its Retry-After, bounded,
    spread a little (the learner tells every worker it refused at once the same number)."""
    wait = e.retry_after if e.retry_after > 0 else RETRY_AFTER_DEFAULT_S
    return min(wait, RETRY_AFTER_MAX_S) * random.uniform(1.0, 1.25)


class RateMeter:
    """Smoothed delivered rollouts/s: accepted, rewarded rollouts over wall time between
    deliveries, so waiting for leases counts against it. Capped by what the learner consumes
    (back-pressure), so it measures demand, not what this machine could do."""

    def __init__(self, half_life: float = 10.0):
        self.half_life, self.rate, self._last = half_life, 0.0, time.monotonic()

    def add(self, rollouts: int, now: float) -> None:
        seconds, self._last = now - self._last, now
        if seconds <= 0:
            return
        instant = rollouts / seconds
        weight = 1.0 if self.rate == 0 else 1 - 0.5 ** (seconds / self.half_life)
        self.rate += weight * (instant - self.rate)


class CapacityMeter:
    """Rollouts per second of engine-busy time: generating and scoring a lease (and the
    emulated slowness of a throttled worker), never waiting for a lease, idled by the scheduler
    or held back by the learner. What the scheduler provisions with.

    Exponentially weighted sums of rollouts and busy seconds, with a half-life in busy seconds,
    so a long batch weighs as much as several short ones of the same total time.
    """

    def __init__(self, half_life_s: float = 30.0):
        self.half_life_s = half_life_s
        self.rollouts = self.busy = 0.0

    def add(self, rollouts: int, busy_s: float) -> None:
        if busy_s <= 0:
            return
        keep = 0.5 ** (busy_s / self.half_life_s)
        self.rollouts = keep * self.rollouts + rollouts
        self.busy = keep * self.busy + busy_s

    @property
    def rate(self) -> float:
        return self.rollouts / self.busy if self.busy > 0 else 0.0


class Worker:
    def __init__(self, cfg: WorkerConfig, url: str, token: str):
        self.cfg = cfg
        self.url, self.token = url, token
        self.name = cfg.worker.name or f"{socket.gethostname()}-{os.getpid()}"
        self.engine: Engine | None = None
        self.pending: tuple[int, bytes] | None = None  # downloaded, waiting to be installed
        self.pending_manifest = None  # chain mode: the manifest of `pending` (the base of the next delta)
        self.base: tuple | None = None  # chain mode: (manifest, blob) of the installed version
        self.relay = None  # chain mode: broadcast.relay.Relay
        self.broadcast = P.BroadcastInfo()  # how versions travel: the learner says at join
        self.downloading: int | None = None
        self.meter = RateMeter()  # delivered
        self.capacity = CapacityMeter()
        self.rollouts = 0
        self.stopped = asyncio.Event()
        self.unreachable = False
        self.give_up_s = cfg.worker.learner_timeout_s  # no heartbeat answered this long: the learner is gone
        self._unanswered: dict[str, tuple[float, float]] = {}  # what -> (unanswered since, last said)
        self.active = asyncio.Event()  # the learner's scheduler may idle this worker
        self.active.set()
        # (version, installed at, received at, install seconds): T_bcast and install time, apart
        self.installs: deque[tuple[int, float, float, float]] = deque(maxlen=32)
        self.received_at: dict[int, float] = {}  # version -> when it arrived whole and verified
        self.rtt: float | None = None  # seconds, the latest heartbeat's round trip
        self.quarantined = ""  # why the learner stopped taking this worker's work
        self.failed = ""  # why this worker stopped on an error of its own
        self.arrived = asyncio.Event()  # a newer version was downloaded or pushed (staged in `pending`)
        self._rejoining = asyncio.Lock()
        self.joined: P.JoinReply | None = None

    def _info(self) -> P.Report:
        w = self.cfg.worker
        now = time.monotonic()
        return P.Report(
            name=self.name[:64], version=self.engine.version if self.engine else -1,
            rollouts_per_s=round(self.meter.rate, 4), capacity_per_s=round(self.capacity.rate, 4),
            price_per_hour=w.price_per_hour,
            # what runs, once it does: not the config's "auto"
            gpu=(w.gpu or _gpu_name())[:64], device=(self.engine.device if self.engine else self.cfg.engine.device)[:64],
            engine=self.engine.name if self.engine else self.cfg.engine.type,
            download_mbit=w.download_mbit, upload_mbit=w.upload_mbit, expected_rollouts_per_s=w.max_rollouts_per_s,
            # When each recent version was installed, as "seconds ago" (clocks differ between machines).
            installs=[P.Install(version=v, installed_ago=round(now - t, 4), received_ago=round(now - r, 4),
                                install_s=round(d, 4)) for v, t, r, d in self.installs],
            relay_url=self.relay.url if self.relay is not None else "",
            # Measured links: the heartbeat round trip, and each finished version's goodput
            # (broadcast.links); the learner plans the next broadcast with them.
            rtt_ms=None if self.rtt is None else round(self.rtt * 1e3, 3),
            links=[s.to_dict() for s in self.relay.link_samples()][-16:] if self.relay is not None else [],
            # The pushes its relay made that children took whole, with their receipts: what clears
            # it when a child pulls them from the learner anyway (broadcast.receipts).
            deliveries=[P.Delivery(key=k, child=c, tree=t, receipt=r)
                        for k, c, t, r in self.relay.deliveries()] if self.relay is not None else [],
        )

    async def run(self) -> int:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            client = LearnerClient(session, self.url, self.token)
            joined = await self._join(client)
            log.info("%s joined %s as %s", self.name, self.url, client.worker_id)
            self.joined = joined
            # Beat from the start: loading the engine can take long, and silence means dead.
            beats = asyncio.create_task(self._heartbeats(client))
            beats.add_done_callback(self._beats_ended)
            try:
                self.broadcast = joined.broadcast
                if self.broadcast.mode == "chain":
                    await self._start_relay(client.worker_id, client.credential)
                self.task = await asyncio.to_thread(load_task, joined.task.name, await self._task_options(client, joined.task))
                self.task.check_here()  # what its environment reads here (poker's LLM opponent), before any lease
                e = self.cfg.engine
                # LoRA runs: versions are adapters on the base, which this worker loads once (and
                # make_engine checks by digest): its own copy, or the learner's.
                lora = joined.lora
                model_dir = (e.base_dir if lora is not None and e.base_dir is not None
                             else await self._fetch_model_dir(client, weights=lora is not None))
                self.engine = await asyncio.to_thread(make_engine, e.type, model_dir, e.device, e.dtype, e.threads,
                                                      self.cfg.worker.seed * 1000 + int(client.worker_id.lstrip("w") or 0),
                                                      lora)
                self.engine.sampling = (joined.rollout.temperature, joined.rollout.top_p)  # what its installs prove
                self.tokenizer = await asyncio.to_thread(_load_tokenizer, model_dir)
                r = joined.rollout
                # The learner's rules: what ends a turn, how the environment's messages become tokens, the budgets.
                self.episodes = Episodes.of(self.task, self.tokenizer, chat_template=r.chat_template,
                                            template_kwargs=r.chat_template_kwargs, stop_ids=r.stop_ids,
                                            max_new_tokens=r.max_new_tokens, max_tokens=r.max_tokens,
                                            max_turns=r.max_turns, scored=not r.scored_by_learner)
                if self.episodes.scored:  # (unscored: one-turn, nothing of the environment played here)
                    self.episodes.check_playable()  # the learner's model's tokenizer, so this holds there too
                pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
                self.params = GenerationParams(n=r.group_size, max_new_tokens=r.max_new_tokens,
                                               temperature=r.temperature, top_p=r.top_p,
                                               stop_ids=self.episodes.stop_ids, pad_id=pad)
                if joined.snapshot is not None:  # a late joiner pulls the newest version whole
                    await self._fetch(client, joined.snapshot)
                gc.freeze()  # the engine's objects stay out of the cyclic collector's full passes
                loopwatch.watch(f"echo-worker {self.name}")
                # Collections on a clock, as the learner's (`echo.collector`): an automatic full pass
                # came whenever allocation said, and a fresh-clone CI's vLLM worker playing
                # multi-turn episodes spent 331 ms of its loop in one over 752k objects.
                collector.serve()
                collecting = asyncio.create_task(collector.collections())
                try:
                    await self._loop(client)
                finally:
                    collecting.cancel()
            except RunFinished:
                pass
            except aiohttp.ClientConnectionError:
                if not self.stopped.is_set():
                    raise
                # Told the run finished, then the learner closed while a request was in flight: done.
            finally:
                beats.cancel()
                if self.engine is not None:
                    self.engine.close()
                if self.relay is not None:
                    await self.relay.stop()
        if self.quarantined:
            log.error("%s: quarantined by the learner: %s", self.name, self.quarantined)
            return QUARANTINED
        if self.unreachable or self.failed:
            return 1
        log.info("%s: run finished after %d rollouts", self.name, self.rollouts)
        return 0

    async def _rejoin(self, client: LearnerClient, credential: str) -> None:
        """The learner forgot `credential` (it restarted, or this worker was silent too long):
        join again — once, however many calls noticed — and carry on with what is installed."""
        async with self._rejoining:
            if client.credential != credential:
                return  # another task already joined again
            if self.relay is not None:  # the relay is named by the worker id, which changes
                # Before the join: the join's report named the old relay, the learner probed it
                # as it was stopped, found it shut, and planned this worker as behind NAT for a
                # minute after every resume (a new user, 2026-12-07). Its successor is reported
                # by the next heartbeat, and probed then.
                old, self.relay = self.relay, None  # first: a pull starting meanwhile must not use it
                await old.stop()
            joined = await self._join(client)
            log.info("%s: joined %s again as %s", self.name, self.url, client.worker_id)
            self.joined = joined
            self.broadcast = joined.broadcast
            if self.broadcast.mode == "chain":
                await self._start_relay(client.worker_id, client.credential)
            self._notice(client, joined.snapshot)

    async def _join(self, client: LearnerClient) -> P.JoinReply:
        """Join, waiting out the learner's join limits (429, 503: as long as it says) and a learner
        not up yet (up to `learner_timeout_s`); any other refusal is final."""
        since = time.monotonic()
        while True:
            try:
                return await client.join(self._info())
            except LearnerError as e:
                if e.status not in (429, 503):
                    raise
                # The learner's own words: a hold says why (a worker of this address was quarantined), a full
                # fleet or the join rate names its setting; an honest neighbour should read them.
                log.info("%s: the learner is not taking joins now (%s); retrying in %.0f s", self.name,
                         e.message or e.reason, max(1.0, e.retry_after))
                await asyncio.sleep(max(1.0, e.retry_after) * random.uniform(1.0, 1.5))  # spread a herd
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                if time.monotonic() - since > self.give_up_s:
                    raise
                log.warning("%s: cannot reach the learner (%s); retrying", self.name, e)
                await asyncio.sleep(2.0)

    async def _calling(self, client: LearnerClient, call, what: str = "", patience: float | None = None):
        """Run `call()` through the learner's outages: rejoin when forgotten; retry while it does
        not answer, until `give_up_s` (the heartbeats decide that and stop the worker). A refusal
        for now (429, 503) is waited out as its Retry-After says and the same call sent again
        (`what` names it in the log line): before, a refused upload was dropped, its groups
        generated for nothing, and a refused lease request ended the worker. With `patience`
        (work that goes stale), at most `RESENDS` times and for `patience` seconds after the first
        refusal; then the refusal is raised."""
        first, resends = None, 0
        while not self.stopped.is_set():
            credential = client.credential
            try:
                result = await call()
                self._answered(what or "a request")
                return result
            except Forgotten:
                try:
                    await self._rejoin(client, credential)
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                    log.warning("%s: joining again failed (%s); retrying", self.name, e)
                    await asyncio.sleep(1.0)
            except LearnerError as e:
                if e.status not in (429, 503):
                    raise
                now, wait = time.monotonic(), retry_wait(e)
                first = first or now
                if patience is not None and (resends >= RESENDS or now + wait - first > patience):
                    raise
                resends += 1
                log.info("%s: the learner refused %s for now (%d %s); sending it again in %.1f s", self.name,
                         what or "a request", e.status, e.reason, wait)
                await asyncio.sleep(wait)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                self._unanswered_now(what or "a request", e)
                await asyncio.sleep(1.0)
        raise RunFinished("stopped")

    def _unanswered_now(self, what: str, e: Exception) -> None:
        """The learner did not answer `what`: said at once, then every UNANSWERED_EVERY_S while it
        goes on. A learner down for the workers' 600 s timeout was ~1,000 lines of the same two
        (a new user, 2026-12-07). `_answered` ends it."""
        now = time.monotonic()
        since, said = self._unanswered.get(what, (now, -UNANSWERED_EVERY_S))
        if now - said >= UNANSWERED_EVERY_S:
            log.warning("%s: the learner did not answer %s%s (%s); retrying", self.name, what,
                        f" for {now - since:.0f} s" if now > since else "", e)
            said = now
        self._unanswered[what] = (since, said)

    def _answered(self, what: str) -> None:
        if self._unanswered.pop(what, None) is not None:
            log.info("%s: the learner answers %s again", self.name, what)

    async def _in_turn(self, call, what: str):
        """A download of weights, asked again while the learner says the streams to this
        address are all busy (429 `busy`: workers behind one address take turns)."""
        while True:
            try:
                return await call()
            except LearnerError as e:
                if (e.status, e.reason) != (429, "busy"):
                    raise
                wait = retry_wait(e)
                log.info("%s: the learner is sending weights to others at this address; asking for %s again in "
                         "%.0f s", self.name, what, wait)
                await asyncio.sleep(wait)

    async def _fetch_model_dir(self, client: LearnerClient, weights: bool = False) -> Path:
        files = await self._in_turn(lambda: client.model_files(weights), "the model")
        try:
            return await asyncio.to_thread(dirfiles.write, files, self.cfg.worker.cache_dir, "model")
        except ValueError as e:
            raise LearnerError(0, "bad-model-file", f"the model directory: {e}") from None

    async def _task_options(self, client: LearnerClient, info: P.TaskInfo) -> dict:
        """The task's options, each of its model directories (poker's LLM opponent) pointing at a
        copy here with the learner's digest: the one the option names where it digests the same,
        else the learner's, fetched into the cache. An opponent that plays otherwise than the
        learner's would make every replayed episode a reward mismatch, and this worker quarantined."""
        options = dict(info.options)
        for option, want in info.model_dirs.items():
            named = str(options.get(option) or "")
            here = bool(named) and Path(named).is_dir()  # (Path("") would be the working directory)
            if here and await asyncio.to_thread(dirfiles.digest, Path(named)) == want:
                continue
            files = await self._in_turn(lambda: client.task_dir(option), f"task.{option}")
            if await asyncio.to_thread(dirfiles.files_digest, files) != want:  # up to 2 GiB: not on the loop
                raise LearnerError(0, "bad-task-dir", f"task.{option} as the learner sent it does not digest to "
                                                      "what its join reply said")
            try:
                options[option] = str(await asyncio.to_thread(dirfiles.write, files, self.cfg.worker.cache_dir, option, want))
            except ValueError as e:
                raise LearnerError(0, "bad-task-dir", f"task.{option}: {e}") from None
            log.info("%s: task.%s fetched from the learner into %s (%s)", self.name, option, options[option],
                     "this machine's copy differs" if here else f"no copy at {named!r} here")
        return options

    async def _start_relay(self, worker_id: str, credential: str) -> None:
        from broadcast.receipts import receipt_key
        from broadcast.relay import Relay
        from broadcast.signing import VerifyKey
        from broadcast.tickets import proof_key
        from broadcast.transport import local_address_toward

        w = self.cfg.worker
        key = receipt_key(credential.partition(".")[2])  # `<worker id>.<secret>`: what the learner keeps of it
        host = w.relay_host
        if host == "auto":  # where the learner sees this worker connect from, unless a NAT lies between
            host = await asyncio.to_thread(local_address_toward, urlsplit(self.url).hostname or "127.0.0.1")
        relay = Relay(worker_id, VerifyKey.from_text(self.broadcast.public_key), host=host,
                      port=w.relay_port, public_url=w.advertise_url or None, on_complete=self._received,
                      transport=w.relay_transport, read_token=self.broadcast.read_token or None,
                      receipt_key=key, proof_key=proof_key(key))
        await relay.start()
        self.relay = relay  # only now: a heartbeat meanwhile would report its unbound port 0
        log.info("%s: relay listening at %s", self.name, self.relay.url)

    async def _received(self, received) -> None:
        """A version arrived whole and verified (pushed down a chain or pulled): decode, stage."""
        from broadcast.delta import DeltaError, decode_async

        m = received.manifest
        base_manifest, base_blob = self.base if self.base else (None, None)
        try:
            blob = await decode_async(m, received.data, base_blob, base_manifest)
        except DeltaError as e:  # not our base after all: the full version is one pull away
            log.warning("%s: %s", self.name, e)
            return
        if self.pending is None or m.version > self.pending[0]:
            # No copy: the relay's buffer (or the delta's decoded one) is staged and installed from,
            # and kept as the next delta's base; a copy was a model's size more (16 GB at 8B).
            self.pending, self.pending_manifest = (m.version, blob), m
            self.received_at[m.version] = time.monotonic()
            self.arrived.set()

    async def _fetch(self, client: LearnerClient, snapshot: P.Snapshot, on_route: bool | None = None) -> None:
        """Get an announced version: by star download, or in chain mode from the push — and if the
        push does not arrive within `fallback_s`, by pulling the full version from the source. A
        version whose push was planned without this worker is pulled at once: one published before
        this identity joined, or one the learner says is not pushed to it (`on_route` False: it was
        idle then). A worker idled at join, activated, waited out fallback_s for a push never
        coming: 10 of a one-worker demo's first 18 s, and a fresh-clone CI run's whole 120 s
        where the worker joined before v0 was published."""
        if self.relay is None or not isinstance(snapshot, P.PushAnnouncement):  # nothing pushes it
            return await self._download(client, BlobInfo(snapshot.version, snapshot.size, snapshot.sha256))
        from broadcast.relay import BroadcastError
        from broadcast.transport import Hop

        version = snapshot.version
        self.downloading = version
        try:
            keys = [k for k in (snapshot.delta_key, snapshot.key) if k]
            at_join = self.joined.snapshot.version if self.joined and self.joined.snapshot else -1
            if version > at_join and on_route is not False:
                waits = [asyncio.create_task(self.relay.wait(k)) for k in keys]
                done, waiting = await asyncio.wait(waits, timeout=self.broadcast.fallback_s,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for t in waiting:
                    t.cancel()
                if any(not t.cancelled() and t.exception() is None for t in done):
                    return  # on_complete staged it
            # A push of some trees began: the relay pulls the spans that did not come from the
            # route's ancestors, then the source (its own repair), under the pushed key. Wait for
            # that before pulling the whole version, as long as the repair may take (a stalled
            # parent is given up on within twice its stall timeout): a whole pull by a member
            # pushed a tree, or by a leaf, would tell the learner every parent swallowed its tree
            # (`broadcast.forwarding`), and honest stripe owners were demoted with the one that did.
            begun = [k for k in keys if k in self.relay.stores]
            if begun:
                repair_s = max(self.broadcast.fallback_s, 2 * self.relay.stall_timeout)
                with contextlib.suppress(asyncio.TimeoutError, BroadcastError):
                    await asyncio.wait_for(self.relay.wait(begun[0]), repair_s)
                    return
            # Pull only what would be installed: not while idled (the newest comes at activation;
            # an idled fleet pulled every version whole from the learner's uplink) and not a
            # version older than one installed or staged meanwhile.
            if self.active.is_set() and self._held_version() < version:
                log.info("%s: pulling v%d from the learner", self.name, version)
                await self.relay.fetch(snapshot.key, [Hop("source", snapshot.source)])
        except (BroadcastError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("%s: v%d did not arrive: %s", self.name, version, e)
        finally:
            self.downloading = None

    async def _download(self, client: LearnerClient, info: BlobInfo) -> None:
        """Fetch and verify one version. A failure (the learner already dropped that version,
        a broken transfer) is logged; the next announcement starts a fresh download."""
        self.downloading = info.version
        try:
            blob = await client.snapshot(info)
        except (BlobError, LearnerError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("%s: download of v%d failed: %s", self.name, info.version, e)
            return
        finally:
            self.downloading = None
        if self.pending is None or info.version > self.pending[0]:
            self.pending = (info.version, blob)
            self.received_at[info.version] = time.monotonic()
            self.arrived.set()

    def _beats_ended(self, beats: asyncio.Task) -> None:
        """Heartbeats end only when the worker stops: one that died of an error of ours must not
        leave a worker that leases on, unheard (its relay URL, its links), so it stops."""
        if beats.cancelled() or beats.exception() is None:
            return
        e = beats.exception()
        log.error("%s: heartbeats failed, stopping: %s: %s", self.name, type(e).__name__, e)
        self.failed = f"heartbeats failed: {e}"
        self.stopped.set()
        self.active.set()  # wake the loop so it can exit

    async def _heartbeats(self, client: LearnerClient) -> None:
        failing_since = None
        while not self.stopped.is_set():
            credential = client.credential
            try:
                sent = time.monotonic()
                reply = await client.heartbeat(self._info())
                self.rtt = time.monotonic() - sent
                if reply.state == "quarantined":
                    self.quarantined = reply.message
                    self.stopped.set()
                    self.active.set()  # wake the loop so it can exit
                elif reply.state == "stop":
                    self.stopped.set()
                    self.active.set()
                elif reply.state == "idle" and self.active.is_set():
                    log.info("%s: idled by the learner's scheduler", self.name)
                    self.active.clear()
                elif reply.state == "active" and not self.active.is_set():
                    log.info("%s: activated by the learner's scheduler", self.name)
                    self.active.set()
                if reply.read_token:  # the learner renewed this worker's read ticket: present the new one
                    self.broadcast = self.broadcast.model_copy(update={"read_token": reply.read_token})
                    if self.relay is not None:
                        self.relay.read_token = reply.read_token
                if reply.reachable is False and self.relay is not None and self.broadcast.source:
                    if self.relay.source_url is None:  # said once: why this relay forwards nothing
                        log.info("%s: the learner does not connect to this relay at %s (behind NAT, or not the "
                                 "address this worker connects from): it pulls each version from its parents. To "
                                 "forward versions too, bind --worker.relay_host where others reach it, or give "
                                 "--worker.advertise_url", self.name, self.relay.url)
                    self.relay.follow(self.broadcast.source)  # behind NAT: pull what the routes assign
                self._notice(client, reply.snapshot, reply.on_route)
                failing_since = None
                self._answered("heartbeats")
            except Forgotten:
                try:
                    await self._rejoin(client, credential)
                except (aiohttp.ClientError, LearnerError, asyncio.TimeoutError) as e:
                    log.warning("%s: joining again failed: %s", self.name, e)
                continue
            except (aiohttp.ClientError, LearnerError, asyncio.TimeoutError) as e:
                if isinstance(e, LearnerError):
                    log.warning("%s: heartbeat failed: %s", self.name, e)
                else:  # the learner down: said at once, then every UNANSWERED_EVERY_S
                    self._unanswered_now("heartbeats", e)
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > self.give_up_s:
                    log.error("%s: the learner has not answered for %.0f s; leaving", self.name, self.give_up_s)
                    self.unreachable = True
                    self.stopped.set()
                    self.active.set()
                if isinstance(e, LearnerError) and e.status in (429, 503):
                    # The next one after its Retry-After, but before this worker's leases lapse.
                    wait = min(retry_wait(e), self.joined.lease_ttl / 2)
                    await asyncio.sleep(max(0.0, wait - self.joined.heartbeat_interval))
            await asyncio.sleep(self.joined.heartbeat_interval)

    def _held_version(self) -> int:
        """The newest version installed or staged to be (-1: none)."""
        return max(self.engine.version if self.engine else -1, self.pending[0] if self.pending else -1)

    def _notice(self, client: LearnerClient, snapshot: P.Snapshot | None, on_route: bool | None = None) -> None:
        """Start downloading an announced version newer than anything installed or on its way
        (`on_route`: whether the learner pushes it to this worker; see `_fetch`)."""
        if self.engine is None:
            return  # still starting; the snapshot announced at join is fetched then
        newest_known = max(self._held_version(), self.downloading if self.downloading is not None else -1)
        if snapshot is not None and snapshot.version > newest_known:
            self._download_task = asyncio.create_task(self._fetch(client, snapshot, on_route))

    async def _install_pending(self) -> None:
        if self.pending is None:
            return
        version, blob = self.pending
        manifest, self.pending, self.pending_manifest = self.pending_manifest, None, None
        if version <= self.engine.version:
            return
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(self.engine.install, version, blob)
        except EngineError as e:  # refused (incomplete, or the engine did not take it): say so, keep going
            log.error("%s: did not install v%d: %s", self.name, version, e)
            return
        if manifest is not None:
            self.base = (manifest, blob)
        now = time.monotonic()
        received = self.received_at.pop(version, now)
        self.received_at = {v: t for v, t in self.received_at.items() if v > version}
        self.installs.append((version, now, received, time.perf_counter() - t0))
        log.info("%s: installed v%d in %.3f s", self.name, version, time.perf_counter() - t0)
        # What the engine built to install and generate stays out of the collector's full passes: a
        # fresh-clone CI's vLLM worker held 750k such objects by v8 and a full pass took 396 ms of
        # its loop. Reference counting still frees them; only cycles among them are never collected
        # (each evicted broadcast version was one until 2026-11-28: its buffer was kept for good).
        gc.freeze()

    async def _loop(self, client: LearnerClient) -> None:
        while not self.stopped.is_set():
            await self.active.wait()
            if self.stopped.is_set():
                break
            await self._install_pending()
            if self.engine.version < 0:
                await self._version_arrives(1.0)
                continue
            version = self.engine.version  # the weights that will generate this whole lease
            wait_s = self.joined.long_poll_s
            asked = time.monotonic()
            lease = await self._calling(client, lambda: client.lease(self.cfg.worker.prompts_per_lease, version, wait_s),
                                        "a lease request")
            self._notice(client, lease.snapshot, lease.on_route)
            if lease.lease_id is None:
                if lease.empty == "install":  # too stale to be trained on: wait for the announced version
                    await self._version_arrives(5.0)
                elif time.monotonic() - asked < 0.5 * wait_s or wait_s == 0:
                    await asyncio.sleep(0.5)  # answered at once (idled, or no long poll): do not spin
                continue
            prompts = [Prompt(p.id, p.text, p.answer, p.seed) for p in lease.prompts]
            if lease.eval_version is not None:
                await self._evaluate(client, lease, prompts, version)
                continue
            await self._rollout(client, lease, prompts, version)

    async def _version_arrives(self, timeout: float) -> None:
        self.arrived.clear()
        if self.pending is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), timeout)

    async def _rollout(self, client: LearnerClient, lease: P.LeaseReply, prompts: list[Prompt], version: int) -> None:
        throttle = self.cfg.worker.max_rollouts_per_s
        t0 = time.monotonic()
        try:
            msgs = await asyncio.to_thread(self._generate, lease, prompts, version)
        except (EpisodeError, ChatError) as e:  # the task's environment failed, not this lease: hand it back
            log.error("%s: the task's environment failed: %s; %d prompts handed back", self.name, e, len(prompts))
            with contextlib.suppress(LearnerError, aiohttp.ClientError, RunFinished):
                await client.release(lease.lease_id)
            return
        n_rollouts = sum(len(g.samples) for g in msgs)
        if throttle:  # emulate a slower machine: hold the results until the budgeted time
            await asyncio.sleep(max(0.0, n_rollouts / throttle - (time.monotonic() - t0)))
        self.capacity.add(n_rollouts, time.monotonic() - t0)  # busy: generate, score, emulated slowness
        if self.cfg.engine.on_new_version == "abort" and self.pending and self.pending[0] > version:
            # A newer version arrived while this batch ran: hand the prompts back rather than
            # submit work of the old weights (it is re-issued, and generated with the new one).
            with contextlib.suppress(LearnerError):
                await self._calling(client, lambda: client.release(lease.lease_id), "a release",
                                    self._patience(lease))
            log.info("%s: v%d arrived during a v%d batch; handed %d prompts back", self.name,
                     self.pending[0], version, len(prompts))
            return
        try:
            reply = await self._calling(client, lambda: client.submit(Submission(client.worker_id, lease.lease_id, msgs)),
                                        f"an upload of {len(msgs)} groups", self._patience(lease))
        except LearnerError as e:
            if e.reason == "quarantined":
                self.quarantined = e.message
                self.stopped.set()
                return
            # Refused whole (malformed, unknown lease, duplicate): hand back whatever the lease
            # still holds, so its prompts are re-issued now instead of when it expires.
            log.warning("%s: %d groups of v%d refused: %s", self.name, len(msgs), version, e)
            with contextlib.suppress(LearnerError, aiohttp.ClientError, RunFinished):
                await client.release(lease.lease_id)
            return
        self.rollouts += reply.accepted * self.params.n
        self.meter.add(reply.accepted * self.params.n, time.monotonic())

    @staticmethod
    def _patience(lease: P.LeaseReply) -> float:
        """How long a refused upload of `lease` keeps being sent again: the lease's TTL (heartbeats
        renew the lease meanwhile), never less than `RETRY_AFTER_MAX_S`; past it, its prompts are
        better handed back and generated afresh."""
        return max(lease.expires_in or 0.0, RETRY_AFTER_MAX_S)

    def _generate(self, lease: P.LeaseReply, prompts: list[Prompt], version: int) -> list[GroupMsg]:
        """Play the lease's episodes, `group_size` per prompt, all on `version` (blocking: runs on a thread)."""
        def generate(contexts: list[list[int]], n: int, max_new_tokens: int):
            return self.engine.generate(contexts, dataclasses.replace(self.params, n=n, max_new_tokens=max_new_tokens))

        played = self.episodes.play([(p, m.prompt_ids) for p, m in zip(prompts, lease.prompts)], generate,
                                    n=self.params.n)
        return [GroupMsg(prompt.id, version, [SampleMsg(e.tokens, e.logprobs, e.reward, e.mask, e.truncated)
                                              for e in episodes])
                for prompt, episodes in zip(prompts, played)]

    async def _evaluate(self, client: LearnerClient, lease: P.LeaseReply, prompts: list[Prompt], version: int) -> None:
        """An eval lease: one greedy sample per prompt with `version`, sent back. The learner keeps
        the answers to itself and scores the completions; the rewards field carries nothing."""
        greedy = dataclasses.replace(self.params, n=1, temperature=0.0, top_p=1.0)

        def generate() -> dict[str, list[int]]:
            groups = self.engine.generate([p.prompt_ids for p in lease.prompts], greedy)
            return {p.id: list(g[0].tokens) for p, g in zip(prompts, groups)}

        completions = await asyncio.to_thread(generate)
        rewards = {pid: 0.0 for pid in completions}
        try:
            await self._calling(client, lambda: client.submit_eval(lease.lease_id, version, rewards, completions),
                                f"the answers of eval lease {lease.lease_id}", self._patience(lease))
        except LearnerError as e:  # the round moved on (restarted, or its lease expired): nothing to keep
            if e.reason == "answered":  # a backup (ours or another's) answered first: as designed
                log.info("%s: eval of v%d not needed: %s", self.name, version, e)
            else:
                log.warning("%s: eval of v%d refused: %s", self.name, version, e)


@functools.cache  # asked at every heartbeat; the answer never changes
def _gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # no torch or a broken driver: the learner only needs a label
        return "cpu"


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
