"""Before any weight loads: what is about to be trained, and will a step fit.

Reads the model directory's config and tokenizer only (the model is built on the meta device),
prints parameters, dtypes, tied embeddings, vocabulary against tokenizer, and the predicted
memory per rank for the configured ranks and token budget (`learner.train.memory`), and refuses a
configuration that cannot work, saying what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from learner.config import LearnerConfig
from learner.train.memory import GiB, ModelShape, MemoryPlan, available_bytes, predict
from learner.train.model import DTYPES, saved_dtype


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class PreflightError(Exception):
    """The configuration cannot train this model here; the message says what to change."""


@dataclass
class Preflight:
    shape: ModelShape
    plan: MemoryPlan
    available: float
    where: str
    lines: list[str]


def preflight(cfg: LearnerConfig, ranks: int, device: str, need_tokenizer: bool = True) -> Preflight:
    """The report and the prediction; `need_tokenizer=False` (`--preflight`) also reads a
    directory that holds only a config.json (to plan a model not downloaded yet)."""
    from transformers import AutoConfig, AutoTokenizer

    from echo.hf import chunk_tokens_for

    t = cfg.trainer
    path = cfg.model.path
    shape = ModelShape.of(path)
    arch = "/".join(AutoConfig.from_pretrained(path).architectures or ["?"])
    tokens = None
    if any((path / name).exists() for name in TOKENIZER_FILES):
        try:
            tokens = len(AutoTokenizer.from_pretrained(path))
        except (OSError, ValueError, TypeError) as e:
            raise PreflightError(f"cannot load the tokenizer of {path}: {e}") from None
    elif need_tokenizer:
        raise PreflightError(f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)}); save the tokenizer into the "
                             "model directory (tokenizer.save_pretrained)")
    if tokens is not None and tokens > shape.vocab:
        raise PreflightError(f"the tokenizer of {path} has {tokens} tokens but the model's output layer "
                             f"has {shape.vocab} rows: tokens past {shape.vocab - 1} would index out of range. "
                             "Resize the embeddings (model.resize_token_embeddings) and save the model again")
    compute = t.compute_dtype
    publish = saved_dtype(path) if cfg.publish.dtype == "auto" else cfg.publish.dtype
    snapshot_bytes = shape.params * DTYPES[publish].itemsize + shape.tied * shape.vocab * shape.hidden * DTYPES[publish].itemsize
    full_bytes, lora = snapshot_bytes, t.lora
    adapter = shape.adapter_params(lora.rank, lora.target_modules) if lora else 0
    if lora:
        if not adapter:
            raise PreflightError(f"[trainer.lora] target_modules {list(lora.target_modules)} match no linear of a "
                                 f"decoder layer of {path} (its linears: {sorted({n for n, _, _ in shape.linears})})")
        snapshot_bytes = adapter * DTYPES[publish].itemsize
    # A sequence longer than the budget is a micro-batch of its own: an episode's tokens bound it from below.
    micro = max(t.micro_batch_tokens, cfg.rollout.episode_tokens(cfg.task.build()))
    chunk = min(chunk_tokens_for(shape.vocab, t.logprob_chunk_tokens), micro)
    plan = predict(shape, ranks=ranks, micro_batch_tokens=micro, compute_bytes=DTYPES[compute].itemsize,
                   checkpointing=t.activation_checkpointing, reference=t.kl_coef > 0, chunk_tokens=chunk,
                   top_p=cfg.rollout.top_p, gpu=device.startswith("cuda"), eval_copy=cfg.eval.where == "workers",
                   mixed=compute == "bfloat16", adapter_params=adapter,
                   claim_copy=cfg.kept_versions > 0)
    available, where = available_bytes(device, ranks)
    lines = [
        f"model {path}: {shape.params / 1e6:.1f}M parameters ({arch}, {shape.layers} layers, hidden {shape.hidden}, "
        f"vocab {shape.vocab}; tokenizer {tokens if tokens is not None else 'not in the directory'}"
        f"{' tokens' if tokens is not None else ''}), tied embeddings: {'yes' if shape.tied else 'no'}",
        (f"  weights: fp32 master + AdamW state; forward/backward {compute}"
         f"{' (FSDP2 mixed precision)' if compute == 'bfloat16' else ' autocast' if compute != 'float32' else ''}; "
         f"snapshots {publish} ({_size(snapshot_bytes)} each)")
        if not lora else
        (f"  weights: LoRA rank {lora.rank}, alpha {lora.alpha:g} on {','.join(lora.target_modules)}: "
         f"{_count(adapter)} adapter parameters (fp32 master + AdamW state), the base frozen in {compute}; "
         f"versions are the adapter: {_size(snapshot_bytes)} each in {publish} "
         f"(full weights: {_size(full_bytes)}, {_times(full_bytes / snapshot_bytes)})"),
        f"  memory: {ranks} rank{'s' if ranks > 1 else ''} on {device}, micro-batches of {micro} tokens, "
        f"activation checkpointing {'on' if t.activation_checkpointing else 'off'}, head chunks of {chunk} tokens: "
        f"predicted {plan.describe()}; {where}",
    ]
    if versions := cfg.kept_versions:
        lines.append(f"  stale groups checked against their own version: {versions} published versions kept in "
                     f"host memory, {_size(versions * snapshot_bytes / ranks)} per rank "
                     f"([verify] stale_check_fraction = 0 keeps none)")
    narrowest = min((min(i, o) for n, i, o in shape.linears if n in set(lora.target_modules)), default=0) if lora else 0
    if lora and lora.rank >= narrowest:
        lines.append(f"  warning: LoRA rank {lora.rank} is not below the width of the narrowest adapted layer "
                     f"({narrowest}): the adapter can do no more than training those layers whole and costs more; "
                     f"use a rank below {narrowest}")
    return Preflight(shape, plan, available, where, lines)


# A tiny model's adapter is kilobytes: "0.0M parameters, 0.0 MB each" said nothing.
def _count(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def _size(b: float) -> str:
    return f"{b / 1e6:,.1f} MB" if b >= 1e5 else f"{b / 1e3:,.1f} kB"


def _times(ratio: float) -> str:
    """How many times fewer bytes a version is than the full weights."""
    return f"{ratio:,.0f}× more" if ratio >= 10 else f"{ratio:.1f}× more" if ratio >= 1 else f"{1 / ratio:.1f}× less"


def check_fits(pf: Preflight, cfg: LearnerConfig, ranks: int) -> None:
    if not cfg.trainer.check_memory or pf.plan.total <= pf.available:
        return
    t = cfg.trainer
    advice = [f"more ranks (--nproc {2 * ranks})" if pf.plan.state > pf.available / 2 else None,
              f"a smaller [trainer] micro_batch_tokens (now {t.micro_batch_tokens})"
              if pf.plan.activations > pf.available / 4 else None,
              "[trainer] activation_checkpointing = true" if not t.activation_checkpointing else None,
              "[trainer] compute_dtype = 'bfloat16'" if t.compute_dtype == "float32" else None]
    raise PreflightError(
        f"a training step is predicted to need {pf.plan.total / GiB:.1f} GiB per rank but {pf.where}. Try "
        + ", ".join(a for a in advice if a) + "; or set [trainer] check_memory = false to start anyway")
