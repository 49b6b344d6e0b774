"""The control API workers talk to (aiohttp, JSON except trajectory and snapshot bodies).

    POST /v1/join            run token -> worker id, sampling parameters, task, newest snapshot
    POST /v1/heartbeat       liveness + measurements; renews the worker's leases
    POST /v1/lease           prompts to generate, or an eval lease (greedy, for the version the
                             worker holds); 204: none right now, 410: run finished
    POST /v1/release         hand a lease back unanswered (its prompts are re-issued at once)
    POST /v1/trajectories    zstd msgpack groups (echo.wire); 4xx names the reason
    POST /v1/eval            an eval lease's rewards (learner.evals)
    GET  /v1/model           the model directory minus weights (config, tokenizer)
    GET  /v1/snapshots/...   versioned weights (broadcast.star)
    GET  /v1/status          JSON status
    GET  /metrics            Prometheus

Every /v1 route needs `Authorization: Bearer <run token>`. Peers are untrusted: every upload
is validated, refused with a status and reason, and counted; nothing a worker sends can stop
the learner.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgpack
from aiohttp import web

from broadcast.links import MBIT, LinkSample, LinkTable
from broadcast.star import BlobStore, add_star_routes
from echo.wire import CONTENT_TYPE, Rejected, decode_submission
from learner.buffer import AsyncBuffer, Group
from learner.config import LearnerConfig
from learner.evals import EvalBook
from learner.leases import LeaseBook, UnknownLease
from learner.metrics import LearnerMetrics

UNKNOWN_LINK_MBIT = 1000.0  # planning assumption for a link nobody declared or measured yet
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


@dataclass
class WorkerInfo:
    id: str
    name: str
    joined: float
    last_seen: float
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
    installs: list[tuple[int, float, float, float]] = field(default_factory=list)  # (version, installed, received, install s)
    capacity_per_s: float = 0.0  # rollouts per engine-busy second (what the scheduler provisions with)
    extra: dict = field(default_factory=dict)


class LearnerState:
    """Everything the routes share. Mutated only on the event loop."""

    def __init__(self, cfg: LearnerConfig, token: str, buffer: AsyncBuffer, leases: LeaseBook,
                 encode, vocab_size: int, model_dir: Path):
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
        self.training_done = False  # only eval leases go out (the last version's round)
        self._worker_ids = itertools.count(1)

    @property
    def published_version(self) -> int:
        latest = self.blobs.latest
        return latest.version if latest else -1

    def alive_workers(self, now: float) -> list[WorkerInfo]:
        window = max(3 * self.cfg.server.heartbeat_interval, self.cfg.server.lease_ttl)
        return [w for w in self.workers.values() if now - w.last_seen <= window]


def json_error(status: int, reason: str, message: str) -> web.Response:
    return web.json_response({"error": reason, "message": message}, status=status)


def build_app(state: LearnerState) -> web.Application:
    cfg = state.cfg
    app = web.Application(client_max_size=int(cfg.server.max_body_mb * (1 << 20)),
                          middlewares=[_errors_as_json])

    def authorize(request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        given = header[7:] if header.startswith("Bearer ") else ""
        if not given or not hmac.compare_digest(given.encode(), state.token.encode()):
            state.metrics.joins_refused.inc()
            what = "missing" if not given else "wrong"
            raise web.HTTPUnauthorized(
                text=f"{what} run token: pass the token the learner printed at start-up "
                     "(echo-worker join URL --token TOKEN, or $ECHO_TOKEN)")

    async def body_json(request: web.Request) -> dict:
        try:
            data = await request.json()
        except Exception:
            raise web.HTTPBadRequest(text="body must be a JSON object") from None
        if not isinstance(data, dict):
            raise web.HTTPBadRequest(text="body must be a JSON object")
        return data

    def worker_of(data: dict) -> WorkerInfo:
        worker = state.workers.get(str(data.get("worker_id", "")))
        if worker is None:
            raise web.HTTPNotFound(text="unknown worker_id: join again (POST /v1/join)")
        worker.last_seen = time.monotonic()
        return worker

    async def join(request: web.Request) -> web.Response:
        authorize(request)
        data = await body_json(request)
        now = time.monotonic()
        wid = f"w{next(state._worker_ids)}"
        info = WorkerInfo(id=wid, name=str(data.get("name") or wid)[:64], joined=now, last_seen=now)
        _update_worker(info, data)
        _record_links(state, info, data)
        state.workers[wid] = info
        if state.fleet is not None:
            state.fleet.joined(now, info.name, info.price_per_hour, _number(data.get("expected_rollouts_per_s", 0)))
            info.active = state.fleet.is_active(info.name)
        return web.json_response({
            "worker_id": wid,
            "broadcast": state.broadcast,
            "heartbeat_interval": cfg.server.heartbeat_interval,
            "lease_ttl": cfg.server.lease_ttl,
            "task": {"name": cfg.task.name, "options": cfg.task.options},
            "rollout": cfg.rollout.model_dump(),
            "snapshot": state.announcement,
        })

    async def heartbeat(request: web.Request) -> web.Response:
        authorize(request)
        data = await body_json(request)
        worker = worker_of(data)
        _update_worker(worker, data)
        _record_installs(worker, data.get("installs", []))
        _record_links(state, worker, data)
        state.leases.renew(worker.id, worker.last_seen)
        if state.evals is not None:
            state.evals.renew(worker.id, worker.last_seen)
        if state.fleet is not None:
            state.fleet.heartbeat(worker.last_seen, worker.name, worker.capacity_per_s)
            worker.active = state.fleet.is_active(worker.name)
        worker.told_finished = state.finished
        return web.json_response({
            "state": "stop" if state.finished else "active" if worker.active else "idle",
            "snapshot": state.announcement,
        })

    async def lease(request: web.Request) -> web.Response:
        authorize(request)
        data = await body_json(request)
        worker = worker_of(data)
        if state.finished:
            worker.told_finished = True
            return json_error(410, "finished", "the run has finished; the worker can exit")
        try:
            max_prompts = max(1, min(int(data.get("max_prompts", 1)), 1024))
            worker.version = int(data.get("version", worker.version))  # what will generate this lease
        except (TypeError, ValueError):
            raise web.HTTPBadRequest(text="max_prompts and version must be integers") from None
        if state.evals is not None and worker.active:
            got_eval = state.evals.lease(worker.id, worker.version, cfg.eval.prompts_per_lease, time.monotonic())
            if got_eval is not None:
                lease_id, version, eval_prompts = got_eval
                return web.json_response({
                    "lease_id": lease_id, "eval": {"version": version}, "expires_in": cfg.server.lease_ttl,
                    "prompts": [{"id": p.id, "text": p.text, "answer": p.answer, "prompt_ids": state.encode(p.text)}
                                for p in eval_prompts],
                    "snapshot": state.announcement})
        buf = state.buffer.buffer
        full = cfg.buffer.backpressure and len(buf) >= buf.capacity
        # A worker on a version already too old to be admitted would only generate refusals.
        too_old = cfg.server.refuse_stale_leases and worker.version >= 0 and not buf.leasable(
            worker.version, state.learner_version)
        room = buf.lease_room(state.learner_version, state.leases.outstanding)  # S = 0: what the batch still needs
        idle = full or too_old or not worker.active or state.training_done or room == 0
        got = None if idle else state.leases.lease(worker.id, min(max_prompts, room or max_prompts), time.monotonic())
        if got is None:
            return web.Response(status=204)
        prompts = []
        for p in got.prompts.values():
            ids = state.prompt_ids.setdefault(p.id, state.encode(p.text))
            prompts.append({"id": p.id, "text": p.text, "answer": p.answer, "prompt_ids": ids})
        # Workers learn of new versions here too, without waiting for a heartbeat.
        return web.json_response({"lease_id": got.id, "prompts": prompts, "expires_in": cfg.server.lease_ttl,
                                  "snapshot": state.announcement})

    async def release(request: web.Request) -> web.Response:
        authorize(request)
        data = await body_json(request)
        worker = worker_of(data)
        try:
            count = state.leases.release(str(data.get("lease_id", "")), worker.id)
        except UnknownLease as e:
            return json_error(409, "unknown-lease", str(e.args[0]))
        return web.json_response({"released": count})

    async def trajectories(request: web.Request) -> web.Response:
        authorize(request)
        try:
            if request.content_type != CONTENT_TYPE:
                raise Rejected(415, "malformed", f"Content-Type must be {CONTENT_TYPE}")
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise Rejected(413, "oversized", f"upload larger than [server] max_body_mb = {cfg.server.max_body_mb} MiB; "
                                                 "submit fewer groups per request") from None
            sub = decode_submission(body, vocab_size=state.vocab_size, max_tokens=cfg.rollout.max_new_tokens,
                                    group_size=cfg.rollout.group_size)
            worker = state.workers.get(sub.worker_id)
            if worker is None:
                raise Rejected(404, "unknown-worker", "unknown worker_id: join again")
            worker.last_seen = time.monotonic()
            groups = _admit(state, sub)
        except Rejected as e:
            state.metrics.rejected.labels(e.reason).inc()
            return json_error(e.status, e.reason, e.message)
        for g in groups:
            state.leases.complete(sub.lease_id, g.prompt_id)
            state.prompt_ids.pop(g.prompt_id, None)
            await state.buffer.put(g)
            worker.groups_accepted += 1
            state.metrics.accepted.inc()
        state.metrics.queue.set(len(state.buffer.buffer))
        return web.json_response({"accepted": len(groups), "given_back": len(sub.groups) - len(groups)})

    async def eval_results(request: web.Request) -> web.Response:
        authorize(request)
        data = await body_json(request)
        worker = worker_of(data)
        rewards = data.get("rewards")
        if state.evals is None:
            return json_error(409, "no-eval", "this learner evaluates on itself ([eval] where = 'learner')")
        if not isinstance(rewards, dict):
            raise web.HTTPBadRequest(text="rewards must be an object {prompt_id: reward}")
        try:
            result = state.evals.submit(worker.id, str(data.get("lease_id", "")), int(_number(data.get("version"))),
                                        rewards, time.monotonic())
        except Rejected as e:
            state.metrics.rejected.labels(f"eval-{e.reason}").inc()
            return json_error(e.status, e.reason, e.message)
        if result is not None:
            state.metrics.eval_accuracy.set(result.accuracy)
            state.on_eval(result)
        return web.json_response({"accepted": len(rewards)})

    async def model_files(request: web.Request) -> web.Response:
        authorize(request)
        files = {p.name: p.read_bytes() for p in sorted(state.model_dir.iterdir())
                 if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and p.stat().st_size < (64 << 20)}
        return web.Response(body=msgpack.packb(files, use_bin_type=True), content_type="application/msgpack")

    async def status(request: web.Request) -> web.Response:
        authorize(request)
        alive = {w.id for w in state.alive_workers(time.monotonic())}
        leased = state.leases.outstanding_by_worker()
        return web.json_response({
            "learner_version": state.learner_version,
            "published_version": state.published_version,
            "finished": state.finished,
            "buffer": state.buffer.buffer.metrics(),
            "leases": {**asdict(state.leases.stats), "outstanding": state.leases.outstanding},
            "workers": [{**asdict(w), "alive": w.id in alive, "leased_prompts": leased.get(w.id, 0)}
                        for w in state.workers.values()],
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
    add_star_routes(app, state.blobs, "/v1/snapshots", authorize)
    return app


def _admit(state: LearnerState, sub) -> list[Group]:
    """Check an upload group by group. What makes the upload itself wrong refuses all of it
    before anything is queued: a prompt twice (422), a prompt not outstanding in this lease
    (409), a version never published (422). Then each group on its own: fresh ones are
    accepted, the prompt of each stale one is given back at once to be generated again; an
    upload with nothing fresh is refused (409) after the prompts went back."""
    prompts = {}  # prompt_id -> the leased Prompt (re-issued if the group is dropped later)
    for g in sub.groups:
        if g.prompt_id in prompts:
            raise Rejected(422, "duplicate-prompt", f"prompt {g.prompt_id!r} appears twice in one upload; send one "
                                                    "group per prompt (nothing of this upload was queued)")
        try:
            prompts[g.prompt_id] = state.leases.prompt_of(sub.lease_id, g.prompt_id)
        except UnknownLease as e:
            raise Rejected(409, "unknown-lease", str(e.args[0])) from None
        if g.version > state.published_version or g.version < 0:
            raise Rejected(422, "future-version", f"version {g.version} was never published (newest: {state.published_version})")
    buf = state.buffer.buffer
    fresh, stale = [], []
    for g in sub.groups:
        (fresh if buf.admissible(g.version, state.learner_version) else stale).append(g)
    for g in stale:  # the prompt itself is fine: a fresher snapshot generates it
        state.leases.give_back(sub.lease_id, g.prompt_id)
    if not fresh:
        S, oldest = state.cfg.buffer.max_staleness, min(g.version for g in stale)
        raise Rejected(409, "stale-version",
                       f"version {oldest} is {state.learner_version - oldest} updates old at learner version "
                       f"{state.learner_version}; max staleness is {S}. Install the newest snapshot "
                       f"({len(stale)} prompts were given back)")
    if stale:
        state.metrics.rejected.labels("stale-version").inc(len(stale))
    return [Group(prompt_id=g.prompt_id, version=g.version, prompt_ids=state.prompt_ids[g.prompt_id],
                  completions=[s.tokens for s in g.samples], behaviour_logprobs=[s.logprobs for s in g.samples],
                  rewards=[s.reward for s in g.samples], worker_id=sub.worker_id,
                  prompt=prompts[g.prompt_id]) for g in fresh]


def _record_installs(worker: WorkerInfo, installs) -> None:
    """Installs the worker reports as `[version, installed_ago, received_ago, install_s]` (seconds
    ago, since clocks differ between machines; older workers send the first two only): kept for
    T_bcast (publication → received) and the install time τ, each on its own."""
    usage = "installs must be a list of [version, installed_ago, received_ago, install_s]"
    if not isinstance(installs, list):
        raise web.HTTPBadRequest(text=usage)
    known = worker.installs[-1][0] if worker.installs else -1
    for item in installs[-64:]:
        if not (isinstance(item, list) and len(item) in (2, 4)):
            raise web.HTTPBadRequest(text=usage)
        version, ago = int(_number(item[0])), max(0.0, _number(item[1]))
        received_ago = max(ago, _number(item[2])) if len(item) == 4 else ago
        install_s = max(0.0, _number(item[3])) if len(item) == 4 else 0.0
        if version > known:
            worker.installs.append((version, worker.last_seen - ago, worker.last_seen - received_ago, install_s))
            known = version
    del worker.installs[:-64]


def _record_links(state: LearnerState, worker: WorkerInfo, data: dict) -> None:
    """A worker's declared rates, heartbeat round trip and measured transfer goodput."""
    state.links.declare(worker.id, worker.download_mbit * MBIT, worker.upload_mbit * MBIT)
    rtt = data.get("rtt_ms")
    if rtt is not None:
        rtt = _number(rtt)
        if not 0 <= rtt < 600_000:
            raise web.HTTPBadRequest(text=f"rtt_ms must be between 0 and 600000, got {rtt}")
        state.links.observe_rtt(worker.id, rtt / 1e3)
    samples = data.get("links", [])
    if not isinstance(samples, list) or len(samples) > 16:
        raise web.HTTPBadRequest(text="links must be a list of at most 16 link samples (broadcast.links.LinkSample)")
    try:
        parsed = [LinkSample.from_dict(d) for d in samples]
    except ValueError as e:
        raise web.HTTPBadRequest(text=str(e)) from None
    for sample in parsed:
        state.links.observe(worker.id, sample)


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise web.HTTPBadRequest(text=f"expected a number, got {value!r}") from None


def _update_worker(w: WorkerInfo, data: dict) -> None:
    for key, kind in (("version", int), ("rollouts_per_s", float), ("capacity_per_s", float), ("price_per_hour", float),
                      ("download_mbit", float), ("upload_mbit", float)):
        if key in data:
            try:
                setattr(w, key, kind(data[key]))
            except (TypeError, ValueError):
                raise web.HTTPBadRequest(text=f"{key} must be a number") from None
    for key in ("device", "gpu", "engine"):
        if key in data:
            setattr(w, key, str(data[key])[:64])
    if "relay_url" in data:
        url = str(data["relay_url"])
        if url and not url.startswith(("http://", "https://", "p2p:/")):
            raise web.HTTPBadRequest(text="relay_url must be an http(s) URL or p2p:<multiaddr> (libp2p relays)")
        w.relay_url = url[:256]


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    """Every error a worker sees is JSON with a reason and a message saying what to do."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        reason = {401: "unauthorized", 404: "not-found", 413: "oversized"}.get(e.status, "bad-request")
        message = e.text or e.reason
        if e.status == 413:
            message = f"body larger than the learner's limit ([server] max_body_mb = {request.app._client_max_size >> 20} MiB)"
        return json_error(e.status, reason, message)


async def reaper(state: LearnerState, period: float) -> None:
    """Expire silent workers' leases so their prompts are re-issued."""
    while True:
        await asyncio.sleep(period)
        now = time.monotonic()
        dead = state.leases.expire(now)
        if dead:
            state.metrics.leases_expired.inc(len(dead))
        alive = state.alive_workers(now)
        if state.evals is not None:
            state.evals.expire(now, {w.version for w in alive if w.active}, state.published_version)
        state.metrics.workers.set(len(alive))
