"""`echo-rl bench install-memory`: the host memory a worker needs to stage and read a version.

A version arrives whole in the relay's buffer (an anonymous mmap, `broadcast.store`). Before
2026-11-29 the worker copied it (`bytes()`) to stage it and safetensors copied every tensor out
of that copy to install it: three times the snapshot in RAM at once, 48 GB for an 8B model in
bf16 on a consumer machine. Now the buffer is staged as it is and the tensors are views of it
(`worker.engines.base.load_snapshot`). Each way runs in its own process on the same synthetic
snapshot, and the table is its peak resident memory above the buffer, in snapshots.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import subprocess
import sys

MIB = 1 << 20


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _one(way: str, size_mib: int) -> dict:
    """In this process: the snapshot in a relay-like buffer, then staged and read `way`."""
    import torch
    from safetensors.torch import load, save

    from worker.engines.base import load_snapshot  # imported before the peak is reset: not counted

    rows = max(1, size_mib * MIB // 2 // 8 // 4096)
    blob = save({f"layers.{i}.weight": torch.zeros(rows, 4096, dtype=torch.bfloat16) for i in range(8)})
    buffer = mmap.mmap(-1, len(blob))
    buffer[:] = blob
    view = memoryview(buffer)
    del blob
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to what is resident now
        f.write("5")
    before = _rss_mib("VmRSS:")
    if way == "copy":  # what the worker did: stage a copy, and safetensors copies each tensor out
        staged = bytes(view)
        state = load(staged)
    else:
        state = load_snapshot(1, view)
    touched = sum(float(t.max()) for t in state.values())  # read every tensor once (no temporary copy)
    return {"way": way, "snapshot_mib": len(view) / MIB, "peak_above_mib": _rss_mib("VmHWM:") - before,
            "touched": touched}


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="echo-rl bench install-memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024, help="the synthetic snapshot's size (bf16 tensors)")
    p.add_argument("--one", choices=["copy", "views"], help=argparse.SUPPRESS)  # a child process's single way
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args.one, args.size_mib)))
        return 0
    rows = []
    for way in ("copy", "views"):
        out = subprocess.run([sys.executable, "-m", "worker.bench.install_memory", "--one", way,
                              "--size-mib", str(args.size_mib)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    from echo.table import table

    print(table(["staged and read as", "snapshot MiB", "peak above the relay's buffer, MiB", "in snapshots"],
                [["a copy, tensors copied out (before)" if r["way"] == "copy" else "the buffer, tensors as views (now)",
                  f"{r['snapshot_mib']:.0f}", f"{r['peak_above_mib']:.0f}",
                  f"{r['peak_above_mib'] / r['snapshot_mib']:.2f}"] for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
