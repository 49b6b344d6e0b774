"""Whole runs as a user starts them, for the tests that need one: `echo-rl build-model` and
`echo-learner` as processes, and what a finished run leaves in its directory."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def build_poker_model(out: Path, warmup_steps: int, warmup_batch: int, timeout: int = 1200) -> Path:
    """The poker demo's model (`make poker` builds it with 400 steps of 32), warm-started here."""
    build = subprocess.run([BIN / "echo-rl", "build-model", "--config", "configs/poker.toml", "--out", str(out),
                            "--warmup-steps", str(warmup_steps), "--warmup-batch", str(warmup_batch)],
                           cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert build.returncode == 0, build.stderr[-3000:]
    return out


def run_learner(config: str, model: Path, run_dir: Path, *overrides: str, timeout: int = 1200) -> tuple[dict, list[dict]]:
    """Run `echo-learner` to its end; its summary and its run log's records."""
    run = subprocess.run([BIN / "echo-learner", "--config", config, "--model.path", str(model),
                          "--run.dir", str(run_dir), *overrides],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads(next(run_dir.glob("*/summary.json")).read_text())
    records = [json.loads(line) for line in next(run_dir.glob("*/metrics.jsonl")).read_text().splitlines()]
    return summary, records
