"""The engine interface: load a model directory, install versions in place, generate groups.

The whole lifecycle is here; backends register by name in `ENGINES` and are imported only
when chosen, so a worker without vLLM never imports it.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from echo.hf import Sample

ENGINES = {
    "transformers": "worker.engines.transformers:TransformersEngine",
}


class EngineError(RuntimeError):
    """The engine cannot do what was asked (bad weights, missing backend); the message says why."""


@dataclass(frozen=True)
class GenerationParams:
    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    eos_id: int
    pad_id: int


class Engine(ABC):
    name: ClassVar[str]

    def __init__(self, model_dir: Path, device: str, dtype: str, threads: int, seed: int):
        self.model_dir, self.device, self.dtype, self.threads, self.seed = model_dir, device, dtype, threads, seed
        self.version = -1  # nothing installed yet: generate() refuses

    @abstractmethod
    def install(self, version: int, weights: bytes) -> None:
        """Replace the weights in place with a safetensors blob; refuse an incomplete one."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: GenerationParams) -> list[list[Sample]]:
        """A group of `params.n` samples per prompt, with per-token behaviour log-probs."""

    @abstractmethod
    def score(self, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
        """Teacher-forced log-probs of `completion` after `prompt` under the installed weights
        (used to check an install against the learner's own numbers for that version)."""

    def close(self) -> None:
        pass


def resolve_engine_type(kind: str, device: str) -> str:
    if kind != "auto":
        return kind
    try:
        import torch

        has_gpu = torch.cuda.is_available() and device in ("auto", "cuda") or device.startswith("cuda")
    except ImportError:
        has_gpu = False
    vllm_ready = "vllm" in ENGINES and importlib.util.find_spec("vllm") is not None
    return "vllm" if has_gpu and vllm_ready else "transformers"


def make_engine(kind: str, model_dir: Path, device: str, dtype: str, threads: int, seed: int) -> Engine:
    kind = resolve_engine_type(kind, device)
    if kind not in ENGINES:
        raise EngineError(f"unknown engine {kind!r}; choose one of: auto, {', '.join(ENGINES)}")
    module, _, cls = ENGINES[kind].partition(":")
    try:
        engine_cls = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise EngineError(f"engine {kind!r} is not installed ({e}); install the extra: pip install '.[{kind}]'") from e
    return engine_cls(model_dir, device, dtype, threads, seed)
