"""Workers and their identity: who joined, what they report, and who was caught lying.

    POST /v1/join        run token -> worker id + credential, sampling parameters, task, newest snapshot
    POST /v1/heartbeat   liveness + measurements; renews the worker's leases

The run token admits a join, bounded by rate, fleet size and an optional network allow-list
(`learner.admission.JoinGate`); the join answers a per-worker credential, required on every
later call. Heartbeat claims are believed only as far as measurements support them
(`learner.verify.Verifier`), link samples go to the planner's table, a relay's reachability is
probed, and a worker caught lying is quarantined: its leases and queued groups go back, and its
address may not join again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import itertools
import math
import secrets
import time
from pathlib import Path
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from aiohttp import web

from broadcast.addresses import address_key
from broadcast.links import MBIT, LinkSample, LinkTable
from broadcast.node import key_version
from broadcast.receipts import valid
from broadcast.tickets import proof_key
from echo import protocol as P
from learner.addresses import AddressBook, remember
from learner.admission import JoinGate, TokenBucket
from learner.api.http import Auth, continue_later, json_error, read_body, reply, secret_hash
from learner.api.leases import LeaseRoom
from learner.api.run import Run
from learner.buffer import AsyncBuffer, Group
from learner.config import ServerSection, TaskSection, VerifySection
from learner.metrics import LearnerMetrics
from learner.verify import Verdict, Verifier

PROBE_TIMEOUT_S = 3.0  # a relay that does not answer the learner's probe within this is unreachable


@dataclass
class WorkerInfo:
    id: str
    name: str
    joined: float
    last_seen: float
    secret_hash: bytes = field(default=b"", repr=False)
    address: str = ""  # the join's remote address
    version: int = -1
    rollouts_per_s: float = 0.0
    device: str = ""
    gpu: str = ""
    price_per_hour: float = 0.0
    download_mbit: float = 0.0
    upload_mbit: float = 0.0
    engine: str = ""
    groups_accepted: int = 0
    told_finished: bool = False
    active: bool = True  # the scheduler may idle a worker: it then gets no prompts
    relay_url: str = ""  # where this worker's broadcast relay listens (chain mode)
    reachable: bool | None = None  # did the learner reach its relay (None: not probed yet)
    installs: list[tuple[int, float, float, float]] = field(default_factory=list)  # (version, installed, received, install s)
    deliveries: frozenset = frozenset()  # its latest reported pushes (each heartbeat repeats them): checked once
    capacity_per_s: float = 0.0  # believed rollouts per engine-busy second (what the scheduler provisions with)
    claimed_capacity_per_s: float = 0.0  # what the worker said
    quarantined: str = ""  # why the learner stopped taking its work
    quarantine_reason: str = ""  # the verdict's reason code ("tokens", "rewards", ...): what others may see of it
    fleet_key: str = ""  # what the scheduler knows it by: its pool machine (machine token) or its id
    machine: str = ""  # the machine its machine token proved (one live identity per machine), or ""
    probed_at: float = -1e9  # the last reachability probe of its relay
    probe_due: bool = False  # its relay URL changed too soon after a probe: a leaf until probed
    probes_failed: int = 0  # unreachable probes in a row: each doubles the wait before the next
    ticket_at: float = -1e9  # when its read ticket was last issued (monotonic)
    # Its requests per second ([server] worker_requests_per_s), checked by `Auth.worker`; kept on
    # the record, so it goes when the worker is forgotten. None: not limited.
    requests: TokenBucket | None = field(default=None, repr=False)

    def row(self, now: float, alive: bool, leased: int) -> dict:
        """The worker as /v1/status shows it (no secrets, bounded size)."""
        return {"id": self.id, "name": self.name, "address": self.address, "alive": alive, "active": self.active,
                "version": self.version, "seen_s_ago": round(now - self.last_seen, 1),
                "rollouts_per_s": self.rollouts_per_s, "capacity_per_s": self.capacity_per_s,
                "claimed_capacity_per_s": self.claimed_capacity_per_s, "price_per_hour": self.price_per_hour,
                "gpu": self.gpu, "engine": self.engine, "groups_accepted": self.groups_accepted,
                "relay_url": self.relay_url, "reachable": self.reachable, "leased_prompts": leased,
                "quarantined": self.quarantined}


PROBE_EVERY_S = 30.0  # a relay is probed at most this often, however often its URL changes
PROBE_AGAIN_MAX_S = 600.0  # an unreachable relay is probed again, backing off to this (a port opened late)


def probe_wait(w: WorkerInfo) -> float:
    """Seconds after its last probe before a relay may be probed again."""
    return min(PROBE_EVERY_S * 2 ** min(w.probes_failed, 16), PROBE_AGAIN_MAX_S)


def relay_addressed(url: str, address: str, any_public: bool) -> bool:
    """Does a relay URL name the address its worker connects from (or, with `[server]
    relay_any_public`, a public one)? Only such a relay is probed, and pushed to once reachable:
    the learner must not connect, and push snapshots, wherever a worker pointed it, inside its own
    network too. Any other (a name, a NAT'd worker's own private address, its loopback) makes
    the worker a leaf that pulls over its own outbound connections, as if behind NAT: refused
    outright, a NAT'd worker with the default relay was refused every heartbeat, and never served."""
    host = urlsplit(url).hostname if "://" in url else url.split("/")[2]  # p2p:/ip4/<host>/tcp/...
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: the learner does not resolve names a worker chose
    try:
        own = ipaddress.ip_address(address)
    except ValueError:
        own = None
    return ip == own or (any_public and ip.is_global)


class WorkerRegistry:
    """Every joined worker, by id. `fleet` (a `scheduler.fleet.Fleet`, or None) decides who is active."""

    def __init__(self, server: ServerSection, verify: VerifySection, *, run: Run, leases: LeaseRoom,
                 buffer: AsyncBuffer, links: LinkTable, verifier: Verifier, metrics: LearnerMetrics,
                 fleet=None, tickets=None, placements=None, on_note=lambda text: None):
        self.server, self.verify, self.run = server, verify, run
        self.leases, self.buffer, self.links, self.verifier, self.metrics = leases, buffer, links, verifier, metrics
        self.fleet, self.on_note = fleet, on_note  # on_note: something the operator should read (status line)
        self.tickets = tickets  # chain mode: read tickets (broadcast.tickets.TicketOffice), or None
        self.placements = placements  # chain mode: the publisher's `broadcast.forwarding.Forwarding` (who was placed where)
        self.workers: dict[str, WorkerInfo] = {}
        # Per address: workers joined, wrong tokens, bans that expire (learner.addresses).
        self.addresses = AddressBook(max_workers=server.max_workers_per_address,
                                     max_64s_per_48=server.max_64s_per_48, ban_s=server.ban_s, hold_s=server.hold_s,
                                     failures_per_min=server.auth_failures_per_min,
                                     failure_burst=server.auth_failure_burst)
        self.gate = JoinGate(server.join_rate, server.join_burst, server.allow_networks)
        self._ids = itertools.count(1)
        self.quarantined_machines: dict[str, str] = {}  # pool machine -> why (kept after its worker is forgotten)
        self._probes: set[asyncio.Task] = set()

    def alive(self, now: float) -> list[WorkerInfo]:
        window = max(3 * self.server.heartbeat_interval, self.server.lease_ttl)
        return [w for w in self.workers.values() if now - w.last_seen <= window]

    def active(self, now: float) -> list[WorkerInfo]:
        return [w for w in self.alive(now) if w.active]

    def address_of(self, worker_id: str) -> str | None:
        """A worker's address key (its /64 for IPv6); None for one not registered."""
        w = self.workers.get(worker_id)
        return None if w is None else address_key(w.address)

    def of_machine(self, machine: str | None) -> WorkerInfo | None:
        """The live identity of pool machine `machine` (a join with its machine token replaces it)."""
        if not machine:  # most joins: no machine token, and nothing to scan the fleet for
            return None
        return next((w for w in self.workers.values() if w.machine == machine), None)

    def refusal(self, address: str, now: float, machine: str | None = None) -> web.Response | None:
        """Why a join from `address` (with `machine`'s machine token) may not pass now (403, 503 or
        429), or None. The identity the join would replace does not count against the limits."""
        server, refused = self.server, self.metrics.joins_refused
        previous = self.of_machine(machine)
        if not self.gate.allowed_from(address):
            refused.labels("network").inc()
            return json_error(403, "network", f"joins from {address} are not allowed ([server] allow_networks)")
        # A pool machine (its machine token is the operator's word) is not barred for a neighbour behind
        # the same address: the ban is there to stop a quarantined worker coming back under a new name,
        # and a machine's own quarantine is kept by its id (below).
        banned = "" if machine else self.addresses.banned(address, now)
        if banned:
            refused.labels("banned").inc()
            return json_error(403, "banned", f"a worker from {address} was quarantined: {banned}")
        if machine and machine in self.quarantined_machines:  # its machine token is its identity
            refused.labels("banned").inc()
            return json_error(403, "banned", f"machine {machine} was quarantined: {self.quarantined_machines[machine]}")
        wait, why = (0.0, "") if machine else self.addresses.held(address, now)
        if wait > 0:
            refused.labels("held").inc()
            return json_error(429, "held", f"a worker from {address} was quarantined ({why[:300]}); no new worker "
                                           f"joins from it for {wait:.0f} s more ([server] hold_s, doubled for each "
                                           "repeat); retry after the given seconds", {"Retry-After": str(math.ceil(wait))})
        replaced = previous is not None
        same_address = replaced and address_key(previous.address) == address_key(address)
        full = "" if same_address else self.addresses.full(address)
        if full:
            refused.labels("address-full").inc()
            return json_error(403, "address-full", full)
        if len(self.workers) - replaced >= server.max_workers:
            refused.labels("full").inc()
            return json_error(503, "fleet-full", f"the learner holds its maximum of {server.max_workers} workers "
                                                 "([server] max_workers); try again later", {"Retry-After": "30"})
        wait = self.gate.take(now)
        if wait > 0:
            refused.labels("rate").inc()
            return json_error(429, "join-rate", f"joins are limited to {server.join_rate:g}/s "
                                                "([server] join_rate); retry after the given seconds",
                              {"Retry-After": str(max(1, round(wait)))})
        return None

    def join(self, report: P.Report, address: str, now: float, machine: str | None = None) -> tuple[WorkerInfo, str]:
        """A new worker and its secret (only its hash is kept). `machine`: the pool machine its
        machine token proved; it then goes by that name, whatever it calls itself, and replaces
        that machine's previous identity (a machine restarted: one live identity per machine)."""
        wid, secret = f"w{next(self._ids)}", secrets.token_urlsafe(24)
        info = WorkerInfo(id=wid, name=machine or report.name or wid, joined=now, last_seen=now,
                          secret_hash=secret_hash(secret), address=address, fleet_key=wid, machine=machine or "",
                          requests=TokenBucket(self.server.worker_requests_per_s, self.server.worker_request_burst, now))
        self.update(info, report)
        previous = self.of_machine(machine)
        if previous is not None:  # its credential stops working now, its leases go out again now
            leased = self.forget(previous)
            self.on_note(f"machine {machine} joined again as {wid}: {previous.id} forgotten, "
                         f"{leased} leased prompts re-issued")
        self.workers[wid] = info
        self.addresses.joined(address)
        # One more alive now, not at the reaper's next count: 16 identities joining within its second
        # each took a share of three workers' prompts, and held all 96 in flight for ~20 s.
        self.leases.book.alive += 1
        if self.fleet is not None:
            info.fleet_key = self.fleet.joined(now, wid, machine)
            info.active = self.fleet.is_active(info.fleet_key)
        return info, secret

    def update(self, w: WorkerInfo, r: P.Report) -> None:
        """Take a join's or heartbeat's report. Rates are claims: the capacity the scheduler sees is
        capped by what the learner measured (learner.verify); link samples are checked by the table.
        A report refused (a malformed link sample) is refused before anything of it is taken: a
        refused join leaves no record of a worker that never joined."""
        try:
            samples = [LinkSample.from_dict(d) for d in r.links]
        except ValueError as e:
            raise web.HTTPBadRequest(text=str(e)) from None
        w.version = self.run.installable(r.version)
        if w.version < r.version:
            self.metrics.claims_clamped.labels("version").inc()
        w.rollouts_per_s, w.price_per_hour = r.rollouts_per_s, r.price_per_hour
        w.download_mbit, w.upload_mbit = r.download_mbit, r.upload_mbit
        w.device, w.gpu, w.engine = r.device, r.gpu, r.engine
        w.claimed_capacity_per_s = r.capacity_per_s
        before = self.verifier.evidence.get(w.id)
        clamped = before.claims_clamped if before else 0
        w.capacity_per_s = self.verifier.believed_capacity(w.id, r.capacity_per_s)
        if self.verifier.evidence[w.id].claims_clamped > clamped:
            self.metrics.claims_clamped.labels("capacity").inc()
        changed = r.relay_url != w.relay_url
        if changed:
            w.relay_url, w.probes_failed = r.relay_url, 0
            w.probe_due = bool(w.relay_url) and relay_addressed(w.relay_url, w.address, self.server.relay_any_public)
        probe_now = w.probe_due and w.last_seen - w.probed_at >= probe_wait(w)
        if changed:
            # A leaf: one not at the worker's own address (never connected to), and one changed too
            # soon after a probe until it is probed (a worker passed a probe, then named a port on
            # its address that answers nothing, and was planned as reachable unprobed).
            w.reachable = None if not w.relay_url or probe_now else False
        if probe_now:
            w.probe_due, w.probed_at = False, w.last_seen
            self.probe(w)
        known = w.installs[-1][0] if w.installs else -1
        published = self.run.published_version
        for item in r.installs:  # "seconds ago": clocks differ between machines
            if known < item.version <= published:  # a version never published was never installed
                received_ago = max(item.installed_ago, item.received_ago)
                w.installs.append((item.version, w.last_seen - item.installed_ago, w.last_seen - received_ago,
                                   item.install_s))
                known = item.version
        del w.installs[:-64]
        self._links(w, r, samples)
        self._deliveries(w, r.deliveries)

    def _deliveries(self, w: WorkerInfo, deliveries: list[P.Delivery]) -> None:
        """A relay's pushes its children took whole: with a child's valid receipt, the child's own
        pull of that tree is its lie; without one, the relay's word against it (a dispute,
        `broadcast.forwarding`), heard only from a relay whose work the learner accepted."""
        if self.placements is None:
            return
        seen, w.deliveries = w.deliveries, frozenset(deliveries)
        for d in w.deliveries - seen:
            child = self.workers.get(d.child)
            proven = child is not None and valid(child.secret_hash, d.receipt, d.key, d.tree, w.id, d.child)
            # an invalid one is forged by the relay, or a child's garbage: no proof either way
            self.metrics.receipts.labels("valid" if proven else "invalid" if d.receipt else "none").inc()
            if proven or w.groups_accepted > 0:
                self.placements.delivered(d.key, w.id, d.child, d.tree, receipt=proven)

    def _links(self, w: WorkerInfo, r: P.Report, samples: list[LinkSample]) -> None:
        # A market's offer says the machine's links: that seeds the table, not the worker's word,
        # which may lower its rates but not raise them above what an unmeasured link is taken for
        # (a worker declaring 100 Gbit/s was planned as the one stripe every byte went through).
        offered = self.fleet.link_of(w.fleet_key) if self.fleet is not None else None
        unknown = self.links.default
        down, prior = ((offered[0] * MBIT, offered[1] * MBIT) if offered is not None else
                       (min(w.download_mbit * MBIT, unknown), min(w.upload_mbit * MBIT, unknown)))
        self.links.declare(w.id, down, prior)
        if r.rtt_ms is not None:
            self.links.observe_rtt(w.id, r.rtt_ms / 1e3)
        most_down = down or unknown  # its own word on its download raises it no further (nor what it vouches)
        for sample in samples:
            if sample.down is not None and sample.down > most_down:
                self.metrics.claims_clamped.labels("download").inc()
                sample = dataclasses.replace(sample, down=most_down)
            if self.placements is not None:  # chain mode: a sample speaks of a version's route that placed it
                placed = self.placements.hops(sample.key, w.id)
                if placed is None:  # a key no route of the learner's had it in: made up
                    self.metrics.claims_clamped.labels("link-sample").inc()
                    continue
                parents, forwards = placed
                if sample.parent is not None and sample.parent not in parents:
                    sample = dataclasses.replace(sample, down=None, parent=None)  # not its parent there
                if not forwards:
                    sample = dataclasses.replace(sample, up=None)  # it sent that version to nobody
                if sample.down is None and sample.up is None:
                    continue
            # The other end's evidence about its parent's upload, from a worker whose work the learner
            # accepted, about another worker: a fresh identity cannot vouch for its partner's link.
            if sample.parent and sample.down and w.groups_accepted > 0 and sample.parent in self.workers \
                    and sample.parent != w.id:
                # stamped with the version it describes: one report resent every heartbeat kept a
                # liar's lift for as long as two sybils resent it (a tester, 2026-11-29)
                described = key_version(sample.key)
                if described is not None:
                    self.verifier.upload_seen(sample.parent, sample.down, w.id, described)
            if sample.up:  # a worker's word on its own upload, believed as far as its children saw
                up = self.verifier.believed_upload(w.id, sample.up, prior, self.run.published_version)
                if up < sample.up:
                    self.metrics.claims_clamped.labels("upload").inc()
                    sample = dataclasses.replace(sample, up=up)
            self.links.observe(w.id, sample)

    def heartbeat(self, worker: WorkerInfo, report: P.Report) -> P.HeartbeatReply:
        if worker.quarantined:  # nothing of its report is taken (links, claims), nothing renewed
            return P.HeartbeatReply(state="quarantined", message=worker.quarantined)
        self.update(worker, report)
        self.leases.renew(worker.id, worker.last_seen)
        if self.fleet is not None:
            self.fleet.heartbeat(worker.last_seen, worker.fleet_key, worker.capacity_per_s)
            worker.active = self.fleet.is_active(worker.fleet_key)
        finished = self.run.finished
        worker.told_finished = finished
        return P.HeartbeatReply(state="stop" if finished else "active" if worker.active else "idle",
                                snapshot=self.run.announcement, reachable=worker.reachable,
                                read_token=self.ticket(worker, worker.last_seen), on_route=self.run.on_route(worker.id))

    def ticket(self, worker: WorkerInfo, now: float, *, fresh: bool = False) -> str:
        """A renewed read ticket for `worker` when its last one is due (or `fresh`), else "". A
        quarantined worker gets none: its ticket lapses (`broadcast.tickets`)."""
        if self.tickets is None or worker.quarantined or not (fresh or self.tickets.due(worker.ticket_at, now)):
            return ""
        worker.ticket_at = now
        return self.tickets.issue(worker.id, proof_key(worker.secret_hash).public_key())  # its pulls prove it

    def quarantine(self, worker: WorkerInfo, verdict: Verdict) -> None:
        """Stop taking `worker`'s work: its leases and queued groups go back to be generated by others."""
        self.metrics.flagged.labels(verdict.reason).inc()
        if worker.quarantined or not self.verify.quarantine:
            return
        worker.quarantined, worker.quarantine_reason, worker.active = verdict.message, verdict.reason, False
        self.verifier.distrust(worker.id)
        if self.tickets is not None:  # no more weights from the learner's source, none renewed
            self.tickets.revoke(worker.id)
        if worker.machine:  # its machine token may not bring it back as a new identity
            remember(self.quarantined_machines, worker.machine, verdict.message[:500], keep=4096)
        if self.verify.ban_address and worker.address:  # else it would join again under a new name, at once
            if verdict.certain:
                self.addresses.ban(worker.address, verdict.message, time.monotonic())
            else:  # bad luck is possible: its address is held back a while, not banned
                self.addresses.hold(worker.address, verdict.message, time.monotonic())
        leased = self.leases.release_worker(worker.id)
        dropped = self.buffer.buffer.drop_worker(worker.id)
        self.metrics.quarantined.labels(verdict.reason).inc()
        self.on_note(f"quarantined {worker.name} ({worker.id}, {worker.address}): {verdict.message}; "
                     f"{leased} leased prompts re-issued, {dropped} queued groups dropped")

    def quarantine_id(self, worker_id: str, reason: str, message: str) -> None:
        """`quarantine` by worker id (a verdict reached outside the request that brought the work)."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            self.quarantine(worker, Verdict(worker_id, reason, message))

    def judge_logprobs(self, groups: list[Group], staleness: list[int], group_gaps: list[list[float]],
                       group_tokens: list[list[float]] | None = None,
                       skipped: list[tuple[Group, int, list[float]]] = (), claims: list[list[float]] = (),
                       claimable: list[int] = (), skipped_claims: list[tuple[Group, list[float]]] = ()) -> None:
        """Judge each worker's groups, fresh and stale, by how far its μ lies from the trainer's π
        beyond the fleet's drift at their staleness, and whether its tokens look sampled from π
        (learner.verify); `skipped`: (group, staleness, token terms) of groups dynamic sampling did
        not train, token-checked all the same. `claims`: stale groups checked against the version
        they claim ([index, token terms (6), gap, tokens], `Trainer._check_claims`): judged as fresh
        ones, at staleness 0, in place of their gap from the trainer's π and the drift. The other
        `claimable` groups (their version kept, not drawn) carry no evidence: the drift stands in
        only where no version can (a lone honest worker was a liar by it, a group labelled older
        than it was bought credit below it, and sybils with standing could set it).
        `skipped_claims`: (group, the eight sums) of skipped groups checked so, judged alike."""
        exact, claimable = {int(c[0]): c[1:] for c in claims}, set(claimable)
        self.metrics.claims_checked.inc(len(exact) + len(skipped_claims))
        if claimable:
            none = [0.0] * 6
            staleness = [0 if i in exact else k for i, k in enumerate(staleness)]
            group_gaps = [exact[i][6:] if i in exact else [0.0, 0.0] if i in claimable else gap
                          for i, gap in enumerate(group_gaps)]
            group_tokens = [exact[i][:6] if i in exact else none if i in claimable else terms
                            for i, terms in enumerate(group_tokens or [none] * len(groups))]
        checked = [(g.worker_id, k, gap, int(tokens)) for g, k, (gap, tokens) in zip(groups, staleness, group_gaps)]
        checked += [(g.worker_id, 0, sums[6], int(sums[7])) for g, sums in skipped_claims]
        verdicts = self.verifier.logprobs_checked(checked)
        if group_tokens is not None:
            tokens = [*zip(groups, staleness, group_tokens), *skipped, *((g, 0, sums[:6]) for g, sums in skipped_claims)]
            verdicts += self.verifier.tokens_checked(
                [(g.worker_id, k, *terms) for g, k, terms in tokens if terms[2] + terms[3]])
        for verdict in verdicts:
            worker = self.workers.get(verdict.worker_id)
            if worker is not None:
                self.quarantine(worker, verdict)

    def judge_repeats(self, found: list[tuple[str, int]]) -> None:
        """A step's improbable windows, (worker id, window): `learner.verify.Repeats`."""
        repeats = self.verifier.repeats
        first, again = repeats.first, repeats.again
        verdicts = repeats.checked(found)
        self.metrics.improbable_windows.labels("first").inc(repeats.first - first)
        self.metrics.improbable_windows.labels("again").inc(repeats.again - again)
        for verdict in verdicts:
            worker = self.workers.get(verdict.worker_id)
            if worker is not None:
                self.quarantine(worker, verdict)

    def probe(self, worker: WorkerInfo) -> None:
        """Can the learner open a connection to the worker's relay? An unreachable one (behind
        NAT) becomes a leaf that pulls from a reachable parent (learner.publisher)."""
        from broadcast.reach import probe_relay

        url = worker.relay_url

        async def run() -> None:
            ok = await probe_relay(url, PROBE_TIMEOUT_S)
            if worker.relay_url == url:
                worker.reachable = ok
                worker.probes_failed = 0 if ok else worker.probes_failed + 1
                # Unreachable (a port forwarded or a firewall opened after the worker joined, a
                # probe timed out under load): probed again after a backoff, or it stays a leaf
                # for the rest of the run.
                worker.probe_due = not ok
                self.metrics.relays_probed.labels("reachable" if ok else "unreachable").inc()

        task = asyncio.get_running_loop().create_task(run())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def lost(self, fleet_key: str, why: str) -> int:
        """The scheduler lost a machine (preempted, destroyed): its workers stop counting and
        their leases are re-issued now, not at the lease TTL. Returns the prompts re-issued."""
        leased = 0
        for w in [w for w in self.workers.values() if w.fleet_key == fleet_key]:
            w.active = False
            leased += self.leases.release_worker(w.id)
        return leased

    def reap(self, now: float) -> None:
        """Forget long-silent workers (quarantined ones too: their calls renew nothing): their
        credentials stop working, their leases go back. An address ban outlives the worker."""
        for w in [w for w in self.workers.values() if now - w.last_seen > self.server.forget_after_s]:
            self.forget(w)

    def forget(self, w: WorkerInfo) -> int:
        """Forget `w` now: its credential stops working, its leases are re-issued at once (returns
        their prompts). Its queued groups stay (work it delivered before it went)."""
        del self.workers[w.id]
        w.active = False  # a lease request of it still parked gets nothing
        if self.tickets is not None:  # its ticket named a worker that is gone: one address kept ~80 alive
            self.tickets.revoke(w.id, "was forgotten (silent past [server] forget_after_s, or replaced): join again")
        leased = self.leases.release_worker(w.id)
        self.leases.book.forget_worker(w.id)
        self.addresses.left(w.address)
        self.links.forget(w.id)
        self.verifier.forget(w.id)
        if self.fleet is not None:
            self.fleet.left(w.fleet_key)
        return leased

    def routes(self, auth: Auth, welcome) -> list[web.RouteDef]:
        """`welcome(worker_id, credential)`: the join's reply (sampling parameters, task, broadcast)."""
        async def join(request: web.Request) -> web.Response:
            machine = auth.run_token(request, machines=True)
            report = await read_body(request, P.Report, self.metrics.rejected)
            now, address = time.monotonic(), auth.address(request)
            refused = self.refusal(address, now, machine)
            if refused is not None:
                return refused
            info, secret = self.join(report, address, now, machine)
            return reply(welcome(info.id, f"{info.id}.{secret}", self.ticket(info, now, fresh=True)))

        async def heartbeat(request: web.Request) -> web.Response:
            worker = auth.worker(request)
            report = await read_body(request, P.Report, self.metrics.rejected)
            return reply(self.heartbeat(worker, report))

        return [web.post("/v1/join", join, expect_handler=continue_later),
                web.post("/v1/heartbeat", heartbeat, expect_handler=continue_later)]


def shown_dir(path: str) -> str:
    """A task's model directory as a worker is told it: relative to the learner's working
    directory where it lies under it (`models/tiny-poker`, the layout a clone of the repo has
    too, so the worker finds its own copy), else its name alone. The learner's absolute paths
    (a user's home, a mount) went to every holder of the run token (an API-only tester, 2026-12-07)."""
    p = Path(path).absolute()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return p.name


def welcome(server: ServerSection, task: TaskSection, rollout: P.RolloutParams, run: Run, broadcast: P.BroadcastInfo,
            lora: P.LoraInfo | None = None, task_dirs: dict[str, str] | None = None):
    """The join reply's maker: what a new worker needs to start (`broadcast`: how versions travel,
    with the worker's own read ticket; `task_dirs`: the digest of each of the task's model directories)."""
    options = {k: shown_dir(v) if k in (task_dirs or {}) else v for k, v in task.options.items()}
    info = P.TaskInfo(name=task.name, options=options, model_dirs=task_dirs or {})

    def make(worker_id: str, credential: str, read_token: str = "") -> P.JoinReply:
        return P.JoinReply(
            worker_id=worker_id, credential=credential,
            broadcast=broadcast.model_copy(update={"read_token": read_token}) if read_token else broadcast,
            heartbeat_interval=server.heartbeat_interval, lease_ttl=server.lease_ttl,
            long_poll_s=server.long_poll_s, task=info,
            rollout=rollout, snapshot=run.announcement, lora=lora)
    return make

