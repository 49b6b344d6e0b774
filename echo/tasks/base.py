"""The task adapter: where prompts come from and how an episode is played and scored.

A task is one class. It names itself, declares its options as a pydantic model (the keys of
the `[task]` table other than `name`), and implements `train_prompts`, `eval_prompts` and
either `reward` (one turn: a prompt, a completion, a score) or `environment` (an episode that
answers back). Register it with `@register_task`, or name it in the config by import path
(`name = "mypkg.tasks:MyTask"`).

Every task is played as episodes (`echo.episodes`): `environment(prompt)` gives an
`Environment` whose `reset(seed)` says the first messages and whose `step(action)` answers
each action with messages, a reward and whether the episode is over. A one-turn task is the
episode of one step (`OneTurn`: the prompt, then the reward of the completion). Environments
are deterministic in the seed and the actions, because the learner replays a share of every
worker's episodes to check the observations and the return it claims.

The learner calls `train_prompts` and `eval_prompts`; workers play the episodes on their own
machine, so everything an environment needs travels inside the `Prompt` (`answer`, `seed`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

#: A chat message, as chat templates take them: {"role": "user" | "system" | ..., "content": str}.
Message = dict[str, str]


@dataclass(frozen=True)
class Prompt:
    """One start of an episode. `id` is stable: a prompt re-issued after a lost lease keeps it.
    A group is this start played `group_size` times: every play resets with the same `seed`."""

    id: str
    text: str
    answer: str
    seed: int = 0


@dataclass(frozen=True)
class Step:
    """The environment's answer to one action: messages appended to the context (tokens the
    policy reads but is never trained on), the step's reward, and whether the episode is over."""

    messages: list[Message]
    reward: float = 0.0
    done: bool = False


class Environment(ABC):
    """One episode. Deterministic in `seed` and the actions it is given (the learner replays it)."""

    @abstractmethod
    def reset(self, seed: int) -> list[Message]:
        """Start the episode; the first messages (rendered by the learner into the prompt's tokens)."""

    @abstractmethod
    def step(self, action: str) -> Step:
        """Apply the policy's action (its turn's text, special tokens removed). Never raises:
        an illegal or unparseable action is the environment's to penalise."""


class OneTurn(Environment):
    """A one-turn task as an episode: the prompt as a user message, then the completion's reward."""

    def __init__(self, task: Task, prompt: Prompt):
        self.task, self.prompt = task, prompt

    def reset(self, seed: int) -> list[Message]:
        return [{"role": "user", "content": self.prompt.text}]

    def step(self, action: str) -> Step:
        return Step([], float(self.task.reward(self.prompt, action)), True)


class Unscored(Environment):
    """A one-turn episode played where the answer is not known (`Task.one_turn`, on a worker
    the learner does not give answers to): it ends after the completion, scored 0; the learner
    scores it."""

    def reset(self, seed: int) -> list[Message]:
        return []

    def step(self, action: str) -> Step:
        return Step([], 0.0, True)


class TaskOptions(BaseModel):
    """Base for a task's options: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class Task(ABC):
    name: ClassVar[str]
    Options: ClassVar[type[TaskOptions]] = TaskOptions
    #: Most policy turns an episode may take; a longer one is cut and marked truncated.
    max_turns: ClassVar[int] = 1
    #: Tokens (as the tokenizer spells them) that also end a turn, beyond the model's own end ids.
    stop_tokens: ClassVar[tuple[str, ...]] = ()

    def __init__(self, options: TaskOptions | None = None):
        self.options = options if options is not None else self.Options()

    @abstractmethod
    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless, seeded stream of training prompts."""

    @abstractmethod
    def eval_prompts(self) -> list[Prompt]:
        """A fixed evaluation set (the same on every call)."""

    def reward(self, prompt: Prompt, completion: str) -> float:
        """Score one completion of `prompt` (one-turn tasks); 1.0 is correct, 0.0 wrong. Never raises."""
        raise NotImplementedError(f"task {self.name!r} is episodic: it scores episodes, not completions")

    def environment(self, prompt: Prompt) -> Environment:
        """A fresh episode of `prompt`; the default plays a one-turn task (`reward`)."""
        return OneTurn(self, prompt)

    def check_here(self) -> None:
        """Raise `TaskError` when something the task reads on this machine is missing (a model
        directory, a file): said before a run starts, not at its first episode."""

    def model_dirs(self) -> dict[str, str]:
        """The options naming a model directory the environment reads where it runs (option ->
        directory): the learner serves each to workers that hold no copy of it (`echo.dirfiles`)."""
        return {}

    @property
    def one_turn(self) -> bool:
        """Played as `OneTurn` (the environment is not the task's own): the episode is one
        completion, its reward `reward`'s, so whoever holds the answer can score it, and the
        worker that plays it needs none."""
        return type(self).environment is Task.environment

    @property
    def episodic(self) -> bool:
        """More than one turn: evaluated by return, not by a completion's reward."""
        return self.max_turns > 1

    def warmup_examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        """`n` (prompt text, target completion) pairs for a supervised warm start."""
        raise NotImplementedError(f"task {self.name!r} has no warm-start examples")


_REGISTRY: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    _REGISTRY[cls.name] = cls
    return cls


class TaskError(ValueError):
    """A task name or its options are wrong; the message says what to do."""
