"""What every room of the control API shares: JSON errors, typed bodies, and who is calling.

Every error a worker sees is JSON (`echo.protocol.ErrorReply`) with a reason and a message
saying what to do. Bodies are read bounded and validated against their protocol model.
`Auth` tells the run token (joins, the operator) and machine tokens (a provider's machines,
keyed by the run's machine key, which no worker holds) from a worker's own credential, and
throttles an address that keeps presenting wrong ones.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections.abc import Mapping

from aiohttp import web

try:  # a deadline on the awaiting task itself; wait_for wraps the read in a task of its own per request
    from asyncio import timeout as deadline  # Python 3.11+
except ImportError:  # 3.10: aiohttp's own dependency there
    from async_timeout import timeout as deadline

from broadcast.addresses import in_networks
from broadcast.receipts import receipt_key
from broadcast.transport import bearer
from echo import protocol as P
from learner.addresses import AddressBook, client_address
from scheduler.providers import machine_of


BODY_TIMEOUT = web.AppKey("body_timeout_s", float)  # [server] body_timeout_s, set on the app


class Refusal(Exception):
    """A route refuses the request: answered as `json_error(status, reason, message, headers)`."""

    def __init__(self, status: int, reason: str, message: str, headers: dict | None = None, delay_s: float = 0.0):
        super().__init__(message)
        self.status, self.reason, self.message, self.headers = status, reason, message, headers
        self.delay_s = delay_s  # answered this late (`Auth.failure_delay_s`)

    def response(self) -> web.Response:
        return json_error(self.status, self.reason, self.message, self.headers)


def json_error(status: int, reason: str, message: str, headers: dict | None = None) -> web.Response:
    return reply(P.ErrorReply(error=reason, message=message), status, headers)


def reply(message: P.Message, status: int = 200, headers: dict | None = None) -> web.Response:
    """`message` as JSON, serialized by pydantic's compiled encoder: `json.dumps(model_dump())`
    cost a heartbeat's reply a fifth of the learner's time for the whole request."""
    return web.Response(body=message.model_dump_json().encode(), status=status, headers=headers,
                        content_type="application/json")


# What the learner keeps of a worker's secret, and the key that worker signs its relay's receipts
# with (the learner checks them with it): one function, so the two cannot drift apart.
secret_hash = receipt_key


ABORTED = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)  # the peer went away mid-body


def refuse_encoding(request: web.Request, rejected) -> None:
    """415 for a body sent with a `Content-Encoding` (gzip, deflate, ...): aiohttp would inflate it
    before the learner holds it, so the bytes counted against the limits would not be the bytes
    held. Nothing echo sends is compressed by HTTP (uploads are zstd inside). Every
    Content-Encoding header and every coding listed in one counts: aiohttp's parser inflated by a
    second header (`identity` then `gzip`) that `headers.get` never showed. (The server does not
    inflate bodies at all either: `auto_decompress=False` in `ControlApi.runner`.)"""
    codings = [c.strip().lower() for h in request.headers.getall("Content-Encoding", []) for c in h.split(",")]
    encoding = next((c for c in codings if c not in ("", "identity")), "")
    if encoding:
        rejected.labels("content-encoding").inc()
        raise Refusal(415, "content-encoding", f"Content-Encoding {encoding[:32]!r} is not accepted: send the body "
                                               "as it is, without a Content-Encoding header (trajectories are "
                                               "zstd-compressed inside already)")


def aborted(rejected) -> Refusal:
    """The client closed its connection while its body was being read: counted, no traceback (the
    answer goes nowhere; aiohttp drops it quietly)."""
    rejected.labels("aborted").inc()
    return Refusal(400, "aborted", "the connection closed before the request body arrived")


async def read_in_time(request: web.Request, read, rejected) -> bytes:
    """`await read()` (the request's body) within `[server] body_timeout_s`, else 408: a trickled
    body would hold its handler (and a connection) as long as the sender likes. A sender that hung
    up mid-body is counted, not logged."""
    timeout = request.config_dict.get(BODY_TIMEOUT, 60.0)
    try:
        async with deadline(timeout):
            return await read()
    except asyncio.TimeoutError:
        rejected.labels("slow-body").inc()
        raise Refusal(408, "slow-body", f"the request body did not arrive within [server] body_timeout_s = "
                                        f"{timeout:g} s") from None
    except ABORTED:
        raise aborted(rejected) from None


async def body_at_most(request: web.Request, most: int) -> bytes:
    """The request's body; past `most` bytes, 413 (`HTTPRequestEntityTooLarge`) however it is
    framed: a chunked body has no length to check first."""
    chunks, size = [], 0
    while chunk := await request.content.read(1 << 16):
        size += len(chunk)
        if size > most:
            raise web.HTTPRequestEntityTooLarge(max_size=most, actual_size=size)
        chunks.append(chunk)
    return b"".join(chunks)


async def continue_later(request: web.Request) -> None:
    """A route's `expect_handler`: nothing yet. `invite_body` answers `Expect: 100-continue` once
    the request is admitted (its credential, and its declared length within the route's bound),
    not before, as aiohttp's default does."""


async def invite_body(request: web.Request) -> None:
    if request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")


async def read_body(request: web.Request, model: type[P.Message], rejected) -> P.Message:
    """The request's JSON body as `model`, at most `model.max_bytes`; a bad one counts in `rejected`.
    Its route's `expect_handler` is `continue_later`: the body is invited here."""
    refuse_encoding(request, rejected)
    if (request.content_length or 0) > model.max_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=model.max_bytes, actual_size=request.content_length)
    await invite_body(request)

    body = await read_in_time(request, lambda: body_at_most(request, model.max_bytes), rejected)
    try:
        return P.parse_json(model, body)  # bounded nesting: a deep array is a 400, not a 500
    except P.ProtocolError as e:
        rejected.labels("bad-request").inc()
        raise web.HTTPBadRequest(text=str(e)) from None


class Auth:
    """The run token admits joins and the operator; afterwards a worker is known by its own
    credential (`<worker id>.<secret>`) alone. `workers` maps ids to records with a `secret_hash`,
    `quarantined` and `requests` (a `learner.admission.TokenBucket` of its requests, or None)."""

    def __init__(self, token: str, workers: Mapping, refused, addresses: AddressBook | None = None,
                 trusted_proxies: list | None = None, machine_key: str = "", failure_delay_s: float = 0.0):
        self.token, self.workers, self.refused = token, workers, refused  # refused: a Counter by credential kind
        self.failure_delay_s = failure_delay_s  # [server] auth_failure_delay_s: how late a wrong one is answered
        self.machine_key = machine_key  # machine tokens' key ("": none is valid)
        self.addresses = addresses if addresses is not None else AddressBook()
        self.trusted_proxies = trusted_proxies or []

    @staticmethod
    def bearer(request: web.Request) -> str:
        return bearer(request) or ""

    def address(self, request: web.Request) -> str:
        """The caller's own address (behind a trusted proxy: the one it forwarded)."""
        return client_address(request.remote or "", request.headers.get("X-Forwarded-For", ""), self.trusted_proxies)

    def _throttled(self, request: web.Request) -> str:
        address, now = self.address(request), time.monotonic()
        wait = self.addresses.throttled(address, now)
        if wait > 0:
            self.refused.labels("throttled").inc()
            raise Refusal(429, "throttled", f"too many wrong tokens or credentials from {address}; retry after the "
                                            "given seconds", {"Retry-After": str(max(1, round(wait)))},
                          self.failure_delay_s)
        return address

    def run_token(self, request: web.Request, machines: bool = False) -> str | None:
        """Admit the run token (None), or with `machines` a machine token (the machine id it was
        issued for: joins only); else 401."""
        address = self._throttled(request)
        given = self.bearer(request)
        if given and hmac.compare_digest(given.encode(), self.token.encode()):
            return None
        machine = machine_of(self.machine_key, given) if given and machines and self.machine_key else None
        if machine is not None:
            return machine
        self.addresses.failed(address, time.monotonic())
        self.refused.labels("run-token").inc()
        raise Refusal(401, "unauthorized", f"{'missing' if not given else 'wrong'} run token: pass the token the "
                                           "learner printed at start-up (echo-worker join URL --token TOKEN, or $ECHO_TOKEN)",
                      delay_s=self.failure_delay_s)

    def worker(self, request: web.Request):
        """The calling worker (its `last_seen` renewed, unless it is quarantined), or 401.

        A valid credential is served even from a throttled address: the throttle is there to stop
        guessing, and a 192-bit secret is not guessed, so it refuses only wrong ones. Checked
        first, a neighbour behind the same NAT sending wrong credentials locked every honest
        worker of that address out (429 on its uploads: the worker exited)."""
        wid, _, secret = self.bearer(request).partition(".")
        worker = self.workers.get(wid)
        if worker is None or not secret or not hmac.compare_digest(secret_hash(secret), worker.secret_hash):
            address = self._throttled(request)
            self.addresses.failed(address, time.monotonic())
            self.refused.labels("credential").inc()
            raise Refusal(401, "unknown-credential", "unknown or wrong worker credential (the learner restarted or "
                                                     "forgot this worker): join again with the run token",
                          delay_s=self.failure_delay_s)
        self._rate(worker)
        if not worker.quarantined:  # whatever it calls, a quarantined worker is forgotten after forget_after_s
            worker.last_seen = time.monotonic()
        return worker

    def _rate(self, worker) -> None:
        """429 for a worker past its request rate ([server] worker_requests_per_s): one credential
        sending 2-3k cheap requests a second kept most of a learner core busy. Checked after the
        credential (a wrong one has its own throttle, per address); a refused request renews nothing."""
        if worker.requests is None:
            return
        wait = worker.requests.take(time.monotonic())
        if wait > 0:
            self.refused.labels("rate-limited").inc()
            raise Refusal(429, "rate-limited", f"this worker sent more than {worker.requests.rate:g} requests/s "
                                               f"(after a burst of {worker.requests.burst:g}; [server] "
                                               "worker_requests_per_s); retry after the given seconds",
                          {"Retry-After": str(max(1, math.ceil(wait)))})

    def operator(self, request: web.Request, networks: list) -> bool:
        """Requests from `networks` (this machine, by default: True), or anyone with the run token
        (False). Behind a trusted proxy the address judged is the one it forwarded, not the proxy's own."""
        if in_networks(self.address(request), networks):
            return True
        self.run_token(request)
        return False

    def anyone(self, request: web.Request) -> str:
        """The model's files without weights, and which version is latest: any worker, or the
        operator and a provider's machine (`echo-worker doctor`) with the run or a machine token.
        Who reads: the worker's id, else the address. A quarantined worker reads nothing."""
        if "." in self.bearer(request):
            return self.weights_reader(request)
        self.run_token(request, machines=True)
        return self.address(request)

    def weights_reader(self, request: web.Request) -> str:
        """Weights (a snapshot, a LoRA base): a joined worker that is not quarantined, by its
        credential; its id, for counting downloads. Every rented worker holds the run token, so
        it reads no weights: with it, a quarantined worker, from an address banned for forging,
        downloaded every snapshot, 4 copies per address (the API-only tester, 2026-11-29)."""
        if "." not in self.bearer(request):
            self.refused.labels("weights-token").inc()
            raise Refusal(401, "worker-credential", "weights are served to joined workers only: present the "
                                                    "credential /v1/join returned, not the run token")
        worker = self.worker(request)
        refuse_quarantined(worker)
        return worker.id


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
        reason = {401: "unauthorized", 404: "not-found", 413: "oversized", 429: "throttled"}.get(e.status, "bad-request")
        message = e.text or e.reason
        if e.status == 413:
            message = (f"body larger than the learner's limit for this route "
                       f"({P.MAX_JSON_BYTES >> 10} KiB for JSON, [server] max_body_mb for trajectories)")
        retry = {"Retry-After": e.headers["Retry-After"]} if "Retry-After" in e.headers else None
        return json_error(e.status, reason, message, retry)
    except Refusal as e:
        if e.delay_s:
            await asyncio.sleep(e.delay_s)
        return e.response()
