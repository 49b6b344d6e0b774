"""The aiohttp transport (`http://`, `https://` peers): pushes as chunked POSTs, pulls as streamed
GETs. Endpoints of every node (prefix `/bcast/v1`), each a thin adapter over the node's core:

- `POST /push` — the push stream (manifest, route, sender, then chunk frames);
- `GET /chunks/{key}?from=k&to=e` — chunks k..e-1 as they become verified (repair, pulls);
- `GET /manifest/{key}` — the signed manifest (late joiners).

Every node serves these on its aiohttp server, whatever it advertises; `GET /health` answers
the learner's join probe (`probe`), and the learner's `GET /routes` is its route feed
(`broadcast.source`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator

import aiohttp
import msgpack
from aiohttp import web

from broadcast.manifest import BroadcastError
from broadcast.tickets import LEARNER, PROOF_HEADER, Proof, prove
from broadcast.transport import (
    MAX_HEADER_BYTES, PREFIX, Hop, ProtocolError, Refused, Transport, bearer, check_pull_header, http_url, read_header,
)

if TYPE_CHECKING:
    from broadcast.node import Node

log = logging.getLogger("echo.broadcast")
#: One long poll of the route feed: the learner answers within `broadcast.source.FEED_WAIT_S`.
FEED_TIMEOUT = aiohttp.ClientTimeout(total=90, sock_connect=10)


async def bounded_read(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """A peer's reply body, refused (`ProtocolError`) past `limit` bytes: a relay that answered
    the learner's push with an endless body had it buffered, 2 GB per push (an API-only tester,
    2026-12-07)."""
    if (resp.content_length or 0) > limit:
        resp.close()
        raise ProtocolError(f"{resp.url.host}: a reply of {resp.content_length} B, over the {limit} B limit")
    data = bytearray()
    while piece := await resp.content.read(limit + 1 - len(data)):
        data += piece
        if len(data) > limit:
            resp.close()  # the rest is never read
            raise ProtocolError(f"{resp.url.host}: a reply over the {limit} B limit")
    return bytes(data)


async def reply_text(resp: aiohttp.ClientResponse, limit: int) -> str:
    """The first `limit` bytes of a peer's reply (a refusal's reason, a receipt) as text; the rest
    is never read."""
    data = bytearray()
    while len(data) < limit and (piece := await resp.content.read(limit - len(data))):
        data += piece
    if not resp.content.at_eof():
        resp.close()
    return data.decode(errors="replace")


class HttpTransport(Transport):
    schemes = ("http", "https")

    def __init__(self, node: "Node", connect_timeout: float) -> None:
        self.node, self.connect_timeout = node, connect_timeout
        self._session: aiohttp.ClientSession | None = None  # made in start(), on the event loop

    async def start(self) -> None:
        # Not in __init__: `Node.transport_for` builds transports on a thread (an import may be
        # slow), where aiohttp finds no running loop ("no running event loop" killed a worker's
        # pull after it joined again; a new user, 2026-12-07).
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout), auto_decompress=False)

    @classmethod
    def for_node(cls, node: "Node", advertised: bool) -> "HttpTransport":
        return cls(node, node.connect_timeout)

    @classmethod
    async def probe(cls, url: str, timeout_s: float) -> bool:
        async def health() -> bool:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{url.rstrip('/')}{PREFIX}/health") as resp:
                    return resp.status == 200

        return await asyncio.wait_for(health(), timeout_s)

    @property
    def url(self) -> str:
        return http_url(self.node.host, self.node.port)  # bound to 0.0.0.0: the address others reach

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()

    # -- client half -----------------------------------------------------------------------------
    def _read(self, proof: tuple[str | None, str, str] | None = None) -> dict[str, str]:
        """Every request presents the node's read ticket, as renewed now; a pull or a push also
        proves it is this node's (`proof`: the node it goes to, the method and the path)."""
        if not self.node.read_token:
            return {}
        headers = {"Authorization": f"Bearer {self.node.read_token}"}
        if proof is not None and proof[0] is not None and self.node.proof_key is not None:
            headers[PROOF_HEADER] = prove(self.node.proof_key, *proof)
        return headers

    async def push(self, url: str, body: Any, ticket: str | None = None, audience: str | None = None) -> tuple[int, str]:
        # A ticket of this node's own is proven; one naming the child as its audience (the source's) needs no proof
        own = not ticket or ticket == self.node.read_token
        read = self._read((audience, "POST", PREFIX + "/push")) if own else {"Authorization": f"Bearer {ticket}"}
        async with self._session.post(f"{url}{PREFIX}/push", data=body,
                                      headers={"Content-Type": "application/octet-stream", **read}) as resp:
            return resp.status, await reply_text(resp, 300)

    @contextlib.asynccontextmanager
    async def pull(self, url: str, key: str, start: int, end: int, audience: str | None = None) -> AsyncIterator[Any]:
        # No read timeout here: the receiver's stall guard watches progress.
        path = f"{PREFIX}/chunks/{key}"
        async with self._session.get(f"{url}{path}", params={"from": start, "to": end},
                                     headers=self._read((audience, "GET", path))) as resp:
            if resp.status != 200:
                raise Refused(resp.status, await reply_text(resp, 200))
            check_pull_header(await read_header(resp.content), key, start)
            yield resp.content

    async def manifest(self, url: str, key: str) -> bytes | None:
        async with self._session.get(f"{url}{PREFIX}/manifest/{key}", headers=self._read()) as resp:
            return await bounded_read(resp, MAX_HEADER_BYTES) if resp.status == 200 else None

    async def route_feed(self, url: str, after: int, node_id: str) -> dict:
        async with self._session.get(f"{url.rstrip('/')}{PREFIX}/routes", params={"after": after, "id": node_id},
                                     timeout=FEED_TIMEOUT, headers=self._read()) as resp:
            if resp.status != 200:
                raise Refused(resp.status, (await resp.text())[:200])
            return msgpack.unpackb(await resp.read(), raw=False)

    # -- server half (routes of the node's aiohttp app) -------------------------------------------
    def routes(self) -> list[web.RouteDef]:
        return [web.post(PREFIX + "/push", self._handle_push),
                # No HEAD: aiohttp answers one with the GET handler, and the chunk stream wrote its
                # whole body after the headers, which the client then read as its next response.
                web.get(PREFIX + "/chunks/{key}", self._handle_chunks, allow_head=False),
                web.get(PREFIX + "/manifest/{key}", self._handle_manifest, allow_head=False)]

    @staticmethod
    def _proof(request: web.Request, path: str) -> Proof:
        """What `request` offers to prove its ticket is its sender's (`broadcast.tickets`): the
        path as the route names it, whatever prefix the sender's URL had."""
        return Proof(request.headers.get(PROOF_HEADER), request.method, path)

    async def _handle_push(self, request: web.Request) -> web.StreamResponse:
        # Plain HTTP proves no peer; the read ticket names one. Any holder's push, claiming to come
        # from the source, was taken by a relay not yet receiving that version: a stranger could
        # trickle it and hold the relay off the version (its parent's push then 409), or take the
        # relay's receipt (an API-only tester, 2026-11-29).
        # a `Refused` is answered by the node's middleware
        holder = self.node.require_read(bearer(request), self._proof(request, PREFIX + "/push"))

        def identity(sender: Hop, route: Any) -> str | None:
            """Why the ticket's holder is not the sender the signed route names, or None."""
            expected = LEARNER if sender.id == route.source.id else sender.id
            if holder is None or holder == expected:  # None: a node that checks no tickets
                return None
            return f"the push's read ticket is {holder[:64]!r}'s, but the route names {sender.id[:64]!r} as its sender"

        status, text = await self.node.accept_push(request.content, peer=request.remote, identity=identity)
        if status == 200:
            return web.json_response(text=text)
        if status == 409:
            # Reply without cutting the connection: the sender must read this 409 (it means "taken
            # care of", not "failed"); its client stops sending once it has the reply.
            return web.Response(status=409, text=text)
        # Refused, or a bad upstream: reply, then drop its connection so it stops sending.
        resp = web.Response(status=status, text=text)
        resp.force_close()
        try:
            await resp.prepare(request)
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the sender is gone already
        if request.transport is not None:
            request.transport.close()
        return resp

    async def _handle_chunks(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        holder = self.node.require_read(bearer(request), self._proof(request, f"{PREFIX}/chunks/{request.match_info['key']}"))
        store, start, end = await self.node.open_pull(request.match_info["key"], q.get("from", "0"), q.get("to"))
        self.node.pulled(store, holder, start, end)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await resp.prepare(request)
        try:
            await self.node.serve_pull(store, start, end, resp.write, holder)
            await resp.write_eof()
        except (ConnectionError, aiohttp.ClientError, BroadcastError, RuntimeError) as e:
            log.info("%s: pull of %s from %d ended: %s", self.node.id, store.key, start, e)
            if request.transport is not None:
                request.transport.close()
        return resp

    async def _handle_manifest(self, request: web.Request) -> web.Response:
        self.node.require_read(bearer(request))
        wire = self.node.manifest_wire(request.match_info["key"])
        if wire is None:
            raise web.HTTPNotFound(text=f"{self.node.id} does not hold {request.match_info['key'][:64]!r}")
        return web.Response(body=wire, content_type="application/octet-stream")
