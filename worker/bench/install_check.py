"""`echo-rl bench install-check`: what checking an installed version costs a vLLM worker's CPU.

A vLLM worker proves each install by comparing its engine's log-probs of a fixed probe with the
trainer's. Before 2026-11-29 it computed the trainer's numbers itself, a forward of the model on
its CPU (`worker.engines.base.Reference`), and with top-p or a temperature four more to prove the
sampler; now the learner writes them into the snapshot's metadata and the worker reads them
(`echo.lora.read_weights_probe`), and the sampler is proved once per setting. This times both on
a model of the given shape (random bf16 weights, built here; nothing is downloaded), and scales
the CPU forward to 8B parameters by parameter count (an estimate, labelled so).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

# A Qwen2.5-1.5B-shaped model: hidden, intermediate, layers, heads, kv heads, vocab.
SHAPE = (1536, 8960, 28, 12, 2, 151936)
TARGET_PARAMS = 8.0e9


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="echo-rl bench install-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=SHAPE[2], help="decoder layers of the Qwen2.5-1.5B shape (fewer: faster)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads torch may use")
    args = p.parse_args(argv)

    import torch
    from safetensors.torch import save
    from transformers import Qwen2Config

    from echo.lora import read_weights_probe, weights_metadata
    from echo.table import table
    from worker.engines.base import Reference

    torch.set_num_threads(args.threads)
    hidden, intermediate, _, heads, kv_heads, vocab = SHAPE
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         tie_word_embeddings=False)
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        reference = Reference(Path(tmp))
        g = torch.Generator().manual_seed(0)
        state = {name: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
                 for name, shape in reference.expected.items()}
        params = sum(t.numel() for t in state.values())
        prompt, completion = reference.probe
        reference.logprobs(state, prompt, completion)  # warm: first calls pay for imports and kernels
        t0 = time.perf_counter()
        probe = reference.logprobs(state, prompt, completion)
        forward_s = time.perf_counter() - t0
        blob = save({"w": torch.zeros(4)}, metadata=weights_metadata(probe, "bfloat16"))
        t0 = time.perf_counter()
        for _ in range(1000):
            read_weights_probe(blob)
        read_s = (time.perf_counter() - t0) / 1000
    scale = TARGET_PARAMS / params
    rows = [
        ["the trainer's probe, a forward on this CPU (before)", f"{params / 1e9:.2f}B", f"{forward_s:.2f}",
         f"{5 * forward_s:.2f}"],
        ["  the same, scaled by parameters (an estimate)", f"{TARGET_PARAMS / 1e9:.0f}B", f"{forward_s * scale:.0f}",
         f"{5 * forward_s * scale:.0f}"],
        ["the learner's probe, read from the metadata (now)", "any", f"{read_s:.1e}", f"{read_s:.1e}"],
    ]
    print(f"Qwen2.5-1.5B shape, {args.layers} layers, bf16 weights, {args.threads} threads; "
          f"probe {len(prompt)} + {len(completion)} tokens; with top-p < 1, four sampled probes more")
    print(table(["each install checked by", "model", "s per install, top-p 1", "s, top-p < 1"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
