"""A local stand-in for the Vast.ai API, for the real `vastai` SDK to talk to (server_url).

It answers the four calls `scheduler/vast.py` makes with the responses kept in
tests/data/vast/ and keeps a market's state: offers (rented ones leave the search), instances
(created from an offer; the on-start command runs as a real local process, the way a rented
machine would run it in its container) and a bill (seconds each instance existed). Tests steer
it: `vanish(offer)` (taken by someone else between search and create), `dud(offer)` (the
machine boots but its on-start never joins), `preempt(instance)` (an interruptible instance
outbid: its process is killed and the instance is `exited`).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

DATA = Path(__file__).resolve().parent / "data" / "vast"
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class FakeInstance:
    id: int
    offer: dict
    label: str
    onstart: str
    image: str
    price: float | None
    created: float = field(default_factory=time.monotonic)
    destroyed: float | None = None
    status: str = "running"
    proc: subprocess.Popen | None = None

    @property
    def billed_s(self) -> float:
        return (self.destroyed or time.monotonic()) - self.created


class FakeVast:
    def __init__(self, workdir: Path, offers: list[dict] | None = None, api_key: str = "fake-vast-key"):
        self.workdir, self.api_key = workdir, api_key
        self.offers = offers if offers is not None else json.loads((DATA / "bundles.json").read_text())["offers"]
        self.instances: dict[int, FakeInstance] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.creates: list[int] = []  # offer ids asked for, in order
        self._vanished: set[int] = set()
        self._duds: set[int] = set()
        self._ids = iter(range(25500101, 25600000))
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.shim = workdir / "bin"
        self.shim.mkdir(parents=True, exist_ok=True)
        echo_worker = self.shim / "echo-worker"  # what the worker image has on its PATH
        echo_worker.write_text(f"#!/bin/sh\nexec {sys.executable} -m worker.main \"$@\"\n")
        echo_worker.chmod(echo_worker.stat().st_mode | stat.S_IEXEC)

    # --- steering ------------------------------------------------------------------------------

    def vanish(self, offer_id: int) -> None:
        """The offer stays in search results until someone tries to rent it: taken meanwhile."""
        self._vanished.add(offer_id)

    def dud(self, offer_id: int) -> None:
        self._duds.add(offer_id)

    def preempt(self, instance_id: int) -> None:
        inst = self.instances[instance_id]
        inst.status = "exited"
        self._kill(inst)

    def by_offer(self, offer_id: int) -> list[FakeInstance]:
        return [i for i in self.instances.values() if i.offer["id"] == offer_id]

    # --- the API -------------------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> None:
        self.requests.append((request.method, request.path))
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            raise web.HTTPUnauthorized(text=json.dumps({"success": False, "error": "auth_error"}),
                                       content_type="application/json")

    async def bundles(self, request: web.Request) -> web.Response:
        self._authorized(request)
        q = await request.json()
        rented = {i.offer["id"] for i in self.instances.values() if i.destroyed is None}
        rows = []
        for o in self.offers:
            if o["id"] in rented or (o["id"] in self._vanished and o["id"] in self.creates):
                continue
            if not all(_matches(o, k, cond) for k, cond in q.items() if isinstance(cond, dict)):
                continue
            row = copy.deepcopy(o)
            row["is_bid"] = q.get("type") == "bid"
            rows.append(row)
        for key, direction in reversed(q.get("order") or []):
            rows.sort(key=lambda r: r.get(key) or 0, reverse=direction == "desc")
        return web.json_response({"offers": rows[: int(q.get("limit") or len(rows))]})

    async def create(self, request: web.Request) -> web.Response:
        self._authorized(request)
        offer_id = int(request.match_info["id"])
        body = await request.json()
        self.creates.append(offer_id)
        offer = next((o for o in self.offers if o["id"] == offer_id), None)
        taken = any(i.offer["id"] == offer_id and i.destroyed is None for i in self.instances.values())
        if offer is None or offer_id in self._vanished or taken:
            gone = json.loads((DATA / "create_gone.json").read_text())
            gone["msg"] = gone["msg"].replace("18421001", str(offer_id))
            return web.json_response(gone, status=400)
        inst = FakeInstance(next(self._ids), offer, body.get("label") or "", body.get("onstart") or "",
                            body.get("image") or "", body.get("price"))
        self.instances[inst.id] = inst
        if offer_id not in self._duds and inst.onstart:
            log = open(self.workdir / f"instance-{inst.id}.log", "w")
            inst.proc = subprocess.Popen(["bash", "-c", inst.onstart], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PATH": f"{self.shim}:{os.environ['PATH']}",
                                              "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
                                         start_new_session=True)
        reply = json.loads((DATA / "create_ok.json").read_text())
        reply["new_contract"] = inst.id
        return web.json_response(reply)

    async def destroy(self, request: web.Request) -> web.Response:
        self._authorized(request)
        inst = self.instances.get(int(request.match_info["id"]))
        if inst is None or inst.destroyed is not None:
            return web.json_response({"success": False, "error": "no_such_instance"}, status=404)
        inst.destroyed = time.monotonic()
        self._kill(inst)
        return web.json_response(json.loads((DATA / "destroy_ok.json").read_text()))

    async def show(self, request: web.Request) -> web.Response:
        self._authorized(request)
        template = json.loads((DATA / "instances.json").read_text())["instances"][0]
        rows = []
        for inst in self.instances.values():
            if inst.destroyed is not None:
                continue
            row = {**copy.deepcopy(template), "id": inst.id, "machine_id": inst.offer["machine_id"],
                   "label": inst.label, "gpu_name": inst.offer["gpu_name"], "dph_total": inst.offer["dph_total"],
                   "onstart": inst.onstart, "image_uuid": inst.image, "actual_status": inst.status,
                   "cur_state": "stopped" if inst.status == "exited" else "running",
                   "intended_status": "running"}
            rows.append(row)
        return web.json_response({"instances": rows, "next_token": None, "total_instances": len(rows)})

    # --- lifecycle -----------------------------------------------------------------------------

    def _kill(self, inst: FakeInstance) -> None:
        if inst.proc is not None and inst.proc.poll() is None:
            os.killpg(inst.proc.pid, signal.SIGKILL)  # the machine is gone, not asked to stop
            inst.proc.wait(10)

    def start(self) -> "FakeVast":
        app = web.Application()
        app.router.add_post("/api/v0/bundles/", self.bundles)
        app.router.add_put("/api/v0/asks/{id}/", self.create)
        app.router.add_delete("/api/v0/instances/{id}/", self.destroy)
        app.router.add_get("/api/v1/instances/", self.show)
        ready = threading.Event()

        async def serve() -> None:
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()

        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop)
        ready.wait(10)
        return self

    def stop(self) -> None:
        for inst in self.instances.values():
            self._kill(inst)
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def _matches(row: dict, key: str, cond: dict) -> bool:
    """The search filters the SDK sends ({"gpu_name": {"in": [...]}, "reliability": {"gt": "0.98"}})."""
    if key not in row:
        return True  # a filter on a field the fake does not model
    value = row[key]
    for op, want in cond.items():
        if op in ("eq", "neq"):
            if isinstance(value, bool) or isinstance(want, bool):
                same = bool(value) == (str(want).lower() == "true" if isinstance(want, str) else bool(want))
            elif isinstance(value, (int, float)):
                same = float(value) == float(want)
            else:
                same = str(value) == str(want)
            if same != (op == "eq"):
                return False
        elif op == "in":
            if value not in want:
                return False
        elif op in ("gt", "gte", "lt", "lte"):
            v, w = float(value), float(want)
            if not {"gt": v > w, "gte": v >= w, "lt": v < w, "lte": v <= w}[op]:
                return False
    return True
