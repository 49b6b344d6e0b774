"""`echo-learner`'s configuration: one pydantic model, loaded from TOML with dotted overrides.

Every field names its TOML key in its description (`[trainer] lr`), has a bound, and says
what it does. `configs/demo.toml` is the CPU demo; `configs/learner-gpu.toml` a real model.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from echo.config import Section, load_config
from echo.tasks import Task, TaskError, load_task
from scheduler.config import SchedulerSection


class RunSection(Section):
    name: str = Field("run", description="[run] name: prefix of the run directory")
    dir: Path = Field(Path("runs"), description="[run] dir: where run directories are created")
    seed: int = Field(0, description="[run] seed: seeds prompts, sampling and torch")
    steps: int = Field(60, ge=1, description="[run] steps: learner updates before the run ends")
    eval_every: int = Field(5, ge=0, description="[run] eval_every: greedy eval every N steps (0: only start and end)")
    checkpoint_every: int = Field(20, ge=0, description="[run] checkpoint_every: resumable checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = Field(2, ge=0, description="[run] keep_checkpoints: the newest N checkpoints are kept, older ones deleted once a newer one is written (0: keep all; an 8B model's checkpoint with its optimizer state is ~100 GB)")
    threads: int = Field(1, ge=1, le=256, description="[run] threads: torch CPU threads of the trainer (per rank)")
    nproc: int = Field(1, ge=1, le=64, description="[run] nproc: trainer ranks on this node; > 1 relaunches under torchrun with FSDP2 (echo-learner --nproc N)")


class ModelSection(Section):
    path: Path = Field(Path("models/tiny-arith"), description="[model] path: Hugging Face model directory to train")
    device: str = Field("cpu", description="[model] device: torch device of the trainer ('cpu', 'cuda', 'cuda:1'; under torchrun each rank takes cuda:LOCAL_RANK)")

    @model_validator(mode="before")
    @classmethod
    def _dtype_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "dtype" in data:
            raise ValueError("[model] dtype is gone: parameters and optimizer state are always fp32 master weights. "
                             "Set [trainer] compute_dtype ('bfloat16' on GPUs: FSDP2 mixed precision) and [publish] dtype "
                             "(what snapshots carry; 'auto' = the model directory's dtype)")
        return data


class TaskSection(Section):
    """`[task] name = "arith"`; every other key of the table (but the two prompt keys below) is
    an option of that task."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    name: str = Field("arith", description="[task] name: a built-in task or 'package.module:Class'")
    chat_template: Literal["auto", "on", "off"] = Field("auto", description="[task] chat_template: wrap each prompt in the tokenizer's chat template ('auto': when it has one)")
    system_prompt: str = Field("", max_length=65536, description="[task] system_prompt: system message placed before each prompt when the chat template is used")
    chat_template_kwargs: dict[str, Any] = Field({}, description="[task] chat_template_kwargs: extra arguments of the chat template, e.g. {enable_thinking = false} for Qwen3")

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def build(self) -> Task:
        return load_task(self.name, self.options)

    @model_validator(mode="after")
    def _options_valid(self) -> "TaskSection":
        try:
            self.build()
        except TaskError as e:
            raise ValueError(str(e)) from None
        return self


class RolloutSection(Section):
    group_size: int = Field(8, ge=2, le=1024, description="[rollout] group_size: samples per prompt (n); advantages are normalised within a group")
    max_new_tokens: int = Field(4, ge=1, le=65536, description="[rollout] max_new_tokens: completion length cap (per turn of an episode)")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="[rollout] temperature: sampling temperature (the trainer scales logits the same way)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="[rollout] top_p: nucleus sampling mass")
    max_turns: int = Field(0, ge=0, le=4096, description="[rollout] max_turns: policy turns per episode before it is cut (truncated); 0: the task's own limit")
    max_episode_tokens: int = Field(0, ge=0, le=1 << 20, description="[rollout] max_episode_tokens: an episode's tokens after its prompt, turns and environment answers together (0: max_new_tokens for one-turn tasks, 2 · turns · max_new_tokens for episodic ones)")

    def turns(self, task: Task) -> int:
        """Policy turns per episode: the task's limit, lowered by `max_turns`."""
        return min(task.max_turns, self.max_turns) if self.max_turns else task.max_turns

    def episode_tokens(self, task: Task) -> int:
        """An episode's token budget after its prompt (what uploads, buffer and trainer are bounded by)."""
        turns = self.turns(task)
        return self.max_episode_tokens or (self.max_new_tokens if turns == 1 else 2 * turns * self.max_new_tokens)


class LoraSection(Section):
    """`[trainer.lora]` (or `[trainer] lora = {rank = 32, ...}`): train a LoRA adapter on the
    frozen base; every version is the adapter alone (`learner.train.lora`)."""

    rank: int = Field(16, ge=1, le=4096, description="[trainer.lora] rank: r, the adapter's inner dimension")
    alpha: float = Field(32.0, gt=0.0, le=1e6, description="[trainer.lora] alpha: the update is scaled by alpha / rank")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], min_length=1, max_length=64,
        description="[trainer.lora] target_modules: names of the linear layers that get an adapter (peft's target_modules)")
    dropout: float = Field(0.0, description="[trainer.lora] dropout: must be 0 (π must be the very function workers sample from)")

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, v: float) -> float:
        if v != 0:
            raise ValueError(f"[trainer.lora] dropout = {v}: must be 0; with dropout the trained function differs from "
                             "the one workers sample, and the importance ratio is no longer 1 on policy")
        return v

    @field_validator("target_modules")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if not m or len(m) > 64 or not all(c.isalnum() or c in "_." for c in m)]
        if bad:
            raise ValueError(f"[trainer.lora] target_modules: {bad[:3]} are not module names (letters, digits, '_', '.')")
        return sorted(set(v))


class TrainerSection(Section):
    batch_prompts: int = Field(8, ge=1, description="[trainer] batch_prompts: groups per update (G); B = G * group_size rollouts")
    lr: float = Field(3e-4, gt=0.0, le=1.0, description="[trainer] lr: Adam learning rate")
    betas: tuple[float, float] = Field((0.9, 0.999), description="[trainer] betas: Adam betas")
    schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="[trainer] schedule: learning-rate decay over [run] steps after warm-up")
    warmup_steps: int = Field(0, ge=0, description="[trainer] warmup_steps: linear learning-rate warm-up steps")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="[trainer] min_lr_ratio: final learning rate as a fraction of lr (linear/cosine)")
    weight_decay: float = Field(0.0, ge=0.0, description="[trainer] weight_decay: AdamW decoupled weight decay")
    max_grad_norm: float = Field(1.0, gt=0.0, description="[trainer] max_grad_norm: gradient clipping norm")
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="[trainer] clip_eps: PPO ratio clip ε")
    is_cap: float = Field(2.0, ge=1.0, description="[trainer] is_cap: truncation δ of the importance weight min(π/μ, δ)")
    kl_coef: float = Field(0.0, ge=0.0, description="[trainer] kl_coef: weight of the k3 KL to the initial model (0: off, no reference copy kept)")
    minibatches: int = Field(1, ge=1, description="[trainer] minibatches: optimizer steps per batch (the clip matters only when > 1)")
    adv_eps: float = Field(1e-6, gt=0.0, description="[trainer] adv_eps: ε in (s - mean) / (std + ε)")
    loss: Literal["grpo", "asymre"] = Field("grpo", description="[trainer] loss: 'grpo' (group-normalised advantages, truncated IS, clipped ratio) or 'asymre' (REINFORCE with the group mean shifted by asymre_shift as baseline, no importance correction: the replay paper's choice with a buffer)")
    asymre_shift: float = Field(-0.1, ge=-1.0, le=1.0, description="[trainer] asymre_shift: δV, the AsymRE baseline is mean(group rewards) + δV (the replay paper: -0.1)")
    compute_dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="[trainer] compute_dtype: dtype of forward and backward: 'bfloat16' through FSDP2's mixed precision (on GPUs), 'float16' under autocast with loss scaling; parameters and optimizer state stay fp32")
    micro_batch_tokens: int = Field(16384, ge=16, le=1 << 24, description="[trainer] micro_batch_tokens: padded tokens (rows × longest row) per forward/backward; gradients accumulate over micro-batches, so this bounds activation memory, not the batch")
    packing: bool = Field(True, description="[trainer] packing: micro-batches as sequences end to end with no padding (position ids restart per sequence; attention stays within each); false: right-padded rows")
    activation_checkpointing: bool = Field(False, description="[trainer] activation_checkpointing: keep only each decoder layer's input and recompute its activations in the backward pass")
    logprob_chunk_tokens: int = Field(0, ge=0, le=1 << 20, description="[trainer] logprob_chunk_tokens: completion tokens per chunk of the output head (0: as many as keep 32M logits)")
    check_memory: bool = Field(True, description="[trainer] check_memory: stop at start-up when the predicted memory per rank exceeds what the device has")
    lora: LoraSection | None = Field(None, description="[trainer.lora]: train a LoRA adapter on the frozen base instead of every weight (off when absent)")


class BufferSection(Section):
    type: Literal["queue-drop", "queue-max"] = Field("queue-drop", description="[buffer] type: 'queue-drop' (capacity q·G groups, the oldest dropped when full) or 'queue-max' (no capacity, groups staler than S discarded)")
    max_staleness: int = Field(2, ge=0, le=1000, description="[buffer] max_staleness: S; a rollout of version v is trained at version t only if t - v <= S (with the staleness filter)")
    staleness_filter: bool = Field(True, description="[buffer] staleness_filter: refuse and discard groups staler than S; off with queue-drop is the blog's pure queue-drop, bounded by its capacity alone (queue-max always filters)")
    queue_factor: float = Field(2.0, ge=1.0, le=100.0, description="[buffer] queue_factor: q; queue-drop capacity is q·G groups")
    backpressure: bool = Field(True, description="[buffer] backpressure: lease no prompts while q·G groups are queued, so workers idle instead of generating rollouts that would be dropped")
    reuse: int = Field(1, ge=1, le=64, description="[buffer] reuse: times one group may be trained while within S (1: no replay); a step then needs ceil(G / reuse) fresh groups and samples the rest from the replay pool (needs max_staleness >= 1)")
    replay_size: int = Field(0, ge=0, le=1_000_000, description="[buffer] replay_size: N, trained groups the replay pool keeps (0: q·G)")
    dynamic_sampling: bool | None = Field(None, description="[buffer] dynamic_sampling: train only groups whose rewards differ (DAPO's dynamic sampling); groups of equal rewards are counted (skipped_uniform) and their prompts done. Default: on with [trainer] loss = 'grpo', where such a group has no advantage and only takes a batch's place (and a worker can send them at will), off with 'asymre', whose shifted baseline gives them one. A step is then a mean over the groups with signal only, however few: an lr tuned without it may be too large (the learner notes it once when fewer than a quarter of 16 batches' groups carry signal)")
    positive_bias: float = Field(0.0, ge=0.0, lt=1.0, description="[buffer] positive_bias: δ; the replay pool keeps the freshest (1 - δ)N groups plus the freshest δN groups with a correct sample not among them (0: freshest only). Only groups whose rewards vary enter the pool (equal rewards: no advantage, no gradient), freshest by the version that generated them")

    @model_validator(mode="after")
    def _replay_possible(self) -> "BufferSection":
        if self.reuse > 1 and self.max_staleness < 1:
            raise ValueError(f"[buffer] reuse = {self.reuse} needs max_staleness >= 1: a group trained at version t is "
                             "already one version stale at t + 1; set reuse = 1 or raise max_staleness")
        if self.type == "queue-max" and not self.staleness_filter:  # accepted silently, it changed nothing
            raise ValueError("[buffer] staleness_filter = false does nothing with type = 'queue-max', which has no "
                             "capacity and always discards groups staler than S; for the unfiltered queue set "
                             "type = 'queue-drop'")
        return self


class PublishSection(Section):
    every: int | None = Field(None, ge=1, description="[publish] every: I, publish a snapshot every I updates (default S - 1, at least 1)")
    keep: int = Field(4, ge=1, description="[publish] keep: snapshots kept for download")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="[publish] dtype: dtype of the weights in snapshots ('auto': the model directory's saved dtype)")


class WorkersEval(Section):
    """`[eval] where = "workers"`: greedy, version-stamped eval leases (learner.evals); the learner never generates."""

    where: Literal["workers"] = Field("workers", description="[eval] where: 'workers' (greedy, version-stamped eval leases; the learner never generates) or 'learner' (between steps on the trainer, every rank together: tiny models and multi-turn tasks)")
    prompts_per_lease: int = Field(64, ge=1, le=4096, description="[eval] prompts_per_lease: eval prompts a worker generates together")
    limit: int = Field(0, ge=0, description="[eval] limit: evaluate on the first N eval prompts (0: all)")
    final_timeout_s: float = Field(300.0, ge=0.0, description="[eval] final_timeout_s: how long the learner waits for the workers' eval of the last version before it stops")


class LearnerEval(Section):
    """`[eval] where = "learner"`: the trainer evaluates between steps, every rank together (tiny models,
    and multi-turn tasks, whose returns only the learner's environment can score)."""

    where: Literal["learner"] = Field("learner", description="[eval] where: 'learner' evaluates between steps on the trainer thread")
    limit: int = Field(0, ge=0, description="[eval] limit: evaluate on the first N eval prompts (0: all)")

    @model_validator(mode="before")
    @classmethod
    def _workers_keys_ignored(cls, data: Any) -> Any:
        # Keys that only mean something on workers stay accepted, so `--eval.where learner` works on any config.
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k not in WORKERS_ONLY_EVAL_KEYS}
        return data


WORKERS_ONLY_EVAL_KEYS = ("prompts_per_lease", "final_timeout_s")


def _eval_where(data: Any) -> str:
    """The tag of an `[eval]` table; a table that does not say is evaluated on the workers."""
    return data.get("where", "workers") if isinstance(data, dict) else getattr(data, "where", "workers")


#: `[eval]`: where eval rounds run, a tagged union on `where` (one factory: `learner.evaluation.make_evaluation`).
EvalSection = Annotated[Union[Annotated[WorkersEval, Tag("workers")], Annotated[LearnerEval, Tag("learner")]],
                        Discriminator(_eval_where)]


class _BroadcastShared(Section):
    mode: Literal["chain", "star"] = Field("chain", description="[broadcast] mode: 'chain' (signed, chunked, pipelined chains planned from links) or 'star' (every worker downloads from the learner)")
    uplink_mbit: float = Field(1000.0, gt=0.0, description="[broadcast] uplink_mbit: the learner's upload bandwidth (Mbit/s), for planning and pacing")
    done_fraction: float = Field(0.9, gt=0.0, le=1.0, description="[broadcast] done_fraction: T_bcast is measured until this share of the active workers received a version (a straggler does not set it)")


class StarBroadcast(_BroadcastShared):
    """Every worker downloads each version whole from the learner (`broadcast.star`)."""

    mode: Literal["star"] = "star"


class ChainBroadcast(_BroadcastShared):
    """Signed, chunked versions pushed along chains planned from the workers' links."""

    mode: Literal["chain"] = "chain"
    chunk_mib: float = Field(1.0, ge=0.0625, le=64.0, description="[broadcast] chunk_mib: the largest chunk in MiB; each version's chunk size is chosen from its size, the rates and the hop count of its plan, 256 KiB up to this")
    deltas: bool = Field(True, description="[broadcast] deltas: send XOR+zstd deltas on the previous version when smaller")
    key_file: Path | None = Field(None, description="[broadcast] key_file: ed25519 signing key (PEM; created if missing; default: in the run directory)")
    fallback_s: float = Field(10.0, gt=0.0, description="[broadcast] fallback_s: a worker not reached by the push within this many seconds pulls the version from the learner")
    ticket_s: float = Field(600.0, ge=1.0, le=86400.0, description="[broadcast] ticket_s: lifetime of a worker's read ticket (renewed in heartbeat replies); a quarantined worker is refused by the learner at once and by relays within this (+2 min for their clocks)")


CHAIN_ONLY = frozenset(ChainBroadcast.model_fields) - frozenset(_BroadcastShared.model_fields) - {"mode"}


def _broadcast_mode(data: Any) -> Any:
    """`mode` defaults to "chain"; a star table may keep chain-only keys (a shared file with
    `--broadcast.mode star`), which mean nothing to a star and are dropped, as before the union."""
    if not isinstance(data, dict):
        return data
    data = {"mode": "chain", **data}
    if data["mode"] == "star":
        data = {k: v for k, v in data.items() if k not in CHAIN_ONLY}
    return data


#: `[broadcast]`: the broadcast design, a tagged union on `mode` (`learner.publisher.make_publisher`).
BroadcastSection = Annotated[Annotated[ChainBroadcast | StarBroadcast, Field(discriminator="mode")],
                             BeforeValidator(_broadcast_mode)]


MIN_TOKEN_CHARS = 16  # ~80 bits from a random alphabet: out of reach of a throttled guesser


def check_token(token: str) -> str:
    """A run token that a guesser cannot find: long enough and not one character repeated."""
    if token and (len(token) < MIN_TOKEN_CHARS or len(set(token)) < 6):
        raise ValueError(f"a run token needs at least {MIN_TOKEN_CHARS} characters, not all alike (this one has "
                         f"{len(token)}); leave it empty for a random one, or use `python -c 'import secrets; "
                         "print(secrets.token_hex(16))'`")
    return token


class ServerSection(Section):
    host: str = Field("127.0.0.1", description="[server] host: address the control API binds to")
    port: int = Field(8650, ge=0, le=65535, description="[server] port: control API port (0 = pick a free one)")
    token: str = Field("", description="[server] token: run token workers must present; empty = $ECHO_TOKEN or a random one (printed)")
    lease_ttl: float = Field(20.0, gt=0.0, description="[server] lease_ttl: seconds a lease lives without a heartbeat before its prompts are re-issued")
    heartbeat_interval: float = Field(2.0, gt=0.0, description="[server] heartbeat_interval: seconds between worker heartbeats")
    max_body_mb: float = Field(8.0, gt=0.0, description="[server] max_body_mb: largest accepted trajectory upload (MiB)")
    max_inflight_prompts: int = Field(0, ge=0, description="[server] max_inflight_prompts: leased-but-unfinished prompt cap (0: (S + 1)·G)")
    lease_first_prompts: int = Field(8, ge=1, le=1024, description="[server] lease_first_prompts: prompts a worker may hold before it delivered any (at most its share of the prompts in flight among the workers alive); then twice what it delivered within one lease turnaround (at least lease_ttl)")
    unproven_share: float = Field(1.0, gt=0.0, le=1.0, description="[server] unproven_share: of the prompts in flight, the share workers that never delivered may hold together (1: no bound; a fleet that joins at once is all unproven, and a bound slows its start); their leases expire after 4 of the fleet's median turnarounds whatever their heartbeats, each unanswered expiry halving what they may take next")
    lease_max_s: float = Field(600.0, gt=0.0, description="[server] lease_max_s: a lease expires this many seconds after its issue, however often heartbeats renew it")
    refuse_stale_leases: bool = Field(True, description="[server] refuse_stale_leases: give no prompts to a worker whose installed version is already staler than S (its groups would be refused); it gets them once it installs a newer one")
    long_poll_s: float = Field(10.0, ge=0.0, le=60.0, description="[server] long_poll_s: a lease request with nothing to hand out waits up to this long for work instead of the worker polling")
    max_workers: int = Field(1024, ge=1, le=100_000, description="[server] max_workers: joined workers the learner holds at once; a join beyond it gets 503 (silent workers are forgotten after forget_after_s)")
    join_rate: float = Field(20.0, gt=0.0, description="[server] join_rate: joins admitted per second on average (a burst of join_burst passes); beyond it, 429 with Retry-After")
    join_burst: int = Field(200, ge=1, description="[server] join_burst: joins admitted at once before join_rate applies")
    allow_networks: list[str] = Field(default_factory=list, description="[server] allow_networks: CIDR blocks a join may come from, e.g. ['10.0.0.0/8'] (empty: anywhere)")
    body_timeout_s: float = Field(60.0, gt=0.0, description="[server] body_timeout_s: a request's body (an upload, a JSON report) must arrive within this many seconds (a trickling sender holds nothing long)")
    header_timeout_s: float = Field(20.0, gt=0.0, description="[server] header_timeout_s: a connection must send a complete request within this many seconds of opening, or of its last answer (slow headers, idle keep-alives); a long-polled lease is a request in progress and is not cut")
    max_inflight_upload_mb: float = Field(256.0, gt=0.0, description="[server] max_inflight_upload_mb: bytes of uploads read at once (each counted at what it declares, at most what its sender's prompts can be); workers that never delivered hold half of it together; past it a new upload gets 503 and retries")
    max_workers_per_address: int = Field(16, ge=1, le=100_000, description="[server] max_workers_per_address: workers joined from one address (one IPv6 /64) at once; a rented machine can open many identities but not many addresses")
    max_64s_per_48: int = Field(8, ge=1, le=65536, description="[server] max_64s_per_48: an IPv6 /48 (one site; a tunnel broker gives one away, and it holds 65,536 /64s) holds at most this many /64s' worth of workers (× max_workers_per_address) and of connections; a cloud provider may put several rented machines, a /64 each, in one /48")
    worker_requests_per_s: float = Field(100.0, gt=0.0, description="[server] worker_requests_per_s: requests one worker (one credential) may make per second on average, after worker_request_burst; beyond it, 429 rate-limited with Retry-After. An honest worker sends a heartbeat every heartbeat_interval, a lease and an upload per batch and a snapshot download per version: at most 42/s over 10 s measured for the fastest worker of the integration tests (200 rollouts/s in leases of 4 prompts × 4 samples), about 20/s estimated for the CPU demo's (500 rollouts/s, 4 × 16), under 1/s with a real model; a faster one takes more prompts a lease")
    worker_request_burst: int = Field(200, ge=1, description="[server] worker_request_burst: requests one worker may make at once before worker_requests_per_s applies")
    auth_failures_per_min: float = Field(10.0, gt=0.0, description="[server] auth_failures_per_min: wrong run tokens or credentials one address may present per minute (after auth_failure_burst); beyond it, 429")
    auth_failure_delay_s: float = Field(1.0, ge=0.0, le=30.0, description="[server] auth_failure_delay_s: a wrong run token or credential (and a throttled address's request) is answered this many seconds late, as a refused login (PAM's faildelay): a guesser that waits for its answers costs the learner one request a second per connection, not as many as it can send; an honest worker with a forgotten credential joins again a second later")
    auth_failure_burst: int = Field(20, ge=1, description="[server] auth_failure_burst: wrong tokens or credentials one address may present at once before auth_failures_per_min applies")
    ban_s: float = Field(3600.0, gt=0.0, description="[server] ban_s: how long a quarantined worker's address may not join (doubled for each repeat); an address is the ISP's, and its next holder is someone else")
    hold_s: float = Field(60.0, ge=0.0, description="[server] hold_s: a worker quarantined on statistical evidence (its tokens' ranks or repeats; an honest one can draw that by bad luck) bans no address, but no new worker joins from its address for this long (doubled for each repeat within ban_s, at most ban_s; 0: none): a worker caught choosing its samples joined again at once")
    trusted_proxies: list[str] = Field(default_factory=list, description="[server] trusted_proxies: CIDR blocks of reverse proxies whose X-Forwarded-For names the worker's address (empty: the connection's address is the worker's)")
    relay_any_public: bool = Field(False, description="[server] relay_any_public: connect to a worker's relay on any public IP address (else only at the address the worker connects from; a relay elsewhere makes its worker a leaf that pulls, as behind NAT)")
    metrics_from: list[str] = Field(default_factory=lambda: ["127.0.0.0/8", "::1/128"], description="[server] metrics_from: CIDR blocks /metrics answers (default: this machine only; the run token also opens it)")
    forget_after_s: float = Field(120.0, gt=0.0, description="[server] forget_after_s: a worker silent this long is forgotten; its credential stops working and it must join again")

    @field_validator("token")
    @classmethod
    def _token_strength(cls, value: str) -> str:
        check_token(value)
        return value

    @field_validator("allow_networks", "trusted_proxies", "metrics_from")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for net in value:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"allow_networks: {net!r} is not a CIDR block like '10.0.0.0/8' or '192.0.2.7/32'") from None
        return value


class VerifySection(Section):
    """How the learner checks untrusted workers' work (learner.verify)."""

    rescore_fraction: float = Field(1.0, ge=0.0, le=1.0, description="[verify] rescore_fraction: share of uploaded groups whose rewards the learner recomputes itself (the recomputed rewards are the ones trained on); at 1 a one-turn task's training prompts go to workers without their answers")
    reward_tolerance: float = Field(1e-4, ge=0.0, description="[verify] reward_tolerance: a claimed reward further than this from the learner's counts as a mismatch")
    max_reward_mismatch: float = Field(0.05, ge=0.0, le=1.0, description="[verify] max_reward_mismatch: a worker whose share of mismatched rewards (over its last 256 checked samples) exceeds this is quarantined")
    min_checked: int = Field(16, ge=1, description="[verify] min_checked: checked samples needed before a worker can be judged on rewards")
    max_eval_logit_gap: float = Field(1.0, gt=0.0, description="[verify] max_eval_logit_gap: an eval answer with a token this many logits below the best, under the evaluated version, is not its greedy completion: its worker is quarantined and the prompt asked again of another")
    max_logprob_gap: float = Field(0.5, gt=0.0, description="[verify] max_logprob_gap: mean |log pi - log mu| per token (nats) beyond the fleet's drift at the groups' staleness, above which a worker's log-probs are judged fabricated")
    min_gap_tokens: int = Field(512, ge=1, description="[verify] min_gap_tokens: tokens needed before a worker can be judged on log-probs, or (its log-probs passing) vote on the fleet's drift (a new worker's first groups are its stalest, and one group far from π among a few read as a forger at 64)")
    token_check_fraction: float = Field(0.25, ge=0.0, le=1.0, description="[verify] token_check_fraction: how many groups per step (this share of G) the learner checks were sampled from the policy, not chosen, drawn from every group accepted since the last step (one no-grad forward of them: where each token ranks under the policy)")
    stale_check_fraction: float = Field(0.25, ge=0.0, le=1.0, description="[verify] stale_check_fraction: how many of a batch's stale groups per step (this share of G) the learner checks against the very version each claims, not the fleet's drift: their log-probs and tokens held to the fresh bound, in one no-grad pass of a frozen copy per version. The learner keeps the published versions within max_staleness on the host for it (at 8B in bf16 on 4 ranks: 4 GB per rank per version); 0 keeps none")
    repeat_nats: float = Field(30.0, ge=0.0, le=1000.0, description="[verify] repeat_nats: a run of tokens the policy gives at most e^-repeat_nats, seen 3 times in the groups checked under the version that sampled them, was written, not sampled (sampling repeats it with probability below e^-repeat_nats each time): its writers are quarantined. Catches a phrase trained in with right rewards; 0 turns it off")
    max_token_z: float = Field(8.0, gt=0.0, description="[verify] max_token_z: a worker whose recent checked tokens' ranks under the policy lie this many standard deviations from sampling's (beyond the fleet's own at their staleness) chose its tokens: greedy, or a phrase the policy would rarely say; and one whose samples repeat one another this many standard deviations more often than sampling gives copied them (less often: chose them to differ)")
    min_token_checks: int = Field(256, ge=1, description="[verify] min_token_checks: checked tokens needed before a worker can be judged on its tokens, or (they passing) vote on the fleet's token drift")
    max_outside_nucleus: float = Field(0.05, ge=0.0, le=1.0, description="[verify] max_outside_nucleus: share of a worker's recent checked tokens outside the policy's top-p nucleus (which sampling never gives) above which it is judged to have chosen them; counted on groups of the learner's own version (staleness 0) once min_token_checks of them were checked: an older snapshot's nucleus is not the policy's")
    capacity_claim_factor: float = Field(2.0, ge=1.0, description="[verify] capacity_claim_factor: a worker's claimed rollouts/s is believed up to this multiple of the rate the learner measured on its leases (unproven until one lease came back)")
    quarantine: bool = Field(True, description="[verify] quarantine: stop taking work from a worker judged dishonest (else only count it)")
    ban_address: bool = Field(True, description="[verify] ban_address: refuse joins from a quarantined worker's address, so it cannot return under a new identity (workers behind one NAT share the ban)")


class WorkersSection(Section):
    spawn: int = Field(0, ge=0, le=64, description="[workers] spawn: local worker processes to start, without a scheduler (the demo starts its workers from a pool instead: [scheduler.provider] type = 'local')")
    config: Path = Field(Path("configs/worker.toml"), description="[workers] config: worker config file for spawned workers")
    overrides: list[str] = Field(default_factory=list, description="[workers] overrides: extra dotted overrides for spawned workers")
    python: str = Field("", description="[workers] python: interpreter for spawned workers, e.g. '.venv-vllm/bin/python' for vLLM workers (default: the learner's)")


class LearnerConfig(Section):
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    task: TaskSection = TaskSection()
    rollout: RolloutSection = RolloutSection()
    trainer: TrainerSection = TrainerSection()
    buffer: BufferSection = BufferSection()
    publish: PublishSection = PublishSection()
    eval: EvalSection = WorkersEval()
    server: ServerSection = ServerSection()
    verify: VerifySection = VerifySection()
    broadcast: BroadcastSection = ChainBroadcast()
    workers: WorkersSection = WorkersSection()
    scheduler: SchedulerSection = SchedulerSection()

    @model_validator(mode="before")
    @classmethod
    def _episodes_evaluated_on_the_learner(cls, data: Any) -> Any:
        """An `[eval]` table that does not say where, for a multi-turn task: on the learner, the
        only place its returns are scored (a calculator config without `[eval] where` was refused)."""
        if not isinstance(data, dict) or not isinstance(data.get("eval", {}), dict) or "where" in data.get("eval", {}):
            return data
        try:
            episodic = TaskSection.model_validate(data.get("task", {})).build().episodic
        except Exception:  # noqa: BLE001 - a bad [task] table is said by its own validation, next
            return data
        return {**data, "eval": {**data.get("eval", {}), "where": "learner"}} if episodic else data

    @model_validator(mode="after")
    def _ranks_supported(self) -> "LearnerConfig":
        if self.eval.where == "workers" and self.task.build().episodic:
            raise ValueError(f"task {self.task.name!r} plays multi-turn episodes, which are evaluated by their return "
                             "on the learner: set [eval] where = 'learner' (or --eval.where learner)")
        if self.run.nproc > 1 and self.trainer.compute_dtype == "float16":
            raise ValueError("[trainer] compute_dtype = 'float16' (loss scaling) is supported on one rank; "
                             "use 'bfloat16' with [run] nproc > 1")
        b, every = self.buffer, self.publish_every
        if self.staleness_bound is not None and every > b.max_staleness + 1:
            # At version S + 1 the newest snapshot is still v0 (the next comes at I): nothing within S
            # can ever arrive, and the learner waited for a batch forever, saying nothing.
            raise ValueError(f"[publish] every = {every} > max_staleness + 1 = {b.max_staleness + 1}: at update "
                             f"{b.max_staleness + 1} no published version is within S = {b.max_staleness} of the "
                             f"learner, so no group could be trained and the run would wait forever; set [publish] "
                             f"every <= {b.max_staleness + 1} (the default is S - 1) or raise [buffer] max_staleness")
        return self

    @property
    def scheduled(self) -> bool:
        """Does a controller decide which workers generate (else every joined worker does)?"""
        return self.scheduler.pool is not None or self.scheduler.provider != "static"

    @property
    def publish_every(self) -> int:
        """I: explicit, else S - 1 so the worst-case staleness stays within S."""
        return self.publish.every or max(1, self.buffer.max_staleness - 1)

    @property
    def kept_versions(self) -> int:
        """Published versions the trainer keeps to check stale groups against the version they
        claim: those within S of the newest (0 with `[verify] stale_check_fraction = 0` or S = 0)."""
        if self.verify.stale_check_fraction <= 0 or self.buffer.max_staleness <= 0:
            return 0
        return self.buffer.max_staleness // self.publish_every + 1

    @property
    def staleness_bound(self) -> int | None:
        """S where the buffer drops what is staler (None: its filter is off, nothing is dropped for age)."""
        b = self.buffer
        return b.max_staleness if b.staleness_filter or b.type == "queue-max" else None

    @property
    def dynamic_sampling(self) -> bool:
        """`[buffer] dynamic_sampling` resolved: on by default where equal rewards carry no advantage."""
        ds = self.buffer.dynamic_sampling
        return self.trainer.loss == "grpo" if ds is None else ds

    @property
    def batch_rollouts(self) -> int:
        return self.trainer.batch_prompts * self.rollout.group_size

    def resolve_token(self) -> str:
        return self.server.token or check_token(os.environ.get("ECHO_TOKEN", "")) or secrets.token_hex(16)


def load_learner_config(path: str | Path | None, overrides: list[str] | None = None) -> LearnerConfig:
    return load_config(LearnerConfig, path, overrides)
