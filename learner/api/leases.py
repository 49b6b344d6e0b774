"""The lease room: prompts out to workers, long-polled, and back when nobody answers.

    POST /v1/lease     prompts to generate, or an eval lease; long-polls up to `wait_s` when
                       there is nothing to hand out; 410: run finished
    POST /v1/release   hand a lease back unanswered (its prompts are re-issued at once)

It owns the parked requests (`learner.admission.Waiters`) and the prompts' token ids while
they are leased; the books it serves from (`learner.leases.LeaseBook`, the optional
`learner.evals.EvalBook`) are plain logic it drives. Eval leases come before training prompts.

Prompts are encoded off the loop, on one thread of their own, ahead of being leased
(`encode_ahead`): rendering a chat template and resetting an episode's environment take
milliseconds a prompt, which every parked request would otherwise wait through.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from echo import protocol as P
from echo.tasks import Prompt
from learner.admission import Waiters
from learner.api.http import Auth, continue_later, json_error, read_body, reply
from learner.api.run import Run
from learner.buffer import AsyncBuffer
from learner.config import ServerSection
from learner.evals import EvalBook
from learner.leases import LeaseBook, UnknownLease
from learner.metrics import LearnerMetrics

log = logging.getLogger(__name__)

ENCODE_CHUNK = 8  # prompts per call of the encoder thread when encoding ahead


class LeaseRoom:
    def __init__(self, book: LeaseBook, buffer: AsyncBuffer, run: Run, server: ServerSection, *,
                 backpressure: bool, encode, metrics: LearnerMetrics, evals: EvalBook | None = None,
                 waiters: Waiters | None = None, answers: bool = True):
        self.book, self.buffer, self.run, self.server = book, buffer, run, server
        self.answers = answers  # training prompts go out with their answers (not when the learner scores them all)
        self.backpressure, self.metrics, self.evals = backpressure, metrics, evals
        self.encode = encode  # Prompt -> its episode's first token ids (the learner's rendering is authoritative)
        # `is None`, not `or`: an empty Waiters is falsy (it has a length), and the room made its own,
        # deaf to the wake-ups of the learner's (an eval round opening): final evals waited 10 s
        self.waiters = waiters if waiters is not None else Waiters()
        # room goes to who can take it: a worker with room in its window, on a version it may lease with (one
        # that must install first is woken by the version, `published`; woken by room, two passed it between them)
        self.waiters.eligible = lambda worker: (self.book.worker_room(worker.id, time.monotonic()) > 0
                                                and not self._must_install(worker))
        self._token_ids: dict[str, list[int]] = {}
        self._eval_ids: dict[str, list[int]] = {}  # the eval set's, kept: every round leases them again
        self._encoding: dict[str, asyncio.Future] = {}  # prompt id -> the encoder's job that has it
        # A thread of its own: encoding never queues behind uploads on the offload pool, and runs in the order asked.
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="encode")
        self._leased = asyncio.Event()
        # Prompts of uploads admitted and still being checked: no longer outstanding, not yet
        # queued. Uncounted, S = 0 leased past its batch while an upload's rewards were checked.
        self.checking = 0
        self._overdue = (-math.inf, 0)  # (when counted, prompts of overdue leases): `_coming`

    def _must_install(self, worker) -> bool:
        """Is `worker`'s version too stale to be leased with (a newer one must be installed first):
        not trainable any more, or trainable for fewer batches than the groups queued and in flight
        already fill (`StalenessBuffer.version_room`)?"""
        if not (self.server.refuse_stale_leases and worker.version >= 0):
            return False
        buf, version = self.buffer.buffer, self.run.version
        return (not buf.leasable(worker.version, version)
                or buf.version_room(worker.version, version, self._coming()) == 0)

    def _coming(self) -> int:
        """Prompts a version's room counts as coming: leased or being checked, less those overdue
        (a dead worker's leases, until they expire, held every other worker on its version to
        `install`). The overdue ones are counted at most 4 times a second: it scans the leases,
        and this is asked for every waiting worker at each wake."""
        now = time.monotonic()
        if now - self._overdue[0] >= 0.25:
            self._overdue = (now, self.book.overdue(now))
        return max(0, self.book.outstanding + self.checking - self._overdue[1])

    def token_ids(self, prompt: Prompt) -> list[int]:
        """The prompt as the learner's tokenizer encodes it, once per prompt while it is leased
        (a leased prompt was encoded before its lease was answered: this does not encode on the loop)."""
        ids = self._token_ids.get(prompt.id)
        if ids is None:
            ids = self._token_ids[prompt.id] = self.encode(prompt)
        return ids

    async def _encoded(self, prompts, into: dict[str, list[int]]) -> None:
        """`prompts`' token ids in `into`, those missing encoded on the encoder thread, each once: a
        prompt already on the thread (encoded ahead, or for another lease) is waited for."""
        while missing := [p for p in prompts if p.id not in into]:
            ours = [p for p in missing if p.id not in self._encoding]
            theirs = {self._encoding[p.id] for p in missing if p.id in self._encoding}
            if ours:
                job = asyncio.get_running_loop().run_in_executor(self._encoder, lambda: [self.encode(p) for p in ours])
                self._encoding.update((p.id, job) for p in ours)
                try:
                    ids = await job
                finally:
                    for p in ours:
                        self._encoding.pop(p.id, None)
                for p, i in zip(ours, ids):
                    into.setdefault(p.id, i)
            if theirs:  # what failed there, or went to the other table, is encoded here next turn
                await asyncio.gather(*theirs, return_exceptions=True)

    async def encode_ahead(self, ahead: int) -> None:
        """Keep the next `ahead` prompts to be leased encoded (a task for the server's lifetime)."""
        while True:
            self._leased.clear()
            try:
                # A few at a time: a lease whose prompts were not ready waits at most one chunk for the thread.
                while missing := [p for p in self.book.upcoming(ahead) if p.id not in self._token_ids][:ENCODE_CHUNK]:
                    await self._encoded(missing, self._token_ids)
            except Exception:  # a prompt that cannot be encoded fails its lease, where it is reported
                log.exception("encoding prompts ahead of their leases failed")
            await self._leased.wait()

    def close(self) -> None:
        self._encoder.shutdown(wait=False, cancel_futures=True)

    def trained(self, prompt_id: str) -> None:
        """The prompt's group was taken: its token ids are no longer needed here."""
        self._token_ids.pop(prompt_id, None)

    def room(self) -> int:
        """Prompts a lease could be given now."""
        buf = self.buffer.buffer
        if self.run.training_done or (self.backpressure and len(buf) >= buf.capacity):
            return 0
        room = max(0, self.book.max_outstanding - self.book.outstanding)
        if not buf.synchronous:
            return room
        # S = 0: what the batch still needs, less the groups coming (overdue ones' room goes to others)
        return min(room, buf.lease_room(self.run.version, self._coming()))

    def changed(self) -> None:
        """Something every waiting lease request must hear at once (training done, run finished, an eval round)."""
        self.waiters.wake_all()

    def stepped(self) -> None:
        """The learner took a batch and moved on a version: serve the room that freed, and tell
        the waiting workers this version made too stale to be trained on to install a newer one."""
        self.waiters.wake_where(self._must_install)
        self.waiters.wake(self.room())

    def published(self) -> None:
        """A version was announced: the waiting workers whose own is too stale to lease with install it now."""
        self.waiters.wake_where(self._must_install)

    def freed(self, prompts: int, worker_id: str) -> None:
        """`worker_id` answered or gave back `prompts`: as many waiting requests may be served,
        its own among them (its window has room again)."""
        self.waiters.unblock(worker_id)
        self.waiters.wake(prompts)

    def release_worker(self, worker_id: str) -> int:
        """Hand back every lease of a worker (forgotten or quarantined); returns its prompts."""
        leased = 0
        for lease in self.book.release_worker(worker_id):
            leased += len(lease.prompts)
            self.waiters.wake(len(lease.prompts))
        self.waiters.unblock(worker_id)  # its parked requests are answered (quarantined, forgotten)
        return leased

    def renew(self, worker_id: str, now: float) -> None:
        self.book.renew(worker_id, now)
        if self.evals is not None:
            self.evals.renew(worker_id, now)

    def reap(self, now: float) -> None:
        """Expire silent workers' leases so their prompts are re-issued."""
        dead = self.book.expire(now)
        if dead:
            self.metrics.leases_expired.inc(len(dead))
            for lease in dead:
                self.waiters.unblock(lease.worker_id)
            self.waiters.wake(sum(len(lease.prompts) for lease in dead))
        if self.buffer.buffer.synchronous and self.book.overdue(now):  # their room is others' now (`room`)
            self.waiters.wake(self.room())

    def routes(self, auth: Auth) -> list[web.RouteDef]:
        async def lease(request: web.Request) -> web.Response:
            worker = auth.worker(request)
            req = await read_body(request, P.LeaseRequest, self.metrics.rejected)
            worker.version = self.run.installable(req.version)  # what will generate this lease
            if worker.version < req.version:
                self.metrics.claims_clamped.labels("version").inc()
            return await self._lease(worker, req)

        async def release(request: web.Request) -> web.Response:
            worker = auth.worker(request)
            req = await read_body(request, P.ReleaseRequest, self.metrics.rejected)
            try:
                count = self.book.release(req.lease_id, worker.id)
            except UnknownLease as e:
                return json_error(409, "unknown-lease", str(e.args[0]))
            self.freed(count, worker.id)
            return reply(P.ReleaseReply(released=count))

        return [web.post("/v1/lease", lease, expect_handler=continue_later),
                web.post("/v1/release", release, expect_handler=continue_later)]

    async def _lease(self, worker, req: P.LeaseRequest) -> web.Response:
        run, server, buf = self.run, self.server, self.buffer.buffer
        asked = time.monotonic()
        deadline = asked + min(req.wait_s, server.long_poll_s)

        def answer(message: P.LeaseReply) -> web.Response:  # saying how long the request was held
            return reply(message.model_copy(update={"waited_s": round(time.monotonic() - asked, 4),
                                                    "on_route": run.on_route(worker.id)}))

        while True:
            if run.finished:
                worker.told_finished = True
                return json_error(410, "finished", "the run has finished; the worker can exit")
            if worker.quarantined:
                return json_error(403, "quarantined", f"this worker is quarantined: {worker.quarantined}")
            if not worker.active:
                return answer(P.LeaseReply(empty="wait", snapshot=run.announcement))
            now = time.monotonic()
            if self.evals is not None:
                # Only to a worker with accepted training work (any, before the run's first group was
                # accepted): a fresh identity took a round's lease and sat on it (an API-only tester)
                proven = worker.groups_accepted > 0 or buf.stats.accepted == 0
                got_eval = self.evals.lease(worker.id, worker.version, req.max_prompts, now, proven=proven)
                if got_eval is not None:
                    lease_id, version, eval_prompts = got_eval
                    await self._encoded(eval_prompts, self._eval_ids)
                    return answer(P.LeaseReply(
                        lease_id=lease_id, eval_version=version, expires_in=server.lease_ttl,
                        prompts=[P.PromptMsg(id=p.id, text=p.text, answer="", prompt_ids=self._eval_ids[p.id], seed=p.seed)
                                 for p in eval_prompts], snapshot=run.announcement))
            # A worker on a version already too old to be admitted would only generate refusals.
            if self._must_install(worker):
                if self.room():
                    self.waiters.wake(1)  # in case this request was woken for room it cannot use
                # Nothing newer announced yet (the step that made it stale is being published): held
                # until it is, or a star worker heard of it only at its next heartbeat, and a
                # synchronous run (S = 0) took a heartbeat interval a step (2 s; a new user, 2026-12-07)
                announced = getattr(run.announcement, "version", -1)
                if announced > worker.version or now >= deadline:
                    return answer(P.LeaseReply(empty="install", snapshot=run.announcement))
                await self.waiters.wait(deadline - now, worker)
                continue
            room = self.room()
            mine = buf.version_room(worker.version, run.version, self._coming())
            mine = room if mine is None or not server.refuse_stale_leases else min(room, mine)
            got = self.book.lease(worker.id, min(req.max_prompts, mine), now) if mine else None
            if got is not None:
                self._leased.set()
                await self._encoded(got.prompts.values(), self._token_ids)  # done ahead, unless re-issued or a burst
                prompts = [P.PromptMsg.model_construct(id=p.id, text=p.text, answer=p.answer if self.answers else "",
                                                       prompt_ids=self._token_ids[p.id], seed=p.seed)
                           for p in got.prompts.values()]
                if self.room():
                    self.waiters.wake(1)  # room for more: the next waiter may take it
                # Workers learn of new versions here too, without waiting for a heartbeat.
                return answer(P.LeaseReply.model_construct(lease_id=got.id, prompts=prompts, expires_in=server.lease_ttl,
                                                           snapshot=run.announcement, eval_version=None, empty=""))
            if room:
                self.waiters.wake(1)  # this worker's window is full: the room is the next waiter's
            elif self.evals is not None and self.evals.wants_newer(worker.version, run.published_version):
                # Nothing to generate, and an eval round wants a version it can install: parked, a
                # worker installs only between requests, and the run's last eval waited out the poll.
                return answer(P.LeaseReply(empty="install", snapshot=run.announcement))
            if now >= deadline:
                return answer(P.LeaseReply(empty="wait", snapshot=run.announcement))
            await self.waiters.wait(deadline - now, worker)
