"""`arith`: procedural, verifiable integer arithmetic, the task of the CPU demo.

A prompt is an expression with no spaces followed by `=`, e.g. `"3+5*2="`; the answer is its
value written in decimal (`"13"`, possibly negative: `"-4"`). Expressions are evaluated with
normal precedence, as Python does: `*` binds tighter than `+` and `-`, which go left to right.
Only the characters `0123456789+-*=` appear, so the demo's character-level tokenizer covers
every prompt and answer; a completion is the answer followed by end-of-sequence.

Difficulty is set by three options, so a demo is not saturated in a few steps: `digits` (the
largest operand has that many digits), `operands` (terms per expression) and `ops` (which
operators appear). One-digit addition has only 100 distinct problems, so at that setting the
training stream and the eval set overlap; nothing here keeps them disjoint.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from pydantic import Field, field_validator

from echo.tasks.base import Prompt, Task, TaskOptions, register_task

_OPERATORS = "+-*"
# An answer is an optional minus sign then digits; reading stops at anything else.
_NUMBER = re.compile(r"-?[0-9]+")


class ArithOptions(TaskOptions):
    """Options of the `arith` task (`[task]` table, `name = "arith"`)."""

    digits: int = Field(1, ge=1, le=4, description="task.digits: most digits of one operand")
    operands: int = Field(2, ge=2, le=4, description="task.operands: operands per expression")
    ops: str = Field(
        "+", min_length=1, description='task.ops: operators to draw from, a subset of "+-*"'
    )
    eval_size: int = Field(200, ge=1, le=100_000, description="task.eval_size: eval prompts")
    eval_seed: int = Field(1234, ge=0, description="task.eval_seed: seed of the fixed eval set")

    @field_validator("ops")
    @classmethod
    def _known_operators(cls, ops: str) -> str:
        unknown = sorted(set(ops) - set(_OPERATORS))
        if unknown:
            raise ValueError(
                f"unknown operator(s) {''.join(unknown)!r}; use some of {_OPERATORS!r}"
            )
        # Deduplicated and ordered, so "+*+" and "*+" draw the same streams.
        return "".join(op for op in _OPERATORS if op in ops)


def evaluate(operands: list[int], operators: list[str]) -> int:
    """Value of `operands[0] operators[0] operands[1] ...` with `*` before `+`/`-`.

    Written out instead of calling `eval` so the rule is explicit: the expression is a sum of
    signed terms, and each term is a product of consecutive operands.
    """
    if len(operators) != len(operands) - 1:
        raise ValueError(f"{len(operands)} operands need {len(operands) - 1} operators")
    total, sign, term = 0, 1, operands[0]
    for op, x in zip(operators, operands[1:], strict=True):
        if op == "*":
            term *= x
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), x
    return total + sign * term


def read_answer(completion: str) -> str | None:
    """The number a completion starts with (after whitespace), or None if it starts with none."""
    match = _NUMBER.match(completion.strip())
    return match.group(0) if match else None


@register_task
class ArithTask(Task):
    """Integer arithmetic with a configurable difficulty; reward 1.0 for the exact answer."""

    name = "arith"
    Options = ArithOptions
    options: ArithOptions

    def __init__(self, options: ArithOptions | None = None):
        super().__init__(options)
        self._eval: list[Prompt] | None = None

    def _problem(self, rng: random.Random) -> tuple[str, str]:
        """Draw one (prompt text, answer) pair."""
        o = self.options
        # Uniform over 0 .. 10**digits - 1, so most operands have the full number of digits.
        operands = [rng.randrange(10**o.digits) for _ in range(o.operands)]
        operators = [rng.choice(o.ops) for _ in range(o.operands - 1)]
        text = str(operands[0]) + "".join(
            op + str(x) for op, x in zip(operators, operands[1:], strict=True)
        )
        return text + "=", str(evaluate(operands, operators))

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        # String seeds are hashed deterministically (not with PYTHONHASHSEED), and the prefix
        # keeps training, eval and warm-up streams apart even when their integer seeds match.
        rng = random.Random(f"arith-train-{seed}")
        i = 0
        while True:
            text, answer = self._problem(rng)
            yield Prompt(id=f"arith-train-{seed}-{i}", text=text, answer=answer)
            i += 1

    def eval_prompts(self) -> list[Prompt]:
        if self._eval is None:
            rng = random.Random(f"arith-eval-{self.options.eval_seed}")
            self._eval = []
            for i in range(self.options.eval_size):
                text, answer = self._problem(rng)
                self._eval.append(Prompt(id=f"arith-eval-{i}", text=text, answer=answer))
        return list(self._eval)  # a copy: callers may shuffle or trim theirs

    def reward(self, prompt: Prompt, completion: str) -> float:
        """1.0 if the completion's leading number is exactly the answer ("08" is not "8")."""
        if not isinstance(completion, str):
            return 0.0
        return 1.0 if read_answer(completion) == prompt.answer else 0.0

    def warmup_examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        """`n` (prompt, answer) pairs from a stream separate from training; the trainer adds EOS."""
        rng = random.Random(f"arith-warmup-{seed}")
        return [self._problem(rng) for _ in range(n)]
