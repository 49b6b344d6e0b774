"""`echo-rl bench engines`: generation throughput and install time of the rollout engines.

For each engine and model: tokens/s of `generate` on a fixed workload (prompts × group size ×
max new tokens, every sample forced to full length), the time of an in-place `install` of a
new version (parse + load + verification), and `mismatch_kl` of the generated tokens against
the trainer's log-probs for that version. Each engine runs in a child process of the
interpreter that has it (vLLM lives in .venv-vllm, see mk/vllm.mk); the parent builds the
models and merges the rows. The same command runs on a GPU with `--device cuda`.

    echo-rl bench engines                                   # both engines, demo + ~94M model
    echo-rl bench engines --device cuda --prompts 64 --n 16 --max-new-tokens 256
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

# name -> (hidden, intermediate, layers, heads, kv heads, vocab): the demo model's shape
# (learner.tinymodel, 0.30M parameters) and a ~94M one. The larger keeps the character tokenizer
# (prompts are short digit strings) but a 16k-row vocabulary, so the head costs what a real
# model's does.
MODELS = {
    "demo": (128, 256, 2, 4, 2, None),
    "large": (768, 3072, 8, 12, 4, 16384),
}
PROMPT = "12+34="


def build(name: str, cache: Path) -> Path:
    """The model directory for `name` (random init, built locally, cached)."""
    out = cache / name
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.tinymodel import build_tokenizer

    hidden, intermediate, layers, heads, kv_heads, vocab = MODELS[name]
    tok = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab or len(tok), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def measure(engine_name: str, model_dir: Path, device: str, dtype: str, threads: int, prompts: int, n: int,
            max_new_tokens: int, repeats: int, installs: int) -> dict:
    """One row, measured in this process (the child)."""
    import torch
    from safetensors.torch import load_file, save

    from learner.tinymodel import build_tokenizer
    from worker.engines.base import GenerationParams, Reference, make_engine, mismatch_kl

    base = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    # Two versions that differ everywhere, alternated, so every install moves every tensor.
    states = [base, {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in base.items()}]
    versions = [save(state) for state in states]
    t0 = time.perf_counter()
    engine = make_engine(engine_name, model_dir, device, dtype, threads, seed=0)
    startup = time.perf_counter() - t0
    install_s = []
    for v in range(installs + 1):
        t0 = time.perf_counter()
        engine.install(v, versions[v % 2])
        install_s.append(time.perf_counter() - t0)
    install_s = install_s[1:]  # the first install also warms the engine up
    detail = getattr(engine, "last_install", {})

    tok = build_tokenizer()
    prompt_ids = [tok(PROMPT)["input_ids"]] * prompts
    # An end-of-sequence id no sample can draw (-1), so that every sample runs to full length.
    p = GenerationParams(n=n, max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, stop_ids=(),
                         pad_id=tok.pad_token_id)
    engine.generate(prompt_ids[:1], GenerationParams(**{**p.__dict__, "n": 1, "max_new_tokens": 2}))  # warm up
    rates, groups = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        groups = engine.generate(prompt_ids, p)
        seconds = time.perf_counter() - t0
        rates.append(sum(len(s.tokens) for g in groups for s in g) / seconds)
    # Behaviour vs trainer log-probs for the installed version, on a few samples.
    ref = Reference(model_dir)
    state = states[engine.version % 2]
    samples = [s for g in groups for s in g][:8]
    trainer = [ref.logprobs(state, prompt_ids[0], s.tokens) for s in samples]
    kl = mismatch_kl([s.logprobs for s in samples], trainer)
    engine.close()
    return {
        "engine": engine_name, "model": model_dir.name, "device": engine.device, "dtype": dtype,
        "params": sum(t.numel() for t in base.values()), "startup_s": round(startup, 2),
        "tokens_per_s": round(statistics.median(rates), 1), "install_ms": round(1e3 * statistics.median(install_s), 1),
        "verify_ms": round(1e3 * detail["verify_s"], 1) if "verify_s" in detail else None,
        "install_detail": detail,
        "mismatch_kl": kl, "workload": f"{prompts}x{n}x{max_new_tokens}",
    }


def _child(args) -> int:
    row = measure(args.engine, Path(args.model_dir), args.device, args.dtype, args.threads, args.prompts, args.n,
                  args.max_new_tokens, args.repeats, args.installs)
    Path(args.out).write_text(json.dumps(row))
    return 0


def _run_child(engine: str, python: str, model_dir: Path, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [python, "-m", "worker.bench.engines", "--child", "--engine", engine, "--model-dir", str(model_dir),
               "--out", str(out), "--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads),
               "--prompts", str(args.prompts), "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens),
               "--repeats", str(args.repeats), "--installs", str(args.installs)]
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                              cwd=Path(__file__).resolve().parents[2])
        if proc.returncode != 0 or not out.exists():
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"engine": engine, "model": model_dir.name, "error": last[0][:200]}
        return json.loads(out.read_text())


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="echo-rl bench engines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="transformers,vllm", help="comma-separated (default: both)")
    parser.add_argument("--models", default="demo,large", help=f"comma-separated from {', '.join(MODELS)}")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per engine (default 2)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per generate call (default 8)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per sample (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate calls; the median is shown")
    parser.add_argument("--installs", type=int, default=5, help="timed installs; the median is shown")
    parser.add_argument("--python", dest="python_vllm", default=None,
                        help="interpreter with vllm (default: .venv-vllm/bin/python if present, else this one)")
    parser.add_argument("--cache-dir", type=Path, default=Path(".echo-cache/bench"), help="where models are built")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)

    engines = args.engines.split(",")
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        print(f"echo-rl bench engines: unknown model(s) {unknown}; choose from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    default_vllm = Path(".venv-vllm/bin/python")
    pythons = {"transformers": sys.executable,
               "vllm": args.python_vllm or (str(default_vllm) if default_vllm.exists() else sys.executable)}
    rows = []
    for model in models:
        model_dir = build(model, args.cache_dir)
        for engine in engines:
            if not args.json:
                print(f"measuring {engine} on {model} ...", file=sys.stderr, flush=True)
            rows.append(_run_child(engine, pythons.get(engine, sys.executable), model_dir, args))
    for row in rows:  # ratio vs the transformers engine on the same model
        base = next((r for r in rows if r["model"] == row["model"] and r["engine"] == "transformers"
                     and "tokens_per_s" in r), None)
        if base and "tokens_per_s" in row:
            row["ratio"] = round(row["tokens_per_s"] / base["tokens_per_s"], 2)
    if args.json:
        print(json.dumps(rows))
        return 0 if all("error" not in r for r in rows) else 1
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rollout engines ({args.device}, {args.dtype}, workload prompts x n x tokens = "
                        f"{args.prompts}x{args.n}x{args.max_new_tokens})")
    for col in ("engine", "model", "params", "tokens/s", "install ms", "of which verify", "ratio vs transformers",
                "mismatch_kl", "startup s"):
        table.add_column(col, justify="left" if col in ("engine", "model") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["engine"], r["model"], "", "[red]failed[/red]", "", "", "", "", "")
            continue
        table.add_row(r["engine"], r["model"], f"{r['params'] / 1e6:.1f}M", f"{r['tokens_per_s']:,.0f}",
                      f"{r['install_ms']:.0f}", "" if r["verify_ms"] is None else f"{r['verify_ms']:.0f}",
                      f"{r.get('ratio', ''):}", f"{r['mismatch_kl']:.1e}", f"{r['startup_s']:.1f}")
    console = Console(width=max(Console().width, 130))
    console.print(table)
    for r in rows:
        if "error" in r:
            console.print(f"[red]{r['engine']} on {r['model']} failed:[/red] {r['error']}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
