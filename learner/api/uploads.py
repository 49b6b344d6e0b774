"""The upload room: trajectories in, checked, into the buffer.

    POST /v1/trajectories   zstd msgpack groups (echo.wire); 4xx names the reason

Peers are untrusted: the upload is decoded bounded (`echo.wire.decode_submission`, off the
event loop), must be the credential's own work in its own leases, of a published version
within the staleness bound; a share of its rewards is recomputed here (`learner.verify`) and a
worker whose claims differ is quarantined. Groups that pass go into the buffer.

Bodies are bounded in time and in total: an upload must arrive within `[server] body_timeout_s`
(a worker trickling bytes holds nothing for long), and the bytes of uploads being read at once
stay under `[server] max_inflight_upload_mb` (past it: 503 with Retry-After), so a fleet of slow
uploaders cannot hold the learner's memory. An upload is counted at the size it declares, which
may not exceed what an honest upload of the prompts its sender holds can be (`echo.wire.max_body`:
413 before a byte is read), and workers that never delivered may hold half the budget together:
32 stalled uploads declaring 8 MiB each, from 16 new identities on each of two addresses, took
all of it, and training stopped for a minute (2026-11-28). A body with a `Content-Encoding` is
refused (415): aiohttp would inflate it, and the bytes held would not be the bytes counted. An
upload whose sender hung up mid-body is counted (`rejected{reason="aborted"}`), not logged.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor

from aiohttp import web

from echo import protocol as P
from echo.wire import CONTENT_TYPE, Rejected, decode_submission, max_body
from learner.api.http import (
    Auth,
    Refusal,
    body_at_most,
    continue_later,
    invite_body,
    json_error,
    read_in_time,
    refuse_encoding,
    refuse_quarantined,
    reply,
)
from learner.api.leases import LeaseRoom
from learner.api.run import Run
from learner.api.workers import WorkerInfo, WorkerRegistry
from learner.buffer import AsyncBuffer, Group
from learner.config import LearnerConfig
from learner.leases import UnknownLease
from learner.metrics import LearnerMetrics
from learner.verify import Verdict


class UploadRoom:
    """`rescore` (a `learner.verify.Rescorer`, or None: rewards are taken as claimed) runs on `offload`.
    Without `claimed_rewards` (the workers were given no answers) a sample's reward is the
    learner's alone: what a worker sent for it is neither used nor evidence."""

    def __init__(self, cfg: LearnerConfig, *, run: Run, buffer: AsyncBuffer, leases: LeaseRoom,
                 registry: WorkerRegistry, metrics: LearnerMetrics, vocab_size: int, offload: Executor,
                 max_tokens: int, stop_ids: tuple[int, ...] = (), turn_tokens: int | None = None, rescore=None,
                 claimed_rewards: bool = True):
        self.max_body_mb, self.rollout, self.max_staleness = cfg.server.max_body_mb, cfg.rollout, cfg.buffer.max_staleness
        self.run, self.buffer, self.leases, self.registry, self.metrics = run, buffer, leases, registry, metrics
        self.vocab_size, self.offload, self.rescore = vocab_size, offload, rescore
        self.claimed_rewards = claimed_rewards
        self.max_tokens = max_tokens  # an episode's tokens after its prompt
        self.stop_ids = stop_ids  # the ids that end a policy turn (`P.RolloutParams.stop_ids`)
        self.turn_tokens = turn_tokens  # a turn's budget (`P.RolloutParams.max_new_tokens`): where one cut ends
        self.inflight_cap = int(cfg.server.max_inflight_upload_mb * (1 << 20))
        self.inflight = 0  # bytes of the uploads being read now (declared lengths, or the cap per chunked body)
        # ... and by whom: one worker (one address) may hold only its share of them, else a worker
        # holding one lease opened 32 stalled 8 MiB uploads and every other worker's got 503. A worker
        # holds two uploads of what it holds at once.
        self.by_worker: dict[str, int] = {}
        self.by_address: dict[str, int] = {}
        self.address_cap = self.inflight_cap // 2
        self.unproven = 0  # ... of workers with no group accepted yet: new identities cost nothing to make
        self.unproven_cap = self.inflight_cap // 2

    def routes(self, auth: Auth) -> list[web.RouteDef]:
        async def trajectories(request: web.Request) -> web.Response:
            try:
                worker = auth.worker(request)
                refuse_quarantined(worker)
                return await self.upload(request, worker)
            except Rejected as e:
                self.metrics.rejected.labels(e.reason).inc()
                return json_error(e.status, e.reason, e.message)
            except Refusal as e:
                return e.response()

        # `Expect: 100-continue` is answered by `upload`, once the lease and the bounds are checked:
        # aiohttp's own answer, before any handler, invited bodies the learner would then refuse.
        return [web.post("/v1/trajectories", trajectories, expect_handler=continue_later)]

    async def upload(self, request: web.Request, worker: WorkerInfo) -> web.Response:
        if request.content_type != CONTENT_TYPE:
            raise Rejected(415, "malformed", f"Content-Type must be {CONTENT_TYPE}")
        refuse_encoding(request, self.metrics.rejected)  # aiohttp would inflate it past what `claim` counts
        # An upload answers prompts its sender holds, no more: its decoding is bounded by them. Counted
        # once, here: a lease that expires while the body is read is then refused by name (409), not
        # as a body beyond its bounds.
        held = self.leases.book.held(worker.id)
        if not held:  # nothing it could upload into: read and decode nothing
            raise Rejected(409, "unknown-lease", "this worker holds no outstanding lease (expired, already "
                                                 "answered, or never leased): lease prompts first")
        most = min(max_body(self.max_tokens, self.rollout.group_size, held), int(self.max_body_mb * (1 << 20)))
        if (request.content_length or 0) > most:
            raise Rejected(413, "oversized", f"the upload declares {request.content_length} bytes; at most {most} fit "
                                             f"this run's group_size and episode token budget for the {held} prompts "
                                             f"this worker holds (and [server] max_body_mb = {self.max_body_mb} MiB); "
                                             "submit fewer groups per request")
        claim = min(request.content_length or most, most)
        proven = worker.groups_accepted > 0
        if self.inflight + claim > self.inflight_cap or (not proven and self.unproven + claim > self.unproven_cap):
            self.metrics.rejected.labels("busy").inc()
            return json_error(503, "busy", "the learner is reading as many uploads as it holds at once "
                                           "([server] max_inflight_upload_mb); retry shortly", {"Retry-After": "2"})
        mine, here = self.by_worker.get(worker.id, 0), self.by_address.get(worker.address, 0)
        if mine + claim > 2 * most or here + claim > self.address_cap:
            self.metrics.rejected.labels("uploads-in-flight").inc()
            return json_error(429, "uploads-in-flight", "this worker (or its address) is already sending as many "
                                                        "upload bytes as one may at once; send the next when those "
                                                        "are answered", {"Retry-After": "2"})
        self.inflight += claim
        self.unproven += 0 if proven else claim
        self.by_worker[worker.id] = mine + claim
        self.by_address[worker.address] = here + claim
        try:
            await invite_body(request)
            raw = await read_in_time(request, lambda: body_at_most(request, most), self.metrics.rejected)
        except web.HTTPRequestEntityTooLarge:
            raise Rejected(413, "oversized", f"upload larger than {most} bytes, what this run's group_size and "
                                             f"episode token budget allow for the {held} prompts this worker holds "
                                             f"(and [server] max_body_mb = {self.max_body_mb} MiB); submit fewer "
                                             "groups per request") from None
        finally:
            self.inflight -= claim
            self.unproven -= 0 if proven else claim
            _release(self.by_worker, worker.id, claim)
            _release(self.by_address, worker.address, claim)
        loop = asyncio.get_running_loop()
        sub = await loop.run_in_executor(self.offload, lambda: decode_submission(
            raw, vocab_size=self.vocab_size, max_tokens=self.max_tokens, group_size=self.rollout.group_size,
            max_groups=held, stop_ids=self.stop_ids, turn_tokens=self.turn_tokens))
        if sub.worker_id != worker.id:
            raise Rejected(403, "impersonation", f"the upload names worker {sub.worker_id[:64]!r} but the credential is "
                                                 f"{worker.id!r}'s; a worker submits only its own work")
        groups, lease_age = self.admit(sub, worker)
        self.leases.checking += len(groups)  # until queued: a synchronous batch counts them as coming
        queued = 0
        try:
            self.leases.freed(len(sub.groups), worker.id)  # the lease's room is free again
            # The leases are closed: a second upload of the same groups is refused from here on.
            refused = await self.check_rewards(worker, groups)
            if refused is not None:
                return refused
            if worker.quarantined:  # caught now, or while its rewards were being checked
                for g in groups:
                    self.leases.book.recycle(g.prompt)
                return json_error(403, "quarantined", f"this worker is quarantined: {worker.quarantined}")
            n = sum(len(g.completions) for g in groups)
            if lease_age is not None:
                self.registry.verifier.lease_returned(worker.id, n, lease_age)
            for g in groups:
                self.leases.trained(g.prompt_id)
                await self.buffer.put(g)
                queued += 1
                worker.groups_accepted += 1
                self.metrics.accepted.inc()
        finally:
            self.leases.checking -= len(groups)
            if queued < len(groups):  # refused after all: what they were counted for is room again
                self.leases.waiters.wake(len(groups) - queued)
        self.metrics.queue.set(len(self.buffer.buffer))
        return reply(P.UploadReply(accepted=len(groups), given_back=len(sub.groups) - len(groups)))

    async def check_rewards(self, worker: WorkerInfo, groups: list[Group]) -> web.Response | None:
        """Recompute the rewards of the verifier's pick of `groups`; quarantine a worker whose claims
        differ (where it had the answers to claim them with), or whose episodes the environment does
        not answer so. A refusal when the task's reward code itself failed (the prompts go out again)."""
        verifier = self.registry.verifier
        rescored = [g for g, pick in zip(groups, verifier.pick(groups)) if pick] if self.rescore else []
        if not rescored:
            return None
        try:
            replayed = await asyncio.get_running_loop().run_in_executor(self.offload, self.rescore, rescored)
        except Exception as e:  # the task's reward code failed: train nothing unchecked, lose no prompt
            for g in groups:
                self.leases.book.recycle(g.prompt)
            self.registry.on_note(f"recomputing rewards failed ({type(e).__name__}: {e}); {len(groups)} prompts re-issued")
            return json_error(500, "verify-failed", "the learner could not recompute this upload's rewards; "
                                                    "its prompts were re-issued (nothing to do on the worker)")
        if replayed.forged:  # a deterministic environment said otherwise: proof, quarantined at once
            self.registry.quarantine(worker, Verdict(worker.id, "episodes", f"{len(replayed.forged)} of its episodes "
                                                     f"are not what the environment answers: {replayed.forged[0][:200]}"))
        if not self.claimed_rewards:
            return None
        flags = [m for per_group in replayed.mismatches for m in per_group]
        self.metrics.rewards_checked.inc(len(flags))
        self.metrics.rewards_mismatched.inc(sum(flags))
        verdict = verifier.rewards_checked(worker.id, flags)
        if verdict is not None and not worker.quarantined:
            self.registry.quarantine(worker, verdict)
        return None

    def admit(self, sub, worker: WorkerInfo) -> tuple[list[Group], float | None]:
        """Check an upload group by group, and close its leases. What makes the upload itself wrong
        refuses all of it before anything changes: a prompt twice (422), a prompt not outstanding in
        a lease of this worker (409), a version never published (422). Then each group on its own:
        fresh ones are taken, the prompt of each stale one is given back at once to be generated
        again; an upload with nothing fresh is refused (409) after the prompts went back.
        Returns the fresh groups and the lease's age (issue to now) when this upload finished it."""
        book, version, published = self.leases.book, self.run.version, self.run.published_version
        prompts = {}  # prompt_id -> the leased Prompt (re-issued if the group is dropped later)
        for g in sub.groups:
            if g.prompt_id in prompts:
                raise Rejected(422, "duplicate-prompt", f"prompt {g.prompt_id!r} appears twice in one upload; send one "
                                                        "group per prompt (nothing of this upload was queued)")
            try:
                prompts[g.prompt_id] = book.prompt_of(sub.lease_id, g.prompt_id, worker.id)
            except UnknownLease as e:
                raise Rejected(409, "unknown-lease", str(e.args[0])) from None
            if g.version > published or g.version < 0:
                raise Rejected(422, "future-version", f"version {g.version} was never published (newest: {published})")
            if self.run.blobs.never_published(g.version):  # a label no snapshot had: no version to check it against
                raise Rejected(422, "unpublished-version",
                               f"version {g.version} was never published (versions go out every [publish] every "
                               f"updates; label each group with the version that generated it)")
        lease = book.get(sub.lease_id)
        whole = lease is not None and len(lease.prompts) == len(sub.groups)
        age = time.monotonic() - lease.issued_at if whole and lease.size == len(sub.groups) else None
        buf = self.buffer.buffer
        fresh, stale = [], []
        for g in sub.groups:
            # Judged at the version it can first be trained at (the next one while a batch trains).
            (fresh if buf.leasable(g.version, version) else stale).append(g)
        for g in stale:  # the prompt itself is fine: a fresher snapshot generates it
            book.give_back(sub.lease_id, g.prompt_id, worker.id)
        if not fresh:
            self.leases.freed(len(stale), worker.id)  # the room those prompts held is free again, its own included
            oldest, at = min(g.version for g in stale), buf.trained_at(version)
            # Said at the version it would be trained at: "2 updates old at learner version 2; max
            # staleness is 2" read as an off-by-one (a new user, 2026-12-07).
            when = f"at learner version {at}" + (f" (v{version}'s batch is being trained now)" if at > version else "")
            raise Rejected(409, "stale-version",
                           f"version {oldest} would be {at - oldest} updates old when trained, {when}; max staleness "
                           f"is {self.max_staleness}. Install the newest snapshot ({len(stale)} prompts were given back)")
        if stale:
            self.metrics.rejected.labels("stale-version").inc(len(stale))
        for g in fresh:
            book.complete(sub.lease_id, g.prompt_id, worker.id, time.monotonic())  # its measured rate
        return [Group(prompt_id=g.prompt_id, version=g.version, prompt_ids=self.leases.token_ids(prompts[g.prompt_id]),
                      completions=[s.tokens for s in g.samples], behaviour_logprobs=[s.logprobs for s in g.samples],
                      rewards=[s.reward for s in g.samples], worker_id=worker.id,
                      masks=group_masks(g.samples),
                      truncated=[s.truncated for s in g.samples],
                      prompt=prompts[g.prompt_id]) for g in fresh], age


def _release(table: dict[str, int], key: str, claim: int) -> None:
    left = table.get(key, 0) - claim
    if left > 0:
        table[key] = left
    else:
        table.pop(key, None)  # the tables hold only the senders with bytes in flight


def group_masks(samples) -> list[list[int]] | None:
    """A group's loss masks: None when every sample is all the policy's (one turn). A sample
    that travelled without a mask is all ones, also when others of its group have one (a hand
    that ended after one decision beside hands that went on)."""
    if all(s.mask is None for s in samples):
        return None
    return [s.mask if s.mask is not None else [1] * len(s.tokens) for s in samples]
