"""The control API assembled: each room built from the parts it uses, one aiohttp app routing to them.

    api = ControlApi(cfg, token, run=run, buffer=buffer, lease_book=book, encode=..., vocab_size=..., model_dir=...)
    url = await api.start(host, port, reap_every)   # or serve api.app() yourself, and run api.reaper(period)

Rooms: `leases` (LeaseRoom), `registry` (WorkerRegistry: workers and identity), `uploads`,
`evals`, `status`. No room holds this object: each got only what it reads or writes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from pathlib import Path

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from broadcast.addresses import connection_limits
from broadcast.links import MBIT, LinkTable
from broadcast.node import QuietRunner, no_version_banner
from broadcast.transport import http_url
from echo import protocol as P
from learner.admission import Waiters
from learner.api.evals import EvalRoom
from learner.api.http import BODY_TIMEOUT, Auth, errors_as_json, json_error
from learner.api.leases import LeaseRoom
from learner.api.run import Run
from learner.api.status import StatusRoom
from learner.api.uploads import UploadRoom
from learner.api.workers import WorkerRegistry, welcome
from learner.buffer import AsyncBuffer
from learner.config import BroadcastSection, LearnerConfig, ServerSection
from learner.evals import EvalBook
from learner.leases import LeaseBook
from learner.metrics import LearnerMetrics
from learner.verify import Verifier

UNKNOWN_LINK_MBIT = 1000.0  # planning assumption for a link nobody declared or measured yet


def link_table(broadcast: BroadcastSection) -> LinkTable:
    """Every worker's links, declared at join and refreshed by heartbeats' measurements."""
    return LinkTable(uplink=broadcast.uplink_mbit * MBIT, default=UNKNOWN_LINK_MBIT * MBIT)


CONNECTIONS_PER_WORKER = 8  # a worker's heartbeat, long-polled lease, uploads, downloads, with room


def worker_connections(server: ServerSection):
    """The connections one address may hold open, on the control API and on the broadcast
    source alike (`broadcast.addresses.connection_limits`): `CONNECTIONS_PER_WORKER` per worker it
    may join; trusted proxies any number."""
    return connection_limits(CONNECTIONS_PER_WORKER * server.max_workers_per_address,
                             [ipaddress.ip_network(n, strict=False) for n in server.trusted_proxies],
                             server.max_64s_per_48)


class MalformedRequests(logging.Filter):
    """Drops aiohttp's "Error handling request" for a request it could not parse (a negative
    Content-Length, a bad header...), counted instead (`broadcast.node.QuietRunner`): each was a 540-byte
    traceback in the learner's log, so anyone could write 0.4 MB/s to the operator's disk
    without a credential."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, HttpProcessingError) and exc.code == 400)


def _unreadable(status: int) -> web.Response:
    """What aiohttp's parser refused, as the routes refuse: JSON, nothing of the request."""
    if status == HTTPStatus.BAD_REQUEST:
        return json_error(status, "malformed-http", "the request could not be read as HTTP")
    return json_error(status, "server-error", HTTPStatus(status).phrase)


class ControlApi:
    """`waiters`: the parked lease requests (others wake them too: an eval round opens); `evals`: the eval rounds the workers answer (`[eval] where = "workers"`), each finished one
    passed to `on_eval`; `fleet`: a `scheduler.fleet.Fleet` when a scheduler decides who generates;
    `broadcast`: how versions travel, told at join (`learner.publisher`), `tickets` the workers'
    read tickets in chain mode (the publisher's `tickets`), `placements` where its routes placed
    each worker (the publisher's `forwarding`: what a link sample may speak of); `rescore`: a
    `learner.verify.Rescorer`, or None (rewards are taken as claimed); `rollout`: how workers
    play episodes (`learner.train.Trainer.rollout_params`; default: one-turn, from `[rollout]`)."""

    def __init__(self, cfg: LearnerConfig, token: str, *, run: Run, buffer: AsyncBuffer, lease_book: LeaseBook,
                 encode, vocab_size: int, model_dir: Path, links: LinkTable | None = None,
                 metrics: LearnerMetrics | None = None, waiters: Waiters | None = None,
                 evals: EvalBook | None = None, on_eval=lambda result: None, rescore=None, fleet=None,
                 broadcast: P.BroadcastInfo | None = None, on_note=lambda text: None,
                 rollout: P.RolloutParams | None = None, lora: P.LoraInfo | None = None, tickets=None, placements=None,
                 machine_key: str = "", task_dirs: dict[str, tuple[Path, str]] | None = None):
        self.cfg, self.token, self.run = cfg, token, run
        self.machine_key = machine_key  # what machine tokens are keyed by (`scheduler.providers`); "": none valid
        self.lora = lora  # LoRA mode: told at join; /v1/model then serves the base's weights too
        self.task_dirs = task_dirs or {}  # option -> (directory, digest): the task's model directories (`Task.model_dirs`)
        r = cfg.rollout
        self.rollout = rollout or P.RolloutParams(group_size=r.group_size, max_new_tokens=r.max_new_tokens,
                                                  temperature=r.temperature, top_p=r.top_p,
                                                  max_tokens=r.max_new_tokens)
        if self.rollout.scored_by_learner and (rescore is None or cfg.verify.rescore_fraction < 1.0):
            raise ValueError("workers told the learner scores every group (rollout.scored_by_learner) need a rescorer "
                             "and [verify] rescore_fraction = 1: they send no rewards")
        self.metrics = metrics or LearnerMetrics()
        self.links = links or link_table(cfg.broadcast)
        self.verifier = Verifier(cfg.verify, seed=cfg.run.seed)
        # Blocking work a request needs (decoding uploads, recomputing rewards, reading files) runs here.
        self.offload = ThreadPoolExecutor(2, thread_name_prefix="offload")
        self.broadcast = broadcast or P.BroadcastInfo()
        self.leases = LeaseRoom(lease_book, buffer, run, cfg.server, backpressure=cfg.buffer.backpressure,
                                encode=encode, metrics=self.metrics, evals=evals, waiters=waiters,
                                answers=not self.rollout.scored_by_learner)
        self.registry = WorkerRegistry(cfg.server, cfg.verify, run=run, leases=self.leases, buffer=buffer,
                                       links=self.links, verifier=self.verifier, metrics=self.metrics, fleet=fleet,
                                       tickets=tickets, placements=placements, on_note=on_note)
        shared = dict(run=run, registry=self.registry, metrics=self.metrics, vocab_size=vocab_size,
                      offload=self.offload, rescore=rescore)
        self.uploads = UploadRoom(cfg, buffer=buffer, leases=self.leases, max_tokens=self.rollout.max_tokens,
                                  stop_ids=tuple(self.rollout.stop_ids), turn_tokens=self.rollout.max_new_tokens,
                                  claimed_rewards=not self.rollout.scored_by_learner,
                                  **shared)
        self.evals = EvalRoom(cfg, evals, run=run, metrics=self.metrics, vocab_size=vocab_size, offload=self.offload,
                              rescore=rescore, on_result=on_eval)
        self.status = StatusRoom(run=run, buffer=buffer, leases=self.leases, registry=self.registry,
                                 links=self.links, metrics=self.metrics, model_dir=model_dir, offload=self.offload,
                                 serve_weights=lora is not None, task_dirs={k: d for k, (d, _) in self.task_dirs.items()},
                                 metrics_from=[ipaddress.ip_network(n, strict=False) for n in cfg.server.metrics_from],
                                 workers_per_address=cfg.server.max_workers_per_address)

    def app(self) -> web.Application:
        cfg = self.cfg
        app = web.Application(client_max_size=int(cfg.server.max_body_mb * (1 << 20)), middlewares=[errors_as_json])
        app.on_response_prepare.append(no_version_banner)
        app[BODY_TIMEOUT] = cfg.server.body_timeout_s
        auth = Auth(self.token, self.registry.workers, self.metrics.auth_refused, self.registry.addresses,
                    [ipaddress.ip_network(n, strict=False) for n in cfg.server.trusted_proxies], self.machine_key,
                    cfg.server.auth_failure_delay_s)
        app.add_routes(self.registry.routes(auth, welcome(cfg.server, cfg.task, self.rollout, self.run, self.broadcast,
                                                           self.lora, {k: h for k, (_, h) in self.task_dirs.items()})))
        app.add_routes(self.leases.routes(auth))
        app.add_routes(self.uploads.routes(auth))
        app.add_routes(self.evals.routes(auth))
        self.status.add_routes(app, auth)
        app.cleanup_ctx.append(self._encoding_ahead)
        return app

    async def _encoding_ahead(self, app: web.Application):
        """While serving, the next batch's prompts are encoded before any worker asks for them."""
        task = asyncio.create_task(self.leases.encode_ahead(self.cfg.trainer.batch_prompts))
        yield
        task.cancel()

    def runner(self) -> web.AppRunner:
        """The app's runner. aiohttp's keep-alive timer also runs from a connection's opening: a
        connection that has not sent a whole request by then (slow headers, or nothing) is closed.
        Each address (IPv6: its /64; its /48 `max_64s_per_48` times that) holds at most
        `CONNECTIONS_PER_WORKER` connections per worker it may join (trusted proxies: any number).
        No body is inflated by HTTP (`auto_decompress=False`): a gzip body declaring nothing was
        inflated whole, 2.5 GiB from 2.5 MiB, before any handler could refuse it."""
        server_log = logging.getLogger("aiohttp.server")
        if not any(isinstance(f, MalformedRequests) for f in server_log.filters):
            server_log.addFilter(MalformedRequests())
        return QuietRunner(self.app(), answer=_unreadable, rejected=self.metrics.rejected,
                           limits=worker_connections(self.cfg.server), access_log=None,
                           left_unread=int(self.cfg.server.max_body_mb * (1 << 20)),
                           keepalive_timeout=self.cfg.server.header_timeout_s, auto_decompress=False)

    async def start(self, host: str, port: int, reap_every: float) -> str:
        """Serve on `host:port` (0: a free port) and start the reaper; returns the URL workers join."""
        self._runner = self.runner()
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.reaping = asyncio.create_task(self.reaper(reap_every))
        return http_url(host, site._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self.reaping.cancel()
        await self._runner.cleanup()

    async def reaper(self, period: float) -> None:
        """Expire silent workers' leases so their prompts are re-issued; forget long-silent workers."""
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            self.leases.reap(now)
            self.registry.reap(now)
            alive = self.registry.alive(now)
            self.leases.book.alive = len(alive)
            self.evals.reap(now, alive)
            self.metrics.workers.set(len(alive))

    def close(self) -> None:
        self.offload.shutdown()
        self.leases.close()
