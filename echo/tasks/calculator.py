"""`calculator`: arithmetic with a tool, an environment that is not a game.

The policy is asked for the value of an expression and may call a calculator as often as it
likes (up to `max_turns`): a turn `calc 37*12` is answered by the environment with the value
(`= 444`, a `tool` message: tokens the policy reads and is not trained on); a turn
`answer 449` ends the episode with reward 1.0 if it is the expression's value, else 0.0. A
turn that is neither is answered `error`, and costs the turn. An episode that runs out
of turns without answering is cut (truncated) with reward 0.

The calculator accepts `+ - *` and integers only (no parentheses, no names: it is evaluated by
`echo.tasks.arith.evaluate`, never by `eval`), at most 64 characters.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from pydantic import Field

from echo.tasks.arith import evaluate
from echo.tasks.base import Environment, Message, Prompt, Step, Task, TaskOptions, register_task

_CALL = re.compile(r"^\s*calc\s+(-?\d+(?:\s*[-+*]\s*-?\d+)*)\s*$")
_ANSWER = re.compile(r"^\s*answer\s+(-?\d+)\s*$")
_QUESTION = re.compile(r"^What is (.+)\?$")
GRAMMAR = "write 'calc EXPR' (integers and + - *) or 'answer N'"


def calculate(expression: str) -> int | None:
    """The value of `12+3*4`-style text, or None when it is not one."""
    expression = expression.replace(" ", "")
    if len(expression) > 64:
        return None
    match = re.fullmatch(r"(-?\d+)((?:[-+*]-?\d+)*)", expression)
    if match is None:
        return None
    operands = [int(match.group(1))]
    operators = []
    for op, x in re.findall(r"([-+*])(-?\d+)", match.group(2)):
        operators.append(op)
        operands.append(int(x))
    return evaluate(operands, operators)


class CalculatorOptions(TaskOptions):
    digits: int = Field(2, ge=1, le=6, description="task.digits: most digits of one operand")
    operands: int = Field(3, ge=2, le=5, description="task.operands: operands per expression")
    turns: int = Field(4, ge=1, le=32, description="task.turns: policy turns per episode (tool calls + the answer)")
    eval_size: int = Field(100, ge=1, le=100_000, description="task.eval_size: eval prompts")
    eval_seed: int = Field(4321, ge=0, description="task.eval_seed: seed of the fixed eval set")


class CalculatorEnv(Environment):
    def __init__(self, prompt: Prompt, turns: int):
        self.prompt, self.turns, self.taken = prompt, turns, 0

    def reset(self, seed: int) -> list[Message]:
        self.taken = 0
        return [{"role": "user", "content": f"{self.prompt.text} ({GRAMMAR})"}]

    def step(self, action: str) -> Step:
        self.taken += 1
        answer = _ANSWER.match(action)
        if answer:
            return Step([], 1.0 if answer.group(1) == self.prompt.answer else 0.0, True)
        call = _CALL.match(action)
        value = calculate(call.group(1)) if call else None
        reply = f"= {value}" if value is not None else "error"  # short: every character is context
        return Step([{"role": "tool", "content": reply}])

    def expert_action(self) -> str:
        """The demonstration (`echo-rl build-model`'s warm start): ask the tool for the
        expression, then answer with its value; with one turn, answer at once."""
        expression = _QUESTION.match(self.prompt.text)
        if self.taken == 0 and self.turns > 1 and expression:
            return f"calc {expression.group(1)}"
        return f"answer {self.prompt.answer}"


@register_task
class CalculatorTask(Task):
    """Integer arithmetic with a calculator tool: multi-turn, answered by the environment."""

    name = "calculator"
    Options = CalculatorOptions
    options: CalculatorOptions

    def __init__(self, options: CalculatorOptions | None = None):
        super().__init__(options)
        self.max_turns = self.options.turns  # per instance: the option sets it

    def _problem(self, rng: random.Random) -> tuple[str, str]:
        o = self.options
        operands = [rng.randrange(10**o.digits) for _ in range(o.operands)]
        operators = [rng.choice("+-*") for _ in range(o.operands - 1)]
        text = str(operands[0]) + "".join(op + str(x) for op, x in zip(operators, operands[1:], strict=True))
        return f"What is {text}?", str(evaluate(operands, operators))

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(f"calculator-train-{seed}")
        i = 0
        while True:
            text, answer = self._problem(rng)
            yield Prompt(id=f"calculator-train-{seed}-{i}", text=text, answer=answer, seed=i)
            i += 1

    def eval_prompts(self) -> list[Prompt]:
        rng = random.Random(f"calculator-eval-{self.options.eval_seed}")
        out = []
        for i in range(self.options.eval_size):
            text, answer = self._problem(rng)
            out.append(Prompt(id=f"calculator-eval-{i}", text=text, answer=answer, seed=i))
        return out

    def environment(self, prompt: Prompt) -> Environment:
        return CalculatorEnv(prompt, self.max_turns)
