"""Shared fixtures: a tiny model built locally, and real learner/worker processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Every learner and worker the tests start reports event-loop callbacks over 100 ms
# (echo.loopwatch); `learner_factory` fails the test on any.
WATCHED = {**os.environ, "ECHO_SLOW_CALLBACK_MS": "100", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A small Qwen2-architecture model + character tokenizer, warm-started on arith (~2 s)."""
    import torch

    from echo.tasks import load_task
    from learner.tinymodel import build_model, build_tokenizer, warm_start

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("model")
    tok = build_tokenizer()
    model = build_model(tok, hidden=64, layers=1, seed=0)
    task = load_task("arith", {})
    warm_start(model, tok, task.warmup_examples(256, seed=1), steps=10, lr=3e-3, batch=32, seed=0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    """A small Qwen2-architecture model with a byte-level tokenizer and a Qwen-style chat
    template: a turn ends on <|im_end|>, which is not the eos (untrained: episodes are noise)."""
    import torch

    from learner.tinymodel import build_chat_tokenizer, build_model

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("chat-model")
    tok = build_chat_tokenizer()
    build_model(tok, hidden=64, layers=1, heads=2, seed=0, positions=1024).save_pretrained(out)  # head_dim 32: vLLM CPU
    tok.save_pretrained(out)
    return out


async def closed_of(host: str, port: int, n: int) -> int:
    """Open `n` idle connections to a server and count those it closed as they opened (its
    per-address connection limit); the rest are closed here afterwards."""
    import asyncio

    held = [await asyncio.open_connection(host, port) for _ in range(n)]
    await asyncio.sleep(0.3)
    closed = 0
    for reader, _ in held:
        try:
            closed += await asyncio.wait_for(reader.read(1), 0.05) == b""
        except asyncio.TimeoutError:
            pass
    for _, writer in held:
        writer.close()
    return closed


def toml_value(v) -> str:
    """A TOML value: JSON's spelling for scalars and lists, an inline table for a dict."""
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return json.dumps(v)


def write_config(path: Path, model: Path, run_dir: Path, **sections: dict) -> Path:
    base = {
        "run": {"name": "t", "dir": str(run_dir), "steps": 6, "eval_every": 0, "checkpoint_every": 0},
        "model": {"path": str(model)},
        "task": {"name": "arith"},
        "rollout": {"group_size": 4, "max_new_tokens": 4},
        "trainer": {"batch_prompts": 4},
        # The 10-step warm-started test model answers most prompts all wrong: dynamic sampling would skip
        # those groups and a 6-step test would wait for minutes. Its own tests turn it on.
        "buffer": {"max_staleness": 1, "dynamic_sampling": False},
        "publish": {"every": 1},
        "eval": {"limit": 16, "final_timeout_s": 30},
        "server": {"port": 0, "token": "test-token-0123456789", "lease_ttl": 3.0, "heartbeat_interval": 0.5},
        "workers": {"spawn": 0},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    lines = []
    for name, values in base.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def sigint_as_at_a_terminal() -> None:
    """A `preexec_fn`: SIGINT at its default, as for a learner started from a terminal. A suite
    started in the background (`make test-slow &`) has SIGINT ignored, and its children inherit
    that: the two-rank SIGINT test failed there only."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class LearnerProcess:
    def __init__(self, config: Path, run_root: Path, token: str = "test-token-0123456789"):
        self.token = token
        self.run_root = run_root
        self.log = open(run_root.parent / "learner.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "learner.main", "--config", str(config), "--json"],
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=WATCHED,
                                     preexec_fn=sigint_as_at_a_terminal)
        deadline = time.monotonic() + 60
        while not list(run_root.glob("*/url")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"learner did not start:\n{self.output()}")
            time.sleep(0.1)
        self.run_dir = next(run_root.glob("*/url")).parent
        self.url = (self.run_dir / "url").read_text().strip()

    def finished(self, timeout: float) -> int:
        """The learner's exit code, waiting at most `timeout` s. A learner still running then fails
        the test with its log's tail and each worker's: CI hands back only the test's output."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logs = [self.run_root.parent / "learner.log",
                    *sorted(p for p in self.run_root.parent.glob("*.log") if p.name != "learner.log")]
            tails = "\n".join(f"--- {p.name} (last 2,500 chars) ---\n{p.read_text(errors='replace')[-2500:]}"
                               for p in logs)
            raise AssertionError(f"the learner did not finish within {timeout:g} s\n{tails}") from None

    def output(self) -> str:
        self.log.flush()
        return (self.run_root.parent / "learner.log").read_text()

    def request(self, method: str, path: str, body: bytes | dict | None = None, token: str | None = "default",
                content_type: str = "application/json") -> tuple[int, dict | str]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if token is not None:
            req.add_header("Authorization", f"Bearer {self.token if token == 'default' else token}")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                raw, status = resp.read(), resp.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw) if raw else {}
        except ValueError:
            return status, raw.decode(errors="replace")

    def join(self, name: str = "probe", **report) -> tuple[str, str]:
        """Join as a hand-driven worker: (worker id, credential for `request(..., token=credential)`)."""
        joined = self.join_reply(name, **report)
        return joined["worker_id"], joined["credential"]

    def join_reply(self, name: str = "probe", **report) -> dict:
        """Join as a hand-driven worker: the whole join reply (its broadcast info too)."""
        status, joined = self.request("POST", "/v1/join", {"name": name, **report})
        assert status == 200, joined
        return joined

    def status(self) -> dict:
        return self.request("GET", "/v1/status")[1]

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line] if path.exists() else []

    def wait_until(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.output()[-3000:]}")
            for w in getattr(self, "workers", []):
                if (w.poll() or 0) > 0:  # a crash; tests kill workers with signals on purpose
                    raise AssertionError(f"a worker died ({w.returncode}) before {what}: {w.args}")
            if self.proc.poll() is not None and not predicate():
                raise AssertionError(f"learner exited ({self.proc.returncode}) before {what}\n{self.output()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def machine_token(run_dir: Path, machine: str) -> str:
    import tomllib

    return tomllib.loads((run_dir / "machine-tokens.toml").read_text())["tokens"][machine]


def start_worker(url: str, token: str, name: str, log: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "worker.main", "join", url, "--token", token, "--config", "configs/worker.toml",
           "--worker.name", name, "--worker.cache_dir", str(log.parent / "cache"), *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=WATCHED)


@pytest.fixture
def learner_factory(tmp_path, tiny_model):
    started: list[tuple[LearnerProcess, list[subprocess.Popen]]] = []

    def make(model: Path | None = None, **sections) -> LearnerProcess:
        config = write_config(tmp_path / f"learner{len(started)}.toml", model or tiny_model,
                              tmp_path / f"runs{len(started)}", **sections)
        lp = LearnerProcess(config, tmp_path / f"runs{len(started)}")
        lp.workers = []
        lp.worker = lambda name, *o: lp.workers.append(
            start_worker(lp.url, lp.token, name, tmp_path / f"{name}.log", *o)) or lp.workers[-1]
        # A static pool's machine joins with its own token (RUN_DIR/machine-tokens.toml), which binds it to its entry.
        lp.machine = lambda name, *o: lp.workers.append(
            start_worker(lp.url, machine_token(lp.run_dir, name), name, tmp_path / f"{name}.log", *o)) or lp.workers[-1]
        started.append(lp)
        return lp

    yield make
    for lp in started:
        lp.stop()
        for w in lp.workers:
            if w.poll() is None:
                w.kill()
    slow = [line for path in [*tmp_path.glob("*.log"), *tmp_path.glob("runs*/*/workers/*.log")]
            for line in path.read_text(errors="replace").splitlines() if "SLOW CALLBACK" in line]
    assert not slow, "event-loop callbacks over 100 ms:\n" + "\n".join(slow[:10])


def worker_pass(issuer, holder: str) -> dict:
    """A worker's read ticket and the proof key it names, as the learner gives them: keyword
    arguments of `Relay`. `issuer`: the learner's `TicketOffice` or its `SigningKey`."""
    from broadcast.tickets import TicketOffice, issue, proof_key

    key = proof_key(holder.encode())
    ticket = (issuer.issue(holder, key.public_key()) if isinstance(issuer, TicketOffice)
              else issue(issuer, holder, proof=key.public_key()))
    return {"read_token": ticket, "proof_key": key}
