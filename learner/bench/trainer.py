"""`echo-rl bench learner`: what the trainer's memory and time do as the work grows.

Every measurement runs in a fresh process (ranks under torchrun), on models built here from
a config (random weights, nothing downloaded). Memory is the process's own peak resident set
(`VmHWM`, reset before the measured step through /proc/self/clear_refs), so it counts what
torch really allocated on this CPU; tensor accounting is exact bytes of parameters, gradients
and optimizer state. The tables, each against a baseline from the same run:

1. tokens: one step's peak as the batch grows 8× at a fixed `micro_batch_tokens`, against the
   same batches in one micro-batch; with the prediction of `learner.train.memory`.
2. log-probs: chunked `logit[target] − logsumexp` vs the full log-softmax, vocab 32k and 152k.
3. ranks: per-rank parameter + gradient + optimizer bytes and step time, 1 and 2 ranks.
4. fit: the largest model built here whose step stays within a memory limit (16 GiB).
5. packing: a long-tailed mix of response lengths in padded vs packed micro-batches: tokens
   computed per real token (goal ≤ 1.05 packed), peak and step time.
6. precision: fp32 vs bf16 through FSDP2's mixed precision, on 1 and 2 ranks.
7. lora: full fine-tuning vs a rank-16 LoRA adapter on the same model: state, peak, step time
   and the bytes of one published version.
8. memory (`--only memory`, not in the default run): `learner.train.memory`'s prediction against
   the measured peak over a grid — tokens 512 → 4096 with and without activation checkpointing,
   8 and 16 layers, vocab 32k and 152k, top-p 1.0 and 0.9, fp32 and bf16 on one rank. The
   measured step has two micro-batches, the smaller first, so the measured one runs with every
   gradient held (as all but the first of a real step do); its phases' peaks are kept too.
   With `--device cuda` (8b) the same step on a GPU, over a grid of 0.5B and 1.9B models at the
   8B config's settings: the peak is the allocator's reserved peak plus what lives outside it.
9. claims: a batch of stale groups with a share of them checked against the version they claim
   (`[verify] stale_check_fraction` 0, 0.25, 1): step time and the host memory the kept versions hold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB, MiB = float(1 << 30), float(1 << 20)
ROW_TOKENS, PROMPT_TOKENS, GROUP = 128, 32, 8  # synthetic rows: 32 prompt + 96 completion tokens


# --- measured in a child process ------------------------------------------------------------------

def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


class _Peak:
    """A step's peak memory. On a CPU the process's resident set (VmHWM). On a GPU what the
    process holds on the device: the caching allocator's peak reservation plus what lives outside
    the allocator (the CUDA context, NCCL's and the kernels' own buffers), read after the step
    as the device's used memory less the allocator's current reservation."""

    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"
        self.allocated = 0.0  # the tensors alone, the highest over every read since the first reset

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
        else:
            _reset_peak()

    def outside_allocator(self) -> float:
        cuda = self.torch.cuda
        cuda.synchronize()
        free, total = cuda.mem_get_info()
        return float(total - free - cuda.memory_reserved())

    def read(self) -> float:
        if self.cuda:
            self.allocated = max(self.allocated, float(self.torch.cuda.max_memory_allocated()))
            return self.outside_allocator() + self.torch.cuda.max_memory_reserved()
        return _status("VmHWM")


def model_config(hidden: int, layers: int, vocab: int, tied: bool = False, **ids):
    """The Qwen2 config of the models built here: heads of 64, a quarter as many key/value heads,
    an intermediate size of 2.75 × hidden."""
    from transformers import Qwen2Config

    heads = max(2, hidden // 64)
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.75 * hidden) // 64 * 64,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                       max_position_embeddings=4096, tie_word_embeddings=tied, **ids)


def build_model(out: Path, hidden: int, layers: int, vocab: int, tied: bool = False, device: str = "cpu") -> Path:
    """A Qwen2-architecture model of this shape with the local character tokenizer (cached),
    initialized on `device` (a GPU draws a 2B model's weights in seconds, a CPU in minutes) in a
    process of its own, so that no memory of it stays on the GPU the measured steps use."""
    if (out / "config.json").exists():
        return out
    if device != "cpu":
        spec = {"out": str(out), "hidden": hidden, "layers": layers, "vocab": vocab, "tied": tied, "device": device}
        if "error" in (r := _run_child("build", spec)[0]):
            raise RuntimeError(f"building {out} on {device} failed: {r['error']}")
        return out
    return _build_here(out, hidden, layers, vocab, tied, device)


def _build_here(out: Path, hidden: int, layers: int, vocab: int, tied: bool, device: str) -> Path:
    import torch
    from transformers import Qwen2ForCausalLM

    from learner.tinymodel import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = model_config(hidden, layers, vocab, tied, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def synthetic_batch(rows: int, vocab: int, seed: int = 0, long_tail: bool = False):
    """`rows` sequences of 32 prompt + 96 completion tokens; `long_tail`: completion lengths
    log-normal around 96 (median 48, a few 8× longer), as reasoning rollouts are."""
    import random

    from learner.buffer import BatchInfo, Group

    rng = random.Random(seed)
    groups = []
    length = lambda: max(4, min(1024, int(rng.lognormvariate(3.9, 1.0)))) if long_tail else ROW_TOKENS - PROMPT_TOKENS  # noqa: E731
    for g in range(max(1, rows // GROUP)):
        prompt = [1] + [rng.randrange(4, 19) for _ in range(PROMPT_TOKENS - 1)]
        completions = [[rng.randrange(4, min(vocab, 19)) for _ in range(length())] for _ in range(GROUP)]
        groups.append(Group(f"g{g}", 0, prompt, completions, [[-2.0] * len(c) for c in completions],
                            [float(i % 2) for i in range(GROUP)]))
    return BatchInfo(groups, 0, [0] * len(groups))


def _state_bytes(trainer) -> float:
    """Exact bytes of this rank's parameters, gradients and optimizer state (local shards)."""
    import torch

    from learner.train.dist import local_part as local

    total = 0
    for p in trainer.policy.parameters():
        total += local(p).numel() * local(p).element_size()
    total += total  # fp32 gradients, same shapes (they are freed after the step: counted at their peak)
    for state in trainer.optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += local(v).numel() * local(v).element_size()
    return float(total)


def child_step(spec: dict) -> dict:
    """One trainer, a warm-up step (allocates AdamW state), then the measured step(s)."""
    import torch

    from learner.config import load_learner_config
    from learner.train.dist import close, cuda_allocator_defaults, init_world
    from learner.train.trainer import Trainer

    cuda_allocator_defaults()  # as echo-learner runs
    torch.set_num_threads(spec.get("threads", 1))
    device = spec.get("device", "cpu")
    world = init_world(device)
    cfg = load_learner_config(None, ["--model.path", spec["model"], "--model.device", device, "--trainer.batch_prompts", "1",
                                     "--rollout.group_size", str(GROUP), "--publish.dtype", "float32",
                                     "--trainer.micro_batch_tokens", str(spec["micro_batch_tokens"]),
                                     *spec.get("overrides", [])])
    runtime = _status("VmRSS")  # the interpreter with torch, transformers and the learner imported, no model
    trainer = Trainer(cfg, world)
    meter = _Peak(world.device)
    vocab, tail, stale = trainer.vocab_size, spec.get("long_tail", False), spec.get("stale", False)
    if stale:  # v0 published, so kept: every batch after claims it (table 9)
        trainer.snapshot()
    warm = synthetic_batch(GROUP * max(1, world.size), vocab, seed=1, long_tail=tail)
    warm.learner_version = int(stale)  # stale: the copy the claims are checked on is built here, not measured
    trainer.step(warm)
    phases = {"forward_backward": 0.0, "optimizer": 0.0}
    if spec.get("grads_held"):
        # Smallest micro-batch first: the measured (largest) one then runs with every gradient
        # already allocated, as every micro-batch after the first of a real step does.
        micro_batches = trainer._micro_batches
        trainer._micro_batches = lambda samples, indices: sorted(micro_batches(samples, indices), key=len)
        # The peak of each phase: forward/backward (with the gradient clip) up to the optimizer step, then the step.
        opt_step = trainer.optimizer.step

        def step_with_phases(*args, **kwargs):
            phases["forward_backward"] = max(phases["forward_backward"], meter.read())
            meter.reset()
            result = opt_step(*args, **kwargs)
            phases["optimizer"] = max(phases["optimizer"], meter.read())
            return result

        trainer.optimizer.step = step_with_phases
    times = []
    before = _status("VmRSS")
    meter.reset()
    meter.allocated = 0.0
    for i in range(spec.get("steps", 1)):
        t0 = time.perf_counter()
        batch = synthetic_batch(spec["rows"], vocab, seed=2 + i, long_tail=tail)
        batch.learner_version = trainer.version if stale else 0
        stats = trainer.step(batch)
        times.append(time.perf_counter() - t0)
    peak = max(meter.read(), *phases.values())  # before the snapshot below allocates anything
    cuda = {"allocated": meter.allocated, "outside": meter.outside_allocator(),  # context, NCCL, kernels
            "device_name": torch.cuda.get_device_name(),
            "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
            } if meter.cuda else {}
    out = {"claims_checked": len(stats["claim_checks"]), "kept_bytes": trainer.kept.bytes() if trainer.kept else 0,
           "rank": world.rank, "ranks": world.size, "peak": peak, "before": before,
           "runtime": runtime, "phases": phases,
           "step_s": statistics.median(times), "state": _state_bytes(trainer), "params": trainer.num_parameters,
           "padded_token_share": stats["padded_token_share"], "loss": stats["loss"],
           "version_bytes": len(trainer.snapshot() or b""), **cuda}
    close(world)
    return out


def child_logprobs(spec: dict) -> dict:
    """Head log-probs of T tokens with backward: the full log-softmax vs echo's chunked one."""
    import torch

    from echo.hf import head_logprobs

    torch.set_num_threads(spec.get("threads", 1))
    torch.manual_seed(0)
    T, H, V = spec["tokens"], spec["hidden"], spec["vocab"]
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(T, H, requires_grad=True)
    targets = torch.randint(0, V, (T,))
    head_logprobs(hidden[:2], head, targets[:2], temperature=1.0, top_p=1.0).sum().backward()  # lazy imports
    hidden.grad = None
    _reset_peak()
    before = _status("VmRSS")
    t0 = time.perf_counter()
    if spec["kind"] == "naive":
        logp = torch.log_softmax(head(hidden).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    else:
        logp = head_logprobs(hidden, head, targets, temperature=1.0, top_p=1.0)
    logp.sum().backward()
    seconds = time.perf_counter() - t0
    return {"peak_extra": _status("VmHWM") - before, "seconds": seconds,
            "checksum": float(logp.detach().double().sum()), "grad": float(hidden.grad.double().norm())}


# --- the driver -----------------------------------------------------------------------------------

def _run_child(kind: str, spec: dict, ranks: int = 0, timeout: float = 1800) -> list[dict]:
    payload = json.dumps(spec)
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "-m", "learner.bench.trainer", "_child", kind, payload]
    else:
        cmd = [sys.executable, "-m", "learner.bench.trainer", "_child", kind, payload]
    env = {**os.environ, "OMP_NUM_THREADS": str(spec.get("threads", 1))}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    rows = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not rows:
        return [{"error": (done.stderr or done.stdout)[-600:].strip().splitlines()[-1] if (done.stderr or done.stdout)
                 else f"exit {done.returncode}", "returncode": done.returncode}]
    return rows


def _predicted(model, tokens: int, ranks: int = 1, checkpointing: bool = False, top_p: float = 1.0,
               dtype: str = "float32", plan: bool = False, gpu: bool = False, lora_rank: int = 0):
    """`learner.train.memory`'s prediction for this step, as the preflight makes it; `model`: its
    directory, or its `ModelShape` (tests/unit/learner/test_memory_model.py holds the shapes)."""
    from echo.hf import chunk_tokens_for
    from learner.config import LoraSection
    from learner.train.memory import ModelShape, predict

    shape = model if isinstance(model, ModelShape) else ModelShape.of(model)
    mixed = dtype == "bfloat16"
    adapter = shape.adapter_params(lora_rank, LoraSection().target_modules) if lora_rank else 0
    out = predict(shape, ranks=ranks, micro_batch_tokens=tokens, compute_bytes=2 if mixed else 4,
                  checkpointing=checkpointing, reference=False, chunk_tokens=min(tokens, chunk_tokens_for(shape.vocab)),
                  top_p=top_p, mixed=mixed, gpu=gpu, adapter_params=adapter)
    return out if plan else out.total


# The memory grid (table 8): (hidden, layers, vocab), micro-batch tokens, activation checkpointing,
# top-p, compute dtype. One knob at a time from a baseline: tokens 8× with and without
# checkpointing, a wider model, a 152k vocabulary with and without top-p, bf16 on one rank, twice
# the layers checkpointed.
MEMORY_GRID = [
    ((512, 8, 32000), 512, False, 1.0, "float32"),
    ((512, 8, 32000), 4096, False, 1.0, "float32"),
    ((512, 8, 32000), 4096, True, 1.0, "float32"),
    ((512, 8, 32000), 2048, False, 1.0, "bfloat16"),
    ((1024, 8, 32000), 512, False, 1.0, "float32"),
    ((1024, 8, 32000), 2048, False, 1.0, "float32"),
    ((1024, 8, 32000), 2048, True, 1.0, "float32"),
    ((512, 4, 151936), 512, False, 1.0, "float32"),
    ((512, 4, 151936), 512, False, 0.9, "float32"),
    ((512, 4, 151936), 4096, False, 0.9, "float32"),
    ((512, 16, 32000), 4096, True, 1.0, "float32"),
    ((512, 16, 32000), 512, True, 1.0, "float32"),
]
QUICK_MEMORY_GRID = [((64, 2, 1000), 256, False, 1.0, "float32"), ((64, 2, 1000), 512, True, 0.9, "float32")]
# On a GPU (`--device cuda`, one rank): the settings of configs/learner-8b.toml (16,384-token
# micro-batches, checkpointing, bf16, a 152k vocabulary) on models of 0.5B and 1.9B parameters,
# one knob at a time; the last point a rank-16 LoRA adapter (a sixth field: the LoRA rank).
GPU_MEMORY_GRID = [
    ((1024, 16, 151936), 4096, False, 1.0, "float32"),
    ((1024, 16, 151936), 16384, True, 1.0, "float32"),
    ((1024, 16, 151936), 16384, True, 1.0, "bfloat16"),
    ((1024, 16, 151936), 16384, True, 0.9, "bfloat16"),
    ((1024, 16, 151936), 8192, False, 1.0, "bfloat16"),
    ((2048, 28, 151936), 16384, True, 1.0, "bfloat16"),
    ((2048, 28, 151936), 16384, True, 1.0, "bfloat16", 16),
]


def bench_memory(models: Path, grid: list, device: str = "cpu") -> list[dict]:
    """Each point a fresh process: a warm-up step, then one step of two micro-batches, the
    smaller first, so the measured one (`tokens` long) runs with every gradient held."""
    rows = []
    for (hidden, layers, vocab), tokens, ckpt, top_p, dtype, *lora in grid:
        lora_rank = lora[0] if lora else 0
        model = build_model(models / f"h{hidden}-l{layers}-v{vocab}", hidden, layers, vocab, device=device)
        per_micro = max(1, tokens // ROW_TOKENS)
        n_rows = per_micro + GROUP if per_micro >= GROUP else 2 * per_micro  # two micro-batches
        overrides = ["--trainer.activation_checkpointing", str(ckpt).lower(), "--rollout.top_p", str(top_p),
                     "--trainer.compute_dtype", dtype]
        if lora_rank:
            overrides += ["--trainer.lora", f"{{rank = {lora_rank}, alpha = {2 * lora_rank}}}"]
        r = _run_child("step", {"model": str(model), "rows": max(GROUP, n_rows), "micro_batch_tokens": tokens,
                                "threads": 2, "grads_held": True, "overrides": overrides, "device": device})[0]
        rows.append({"model": model.name, "hidden": hidden, "layers": layers, "vocab": vocab, "tokens": tokens,
                     "checkpointing": ckpt, "top_p": top_p, "dtype": dtype, "lora_rank": lora_rank, "device": device,
                     **r, "predicted": _predicted(model, tokens, checkpointing=ckpt, top_p=top_p, dtype=dtype,
                                                  gpu=device.startswith("cuda"), lora_rank=lora_rank)})
        print(f"memory {len(rows)}/{len(grid)}: {model.name} {tokens} tokens: "
              + (f"failed: {r['error']}" if "error" in r else
                 f"peak {r['peak'] / MiB:.0f} MiB, predicted {rows[-1]['predicted'] / MiB:.0f} MiB"),
              file=sys.stderr, flush=True)
    return rows


def bench_tokens(models: Path, sizes: list[int], micro: int, hidden: int, layers: int, vocab: int) -> list[dict]:
    model = build_model(models / f"h{hidden}-l{layers}-v{vocab}", hidden, layers, vocab)
    rows = []
    for tokens in sizes:
        n_rows = max(GROUP, tokens // ROW_TOKENS)
        for label, budget in ((f"micro {micro}", micro), ("one micro-batch", tokens)):
            r = _run_child("step", {"model": str(model), "rows": n_rows, "micro_batch_tokens": budget, "threads": 2})[0]
            rows.append({"batch_tokens": n_rows * ROW_TOKENS, "mode": label, **r,
                         "predicted": _predicted(model, min(budget, n_rows * ROW_TOKENS))})
    return rows


def bench_logprobs(tokens: int, hidden: int, vocabs: list[int]) -> list[dict]:
    rows = []
    for vocab in vocabs:
        for kind in ("naive", "chunked"):
            r = _run_child("logprobs", {"kind": kind, "tokens": tokens, "hidden": hidden, "vocab": vocab, "threads": 2})[0]
            rows.append({"vocab": vocab, "kind": kind, "tokens": tokens, "hidden": hidden, **r})
    return rows


def bench_ranks(models: Path, hidden: int, layers: int, vocab: int, rows_per_step: int, micro: int) -> list[dict]:
    model = build_model(models / f"h{hidden}-l{layers}-v{vocab}", hidden, layers, vocab)
    spec = {"model": str(model), "rows": rows_per_step, "micro_batch_tokens": micro, "steps": 3}
    out = []
    for ranks, threads in ((1, 2), (2, 1)):  # the same two cores either way
        for r in _run_child("step", {**spec, "threads": threads}, ranks=ranks):
            out.append({**r, "threads": threads})
    return out


def bench_fit(models: Path, limit_gib: float, candidates: list[tuple[int, int]], vocab: int, micro: int) -> list[dict]:
    """Build each candidate shape (smallest first) and run one step; stop after the first that
    does not fit."""
    rows = []
    for hidden, layers in candidates:
        model = build_model(models / f"h{hidden}-l{layers}-v{vocab}", hidden, layers, vocab)
        r = _run_child("step", {"model": str(model), "rows": GROUP, "micro_batch_tokens": micro, "threads": 2})[0]
        row = {"hidden": hidden, "layers": layers, "vocab": vocab, **r, "predicted": _predicted(model, micro)}
        row["fits"] = "peak" in r and r["peak"] <= limit_gib * GiB
        rows.append(row)
        if not row["fits"]:
            break
    return rows


def bench_packing(models: Path, hidden: int, layers: int, vocab: int, rows: int, micro: int) -> list[dict]:
    model = build_model(models / f"h{hidden}-l{layers}-v{vocab}", hidden, layers, vocab)
    spec = {"model": str(model), "rows": rows, "micro_batch_tokens": micro, "threads": 2, "long_tail": True, "steps": 2}
    return [{"mode": mode, **_run_child("step", {**spec, "overrides": ["--trainer.packing", packing]})[0]}
            for mode, packing in (("padded", "false"), ("packed", "true"))]


def bench_precision(models: Path, hidden: int, layers: int, vocab: int, rows: int, micro: int) -> list[dict]:
    model = build_model(models / f"h{hidden}-l{layers}-v{vocab}", hidden, layers, vocab)
    spec = {"model": str(model), "rows": rows, "micro_batch_tokens": micro, "steps": 2}
    out = []
    for dtype in ("float32", "bfloat16"):
        for ranks, threads in ((1, 2), (2, 1)):
            for r in _run_child("step", {**spec, "threads": threads, "overrides": ["--trainer.compute_dtype", dtype]},
                                ranks=ranks):
                out.append({"dtype": dtype, **r})
    return out


def bench_lora(models: Path, hidden: int, layers: int, vocab: int, rows: int, micro: int) -> list[dict]:
    model = build_model(models / f"h{hidden}-l{layers}-v{vocab}", hidden, layers, vocab)
    spec = {"model": str(model), "rows": rows, "micro_batch_tokens": micro, "threads": 2, "steps": 2}
    return [{"mode": mode, **_run_child("step", {**spec, "overrides": extra})[0]}
            for mode, extra in (("full", []), ("lora r16", ["--trainer.lora", "{rank = 16, alpha = 32}"]))]


def bench_claims(models: Path, hidden: int, layers: int, vocab: int, rows: int, micro: int) -> list[dict]:
    """A batch of stale groups, `[verify] stale_check_fraction` of G of them checked against the
    version they claim (`Trainer._check_claims`), against none checked."""
    model = build_model(models / f"h{hidden}-l{layers}-v{vocab}", hidden, layers, vocab)
    spec = {"model": str(model), "rows": rows, "micro_batch_tokens": micro, "threads": 2, "steps": 3, "stale": True}
    return [{"fraction": f, **_run_child("step", {**spec, "overrides": [
        "--buffer.max_staleness", "8", "--verify.stale_check_fraction", str(f)]})[0]} for f in (0.0, 0.25, 1.0)]


def _print_tables(result: dict) -> None:
    t = result.get("tokens")
    if t:
        base = {r["mode"]: r for r in t if r["batch_tokens"] == t[0]["batch_tokens"]}
        print("1. one step's peak memory as the batch grows (fixed micro_batch_tokens vs one micro-batch)")
        print(f"{'batch tokens':>12} {'mode':>16} {'peak RSS':>10} {'× first':>8} {'step work':>10} {'× first':>8} "
              f"{'predicted':>10} {'step s':>7}")
        for r in t:
            if "error" in r:
                print(f"{r['batch_tokens']:>12} {r['mode']:>16}  failed: {r['error']}")
                continue
            b = base[r["mode"]]
            work, bwork = r["peak"] - r["before"], b["peak"] - b["before"]
            print(f"{r['batch_tokens']:>12} {r['mode']:>16} {r['peak'] / MiB:>8.0f}Mi {r['peak'] / b['peak']:>8.2f} "
                  f"{work / MiB:>8.0f}Mi {work / max(bwork, 1):>8.2f} {r['predicted'] / MiB:>8.0f}Mi {r['step_s']:>7.2f}")
        print()
    lp = result.get("logprobs")
    if lp:
        print("2. head log-probs of %d tokens (hidden %d) with backward: full log-softmax vs chunked"
              % (lp[0]["tokens"], lp[0]["hidden"]))
        print(f"{'vocab':>8} {'kind':>8} {'peak extra':>11} {'beyond W, dW':>13} {'× naive':>8} {'seconds':>8} "
              f"{'|Δ checksum|':>13}")
        for r in lp:
            ref = next(x for x in lp if x["vocab"] == r["vocab"] and x["kind"] == "naive")
            delta = abs(r["checksum"] - ref["checksum"]) if "checksum" in r and "checksum" in ref else float("nan")
            weights = 2 * 4 * r["vocab"] * r["hidden"]  # the head and its gradient, the same in both
            logits, ref_logits = r["peak_extra"] - weights, ref["peak_extra"] - weights
            print(f"{r['vocab']:>8} {r['kind']:>8} {r['peak_extra'] / MiB:>9.0f}Mi {logits / MiB:>11.0f}Mi "
                  f"{logits / ref_logits:>8.2f} {r['seconds']:>8.2f} {delta:>13.2e}")
        print()
    rk = result.get("ranks")
    if rk:
        one = next(r for r in rk if r.get("ranks") == 1)
        print("3. per-rank state (params + grads + AdamW, exact bytes) and step time, 1 vs 2 ranks on the same 2 cores")
        print(f"{'ranks':>5} {'rank':>4} {'threads':>7} {'state':>9} {'× 1 rank':>9} {'step s':>7} {'× 1 rank':>9}")
        for r in rk:
            if "error" in r:
                print(f"  failed: {r['error']}")
                continue
            print(f"{r['ranks']:>5} {r['rank']:>4} {r['threads']:>7} {r['state'] / MiB:>7.0f}Mi "
                  f"{r['state'] / one['state']:>9.2f} {r['step_s']:>7.2f} {r['step_s'] / one['step_s']:>9.2f}")
        print()
    fit = result.get("fit")
    if fit:
        print(f"4. the largest model built here whose step fits in {result['fit_limit_gib']:.0f} GiB "
              f"(one micro-batch of {result['fit_micro']} tokens)")
        print(f"{'hidden':>6} {'layers':>6} {'params':>9} {'peak RSS':>10} {'predicted':>10} {'fits':>5}")
        for r in fit:
            params = f"{r['params'] / 1e6:.0f}M" if "params" in r else "-"
            peak = f"{r['peak'] / GiB:.2f}Gi" if "peak" in r else r.get("error", "failed")[:40]
            print(f"{r['hidden']:>6} {r['layers']:>6} {params:>9} {peak:>10} {r['predicted'] / GiB:>8.2f}Gi "
                  f"{'yes' if r['fits'] else 'no':>5}")


def _print_new_tables(result: dict) -> None:
    pk = result.get("packing")
    if pk:
        print("5. a long-tailed mix of response lengths (log-normal, median 48, up to 1024 tokens): padded vs packed")
        print(f"{'mode':>8} {'computed/real':>14} {'peak RSS':>10} {'step s':>7} {'× padded':>9} {'loss':>9}")
        pad = pk[0]
        for r in pk:
            if "error" in r:
                print(f"{r['mode']:>8}  failed: {r['error']}")
                continue
            print(f"{r['mode']:>8} {1 / (1 - r['padded_token_share']):>14.3f} {r['peak'] / MiB:>8.0f}Mi "
                  f"{r['step_s']:>7.2f} {r['step_s'] / pad['step_s']:>9.2f} {r['loss']:>9.5f}")
        print()
    pr = result.get("precision")
    if pr:
        print("6. fp32 vs bf16 (FSDP2 mixed precision: fp32 master shards, bf16 compute), 1 and 2 ranks on 2 cores")
        print(f"{'dtype':>9} {'ranks':>5} {'rank':>4} {'state':>9} {'peak RSS':>10} {'step s':>7} {'× fp32':>7}")
        for r in pr:
            if "error" in r:
                print(f"{r['dtype']:>9}  failed: {r['error']}")
                continue
            base = next(x for x in pr if x.get("dtype") == "float32" and x.get("ranks") == r["ranks"]
                        and x.get("rank") == r["rank"])
            print(f"{r['dtype']:>9} {r['ranks']:>5} {r['rank']:>4} {r['state'] / MiB:>7.0f}Mi {r['peak'] / MiB:>8.0f}Mi "
                  f"{r['step_s']:>7.2f} {r['step_s'] / base['step_s']:>7.2f}")
        print()
    lo = result.get("lora")
    if lo:
        print("7. full fine-tuning vs LoRA (rank 16 on every linear of the decoder layers), same model and batch")
        print(f"{'mode':>9} {'state':>9} {'peak RSS':>10} {'step s':>7} {'version bytes':>14} {'× fewer':>8}")
        full = lo[0]
        for r in lo:
            if "error" in r:
                print(f"{r['mode']:>9}  failed: {r['error']}")
                continue
            print(f"{r['mode']:>9} {r['state'] / MiB:>7.0f}Mi {r['peak'] / MiB:>8.0f}Mi {r['step_s']:>7.2f} "
                  f"{r['version_bytes']:>14,} {full['version_bytes'] / r['version_bytes']:>8.1f}")


def _print_claims_table(result: dict) -> None:
    cl = result.get("claims")
    if cl:
        print("9. stale groups checked against the version they claim ([verify] stale_check_fraction), same batch")
        print(f"{'fraction':>8} {'groups checked':>14} {'step s':>7} {'× none':>7} {'host memory kept':>17}")
        for r in cl:
            if "error" in r:
                print(f"{r['fraction']:>8}  failed: {r['error']}")
                continue
            print(f"{r['fraction']:>8} {r['claims_checked']:>14} {r['step_s']:>7.2f} {r['step_s'] / cl[0]['step_s']:>7.2f} "
                  f"{r['kept_bytes'] / MiB:>15.1f}Mi")
        print()


def _print_memory_table(result: dict) -> None:
    me = result.get("memory")
    if me:
        gpu = next((r["device_name"] for r in me if "device_name" in r), None)
        print("8. the memory model against the measured peak (one step, two micro-batches, the measured one last)"
              + (f", on {gpu}: the peak is the allocator's reservation plus what lives outside it "
                 "(context, NCCL); tensors: the allocator's allocated peak" if gpu else ""))
        print(f"{'model':>16} {'params':>7} {'tokens':>6} {'ckpt':>4} {'top-p':>5} {'dtype':>8} {'lora':>4} {'peak':>9} "
              f"{'predicted':>10} {'ratio':>6}" + (f" {'tensors':>9} {'outside':>8}" if gpu else ""))
        for r in me:
            head = f"{r['model']:>16} {r.get('params', 0) / 1e6:>6.0f}M {r['tokens']:>6} {'on' if r['checkpointing'] else 'off':>4} " \
                   f"{r['top_p']:>5} {r['dtype']:>8} {r.get('lora_rank') or '-':>4}"
            if "error" in r:
                print(f"{head}  failed: {r['error']}")
                continue
            print(f"{head} {r['peak'] / MiB:>7.0f}Mi {r['predicted'] / MiB:>8.0f}Mi {r['predicted'] / r['peak']:>6.3f}"
                  + (f" {r['allocated'] / MiB:>7.0f}Mi {r['outside'] / MiB:>6.0f}Mi" if "allocated" in r else ""))


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="echo-rl bench learner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="tokens,logprobs,ranks,fit,packing,precision,lora,claims",
                   help="tables to run, comma-separated (default: all but memory)")
    p.add_argument("--micro", type=int, default=512, help="micro_batch_tokens of table 1 (default 512)")
    p.add_argument("--fit-gib", type=float, default=16.0, help="memory limit of table 4 (default 16)")
    p.add_argument("--models", type=Path, default=Path(".echo-cache/bench-models"),
                   help="where the built models are kept between runs (default .echo-cache/bench-models)")
    p.add_argument("--quick", action="store_true", help="seconds-long smoke version (tiny sizes)")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda (default cpu). Only table 8 (--only memory) runs on a GPU, on its own grid "
                        "of 0.5B- and 1.9B-parameter models at the 8B config's settings")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    only = set(args.only.split(","))
    if args.device != "cpu" and only != {"memory"}:
        p.error(f"--device {args.device}: only table 8 runs on a GPU; add --only memory")
    quick = args.quick
    models = Path(tempfile.mkdtemp()) if quick else args.models
    result: dict = {}
    if "tokens" in only:
        sizes = [1024, 2048] if quick else [1024, 2048, 4096, 8192]
        result["tokens"] = bench_tokens(models, sizes, 256 if quick else args.micro, 64 if quick else 256,
                                        1 if quick else 4, 512 if quick else 32000)
    if "logprobs" in only:
        result["logprobs"] = bench_logprobs(64 if quick else 2048, 32 if quick else 1024,
                                            [1000] if quick else [32000, 151936])
    if "ranks" in only:
        result["ranks"] = bench_ranks(models, 64 if quick else 512, 1 if quick else 8, 512 if quick else 32000,
                                      GROUP if quick else 4 * GROUP, 1024)
    if "fit" in only:
        candidates = [(64, 1)] if quick else [(1024, 16), (1536, 20), (2048, 14), (2048, 16)]
        result["fit"] = bench_fit(models, args.fit_gib, candidates, 512 if quick else 32000, 512)
        result["fit_limit_gib"], result["fit_micro"] = args.fit_gib, 512
    small = dict(hidden=64 if quick else 512, layers=1 if quick else 4, vocab=512 if quick else 32000)
    if "packing" in only:
        result["packing"] = bench_packing(models, **small, rows=GROUP if quick else 4 * GROUP, micro=1024 if quick else 4096)
    if "precision" in only:
        result["precision"] = bench_precision(models, **small, rows=GROUP if quick else 2 * GROUP, micro=1024)
    if "lora" in only:
        result["lora"] = bench_lora(models, **small, rows=GROUP if quick else 2 * GROUP, micro=1024)
    if "claims" in only:
        result["claims"] = bench_claims(models, **small, rows=GROUP if quick else 8 * GROUP, micro=1024 if quick else 4096)
    if "memory" in only:
        gpu = args.device.startswith("cuda")
        result["memory"] = bench_memory(models, QUICK_MEMORY_GRID if quick else GPU_MEMORY_GRID if gpu else MEMORY_GRID,
                                        args.device)
    if args.json:
        print(json.dumps(result))
    else:
        _print_tables(result)
        _print_new_tables(result)
        _print_claims_table(result)
        _print_memory_table(result)
    return 0


def _child_main(kind: str, payload: str) -> None:
    spec = json.loads(payload)
    if kind == "build":
        _build_here(Path(spec.pop("out")), **spec)
        out = {}
    else:
        out = child_step(spec) if kind == "step" else child_logprobs(spec)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "_child":
        _child_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit(cli(sys.argv[1:]))
