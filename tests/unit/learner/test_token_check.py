"""Chosen tokens with honest log-probs pass the μ check; the learner's token check catches them.

A worker holding the weights can write what it likes — greedy completions, a phrase the policy
would rarely say (the poisoning of "Hail to the Thief") — and report π for it exactly. A sampled
token's mid-rank under π has mean ½ and a known variance, so the learner scores where checked
groups' tokens rank under the policy (`echo.hf.rank_terms`,
`Trainer._check_tokens`, `Verifier.tokens_checked`)."""

import pytest
import torch

from echo.hf import RANK_VARIANCE_FLOOR, TokenBatch, processed_logits, rank_terms, sample
from learner.buffer import BatchInfo, Group
from learner.config import load_learner_config
from learner.train.trainer import Trainer
from learner.verify import Verifier

T, TOP_P = 0.7, 0.9


def _trainer(model, *overrides, temperature=T, top_p=TOP_P):
    return Trainer(load_learner_config(None, [
        "--model.path", str(model), "--rollout.group_size", "4", "--trainer.batch_prompts", "8",
        "--rollout.temperature", str(temperature), "--rollout.top_p", str(top_p),
        "--verify.token_check_fraction", "1.0", *overrides]))


def test_rank_terms_are_the_mid_rank_and_its_variance_under_the_sampled_distribution(tiny_model):
    trainer = _trainer(tiny_model)
    tok = trainer.tokenizer
    prompt, completion = trainer.episodes.chat("3+4="), tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    batch = TokenBatch.build([prompt], [completion], tok.pad_token_id, torch.device("cpu"))
    terms = rank_terms(trainer.hf, batch, temperature=T, top_p=TOP_P)
    with torch.no_grad():  # the whole distribution, position by position
        logits = trainer.hf(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1]
        p = processed_logits(logits, T, TOP_P).softmax(-1).double()
    for row, token in enumerate(completion):
        own = p[row, token]
        assert terms[row, 0] == pytest.approx(float(p[row][p[row] > own].sum() + own / 2 - 0.5), abs=1e-5)
        exact = float((1 - p[row].pow(3).sum()) / 12)
        assert terms[row, 1] == pytest.approx(max(exact, RANK_VARIANCE_FLOOR), abs=1e-6)
        assert terms[row, 2] == float(own > 0)
        assert terms[row, 3] == pytest.approx(float(own.log()), abs=1e-4)  # log π: the μ check's, from the same pass
        # Sampled from π, the mid-rank has mean ½ and that variance exactly (each candidate's u, weighted by π).
        u = torch.stack([p[row][p[row] > q].sum() + q / 2 for q in p[row]])
        assert float((p[row] * u).sum()) == pytest.approx(0.5, abs=1e-6)
        assert float((p[row] * (u - 0.5) ** 2).sum()) == pytest.approx(exact, abs=1e-6)


def _groups(trainer, how: str, seed: int = 3) -> list[Group]:
    """8 groups of 4, the tokens sampled from π (`sampled`), its argmax (`greedy`), or the least
    likely token inside the nucleus at each position (`poisoned`); μ = π for them either way."""
    tok = trainer.tokenizer
    T, TOP_P = trainer.cfg.rollout.temperature, trainer.cfg.rollout.top_p
    prompts = [trainer.episodes.chat(f"{a}+{b}=") for a, b in ((3, 4), (5, 5), (1, 8), (9, 2), (2, 2), (6, 1), (4, 4), (7, 2))]
    torch.manual_seed(seed)
    outs = sample(trainer.hf, [p for p in prompts for _ in range(4)], max_new_tokens=12, stop_ids=tok.eos_token_id,
                  pad_id=tok.pad_token_id, temperature=0.0 if how == "greedy" else T, top_p=TOP_P)
    completions = [o.tokens for o in outs]
    if how == "poisoned":
        completions = []
        for p in prompts:
            for _ in range(4):
                ids = []
                with torch.no_grad():
                    for _ in range(12):
                        logits = trainer.hf(input_ids=torch.tensor([p + ids])).logits[0, -1]
                        logp = processed_logits(logits, T, TOP_P)
                        logp = logp.masked_fill(~torch.isfinite(logp), float("inf"))
                        ids.append(int(logp.argmin()))  # inside the nucleus, the rarest
                completions.append(ids)
    with torch.no_grad():
        from echo.hf import completion_logprobs
        logp, _ = completion_logprobs(trainer.hf, [p for p in prompts for _ in range(4)], completions,
                                      pad_id=tok.pad_token_id, temperature=T, top_p=TOP_P)
    mu = [logp[i, : len(c)].tolist() for i, c in enumerate(completions)]  # honest μ for whatever was written
    return [Group(f"p{g}", 0, prompts[g], completions[4 * g: 4 * g + 4], mu[4 * g: 4 * g + 4], [1.0, 0.0, 0.0, 1.0],
                  worker_id=how) for g in range(8)]


def _check(trainer, verifier, how: str) -> list:
    groups = _groups(trainer, how)
    stats = trainer.step(BatchInfo(groups, learner_version=trainer.version, staleness=[0] * len(groups)))
    assert abs(stats["mismatch_kl"]) < 1e-5  # μ is π whatever the tokens: the log-prob check sees nothing
    return verifier.tokens_checked([(g.worker_id, 0, *t) for g, t in zip(groups, stats["group_tokens"])])


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (1.0, 1.0)])
def test_sampled_tokens_pass_and_poisoned_ones_are_caught_whatever_their_mu(tiny_model, temperature, top_p):
    """The fleet (whose median sets what fresh tokens look like) samples honestly; one worker
    writes, at every position, the least likely token inside π's nucleus."""
    trainer = _trainer(tiny_model, temperature=temperature, top_p=top_p)
    cfg = trainer.cfg.verify
    verifier = Verifier(cfg.model_copy(update={"min_token_checks": 64}))
    assert not _check(trainer, verifier, "sampled") + _check(trainer, verifier, "sampled")
    assert abs(verifier.evidence["sampled"].token_z) < 4
    verdicts = _check(trainer, verifier, "poisoned")
    assert verifier.evidence["poisoned"].token_z > cfg.max_token_z and "less likely" in verdicts[0].message


def test_greedy_tokens_are_caught_where_the_policy_has_entropy(tiny_model):
    """Greedy in place of sampling: likelier tokens than sampling gives, by as much as the policy
    is uncertain (at temperature 0.7 and top-p 0.9 this model is nearly certain, and greedy is
    nearly sampling; at temperature 1, three batches of it, 192 tokens, are caught)."""
    trainer = _trainer(tiny_model, temperature=1.0, top_p=1.0)
    verifier = Verifier(trainer.cfg.verify.model_copy(update={"min_token_checks": 128}))
    for _ in range(4):  # an honest majority in the fleet's recent groups
        assert not _check(trainer, verifier, "sampled")
    verdicts = [v for _ in range(3) for v in _check(trainer, verifier, "greedy")]
    assert verifier.evidence["greedy"].token_z < -trainer.cfg.verify.max_token_z, verifier.evidence["greedy"].token_z
    assert verdicts and "likelier than sampling" in verdicts[0].message
    assert abs(verifier.evidence["sampled"].token_z) < 4


def test_tokens_outside_the_nucleus_are_caught_and_nothing_is_checked_at_fraction_zero(tiny_model):
    """Sampling at top-p never gives a token outside the nucleus; a writer does (its μ for it is
    whatever it says: the log-prob check counts such tokens apart, it does not judge them)."""
    trainer = _trainer(tiny_model)
    prompt = trainer.episodes.chat("3+4=")
    with torch.no_grad():
        rarest = int(trainer.hf(input_ids=torch.tensor([prompt])).logits[0, -1].argmin())
    groups = [Group("p0", 0, prompt, [[rarest] * 8] * 4, [[-1.0] * 8] * 4, [1.0, 0, 0, 1.0], worker_id="x")]
    terms = trainer.step(BatchInfo(groups, learner_version=trainer.version, staleness=[0]))["group_tokens"][0]
    assert terms[3] >= 4  # at least the first token of each sample lies outside
    verdicts = Verifier(trainer.cfg.verify.model_copy(update={"min_token_checks": 16})).tokens_checked([("x", 0, *terms)])
    assert verdicts and "outside the policy's top-p nucleus" in verdicts[0].message
    off = _trainer(tiny_model, "--verify.token_check_fraction", "0")
    assert off.step(BatchInfo(groups, learner_version=0, staleness=[0]))["group_tokens"] == [[0.0] * 6]


def test_the_check_draws_from_the_groups_dynamic_sampling_skipped_too(tiny_model):
    """The groups checked are drawn from everything accepted since the previous batch, skipped
    groups included: drawn from the trained ones alone they were chosen for their rewards (a
    wrong answer beside right ones), and honest workers' tokens read as too unlikely (the demo's
    four workers were quarantined at z = +8). Here a batch of 8 sampled groups and 10,000 skipped
    ones (a sample of 8 kept): nearly every draw is a skipped group, and its writer is caught."""
    trainer = _trainer(tiny_model)
    trained, skipped = _groups(trainer, "sampled"), _groups(trainer, "poisoned")
    stats = trainer.step(BatchInfo(trained, learner_version=trainer.version, staleness=[0] * 8, uses=[1] * 8,
                                   skipped=10_000, skipped_sample=skipped))
    drawn = stats["skipped_tokens"]
    assert len(drawn) >= 7 and all(terms[2] > 0 for _, terms in drawn)
    assert sum(t[2] + t[3] > 0 for t in stats["group_tokens"]) == 8 - len(drawn)  # 8 draws in all (fraction 1)
    verifier = Verifier(trainer.cfg.verify.model_copy(update={"min_token_checks": 64}))
    verdicts = verifier.tokens_checked([(skipped[j].worker_id, 0, *terms) for j, terms in drawn])
    assert [v.worker_id for v in verdicts] == ["poisoned"]
    # No dynamic sampling (nothing skipped): the draw is the batch's fresh groups, replays not again.
    stats = trainer.step(BatchInfo(trained, learner_version=trainer.version, staleness=[0] * 8, uses=[1] * 4 + [2] * 4))
    assert stats["skipped_tokens"] == [] and [t[2] > 0 for t in stats["group_tokens"]] == [True] * 4 + [False] * 4


def test_repeats_are_what_independent_sampling_gives_and_copies_are_caught():
    """`Trainer._copies`: taken in a random order, a sample repeats an earlier one with probability
    Σ π(c) over the distinct completions before it, so Σ(repeat − q) / √Σ q(1 − q) is a standard
    normal over many groups of samples drawn from π; a tester's copies of each group's most
    common and rarest completions, balanced to leave the ranks' mean where sampling puts it,
    passed the rank test (2026-11-29) and repeat far more often; samples chosen to differ repeat
    less often than sampling gives (a tester's distinct picks read −9.0, 2026-11-29)."""
    import math
    import random

    from learner.train.trainer import _copies, _Samples

    rng = random.Random(0)
    probs = {(1,): 0.5, (2,): 0.3, (3, 4): 0.15, (5, 6, 7): 0.05}
    completions, weights = list(probs), list(probs.values())

    def z(groups: list[list[tuple]]) -> float:
        batch = BatchInfo([Group(f"p{g}", 0, [0], [list(c) for c in group], [[0.0] * len(c) for c in group],
                                 [0.0] * len(group)) for g, group in enumerate(groups)], 0)
        samples = _Samples.of(batch, None)
        seq = [math.log(probs[tuple(c)]) for c in samples.completions]
        terms = [_copies(samples, seq, [i for i, o in enumerate(samples.owner) if o == g], rng) for g in range(len(groups))]
        return sum(t[0] for t in terms) / math.sqrt(1.0 + sum(t[1] for t in terms))

    honest = [z([rng.choices(completions, weights, k=16) for _ in range(64)]) for _ in range(20)]
    assert max(map(abs, honest)) < 4.0 and abs(sum(honest) / len(honest)) < 0.6, honest

    def balanced() -> list[tuple]:  # 60% the most common, 10% the rarest, the rest sampled
        return [completions[0] if r < 0.6 else completions[3] if r < 0.7 else rng.choices(completions, weights)[0]
                for r in (rng.random() for _ in range(16))]

    assert z([balanced() for _ in range(64)]) > 8.0
    # Chosen to differ (of many samples, each completion once): fewer repeats than sampling gives.
    assert z([list(completions) for _ in range(64)]) < -8.0
    # Multi-turn episodes (the environment's tokens under a 0 mask) are left out: π does not give their probability.
    batch = BatchInfo([Group("p", 0, [0], [[1, 9]] * 4, [[0.0, 0.0]] * 4, [0.0] * 4, masks=[[1, 0]] * 4)], 0)
    assert _copies(_Samples.of(batch, None), [0.0] * 4, [0, 1, 2, 3], rng) == [0.0, 0.0]


def test_a_worker_copying_its_samples_is_caught_by_their_repeats(tiny_model):
    """Each group's four samples one sampled completion four times, its μ honest: the ranks'
    mean is sampling's, but eight groups of four alike do not come out of π."""
    trainer = _trainer(tiny_model)
    groups = _groups(trainer, "sampled")
    for g in groups:
        g.completions, g.behaviour_logprobs = [g.completions[0]] * 4, [g.behaviour_logprobs[0]] * 4
    stats = trainer.step(BatchInfo(groups, learner_version=trainer.version, staleness=[0] * len(groups)))
    verifier = Verifier(trainer.cfg.verify.model_copy(update={"min_token_checks": 64}))
    verdicts = verifier.tokens_checked([("copier", 0, *t) for t in stats["group_tokens"]])
    assert verdicts and "not drawn independently" in verdicts[0].message, verifier.evidence["copier"].copy_z
    honest = _trainer(tiny_model)
    stats = honest.step(BatchInfo(_groups(honest, "sampled"), learner_version=0, staleness=[0] * 8))
    terms = stats["group_tokens"]
    assert abs(sum(t[4] for t in terms)) / (1.0 + sum(t[5] for t in terms)) ** 0.5 < 3.0  # sampled: repeats as π gives


def test_samples_chosen_to_differ_are_caught_by_their_repeats_too():
    """The repeat test is two-sided: a worker that keeps, of many samples, those unlike the
    others (more signal per group) repeats less often than sampling gives. A tester's distinct
    picks read −9.0 and passed it, caught by the rank test only because its picks were rare ones."""
    verify = load_learner_config(None, []).verify.model_copy(update={"min_token_checks": 64})
    # Ranks as sampling gives (Σ(u − ½) = 0), each group's samples repeating one another twice
    # less often than π's probabilities say they should.
    rows = [("chooser", 0, 0.0, 16 / 12, 16.0, 0.0, -2.0, 1.0)] * 64
    verdicts = Verifier(verify).tokens_checked(rows)
    assert verdicts and "less often" in verdicts[0].message and "chosen to differ" in verdicts[0].message
    assert not Verifier(verify).tokens_checked([("honest", 0, 0.0, 16 / 12, 16.0, 0.0, -0.1, 1.0)] * 64)


def test_a_phrase_written_into_a_few_samples_is_caught_by_its_improbable_repeats(tiny_model):
    """An API-only tester (2026-12-07) put a phrase into one sample of a group now and then, in
    turns whose reward it did not change, with μ that passed: the ranks' mean and the log-prob gap
    average it away among honest tokens, so it was trained in. Sampling never writes the same
    improbable run of tokens three times (`learner.verify.Repeats`); the writer is caught, and
    honest samples, however many, are not."""
    import dataclasses

    from echo.hf import completion_logprobs
    from learner.verify import REPEATS

    # every fresh trained group gives its windows from the update's own pass, drawn by the token check
    # or not: drawn (a quarter), the phrase's log-prob rose past the bound before it was seen thrice
    trainer = _trainer(tiny_model, "--verify.repeat_nats", "20", "--verify.token_check_fraction", "0",
                       temperature=1.0, top_p=1.0)
    verifier = Verifier(trainer.cfg.verify)
    tok = trainer.tokenizer
    def sampled() -> list[Group]:  # sampled by the version the trainer holds now, afresh each time
        return [dataclasses.replace(g, version=trainer.version) for g in _groups(trainer, "sampled", seed=trainer.version)]

    for _ in range(3):  # honest groups alone: 32 samples a step, none of their improbable runs seen thrice
        groups = sampled()
        stats = trainer.step(BatchInfo(groups, learner_version=trainer.version, staleness=[0] * len(groups)))
        assert not verifier.repeats.checked([(groups[g].worker_id, key) for _, g, key in stats["improbable"]])
    groups = sampled()
    with torch.no_grad():  # the phrase: the rarest token after each prompt, eight times over
        rarest = int(trainer.hf(input_ids=torch.tensor([groups[0].prompt_ids])).logits[0, -1].argmin())
    phrase = [rarest] * 8 + [tok.eos_token_id]
    for g in (1, 4):  # one sample in each of two groups, and the same in the next step's group
        group = groups[g]
        logp, _ = completion_logprobs(trainer.hf, [group.prompt_ids], [phrase], pad_id=tok.pad_token_id,
                                      temperature=1.0, top_p=1.0)
        assert float(logp[0, :8].sum()) < -20  # improbable to π, whatever μ the writer sends
        groups[g] = Group(group.prompt_id, group.version, group.prompt_ids, [phrase, *group.completions[1:]],
                          [logp[0, : len(phrase)].tolist(), *group.behaviour_logprobs[1:]], group.rewards,
                          worker_id="writer")
    stats = trainer.step(BatchInfo(groups, learner_version=trainer.version, staleness=[0] * len(groups)))
    found = [(groups[g].worker_id, key) for _, g, key in stats["improbable"]]
    assert sum(w == "writer" for w, _ in found) >= 2
    verdicts = verifier.repeats.checked(found)
    assert REPEATS == 3 and not verdicts  # twice: sampling might, once in a long while
    third = [(w, key) for w, key in found if w == "writer"][:1]
    verdicts = verifier.repeats.checked(third)
    assert [v.worker_id for v in verdicts] == ["writer"] and "improbable run of tokens" in verdicts[0].message
    assert not verdicts[0].certain  # a statistical finding: the worker's address is not banned for it
    # A replayed group's windows were counted at its first use: with reuse = 3 one honest sample's
    # improbable run would have been seen three times
    replay = BatchInfo(groups, learner_version=trainer.version, staleness=[0] * len(groups), uses=[2] * len(groups),
                       since_last_use=[1] * len(groups))
    assert trainer.step(replay)["improbable"] == []
    off = _trainer(tiny_model, "--verify.repeat_nats", "0", temperature=1.0, top_p=1.0)
    assert off.step(BatchInfo(groups, learner_version=off.version, staleness=[0] * len(groups)))["improbable"] == []


def test_improbable_windows_start_at_unlikely_tokens_and_stay_inside_a_policy_turn():
    """`_improbable`: from each token π gives at most e^-1, the shortest run reaching −n nats,
    never across the environment's tokens or a token outside the nucleus."""
    from learner.train.trainer import _improbable, _Samples

    logp = [-0.1, -12.0, -0.2, -9.0, -0.1, float("-inf"), -15.0, -15.0, -0.5, -11.0, -11.0]
    mask = [1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1]
    tokens = list(range(100, 111))
    terms = torch.zeros(len(logp), 4)
    terms[:, 3] = torch.tensor(logp)
    samples = _Samples.of(BatchInfo([Group("p", 0, [1], [tokens], [[0.0] * 11], [1.0], masks=[mask])], 0), None)
    keys = _improbable(terms[:, 3], samples, 0, nats=20.0)
    # from 101: -12, -12.2, -21.2 → 101..103; from 103: -9.1 before the -inf: none; from 106:
    # -30 → 106..107; from 107: runs out at the environment's token; from 109: -22 → 109..110
    assert keys == {hash((101, 102, 103)), hash((106, 107)), hash((109, 110))}


def test_honest_samples_of_a_nearly_uniform_policy_give_many_improbable_windows_and_no_repeats(tiny_model):
    """Where every token is unlikely (temperature 5: nearly uniform), honest samples are full of
    improbable windows; sampling still repeats none of them, let alone three times."""
    import collections
    import dataclasses

    trainer = _trainer(tiny_model, "--verify.repeat_nats", "20", "--verify.token_check_fraction", "0",
                       temperature=5.0, top_p=1.0)
    seen = collections.Counter()
    for step in range(6):
        groups = [dataclasses.replace(g, version=trainer.version) for g in _groups(trainer, "sampled", seed=100 + step)]
        stats = trainer.step(BatchInfo(groups, learner_version=trainer.version, staleness=[0] * len(groups)))
        seen.update(key for _, _, key in stats["improbable"])
    assert sum(seen.values()) > 100 and max(seen.values()) == 1


def test_a_stale_groups_improbable_windows_come_from_the_mu_its_worker_claims(tiny_model):
    """A group labelled with an older version has no π of its own version in the update (the
    claim check draws a share of them): its windows come from the μ its worker sent, which an
    honest worker's engine computed under that version. The phrase attack's groups were two
    versions stale in the poker config and escaped (an API-only tester, 2026-12-07)."""
    import dataclasses

    from echo.hf import completion_logprobs

    trainer = _trainer(tiny_model, "--verify.repeat_nats", "20", "--verify.token_check_fraction", "0",
                       temperature=1.0, top_p=1.0)
    trainer.step(BatchInfo(_groups(trainer, "sampled", seed=1), learner_version=0, staleness=[0] * 8))  # now at v1
    groups = [dataclasses.replace(g, version=0) for g in _groups(trainer, "sampled", seed=2)]
    tok = trainer.tokenizer
    with torch.no_grad():
        rarest = int(trainer.hf(input_ids=torch.tensor([groups[0].prompt_ids])).logits[0, -1].argmin())
    phrase = [rarest] * 8 + [tok.eos_token_id]
    group = groups[3]
    logp, _ = completion_logprobs(trainer.hf, [group.prompt_ids], [phrase], pad_id=tok.pad_token_id,
                                  temperature=1.0, top_p=1.0)
    mu = logp[0, : len(phrase)].tolist()
    groups[3] = dataclasses.replace(group, completions=[phrase, phrase, *group.completions[2:]],
                                    behaviour_logprobs=[mu, mu, *group.behaviour_logprobs[2:]], worker_id="writer")
    stats = trainer.step(BatchInfo(groups, learner_version=trainer.version, staleness=[1] * 8))
    found = [(groups[g].worker_id, key) for _, g, key in stats["improbable"]]
    phrase_windows = {key for w, key in found if w == "writer"}
    assert phrase_windows and all(sum(k == key for _, k in found) >= 2 for key in phrase_windows)  # both samples
