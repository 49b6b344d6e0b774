"""`echo-worker` against a learner that refuses for now: a real learner and a real worker process
on loopback, with a small reverse proxy between them that answers the first requests of a route
with 503/429 and `Retry-After`, as a busy learner does, then forwards everything."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading

import aiohttp
from aiohttp import web

from conftest import start_worker

FORWARDED_HEADERS = ("Authorization", "Content-Type")
ANSWERED_HEADERS = ("Content-Type", "Retry-After", "X-Sha256", "X-Version")


class RefusingProxy:
    """Forwards every request to `target`, but first refuses `refuse[path] = (status, reason,
    count)`: the first `count` requests to `path` get `status` with a JSON error and Retry-After: 1.
    Uploads are recorded by their bytes, refused or forwarded (with the learner's answer)."""

    def __init__(self, target: str, refuse: dict[str, tuple[int, str, int]]):
        self.target, self.refuse = target.rstrip("/"), dict(refuse)
        self.refused: list[tuple[str, str]] = []  # (path, sha256 of the body)
        self.uploads: list[tuple[str, int, dict]] = []  # forwarded: (sha256, status, reply)
        self.loop = asyncio.new_event_loop()

    def start(self) -> str:
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait(10)
        return self.url

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=120))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _cleanup(self) -> None:
        await self.session.close()
        await self.runner.cleanup()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        digest = hashlib.sha256(body).hexdigest()
        status, reason, count = self.refuse.get(request.path, (0, "", 0))
        if count > 0:
            self.refuse[request.path] = (status, reason, count - 1)
            self.refused.append((request.path, digest))
            return web.json_response({"error": reason, "message": "refused for now by the test's proxy"},
                                     status=status, headers={"Retry-After": "1"})
        headers = {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}
        async with self.session.request(request.method, self.target + request.path_qs, data=body or None,
                                        headers=headers) as resp:
            data = await resp.read()
            answered = {k: resp.headers[k] for k in ANSWERED_HEADERS if k in resp.headers}
        if request.path == "/v1/trajectories":
            self.uploads.append((digest, resp.status, json.loads(data) if data else {}))
        return web.Response(status=resp.status, body=data, headers=answered)


def test_a_batch_refused_for_now_is_sent_again_not_dropped(learner_factory, tmp_path):
    """The learner refuses uploads with 503 `busy` (too many upload bytes in flight) or 429 while
    a worker is past its request rate: `echo-worker` dropped the batch (and exited on a refused
    lease request). It waits the Retry-After and sends the same upload again, which is accepted.
    A start-up download refused 429 `busy` (its address's turn at the weights) is asked again."""
    lp = learner_factory(run={"steps": 3}, buffer={"max_staleness": 4})  # the waits make no group stale
    # and the model's files at start-up: 429 `busy` while four others at its address download weights
    proxy = RefusingProxy(lp.url, {"/v1/trajectories": (503, "busy", 2), "/v1/lease": (429, "rate-limited", 1),
                                   "/v1/heartbeat": (429, "rate-limited", 1), "/v1/model": (429, "busy", 2)})
    url = proxy.start()
    try:
        lp.workers.append(start_worker(url, lp.token, "w", tmp_path / "w.log"))
        lp.wait_until(lambda: lp.proc.poll() is not None, 180, "the run to finish")
        assert lp.proc.returncode == 0, lp.output()[-3000:]
    finally:
        proxy.stop()
    log = (tmp_path / "w.log").read_text()
    refused = [digest for path, digest in proxy.refused if path == "/v1/trajectories"]
    assert len(refused) == 2 and {p for p, _ in proxy.refused} == {"/v1/trajectories", "/v1/lease", "/v1/heartbeat",
                                                                   "/v1/model"}
    assert log.count("asking for the model again") == 2
    delivered = {digest: (status, reply) for digest, status, reply in proxy.uploads}
    for digest in refused:  # the very same upload, sent again and taken
        assert digest in delivered, log[-3000:]
        status, reply = delivered[digest]
        assert status == 200 and reply["accepted"] >= 1, reply
    assert log.count("sending it again") >= 3 and "refused" in log
    assert "groups of v" not in log  # no batch given up ("N groups of vX refused")


def test_a_worker_the_learner_refuses_as_quarantined_exits_with_code_3(learner_factory, tmp_path):
    """docs/workers.md: a quarantined worker exits with code 3 (so a supervisor does not restart
    it). Heard on a lease or a join (banned: its address or machine was quarantined), it exited 1."""
    lp = learner_factory(run={"steps": 1000})
    proxies = {reason: RefusingProxy(lp.url, {path: (403, reason, 1000)})
               for path, reason in (("/v1/lease", "quarantined"), ("/v1/join", "banned"))}
    try:  # both at once: each is a worker process's start-up (~10 s)
        workers = {reason: start_worker(proxy.start(), lp.token, f"q-{reason}", tmp_path / f"{reason}.log")
                   for reason, proxy in proxies.items()}
        lp.workers += workers.values()  # killed at the end if one hangs
        for reason, worker in workers.items():
            assert worker.wait(120) == 3, (tmp_path / f"{reason}.log").read_text()[-2000:]
            assert "the learner refused" in (tmp_path / f"{reason}.log").read_text()
    finally:
        for proxy in proxies.values():
            proxy.stop()
