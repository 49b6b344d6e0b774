"""Loading a sharded model: every rank reads from the checkpoint only the part it holds.

`from_pretrained` on every rank and sharding afterwards costs each host the whole model once per
rank (Qwen3-8B in fp32 on 8 ranks: 262 GB) and reads the checkpoint N times. Instead, on a
sharded world (`learner.train.model.build_policy`):

    the HF model from its config, parameters on the meta device (`meta_parameters`: no memory;
    buffers such as rotary `inv_freq` are computed as usual)
    → LoRA injected, layers checkpointed, FSDP2 `fully_shard` (placements only, no data)
    → `materialize`: each rank allocates its shards (`to_empty`) and copies into each one the
      block of the checkpoint tensor it holds (`safe_open(...).get_slice(name)[block]`)

A rank's host memory at load is then its share of the model plus one tensor's block in transit:
each file is opened per tensor, because the pages a memory-mapped read touched count as the
process's until the file is closed. The block comes from DTensor's own arithmetic
(`compute_local_shape_and_global_offset`: FSDP2 shards dim 0 in `torch.chunk` sizes, the last
ranks' shards shorter or empty), not from a copy of FSDP2's rule.

Names: the checkpoint's are the HF model's parameter names. PEFT holds a wrapped linear's weight
as `….base_layer.weight`; a model saved from its base module lacks the `model.` prefix; tied
parameters (`tie_word_embeddings`) are one tensor under several names, of which the checkpoint
has one (the embeddings'). A parameter found under none of its names, or with another shape,
is an error that names it: nothing is left uninitialised silently.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"


@contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device; buffers stay real.

    (accelerate's `init_empty_weights(include_buffers=False)`.) A parameter is created where its
    module creates it, then moved: `torch.empty` pages are never touched, and initialisers run
    on the meta tensor. Patches `nn.Module.register_parameter` for the block: build nothing else
    on another thread meanwhile."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # a meta one may be registered twice: tied weights
            meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # attributes a library set on it (e.g. transformers' flags)
            module._parameters[name] = meta

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Each tensor name of a model directory's safetensors checkpoint → the file holding it: the
    index of a checkpoint split in several files, else every `*.safetensors` file's header."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    if (model_dir / INDEX).exists():
        weight_map = json.loads((model_dir / INDEX).read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files: dict[str, Path] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), path))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no safetensors checkpoint (*.safetensors): cannot load it sharded")
    return files


def local_block(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """What this rank holds of `tensor`: the local tensor to write into, and where it lies in the
    whole one. A DTensor's local shard (its padding excluded) and offset; a plain tensor, whole."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, n) for n in tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):
        raise AssertionError(f"local shard {tuple(local.shape)} is not DTensor's computed block {tuple(shape)}")
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def write_whole(tensor: torch.Tensor, whole: torch.Tensor) -> None:
    """Set `tensor` (sharded or not) to `whole`, each rank writing only its block."""
    local, block = local_block(tensor)
    local.copy_(whole[block])


@torch.no_grad()
def materialize(module: torch.nn.Module, hf: torch.nn.Module, model_dir: Path, device: torch.device,
                fresh: Callable[[str], bool] = lambda name: False) -> None:
    """Allocate `module`'s meta parameters on `device` (sharded: each rank its shards) and fill
    those of `hf` (inside `module`) from `model_dir`'s safetensors, each rank reading only its
    blocks; persistent buffers the checkpoint has are read too, the others keep the values they
    were built with. `fresh(name)`: parameters not in the checkpoint (a new LoRA adapter), left
    allocated for their initialiser."""
    from safetensors import safe_open

    files = checkpoint_files(model_dir)
    built = [(m, name, buf) for m in module.modules() for name, buf in m._buffers.items() if buf is not None]
    module.to_empty(device=device)  # empties buffers too: put the built ones back
    for m, name, buf in built:
        m._buffers[name] = buf.to(device)

    def read(names: list[str], into: torch.Tensor, what: str) -> bool:
        """Copy this rank's block of the first of `names` the checkpoint has into `into`."""
        candidates = [c for n in names for c in checkpoint_names(n, hf)]
        found = next((c for c in candidates if c in files), None)
        if found is None:
            return False
        local, block = local_block(into)
        with safe_open(files[found], framework="pt") as f:  # per tensor: see the module docstring
            part = f.get_slice(found)
            shape = tuple(part.get_shape())
            if shape != tuple(into.shape):
                raise ValueError(f"{what} {names[0]} has shape {tuple(into.shape)} but the checkpoint's {found} in "
                                 f"{files[found].name} has {shape}")
            if local.numel():
                local.copy_(part[block])  # cast to the parameter's dtype as it is copied
        return True

    names: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, p in hf.named_parameters(remove_duplicate=False):  # a tied parameter under each of its names
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    for key, p in params.items():
        if fresh(names[key][0]):
            continue
        if not read(names[key], p, "parameter"):
            raise KeyError(f"parameter {' = '.join(names[key])} is not in the checkpoint of {model_dir} "
                           f"(tried {', '.join(checkpoint_names(names[key][0], hf))})")
    for prefix, m in hf.named_modules():
        for name, buf in m._buffers.items():
            if buf is not None and name not in m._non_persistent_buffers_set:
                read([f"{prefix}.{name}" if prefix else name], buf, "buffer")


def checkpoint_names(name: str, hf: torch.nn.Module) -> list[str]:
    """The names a checkpoint may hold module parameter `name` under: without PEFT's wrapping, and
    with or without the base model's prefix (`model.`)."""
    plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    prefix = f"{getattr(hf, 'base_model_prefix', '') or 'model'}."
    other = plain.removeprefix(prefix) if plain.startswith(prefix) else prefix + plain
    return [plain, other]
