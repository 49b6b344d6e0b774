"""The log-prob check judges every group against the version it claims: stale groups are held
to the fleet's measured drift at their staleness, so fabricated μ on an older label is caught
and an honest worker's stale groups are not."""

from learner.config import VerifySection
from learner.verify import Verifier


def batch(worker_gaps: dict[str, float], staleness: int, tokens: int = 40) -> list[tuple[str, int, float, int]]:
    return [(w, staleness, gap * tokens, tokens) for w, gap in worker_gaps.items()]


def test_honest_stale_groups_are_held_to_the_fleets_drift():
    v = Verifier(VerifySection(max_logprob_gap=0.5, min_gap_tokens=64))
    for _ in range(5):  # three honest workers: 0.9 nats of drift at staleness 3, above the fresh bound
        assert v.logprobs_checked(batch({"a": 0.9, "b": 0.85, "c": 0.95}, staleness=3)) == []
        assert v.logprobs_checked(batch({"a": 0.01, "b": 0.02, "c": 0.01}, staleness=0)) == []


def test_fabricated_logprobs_on_an_older_label_are_caught():
    v = Verifier(VerifySection(max_logprob_gap=0.5, min_gap_tokens=64))
    verdicts = []
    for _ in range(5):
        verdicts += v.logprobs_checked(batch({"a": 0.9, "b": 0.85, "c": 0.95, "liar": 3.0}, staleness=3))
    assert {d.worker_id for d in verdicts} == {"liar"} and verdicts[0].reason == "logprobs"
    assert "beyond the fleet's drift" in verdicts[0].message


def test_fresh_groups_keep_the_absolute_bound():
    v = Verifier(VerifySection(max_logprob_gap=0.5, min_gap_tokens=64))
    verdicts = []
    for _ in range(3):
        verdicts += v.logprobs_checked(batch({"a": 0.01, "liar": 0.8}, staleness=0))
    assert {d.worker_id for d in verdicts} == {"liar"}
