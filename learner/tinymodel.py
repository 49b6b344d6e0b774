"""Build the tiny demo model without any download: a character-level tokenizer built with
`tokenizers`, a small Qwen2-architecture causal LM from a transformers config, and a brief
supervised warm start on the task so that RL has signal. The result is an ordinary Hugging Face
model directory; any other one (a real Qwen3, say) can be used in its place.

    echo-rl build-model --config configs/demo.toml      # builds at [model].path if missing

Untied embeddings on purpose: a checkpoint of a tied model has no `lm_head.weight`, which is
the case where weight installs silently go stale in some engines.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import sys
import time
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARACTERS = list("0123456789+-*= ")
TURN_MARKERS = ["<|im_start|>", "<|im_end|>"]
# Qwen2's template without tools: a turn ends with <|im_end|>, which is not the eos (as in Qwen).
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast` that prepends `<s>` to every encoded text."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARACTERS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per character
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_chat_tokenizer():
    """A byte-level BPE tokenizer without merges (one token per byte, as Qwen's tokenizer spells
    bytes, so transformers' Qwen2 tokenizer class loads it unchanged) with a Qwen-style chat
    template: `<|im_start|>`/`<|im_end|>` as special tokens, and a turn that ends on `<|im_end|>`
    while the tokenizer's eos is `</s>` (a worker that stopped only on eos would run on)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS + TURN_MARKERS + sorted(byte_chars))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s+|\S+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", padding_side="left", additional_special_tokens=TURN_MARKERS)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def end_of_turn_ids(tokenizer) -> list[int]:
    """What generation_config.json's eos_token_id lists: the turn's end and the tokenizer's eos."""
    ids = [tokenizer.convert_tokens_to_ids("<|im_end|>")] if getattr(tokenizer, "chat_template", None) else []
    return ids + [tokenizer.eos_token_id]


def build_model(tokenizer, hidden: int = 128, layers: int = 2, heads: int = 4, seed: int = 0, positions: int = 128):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=end_of_turn_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForCausalLM(config)


def warm_start(model, tokenizer, examples: list[tuple[str, str]], *, steps: int, lr: float,
               batch: int, seed: int, progress=None) -> list[float]:
    """Supervised steps on (prompt, completion) pairs, loss on completion tokens only."""
    pairs = [(tokenizer(p)["input_ids"], tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
             for p, c in examples]
    return warm_start_ids(model, tokenizer, pairs, steps=steps, lr=lr, batch=batch, seed=seed, progress=progress)


def warm_start_ids(model, tokenizer, pairs: list[tuple[list[int], list[int]]], *, steps: int, lr: float,
                   batch: int, seed: int, progress=None) -> list[float]:
    """Supervised steps on (context ids, target ids) pairs, loss on the target tokens only."""
    import torch

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        chunk = rng.sample(pairs, min(batch, len(pairs)))
        prompts = [p for p, _ in chunk]
        targets = [t for _, t in chunk]
        seqs = [p + t for p, t in zip(prompts, targets)]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
        labels = torch.full((len(seqs), width), -100)
        attention = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (p, s) in enumerate(zip(prompts, seqs)):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, len(p) : len(s)] = torch.tensor(s[len(p) :])
            attention[i, : len(s)] = 1
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress(loss.item())
    model.eval()
    return losses


def greedy_accuracy(model, tokenizer, task, prompts, max_new_tokens: int) -> float:
    from echo.hf import sample

    ids = [tokenizer(p.text)["input_ids"] for p in prompts]
    outs = sample(model, ids, max_new_tokens=max_new_tokens, stop_ids=tokenizer.eos_token_id,
                  pad_id=tokenizer.pad_token_id, temperature=0.0)
    texts = tokenizer.batch_decode([o.tokens for o in outs], skip_special_tokens=True)
    return sum(task.reward(p, t) for p, t in zip(prompts, texts)) / max(1, len(prompts))


def _episodes(cfg, task, tokenizer, model_dir: Path):
    """The run's episode rules for `model_dir`, as the trainer builds them."""
    from echo.chat import stop_ids
    from echo.episodes import Episodes

    r = cfg.rollout
    return Episodes.of(task, tokenizer, chat_template=cfg.task.chat_template, system_prompt=cfg.task.system_prompt,
                       template_kwargs=cfg.task.chat_template_kwargs,
                       stop_ids=stop_ids(tokenizer, model_dir, task.stop_tokens), max_new_tokens=r.max_new_tokens,
                       max_tokens=r.episode_tokens(task), max_turns=r.turns(task))


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="echo-rl build-model",
        description="Build a tiny Qwen2-architecture model and a character tokenizer from scratch "
        "(no download), warm-start it on the task, and save a Hugging Face model directory.",
        epilog="Any other --section.key VALUE overrides the learner config, as echo-learner takes them "
        "(e.g. --task.name calculator --eval.where learner).",
    )
    parser.add_argument("--config", default="configs/demo.toml",
                        help="learner config: its [model].path is the output, its [task] the task")
    parser.add_argument("--out", help="output directory (default: [model].path of the config)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory exists")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    parser.add_argument("--positions", type=int, default=0,
                        help="longest sequence (default: 128, or 1024 for multi-turn tasks)")
    parser.add_argument("--warmup-steps", type=int, default=30, help="supervised warm-start steps (default 30)")
    parser.add_argument("--warmup-lr", type=float, default=3e-3, help="warm-start learning rate (default 3e-3)")
    parser.add_argument("--warmup-batch", type=int, default=64, help="warm-start batch size (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args, overrides = parser.parse_known_args(argv)

    from echo.config import ConfigError
    from learner.config import LearnerConfig, load_learner_config

    try:
        cfg: LearnerConfig = load_learner_config(args.config, overrides)
    except ConfigError as e:
        print(f"echo-rl build-model: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or cfg.model.path)
    if args.out and Path(cfg.task.options.get("opponent_model") or "") == Path(cfg.model.path):
        cfg.task.opponent_model = str(out)  # the initial model is the frozen opponent: the one built here
    if (out / "config.json").exists() and not args.force:
        msg = f"{out} already exists (use --force to rebuild)"
        print(json.dumps({"path": str(out), "built": False}) if args.json else msg)
        return 0

    import torch
    from rich.progress import Progress

    torch.set_num_threads(2)
    task = cfg.task.build()
    t0 = time.perf_counter()
    # Multi-turn tasks get the byte-level chat tokenizer (a turn ends on <|im_end|>, as in Qwen)
    # and a warm start on the environment's expert, rendered as the workers render episodes.
    tokenizer = build_chat_tokenizer() if task.episodic else build_tokenizer()
    positions = args.positions or (1024 if task.episodic else 128)
    model = build_model(tokenizer, hidden=args.hidden, layers=args.layers, seed=args.seed, positions=positions)
    n_params = sum(p.numel() for p in model.parameters())
    evals = task.eval_prompts()[: cfg.eval.limit or None]

    def progress(bar, job):
        """The bar on a terminal; into a log (no terminal), a line every tenth of the warm start:
        a 13-minute poker build printed nothing at all."""
        every, done = max(1, args.warmup_steps // 10), [0]
        plain = not bar.console.is_terminal and not args.json

        def step(loss: float) -> None:
            bar.update(job, advance=1, description=f"warm start loss {loss:.3f}")
            done[0] += 1
            if plain and (done[0] % every == 0 or done[0] == args.warmup_steps):
                print(f"warm start {done[0]}/{args.warmup_steps}: loss {loss:.3f} "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        return step

    def say(what: str) -> None:
        """A line before each slow part: the poker build scored and demonstrated for 6 minutes
        before its warm start's first line, saying nothing (a new user, 2026-12-07)."""
        if not args.json:
            print(f"{what} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    if task.episodic:
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)  # the generation config's end ids are what Episodes reads
        tokenizer.save_pretrained(out)
        episodes = _episodes(cfg, task, tokenizer, out)
        score = lambda: sum(episodes.greedy_returns(model.eval(), evals, tokenizer.pad_token_id)) / max(1, len(evals))  # noqa: E731
        say(f"scoring the untrained model: {len(evals)} eval episodes, greedy")
        acc_random = score()
        say("playing the environment's expert for the warm start's demonstrations")
        try:
            pairs = episodes.demonstrations(list(itertools.islice(task.train_prompts(args.seed + 7919), max(
                300, args.warmup_steps * args.warmup_batch // 3)))) if args.warmup_steps else []
        except NotImplementedError as e:
            # An untrained model left at `out` would pass for a built one ("already exists") on the next try.
            if created:
                shutil.rmtree(out)
            else:
                (out / "config.json").unlink(missing_ok=True)
            print(f"echo-rl build-model: {e}; give its environment an expert_action() or pass --warmup-steps 0 "
                  "(an untrained model)", file=sys.stderr)
            return 2
        with Progress(transient=True, disable=args.json) as bar:
            job = bar.add_task("warm start", total=args.warmup_steps)
            losses = warm_start_ids(model, tokenizer, pairs, steps=args.warmup_steps, lr=args.warmup_lr,
                                    batch=args.warmup_batch, seed=args.seed, progress=progress(bar, job))
        say(f"scoring the warm-started model: {len(evals)} eval episodes, greedy")
        acc = score()
    else:
        max_new = cfg.rollout.max_new_tokens
        acc_random = greedy_accuracy(model, tokenizer, task, evals, max_new)
        examples = task.warmup_examples(max(1000, args.warmup_steps * args.warmup_batch), seed=args.seed + 7919)
        with Progress(transient=True, disable=args.json) as bar:
            job = bar.add_task("warm start", total=args.warmup_steps)
            losses = warm_start(model, tokenizer, examples, steps=args.warmup_steps, lr=args.warmup_lr,
                                batch=args.warmup_batch, seed=args.seed, progress=progress(bar, job))
        acc = greedy_accuracy(model, tokenizer, task, evals, max_new)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    result = {
        "path": str(out), "built": True, "parameters": n_params, "task": cfg.task.name,
        "warmup_steps": args.warmup_steps, "final_loss": losses[-1] if losses else None,
        "eval_accuracy_random_init": acc_random, "eval_accuracy": acc,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    metric = "return" if task.episodic else "accuracy"  # an episode is judged by its return
    result["eval_metric"] = metric
    if args.json:
        print(json.dumps(result))
    else:
        loss = "" if result["final_loss"] is None else f" (loss {result['final_loss']:.3f})"
        print(f"built {out}: {n_params / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}, "
              f"warm start {args.warmup_steps} steps{loss}; "
              f"greedy eval {metric} {acc_random:.2f} -> {acc:.2f} in {result['seconds']} s")
        if args.warmup_steps and acc <= acc_random:
            # RL needs some reward to start from: a policy that never scores gives every group a
            # uniform reward, nothing to learn from (the run would stall and say so)
            print(f"echo-rl build-model: the warm start did not raise the greedy eval {metric}; a run from this "
                  f"model may find no reward to learn from. Try more steps (--warmup-steps {4 * args.warmup_steps}) "
                  "and --force", file=sys.stderr)
    return 0
