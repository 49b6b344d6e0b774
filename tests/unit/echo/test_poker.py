"""The poker table (ECHO-2 App. D) on pokerkit: deterministic hands, duplicate seats, penalties,
opponents that act legally, and an episode the learner's replay accepts token for token."""

from __future__ import annotations

import itertools
import random

import pytest

from echo.tasks import load_task
from echo.tasks.poker import BB, HoldemEnv, rule_action


def play(env, seed: int, policy) -> tuple[list[str], float]:
    said = [env.reset(seed)[0]["content"]]
    for _ in range(64):
        step = env.step(policy(env))
        if step.done:
            return said, step.reward
        said.append(step.messages[0]["content"])
    raise AssertionError("a hand that never ends")


def random_policy(seed: int):
    rng = random.Random(seed)
    return lambda env: rng.choice(["fold", "check", "call", "raise", "allin", f"raise {rng.randrange(2, 60)}"])


def test_a_hand_is_deterministic_in_its_seed_and_the_actions():
    task = load_task("poker", {})
    for prompt in itertools.islice(task.train_prompts(3), 40):
        a = play(task.environment(prompt), prompt.seed, random_policy(prompt.seed))
        b = play(task.environment(prompt), prompt.seed, random_policy(prompt.seed))
        assert a == b


def test_duplicate_deals_give_each_seat_the_same_cards():
    task = load_task("poker", {"eval_size": 20})
    prompts = task.eval_prompts()
    assert len(prompts) == 20
    for first, second in zip(prompts[0::2], prompts[1::2]):
        e1, e2 = task.environment(first), task.environment(second)
        e1.reset(first.seed)
        e2.reset(second.seed)
        assert (e1.seat, e2.seat) == (0, 1) and e1.holes == e2.holes and e1.board_deck == e2.board_deck
        assert e1.opponent == e2.opponent


def test_an_unparseable_or_illegal_action_costs_the_penalty():
    task = load_task("poker", {"illegal_penalty_bb": 1.0, "opponents": ["station"]})
    prompt = next(p for p in task.train_prompts(0) if _to_call(task, p))
    folded = play(task.environment(prompt), prompt.seed, lambda env: "fold")[1]
    for bad in ("banana", "raise 9999", "raise 1", "check"):  # 'check' is illegal facing a bet
        assert play(task.environment(prompt), prompt.seed, lambda env, bad=bad: bad)[1] == folded - 1.0


def _to_call(task, prompt) -> bool:
    env = task.environment(prompt)
    env.reset(prompt.seed)
    return env.state.status and env.legal()[0] > 0


def test_the_return_is_the_chip_change_in_big_blinds_and_the_game_is_zero_sum():
    task = load_task("poker", {"illegal_penalty_bb": 0.0})
    for prompt in itertools.islice(task.train_prompts(5), 60):
        env = task.environment(prompt)
        _, ret = play(env, prompt.seed, random_policy(prompt.seed + 1))
        stacks = env.state.stacks
        assert ret == (stacks[env.seat] - env.stack) / BB
        assert sum(stacks) == 2 * env.stack  # what one wins the other loses


@pytest.mark.parametrize("style", ["station", "tag", "lag"])
def test_each_rule_based_opponent_only_acts_legally(style, monkeypatch):
    task = load_task("poker", {"opponents": [style]})
    fallbacks = []
    real = HoldemEnv._apply

    def apply(env, action):
        ok = real(env, action)
        if env.state.actor_index is not None and not ok and env.seat != env.state.actor_index:
            fallbacks.append(action)
        return ok

    monkeypatch.setattr(HoldemEnv, "_apply", apply)
    for prompt in itertools.islice(task.train_prompts(7), 80):
        env = task.environment(prompt)
        play(env, prompt.seed, random_policy(prompt.seed))
        assert env.opponent == style
    assert not fallbacks


def test_styles_differ_where_they_should():
    assert rule_action("station", 0.1, 10, 20, 20, 40, 0.9) == "call"
    assert rule_action("tag", 0.1, 10, 20, 20, 40, 0.9) == "fold"
    assert rule_action("tag", 0.9, 10, 20, 20, 40, 0.9).startswith("raise")
    assert rule_action("lag", 0.1, 10, 20, 20, 40, 0.1).startswith("raise")  # a seeded bluff


def test_an_expert_hand_replays_token_for_token_with_a_real_chat_tokenizer(tmp_path):
    from echo.chat import Chat
    from echo.episodes import Episodes, segments
    from learner.tinymodel import build_chat_tokenizer, end_of_turn_ids

    tok = build_chat_tokenizer()
    task = load_task("poker", {"hints": True})
    episodes = Episodes(task, Chat(tok, "on", stop_ids=end_of_turn_ids(tok)),
                        lambda ids: tok.decode(ids, skip_special_tokens=True), max_new_tokens=10, max_tokens=2000,
                        max_turns=task.max_turns)
    checked = 0
    for prompt in itertools.islice(task.train_prompts(11), 20):
        pairs = episodes.demonstrations([prompt])
        first = episodes.first(prompt)
        context, actions = pairs[-1][0] + pairs[-1][1], [a for _, a in pairs]
        tokens = context[len(first):]
        mask = [0] * len(tokens)
        at = 0
        for (ctx, action) in pairs:  # the policy's tokens: each demonstration's action
            start = len(ctx) - len(first)
            mask[start : start + len(action)] = [1] * len(action)
            at = start + len(action)
        assert at == len(tokens)
        env = task.environment(prompt)
        _, expected = play(env, prompt.seed, lambda e: e.expert_action())
        result = episodes.replay(prompt, tokens, mask)
        assert result.ok and result.reward == expected, result
        assert len([s for s in segments(mask) if s[0] == 1]) == len(actions)
        checked += len(actions) > 1
        forged = tokens[:]
        obs = next(i for i, m in enumerate(mask) if m == 0) if 0 in mask else None
        if obs is not None:
            forged[obs + 20] = tok.convert_tokens_to_ids("9")  # the worker rewrites the state it was shown
            assert not episodes.replay(prompt, forged, mask).ok
    assert checked  # some hands had more than one decision


def test_eval_poker_prints_table_4s_shape(chat_model, capsys):
    """`echo-rl eval poker`: a row per policy, a column per opponent, each cell a mean in big
    blinds with a 95% interval over duplicate deals (an untrained model: the shape, not the play)."""
    import json

    from learner.evaluate import cli

    assert cli(["poker", str(chat_model), str(chat_model), "--hands", "8", "--opponents", "station,llm",
                "--opponent-model", str(chat_model), "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["deals"] == 4 and len(table["rows"]) == 2
    for row in table["rows"]:
        for col in ("station", "llm"):
            cell = row[col]
            assert cell["deals"] == 4 and cell["ci95_bb"] >= 0 and -100 <= cell["mean_bb"] <= 100
    with pytest.raises(SystemExit):
        cli(["poker", str(chat_model), "--hands", "7"])  # each deal from both seats: an even number


def test_a_missing_llm_opponent_is_named_before_a_run_not_looked_up_on_a_hub(chat_model, tmp_path):
    """The demo's LLM opponent is a local model directory. Missing (a model built with --out, a
    worker on another machine), it went to the Hugging Face hub: a minute of retries, then a
    traceback from the first episode. Now the learner says so and exits 2 before serving."""
    import subprocess
    import sys

    from echo.tasks import TaskError

    missing = tmp_path / "no-such-model"
    task = load_task("poker", {"opponents": ["tag", "llm"], "opponent_model": str(missing)})
    with pytest.raises(TaskError, match="build-model"):
        task.check_here()
    alone = load_task("poker", {"opponents": ["llm"], "opponent_model": str(missing)})
    with pytest.raises(TaskError, match="not a Hugging Face model directory"):
        for seed in range(4):  # hands against it without the check (one where it acts first): no hub either
            alone.environment(next(alone.train_prompts(0))).reset(seed)
    load_task("poker", {"opponents": ["tag", "llm"], "opponent_model": str(chat_model)}).check_here()
    load_task("poker", {"opponents": ["tag"], "opponent_model": str(missing)}).check_here()  # not played: not needed

    out = subprocess.run([sys.executable, "-m", "learner.main", "--config", "configs/poker.toml", "--model.path",
                          str(chat_model), "--task.opponent_model", str(missing)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "task.opponent_model" in out.stderr and "Traceback" not in out.stderr, out.stderr
