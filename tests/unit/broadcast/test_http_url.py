"""The URLs a server bound here is reached at (the learner's join URL, its broadcast source's):
reachable as given, for a specific bind and a wildcard one."""

import socket
from urllib.parse import urlsplit

import pytest

from broadcast.transport import http_url as join_url
from conftest import closed_of


def test_an_ipv6_address_is_bracketed_and_a_name_kept():
    assert join_url("::1", 8000) == "http://[::1]:8000"
    assert join_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert join_url("learner.example", 8000) == "http://learner.example:8000"


@pytest.mark.parametrize("wildcard,family", [("0.0.0.0", socket.AF_INET), ("::", socket.AF_INET6)])
def test_a_wildcard_bind_prints_an_address_a_worker_can_connect_to(wildcard, family):
    try:
        server = socket.socket(family, socket.SOCK_STREAM)
        server.bind((wildcard, 0))
    except OSError:
        pytest.skip(f"no {wildcard} here")
    with server:
        server.listen()
        url = urlsplit(join_url(wildcard, server.getsockname()[1]))
        assert url.hostname not in ("0.0.0.0", "::")  # names nothing another machine can reach
        with socket.create_connection((url.hostname, url.port), timeout=5):
            pass


def test_a_broadcast_source_bound_to_every_address_advertises_one_a_worker_can_reach():
    """With `--server.host 0.0.0.0` (how a learner serves workers on the internet) the join reply
    named the source `http://0.0.0.0:PORT`: every remote worker would pull from itself."""
    import asyncio

    import aiohttp

    from broadcast.signing import SigningKey
    from broadcast.source import Source

    async def run() -> tuple[str, int]:
        src = Source(SigningKey.generate(), host="0.0.0.0")
        await src.start()
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(src.url + "/bcast/v1/health") as resp:
                    return src.url, resp.status
        finally:
            await src.stop()

    url, status = asyncio.run(run())
    assert urlsplit(url).hostname != "0.0.0.0" and status == 200, url


def test_one_address_holds_only_so_many_connections_to_a_broadcast_source():
    """The control API closed connections past 8 per worker an address may join, the broadcast
    source none: 21,000 idle ones from one address took the learner to its file limit, and every
    new connection to the control API was reset. The learner gives its source the same limits."""
    import asyncio

    from broadcast.signing import SigningKey
    from broadcast.source import Source

    async def run() -> int:
        src = Source(SigningKey.generate(), connection_limits=lambda host: ((host, 4),))
        await src.start()
        try:
            url = urlsplit(src.url)
            return await closed_of(url.hostname, url.port, 10)
        finally:
            await src.stop()

    assert asyncio.run(run()) == 10 - 4


def test_a_relay_holds_only_so_many_connections_per_address_but_its_own_machine_any():
    """A worker's relay took any number of connections: one address holding thousands idle
    would take the worker's file descriptors, and the relay would refuse its own children. It
    counts like the learner: per IPv4 address, per IPv6 /64 and /48; loopback is not counted."""
    import asyncio

    from broadcast.relay import CONNECTIONS_PER_ADDRESS, Relay
    from broadcast.signing import SigningKey

    relay = Relay("w", SigningKey.generate().public_key())
    limits = relay.connection_limits
    assert limits("203.0.113.7") == (("203.0.113.7", CONNECTIONS_PER_ADDRESS),)
    assert limits("2001:db8:1:2::9") == (("2001:db8:1:2::/64", CONNECTIONS_PER_ADDRESS),
                                         ("2001:db8:1::/48", 8 * CONNECTIONS_PER_ADDRESS))
    assert limits("127.0.0.1") == limits("::1") == ()

    async def held_open(relay: Relay, n: int) -> int:  # how many of n connections the relay keeps
        await relay.start()
        try:
            url = urlsplit(relay.url)
            return n - await closed_of(url.hostname, url.port, n)
        finally:
            await relay.stop()

    key = SigningKey.generate().public_key()
    assert asyncio.run(held_open(Relay("w", key), 80)) == 80  # loopback: the worker's own machine
    capped = Relay("w", key, connection_limits=lambda host: ((host, 4),))  # as a remote address is
    assert asyncio.run(held_open(capped, 10)) == 4


def test_a_bearer_token_is_read_whatever_the_schemes_case():
    """`authorization: bearer x` (RFC 7235: the scheme is case-insensitive) was read as no token,
    answered 401 and counted as a wrong credential against the sender's address."""
    from types import SimpleNamespace

    from broadcast.transport import NOT_A_TOKEN, bearer

    def read(header: str | None):
        return bearer(SimpleNamespace(headers={} if header is None else {"Authorization": header}))

    assert read("Bearer abc.def") == read("bearer abc.def") == read("BEARER  abc.def") == "abc.def"
    assert read(None) is None and read("Basic abc") is None and read("Bearerabc") is None
    assert read("Bearer caf\u00e9") == NOT_A_TOKEN


def test_a_relay_binds_where_the_learner_sees_its_worker_connect_from():
    """A worker's relay (`relay_host = "auto"`) binds its address on the route to the learner: the
    learner connects only to a relay there (by default it bound loopback, and a remote learner
    took every worker for a leaf). A learner on this machine: loopback."""
    from broadcast.transport import _outbound_address, local_address_toward

    assert local_address_toward("127.0.0.1") == "127.0.0.1"
    assert local_address_toward("localhost") in ("127.0.0.1", "::1")
    assert local_address_toward("no-such-host.invalid") == "127.0.0.1"  # no route: loopback, never an error
    here = _outbound_address(4)
    if here == "127.0.0.1":
        pytest.skip("no interface but loopback here")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as learner:  # a learner on this machine's other address
        learner.bind((here, 0))
        learner.listen()
        assert local_address_toward(here) == here
        with socket.create_connection(learner.getsockname(), timeout=5) as worker:
            connected_from = learner.accept()[0]
            with connected_from:
                assert connected_from.getpeername()[0] == local_address_toward(here) == worker.getsockname()[0]
