"""`echo-rl bench buffer`: what the learner's buffer of uploaded groups costs to hold.

The groups a learner holds between uploads and training, `(S + 1) · G` of them, arrive as
int32 token ids and float32 log-probs. Held as Python lists, every number is an object and
every list a container the cyclic garbage collector walks: each full collection holds the
event loop (heartbeats, leases and uploads wait) for as long as the walk takes. This builds
the buffer through the real upload decoder (`echo.wire.decode_submission`) and compares what
it holds (arrays) with the same numbers as lists, in one run: memory traced, and the time of
a full collection with everything else frozen out of it.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

import numpy as np

from echo.wire import GroupMsg, SampleMsg, Submission, decode_submission, encode_submission


def _uploads(groups: int, samples: int, tokens: int, vocab: int, seed: int = 0):
    """One encoded upload per group (a lease of one prompt), as a worker sends it."""
    rng = np.random.default_rng(seed)
    for g in range(groups):
        yield encode_submission(Submission("w", "L", [GroupMsg(f"p{g}", 0, [
            SampleMsg(rng.integers(0, vocab, tokens, dtype=np.int32), -rng.random(tokens, dtype=np.float32), 1.0)
            for _ in range(samples)])]))


def _hold(args, as_lists: bool) -> tuple[float, float]:
    """Decode the buffer's uploads and keep their samples; returns (MB traced, full collection ms)."""
    for body in _uploads(1, args.samples, args.tokens, args.vocab, seed=1):  # the decoder's one-time setup, untraced
        decode_submission(body, vocab_size=args.vocab, max_tokens=args.tokens, group_size=args.samples, max_groups=1)
    gc.collect()
    gc.freeze()  # the interpreter's own objects, as echo-learner does once serving
    tracemalloc.start()
    held = []
    for body in _uploads(args.groups, args.samples, args.tokens, args.vocab):
        sub = decode_submission(body, vocab_size=args.vocab, max_tokens=args.tokens, group_size=args.samples,
                                max_groups=1)
        for s in sub.groups[0].samples:
            held.append((s.tokens.tolist(), s.logprobs.tolist()) if as_lists else (s.tokens, s.logprobs))
    traced = tracemalloc.get_traced_memory()[0] / (1 << 20)
    tracemalloc.stop()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t)
    del held
    gc.unfreeze()
    gc.collect()
    return traced, 1e3 * min(times)


def cli(argv: list[str]) -> int:
    from echo.table import table

    p = argparse.ArgumentParser(prog="echo-rl bench buffer", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=768, help="groups held (default 768: (S + 1) · G with S = 2, G = 256)")
    p.add_argument("--samples", type=int, default=8, help="samples per group (default 8)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per sample (default 2,048)")
    p.add_argument("--vocab", type=int, default=151_936, help="vocabulary size (default Qwen's)")
    args = p.parse_args(argv)
    arrays = _hold(args, as_lists=False)
    lists = _hold(args, as_lists=True)
    n = args.groups * args.samples * args.tokens
    print(f"the buffer: {args.groups} groups × {args.samples} samples × {args.tokens} tokens = {n / 1e6:.1f} M tokens "
          "(ids and log-probs), decoded from real uploads")
    print(table(["held as", "memory MB", "bytes/token", "full GC pass ms"], [
        ["arrays (echo-learner)", f"{arrays[0]:.0f}", f"{arrays[0] * (1 << 20) / n:.1f}", f"{arrays[1]:.1f}"],
        ["Python lists", f"{lists[0]:.0f}", f"{lists[0] * (1 << 20) / n:.1f}", f"{lists[1]:.1f}"],
        ["lists / arrays", f"{lists[0] / arrays[0]:.1f}×", "", f"{lists[1] / max(arrays[1], 1e-3):.0f}×"]]))
    print("a full pass holds the learner's event loop that long: 8 bytes/token is the floor (int32 + float32)")
    return 0
