"""`math`: problems from a JSONL file, answers checked for equivalence with math-verify.

Each line of the file is `{"id": str, "problem": str, "answer": str}` (other keys are ignored).
The answer is LaTeX or plain (`"\\frac{1}{2}"`, `"0.5"`, `"-7"`, `"5\\sqrt{2}"`); a completion
is correct when math-verify finds an answer in it equal to the gold one, so `"0.5"`, `"1/2"`
and `"$\\frac12$"` all match `"\\frac{1}{2}"`. The whole completion is read and the last answer
it states counts, so the engine should stop generation where the answer ends (e.g. at a
newline for the default template).

Eval split: unless `eval_path` names a separate file, a problem is in the eval set when the
SHA-256 of its id falls in the lowest `eval_fraction` of the hash range. That split is the same
on every machine, needs no stored state, and keeps each problem on its side when the file grows.

Why rewards run in a child process: math-verify bounds its own work with `signal.alarm`, which
only works on the main thread, and workers score from threads. A thread cannot be stopped
either: sympy evaluating `9^{9^{9}}` is one big-integer power that holds the GIL, so the whole
worker (heartbeats included) would freeze. Each check therefore runs in a small pool of child
processes with math-verify's own timeouts off; a check that exceeds `reward_timeout_s` scores
0.0, and its process is killed and replaced on the next call.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import queue
import random
import select
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from echo.tasks.base import Prompt, Task, TaskError, TaskOptions, register_task

log = logging.getLogger(__name__)

SAMPLE_PATH = Path(__file__).resolve().parent.parent / "data" / "math_sample.jsonl"
# Spawning a verifier imports sympy (a second or two); that is not counted against a reward.
_START_TIMEOUT_S = 120.0


class MathOptions(TaskOptions):
    """Options of the `math` task (`[task]` table, `name = "math"`)."""

    path: Path | None = Field(
        None, description="task.path: JSONL problem file; default: the shipped sample"
    )
    eval_path: Path | None = Field(
        None, description="task.eval_path: JSONL eval file; default: split off from task.path"
    )
    eval_fraction: float = Field(
        0.2,
        gt=0.0,
        lt=1.0,
        description="task.eval_fraction: share of task.path held out for eval (by id hash)",
    )
    template: str = Field(
        "{problem}\nAnswer: ",
        description="task.template: prompt text; '{problem}' is replaced by the problem",
    )
    reward_timeout_s: float = Field(
        5.0, gt=0.0, le=600.0, description="task.reward_timeout_s: limit on one answer check"
    )
    verifier_processes: int = Field(
        1, ge=1, le=64, description="task.verifier_processes: processes checking answers"
    )

    @field_validator("template")
    @classmethod
    def _has_problem(cls, template: str) -> str:
        if "{problem}" not in template:
            raise ValueError("the template must contain '{problem}', where the problem goes")
        return template

    @model_validator(mode="after")
    def _one_eval_source(self) -> MathOptions:
        if self.eval_path is not None and "eval_fraction" in self.model_fields_set:
            raise ValueError(
                "set task.eval_path (a separate eval file) or task.eval_fraction (a split of "
                "task.path), not both"
            )
        return self


def read_problems(path: Path, template: str) -> list[Prompt]:
    """Read a JSONL problem file into prompts; a bad line is a TaskError naming file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TaskError(f"cannot read math problems from {path}: {e.strerror or e}") from e
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{where}: not valid JSON ({e.msg})") from e
        if not isinstance(row, dict):
            raise TaskError(f'{where}: expected an object {{"id", "problem", "answer"}}')
        for key in ("id", "problem", "answer"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise TaskError(
                    f"{where}: {key!r} must be a non-empty string, got {row.get(key)!r}"
                )
        if row["id"] in seen:
            raise TaskError(f"{where}: id {row['id']!r} already used on line {seen[row['id']]}")
        seen[row["id"]] = lineno
        # str.replace, not str.format, so LaTeX braces in a template need no escaping.
        text = template.replace("{problem}", row["problem"])
        prompts.append(Prompt(id=row["id"], text=text, answer=row["answer"]))
    if not prompts:
        raise TaskError(f"{path} holds no problems; give a JSONL file with one problem per line")
    return prompts


def in_eval_split(problem_id: str, fraction: float) -> bool:
    """Whether a problem is held out: its id's hash lies in the lowest `fraction` of the range."""
    digest = hashlib.sha256(problem_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


@register_task
class MathTask(Task):
    """Problems from a JSONL file; reward 1.0 when math-verify finds the answer equivalent."""

    name = "math"
    Options = MathOptions
    options: MathOptions

    def __init__(self, options: MathOptions | None = None):
        super().__init__(options)
        if importlib.util.find_spec("math_verify") is None:
            raise TaskError("the math task needs the math-verify package: pip install math-verify")
        # The file is read on first use, not here: a worker only scores, and the answer travels
        # inside each Prompt, so it needs no copy of the data.
        self._lock = threading.Lock()
        self._split: tuple[list[Prompt], list[Prompt]] | None = None
        self._pool: _VerifierPool | None = None

    def _data(self) -> tuple[list[Prompt], list[Prompt]]:
        """(train, eval) prompts, read once."""
        with self._lock:
            if self._split is None:
                o = self.options
                problems = read_problems(o.path or SAMPLE_PATH, o.template)
                if o.eval_path is not None:
                    train, evals = problems, read_problems(o.eval_path, o.template)
                    shared = {p.id for p in train} & {p.id for p in evals}
                    if shared:
                        raise TaskError(
                            f"ids {sorted(shared)[:5]} are in both {o.path or SAMPLE_PATH} and "
                            f"{o.eval_path}; give eval problems their own ids"
                        )
                else:
                    train = [p for p in problems if not in_eval_split(p.id, o.eval_fraction)]
                    evals = [p for p in problems if in_eval_split(p.id, o.eval_fraction)]
                    if not train or not evals:
                        raise TaskError(
                            f"task.eval_fraction = {o.eval_fraction} leaves "
                            f"{len(train)} training and {len(evals)} eval problems out of "
                            f"{len(problems)}; change it or set task.eval_path"
                        )
                self._split = (train, evals)
            return self._split

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """Every training problem once per epoch, each epoch in a new seeded order."""
        train = list(self._data()[0])
        rng = random.Random(f"math-train-{seed}")
        while True:
            rng.shuffle(train)
            yield from train

    def eval_prompts(self) -> list[Prompt]:
        return list(self._data()[1])

    def reward(self, prompt: Prompt, completion: str) -> float:
        if not isinstance(completion, str) or not isinstance(prompt.answer, str):
            return 0.0
        try:
            ok = self._verifiers().check(prompt.answer, completion, self.options.reward_timeout_s)
        except TimeoutError:
            log.warning(
                "math: checking the answer to %s took over %ss; scored 0.0",
                prompt.id,
                self.options.reward_timeout_s,
            )
            return 0.0
        except Exception as e:  # the contract is to never raise; the cause goes to the log
            log.warning("math: could not check the answer to %s (%s); scored 0.0", prompt.id, e)
            return 0.0
        return 1.0 if ok else 0.0

    def warmup_examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        """`n` (prompt, gold answer) pairs drawn from the training problems."""
        train = self._data()[0]
        rng = random.Random(f"math-warmup-{seed}")
        return [(p.text, p.answer) for p in (rng.choice(train) for _ in range(n))]

    def close(self) -> None:
        """Stop the verifier processes now (they also stop when this task is collected)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _verifiers(self) -> _VerifierPool:
        with self._lock:
            if self._pool is None:
                self._pool = _VerifierPool(self.options.verifier_processes)
                weakref.finalize(self, self._pool.close)
            return self._pool


class _Verifier:
    """One child process running math-verify, started on demand and killed when it overruns.

    The child is a plain `python -c` subprocess speaking JSON lines on stdin/stdout, not a
    multiprocessing one: spawn would re-import the parent's `__main__` (re-running any script
    without a main guard), and fork would copy a threaded worker in an arbitrary state.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None

    def check(self, gold: str, completion: str, timeout: float) -> bool:
        """Whether `completion` states `gold`; TimeoutError (and a killed child) past `timeout`."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        assert self._proc is not None and self._proc.stdin and self._proc.stdout
        try:
            self._proc.stdin.write(json.dumps([gold, completion]).encode() + b"\n")
            self._proc.stdin.flush()
            return self._read_line(timeout) == b"1"
        except BaseException:
            # The child may be mid-computation or its pipe half-used: only a fresh one is safe.
            self.stop()
            raise

    def _read_line(self, timeout: float) -> bytes:
        """The child's next reply; it writes each in one go, so readable means complete."""
        assert self._proc is not None and self._proc.stdout
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"answer check exceeded {timeout}s")
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the math-verify process exited (code {self._proc.wait()})")
        return line.strip()

    def _start(self) -> None:
        self.stop()
        # The child finds echo (and math-verify) exactly where this process found them.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from echo.tasks.math import _serve; _serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # Ctrl-C is the parent's to handle; it then stops us
        )
        try:
            ready = self._read_line(_START_TIMEOUT_S) == b"ready"
        except (TimeoutError, RuntimeError):
            ready = False
        if not ready:
            self.stop()
            raise RuntimeError(
                "the math-verify process did not start (see its error above); "
                "is math-verify installed in this Python?"
            )

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._proc = None


class _VerifierPool:
    """A fixed set of verifiers; a caller borrows an idle one, waiting if all are busy."""

    def __init__(self, size: int) -> None:
        self._all = [_Verifier() for _ in range(size)]
        self._idle: queue.SimpleQueue[_Verifier] = queue.SimpleQueue()
        for verifier in self._all:
            self._idle.put(verifier)

    def check(self, gold: str, completion: str, timeout: float) -> bool:
        verifier = self._idle.get()
        try:
            return verifier.check(gold, completion, timeout)
        finally:
            self._idle.put(verifier)

    def close(self) -> None:
        # A check in flight on a stopped verifier fails with a closed pipe and scores 0.0.
        for verifier in self._all:
            verifier.stop()


# ---- in the child process ------------------------------------------------------------------


def _serve() -> None:
    """Answer `[gold, completion]` lines with `1` or `0` until stdin closes."""
    # Replies go to a private copy of stdout; fd 1 becomes stderr so a stray print from a
    # library cannot corrupt the protocol.
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    # Its one warning says timeouts are off and must be provided by the caller: they are, ours.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401  (imported before "ready", so the first check is fast)

    replies.write(b"ready\n")
    for line in sys.stdin.buffer:
        try:
            gold, completion = json.loads(line)
            ok = _equivalent(gold, completion)
        except Exception:
            ok = False
        replies.write(b"1\n" if ok else b"0\n")


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> list[Any]:
    from math_verify import parse

    # A bare gold answer is LaTeX: unwrapped, "5\sqrt{2}" would be read as the number 5.
    if "$" not in answer and "\\boxed" not in answer:
        answer = f"${answer}$"
    return parse(answer, parsing_timeout=None)


def _equivalent(gold: str, completion: str) -> bool:
    from math_verify import parse, verify

    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        return False
    candidates = [completion]
    # Bare LaTeX ("5\sqrt{2}") is misread outside $...$ (here as 5), so try it wrapped too.
    if "\\" in completion and "$" not in completion:
        candidates.append(f"${completion}$")
    for candidate in candidates:
        pred = parse(candidate, parsing_timeout=None)
        if pred and verify(gold_parsed, pred, timeout_seconds=None):
            return True
    return False
