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

Over plain HTTP a ticket is a bearer token its peers see: a relay's children read it on every
push, the ancestors a child pulls from read the child's. A copied ticket read as its holder: a
child pulling at the source with its parent's used up the parent's pull share and had the
source blame the parent's nearest ancestor (a grandparent framed; an API-only tester,
2026-11-29). So a worker's ticket also names its *proof key* (`"k"`), an ed25519 key derived
from the worker's credential, which its peers never see (`proof_key`), and a pull or a push
presented with it carries an `Echo-Proof`: the time and the key's signature over the node it is
sent to, the time, the method and the path (`prove`). A copied ticket, without the key, pulls
and pushes nothing, and a proof seen by one node is good at that node only. libp2p proves the
peer itself and needs none.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple

from broadcast.signing import SignatureError, SigningKey, VerifyKey
from broadcast.transport import Refused

TICKET_CONTEXT = b"echo-ticket-v1\0"
PROOF_CONTEXT = b"echo-proof-v1\0"
PROOF_HEADER = "Echo-Proof"  # `<unix ms>.<base64url signature>` on pulls and pushes over HTTP
MAX_PROOF = 128  # characters: 13 digits, a dot and 86 of signature
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
          audience: str | None = None, proof: VerifyKey | None = None) -> str:
    """A ticket for `holder`, valid for `lifetime` seconds from `now` (the learner's clock), at
    every node of the run or, with `audience`, at the node of that id only; with `proof`, pulls
    and pushes over HTTP must prove they come from the holder of that key (`prove`)."""
    until = (time.time() if now is None else now) + lifetime
    fields = {"h": holder, "u": round(until, 3), **({"a": audience} if audience is not None else {}),
              **({"k": _b64(proof.raw())} if proof is not None else {})}
    payload = json.dumps(fields, separators=(",", ":")).encode()
    return f"{_b64(payload)}.{_b64(key.sign(payload, TICKET_CONTEXT))}"


def proof_key(secret_hash: bytes) -> SigningKey:
    """A worker's proof key: derived from the hash of its credential's secret, which the learner
    keeps (`learner.api.http.secret_hash`) and no peer sees, so the learner names its public half
    in the worker's tickets without a word from the worker."""
    return SigningKey.from_seed(hashlib.sha256(PROOF_CONTEXT + secret_hash).digest())


def prove(key: SigningKey, audience: str, method: str, path: str, now: float | None = None) -> str:
    """The `Echo-Proof` of a request (`method`, URL `path` without the query) to node `audience`."""
    at = str(round((time.time() if now is None else now) * 1000))
    return f"{at}.{_b64(key.sign(_proof_message(audience, at, method, path), PROOF_CONTEXT))}"


def _proof_message(audience: str, at: str, method: str, path: str) -> bytes:
    return json.dumps([audience, at, method, path]).encode()


class Proof(NamedTuple):
    """What a request offers to prove its ticket is its own: its `Echo-Proof` (or None), method and path."""

    header: str | None
    method: str
    path: str


@dataclass(frozen=True)
class _Ticket:
    holder: str
    until: float
    bound: bool  # names this node as its audience: good here only, no proof needed
    key: VerifyKey | None  # its holder's proof key


class Readers:
    """The check a node runs on every request for its versions: a ticket of this run, unexpired,
    whose holder has not been revoked here."""

    def __init__(self, key: VerifyKey, *, me: str | None = None, clock: Callable[[], float] = time.time,
                 skew: float = SKEW_S) -> None:
        self.key, self.me, self.clock, self.skew = key, me, clock, skew  # me: this node's id (a ticket's audience)
        self.revoked: OrderedDict[str, tuple[float, str]] = OrderedDict()  # holder -> (when, why), oldest first
        self._valid: OrderedDict[str, _Ticket] = OrderedDict()  # tickets verified

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

    def holder(self, presented: str | None, proof: Proof | None = None) -> str:
        """The holder of a valid ticket, or `Refused(401)` saying what was wrong with it. With
        `proof` (a pull or a push over HTTP), the request must prove it comes from the holder."""
        if not presented:
            raise Refused(401, "no read ticket: versions are served to the run's workers only (the learner "
                               "gives each worker a ticket at join and renews it in heartbeat replies)")
        known = self._valid.get(presented)
        ticket = known if known is not None else self._verify(presented)
        holder, until = ticket.holder, ticket.until
        if until + self.skew < self.clock():
            raise Refused(401, f"the read ticket of {holder[:64]!r} expired: a worker's ticket is renewed in "
                               "its heartbeat replies (a quarantined worker's is not)")
        if holder in self.revoked:
            raise Refused(401, f"the read ticket of {holder[:64]!r} was revoked: that worker {self.revoked[holder][1]}")
        if known is None:
            self._valid[presented] = ticket
            if len(self._valid) > _VALID_KEEP:
                self._valid.popitem(last=False)
        if proof is not None and not ticket.bound:
            self._check_proof(ticket, proof)
        return holder

    def _check_proof(self, ticket: _Ticket, proof: Proof) -> None:
        """Refuse (401) a request whose `Echo-Proof` is not its ticket holder's, made for this node, now."""
        who = repr(ticket.holder[:64])
        if ticket.key is None:
            raise Refused(401, f"the read ticket of {who} names no proof key: pulls and pushes over HTTP take a "
                               "worker's ticket, which the learner gives at join and in heartbeat replies")
        header = proof.header or ""
        if not header:
            raise Refused(401, f"no {PROOF_HEADER} with the read ticket of {who}: a pull or a push proves it "
                               "comes from the ticket's holder (`broadcast.tickets.prove`)")
        try:
            if len(header) > MAX_PROOF or header.count(".") != 1:
                raise ValueError
            at, signature = header.split(".")
            ticket.key.verify(_proof_message(self.me or "", at, proof.method, proof.path), _unb64(signature),
                              PROOF_CONTEXT)
            made = int(at) / 1000
        except (SignatureError, binascii.Error, ValueError):
            raise Refused(401, f"the {PROOF_HEADER} does not verify under the proof key the read ticket of {who} "
                               "names, for this request to this node: the ticket was copied from another node's "
                               "request, or the proof was made for another request") from None
        # The sender's clock against this node's, whatever this node allows the learner's (its own
        # source allows none)
        if abs(made - self.clock()) > SKEW_S:
            raise Refused(401, f"the {PROOF_HEADER} was made {made - self.clock():+.0f} s from now here: a proof "
                               f"is good for {SKEW_S:.0f} s either way (is one clock wrong?)")

    def _verify(self, presented: str) -> _Ticket:
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
            key = VerifyKey.from_raw(_unb64(fields["k"])) if "k" in fields else None
        except (SignatureError, binascii.Error, ValueError, TypeError, KeyError, AttributeError):
            raise _wrong_ticket() from None
        if not isinstance(holder, str):
            raise _wrong_ticket()
        if audience is not None and audience != self.me:
            raise Refused(401, f"a read ticket for {str(audience)[:64]!r} only, not for this node: the tickets the "
                               "learner's source presents on its pushes are good at the relay pushed to")
        return _Ticket(holder, until, audience is not None, key)


def _wrong_ticket() -> Refused:
    return Refused(401, "a wrong read ticket: it is not one the run's learner signed")


class TicketOffice:
    """The learner's side: issues tickets with the run's key and revokes them at its own source
    (`readers`, the source's check)."""

    def __init__(self, key: SigningKey, readers: Readers, *, lifetime: float = TICKET_S) -> None:
        self.key, self.readers, self.lifetime = key, readers, lifetime

    def issue(self, holder: str, proof: VerifyKey | None = None) -> str:
        return issue(self.key, holder, lifetime=self.lifetime, now=self.readers.clock(), proof=proof)

    def due(self, issued_at: float, now: float) -> bool:
        """Is a ticket issued at `issued_at` (monotonic) due for renewal at `now`?"""
        return now - issued_at >= self.lifetime / 4

    def revoke(self, holder: str, why: str = "is quarantined") -> None:
        self.readers.revoke(holder, why)
