"""Hugging Face model helpers shared by the trainer, the eval loop and the transformers engine.

- `load_model_dir`: any HF causal-LM directory (config + weights + tokenizer).
- `sample`: batched, KV-cached sampling (temperature, top-p) returning per-token log-probs of
  the sampled tokens under the distribution they were actually drawn from (the behaviour
  policy μ the trainer's importance weights need).
- `completion_logprobs`: teacher-forced log-probs of given completions (the trainer's π).

Both use the same temperature scaling, so for fresh weights and top_p = 1 the two agree to
float rounding; that residual is what `mismatch_kl` measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # echo draws its own progress; per-file bars are noise here


def load_model_dir(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) from a Hugging Face model directory, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path} is not a Hugging Face model directory (no config.json); "
            "build the demo model with `echo-rl build-model --out {path}`"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval(), tokenizer


@dataclass
class Sample:
    tokens: list[int]
    logprobs: list[float]
    finish: str  # "stop" (end-of-sequence sampled) or "length"


@torch.no_grad()
def sample(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[Sample]:
    """One completion per prompt (repeat a prompt `n` times for a group).

    temperature 0 means greedy. The end-of-sequence token is part of the completion (it is a
    decision the policy made and is trained on); nothing after it is.
    """
    device = next(model.parameters()).device
    batch = len(prompts)
    width = max(map(len, prompts))
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding keeps every prompt's last token aligned
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)

    tokens = torch.zeros((batch, max_new_tokens), dtype=torch.long)
    logprobs = torch.zeros((batch, max_new_tokens))
    lengths = torch.full((batch,), max_new_tokens)
    done = torch.zeros(batch, dtype=torch.bool)
    past = None
    step_ids, step_pos = input_ids, positions
    for t in range(max_new_tokens):
        out = model(
            input_ids=step_ids,
            attention_mask=attention,
            position_ids=step_pos,
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        logits = out.logits[:, -1, :].float()
        if temperature <= 0:
            next_ids = logits.argmax(-1)
            logp = torch.log_softmax(logits, -1)
        else:
            logp = torch.log_softmax(logits / temperature, -1)
            if top_p < 1.0:
                logp = _top_p_logprobs(logp, top_p)
            next_ids = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        chosen = logp.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)
        next_ids = torch.where(done, torch.full_like(next_ids, pad_id), next_ids)
        tokens[:, t] = next_ids.cpu()
        logprobs[:, t] = chosen.cpu()
        finished_now = (~done) & (next_ids == eos_id)
        lengths[finished_now.cpu()] = t + 1
        done |= finished_now
        if bool(done.all()):
            break
        step_ids = next_ids.unsqueeze(-1)
        step_pos = step_pos[:, -1:] + 1
        attention = torch.cat([attention, torch.ones((batch, 1), dtype=attention.dtype, device=device)], 1)

    return [
        Sample(
            tokens=tokens[i, : lengths[i]].tolist(),
            logprobs=logprobs[i, : lengths[i]].tolist(),
            finish="stop" if lengths[i] < max_new_tokens or tokens[i, lengths[i] - 1] == eos_id else "length",
        )
        for i in range(batch)
    ]


def _top_p_logprobs(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Log-probs renormalised over the smallest set of tokens whose mass reaches `top_p`."""
    sorted_logp, order = logp.sort(-1, descending=True)
    cumulative = sorted_logp.exp().cumsum(-1)
    drop_sorted = cumulative - sorted_logp.exp() >= top_p  # keep the token that crosses top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    kept = logp.masked_fill(drop, float("-inf"))
    return kept - torch.logsumexp(kept, -1, keepdim=True)


def completion_logprobs(
    model,
    prompts: list[list[int]],
    completions: list[list[int]],
    *,
    pad_id: int,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs of each completion token: `(logp [B, Lc], mask [B, Lc])`.

    Right-padded; differentiable (call under `torch.no_grad()` when no gradient is wanted).
    """
    device = next(model.parameters()).device
    batch = len(prompts)
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(map(len, seqs))
    comp_width = max(1, max(map(len, completions)))
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
    logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
    logp_all = torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), -1)

    # Token j of completion i sits at position len(prompt_i) + j and is predicted by the
    # logits one position earlier.
    index = torch.zeros((batch, comp_width), dtype=torch.long)
    mask = torch.zeros((batch, comp_width))
    targets = torch.zeros((batch, comp_width), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        index[i, : len(c)] = torch.arange(len(p) - 1, len(p) - 1 + len(c))
        targets[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, : len(c)] = 1
    index, targets, mask = index.to(device), targets.to(device), mask.to(device)
    rows = logp_all.gather(1, index.unsqueeze(-1).expand(-1, -1, logp_all.shape[-1]))
    logp = rows.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
    return logp, mask
