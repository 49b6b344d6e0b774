"""LoRA versions: what an adapter blob carries besides its tensors, shared by learner and workers.

In LoRA mode (`[trainer.lora]`) a version is the adapter alone: a safetensors blob of the LoRA
tensors under PEFT's names (`base_model.model.<module>.lora_A.weight`, so the blob *is* a PEFT
`adapter_model.safetensors`), whose `__metadata__` says

- `echo`: `ADAPTER_KIND`, so nothing installs it as full weights (nor full weights as an adapter);
- `base`: the digest of the frozen base's weight files (`base_digest`), so nothing installs it
  on another base;
- `rank`, `alpha`, `targets`: the adapter's shape;
- `probe`: the learner's log-probs of a fixed probe sequence (`probe_tokens`) under this version,
  base and adapter together. A worker scores the same sequence after loading and must agree
  within its dtype's tolerance before it takes work with the version: an adapter that did not
  load, or loaded wrong, or sits on another base, cannot pass (for the initial adapter, B = 0,
  the probe equals the base's, and so does a worker that loaded nothing: the two are the same
  function).

The metadata has a fixed width (every probe value is written with `PROBE_FORMAT`), so the
header, and with it the whole byte layout, is the same in every version: XOR deltas apply as on
full snapshots. The blob is signed (chain) or checked by sha256 (star) like any version.
"""

from __future__ import annotations

import contextlib
import json
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

from echo import dirfiles

ADAPTER_KIND = "echo-lora-adapter/1"
PROBE_LEN = 8  # prompt and completion tokens of the probe (the same as the full-snapshot probe)
PROBE_FORMAT = "{:+.9e}"  # fixed width: "+1.234567890e-05"
WEIGHT_SUFFIXES = (".safetensors", ".bin")
MAX_HEADER = 1 << 24


def probe_tokens(vocab: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """The fixed probe: random tokens (they exercise the whole embedding and head), as prompt
    and completion of `PROBE_LEN` each."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2 * PROBE_LEN,), generator=g).tolist()
    return tokens[:PROBE_LEN], tokens[PROBE_LEN:]


def format_probe(values: list[float]) -> str:
    out = []
    for v in values:
        v = float(v)
        if v != v or abs(v) == float("inf"):
            v = -1e30  # a non-finite probe can match nothing real: fixed width still
        if abs(v) < 1e-30:
            v = 0.0
        out.append(PROBE_FORMAT.format(max(-9.9e30, min(9.9e30, v))))
    return ",".join(out)


def parse_probe(text: str) -> tuple[float, ...]:
    """`format_probe`'s values back; ValueError on anything else."""
    return tuple(float(x) for x in text.split(","))


WEIGHTS_KIND = "echo-weights/1"  # a full snapshot's `echo` metadata (its `probe`, `probe_dtype`)


def weights_metadata(probe: list[float], probe_dtype: str) -> dict[str, str]:
    """A full snapshot's metadata: the learner's probe log-probs for it, computed in `probe_dtype`
    (fixed width, so every version keeps one byte layout and deltas apply)."""
    # "format": transformers 4 refuses a safetensors file whose metadata names no framework (the export)
    return {"format": "pt", "echo": WEIGHTS_KIND, "probe": format_probe(probe), "probe_dtype": probe_dtype}


def read_weights_probe(blob) -> tuple[tuple[float, ...], str] | None:
    """A full snapshot's probe and the dtype it was computed in; None when it carries none (a
    learner before 2026-11-29, a snapshot written by hand) or is malformed."""
    try:
        meta = read_metadata(blob)
        if meta.get("echo") != WEIGHTS_KIND:
            return None
        probe, dtype = parse_probe(meta["probe"]), meta["probe_dtype"]
    except (NotAnAdapter, KeyError, ValueError, AttributeError):
        return None
    return (probe, dtype) if len(probe) == PROBE_LEN and dtype in ("float32", "bfloat16", "float16") else None


def base_digest(model_dir: Path) -> str:
    """sha256 over the base's weight files (name and sha256 of each, sorted): the same for any
    copy of the same checkpoint. Reads every weight byte once (about a minute for 16 GB)."""
    if not any(p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) for p in Path(model_dir).iterdir()):
        raise FileNotFoundError(f"{model_dir} has no weight files ({', '.join(WEIGHT_SUFFIXES)}): LoRA mode needs "
                                "the base model's weights")
    return dirfiles.digest(model_dir, only=lambda name: name.endswith(WEIGHT_SUFFIXES))


@dataclass(frozen=True)
class AdapterMeta:
    base: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    probe: tuple[float, ...]

    def metadata(self) -> dict[str, str]:
        return {"echo": ADAPTER_KIND, "base": self.base, "rank": str(self.rank), "alpha": repr(float(self.alpha)),
                "targets": ",".join(self.targets), "probe": format_probe(list(self.probe))}


class NotAnAdapter(ValueError):
    """A blob that is not an echo LoRA adapter (full weights, or unreadable)."""


def read_metadata(blob: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors blob ({} when it has none), from its header alone."""
    if len(blob) < 8:
        raise NotAnAdapter("blob shorter than a safetensors header")
    (n,) = struct.unpack("<Q", bytes(blob[:8]))
    if n > min(MAX_HEADER, len(blob) - 8):
        raise NotAnAdapter("bad safetensors header length")
    try:
        header = json.loads(bytes(blob[8 : 8 + n]))
    except ValueError as e:
        raise NotAnAdapter(f"unreadable safetensors header ({e})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def read_adapter_meta(blob: bytes) -> AdapterMeta:
    """The adapter's metadata, or `NotAnAdapter` saying why the blob is not one."""
    meta = read_metadata(blob)
    if meta.get("echo") != ADAPTER_KIND:
        raise NotAnAdapter(f"not an echo LoRA adapter (metadata echo={str(meta.get('echo'))[:40]!r}; "
                           f"full weights carry {WEIGHTS_KIND!r} or none)")
    try:
        return AdapterMeta(base=meta["base"], rank=int(meta["rank"]), alpha=float(meta["alpha"]),
                           targets=tuple(t for t in meta["targets"].split(",") if t),
                           probe=parse_probe(meta["probe"]))
    except (KeyError, ValueError) as e:
        raise NotAnAdapter(f"malformed adapter metadata ({type(e).__name__}: {e})") from None


def peft_name(param_name: str, adapter: str) -> str:
    """A LoRA parameter's name in PEFT's saved format: `model.layers.0.q_proj.lora_A.<adapter>.weight`
    of the injected model → `base_model.model.model.layers.0.q_proj.lora_A.weight`."""
    return "base_model.model." + param_name.replace(f".{adapter}.", ".")


def adapter_config(rank: int, alpha: float, targets: list[str] | tuple[str, ...], base: str = "") -> dict:
    """PEFT's `adapter_config.json` for this adapter (what vLLM and `PeftModel.from_pretrained` read)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": float(alpha),
            "target_modules": sorted(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
            "base_model_name_or_path": base, "inference_mode": True}


@contextlib.contextmanager
def quiet_peft():
    """Around PEFT's model wrapping: it asks transformers for a deprecated attribute, a
    FutureWarning on every LoRA run's console (learner and workers)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield
