"""The task adapter: where prompts come from and how a completion is scored.

A task is one class. It names itself, declares its options as a pydantic model (the keys of
the `[task]` table other than `name`), and implements three methods. Register it with
`@register_task`, or name it in the config by import path (`name = "mypkg.tasks:MyTask"`).

The learner calls `train_prompts` and `eval_prompts`; workers call `reward` on their own
machine, so everything a reward needs travels inside the `Prompt` (its `answer`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True)
class Prompt:
    """One prompt. `id` is stable: a prompt re-issued after a lost lease keeps it."""

    id: str
    text: str
    answer: str


class TaskOptions(BaseModel):
    """Base for a task's options: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class Task(ABC):
    name: ClassVar[str]
    Options: ClassVar[type[TaskOptions]] = TaskOptions

    def __init__(self, options: TaskOptions | None = None):
        self.options = options if options is not None else self.Options()

    @abstractmethod
    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless, seeded stream of training prompts."""

    @abstractmethod
    def eval_prompts(self) -> list[Prompt]:
        """A fixed evaluation set (the same on every call)."""

    @abstractmethod
    def reward(self, prompt: Prompt, completion: str) -> float:
        """Score one completion of `prompt`; 1.0 is correct, 0.0 wrong. Never raises."""

    def warmup_examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        """`n` (prompt text, target completion) pairs for a supervised warm start."""
        raise NotImplementedError(f"task {self.name!r} has no warm-start examples")


_REGISTRY: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    _REGISTRY[cls.name] = cls
    return cls


class TaskError(ValueError):
    """A task name or its options are wrong; the message says what to do."""
