"""The control API workers talk to (aiohttp; JSON bodies are `echo.protocol` models).

    POST /v1/join            run token -> worker id + credential, sampling parameters, task, newest snapshot
    POST /v1/heartbeat       liveness + measurements; renews the worker's leases
    POST /v1/lease           prompts to generate, or an eval lease; long-polls up to `wait_s`
                             when there is nothing to hand out; 410: run finished
    POST /v1/release         hand a lease back unanswered (its prompts are re-issued at once)
    POST /v1/trajectories    zstd msgpack groups (echo.wire); 4xx names the reason
    POST /v1/eval            an eval lease's rewards (learner.evals)
    GET  /v1/model           the model directory minus weights (config, tokenizer)
    GET  /v1/snapshots/...   versioned weights (broadcast.star)
    GET  /v1/status          JSON status (run token)
    GET  /metrics            Prometheus

Identity: the run token admits a join (bounded by rate, fleet size and an optional network
allow-list); the join answers a per-worker credential, required on every later call, and
the learner knows the worker from it alone. A lease belongs to the worker it was issued to.

Peers are untrusted: every body is validated against its model (unknown keys refused,
strings and lists bounded), every upload is checked and its rewards recomputed
(`learner.verify`), heartbeat claims are believed only as far as measurements support them,
and a worker caught lying is quarantined. Nothing heavy runs on the event loop: decoding
uploads and rescoring run on the `offload` threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import itertools
import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
from aiohttp import web

from broadcast.links import MBIT, LinkSample, LinkTable
from broadcast.star import BlobStore, add_star_routes
from echo import protocol as P
from echo.wire import CONTENT_TYPE, Rejected, decode_submission
from learner.buffer import AsyncBuffer, Group
from learner.config import LearnerConfig
from learner.admission import JoinGate, Waiters
from learner.evals import EvalBook
from learner.leases import LeaseBook, UnknownLease
from learner.metrics import LearnerMetrics
from learner.verify import Verdict, Verifier

UNKNOWN_LINK_MBIT = 1000.0  # planning assumption for a link nobody declared or measured yet
PROBE_TIMEOUT_S = 3.0  # a relay that does not answer the learner's probe within this is unreachable
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


@dataclass
class WorkerInfo:
    id: str
    name: str
    joined: float
    last_seen: float
    secret_hash: bytes = field(default=b"", repr=False)
    address: str = ""  # the join's remote address
    version: int = -1
    rollouts_per_s: float = 0.0
    device: str = ""
    gpu: str = ""
    price_per_hour: float = 0.0
    download_mbit: float = 0.0
    upload_mbit: float = 0.0
    engine: str = ""
    groups_accepted: int = 0
    told_finished: bool = False
    active: bool = True  # the scheduler may idle a worker: it then gets no prompts
    relay_url: str = ""  # where this worker's broadcast relay listens (chain mode)
    reachable: bool | None = None  # did the learner reach its relay (None: not probed yet)
    installs: list[tuple[int, float, float, float]] = field(default_factory=list)  # (version, installed, received, install s)
    capacity_per_s: float = 0.0  # believed rollouts per engine-busy second (what the scheduler provisions with)
    claimed_capacity_per_s: float = 0.0  # what the worker said
    quarantined: str = ""  # why the learner stopped taking its work

    def row(self, now: float, alive: bool, leased: int) -> dict:
        """The worker as /v1/status shows it (no secrets, bounded size)."""
        return {"id": self.id, "name": self.name, "address": self.address, "alive": alive, "active": self.active,
                "version": self.version, "seen_s_ago": round(now - self.last_seen, 1),
                "rollouts_per_s": self.rollouts_per_s, "capacity_per_s": self.capacity_per_s,
                "claimed_capacity_per_s": self.claimed_capacity_per_s, "price_per_hour": self.price_per_hour,
                "gpu": self.gpu, "engine": self.engine, "groups_accepted": self.groups_accepted,
                "relay_url": self.relay_url, "reachable": self.reachable, "leased_prompts": leased,
                "quarantined": self.quarantined}


class LearnerState:
    """Everything the routes share. Mutated only on the event loop."""

    def __init__(self, cfg: LearnerConfig, token: str, buffer: AsyncBuffer, leases: LeaseBook,
                 encode, vocab_size: int, model_dir: Path, rescore=None):
        self.cfg = cfg
        self.token = token
        self.buffer = buffer
        self.leases = leases
        self.encode = encode  # prompt text -> token ids (the learner's tokenizer is authoritative)
        self.vocab_size = vocab_size
        self.model_dir = model_dir
        self.blobs = BlobStore(keep=cfg.publish.keep)
        self.metrics = LearnerMetrics()
        self.workers: dict[str, WorkerInfo] = {}
        self.learner_version = 0
        self.finished = False
        self.prompt_ids: dict[str, list[int]] = {}
        self.fleet = None  # scheduler.fleet.Fleet when a scheduler decides who generates
        # Every worker's links, declared at join and refreshed by heartbeats' measurements.
        self.links = LinkTable(uplink=cfg.broadcast.uplink_mbit * MBIT, default=UNKNOWN_LINK_MBIT * MBIT)
        self.announcement: dict | None = None  # the newest version as workers are told of it
        self.broadcast: dict = {"mode": "star"}  # how versions travel (learner.publisher)
        self.evals: EvalBook | None = None  # eval rounds on the workers ([eval] where = "workers")
        self.on_eval = lambda result: None  # the learner logs each finished round
        self.on_note = lambda text: None  # something the operator should read (status line)
        self.training_done = False  # only eval leases go out (the last version's round)
        self.verifier = Verifier(cfg.verify, seed=cfg.run.seed)
        self.rescore = rescore  # learner.verify.Rescorer, or None: rewards are taken as claimed
        # Blocking work a request needs (decoding uploads, recomputing rewards) runs here.
        self.offload = ThreadPoolExecutor(2, thread_name_prefix="offload")
        self.waiters = Waiters()
        self.banned: dict[str, str] = {}  # address -> why: a quarantined worker's address may not join again
        self.gate = JoinGate(cfg.server.join_rate, cfg.server.join_burst, cfg.server.allow_networks)
        self._worker_ids = itertools.count(1)
        self._probes: set[asyncio.Task] = set()

    @property
    def published_version(self) -> int:
        latest = self.blobs.latest
        return latest.version if latest else -1

    def alive_workers(self, now: float) -> list[WorkerInfo]:
        window = max(3 * self.cfg.server.heartbeat_interval, self.cfg.server.lease_ttl)
        return [w for w in self.workers.values() if now - w.last_seen <= window]

    def token_ids(self, prompt) -> list[int]:
        """The prompt as the learner's tokenizer encodes it, once per prompt while it is leased."""
        ids = self.prompt_ids.get(prompt.id)
        if ids is None:
            ids = self.prompt_ids[prompt.id] = self.encode(prompt.text)
        return ids

    def changed(self) -> None:
        """Something every waiting lease request must hear at once (training done, run finished)."""
        self.waiters.wake_all()

    def room(self) -> int:
        """Prompts a lease could be given now."""
        buf = self.buffer.buffer
        if self.training_done or (self.cfg.buffer.backpressure and len(buf) >= buf.capacity):
            return 0
        room = max(0, self.leases.max_outstanding - self.leases.outstanding)
        needed = buf.lease_room(self.learner_version, self.leases.outstanding)  # S = 0: what the batch needs
        return room if needed is None else min(room, needed)

    def stepped(self) -> None:
        """The learner took a batch and moved on a version: serve the room that freed, and tell
        the waiting workers this version made too stale to be trained on to install a newer one."""
        buf = self.buffer.buffer
        if self.cfg.server.refuse_stale_leases:
            self.waiters.wake_where(lambda w: w.version >= 0 and not buf.leasable(w.version, self.learner_version))
        self.waiters.wake(self.room())

    def quarantine(self, worker: WorkerInfo, verdict: Verdict) -> None:
        """Stop taking `worker`'s work: its leases and queued groups go back to be generated by others."""
        self.metrics.flagged.labels(verdict.reason).inc()
        if worker.quarantined or not self.cfg.verify.quarantine:
            return
        worker.quarantined, worker.active = verdict.message, False
        if self.cfg.verify.ban_address and worker.address:  # else it would join again under a new name
            self.banned[worker.address] = verdict.message
        leased = sum(len(lease.prompts) for lease in self.leases.release_worker(worker.id))
        dropped = self.buffer.buffer.drop_worker(worker.id)
        self.metrics.quarantined.labels(verdict.reason).inc()
        self.on_note(f"quarantined {worker.name} ({worker.id}, {worker.address}): {verdict.message}; "
                     f"{leased} leased prompts re-issued, {dropped} queued groups dropped")
        self.waiters.wake(leased)

    def probe(self, worker: WorkerInfo) -> None:
        """Can the learner open a connection to the worker's relay? An unreachable one (behind
        NAT) becomes a leaf that pulls from a reachable parent (learner.publisher)."""
        from broadcast.reach import probe_relay

        url = worker.relay_url

        async def run() -> None:
            ok = await probe_relay(url, PROBE_TIMEOUT_S)
            if worker.relay_url == url:
                worker.reachable = ok
                self.metrics.relays_probed.labels("reachable" if ok else "unreachable").inc()

        task = asyncio.get_running_loop().create_task(run())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def forget(self, worker: WorkerInfo) -> None:
        del self.workers[worker.id]
        for lease in self.leases.release_worker(worker.id):
            self.waiters.wake(len(lease.prompts))
        self.links.forget(worker.id)
        self.verifier.forget(worker.id)


def json_error(status: int, reason: str, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response(P.ErrorReply(error=reason, message=message).model_dump(), status=status, headers=headers)


def reply(message: P.Message) -> web.Response:
    return web.json_response(message.model_dump())


def _hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def build_app(state: LearnerState) -> web.Application:
    cfg = state.cfg
    app = web.Application(client_max_size=int(cfg.server.max_body_mb * (1 << 20)),
                          middlewares=[_errors_as_json])

    def bearer(request: web.Request) -> str:
        header = request.headers.get("Authorization", "")
        return header[7:] if header.startswith("Bearer ") else ""

    def run_token(request: web.Request) -> None:
        given = bearer(request)
        if not given or not hmac.compare_digest(given.encode(), state.token.encode()):
            state.metrics.auth_refused.labels("run-token").inc()
            raise web.HTTPUnauthorized(
                text=f"{'missing' if not given else 'wrong'} run token: pass the token the learner printed at "
                     "start-up (echo-worker join URL --token TOKEN, or $ECHO_TOKEN)")

    def worker_of(request: web.Request) -> WorkerInfo:
        wid, _, secret = bearer(request).partition(".")
        worker = state.workers.get(wid)
        if worker is None or not secret or not hmac.compare_digest(_hash(secret), worker.secret_hash):
            state.metrics.auth_refused.labels("credential").inc()
            raise web.HTTPUnauthorized(reason="unknown-credential",
                                       text="unknown or wrong worker credential (the learner restarted or forgot "
                                            "this worker): join again with the run token")
        worker.last_seen = time.monotonic()
        return worker

    def anyone(request: web.Request) -> None:
        """Model files and snapshots: any worker, or the operator with the run token."""
        if "." in bearer(request):
            worker_of(request)
        else:
            run_token(request)

    async def body(request: web.Request, model: type[P.Message]) -> P.Message:
        if (request.content_length or 0) > P.MAX_JSON_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=P.MAX_JSON_BYTES, actual_size=request.content_length)
        chunks, size = [], 0
        while chunk := await request.content.read(1 << 16):  # a chunked body has no length to check first
            size += len(chunk)
            if size > P.MAX_JSON_BYTES:
                raise web.HTTPRequestEntityTooLarge(max_size=P.MAX_JSON_BYTES, actual_size=size)
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            data = json.loads(raw or b"{}")
            return P.parse(model, data)
        except (ValueError, P.ProtocolError) as e:
            state.metrics.rejected.labels("bad-request").inc()
            raise web.HTTPBadRequest(text=str(e) if isinstance(e, P.ProtocolError) else "body must be a JSON object") from None

    async def join(request: web.Request) -> web.Response:
        run_token(request)
        report = await body(request, P.Report)
        now = time.monotonic()
        address = request.remote or ""
        if not state.gate.allowed_from(address):
            state.metrics.joins_refused.labels("network").inc()
            return json_error(403, "network", f"joins from {address} are not allowed ([server] allow_networks)")
        if address in state.banned:
            state.metrics.joins_refused.labels("banned").inc()
            return json_error(403, "banned", f"a worker from {address} was quarantined: {state.banned[address]}")
        if len(state.workers) >= cfg.server.max_workers:
            state.metrics.joins_refused.labels("full").inc()
            return json_error(503, "fleet-full", f"the learner holds its maximum of {cfg.server.max_workers} workers "
                                                 "([server] max_workers); try again later", {"Retry-After": "30"})
        wait = state.gate.take(now)
        if wait > 0:
            state.metrics.joins_refused.labels("rate").inc()
            return json_error(429, "join-rate", f"joins are limited to {cfg.server.join_rate:g}/s "
                                                "([server] join_rate); retry after the given seconds",
                              {"Retry-After": str(max(1, round(wait)))})
        wid, secret = f"w{next(state._worker_ids)}", secrets.token_urlsafe(24)
        info = WorkerInfo(id=wid, name=report.name or wid, joined=now, last_seen=now, secret_hash=_hash(secret),
                          address=address)
        _update_worker(state, info, report)
        state.workers[wid] = info
        if state.fleet is not None:
            state.fleet.joined(now, info.name, info.price_per_hour, report.expected_rollouts_per_s)
            info.active = state.fleet.is_active(info.name)
        return reply(P.JoinReply(
            worker_id=wid, credential=f"{wid}.{secret}", broadcast=state.broadcast,
            heartbeat_interval=cfg.server.heartbeat_interval, lease_ttl=cfg.server.lease_ttl,
            long_poll_s=cfg.server.long_poll_s, task=P.TaskInfo(name=cfg.task.name, options=cfg.task.options),
            rollout=cfg.rollout.model_dump(), snapshot=state.announcement))

    async def heartbeat(request: web.Request) -> web.Response:
        worker = worker_of(request)
        report = await body(request, P.Report)
        _update_worker(state, worker, report)
        state.leases.renew(worker.id, worker.last_seen)
        if state.evals is not None:
            state.evals.renew(worker.id, worker.last_seen)
        if worker.quarantined:
            return reply(P.HeartbeatReply(state="quarantined", message=worker.quarantined))
        if state.fleet is not None:
            state.fleet.heartbeat(worker.last_seen, worker.name, worker.capacity_per_s)
            worker.active = state.fleet.is_active(worker.name)
        worker.told_finished = state.finished
        return reply(P.HeartbeatReply(state="stop" if state.finished else "active" if worker.active else "idle",
                                      snapshot=state.announcement, reachable=worker.reachable))

    def refuse_quarantined(worker: WorkerInfo) -> None:
        if worker.quarantined:
            raise _Refusal(403, "quarantined", f"this worker is quarantined: {worker.quarantined}")

    async def lease(request: web.Request) -> web.Response:
        worker = worker_of(request)
        req = await body(request, P.LeaseRequest)
        worker.version = req.version  # what will generate this lease
        asked = time.monotonic()
        deadline = asked + min(req.wait_s, cfg.server.long_poll_s)
        buf = state.buffer.buffer

        def reply(message: P.LeaseReply) -> web.Response:  # saying how long the request was held
            return web.json_response({**message.model_dump(), "waited_s": round(time.monotonic() - asked, 4)})

        while True:
            if state.finished:
                worker.told_finished = True
                return json_error(410, "finished", "the run has finished; the worker can exit")
            if worker.quarantined:
                return json_error(403, "quarantined", f"this worker is quarantined: {worker.quarantined}")
            if not worker.active:
                return reply(P.LeaseReply(empty="wait", snapshot=state.announcement))
            now = time.monotonic()
            if state.evals is not None:
                got_eval = state.evals.lease(worker.id, worker.version, cfg.eval.prompts_per_lease, now)
                if got_eval is not None:
                    lease_id, version, eval_prompts = got_eval
                    return reply(P.LeaseReply(
                        lease_id=lease_id, eval_version=version, expires_in=cfg.server.lease_ttl,
                        prompts=[P.PromptMsg(id=p.id, text=p.text, answer=p.answer, prompt_ids=state.encode(p.text))
                                 for p in eval_prompts], snapshot=state.announcement))
            # A worker on a version already too old to be admitted would only generate refusals.
            if cfg.server.refuse_stale_leases and worker.version >= 0 and not buf.leasable(
                    worker.version, state.learner_version):
                if state.room():
                    state.waiters.wake(1)  # in case this request was woken for room it cannot use
                return reply(P.LeaseReply(empty="install", snapshot=state.announcement))
            room = state.room()
            got = state.leases.lease(worker.id, min(req.max_prompts, room), now) if room else None
            if got is not None:
                prompts = [P.PromptMsg.model_construct(id=p.id, text=p.text, answer=p.answer,
                                                       prompt_ids=state.token_ids(p))
                           for p in got.prompts.values()]
                if state.room():
                    state.waiters.wake(1)  # room for more: the next waiter may take it
                # Workers learn of new versions here too, without waiting for a heartbeat.
                return reply(P.LeaseReply.model_construct(lease_id=got.id, prompts=prompts, expires_in=cfg.server.lease_ttl,
                                                          snapshot=state.announcement, eval_version=None, empty=""))
            if now >= deadline:
                return reply(P.LeaseReply(empty="wait", snapshot=state.announcement))
            await state.waiters.wait(deadline - now, worker)

    async def release(request: web.Request) -> web.Response:
        worker = worker_of(request)
        req = await body(request, P.ReleaseRequest)
        try:
            count = state.leases.release(req.lease_id, worker.id)
        except UnknownLease as e:
            return json_error(409, "unknown-lease", str(e.args[0]))
        state.waiters.wake(count)
        return reply(P.ReleaseReply(released=count))

    async def trajectories(request: web.Request) -> web.Response:
        try:
            worker = worker_of(request)
            refuse_quarantined(worker)
            if request.content_type != CONTENT_TYPE:
                raise Rejected(415, "malformed", f"Content-Type must be {CONTENT_TYPE}")
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise Rejected(413, "oversized", f"upload larger than [server] max_body_mb = {cfg.server.max_body_mb} MiB; "
                                                 "submit fewer groups per request") from None
            loop = asyncio.get_running_loop()
            sub = await loop.run_in_executor(state.offload, lambda: decode_submission(
                raw, vocab_size=state.vocab_size, max_tokens=cfg.rollout.max_new_tokens, group_size=cfg.rollout.group_size))
            if sub.worker_id != worker.id:
                raise Rejected(403, "impersonation", f"the upload names worker {sub.worker_id[:64]!r} but the credential is "
                                                     f"{worker.id!r}'s; a worker submits only its own work")
            groups, lease_age = _admit(state, sub, worker)
        except Rejected as e:
            state.metrics.rejected.labels(e.reason).inc()
            return json_error(e.status, e.reason, e.message)
        except _Refusal as e:
            return json_error(e.status, e.reason, e.message)
        state.waiters.wake(len(sub.groups))  # the lease's room is free again
        # The leases are closed: a second upload of the same groups is refused from here on.
        rescored = [g for g, pick in zip(groups, state.verifier.pick(groups)) if pick] if state.rescore else []
        if rescored:
            try:
                mismatched = await asyncio.get_running_loop().run_in_executor(state.offload, state.rescore, rescored)
            except Exception as e:  # the task's reward code failed: train nothing unchecked, lose no prompt
                for g in groups:
                    state.leases.recycle(g.prompt)
                state.on_note(f"recomputing rewards failed ({type(e).__name__}: {e}); {len(groups)} prompts re-issued")
                return json_error(500, "verify-failed", "the learner could not recompute this upload's rewards; "
                                                        "its prompts were re-issued (nothing to do on the worker)")
            flags = [m for per_group in mismatched for m in per_group]
            state.metrics.rewards_checked.inc(len(flags))
            state.metrics.rewards_mismatched.inc(sum(flags))
            verdict = state.verifier.rewards_checked(worker.id, flags)
            if verdict is not None:
                state.quarantine(worker, verdict)
        if worker.quarantined:  # caught now, or while its rewards were being checked
            for g in groups:
                state.leases.recycle(g.prompt)
            return json_error(403, "quarantined", f"this worker is quarantined: {worker.quarantined}")
        n = sum(len(g.completions) for g in groups)
        if lease_age is not None:
            state.verifier.lease_returned(worker.id, n, lease_age)
        for g in groups:
            state.prompt_ids.pop(g.prompt_id, None)
            await state.buffer.put(g)
            worker.groups_accepted += 1
            state.metrics.accepted.inc()
        state.metrics.queue.set(len(state.buffer.buffer))
        return reply(P.UploadReply(accepted=len(groups), given_back=len(sub.groups) - len(groups)))

    async def eval_results(request: web.Request) -> web.Response:
        worker = worker_of(request)
        req = await body(request, P.EvalSubmission)
        if worker.quarantined:
            return json_error(403, "quarantined", f"this worker is quarantined: {worker.quarantined}")
        if state.evals is None:
            return json_error(409, "no-eval", "this learner evaluates on itself ([eval] where = 'learner')")
        rewards = dict(req.rewards)
        try:
            if state.rescore is not None:  # score the answers here; the worker's rewards are claims
                rewards = await score_eval(worker, req)
            result = state.evals.submit(worker.id, req.lease_id, req.version, rewards, time.monotonic())
        except Rejected as e:
            state.metrics.rejected.labels(f"eval-{e.reason}").inc()
            return json_error(e.status, e.reason, e.message)
        if result is not None:
            state.metrics.eval_accuracy.set(result.accuracy)
            state.on_eval(result)
        return reply(P.EvalReply(accepted=len(req.rewards)))

    async def score_eval(worker: WorkerInfo, req: P.EvalSubmission) -> dict[str, float]:
        prompts = state.evals.prompts
        if set(req.completions) != set(req.rewards) or not set(req.completions) <= set(prompts):
            raise Rejected(422, "wrong-prompts", "send the completion token ids of exactly the eval lease's prompts "
                                                 "(`completions`), one per reward")
        for pid, ids in req.completions.items():
            if not 0 < len(ids) <= cfg.rollout.max_new_tokens or min(ids) < 0 or max(ids) >= state.vocab_size:
                raise Rejected(422, "bad-token", f"eval completion {pid!r}: 1..{cfg.rollout.max_new_tokens} token ids "
                                                 f"in [0, {state.vocab_size})")
        ids = list(req.completions)
        truth = await asyncio.get_running_loop().run_in_executor(
            state.offload, state.rescore.score, [(prompts[k], req.completions[k]) for k in ids])
        mismatches = [abs(req.rewards[k] - t) > cfg.verify.reward_tolerance for k, t in zip(ids, truth)]
        state.metrics.rewards_checked.inc(len(mismatches))
        state.metrics.rewards_mismatched.inc(sum(mismatches))
        verdict = state.verifier.rewards_checked(worker.id, mismatches)
        if verdict is not None:
            state.quarantine(worker, verdict)
            raise Rejected(403, "quarantined", f"this worker is quarantined: {worker.quarantined}")
        return dict(zip(ids, truth))

    def read_model_files() -> bytes:
        files = {p.name: p.read_bytes() for p in sorted(state.model_dir.iterdir())
                 if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and p.stat().st_size < (64 << 20)}
        return msgpack.packb(files, use_bin_type=True)

    async def model_files(request: web.Request) -> web.Response:
        anyone(request)
        data = await asyncio.get_running_loop().run_in_executor(state.offload, read_model_files)
        return web.Response(body=data, content_type="application/msgpack")

    async def status(request: web.Request) -> web.Response:
        run_token(request)
        now = time.monotonic()
        alive = {w.id for w in state.alive_workers(now)}
        leased = state.leases.outstanding_by_worker()
        return web.json_response({
            "learner_version": state.learner_version,
            "published_version": state.published_version,
            "finished": state.finished,
            "buffer": state.buffer.buffer.metrics(),
            "leases": {**vars(state.leases.stats), "outstanding": state.leases.outstanding,
                       "waiting_requests": len(state.waiters)},
            "workers": [{**w.row(now, w.id in alive, leased.get(w.id, 0)), **state.verifier.summary(w.id)}
                        for w in state.workers.values()],
            "quarantined": [{"id": w.id, "name": w.name, "address": w.address, "why": w.quarantined}
                            for w in state.workers.values() if w.quarantined],
            "links": state.links.to_dict(),
        })

    async def metrics(request: web.Request) -> web.Response:
        state.metrics.links(state.links.to_dict())
        return web.Response(body=state.metrics.exposition(), content_type="text/plain")

    app.router.add_post("/v1/join", join)
    app.router.add_post("/v1/heartbeat", heartbeat)
    app.router.add_post("/v1/lease", lease)
    app.router.add_post("/v1/release", release)
    app.router.add_post("/v1/trajectories", trajectories)
    app.router.add_post("/v1/eval", eval_results)
    app.router.add_get("/v1/model", model_files)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/metrics", metrics)
    add_star_routes(app, state.blobs, "/v1/snapshots", anyone)
    return app


class _Refusal(Exception):
    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def _admit(state: LearnerState, sub, worker: WorkerInfo) -> tuple[list[Group], float | None]:
    """Check an upload group by group, and close its leases. What makes the upload itself wrong
    refuses all of it before anything changes: a prompt twice (422), a prompt not outstanding in
    a lease of this worker (409), a version never published (422). Then each group on its own:
    fresh ones are taken, the prompt of each stale one is given back at once to be generated
    again; an upload with nothing fresh is refused (409) after the prompts went back.
    Returns the fresh groups and the lease's age (issue to now) when this upload finished it."""
    prompts = {}  # prompt_id -> the leased Prompt (re-issued if the group is dropped later)
    for g in sub.groups:
        if g.prompt_id in prompts:
            raise Rejected(422, "duplicate-prompt", f"prompt {g.prompt_id!r} appears twice in one upload; send one "
                                                    "group per prompt (nothing of this upload was queued)")
        try:
            prompts[g.prompt_id] = state.leases.prompt_of(sub.lease_id, g.prompt_id, worker.id)
        except UnknownLease as e:
            raise Rejected(409, "unknown-lease", str(e.args[0])) from None
        if g.version > state.published_version or g.version < 0:
            raise Rejected(422, "future-version", f"version {g.version} was never published (newest: {state.published_version})")
    lease = state.leases.get(sub.lease_id)
    whole = lease is not None and len(lease.prompts) == len(sub.groups)
    age = time.monotonic() - lease.issued_at if whole and lease.size == len(sub.groups) else None
    buf = state.buffer.buffer
    fresh, stale = [], []
    for g in sub.groups:
        (fresh if buf.admissible(g.version, state.learner_version) else stale).append(g)
    for g in stale:  # the prompt itself is fine: a fresher snapshot generates it
        state.leases.give_back(sub.lease_id, g.prompt_id, worker.id)
    if not fresh:
        S, oldest = state.cfg.buffer.max_staleness, min(g.version for g in stale)
        raise Rejected(409, "stale-version",
                       f"version {oldest} is {state.learner_version - oldest} updates old at learner version "
                       f"{state.learner_version}; max staleness is {S}. Install the newest snapshot "
                       f"({len(stale)} prompts were given back)")
    if stale:
        state.metrics.rejected.labels("stale-version").inc(len(stale))
    for g in fresh:
        state.leases.complete(sub.lease_id, g.prompt_id, worker.id)
    return [Group(prompt_id=g.prompt_id, version=g.version, prompt_ids=state.token_ids(prompts[g.prompt_id]),
                  completions=[s.tokens for s in g.samples], behaviour_logprobs=[s.logprobs for s in g.samples],
                  rewards=[s.reward for s in g.samples], worker_id=worker.id,
                  prompt=prompts[g.prompt_id]) for g in fresh], age


def _update_worker(state: LearnerState, w: WorkerInfo, r: P.Report) -> None:
    """Take a join's or heartbeat's report. Rates are claims: the capacity the scheduler sees is
    capped by what the learner measured (learner.verify); link samples are checked by the table."""
    w.version, w.rollouts_per_s, w.price_per_hour = r.version, r.rollouts_per_s, r.price_per_hour
    w.download_mbit, w.upload_mbit = r.download_mbit, r.upload_mbit
    w.device, w.gpu, w.engine = r.device, r.gpu, r.engine
    w.claimed_capacity_per_s = r.capacity_per_s
    before = state.verifier.evidence.get(w.id)
    clamped = before.claims_clamped if before else 0
    w.capacity_per_s = state.verifier.believed_capacity(w.id, r.capacity_per_s)
    if state.verifier.evidence[w.id].claims_clamped > clamped:
        state.metrics.claims_clamped.labels("capacity").inc()
    if r.relay_url != w.relay_url:
        w.relay_url, w.reachable = r.relay_url, None
        if w.relay_url:
            state.probe(w)
    known = w.installs[-1][0] if w.installs else -1
    for item in r.installs:  # "seconds ago": clocks differ between machines
        if item.version > known:
            received_ago = max(item.installed_ago, item.received_ago)
            w.installs.append((item.version, w.last_seen - item.installed_ago, w.last_seen - received_ago, item.install_s))
            known = item.version
    del w.installs[:-64]
    state.links.declare(w.id, w.download_mbit * MBIT, w.upload_mbit * MBIT)
    if r.rtt_ms is not None:
        state.links.observe_rtt(w.id, r.rtt_ms / 1e3)
    try:
        parsed = [LinkSample.from_dict(d) for d in r.links]
    except ValueError as e:
        raise web.HTTPBadRequest(text=str(e)) from None
    for sample in parsed:
        if sample.parent and sample.down:  # the other end's evidence about its parent's upload
            state.verifier.upload_seen(sample.parent, sample.down)
        if sample.up:  # a worker's word on its own upload, believed as far as its children saw
            up = state.verifier.believed_upload(w.id, sample.up, w.upload_mbit * MBIT)
            if up < sample.up:
                state.metrics.claims_clamped.labels("upload").inc()
                sample = dataclasses.replace(sample, up=up)
        state.links.observe(w.id, sample)


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    """Every error a worker sees is JSON with a reason and a message saying what to do."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        reason = {401: "unauthorized", 404: "not-found", 413: "oversized"}.get(e.status, "bad-request")
        if e.status == 401 and e.reason == "unknown-credential":
            reason = "unknown-credential"
        message = e.text or e.reason
        if e.status == 413:
            message = (f"body larger than the learner's limit for this route "
                       f"({P.MAX_JSON_BYTES >> 10} KiB for JSON, [server] max_body_mb for trajectories)")
        return json_error(e.status, reason, message)
    except _Refusal as e:
        return json_error(e.status, e.reason, e.message)


async def reaper(state: LearnerState, period: float) -> None:
    """Expire silent workers' leases so their prompts are re-issued; forget long-silent workers."""
    while True:
        await asyncio.sleep(period)
        now = time.monotonic()
        dead = state.leases.expire(now)
        if dead:
            state.metrics.leases_expired.inc(len(dead))
            state.waiters.wake(sum(len(lease.prompts) for lease in dead))
        for w in [w for w in state.workers.values() if now - w.last_seen > state.cfg.server.forget_after_s]:
            state.forget(w)
        alive = state.alive_workers(now)
        if state.evals is not None:
            state.evals.expire(now, {w.version for w in alive if w.active}, state.published_version)
        state.metrics.workers.set(len(alive))
