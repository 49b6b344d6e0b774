"""The worker's side of the control API: typed calls (`echo.protocol`), learner errors as exceptions.

The run token admits the join; every later call carries the per-worker credential the join
answered. When the learner no longer knows the credential (it restarted, or forgot a worker
silent too long) a call raises `Forgotten`, and the worker joins again.
"""

from __future__ import annotations

import asyncio
from urllib.parse import quote

import aiohttp
import msgpack

from broadcast.star import BlobInfo, fetch_blob
from echo import protocol as P
from echo.wire import CONTENT_TYPE, Submission, encode_submission


class LearnerError(Exception):
    """The learner refused a request; `reason` is its stable code."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float = 0.0):
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status, self.reason, self.message, self.retry_after = status, reason, message, retry_after


class Forgotten(LearnerError):
    """The learner does not know this worker's credential (restarted, or forgot it): join again."""


class RunFinished(Exception):
    """The learner says the run is over."""


class LearnerClient:
    def __init__(self, session: aiohttp.ClientSession, url: str, token: str):
        self.session = session
        self.url = url.rstrip("/")
        self.token = token
        self.worker_id = ""
        self.credential = ""

    def _headers(self, run_token: bool = False) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token if run_token or not self.credential else self.credential}"}

    async def _call(self, method: str, path: str, run_token: bool = False, **kw) -> aiohttp.ClientResponse:
        headers = {**self._headers(run_token), **kw.pop("headers", {})}
        resp = await self.session.request(method, self.url + path, headers=headers, **kw)
        if resp.status >= 400:
            try:
                body = await resp.json()
            except (aiohttp.ContentTypeError, ValueError):
                body = {"error": "http", "message": (await resp.text())[:300]}
            resp.release()
            if resp.status == 410:
                raise RunFinished(body.get("message", "run finished"))
            kind = Forgotten if body.get("error") == "unknown-credential" else LearnerError
            try:
                retry_after = float(resp.headers.get("Retry-After", 0))
            except ValueError:
                retry_after = 0.0
            raise kind(resp.status, body.get("error", "http"), body.get("message", ""), retry_after)
        return resp

    async def _json(self, path: str, message: P.Message, reply: type[P.Message], run_token: bool = False) -> P.Message:
        async with await self._call("POST", path, run_token=run_token, json=message.model_dump()) as resp:
            return reply.model_validate(await resp.json())

    async def join(self, report: P.Report) -> P.JoinReply:
        joined = await self._json("/v1/join", report, P.JoinReply, run_token=True)
        self.worker_id, self.credential = joined.worker_id, joined.credential
        return joined

    async def heartbeat(self, report: P.Report) -> P.HeartbeatReply:
        return await self._json("/v1/heartbeat", report, P.HeartbeatReply)

    async def lease(self, max_prompts: int, version: int, wait_s: float = 0.0) -> P.LeaseReply:
        """Prompts to generate with `version` (the installed snapshot): training prompts, an eval
        lease (`eval_version` set: greedy, one sample each), or nothing after waiting up to `wait_s`."""
        return await self._json("/v1/lease", P.LeaseRequest(max_prompts=max_prompts, version=version, wait_s=wait_s),
                                P.LeaseReply)

    async def submit_eval(self, lease_id: str, version: int, rewards: dict[str, float],
                          completions: dict[str, list[int]]) -> P.EvalReply:
        """An eval lease's answers: the learner scores the completions itself and checks the rewards."""
        return await self._json("/v1/eval", P.EvalSubmission(lease_id=lease_id, version=version, rewards=rewards,
                                                             completions=completions), P.EvalReply)

    async def release(self, lease_id: str) -> P.ReleaseReply:
        """Give a lease's prompts back unanswered (they are re-issued at once)."""
        return await self._json("/v1/release", P.ReleaseRequest(lease_id=lease_id), P.ReleaseReply)

    async def submit(self, submission: Submission) -> P.UploadReply:
        body = await asyncio.to_thread(encode_submission, submission)  # zstd: off the event loop
        async with await self._call("POST", "/v1/trajectories", data=body,
                                    headers={"Content-Type": CONTENT_TYPE}) as resp:
            return P.UploadReply.model_validate(await resp.json())

    async def model_files(self, weights: bool = False) -> dict[str, bytes]:
        async with await self._call("GET", "/v1/model?weights=1" if weights else "/v1/model") as resp:
            return msgpack.unpackb(await resp.read(), raw=False)

    async def task_dir(self, option: str) -> dict[str, bytes]:
        """One of the task's model directories (`TaskInfo.model_dirs`): {file name: bytes}."""
        async with await self._call("GET", f"/v1/task-dirs/{quote(option, safe='')}") as resp:
            files = msgpack.unpackb(await resp.read(), raw=False)
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, bytes) for k, v in files.items()):
            raise LearnerError(resp.status, "bad-task-dir", f"task.{option}: not a directory's files")
        return files

    async def snapshot(self, info: BlobInfo) -> bytes:
        return await fetch_blob(self.session, f"{self.url}/v1/snapshots/{info.version}", info, headers=self._headers())
