"""Providers bring machines up and down when the controller activates or releases them.

- `static`: nothing to do; only workers that joined by themselves are used.
- `local`: a worker process on this machine per candidate, throttled to the pool's declared
  rollouts/s and announcing the pool's price (the demo and tests).
- `command`: user-given shell commands, e.g. a cloud CLI (`launch_command = "mycloud up
  --name {id} --gpu '{gpu}' -- echo-worker join {url} --token {token}"`).
- `vast`: Vast.ai through its `vastai` SDK: live offers are the candidates (`scheduler.vast`).
- `skypilot`: SkyPilot's Python SDK (RunPod, Lambda, Vast, clouds; `scheduler.sky`).

A machine a provider brings up joins with its own **machine token** (`machine_token`: an HMAC of
the machine id under the run's machine key, a secret the learner keeps in `RUN_DIR/machine.key`
and no worker is given), which binds it to its pool entry: the pool's price and rate are the
operator's word, so a worker that merely names itself after a pool machine gets neither. Keyed
by the run token, which every worker holds, any worker could mint any machine's token.
Machines of a `static` pool (brought up by the operator) take theirs from `RUN_DIR/machine-tokens.toml`.

The `[scheduler.provider]` table picks one (`make_provider` is the one place a kind becomes
a provider); the fleet asks only what a provider can do (`launches_machines`,
`releases_machines`), never which kind it is. A provider never blocks the learner: commands
run as background processes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from echo.procs import die_with_parent
from echo.protocol import valid_name
from scheduler.config import (CommandProviderConfig, LocalProviderConfig, ProviderConfig, SkyProviderConfig,
                              StaticProviderConfig, VastProviderConfig)


MACHINE_PREFIX = "machine:"


def machine_token(machine_key: str, machine_id: str) -> str:
    """The token machine `machine_id` joins with: it proves the learner (or its provider) handed
    it out for that machine, and cannot be turned into another machine's. `machine_key`: the
    run's secret (`learner.rundir.RunDir.machine_key`), never the run token."""
    mac = hmac.new(machine_key.encode(), machine_id.encode(), hashlib.sha256).hexdigest()[:32]
    return f"{MACHINE_PREFIX}{machine_id}:{mac}"


def machine_of(machine_key: str, presented: str) -> str | None:
    """The machine id a presented machine token is valid for, or None. An id a worker's name
    could not be (`echo.protocol.Name`: 64 characters, no control or format characters) is none:
    the id becomes the worker's name in the log and the status."""
    if not presented.startswith(MACHINE_PREFIX):
        return None
    machine_id = presented[len(MACHINE_PREFIX):].rpartition(":")[0]
    if not machine_id or not valid_name(machine_id):
        return None
    return machine_id if hmac.compare_digest(machine_token(machine_key, machine_id), presented) else None


@dataclass(frozen=True)
class Machine:
    id: str
    gpu: str
    price_per_hour: float
    rollouts_per_s: float
    down_mbps: float = 0.0  # what the offer (or pool entry) says; 0 = unknown
    up_mbps: float = 0.0
    dollars_per_gb_down: float = 0.0  # bandwidth the market bills
    dollars_per_gb_up: float = 0.0
    interruptible: bool = False


class Provider:
    kind = "static"
    launches_machines = False  # launch() brings a machine up (else only self-joined workers are used)
    releases_machines = False  # release() tears a machine down (so it must join again before it counts)

    def launch(self, machine: Machine) -> None:
        """Bring `machine` up; it joins the learner under its id as name."""

    def release(self, machine: Machine) -> None:
        """Tear `machine` down (a released local worker just idles, so it can be reactivated)."""

    def close(self) -> None:
        """Stop everything this provider started."""

    def offers(self) -> list[Machine] | None:
        """The machines a market offers now (candidates come and go); None: the pool file's."""
        return None

    def poll(self) -> list[tuple[str, str]]:
        """(machine id, why) of machines lost since the last call (preempted, offer vanished)."""
        return []

    def abandon(self, machine: Machine, reason: str) -> bool:
        """A launched machine never joined: give it up. True: it is gone for good (forget it);
        False (the default): it stays a candidate that counts as unavailable."""
        return False


class LocalProvider(Provider):
    kind = "local"
    launches_machines = True

    def __init__(self, url: str, machine_key: str, worker_config: Path, log_dir: Path, overrides: list[str],
                 python: str = sys.executable):
        self.url, self.machine_key, self.worker_config, self.python = url, machine_key, worker_config, python
        self.log_dir, self.overrides = log_dir, overrides
        self.procs: dict[str, subprocess.Popen] = {}

    def launch(self, machine: Machine) -> None:
        if machine.id in self.procs and self.procs[machine.id].poll() is None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [self.python, "-m", "worker.main", "join", self.url,
               "--config", str(self.worker_config), "--worker.name", machine.id,
               "--worker.price_per_hour", repr(machine.price_per_hour),
               "--worker.max_rollouts_per_s", repr(machine.rollouts_per_s), "--worker.gpu", machine.gpu,
               *self.overrides]
        log = open(self.log_dir / f"{machine.id}.log", "a")
        # The token in the environment, not on the command line, where any user of the machine reads it (ps)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "ECHO_TOKEN": machine_token(self.machine_key, machine.id)}
        # It ends with the learner, even a learner killed with SIGKILL: else it retried forever and,
        # after `--resume`, fought the new worker of its machine's name for its identity.
        self.procs[machine.id] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                  preexec_fn=die_with_parent())

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


class CommandProvider(Provider):
    kind = "command"
    launches_machines = True
    releases_machines = True

    def __init__(self, launch_command: str, release_command: str, url: str, machine_key: str, log_dir: Path):
        if not launch_command:
            raise ValueError("[scheduler] provider = 'command' needs launch_command (and usually release_command)")
        self.launch_command, self.release_command = launch_command, release_command
        self.url, self.machine_key, self.log_dir = url, machine_key, log_dir
        self.procs: list[subprocess.Popen] = []

    def _run(self, template: str, machine: Machine, what: str) -> None:
        fields = {"id": machine.id, "gpu": machine.gpu, "price": machine.price_per_hour,
                  "rate": machine.rollouts_per_s, "url": self.url, "token": machine_token(self.machine_key, machine.id)}
        command = template.format(**{k: shlex.quote(str(v)) for k, v in fields.items()})
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{machine.id}.{what}.log", "a")
        self.procs.append(subprocess.Popen(command, shell=True, stdout=log, stderr=subprocess.STDOUT))

    def launch(self, machine: Machine) -> None:
        self._run(self.launch_command, machine, "launch")

    def release(self, machine: Machine) -> None:
        if self.release_command:
            self._run(self.release_command, machine, "release")


def make_provider(spec: ProviderConfig, *, url: str, machine_key: str, log_dir: Path, worker_config: Path,
                  worker_overrides: list[str], python: str = sys.executable) -> Provider:
    """The provider `[scheduler.provider]` names, wired to the learner at `url`; each machine's
    output goes to `log_dir`. `worker_config`, `worker_overrides` and `python` start a local worker."""
    match spec:
        case LocalProviderConfig():
            return LocalProvider(url, machine_key, worker_config, log_dir, worker_overrides, python=python)
        case CommandProviderConfig():
            return CommandProvider(spec.launch_command, spec.release_command, url, machine_key, log_dir)
        case StaticProviderConfig():
            return Provider()
        case VastProviderConfig():
            from scheduler.market import MarketProvider
            from scheduler.vast import VastMarket

            market = VastMarket(gpus=spec.gpus, query=spec.query, image=spec.image, disk_gb=spec.disk_gb,
                                interruptible=spec.interruptible, bid_margin=spec.bid_margin, limit=spec.max_offers,
                                api_url=spec.api_url, api_key=os.environ.get(spec.api_key_env))
            return MarketProvider(market, url=spec.learner_url or url, machine_key=machine_key, gpus=spec.gpus,
                                  onstart=spec.onstart, refresh_s=spec.refresh_s)
        case SkyProviderConfig():
            from scheduler.market import MarketProvider
            from scheduler.sky import SkyMarket

            market = SkyMarket(gpus=spec.gpus, prices=spec.prices, clouds=spec.clouds, image=spec.image,
                               disk_gb=spec.disk_gb, use_spot=spec.use_spot, per_gpu=spec.per_gpu_count,
                               dollars_per_gb=spec.dollars_per_gb)
            return MarketProvider(market, url=spec.learner_url or url, machine_key=machine_key, gpus=spec.gpus,
                                  onstart=spec.onstart, refresh_s=spec.refresh_s)
    raise TypeError(f"unknown provider config {spec!r}")
