"""The published versions a stale group may still claim, kept so that its μ and its tokens are
checked against the very weights it names (issue #18: "every group's μ checked against the
version it claims"), not against the fleet's drift from the trainer's π.

Each is this rank's part of the weights as workers got them: `[publish] dtype`, in host memory
(pinned on a GPU node, for a quick copy back), the adapter alone in LoRA mode. A check loads one
into a frozen copy of the model sharded like the policy, so every rank copies only its own
shards and nothing is gathered; in LoRA mode the policy itself, its adapter swapped in and back.
What it costs is stated in `docs/untrusted-workers.md`: at 8B in bf16 on 4 ranks, 4 GB of host
memory per rank per version kept, and the frozen copy's 4 GB on the device (none with LoRA).
"""

from __future__ import annotations

import torch

from learner.train.dist import local_part


class KeptVersions:
    """This rank's copies of the published versions within `reach` updates of the newest."""

    def __init__(self, reach: int, dtype: torch.dtype, adapter_only: bool):
        self.reach, self.dtype, self.adapter_only = reach, dtype, adapter_only
        self._kept: dict[int, dict[str, torch.Tensor]] = {}

    def __contains__(self, version: int) -> bool:
        return version in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    @torch.no_grad()
    def keep(self, version: int, policy: torch.nn.Module) -> None:
        """Keep `policy`'s weights as `version`, rounded as published; forget the versions no
        group trained from now on may claim (older than `version` − reach), reusing their host
        buffers (pinning 4 GB anew each version is slow)."""
        spare: dict[str, torch.Tensor] = {}
        for old in [v for v in self._kept if v < version - self.reach]:
            spare = self._kept.pop(old)
        if version in self._kept:
            return
        pin = torch.cuda.is_available() and any(p.is_cuda for p in policy.parameters())
        kept = {}
        for name, p in policy.named_parameters():
            if self.adapter_only and "lora_" not in name:
                continue  # the frozen base is every version's
            local = local_part(p.detach()).to(self.dtype)  # rounded where it lies: half the bytes to move in bf16
            into = spare.get(name)
            if into is None or into.shape != local.shape:
                into = torch.empty(local.shape, dtype=self.dtype, pin_memory=pin)
            kept[name] = into.copy_(local)
        self._kept[version] = kept

    @torch.no_grad()
    def load(self, version: int, into: torch.nn.Module) -> None:
        """Set `into` (a copy of the policy, sharded like it) to `version`'s weights."""
        kept = self._kept[version]
        for name, p in into.named_parameters():
            if name in kept:
                local_part(p).copy_(kept[name], non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def bytes(self) -> int:
        """Host memory held, this rank."""
        return sum(t.numel() * t.element_size() for kept in self._kept.values() for t in kept.values())
