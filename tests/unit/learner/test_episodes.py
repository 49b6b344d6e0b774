"""Multi-turn episodes end to end on real parts: a chat model whose turn ends on <|im_end|> (not
its eos), the transformers engine as a worker runs it, the trainer, the learner's replay."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from echo.chat import stop_ids
from echo.episodes import Episodes, segments
from echo.hf import sample
from learner.buffer import BatchInfo, Group
from learner.config import load_learner_config
from learner.train.trainer import Trainer
from learner.verify import Rescorer
from worker.engines import GenerationParams, make_engine


def _trainer(model, *overrides):
    return Trainer(load_learner_config(None, [
        "--model.path", str(model), "--task.name", "calculator", "--task.digits", "1", "--task.turns", "3",
        "--rollout.group_size", "4", "--rollout.max_new_tokens", "10", "--rollout.max_episode_tokens", "200", "--trainer.batch_prompts", "2",
        "--eval.where", "learner", *overrides]))


def _play(trainer: Trainer, prompts: int = 2, seed: int = 0) -> list[Group]:
    """Play as a worker does: the engine with the trainer's snapshot, the rules sent at join."""
    r = trainer.rollout_params()
    tok = trainer.tokenizer
    episodes = Episodes.of(trainer.episodes.task, tok, chat_template=r.chat_template,
                           template_kwargs=r.chat_template_kwargs, stop_ids=r.stop_ids,
                           max_new_tokens=r.max_new_tokens, max_tokens=r.max_tokens, max_turns=r.max_turns)
    engine = make_engine("transformers", trainer.model_dir, "cpu", "float32", 1, seed)
    engine.install(0, bytes(trainer.snapshot()))
    params = GenerationParams(n=r.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                              top_p=r.top_p, stop_ids=episodes.stop_ids, pad_id=tok.pad_token_id)
    chosen = list(itertools.islice(episodes.task.train_prompts(seed), prompts))
    played = episodes.play([(p, trainer.encode(p)) for p in chosen],
                           lambda c, n, m: engine.generate(c, dataclasses.replace(params, n=n, max_new_tokens=m)),
                           n=r.group_size)
    return [Group(p.id, 0, trainer.encode(p), [e.tokens for e in eps], [e.logprobs for e in eps],
                  [e.reward for e in eps], masks=[e.mask for e in eps], truncated=[e.truncated for e in eps], prompt=p)
            for p, eps in zip(chosen, played)]


@pytest.mark.parametrize("extra", [[], ["--rollout.top_p", "0.9", "--trainer.kl_coef", "0.1",
                                        "--trainer.minibatches", "2"]], ids=["top_p=1", "top_p=0.9,kl,minibatches=2"])
def test_fresh_multi_turn_episodes_are_token_exact(chat_model, extra):
    trainer = _trainer(chat_model, *extra)
    groups = _play(trainer)
    masks = [m for g in groups for m in g.masks]
    assert any(0 in m for m in masks), "no episode had a second turn"
    for g in groups:  # rewards only matter for the gradient; vary them so it is not zero
        g.rewards = [1.0, 0.0, 0.0, 1.0]
    for step in range(2):
        stats = trainer.step(BatchInfo(groups if step == 0 else _play(trainer, seed=step), step, [0, 0]))
        assert all(math.isfinite(stats[k]) for k in ("loss", "grad_norm", "kl_ref"))
        if step == 0:  # fresh weights: π of the trainer equals μ of the worker on every policy token
            assert stats["mismatch_kl"] < 1e-6
            assert stats["tokens"] == sum(map(sum, masks))  # the normaliser: Σ mask
            assert stats["turns_mean"] > 1 and 0 < stats["env_token_share"] < 1


def test_environment_tokens_are_never_trained(chat_model):
    """Two identical trainers, the same episodes but for the log-probs recorded on the
    environment's tokens: if those tokens were trained (their IS weights used), the updates differ."""
    a, b = _trainer(chat_model), _trainer(chat_model)
    groups = _play(a)
    for g in groups:
        g.rewards = [1.0, 0.0, 0.0, 1.0]
    other = [dataclasses.replace(g, behaviour_logprobs=[[lp if m else -30.0 for lp, m in zip(lps, mask)]
                                                        for lps, mask in zip(g.behaviour_logprobs, g.masks)])
             for g in groups]
    a.step(BatchInfo(groups, 0, [0, 0]))
    b.step(BatchInfo(other, 0, [0, 0]))
    moved = 0
    for (name, pa), (_, pb) in zip(a.policy.named_parameters(), b.policy.named_parameters()):
        assert torch.equal(pa, pb), name
        moved += 1
    assert moved
    # ...and a gradient on them does exist when the mask says they are the policy's:
    c = _trainer(chat_model)
    c.step(BatchInfo([dataclasses.replace(g, masks=None) for g in other], 0, [0, 0]))
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.policy.parameters(), c.policy.parameters()))


def test_every_end_of_turn_id_stops_a_turn(chat_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end != tok.eos_token_id
    assert set(stop_ids(tok, chat_model)) == {im_end, tok.eos_token_id}  # generation_config's list ∪ eos
    assert set(stop_ids(tok, chat_model, ["<|im_start|>"])) == {im_end, tok.eos_token_id, 4}  # the task's own
    model = AutoModelForCausalLM.from_pretrained(chat_model).eval()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every token equally likely: each end id is met within a few hundred
    prompt = tok("x")["input_ids"]
    for end in (im_end, tok.eos_token_id, 4):
        out = sample(model, [prompt] * 3, max_new_tokens=4000, stop_ids=[end], pad_id=tok.pad_token_id,
                     generator=torch.Generator().manual_seed(end))
        for s in out:
            assert s.finish == "stop" and s.tokens[-1] == end and end not in s.tokens[:-1]


def test_replay_catches_a_forged_observation_a_forged_return_and_a_false_cut(chat_model):
    trainer = _trainer(chat_model)
    groups = _play(trainer, prompts=1)
    rescore = Rescorer(trainer.episodes.task, trainer.tokenizer, 1e-6, episodes=trainer.episodes)
    honest = rescore([dataclasses.replace(g) for g in groups])
    assert not honest.forged and not any(map(any, honest.mismatches))
    g = groups[0]
    k = next(i for i, m in enumerate(g.masks) if 0 in m)  # an episode with an environment turn
    tokens, mask = g.completions[k], g.masks[k]
    assert g.truncated[k] == trainer.episodes.replay(g.prompt, tokens, mask).truncated

    env_at = mask.index(0)
    forged_obs = tokens[:env_at] + [tokens[env_at] + 1] + tokens[env_at + 1 :]
    bad = rescore([dataclasses.replace(g, completions=[forged_obs] + g.completions[1:], masks=[mask] + g.masks[1:])])
    assert bad.forged and "differs" in bad.forged[0]

    lying = dataclasses.replace(g, rewards=[5.0] + g.rewards[1:])
    flagged = rescore([lying])
    assert flagged.mismatches[0][0] and not flagged.forged and lying.rewards[0] == g.rewards[0]

    first_turn_end = segments(mask)[0][2]  # stops after turn 1 while the environment goes on
    cut = rescore([dataclasses.replace(g, completions=[tokens[:first_turn_end]], masks=[mask[:first_turn_end]],
                                       rewards=[0.0])])
    assert cut.forged and "goes on" in cut.forged[0]

    # A whole episode marked cut (or a cut one not marked): a tester's 32 whole poker episodes
    # flagged truncated were taken, and counted as cut in the run log (2026-11-29).
    flipped = dataclasses.replace(g, truncated=[not t for t in g.truncated])
    marked = rescore([flipped])
    assert len(marked.forged) == len(g.completions) and all("marked cut" in f for f in marked.forged)
    assert flipped.truncated == g.truncated  # the learner's count, not the worker's


def test_a_scripted_calculator_episode_replays_to_its_return(chat_model):
    trainer = _trainer(chat_model, "--rollout.max_new_tokens", "24")
    tok, episodes = trainer.tokenizer, trainer.episodes
    prompt = next(episodes.task.train_prompts(0))
    end = [tok.convert_tokens_to_ids("<|im_end|>")]
    expression = prompt.text.removeprefix("What is ").removesuffix("?")
    call = tok(f"calc {expression}", add_special_tokens=False)["input_ids"] + end
    obs = episodes.chat.observation([{"role": "tool", "content": f"= {prompt.answer}"}])
    answer = tok(f"answer {prompt.answer}", add_special_tokens=False)["input_ids"] + end
    tokens, mask = call + obs + answer, [1] * len(call) + [0] * len(obs) + [1] * len(answer)
    assert tok.decode(obs).startswith("\n<|im_start|>tool\n=")  # what follows the turn's <|im_end|>
    result = episodes.replay(prompt, tokens, mask)
    assert result.ok and result.reward == 1.0 and not result.truncated


def test_a_group_mixing_one_turn_and_multi_turn_episodes_trains(chat_model):
    """A one-turn episode travels without a mask; beside multi-turn ones in its group it must
    become all ones, not None (which the replay and the trainer cannot read)."""
    from echo.wire import SampleMsg
    from learner.api.uploads import group_masks

    samples = [SampleMsg([5, 6, 7], [-1.0] * 3, 1.0), SampleMsg([5, 9, 9, 7], [-1.0, 0.0, 0.0, -1.0], 0.0, [1, 0, 0, 1])]
    assert group_masks(samples) == [[1, 1, 1], [1, 0, 0, 1]] and group_masks(samples[:1]) is None
    trainer = _trainer(chat_model)
    groups = _play(trainer, prompts=1)
    g = groups[0]
    g.masks[0] = None  # as an upload of a mixed group used to arrive
    g.masks = group_masks([SampleMsg(t, lp, r, m) for t, lp, r, m in zip(g.completions, g.behaviour_logprobs,
                                                                          g.rewards, g.masks)])
    g.rewards = [1.0, 0.0, 0.0, 1.0]
    assert math.isfinite(trainer.step(BatchInfo([g, _play(trainer, prompts=1, seed=1)[0]], 0, [0, 0]))["loss"])


def test_every_honest_episode_passes_the_learners_turn_rules_where_episodes_near_their_budget(chat_model):
    """The learner refuses a turn that ends on no stop id short of its budget (a forger's deleted
    end-of-turn id). Honest play gave such turns: one budget per batch, the least room of any
    episode, cut every other episode's turn short wherever one neared max_episode_tokens. Each
    turn gets its own budget now; played tight, every episode passes."""
    from echo.wire import GroupMsg, SampleMsg, Submission, decode_submission, encode_submission

    trainer = _trainer(chat_model, "--rollout.max_episode_tokens", "40", "--rollout.group_size", "8")  # 7 of 96 cut short before
    r = trainer.rollout_params()
    rules = dict(vocab_size=trainer.tokenizer.vocab_size + 64, max_tokens=r.max_tokens, group_size=r.group_size,
                 stop_ids=r.stop_ids, turn_tokens=r.max_new_tokens)
    cut_short_of_a_turn = 0
    for seed in range(3):
        groups = _play(trainer, prompts=4, seed=seed)
        cut_short_of_a_turn += sum(t for g in groups for t in g.truncated)
        for g in groups:
            samples = [SampleMsg(c, lp, 0.0, mask=m) for c, lp, m in zip(g.completions, g.behaviour_logprobs, g.masks)]
            decode_submission(encode_submission(Submission("w", "L", [GroupMsg(g.prompt_id, 0, samples)])), **rules)
    assert cut_short_of_a_turn, "no episode reached its budget: the test shows nothing"
