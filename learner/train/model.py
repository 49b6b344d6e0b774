"""The model as the trainer holds it: an HF causal LM in fp32 master weights, wrapped so that
its forward *is* π, optionally checkpointed and sharded, and written out as snapshots.

- `Policy`: forward = log π of completion tokens (`echo.hf.policy_logprobs`): the head is
  applied in checkpointed chunks, so the batch's `[tokens, vocab]` logits never exist. As the
  FSDP root it owns embeddings, final norm and head; each decoder layer is its own unit.
- Always in eval mode: dropout off, because π must be the very function workers sample from.
- Loaded whole on one plain rank; sharded, built on the meta device, sharded, and each rank
  reads its own shards from the checkpoint (`learner.train.load`).
- `write_safetensors`: a snapshot gathered one tensor at a time into one preallocated
  buffer, never a second full copy of the model on any rank.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from echo.hf import TokenBatch, check_head, greedy_gaps, policy_logprobs, rank_terms
from learner.train.dist import World, full_tensor, shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def saved_dtype(model_dir: Path) -> str:
    """The dtype a model directory's weights were saved in (its config's `torch_dtype`)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
    return name if name in DTYPES else "float32"


class Policy(torch.nn.Module):
    """An HF causal LM whose forward returns log π of completion tokens (flat, row by row), or
    with `greedy` each token's logit gap to the best (`echo.hf.greedy_gaps`). Whatever it
    computes goes through this forward: with FSDP2 it is the root, whose hook gathers the
    embeddings and head."""

    def __init__(self, hf, *, temperature: float, top_p: float, chunk_tokens: int, greedy: bool = False):
        super().__init__()
        check_head(hf)
        self.hf = hf
        self.temperature, self.top_p, self.chunk_tokens, self.greedy = temperature, top_p, chunk_tokens, greedy
        self.ranks = False  # set while checking workers' tokens (`echo.hf.rank_terms`)

    def forward(self, batch: TokenBatch) -> torch.Tensor:
        if self.greedy:
            return greedy_gaps(self.hf, batch, self.chunk_tokens)
        if self.ranks:
            return rank_terms(self.hf, batch, temperature=self.temperature, top_p=self.top_p,
                                   chunk_tokens=self.chunk_tokens)
        return policy_logprobs(self.hf, batch, temperature=self.temperature, top_p=self.top_p,
                               chunk_tokens=self.chunk_tokens)


def decoder_layers(hf) -> list[torch.nn.Module]:
    """The repeated blocks: the classes the model lists as `_no_split_modules`, else the
    longest ModuleList of the base model."""
    names = set(getattr(hf, "_no_split_modules", None) or [])
    layers = [m for m in hf.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in hf.base_model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"cannot find the decoder layers of {type(hf).__name__} to checkpoint and shard")
    return list(max(lists, key=len))


def checkpoint_activations(layer: torch.nn.Module) -> None:
    """Keep only a layer's inputs; recompute its activations in the backward pass."""
    inner = layer.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    layer.forward = forward


def build_policy(model_dir: Path, world: World, *, temperature: float, top_p: float, chunk_tokens: int,
                 activation_checkpointing: bool, dtype: torch.dtype = torch.float32,
                 trainable: bool = True, greedy: bool = False, compute: torch.dtype | None = None,
                 lora=None, seed: int = 0) -> Policy:
    """Load `model_dir` in `dtype` (fp32: the master weights), wrap, checkpoint, shard or move;
    `compute`: the dtype FSDP2 computes in (mixed precision; the world must be sharded).
    With `lora` (`[trainer.lora]`): the base in `dtype`, frozen, with a LoRA adapter in fp32
    that alone is trainable (`learner.train.lora`), initialised from `seed`.

    Sharded, the model is built on the meta device and sharded before any weight exists; each
    rank then reads its shards from the checkpoint (`learner.train.load`). One plain rank loads
    it whole. A frozen model (the KL reference, the eval copy) reshards its root after each
    forward too: no backward follows to do it, and its embeddings and head would stay gathered."""
    hf = build_on_meta(model_dir, dtype) if world.sharded else _load_whole(model_dir, dtype)
    hf.config.use_cache = False
    hf.eval().requires_grad_(trainable)
    layers = decoder_layers(hf)
    if lora is not None:
        from learner.train.lora import inject

        inject(hf, lora, layers)
        if not trainable:
            hf.requires_grad_(False)
    if activation_checkpointing and trainable:
        for layer in layers:
            checkpoint_activations(layer)
    policy = Policy(hf, temperature=temperature, top_p=top_p, chunk_tokens=chunk_tokens, greedy=greedy).eval()
    if world.sharded:
        from learner.train.load import materialize

        shard(policy, layers, world, compute, reshard_root=not trainable)
        materialize(policy, hf, model_dir, world.device, fresh=lambda name: lora is not None and "lora_" in name)
    else:
        policy.to(world.device)
    if lora is not None:
        from learner.train.lora import init_adapter

        init_adapter(hf, seed)
    return policy


def _load_whole(model_dir: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)


def build_on_meta(model_dir: Path, dtype: torch.dtype):
    """The HF model of `model_dir`'s config, its parameters on the meta device, its buffers and
    generation config as `from_pretrained` makes them."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from learner.train.load import meta_parameters

    with meta_parameters():
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    if (Path(model_dir) / "generation_config.json").exists():
        hf.generation_config = GenerationConfig.from_pretrained(model_dir)
    return hf


def count_parameters(module: torch.nn.Module) -> int:
    """Parameters of the whole model (shared tensors once), sharded or not."""
    return sum(p.numel() for p in module.parameters())  # DTensor.numel() is the global size


def write_safetensors(tensors: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]],
                      dtype: torch.dtype, keep: bool, metadata: dict[str, str] | None = None) -> bytearray | None:
    """A safetensors blob of `tensors` cast to `dtype`, written tensor by tensor.

    Every rank iterates (gathering a sharded tensor is a collective); only the rank with
    `keep` allocates the buffer and copies into it. Peak memory there: the blob plus one
    tensor. The layout depends only on names, shapes and dtype, so consecutive versions of a
    model are byte-aligned for deltas. No metadata (that would shift the layout), but for
    `metadata` of a fixed width (a LoRA version's, `echo.lora`).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    header, offset = ({"__metadata__": dict(metadata)} if metadata else {}), 0
    for name, shape in shapes.items():
        size = itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
    buf = bytearray(8 + len(head) + offset) if keep else None
    if buf is not None:
        buf[:8] = struct.pack("<Q", len(head))
        buf[8 : 8 + len(head)] = head
    base = 8 + len(head)
    for name, tensor in tensors:
        whole = full_tensor(tensor.detach())
        if buf is not None:
            start, end = header[name]["data_offsets"]
            data = whole.to(dtype).contiguous().view(torch.uint8).reshape(-1).cpu()
            buf[base + start : base + end] = memoryview(data.numpy())
        del whole
    return buf
