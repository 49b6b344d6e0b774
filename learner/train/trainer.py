"""The trainer: one GRPO update per batch of groups, snapshots and checkpoints, on one rank or
many (FSDP2 under torchrun; see `learner.train.dist`).

A step, on every rank at once:

    advantages per group → the batch's samples in a seeded order → `minibatches` slices
    each slice: this rank's share (split by tokens) → micro-batches of ≤ micro_batch_tokens
                → forward (π, chunked head) + backward under autocast, gradients accumulate
                → clip, AdamW on the fp32 master weights
    statistics: token sums, one all-reduce

Each optimizer step's loss is normalised by its own slice's loss tokens on all ranks (Σ mask:
the policy's tokens), so micro-batches and ranks add up to the slice's loss, its gradient does
not depend on the split, and with `minibatches = k` every step's gradient is a mean (clipping at
`max_grad_norm` means what it means with one step per batch). Ranks run
the same number of micro-batches (a rank short of work runs an empty one), because every
forward and backward of a sharded model is a collective.

Blocking torch code: the learner runs it on its trainer thread, never on the event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from echo import protocol as P
from echo.chat import ChatError, stop_ids
from echo.episodes import EpisodeError, Episodes, segments
from echo.hf import TokenBatch
from echo.tasks import Prompt, Task
from learner.buffer import BatchInfo, Group
from learner.config import LearnerConfig
from learner.rundir import updates_of
from learner.train.dist import World, as_root, sharded_alone
from learner.train.losses import LossStats, group_advantages, grpo_loss
from learner.train.microbatch import pack, split_by_tokens
from echo.lora import AdapterMeta, base_digest, probe_tokens, read_adapter_meta, weights_metadata
from learner.train.lora import adapter_parameters, export_merged, write_adapter_dir
from learner.train.model import DTYPES, Policy, build_policy, count_parameters, saved_dtype, write_safetensors
from learner.train.versions import KeptVersions

TOKENIZER_AND_CONFIG = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
                        "tokenizer.model", "added_tokens.json")


def lr_factor(step: int, schedule: str, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base learning rate after `step` updates."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


@dataclass
class _Samples:
    """A batch flattened to its samples, in group order: sample i is episode `completions[i]` of
    prompt `prompts[i]`, sampled with log-probs `behaviour[i]`, trained where `masks[i]` is 1
    (the policy's tokens; the environment's are read, never trained), of group `owner[i]`."""

    prompts: list[list[int]]
    completions: list  # per sample, token ids: lists or arrays (echo.hf.TokenBatch takes both)
    behaviour: list
    masks: list[list[int]]
    owner: list[int]
    rewards: torch.Tensor  # groups × samples
    advantages: list[float]
    lengths: list[int]  # prompt + episode tokens
    total_tokens: int  # the policy's tokens of the whole batch (Σ mask)
    turns: list[int]  # per sample, the policy's turns
    truncated: int  # samples cut at the turn or token budget

    @classmethod
    def of(cls, batch: BatchInfo, adv_eps: float | None, asymre_shift: float | None = None) -> _Samples:
        """`asymre_shift` set: AsymRE advantages r − (mean + δV), not divided by the std;
        `adv_eps` None: no advantages (samples only scored, never trained)."""
        prompts, completions, behaviour, masks, rewards, truncated = [], [], [], [], [], 0
        for g in batch.groups:
            prompts += [g.prompt_ids] * len(g.completions)
            completions += g.completions
            behaviour += g.behaviour_logprobs
            masks += g.masks if g.masks is not None else [[1] * len(c) for c in g.completions]
            rewards.append(g.rewards)
            truncated += sum(g.truncated)
        reward_t = torch.tensor(rewards, dtype=torch.float32)
        return cls(prompts, completions, behaviour, masks,
                   owner=[gi for gi, g in enumerate(batch.groups) for _ in g.completions], rewards=reward_t,
                   advantages=[] if adv_eps is None else
                   (group_advantages(reward_t, adv_eps) if asymre_shift is None else
                    reward_t - reward_t.mean(-1, keepdim=True) - asymre_shift).flatten().tolist(),
                   lengths=[len(p) + len(c) for p, c in zip(prompts, completions)],
                   total_tokens=sum(map(sum, masks)), turns=[_turns(m) for m in masks], truncated=truncated)

    def turn_fields(self) -> dict[str, float]:
        """What the run log shows of episodes: turns, tokens per policy turn, the environment's share."""
        episode = sum(map(len, self.completions))
        return {"turns_mean": sum(self.turns) / max(1, len(self.turns)),
                "turn_tokens_mean": self.total_tokens / max(1, sum(self.turns)),
                "env_token_share": 1 - self.total_tokens / max(1, episode), "truncated": self.truncated}


def _turns(mask: list[int]) -> int:
    """The policy's turns of an episode: its runs of 1s."""
    return sum(1 for k, m in enumerate(mask) if m and (k == 0 or not mask[k - 1]))


class _Gaps:
    """Per group, Σ|log π − log μ| and the token count over its samples, so π can be compared
    with the μ the worker claimed, fresh and stale groups alike (learner.verify)."""

    def __init__(self, batch: BatchInfo, samples: _Samples, mine: list[int], device: torch.device,
                 measured: Callable[[int, torch.Tensor], None] = lambda i, lp: None):
        self.samples = samples
        self.mine = set(mine)
        self.measured = measured  # each sample's π, once (the improbable windows of the fresh ones)
        self.sums = torch.zeros(len(batch.groups), 2, dtype=torch.float64, device=device)

    def measure(self, values: dict[int, torch.Tensor]) -> None:
        """Add π's log-probs `values` (per sample) of the fresh samples among them."""
        for i, lp in values.items():
            if i in self.mine:
                lp = lp.detach().double()
                mu = torch.as_tensor(self.samples.behaviour[i]).to(self.sums.device, torch.float64)
                mine = torch.tensor(self.samples.masks[i], dtype=torch.bool, device=self.sums.device)
                inside = torch.isfinite(lp) & mine  # outside π's nucleus: counted apart, not a gap; the environment's: no μ
                owner = self.samples.owner[i]
                self.sums[owner, 0] += (lp[inside] - mu[inside]).abs().sum()
                self.sums[owner, 1] += inside.sum()
                self.measured(i, lp)


def _token_sums(terms: torch.Tensor, samples: _Samples, i: int) -> torch.Tensor:
    """Sample `i`'s checks from its `echo.hf.rank_terms`, over its policy tokens inside π's
    nucleus: Σ(u − ½), Σ variance, the tokens inside and outside, Σ|log π − log μ| and the
    tokens that is over (the environment's tokens carry no μ and are the task's, not sampled),
    and Σ log π over all its policy tokens (−inf with one outside: `_copies`' sequence log-prob)."""
    excess, variance, in_nucleus, logp = terms.double().unbind(-1)
    policy_token = torch.tensor(samples.masks[i], dtype=torch.bool, device=terms.device)
    inside = (in_nucleus > 0) & policy_token
    mu = torch.as_tensor(samples.behaviour[i], dtype=torch.float64).to(terms.device)
    return torch.stack([excess[inside].sum(), variance[inside].sum(), inside.sum(), (policy_token & ~inside).sum(),
                        (logp[inside] - mu[inside]).abs().sum(), inside.sum(), logp[policy_token].sum()])


def _improbable(logp: torch.Tensor, samples: _Samples, i: int, nats: float) -> set[int]:
    """Sample `i`'s improbable windows (`learner.verify.Repeats`), as keys: from each policy token
    π gives at most e^-1, the shortest run of the turn's tokens from it whose Σ log π reaches
    −`nats`, hashed. `logp`: its tokens' log π under the very version that sampled it, so that
    sampling repeats a given window with probability at most e^-nats. A token outside π's
    nucleus (−inf) ends a run without one (bf16 engines sample at the nucleus' edge; such tokens
    are counted apart)."""
    logp = logp.detach().double().cpu().numpy()
    tokens, keys = samples.completions[i], set()
    for value, start, end in segments(samples.masks[i]):
        if value != 1:
            continue
        lp = logp[start:end]
        cuts = [-1, *np.flatnonzero(~np.isfinite(lp)).tolist(), len(lp)]
        for a, b in zip(cuts, cuts[1:]):
            run = lp[a + 1 : b]
            cs = np.concatenate([[0.0], np.cumsum(run)])  # non-increasing
            starts = np.flatnonzero(run <= -1.0)
            ends = np.searchsorted(-cs, nats - cs[starts], side="left")  # the first k with cs[k] <= cs[s] - nats
            for s_, e in zip(starts.tolist(), ends.tolist()):
                if e < len(cs):
                    first = start + a + 1 + s_
                    keys.add(hash(tuple(int(t) for t in tokens[first : start + a + 1 + e])))
    return keys


def _copies(samples: _Samples, seq: list[float], members: list[int], rng: random.Random) -> list[float]:
    """Were a group's samples drawn independently from π, or copied from one another? Taken in
    an order the learner draws, each sample repeats an earlier one or not; drawn from π it does
    with probability q = Σ π(c) over the distinct completions before it, so Σ(repeat − q) has
    mean 0 and variance Σ q(1 − q) whatever π is (a martingale, like the ranks). Copies repeat
    where sampling rarely would: a tester's copies of a group's rarest and most common
    completions, balanced so that the ranks' mean stayed where sampling puts it, passed the
    rank test (2026-11-29). `seq`: each sample's Σ log π over its tokens (−inf with one outside
    π's nucleus: such samples are counted apart, not here). Episodes with the environment's
    tokens are left out (π does not give their probability). Returns [Σ(repeat − q), Σ q(1 − q)]."""
    if any(not all(samples.masks[i]) for i in members):
        return [0.0, 0.0]
    order = list(members)
    rng.shuffle(order)  # the worker chose the order it sent them in
    seen: set[tuple] = set()
    repeats = variance = q = 0.0  # q: π's mass on the distinct completions seen
    for i in order:
        if seq[i] == -math.inf:
            continue
        key = tuple(int(x) for x in samples.completions[i])
        repeats += (key in seen) - min(1.0, q)
        variance += min(1.0, q) * (1.0 - min(1.0, q))
        if key not in seen:
            seen.add(key)
            q += math.exp(seq[i])
    return [repeats, variance]


class Trainer:
    def __init__(self, cfg: LearnerConfig, world: World | None = None, checkpoint: Path | None = None):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self._windows: set[tuple[str, int, int, int]] = set()  # a step's improbable windows (`_improbable`)
        self.world = world or World(device=torch.device(cfg.model.device))
        if cfg.trainer.compute_dtype == "bfloat16" and not self.world.sharded:  # FSDP2's mixed precision, one rank too
            self.world = sharded_alone(self.world)
        torch.manual_seed(cfg.run.seed)
        t, r = cfg.trainer, cfg.rollout
        self.model_dir = Path(cfg.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        task = cfg.task.build()
        # How episodes are rendered, cut and replayed: the same rules the workers are sent (`rollout_params`).
        self.episodes = Episodes.of(
            task, self.tokenizer, chat_template=cfg.task.chat_template, system_prompt=cfg.task.system_prompt,
            template_kwargs=cfg.task.chat_template_kwargs, stop_ids=stop_ids(self.tokenizer, self.model_dir, task.stop_tokens),
            max_new_tokens=r.max_new_tokens, max_tokens=r.episode_tokens(task), max_turns=r.turns(task))
        self.episodes.check_playable()  # a tokenizer that cannot play the task: said now, not at the first eval
        self.encode = self.episodes.first  # a prompt's token ids
        self.compute_dtype = None if t.compute_dtype == "float32" else DTYPES[t.compute_dtype]
        # Autocast only for fp16 (one rank, with loss scaling): bf16 computes through FSDP2's
        # mixed precision, which never holds more than a unit's bf16 copy.
        self.autocast_dtype = self.compute_dtype if t.compute_dtype == "float16" else None
        self.publish_dtype = DTYPES[saved_dtype(self.model_dir) if cfg.publish.dtype == "auto" else cfg.publish.dtype]
        common = dict(temperature=r.temperature, top_p=r.top_p, chunk_tokens=t.logprob_chunk_tokens)
        self.lora = t.lora  # LoRA mode: the frozen base in the compute dtype, the adapter trained (learner.train.lora)
        self.base_sha256 = base_digest(self.model_dir) if self.lora else ""
        self.policy = build_policy(self.model_dir, self.world, activation_checkpointing=t.activation_checkpointing,
                                   dtype=(self.compute_dtype or torch.float32) if self.lora else torch.float32,
                                   compute=self.compute_dtype if self.world.sharded else None, lora=self.lora,
                                   seed=cfg.run.seed, **common)
        self.reference = None
        if t.kl_coef > 0:  # frozen, in the compute dtype: a second model costs b bytes per parameter
            self.reference = build_policy(self.model_dir, self.world, activation_checkpointing=False,
                                          dtype=self.compute_dtype or torch.float32, trainable=False, **common)
        self.optimizer = torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad], lr=t.lr, betas=t.betas,
                                           weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(
            step, t.schedule, t.warmup_steps, cfg.run.steps, t.min_lr_ratio))
        # fp16 overflows without loss scaling (bf16 has fp32's range and needs none).
        self.scaler = torch.amp.GradScaler(self.world.device.type) if t.compute_dtype == "float16" else None
        self.num_parameters = count_parameters(self.policy)
        self.trainable_parameters = sum(p.numel() for p in self.policy.parameters() if p.requires_grad)
        self.version = 0  # the name of the weights held: a resumed run skips numbers a crash lost
        self.updates = 0  # optimizer updates applied to them, over every crash and resume: what [run] steps counts
        self.skipped_steps = 0  # optimizer steps skipped because the gradient norm was not finite
        self._eval_copy: Policy | None = None  # the weights of the version being evaluated on workers
        self._eval_adapter: list[torch.Tensor] | None = None  # LoRA: that version is its adapter alone
        # The published versions stale groups may claim, to check them against (`_check_claims`).
        self.kept = KeptVersions(cfg.buffer.max_staleness, self.publish_dtype, adapter_only=bool(self.lora)) \
            if cfg.kept_versions else None
        self._claim_copy: Policy | None = None
        self.resumed = self.load_checkpoint(checkpoint) if checkpoint else {}

    @property
    def hf(self):
        return self.policy.hf

    @property
    def vocab_size(self) -> int:
        return self.hf.get_output_embeddings().weight.shape[0]

    @property
    def _pad(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def _autocast(self):
        return torch.autocast(self.world.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    @contextlib.contextmanager
    def _generating(self, model: Policy):
        """`model`'s HF model, to generate with. Generation calls it, not the FSDP root: a sharded
        root is made the root first (`as_root`) and its part gathered once for the whole of it."""
        if self.world.sharded:
            as_root(model)
            model.unshard()
        try:
            with self._autocast():
                yield model.hf
        finally:
            if self.world.sharded:
                model.reshard()

    # --- one update ------------------------------------------------------------------------------

    def step(self, batch: BatchInfo) -> dict[str, float]:
        """One update on `batch` (every rank gets the whole batch); returns the step's statistics."""
        t, world = self.cfg.trainer, self.world
        samples = _Samples.of(batch, t.adv_eps, t.asymre_shift if t.loss == "asymre" else None)
        shares, slice_tokens = self._shares(samples)
        self._computed = torch.zeros(2, dtype=torch.float64)  # tokens the update's forwards computed; real ones
        mine = [i for share in shares for i in share]
        old = self._score(self.policy, samples, mine) if t.minibatches > 1 else None
        # Improbable windows (`_improbable`) of every trained group: a fresh one's from the π the
        # update computes anyway, a stale one's from the μ its worker claims (an honest worker's is
        # its version's π; one claimed likelier than π is the log-prob check's), and those the
        # claim check draws from that version's own π too. Drawn by the token check alone, a
        # quarter of them, they lost the race to a phrase the attack itself made likelier.
        self._windows: set[tuple[str, int, int, int]] = set()  # (where, group, sample, window): once per sample
        first_use = set(batch.fresh)  # a replayed group's windows were counted at its first use (reuse = 3 was three)
        gaps = _Gaps(batch, samples, mine, world.device, measured=lambda i, lp: self._note_windows(
            lp if batch.groups[samples.owner[i]].version == batch.learner_version
            else torch.as_tensor(samples.behaviour[i], dtype=torch.float64), samples, i,
            ("batch", samples.owner[i]) if samples.owner[i] in first_use else None))
        if old:
            gaps.measure(old)
        ref = self._score(self.reference, samples, mine) if self.reference is not None else None
        group_tokens, skipped_tokens = self._check_tokens(batch, samples, mine)  # before the update: π is the trained-at version
        claimable, claims, skipped_claims = self._check_claims(batch, samples, mine)
        sums = torch.zeros(len(dataclasses.fields(LossStats)), dtype=torch.float64, device=world.device)
        norms = [self._update(samples, share, tokens, old, ref, gaps, sums)
                 for share, tokens in zip(shares, slice_tokens)]
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this update ran at (after the step: the next one's)
        self.scheduler.step()
        self.version += 1
        self.updates += 1
        stats = LossStats.from_vector(world.all_reduce(sums))
        computed, real = world.all_reduce(self._computed.to(world.device)).tolist()
        group_gaps = world.all_reduce(gaps.sums).tolist()
        norms = [float(n.full_tensor() if hasattr(n, "full_tensor") else n) for n in norms]
        k = len(slice_tokens)  # each slice's loss is a mean over its own tokens: the batch's is their mean
        return {
            "loss": stats.loss / k,
            "reward_mean": float(samples.rewards.mean()),
            "reward_std": float(samples.rewards.std(unbiased=False)),
            "grad_norm": sum(norms) / k,  # before clipping, mean over the minibatches' optimizer steps
            "grad_norm_max": max(norms),
            "mean_ratio": stats.mean_ratio,
            "clip_fraction": stats.clip_fraction,
            "is_weight_mean": stats.mean_is_weight,
            "is_truncated_fraction": stats.is_truncated_fraction,
            "mismatch_kl": stats.mismatch_kl,
            "outside_nucleus_fraction": stats.outside_nucleus_fraction,
            "kl_ref": stats.kl_ref / k,
            "kl_excluded": stats.kl_excluded,  # tokens outside π_θ's or the reference's nucleus, not in the KL
            "skipped_steps": self.skipped_steps,  # optimizer steps skipped for a non-finite gradient, so far
            "tokens": samples.total_tokens,
            "padded_token_share": 1 - real / max(1.0, computed),  # of what the update's forwards computed
            **samples.turn_fields(),
            "lr": lr,
            "group_gaps": group_gaps,  # per group: [Σ|log π − log μ|, tokens] (learner.verify)
            "group_tokens": group_tokens,  # per group: [Σ(u − ½), Σ variance, inside, outside, copy terms (2)]
            "skipped_tokens": skipped_tokens,  # the same for skipped groups drawn: (index in batch.skipped_sample, terms)
            "claimable": claimable,  # stale groups whose claimed version is kept: judged by claim_checks alone
            "claim_checks": claims,  # those drawn, checked against their own version: [index, terms (6), gap, tokens]
            "skipped_claims": skipped_claims,  # the same for skipped groups drawn: (index in batch.skipped_sample, sums)
            # ("batch" | "skipped", index, window), once per sample: learner.verify.Repeats
            "improbable": self.world.all_lists([(where, g, key) for where, g, _, key in sorted(self._windows)]),
        }

    def _shares(self, samples: _Samples) -> tuple[list[list[int]], list[int]]:
        """This rank's samples of each of the `minibatches` slices, and each slice's loss tokens
        on all ranks (its normaliser: every optimizer step's gradient is a mean over its own
        tokens, so `max_grad_norm` means the same whatever `minibatches` is). The same seeded
        order and split on every rank, so each knows its share without talking."""
        order = list(range(len(samples.completions)))
        random.Random(self.cfg.run.seed * 1_000_003 + self.version).shuffle(order)
        size = math.ceil(len(order) / self.cfg.trainer.minibatches)
        shares, tokens = [], []
        for start in range(0, len(order), size):
            part = order[start : start + size]
            split = split_by_tokens([samples.lengths[i] for i in part], self.world.size)
            shares.append([part[i] for i in split[self.world.rank]])
            tokens.append(max(1, sum(sum(samples.masks[i]) for i in part)))
        return shares, tokens

    def _micro_batches(self, samples: _Samples, indices: list[int]) -> list[list[int]]:
        """`indices` packed into micro-batches of ≤ micro_batch_tokens; padded with empty ones to
        the most any rank has, since every forward and backward of a sharded model is a collective."""
        lengths = [samples.lengths[i] for i in indices]
        packed = [[indices[j] for j in mb] for mb in pack(lengths, self.cfg.trainer.micro_batch_tokens,
                                                          padded=not self.cfg.trainer.packing)]
        count = torch.tensor([len(packed)], device=self.world.device)
        self.world.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        return packed + [[] for _ in range(int(count) - len(packed))]  # [] = an empty micro-batch

    def _token_batch(self, samples: _Samples, indices: list[int]) -> TokenBatch:
        device = self.world.device
        if not indices:  # one pad token scoring one pad token: the collectives run, nothing is learned
            return TokenBatch.build([[self._pad]], [[self._pad]], self._pad, device)
        return TokenBatch.build([samples.prompts[i] for i in indices], [samples.completions[i] for i in indices],
                                self._pad, device, packed=self.cfg.trainer.packing)

    def _update(self, samples: _Samples, share: list[int], slice_tokens: int, old: dict | None, ref: dict | None,
                gaps: _Gaps, sums: torch.Tensor) -> torch.Tensor:
        """One optimizer step on this rank's `share` of a slice of `slice_tokens` loss tokens (all
        ranks): gradients accumulate over its micro-batches, the loss statistics into `sums`;
        returns the global gradient norm before clipping."""
        t, device = self.cfg.trainer, self.world.device
        self.optimizer.zero_grad(set_to_none=True)
        for indices in self._micro_batches(samples, share):
            tb = self._token_batch(samples, indices)
            self._computed += torch.tensor([tb.padded_tokens, sum(samples.lengths[i] for i in indices)],
                                           dtype=torch.float64)
            with self._autocast():
                logp = self.policy(tb)
            if not indices:
                (logp.sum() * 0.0).backward()
                continue
            if not old:  # one pass over the batch: its log-probs are π of the weights held now
                gaps.measure(dict(zip(indices, logp.split(tb.lengths))))
            flat = lambda values: torch.cat([values[i] for i in indices])  # noqa: E731
            behaviour_t = torch.cat([torch.as_tensor(samples.behaviour[i], dtype=torch.float32) for i in indices]).to(device)
            mask_t = torch.cat([torch.as_tensor(samples.masks[i]) for i in indices]).to(device)
            adv_t = torch.tensor([samples.advantages[i] for i in indices for _ in samples.completions[i]],
                                 device=device)
            loss, stats = grpo_loss(logp, flat(old) if old else logp.detach(), behaviour_t, adv_t, mask_t,
                                    clip_eps=t.clip_eps, is_cap=t.is_cap, total_tokens=slice_tokens,
                                    ref_logp=flat(ref) if ref else None, kl_coef=t.kl_coef,
                                    reinforce=t.loss == "asymre")
            loss_sum = loss * self.world.size  # FSDP averages over ranks; the batch gradient is the sum
            (self.scaler.scale(loss_sum) if self.scaler else loss_sum).backward()
            sums += stats
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), t.max_grad_norm)
        if self.scaler:  # fp16: the scaler skips a non-finite step itself and lowers its scale
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif torch.isfinite(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm):
            self.optimizer.step()
        else:  # NaN or inf weights would be published and refused by every worker: skip, and say so
            self.skipped_steps += 1
        return grad_norm

    def skip_to(self, version: int) -> None:
        """Continue version numbers from `version` (a resumed run whose crash lost published
        versions: no number may name two different snapshots)."""
        self.version = max(self.version, version)

    @torch.no_grad()
    def _check_tokens(self, batch: BatchInfo, samples: _Samples, mine: list[int]) -> tuple[list, list]:
        """Were the tokens of `[verify] token_check_fraction` × G groups sampled from π (at the
        run's temperature and top-p), or chosen? The groups are drawn uniformly from every group
        accepted since the previous batch: this batch's fresh groups and those dynamic sampling
        skipped (`batch.skipped`). Drawn from the trained groups alone, they would be chosen for
        their rewards (each with a wrong answer where π is mostly right): honest workers' tokens
        then read as too unlikely, and the demo's four workers were quarantined at z = +8.
        Per group: Σ(u − ½) of its policy tokens' mid-ranks under π (`echo.hf.rank_terms`) and Σ
        their variance, over those inside π's nucleus, the counts inside and outside it, and its
        copy terms (`_copies`; all zero for a group not drawn; `learner.verify.Verifier.tokens_checked`
        judges). Returns them for `batch.groups`, and for the skipped groups drawn as (index in
        `batch.skipped_sample`, terms). Stale groups of a kept version drawn are left unscored:
        `_check_claims` holds them to their own version. The same seeded draw on every rank."""
        f = self.cfg.verify.token_check_fraction
        if f <= 0.0:
            return [[0.0] * 6 for _ in batch.groups], []
        rng = random.Random(self.cfg.run.seed * 7_919 + self.version)
        fresh = batch.fresh  # replays were checked at their first use
        population = len(fresh) + batch.skipped
        drawn = rng.sample(range(population), min(population, math.ceil(f * len(batch.groups))))
        claimed = partial(self._claimable, batch.learner_version)  # `_check_claims`' alone, not the drift's
        picked = {fresh[d] for d in drawn if d < len(fresh) and not claimed(batch.groups[fresh[d]])}
        extra = [j for j in rng.sample(range(len(batch.skipped_sample)), min(len(batch.skipped_sample),
                                                                             sum(d >= len(fresh) for d in drawn)))
                 if not claimed(batch.skipped_sample[j])]
        own = batch.learner_version  # the version π is: a skipped group it sampled gives its improbable windows
        sums = self._rank_sums(samples, [i for i in mine if samples.owner[i] in picked], len(batch.groups))
        if not extra:  # (the same on every rank: the draw is)
            return sums, []
        audit = _Samples.of(BatchInfo([batch.skipped_sample[j] for j in extra], batch.learner_version), None)
        split = split_by_tokens(audit.lengths, self.world.size)[self.world.rank]
        return sums, list(zip(extra, self._rank_sums(
            audit, split, len(extra), lambda a: ("skipped", extra[a]) if batch.skipped_sample[extra[a]].version == own else None)))

    def _rank_sums(self, samples: _Samples, indices: list[int], groups: int,
                   sampled_here: Callable[[int], tuple[str, int] | None] = lambda g: None) -> list[list[float]]:
        """The token check's four sums per group of `samples`, over `indices` (this rank's), and
        its copy terms (`_copies`), all ranks added. A group `sampled_here` names (it claims the
        version π is, and is not trained: the update finds a trained one's) also gives its
        improbable windows (`_improbable`)."""
        sums = torch.zeros(groups, 4, dtype=torch.float64, device=self.world.device)
        seq = torch.zeros(len(samples.completions), dtype=torch.float64, device=self.world.device)
        self.policy.ranks = True
        try:
            terms = self._score(self.policy, samples, indices)
        finally:
            self.policy.ranks = False
        for i, t in terms.items():
            found = _token_sums(t, samples, i).to(sums)
            sums[samples.owner[i]] += found[:4]
            seq[i] = found[6]
            self._note_windows(t[:, 3], samples, i, sampled_here(samples.owner[i]))
        return self._with_copies(samples, self.world.all_reduce(sums).tolist(), self.world.all_reduce(seq).tolist())

    def _note_windows(self, logp: torch.Tensor, samples: _Samples, i: int, group: tuple[str, int] | None) -> None:
        nats = self.cfg.verify.repeat_nats
        if group is not None and nats > 0:
            self._windows.update((*group, i, key) for key in _improbable(logp, samples, i, nats))

    def _with_copies(self, samples: _Samples, sums: list[list[float]], seq: list[float]) -> list[list[float]]:
        """Each group's `sums` with its copy terms (`_copies`) after the four token sums, for
        groups scored (any token counted), so that a group's token terms are its first six
        whichever check made them; the same seeded order on every rank."""
        rng = random.Random(self.cfg.run.seed * 15_485_863 + self.version)
        members: dict[int, list[int]] = {}
        for i, g in enumerate(samples.owner):
            members.setdefault(g, []).append(i)
        return [row[:4] + (_copies(samples, seq, members[g], rng) if row[2] + row[3] > 0 else [0.0, 0.0]) + row[4:]
                for g, row in enumerate(sums)]

    def _claimable(self, learner_version: int, group: Group) -> bool:
        """Is `group` checked against the version it claims (`_check_claims`), not the drift?"""
        return self.kept is not None and group.version < learner_version and group.version in self.kept

    @torch.no_grad()
    def _check_claims(self, batch: BatchInfo, samples: _Samples, mine: list[int]) -> tuple[list[int], list, list]:
        """Check `[verify] stale_check_fraction` × G stale groups against the very version each
        claims (`KeptVersions`: kept as published), not the fleet's drift: its μ (Σ|log π_v −
        log μ| and the tokens it is over) and its tokens' ranks under π_v (the token check's four
        sums), in one no-grad pass of a frozen copy per version. A group labelled with a version
        it was not generated by, or with μ or tokens of its writer's making, stands out against
        π_v as a fresh one does against π (`learner.verify` judges them at staleness 0).

        Drawn uniformly from the stale groups accepted since the previous batch, trained and
        skipped by dynamic sampling alike, as `_check_tokens` draws: drawn from the trained ones
        alone they were chosen for their rewards, and honest workers' tokens read as too
        unlikely (on the demo the fleet's claim checks summed to z = +6.9 where the uniform
        draws read −0.2; a fleet's voted level hid it, a bound on it did not). Returns the
        stale groups of `batch.groups` whose version is kept (drawn or not: `learner.verify`
        judges them by this check alone), per trained group checked [index in `batch.groups`,
        the token check's six terms (`_with_copies`), Σ|log π_v − log μ|, its tokens] and per
        skipped group checked (index in `batch.skipped_sample`, the eight), all ranks added; the
        same seeded draw on every rank."""
        f, kept = self.cfg.verify.stale_check_fraction, self.kept
        if kept is None or not len(kept):
            return [], [], []
        claimed = partial(self._claimable, batch.learner_version)
        claimable = [g for g, group in enumerate(batch.groups) if claimed(group)]
        fresh = set(batch.fresh)  # replays were drawn from at their first use
        first = [g for g in claimable if g in fresh]
        # The skipped groups are known by a uniform sample of them: those claiming a kept version
        # stand for their share of all skipped.
        sample = [j for j, group in enumerate(batch.skipped_sample) if claimed(group)]
        skipped = round(batch.skipped * len(sample) / len(batch.skipped_sample)) if batch.skipped_sample else 0
        rng = random.Random(self.cfg.run.seed * 104_729 + self.version)
        draws = rng.sample(range(len(first) + skipped), min(len(first) + skipped, math.ceil(f * len(batch.groups))))
        drawn = sorted(first[d] for d in draws if d < len(first))
        extra = sorted(rng.sample(sample, min(len(sample), sum(d >= len(first) for d in draws))))
        if not drawn and not extra:
            return claimable, [], []
        # LoRA: a version is its adapter, swapped into the policy and back (no second base on the
        # device). Full weights: a frozen copy, built at the first stale group drawn.
        if not self.lora and self._claim_copy is None:
            r = self.cfg.rollout
            self._claim_copy = build_policy(self.model_dir, self.world, activation_checkpointing=False,
                                            dtype=self.compute_dtype or torch.float32, trainable=False,
                                            temperature=r.temperature, top_p=r.top_p,
                                            chunk_tokens=self.cfg.trainer.logprob_chunk_tokens)
        model = self.policy if self.lora else self._claim_copy
        audit = _Samples.of(BatchInfo([batch.skipped_sample[j] for j in extra], batch.learner_version), None)
        theirs = split_by_tokens(audit.lengths, self.world.size)[self.world.rank]
        sums = torch.zeros(len(batch.groups), 6, dtype=torch.float64, device=self.world.device)
        audit_sums = torch.zeros(len(extra), 6, dtype=torch.float64, device=self.world.device)
        seq = torch.zeros(len(samples.completions), dtype=torch.float64, device=self.world.device)
        audit_seq = torch.zeros(len(audit.completions), dtype=torch.float64, device=self.world.device)
        model.ranks = True
        try:
            with self._adapter_restored():
                for version in sorted({batch.groups[g].version for g in drawn}
                                      | {batch.skipped_sample[j].version for j in extra}):
                    kept.load(version, model)
                    for into, sequences, of, groups, indices in (
                            (sums, seq, samples, {g for g in drawn if batch.groups[g].version == version}, mine),
                            (audit_sums, audit_seq, audit, {a for a, j in enumerate(extra)
                                                            if batch.skipped_sample[j].version == version}, theirs)):
                        for i, t in self._score(model, of, [i for i in indices if of.owner[i] in groups]).items():
                            found = _token_sums(t, of, i).to(into)
                            into[of.owner[i]] += found[:6]
                            sequences[i] = found[6]
                            g = of.owner[i]
                            self._note_windows(t[:, 3], of, i, ("batch", g) if of is samples else ("skipped", extra[g]))
        finally:
            model.ranks = False
        reduce = self.world.all_reduce
        sums = self._with_copies(samples, reduce(sums).tolist(), reduce(seq).tolist())
        audit_sums = self._with_copies(audit, reduce(audit_sums).tolist(), reduce(audit_seq).tolist())
        return claimable, [[g, *sums[g]] for g in drawn], list(zip(extra, audit_sums))

    def _score(self, policy, samples: _Samples, indices: list[int]) -> dict[int, torch.Tensor]:
        """log π of every completion token of `indices` under `policy` (π_old or the reference),
        micro-batched like the update itself; per sample, on the device."""
        out = {}
        for mb in self._micro_batches(samples, indices):
            tb = self._token_batch(samples, mb)
            with self._autocast():
                flat = policy(tb).float()
            if mb:
                out.update(zip(mb, flat.split(tb.lengths)))
        return out

    # --- snapshots, checkpoints, export ----------------------------------------------------------

    def snapshot(self) -> bytearray | None:
        """The current weights as a safetensors blob in `[publish] dtype` (what workers install);
        gathered tensor by tensor, returned on rank 0 (None elsewhere).

        Every state-dict name is written, a tied head under both names, so an engine can never
        keep a stale head. Its metadata is the probe's log-probs under these weights
        (`echo.lora.weights_metadata`): a vLLM worker checks its install against them instead of
        running the model on its CPU (an 8B forward per install, five with top-p). Written at a
        fixed width, so consecutive snapshots keep one byte layout and deltas apply. In LoRA
        mode, the adapter alone (`adapter_snapshot`). The version is kept, as published, to
        check the stale groups that will claim it (`KeptVersions`).
        """
        if self.kept is not None:
            self.kept.keep(self.version, self.policy)
        if self.lora:
            return self.adapter_snapshot()
        metadata = weights_metadata(self.probe_logprobs(), self.cfg.trainer.compute_dtype)
        state = self.hf.state_dict()
        return write_safetensors(state.items(), {k: tuple(v.shape) for k, v in state.items()}, self.publish_dtype,
                                 keep=self.world.is_main, metadata=metadata)

    def adapter_snapshot(self) -> bytearray | None:
        """LoRA mode: the adapter's tensors (PEFT names, `[publish] dtype`) with `echo.lora`'s
        metadata: the base's digest and the probe log-probs of this version, which a worker must
        reproduce before it takes work with it."""
        params = adapter_parameters(self.hf)
        meta = AdapterMeta(base=self.base_sha256, rank=self.lora.rank, alpha=self.lora.alpha,
                           targets=tuple(self.lora.target_modules), probe=tuple(self.probe_logprobs()))
        return write_safetensors(params, {k: tuple(v.shape) for k, v in params}, self.publish_dtype,
                                 keep=self.world.is_main, metadata=meta.metadata())

    @torch.no_grad()
    def probe_logprobs(self) -> list[float]:
        """Teacher-forced log-probs (temperature 1) of the fixed probe (`echo.lora.probe_tokens`)
        under the weights as published: an adapter rounded to `[publish] dtype` as workers get it;
        full weights as the compute dtype sees them (rounding every master weight would take a
        second copy of the model). Every rank runs it (a sharded forward is a collective)."""
        prompt, completion = probe_tokens(self.vocab_size)
        policy = self.policy
        saved = policy.temperature, policy.top_p
        with self._adapter_restored() as adapter:
            try:
                policy.temperature, policy.top_p = 1.0, 1.0
                for p in adapter:
                    p.copy_(p.to(self.publish_dtype).to(p.dtype))
                with self._autocast():
                    logp = policy(TokenBatch.build([prompt], [completion], self._pad, self.world.device)).float()
            finally:
                policy.temperature, policy.top_p = saved
        return logp.tolist()

    @contextlib.contextmanager
    def _adapter_restored(self):
        """LoRA mode: the adapter's parameters, to overwrite for a while (rounded as published, or
        a kept version's); the trained values are put back after. Full weights: nothing."""
        held = [(p, p.detach().clone()) for _, p in adapter_parameters(self.hf)] if self.lora else []
        try:
            yield [p for p, _ in held]
        finally:
            for p, trained in held:
                p.copy_(trained)

    def lora_info(self, keep: int) -> P.LoraInfo | None:
        """What workers are told at join in LoRA mode (`keep`: adapters a worker holds, S + 2)."""
        if not self.lora:
            return None
        return P.LoraInfo(rank=self.lora.rank, alpha=self.lora.alpha, target_modules=list(self.lora.target_modules),
                          base_sha256=self.base_sha256, keep=keep,
                          probe_dtype=self.cfg.trainer.compute_dtype)  # the probe's precision: the workers' tolerance

    def save_checkpoint(self, directory: Path, extra: dict) -> Path:
        """A resumable checkpoint: model and optimizer in torch.distributed.checkpoint format
        (loadable on any number of ranks), with the config, tokenizer and learner state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        path = Path(directory) / f"step-{self.updates:06d}"  # the update: a resume's versions skip ahead of it
        model_state, optim_state = get_state_dict(self.policy, self.optimizer)
        with _single_process_quiet():
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path / "state")
        if self.world.is_main:
            self._copy_model_files(path)
            torch.save({"scheduler": self.scheduler.state_dict(),
                        "scaler": self.scaler.state_dict() if self.scaler else None}, path / "schedule.pt")
            (path / "learner_state.json").write_text(json.dumps(
                {"version": self.version, "updates": self.updates, "ranks": self.world.size, **extra}, indent=2))
            # Point `latest` at it atomically: a learner killed here still has a checkpoint to resume.
            staging = Path(directory) / f".latest-{os.getpid()}"
            staging.unlink(missing_ok=True)
            staging.symlink_to(path.name)
            os.replace(staging, Path(directory) / "latest")
            prune_checkpoints(Path(directory), self.cfg.run.keep_checkpoints)
        self.world.barrier()
        return path

    def load_checkpoint(self, path: Path) -> dict:
        """Resume from `save_checkpoint`'s directory, written by any number of ranks."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = Path(path)
        if not (path / "state").is_dir():
            raise FileNotFoundError(f"{path} is not an echo checkpoint (no state/ directory)")
        model_state, optim_state = get_state_dict(self.policy, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path / "state")
        set_state_dict(self.policy, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        saved = torch.load(path / "schedule.pt", weights_only=True)
        self.scheduler.load_state_dict(saved["scheduler"])
        if self.scaler and saved.get("scaler"):
            self.scaler.load_state_dict(saved["scaler"])
        learner_state = json.loads((path / "learner_state.json").read_text())
        self.version = int(learner_state["version"])
        self.updates = int(learner_state.get("updates", self.version))
        # The rate of the next update by this run's schedule: a resume with another [run] steps
        # ran its first update at the rate restored with the optimizer, the old schedule's, then
        # jumped to the new one's (a new user: 3e-05, then 1.4e-04).
        was = [g["lr"] for g in self.optimizer.param_groups]
        now = [base * f(self.updates) for base, f in zip(self.scheduler.base_lrs, self.scheduler.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, now):
            group["lr"] = lr
        if any(abs(a - b) > 1e-3 * max(abs(a), abs(b), 1e-30) for a, b in zip(was, now)):
            learner_state["lr_resumed"] = {"was": was[0], "now": now[0]}
        return learner_state

    def export(self, directory: Path) -> Path | None:
        """The trained model as a Hugging Face directory (`[publish] dtype` weights). In LoRA mode
        the adapter as a PEFT directory beside it (`<directory>-adapter`, e.g. run_dir/model-adapter)
        and `directory` the base with the adapter merged."""
        blob = self.snapshot()
        if blob is None:
            return None
        directory = Path(directory)
        if self.lora:
            adapter = write_adapter_dir(directory.with_name(directory.name + "-adapter"), blob,
                                        read_adapter_meta(blob), str(self.model_dir))
            self._copy_model_files(adapter)
            export_merged(self.model_dir, adapter, directory, self.publish_dtype)
            self._copy_model_files(directory)
            return directory
        directory.mkdir(parents=True, exist_ok=True)
        self._copy_model_files(directory)
        (directory / "model.safetensors").write_bytes(blob)
        return directory

    def _copy_model_files(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_AND_CONFIG:
            if (self.model_dir / name).exists():
                shutil.copy2(self.model_dir / name, directory / name)

    # --- checking the workers' eval answers ----------------------------------------------------

    @torch.no_grad()
    def hold_for_eval(self) -> int:
        """Keep a frozen copy of the weights held now, the version whose eval round opens, to
        check its answers against (`greedy_gaps`) while training goes on. It costs what the KL
        reference costs: the parameters once more in the compute dtype, sharded like the policy.
        In LoRA mode the version is its adapter: a copy of the adapter alone is kept and swapped
        into the policy to check (a second frozen base was 15 GiB of an 8B run's 47 on one GPU)."""
        if self.lora:
            self._eval_adapter = [p.detach().clone() for _, p in adapter_parameters(self.hf)]
            return self.version
        if self._eval_copy is None:
            self._eval_copy = build_policy(self.model_dir, self.world, activation_checkpointing=False,
                                           dtype=self.compute_dtype or torch.float32, trainable=False, lora=self.lora,
                                           temperature=1.0, top_p=1.0, greedy=True,
                                           chunk_tokens=self.cfg.trainer.logprob_chunk_tokens)
        # Through the state dicts: sharded (DTensor) on both sides under FSDP2, whatever the root holds now.
        self._eval_copy.load_state_dict(self.policy.state_dict())
        return self.version

    @contextlib.contextmanager
    def _held_for_eval(self):
        """The held version as a greedy-gap `Policy`: the eval copy, or (LoRA) the policy with
        the held adapter swapped in and the trained one put back after."""
        if self._eval_adapter is not None:
            with self._adapter_restored() as params:
                for p, held in zip(params, self._eval_adapter):
                    p.copy_(held)
                self.policy.greedy = True
                try:
                    yield self.policy
                finally:
                    self.policy.greedy = False
        elif self._eval_copy is not None:
            yield self._eval_copy
        else:
            raise RuntimeError("hold_for_eval() first: no eval copy is held")

    @torch.no_grad()
    def greedy_gaps(self, prompts: list[list[int]], completions: list[list[int]]) -> list[float]:
        """Per completion, the largest gap between a token's logit and the best logit at its
        position under the held eval copy: ~0 for an honest greedy answer, large for one a worker
        wrote itself. Every rank computes all of it (the forward passes are collectives)."""
        out = [0.0] * len(completions)
        budget = self.cfg.trainer.micro_batch_tokens
        with self._held_for_eval() as held:
            for indices in pack([len(p) + len(c) for p, c in zip(prompts, completions)], budget):
                tb = TokenBatch.build([prompts[i] for i in indices], [completions[i] for i in indices], self._pad,
                                      self.world.device)
                with self._autocast():
                    gaps = held(tb)
                for i, g in zip(indices, gaps.split(tb.lengths)):
                    out[i] = float(g.max()) if len(g) else 0.0
        return out

    @torch.no_grad()
    def held_greedy_returns(self, prompts: list[Prompt]) -> list[float]:
        """Greedy returns of `prompts` under the held eval copy: the learner's own answers, where a
        worker's were near-ties it could have picked from. Every rank runs it (generation through
        the sharded copy is collective)."""
        with self._held_for_eval() as held, self._generating(held) as hf:
            return self.episodes.greedy_returns(hf, prompts, self._pad)

    # --- learner-side eval (tiny models, multi-turn tasks) ---------------------------------------

    @torch.no_grad()
    def evaluate(self, task: Task, prompts: list[Prompt]) -> float:
        """Mean greedy return on `prompts` (a one-turn task's accuracy), played here as the workers
        play them ([eval] where = 'learner'). Every rank runs it (`Lockstep`): generation through a
        sharded model gathers each layer, a collective, and greedy decoding of the same weights
        takes the same steps on every rank. (Rank 0 alone would wait at the first layer for ranks that
        never come, which is why N ranks used to be refused, and multi-turn tasks, evaluated only
        here, could not run on them.)"""
        episodes = dataclasses.replace(self.episodes, task=task)
        try:
            with self._generating(self.policy) as hf:
                returns = episodes.greedy_returns(hf, prompts, self._pad)
        except (EpisodeError, ChatError):
            # The environment failed in a state the start's check did not reach. Every rank fails
            # alike (the same greedy steps); rank 0's caller says so and training goes on, and a
            # follower must not leave its loop over it.
            if self.world.is_main:
                raise
            return math.nan
        return sum(returns) / max(1, len(prompts))

    def rollout_params(self) -> P.RolloutParams:
        """How every worker plays this run's episodes (sent at join). A one-turn task whose every
        group the learner scores itself goes out without its answers: a worker holding them could
        choose which of its samples to send by their rewards, or write right answers it never sampled."""
        r, e = self.cfg.rollout, self.episodes
        return P.RolloutParams(group_size=r.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                               top_p=r.top_p, max_turns=e.max_turns, max_tokens=e.max_tokens, stop_ids=list(e.stop_ids),
                               chat_template="on" if e.chat.templated else "off",
                               chat_template_kwargs=self.cfg.task.chat_template_kwargs,
                               scored_by_learner=e.task.one_turn and self.cfg.verify.rescore_fraction >= 1.0)


def prune_checkpoints(directory: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (0: keep all), never the one `latest` names:
    a week of an 8B run's checkpoints, each with its optimizer state, fills any disk."""
    if keep <= 0:
        return []
    latest = (directory / "latest").resolve() if (directory / "latest").exists() else None
    found = sorted((p for p in directory.glob("step-*") if p.is_dir() and p.name[5:].isdigit()), key=updates_of)
    old = [p for p in found[:-keep] if p.resolve() != latest]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


@contextlib.contextmanager
def _single_process_quiet():
    """torch.distributed.checkpoint on one rank without a process group (the CPU demo) warns at
    every save and load that it assumes a single process, even when told so (`no_dist=True`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)", category=UserWarning)
        yield
