"""Driven by tests/integration/test_sharded_load.py under `torchrun --nproc_per_node N`: build
policies with `build_policy` on a sharded world (one rank: `sharded_alone`) and write, from
rank 0, what they hold gathered whole (`CASE.safetensors`: parameters and persistent buffers
under their state-dict names, every buffer also as `buffer:NAME`). Every rank writes
`rss-RANK.json`: per case, its resident memory before the load and its peak during it (VmHWM,
reset just before), in bytes. A first small case warms up the imports and FSDP2's first use,
which a later case's numbers then do not count.

    --case NAME MODEL_DIR OPTIONS   OPTIONS: comma-separated `lora=R`, `frozen`, `bf16`, or `-`
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--case", nargs=3, action="append", metavar=("NAME", "MODEL_DIR", "OPTIONS"), required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    from learner.config import LoraSection
    from learner.train.dist import close, full_tensor, init_world, sharded_alone
    from learner.train.model import build_policy

    world = init_world("cpu")
    world = sharded_alone(world) if not world.sharded else world
    args.out.mkdir(parents=True, exist_ok=True)
    rss = {}
    for name, model_dir, options in args.case:
        opts = dict(o.partition("=")[::2] for o in options.split(",") if o != "-")
        lora = LoraSection(rank=int(opts["lora"]), alpha=8.0) if "lora" in opts else None
        dtype = torch.bfloat16 if "bf16" in opts else torch.float32
        before = status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        policy = build_policy(Path(model_dir), world, temperature=1.0, top_p=1.0, chunk_tokens=0,
                              activation_checkpointing=False, dtype=dtype, trainable="frozen" not in opts,
                              lora=lora, seed=3)
        rss[name] = {"before": before, "peak": status_bytes("VmHWM")}
        hf = policy.hf
        whole = {k: full_tensor(v).detach().clone() for k, v in hf.state_dict().items()}
        whole.update({f"buffer:{k}": b.detach().clone() for k, b in hf.named_buffers()})
        if "frozen" in opts:  # a frozen model reshards its root after a forward (no backward will)
            from echo.hf import TokenBatch

            with torch.no_grad():
                policy(TokenBatch.build([[1, 5, 6]], [[7, 8]], 0, world.device))
            whole["resharded_root"] = torch.tensor(isinstance(hf.get_output_embeddings().weight, DTensor))
        if world.is_main:
            save_file(whole, args.out / f"{name}.safetensors")
        del policy, hf, whole
    (args.out / f"rss-{world.rank}.json").write_text(json.dumps(rss))
    close(world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
