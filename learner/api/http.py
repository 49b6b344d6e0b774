"""What every room of the control API shares: JSON errors, typed bodies, and who is calling.

Every error a worker sees is JSON (`echo.protocol.ErrorReply`) with a reason and a message
saying what to do. Bodies are read bounded and validated against their protocol model.
`Auth` tells the run token (joins, the operator) from a worker's own credential.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Mapping

from aiohttp import web

from echo import protocol as P


class Refusal(Exception):
    """A route refuses the request: answered as `json_error(status, reason, message)`."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def json_error(status: int, reason: str, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response(P.ErrorReply(error=reason, message=message).model_dump(), status=status, headers=headers)


def reply(message: P.Message) -> web.Response:
    return web.json_response(message.model_dump())


def secret_hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


async def read_body(request: web.Request, model: type[P.Message], rejected) -> P.Message:
    """The request's JSON body as `model`, at most `P.MAX_JSON_BYTES`; a bad one counts in `rejected`."""
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
        rejected.labels("bad-request").inc()
        raise web.HTTPBadRequest(text=str(e) if isinstance(e, P.ProtocolError) else "body must be a JSON object") from None


class Auth:
    """The run token admits joins and the operator; afterwards a worker is known by its own
    credential (`<worker id>.<secret>`) alone. `workers` maps ids to records with a `secret_hash`."""

    def __init__(self, token: str, workers: Mapping, refused):
        self.token, self.workers, self.refused = token, workers, refused  # refused: a Counter by credential kind

    @staticmethod
    def bearer(request: web.Request) -> str:
        header = request.headers.get("Authorization", "")
        return header[7:] if header.startswith("Bearer ") else ""

    def run_token(self, request: web.Request) -> None:
        given = self.bearer(request)
        if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
            self.refused.labels("run-token").inc()
            raise web.HTTPUnauthorized(
                text=f"{'missing' if not given else 'wrong'} run token: pass the token the learner printed at "
                     "start-up (echo-worker join URL --token TOKEN, or $ECHO_TOKEN)")

    def worker(self, request: web.Request):
        """The calling worker (its `last_seen` renewed), or 401."""
        wid, _, secret = self.bearer(request).partition(".")
        worker = self.workers.get(wid)
        if worker is None or not secret or not hmac.compare_digest(secret_hash(secret), worker.secret_hash):
            self.refused.labels("credential").inc()
            raise web.HTTPUnauthorized(reason="unknown-credential",
                                       text="unknown or wrong worker credential (the learner restarted or forgot "
                                            "this worker): join again with the run token")
        worker.last_seen = time.monotonic()
        return worker

    def anyone(self, request: web.Request) -> None:
        """Model files and snapshots: any worker, or the operator with the run token."""
        if "." in self.bearer(request):
            self.worker(request)
        else:
            self.run_token(request)


def refuse_quarantined(worker) -> None:
    if worker.quarantined:
        raise Refusal(403, "quarantined", f"this worker is quarantined: {worker.quarantined}")


@web.middleware
async def errors_as_json(request: web.Request, handler):
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
    except Refusal as e:
        return json_error(e.status, e.reason, e.message)
