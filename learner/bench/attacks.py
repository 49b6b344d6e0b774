"""The hostile share of `echo-rl bench control-plane --hostile F`: workers that attack the learner.

Each hostile worker holds the run token, as every rented worker does, and joins like one
(`hostile-<n>`, from an address of its own, 127.1.x.y; the honest fleet is 127.0.0.1). Then,
one attack every 1-2 s, it cycles through what the learner defends against
(docs/untrusted-workers.md), each an ordinary HTTP request:

    zstd-declared     an upload whose zstd frame declares 1 GiB (32 KiB sent)               4xx
    zstd-undeclared   80 MiB of zeros in a frame that declares no size (3 KiB sent)         4xx
    msgpack-bomb      900,000 empty lists nested under msgpack's length limits (135 B)      4xx
    long-lease-id     a 1 MiB or 200 KiB lease_id to /v1/release, 64 KiB in an upload       4xx, a short reply
    deep-json         a 100,000-deep JSON array as its heartbeat                            4xx
    relay-url         a heartbeat or a join whose relay_url is someone else's: 10.0.0.1,
                      the cloud metadata address, the learner's own port, a LAN router      no probe (a
                      leaf that pulls, as behind NAT: never connected to, so no oracle)
    bad-credentials   a burst of 25 wrong run tokens and guessed credentials, from a
                      fresh address each burst (127.2.x.y)                                  401/429
    weights           the star store's snapshots and the broadcast source's manifest,
                      chunks, status and route feed, with no credential, a wrong one, the
                      run token (a snapshot), or a worker's own credential for the read
                      capability (fresh 127.4.x.y)                                          0 bytes

Alongside, without pause, each hoards (`hoard`): a long-polled lease request for 1024 prompts
always parked at the learner, none ever answered (its heartbeats keep the leases alive), to be
held to a few prompts. And each runs a forger (`forger-<n>`, 127.3.x.y): it leases one prompt at
a time and uploads its group, every reward claimed 1.0, one upload every 1-2 s until the learner
quarantines it; then it joins again from the same address (`rejoin`: banned, 403) and moves on
to a new address.

Every request is counted by class and outcome (its HTTP status, or the client error's name);
`learner.bench.control_plane` judges them. The issue's eval forgery is not among them: the
bench's stand-in trainer has no model, so there is no greedy answer to check one against
(`tests/integration/test_loop_integration.py` runs that attack on a real learner).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import resource
import secrets
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

ATTACK_EVERY_S = (1.0, 2.0)  # one attack per hostile worker this often: a nuisance, not a flood
GUESS_BURST = 25  # wrong credentials per bad-credentials attack (the learner lets an address try 20)
CYCLE = ("zstd-declared", "zstd-undeclared", "msgpack-bomb", "long-lease-id", "deep-json", "relay-url",
         "bad-credentials", "weights")
# Every reply to these must be a refusal (4xx); hoarding and forging are served until the learner's cap or
# verdict; a relay URL elsewhere is taken as a pulling leaf's (a NAT'd worker's), and must never be probed.
REFUSED = (*(c for c in CYCLE if c != "relay-url"), "rejoin")
CLASSES = (*CYCLE, "hoard", "forged-rewards", "rejoin")


def address(net: int, n: int) -> str:
    """The n-th loopback address of a face of the attack: the learner counts its limits per address."""
    return f"127.{net}.{n // 250 % 250}.{n % 250 + 1}"


@dataclass(frozen=True)
class Payloads:
    """The attack bodies, built once: a bomb is cheap to send and dear to build."""

    zstd_declared: bytes
    zstd_undeclared: bytes
    msgpack_bomb: bytes
    long_id_upload: bytes
    long_id_release: tuple[bytes, bytes]  # 1 MiB (over the JSON limit), 200 KiB (under it, over the field's)
    deep_json: bytes

    @classmethod
    def build(cls) -> "Payloads":
        import msgpack
        import zstandard

        zero = bytes(1 << 20)
        declared = zstandard.ZstdCompressor(write_content_size=True).compressobj(size=1 << 30)
        undeclared = zstandard.ZstdCompressor(write_content_size=False).compressobj()

        def upload(obj) -> bytes:
            return zstandard.ZstdCompressor().compress(msgpack.packb(obj, use_bin_type=True))

        sample = {"tokens": bytes(4), "logprobs": bytes(4), "reward": 1.0}
        return cls(
            zstd_declared=b"".join(declared.compress(zero) for _ in range(1024)) + declared.flush(),
            zstd_undeclared=b"".join(undeclared.compress(zero) for _ in range(80)) + undeclared.flush(),
            # ~900 KiB inflated: past what the few prompts an attacker holds may inflate to, and
            # under it (tests/unit/echo/test_wire.py) msgpack's bounds hold it
            msgpack_bomb=upload({"worker_id": "w", "lease_id": "L", "groups": [[[]] * 1000] * 900}),
            long_id_upload=upload({"worker_id": "w", "lease_id": "L" * (64 << 10),
                                   "groups": [{"prompt_id": "p", "version": 0, "samples": [sample] * 4}]}),
            long_id_release=(json.dumps({"lease_id": "L" * (1 << 20)}).encode(),
                             json.dumps({"lease_id": "L" * (200 << 10)}).encode()),
            deep_json=b"[" * 100_000 + b"]" * 100_000)


class HostileFleet:
    """`workers` hostile workers against the learner at `url`; `outcomes[class][status]` counts replies."""

    def __init__(self, url: str, token: str, workers: int, ramp_s: float, tokenizer, classes=CLASSES):
        self.url, self.token, self.workers, self.ramp_s, self.tokenizer = url, token, workers, ramp_s, tokenizer
        self.classes = [c for c in CLASSES if c in classes]  # what runs (`rejoin` comes with the forger)
        self.payloads = Payloads.build()
        self.outcomes: dict[str, Counter[str]] = {c: Counter() for c in CLASSES}
        self.longest_reply: Counter[str] = Counter()
        self.weight_bytes = 0  # bytes of any 2xx reply to a weights request: must stay 0
        self.hoarded: list[int] = []  # prompts per hoard request
        self.held: Counter[int] = Counter()  # prompts held by each hoarder (never answered)
        self.forgers: list[dict] = []  # per forger identity: caught after how long, how many groups acknowledged
        self.failures: list[str] = []
        self._addresses = {net: itertools.count() for net in (2, 3, 4)}

    def next_address(self, net: int) -> str:
        return address(net, next(self._addresses[net]))

    async def run(self, seconds: float) -> None:
        tasks = [asyncio.create_task(self.hostile(n)) for n in range(self.workers)]
        await asyncio.sleep(seconds)
        for t in tasks:
            t.cancel()
        for r in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                self.failures.append(repr(r))

    # --- requests ---------------------------------------------------------------------------------

    async def send(self, cls: str, session, method: str, url: str, token: str | None = None,
                   **kw) -> tuple[int, bytes]:
        """One request of attack class `cls`, counted by outcome; (status, body), or (0, b"") when the
        connection failed (the learner closing on a body it will not read counts here, by error name)."""
        import aiohttp

        headers = dict(kw.pop("headers", {}))
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        try:
            async with session.request(method, url, headers=headers, **kw) as resp:
                status, body = resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.outcomes[cls][type(e).__name__] += 1
            return 0, b""
        self.outcomes[cls][str(status)] += 1
        self.longest_reply[cls] = max(self.longest_reply[cls], len(body))
        return status, body

    @staticmethod
    def session(local: str):
        import aiohttp

        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(local, 0), limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120))

    async def join(self, client, name: str):
        """Join like an honest worker (waiting out the join rate); None if the learner refuses for good."""
        from echo import protocol as P
        from worker.client import LearnerError

        while True:
            try:
                return await client.join(P.Report(name=name))
            except LearnerError as e:
                if e.status not in (429, 503):
                    return None
                await asyncio.sleep(max(1.0, e.retry_after) * random.uniform(1, 1.5))

    # --- one hostile worker -------------------------------------------------------------------------

    async def hostile(self, n: int) -> None:
        from echo import protocol as P
        from worker.client import LearnerClient, LearnerError

        await asyncio.sleep(random.uniform(0, self.ramp_s))
        async with self.session(address(1, n)) as session:
            client = LearnerClient(session, self.url, self.token)
            joined = await self.join(client, f"hostile-{n}")
            if joined is None:
                self.failures.append(f"hostile-{n} could not join")
                return
            me = Attacker(self, n, session, client, joined)

            async def beat() -> None:  # alive, so the hoarded leases are renewed: the worst case
                while True:
                    await asyncio.sleep(joined.heartbeat_interval)
                    try:
                        me.announced((await client.heartbeat(P.Report(name=f"hostile-{n}", version=me.version))).snapshot)
                    except LearnerError:
                        pass

            alongside = [asyncio.create_task(beat())]
            if "hoard" in self.classes:
                alongside.append(asyncio.create_task(me.hoard(joined.long_poll_s)))
            if "forged-rewards" in self.classes:
                alongside.append(asyncio.create_task(self.forger(n)))
            cycle = [c for c in CYCLE if c in self.classes]
            cycle = cycle[n % len(cycle):] + cycle[:n % len(cycle)] if cycle else []  # each starts elsewhere
            try:
                for cls in itertools.cycle(cycle):
                    await asyncio.sleep(random.uniform(*ATTACK_EVERY_S))
                    await getattr(me, cls.replace("-", "_"))()
                await asyncio.Event().wait()  # no cycle: the hoarder and the forger go on
            finally:
                for t in alongside:
                    t.cancel()

    async def forger(self, n: int) -> None:
        """Upload forged rewards until caught; try to come back; move to a new address."""
        from echo import protocol as P
        from echo.wire import CONTENT_TYPE, GroupMsg, SampleMsg, Submission, encode_submission
        from worker.client import LearnerClient, LearnerError

        wrong = self.tokenizer("+", add_special_tokens=False)["input_ids"]
        while True:
            async with self.session(self.next_address(3)) as session:
                client = LearnerClient(session, self.url, self.token)
                joined = await self.join(client, f"forger-{n}")
                if joined is None:
                    await asyncio.sleep(random.uniform(*ATTACK_EVERY_S))
                    continue
                version = joined.snapshot.version if joined.snapshot else 0
                first, acknowledged, caught = 0.0, 0, False
                while not caught:
                    try:
                        lease = await client.lease(1, version, wait_s=joined.long_poll_s)
                    except LearnerError as e:
                        caught = e.reason == "quarantined"
                        break
                    version = lease.snapshot.version if lease.snapshot else version
                    if lease.lease_id is None:
                        continue
                    right = [self.tokenizer(p.answer, add_special_tokens=False)["input_ids"] for p in lease.prompts]
                    groups = [GroupMsg(p.id, version, [SampleMsg(ids, [-0.5] * len(ids), 1.0)  # "all correct"
                                                       for ids in (r, wrong, r, wrong)])
                              for p, r in zip(lease.prompts, right)]
                    body = encode_submission(Submission(client.worker_id, lease.lease_id, groups))
                    first = first or time.monotonic()
                    status, reply = await self.send("forged-rewards", session, "POST", self.url + "/v1/trajectories",
                                                    client.credential, data=body, headers={"Content-Type": CONTENT_TYPE})
                    if status == 200:
                        acknowledged += json.loads(reply)["accepted"]
                    caught = status == 403 and json.loads(reply).get("error") == "quarantined"
                    if not caught:
                        await asyncio.sleep(random.uniform(*ATTACK_EVERY_S))
                self.forgers.append({"caught": caught, "seconds": time.monotonic() - first if first else None,
                                     "acknowledged": acknowledged})
                await asyncio.sleep(random.uniform(*ATTACK_EVERY_S))
                if caught:  # back under a new name from the same address
                    await self.send("rejoin", session, "POST", self.url + "/v1/join", self.token,
                                    json=P.Report(name=f"forger-{n}").model_dump())

    def summary(self) -> dict:
        return {
            "hostile_workers": self.workers, "classes_run": self.classes,
            "classes": {c: {"sent": sum(o.values()), "outcomes": dict(sorted(o.items())),
                            "longest_reply": self.longest_reply[c]} for c, o in self.outcomes.items()},
            "weight_bytes_without_credential": self.weight_bytes,
            "hoard": {"requests": len(self.hoarded), "most_per_request": max(self.hoarded, default=0),
                      "most_held": max(self.held.values(), default=0), "held": sum(self.held.values())},
            "forgers": self.forgers,
            "failures": self.failures[:20],
        }


class Attacker:
    """One hostile worker's attacks (method per class of `CYCLE`), all with its own valid
    credential unless the attack is about credentials."""

    def __init__(self, fleet: HostileFleet, n: int, session, client, joined):
        self.fleet, self.n, self.session, self.client = fleet, n, session, client
        self.url, self.p = fleet.url, fleet.payloads
        self.port = urlsplit(fleet.url).port
        self.source = joined.broadcast.source  # the broadcast source (chain), "" with star
        self.version, self.key = 0, ""
        self.announced(joined.snapshot)
        self.turns: Counter[str] = Counter()  # which variant of a class comes next

    def turn(self, cls: str, variants: int) -> int:
        self.turns[cls] += 1
        return (self.n + self.turns[cls]) % variants  # workers start on different variants

    def announced(self, snapshot) -> None:
        if snapshot is not None:
            self.version, self.key = snapshot.version, getattr(snapshot, "key", "") or ""

    async def _upload(self, cls: str, body: bytes) -> None:
        from echo.wire import CONTENT_TYPE

        await self.fleet.send(cls, self.session, "POST", self.url + "/v1/trajectories", self.client.credential,
                              data=body, headers={"Content-Type": CONTENT_TYPE})

    async def zstd_declared(self) -> None:
        await self._upload("zstd-declared", self.p.zstd_declared)

    async def zstd_undeclared(self) -> None:
        await self._upload("zstd-undeclared", self.p.zstd_undeclared)

    async def msgpack_bomb(self) -> None:
        await self._upload("msgpack-bomb", self.p.msgpack_bomb)

    async def long_lease_id(self) -> None:
        turn = self.turn("long-lease-id", 3)
        if turn == 2:
            return await self._upload("long-lease-id", self.p.long_id_upload)
        await self.fleet.send("long-lease-id", self.session, "POST", self.url + "/v1/release", self.client.credential,
                              data=self.p.long_id_release[turn], headers={"Content-Type": "application/json"})

    async def deep_json(self) -> None:
        await self.fleet.send("deep-json", self.session, "POST", self.url + "/v1/heartbeat", self.client.credential,
                              data=self.p.deep_json, headers={"Content-Type": "application/json"})

    async def hoard(self, wait_s: float) -> None:
        """Always one lease request parked, for all the prompts there are; none ever answered."""
        while True:
            status, body = await self.fleet.send("hoard", self.session, "POST", self.url + "/v1/lease",
                                                 self.client.credential,
                                                 json={"max_prompts": 1024, "version": self.version, "wait_s": wait_s})
            reply = json.loads(body) if status == 200 else {}
            got = len(reply.get("prompts", []))
            if status == 200:
                self.fleet.hoarded.append(got)
                self.fleet.held[self.n] += got  # never answered: its heartbeats keep every one of them
            if not got and reply.get("waited_s", 0.0) < wait_s / 2:  # refused, or answered at once: no spinning
                await asyncio.sleep(random.uniform(*ATTACK_EVERY_S))

    async def relay_url(self) -> None:
        turn = self.turn("relay-url", 8)
        target = ("http://10.0.0.1:80", "http://169.254.169.254:80", f"http://127.0.0.1:{self.port}",
                  "http://192.168.0.1:22")[turn % 4]
        report = {"name": f"hostile-{self.n}", "version": self.version, "relay_url": target}
        if turn < 4:  # in its heartbeat
            await self.fleet.send("relay-url", self.session, "POST", self.url + "/v1/heartbeat",
                                  self.client.credential, json=report)
        else:  # in a join with the run token: a second identity that must not come to be
            await self.fleet.send("relay-url", self.session, "POST", self.url + "/v1/join", self.fleet.token, json=report)

    async def bad_credentials(self) -> None:
        fleet = self.fleet
        async with fleet.session(fleet.next_address(2)) as session:
            for i in range(GUESS_BURST):
                path, token = (
                    ("/v1/join", secrets.token_urlsafe(16)),  # a guessed run token
                    ("/v1/heartbeat", f"w{random.randint(1, 2000)}.{secrets.token_urlsafe(24)}"),  # an id, a guessed secret
                    ("/v1/lease", fleet.token),  # the run token is nobody's worker credential
                    ("/v1/heartbeat", self.client.worker_id),  # its own id without the secret
                )[i % 4]
                await fleet.send("bad-credentials", session, "POST", self.url + path, token, json={})

    async def weights(self) -> None:
        """The weights without the right to read them: each 2xx byte counts against the learner."""
        fleet = self.fleet
        wrong = secrets.token_urlsafe(24)
        targets = [(f"{self.url}/v1/snapshots/{path}", token) for path in ("latest", str(self.version))
                   for token in (None, wrong, f"{self.client.worker_id}.{wrong}")]
        targets.append((f"{self.url}/v1/snapshots/{self.version}", fleet.token))  # every worker holds the run token
        if self.source:  # the read capability is what the source asks; a worker credential is not it
            targets += [(f"{self.source}/bcast/v1/{path}", token)
                        for path in (f"manifest/{self.key}", f"chunks/{self.key}?from=0&to=65536", "status",
                                     "routes?after=0&wait=0&id=x")
                        for token in (None, wrong, self.client.credential)]
        async with fleet.session(fleet.next_address(4)) as session:
            for url, token in targets:
                status, body = await fleet.send("weights", session, "GET", url, token)
                if 200 <= status < 300:
                    fleet.weight_bytes += len(body)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _status(outcome: str) -> int:
    return int(outcome) if outcome.isdigit() else 0  # a client error's name: no reply at all


def safety(attacks: dict, learner: dict) -> dict[str, dict]:
    """The hostile run's safety goals, each {"ok", "detail"}, from the attackers' counts and the
    learner's: refused what must be refused, never a 5xx, no weight byte without the read right,
    short replies to long ids, hoarders held to the first window, forgers caught, no honest
    worker caught, no relay probed on a worker's word."""
    classes, run = attacks["classes"], set(attacks["classes_run"])
    served = {c: sum(n for o, n in classes[c]["outcomes"].items() if 200 <= _status(o) < 300) for c in REFUSED}
    errors = {c: sum(n for o, n in v["outcomes"].items() if _status(o) >= 500) for c, v in classes.items()}
    forgers = attacks["forgers"]
    caught = [f for f in forgers if f["caught"]]
    first = learner["lease_first_prompts"]
    # The learner's count: a hoarder never learns that its leases expired (they die after a few of
    # the fleet's turnarounds), so what it received over the run is more than it ever held at once.
    held_most = learner["max_leased_by_kind"].get("hostile", 0)
    honest_caught = sum(learner["quarantined_by_kind"].get(kind, 0) for kind in ("sim", "probe"))
    probed = sum(learner["relays_probed"].values())

    def goal(ok: bool, detail: str) -> dict:
        return {"ok": bool(ok), "detail": detail}

    return {
        "refused": goal(not any(served.values()), ", ".join(f"{c}: {n} served" for c, n in served.items() if n)
                        or "every attack that must be refused was"),
        "no_5xx": goal(not any(errors.values()), ", ".join(f"{c}: {n}" for c, n in errors.items() if n) or "none"),
        "zero_weight_bytes": goal(attacks["weight_bytes_without_credential"] == 0,
                                  f"{attacks['weight_bytes_without_credential']} bytes in "
                                  f"{classes['weights']['sent']} requests"),
        "short_replies": goal(classes["long-lease-id"]["longest_reply"] < 4096,
                              f"longest reply to a long lease_id: {classes['long-lease-id']['longest_reply']} B"),
        "hoard_capped": goal(held_most <= first, f"at most {held_most} prompts held by one hoarder "
                                                 f"(lease_first_prompts = {first})"),
        "forgers_caught": goal((caught or "forged-rewards" not in run) and honest_caught == 0,
                               f"{len(caught)} of {len(forgers)} forger identities quarantined; "
                               f"{honest_caught} honest workers quarantined"),
        "no_relay_probe": goal(probed == 0, f"{probed} relay probes"),
    }


def cli(argv: list[str]) -> int:
    """Internal: `learner.bench.control_plane` runs the hostile fleet in a process of its own."""
    p = argparse.ArgumentParser(prog="python -m learner.bench.attacks")
    p.add_argument("--url", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--ramp-s", type=float, default=5.0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--classes", default=",".join(CLASSES))
    args = p.parse_args(argv)
    from learner.tinymodel import build_tokenizer

    fleet = HostileFleet(args.url, args.token, args.workers, args.ramp_s, build_tokenizer(), args.classes.split(","))
    # Built (imports, tokenizer, bombs: seconds of CPU): start when told, not during the measured run's ramp.
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0 = _cpu()
    asyncio.run(fleet.run(args.seconds))
    args.out.write_text(json.dumps({**fleet.summary(), "cpu_cores": (_cpu() - cpu0) / args.seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
