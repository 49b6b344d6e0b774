"""Workers are untrusted: each category of abuse is refused with a status and a reason, or
neutralised and counted. The control API runs for real (aiohttp on loopback) around a real
lease book, buffer, tokenizer and task; only the trainer is absent (these are control-plane
tests; `test_loop_integration` has the learner process end to end)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from urllib.parse import quote
import logging
import os
import re
import threading
import time
import zlib

from pathlib import Path
from types import SimpleNamespace

import aiohttp
import msgpack
import pytest
from aiohttp import web

from conftest import closed_of
from echo import protocol as P
from echo.config import load_config
from echo.tasks import load_task
from learner.tinymodel import build_tokenizer
from echo.wire import CONTENT_TYPE, GroupMsg, SampleMsg, Submission, encode_submission
from broadcast.star import BlobStore
from learner.buffer import AsyncBuffer, StalenessBuffer
from learner.config import LearnerConfig
from learner.admission import Waiters
from learner.leases import LeaseBook, WorkerCap
from learner.api import ControlApi, Run
from learner.api.workers import PROBE_TIMEOUT_S
from learner.verify import Rescorer, Verdict
from scheduler.providers import machine_token

TOKEN = "run-token-0123456789"
MACHINE_KEY = "machine-key-of-this-run-0123456789"  # the learner's secret: no worker holds it


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


class Api:
    """A learner's control API on loopback, and raw HTTP calls to it."""

    def __init__(self, state: SimpleNamespace, url: str, session: aiohttp.ClientSession):
        self.state, self.url, self.session = state, url, session

    async def call(self, path: str, body=None, token: str | None = TOKEN, raw: bytes | None = None,
                   content_type: str = "application/json", headers: dict | None = None) -> tuple[int, dict, dict]:
        headers = {"Content-Type": content_type, **(headers or {})}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = raw if raw is not None else json.dumps(body if body is not None else {}).encode()
        async with self.session.post(self.url + path, data=data, headers=headers) as resp:
            try:
                payload = await resp.json()
            except (aiohttp.ContentTypeError, ValueError):
                payload = {"text": await resp.text()}
            return resp.status, payload, dict(resp.headers)

    async def join(self, name: str, **report) -> tuple[str, str]:
        status, body, _ = await self.call("/v1/join", {"name": name, **report})
        assert status == 200, body
        return body["worker_id"], body["credential"]

    async def upload(self, cred: str, sub: Submission) -> tuple[int, dict]:
        status, body, _ = await self.call("/v1/trajectories", token=cred, raw=encode_submission(sub),
                                          content_type=CONTENT_TYPE)
        return status, body

    def metric(self, line: str) -> float:
        text = self.state.metrics.exposition().decode()
        return next((float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def run_api(tokenizer, test, tmp_path, evals=None, encode=None, task_dirs=None, lora=None, rollout=None, **overrides):
    """Serve the control API with `overrides` ({"section.key": value}) and run `test(api)`;
    `evals`: an `EvalBook` the workers answer, each finished round appended to `api.state.results`;
    `encode`: a prompt's token ids (default: the tokenizer's); `task_dirs`: the task's model
    directories; `lora`: LoRA mode (`P.LoraInfo`), where /v1/model serves the base's weights;
    `rollout`: the `P.RolloutParams` workers are told (default: the config's, answers sent)."""
    # Wrong tokens answered at once, unless a test asks otherwise: what is refused is asserted
    # here, how late in `test_a_wrong_credential_is_answered_late_and_holds_up_nobody_else`.
    overrides.setdefault("server.auth_failure_delay_s", 0.0)
    args = [a for k, v in overrides.items() for a in (f"--{k}", json.dumps(v) if not isinstance(v, str) else v)]
    cfg = load_config(LearnerConfig, None, ["--server.token", TOKEN, "--rollout.group_size", "4",
                                            "--rollout.max_new_tokens", "8", *args])
    task = load_task("arith", {})

    async def main():
        leases = LeaseBook(task.train_prompts(0), cfg.server.lease_ttl, cfg.server.max_inflight_prompts or 64,
                           per_worker=WorkerCap.of(cfg.server))
        buffer = AsyncBuffer(StalenessBuffer.from_section(cfg.buffer, cfg.trainer.batch_prompts,
                                                          on_drop=lambda g, why: leases.recycle(g.prompt)))
        (tmp_path / "config.json").write_text("{}")
        run = Run(BlobStore(keep=cfg.publish.keep))
        results = []
        waiters = Waiters()  # the learner's, shared with what wakes them (serve.py: an eval round opening)
        control = ControlApi(cfg, TOKEN, run=run, buffer=buffer, lease_book=leases, waiters=waiters,
                             encode=encode or (lambda prompt: tokenizer(prompt.text)["input_ids"]), vocab_size=len(tokenizer),
                             model_dir=tmp_path, rescore=Rescorer(task, tokenizer, cfg.verify.reward_tolerance),
                             evals=evals, on_eval=results.append, machine_key=MACHINE_KEY, task_dirs=task_dirs,
                             lora=lora, rollout=rollout)
        # What the tests look at: the parts the API was built from.
        state = SimpleNamespace(leases=leases, buffer=buffer, workers=control.registry.workers, evals=evals,
                                verifier=control.verifier, metrics=control.metrics, waiters=waiters,
                                results=results, run=run, links=control.links, eval_room=control.evals,
                                registry=control.registry, status_room=control.status, lease_room=control.leases)
        run.blobs.add(0, b"weights")
        run.announcement = P.Announcement(version=0)
        runner = control.runner()
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with aiohttp.ClientSession() as session:
                await test(Api(state, url, session))
        finally:
            await runner.cleanup()
            control.close()

    asyncio.run(main())


def group(tokenizer, prompt_id: str, texts: list[str], reward: float, logprob: float = -0.5, version: int = 0):
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return GroupMsg(prompt_id, version, [SampleMsg(i, [logprob] * len(i), reward) for i in ids])


def test_a_worker_cannot_upload_into_another_workers_lease_or_as_another_worker(tokenizer, tmp_path):
    async def test(api: Api):
        a, cred_a = await api.join("a")
        b, cred_b = await api.join("b")
        assert a != b and cred_a != cred_b
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 2}, token=cred_a)
        assert status == 200 and lease["lease_id"]
        ids = [p["id"] for p in lease["prompts"]]
        honest = [group(tokenizer, i, ["9"] * 4, 0.0) for i in ids]
        # b, holding no lease at all: refused before its body is read or decoded.
        status, body = await api.upload(cred_b, Submission(b, lease["lease_id"], honest))
        assert (status, body["error"]) == (409, "unknown-lease") and "holds no outstanding lease" in body["message"]
        # b, with a lease of its own (as many prompts, so the upload is within what b holds), into
        # a's lease: the lease is not b's.
        status, _, _ = await api.call("/v1/lease", {"max_prompts": 2}, token=cred_b)
        status, body = await api.upload(cred_b, Submission(b, lease["lease_id"], honest))
        assert (status, body["error"]) == (409, "unknown-lease") and "another worker's" in body["message"]
        # b naming a in the upload: the credential decides who is speaking.
        status, body = await api.upload(cred_b, Submission(a, lease["lease_id"], honest))
        assert (status, body["error"]) == (403, "impersonation")
        # b handing a's lease back: refused, a's lease is intact.
        status, body, _ = await api.call("/v1/release", {"lease_id": lease["lease_id"]}, token=cred_b)
        assert status == 409
        assert api.state.leases.outstanding_by_worker() == {a: 2, b: 2}
        assert api.state.buffer.buffer.stats.accepted == 0
        # a itself: accepted.
        status, body = await api.upload(cred_a, Submission(a, lease["lease_id"], honest))
        assert (status, body["accepted"]) == (200, 2)

    run_api(tokenizer, test, tmp_path)


def test_heartbeats_need_the_workers_own_credential(tokenizer, tmp_path):
    async def test(api: Api):
        a, cred_a = await api.join("a")
        forged = f"{a}.not-the-secret"
        for token in (forged, TOKEN, None, a):  # a guessed secret, the shared run token, nothing, the bare id
            status, body, _ = await api.call("/v1/heartbeat", {"capacity_per_s": 1e6}, token=token)
            assert status == 401, (token, body)
        status, body, _ = await api.call("/v1/heartbeat", {"capacity_per_s": 1e6}, token=forged)
        assert body["error"] == "unknown-credential" and "join again" in body["message"]
        assert api.state.workers[a].claimed_capacity_per_s == 0.0  # nothing of the forgeries was stored
        assert api.metric('echo_auth_refused_total{credential="credential"}') >= 3

    run_api(tokenizer, test, tmp_path)


def test_forged_measurements_are_capped_at_what_the_learner_measured(tokenizer, tmp_path):
    async def test(api: Api):
        a, cred = await api.join("a")
        status, body, _ = await api.call("/v1/heartbeat", {"upload_mbit": 1e6}, token=cred)
        assert status == 400 and "upload_mbit" in body["message"]  # beyond any rented link
        status, body, _ = await api.call("/v1/heartbeat", {"capacity_per_s": 1e9}, token=cred)
        assert status == 400 and "capacity_per_s" in body["message"]
        # A plausible-looking claim before any work came back is not believed at all.
        status, _, _ = await api.call("/v1/heartbeat", {"capacity_per_s": 1e6}, token=cred)
        w = api.state.workers[a]
        assert status == 200 and w.claimed_capacity_per_s == 1e6 and w.capacity_per_s == 0.0
        # One lease of 2 prompts × 4 samples came back: the claim is capped at 2× that rate.
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 2}, token=cred)
        await asyncio.sleep(0.2)
        status, _ = await api.upload(cred, Submission(a, lease["lease_id"],
                                                      [group(tokenizer, p["id"], ["9"] * 4, 0.0) for p in lease["prompts"]]))
        assert status == 200
        await api.call("/v1/heartbeat", {"capacity_per_s": 1e6}, token=cred)
        measured = api.state.verifier.evidence[a].lease_rate
        assert 0 < measured <= 8 / 0.2 and w.capacity_per_s == pytest.approx(2 * measured)
        # An honest claim below the cap stands.
        await api.call("/v1/heartbeat", {"capacity_per_s": measured}, token=cred)
        assert w.capacity_per_s == measured
        # A relay's own upload measurement is capped by what its children saw from it (a child
        # whose work was accepted: a fresh identity's word is no evidence).
        b, cred_b = await api.join("b")
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=cred_b)
        status, _ = await api.upload(cred_b, Submission(b, lease["lease_id"],
                                                        [group(tokenizer, p["id"], ["9"] * 4, 0.0) for p in lease["prompts"]]))
        assert status == 200
        await api.call("/v1/heartbeat", {"links": [{"key": "v1", "down": 1e6, "parent": a}]}, token=cred_b)
        await api.call("/v1/heartbeat", {"links": [{"key": "v1", "up": 1e10}]}, token=cred)
        assert api.metric('echo_verify_claims_clamped_total{what="upload"}') == 1
        assert api.metric('echo_verify_claims_clamped_total{what="capacity"}') >= 2

    run_api(tokenizer, test, tmp_path)


def test_fabricated_rewards_are_recomputed_and_the_worker_quarantined(tokenizer, tmp_path):
    async def test(api: Api):
        honest, cred_h = await api.join("honest")
        cheat, cred_c = await api.join("cheat")
        state = api.state
        # The honest worker: wrong answers scored 0, right ones 1, as the task says.
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=cred_h)
        prompt = lease["prompts"][0]
        right = prompt["answer"]  # a real worker would have to work it out
        g = group(tokenizer, prompt["id"], [right, right, "x", "x"], 0.0)
        g.samples[0].reward = g.samples[1].reward = 1.0
        status, body = await api.upload(cred_h, Submission(honest, lease["lease_id"], [g]))
        assert status == 200 and body["accepted"] == 1, body
        # The cheat claims reward 1 for nonsense, four groups of four samples (min_checked 16).
        accepted = 0
        for _ in range(4):
            status, lease, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=cred_c)
            if status != 200 or not lease["lease_id"]:
                break
            status, body = await api.upload(cred_c, Submission(cheat, lease["lease_id"],
                                                               [group(tokenizer, lease["prompts"][0]["id"], ["zz"] * 4, 1.0)]))
            accepted += body.get("accepted", 0)
        assert (status, body["error"]) == (403, "quarantined") and "rewards differ" in body["message"]
        queued = list(state.buffer.buffer._queue)
        assert [g.worker_id for g in queued] == [honest] and queued[0].rewards == [1.0, 1.0, 0.0, 0.0]
        assert state.buffer.buffer.stats.dropped_untrusted == accepted  # its earlier groups left the buffer
        assert state.leases.stats.dropped_reissued == accepted + 1  # and every prompt of it goes out again
        # Told why, on every call; listed in status; counted.
        status, hb, _ = await api.call("/v1/heartbeat", {}, token=cred_c)
        assert hb["state"] == "quarantined" and "rewards differ" in hb["message"]
        status, body, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=cred_c)
        assert (status, body["error"]) == (403, "quarantined")
        assert api.metric('echo_workers_quarantined_total{reason="rewards"}') == 1
        assert api.metric("echo_verify_rewards_mismatched_total") == 16
        async with api.session.get(api.url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            listed = (await resp.json())["quarantined"]
        assert [q["id"] for q in listed] == [cheat] and "rewards differ" in listed[0]["why"]
        # Any other run-token holder sees the reason code, not the evidence the message quotes
        view = json.loads(api.state.status_room.status_json(False))
        assert [(q["id"], q["reason"]) for q in view["quarantined"]] == [(cheat, "rewards")]
        assert "why" not in view["quarantined"][0] and "differ" not in json.dumps(view)
        assert next(w["quarantined"] for w in view["workers"] if w["id"] == cheat) == "rewards"
        # Nor does it come back under a new identity from the same address.
        status, body, _ = await api.call("/v1/join", {"name": "cheat-again"})
        assert (status, body["error"]) == (403, "banned") and "rewards differ" in body["message"]

    run_api(tokenizer, test, tmp_path)


def test_a_one_turn_task_the_learner_scores_itself_sends_no_answers_and_believes_no_reward(tokenizer, tmp_path):
    """Where the learner scores every group itself (a one-turn task, rescore_fraction 1: the
    default), training leases carry no answers: a worker holding them could send, of many
    samples, those the rewards favour, or right answers it never sampled, and tell which of
    its samples are right without solving anything. Its rewards then say nothing: a worker's
    claim is neither trained on nor evidence. Before, every training lease carried its answer."""
    rollout = P.RolloutParams(group_size=4, max_new_tokens=8, max_tokens=8, temperature=1.0, top_p=1.0,
                              scored_by_learner=True)

    async def test(api: Api):
        honest, cred_h = await api.join("honest")
        cheat, cred_c = await api.join("cheat")
        for cred, wid, claim in [(cred_h, honest, 0.0)] * 5 + [(cred_c, cheat, 1.0)] * 5:
            status, lease, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=cred)
            assert status == 200 and lease["lease_id"], lease
            prompt = lease["prompts"][0]
            assert prompt["answer"] == ""
            right = str(eval(prompt["text"].rstrip("=")))  # noqa: S307 (the task's own sums): a worker must solve it
            g = group(tokenizer, prompt["id"], [right, right, "x", "x"], claim)  # honest: 0, not knowing
            status, body = await api.upload(cred, Submission(wid, lease["lease_id"], [g]))
            assert status == 200 and body["accepted"] == 1, body
        queued = list(api.state.buffer.buffer._queue)
        assert len(queued) == 10 and all(g.rewards == [1.0, 1.0, 0.0, 0.0] for g in queued)  # the learner's, both
        assert not any(w.quarantined for w in api.state.workers.values())  # 20 claims apart: not evidence
        assert api.metric("echo_verify_rewards_mismatched_total") == 0

    run_api(tokenizer, test, tmp_path, rollout=rollout)


def test_a_statistical_verdict_quarantines_the_worker_and_holds_its_address_back_but_bans_it_not(tokenizer, tmp_path):
    """The tokens' z is a finding an honest worker can draw by bad luck: a lone honest worker was
    once quarantined by it and banned with its address for an hour, and with it every honest
    worker behind the same NAT. It quarantines the worker; only a certain verdict bans. But a
    chooser it caught joined again at once, eleven identities in 150 s from one address (a
    tester, 2026-11-29): the address's next identity now waits `hold_s`, told when to retry."""
    from learner.verify import Verdict

    async def test(api: Api):
        registry = api.state.registry
        unlucky, cred = await api.join("unlucky")
        registry.quarantine(registry.workers[unlucky], Verdict(unlucky, "tokens", "ranks +8.2 sd", certain=False))
        status, body, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=cred)
        assert (status, body["error"]) == (403, "quarantined")
        status, body, headers = await api.call("/v1/join", {"name": "neighbour"})
        assert (status, body["error"]) == (429, "held") and "ranks +8.2 sd" in body["message"]
        assert 1 <= int(headers["Retry-After"]) <= 2
        await asyncio.sleep(float(headers["Retry-After"]))
        neighbour, _ = await api.join("neighbour")  # the same address: welcome once the hold is over
        registry.quarantine(registry.workers[neighbour], Verdict(neighbour, "rewards", "rewards differ"))
        status, body, _ = await api.call("/v1/join", {"name": "neighbour-again"})
        assert (status, body["error"]) == (403, "banned") and "rewards differ" in body["message"]

    run_api(tokenizer, test, tmp_path, **{"server.hold_s": 1.5})


async def expecting_continue(api: Api, path: str, cred: str, content_type: str, length: int):
    """Send a POST's headers alone, with `Expect: 100-continue`; (reader, writer, the first reply line)."""
    from urllib.parse import urlsplit

    url = urlsplit(api.url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write((f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {cred}\r\n"
                  f"Content-Type: {content_type}\r\nContent-Length: {length}\r\n"
                  "Expect: 100-continue\r\n\r\n").encode())
    await writer.drain()
    return reader, writer, (await asyncio.wait_for(reader.readline(), 5)).decode()


def test_an_upload_that_expects_100_continue_is_invited_only_once_admitted(tokenizer, tmp_path):
    """aiohttp answered `Expect: 100-continue` before any handler ran, so a worker holding no
    lease was invited to send its body, which was then refused. Now the lease and the bounds
    are checked first: a refusal comes instead of the invitation, an admitted upload is invited."""
    async def send_headers(api: Api, cred: str, body: bytes):
        return await expecting_continue(api, "/v1/trajectories", cred, CONTENT_TYPE, len(body))

    async def test(api: Api):
        w, cred = await api.join("w")
        body = b"x" * 1000
        reader, writer, first = await send_headers(api, cred, body)
        assert first.startswith("HTTP/1.1 409"), first  # no lease: refused, never invited
        writer.close()
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=cred)
        g = group(tokenizer, lease["prompts"][0]["id"], ["1", "2", "3", "4"], 0.0)
        body = encode_submission(Submission(w, lease["lease_id"], [g]))
        reader, writer, first = await send_headers(api, cred, body)
        assert first.startswith("HTTP/1.1 100"), first
        await reader.readline()  # the blank line ending the interim response
        writer.write(body)
        await writer.drain()
        final = (await asyncio.wait_for(reader.readline(), 5)).decode()
        writer.close()
        assert final.startswith("HTTP/1.1 200"), final

    run_api(tokenizer, test, tmp_path)


def test_a_json_body_that_expects_100_continue_is_invited_only_within_its_bound(tokenizer, tmp_path):
    """The JSON routes answered `100 Continue` before the declared length was checked (a 3 MB
    heartbeat was invited, then refused); and before the credential was."""
    async def test(api: Api):
        _, cred = await api.join("w")
        for path, length, expected in [("/v1/heartbeat", 3_000_000, "413"), ("/v1/join", 300_000, "413"),
                                       ("/v1/heartbeat", 2, "100"), ("/v1/lease", 2, "100"),
                                       ("/v1/heartbeat", 2, "401")]:
            who = "w9.wrong" if expected == "401" else TOKEN if path == "/v1/join" else cred
            _, writer, line = await expecting_continue(api, path, who, "application/json", length)
            writer.close()
            assert line.startswith(f"HTTP/1.1 {expected}"), (path, length, line)

    run_api(tokenizer, test, tmp_path)


def test_a_parked_worker_is_told_to_install_the_version_an_eval_round_wants(tokenizer, tmp_path):
    """Training over, a worker's lease request parked on v0 when the last version's eval round
    opened: woken, it got no eval lease (it held v0) and parked again for the whole long poll
    (10 s), since a worker installs only between requests: 8 of 22 final evals took 9-10 s."""
    from learner.evals import EvalBook

    prompts = load_task("arith", {}).eval_prompts()[:8]

    async def test(api: Api):
        state = api.state
        state.run.training_done = True  # nothing to generate: a request parks
        _, cred = await api.join("w")
        parked = asyncio.create_task(api.call("/v1/lease", {"max_prompts": 4, "version": 0, "wait_s": 30}, token=cred))
        await asyncio.sleep(0.3)
        state.run.blobs.add(1, b"weights-1")
        state.evals.open(1, time.monotonic())
        state.waiters.wake_all()  # what opening a round does (serve.py hands the evaluation this, not the room)
        status, reply, _ = await parked
        assert status == 200 and reply["empty"] == "install" and reply["waited_s"] < 2.0, reply
        status, reply, _ = await api.call("/v1/lease", {"max_prompts": 1, "version": 1}, token=cred)
        assert reply["eval_version"] == 1 and len(reply["prompts"]) == 1  # installed: its eval lease, of its size

    run_api(tokenizer, test, tmp_path, evals=EvalBook(prompts, 30.0, 4), **{"server.long_poll_s": 20.0})


def test_a_worker_made_too_stale_by_a_step_hears_of_its_successor_when_published(tokenizer, tmp_path):
    """S = 0: a step makes every worker's version too stale to lease with. Its lease request was
    answered `install` at once with the announcement it already had (the new version was still
    being published), so a star worker heard of the new version at its next heartbeat: every
    synchronous step took a heartbeat interval, 2 s (a new user, 2026-12-07). It is held until
    the successor is announced, and answered with it then."""
    async def test(api: Api):
        state = api.state
        _, cred = await api.join("w")
        state.run.version = 1  # v0's batch trained: v0 cannot be leased with at S = 0
        parked = asyncio.create_task(api.call("/v1/lease", {"max_prompts": 4, "version": 0, "wait_s": 30}, token=cred))
        await asyncio.sleep(0.5)
        assert not parked.done()  # nothing newer to install yet
        state.run.blobs.add(1, b"weights-1")
        state.run.announcement = P.Announcement(version=1, size=9, sha256="0" * 64)
        t0 = time.monotonic()
        state.lease_room.published()
        status, reply, _ = await parked
        assert status == 200 and reply["empty"] == "install" and reply["snapshot"]["version"] == 1, reply
        assert time.monotonic() - t0 < 1.0
        # Already announced: answered at once
        status, reply, _ = await api.call("/v1/lease", {"max_prompts": 4, "version": 0, "wait_s": 30}, token=cred)
        assert reply["empty"] == "install" and reply["waited_s"] < 0.5, reply

    run_api(tokenizer, test, tmp_path, **{"buffer.max_staleness": 0, "server.long_poll_s": 20.0})


def test_a_synchronous_batch_leases_an_overdue_leases_room_again(tokenizer, tmp_path):
    """S = 0 leases only what the batch needs, so a fresh identity that leased and never answered
    held every step for its lease's TTL (20 s): 26 steps in 30 s became 2, one identity beside an
    honest worker (an API-only tester, 2026-12-07). A lease out 3 of the fleet's median turnarounds
    is overdue: its room is leased to others, as a straggler's task is run again elsewhere."""
    from learner.leases import OVERDUE_TURNAROUNDS

    async def test(api: Api):
        state = api.state
        honest_id, honest = await api.join("honest")
        _, hoarder = await api.join("hoarder")
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 2, "version": 0}, token=honest)
        sub = Submission(honest_id, lease["lease_id"], [group(tokenizer, p["id"], ["1", "2", "3", "4"], 0.0)
                                                    for p in lease["prompts"]])
        status, body = await api.upload(honest, sub)
        assert status == 200, body  # 2 queued: the batch of 4 needs 2 more
        median = state.leases.median_turnaround
        status, held, _ = await api.call("/v1/lease", {"max_prompts": 2, "version": 0}, token=hoarder)
        assert len(held["prompts"]) == 2  # and never answered
        asked = asyncio.create_task(api.call("/v1/lease", {"max_prompts": 2, "version": 0, "wait_s": 15}, token=honest))
        await asyncio.sleep(OVERDUE_TURNAROUNDS * median + 0.3)
        t0 = time.monotonic()
        state.lease_room.reap(time.monotonic())  # the reaper's round, once a second
        status, backup, _ = await asyncio.wait_for(asked, 5)
        assert status == 200 and len(backup["prompts"]) == len(held["prompts"]), backup
        assert time.monotonic() - t0 < 1.0 and state.leases.outstanding == 2 * len(held["prompts"])

    run_api(tokenizer, test, tmp_path, **{"buffer.max_staleness": 0, "trainer.batch_prompts": 4,
                                          "server.long_poll_s": 20.0})


def test_workers_waiting_to_install_do_not_pass_room_between_them(tokenizer, tmp_path):
    """Held until the successor is announced, a worker too stale to lease was woken by every
    freed room, could not use it, and handed it on: two such requests passed it between them,
    a busy loop for as long as the publication took. They are woken by a version, not by room."""
    async def test(api: Api):
        state = api.state
        creds = [(await api.join(f"w{i}"))[1] for i in range(2)]
        state.run.version = 1  # v0's batch trained: v0 cannot be leased with at S = 0; v1 not announced
        parked = [asyncio.create_task(api.call("/v1/lease", {"max_prompts": 4, "version": 0, "wait_s": 30}, token=c))
                  for c in creds]
        await asyncio.sleep(0.3)
        assert state.lease_room.room() > 0  # the batch of v1 needs prompts
        cpu = time.process_time()
        state.waiters.wake(1)
        await asyncio.sleep(1.0)
        assert time.process_time() - cpu < 0.3 and not any(t.done() for t in parked)
        state.run.blobs.add(1, b"weights-1")
        state.run.announcement = P.Announcement(version=1, size=9, sha256="0" * 64)
        state.lease_room.published()
        for task in parked:
            status, reply, _ = await task
            assert reply["empty"] == "install" and reply["snapshot"]["version"] == 1, reply

    run_api(tokenizer, test, tmp_path, **{"buffer.max_staleness": 0, "server.long_poll_s": 20.0})


def test_a_synchronous_batch_counts_the_groups_being_checked_as_coming(tokenizer, tmp_path, monkeypatch):
    """S = 0 leases no more prompts than the batch still needs. An upload's leases closed before
    its rewards were checked (off the loop), its groups not yet queued: for that while they
    counted nowhere, other workers were leased the same room, and the run generated groups past
    its batch that were refused stale or dropped (68-92 of 640 in a 40-step demo at S = 0; found
    with a new user's report that S = 0 wasted work, 2026-12-07)."""
    import threading

    checked = threading.Event()
    rescore = Rescorer.__call__

    def slow_rescore(self, groups):
        checked.wait(5)  # held until the test has asked for a lease meanwhile
        return rescore(self, groups)

    monkeypatch.setattr(Rescorer, "__call__", slow_rescore)

    async def test(api: Api):
        first_id, first = await api.join("first")
        _, second = await api.join("second")
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 2, "version": 0}, token=first)
        assert status == 200 and len(lease["prompts"]) == 2  # the whole batch
        sub = Submission(first_id, lease["lease_id"], [group(tokenizer, p["id"], ["1", "2", "3", "4"], 0.0)
                                                       for p in lease["prompts"]])
        uploading = asyncio.create_task(api.upload(first, sub))
        await asyncio.sleep(0.3)  # admitted, its rewards being checked
        status, other, _ = await api.call("/v1/lease", {"max_prompts": 2, "version": 0, "wait_s": 0.5}, token=second)
        checked.set()
        assert status == 200 and not other.get("prompts"), other  # the batch is coming: nothing to lease
        status, body = await uploading
        assert status == 200 and body["accepted"] == 2, body
        assert api.state.leases.outstanding == 0

    run_api(tokenizer, test, tmp_path, **{"buffer.max_staleness": 0, "trainer.batch_prompts": 2,
                                          "verify.rescore_fraction": 1.0})


def test_eval_answers_are_scored_by_the_learner_not_taken_from_the_worker(tokenizer, tmp_path):
    """Eval leases carry no answers (a worker holding them could return them as its model's), and
    the rewards a worker sends are not read: the learner scores the completions itself."""
    from learner.evals import EvalBook

    prompts = load_task("arith", {}).eval_prompts()[:8]
    truth = {p.id: p.answer for p in prompts}

    async def test(api: Api):
        state = api.state
        results = state.results
        state.evals.open(0, time.monotonic())
        liar, cred = await api.join("liar")
        honest, cred_h = await api.join("honest")

        async def answer(token, right: bool, claim: float):
            status, lease, _ = await api.call("/v1/lease", {"max_prompts": 4, "version": 0}, token=token)
            assert lease["eval_version"] == 0
            assert all(p["answer"] == "" for p in lease["prompts"])  # nothing to copy
            ids = {p["id"]: tokenizer(truth[p["id"]] if right else "+", add_special_tokens=False)["input_ids"]
                   for p in lease["prompts"]}
            return await api.call("/v1/eval", {"lease_id": lease["lease_id"], "version": 0, "completions": ids,
                                               "rewards": {k: claim for k in ids}}, token=token)

        status, body, _ = await answer(cred, right=False, claim=1.0)  # wrong answers, claimed right
        assert status == 200
        status, body, _ = await answer(cred_h, right=True, claim=0.0)  # right answers, claimed wrong
        assert status == 200
        # The round counts what the learner scored: half the answers were wrong, whatever was claimed.
        assert [r.accuracy for r in results] == [0.5]
        # Without completions there is nothing to score: refused.
        state.run.blobs.add(1, b"weights-1")  # a round opens at a published version, which workers can hold
        state.evals.open(1, time.monotonic())
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 4, "version": 1}, token=cred_h)
        status, body, _ = await api.call("/v1/eval", {"lease_id": lease["lease_id"], "version": 1,
                                                      "rewards": {p["id"]: 1.0 for p in lease["prompts"]}}, token=cred_h)
        assert (status, body["error"]) == (422, "wrong-prompts")
        # Answers for a lease it was never given cost the learner nothing: refused before any scoring.
        scored = []
        room = state.eval_room
        real = room.rescore
        room.rescore = SimpleNamespace(score=lambda pairs: scored.append(len(pairs)) or real.score(pairs))
        every = {p.id: [5, 6] for p in prompts}
        status, body, _ = await api.call("/v1/eval", {"lease_id": "E999-0000", "version": 1, "completions": every,
                                                      "rewards": {k: 0.0 for k in every}}, token=cred)
        assert (status, body["error"], scored) == (409, "unknown-lease", [])

    run_api(tokenizer, test, tmp_path, evals=EvalBook(prompts, 30.0, 4))


def test_once_the_run_has_work_eval_leases_go_only_to_workers_that_delivered_some(tokenizer, tmp_path):
    """An identity that joined, released every training lease and took eval leases to sit on
    held every eval round up (an API-only tester, 2026-11-30). Before any group was accepted
    (the run's first round) anyone on the version may answer; after, only a worker whose own
    training groups were accepted."""
    from learner.evals import EvalBook

    prompts = load_task("arith", {}).eval_prompts()[:8]

    async def test(api: Api):
        state = api.state
        state.run.blobs.add(1, b"weights-1")
        worker, cred = await api.join("worker")
        _, fresh = await api.join("fresh")
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 2, "version": 0}, token=cred)
        assert status == 200 and lease["lease_id"] and lease["eval_version"] is None
        groups = [group(tokenizer, p["id"], ["9", "8", "7", "6"], 0.0) for p in lease["prompts"]]
        status, body = await api.upload(cred, Submission(worker, lease["lease_id"], groups))
        assert (status, body["accepted"]) == (200, 2)
        state.evals.open(1, time.monotonic())
        status, reply, _ = await api.call("/v1/lease", {"max_prompts": 4, "version": 1, "wait_s": 0.2}, token=fresh)
        assert status == 200 and reply["eval_version"] is None, reply  # the fresh identity: none
        status, reply, _ = await api.call("/v1/lease", {"max_prompts": 4, "version": 1}, token=cred)
        assert reply["eval_version"] == 1 and len(reply["prompts"]) == 4

    run_api(tokenizer, test, tmp_path, evals=EvalBook(prompts, 30.0, 4))


def test_oversized_and_unknown_fields_are_refused_and_not_stored(tokenizer, tmp_path):
    async def test(api: Api):
        a, cred = await api.join("a")
        status, body, _ = await api.call("/v1/heartbeat", raw=json.dumps({"gpu": "x" * (5 << 20)}).encode(), token=cred)
        assert status == 413 and body["error"] == "oversized"
        status, body, _ = await api.call("/v1/heartbeat", {"gpu": "x" * 65}, token=cred)
        assert status == 400 and "gpu" in body["message"] and "64 characters" in body["message"]
        status, body, _ = await api.call("/v1/heartbeat", {"worker_id": "w9", "extra": 1}, token=cred)
        assert status == 400 and "Extra inputs are not permitted" in body["message"]
        status, body, _ = await api.call("/v1/heartbeat", {"installs": [{"version": 1, "installed_ago": 0,
                                                                          "received_ago": 0, "install_s": 0}] * 65},
                                         token=cred)
        assert status == 400 and "installs" in body["message"]
        # A report past its own limit (40 KiB) is not parsed: 240 KiB of installs cost 6.8 ms each.
        many = {"installs": [{"version": 1, "installed_ago": 0, "received_ago": 0, "install_s": 0}] * 3000}
        status, body, _ = await api.call("/v1/heartbeat", many, token=cred)
        assert (status, body["error"]) == (413, "oversized")
        status, body, _ = await api.call("/v1/join", {"name": "n" * 65})
        assert status == 400
        status, body, _ = await api.call("/v1/lease", {"max_prompts": 10**9}, token=cred)
        assert status == 400 and "max_prompts" in body["message"]
        assert api.state.workers[a].gpu == "" and len(api.state.workers) == 1
        status, body, _ = await api.call("/v1/heartbeat", raw=b"not json", token=cred)
        assert status == 400 and body["error"] == "bad-request"

    run_api(tokenizer, test, tmp_path)


def test_join_floods_are_rate_limited_and_the_fleet_is_bounded(tokenizer, tmp_path):
    async def test(api: Api):
        replies = [await api.call("/v1/join", {"name": f"j{i}"}) for i in range(40)]
        statuses = [r[0] for r in replies]
        assert statuses[:10] == [200] * 10  # the burst
        limited = [r for r in replies if r[0] == 429]
        assert limited and all(int(r[2]["Retry-After"]) >= 1 and r[1]["error"] == "join-rate" for r in limited)
        assert len(api.state.workers) == statuses.count(200) <= 12
        await asyncio.sleep(1.2)  # the bucket refills; the fleet cap still holds
        while len(api.state.workers) < 12:
            if (await api.call("/v1/join", {"name": "more"}))[0] != 200:
                await asyncio.sleep(0.2)
        status, body, headers = await api.call("/v1/join", {"name": "one-too-many"})
        assert (status, body["error"]) == (503, "fleet-full") and "Retry-After" in headers
        assert api.metric('echo_joins_refused_total{reason="rate"}') == len(limited)

    run_api(tokenizer, test, tmp_path, **{"server.join_rate": 5.0, "server.join_burst": 10, "server.max_workers": 12})


def test_joins_from_outside_the_allowed_networks_are_refused(tokenizer, tmp_path):
    async def test(api: Api):
        status, body, _ = await api.call("/v1/join", {"name": "far"})
        assert (status, body["error"]) == (403, "network") and "127.0.0.1" in body["message"]
        assert not api.state.workers

    run_api(tokenizer, test, tmp_path, **{"server.allow_networks": ["10.0.0.0/8"]})


def test_a_long_polled_lease_is_served_the_moment_room_frees_up(tokenizer, tmp_path):
    async def test(api: Api):
        a, cred_a = await api.join("a")
        status, held, _ = await api.call("/v1/lease", {"max_prompts": 4}, token=cred_a)  # all the room there is
        assert len(held["prompts"]) == 4  # alone: a newcomer's share is all of it
        b, cred_b = await api.join("b")
        t0 = time.monotonic()
        waiting = asyncio.create_task(api.call("/v1/lease", {"max_prompts": 2, "wait_s": 30}, token=cred_b))
        await asyncio.sleep(0.5)
        assert not waiting.done() and len(api.state.waiters) == 1  # held, not answered "nothing"
        await api.call("/v1/release", {"lease_id": held["lease_id"]}, token=cred_a)
        status, got, _ = await asyncio.wait_for(waiting, 10)
        assert status == 200 and len(got["prompts"]) == 2 and time.monotonic() - t0 < 10
        # With nothing freed, the poll ends empty-handed at its own deadline.
        status, empty, _ = await api.call("/v1/lease", {"max_prompts": 4, "wait_s": 0.3}, token=cred_a)
        status, empty, _ = await api.call("/v1/lease", {"max_prompts": 4, "wait_s": 0.3}, token=cred_a)
        assert status == 200 and empty["lease_id"] is None and empty["empty"] == "wait"

    run_api(tokenizer, test, tmp_path, **{"server.max_inflight_prompts": 4})


def test_prompts_are_encoded_off_the_loop_before_their_leases_ask(tokenizer, tmp_path):
    """Rendering a prompt (a chat template, an environment's reset) takes milliseconds: on the
    loop, every parked request waited through each lease's. They are encoded on a thread of their
    own, the next batch's before any worker asks for it."""
    encoded = []  # (thread, prompt id)

    def encode(prompt):
        encoded.append((threading.current_thread().name, prompt.id))
        time.sleep(0.02)  # a chat template's rendering, slowed: the first lease asks while its prompts are on the thread
        return tokenizer(prompt.text)["input_ids"]

    async def test(api: Api):
        room, book = api.state.lease_room, api.state.leases
        _, cred = await api.join("w")
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 3}, token=cred)
        assert status == 200 and [p["prompt_ids"] for p in lease["prompts"]] == [
            tokenizer(p["text"])["input_ids"] for p in lease["prompts"]]
        deadline = time.monotonic() + 5
        while any(p.id not in room._token_ids for p in book.upcoming(8)) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        upcoming = book.upcoming(8)
        assert all(p.id in room._token_ids for p in upcoming)  # the next batch, before anyone asked
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 3}, token=cred)
        assert [p["id"] for p in lease["prompts"]] == [p.id for p in upcoming[:3]]
        ids = [i for _, i in encoded]
        assert len(ids) >= 11 and len(set(ids)) == len(ids)  # each once
        assert {t.split("_")[0] for t, _ in encoded} == {"encode"}  # never the loop's thread

    run_api(tokenizer, test, tmp_path, encode=encode, **{"trainer.batch_prompts": 8, "server.lease_first_prompts": 8})


def test_ledger_replay_reissues_in_flight_and_rolled_back_prompts(tmp_path):
    from echo.tasks import Prompt
    from learner.ledger import Ledger

    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    ps = [Prompt(f"p{i}", f"{i}+1=", str(i + 1)) for i in range(6)]
    ledger.published(0)
    ledger.leased(ps[:4])
    ledger.trained(1, ["p0"])
    ledger.published(1)
    ledger.trained(2, ["p1"])  # after the checkpoint of update 1: rolled back by the crash
    ledger.published(2)
    ledger.leased(ps[4:])
    ledger.close()
    with path.open("a") as f:
        f.write('{"e":"T","s":3,"p":["p2"')  # the line a kill -9 cut short
    rec = Ledger.replay(path, checkpoint_step=1)
    assert [p.id for p in rec.pending] == ["p1", "p2", "p3", "p4", "p5"]
    assert (rec.newest_published, rec.starts, rec.trained_rolled_back) == (2, 1, 1)
    # A second crash: the first resume rolled back update 2, so p1 counts only if trained again.
    ledger = Ledger(path)
    ledger.resumed(1)
    ledger.trained(3, ["p2", "p3"])
    ledger.close()
    rec = Ledger.replay(path, checkpoint_step=3)
    assert [p.id for p in rec.pending] == ["p1", "p4", "p5"] and rec.starts == 2
    with contextlib.suppress(FileNotFoundError):
        assert Ledger.replay(tmp_path / "none.jsonl", 0).pending == []


# --- end to end, real learner and worker processes ---------------------------------------------


def _ledger(run_dir):
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines() if line.endswith("}")]


def test_a_learner_killed_mid_run_resumes_and_its_workers_rejoin_by_themselves(learner_factory):
    import signal
    import subprocess
    import sys

    from conftest import ROOT, WATCHED

    lp = learner_factory(run={"steps": 24, "checkpoint_every": 4}, buffer={"max_staleness": 2})
    # Slow enough workers that the kill lands mid-run: at 150 rollouts/s each, an update took ~30 ms
    # and the run could finish between two polls, leaving nothing to resume (CI, 2026-11-29).
    for name in ("a", "b"):
        lp.worker(name, "--worker.max_rollouts_per_s", "40")
    lp.wait_until(lambda: lp.status()["learner_version"] >= 10, 120, "ten updates")
    lp.proc.send_signal(signal.SIGKILL)
    lp.proc.wait(10)
    before = _ledger(lp.run_dir)
    newest_before = max(e["v"] for e in before if e["e"] == "P")
    assert newest_before < 20, f"the learner was killed at version {newest_before}, not mid-run"
    leased_before = {p[0] for e in before if e["e"] == "L" for p in e["p"]}

    out = open(lp.run_dir.parent / "resumed.log", "w")
    resumed = subprocess.Popen([sys.executable, "-m", "learner.main", "--resume", str(lp.run_dir), "--json"],
                               cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=WATCHED)
    try:
        assert resumed.wait(240) == 0, (lp.run_dir.parent / "resumed.log").read_text()[-3000:]
    finally:
        resumed.kill()
    logs = {name: lp.run_dir.parent.parent / f"{name}.log" for name in ("a", "b")}
    for w, name in zip(lp.workers, logs):  # the same processes, never restarted: they found the learner again
        try:
            assert w.wait(60) == 0, logs[name].read_text()[-3000:]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {name} did not leave: {logs[name].read_text()[-4000:]}") from None
    logs = [path.read_text() for path in logs.values()]
    assert all("joined" in log and "again as" in log for log in logs)
    # Their relays, started again after the rejoin, were reachable: the learner probed the old one
    # as it was stopped and planned every worker as behind NAT for a minute (a new user, 2026-12-07)
    assert not any("does not connect to this relay" in log for log in logs), logs[0][-3000:]

    events = _ledger(lp.run_dir)
    resume = next(i for i, e in enumerate(events) if e["e"] == "R")
    checkpoint = events[resume]["from"]
    assert checkpoint % 4 == 0 and 8 <= checkpoint <= newest_before
    after = events[resume + 1:]
    # Version numbers continue past everything published before the crash; the one exception is
    # the checkpoint's own version, published again with the very same weights.
    first_after = min(e["v"] for e in after if e["e"] == "P")
    assert first_after > newest_before or first_after == checkpoint == newest_before
    # What was leased before the crash and not trained by a checkpointed update went out again.
    trained_kept = {p for e in events[:resume] if e["e"] == "T" and e["s"] <= checkpoint for p in e["p"]}
    reissued = {p[0] for e in after if e["e"] == "L" for p in e["p"]} & leased_before
    assert reissued and reissued.isdisjoint(trained_kept)
    # No group is trained twice: every prompt appears in at most one surviving training event.
    surviving = [p for e in events[:resume] if e["e"] == "T" and e["s"] <= checkpoint for p in e["p"]]
    surviving += [p for e in after if e["e"] == "T" for p in e["p"]]
    assert len(surviving) == len(set(surviving))
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    assert summary["steps"] == 24
    # The run log marks the resume at the checkpoint's update (versions equalled updates before the
    # crash): what the killed process logged past it is redone after, and a reader keeps each step once.
    from echo.report import load_run

    marks = [json.loads(line) for line in (lp.run_dir / "metrics.jsonl").read_text().splitlines()
             if '"event": "resume"' in line]
    assert [(m["step"], m["checkpoint"]) for m in marks] == [(checkpoint, f"step-{checkpoint:06d}")]
    assert [r["step"] for r in load_run(lp.run_dir)[0]] == list(range(1, 25))

    # `--resume` of a finished run evaluated again, re-saved its last checkpoint and replaced its
    # summary with one of zero groups trained: it says the run is finished and how to train on,
    # and touches nothing, not even its config.toml.
    latest = (lp.run_dir / "checkpoints" / "latest").resolve()
    saved = {p: p.stat().st_mtime_ns for p in latest.rglob("*")}
    summary_bytes = (lp.run_dir / "summary.json").read_bytes()
    config_mtime = (lp.run_dir / "config.toml").stat().st_mtime_ns
    done = subprocess.run([sys.executable, "-m", "learner.main", "--resume", str(lp.run_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=WATCHED)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "already finished: 24 of 24 updates" in done.stderr and "--run.steps" in done.stderr
    assert "parameters" not in done.stdout  # said before the model loads (it printed the model's lines first)
    assert (lp.run_dir / "summary.json").read_bytes() == summary_bytes
    assert (lp.run_dir / "config.toml").stat().st_mtime_ns == config_mtime
    assert {p: p.stat().st_mtime_ns for p in latest.rglob("*")} == saved
    # An interrupted run (no summary) resumed with --run.steps at or below its checkpoint trained
    # nothing, re-saved the checkpoint and wrote a summary of zero groups and its steps into
    # config.toml (a new user, 2026-12-07): refused in one line, nothing touched.
    (lp.run_dir / "summary.json").rename(lp.run_dir / "summary.json.kept")
    done = subprocess.run([sys.executable, "-m", "learner.main", "--resume", str(lp.run_dir), "--run.steps", "20"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=WATCHED)
    assert done.returncode == 2 and "--run.steps 20 leaves nothing to train" in done.stderr, done.stderr[-3000:]
    assert "checkpoint at update 24; resume with --run.steps above 24" in done.stderr and "Traceback" not in done.stderr
    assert (lp.run_dir / "config.toml").stat().st_mtime_ns == config_mtime and not (lp.run_dir / "summary.json").exists()
    assert {p: p.stat().st_mtime_ns for p in latest.rglob("*")} == saved


def test_a_turn_whose_end_of_turn_id_was_deleted_is_refused(learner_factory, tiny_model):
    """An API-only tester deleted the eos from its right answers only (2026-12-07): every upload
    was accepted, no check saw a token that was not there, and within 44 versions the policy no
    longer ended its answers. A turn ends at a stop id or at its budget (max_new_tokens), never
    short of it on no stop id."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    lp = learner_factory(run={"steps": 100000}, rollout={"max_new_tokens": 4}, eval={"where": "learner"})  # no eval leases
    joined = lp.join_reply("cheat")
    wid, cred = joined["worker_id"], joined["credential"]
    lp.wait_until(lambda: lp.status()["published_version"] >= 0, 60, "the first version")
    answer = tok("7", add_special_tokens=False)["input_ids"]
    for ids, expect in ((answer, 422), (answer + [tok.eos_token_id], 200)):  # eos deleted; then as sampled
        assert lp.request("POST", "/v1/heartbeat", {"name": "cheat", "version": 0}, token=cred)[0] == 200  # alive
        status, lease = lp.request("POST", "/v1/lease", {"max_prompts": 1, "version": 0}, token=cred)
        assert status == 200 and lease["lease_id"], lease  # a refused upload's prompts went back: lease again
        groups = [GroupMsg(p["id"], 0, [SampleMsg(ids, [-0.5] * len(ids), 0.0) for _ in range(4)]) for p in lease["prompts"]]
        status, body = lp.request("POST", "/v1/trajectories", encode_submission(Submission(wid, lease["lease_id"], groups)),
                                  content_type=CONTENT_TYPE, token=cred)
        assert status == expect, body
        if expect == 422:
            assert body["error"] == "cut-short" and "short of its budget of 4" in body["message"], body


def test_a_worker_sending_fabricated_logprobs_is_quarantined_end_to_end(learner_factory, tiny_model):
    """A worker whose behaviour log-probs are made up (claimed near-certain for random tokens)
    while its rewards are right: the trainer's π on its fresh groups gives it away."""
    import urllib.error
    import urllib.request

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    lp = learner_factory(run={"steps": 100000}, buffer={"max_staleness": 4}, verify={"min_gap_tokens": 32})
    lp.worker("honest", "--worker.max_rollouts_per_s", "20")  # slow: most groups trained are the cheat's, fresh
    joined = lp.join_reply("cheat")
    wid, cred, ticket = joined["worker_id"], joined["credential"], joined["broadcast"]["read_token"]
    lp.wait_until(lambda: lp.status()["learner_version"] >= 1, 60, "training to start")

    def weights(v: int) -> int:  # the cheat's read ticket at the learner's source
        req = urllib.request.Request(f"{joined['broadcast']['source']}/bcast/v1/manifest/v{v}",
                                     headers={"Authorization": f"Bearer {ticket}"})
        try:
            return urllib.request.urlopen(req, timeout=10).status
        except urllib.error.HTTPError as e:
            return e.code

    assert ticket and weights(lp.status()["published_version"]) == 200  # a worker's ticket reads the weights
    told = None
    for _ in range(40):
        status, lease = lp.request("POST", "/v1/lease", {"max_prompts": 1, "version": lp.status()["published_version"]},
                                   token=cred)
        if status == 403:
            told = lease
            break
        if not lease.get("lease_id"):
            continue
        version = lease["snapshot"]["version"]
        # never a right answer: reward 0, as claimed; ended on eos (a turn cut short of its budget is refused)
        ids = tok("++", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        groups = [GroupMsg(p["id"], version, [SampleMsg(ids, [-0.01] * len(ids), 0.0) for _ in range(4)])
                  for p in lease["prompts"]]
        status, body = lp.request("POST", "/v1/trajectories", encode_submission(Submission(wid, lease["lease_id"], groups)),
                                  content_type=CONTENT_TYPE, token=cred)
        if status == 403:
            told = body
            break
        assert status == 200, body
        lp.request("POST", "/v1/heartbeat", {}, token=cred)
        time.sleep(0.3)
    assert told is not None and told["error"] == "quarantined" and "log-probs differ" in told["message"], json.dumps(lp.status()["workers"])
    status, hb = lp.request("POST", "/v1/heartbeat", {}, token=cred)
    assert hb["state"] == "quarantined"
    assert [q["id"] for q in lp.status()["quarantined"]] == [wid]
    metrics = urllib.request.urlopen(lp.url + "/metrics").read().decode()
    assert 'echo_workers_quarantined_total{reason="logprobs"} 1.0' in metrics
    assert weights(lp.status()["published_version"]) == 401  # revoked: no later version from the learner
    v = lp.status()["learner_version"]  # the honest worker carries the run on
    lp.wait_until(lambda: lp.status()["learner_version"] > v + 2, 60, "training to continue")
    assert all(not w["quarantined"] for w in lp.status()["workers"] if w["name"] == "honest")


def test_a_worker_nobody_can_connect_to_is_told_so_and_pulls_every_version(learner_factory):
    """The reachability ladder in the real loop: the learner's probe of a relay that advertises an
    address nobody listens on fails, the heartbeat says so, and the worker follows the route feed
    and pulls each version from its parent; with the fallback pull 10 minutes away, training at
    S = 1 only keeps going if that works. Read tickets live 4 s here: the route feed and the pulls
    go on only if the heartbeats renew them."""
    lp = learner_factory(run={"steps": 8}, buffer={"max_staleness": 1}, broadcast={"fallback_s": 600.0, "ticket_s": 4.0})
    natted_log = lp.run_dir.parent.parent / "natted.log"
    lp.worker("natted", "--worker.max_rollouts_per_s", "100", "--worker.advertise_url", "http://127.0.0.1:9")
    # The open worker starts once the natted one is serving: started together, a slow machine let the
    # open one train all 8 steps before the natted one had loaded its model (CI, 2026-11-27).
    lp.wait_until(lambda: "natted: installed v" in natted_log.read_text(errors="replace"), 120, "the natted worker's first version")
    lp.worker("open", "--worker.max_rollouts_per_s", "100")
    assert lp.finished(240) == 0, lp.output()[-3000:]
    log = natted_log.read_text()
    installs = [line for line in log.splitlines() if "natted: installed v" in line]
    assert len(installs) >= 4, log[-3000:]
    # Never the learner's fallback: a worker joining after a version was published pulls only that one whole.
    pulled = [int(v) for v in re.findall(r"pulling v(\d+) from the learner", log)]
    first = int(re.search(r"natted: installed v(\d+)", log).group(1))
    assert pulled in ([], [first]), log[-3000:]
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and {w["name"]: w["groups"] > 0 for w in summary["workers"]}["natted"]


# --- the hostile fleet (each of these worked against the learner before) ---------------------------


def test_one_worker_cannot_hoard_every_prompt(tokenizer, tmp_path):
    async def test(api: Api):
        _, hoarder = await api.join("hoarder")
        _, honest = await api.join("honest")
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 1024}, token=hoarder)
        assert status == 200 and len(lease["prompts"]) == 3  # [server] lease_first_prompts: it delivered nothing yet
        status, more, _ = await api.call("/v1/lease", {"max_prompts": 1024}, token=hoarder)
        assert status == 200 and more["lease_id"] is None  # its window is full
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 4}, token=honest)
        assert status == 200 and len(lease["prompts"]) == 3  # the rest is there for everyone else

    run_api(tokenizer, test, tmp_path, **{"server.lease_first_prompts": 3, "server.long_poll_s": 0})


def test_a_wave_of_new_identities_takes_a_share_each_not_every_prompt(tokenizer, tmp_path):
    """Workers alive were counted once a second: 48 identities joining within it each took a
    share of a few workers' prompts, held all 96 in flight and stalled the run ~20 s, per wave."""
    async def test(api: Api):
        _, honest = await api.join("honest")
        sybils = [(await api.join(f"sybil-{i}"))[1] for i in range(12)]
        held = 0
        for cred in sybils:
            status, lease, _ = await api.call("/v1/lease", {"max_prompts": 64}, token=cred)
            held += len(lease["prompts"] or [])
        assert held <= 12  # a share each of 24 among 13 alive: 1
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 4}, token=honest)
        assert status == 200 and lease["prompts"]

    run_api(tokenizer, test, tmp_path, **{"server.max_inflight_prompts": 24, "server.lease_first_prompts": 8,
                                          "server.long_poll_s": 0, "server.max_workers_per_address": 16})


def test_one_address_cannot_fill_the_fleet_or_guess_tokens(tokenizer, tmp_path):
    async def test(api: Api):
        for i in range(3):
            await api.join(f"sybil-{i}")
        status, body, _ = await api.call("/v1/join", {"name": "sybil-3"})
        assert (status, body["error"]) == (403, "address-full")
        for _ in range(4):
            status, _, _ = await api.call("/v1/heartbeat", {}, token="w1.guess")
            assert status == 401
        status, body, headers = await api.call("/v1/heartbeat", {}, token="w1.guess")
        assert (status, body["error"]) == (429, "throttled") and int(headers["Retry-After"]) >= 1
        status, body, _ = await api.call("/v1/join", {"name": "x"}, token="still-guessing")
        assert status == 429  # the address waits, whatever it guesses

    run_api(tokenizer, test, tmp_path, **{"server.max_workers_per_address": 3, "server.auth_failure_burst": 4})


def test_wrong_credentials_from_an_address_do_not_lock_out_its_honest_workers(tokenizer, tmp_path):
    """Workers behind one NAT (or containers on one rented host) share an address: a neighbour
    presenting wrong credentials throttles the guesses, not the honest worker's own calls."""
    async def test(api: Api):
        _, honest = await api.join("honest")
        for _ in range(6):
            await api.call("/v1/heartbeat", {}, token="w1.guess")
        status, body, _ = await api.call("/v1/heartbeat", {}, token="w1.guess")
        assert (status, body["error"]) == (429, "throttled")  # the guesser waits
        status, hb, _ = await api.call("/v1/heartbeat", {}, token=honest)
        assert status == 200 and hb["state"] in ("active", "idle")
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=honest)
        assert status == 200 and lease["lease_id"]
        status, body, _ = await api.call("/v1/join", {"name": "x"})
        assert status == 429  # the run token, which may be guessable, stays throttled

    run_api(tokenizer, test, tmp_path, **{"server.auth_failure_burst": 4, "server.long_poll_s": 0})


def test_a_wrong_credential_is_answered_late_and_holds_up_nobody_else(tokenizer, tmp_path):
    """A guesser that waits for its answers guessed as fast as the learner could refuse: ~3,000
    wrong tokens a second from one client, each a whole request of the learner's loop. Each is
    now answered `auth_failure_delay_s` late, without holding up anyone: an honest worker's
    heartbeats, sent meanwhile from the same address, are answered at once."""
    async def test(api: Api):
        _, honest = await api.join("honest")

        async def guess(token: str) -> tuple[int, float]:
            start = time.monotonic()
            status, _, _ = await api.call("/v1/heartbeat", {}, token=token)
            return status, time.monotonic() - start

        async def beats() -> list[float]:
            took = []
            for _ in range(5):
                status, took_s = await guess(honest)
                assert status == 200
                took.append(took_s)
            return took

        guesses = [await guess(t) for t in ("w1.guess", TOKEN, "")]  # a wrong secret, the run token, none
        assert [status for status, _ in guesses] == [401] * 3 and min(took for _, took in guesses) >= 0.5
        status, took = await guess("w1.guess")  # the throttle's 429 is late too
        assert status == 429 and took >= 0.5
        late, honest_beats = await asyncio.gather(guess("w2.guess"), beats())
        assert late[1] >= 0.5 and max(honest_beats) < 0.25, honest_beats

    run_api(tokenizer, test, tmp_path, **{"server.auth_failure_delay_s": 0.5, "server.auth_failure_burst": 3})


def test_each_reply_says_whether_the_announced_version_is_pushed_to_that_worker(tokenizer, tmp_path):
    """A worker idle when a version was published is not on its push route; activated, it waited
    `fallback_s` for a push never coming (a fresh-clone CI run timed out on it). Heartbeat and
    lease replies say, per worker, whether the announced version is pushed to it (chain mode);
    in star mode nothing is pushed and they say nothing."""
    async def test(api: Api):
        a, cred_a = await api.join("a")
        b, cred_b = await api.join("b")
        for cred in (cred_a, cred_b):
            status, body, _ = await api.call("/v1/heartbeat", {}, token=cred)
            assert status == 200 and body["on_route"] is None  # star: nothing is pushed
        api.state.run.routed = frozenset({a})  # v0 was pushed to a only (b was idle then)
        said = {}
        for wid, cred in ((a, cred_a), (b, cred_b)):
            status, beat, _ = await api.call("/v1/heartbeat", {}, token=cred)
            status, lease, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=cred)
            said[wid] = (beat["on_route"], lease["on_route"])
        assert said == {a: (True, True), b: (False, False)}

    run_api(tokenizer, test, tmp_path)


def test_a_relay_url_cannot_aim_the_learner_elsewhere(tokenizer, tmp_path):
    async def test(api: Api):
        wid, cred = await api.join("w")
        status, body, _ = await api.call("/v1/heartbeat", {"relay_url": "http://169.254.169.254/latest/meta-data"},
                                         token=cred)
        assert status == 400 and "relay_url" in body["message"]
        probed = api.state.metrics.relays_probed
        # Not its own address (a NAT'd worker's private one, or one aimed inside the learner's
        # network): never connected to, so no oracle; the worker is a leaf that pulls, as behind
        # NAT. Refused instead (until 2026-12-07), a NAT'd worker was refused every heartbeat.
        for elsewhere in ("http://10.1.2.3:8700", "http://learner.internal:8700", "http://[::1]:8700"):
            status, body, _ = await api.call("/v1/heartbeat", {"relay_url": elsewhere}, token=cred)
            assert status == 200 and body["reachable"] is False, body
            assert api.state.workers[wid].relay_url == elsewhere and api.state.workers[wid].reachable is False
        await asyncio.sleep(0.2)
        assert not any(s.value for m in probed.collect() for s in m.samples if s.name.endswith("_total"))
        status, body, _ = await api.call("/v1/heartbeat", {"relay_url": "http://127.0.0.1:9"}, token=cred)
        assert status == 200  # its own address: probed (nothing listens at port 9: unreachable)
        await asyncio.sleep(PROBE_TIMEOUT_S + 0.5)
        assert probed.labels("unreachable")._value.get() == 1

    run_api(tokenizer, test, tmp_path)


def test_a_relay_url_changed_soon_after_a_probe_is_a_leaf_until_probed(tokenizer, tmp_path, monkeypatch):
    """A worker passed the probe, then named another port on its address within the probe's
    30 s: planned as reachable, never probed, pushed to a port that answered nothing (an
    API-only tester, 2026-12-07). Until the window allows a probe it is a leaf."""
    import learner.api.workers as workers

    monkeypatch.setattr(workers, "PROBE_EVERY_S", 1.0)

    async def test(api: Api):
        wid, cred = await api.join("w")
        probed = api.state.metrics.relays_probed
        count = lambda: sum(s.value for m in probed.collect() for s in m.samples if s.name.endswith("_total"))  # noqa: E731
        status, body, _ = await api.call("/v1/heartbeat", {"relay_url": "http://127.0.0.1:9"}, token=cred)
        assert status == 200 and body["reachable"] is None  # probed now, the answer to come
        await asyncio.sleep(0.3)
        assert count() == 1
        status, body, _ = await api.call("/v1/heartbeat", {"relay_url": "http://127.0.0.1:10"}, token=cred)
        assert status == 200 and body["reachable"] is False and count() == 1  # too soon to probe: a leaf
        await asyncio.sleep(1.2)
        await api.call("/v1/heartbeat", {"relay_url": "http://127.0.0.1:10"}, token=cred)  # the window passed
        await asyncio.sleep(0.3)
        assert count() == 2 and api.state.workers[wid].reachable is False  # probed: nothing listens there

    run_api(tokenizer, test, tmp_path)


def test_a_relay_unreachable_at_its_first_probe_is_probed_again_with_backoff(tokenizer, tmp_path, monkeypatch):
    """A relay whose port opened after the worker joined (a port forward set up late, a probe
    that timed out under load) failed its one probe and was a leaf for the rest of the run.
    It is probed again, each failure doubling the wait, and planned reachable once it answers."""
    import socket

    from nacl.signing import SigningKey

    import learner.api.workers as workers
    from broadcast.relay import Relay

    monkeypatch.setattr(workers, "PROBE_EVERY_S", 1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"

    async def test(api: Api):
        wid, cred = await api.join("w")
        w = api.state.workers[wid]
        probed = api.state.metrics.relays_probed
        heartbeat = lambda: api.call("/v1/heartbeat", {"relay_url": url}, token=cred)  # noqa: E731
        await heartbeat()
        await asyncio.sleep(0.3)
        assert (w.reachable, w.probes_failed, probed.labels("unreachable")._value.get()) == (False, 1, 1)
        await asyncio.sleep(0.9)  # 1 s after the probe, but one failure doubled the wait to 2 s
        await heartbeat()
        await asyncio.sleep(0.1)
        assert probed.labels("unreachable")._value.get() == 1
        relay = Relay("w", SigningKey.generate().verify_key, port=port)
        await relay.start()  # the port opens late
        try:
            await asyncio.sleep(1.0)
            status, body, _ = await heartbeat()
            assert status == 200 and body["reachable"] is False  # a leaf while the probe runs
            await asyncio.sleep(0.3)
            assert (w.reachable, w.probes_failed, probed.labels("reachable")._value.get()) == (True, 0, 1)
            for _ in range(3):  # reachable: not probed again while its URL stands
                await heartbeat()
                await asyncio.sleep(0.5)
            assert probed.labels("reachable")._value.get() == 1
        finally:
            await relay.stop()

    run_api(tokenizer, test, tmp_path)


def test_a_deeply_nested_body_is_a_400_and_metrics_stay_local(tokenizer, tmp_path):
    async def test(api: Api):
        _, cred = await api.join("w")
        # As deep as each route's limit allows: 100,000 under 256 KiB; a heartbeat's 40 KiB, 20,000.
        for path, depth in (("/v1/lease", 100_000), ("/v1/heartbeat", 20_000)):
            status, body, _ = await api.call(path, raw=b"[" * depth + b"]" * depth, token=cred)
            assert (status, body["error"]) == (400, "bad-request"), (path, status, body)
        async with api.session.get(api.url + "/metrics") as resp:
            assert resp.status == 401  # loopback is not among [server] metrics_from here
        async with api.session.get(api.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200

    run_api(tokenizer, test, tmp_path, **{"server.metrics_from": ["10.0.0.0/8"]})


def test_a_group_is_admitted_by_the_version_it_will_be_trained_at(tokenizer, tmp_path):
    """S = 1, learner at v1 and training v1's batch: a v0 group would first be trained at v2,
    staleness 2 > S, so it is given back now instead of queued and evicted at the next batch."""
    async def test(api: Api):
        wid, cred = await api.join("w")
        api.state.run.blobs.add(1, b"weights-1")
        api.state.run.version = 1
        for taken, expect in ((1, 409), (-1, 200)):  # training v1's batch; then between batches
            api.state.buffer.buffer.taken_at = taken
            status, lease, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=cred)
            assert status == 200 and lease["lease_id"], lease
            sub = Submission(wid, lease["lease_id"], [group(tokenizer, lease["prompts"][0]["id"], ["9"] * 4, 0.0)])
            status, body = await api.upload(cred, sub)
            assert status == expect, (expect, body, lease)
            if expect == 409:
                assert body["error"] == "stale-version" and len(api.state.buffer.buffer) == 0

    run_api(tokenizer, test, tmp_path, **{"buffer.max_staleness": 1, "server.refuse_stale_leases": False})


def test_a_worker_whose_whole_upload_came_back_stale_is_served_at_once(tokenizer, tmp_path):
    """Its window full, a worker's next lease request is parked and set aside; its upload is then
    refused as stale and every prompt goes back. The parked request must hear of that room now,
    not at the end of its long poll (it did: the refusal gave the prompts back silently)."""
    async def test(api: Api):
        wid, cred = await api.join("w")
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 8}, token=cred)
        assert status == 200 and len(lease["prompts"]) == 8  # its whole first window
        for v in (1, 2):
            api.state.run.blobs.add(v, b"weights-%d" % v)
        api.state.run.version = 2
        parked = asyncio.create_task(api.call("/v1/lease", {"max_prompts": 8, "version": 2, "wait_s": 20.0}, token=cred))
        await asyncio.sleep(0.3)
        assert not parked.done() and len(api.state.waiters) == 1
        stale = [group(tokenizer, p["id"], ["9"] * 4, 0.0, version=0) for p in lease["prompts"]]
        status, body = await api.upload(cred, Submission(wid, lease["lease_id"], stale))
        assert (status, body["error"]) == (409, "stale-version")
        status, again, _ = await asyncio.wait_for(parked, 5.0)
        assert status == 200 and again["lease_id"] and again["waited_s"] < 5.0, again

    run_api(tokenizer, test, tmp_path, **{"buffer.max_staleness": 1, "server.refuse_stale_leases": False})


def test_a_refused_report_leaves_nothing_behind(tokenizer, tmp_path):
    async def test(api: Api):
        wid, cred = await api.join("w")
        claims = {"gpu": "H100", "price_per_hour": 0.01, "download_mbit": 900.0}
        for wrong, status in (({"relay_url": "http://10.1.2.3:8700/x"}, 400), ({"links": [{"key": 1}]}, 400)):
            got, body, _ = await api.call("/v1/heartbeat", {**claims, **wrong}, token=cred)
            assert got == status
            assert (api.state.workers[wid].gpu, api.state.workers[wid].price_per_hour) == ("", 0.0)  # none of it taken
            for i in range(3):  # a join refused for it: no worker, and no record kept of one
                got, body, _ = await api.call("/v1/join", {"name": f"x{i}", **claims, **wrong})
                assert got == status
        assert list(api.state.workers) == [wid]
        assert set(api.state.verifier.evidence) <= {wid} and set(api.state.links.to_dict()["peers"]) <= {wid}

    run_api(tokenizer, test, tmp_path)


def test_slow_headers_and_slow_json_bodies_are_cut_off(tokenizer, tmp_path):
    """A connection that never finishes its headers is closed at [server] header_timeout_s; a JSON
    body trickled slower than [server] body_timeout_s is a 408; an honest call meanwhile is served."""
    async def test(api: Api):
        _, cred = await api.join("w")
        host, port = api.url.removeprefix("http://").split(":")
        start = time.monotonic()
        slow_headers = await asyncio.open_connection(host, int(port))
        slow_headers[1].write(b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n")  # never ends its headers
        idle = await asyncio.open_connection(host, int(port))  # says nothing at all
        slow_body = await asyncio.open_connection(host, int(port))
        slow_body[1].write(f"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {cred}\r\n"
                           "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode())
        status, _, _ = await api.call("/v1/heartbeat", {}, token=cred)
        assert status == 200
        for reader, _ in (slow_headers, idle):
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the learner
            assert time.monotonic() - start < 6
        answer = await asyncio.wait_for(slow_body[0].read(4096), 10)
        assert answer.startswith(b"HTTP/1.1 408") and b"slow-body" in answer, answer[:200]

    run_api(tokenizer, test, tmp_path, **{"server.header_timeout_s": 1.5, "server.body_timeout_s": 1.0})


def test_a_body_its_route_left_unread_is_read_to_the_routes_bound_then_the_connection_closes(tokenizer, tmp_path):
    """aiohttp read whatever followed a request its route had answered, for 10 s: an endless
    chunked body to `GET /v1/health`, no credential, was read at 2 GB/s, and four such connections
    took 0.9 of the learner's core (the API-only tester, 2026-11-29). Now at most [server]
    max_body_mb is read after the answer, then the connection closes. A body within the bound is
    still read to its end: a worker whose upload is refused before its body is read (no lease)
    reads the 409, not a reset."""
    async def test(api: Api):
        host, port = api.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"10000\r\n" + b"x" * (1 << 16) + b"\r\n"
        sent, start = 0, time.monotonic()
        with contextlib.suppress(ConnectionError):
            while time.monotonic() - start < 8:
                writer.write(piece)
                await writer.drain()
                sent += 1 << 16
        cut_after = time.monotonic() - start
        writer.close()
        # 1 MiB read, the rest what loopback's socket buffers held: before, ~GBs over the 8 s.
        assert cut_after < 8 and sent < 48 << 20, (cut_after, sent >> 20)

        wid, cred = await api.join("w")
        body = os.urandom(900 << 10)  # within max_body_mb: read to its end after the answer
        async with api.session.post(api.url + "/v1/trajectories", data=body, headers={
                "Authorization": f"Bearer {cred}", "Content-Type": CONTENT_TYPE}) as resp:
            assert (resp.status, (await resp.json())["error"]) == (409, "unknown-lease")
        status, _, _ = await api.call("/v1/heartbeat", {}, token=cred)
        assert status == 200

    run_api(tokenizer, test, tmp_path, **{"server.max_body_mb": 1})


def test_a_fresh_identity_cannot_vouch_for_its_partners_upload(tokenizer, tmp_path):
    """Worker B reports having downloaded from A at 10^15 B/s; A then claims that upload. Before,
    the planner's table showed A's upload at 8,000,000,000 Mbit, "measured"."""
    async def test(api: Api):
        a, cred_a = await api.join("a", upload_mbit=100.0)
        b, cred_b = await api.join("b")
        status, _, _ = await api.call("/v1/heartbeat", {"links": [{"key": "v4", "parent": a, "down": 1e15}]},
                                      token=cred_b)
        assert status == 400  # beyond any rented link: not a measurement
        status, _, _ = await api.call("/v1/heartbeat", {"links": [{"key": "v4", "parent": a, "down": 1e9}]},
                                      token=cred_b)
        assert status == 200  # taken as B's own report, not as evidence about A: B delivered nothing
        status, _, _ = await api.call("/v1/heartbeat", {"upload_mbit": 100.0, "links": [{"key": "v4", "up": 1e9}]},
                                      token=cred_a)
        assert status == 200
        assert api.state.verifier.evidence[a].upload_seen == 0.0
        assert api.state.links.to_dict()["peers"][a]["up"]["mbit"] <= 2 * 100.0  # its declared uplink, capped

    run_api(tokenizer, test, tmp_path)


def test_link_samples_and_declared_links_raise_nothing_a_route_did_not_measure(tokenizer, tmp_path):
    """A worker with standing declared upload_mbit 100000 and added a made-up sample (100 Gbit/s
    up, a new key each heartbeat) to every heartbeat: its upload read 100,000 Mbit "measured", the
    planner made it the one stripe every byte went through, and its slow forwarding then cost the
    honest fleet 64% (a tester, 2026-11-28). In chain mode a sample counts only for a version
    whose route placed its worker: its parent there, its upload only where it forwarded, and its
    own claim capped by what its recent children saw (an unmeasured link's rate before any did)."""
    from broadcast.forwarding import Forwarding
    from broadcast.route import Route
    from broadcast.transport import Hop

    def route(key: str, *chain: str) -> Route:
        return Route(key=key, root=b"", source=Hop("source", "http://127.0.0.1:9"),
                     chains=(tuple(Hop(w, "http://127.0.0.1:9") for w in chain),), rates=(None,))

    async def test(api: Api):
        liar, cred = await api.join("liar", upload_mbit=100000.0)
        child, cred_c = await api.join("child")
        for w in (liar, child):
            api.state.workers[w].groups_accepted = 5  # standing: their work was accepted

        def up_mbit(worker: str) -> float:
            api.state.links.settle()
            return api.state.links.to_dict()["peers"][worker]["up"]["mbit"]

        async def beat(credential: str, *links: dict) -> None:
            status, body, _ = await api.call("/v1/heartbeat", {"upload_mbit": 100000.0, "links": list(links)},
                                             token=credential)
            assert status == 200, body

        await beat(cred)
        assert up_mbit(liar) <= 1000.0  # declared beyond an unknown link: taken for one
        forwarding = Forwarding()
        api.state.registry.placements = forwarding  # chain mode
        forwarding.planned(route("v3", liar, child))
        forwarding.planned(route("v4", liar, child))
        lie = {"up": 1.2e10, "up_limited": True}
        await beat(cred, {"key": "v91-0", **lie}, {"key": "v92-0", **lie})  # keys no route had
        assert up_mbit(liar) <= 1000.0
        await beat(cred, {"key": "v3", **lie})  # its own word, before any child measured it
        assert up_mbit(liar) <= 1000.0
        await beat(cred_c, {"key": "v3", "parent": "someone-else", "down": 5e9, "down_limited": True},
                   {"key": "v4", "up": 1e9, "up_limited": True})  # not its parent there; it forwarded nothing
        assert api.state.verifier.evidence[liar].upload_seen == 0.0 and up_mbit(child) <= 1000.0
        await beat(cred_c, {"key": "v3", "parent": liar, "down": 50e6, "down_limited": True})  # its child saw 400 Mbit/s
        assert api.state.verifier.evidence[liar].upload_seen == 50e6
        await beat(cred, {"key": "v4", **lie})
        # its claim taken at capacity_claim_factor x what its child saw (800), averaged with the last
        assert up_mbit(liar) <= (1000.0 + 2 * 400.0) / 2

    run_api(tokenizer, test, tmp_path)


def test_two_sybils_lift_a_liars_upload_only_while_they_keep_vouching(tokenizer, tmp_path):
    """Three identities with standing, the two sybils placed under the liar by real stripes: both
    vouched once at 100 Gbit/s (each clamped at the 1,000 Mbit/s prior), which made the liar's
    claim 2,000 Mbit/s "measured", and it stayed so for good without another report: the head of
    every single chain behind a 1,000 Mbit/s uplink (a tester, 2026-11-28). The lift lasts
    `VOUCH_VERSIONS` of the learner's published versions after the version a vouch speaks of: a
    report resent every heartbeat kept it up for as long as it was resent (a tester, 2026-11-29)."""
    from broadcast.forwarding import Forwarding
    from broadcast.route import Route
    from broadcast.transport import Hop
    from learner.verify import VOUCH_VERSIONS

    async def test(api: Api):
        liar, cred = await api.join("liar")
        sybils = [await api.join(f"sybil{i}") for i in range(2)]
        for w in (liar, *(s for s, _ in sybils)):
            api.state.workers[w].groups_accepted = 5
        forwarding = Forwarding()
        api.state.registry.placements = forwarding
        forwarding.planned(Route(key="v3", root=b"", source=Hop("source", "http://127.0.0.1:9"),
                                 chains=tuple((Hop(liar, "http://127.0.0.1:9"), Hop(s, "http://127.0.0.1:9"))
                                              for s, _ in sybils),
                                 rates=(None, None), spans=((0, 1), (1, 2))))
        api.state.run.blobs.add(3, b"weights-3")

        async def lie_and_read(version: int) -> float:
            status, body, _ = await api.call("/v1/heartbeat", {"upload_mbit": 100000.0, "download_mbit": 100000.0,
                                                               "links": [{"key": "v3", "up": 1.25e10, "up_limited": True}]},
                                              token=cred)
            assert status == 200, body
            return api.state.verifier.believed_upload(liar, 1.25e10, 125e6, version) * 8 / 1e6

        async def vouch() -> None:
            for _, cred_s in sybils:
                status, body, _ = await api.call("/v1/heartbeat", {"links": [{"key": "v3", "parent": liar, "down": 1.25e10,
                                                                              "down_limited": True}]}, token=cred_s)
                assert status == 200, body

        await vouch()
        assert await lie_and_read(3) == 2000.0  # both vouched: the most the factor gives
        for v in range(4, 3 + VOUCH_VERSIONS + 1):
            api.state.run.blobs.add(v, b"weights-%d" % v)
        assert await lie_and_read(api.state.run.published_version) == 1000.0  # nobody saw it since
        await vouch()  # the same v3 report, resent: it speaks of v3, however late it comes
        assert await lie_and_read(api.state.run.published_version) == 1000.0
        assert [e[2] for e in api.state.verifier.evidence[liar].uploads_seen] == [3, 3]  # once per child

    run_api(tokenizer, test, tmp_path)


def test_a_relays_report_of_its_pushes_is_checked_against_its_childs_receipt(tokenizer, tmp_path):
    """A relay's heartbeat says which pushes its children took whole (`deliveries`), each with
    the child's receipt, an HMAC keyed by the hash of the child's own credential secret. A valid
    one makes the child's pull of that tree its own lie; a relay cannot forge one (counted invalid,
    and its report is its word only: a dispute); one not in the receipt's form is a 400 naming it."""
    from broadcast.forwarding import Forwarding
    from broadcast.receipts import receipt, receipt_key
    from broadcast.route import Route
    from broadcast.transport import Hop

    async def test(api: Api):
        parent, cred_p = await api.join("parent")
        child, cred_c = await api.join("child")
        api.state.workers[parent].groups_accepted = 5
        forwarding = Forwarding()
        api.state.registry.placements = forwarding
        forwarding.planned(Route(key="v3", root=b"", source=Hop("source", "http://127.0.0.1:9"),
                                 chains=((Hop(parent, "http://127.0.0.1:9"), Hop(child, "http://127.0.0.1:9")),),
                                 rates=(None,)))
        signed = receipt(receipt_key(cred_c.partition(".")[2]), "v3", 0, parent, child)  # as the child's relay signs

        async def report(*deliveries: dict) -> tuple[int, dict]:
            status, body, _ = await api.call("/v1/heartbeat", {"deliveries": list(deliveries)}, token=cred_p)
            return status, body

        forged = receipt(receipt_key(cred_p.partition(".")[2]), "v3", 0, parent, child)  # the parent's own key
        assert (await report({"key": "v3", "child": child, "tree": 0, "receipt": forged}))[0] == 200
        assert api.metric('echo_broadcast_receipts_total{receipt="invalid"}') == 1
        v = forwarding._versions[3]
        assert v.disputed["v3"] == {(0, parent, child)} and "v3" not in v.acked
        assert (await report({"key": "v3", "child": child, "tree": 0, "receipt": signed}))[0] == 200
        assert v.acked["v3"] == {(0, child)}
        status, body = await report({"key": "v3", "child": child, "tree": 0, "receipt": "not-a-receipt"})
        assert status == 400 and "deliveries" in body["message"]
        forwarding.pulled("v3", child, 0, 1)
        assert forwarding.settle(4) == [(child, 4 + 2)]  # it pulled what it signed for

    run_api(tokenizer, test, tmp_path)


def test_a_colluding_child_cannot_lift_its_partners_upload_nor_its_own_download(tokenizer, tmp_path):
    """Two workers with standing, placed parent and child by a real route: the child reported a
    100 Gbit/s download from its partner, which then claimed that upload: believed 99,976 Mbit
    "measured", planned as the one stripe of a version, which it then forwarded slowly (-69% of the
    honest rollouts; a tester, 2026-11-28). One child's word now lowers a relay's cap but raises
    it no higher than its prior; two children raise it as far as the slower of them saw. A
    worker's own download sample counts no higher than its prior, which bounds what it vouches."""
    from broadcast.forwarding import Forwarding
    from broadcast.route import Route
    from broadcast.transport import Hop

    def route(key: str, *chain: str) -> Route:
        return Route(key=key, root=b"", source=Hop("source", "http://127.0.0.1:9"),
                     chains=(tuple(Hop(w, "http://127.0.0.1:9") for w in chain),), rates=(None,))

    async def test(api: Api):
        liar, cred = await api.join("liar")
        sybil, cred_s = await api.join("sybil")
        honest, cred_h = await api.join("honest")
        for w in (liar, sybil, honest):
            api.state.workers[w].groups_accepted = 5  # standing: their work was accepted
        forwarding = Forwarding()
        api.state.registry.placements = forwarding  # chain mode
        for key in ("v3", "v4", "v5", "v6"):
            forwarding.planned(route(key, liar, sybil, honest))  # the honest one below the sybil
        forwarding.planned(route("v7", liar, honest))

        def mbit(worker: str, way: str) -> float:
            api.state.links.settle()
            return api.state.links.to_dict()["peers"][worker][way]["mbit"]

        async def beat(credential: str, *links: dict) -> None:
            status, body, _ = await api.call("/v1/heartbeat", {"upload_mbit": 100000.0, "download_mbit": 100000.0,
                                                               "links": list(links)}, token=credential)
            assert status == 200, body

        fast = 1.25e10  # 100 Gbit/s
        await beat(cred_s, {"key": "v3", "parent": liar, "down": fast, "down_limited": True})
        await beat(cred, {"key": "v3", "up": fast, "up_limited": True})
        assert mbit(liar, "up") <= 1000.0 and mbit(sybil, "down") <= 1000.0
        assert api.state.verifier.evidence[liar].upload_vouched == 0.0
        await beat(cred_s, {"key": "v4", "parent": liar, "down": fast, "down_limited": True})
        await beat(cred, {"key": "v4", "up": fast, "up_limited": True})
        assert mbit(liar, "up") <= 1000.0  # the same child twice is still one child
        # A second child, honest, saw 100 Mbit/s: the two together vouch for the slower
        await beat(cred_h, {"key": "v7", "parent": liar, "down": 12.5e6, "down_limited": True})
        assert api.state.verifier.evidence[liar].upload_vouched == 12.5e6
        await beat(cred, {"key": "v5", "up": fast, "up_limited": True})
        assert mbit(liar, "up") <= (1000.0 + 2 * 100.0) / 2  # capped at 200, averaged with the last

    run_api(tokenizer, test, tmp_path)


def test_a_compressed_body_is_refused_not_inflated(tokenizer, tmp_path):
    """aiohttp inflates a `Content-Encoding` body before the handler holds it: 8 KiB on the wire
    that inflate to 8 MiB would count 8 KiB against [server] max_inflight_upload_mb. Refused (415)
    on every route that reads a body; the same bytes sent plainly pass."""
    async def test(api: Api):
        wid, cred = await api.join("w")
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=cred)
        sub = Submission(wid, lease["lease_id"], [group(tokenizer, lease["prompts"][0]["id"], ["9"] * 4, 0.0)])
        status, body, _ = await api.call("/v1/trajectories", token=cred, raw=zlib.compress(encode_submission(sub)),
                                         content_type=CONTENT_TYPE, headers={"Content-Encoding": "deflate"})
        assert (status, body["error"]) == (415, "content-encoding") and "without a Content-Encoding" in body["message"]
        status, body, _ = await api.call("/v1/heartbeat", token=cred, raw=zlib.compress(b'{"gpu": "H100"}'),
                                         headers={"Content-Encoding": "deflate"})
        assert (status, body["error"]) == (415, "content-encoding") and api.state.workers[wid].gpu == ""
        assert api.metric('echo_trajectories_rejected_total{reason="content-encoding"}') == 2
        assert len(api.state.buffer.buffer) == 0
        status, body, _ = await api.call("/v1/trajectories", token=cred, raw=encode_submission(sub),
                                         content_type=CONTENT_TYPE, headers={"Content-Encoding": "identity"})
        assert (status, body["accepted"]) == (200, 1)

    run_api(tokenizer, test, tmp_path)


def test_stalled_uploads_hold_no_more_than_what_their_senders_hold_and_new_identities_half(tokenizer, tmp_path):
    """Stalled uploads declaring [server] max_body_mb each held the learner's whole
    max_inflight_upload_mb, and every other worker's upload got 503: first from one worker holding
    one lease, then (capped per worker and address) from 16 new identities on each of two
    addresses, and training stopped for a minute (2026-11-28). An upload may declare no more than
    an honest one of the prompts its sender holds can be (413 before a byte of it is read), a
    worker reads two of those at once, and workers that never delivered hold half the budget
    together: a worker that has delivered still uploads."""
    from echo.wire import max_body

    most = max_body(8, 4, 1)  # this run's max_new_tokens and group_size, one prompt held

    async def test(api: Api):
        host, port = api.url.removeprefix("http://").split(":")

        async def joined(name: str, address: str) -> tuple[str, str]:
            status, body, _ = await api.call("/v1/join", {"name": name}, headers={"X-Forwarded-For": address})
            assert status == 200, body
            status, _, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=body["credential"],
                                          headers={"X-Forwarded-For": address})
            return body["worker_id"], body["credential"]

        async def stalled(cred: str, address: str, length: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write((f"POST /v1/trajectories HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {cred}\r\n"
                          f"X-Forwarded-For: {address}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                          f"Content-Length: {length}\r\n\r\n").encode() + b"\0" * 100)
            await writer.drain()
            return reader, writer

        wid, honest = await joined("honest", "203.0.113.3")
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=honest)
        sub = Submission(wid, lease["lease_id"], [group(tokenizer, lease["prompts"][0]["id"], ["9"] * 4, 0.0)])
        assert (await api.upload(honest, sub))[1]["accepted"] == 1  # it has delivered
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=honest)

        _, hog = await joined("hog", "203.0.113.1")
        reader, writer = await stalled(hog, "203.0.113.1", 1 << 20)  # the headers alone are answered
        answer = await asyncio.wait_for(reader.read(4096), 5)
        assert answer.startswith(b"HTTP/1.1 413") and f"at most {most} fit".encode() in answer, answer
        writer.close()
        held = [await stalled(hog, "203.0.113.1", most) for _ in range(2)]
        await asyncio.sleep(0.2)
        status, body, headers = await api.call("/v1/trajectories", token=hog, raw=b"\0" * 100,
                                               content_type=CONTENT_TYPE, headers={"X-Forwarded-For": "203.0.113.1"})
        assert (status, body["error"]) == (429, "uploads-in-flight") and headers["Retry-After"]  # two at once

        _, sybil = await joined("sybil", "203.0.113.2")
        held += [await stalled(sybil, "203.0.113.2", most) for _ in range(2)]  # new identities: half the budget
        _, late = await joined("late", "203.0.113.4")
        await asyncio.sleep(0.2)
        status, body, _ = await api.call("/v1/trajectories", token=late, raw=b"\0" * 100, content_type=CONTENT_TYPE,
                                         headers={"X-Forwarded-For": "203.0.113.4"})
        assert (status, body["error"]) == (503, "busy")
        sub = Submission(wid, lease["lease_id"], [group(tokenizer, lease["prompts"][0]["id"], ["9"] * 4, 0.0)])
        status, body = await api.upload(honest, sub)
        assert (status, body["accepted"]) == (200, 1)
        for _, writer in held:
            writer.close()

    run_api(tokenizer, test, tmp_path, **{"server.max_inflight_upload_mb": 8 * most / (1 << 20),
                                          "server.trusted_proxies": ["127.0.0.1/32"], "server.long_poll_s": 0})


def test_a_lease_that_expires_while_its_upload_is_read_is_named_as_such(tokenizer, tmp_path):
    """The upload's bound (the prompts its sender holds) was counted again after the body was
    read: a lease that expired meanwhile made an honest upload of 4 groups "malformed, beyond the
    protocol's bounds" (400). The bound is taken once, when the upload starts; what expired is
    then refused by name (409 unknown-lease), and the prompts are out again, not lost."""
    async def test(api: Api):
        wid, cred = await api.join("w")
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 4}, token=cred)
        assert status == 200 and len(lease["prompts"]) == 4
        sub = Submission(wid, lease["lease_id"], [group(tokenizer, p["id"], ["9"] * 4, 0.0) for p in lease["prompts"]])
        body = encode_submission(sub)
        host, port = api.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write((f"POST /v1/trajectories HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {cred}\r\n"
                      f"Content-Type: {CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body[:10])
        await writer.drain()
        await asyncio.sleep(0.2)
        expired = api.state.leases.expire(time.monotonic() + 3600)  # the lease runs out mid-read
        assert [x.id for x in expired] == [lease["lease_id"]]
        writer.write(body[10:])
        await writer.drain()
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode()
        length = int(re.search(r"Content-Length: (\d+)", head, re.I).group(1))
        reply = json.loads(await reader.readexactly(length))
        writer.close()
        assert head.startswith("HTTP/1.1 409") and reply["error"] == "unknown-lease", (head, reply)
        assert api.state.leases.waiting_retry == 4  # given out again to the next worker

    run_api(tokenizer, test, tmp_path, **{"server.long_poll_s": 0})


def test_one_worker_cannot_download_a_snapshot_over_and_over(tokenizer, tmp_path):
    """One worker looping over GET /v1/snapshots/{v} sent 7.8 Gbit/s of the learner's uplink; each
    reader now gets each version a few times (retries), then 429."""
    async def test(api: Api):
        hog_id, hog = await api.join("hog")
        other_id, other = await api.join("other")

        async def get(cred: str, path: str = "/v1/snapshots/0") -> tuple[int, bytes]:
            async with api.session.get(api.url + path, headers={"Authorization": f"Bearer {cred}"}) as resp:
                return resp.status, await resp.read()

        for _ in range(4):
            assert await get(hog) == (200, b"weights")
        status, body = await get(hog)
        assert status == 429 and json.loads(body)["error"] == "downloads"
        assert (await get(hog, "/v1/snapshots/latest"))[0] == 200  # the announcement is a few bytes
        assert await get(other) == (200, b"weights")
        # Paths that name no held version are not counted: their raw text was the key (~8 KB each)
        for path in ("/v1/snapshots/" + "9" * 4000, "/v1/snapshots/7", "/v1/snapshots/x" * 100):
            assert (await get(other, path))[0] in (400, 404)
        assert sorted(api.state.status_room.downloads) == sorted([f"{hog_id} 0", f"{other_id} 0", "@127.0.0.1 0"])
        # Other spellings of 0 that int() reads were served uncounted: 504 downloads in 10.7 s (a tester)
        for spelling in ("+0", "0_0", "\u0660", "\uff10", "\u0966", " 0"):
            status, body = await get(hog, "/v1/snapshots/" + quote(spelling))
            assert status == 400 and b"ASCII digits" in body, (spelling, status, body)

    run_api(tokenizer, test, tmp_path)


def test_an_address_downloads_a_thing_a_bounded_number_of_times_whatever_identities_it_takes(tokenizer, tmp_path):
    """Each identity may download a version (or the LoRA base, or a task directory) 4 times, and
    a worker joining again is a new identity: one address had the base 4 more times per join,
    without end (an API-only tester, 2026-12-07; at 8B a base is 16 GB). An address gets each
    thing at most twice per worker it may hold, whoever asks; another address is not touched."""
    async def test(api: Api):
        async def get(cred: str) -> int:
            async with api.session.get(api.url + "/v1/snapshots/0", headers={"Authorization": f"Bearer {cred}"}) as resp:
                await resp.read()
                return resp.status

        most = 2 * 2  # [server] max_workers_per_address = 2
        got = 0
        for n in range(6):  # identity after identity from one address, each forgotten after its copies
            _, cred = await api.join(f"churn{n}")
            statuses = [await get(cred) for _ in range(4)]
            got += statuses.count(200)
            assert set(statuses) <= {200, 429}
            api.state.registry.forget(api.state.workers[cred.partition(".")[0]])  # its address may join again
        assert got == most
        _, cred = await api.join("elsewhere")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.9", 0))) as other:
            async with other.get(api.url + "/v1/snapshots/0", headers={"Authorization": f"Bearer {cred}"}) as resp:
                assert resp.status == 200  # read from another address: its own count

    run_api(tokenizer, test, tmp_path, **{"server.max_workers_per_address": 2})


def test_one_address_takes_its_turn_at_the_weights(tokenizer, tmp_path):
    """Sixteen identities at one address, each allowed a few copies of a version, opened 64
    downloads at once: 64 of the learner uplink's fair shares, from every other worker. An
    address is sent `WEIGHT_STREAMS_PER_ADDRESS` at once; the rest wait their turn, and another
    address does not wait behind them."""
    from learner.api.status import WEIGHT_STREAMS_PER_ADDRESS as PER

    blob = os.urandom(32 << 20)  # far more than loopback's socket buffers: an unread stream holds its turn

    async def test(api: Api):
        api.state.run.blobs.add(1, blob)
        creds = [(await api.join(f"sybil{i}"))[1] for i in range(PER + 2)]
        other = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0)))
        try:
            status, joined, _ = await api.call("/v1/join", {"name": "elsewhere"})  # read from 127.0.0.2
            assert status == 200, joined
            opened = [await api.session.get(api.url + "/v1/snapshots/1", headers={"Authorization": f"Bearer {c}"})
                      for c in creds[:PER]]  # each holds its turn, reading nothing
            waiting = [asyncio.create_task(api.session.get(api.url + "/v1/snapshots/1",
                                                           headers={"Authorization": f"Bearer {c}"}))
                       for c in creds[PER:]]
            await asyncio.sleep(1.0)
            assert all(r.status == 200 for r in opened) and not any(t.done() for t in waiting)
            async with other.get(api.url + "/v1/snapshots/1",
                                 headers={"Authorization": f"Bearer {joined['credential']}"}) as resp:
                assert resp.status == 200 and await resp.read() == blob  # another address: served at once
            assert await opened[0].read() == blob  # one turn ends...
            first = (await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED))[0].pop().result()
            assert first.status == 200 and await first.read() == blob  # ...and the next begins
            for resp in opened[1:]:
                resp.close()
            for task in waiting:
                resp = await task
                assert resp.status == 200 and await resp.read() == blob
        finally:
            await other.close()
        assert not api.state.status_room.streams._gates  # nothing kept once the streams are done

    run_api(tokenizer, test, tmp_path)


def test_a_reader_that_stops_reading_loses_its_turn(tokenizer, tmp_path, monkeypatch):
    """A turn at the weights was held as long as its stream was open: four readers that stopped
    reading kept their address's workers (a shared NAT, a carrier's) from the weights for good.
    A stream whose reader takes none of a piece for `WRITE_STALL_S` is closed."""
    import broadcast.star as star
    from learner.api.status import WEIGHT_STREAMS_PER_ADDRESS as PER

    monkeypatch.setattr(star, "WRITE_STALL_S", 1.0)
    blob = os.urandom(32 << 20)

    async def test(api: Api):
        api.state.run.blobs.add(1, blob)
        creds = [(await api.join(f"w{i}"))[1] for i in range(PER + 1)]
        get = lambda c: api.session.get(api.url + "/v1/snapshots/1", headers={"Authorization": f"Bearer {c}"})  # noqa: E731
        stalled = [await get(c) for c in creds[:PER]]  # then read nothing
        t0 = time.monotonic()
        async with get(creds[-1]) as resp:
            assert resp.status == 200 and await resp.read() == blob
        assert time.monotonic() - t0 < 10
        for resp in stalled:
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()  # cut short: the reader knows it did not get the version
            resp.close()

    run_api(tokenizer, test, tmp_path)


def test_a_download_given_no_turn_is_refused_busy_and_not_counted(tokenizer, tmp_path, monkeypatch):
    """Waiting for a turn longer than echo-worker's read timeout would fail the download and
    spend one of the worker's few copies: past `TURN_WAIT_S` it is a 429 `busy`, uncounted."""
    import learner.api.status as status_module

    monkeypatch.setattr(status_module, "TURN_WAIT_S", 0.5)
    blob = os.urandom(32 << 20)

    async def test(api: Api):
        api.state.run.blobs.add(1, blob)
        creds = [(await api.join(f"w{i}"))[1] for i in range(status_module.WEIGHT_STREAMS_PER_ADDRESS + 1)]
        get = lambda c: api.session.get(api.url + "/v1/snapshots/1", headers={"Authorization": f"Bearer {c}"})  # noqa: E731
        opened = [await get(c) for c in creds[:-1]]
        late = creds[-1]
        for _ in range(status_module.MAX_SNAPSHOT_DOWNLOADS + 1):  # more tries than it has copies
            async with get(late) as resp:
                assert resp.status == 429 and resp.headers["Retry-After"] == "5"
                assert (await resp.json())["error"] == "busy"
        for resp in opened:
            resp.close()
        for _ in range(status_module.MAX_SNAPSHOT_DOWNLOADS):  # every copy still its own
            async with get(late) as resp:
                assert resp.status == 200 and await resp.read() == blob

    run_api(tokenizer, test, tmp_path)


def test_a_quarantined_worker_downloads_nothing(tokenizer, tmp_path):
    """Its heartbeats and leases were refused, but its credential still downloaded every new
    snapshot (and the model files) until it was forgotten (the API-only tester, 2026-11-28)."""
    async def test(api: Api):
        bad, cred = await api.join("bad")

        async def get(path: str) -> tuple[int, dict | bytes]:
            async with api.session.get(api.url + path, headers={"Authorization": f"Bearer {cred}"}) as resp:
                body = await resp.read()
                return resp.status, json.loads(body) if resp.content_type == "application/json" else body

        assert await get("/v1/snapshots/0") == (200, b"weights")
        api.state.registry.quarantine(api.state.workers[bad], Verdict(bad, "rewards", "rewards differ"))
        for path in ("/v1/snapshots/0", "/v1/model"):
            status, body = await get(path)
            assert (status, body["error"]) == (403, "quarantined"), (path, status, body)

    run_api(tokenizer, test, tmp_path)


def test_the_run_token_every_worker_holds_reads_no_weights(tokenizer, tmp_path):
    """The run token downloaded every snapshot and the LoRA base: a quarantined worker, from an
    address banned for forging, kept reading each new version with it, 4 copies per address (the
    API-only tester, 2026-11-29). Weights now go to a joined worker's credential only; the run
    token still reads which version is latest and the model files without weights (`doctor`)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"base weights")

    async def test(api: Api):
        async def get(path: str, token: str) -> tuple[int, dict | bytes]:
            async with api.session.get(api.url + path, headers={"Authorization": f"Bearer {token}"}) as resp:
                body = await resp.read()
                return resp.status, json.loads(body) if resp.content_type == "application/json" else body

        for path in ("/v1/snapshots/0", "/v1/model?weights=1"):
            status, body = await get(path, TOKEN)
            assert (status, body["error"]) == (401, "worker-credential"), (path, status, body)
        assert (await get("/v1/snapshots/latest", TOKEN))[0] == 200
        status, files = await get("/v1/model", TOKEN)
        assert status == 200 and set(msgpack.unpackb(files)) == {"config.json"}
        _, cred = await api.join("reader")
        assert await get("/v1/snapshots/0", cred) == (200, b"weights")
        assert msgpack.unpackb((await get("/v1/model?weights=1", cred))[1])["model.safetensors"] == b"base weights"
        assert not any(key.startswith("127.0.0.1") for key in api.state.status_room.downloads)

    lora = P.LoraInfo(rank=4, alpha=8.0, target_modules=["q_proj"], base_sha256="0" * 64)
    run_api(tokenizer, test, model, lora=lora)


def test_one_address_cannot_hold_every_connection_the_learner_may_open(tokenizer, tmp_path):
    """Idle connections, no credential: 24,000 from three addresses took the learner to its file
    limit (each closed by the header timer only after 20 s). An address holds 8 per worker it may
    join; the rest are closed as they open, and the learner serves on."""
    async def test(api: Api):
        host, port = api.url.removeprefix("http://").split(":")
        assert await closed_of(host, int(port), 20) == 20 - 8
        await asyncio.sleep(0.1)
        await api.join("honest")  # the address's connections are its own again

    run_api(tokenizer, test, tmp_path, **{"server.max_workers_per_address": 1})


def test_the_run_token_does_not_show_a_worker_the_others_addresses(tokenizer, tmp_path):
    """Every worker holds the run token, which opens /v1/status: each learnt every other worker's
    address and relay URL and the evidence held on it (its own `token_z`, to steer by), and could
    loop over the costliest route. Away from the operator's machines (`metrics_from`) the status
    leaves them out, and it is rebuilt at most once a second."""
    async def test(api: Api):
        await api.join("w", relay_url="http://127.0.0.1:9")

        async def status() -> tuple[dict, str]:
            async with api.session.get(api.url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                assert resp.status == 200
                text = await resp.text()
                return json.loads(text), text

        view, text = await status()
        assert view["workers"][0]["name"] == "w" and "address" not in view["workers"][0]
        assert "127.0.0.1" not in text and "relay_url" not in text
        # Nor the evidence held on it: a forger polling its own token_z kept its copies under the limit.
        assert not {"token_z", "logprob_gap", "reward_mismatch_share", "tokens_unjudged"} & view["workers"][0].keys()
        await api.join("v")
        assert len((await status())[0]["workers"]) == 1  # the same second: the same bytes
        await asyncio.sleep(1.05)
        assert len((await status())[0]["workers"]) == 2
        # Nor may it loop over /v1/status and /metrics: one looping over /metrics on 4 connections
        # took a whole learner core. Ten at once, then one a second, per address.
        answered = []
        for path in ["/v1/status", "/metrics"] * 7:
            async with api.session.get(api.url + path, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                answered.append(resp.status)
                body = await resp.json() if resp.status == 429 else None
        assert answered[:7] == [200] * 7 and answered[-1] == 429, answered  # three came before
        assert body["error"] == "rate-limited" and "metrics_from" in body["message"]

    run_api(tokenizer, test, tmp_path, **{"server.metrics_from": ["10.0.0.0/8"]})


def test_a_request_aiohttp_cannot_parse_is_counted_not_logged(tokenizer, tmp_path, caplog):
    """Each unparsable request (here a negative Content-Length, no credential) wrote aiohttp's
    traceback to the learner's log: 540 bytes a request, 0.4 MB/s from one client."""
    caplog.set_level(logging.DEBUG, logger="aiohttp")

    async def test(api: Api):
        host, port = api.url.removeprefix("http://").split(":")
        for _ in range(3):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
            assert (await reader.read()).startswith(b"HTTP/1.0 400")
            writer.close()
        assert "Error handling request" not in caplog.text
        assert api.metric('echo_trajectories_rejected_total{reason="malformed-http"}') == 3

    run_api(tokenizer, test, tmp_path)


def test_a_body_cut_off_by_its_sender_is_counted_not_logged(tokenizer, tmp_path, caplog):
    """A worker that hangs up mid-body (an upload or a JSON call) costs a count, not a traceback
    in the learner's log; the learner serves on."""
    caplog.set_level(logging.DEBUG, logger="aiohttp")

    async def test(api: Api):
        _, cred = await api.join("w")
        await api.call("/v1/lease", {"max_prompts": 1}, token=cred)  # an upload is read only from a lease holder
        host, port = api.url.removeprefix("http://").split(":")
        for path, kind in (("/v1/trajectories", CONTENT_TYPE), ("/v1/heartbeat", "application/json")):
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {cred}\r\n"
                         f"Content-Type: {kind}\r\nContent-Length: 3000\r\n\r\n".encode() + b"x" * 1000)
            await writer.drain()
            await asyncio.sleep(0.3)  # the handler is reading the body
            writer.close()
        for _ in range(50):
            if api.metric('echo_trajectories_rejected_total{reason="aborted"}') == 2:
                break
            await asyncio.sleep(0.1)
        assert api.metric('echo_trajectories_rejected_total{reason="aborted"}') == 2
        status, _, _ = await api.call("/v1/heartbeat", {}, token=cred)
        assert status == 200

    run_api(tokenizer, test, tmp_path)
    logged = [r for r in caplog.records if r.name.startswith("aiohttp") and (r.levelno >= logging.ERROR or r.exc_info)]
    assert not logged, [r.getMessage() for r in logged]


def test_metrics_behind_a_trusted_proxy_judge_the_forwarded_address(tokenizer, tmp_path):
    """Behind a reverse proxy on the learner's machine every connection comes from loopback: the
    address /metrics is open to ([server] metrics_from) is the one the proxy forwarded."""
    async def test(api: Api):
        async def metrics(headers: dict) -> int:
            async with api.session.get(api.url + "/metrics", headers=headers) as resp:
                return resp.status

        assert await metrics({"X-Forwarded-For": "203.0.113.7"}) == 401  # anyone on the internet, via the proxy
        assert await metrics({"X-Forwarded-For": "127.0.0.1, 203.0.113.7"}) == 401  # what it wrote itself is not read
        assert await metrics({"X-Forwarded-For": "203.0.113.7", "Authorization": f"Bearer {TOKEN}"}) == 200
        assert await metrics({"X-Forwarded-For": "127.0.0.2"}) == 200  # a local client via the proxy
        assert await metrics({}) == 200  # this machine itself

    run_api(tokenizer, test, tmp_path, **{"server.trusted_proxies": ["127.0.0.0/8"]})


def test_one_machine_token_holds_one_live_identity(tokenizer, tmp_path):
    """A pool machine's token joins as that machine: a second join replaces the first identity
    (a restarted machine), whose credential stops working and whose leases go out again at once,
    also when the fleet or the address is full. A quarantined machine does not come back by it."""
    machine = machine_token(MACHINE_KEY, "cpu-a-0")

    async def test(api: Api):
        state = api.state
        first, cred1 = await _join(api, machine, "anything-0")
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 2}, token=cred1)
        assert status == 200 and len(lease["prompts"]) == 2
        second, cred2 = await _join(api, machine, "anything-1")
        assert second != first and list(state.workers) == [second] and state.workers[second].name == "cpu-a-0"
        status, body, _ = await api.call("/v1/heartbeat", {}, token=cred1)
        assert (status, body["error"]) == (401, "unknown-credential")
        assert state.leases.outstanding_by_worker() == {}  # its prompts are leasable now, not at the TTL
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 2}, token=cred2)
        assert status == 200 and len(lease["prompts"]) == 2
        # A full fleet and a full address still let the machine rejoin: it takes its own place.
        other, _ = await api.join("self-joined")
        status, body, _ = await api.call("/v1/join", {"name": "one-more"})
        assert (status, body["error"]) == (403, "address-full") and len(state.workers) == 2
        third, _ = await _join(api, machine, "anything-2")
        assert sorted(state.workers) == sorted([other, third]) and state.leases.outstanding_by_worker() == {}
        # Caught: the machine's token does not bring it back (its address is not banned here).
        state.registry.quarantine(state.workers[third], Verdict(third, "rewards", "rewards differ"))
        status, body, _ = await api.call("/v1/join", {"name": "anything-3"}, token=machine)
        assert (status, body["error"]) == (403, "banned") and "cpu-a-0" in body["message"]
        assert state.workers[third].quarantined

    run_api(tokenizer, test, tmp_path, **{"server.max_workers": 2, "server.max_workers_per_address": 2,
                                          "verify.ban_address": False})


async def _join(api: Api, token: str, name: str) -> tuple[str, str]:
    status, body, _ = await api.call("/v1/join", {"name": name}, token=token)
    assert status == 200, body
    return body["worker_id"], body["credential"]


def test_a_quarantined_worker_is_heard_no_more_and_forgotten(tokenizer, tmp_path):
    """Once quarantined, a worker's heartbeats take nothing of its report (no claims, no link
    samples vouching for a partner) and its calls renew nothing: it is forgotten after [server]
    forget_after_s like a silent worker, and its address ban outlives it."""
    async def test(api: Api):
        state = api.state
        partner, cred_p = await api.join("partner")
        cheat, cred = await api.join("cheat")
        state.registry.quarantine(state.workers[cheat], Verdict(cheat, "rewards", "rewards differ"))
        w = state.workers[cheat]
        seen = w.last_seen
        await asyncio.sleep(0.05)
        status, hb, _ = await api.call("/v1/heartbeat", {"gpu": "H100", "capacity_per_s": 5.0, "price_per_hour": 0.0,
                                                         "links": [{"key": "v1", "down": 1e6, "parent": partner}]},
                                       token=cred)
        assert status == 200 and hb["state"] == "quarantined" and "rewards differ" in hb["message"]
        assert (w.gpu, w.claimed_capacity_per_s) == ("", 0.0)  # nothing of the report was taken
        assert state.verifier.evidence[partner].upload_seen == 0  # its link sample vouched for nobody
        status, body, _ = await api.call("/v1/lease", {"max_prompts": 1}, token=cred)
        assert (status, body["error"]) == (403, "quarantined")
        assert w.last_seen == seen  # its calls renew nothing
        await asyncio.sleep(1.2)
        await api.call("/v1/heartbeat", {}, token=cred)
        await api.call("/v1/heartbeat", {}, token=cred_p)
        state.registry.reap(time.monotonic())
        assert list(state.workers) == [partner]  # forgotten like a silent one; the honest partner stays
        status, body, _ = await api.call("/v1/heartbeat", {}, token=cred)
        assert (status, body["error"]) == (401, "unknown-credential")
        status, body, _ = await api.call("/v1/join", {"name": "cheat-again"})
        assert (status, body["error"]) == (403, "banned")  # the ban lives in the address book

    run_api(tokenizer, test, tmp_path, **{"server.forget_after_s": 1.0})


def test_a_forgotten_workers_read_ticket_is_refused_at_the_source(tokenizer, tmp_path):
    """A worker silent past forget_after_s lost its credential, but its read ticket still pulled
    whole versions from the learner's source until it expired: one address kept ~80 live
    tickets, none of a worker the learner knows, by joining 16 at a time and going silent."""
    from broadcast.signing import SigningKey
    from broadcast.tickets import Readers, TicketOffice
    from broadcast.transport import Refused

    async def test(api: Api):
        key = SigningKey.generate()
        registry = api.state.registry
        registry.tickets = TicketOffice(key, Readers(key.public_key()))
        gone, _ = await api.join("gone")
        stays, _ = await api.join("stays")
        tickets = {w: registry.ticket(api.state.workers[w], time.monotonic(), fresh=True) for w in (gone, stays)}
        assert registry.tickets.readers.holder(tickets[gone]) == gone
        registry.forget(api.state.workers[gone])
        with pytest.raises(Refused) as refused:
            registry.tickets.readers.holder(tickets[gone])
        assert refused.value.status == 401 and "was forgotten" in refused.value.text
        assert registry.tickets.readers.holder(tickets[stays]) == stays

    run_api(tokenizer, test, tmp_path)


def test_a_forgotten_worker_leaves_the_metrics(tokenizer, tmp_path):
    """/metrics exports each worker's links; a forgotten worker's series went on being exported,
    and held in memory, forever: a week of churn is hundreds of thousands of series."""
    async def test(api: Api):
        gone, _ = await api.join("gone", download_mbit=50.0, upload_mbit=10.0, rtt_ms=40.0)
        stays, cred = await api.join("stays", download_mbit=50.0, upload_mbit=10.0, rtt_ms=40.0)

        async def exported() -> str:
            async with api.session.get(api.url + "/metrics") as resp:
                assert resp.status == 200
                return await resp.text()

        text = await exported()
        assert f'peer="{gone}"' in text and f'peer="{stays}"' in text
        api.state.registry.forget(api.state.workers[gone])
        text = await exported()
        assert f'peer="{gone}"' not in text and f'peer="{stays}"' in text

    run_api(tokenizer, test, tmp_path)


def test_the_operators_status_is_fresh_and_the_workers_view_is_shared(tokenizer, tmp_path):
    """/v1/status is rebuilt at most once a second for run-token holders elsewhere (a worker
    looping over it), never for the operator's own machine: a tool that acts, then reads, must
    see what it did."""
    async def test(api: Api):
        wid, cred = await api.join("w")
        operator = {"Authorization": f"Bearer {TOKEN}"}

        async def leased() -> int:
            async with api.session.get(api.url + "/v1/status", headers=operator) as resp:
                return next(w["leased_prompts"] for w in (await resp.json())["workers"] if w["id"] == wid)

        assert await leased() == 0
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 2}, token=cred)
        assert status == 200 and await leased() == 2  # at once, not a second later
        room = api.state.status_room
        first = room.status_json(False, now=100.0)
        api.state.leases.lease("other", 1, now=0.0)
        assert room.status_json(False, now=100.5) == first  # the workers' view: shared for a second
        assert room.status_json(False, now=101.0) != first

    run_api(tokenizer, test, tmp_path)


def test_a_flood_of_groups_without_an_advantage_is_not_trained(learner_factory, tiny_model):
    """A worker answering every prompt right in every sample (every claim true, so no check
    fires) fills no batch with dynamic sampling: its groups are counted and skipped, each batch
    is groups whose rewards differ, so no step's mean reward is 0 or 1. Trained, such a flood
    made every step the attacker's (training reward 1.000) and accuracy fell from 0.74 to 0.2."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    steps = 4
    lp = learner_factory(run={"steps": steps}, buffer={"max_staleness": 2, "dynamic_sampling": True},
                         rollout={"group_size": 8}, verify={"ban_address": False})
    lp.worker("honest")
    joined = lp.join_reply("flood")
    wid, cred = joined["worker_id"], joined["credential"]
    flooded, version = 0, 0
    while lp.proc.poll() is None:
        try:
            status, lease = lp.request("POST", "/v1/lease", {"max_prompts": 4, "version": version, "wait_s": 1},
                                       token=cred)
        except OSError:  # the learner finished and closed its port
            break
        if status == 200 and lease.get("snapshot"):
            version = lease["snapshot"]["version"]
        if status != 200 or not lease.get("lease_id") or lease.get("eval_version") is not None:
            continue
        assert all(p["answer"] == "" for p in lease["prompts"])  # the learner scores them: it keeps the answers
        groups = []
        for p in lease["prompts"]:
            answer = str(eval(p["text"].split("=")[0].split(":")[-1].strip()))  # noqa: S307 (the task's own sums)
            ids = tok(answer + tok.eos_token, add_special_tokens=False)["input_ids"]
            groups.append(GroupMsg(p["id"], version,  # the newest announced (a reply may carry none)
                                   [SampleMsg(ids, [-0.05] * len(ids), 1.0) for _ in range(8)]))
        with contextlib.suppress(OSError):
            status, body = lp.request("POST", "/v1/trajectories", encode_submission(Submission(wid, lease["lease_id"], groups)),
                                      content_type=CONTENT_TYPE, token=cred)
            flooded += len(groups) if status == 200 else 0
    assert lp.finished(180) == 0, lp.output()[-3000:]
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    steps_logged = lp.records()
    assert len(steps_logged) == steps and all(0.0 < s["reward_mean"] < 1.0 for s in steps_logged), \
        [s["reward_mean"] for s in steps_logged]
    assert summary["groups_trained"] == steps * 4
    assert flooded >= 8 and summary["skipped_uniform"] >= flooded


def test_one_credential_cannot_send_requests_as_fast_as_it_likes(tokenizer, tmp_path):
    """One worker with a valid credential sending 2-3k cheap requests a second kept 0.6-0.9 of a
    learner core busy. Each credential has a token bucket ([server] worker_requests_per_s after
    worker_request_burst): past it, every route answers 429 `rate-limited` with Retry-After, and
    other workers (the same address too) are served as before."""
    async def test(api: Api):
        wid, flood = await api.join("flood")
        _, other = await api.join("other")
        for _ in range(5):
            status, _, _ = await api.call("/v1/heartbeat", {}, token=flood)
            assert status == 200
        seen = api.state.workers[wid].last_seen
        for path, body in (("/v1/heartbeat", {}), ("/v1/lease", {"max_prompts": 1})):
            status, reply, headers = await api.call(path, body, token=flood)
            assert (status, reply["error"]) == (429, "rate-limited"), reply
            assert "worker_requests_per_s" in reply["message"] and int(headers["Retry-After"]) >= 1
        status, reply, headers = await api.call("/v1/trajectories", token=flood, raw=b"x", content_type=CONTENT_TYPE)
        assert (status, reply["error"]) == (429, "rate-limited") and int(headers["Retry-After"]) >= 1
        assert api.state.workers[wid].last_seen == seen  # a refused request renews nothing
        assert api.metric('echo_auth_refused_total{credential="rate-limited"}') == 3
        status, _, _ = await api.call("/v1/heartbeat", {}, token=other)
        assert status == 200  # per credential, not per address
        status, reply, _ = await api.call("/v1/heartbeat", {}, token=f"{wid}.wrong-secret")
        assert (status, reply["error"]) == (401, "unknown-credential")  # a wrong secret: its own path
        await asyncio.sleep(2.1)  # 0.5/s: one request's worth again
        status, _, _ = await api.call("/v1/heartbeat", {}, token=flood)
        assert status == 200

    run_api(tokenizer, test, tmp_path, **{"server.worker_requests_per_s": 0.5, "server.worker_request_burst": 5})


def test_a_worker_cannot_claim_a_version_that_was_never_published(tokenizer, tmp_path):
    """A heartbeat (or a join, or a lease request) claiming version 10^6 while v0 is the newest
    published: the claim was shown in /v1/status and read by the broadcast planner (who holds a
    delta's base), the eval book and the T_bcast measure (its installs). Clamped to the newest
    published version, not refused: an honest worker cannot be ahead of it, except after the
    learner resumed from an older checkpoint, and then it must keep working."""
    async def test(api: Api):
        state = api.state
        wid, cred = await api.join("liar", version=7)
        w = state.workers[wid]
        assert w.version == 0
        future = {"version": 999, "installed_ago": 1.0, "received_ago": 2.0, "install_s": 0.1}
        status, _, _ = await api.call("/v1/heartbeat", {"version": 10 ** 6, "installs": [future]}, token=cred)
        assert status == 200 and w.version == 0 and w.installs == []
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 1, "version": 50}, token=cred)
        assert status == 200 and lease["lease_id"] and w.version == 0  # served, as at the version it can hold
        async with api.session.get(api.url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            row = next(r for r in (await resp.json())["workers"] if r["id"] == wid)
        assert row["version"] == 0
        assert api.metric('echo_verify_claims_clamped_total{what="version"}') == 3
        # Once v1 is published, the same worker's honest report of it is believed.
        state.run.blobs.add(1, b"weights-1")
        now = {"version": 1, "installed_ago": 0.5, "received_ago": 0.6, "install_s": 0.1}
        status, _, _ = await api.call("/v1/heartbeat", {"version": 1, "installs": [now, future]}, token=cred)
        assert status == 200 and w.version == 1 and [i[0] for i in w.installs] == [1]
        assert api.metric('echo_verify_claims_clamped_total{what="version"}') == 3

    run_api(tokenizer, test, tmp_path, **{"server.long_poll_s": 0})


def test_one_ipv6_48_cannot_fill_the_fleet_from_its_64s(tokenizer, tmp_path):
    """Limits count per /64, and a /48 (one site; a tunnel broker gives one away) holds 65,536
    of them: 16 workers from each could fill any fleet. A /48 holds max_64s_per_48 /64s' worth.
    (Joins arrive through a trusted proxy on loopback, which names the IPv6 addresses.)"""
    async def test(api: Api):
        async def join(address: str) -> tuple[int, dict]:
            status, body, _ = await api.call("/v1/join", {"name": "s"}, headers={"X-Forwarded-For": address})
            return status, body

        for net in range(3):
            for _ in range(2):
                assert (await join(f"2001:db8:1:{net:x}::1"))[0] == 200
        status, body = await join("2001:db8:1:ff::1")  # a fresh /64 of the same /48
        assert (status, body["error"]) == (403, "address-full") and "2001:db8:1::/48" in body["message"]
        assert (await join("2001:db8:2::1"))[0] == 200  # another /48
        assert len(api.state.workers) == 7

    run_api(tokenizer, test, tmp_path, **{"server.trusted_proxies": ["127.0.0.0/8"],
                                          "server.max_workers_per_address": 2, "server.max_64s_per_48": 3})


def test_a_forwarded_address_that_is_not_one_is_not_taken(tokenizer, tmp_path):
    """Behind a trusted proxy, an X-Forwarded-For entry was the worker's address as written:
    'not-an-ip' was stored, shown and counted as one. A malformed entry falls back to the
    proxy's address; a well-formed one is written the canonical way."""
    async def test(api: Api):
        for forwarded, expect in (("not-an-ip", "127.0.0.1"), ("203.0.113.7, bogus", "127.0.0.1"),
                                  ("2001:DB8:0::7", "2001:db8::7")):
            status, body, _ = await api.call("/v1/join", {"name": "w"}, headers={"X-Forwarded-For": forwarded})
            assert status == 200, body
            assert api.state.workers[body["worker_id"]].address == expect

    run_api(tokenizer, test, tmp_path, **{"server.trusted_proxies": ["127.0.0.0/8"]})


def test_the_run_token_cannot_mint_a_pool_machines_token(tokenizer, tmp_path):
    """Machine tokens were the run token's HMAC of the machine id, and every worker holds the run
    token: one minted `cpu-a-0`'s, joined as it (the honest machine's credential stopped working)
    and, uploading forgeries under its name, got the honest machine banned. They are keyed by the
    learner's own machine key now; an id a name could not be is refused whatever its MAC."""
    async def test(api: Api):
        for minted in (machine_token(TOKEN, "cpu-a-0"), machine_token(TOKEN + "x", "cpu-a-0")):
            status, body, _ = await api.call("/v1/join", {"name": "cpu-a-0"}, token=minted)
            assert (status, body["error"]) == (401, "unauthorized")
        assert not api.state.workers
        for odd in ("x" * 65, "cpu\ta", "cpu\u202ea"):  # keyed right, but no worker may be named so
            status, body, _ = await api.call("/v1/join", {"name": "w"}, token=machine_token(MACHINE_KEY, odd)
                                             .encode("utf-8").decode("latin-1"))
            assert status == 401, (odd, body)
        wid, _ = await _join(api, machine_token(MACHINE_KEY, "cpu-a-0"), "whatever")
        assert api.state.workers[wid].name == "cpu-a-0"

    run_api(tokenizer, test, tmp_path)


def test_a_pool_machine_is_not_barred_by_a_neighbours_ban(tokenizer, tmp_path):
    """A self-joined worker quarantined bans its address from joining (it would come back under a
    new name); a pool machine behind the same address (its machine token is the operator's word,
    its own quarantine kept by its id) still joins."""
    async def test(api: Api):
        bad, _ = await api.join("neighbour")
        api.state.registry.quarantine(api.state.workers[bad], Verdict(bad, "rewards", "rewards differ"))
        status, body, _ = await api.call("/v1/join", {"name": "new-name"})
        assert (status, body["error"]) == (403, "banned")
        wid, _ = await _join(api, machine_token(MACHINE_KEY, "cpu-b-0"), "cpu-b-0")
        assert api.state.workers[wid].name == "cpu-b-0" and not api.state.workers[wid].quarantined

    run_api(tokenizer, test, tmp_path)


async def _raw(url: str, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """One request written byte for byte (what aiohttp's client would not send), and its answer."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    writer.write(head + b"\r\n" + body)
    await writer.drain()
    status_line = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    payload = await reader.readexactly(int(headers.get("content-length", 0)))
    writer.close()
    return int(status_line.split()[1]), headers, payload


def test_a_bearer_value_outside_ascii_is_a_wrong_token_not_a_500(tokenizer, tmp_path):
    """`Authorization: Bearer \\xe9\\xff` raised UnicodeEncodeError in the token check: a 500 and a
    traceback per request, never throttled. Now it is a wrong token: 401, counted, throttled."""
    async def test(api: Api):
        head = (b"POST /v1/join HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xe9\xff\r\n"
                b"Content-Type: application/json\r\nContent-Length: 2\r\n")
        for _ in range(4):
            status, headers, body = await _raw(api.url, head, b"{}")
            assert status == 401 and json.loads(body)["error"] == "unauthorized" and headers["server"] == "echo"
        status, _, body = await _raw(api.url, head, b"{}")
        assert status == 429 and json.loads(body)["error"] == "throttled"
        status, _, _ = await _raw(api.url, b"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xe9\r\n")
        assert status == 429

    run_api(tokenizer, test, tmp_path, **{"server.auth_failure_burst": 4})


def test_a_second_content_encoding_header_is_refused_and_nothing_is_inflated(tokenizer, tmp_path):
    """`Content-Encoding: identity` then `Content-Encoding: gzip`: the check read the first, aiohttp
    inflated by the second (a heartbeat's gzip body was taken, 200). And aiohttp inflated a gzip
    body whole before anything could refuse it: 2.5 MiB that inflate to 2.5 GiB held every
    heartbeat ~8 s. Every coding of every header counts now, and the server inflates nothing."""
    import gzip

    async def test(api: Api):
        wid, cred = await api.join("w")
        hb = gzip.compress(b'{"gpu": "H100"}')
        head = (b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + cred.encode() +
                b"\r\nContent-Type: application/json\r\nContent-Encoding: identity\r\nContent-Encoding: gzip\r\n"
                b"Content-Length: %d\r\n" % len(hb))
        status, _, body = await _raw(api.url, head, hb)
        assert (status, json.loads(body)["error"]) == (415, "content-encoding") and api.state.workers[wid].gpu == ""
        # A bomb: 2 GiB of zeros in ~2 MiB. Answered 415 while the body is still arriving, and the
        # next request on a fresh connection is answered as at any time (inflating took seconds).
        bomb = gzip.compress(bytes(64 << 20), compresslevel=9) * 32
        head = (b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + cred.encode() +
                b"\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n" % len(bomb))
        t = time.monotonic()
        status, _, body = await _raw(api.url, head, bomb)
        assert (status, json.loads(body)["error"]) == (415, "content-encoding")
        status, _, _ = await api.call("/v1/heartbeat", {}, token=cred)
        assert status == 200 and time.monotonic() - t < 3.0  # inflating it: ~8 s on 2 cores

    run_api(tokenizer, test, tmp_path)


def test_a_worker_gets_the_tasks_model_directory_from_the_learner_unless_its_own_copy_digests_the_same(tokenizer, tmp_path):
    """Poker's LLM opponent is a model directory the environment reads on the worker. A worker on
    another machine had none (`check_here` refused to start); one with another build of it would
    play other opponent moves than the learner replays, every checked episode a mismatch. The
    join reply names its digest; a worker without that copy fetches the learner's, checked."""
    from echo import dirfiles
    from worker.client import LearnerClient, LearnerError
    from worker.config import WorkerConfig
    from worker.rollout import Worker

    opponent = tmp_path / "opponent"
    opponent.mkdir()
    (opponent / "config.json").write_text('{"model_type": "qwen2"}')
    (opponent / "model.safetensors").write_bytes(b"\x01" * 100_000)
    digest = dirfiles.digest(opponent)

    async def test(api: Api):
        worker = Worker(load_config(WorkerConfig, None, ["--worker.cache_dir", str(tmp_path / "cache")]), api.url, TOKEN)
        client = LearnerClient(api.session, api.url, TOKEN)
        joined = await client.join(P.Report(name="w"))
        assert joined.task.model_dirs == {"opponent_model": digest}
        # No copy here (the learner's relative path names nothing on this machine): the learner's, fetched.
        info = joined.task.model_copy(update={"options": {"opponent_model": "models/no-such-dir"}})
        fetched = Path((await worker._task_options(client, info))["opponent_model"])
        assert fetched.parent == tmp_path / "cache" and dirfiles.digest(fetched) == digest
        # Its own copy, the same files: kept, nothing fetched.
        mine = tmp_path / "mine"
        mine.mkdir()
        for name, data in dirfiles.read(opponent).items():
            (mine / name).write_bytes(data)
        info = joined.task.model_copy(update={"options": {"opponent_model": str(mine)}})
        assert (await worker._task_options(client, info))["opponent_model"] == str(mine)
        # Another build of it: replaced by the learner's.
        (mine / "model.safetensors").write_bytes(b"\x02" * 100_000)
        assert Path((await worker._task_options(client, info))["opponent_model"]) == fetched
        # None named (not the working directory, which Path("") is): the learner's.
        info = joined.task.model_copy(update={"options": {"opponent_model": ""}})
        assert Path((await worker._task_options(client, info))["opponent_model"]) == fetched
        # The route: a joined worker only, a directory the task declares only, a few times each.
        async def get(path: str, token: str) -> tuple[int, dict]:
            async with api.session.get(api.url + path, headers={"Authorization": f"Bearer {token}"}) as resp:
                return resp.status, await resp.json()

        assert (await get("/v1/task-dirs/opponent_model", TOKEN))[0] == 401  # the run token is not a worker
        status, body = await get("/v1/task-dirs/..%2F..%2Fetc", client.credential)
        assert status == 404 and body["error"] == "no-task-dir" and "opponent_model" in body["message"]
        await client.task_dir("opponent_model")  # the fourth download (MAX_SNAPSHOT_DOWNLOADS)
        with pytest.raises(LearnerError) as refused:
            await client.task_dir("opponent_model")
        assert refused.value.status == 429 and refused.value.reason == "downloads"
        # What the learner sends is checked against what its join reply said.
        info = P.TaskInfo(name="poker", options={}, model_dirs={"opponent_model": "0" * 64})
        other = LearnerClient(api.session, api.url, TOKEN)
        await other.join(P.Report(name="w2"))
        with pytest.raises(LearnerError, match="does not digest"):
            await worker._task_options(other, info)

    run_api(tokenizer, test, tmp_path, task_dirs={"opponent_model": (opponent, digest)})


def test_a_join_reply_names_the_tasks_model_directory_without_the_learners_path(tmp_path, monkeypatch):
    """The join reply told every holder of the run token where the learner keeps poker's opponent
    (`/home/alice/...`, an API-only tester, 2026-12-07). A directory under the learner's working
    directory is told relative to it (a clone's layout, where a worker finds its own copy), any
    other by its name alone; the digest says which files."""
    from learner.api.workers import shown_dir, welcome

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "opp").mkdir(parents=True)
    assert shown_dir(str(tmp_path / "models" / "opp")) == "models/opp" and shown_dir("models/opp") == "models/opp"
    assert shown_dir("/home/alice/secret/opponent") == "opponent"
    task = SimpleNamespace(name="poker", options={"opponent_model": "/home/alice/secret/opponent", "big_blind": 2})
    cfg = load_config(LearnerConfig, None, [])
    make = welcome(cfg.server, task, P.RolloutParams(group_size=4, max_new_tokens=8, temperature=1.0, top_p=1.0), Run(BlobStore(keep=2)),
                   P.BroadcastInfo(mode="star"), task_dirs={"opponent_model": "0" * 64})
    reply = make("w-1", "w-1.secret")
    assert reply.task.options == {"opponent_model": "opponent", "big_blind": 2}
    assert "alice" not in reply.model_dump_json()


def test_what_aiohttps_parser_refuses_is_answered_as_json_without_its_version_or_the_request(tokenizer, tmp_path):
    """A request line or header aiohttp cannot parse is refused before any route or middleware
    runs: it answered in plain text, `Server: Python/3.11 aiohttp/3.x`, echoing the rejected line
    back. Now: JSON like every refusal, `Server: echo`, nothing of the request, and counted."""
    async def test(api: Api):
        for head in (b"GE\x01T /v1/status HTTP/1.1\r\nHost: x\r\n",  # a bad method
                     b"GET /v1/status HTTP/1.1\r\nHost: x\r\nX-Echo-Me: a\x00b\r\n",  # a NUL in a header
                     b"GET /v1/status HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n"):
            status, headers, body = await _raw(api.url, head)
            assert status == 400 and headers["server"] == "echo", (head, headers)
            assert json.loads(body)["error"] == "malformed-http" and b"Echo-Me" not in body and b"GE" not in body, body
        assert api.metric('echo_trajectories_rejected_total{reason="malformed-http"}') == 3
        status, headers, _ = await _raw(api.url, b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")  # still serving
        assert status == 401 and headers["server"] == "echo"

    run_api(tokenizer, test, tmp_path)


def _rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_readers_that_stop_reading_a_model_directory_hold_a_chunk_of_the_learner_each_not_the_directory(tokenizer, tmp_path):
    """The learner built each task directory and LoRA base whole (the files, then their msgpack:
    twice the directory, up to 4 GiB) for every reader at once, and a reader that stopped reading
    held it: eight stalled readers of a 32 MiB directory held ~0.5 GiB of the learner. Now each is
    read from disk a chunk at a time, each chunk written before the next is read. The base of
    /v1/model?weights=1 is also counted, as every other download: a few times per reader."""
    from echo import dirfiles
    from worker.client import LearnerClient, LearnerError

    opponent = tmp_path / "opponent"
    opponent.mkdir()
    (opponent / "model.safetensors").write_bytes(os.urandom(32 << 20))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(os.urandom(1 << 20))

    async def test(api: Api):
        # Two addresses: one is sent four weight streams at once (`test_one_address_takes_its_turn_at_the_weights`)
        sessions = [api.session, aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0)))]
        readers = [LearnerClient(session, api.url, TOKEN) for session in sessions]
        for n, client in enumerate(readers):
            await client.join(P.Report(name=f"r{n}"))
        before = _rss_mb()
        stalled = []
        for session, client in zip(sessions, readers):
            for _ in range(4):  # MAX_SNAPSHOT_DOWNLOADS each
                resp = await session.get(api.url + "/v1/task-dirs/opponent_model",
                                         headers={"Authorization": f"Bearer {client.credential}"})
                assert resp.status == 200 and resp.content_length == dirfiles.Packed(dirfiles.listed(opponent)).size
                await resp.content.readexactly(1 << 16)  # then no more
                stalled.append(resp)
        await asyncio.sleep(1.0)  # what the learner would send without a reader, it has sent
        held = _rss_mb() - before
        assert held < 64, f"eight stalled readers of a 32 MiB directory hold {held:.0f} MiB of the learner"
        # No HEAD: aiohttp answered one with the GET handler, which streamed the body after the headers.
        for path in ("/v1/task-dirs/opponent_model", "/v1/model?weights=1", "/v1/snapshots/0"):
            async with api.session.head(api.url + path, headers={"Authorization": f"Bearer {readers[0].credential}"}) as resp:
                assert resp.status == 405, path
        for resp in stalled:
            resp.close()
        await sessions[1].close()
        # Read to the end, it is the directory, byte for byte.
        fresh = LearnerClient(api.session, api.url, TOKEN)
        await fresh.join(P.Report(name="whole"))
        assert dirfiles.files_digest(await fresh.task_dir("opponent_model")) == dirfiles.digest(opponent)
        # The base's weights in LoRA mode: served, and counted.
        files = await fresh.model_files(weights=True)
        assert set(files) == {"config.json", "model.safetensors"} and len(files["model.safetensors"]) == 1 << 20
        assert set(await fresh.model_files()) == {"config.json"}  # without: config and tokenizer, uncounted
        for _ in range(3):
            await fresh.model_files(weights=True)
        with pytest.raises(LearnerError) as refused:
            await fresh.model_files(weights=True)
        assert refused.value.status == 429 and refused.value.reason == "downloads"

    lora = P.LoraInfo(rank=4, alpha=8.0, target_modules=["q_proj"], base_sha256="0" * 64)
    run_api(tokenizer, test, model, task_dirs={"opponent_model": (opponent, dirfiles.digest(opponent))}, lora=lora)


def test_a_group_labelled_with_a_version_never_published_is_refused(tokenizer, tmp_path):
    """With `[publish] every` = 2 versions 1, 3, 5, ... are never published. A label between two
    published ones was taken (it was not newer than the newest), and the learner keeps only
    published versions to check stale groups against (`Trainer._check_claims`): a forger
    labelling with version 1 was left to the fleet's drift."""
    async def test(api: Api):
        api.state.run.blobs.add(2, b"weights 2")
        api.state.run.version = 2
        w, cred = await api.join("w")
        status, lease, _ = await api.call("/v1/lease", {"max_prompts": 2}, token=cred)
        p0, p1 = (p["id"] for p in lease["prompts"])
        status, body = await api.upload(cred, Submission(w, lease["lease_id"], [group(tokenizer, p0, ["7"] * 4, 0.0,
                                                                                       version=1)]))
        assert (status, body["error"]) == (422, "unpublished-version") and "version 1 was never published" in body["message"]
        for version in (0, 2):  # published: taken, stale or fresh
            status, body = await api.upload(cred, Submission(w, lease["lease_id"], [group(
                tokenizer, p0 if version == 0 else p1, ["7"] * 4, 0.0, version=version)]))
            assert status == 200, body
        assert api.metric('echo_trajectories_rejected_total{reason="unpublished-version"}') == 1

    run_api(tokenizer, test, tmp_path, **{"buffer.max_staleness": 4})


def test_stale_groups_checked_against_their_own_version_are_judged_by_that_check_alone(tokenizer, tmp_path):
    """A lone honest worker whose groups are two versions old, where the policy moved 1.7 nats a
    token since: against the trainer's π, with no other worker's drift to be held to, it was a
    liar. Checked against the version it claims (`Trainer._check_claims`: 1e-7 nats a token),
    it is not, and its other groups of a kept version, not drawn, carry no evidence; a forger's
    drawn groups, a nat a token off their own version, quarantine it."""
    from learner.buffer import Group

    async def test(api: Api):
        honest, _ = await api.join("honest")
        forger, _ = await api.join("forger")
        groups = [Group(f"p{i}", 0, [1], [[5] * 64] * 4, [[-1.0] * 64] * 4, [0.0] * 4, worker_id=w)
                  for i, w in enumerate([honest] * 6 + [forger] * 2)]
        gaps = [[1.7 * 256, 256]] * 8  # Σ|log π − log μ| against the trainer's π, and the tokens
        tokens = [[0.0] * 4] * 8
        # [index, the token terms (four sums, two copy terms), Σ|log π_v − log μ|, tokens]
        drawn = [[0, 0.0, 20.0, 256, 0, 0.0, 0.0, 1e-7 * 256, 256], [1, 0.0, 20.0, 256, 0, 0.0, 0.0, 1e-7 * 256, 256],
                 [6, 0.0, 20.0, 256, 0, 0.0, 0.0, 1.0 * 256, 256], [7, 0.0, 20.0, 256, 0, 0.0, 0.0, 1.0 * 256, 256]]
        for _ in range(2):
            api.state.registry.judge_logprobs(groups, [2] * 8, gaps, tokens, [], drawn, list(range(8)))
        quarantined = {w for w, info in api.state.workers.items() if info.quarantined}
        assert quarantined == {forger}
        assert api.state.verifier.evidence[honest].mean_gap < 1e-3
        assert api.metric("echo_verify_claims_checked_total") == 8
        # The same evidence with no version kept (`stale_check_fraction = 0`): the drift alone judges.
        api.state.registry.judge_logprobs(groups[:6], [2] * 6, gaps[:6], tokens[:6], [])
        assert api.state.workers[honest].quarantined

    run_api(tokenizer, test, tmp_path, **{"verify.min_gap_tokens": 256})
