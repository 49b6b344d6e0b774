"""`echo-rl eval poker MODEL_OR_RUN ...`: ECHO-2's Table 4, on this machine.

Rows are the policies given (Hugging Face model directories, or run directories, whose
exported `model/` is used), columns the opponents: the three rule-based styles and the frozen
LLM opponent. A cell is the policy's mean chips per hand in big blinds with a 95% interval over
**duplicate deals**: every deal is played from both seats with the same cards, and the pair's
mean is one observation, so the luck of the cards cancels and the interval is over deals. Play
is greedy, through the same episode code the workers run (`echo.episodes`).

    echo-rl eval poker models/tiny-poker runs/poker-*/ --hands 400
    echo-rl eval poker models/tiny-poker --opponent-model models/tiny-poker --json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

RULE_BASED = ("station", "tag", "lag")


def policy_dir(path: str) -> Path:
    """A model directory, or a run directory's exported model."""
    p = Path(path)
    if (p / "config.json").exists():
        return p
    if (p / "model" / "config.json").exists():
        return p / "model"
    raise SystemExit(f"echo-rl eval: {path} is neither a Hugging Face model directory nor a run directory "
                     "with an exported model/ (a run exports it when it ends)")


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% interval (normal approximation)."""
    mean = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("inf")
    return mean, half


def play(model_dir: Path, cfg, opponent: str, opponent_model: str, hands: int) -> dict:
    """The policy at `model_dir` against `opponent` over `hands` eval hands (hands/2 duplicate deals)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo.chat import stop_ids
    from echo.episodes import Episodes
    from echo.tasks import load_task

    options = {**cfg.task.options, "opponents": [opponent], "opponent_model": opponent_model,
               "eval_size": hands}
    task = load_task("poker", options)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    r = cfg.rollout
    episodes = Episodes.of(task, tok, chat_template=cfg.task.chat_template, system_prompt=cfg.task.system_prompt,
                           template_kwargs=cfg.task.chat_template_kwargs,
                           stop_ids=stop_ids(tok, model_dir, task.stop_tokens), max_new_tokens=r.max_new_tokens,
                           max_tokens=r.episode_tokens(task), max_turns=r.turns(task))
    prompts = task.eval_prompts()
    t0 = time.perf_counter()
    returns = episodes.greedy_returns(model, prompts, tok.pad_token_id if tok.pad_token_id is not None else 0)
    deals = [(a + b) / 2 for a, b in zip(returns[0::2], returns[1::2])]
    mean, half = interval(deals)
    return {"mean_bb": mean, "ci95_bb": half, "deals": len(deals), "seconds": round(time.perf_counter() - t0, 1)}


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="echo-rl eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=["poker"], help="what to evaluate (poker: App. D's table)")
    parser.add_argument("policies", nargs="+", help="model directories or run directories (rows)")
    parser.add_argument("--config", default="configs/poker.toml",
                        help="the run config whose [task] and [rollout] the hands use (default configs/poker.toml)")
    parser.add_argument("--hands", type=int, default=400, help="hands per cell: half as many duplicate deals (default 400)")
    parser.add_argument("--opponent-model", default="",
                        help="the frozen LLM opponent (default: the config's task.opponent_model, else the first policy)")
    parser.add_argument("--opponents", default="station,tag,lag,llm", help="columns (default: all four)")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args(argv)
    if args.hands < 4 or args.hands % 2:
        parser.error("--hands must be an even number of at least 4 (each deal is played from both seats)")

    from echo.config import ConfigError
    from learner.config import load_learner_config

    try:
        cfg = load_learner_config(args.config, [])
    except ConfigError as e:
        print(f"echo-rl eval: {e}", file=sys.stderr)
        return 2
    if cfg.task.name != "poker":
        parser.error(f"{args.config} trains task {cfg.task.name!r}; give a poker config (--config configs/poker.toml)")
    dirs = [policy_dir(p) for p in args.policies]
    opponent_model = args.opponent_model or cfg.task.options.get("opponent_model") or str(dirs[0])
    columns = [c for c in args.opponents.split(",") if c]
    unknown = set(columns) - {*RULE_BASED, "llm"}
    if unknown:
        parser.error(f"unknown opponents {sorted(unknown)}; use some of station, tag, lag, llm")
    rows = []
    from rich.progress import Progress

    with Progress(transient=True, disable=args.json) as bar:
        job = bar.add_task("hands", total=len(dirs) * len(columns))
        for name, d in zip(args.policies, dirs):
            row = {"policy": name, "model": str(d)}
            for col in columns:
                bar.update(job, description=f"{name} vs {col}")
                row[col] = play(d, cfg, col, opponent_model if col == "llm" else "", args.hands)
                bar.advance(job)
            rows.append(row)
    result = {"hands": args.hands, "deals": args.hands // 2, "opponent_model": opponent_model, "config": str(args.config),
              "hints": bool(cfg.task.options.get("hints")), "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"mean big blinds per hand, ± 95% interval over {args.hands // 2} duplicate deals "
          f"(each from both seats); LLM opponent: {opponent_model}")
    width = max(len(r["policy"]) for r in rows)
    print(f"{'policy':<{width}} " + " ".join(f"{c:>16}" for c in columns))
    for r in rows:
        print(f"{r['policy']:<{width}} " + " ".join(f"{r[c]['mean_bb']:>+8.2f} ± {r[c]['ci95_bb']:<5.2f}" for c in columns))
    return 0
