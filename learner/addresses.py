"""What the learner holds against a network address: how many workers joined from it, how many
wrong tokens and credentials it sent, and whether it is banned, and for how long.

Every limit counts in `broadcast.addresses.address_key` (an IPv4 address, an IPv6 /64); the
workers joined from one IPv6 /48 are bounded too, at `max_64s_per_48` /64s' worth.
Behind a reverse proxy every request arrives from the proxy; `client_address` takes the
forwarded address only from proxies the operator named, so a worker cannot choose whose
address it is counted as, and a ban of one worker does not ban the proxy's whole fleet.

A ban expires (`ban_s`, doubled for each repeat): an address is a lease from an ISP, and the
next customer behind it is not the one who cheated. A statistical verdict (an honest worker can
draw one by bad luck) bans nothing, but holds the address's next identity back a while (`hold_s`,
doubled for each repeat, at most `ban_s`): without it, a worker caught choosing its samples
joined again at once, eleven identities in 150 s (a tester, 2026-11-29).

Plain logic with an injectable clock; the workers room calls it on every join and every
refused credential.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from broadcast.addresses import address_key, in_networks, prefix48

TRACKED = 65536  # addresses remembered for failures, and for bans: the least recently seen go first


def forwarded_ip(entry: str) -> str | None:
    """One X-Forwarded-For entry as an IP address ('198.51.100.7', '2001:db8::1', also with a
    port: '198.51.100.7:4711', '[2001:db8::1]:4711'), written the canonical way; None if it is
    not one ('unknown', a name, garbage)."""
    entry = entry.strip()
    if entry.startswith("["):
        entry = entry[1:].partition("]")[0]
    elif entry.count(":") == 1:  # IPv4 with a port
        entry = entry.partition(":")[0]
    try:
        return str(ipaddress.ip_address(entry))
    except ValueError:
        return None


def client_address(remote: str, forwarded_for: str, trusted_proxies: list) -> str:
    """The worker's own address: the connection's, unless that is a trusted proxy, in which case
    the right-most address of X-Forwarded-For that is not itself a trusted proxy. An entry that
    is not an IP address ends the search at the proxy's own address: it is never a key (a
    string shown in status and logs), and the entries left of it are what a client wrote."""
    def trusted(addr: str) -> bool:
        return in_networks(addr, trusted_proxies)

    if not trusted_proxies or not trusted(remote):
        return remote
    for hop in reversed([h for h in forwarded_for.split(",") if h.strip()]):
        ip = forwarded_ip(hop)
        if ip is None:
            return remote
        if not trusted(ip):
            return ip
    return remote


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class _Ban:
    why: str
    until: float
    count: int


@dataclass
class AddressBook:
    """Per-address limits. `max_workers`: joined workers from one address at once (an IPv6 /48:
    `max_64s_per_48` times as many); `failures_per_min`/`failure_burst`: wrong tokens and
    credentials before the address must wait; `ban_s`: the first ban's length (each repeat
    doubles it); `hold_s`: the first hold's (each repeat within `ban_s` of the last doubles it)."""

    max_workers: int = 16
    max_64s_per_48: int = 8
    failures_per_min: float = 10.0
    failure_burst: int = 20
    ban_s: float = 3600.0
    hold_s: float = 60.0
    _workers: dict[str, int] = field(default_factory=dict)
    _failures: dict[str, _Bucket] = field(default_factory=dict)
    _bans: dict[str, _Ban] = field(default_factory=dict)
    _holds: dict[str, _Ban] = field(default_factory=dict)

    # --- workers per address -----------------------------------------------------------------

    def full(self, address: str) -> str:
        """'' if one more worker may join from `address`, else which limit it reached."""
        key = address_key(address)
        if self._workers.get(key, 0) >= self.max_workers:
            return (f"{address} holds the most workers one address may "
                    f"([server] max_workers_per_address = {self.max_workers})")
        wide = prefix48(address)
        if wide is not None and self._workers.get(wide, 0) >= self.max_workers * self.max_64s_per_48:
            return (f"{wide} holds the most workers one IPv6 /48 may ([server] max_64s_per_48 × "
                    f"max_workers_per_address = {self.max_workers * self.max_64s_per_48})")
        return ""

    def room(self, address: str) -> bool:
        return not self.full(address)

    def joined(self, address: str) -> None:
        for key in (address_key(address), prefix48(address)):
            if key is not None:
                self._workers[key] = self._workers.get(key, 0) + 1

    def left(self, address: str) -> None:
        for key in (address_key(address), prefix48(address)):
            if key is None:
                continue
            n = self._workers.get(key, 0) - 1
            if n > 0:
                self._workers[key] = n
            else:
                self._workers.pop(key, None)

    # --- failed authentication ---------------------------------------------------------------

    def failed(self, address: str, now: float) -> None:
        """A wrong run token or credential from `address`."""
        key = address_key(address)
        bucket = self._refill(key, now)
        bucket.tokens -= 1
        remember(self._failures, key, bucket)

    def throttled(self, address: str, now: float) -> float:
        """0 if `address` may try to authenticate now, else the seconds until it may."""
        bucket = self._refill(address_key(address), now)
        return 0.0 if bucket.tokens >= 1 else (1 - bucket.tokens) * 60.0 / self.failures_per_min

    def _refill(self, key: str, now: float) -> _Bucket:
        # Popped and put back: the table's order is least recently seen first, which `remember` evicts.
        bucket = self._failures.pop(key, None) or _Bucket(float(self.failure_burst), now)
        bucket.tokens = min(self.failure_burst, bucket.tokens + (now - bucket.at) * self.failures_per_min / 60.0)
        bucket.at = now
        if bucket.tokens < self.failure_burst:  # a full bucket is the default: only debts are kept
            remember(self._failures, key, bucket)
        return bucket

    # --- bans ----------------------------------------------------------------------------------

    def ban(self, address: str, why: str, now: float) -> float:
        """Ban `address` (its /64 for IPv6); returns the ban's length in seconds."""
        key = address_key(address)
        previous = self._bans.pop(key, None)
        count = previous.count + 1 if previous else 1
        length = self.ban_s * 2 ** min(count - 1, 20)
        remember(self._bans, key, _Ban(why, now + length, count))
        return length

    def banned(self, address: str, now: float) -> str:
        """Why `address` is banned now, or '' if it is not."""
        ban = self._bans.get(address_key(address))
        return ban.why if ban is not None and ban.until > now else ""

    def hold(self, address: str, why: str, now: float) -> float:
        """Hold `address`'s next identity back (one of its workers was quarantined on statistical
        evidence); returns the hold's length in seconds."""
        key = address_key(address)
        previous = self._holds.pop(key, None)
        count = previous.count + 1 if previous and now < previous.until + self.ban_s else 1
        length = min(self.ban_s, self.hold_s * 2 ** min(count - 1, 20))
        remember(self._holds, key, _Ban(why, now + length, count))
        return length

    def held(self, address: str, now: float) -> tuple[float, str]:
        """(seconds until a new identity may join from `address`, why), or (0, '')."""
        hold = self._holds.get(address_key(address))
        return (hold.until - now, hold.why) if hold is not None and hold.until > now else (0.0, "")


def remember(table: dict, key: str, value, keep: int | None = None) -> None:
    """Put `value` last in `table`, dropping the least recently seen entries past `keep` (default
    `TRACKED`): an attacker with many addresses (a /48 holds 65,536 /64s) or identities cannot
    grow the learner's memory."""
    table.pop(key, None)
    table[key] = value
    while len(table) > (keep or TRACKED):
        del table[next(iter(table))]
