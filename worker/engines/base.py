"""The engine interface: load a model directory, install versions in place, generate groups.

The whole lifecycle is here; backends register by name in `ENGINES` and are imported only
when chosen, so a worker without vLLM never imports it.

Version contract (what the rollout loop relies on to stamp trajectories):

- `install(v, blob)` either makes every later `generate` run on exactly snapshot `v` and sets
  `version = v`, or raises `EngineError`. A snapshot that does not match the model (a missing,
  extra or misshapen tensor) is refused *before* anything is touched, so the engine keeps its
  previous version and can go on generating.
- `generate` runs entirely on the weights present when it started. The worker reads
  `engine.version` before calling it and stamps the whole batch with that number.
- `install` is never called while `generate` runs: the rollout loop installs between two
  batches. Engines enforce this (`EngineBusy`) instead of trusting it, because a violation
  would silently mix two versions in one batch.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import struct
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from echo.hf import Sample
from echo.lora import PROBE_LEN, AdapterMeta, NotAnAdapter, base_digest, probe_tokens, read_adapter_meta
from echo.protocol import LoraInfo

if TYPE_CHECKING:
    import torch

ENGINES = {
    "transformers": "worker.engines.transformers:TransformersEngine",
    "vllm": "worker.engines.vllm:VLLMEngine",
}


class EngineError(RuntimeError):
    """The engine cannot do what was asked (bad weights, missing backend); the message says why."""


class SnapshotMismatch(EngineError):
    """A snapshot's tensors do not match the model; nothing was installed, the old version stays."""


class InstallVerificationError(EngineError):
    """The engine's log-probs after an install disagree with the trainer's for that snapshot."""


class EngineBusy(EngineError):
    """`install` was called while `generate` ran (the rollout loop must install between batches)."""


@dataclass(frozen=True)
class GenerationParams:
    n: int  # samples per prompt (a group)
    max_new_tokens: int
    temperature: float  # 0: greedy (log-probs then at temperature 1)
    top_p: float
    stop_ids: tuple[int, ...]  # every end-of-turn id: ends a sample and is kept in it; none: no end (benchmarks)
    pad_id: int


class Engine(ABC):
    name: ClassVar[str]

    def __init__(self, model_dir: Path, device: str, dtype: str, threads: int, seed: int,
                 lora: LoraInfo | None = None):
        self.model_dir, self.device, self.dtype, self.threads, self.seed = model_dir, device, dtype, threads, seed
        self.lora = lora  # LoRA mode: `model_dir` holds the base's weights, versions are adapters (`echo.lora`)
        self.version = -1  # nothing installed yet: generate() refuses
        self._busy = threading.Lock()  # held by generate and install: the two never overlap
        # The run's sampling (temperature, top-p), told by the worker at join: an engine whose
        # sampler is its own (vLLM) proves after each install that it samples μ at exactly these.
        self.sampling: tuple[float, float] = (1.0, 1.0)

    @abstractmethod
    def install(self, version: int, weights: bytes) -> None:
        """Replace the weights in place with a safetensors blob; refuse an incomplete one."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: GenerationParams) -> list[list[Sample]]:
        """A group of `params.n` samples per prompt, with per-token behaviour log-probs: those of
        the distribution actually sampled from (temperature-scaled, top-p renormalised)."""

    @abstractmethod
    def score(self, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
        """Teacher-forced log-probs of `completion` after `prompt` under the installed weights
        (used to check an install against the learner's own numbers for that version)."""

    def close(self) -> None:
        pass

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """Run `what` (install or generate) alone; a second caller fails instead of waiting."""
        if not self._busy.acquire(blocking=False):
            raise EngineBusy(f"{self.name} engine: {what} called while another install/generate runs; "
                             "install snapshots between generation batches (see worker/rollout.py)")
        try:
            yield
        finally:
            self._busy.release()


# --- snapshots: parsing, checking, and the trainer's reference numbers ---------------------------

#: safetensors' dtype names (https://github.com/huggingface/safetensors, the format's header).
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def load_snapshot(version: int, weights) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors blob as views of its bytes (no copy), or `SnapshotMismatch`
    saying why it is unreadable. A version arrives in the relay's buffer, and the worker used to
    copy it (`bytes()`) and then have safetensors copy each tensor out: at 8B, 16 GB of store, 16
    of copy and 16 of tensors at once on a consumer machine's RAM (+2.0x the snapshot measured,
    `worker/bench/install_memory.py`). The engines only read the tensors (copied into their own
    weights), so views are enough."""
    import torch

    view = memoryview(weights).cast("B")
    try:
        (n,) = struct.unpack("<Q", view[:8])
        if n > len(view) - 8:
            raise ValueError(f"a header of {n} B in a blob of {len(view)} B")
        header, base = json.loads(bytes(view[8:8 + n])), 8 + n
        state = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = getattr(torch, _DTYPES[entry["dtype"]])
            shape, (begin, end) = [int(d) for d in entry["shape"]], entry["data_offsets"]
            count = math.prod(shape)
            if not 0 <= begin <= end <= len(view) - base or end - begin != count * dtype.itemsize:
                raise ValueError(f"{name}: bytes {begin}..{end} do not hold {shape} of {entry['dtype']}")
            with warnings.catch_warnings():  # a bytes blob is read-only; nothing writes these tensors
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(view, dtype=dtype, count=count, offset=base + begin) if count else \
                    torch.empty(0, dtype=dtype)
            state[name] = flat.reshape(shape)
        return state
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, struct.error) as e:
        raise SnapshotMismatch(f"snapshot v{version} is not a readable safetensors blob ({type(e).__name__}: {e}); "
                               "refusing to install") from e


def check_snapshot(version: int, state: Mapping[str, torch.Tensor], expected: Mapping[str, Sequence[int]],
                   current: int) -> None:
    """Refuse a snapshot whose tensor names or shapes differ from the model's.

    `expected` maps every state-dict name of the model (as the trainer's `snapshot()` writes
    them, tied heads included) to its shape. Checked before any weight is touched, so a refused
    snapshot leaves the engine on `current`.
    """
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise SnapshotMismatch(f"snapshot v{version} does not match the model: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}; refusing to install (the engine keeps v{current}). "
                               "Was it published for another model directory?")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise SnapshotMismatch(f"snapshot v{version}: {name} has shape {tuple(tensor.shape)}, model expects "
                                   f"{tuple(expected[name])}; refusing to install (the engine keeps v{current})")


# --- LoRA versions: an adapter on the base, proved live by the learner's probe -------------------

#: Mean |engine − learner| log-prob over the probe tokens an installed adapter may show. The
#: learner computes the probe with the very adapter it publishes; fp32 agrees to ~1e-6 with the
#: same code (transformers), half precision only to its rounding.
LORA_PROBE_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.05}


def adapter_tolerance(own: float, lora: LoraInfo) -> float:
    """The probe tolerance of an adapter install: the engine's own (`own`, for its dtype), or the
    half-precision one when the learner computed the probe in half precision (`probe_dtype`): a
    bf16 learner's probe differs from an fp32 engine's by bf16 rounding (~1e-2 per token), and
    an fp32 tolerance would refuse every version, v0 included, while the run waits for rollouts."""
    return own if lora.probe_dtype == "float32" else max(own, LORA_PROBE_TOLERANCE[lora.probe_dtype])


def check_base(model_dir: Path, lora: LoraInfo) -> None:
    """Refuse to serve a LoRA run on a base other than the learner's (`echo.lora.base_digest`)."""
    try:
        digest = base_digest(model_dir)
    except FileNotFoundError as e:
        raise EngineError(f"LoRA run: {e}; set [engine] base_dir to a copy of the learner's base model") from None
    if digest != lora.base_sha256:
        raise EngineError(f"LoRA run: the base weights in {model_dir} digest to {digest[:16]}…, the learner trains on "
                          f"{lora.base_sha256[:16]}…; adapters would run on the wrong model. Point [engine] base_dir "
                          "at the learner's base model")


def check_adapter(version: int, weights: bytes, lora: LoraInfo, current: int) -> AdapterMeta:
    """The metadata of adapter `version`, or `SnapshotMismatch`: not an adapter (full weights in
    a LoRA run), another base, or another rank, scale or set of target modules."""
    try:
        meta = read_adapter_meta(weights)
    except NotAnAdapter as e:
        raise SnapshotMismatch(f"v{version} is not a LoRA adapter of this run ({e}); refusing to install "
                               f"(the engine keeps v{current})") from None
    if meta.base != lora.base_sha256:
        raise SnapshotMismatch(f"adapter v{version} was trained on base {meta.base[:16]}…, this engine holds "
                               f"{lora.base_sha256[:16]}…; refusing to install (the engine keeps v{current})")
    if (meta.rank, meta.alpha, sorted(meta.targets)) != (lora.rank, lora.alpha, sorted(lora.target_modules)):
        raise SnapshotMismatch(f"adapter v{version} has rank {meta.rank}, alpha {meta.alpha}, targets "
                               f"{sorted(meta.targets)}; the run announced rank {lora.rank}, alpha {lora.alpha}, "
                               f"targets {sorted(lora.target_modules)}; refusing (the engine keeps v{current})")
    if len(meta.probe) != PROBE_LEN:
        raise SnapshotMismatch(f"adapter v{version} carries {len(meta.probe)} probe values, not {PROBE_LEN}")
    return meta


def probe_error(got: Sequence[float], meta: AdapterMeta) -> float:
    """Mean |engine − learner| over the probe tokens (NaN-propagating: `not error <= tol` refuses NaN)."""
    return sum(abs(a - b) for a, b in zip(got, meta.probe, strict=True)) / len(meta.probe)


class Reference:
    """The trainer's own log-probs for a snapshot, to check what an engine computes from it.

    Built from the model directory's config alone. `expected` lists the state-dict names and
    shapes a snapshot must have (from a model on the meta device: no memory). `logprobs`
    wraps the snapshot's tensors in a transformers model without copying them (tied heads
    tied, as in the trainer) and runs `echo.hf.completion_logprobs`, the trainer's π.
    """

    PROBE_LEN = PROBE_LEN  # prompt and completion tokens of the probe

    def __init__(self, model_dir: Path, seed: int = 0):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        self.config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.config)
        self.expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
        self.model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(self.config)]
        vocab = skeleton.get_output_embeddings().weight.shape[0]
        # A fixed probe: random tokens exercise the whole embedding and head, not one corner.
        self.probe = probe_tokens(vocab, seed)

    def logprobs(self, state: Mapping[str, torch.Tensor], prompt: list[int], completion: list[int],
                 temperature: float = 1.0, top_p: float = 1.0) -> list[float]:
        import torch

        from echo.hf import completion_logprobs

        dtype = next(t.dtype for t in state.values() if t.is_floating_point())
        model = self.model_cls.from_pretrained(None, config=self.config, state_dict=dict(state), dtype=dtype).eval()
        with torch.no_grad():
            logp, _ = completion_logprobs(model, [prompt], [completion], pad_id=0, temperature=temperature,
                                          top_p=top_p)
        return logp[0, : len(completion)].float().tolist()


def mismatch_kl(behaviour: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> float:
    """E_μ[log μ − log π]: the mean over tokens of engine minus trainer log-probs for the same
    tokens and version (`mismatch_kl` of the run log; ≈0 when engine and trainer agree)."""
    diffs = [b - t for bs, ts in zip(behaviour, trainer, strict=True) for b, t in zip(bs, ts, strict=True)]
    return sum(diffs) / max(1, len(diffs))


# --- choosing an engine --------------------------------------------------------------------------

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


def check_engine_here(kind: str, device: str) -> None:
    """`EngineError` if this machine cannot run engine `kind` on `device`: said before the worker
    joins, not as a traceback after it joined and fetched the model."""
    kind = resolve_engine_type(kind, device)
    if kind not in ENGINES:
        raise EngineError(f"unknown engine {kind!r}; choose one of: auto, {', '.join(ENGINES)}")
    if kind == "vllm" and importlib.util.find_spec("vllm") is None:
        raise EngineError("engine.type = 'vllm' but vllm is not installed in this Python; create its venv with "
                          "`make vllm-venv` and run .venv-vllm/bin/echo-worker, or use --engine.type transformers")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise EngineError(f"engine.device = {device!r} but this torch ({torch.__version__}) sees no CUDA GPU; "
                              "use --engine.device auto (or cpu), or install a CUDA build of torch")


def make_engine(kind: str, model_dir: Path, device: str, dtype: str, threads: int, seed: int,
                lora: LoraInfo | None = None) -> Engine:
    kind = resolve_engine_type(kind, device)
    if kind not in ENGINES:
        raise EngineError(f"unknown engine {kind!r}; choose one of: auto, {', '.join(ENGINES)}")
    module, _, cls = ENGINES[kind].partition(":")
    try:
        engine_cls = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        hint = ("create its venv with `make vllm-venv` and run .venv-vllm/bin/echo-worker"
                if kind == "vllm" else f"install the extra: pip install '.[{kind}]'")
        raise EngineError(f"engine {kind!r} is not installed ({e}); {hint}") from e
    if lora is not None:
        check_base(model_dir, lora)
    return engine_cls(model_dir, device, dtype, threads, seed, lora=lora)
