"""Hugging Face model helpers shared by the trainer, the eval loop and the transformers engine.

- `processed_logits`: the sampling transform, temperature then top-p with vLLM's rule. It
  defines the behaviour policy μ the workers sample from *and* the policy π the trainer
  scores, so the two are the same function of the logits.
- `sample`: batched, KV-cached sampling returning per-token log-probs of the sampled tokens
  under the distribution they were actually drawn from (μ).
- `TokenBatch` + `policy_logprobs`: teacher-forced log-probs of given completions (π), as
  `logit[target] − logsumexp` over the head applied to completion positions only, in chunks
  of tokens, each recomputed in the backward pass: the `[tokens, vocab]` logits of a batch
  never exist at once. `completion_logprobs` is the padded-matrix form of the same numbers.

For fresh weights the two agree to float rounding; that residual is what `mismatch_kl`
measures.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
import inspect

import torch
from torch.nn import functional as F
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # echo draws its own progress; per-file bars are noise here

LOGIT_CHUNK_ELEMENTS = 1 << 25  # default chunk: tokens × vocab ≤ 32M fp32 logits (128 MiB)


# --- the sampling transform (μ and π alike) -------------------------------------------------------

def top_p_keep(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens the nucleus keeps: vLLM's rule (`apply_top_k_top_p`), step for step.

    Sort ascending, cumulate the softmax, drop every token whose inclusive cumulative mass is
    ≤ 1 − top_p, never the most likely one. In descending order that keeps each token whose
    higher-ranked mass is < top_p, i.e. the token that crosses top_p is kept.
    """
    ascending, order = logits.sort(-1, descending=False)
    cumulative = ascending.softmax(-1).cumsum(-1)
    drop = cumulative <= 1 - torch.tensor(top_p, dtype=cumulative.dtype)  # 1 − p in the logits' dtype, as vLLM
    drop[..., -1] = False
    return ~torch.zeros_like(drop).scatter(-1, order, drop)


def processed_logits(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """fp32 logits of the distribution sampled from: `/ temperature` (0 = greedy, scored at 1),
    then everything outside the top-p nucleus at −inf (the mask carries no gradient)."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    if top_p < 1.0:
        with torch.no_grad():
            keep = top_p_keep(scaled, top_p)
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return scaled


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
    stop_ids: int | Collection[int],
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[Sample]:
    """One completion per prompt (repeat a prompt `n` times for a group).

    temperature 0 means greedy (log-probs at temperature 1, no top-p). A completion ends at
    the first of `stop_ids` (every end-of-turn id: eos, `<|im_end|>`, ...); that token is part
    of it (a decision the policy made, trained on), nothing after it is.
    """
    stops = torch.tensor(sorted({stop_ids} if isinstance(stop_ids, int) else set(stop_ids)), dtype=torch.long)
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
    cache_kw = _cache_kwarg(model)
    for t in range(max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=attention, position_ids=step_pos, use_cache=True,
                    **{cache_kw: past})
        past = getattr(out, cache_kw)
        logits = out.logits[:, -1, :]
        if temperature <= 0:
            logp = torch.log_softmax(logits.float(), -1)
            next_ids = logp.argmax(-1)
        else:
            logp = torch.log_softmax(processed_logits(logits, temperature, top_p), -1)
            next_ids = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        chosen = logp.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)
        next_ids = torch.where(done.to(device), torch.full_like(next_ids, pad_id), next_ids)
        tokens[:, t] = next_ids.cpu()
        logprobs[:, t] = chosen.cpu()
        finished_now = (~done) & torch.isin(next_ids.cpu(), stops)
        lengths[finished_now] = t + 1
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
            finish="stop" if lengths[i] < max_new_tokens or bool(torch.isin(tokens[i, lengths[i] - 1], stops)) else "length",
        )
        for i in range(batch)
    ]


# --- teacher-forced log-probs (π) -----------------------------------------------------------------

def _ids(prompt, completion) -> torch.Tensor:
    """A sequence's token ids; each part a list or an array (the learner keeps completions as arrays)."""
    return torch.cat([torch.as_tensor(prompt, dtype=torch.long), torch.as_tensor(completion, dtype=torch.long)])


def _targets(completions) -> torch.Tensor:
    return torch.cat([torch.as_tensor(c, dtype=torch.long) for c in completions])


@dataclass
class TokenBatch:
    """Prompt+completion sequences and where their completion tokens are: right-padded rows, or
    (`packed`) rows as long as the longest sequence, each holding as many sequences end to end
    as fit, every sequence restarting its position ids at 0 — transformers then masks attention
    to each sequence's own tokens (a block-diagonal causal mask; varlen kernels under flash
    attention). Rows no longer than the longest sequence keep attention's cost what padded rows
    cost (rows × width²) where one long row would make it (Σ lengths)².

    `positions[k]` is the flat index (row·width + column) of the hidden state that predicts
    completion token `k`, `targets[k]` that token; completion tokens are listed sequence by sequence.
    """

    input_ids: torch.Tensor  # [rows, width]
    attention_mask: torch.Tensor | None  # [rows, width]; None when packed
    positions: torch.Tensor  # [tokens]
    targets: torch.Tensor  # [tokens]
    lengths: list[int]  # completion tokens per sequence
    position_ids: torch.Tensor | None = None  # [rows, width] when packed

    @classmethod
    def build(cls, prompts: list[list[int]], completions: list[list[int]], pad_id: int,
              device: torch.device | str = "cpu", packed: bool = False) -> TokenBatch:
        if packed:
            return cls.pack(prompts, completions, device)
        width = max(len(p) + len(c) for p, c in zip(prompts, completions))
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        positions = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            input_ids[i, : len(p) + len(c)] = _ids(p, c)
            attention[i, : len(p) + len(c)] = 1
            # Completion token j sits at len(p) + j and is predicted one position earlier.
            positions += range(i * width + len(p) - 1, i * width + len(p) - 1 + len(c))
        return cls(input_ids.to(device), attention.to(device), torch.tensor(positions, dtype=torch.long, device=device),
                   _targets(completions).to(device), [len(c) for c in completions])

    @classmethod
    def pack(cls, prompts: list[list[int]], completions: list[list[int]], device: torch.device | str = "cpu") -> TokenBatch:
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
        width = max(lengths)
        rows: list[list[int]] = []  # first fit, longest first
        room: list[int] = []
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            k = next((k for k, r in enumerate(room) if lengths[i] <= r), None)
            if k is None:
                rows.append([])
                room.append(width)
                k = len(rows) - 1
            rows[k].append(i)
            room[k] -= lengths[i]
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        position_ids = torch.zeros((len(rows), width), dtype=torch.long)
        start: dict[int, int] = {}  # sequence -> its flat offset
        for r, members in enumerate(rows):
            at = 0
            for i in members:
                ids[r, at : at + lengths[i]] = _ids(prompts[i], completions[i])
                position_ids[r, at : at + lengths[i]] = torch.arange(lengths[i])
                start[i] = r * width + at
                at += lengths[i]
            position_ids[r, at:] = torch.arange(width - at)  # the row's tail: a sequence of its own, never read
        positions = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            positions += range(start[i] + len(p) - 1, start[i] + len(p) - 1 + len(c))
        return cls(ids.to(device), None, torch.tensor(positions, dtype=torch.long, device=device),
                   _targets(completions).to(device), [len(c) for c in completions],
                   position_ids=position_ids.to(device))

    @property
    def padded_tokens(self) -> int:
        """Tokens the forward computes (padding included)."""
        return self.input_ids.numel()


def chunk_tokens_for(vocab: int, chunk_tokens: int = 0) -> int:
    """Tokens per head chunk: given, or as many as keep one chunk's logits at 32M elements."""
    return chunk_tokens if chunk_tokens > 0 else max(1, LOGIT_CHUNK_ELEMENTS // vocab)


def _chunk_logprobs(hidden, weight, bias, targets, temperature: float, top_p: float):
    logits = processed_logits(F.linear(hidden, weight, bias), temperature, top_p)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, *, temperature: float,
                  top_p: float, chunk_tokens: int = 0) -> torch.Tensor:
    """log π(target) for each row of `hidden` `[tokens, H]`, `chunk_tokens` rows at a time.

    With gradients on, each chunk is checkpointed: its logits are recomputed in the backward
    pass instead of kept, so memory holds one chunk's `[chunk, vocab]` at a time. A target
    outside π's top-p nucleus gets −inf (π gives it no mass).
    """
    step = chunk_tokens_for(head.weight.shape[0], chunk_tokens)
    pieces = []
    for start in range(0, hidden.shape[0], step):
        args = (hidden[start : start + step], head.weight, head.bias, targets[start : start + step], temperature, top_p)
        if torch.is_grad_enabled():
            pieces.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(*args))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


def check_head(model) -> None:
    """Refuse models whose logits are not `hidden @ W_head`, which π here assumes."""
    config = model.config
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            raise ValueError(f"{type(model).__name__} transforms its logits ({attr} = {getattr(config, attr)}); "
                             "echo's chunked log-probs assume logits = hidden @ W_head and do not support it yet")


def completion_hidden(model, batch: TokenBatch) -> torch.Tensor:
    """The trunk's last hidden state at each position that predicts a completion token, `[tokens, H]`."""
    hidden = model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=batch.position_ids, use_cache=False).last_hidden_state
    return hidden.flatten(0, 1).index_select(0, batch.positions)


def policy_logprobs(model, batch: TokenBatch, *, temperature: float, top_p: float,
                    chunk_tokens: int = 0) -> torch.Tensor:
    """log π of every completion token of `batch` (flat, row by row) under an HF causal LM."""
    hidden = completion_hidden(model, batch)
    return head_logprobs(hidden, model.get_output_embeddings(), batch.targets, temperature=temperature,
                         top_p=top_p, chunk_tokens=chunk_tokens)


@torch.no_grad()
def greedy_gaps(model, batch: TokenBatch, chunk_tokens: int = 0) -> torch.Tensor:
    """For every completion token of `batch`: how far its logit lies below the largest (0 for the
    argmax). A greedy completion has 0 everywhere, up to the engines' numerics."""
    hidden = completion_hidden(model, batch)
    head = model.get_output_embeddings()
    step = chunk_tokens_for(head.weight.shape[0], chunk_tokens)
    pieces = []
    for start in range(0, hidden.shape[0], step):
        logits = F.linear(hidden[start : start + step], head.weight, head.bias).float()
        chosen = logits.gather(-1, batch.targets[start : start + step].unsqueeze(-1)).squeeze(-1)
        pieces.append(logits.max(-1).values - chosen)
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


# The least variance a position's mid-rank is held to: that of a policy 99% sure of its token.
# Where π is surer (a solved prompt late in a run), its own variance is ~1e-5 and a stale
# snapshot's slightly different certainty read as many standard deviations; a written token
# still moves z by 10 of them per token.
RANK_VARIANCE_FLOOR = (1.0 - 0.99**3) / 12.0


@torch.no_grad()
def rank_terms(model, batch: TokenBatch, *, temperature: float, top_p: float, chunk_tokens: int = 0) -> torch.Tensor:
    """For every completion token of `batch`, `[tokens, 4]`: where it ranks under π (π as sampled
    from: the temperature, the top-p nucleus) as u − ½, the variance of u under π, 1 inside the
    nucleus (0 outside, where u − ½ is ½ and the token is counted apart), and its log π (−inf
    outside), so that one pass checks a group's tokens and its μ (`policy_logprobs`' value).

    u is the token's mid-rank: π's mass on likelier tokens plus half its own. A token sampled
    from π has E[u] = ½ and Var u = (1 − Σπ³)/12 (held to at least `RANK_VARIANCE_FLOOR`)
    whatever came before (a martingale), so over many tokens Σ(u − ½) / √Σ variance is a
    standard normal — and a worker that chose its tokens
    (greedy: u near 0; a phrase the policy would rarely say: u near 1) drifts away from 0. Each
    token moves the sum by at most ½: the surprisal it replaced had heavy tails (a stale
    snapshot's token π now all but forbids added 20 nats), and honest workers of the demo read
    as 40 standard deviations off."""
    hidden = completion_hidden(model, batch)
    head = model.get_output_embeddings()
    step = chunk_tokens_for(head.weight.shape[0], chunk_tokens)
    pieces = []
    for start in range(0, hidden.shape[0], step):
        logp = processed_logits(F.linear(hidden[start : start + step], head.weight, head.bias), temperature,
                                top_p).log_softmax(-1)
        target = batch.targets[start : start + step].unsqueeze(-1)
        p = logp.exp()
        own = p.gather(-1, target)
        u = (p * (p > own)).sum(-1) + 0.5 * (p * (p == own)).sum(-1)  # ties share the mid-rank
        variance = (1.0 - p.pow_(3).sum(-1)).clamp(min=RANK_VARIANCE_FLOOR * 12.0) / 12.0
        pieces.append(torch.stack([u - 0.5, variance, (own.squeeze(-1) > 0).float(), logp.gather(-1, target).squeeze(-1)],
                                  -1))
    return torch.cat(pieces) if pieces else hidden.new_zeros((0, 4), dtype=torch.float32)


def completion_logprobs(
    model,
    prompts: list[list[int]],
    completions: list[list[int]],
    *,
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs of each completion token: `(logp [B, Lc], mask [B, Lc])`.

    Right-padded; differentiable (call under `torch.no_grad()` when no gradient is wanted).
    """
    device = next(model.parameters()).device
    batch = TokenBatch.build(prompts, completions, pad_id, device)
    flat = policy_logprobs(model, batch, temperature=temperature, top_p=top_p)
    width = max(1, max(batch.lengths))
    mask = torch.zeros((len(prompts), width), device=device)
    logp = torch.zeros((len(prompts), width), device=device, dtype=flat.dtype)
    rows = torch.repeat_interleave(torch.arange(len(prompts), device=device),
                                   torch.tensor(batch.lengths, device=device))
    cols = torch.cat([torch.arange(n, device=device) for n in batch.lengths]) if flat.numel() else rows
    mask[rows, cols] = 1.0
    logp = logp.index_put((rows, cols), flat)
    return logp, mask


def _cache_kwarg(model) -> str:
    """The KV cache's name in `model.forward`: `cache` from transformers 5.x (`past_key_values`
    is deprecated there, removed in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
