"""The learner's ranks: one process per device under `torchrun`, rank 0 in charge.

Rank 0 runs everything a worker talks to (control API, buffer, leases, publisher) and drives
the trainer; every other rank only trains. The trainer's collective calls (a step, a snapshot,
a checkpoint) must happen on all ranks in the same order, so rank 0 *announces* each call on a
command channel and the followers replay it (`Lockstep`). The channel is its own gloo group
with a long timeout: followers may wait for hours while rank 0 waits for rollouts, which the
compute group's watchdog (nccl: minutes) must not mistake for a hang.

Without torchrun (`WORLD_SIZE` unset) the learner is one plain process: no process group, no
FSDP, the same trainer code — except in bf16, where one rank shards over a process group of
one (`sharded_alone`), so that it computes with FSDP2's mixed precision exactly as N ranks do.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

COMMAND_TIMEOUT = timedelta(days=7)
# The caching allocator's default carves fixed-size segments: on an H200 a training step reserved
# 1.09-1.32x the tensors it held (1.9B parameters, bf16, 16k tokens: 8.5 GiB above them), so a
# step the preflight fits could run out. Expandable segments grow one mapping per stream instead
# (what torchtitan runs with). Read when CUDA starts; a user's own setting is kept.
CUDA_ALLOC_CONF = "expandable_segments:True"


def cuda_allocator_defaults() -> None:
    """Set `PYTORCH_CUDA_ALLOC_CONF` to `CUDA_ALLOC_CONF` unless the user set either name; call
    before anything starts CUDA (torchrun's ranks inherit it)."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOC_CONF


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    commands: Any = None  # the gloo group rank 0 announces calls on (None: one process)
    sharded: bool = False  # parameters held by FSDP2 (N > 1 ranks, or one rank in bf16)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def use_device(self) -> None:
        """Make this thread's current CUDA device the rank's (a thread starts on cuda:0)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def all_lists(self, items: list) -> list:
        """Every rank's `items` (small Python objects), concatenated in rank order."""
        if not self.distributed:
            return list(items)
        parts: list = [None] * self.size
        dist.all_gather_object(parts, items, group=self.commands)
        return [x for part in parts for x in part]

    def all_reduce(self, tensor: torch.Tensor, op=None) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.commands)


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


class DeviceError(RuntimeError):
    """The configured device is not on this machine."""


def init_world(device: str) -> World:
    """The process's rank and device. `device` is the config's ('cpu', 'cuda', 'cuda:1'); under
    torchrun a CUDA rank takes `cuda:LOCAL_RANK`, one process without an index the current CUDA
    device (torch refuses to make an index-less `cuda` current: every one-rank GPU run failed)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"[model] device = \"{device}\", but this torch sees no CUDA device "
                          f"(torch {torch.__version__}): set [model] device = \"cpu\", or install a CUDA build of torch")
    if not under_torchrun():
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return World(device=dev)
    rank, size, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    dev = torch.device(f"cuda:{local}") if device.startswith("cuda") else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    return World(rank, size, local, dev, commands, sharded=size > 1)


def sharded_alone(world: World) -> World:
    """`world`, sharded: one rank gets a process group of its own if it has none (an in-process
    store: nothing listens), so FSDP2 can hold its parameters as it does for N ranks."""
    if not dist.is_initialized():
        cuda = world.device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=world.device if cuda else None)
    return World(world.rank, world.size, world.local_rank, world.device, world.commands, sharded=True)


def shard(policy: torch.nn.Module, layers: list[torch.nn.Module], world: World,
          compute: torch.dtype | None = None, reshard_root: bool = False) -> torch.nn.Module:
    """FSDP2: each decoder layer one unit, the rest (embeddings, final norm, head) the root.

    The sharded parameters are what they were built in (fp32: the master weights). With
    `compute` (bf16), FSDP2's mixed precision gathers each unit in that dtype for its forward
    and backward and reduces gradients in fp32 into the fp32 shards: the whole forward runs in
    bf16, as vLLM's does, and only one unit at a time exists unsharded — where autocast would
    cache a bf16 copy of every layer until the forward ends. FSDP averages gradients over
    ranks; the batch gradient is their *sum* (the loss is already normalised by the slice's
    token count), so the trainer scales each rank's loss by the world size (gloo cannot reduce
    with a divide factor of 1).

    The root keeps its parameters gathered after the forward (FSDP2's default for a root): the
    backward needs them at once and reshards them. A model that never runs a backward (the
    frozen reference) passes `reshard_root`, or its embeddings and head would stay gathered.
    Parameters still on the meta device stay there: `learner.train.load` allocates and fills them.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute is not None else None
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for layer in layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(policy, mesh=mesh, **kwargs, **({"reshard_after_forward": True} if reshard_root else {}))
    return policy


def as_root(model: torch.nn.Module) -> None:
    """Make the FSDP2 root of `model` the root before anything calls a module under it.

    FSDP2 settles which state is the root at the first forward: generation calls the HF model
    under the root, and done before any forward through the root (the v0 eval on the learner),
    each layer took itself for a root and the first update refused ("FSDP state has already
    been lazily initialized"). A no-op once settled."""
    model._get_fsdp_state()._lazy_init()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A parameter whole: gathered from every rank if sharded (a collective), else itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: its local shard if sharded (no communication), else itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class Lockstep:
    """Rank 0 calls `target`'s methods through `call`; followers run `follow` and replay each.

    Invariant: every rank executes the same sequence of trainer calls with the same arguments,
    so the collectives inside them line up.
    """

    STOP = "__stop__"

    def __init__(self, target: Any, world: World):
        self.target, self.world = target, world

    def call(self, method: str, *args) -> Any:
        if self.world.distributed:
            dist.broadcast_object_list([(method, args)], src=0, group=self.world.commands)
        return getattr(self.target, method)(*args)

    def stop(self) -> None:
        if self.world.distributed:
            dist.broadcast_object_list([(self.STOP, ())], src=0, group=self.world.commands)

    def follow(self) -> None:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.world.commands)
            method, args = box[0]
            if method == self.STOP:
                return
            getattr(self.target, method)(*args)


def close(world: World) -> None:
    if (world.distributed or world.sharded) and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # tearing down after a failure: say so, do not mask the failure
            print(f"echo-learner rank {world.rank}: process group teardown failed: {e}", file=sys.stderr)
