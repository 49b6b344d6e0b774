"""The run directory: what a run keeps on disk so it can be read, and resumed.

    config.toml   the resolved config (`--resume` takes it as the base config)
    token         the run token (a resumed run keeps it, so running workers can join it again)
    machine.key   the secret machine tokens are keyed by (`scheduler.providers.machine_token`);
                  no worker is given it, and a resumed run keeps it
    url           the control API's address (a resumed run binds the same port: workers come back)
    checkpoints/  `latest` and `step-N`, N the update (learner.train.trainer)
    ledger.jsonl, metrics.jsonl, summary.json, workers/, model/
"""

from __future__ import annotations

import json
import os
import secrets
from datetime import datetime
from pathlib import Path

from echo.config import dump_toml
from learner.config import LearnerConfig


class RunDir:
    def __init__(self, cfg: LearnerConfig, resume: Path | None = None):
        self.resumed = resume is not None
        self.path = resume or cfg.run.dir / f"{cfg.run.name}-{datetime.now():%Y%m%d-%H%M%S}"
        saved = self.path / "token"
        self.token = cfg.server.token or os.environ.get("ECHO_TOKEN", "") or (
            saved.read_text().strip() if resume and saved.exists() else cfg.resolve_token())
        key = self.path / "machine.key"
        self.machine_key = key.read_text().strip() if resume and key.exists() else secrets.token_hex(32)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def __str__(self) -> str:
        return str(self.path)

    def create(self, cfg: LearnerConfig) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.toml").write_text(dump_toml(cfg))
        for name, secret in (("token", self.token), ("machine.key", self.machine_key)):
            path = self.path / name
            path.touch(0o600)  # never readable by others, not even between the write and a chmod
            path.chmod(0o600)
            path.write_text(secret + "\n")

    def port(self, configured: int) -> int:
        """The port to bind: a resumed run on a free port takes the one it had. A fresh run on a
        free port takes one below the kernel's ephemeral range: a port the kernel hands out for
        outgoing connections may be some client's local port when the run resumes, and the
        resumed learner could not bind it."""
        url = self.path / "url"
        if self.resumed and configured == 0 and url.exists():
            return int(url.read_text().strip().rsplit(":", 1)[1])
        return configured or free_port_below_ephemeral()

    def announce(self, url: str) -> None:
        """Write the URL workers join at, whole or not at all: whoever polls for the file (a
        script starting workers, the tests) read it empty mid-write and joined "" (CI, 2026-11-27)."""
        tmp = self.path / "url.tmp"
        tmp.write_text(url + "\n")
        os.replace(tmp, self.path / "url")

    def hold(self) -> str | None:
        """Hold the run directory for this process (released when it exits, however it exits);
        None when it is ours, else who holds it: a second learner resumed on a live run
        directory on another port overwrote its url and raced its checkpoints (a new user)."""
        import fcntl

        self.path.mkdir(parents=True, exist_ok=True)
        lock = (self.path / "learner.lock").open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            return holder
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}\n")
        lock.flush()
        self._lock = lock  # held while this object (the run) lives
        return None

    def checkpoint(self) -> Path | None:
        """The checkpoint a resumed run starts from (None: a fresh run, or none was saved)."""
        return latest_checkpoint(self.path) if self.resumed else None


def latest_checkpoint(run_dir: Path) -> Path | None:
    latest = run_dir / "checkpoints" / "latest"
    return latest.resolve() if latest.exists() else None


def updates_of(checkpoint: Path) -> int:
    """The update a checkpoint was saved at: its learner state says (one saved before 2026-11-28
    is named by its version, which a resume puts ahead of the updates), else its name."""
    try:
        return int(json.loads((checkpoint / "learner_state.json").read_text())["updates"])
    except (OSError, ValueError, KeyError, TypeError):
        return int(checkpoint.name[5:])


def nothing_to_train(run_dir: Path, steps: int) -> tuple[int, bool] | None:
    """Where `run_dir`'s checkpoint already holds `steps` updates or more: (those updates, whether
    the run finished: its summary.json exists). A `--resume` then trains nothing: a finished run
    says so, an interrupted one is refused (it re-saved the checkpoint and wrote a summary of zero
    groups and the steps into its config). Read from disk, before a model loads."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return None
    updates = updates_of(checkpoint)
    return (updates, (run_dir / "summary.json").exists()) if updates >= steps else None


def port_in_use(host: str, port: int) -> bool:
    """Is `host:port` bound by another process now (as the control API would bind it)?"""
    import errno
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as e:
        return e.errno == errno.EADDRINUSE
    return False


def free_port_below_ephemeral(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A port free now, outside the range the kernel picks outgoing connections' ports from
    (0: let the kernel choose, if none is found)."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    if low <= 10000:
        return 0
    for port in random.sample(range(10000, low), min(tries, low - 10000)):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    return 0
