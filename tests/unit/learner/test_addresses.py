"""Per-address limits: workers per address (per /64 on IPv6), failed-auth throttling, bans that
expire and grow, and the client address behind a trusted proxy only."""

import ipaddress

from broadcast.addresses import address_key, prefix48
from learner.addresses import AddressBook, client_address


def test_ipv6_counts_per_64_and_ipv4_per_address():
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("::ffff:192.0.2.7") == address_key("192.0.2.7") == "192.0.2.7"
    assert address_key("not an address") == "unknown"


def test_one_address_holds_at_most_max_workers():
    book = AddressBook(max_workers=2)
    for _ in range(2):
        assert book.room("2001:db8::1")
        book.joined("2001:db8::1")
    assert not book.room("2001:db8::ffff")  # the same /64
    assert book.room("2001:db8:0:1::1")
    book.left("2001:db8::1")
    assert book.room("2001:db8::1")


def test_one_ipv6_48_holds_at_most_a_few_64s_worth_of_workers():
    """A /48 holds 65,536 /64s: with per-/64 limits alone one site (or a tunnel broker's free
    /48) could fill the whole fleet. It holds `max_64s_per_48` × `max_workers` workers."""
    book = AddressBook(max_workers=2, max_64s_per_48=3)
    for net in range(3):
        for _ in range(2):
            assert book.room(f"2001:db8:1:{net:x}::1")
            book.joined(f"2001:db8:1:{net:x}::1")
    assert "2001:db8:1::/48" in book.full("2001:db8:1:ff::1") and "max_64s_per_48" in book.full("2001:db8:1:ff::1")
    assert book.room("2001:db8:2::1")  # another /48
    assert book.room("192.0.2.1") and prefix48("192.0.2.1") is None and prefix48("::ffff:192.0.2.1") is None
    book.left("2001:db8:1:0::1")
    assert book.room("2001:db8:1:ff::1")
    for net in range(3):  # the /48's count goes with its workers
        book.left(f"2001:db8:1:{net:x}::1")
        book.left(f"2001:db8:1:{net:x}::1")
    assert book._workers == {}


def test_one_ipv6_48_holds_at_most_a_few_64s_worth_of_connections():
    from broadcast.node import ConnectionCap
    from broadcast.addresses import connection_limits

    class Transport:  # what ConnectionCap reads of an accepted connection
        def __init__(self, host: str):
            self.host, self.aborted = host, False

        def get_extra_info(self, name: str):
            return (self.host, 1234, 0, 0) if name == "peername" else None

        def abort(self) -> None:
            self.aborted = True

    def connect(host: str) -> tuple[Transport, tuple | None]:
        transport = Transport(host)
        return transport, cap.opened(transport)

    cap = ConnectionCap(server=None, limits=connection_limits(limit=2, trusted=[], per_48=3))
    opened = [connect(f"2001:db8:1:{i // 2:x}::1") for i in range(8)]  # 2 from each of 4 /64s of one /48
    assert [t.aborted for t, _ in opened] == [False] * 6 + [True] * 2
    assert not connect("2001:db8:2::1")[0].aborted  # another /48
    for _, keys in opened:
        cap.closed(keys)
    assert not connect("2001:db8:1:9::1")[0].aborted  # the /48's connections closed: room again
    assert set(cap.open) == {"2001:db8:2::/64", "2001:db8:2::/48", "2001:db8:1:9::/64", "2001:db8:1::/48"}


def test_wrong_tokens_are_throttled_per_address_and_recover():
    book = AddressBook(failures_per_min=60.0, failure_burst=3)
    for _ in range(3):
        assert book.throttled("192.0.2.1", now=0.0) == 0.0
        book.failed("192.0.2.1", now=0.0)
    assert book.throttled("192.0.2.1", now=0.0) > 0  # a guesser waits...
    assert book.throttled("192.0.2.2", now=0.0) == 0.0  # ...nobody else does
    assert book.throttled("192.0.2.1", now=1.5) == 0.0  # one guess a second refills


def test_a_ban_expires_and_a_repeat_lasts_longer():
    book = AddressBook(ban_s=10.0)
    assert book.ban("192.0.2.1", "fabricated log-probs", now=0.0) == 10.0
    assert book.banned("192.0.2.1", now=5.0) == "fabricated log-probs"
    assert book.banned("192.0.2.1", now=10.5) == ""
    assert book.ban("192.0.2.1", "again", now=11.0) == 20.0
    assert book.banned("192.0.2.1", now=30.0) == "again" and book.banned("192.0.2.1", now=31.5) == ""


def test_a_hold_is_shorter_than_a_ban_doubles_while_repeated_and_starts_over_after_a_quiet_ban_s():
    book = AddressBook(ban_s=100.0, hold_s=10.0)
    assert book.held("192.0.2.1", now=0.0) == (0.0, "")
    assert book.hold("192.0.2.1", "ranks +8.2 sd", now=0.0) == 10.0
    assert book.held("192.0.2.1", now=4.0) == (6.0, "ranks +8.2 sd") and book.banned("192.0.2.1", now=4.0) == ""
    assert book.held("192.0.2.2", now=4.0)[0] == 0.0  # another address: not held
    assert book.hold("192.0.2.1", "again", now=12.0) == 20.0  # within ban_s of the last: doubled
    assert [book.hold("192.0.2.1", "again", now=t) for t in (40.0, 90.0)] == [40.0, 80.0]
    assert book.hold("192.0.2.1", "again", now=200.0) == 100.0  # never longer than a ban
    assert book.hold("192.0.2.1", "later", now=500.0) == 10.0  # quiet for ban_s after the last: the first again


def test_the_forwarded_address_is_believed_only_from_a_trusted_proxy():
    proxies = [ipaddress.ip_network("10.0.0.0/8")]
    assert client_address("10.0.0.5", "198.51.100.7", proxies) == "198.51.100.7"
    assert client_address("10.0.0.5", "203.0.113.9, 198.51.100.7, 10.0.0.4", proxies) == "198.51.100.7"
    assert client_address("198.51.100.7", "203.0.113.9", proxies) == "198.51.100.7"  # not a proxy: its own
    assert client_address("10.0.0.5", "203.0.113.9", []) == "10.0.0.5"  # no proxies configured


def test_a_forwarded_entry_that_is_not_an_address_is_not_a_key():
    """X-Forwarded-For entries were taken as written: 'not-an-ip' became a worker's address, and
    the key its limits were counted under. Now parsed; one that is not an address falls back to
    the proxy's own (never to an entry left of it, which a client wrote)."""
    proxies = [ipaddress.ip_network("10.0.0.0/8")]
    assert client_address("10.0.0.5", "not-an-ip", proxies) == "10.0.0.5"
    assert client_address("10.0.0.5", "198.51.100.7, unknown", proxies) == "10.0.0.5"
    assert client_address("10.0.0.5", "198.51.100.7, garbage, 10.0.0.4", proxies) == "10.0.0.5"
    assert client_address("10.0.0.5", " 198.51.100.7:4711", proxies) == "198.51.100.7"  # with a port
    assert client_address("10.0.0.5", "[2001:DB8::1]:4711", proxies) == "2001:db8::1"
    assert client_address("10.0.0.5", "2001:DB8:0::1", proxies) == "2001:db8::1"  # the canonical spelling


def test_many_addresses_cannot_grow_the_tables_without_bound(monkeypatch):
    import learner.addresses as addresses

    monkeypatch.setattr(addresses, "TRACKED", 100)
    book = AddressBook(failures_per_min=1.0, failure_burst=3)
    for i in range(1000):  # one wrong token from each of 1,000 /64s of one /48, and a ban each
        book.failed(f"2001:db8:0:{i:x}::1", now=0.0)
        book.ban(f"2001:db8:0:{i:x}::1", "cheated", now=0.0)
    assert len(book._failures) <= 100 and len(book._bans) <= 100
    for _ in range(3):  # a guesser that keeps guessing stays remembered and throttled
        book.failed("192.0.2.1", now=1.0)
        for i in range(50):
            book.failed(f"2001:db8:1:{i:x}::1", now=1.0)
    assert book.throttled("192.0.2.1", now=1.0) > 0


def test_an_address_that_stops_guessing_is_forgotten_once_refilled():
    book = AddressBook(failures_per_min=60.0, failure_burst=3)
    book.failed("192.0.2.1", now=0.0)
    assert "192.0.2.1" in book._failures
    assert book.throttled("192.0.2.1", now=5.0) == 0.0
    assert "192.0.2.1" not in book._failures
