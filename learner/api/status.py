"""The status room: what the learner shows and serves to read.

    GET  /v1/health          that the learner answers (no credential)
    GET  /v1/status          JSON status (run token)
    GET  /metrics            Prometheus
    GET  /v1/model           the model directory minus weights (config, tokenizer)
    GET  /v1/task-dirs/NAME  a model directory the task's environment reads (poker's LLM opponent)
    GET  /v1/snapshots/...   versioned weights (broadcast.star)

Reading is free of side effects; files are read on the `offload` threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from pathlib import Path

from aiohttp import web

from broadcast.addresses import NoTurn, StreamGate, address_key, in_networks
from broadcast.links import LinkTable
from broadcast.star import add_star_routes, parse_version, write_in_time
from echo import dirfiles
from learner.addresses import remember
from learner.admission import TokenBucket
from learner.api.http import Auth, Refusal, refuse_quarantined
from learner.api.leases import LeaseRoom
from learner.api.run import Run
from learner.api.workers import WorkerRegistry
from learner.buffer import AsyncBuffer
from learner.metrics import LearnerMetrics

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
# How often one reader may download one version's snapshot (a retry or two after a failed
# check; an honest worker needs it once): one worker looping over it sent 7.8 Gbit/s of 1.2 MB
# snapshots, and with an 8B model's 16 GB it fills the learner's uplink every other worker needs.
MAX_SNAPSHOT_DOWNLOADS = 4
STATUS_EVERY_S = 1.0  # /v1/status is rebuilt at most this often
VIEWS_PER_S, VIEW_BURST = 1.0, 10  # /v1/status and /metrics from outside metrics_from, per address (`_paced`)
WEIGHT_STREAMS_PER_ADDRESS = 4  # weights (snapshots, a LoRA base, task dirs) sent to one address at once (`StreamGate`)
TURN_WAIT_S = 60.0  # ...the rest wait this long for a turn, then 429 `busy` uncounted (under echo-worker's 120 s read timeout)
COUNTED = web.RequestKey("counted download", tuple)  # the counts a request's download took (`_count_download`)
MAX_SERVED_WEIGHTS = 2 << 30  # LoRA mode: the largest base /v1/model?weights=1 sends (a worker sets base_dir beyond)


class StatusRoom:
    def __init__(self, *, run: Run, buffer: AsyncBuffer, leases: LeaseRoom, registry: WorkerRegistry,
                 links: LinkTable, metrics: LearnerMetrics, model_dir: Path, offload: Executor,
                 metrics_from: list | None = None, serve_weights: bool = False, task_dirs: dict[str, Path] | None = None,
                 workers_per_address: int = 16):
        self.run, self.buffer, self.leases, self.registry = run, buffer, leases, registry
        self.task_dirs = task_dirs or {}  # option -> the directory (`Task.model_dirs`), served whole
        self.metrics_from = metrics_from or []  # networks /metrics answers without the run token
        self.links, self.metrics, self.model_dir, self.offload = links, metrics, model_dir, offload
        self.serve_weights = serve_weights  # LoRA mode: workers without [engine] base_dir fetch the base here
        self._views: dict[bool, tuple[float, bytes]] = {}  # full view? -> (built at, JSON)
        self.downloads: dict[str, int] = {}  # "reader thing" and "@address thing" -> downloads (most recent kept)
        # An address's downloads of one thing, whoever its identities: a worker joining again as a
        # new identity had 4 more of the base each time, without end (an API-only tester, 2026-12-07).
        # Its workers behind one NAT need one each, and a retry or two between them.
        self.per_address = 2 * workers_per_address
        self.views: dict[str, TokenBucket] = {}  # address -> its /v1/status and /metrics calls (`_paced`)
        self.streams = StreamGate(WEIGHT_STREAMS_PER_ADDRESS, TURN_WAIT_S)

    def status(self) -> dict:
        now = time.monotonic()
        registry, book = self.registry, self.leases.book
        alive = {w.id for w in registry.alive(now)}
        leased = book.outstanding_by_worker()
        workers = registry.workers.values()
        return {
            "learner_version": self.run.version,
            "published_version": self.run.published_version,
            "finished": self.run.finished,
            "buffer": self.buffer.buffer.metrics(),
            "leases": {**vars(book.stats), "outstanding": book.outstanding, "waiting_requests": len(self.leases.waiters)},
            "workers": [{**w.row(now, w.id in alive, leased.get(w.id, 0)), **registry.verifier.summary(w.id)}
                        for w in workers],
            "quarantined": [{"id": w.id, "name": w.name, "address": w.address, "reason": w.quarantine_reason,
                             "why": w.quarantined} for w in workers if w.quarantined],
            "links": self.links.to_dict(),
        }

    def status_json(self, full: bool, now: float | None = None) -> bytes:
        """`status()` as JSON, the workers' view built at most once a second: every worker holds the run
        token, and one looping over it (174 KB and 15-30 ms of the event loop at 270 workers) took
        honest heartbeats from 2 to 245 ms. Only the operator's own machines (`metrics_from`) see
        workers' addresses and relay URLs (a worker with the run token learnt every other's) and
        the evidence the learner holds on each (a forger reading its own `token_z` every 2 s
        steered its copies to stay within ±5 of the limit of 8 and had 2,899 forged groups with a
        signal accepted in 155 s; an API-only tester, 2026-11-29)."""
        now = time.monotonic() if now is None else now
        built = self._views.get(full)
        # The operator's own view is always fresh (its tools read it right after acting); only
        # the view any run-token holder gets is shared for a second.
        if full or built is None or now - built[0] >= STATUS_EVERY_S:
            view = self.status()
            if not full:
                # every field of `Verifier.summary` but the lease rate the learner measured: a field added there is hidden too
                evidence = self.registry.verifier.summary("").keys() - {"lease_rate"}
                # and of a quarantine its reason code, not the evidence its message quotes ("+9.2
                # standard deviations": how far the checks let a forger go; an API-only tester)
                hidden = {"address", "relay_url", "why", *evidence}
                reasons = {q["id"]: q["reason"] for q in view["quarantined"]}
                view["workers"] = [{**{k: v for k, v in w.items() if k not in hidden},
                                    "quarantined": reasons.get(w["id"], "")} for w in view["workers"]]
                view["quarantined"] = [{k: v for k, v in q.items() if k not in hidden} for q in view["quarantined"]]
            built = self._views[full] = (now, json.dumps(view).encode())
        return built[1]

    def model_files(self, weights: bool = False) -> dirfiles.Packed:
        """Config and tokenizer files; with `weights` (LoRA mode only) the base's weight files too,
        up to `MAX_SERVED_WEIGHTS` (a larger base: workers set [engine] base_dir)."""
        listed = dirfiles.listed(self.model_dir)
        paths = [p for p in listed if not p.name.endswith(WEIGHT_SUFFIXES) and p.stat().st_size < (64 << 20)]
        if weights and self.serve_weights:
            base = [p for p in listed if p.name.endswith((".safetensors", ".bin"))]
            if sum(p.stat().st_size for p in base) > MAX_SERVED_WEIGHTS:
                raise Refusal(413, "too-large", f"the base is over {MAX_SERVED_WEIGHTS >> 30} GiB, too large to serve: "
                                                "set [engine] base_dir on the worker")
            paths += base
        return dirfiles.Packed(paths)

    def _count_download(self, request: web.Request, reader: str, address: str, thing: str, what: str,
                        advice: str) -> None:
        """One more download of `thing` by `reader` from `address`: past MAX_SNAPSHOT_DOWNLOADS by
        the reader, or `per_address` from the address (its /64), refused (429 `downloads`)."""
        mine, here = f"{reader} {thing}", f"@{address_key(address)} {thing}"
        for key, most, by in ((mine, MAX_SNAPSHOT_DOWNLOADS, "this worker"), (here, self.per_address, "this address")):
            if self.downloads.get(key, 0) >= most:
                raise Refusal(429, "downloads", f"{what} was already downloaded {most} times by {by}; {advice}")
        for key in (mine, here):
            remember(self.downloads, key, self.downloads.get(key, 0) + 1)
        request[COUNTED] = (mine, here)  # given back if it gets no turn (`weights_turn`)

    @contextlib.asynccontextmanager
    async def weights_turn(self, request: web.Request, address: str) -> AsyncIterator[None]:
        """Weights are sent in a turn among the address's streams (`StreamGate`); one that gets
        none in `TURN_WAIT_S` is refused 429 `busy`, its download not counted."""
        try:
            async with self.streams.hold(address):
                yield
        except NoTurn as e:
            for key in request.get(COUNTED, ()):
                if key in self.downloads:
                    self.downloads[key] -= 1
            raise Refusal(429, "busy", f"{e}: retry after the given seconds", {"Retry-After": "5"}) from None

    def task_dir_files(self, option: str) -> dirfiles.Packed:
        """A task's model directory, weights and all, up to `MAX_SERVED_WEIGHTS` (a larger one:
        each worker keeps its own copy, which the join reply's digest checks)."""
        packed = dirfiles.Packed(dirfiles.listed(self.task_dirs[option]))
        if packed.files_size > MAX_SERVED_WEIGHTS:
            raise Refusal(413, "too-large", f"task.{option} is over {MAX_SERVED_WEIGHTS >> 30} GiB, too large to serve: "
                                            f"copy it to the worker and set task.{option} there (its digest is checked)")
        return packed

    async def send(self, request: web.Request, packed: dirfiles.Packed, weights_to: str | None) -> web.StreamResponse:
        """`packed` read on the offload threads a chunk at a time, each written before the next is
        read: what a reader that stops reading holds is one chunk, not the directory. Weights are
        sent in a turn among `weights_to`'s (an address's) streams."""
        async with self.weights_turn(request, weights_to) if weights_to else contextlib.nullcontext():
            return await self._send(request, packed)

    async def _send(self, request: web.Request, packed: dirfiles.Packed) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        resp = web.StreamResponse(headers={"Content-Type": "application/msgpack"})
        resp.content_length = packed.size
        await resp.prepare(request)
        pieces = packed.chunks()
        try:
            while (piece := await loop.run_in_executor(self.offload, next, pieces, None)) is not None:
                if not await write_in_time(request, resp, piece):
                    return resp
            await resp.write_eof()
        except ConnectionResetError:  # the reader went away: nothing more to send, nothing to log
            pass
        finally:
            pieces.close()  # the open file with it
        return resp

    def _paced(self, address: str) -> None:
        """/v1/status and /metrics from outside `metrics_from`: every worker holds the run token
        that opens them, and one looping over /metrics on 4 connections took a whole learner core
        (872/s; on 50, honest heartbeats' p99 went from 5 to 115 ms). At most `VIEWS_PER_S` a
        second per address after `VIEW_BURST`, then 429 `rate-limited`."""
        now, key = time.monotonic(), address_key(address)
        bucket = self.views.pop(key, None) or TokenBucket(VIEWS_PER_S, VIEW_BURST, now)
        wait = bucket.take(now)
        remember(self.views, key, bucket)
        if wait > 0:
            raise Refusal(429, "rate-limited", f"/v1/status and /metrics answer an address outside [server] "
                                               f"metrics_from {VIEWS_PER_S:g} times a second (after {VIEW_BURST}); "
                                               "retry after the given seconds",
                          {"Retry-After": str(max(1, math.ceil(wait)))})

    def add_routes(self, app: web.Application, auth: Auth) -> None:
        async def status(request: web.Request) -> web.Response:
            auth.run_token(request)
            address = auth.address(request)
            full = in_networks(address, self.metrics_from)
            if not full:
                self._paced(address)
            return web.Response(body=self.status_json(full), content_type="application/json")

        async def metrics(request: web.Request) -> web.Response:
            if not auth.operator(request, self.metrics_from):
                self._paced(auth.address(request))
            self.metrics.links(self.links.to_dict())
            return web.Response(body=self.metrics.exposition(), content_type="text/plain")

        async def model_files(request: web.Request) -> web.Response:
            weights = request.query.get("weights") == "1" and self.serve_weights
            reader = auth.weights_reader(request) if weights else auth.anyone(request)
            if weights:  # a base of up to 2 GiB: a few times per reader, as a snapshot
                self._count_download(request, reader, auth.address(request), "base", "the base model",
                                     "use the copy you have, or set [engine] base_dir")
            packed = await asyncio.get_running_loop().run_in_executor(self.offload, self.model_files, weights)
            return await self.send(request, packed, auth.address(request) if weights else None)

        async def task_dir(request: web.Request) -> web.Response:
            """A joined worker's copy of a task directory, each at most MAX_SNAPSHOT_DOWNLOADS times."""
            worker = auth.worker(request)
            refuse_quarantined(worker)
            option = request.match_info["option"]
            if option not in self.task_dirs:
                raise Refusal(404, "no-task-dir", f"this run's task serves no directory {option[:64]!r} "
                                                  f"(it serves: {', '.join(self.task_dirs) or 'none'})")
            self._count_download(request, worker.id, auth.address(request), f"task {option}", f"task.{option}",
                                 "use the copy you have")
            packed = await asyncio.get_running_loop().run_in_executor(self.offload, self.task_dir_files, option)
            return await self.send(request, packed, auth.address(request))

        async def health(request: web.Request) -> web.Response:
            """That the learner answers, for `echo-worker doctor`'s round trip and clock: nothing else."""
            return web.Response(body=b'{"ok": true}', content_type="application/json")

        # No HEAD: aiohttp answers one with the GET handler, and a streamed reply (`send`) wrote its
        # whole body after the headers, which the client then read as its next response.
        app.router.add_get("/v1/health", health, allow_head=False)
        app.router.add_get("/v1/model", model_files, allow_head=False)
        app.router.add_get("/v1/task-dirs/{option}", task_dir, allow_head=False)
        app.router.add_get("/v1/status", status, allow_head=False)
        app.router.add_get("/metrics", metrics, allow_head=False)
        def snapshot_reader(request: web.Request) -> None:
            """Which version is latest: anyone `auth.anyone` admits. A version's weights: a joined
            worker (`auth.weights_reader`), each version at most MAX_SNAPSHOT_DOWNLOADS times."""
            version = request.match_info.get("version")
            if version is None:  # /latest: a few bytes of JSON
                auth.anyone(request)
                return
            reader = auth.weights_reader(request)
            # Counted only for a version held, by number: the path's raw text (up to 8 KB) was the
            # key, 65,536 of them ~540 MB from any run-token holder.
            number = parse_version(version)
            if self.run.blobs.get(number) is None:
                return  # the snapshot route answers it (404)
            self._count_download(request, reader, auth.address(request), str(number), f"version {number}",
                                 "install the copy you have, or the next version")

        add_star_routes(app, self.run.blobs, "/v1/snapshots", snapshot_reader,
                        gate=lambda request: self.weights_turn(request, auth.address(request)))
