"""The shipped demos as a new user runs them: `make poker`'s model and `configs/poker.toml`
through the real learner and its two local workers. A default that changed under the demo
(dynamic sampling, on with GRPO since 2026-11-25) collapsed its policy by step 60, and without it
the policy collapsed by step 180 (2026-11-29), and no test noticed: this one would have."""

import pytest
from learner_runs import build_poker_model, run_learner


@pytest.mark.timeout(2700)
@pytest.mark.slow  # ~20 min: the warm start (400 supervised steps, ~6 min) and the demo's 240 updates (~13 min)
def test_the_poker_demo_holds_its_warm_start_for_its_whole_run(tmp_path):
    model = build_poker_model(tmp_path / "tiny-poker", 400, 32)
    summary, records = run_learner("configs/poker.toml", model, tmp_path / "runs", "--task.opponent_model", str(model))
    assert summary["steps"] == 240 and not summary["quarantined"]
    evals = [(r["version"], r["eval_accuracy"]) for r in records if r.get("event") == "eval"]
    # The mean greedy return over the 200 eval hands (bb/hand), every 60 updates. Collapsed, every
    # hand is played the same losing line: -0.49 -> -1.01 at v60 with dynamic sampling (twice), at
    # v180 without it; with the KL to the warm start -0.41, -0.44, -0.39, -0.45.
    assert len(evals) == 5 and all(ret > evals[0][1] - 0.25 for _, ret in evals), evals
