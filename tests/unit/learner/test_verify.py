"""The log-prob check judges every group against the version it claims: stale groups are held
to the fleet's measured drift at their staleness, so fabricated μ on an older label is caught
and an honest worker's stale groups are not."""

import pytest

from learner.config import VerifySection
from learner.verify import SPREAD_GROUPS, Verifier


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


def test_a_forger_sending_most_groups_at_a_staleness_does_not_set_its_own_drift():
    """One forger's 12 groups of μ 50 nats/token off against one honest worker's 4 groups at the
    same staleness: counted by groups (its own included) the drift was the forger's and its
    excess 0; held to the other workers' drift it is caught, and the honest worker is not."""
    v = Verifier(VerifySection(max_logprob_gap=0.5, min_gap_tokens=64))
    verdicts = []
    for _ in range(3):
        groups = [("honest", 3, 0.05 * 40, 40)] * 4 + [("forger", 3, 50.0 * 40, 40)] * 12
        verdicts += v.logprobs_checked(groups)
    assert {d.worker_id for d in verdicts} == {"forger"}


def test_a_lone_worker_at_a_staleness_is_held_to_the_fresh_bound():
    v = Verifier(VerifySection(max_logprob_gap=0.5, min_gap_tokens=64))
    verdicts = []
    for _ in range(3):
        verdicts += v.logprobs_checked([("forger", 5, 50.0 * 40, 40)] * 8)
    assert {d.worker_id for d in verdicts} == {"forger"}


def test_forgers_caught_in_a_batch_have_no_vote_on_the_others():
    """Three forgers beside one honest worker at one staleness: one vote each, the two far-off
    ones (47 and 1e30 nats/token) made the drift the modest one (4) was judged against."""
    v = Verifier(VerifySection(max_logprob_gap=0.5, min_gap_tokens=64))
    verdicts = []
    for _ in range(3):
        gaps = {"honest": 0.03, "far": 47.0, "farther": 1e30, "modest": 4.0}
        verdicts += v.logprobs_checked(batch(gaps, staleness=3))
    assert {d.worker_id for d in verdicts} == {"far", "farther", "modest"}


def test_forgers_cannot_move_the_token_drift_onto_an_honest_worker():
    """Token checks at one staleness: three honest workers whose tokens read as sampled (excess 0)
    beside a forger sending most of the groups, far above the entropy, and three more whose
    log-probs already gave them away. Pooled by groups, the forgers were the fleet's drift, the
    honest workers read as greedy (z far below 0) and were quarantined."""
    v = Verifier(VerifySection(max_token_z=8.0, min_token_checks=64, max_logprob_gap=0.5, min_gap_tokens=64))
    caught = v.logprobs_checked([(f"honest{i}", 2, 0.05 * 80, 80) for i in range(3)]
                                + [(f"liar{i}", 2, 50.0 * 80, 80) for i in range(3)])  # caught by their μ
    assert {d.worker_id for d in caught} == {"liar0", "liar1", "liar2"}
    verdicts = []
    for _ in range(4):
        groups = [(f"honest{i}", 2, 0.0, 40.0, 40.0, 0.0) for i in range(3) for _ in range(2)]
        groups += [("forger", 2, 3.0 * 40, 40.0, 40.0, 0.0)] * 12
        groups += [(f"liar{i}", 2, 3.0 * 40, 40.0, 40.0, 0.0) for i in range(3)]
        verdicts += v.tokens_checked(groups)
    assert {d.worker_id for d in verdicts} == {"forger", "liar0", "liar1", "liar2"}


def test_sybils_without_standing_have_no_vote_on_the_drift():
    """One honest worker whose checked work passed (standing) beside three new identities sending
    stale groups with μ 50 nats/token off: one vote each, the sybils were the drift (each passed
    with an excess of 0). Only workers with standing vote where one is heard: they are caught."""
    v = Verifier(VerifySection(max_logprob_gap=0.5, min_gap_tokens=64))
    for _ in range(2):  # alone at staleness 3, held to the fresh bound: 80 tokens that pass
        assert v.logprobs_checked(batch({"honest": 0.05}, staleness=3)) == []
    verdicts = []
    for _ in range(3):
        verdicts += v.logprobs_checked(batch({"honest": 0.05, "sybil0": 50.0, "sybil1": 50.0, "sybil2": 50.0}, staleness=3))
    assert {d.worker_id for d in verdicts} == {"sybil0", "sybil1", "sybil2"}


def test_sybils_without_standing_cannot_move_the_token_drift():
    """The same at the token check: three new identities whose tokens lie 3 nats/token above the
    entropy at staleness 1 set the drift, passed, and read the one honest worker with standing as
    greedy (it was quarantined). The honest worker earned its standing on fresh groups (a stale
    group nobody else's stale groups are heard beside is not judged, so earns none)."""
    v = Verifier(VerifySection(max_token_z=8.0, min_token_checks=64))
    for _ in range(2):
        assert v.tokens_checked([("honest", 0, 0.0, 40.0, 40.0, 0.0)] * 2) == []
    verdicts = []
    for _ in range(4):
        groups = [("honest", 1, 0.0, 40.0, 40.0, 0.0)] * 2
        groups += [(f"sybil{i}", 1, 3.0 * 40, 40.0, 40.0, 0.0) for i in range(3) for _ in range(2)]
        verdicts += v.tokens_checked(groups)
    assert {d.worker_id for d in verdicts} == {"sybil0", "sybil1", "sybil2"}


def fleet_batch(workers: list[str], gap: dict[int, float], shift: dict[int, float]):
    """One batch of honest work at stalenesses 1 and 2, with a real drift above the fresh bound:
    per worker and staleness, a group of 40 tokens for the log-prob check and one for the token
    check (variance 0.25 per token), each worker a little off the others."""
    gaps = [(w, k, (gap[k] + 0.01 * i) * 40, 40) for i, w in enumerate(workers) for k in gap]
    tokens = [(w, k, (shift[k] + 0.005 * i) * 40, 10.0, 40.0, 0.0) for i, w in enumerate(workers) for k in shift]
    return gaps, tokens


def test_a_fresh_honest_fleet_is_held_to_its_own_drift_until_it_has_standing():
    """Nobody has standing at the start of a run: each worker is held to the other workers' drift
    (a worker alone to the fresh bound), as before. Held to the fresh bound instead, this fleet's
    real drift (0.7 and 0.9 nats/token; tokens 0.3 and 0.5 nats above the entropy) would be
    dishonest the moment it was enough evidence to judge."""
    v = Verifier(VerifySection(max_logprob_gap=0.5, min_gap_tokens=64, max_token_z=8.0, min_token_checks=512))
    workers = ["a", "b", "c"]
    for _ in range(12):
        gaps, tokens = fleet_batch(workers, {1: 0.7, 2: 0.9}, {1: 0.3, 2: 0.5})
        assert v.logprobs_checked(gaps) == [] and v.tokens_checked(tokens) == []
    assert all(v.evidence[w].gap_tokens >= 64 and v.evidence[w].checked_tokens >= 512 for w in workers)


def test_standing_is_earned_by_stale_work_alone():
    """A fleet that never sends a fresh group earns standing all the same (judged against each
    other's drift), and then three sybils outnumbering it at a staleness are caught."""
    v = Verifier(VerifySection(max_logprob_gap=0.5, min_gap_tokens=64, max_token_z=8.0, min_token_checks=64))
    honest = ["a", "b"]
    # Tokens are recorded once a stale spread is measured (`SPREAD_GROUPS` groups), then two
    # groups (64 checked tokens) give standing.
    for _ in range(SPREAD_GROUPS + 2):
        gaps, tokens = fleet_batch(honest, {1: 0.7, 2: 0.9}, {1: 0.3, 2: 0.5})
        assert v.logprobs_checked(gaps) == [] and v.tokens_checked(tokens) == []
    verdicts, token_verdicts = [], []
    for _ in range(4):
        gaps, tokens = fleet_batch(honest, {1: 0.7, 2: 0.9}, {1: 0.3, 2: 0.5})
        sybils = [f"sybil{i}" for i in range(3)]
        verdicts += v.logprobs_checked(gaps + [(s, 2, 50.0 * 40, 40) for s in sybils])
        token_verdicts += v.tokens_checked(tokens + [(s, 2, 3.0 * 40, 10.0, 40.0, 0.0) for s in sybils])
    assert {d.worker_id for d in verdicts} == {d.worker_id for d in token_verdicts} == {"sybil0", "sybil1", "sybil2"}


def test_honest_workers_with_skewed_groups_are_held_to_the_fleets_mean_not_its_median():
    """Token checks of three honest workers alike at staleness 1: most groups sit a little under
    the fleet's per-token drift, one in eight far over it (a wrong answer with a high surprisal
    among sure right ones). A worker's z sums its groups; the drift took the median of its groups,
    below their mean, so every honest worker drifted to z > 8 and was quarantined (the demo's
    four, with dynamic sampling)."""
    v = Verifier(VerifySection(max_token_z=8.0, min_token_checks=64))
    verdicts = []
    for step in range(40):
        groups = [(f"w{i}", 1, (3.0 if (step + g) % 8 == 0 else -0.2) * 20, 10.0, 20.0, 0.0)
                  for i in range(3) for g in range(2)]
        verdicts += v.tokens_checked(groups)
    assert verdicts == [] and all(abs(v.evidence[f"w{i}"].token_z) < 3 for i in range(3)), \
        [v.evidence[f"w{i}"].token_z for i in range(3)]


def test_stale_groups_are_held_to_the_spread_the_fleet_shows_and_a_writer_is_still_caught():
    """Tokens a stale snapshot sampled vary far more than π's own variance says (the demo's, 2–5
    updates old: 50–100× per group late in the run). Held to π's variance, honest workers read as
    ±10 standard deviations off and were quarantined; held to the spread the other workers show at
    that staleness they pass, and a worker writing tokens π ranks low is still caught."""
    import random

    rng = random.Random(5)
    v = Verifier(VerifySection(max_token_z=8.0, min_token_checks=256))
    verdicts = []
    for step in range(120):
        groups = [(f"honest{i}", 3, 0.02 * 40 + rng.gauss(0.0, 8 * 0.3), 0.09, 40.0, 0.0) for i in range(4)]
        if step >= 60:  # tokens π ranks in its last quarter: u − ½ = 0.3 more per token than the fleet's
            groups.append(("writer", 3, 0.32 * 40 + rng.gauss(0.0, 8 * 0.3), 0.09, 40.0, 0.0))
        verdicts += v.tokens_checked(groups)
    assert {d.worker_id for d in verdicts} == {"writer"}, [(w, round(e.token_z, 1)) for w, e in v.evidence.items()]


def test_a_slow_new_worker_alone_at_a_high_staleness_takes_the_drift_below_it():
    """A worker activated late on a slow machine: its groups are 5 versions old, where nobody
    else was heard lately, and drift from π as everyone's of that age do (about 1 nat/token;
    the fleet measures 0.9 at staleness 4). Held to the fresh bound, it was quarantined on the
    demo; held to the nearest lower staleness's drift it passes, and one far beyond still fails.
    Votes heard long ago (the fleet's groups at staleness 5 early in the run, when the drift
    was smaller) no longer count."""
    v = Verifier(VerifySection(max_logprob_gap=0.5, min_gap_tokens=64))
    for _ in range(5):  # early: the fleet at staleness 5 with little drift
        assert v.logprobs_checked(batch({"a": 0.1, "b": 0.12, "c": 0.1}, staleness=5)) == []
    for _ in range(60):  # later: the policy moves faster, and the fleet is fast (staleness 4)
        assert v.logprobs_checked(batch({"a": 0.9, "b": 0.85, "c": 0.95}, staleness=4)) == []
    verdicts = []
    for _ in range(3):
        verdicts += v.logprobs_checked(batch({"slow": 1.0, "liar": 3.0}, staleness=5))
    assert {d.worker_id for d in verdicts} == {"liar"}


def test_a_worker_alone_at_its_staleness_is_held_to_the_largest_spread_the_fleet_shows():
    """A worker back from idling generates with an older snapshot than the fleet's (staleness 3
    where the fleet's groups are 2 and 4 versions old). Held to the spread of the staleness below
    (2: small), its honest tokens read as +9 standard deviations off on the demo; held to the
    largest spread heard (4's) it passes."""
    import random

    rng = random.Random(1)
    v = Verifier(VerifySection(max_token_z=8.0, min_token_checks=256))
    verdicts = []
    for _ in range(100):
        groups = [(f"fleet{i}", 2, 0.02 * 40 + rng.gauss(0.0, 1.5 * 0.3), 0.09, 40.0, 0.0) for i in range(4)]
        groups += [(f"fleet{i}", 4, 0.04 * 40 + rng.gauss(0.0, 8 * 0.3), 0.09, 40.0, 0.0) for i in range(4)]
        groups.append(("back", 3, 0.03 * 40 + rng.gauss(0.0, 8 * 0.3), 0.09, 40.0, 0.0))
        verdicts += v.tokens_checked(groups)
    assert verdicts == [], [(w, round(e.token_z, 1)) for w, e in v.evidence.items()]


def test_tokens_outside_the_nucleus_count_only_at_the_learners_own_version():
    """With top_p 0.9 on the demo (S = 5) an honest worker's tokens lay outside the current π's
    nucleus 0% at staleness 0 and 3-11% at 1-4: the older snapshot's nucleus is another one, and a
    flat 5% quarantined it at step 7. Only groups of the learner's own version count; there 5%
    outside still is a writer's."""
    v = Verifier(VerifySection(max_token_z=8.0, min_token_checks=64, max_outside_nucleus=0.05))
    stale = [("honest", 3, 0.0, 90 / 12, 90, 10) for _ in range(8)]  # 10% outside, at staleness 3
    assert v.tokens_checked(stale) == [] and v.evidence["honest"].outside_share == 0.0
    assert v.tokens_checked([("writer", 0, 0.0, 90 / 12, 90, 10) for _ in range(8)])[0].message.startswith(
        "10.0% of its last 800 checked tokens of the learner's own version lie outside")


def test_a_lone_honest_worker_whose_groups_are_stale_is_not_read_as_choosing_its_tokens():
    """One worker, alone in the fleet or the only one whose groups are stale: its stale tokens
    come from an older snapshot, so their ranks under π drift (here +0.05 per token at staleness
    2-5). With no other worker's stale groups to measure that drift on, it was held to the fresh
    bound: +8.2 standard deviations after 2,414 tokens on a demo run, quarantined, and training
    stopped (2026-11-28). Its stale groups are now not judged (counted as `tokens_unjudged`); its
    fresh ones are, against sampling itself, so a lone writer is still caught there."""
    import random

    rng = random.Random(3)
    for fleet in ([], ["fast"]):  # alone; beside a worker whose groups are all fresh
        v = Verifier(VerifySection(max_token_z=8.0, min_token_checks=256))
        verdicts = []
        for step in range(200):
            groups = [("lone", step % 4 + 2, 0.05 * 40 + rng.gauss(0.0, 2.0), 1.0, 40.0, 0.0)]  # stale: drift
            if step % 4 == 0:
                groups.append(("lone", 0, rng.gauss(0.0, 1.0), 1.0, 40.0, 0.0))  # fresh: sampling's own
            groups += [(w, 0, rng.gauss(0.0, 1.0), 1.0, 40.0, 0.0) for w in fleet]
            verdicts += v.tokens_checked(groups)
        assert verdicts == [], [(w, round(e.token_z, 1)) for w, e in v.evidence.items()]
        assert v.summary("lone")["tokens_unjudged"] == 200 * 40 and v.evidence["lone"].checked_tokens > 256
    writer = Verifier(VerifySection(max_token_z=8.0, min_token_checks=256))
    caught = []
    for step in range(40):  # greedy tokens: ranks well below sampling's, on its fresh groups too
        caught += writer.tokens_checked([("writer", step % 2 * 3, -0.2 * 40, 1.0, 40.0, 0.0)])
    assert {d.worker_id for d in caught} == {"writer"}


def test_a_worker_alone_at_a_lower_staleness_takes_the_drift_above_it_scaled_down():
    """Nobody else at staleness 2 or 1, the fleet at 4: the drift at 4, halved, is 2's (not the
    fresh bound, and not unjudged): an honest worker there passes, a writer of greedy tokens
    there is caught."""
    import random

    rng = random.Random(5)
    verdicts = {}
    for name, shift in (("honest", 0.05), ("writer", -0.2)):
        v = Verifier(VerifySection(max_token_z=8.0, min_token_checks=256))
        found = []
        for _ in range(100):
            groups = [(f"fleet{i}", 4, 0.1 * 40 + rng.gauss(0.0, 2.0), 1.0, 40.0, 0.0) for i in range(3)]
            groups.append((name, 2, shift * 40 + rng.gauss(0.0, 2.0), 1.0, 40.0, 0.0))
            found += v.tokens_checked(groups)
        verdicts[name] = {d.worker_id for d in found}
        # Only the batches before the fleet's stale spread was measured (`SPREAD_GROUPS` groups each).
        assert v.summary(name)["tokens_unjudged"] <= (SPREAD_GROUPS - 1) * 40
    assert verdicts == {"honest": set(), "writer": {"writer"}}


def test_stale_tokens_are_not_recorded_before_any_stale_spread_is_measured():
    """A stale snapshot's tokens vary far more than π's variance says (50× here). At the start
    of a run nobody had `SPREAD_GROUPS` groups at a stale staleness, so groups were judged with
    π's variance alone and stayed in the worker's window: an honest worker among ten read as
    −8.0 standard deviations off after 294 tokens and was quarantined (a new user's demo run,
    2026-11-28). Those groups are now not recorded until a stale spread is measured; a writer of
    greedy tokens is still caught."""
    import random

    rng = random.Random(11)

    def fleet(n):  # each worker at its own staleness 1-5 in turn, one group a batch
        return [(f"w{i}", 1 + (step + i) % 5, 0.05 * 40 + rng.gauss(0.0, 50 ** 0.5), 1.0, 40.0, 0.0) for i in range(n)]

    honest = Verifier(VerifySection(max_token_z=8.0, min_token_checks=256))
    verdicts, worst = [], 0.0
    for step in range(120):
        verdicts += honest.tokens_checked(fleet(10))
        worst = max(worst, max(abs(e.token_z) for e in honest.evidence.values()))
    assert verdicts == [] and worst < 6, (worst, [(w, round(e.token_z, 1)) for w, e in honest.evidence.items()])
    assert 0 < honest.summary("w0")["tokens_unjudged"] < 40 * 40  # the first batches only
    mixed = Verifier(VerifySection(max_token_z=8.0, min_token_checks=256))
    caught = []
    for step in range(120):
        writer = ("writer", 1 + step % 5, -2.0 * 40 + rng.gauss(0.0, 50 ** 0.5), 1.0, 40.0, 0.0)
        caught += mixed.tokens_checked(fleet(9) + [writer])
    assert {d.worker_id for d in caught} == {"writer"}


def test_a_forgotten_workers_queued_groups_make_no_evidence_again():
    """A forgotten worker's queued groups are still trained and judged: judging them made its
    evidence again (kept forever, 1.7 KB each, and counted as a voter)."""
    v = Verifier(VerifySection())
    v.logprobs_checked(batch({"a": 0.9, "gone": 0.85}, staleness=1))
    assert set(v.evidence) == {"a", "gone"}
    v.forget("gone")
    for _ in range(3):
        v.logprobs_checked(batch({"a": 0.9, "gone": 0.85}, staleness=1))
        v.tokens_checked([("gone", 1, 0.0, 1.0, 10.0, 0.0), ("a", 1, 0.0, 1.0, 10.0, 0.0)])
        v.rewards_checked("gone", [False])
    assert set(v.evidence) == {"a"}


def test_the_drift_holds_a_bounded_number_of_stalenesses():
    """With the staleness filter off a group's staleness runs up to the version: every distinct
    one was a drift window kept for good, and 10,000 made one lookup take 375 ms."""
    import time

    from learner.verify import DRIFT_AGE, MAX_DRIFT_STALENESS, Drift

    d = Drift()
    for s in range(1, 10_000):
        d.add(s, 0.5 * 40, 40, f"w{s % 7}")
    assert len(d._recent) == MAX_DRIFT_STALENESS
    started = time.perf_counter()
    assert d.at(9_000, "w1") == 0.5
    d.spread(9_000, "w1")
    assert time.perf_counter() - started < 0.05
    for _ in range(DRIFT_AGE + 1):
        d.next_batch()
    d.add(3, 0.5 * 40, 40, "w1")
    d.next_batch()
    assert list(d._recent) == [3]  # stalenesses unheard for DRIFT_AGE batches are dropped


def test_a_forger_with_a_long_honest_history_is_caught_within_a_window():
    """A tester's worker with ~4,000 honest groups then sent μ 3 nats a token off: judged on its
    whole history, 1,532 forged groups were trained before the mean crossed the bound."""
    from learner.verify import WINDOW

    v = Verifier(VerifySection(max_logprob_gap=0.5, min_gap_tokens=64))
    for _ in range(400):  # honest history: 10 batches' worth per call, the others alike
        assert v.logprobs_checked(batch({"a": 0.1, "b": 0.12, "c": 0.1, "forger": 0.11}, staleness=1)) == []
    forged = 0
    while not (verdicts := v.logprobs_checked(batch({"a": 0.1, "b": 0.12, "c": 0.1, "forger": 3.0}, staleness=1))):
        forged += 1
    assert [x.worker_id for x in verdicts] == ["forger"] and forged < WINDOW // 4, forged
    assert "on its last" in verdicts[0].message


def test_a_relays_upload_is_believed_as_its_children_see_it_now_and_raised_only_by_two():
    """Each child's latest report counts, not the best of the last 16: a relay that forwarded
    fast and then slowly (just under fallback_s) kept its fast claims believed for 8 versions.
    One child lowers the cap; raising it above the prior takes two."""
    v = Verifier(VerifySection(capacity_claim_factor=2.0))
    prior = 125e6  # 1,000 Mbit/s: an unknown link
    assert v.believed_upload("r", 1e10, prior, 0) == prior  # its word alone
    for _ in range(8):
        v.upload_seen("r", 50e6, "c1", 0)
    assert v.believed_upload("r", 1e10, prior, 0) == 100e6
    v.upload_seen("r", 15e3, "c1", 0)  # now it forwards at 15 kB/s
    assert v.believed_upload("r", 1e10, prior, 0) == 30e3
    v.upload_seen("r", 1e10, "sybil", 0)  # one child's word lifts nothing: c1 and it vouch for c1's
    assert v.believed_upload("r", 1e10, prior, 0) == 30e3
    v.upload_seen("r", 400e6, "c2", 0)  # the second fastest of the children's latest
    assert v.believed_upload("r", 1e10, prior, 0) == 800e6
    v = Verifier(VerifySection(capacity_claim_factor=2.0))
    v.upload_seen("r", 1e10, "sybil", 0)
    assert v.believed_upload("r", 1e10, prior, 0) == prior  # above the prior, one child is not enough


def test_honest_workers_are_not_liars_where_the_drift_is_large_and_scattered_and_a_forger_still_is():
    """A tester's three honest workers were all quarantined at 0.50–0.54 nats/token, 75 minutes
    into a run whose policy moved 1–4 nats a token per update: each group's excess over the
    fleet's drift was floored at 0, so a worker's mean was half the groups' scatter, whatever its
    honesty. Here the drift at staleness k grows to k nats/token, each batch's by a factor of
    e^N(0, 0.6), each group's tokens as skewed as a sharp policy's (most unmoved, a quarter far):
    on the old code the honest workers were quarantined at ~70% of the climb (eight seeds). A
    worker adding 1 nat/token to its μ late in the run is still caught within a window."""
    import random

    from learner.verify import WINDOW

    rng = random.Random(1)
    v = Verifier(VerifySection(max_logprob_gap=0.5, min_gap_tokens=512))

    def group_gap() -> float:  # one group's per-token |log π − log μ| over its 16 samples, in drift units
        return sum(0.0 if rng.random() < 0.75 else 4.0 * rng.expovariate(1.0) for _ in range(16)) / 16

    caught = {}
    for step in range(1000):
        k = step % 4
        drift = k * min(1.0, 0.02 + step / 1000) * rng.lognormvariate(0, 0.6)
        groups = [(w, k, (drift * group_gap() + (1.0 if w == "forger" and step >= 700 else 0.0)) * 40, 40)
                  for w in ("h1", "h2", "h3", "forger") for _ in range(2)]
        for verdict in v.logprobs_checked(groups):
            caught.setdefault(verdict.worker_id, step)
    assert set(caught) == {"forger"}, (caught, {w: e.mean_gap for w, e in v.evidence.items()})
    assert (caught["forger"] - 700) * 2 < WINDOW, caught
    assert all(v.evidence[w].mean_gap < 0.4 for w in ("h1", "h2", "h3"))


def test_two_childrens_vouch_lifts_a_relay_only_while_they_keep_seeing_it():
    """Two sybils' vouches, never followed by newer reports, kept a liar at twice the prior for
    good: the head of every single chain behind a 1,000 Mbit/s uplink (a tester, 2026-11-28).
    A lift above the prior lasts `VOUCH_VERSIONS` published versions; what lowers the cap stays."""
    from learner.verify import VOUCH_VERSIONS

    v = Verifier(VerifySection(capacity_claim_factor=2.0))
    prior = 125e6
    v.upload_seen("liar", prior, "sybil1", 10)
    v.upload_seen("liar", prior, "sybil2", 10)
    assert v.believed_upload("liar", 1e10, prior, 10 + VOUCH_VERSIONS - 1) == 2 * prior
    assert v.believed_upload("liar", 1e10, prior, 10 + VOUCH_VERSIONS) == prior
    v.upload_seen("liar", prior, "sybil1", 30)  # one of them again: one child lifts nothing
    assert v.believed_upload("liar", 1e10, prior, 30) == prior
    v.upload_seen("slow", 15e3, "c1", 0)
    assert v.believed_upload("slow", 1e10, prior, 1000) == 30e3


def test_a_fast_worker_is_not_read_as_choosing_its_tokens_by_a_slow_voters_noise():
    """S = 1, publish every step, workers 50× apart in speed (the lease-flow test's fleet): the
    fastest worker's 64-group window held to the drift of one slow voter with a few tokens at
    the learner's own version. Both sample honestly (u − ½ uniform: mean 0, variance 1/12), yet
    the voter's noise, multiplied by the fastest worker's tokens, read as −14.8 standard
    deviations in a live run, and it was quarantined twice on 2026-11-29. The drift's error is
    counted now, and a fresh level within it is 0. A fast greedy worker beside the same voter
    is still caught."""
    import random

    rng = random.Random(1)

    def group(tokens: int, shift: float = 0.0) -> tuple[float, float, float, float]:
        return sum(rng.random() - 0.5 + shift for _ in range(tokens)), tokens / 12, float(tokens), 0.0

    for liar in ("", "greedy"):
        v = Verifier(VerifySection(max_token_z=8.0, min_token_checks=256))
        verdicts, worst = [], 0.0
        for b in range(3_000):
            groups = [("fast", 0, *group(8, -0.2 if liar else 0.0))]
            if b % 20 == 0:  # one group of 8 tokens every 20 steps, from the slow worker
                groups.append(("slow", 0, *group(8)))
            verdicts += v.tokens_checked(groups)
            worst = max(worst, abs(v.evidence["fast"].token_z))
            if verdicts:
                break
        if liar:
            assert [d.worker_id for d in verdicts] == ["fast"] and verdicts[0].reason == "tokens"
        else:
            assert verdicts == [] and worst < 5.0, worst  # (it was quarantined at step 719)


@pytest.mark.parametrize("sybil_gap", [pytest.param(1e-7, id="genuine-mu"), pytest.param(0.3, id="misreported-mu")])
def test_sybils_with_standing_cannot_vote_a_fresh_level_numerics_cannot_make(sybil_gap):
    """One honest worker and three identities with standing that, past their standing, sent tokens
    less likely than sampling gives (a group's rarest completion copied), with genuine μ (a fresh
    gap of ~1e-7): as the majority they voted the level at the learner's own version, passed, and
    read the honest worker as choosing its tokens (−6.2; a tester, 2026-11-29). A worker's level
    there is bounded by numerics (√(gap / 2)): the sybils are caught, the honest one is not. And a
    worker chooses the μ it reports: sybils adding 0.3 nats/token of noise to theirs (under the
    0.5 allowed) widened their own bound to √(0.3/2) ≈ 0.39, voted the level to their shift, and
    passed, until a worker's gap was capped by the least among workers whose log-probs have
    standing (one honest worker's 1e-7 holds them)."""
    import random

    rng = random.Random(3)
    workers = ["honest", "s1", "s2", "s3"]

    def group(shift: float) -> tuple[float, float, float, float]:
        return sum(rng.random() - 0.5 + shift for _ in range(16)), 16 / 12, 16.0, 0.0

    v = Verifier(VerifySection(max_token_z=8.0, min_token_checks=256, max_logprob_gap=0.5, min_gap_tokens=64))
    verdicts = []
    for b in range(600):
        forging = b >= 100  # after their standing is earned
        gaps = [(w, 0, (1e-7 if w == "honest" else sybil_gap) * 16, 16) for w in workers]
        assert v.logprobs_checked(gaps) == []  # both pass the log-prob check
        verdicts += v.tokens_checked([(w, 0, *group(0.15 if forging and w != "honest" else 0.0)) for w in workers])
        if {d.worker_id for d in verdicts} >= {"s1", "s2", "s3"}:
            break
        assert abs(v.evidence["honest"].token_z) < 5.0, (b, v.evidence["honest"].token_z)
    assert {d.worker_id for d in verdicts} == {"s1", "s2", "s3"}, [(d.worker_id, d.message) for d in verdicts]
    assert b < 200, b  # within 100 batches of their switch
