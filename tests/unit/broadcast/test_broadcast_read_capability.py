"""The weights reach no one without a read ticket of the run: a source or relay given a
`read_token` (its own ticket) serves manifests, chunks, pushes, its status and the route feed
only to requests that present a valid ticket signed by the run's key; relays that hold one fetch
as before. A ticket expires, and the source refuses a revoked holder at once (the learner issues
them at join and in heartbeat replies, `broadcast.tickets`)."""

import asyncio
import os
import time

import aiohttp
import pytest

from broadcast.http_transport import PREFIX
from broadcast.relay import Relay
from broadcast.route import route_for, sign_route
from broadcast.signing import SigningKey
from broadcast.source import Source
from broadcast.tickets import PROOF_HEADER, SKEW_S, TICKET_S, Readers, TicketOffice, issue, prove
from broadcast.transport import Hop, Refused, frame_header
from conftest import worker_pass

KEY = SigningKey.generate()


def holder_headers(holder: str, to: str, path: str, method: str = "GET") -> dict:
    """The headers of a worker's own request to node `to`: its ticket, and the proof it is its own."""
    own = worker_pass(KEY, holder)
    return {"Authorization": f"Bearer {own['read_token']}", PROOF_HEADER: prove(own["proof_key"], to, method, path)}


async def fetch(node, to, ticket: str | dict) -> int:
    """The status of `node`'s pull of v1's first chunk from node `to`, presenting `ticket`: a
    worker's pass (`worker_pass`: proven) or a bare ticket (as copied: no proof)."""
    node.read_token, node.proof_key = (ticket["read_token"], ticket["proof_key"]) if isinstance(ticket, dict) else (ticket, None)
    transport = await node.transport_for(to.url)
    try:
        async with transport.pull(to.url, "v1", 0, 1, audience=to.id):
            return 200
    except Refused as e:
        return e.status


def test_nothing_is_served_without_the_read_capability():
    key = KEY
    w1 = worker_pass(KEY, "w1")  # issued now: one made at import expired before a long suite reached this test
    TOKEN = w1["read_token"]

    def proven(path: str) -> dict:  # the ticket's holder proves it on a pull (`broadcast.tickets.prove`)
        if "/chunks/" not in path:
            return {}
        return {PROOF_HEADER: prove(w1["proof_key"], "source", "GET", path.partition("?")[0])}

    async def run():
        src = Source(key, read_token=issue(key, "learner"))
        await src.start()
        await src.publish(os.urandom(1 << 20), 1, chunk_size=256 << 10)
        paths = [f"{PREFIX}/manifest/v1", f"{PREFIX}/chunks/v1?from=0", f"{PREFIX}/status", f"{PREFIX}/routes?wait=0"]
        out = {}
        try:
            async with aiohttp.ClientSession() as session:
                async def get(path: str, name: str, headers: dict) -> None:
                    start = time.monotonic()
                    async with session.get(src.url + path, headers=headers) as resp:
                        body = await resp.read()
                        out[path, name] = (resp.status, len(body), time.monotonic() - start)

                await asyncio.gather(*(get(path, name, headers) for path in paths for name, headers in (
                    ("none", {}), ("wrong", {"Authorization": "Bearer guess"}),
                    ("right", {"Authorization": f"Bearer {TOKEN}", **proven(path)}),
                    ("copied", {"Authorization": f"Bearer {TOKEN}"}))))  # a peer's copy: no proof
                async with session.post(src.url + f"{PREFIX}/push", data=b"x" * 64) as resp:
                    out["push", "none"] = (resp.status, 0)
                right = {"Authorization": f"Bearer {TOKEN}"}
                # HEAD was answered by the GET handler, and the chunk stream wrote its body after the
                # headers; a NaN wait was a 500 with a traceback in the log, every request.
                async with session.head(src.url + f"{PREFIX}/chunks/v1?from=0", headers=right) as resp:
                    out["head", "right"] = (resp.status, 0)
                async with session.get(src.url + f"{PREFIX}/routes?wait=nan", headers=right) as resp:
                    out["nan", "right"] = (resp.status, 0)
                async with session.get(src.url + f"{PREFIX}/health") as resp:
                    out["health", "none"] = (resp.status, 0)
            # The status (pushes, receipts, the stripe plan) answers the node's own machine only:
            # any ticket holder read every relay's once it knew their addresses (a tester, 2026-11-29).
            elsewhere = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            async with aiohttp.ClientSession(connector=elsewhere) as session:
                async with session.get(src.url + f"{PREFIX}/status", headers=right) as resp:
                    out["status", "elsewhere"] = (resp.status, await resp.text())
        finally:
            await src.stop()
        return out

    out = asyncio.run(run())
    for path in (f"{PREFIX}/manifest/v1", f"{PREFIX}/chunks/v1?from=0", f"{PREFIX}/status", f"{PREFIX}/routes?wait=0"):
        assert out[path, "none"][0] == 401 and out[path, "wrong"][0] == 401, (path, out)
        assert out[path, "right"][0] == 200, (path, out)
        # A copied ticket reads what costs nothing (a manifest, the status, the route feed); the
        # weights only with its holder's proof
        assert out[path, "copied"][0] == (401 if "/chunks/" in path else 200), (path, out)
        # A refusal is answered `Node.refusal_delay_s` (1 s) late: a guesser that waits reads one a second.
        assert min(out[path, "none"][2], out[path, "wrong"][2]) >= 0.9, (path, out)
    assert out[f"{PREFIX}/chunks/v1?from=0", "right"][1] >= 1 << 20  # the weights, to the holder only
    assert out["push", "none"][0] == 401
    assert out["head", "right"][0] == 405 and out["nan", "right"][0] == 400
    assert out["health", "none"][0] == 200  # reachability probes carry no weights
    assert out["status", "elsewhere"][0] == 403 and "own machine" in out["status", "elsewhere"][1]


def test_a_relay_with_the_capability_fetches_and_one_without_is_refused():
    key = KEY
    blob = os.urandom(1 << 20)

    async def run():
        src = Source(key, read_token=issue(key, "learner"))
        await src.start()
        await src.publish(blob, 1, chunk_size=256 << 10)
        holder = Relay("w1", key.public_key(), **worker_pass(key, "w1"), source_url=src.url, stall_timeout=3)
        stranger = Relay("w2", key.public_key(), source_url=src.url, stall_timeout=3)
        await holder.start()
        await stranger.start()
        try:
            transport = await holder.transport_for(src.url)
            wire = await transport.manifest(src.url, "v1")
            theirs = await stranger.transport_for(src.url)
            refused_manifest = await theirs.manifest(src.url, "v1")
            with pytest.raises(Refused) as refused:
                async with theirs.pull(src.url, "v1", 0, 1):
                    pass
            return wire, refused_manifest, refused.value.status
        finally:
            await holder.stop()
            await stranger.stop()
            await src.stop()

    wire, refused_manifest, status = asyncio.run(run())
    assert wire and refused_manifest is None and status == 401


def test_a_ticket_is_checked_by_signature_holder_and_expiry():
    """What a node accepts: the run's signature over this holder and expiry, nothing else."""
    now = [1000.0]
    readers = Readers(KEY.public_key(), clock=lambda: now[0])
    good = issue(KEY, "w7", lifetime=60, now=now[0])
    assert readers.holder(good) == "w7"
    body, sig = good.split(".")
    other_run = issue(SigningKey.generate(), "w7", lifetime=60, now=now[0])
    forged_holder = issue(KEY, "w8", lifetime=60, now=now[0]).split(".")[0] + "." + sig  # w8's body, w7's signature
    for bad in (None, "", "guess", "a.b.c", other_run, forged_holder, body + "." + sig[:-4], "x" * 600 + "." + sig):
        with pytest.raises(Refused) as refused:
            readers.holder(bad)
        assert refused.value.status == 401, bad
    now[0] += 60 + SKEW_S - 1  # a relay's clock may run behind: the skew is allowed
    assert readers.holder(good) == "w7"
    now[0] += 2
    with pytest.raises(Refused, match="expired"):
        readers.holder(good)


def test_a_ticket_naming_its_audience_is_good_at_that_node_only():
    readers = {me: Readers(KEY.public_key(), me=me) for me in ("source", "a", "b")}
    ticket = issue(KEY, "learner", audience="a")
    assert readers["a"].holder(ticket) == "learner"
    for me in ("source", "b"):
        with pytest.raises(Refused, match="for 'a' only") as refused:
            readers[me].holder(ticket)
        assert refused.value.status == 401


def test_the_ticket_the_source_pushes_with_reads_nothing_but_at_the_relay_it_was_pushed_to():
    """The source presented the learner's own ticket on every push: the relay's operator copied
    it and pulled whole versions at the source with it (charged to no worker, so no quarantine
    ended it), and read every relay's status (an API-only tester, 2026-11-29)."""
    async def run():
        src = Source(KEY, read_token=issue(KEY, "learner"))
        await src.start()
        await src.publish(os.urandom(1 << 18), 1, chunk_size=64 << 10)
        a, b = (Relay(w, KEY.public_key(), **worker_pass(KEY, w), stall_timeout=3) for w in ("a", "b"))
        for node in (a, b):
            await node.start()
        try:
            assert await src.push("v1", [[a.hop]]) == [True]  # a takes the push and its ticket
            copied = src.push_ticket("a")
            out = {"pull at the source": await fetch(b, src, copied)}
            async with aiohttp.ClientSession() as session:
                for name, node in (("status at b", b), ("status at a", a)):
                    async with session.get(node.url + f"{PREFIX}/status",
                                           headers={"Authorization": f"Bearer {copied}"}) as resp:
                        out[name] = resp.status
            return out
        finally:
            for node in (b, a):
                await node.stop()
            await src.stop()

    assert asyncio.run(run()) == {"pull at the source": 401, "status at b": 401, "status at a": 200}


def test_a_push_whose_ticket_is_not_the_routes_sender_is_refused_and_the_relay_pulls_from_its_parent():
    """A third worker with a ticket of its own pushed a version's genuine header to an honest
    relay, claiming to be the source: the relay took it, the trickle that followed held it off
    the version for 26-40 s, the source's real push was answered 409 (already receiving), and
    the relay skipped the version (an API-only tester, 2026-11-29). The ticket now has to be the
    sender's the route names; the relay answers at once and pulls from its route parent."""
    async def run():
        src = Source(KEY, read_token=issue(KEY, "learner"))
        await src.start()
        await src.publish(os.urandom(1 << 18), 1, chunk_size=64 << 10)
        a = Relay("a", KEY.public_key(), **worker_pass(KEY, "a"), stall_timeout=3)
        await a.start()
        x = worker_pass(KEY, "x")  # a worker of the run, proving its own ticket
        store = src.stores["v1"]
        route = sign_route(KEY, route_for(store.manifest, src.hop, [[a.hop]]))
        header = frame_header({"manifest": store.manifest_wire, "route": route.to_wire(), "from": src.id, "tree": 0})

        async def trickle():
            yield header
            await asyncio.sleep(30)  # then nothing: the hold

        try:
            async with aiohttp.ClientSession() as session:
                start = time.monotonic()
                async with session.post(a.url + f"{PREFIX}/push", data=trickle(),
                                        headers={"Authorization": f"Bearer {x['read_token']}",
                                                 PROOF_HEADER: prove(x["proof_key"], "a", "POST", f"{PREFIX}/push")}) as resp:
                    answer = resp.status, await resp.text(), time.monotonic() - start
            await asyncio.wait_for(a.wait("v1"), 10)
            return answer, time.monotonic() - start
        finally:
            await a.stop()
            await src.stop()

    (status, text, answered_s), whole_s = asyncio.run(run())
    assert status == 409 and "'x''s, but the route names 'source'" in text, text
    assert answered_s < 2 and whole_s < 5, (answered_s, whole_s)


def test_a_revoked_holder_is_refused_until_every_ticket_it_could_hold_has_expired_then_forgotten():
    now = [1000.0]
    readers = Readers(KEY.public_key(), clock=lambda: now[0])
    ticket = issue(KEY, "w1", lifetime=TICKET_S, now=now[0])
    readers.revoke("w1", "was forgotten")
    now[0] += 100
    readers.revoke("w2")
    readers.revoke("w1", "is quarantined")  # again, later: kept from this time on
    with pytest.raises(Refused, match="is quarantined"):
        readers.holder(ticket)
    now[0] += TICKET_S + SKEW_S + 1  # past every ticket w1 and w2 could hold
    readers.revoke("w3")
    assert list(readers.revoked) == ["w3"]


def test_revoking_costs_the_same_however_many_holders_are_revoked():
    """The learner revokes every worker it forgets (10 a second in the control-plane bench's
    churn), and a revoked holder is kept for a ticket's lifetime: rebuilding the map on every
    revocation held the learner's loop 10-60 ms a second once ~7,000 were kept. 20,000
    revocations: ~0.02 s kept oldest-first, ~20 s rebuilt each time."""
    now = [1000.0]
    readers = Readers(KEY.public_key(), clock=lambda: now[0])
    t = time.perf_counter()
    for i in range(20_000):
        now[0] += 0.01
        readers.revoke(f"w{i}")
    assert time.perf_counter() - t < 2.0
    assert len(readers.revoked) == 20_000


def test_the_source_refuses_a_revoked_worker_at_once_and_relays_when_its_ticket_lapses():
    """A quarantined worker's ticket: refused by the learner's source the moment it is revoked,
    by a relay once it expires (its heartbeat replies no longer renew it); another worker's
    renewed ticket keeps working at both."""
    blob = os.urandom(1 << 18)

    async def run():
        src = Source(KEY, read_token=issue(KEY, "learner"))
        src.refusal_delay_s = 0.0  # answered at once: the tickets here live a second
        await src.start()
        await src.publish(blob, 1, chunk_size=64 << 10)
        office = TicketOffice(KEY, src.readers, lifetime=1.0)
        honest, cheat = worker_pass(office, "honest"), worker_pass(office, "cheat")
        relay = Relay("r", KEY.public_key(), **worker_pass(KEY, "r"), source_url=src.url, stall_timeout=3)
        relay.readers.skew = 0.0
        below = [Relay(w, KEY.public_key(), **worker_pass(KEY, w), stall_timeout=3) for w in ("honest", "cheat")]
        client = Relay("c", KEY.public_key())
        for node in (relay, *below, client):
            await node.start()
        out = {}
        try:
            # The relay holds v1 along a route with both workers below it, so it serves them.
            assert await src.push("v1", [[relay.hop, *(n.hop for n in below)]]) == [True]
            await below[-1].wait("v1")
            out["before"] = [await fetch(client, u, t) for u in (src, relay) for t in (honest, cheat)]
            office.revoke("cheat")
            out["revoked"] = [await fetch(client, u, cheat) for u in (src, relay)]
            await asyncio.sleep(1.2)
            out["lapsed"] = [await fetch(client, relay, cheat), await fetch(client, relay, honest),
                             await fetch(client, relay, worker_pass(office, "honest"))]
        finally:
            for node in (client, *below, relay):
                await node.stop()
            await src.stop()
        return out

    out = asyncio.run(run())
    assert out["before"] == [200, 200, 200, 200], out
    assert out["revoked"] == [401, 200], out  # the source at once; the relay cannot know yet
    assert out["lapsed"] == [401, 401, 200], out  # expired at the relay too; a renewed ticket works


def test_a_refused_request_leaves_nothing_for_the_collector():
    """Raised out of a route, a refusal kept its request, headers and frames in a reference cycle
    (and a wrong ticket's refusal its own frame): every weight request without a ticket was left
    for the garbage collector, whose passes hold the learner's loop. Counted: the requests and
    refusals found only by the collector after each route refused a missing, a guessed and a
    malformed ticket."""
    import gc

    from aiohttp import web

    async def run() -> list:
        src = Source(KEY, read_token=issue(KEY, "learner"))
        await src.start()
        await src.publish(os.urandom(1 << 17), 1, chunk_size=1 << 16)
        paths = [f"{PREFIX}/manifest/v1", f"{PREFIX}/chunks/v1?from=0", f"{PREFIX}/status", f"{PREFIX}/routes?wait=0"]
        try:
            async with aiohttp.ClientSession() as session:
                gc.collect()
                gc.disable()
                gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds stays in gc.garbage
                async def refused(path: str, headers: dict) -> None:
                    async with session.get(src.url + path, headers=headers) as resp:
                        assert resp.status == 401, (path, headers, resp.status)

                try:  # at once: each is answered `refusal_delay_s` late
                    await asyncio.gather(*(refused(path, headers) for path in paths for headers in (
                        {}, {"Authorization": "Bearer guess"}, {"Authorization": "Bearer eyJ4IjoxfQ.AAAA"})))
                    gc.collect()
                    return [type(o).__name__ for o in gc.garbage if isinstance(o, (web.BaseRequest, BaseException))]
                finally:
                    gc.set_debug(0)
                    gc.garbage.clear()
                    gc.enable()
        finally:
            await src.stop()

    assert asyncio.run(run()) == []


def test_what_aiohttps_parser_refuses_is_answered_without_its_version_or_the_request():
    """A source's or relay's answer to a request aiohttp cannot parse (before any route or
    middleware runs) carried `Server: Python/3.x aiohttp/3.y` and echoed the rejected line."""
    from urllib.parse import urlsplit

    async def raw(url: str, head: bytes) -> tuple[bytes, bytes]:
        u = urlsplit(url)
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        writer.write(head + b"\r\n")
        answer = await reader.read()  # the connection is closed after it
        writer.close()
        return answer.partition(b"\r\n\r\n")[::2]

    async def run():
        src = Source(KEY, read_token=issue(KEY, "learner"))
        await src.start()
        try:
            return [await raw(src.url, head) for head in (b"GE\x01T /bcast/v1/status HTTP/1.1\r\nHost: x\r\n",
                                                           b"GET /bcast/v1/status HTTP/1.1\r\nHost: x\r\nX-Me: a\x00b\r\n")]
        finally:
            await src.stop()

    for head, body in asyncio.run(run()):
        assert head.startswith(b"HTTP/1.") and b" 400 " in head.split(b"\r\n")[0], head
        assert b"\r\nServer: echo" in head and b"aiohttp" not in head, head
        assert body == b"400 Bad Request", body


def test_a_key_a_node_does_not_hold_is_answered_bounded_and_escaped_not_echoed():
    """The 404 for a manifest or chunks a node does not hold repeated the requested key whole:
    7,000 characters gave a 7,021-byte reply, and control characters went out raw (an API-only
    tester, 2026-11-30), where every refusal is meant to stay short and echo nothing."""
    w1 = worker_pass(KEY, "w1")
    key = "A" * 7000 + "\x1b[31m"

    async def run():
        src = Source(KEY, read_token=issue(KEY, "learner"))
        await src.start()
        out = []
        try:
            async with aiohttp.ClientSession() as session:
                for path in (f"{PREFIX}/manifest/{key}", f"{PREFIX}/chunks/{key}"):
                    headers = {"Authorization": f"Bearer {w1['read_token']}",
                               PROOF_HEADER: prove(w1["proof_key"], "source", "GET", path)}
                    async with session.get(src.url + path.replace("\x1b", "%1b"), headers=headers) as resp:
                        out.append((resp.status, await resp.read()))
        finally:
            await src.stop()
        return out

    for status, body in asyncio.run(run()):
        assert status == 404 and len(body) <= 250 and b"\x1b" not in body and b"AAAA" in body, (status, body[:300])


def test_a_holder_pulls_a_version_at_most_twice_over_from_a_node():
    """A joined identity with no work pulled 2,060 whole versions from the learner's source in
    20 s (989 Mbit/s, the whole paced uplink): a fallback or repair pull by an honest worker fell
    from 990 to 59 Mbit/s and pushes to honest chain heads slowed 8×. Each holder may now take a
    version's size twice over by pull (once, and once again for repairs); another holder is not
    affected, and what a pull cut short did not send is given back."""
    from broadcast.node import PULL_SHARE

    blob = os.urandom(1 << 20)

    async def run():
        src = Source(KEY, read_token=issue(KEY, "learner"), up_rate=4e6)  # paced: 1 MiB takes 0.26 s
        await src.start()
        await src.publish(blob, 1, chunk_size=64 << 10)
        flood, other, cut = (holder_headers(w, "source", f"{PREFIX}/chunks/v1") for w in ("flood", "other", "cut"))
        try:
            async with aiohttp.ClientSession() as session:
                async def pull(headers, query="from=0") -> tuple[int, int]:
                    async with session.get(f"{src.url}{PREFIX}/chunks/v1?{query}", headers=headers) as resp:
                        return resp.status, len(await resp.read())

                statuses = [await pull(flood, "from=4&to=12")] + [await pull(flood) for _ in range(3)]
                statuses.append(await pull(other))
                # Cut short: the first chunks read, then the connection dropped
                async with session.get(f"{src.url}{PREFIX}/chunks/v1?from=0", headers=cut) as resp:
                    await resp.content.readexactly(64 << 10)
                    resp.close()
                for _ in range(100):  # the node notices the closed connection and gives the rest back
                    await asyncio.sleep(0.05)
                    if src.stores["v1"].pulled_by["cut"] < 1 << 20:
                        break
                given_back = src.stores["v1"].pulled_by["cut"]
        finally:
            await src.stop()
        return given_back, statuses

    given_back, statuses = asyncio.run(run())
    assert PULL_SHARE == 2
    # half a version and a whole one fit the share; the next whole ones do not
    assert [s for s, _ in statuses[:4]] == [200, 200, 429, 429], statuses
    assert statuses[0][1] >= 512 << 10 and statuses[1][1] >= 1 << 20
    assert statuses[4][0] == 200 and statuses[4][1] >= 1 << 20  # another holder's share is its own
    assert given_back < 1 << 19  # most of the cut-short pull went back to its holder's share


def test_a_relay_serves_pulls_only_to_the_members_below_it_in_the_route():
    """16 sybil identities, each with its own valid ticket, took their two versions' worth from
    an honest worker's relay: 157 MB in 75 s of its upload (a tester, 2026-11-28). A relay that
    got a version along a route serves pulls of it only to the members below it there (a NAT
    child, a repair walking up its ancestors); others pull from their own parents or the source."""
    blob = os.urandom(1 << 18)

    async def run():
        src = Source(KEY, read_token=issue(KEY, "learner"))
        await src.start()
        await src.publish(blob, 1, chunk_size=64 << 10)
        a, b, c = (Relay(w, KEY.public_key(), **worker_pass(KEY, w), stall_timeout=3) for w in ("a", "b", "c"))
        client = Relay("client", KEY.public_key())
        for node in (a, b, c, client):
            await node.start()
        loner = Relay("loner", KEY.public_key(), **worker_pass(KEY, "loner"), source_url=src.url, stall_timeout=3)
        await loner.start()
        try:
            assert await src.push("v1", [[a.hop, b.hop, c.hop]]) == [True]
            await c.wait("v1")
            out = {who: await fetch(client, a, worker_pass(KEY, who)) for who in ("b", "c", "sybil", "a")}
            # A version a relay pulled for itself, with no route: nobody is below it there (it was
            # served to any ticket holder).
            await loner.fetch("v1", [Hop("source", src.url)])
            out["from a relay with no route"] = await fetch(client, loner, worker_pass(KEY, "b"))
            return out
        finally:
            for node in (client, loner, c, b, a):
                await node.stop()
            await src.stop()

    out = asyncio.run(run())
    assert out == {"b": 200, "c": 200, "sybil": 403, "a": 403, "from a relay with no route": 403}, out


def test_a_member_below_a_relay_in_one_stripe_pulls_only_that_stripe_from_it():
    """A tester read that a member below an honest relay in one tree could pull the whole version
    from it (every stripe), two versions' worth per identity. Now only the spans of the trees
    it is below the relay in."""
    from broadcast.route import route_for

    blob = os.urandom(1 << 19)

    async def pull(node, to, own: dict, start: int, end: int) -> int:
        node.read_token, node.proof_key = own["read_token"], own["proof_key"]
        transport = await node.transport_for(to.url)
        try:
            async with transport.pull(to.url, "v1", start, end, audience=to.id):
                return 200
        except Refused as e:
            return e.status

    async def run():
        src = Source(KEY, read_token=issue(KEY, "learner"))
        await src.start()
        full, _ = await src.publish(blob, 1, chunk_size=64 << 10)  # 8 chunks: stripes [0, 4) and [4, 8)
        o1, o2, x = (Relay(w, KEY.public_key(), **worker_pass(KEY, w), stall_timeout=3) for w in ("o1", "o2", "x"))
        client = Relay("client", KEY.public_key())
        for node in (o1, o2, x, client):
            await node.start()
        try:
            route = route_for(full.manifest, src.hop, [[o1.hop, o2.hop, x.hop], [o2.hop, o1.hop, x.hop]],
                              spans=[(0, 4), (4, 8)], parents=[[-1, 0, 0], [-1, 0, 0]])
            await src.push_route("v1", route)
            await x.wait("v1", 10)
            return {(start, end): await pull(client, o1, worker_pass(KEY, "x"), start, end)
                    for start, end in ((0, 4), (1, 3), (4, 8), (0, 8))}
        finally:
            for node in (client, x, o2, o1):
                await node.stop()
            await src.stop()

    out = asyncio.run(run())
    assert out == {(0, 4): 200, (1, 3): 200, (4, 8): 403, (0, 8): 403}, out


def test_a_ticket_copied_from_a_push_pulls_nothing_and_frames_nobody():
    """Over HTTP a child reads its parent's ticket on every push. Copied, it pulled at the source
    as the parent: it used up the parent's pull share and had the source blame the parent's
    nearest ancestor (a grandparent framed; an API-only tester, 2026-11-29). A worker's ticket
    names its proof key now, and a pull or a push must carry the holder's proof, made for the
    node it goes to: the copy, bare or with the push's own proof, pulls nothing anywhere, and
    nothing is charged to the parent."""
    async def run():
        src = Source(KEY, read_token=issue(KEY, "learner"))
        await src.start()
        await src.publish(os.urandom(1 << 18), 1, chunk_size=64 << 10)
        a, b, c = (Relay(w, KEY.public_key(), **worker_pass(KEY, w), stall_timeout=3) for w in ("a", "b", "c"))
        for node in (a, b, c):
            await node.start()
        try:
            assert await src.push("v1", [[a.hop, b.hop, c.hop]]) == [True]  # a pushes to b, b to c: proven
            await c.wait("v1", 10)
            copied = worker_pass(KEY, "a")["read_token"]  # what b read on a's push
            push_proof = prove(worker_pass(KEY, "a")["proof_key"], "b", "POST", f"{PREFIX}/push")  # and a's proof there
            chunks = f"{PREFIX}/chunks/v1"
            out = {}
            async with aiohttp.ClientSession() as session:
                for name, to, headers in (
                        ("bare copy at the source", src, {}),
                        ("copy with the push's proof at the source", src, {PROOF_HEADER: push_proof}),
                        ("copy with a proof for b, at a", a, {PROOF_HEADER: prove(worker_pass(KEY, "a")["proof_key"], "b", "GET", chunks)}),
                        ("a itself at the source", src, {PROOF_HEADER: prove(worker_pass(KEY, "a")["proof_key"], "source", "GET", chunks)})):
                    async with session.get(f"{to.url}{chunks}?from=0&to=1",
                                           headers={"Authorization": f"Bearer {copied}", **headers}) as resp:
                        out[name] = resp.status, await resp.text() if resp.status != 200 else ""
            return out, dict(src.stores["v1"].pulled_by)
        finally:
            for node in (c, b, a):
                await node.stop()
            await src.stop()

    out, pulled = asyncio.run(run())
    assert out["bare copy at the source"][0] == 401 and "no Echo-Proof" in out["bare copy at the source"][1], out
    assert out["copy with the push's proof at the source"][0] == 401, out
    assert "copied from another node's request" in out["copy with the push's proof at the source"][1]
    assert out["copy with a proof for b, at a"][0] == 401, out
    assert out["a itself at the source"][0] == 200, out  # the holder, proving it, pulls as before
    assert set(pulled) == {"a"}  # only the holder's own pull is charged to it


def test_a_versions_full_and_delta_streams_share_one_pull_share():
    """Counted per stream, one holder pulled a version's full stream twice and then its delta
    twice, 3.5 versions' worth (a tester, 2026-11-29): they share one share now."""
    import numpy as np

    base = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    new = base.copy()
    new[::97] ^= 1  # a small update: the delta is worth sending

    async def run():
        src = Source(KEY, read_token=issue(KEY, "learner"))
        await src.start()
        full1, _ = await src.publish(base.tobytes(), 1, chunk_size=64 << 10)
        full2, delta2 = await src.publish(new.tobytes(), 2, chunk_size=64 << 10, base=(base.tobytes(), full1.manifest))
        assert delta2 is not None
        client = Relay("client", KEY.public_key())
        await client.start()
        out = []
        try:
            own = worker_pass(KEY, "w1")
            client.read_token, client.proof_key = own["read_token"], own["proof_key"]
            transport = await client.transport_for(src.url)
            for key in (full2.manifest.key, full2.manifest.key, delta2.manifest.key, "v1"):
                try:
                    async with transport.pull(src.url, key, 0, len(src.stores[key].manifest.chunks), audience=src.id) as reader:
                        while await reader.read(1 << 16):
                            pass
                    out.append(200)
                except Refused as e:
                    out.append(e.status)
        finally:
            await client.stop()
            await src.stop()
        return out

    assert asyncio.run(run()) == [200, 200, 429, 200]  # v2 twice whole, then its delta is past the share; v1 is its own


def test_the_proof_recipe_in_the_api_docs_is_the_one_nodes_check():
    """docs/api.md ("Proving a pull or a push") tells another client how to make an `Echo-Proof`
    from its credential alone: an API-only tester could not pull anything without it."""
    import base64
    import hashlib
    import json

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from broadcast.receipts import receipt_key
    from broadcast.tickets import proof_key, prove

    credential = "w3.s3cr3t-part"
    secret_hash = hashlib.sha256(credential.split(".", 1)[1].encode()).digest()
    key = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"echo-proof-v1\0" + secret_hash).digest())
    message = json.dumps(["w7", "1733580000000", "GET", "/bcast/v1/chunks/v12-d8"]).encode()
    signature = base64.urlsafe_b64encode(key.sign(b"echo-proof-v1\0" + message)).rstrip(b"=").decode()
    assert secret_hash == receipt_key(credential.partition(".")[2])  # what the worker derives it from
    assert f"1733580000000.{signature}" == prove(proof_key(secret_hash), "w7", "GET", "/bcast/v1/chunks/v12-d8",
                                                 now=1733580000.0)


def test_a_version_opened_along_a_route_is_registered_with_its_route():
    """A child's pull waiting for a version (`_store_soon`) wakes when the store is registered;
    the route was set only after, so across a yield in between (evicting the oldest version) the
    pull was refused as for "a version that came to this relay without a route", and the honest
    relay was blamed for its leaf's repair from the source (an API-only tester's run, 2026-12-07)."""
    blob = os.urandom(1 << 18)
    seen: list[object] = []

    async def run():
        src = Source(KEY, read_token=issue(KEY, "learner"))
        await src.start()
        await src.publish(blob, 1, chunk_size=64 << 10)
        a = Relay("a", KEY.public_key(), **worker_pass(KEY, "a"), stall_timeout=3)
        registered = a._add_store

        async def add_store(store):  # what a waiting pull would see the moment it wakes
            seen.append(store.route)
            return await registered(store)

        a._add_store = add_store
        await a.start()
        try:
            assert await src.push("v1", [[a.hop]]) == [True]
            await a.wait("v1")
        finally:
            await a.stop()
            await src.stop()

    asyncio.run(run())
    assert seen and all(route is not None for route in seen), seen


def test_a_peers_endless_reply_is_read_no_further_than_its_bound():
    """A worker's relay answered the learner's push with an endless body, and the source read it
    all: 0.5 → 4.4 GB of the learner, about 2 GB a push (an API-only tester, 2026-12-07). A push's
    reply is read to 300 bytes, a refusal's to 200, a manifest to the header limit; the rest is
    never read."""
    from aiohttp import web

    from broadcast.transport import MAX_HEADER_BYTES, ProtocolError

    sent = {"push": 0, "manifest": 0, "chunks": 0}

    def endless(what: str, status: int = 200):
        async def handler(request: web.Request) -> web.StreamResponse:
            await request.read()
            resp = web.StreamResponse(status=status)
            await resp.prepare(request)
            piece = b"x" * (1 << 20)
            try:
                while sent[what] < 4 * MAX_HEADER_BYTES:
                    await resp.write(piece)
                    sent[what] += len(piece)
            except ConnectionError:  # the reader closed the connection: what the test wants
                pass
            return resp
        return handler

    async def run():
        app = web.Application()
        app.router.add_post(PREFIX + "/push", endless("push"))
        app.router.add_get(PREFIX + "/manifest/{key}", endless("manifest"))
        app.router.add_get(PREFIX + "/chunks/{key}", endless("chunks", 409))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        node = Relay("n", KEY.public_key())
        await node.start()
        try:
            transport = await node.transport_for(url)
            status, text = await asyncio.wait_for(transport.push(url, b"a version"), 10)
            assert status == 200 and text == "x" * 300
            with pytest.raises(ProtocolError, match="over the"):
                await asyncio.wait_for(transport.manifest(url, "v1"), 10)
            with pytest.raises(Refused) as refused:
                async with transport.pull(url, "v1", 0, 1):
                    pass
            assert refused.value.status == 409 and len(refused.value.text) <= 200
            await asyncio.sleep(0.3)
        finally:
            await node.stop()
            await runner.cleanup()
        # What the peer got out: the socket buffers' worth, not what it had to say
        assert sent["push"] < 32 << 20 and sent["chunks"] < 32 << 20, sent
        assert sent["manifest"] < MAX_HEADER_BYTES + (32 << 20), sent

    asyncio.run(run())


def test_the_holders_of_one_address_pull_a_bounded_number_of_copies_from_the_source():
    """Each holder's share was renewed by each identity an address joined as: 16 sybils from one
    address, each pulling twice, took 32 copies of a version from the learner's uplink, and a
    new identity took more (at 8B, 16 GB each). The source now counts an address's holders
    together (`Source.address_of`, the learner's registry), up to `copies_per_address`; a holder
    at another address is not affected, nor a source that knows no addresses."""
    blob = os.urandom(1 << 20)

    async def run():
        src = Source(KEY, read_token=issue(KEY, "learner"), up_rate=None)
        await src.start()
        await src.publish(blob, 1, chunk_size=64 << 10)
        src.address_of = lambda holder: "198.51.100.7" if holder.startswith("sybil") else "203.0.113.9"
        src.copies_per_address = 3
        statuses = []
        try:
            async with aiohttp.ClientSession() as session:
                async def pull(holder: str) -> int:
                    headers = holder_headers(holder, "source", f"{PREFIX}/chunks/v1")
                    async with session.get(f"{src.url}{PREFIX}/chunks/v1?from=0", headers=headers) as resp:
                        await resp.read()
                        return resp.status

                for k in range(5):  # a new identity for each copy
                    statuses.append(await pull(f"sybil-{k}"))
                statuses.append(await pull("honest"))
                store = src.stores["v1"]
                served, size = store.pulled_from["198.51.100.7"], store.manifest.wire_size
        finally:
            await src.stop()
        return statuses, served, size

    statuses, served, size = asyncio.run(run())
    assert statuses == [200, 200, 200, 429, 429, 200], statuses
    assert served == 3 * size  # the refused pulls were not counted
