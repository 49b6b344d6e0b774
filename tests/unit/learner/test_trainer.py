"""The trainer uses the behaviour log-probs the worker recorded: a batch where π/μ is known."""

import math

import pytest
import torch

from echo.hf import completion_logprobs, sample
from learner.buffer import BatchInfo, Group
from learner.config import load_learner_config
from learner.train.trainer import Trainer


@pytest.mark.parametrize("is_cap,expected_weight,truncated", [(1.5, 1.5, 1.0), (3.0, 2.0, 0.0)])
def test_importance_weights_follow_recorded_behaviour_logprobs(tiny_model, is_cap, expected_weight, truncated):
    cfg = load_learner_config(None, ["--model.path", str(tiny_model), "--trainer.is_cap", str(is_cap),
                                     "--rollout.group_size", "4", "--trainer.batch_prompts", "2"])
    trainer = Trainer(cfg)
    tok = trainer.tokenizer
    prompts = [trainer.episodes.chat("3+4="), trainer.episodes.chat("5+5=")]
    torch.manual_seed(0)
    outs = sample(trainer.hf, [p for p in prompts for _ in range(4)], max_new_tokens=4,
                  stop_ids=tok.eos_token_id, pad_id=tok.pad_token_id)
    with torch.no_grad():
        logp, mask = completion_logprobs(trainer.hf, [p for p in prompts for _ in range(4)],
                                         [o.tokens for o in outs], pad_id=tok.pad_token_id)
    # Behaviour μ = π / 2 on every token, as if an older snapshot had generated them.
    behaviour = [(logp[i, : len(o.tokens)] - math.log(2)).tolist() for i, o in enumerate(outs)]
    groups = [Group(f"p{g}", 0, prompts[g], [o.tokens for o in outs[4 * g: 4 * g + 4]],
                    behaviour[4 * g: 4 * g + 4], [1.0, 0.0, 1.0, 0.0]) for g in range(2)]
    stats = trainer.step(BatchInfo(groups, learner_version=0, staleness=[0, 0]))
    assert stats["is_weight_mean"] == pytest.approx(expected_weight, rel=1e-4)
    assert stats["is_truncated_fraction"] == pytest.approx(truncated)
    assert stats["mismatch_kl"] == pytest.approx(-math.log(2), abs=1e-4)
    assert trainer.version == 1


# --- numerics: π is the workers' μ, gradients do not depend on the split, fp32 master weights ----

from dist_trainer import synthetic_batch  # noqa: E402  (tests/ is on sys.path, as for test_engines)

from echo.hf import head_logprobs, processed_logits  # noqa: E402
from learner.buffer import BatchInfo as _BatchInfo  # noqa: E402
from learner.train.microbatch import pack  # noqa: E402


def _trainer(model, *overrides):
    return Trainer(load_learner_config(None, ["--model.path", str(model), "--rollout.group_size", "4",
                                               "--trainer.batch_prompts", "4", *overrides]))


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_chunked_head_logprobs_equal_the_full_log_softmax_with_gradients(top_p):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(23, 16, requires_grad=True)
    targets = torch.randint(0, 50, (23,))
    full = torch.log_softmax(processed_logits(head(hidden), 0.7, top_p), -1).gather(-1, targets[:, None]).squeeze(-1)
    keep = torch.isfinite(full)
    (full[keep].sum()).backward()
    want_grad, hidden.grad = hidden.grad.clone(), None
    for chunk in (1, 5, 23, 100):
        got = head_logprobs(hidden, head, targets, temperature=0.7, top_p=top_p, chunk_tokens=chunk)
        assert torch.equal(torch.isfinite(got), keep)
        assert torch.allclose(got[keep], full[keep], atol=1e-6)
        got[keep].sum().backward()
        assert torch.allclose(hidden.grad, want_grad, atol=1e-6)
        hidden.grad = None
    if top_p < 1:
        assert not keep.all()  # some targets fell outside the nucleus: the −inf path is exercised


def test_one_two_and_four_micro_batches_give_the_same_gradient(tiny_model):
    batch = synthetic_batch(0, 19)
    lengths = [len(g.prompt_ids) + len(c) for g in batch.groups for c in g.completions]
    budgets = {}
    for budget in range(max(lengths), sum(lengths) * max(lengths) + 1):
        budgets.setdefault(len(pack(lengths, budget)), budget)
        if 1 in budgets:
            break
    grads = {}
    for count in (1, 2, 4):
        trainer = _trainer(tiny_model, "--trainer.micro_batch_tokens", str(budgets[count]))
        captured = {}
        trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs, _c=captured, _t=trainer: _c.update(
            {n: p.grad.clone() for n, p in _t.policy.named_parameters()}))
        trainer.step(batch)
        grads[count] = captured
    for count in (2, 4):
        for name, g in grads[1].items():
            rel = (grads[count][name] - g).norm() / g.norm().clamp(min=1e-12)
            assert rel <= 1e-6, (count, name, float(rel))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_p_trainer_pi_equals_worker_mu_on_fresh_weights(tiny_model, temperature):
    """The worker samples with top-p 0.9 (μ renormalised over the nucleus); the trainer's π for
    the same weights must be that distribution, not the full softmax (the last round's bug:
    mismatch_kl 0.047 and every importance weight ≈ 0.955)."""
    overrides = ["--rollout.top_p", "0.9", "--rollout.temperature", str(temperature)]
    trainer = _trainer(tiny_model, *overrides)
    tok = trainer.tokenizer
    prompts = [trainer.episodes.chat(f"{a}+{b}=") for a, b in ((3, 4), (5, 5), (1, 8), (9, 2))]
    torch.manual_seed(1)
    outs = sample(trainer.hf, [p for p in prompts for _ in range(4)], max_new_tokens=4, stop_ids=tok.eos_token_id,
                  pad_id=tok.pad_token_id, temperature=temperature, top_p=0.9)
    groups = [Group(f"p{g}", 0, prompts[g], [o.tokens for o in outs[4 * g: 4 * g + 4]],
                    [o.logprobs for o in outs[4 * g: 4 * g + 4]], [1.0, 0.0, 0.0, 1.0]) for g in range(4)]
    batch = _BatchInfo(groups, learner_version=0, staleness=[0] * 4)
    ignoring_top_p = _trainer(tiny_model, "--rollout.temperature", str(temperature)).step(batch)
    stats = trainer.step(batch)
    assert abs(stats["mismatch_kl"]) < 1e-6 and stats["outside_nucleus_fraction"] == 0.0
    assert stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert ignoring_top_p["mismatch_kl"] > 1e-3  # the check has teeth: π without top-p is another policy


def test_bf16_autocast_keeps_fp32_master_weights_that_move_at_small_lr(tiny_model):
    """bf16 forward/backward, fp32 parameters and AdamW state: at lr 1e-6 a bf16 parameter
    would mostly not move (an update below half an ulp rounds away); fp32 masters do."""
    trainer = _trainer(tiny_model, "--trainer.compute_dtype", "bfloat16", "--trainer.lr", "1e-6",
                       "--publish.dtype", "bfloat16")
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    for step in range(10):
        stats = trainer.step(synthetic_batch(step, trainer.vocab_size))
        assert math.isfinite(stats["loss"])
    changed = sum(int((p.detach() != before[n]).sum()) for n, p in trainer.policy.named_parameters())
    total = sum(p.numel() for p in before.values())
    assert changed / total > 0.9, changed / total
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())
    assert all(v.dtype == torch.float32 for s in trainer.optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0)
    from safetensors.torch import load

    snapshot = load(bytes(trainer.snapshot()))
    assert {t.dtype for t in snapshot.values()} == {torch.bfloat16}  # what workers install


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_step_on_cuda_keeps_every_tensor_on_the_device(tiny_model, dtype):
    """The last round's crash: behaviour log-probs and advantages built on the CPU and mixed with
    log-probs on the GPU. A whole step, top-p and KL included, must run on cuda."""
    trainer = _trainer(tiny_model, "--model.device", "cuda", "--trainer.compute_dtype", dtype,
                       "--rollout.top_p", "0.9", "--trainer.kl_coef", "0.01", "--trainer.minibatches", "2")
    stats = trainer.step(synthetic_batch(0, trainer.vocab_size))
    assert math.isfinite(stats["loss"]) and next(trainer.policy.parameters()).is_cuda
    assert trainer.snapshot() is not None


# --- fail before loading ---------------------------------------------------------------------------

def test_preflight_predicts_qwen3_8b_from_its_config_and_refuses_what_cannot_fit():
    """Qwen3-8B's published config (configs/models/Qwen3-8B, no weights): 8.19B parameters; the
    4-rank plan fits an 80 GB A100, one rank on this machine does not and says what to change."""
    import subprocess
    import sys
    from pathlib import Path

    from learner.train.memory import ModelShape, predict

    root = Path(__file__).resolve().parents[3]
    shape = ModelShape.of(root / "configs/models/Qwen3-8B")
    assert shape.params == pytest.approx(8.19e9, rel=1e-3) and not shape.tied and shape.layers == 36
    plans = {n: predict(shape, ranks=n, micro_batch_tokens=16384, compute_bytes=2, checkpointing=True,
                        reference=False, chunk_tokens=220, top_p=0.95, gpu=True) for n in (1, 4)}
    assert plans[4].state == pytest.approx(plans[1].state / 4)
    assert plans[4].total < 80e9 < plans[1].total
    out = subprocess.run([sys.executable, "-m", "learner.main", "--config", "configs/learner-8b.toml", "--preflight",
                          "--model.path", "configs/models/Qwen3-8B", "--model.device", "cpu", "--nproc", "1"],
                         cwd=root, capture_output=True, text=True)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "8190.7M parameters" in out.stdout and "predicted to need" in out.stderr and "--nproc 2" in out.stderr


def test_preflight_refuses_a_tokenizer_larger_than_the_vocabulary(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.tinymodel import build_tokenizer
    from learner.train.preflight import PreflightError, preflight

    tok = build_tokenizer()  # 19 tokens
    Qwen2ForCausalLM(Qwen2Config(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = load_learner_config(None, ["--model.path", str(tmp_path)])
    with pytest.raises(PreflightError, match="19 tokens but the model's output layer has 12 rows"):
        preflight(cfg, 1, "cpu")


def test_each_step_logs_the_learning_rate_it_ran_at(tiny_model):
    """The run log's `lr` was read after the scheduler stepped: the next update's rate (warm-up
    step 1 read 6e-5 where it ran at 3e-5)."""
    trainer = _trainer(tiny_model, "--trainer.lr", "3e-4", "--trainer.warmup_steps", "10",
                       "--trainer.schedule", "linear", "--run.steps", "40")
    assert [trainer.step(synthetic_batch(k, trainer.vocab_size))["lr"] for k in range(3)] == pytest.approx(
        [3e-5, 6e-5, 9e-5])


def test_fp16_autocast_with_loss_scaling_trains(tiny_model):
    """compute_dtype = 'float16': autocast with a gradient scaler (fp16 overflows without one);
    the masters stay fp32 and move."""
    trainer = _trainer(tiny_model, "--trainer.compute_dtype", "float16", "--trainer.lr", "1e-4")
    assert trainer.scaler is not None
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    for step in range(3):
        assert math.isfinite(trainer.step(synthetic_batch(step, trainer.vocab_size))["loss"])
    moved = sum(int((p.detach() != before[n]).sum()) for n, p in trainer.policy.named_parameters())
    assert moved > 0.5 * sum(p.numel() for p in before.values())
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())


def test_prompts_go_through_the_tokenizers_chat_template_with_a_system_prompt(tiny_model, tmp_path):
    import shutil

    from echo.chat import Chat

    model = tmp_path / "chat"
    shutil.copytree(tiny_model, model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}={% else %}"
                         "{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}={% endif %}")
    tok.save_pretrained(model)
    plain = Chat(AutoTokenizer.from_pretrained(tiny_model))("1+2")
    assert not Chat(AutoTokenizer.from_pretrained(tiny_model)).templated  # no template: plain text
    with pytest.raises(ValueError, match="no chat template"):
        Chat(AutoTokenizer.from_pretrained(tiny_model), "on")
    trainer = _trainer(model, "--task.system_prompt", '"9"')
    chat = trainer.episodes.chat("1+2")
    assert trainer.tokenizer.decode(chat) == "9=1+2=" and chat != plain
    off = _trainer(model, "--task.chat_template", "off").episodes.chat("1+2")
    assert trainer.tokenizer.decode(off, skip_special_tokens=True) == "1+2"


def test_each_minibatch_step_is_normalised_by_its_own_tokens(tiny_model, monkeypatch):
    """With k minibatches every optimizer step's loss is a mean over its own slice's tokens: the
    normalisers are the slices' token counts (they sum to the batch's), and the gradient norm
    is that of a mean, about the one-minibatch norm — not 1/k of it, which clipping at
    max_grad_norm would then read as k times looser."""
    import learner.train.trainer as trainer_module

    seen = []
    real = trainer_module.grpo_loss
    monkeypatch.setattr(trainer_module, "grpo_loss", lambda *a, **kw: seen.append(kw["total_tokens"]) or real(*a, **kw))
    batch = synthetic_batch(0, 19)
    one = _trainer(tiny_model, "--trainer.max_grad_norm", "1e9").step(batch)
    assert seen == [one["tokens"]]
    seen.clear()
    four = _trainer(tiny_model, "--trainer.minibatches", "4", "--trainer.max_grad_norm", "1e9").step(batch)
    assert len(seen) == 4 and sum(seen) == four["tokens"] == one["tokens"]
    assert four["grad_norm_max"] >= four["grad_norm"] > 0.5 * one["grad_norm"]  # was ~1/4 of it


def test_asymre_advantages_are_rewards_minus_the_shifted_group_mean():
    from learner.train.trainer import _Samples

    batch = BatchInfo([Group("p", 0, [1], [[5], [6], [7], [8]], [[-1.0]] * 4, [1.0, 0.0, 0.0, 1.0])], 0, [0])
    assert _Samples.of(batch, 1e-6, -0.1).advantages == pytest.approx([0.6, -0.4, -0.4, 0.6])
    assert _Samples.of(batch, 1e-6).advantages == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)


def test_packed_micro_batches_give_the_padded_loss_and_gradient_with_fewer_computed_tokens(tiny_model):
    """Sequences end to end in one row, position ids restarting per sequence: the same loss and
    gradient as right-padded rows (≤ 1e-5), and no padding computed."""
    import random as _random

    rng = _random.Random(0)
    groups = [Group(f"g{g}", 0, [1] + [rng.randrange(4, 19) for _ in range(5)],
                    [[rng.randrange(4, 19) for _ in range(n)] for n in (40, 2, 3, 5)], [[-2.0] * n for n in (40, 2, 3, 5)],
                    [1.0, 0.0, 0.0, 1.0]) for g in range(4)]  # long-tailed: one long response per group
    batch = BatchInfo(groups, 0, [0] * 4)
    grads, stats = {}, {}
    for packing in ("true", "false"):
        trainer = _trainer(tiny_model, "--trainer.packing", packing, "--trainer.micro_batch_tokens", "256")
        trainer.optimizer.step = lambda: None  # keep the weights: compare the gradients themselves
        trainer.optimizer.zero_grad = lambda set_to_none=True: None
        stats[packing] = trainer.step(batch)
        grads[packing] = torch.cat([p.grad.flatten() for p in trainer.policy.parameters()])
    assert stats["true"]["loss"] == pytest.approx(stats["false"]["loss"], abs=1e-5)
    assert (grads["true"] - grads["false"]).abs().max() < 1e-5
    assert stats["true"]["padded_token_share"] < 0.5 * stats["false"]["padded_token_share"]


def test_bf16_computes_through_fsdp2_mixed_precision_on_one_rank_too(tiny_model):
    """compute_dtype = bfloat16: the master weights (and optimizer) stay fp32 in FSDP2's shards,
    each decoder layer runs with bf16 inputs and weights — the residual stream in bf16, as a
    bf16 vLLM worker's — and no autocast cache holds a bf16 copy of every layer."""
    trainer = _trainer(tiny_model, "--trainer.compute_dtype", "bfloat16")
    assert trainer.world.sharded and trainer.autocast_dtype is None
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())
    seen = []
    layer = trainer.hf.model.layers[0]
    handle = layer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).dtype), with_kwargs=True)
    stats = trainer.step(synthetic_batch(0, trainer.vocab_size))
    handle.remove()
    assert seen and set(seen) == {torch.bfloat16} and math.isfinite(stats["loss"])
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())


def test_a_sharded_learner_evaluates_before_its_first_update_and_then_trains(tiny_model):
    """[eval] where = 'learner' (every multi-turn task) on a sharded model (bf16, or 2 ranks):
    generation calls the HF model under the FSDP root, and the v0 eval ran before any forward
    through the root, so each layer made itself a root and the first update died ("FSDP state
    has already been lazily initialized"). The held eval copy generates the same way."""
    from echo.tasks import load_task

    trainer = _trainer(tiny_model, "--trainer.compute_dtype", "bfloat16", "--eval.where", "learner")
    assert trainer.world.sharded
    task = load_task("arith", {})
    accuracy = trainer.evaluate(task, task.eval_prompts()[:4])
    stats = trainer.step(synthetic_batch(0, trainer.vocab_size))
    assert 0.0 <= accuracy <= 1.0 and math.isfinite(stats["loss"])
    held = _trainer(tiny_model, "--trainer.compute_dtype", "bfloat16")
    held.hold_for_eval()
    assert len(held.held_greedy_returns(task.eval_prompts()[:2])) == 2
    assert math.isfinite(held.step(synthetic_batch(0, held.vocab_size))["loss"])


def test_preflight_predicts_qwen3_8b_lora_on_one_a100_with_versions_the_adapters_size():
    """LoRA rank 32 on every linear of Qwen3-8B: the frozen bf16 base and the adapter's fp32 state
    fit one 80 GB A100 where full training does not; a version is ~175 MB against 16.4 GB."""
    from pathlib import Path

    from learner.train.memory import ModelShape, predict

    shape = ModelShape.of(Path(__file__).resolve().parents[3] / "configs/models/Qwen3-8B")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = shape.adapter_params(32, targets)
    assert adapter == pytest.approx(87.3e6, rel=1e-3)
    common = dict(ranks=1, micro_batch_tokens=16384, compute_bytes=2, checkpointing=True, reference=False,
                  chunk_tokens=220, top_p=0.95, gpu=True, eval_copy=True)
    lora, full = predict(shape, adapter_params=adapter, **common), predict(shape, **common)
    assert lora.total < 80e9 < full.total
    assert lora.state == pytest.approx(2 * shape.params + 16 * adapter)
    assert shape.params * 2 / (adapter * 2) > 50  # ≥ 50× fewer bytes per version
    # the eval check's held version is its adapter (swapped in), not a second 16 GB base
    assert lora.eval_copy == 0 and full.eval_copy == pytest.approx(2 * shape.params)


def test_a_lora_trainer_trains_the_adapter_alone_and_publishes_it(tiny_model):
    """Only the adapter is in the optimizer and moves; the snapshot is the adapter (PEFT names,
    echo.lora metadata), its layout the same across versions, its probe the trainer's log-probs."""
    from echo.lora import probe_tokens, read_adapter_meta
    from learner.config import TrainerSection

    with pytest.raises(ValueError, match="dropout"):
        TrainerSection(lora={"rank": 4, "dropout": 0.1})
    trainer = _trainer(tiny_model, "--trainer.lora", "{rank = 4, alpha = 8}", "--trainer.lr", "1e-2")
    base = {k: v.clone() for k, v in trainer.hf.named_parameters() if "lora_" not in k}
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(
        [n for n, _ in trainer.hf.named_parameters() if "lora_" in n])
    v0 = bytes(trainer.snapshot())
    trainer.step(synthetic_batch(0, 19))
    v1 = bytes(trainer.snapshot())
    assert len(v0) == len(v1) and v0[:8] == v1[:8] and v0 != v1
    assert all(torch.equal(base[k], v) for k, v in trainer.hf.named_parameters() if "lora_" not in k)
    meta = read_adapter_meta(v1)
    assert meta.rank == 4 and meta.base == trainer.base_sha256
    prompt, completion = probe_tokens(trainer.vocab_size)
    with torch.no_grad():
        logp, _ = completion_logprobs(trainer.hf, [prompt], [completion], pad_id=trainer._pad)
    assert list(meta.probe) == pytest.approx(logp[0].tolist(), abs=1e-6)
    from safetensors.torch import load

    names = set(load(v1))
    assert names and all(n.startswith("base_model.model.") and ".lora_" in n for n in names)


def test_preflight_sizes_a_small_adapter_and_warns_of_a_rank_past_the_layers_width(tiny_model):
    """A tiny model's LoRA line read '0.0M adapter parameters ... 0.0 MB each', and a rank wider
    than the layers (an adapter larger than the model) '0× more', with nothing said."""
    from learner.train.preflight import preflight

    def weights_line(*overrides):
        lines = preflight(load_learner_config(None, ["--model.path", str(tiny_model), *overrides]), 1, "cpu").lines
        return lines[1], [x for x in lines if "warning" in x]

    small, warnings = weights_line("--trainer.lora", "{rank = 2, alpha = 8}")
    assert "0.0M" not in small and "0.0 MB" not in small and "k adapter parameters" in small and " kB each" in small
    assert not warnings
    wide, warnings = weights_line("--trainer.lora", "{rank = 4096, alpha = 8}")
    assert "× less" in wide and warnings and "use a rank below" in warnings[0]


def test_old_checkpoints_are_pruned_but_never_the_latest(tmp_path):
    """No checkpoint was ever deleted: a week of an 8B run's (~100 GB each with Adam) fills a disk."""
    from learner.train.trainer import prune_checkpoints

    for step in (5, 40, 100, 120):
        (tmp_path / f"step-{step:06d}" / "state").mkdir(parents=True)
    (tmp_path / "step-notes").mkdir()  # not a checkpoint's name: left alone
    (tmp_path / "latest").symlink_to("step-000040")  # a resume pointed back (as a test can)
    assert [p.name for p in prune_checkpoints(tmp_path, 2)] == ["step-000005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000040", "step-000100", "step-000120",
                                                          "step-notes"]
    assert prune_checkpoints(tmp_path, 0) == []  # keep all
    # Named by update now; one named by its version before (a resume put v125 at update 121) is
    # ordered by the update its state records, not its name
    (tmp_path / "step-000125" / "state").mkdir(parents=True)
    (tmp_path / "step-000125" / "learner_state.json").write_text('{"version": 125, "updates": 121}')
    (tmp_path / "step-000122" / "state").mkdir(parents=True)
    assert [p.name for p in prune_checkpoints(tmp_path, 2)] == ["step-000100", "step-000120"]


def test_one_rank_saves_and_resumes_a_checkpoint_without_a_process_group_or_a_warning(tiny_model, tmp_path):
    """The CPU demo's learner is one rank with no process group: torch warned at every checkpoint
    that it was "assuming the intent is to save in a single process". Now it says so itself. In a
    process of its own: another test here may have started a process group."""
    import subprocess
    import sys

    script = f"""
import warnings, torch
warnings.simplefilter("error")
from learner.config import load_learner_config
from learner.train.trainer import Trainer
assert not torch.distributed.is_initialized()
trainer = Trainer(load_learner_config(None, ["--model.path", {str(tiny_model)!r}, "--rollout.group_size", "4",
                                             "--trainer.batch_prompts", "4", "--run.keep_checkpoints", "1"]))
path = trainer.save_checkpoint({str(tmp_path)!r}, {{}})
saved = {{k: v.clone() for k, v in trainer.policy.state_dict().items()}}
with torch.no_grad():
    for p in trainer.policy.parameters():
        p.add_(1.0)
trainer.load_checkpoint(path)
assert all(torch.equal(v, saved[k]) for k, v in trainer.policy.state_dict().items())
trainer.version += 1
trainer.updates += 1
newer = trainer.save_checkpoint({str(tmp_path)!r}, {{}})
from pathlib import Path
assert sorted(p.name for p in Path({str(tmp_path)!r}).glob("step-*")) == [newer.name]  # keep_checkpoints = 1
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_resume_with_more_steps_runs_its_first_update_on_the_new_schedule(tiny_model, tmp_path):
    """`--resume RUN --run.steps 160` after a 100-step linear run: update 101 ran at the rate
    restored with the optimizer (the old schedule's 3e-05), update 102 at the new one's (1.4e-04),
    and the log said so. The rate is the new schedule's from the first update, and said at start."""
    import subprocess
    import sys

    script = f"""
import torch
from learner.config import load_learner_config
from learner.train.trainer import Trainer, lr_factor
common = ["--model.path", {str(tiny_model)!r}, "--rollout.group_size", "4", "--trainer.batch_prompts", "4",
          "--trainer.schedule", "linear", "--trainer.warmup_steps", "0", "--trainer.lr", "3e-4"]
first = Trainer(load_learner_config(None, [*common, "--run.steps", "100"]))
for _ in range(100):
    first.optimizer.step()
    first.scheduler.step()
first.updates = first.version = 100
path = first.save_checkpoint({str(tmp_path)!r}, {{}})
cfg = load_learner_config(None, [*common, "--run.steps", "160"])
longer = Trainer(cfg, checkpoint=path)
t = cfg.trainer
now = 3e-4 * lr_factor(100, "linear", 0, 160, t.min_lr_ratio)
assert abs(longer.optimizer.param_groups[0]["lr"] - now) < 1e-12, longer.optimizer.param_groups[0]["lr"]
assert abs(longer.resumed["lr_resumed"]["was"] - 3e-4 * lr_factor(100, "linear", 0, 100, t.min_lr_ratio)) < 1e-12
assert "lr_resumed" not in Trainer(load_learner_config(None, [*common, "--run.steps", "100"]), checkpoint=path).resumed
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_full_snapshot_carries_the_learners_probe_at_a_fixed_width(tiny_model):
    """A vLLM worker checked each install by running the model on its own CPU (an 8B forward per
    install). The learner now writes its probe log-probs for the version into the snapshot's
    metadata, computed in the compute dtype, at a fixed width: every version keeps one byte
    layout (deltas apply) and the worker runs nothing but its own engine."""
    from echo.lora import probe_tokens, read_weights_probe

    trainer = _trainer(tiny_model, "--trainer.lr", "1e-2")
    v0 = bytes(trainer.snapshot())
    trainer.step(synthetic_batch(0, 19))
    v1 = bytes(trainer.snapshot())
    assert len(v0) == len(v1) and v0[:8] == v1[:8] and v0 != v1
    (probe0, dtype), (probe1, _) = read_weights_probe(v0), read_weights_probe(v1)
    prompt, completion = probe_tokens(trainer.vocab_size)
    with torch.no_grad():
        logp, _ = completion_logprobs(trainer.hf, [prompt], [completion], pad_id=trainer._pad)
    assert dtype == "float32" and list(probe1) == pytest.approx(logp[0].tolist(), abs=1e-6) and probe0 != probe1


def test_an_exported_model_with_the_probe_in_its_metadata_loads_in_transformers(tiny_model, tmp_path):
    """The export is the snapshot's blob, metadata and all: transformers 4 refuses a safetensors
    file whose metadata names no framework (`format`), so it names one."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tiny_model)
    out = trainer.export(tmp_path / "model")
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_an_environment_that_errs_in_the_learners_eval_fails_on_rank_0_alone(tiny_model):
    """An environment failing mid-eval (here: a non-finite reward) ended a run in a traceback;
    with N ranks a follower would also have left its loop. Rank 0 raises it for the eval to say;
    a follower returns NaN and goes on replaying rank 0's calls."""
    import dataclasses

    from echo.episodes import EpisodeError
    from echo.tasks import load_task

    task = load_task("arith", {})
    task.reward = lambda prompt, completion: math.nan  # the environment's bug
    trainer = _trainer(tiny_model, "--eval.where", "learner")
    with pytest.raises(EpisodeError, match="non-finite reward"):
        trainer.evaluate(task, task.eval_prompts()[:2])
    trainer.world = dataclasses.replace(trainer.world, rank=1)
    assert math.isnan(trainer.evaluate(task, task.eval_prompts()[:2]))  # and its loop replays the next call
