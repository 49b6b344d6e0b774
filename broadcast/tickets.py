"""Read tickets: who may fetch a run's versions, from the learner's source and from relays.

A ticket is the learner's ed25519 signature over a holder (a worker id) and an expiry. Every
node of the run holds the learner's public key, so a relay tells a worker of the run from an
outsider without asking the learner. The learner renews each worker's ticket in its heartbeat
replies and stops renewing a quarantined worker's: that ticket is refused at once by the
learner's source (`Readers.revoke`) and lapses at every relay within `TICKET_S` (+ `SKEW_S`
for the relays' clocks). A run-wide shared secret could not be taken back from anyone.

Wire form: `<base64url payload>.<base64url signature>`, payload the JSON `{"h": holder, "u":
expiry}` (unix seconds), signed in the `echo-ticket-v1` context, so it can never pass for a
manifest or a route. The tickets the learner's source presents on its pushes also name their
audience (`"a"`, the relay pushed to) and are good at that node only: a relay reads the ticket
of every push it is sent, and the source's own, holder "learner" and charged to no worker, read
the weights at the source for anyone who copied it from a push (an API-only tester, 2026-11-29).
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections import OrderedDict
from typing import Callable

from broadcast.signing import SignatureError, SigningKey, VerifyKey
from broadcast.transport import Refused

TICKET_CONTEXT = b"echo-ticket-v1\0"
#: A ticket's lifetime; the learner renews it every quarter of that in heartbeat replies.
TICKET_S = 600.0
#: How far a relay's clock may run behind or ahead of the learner's.
SKEW_S = 120.0
LEARNER = "learner"  # the holder of the tickets the learner's own nodes present
MAX_TICKET = 512  # characters; a holder id is at most 128
_VALID_KEEP = 4096  # verified tickets remembered, so a pull of many ranges costs one verification


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue(key: SigningKey, holder: str, *, lifetime: float = TICKET_S, now: float | None = None,
          audience: str | None = None) -> str:
    """A ticket for `holder`, valid for `lifetime` seconds from `now` (the learner's clock), at
    every node of the run or, with `audience`, at the node of that id only."""
    until = (time.time() if now is None else now) + lifetime
    fields = {"h": holder, "u": round(until, 3), **({"a": audience} if audience is not None else {})}
    payload = json.dumps(fields, separators=(",", ":")).encode()
    return f"{_b64(payload)}.{_b64(key.sign(payload, TICKET_CONTEXT))}"


class Readers:
    """The check a node runs on every request for its versions: a ticket of this run, unexpired,
    whose holder has not been revoked here."""

    def __init__(self, key: VerifyKey, *, me: str | None = None, clock: Callable[[], float] = time.time,
                 skew: float = SKEW_S) -> None:
        self.key, self.me, self.clock, self.skew = key, me, clock, skew  # me: this node's id (a ticket's audience)
        self.revoked: OrderedDict[str, tuple[float, str]] = OrderedDict()  # holder -> (when, why), oldest first
        self._valid: OrderedDict[str, tuple[str, float]] = OrderedDict()  # ticket -> (holder, expiry)

    def revoke(self, holder: str, why: str = "is quarantined") -> None:
        """Refuse `holder`'s tickets from now on, the unexpired ones too (the learner's source),
        saying that the worker `why`. A revoked holder is forgotten once every ticket it could hold
        has expired anyway."""
        now = self.clock()
        # Oldest first, so only the expired are looked at: rebuilding the whole map on every
        # revocation cost the learner's loop 10-60 ms a second at 10 forgotten workers a second
        # (each revoked, ~7,200 kept for the 720 s a ticket can live)
        while self.revoked and now - next(iter(self.revoked.values()))[0] > TICKET_S + self.skew:
            self.revoked.popitem(last=False)
        self.revoked[holder] = (now, why)
        self.revoked.move_to_end(holder)

    def holder(self, presented: str | None) -> str:
        """The holder of a valid ticket, or `Refused(401)` saying what was wrong with it."""
        if not presented:
            raise Refused(401, "no read ticket: versions are served to the run's workers only (the learner "
                               "gives each worker a ticket at join and renews it in heartbeat replies)")
        known = self._valid.get(presented)
        holder, until = known if known is not None else self._verify(presented)
        if until + self.skew < self.clock():
            raise Refused(401, f"the read ticket of {holder[:64]!r} expired: a worker's ticket is renewed in "
                               "its heartbeat replies (a quarantined worker's is not)")
        if holder in self.revoked:
            raise Refused(401, f"the read ticket of {holder[:64]!r} was revoked: that worker {self.revoked[holder][1]}")
        if known is None:
            self._valid[presented] = (holder, until)
            if len(self._valid) > _VALID_KEEP:
                self._valid.popitem(last=False)
        return holder

    def _verify(self, presented: str) -> tuple[str, float]:
        # The refusal is made where it is raised, never held in a local: a raised exception's frame
        # holding it is a reference cycle, left for the collector on every wrong ticket.
        if len(presented) > MAX_TICKET or presented.count(".") != 1:
            raise _wrong_ticket()
        body, signature = presented.split(".")
        try:
            payload = _unb64(body)
            self.key.verify(payload, _unb64(signature), TICKET_CONTEXT)
            fields = json.loads(payload)
            holder, until, audience = fields["h"], float(fields["u"]), fields.get("a")
        except (SignatureError, binascii.Error, ValueError, TypeError, KeyError, AttributeError):
            raise _wrong_ticket() from None
        if not isinstance(holder, str):
            raise _wrong_ticket()
        if audience is not None and audience != self.me:
            raise Refused(401, f"a read ticket for {str(audience)[:64]!r} only, not for this node: the tickets the "
                               "learner's source presents on its pushes are good at the relay pushed to")
        return holder, until


def _wrong_ticket() -> Refused:
    return Refused(401, "a wrong read ticket: it is not one the run's learner signed")


class TicketOffice:
    """The learner's side: issues tickets with the run's key and revokes them at its own source
    (`readers`, the source's check)."""

    def __init__(self, key: SigningKey, readers: Readers, *, lifetime: float = TICKET_S) -> None:
        self.key, self.readers, self.lifetime = key, readers, lifetime

    def issue(self, holder: str) -> str:
        return issue(self.key, holder, lifetime=self.lifetime, now=self.readers.clock())

    def due(self, issued_at: float, now: float) -> bool:
        """Is a ticket issued at `issued_at` (monotonic) due for renewal at `now`?"""
        return now - issued_at >= self.lifetime / 4

    def revoke(self, holder: str, why: str = "is quarantined") -> None:
        self.readers.revoke(holder, why)
