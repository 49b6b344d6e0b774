"""Episodes, token-exact: played on a worker's engine, replayed on the learner.

An episode's tokens are everything after the prompt: the policy's turns (mask 1, with the
behaviour log-probs μ they were sampled with) and the environment's answers (mask 0, log-prob
0: read by the policy, never trained on), in the order they were written. A one-turn task is
an episode of one turn: its tokens are the completion, all mask 1.

`play` runs the episodes of a lease turn by turn: turn t of every live episode is one engine
call (the first turn of a group is one call with `n` samples, which engines batch best), so
a multi-turn lease costs as many engine calls as its longest episode has turns.

`replay` is the learner's check: the same environment, reset with the same seed and given
the actions the worker's tokens spell, must answer with exactly the observation tokens the
worker appended, and end where the worker's episode ended with the return it claimed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from echo.chat import Chat
from echo.tasks.base import Prompt, Task, TaskError, Unscored
from echo.wire import turn_budget

if TYPE_CHECKING:  # the learner's checks replay episodes without torch
    from echo.hf import Sample

#: generate(contexts, n, max_new_tokens) -> per context, n samples (an engine, or the trainer's model)
Generate = Callable[[list[list[int]], int, int], "list[list[Sample]]"]


@dataclass
class Episode:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: the policy's token, 0: the environment's
    reward: float = 0.0  # the return: the sum of the step rewards
    turns: int = 0
    truncated: bool = False  # cut at the turn or token budget before the environment ended it

    def act(self, sample: Sample) -> None:
        self.tokens += sample.tokens
        self.logprobs += sample.logprobs
        self.mask += [1] * len(sample.tokens)
        self.turns += 1

    def observe(self, ids: list[int]) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)


class EpisodeError(RuntimeError):
    """The environment misbehaved (not the policy): the lease's prompts go back."""


def play(task: Task, chat: Chat, prompts: Sequence[tuple[Prompt, list[int]]], generate: Generate, *, n: int,
         max_new_tokens: int, max_tokens: int, max_turns: int, decode: Callable[[list[int]], str],
         scored: bool = True) -> list[list[Episode]]:
    """Play `n` episodes of each (prompt, its token ids); per prompt, its `n` episodes.

    Each turn may write up to `max_new_tokens`; an episode's tokens stop within `max_tokens`
    and its turns at `max_turns` (truncated, never dropped). Not `scored` (a one-turn task
    whose answers the learner keeps): every return is 0."""
    episodes = [[Episode() for _ in range(n)] for _ in prompts]
    envs = []
    for prompt, _ in prompts:
        envs.append([task.environment(prompt) if scored else Unscored() for _ in range(n)])
        for env in envs[-1]:
            env.reset(prompt.seed)
    first = generate([ids for _, ids in prompts], n, turn_budget(0, max_new_tokens, max_tokens))
    live = [(i, j, s) for i, group in enumerate(first) for j, s in enumerate(group)]
    while live:
        following = []
        for i, j, sample in live:
            ep, env = episodes[i][j], envs[i][j]
            ep.act(sample)
            step = env.step(decode(sample.tokens))
            ep.reward += _finite(step.reward)
            if step.done:
                continue
            obs = chat.observation(step.messages)
            if not obs:
                raise EpisodeError(f"task {task.name!r}: a step that does not end the episode said nothing")
            if ep.turns >= max_turns or len(ep.tokens) + len(obs) >= max_tokens:
                ep.truncated = True
                continue
            ep.observe(obs)
            following.append((i, j))
        if not following:
            break
        # Each episode's turn gets its own budget (`turn_budget`, as the learner checks): one for the
        # batch (the least room of any) cut the other episodes' turns short wherever one neared
        # max_tokens, and a turn cut short of its budget on no stop id is what a forger sends.
        by_budget: dict[int, list[tuple[int, int]]] = {}
        for i, j in following:
            by_budget.setdefault(turn_budget(len(episodes[i][j].tokens), max_new_tokens, max_tokens), []).append((i, j))
        live = []
        for budget, members in by_budget.items():
            samples = generate([prompts[i][1] + episodes[i][j].tokens for i, j in members], 1, budget)
            live += [(i, j, s[0]) for (i, j), s in zip(members, samples)]
    return episodes


def _finite(x: float) -> float:
    x = float(x)
    if not math.isfinite(x):
        raise EpisodeError(f"the environment gave a non-finite reward {x!r}")
    return x


@dataclass
class Replay:
    reward: float  # the return the environment gives for these actions
    problem: str = ""  # "" when the worker's episode is the environment's; else what differs
    truncated: bool = False  # cut, legitimately, at the turn or token budget

    @property
    def ok(self) -> bool:
        return not self.problem


def segments(mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of equal mask values: (value, start, end)."""
    runs, start = [], 0
    for k in range(1, len(mask) + 1):
        if k == len(mask) or mask[k] != mask[start]:
            runs.append((mask[start], start, k))
            start = k
    return runs


def replay(task: Task, chat: Chat, prompt: Prompt, tokens: Sequence[int], mask: Sequence[int],
           decode: Callable[[list[int]], str], *, max_new_tokens: int, max_tokens: int, max_turns: int) -> Replay:
    """Replay the worker's actions in a fresh environment and compare what it answers with the
    tokens the worker wrote as the environment's. Never raises for the worker's content."""
    env = task.environment(prompt)
    env.reset(prompt.seed)
    runs = segments(mask)
    if not runs or runs[0][0] != 1:
        return Replay(0.0, "the episode does not start with the policy's turn")
    total, turns = 0.0, 0
    for k, (value, start, end) in enumerate(runs):
        if value == 0:
            continue  # checked below, against what the step before it answered
        turns += 1
        if turns > max_turns or end - start > max_new_tokens:
            return Replay(total, f"turn {turns} of {end - start} tokens; the run allows {max_turns} turns "
                                 f"of {max_new_tokens} tokens")
        step = env.step(decode(list(tokens[start:end])))
        total += float(step.reward)
        following = runs[k + 1] if k + 1 < len(runs) else None
        if step.done:
            return Replay(total, f"tokens after the episode ended (turn {turns})" if following else "")
        expected = chat.observation(step.messages)
        if following is None:  # cut: only where the budget cut it
            if turns >= max_turns or end + len(expected) >= max_tokens:
                return Replay(total, truncated=True)
            return Replay(total, f"the episode stops after turn {turns}, but the environment goes on")
        written = list(tokens[following[1] : following[2]])
        if written != expected:
            return Replay(total, f"the environment's answer after turn {turns} differs from what the worker wrote "
                                 f"({len(written)} tokens, expected {len(expected)})")
    return Replay(total, "the episode ends on the environment's tokens")


@dataclass
class Episodes:
    """How one run plays its episodes, the same on the learner and on every worker: the task,
    its rendering (`Chat`), how a turn's tokens become an action's text, and the budgets."""

    task: Task
    chat: Chat
    decode: Callable[[list[int]], str]
    max_new_tokens: int  # per turn
    max_tokens: int  # per episode, after its prompt
    max_turns: int
    scored: bool = True  # False: a worker without the answers (`P.RolloutParams.scored_by_learner`)

    @classmethod
    def of(cls, task: Task, tokenizer, *, chat_template: str, system_prompt: str = "",
           template_kwargs: dict | None = None, stop_ids: Sequence[int], max_new_tokens: int, max_tokens: int,
           max_turns: int, scored: bool = True) -> Episodes:
        if not scored and not task.one_turn:
            raise ValueError(f"task {task.name!r} plays its own environment: its episodes cannot be played unscored")
        chat = Chat(tokenizer, chat_template, system_prompt, template_kwargs, stop_ids)
        return cls(task, chat, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), max_new_tokens,
                   max_tokens or max_new_tokens, max_turns, scored)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.chat.stop_ids))

    def first(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids: its episode's first messages, rendered (the learner's copy is the one sent)."""
        return self.chat.first(self.task.environment(prompt).reset(prompt.seed))

    def play(self, prompts: Sequence[tuple[Prompt, list[int]]], generate: Generate, n: int) -> list[list[Episode]]:
        return play(self.task, self.chat, prompts, generate, n=n, max_new_tokens=self.max_new_tokens,
                    max_tokens=self.max_tokens, max_turns=self.max_turns, decode=self.decode, scored=self.scored)

    def greedy_returns(self, model, prompts: Sequence[Prompt], pad_id: int, batch: int = 256) -> list[float]:
        """Each prompt's return with `model` (an HF causal LM) playing greedily, as a worker plays
        an eval lease: the learner's eval and `echo-rl eval poker` both go through here."""
        import torch

        from echo.hf import sample

        def generate(contexts: list[list[int]], n: int, max_new_tokens: int) -> list[list]:
            outs = sample(model, contexts, max_new_tokens=max_new_tokens, stop_ids=self.stop_ids, pad_id=pad_id,
                          temperature=0.0)
            return [[o] * n for o in outs]

        returns: list[float] = []
        with torch.no_grad():
            for start in range(0, len(prompts), batch):
                chunk = prompts[start : start + batch]
                played = self.play([(p, self.first(p)) for p in chunk], generate, n=1)
                returns += [group[0].reward for group in played]
        return returns

    def check_playable(self) -> None:
        """Raise `TaskError` where this tokenizer cannot play the task, before a run starts: an
        environment's reply that renders as no tokens (a policy turn would run into the next; the
        demo's digits-only tokenizer spells the calculator's "error" as nothing, and the
        learner's first eval died of it), or the environment's expert action coming back changed
        (the policy could never write it). Tried on the first eval prompt, with an empty action
        and with the expert's (where the environment has one)."""
        prompts = self.task.eval_prompts()[:1] or [next(iter(self.task.train_prompts(0)))]
        name = self.task.name
        tokenizer, fix = self.chat.tokenizer, (f"use a model whose tokenizer spells the task's text: `echo-rl build-model "
                                               f"--config <this config> --out models/tiny-{name}` builds a tiny one, "
                                               f"then --model.path models/tiny-{name}")
        for prompt in prompts:
            for expert in (False, True):
                env = self.task.environment(prompt)
                env.reset(prompt.seed)
                for _ in range(self.max_turns if expert else 1):
                    action = ""
                    if expert:
                        if not hasattr(env, "expert_action"):
                            break
                        action = env.expert_action()
                        written = self.decode(tokenizer(action, add_special_tokens=False)["input_ids"])
                        if written.strip() != action.strip():
                            raise TaskError(f"task {self.task.name!r}: this tokenizer writes the action {action!r} as "
                                            f"{written!r}, so the policy can never take it; {fix}")
                    step = env.step(action)
                    if step.done:
                        break
                    if not self.chat.observation(step.messages):
                        said = " ".join(m.get("content", "") for m in step.messages)
                        raise TaskError(f"task {self.task.name!r}: the environment's reply {said!r} to the action "
                                        f"{action!r} is no tokens with this tokenizer, so the policy's turns would run "
                                        f"together; {fix}")

    def demonstrations(self, prompts: Sequence[Prompt]) -> list[tuple[list[int], list[int]]]:
        """(context ids, action ids) for every decision of the environment's own expert
        (`Environment.expert_action`) through `prompts`, rendered exactly as workers render
        episodes: a supervised warm start that sees the contexts RL will see."""
        tokenizer = self.chat.tokenizer
        end = sorted(self.chat.stop_ids)[:1]  # the turn's end token, trained as the policy's
        if self.chat.templated:
            end = [i for i in self.chat.stop_ids if i != tokenizer.eos_token_id][:1] or end
        pairs = []
        for prompt in prompts:
            env = self.task.environment(prompt)
            context = self.chat.first(env.reset(prompt.seed))
            for _ in range(self.max_turns):
                expert = getattr(env, "expert_action", None)
                if expert is None:
                    raise NotImplementedError(f"task {self.task.name!r} has no expert to demonstrate")
                action = tokenizer(expert(), add_special_tokens=False)["input_ids"] + end
                pairs.append((list(context), action))
                step = env.step(self.decode(action))
                if step.done:
                    break
                context += action + self.chat.observation(step.messages)
        return pairs

    def replay(self, prompt: Prompt, tokens: Sequence[int], mask: Sequence[int]) -> Replay:
        return replay(self.task, self.chat, prompt, tokens, mask, self.decode, max_new_tokens=self.max_new_tokens,
                      max_tokens=self.max_tokens, max_turns=self.max_turns)
