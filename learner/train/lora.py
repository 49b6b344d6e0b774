"""LoRA mode (`[trainer.lora]`): a PEFT adapter trained on the frozen base; versions are the adapter.

- The base is loaded in the compute dtype (bf16 on GPUs, fp32 in CPU tests), frozen: no
  gradient, no optimizer state. PEFT injects the LoRA layers into the HF model in place, so
  `Policy.hf` stays the HF model (`echo.hf` reaches `hf.base_model` and the head as before);
  the adapter's A and B are fp32 master weights (PEFT's `autocast_adapter_dtype`).
- The adapter starts as PEFT starts it (B = 0: the adapted model is the base), drawn from the
  run's seed (`init_adapter`), so one rank and N ranks train the same adapter.
- Only decoder-layer linears may carry an adapter: the chunked head (`echo.hf.head_logprobs`)
  reads `lm_head.weight` directly, and embeddings are the FSDP root's.
- A version (`adapter_blob`) is the adapter's tensors under PEFT's saved names with the
  metadata of `echo.lora` (kind, base digest, shape, and the probe log-probs of the version):
  same names, shapes and header width every version, so deltas apply.
- The run's end (`export_adapter`, `export_merged`): the adapter as a PEFT directory and the
  base with the adapter merged as an HF directory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from echo.lora import AdapterMeta, adapter_config, peft_name, quiet_peft

ADAPTER = "default"  # PEFT's name of the trained adapter


def inject(hf, lora, layers: list[torch.nn.Module]):
    """Add LoRA layers (`lora`: `learner.config.LoraSection`) to `hf` in place and freeze the rest;
    returns `hf`. Refuses targets outside the decoder layers."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    try:
        with quiet_peft():
            get_peft_model(hf, config, adapter_name=ADAPTER, autocast_adapter_dtype=True)
    except ValueError as e:  # PEFT: "Target modules ... not found in the base model"
        raise ValueError(f"[trainer.lora] target_modules {list(lora.target_modules)}: {e}") from None
    inside = {id(p) for layer in layers for p in layer.parameters()}
    outside = [n for n, p in hf.named_parameters() if "lora_" in n and id(p) not in inside]
    if outside:
        raise ValueError(f"[trainer.lora] target_modules reach outside the decoder layers ({outside[:3]}): only "
                         "the layers' linears may carry an adapter (the head and embeddings are read directly)")
    for name, p in hf.named_parameters():
        p.requires_grad_("lora_" in name)
    return hf


def init_adapter(hf, seed: int) -> None:
    """PEFT's initialisation of the adapter (`init_lora_weights=True`: A kaiming-uniform as an
    `nn.Linear`, B zeros), drawn from a generator seeded with `seed` in parameter order: the
    same adapter on every rank and for any rank count, whether the model was loaded whole or
    built on the meta device and sharded (`learner.train.load`), where PEFT's own draw is lost.
    Each rank draws every A whole (rank × in: small) and keeps its block."""
    from learner.train.load import write_whole

    generator = torch.Generator().manual_seed(seed)
    for name, p in hf.named_parameters():
        if "lora_A" in name:
            a = torch.empty(p.shape, dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            write_whole(p, a)
        elif "lora_B" in name:
            write_whole(p, torch.zeros(p.shape))
        elif "lora_" in name:
            raise ValueError(f"{name}: only LoRA's A and B are initialised here")


def adapter_parameters(hf) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's parameters in a stable order, named as PEFT saves them."""
    return [(peft_name(n, ADAPTER), p) for n, p in hf.named_parameters() if "lora_" in n]


def trainable_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def write_adapter_dir(directory: Path, blob: bytes, meta: AdapterMeta, base_name: str = "") -> Path:
    """A PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`) from a version's blob."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(
        adapter_config(meta.rank, meta.alpha, meta.targets, base_name), indent=2))
    (directory / "adapter_model.safetensors").write_bytes(blob)
    return directory


def export_merged(model_dir: Path, adapter_dir: Path, directory: Path, dtype: torch.dtype) -> Path:
    """The base with the adapter merged in (W + α/r·BA), saved as an HF directory in `dtype`.
    Merged in fp32 on the CPU, then cast: no rounding of the base before the sum."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with quiet_peft():
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.to(dtype).save_pretrained(directory)
    return Path(directory)
