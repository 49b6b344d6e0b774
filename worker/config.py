"""`echo-worker`'s configuration (`configs/worker.toml`), with dotted command-line overrides.

Sampling parameters and the task are not here: the learner sends them at join, so every
worker of a run generates from the same behaviour policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from echo.config import Section, load_config


class WorkerSection(Section):
    name: str = Field("", description="[worker] name: shown in the learner's status (default: host-pid)")
    prompts_per_lease: int = Field(4, ge=1, le=1024, description="[worker] prompts_per_lease: prompts generated together (a group of n samples each)")
    max_rollouts_per_s: float = Field(0.0, ge=0.0, description="[worker] max_rollouts_per_s: throttle to emulate a slower GPU (0: unthrottled)")
    price_per_hour: float = Field(0.0, ge=0.0, description="[worker] price_per_hour: declared $/h, used by the cost-aware scheduler")
    gpu: str = Field("", description="[worker] gpu: declared GPU kind (default: detected, or 'cpu')")
    download_mbit: float = Field(0.0, ge=0.0, description="[worker] download_mbit: declared download bandwidth (Mbit/s, 0: unknown)")
    upload_mbit: float = Field(0.0, ge=0.0, description="[worker] upload_mbit: declared upload bandwidth (Mbit/s, 0: unknown)")
    cache_dir: Path = Field(Path(".echo-cache"), description="[worker] cache_dir: where the model directory from the learner is kept")
    relay_host: str = Field("auto", description="[worker] relay_host: address this worker's broadcast relay binds to (chain mode); 'auto': this machine's address on its route to the learner (loopback for a learner on this machine), so the learner sees the relay where the worker connects from, unless a NAT lies between (the worker is then a leaf that pulls)")
    relay_port: int = Field(0, ge=0, le=65535, description="[worker] relay_port: relay port (0 = any free port)")
    advertise_url: str = Field("", description="[worker] advertise_url: URL other workers reach the relay at, when not http://relay_host:port (NAT, port forwarding)")
    relay_transport: Literal["aiohttp", "libp2p"] = Field(
        "aiohttp", description="[worker] relay_transport: how other relays push to this one: aiohttp (HTTP streams, "
        "the fastest) or libp2p (py-libp2p, peer ID from a fresh key; needs the p2p extra; it advertises "
        "p2p:/ip4/<relay_host>/tcp/<port>/p2p/<id>, so relay_host must be an IP other workers can dial)")
    seed: int = Field(0, description="[worker] seed: sampling seed (mixed with the worker id)")
    learner_timeout_s: float = Field(600.0, gt=0.0, description="[worker] learner_timeout_s: how long the worker waits for a learner that does not answer (restarting: loading a large checkpoint takes minutes) before it leaves")


class EngineSection(Section):
    type: Literal["auto", "transformers", "vllm"] = Field("auto", description="[engine] type: 'transformers', 'vllm', or 'auto' (vLLM when a GPU and vllm are present)")
    device: str = Field("auto", description="[engine] device: torch device ('cpu', 'cuda', 'auto')")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="[engine] dtype: weights and compute dtype")
    threads: int = Field(1, ge=1, le=256, description="[engine] threads: torch CPU threads")
    base_dir: Path | None = Field(None, description="[engine] base_dir: LoRA runs: a local copy of the learner's base model (an HF directory with its weights; checked by digest); unset: fetched from the learner (bases up to 2 GiB)")
    on_new_version: Literal["finish", "abort"] = Field("finish", description="[engine] on_new_version: a batch in flight when a newer version arrives is 'finish'ed and submitted stamped with the version that generated it, or 'abort'ed: its prompts go back to the learner for the new version")


class WorkerConfig(Section):
    worker: WorkerSection = WorkerSection()
    engine: EngineSection = EngineSection()


def load_worker_config(path: str | Path | None, overrides: list[str] | None = None) -> WorkerConfig:
    return load_config(WorkerConfig, path, overrides)
