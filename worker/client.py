"""The worker's side of the control API: typed calls, and learner errors as exceptions."""

from __future__ import annotations

from typing import Any

import aiohttp
import msgpack

from broadcast.star import BlobInfo, fetch_blob
from echo.wire import CONTENT_TYPE, Submission, encode_submission


class LearnerError(Exception):
    """The learner refused a request; `reason` is its stable code."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class RunFinished(Exception):
    """The learner says the run is over."""


class LearnerClient:
    def __init__(self, session: aiohttp.ClientSession, url: str, token: str):
        self.session = session
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"}
        self.worker_id = ""

    async def _call(self, method: str, path: str, **kw) -> aiohttp.ClientResponse:
        headers = {**self.headers, **kw.pop("headers", {})}
        resp = await self.session.request(method, self.url + path, headers=headers, **kw)
        if resp.status >= 400:
            try:
                body = await resp.json()
            except (aiohttp.ContentTypeError, ValueError):
                body = {"error": "http", "message": (await resp.text())[:300]}
            resp.release()
            if resp.status == 410:
                raise RunFinished(body.get("message", "run finished"))
            raise LearnerError(resp.status, body.get("error", "http"), body.get("message", ""))
        return resp

    async def _json(self, path: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        async with await self._call("POST", path, json=payload) as resp:
            return None if resp.status == 204 else await resp.json()

    async def join(self, info: dict[str, Any]) -> dict[str, Any]:
        joined = await self._json("/v1/join", info)
        self.worker_id = joined["worker_id"]
        return joined

    async def heartbeat(self, info: dict[str, Any]) -> dict[str, Any]:
        return await self._json("/v1/heartbeat", {"worker_id": self.worker_id, **info})

    async def lease(self, max_prompts: int, version: int) -> dict[str, Any] | None:
        """Prompts to generate with `version` (the installed snapshot): training prompts, or an
        eval lease (`"eval": {"version": v}`: greedy, one sample each)."""
        return await self._json("/v1/lease", {"worker_id": self.worker_id, "max_prompts": max_prompts,
                                              "version": version})

    async def submit_eval(self, lease_id: str, version: int, rewards: dict[str, float]) -> dict[str, Any]:
        return await self._json("/v1/eval", {"worker_id": self.worker_id, "lease_id": lease_id, "version": version,
                                             "rewards": rewards})

    async def release(self, lease_id: str) -> dict[str, Any]:
        """Give a lease's prompts back unanswered (they are re-issued at once)."""
        return await self._json("/v1/release", {"worker_id": self.worker_id, "lease_id": lease_id})

    async def submit(self, submission: Submission) -> dict[str, Any]:
        async with await self._call("POST", "/v1/trajectories", data=encode_submission(submission),
                                    headers={"Content-Type": CONTENT_TYPE}) as resp:
            return await resp.json()

    async def model_files(self) -> dict[str, bytes]:
        async with await self._call("GET", "/v1/model") as resp:
            return msgpack.unpackb(await resp.read(), raw=False)

    async def snapshot(self, info: BlobInfo) -> bytes:
        return await fetch_blob(self.session, f"{self.url}/v1/snapshots/{info.version}", info, headers=self.headers)
