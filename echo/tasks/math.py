"""`math`: problems with reference answers, checked for equivalence with math-verify.

Where problems come from (`[task] path`, or `[task] dataset` for a Hugging Face hub name):
- a JSONL file of `{"id", "problem", "answer"}` per line (read here, errors name file and line);
- any other local data Hugging Face `datasets` reads: a parquet, arrow, CSV or JSON file, a
  directory of them, or a `save_to_disk` directory, with `[task] split` choosing the split;
- `[task] columns` maps other column names (`{problem = "question", answer = "solution"}`;
  without an `id` column a problem's id is a hash of its text), and `[task] answer_pattern`
  extracts the answer from a longer column (GSM8K: `"####\\s*(.+)"`).
The answer is LaTeX or plain (`"\\frac{1}{2}"`, `"0.5"`, `"-7"`, `"5\\sqrt{2}"`); a completion
is correct when math-verify finds an answer in it equal to the gold one, so `"0.5"`, `"1/2"`
and `"$\\frac12$"` all match `"\\frac{1}{2}"`. The whole completion is read and the last answer
it states counts, so the engine should stop generation where the answer ends (e.g. at a
newline for the default template).

Eval split: `eval_path` (a separate source) or `eval_split` (another split of the same
dataset); otherwise a problem is in the eval set when the
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
import re
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
        None,
        description="task.path: problems: a JSONL file, or parquet/arrow/CSV/JSON files or a "
        "directory read with Hugging Face datasets; default: the shipped sample",
    )
    dataset: str | None = Field(
        None, description="task.dataset: a Hugging Face hub dataset name (needs the hub reachable)"
    )
    subset: str | None = Field(None, description="task.subset: the hub dataset's config name")
    split: str = Field("train", description="task.split: split of a dataset to train on")
    eval_split: str | None = Field(
        None, description="task.eval_split: split of the same dataset to evaluate on (e.g. 'test')"
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="task.columns: column names for 'id', 'problem', 'answer' when they differ",
    )
    answer_pattern: str | None = Field(
        None,
        description="task.answer_pattern: regex whose first group is the answer within the "
        "answer column (e.g. '####\\s*(.+)' for GSM8K)",
    )
    eval_path: Path | None = Field(
        None, description="task.eval_path: eval problems (same formats as task.path)"
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

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, columns: dict[str, str]) -> dict[str, str]:
        unknown = set(columns) - {"id", "problem", "answer"}
        if unknown:
            raise ValueError(f"task.columns maps 'id', 'problem' and 'answer', not {sorted(unknown)}")
        return columns

    @field_validator("answer_pattern")
    @classmethod
    def _pattern_has_group(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                groups = re.compile(pattern).groups
            except re.error as e:
                raise ValueError(f"task.answer_pattern is not a regular expression: {e}") from None
            if groups < 1:
                raise ValueError("task.answer_pattern needs a group, (...), around the answer")
        return pattern

    @model_validator(mode="after")
    def _one_eval_source(self) -> MathOptions:
        sources = [k for k in ("eval_path", "eval_split", "eval_fraction") if k in self.model_fields_set]
        if len(sources) > 1:
            raise ValueError(
                f"set one of task.eval_path (separate problems), task.eval_split (another split) "
                f"or task.eval_fraction (a split of task.path by id), not both {' and '.join(sources)}"
            )
        if self.path is not None and self.dataset is not None:
            raise ValueError("set task.path (local data) or task.dataset (a hub name), not both")
        if self.eval_split is not None and self.path is None and self.dataset is None:
            raise ValueError("task.eval_split needs task.path or task.dataset to take the split from")
        return self


def read_problems(
    path: Path,
    template: str,
    columns: dict[str, str] | None = None,
    answer_pattern: str | None = None,
    split: str = "train",
) -> list[Prompt]:
    """Read problems into prompts; a bad row is a TaskError naming where it is."""
    return _to_prompts(_rows(path, split), str(path), template, columns or {}, answer_pattern)


def read_hub(
    name: str, subset: str | None, split: str, template: str, columns: dict[str, str], pattern: str | None
) -> list[Prompt]:
    """Problems from a Hugging Face hub dataset (downloaded by `datasets`, then cached)."""
    datasets = _datasets()
    try:
        data = datasets.load_dataset(name, subset, split=split)
    except Exception as e:  # offline, unknown name, missing split: datasets raises many types
        raise TaskError(
            f"cannot load hub dataset {name!r} (split {split!r}): {e}; download it where the hub "
            "is reachable and point task.path at the files"
        ) from e
    where = f"{name}[{split}]"
    return _to_prompts(((f"{where} row {i}", row) for i, row in enumerate(data)), where, template, columns, pattern)


def _rows(path: Path, split: str) -> Iterator[tuple[str, Any]]:
    """(where, row) pairs: JSONL read here with line numbers, anything else via `datasets`."""
    if path.suffix == ".jsonl" or not path.exists():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise TaskError(f"cannot read math problems from {path}: {e.strerror or e}") from e
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
        return
    data = _load_local(path, split)
    yield from ((f"{path} [{split}] row {i}", row) for i, row in enumerate(data))


def _load_local(path: Path, split: str):
    """A local dataset in any layout `datasets` knows, as one split."""
    datasets = _datasets()
    try:
        if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
            data = datasets.load_from_disk(str(path))  # save_to_disk output (arrow)
            if isinstance(data, datasets.DatasetDict):
                if split not in data:
                    raise TaskError(f"{path} has splits {sorted(data)}, not {split!r}: set task.split")
                data = data[split]
            return data
        if path.is_dir():
            return datasets.load_dataset(str(path), split=split)
        kind = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json"}.get(path.suffix)
        if kind is None:
            raise TaskError(f"{path}: unknown format {path.suffix!r}; use .jsonl, .json, .parquet, .arrow or .csv")
        return datasets.load_dataset(kind, data_files={split: str(path)}, split=split)
    except TaskError:
        raise
    except Exception as e:  # datasets raises many types for unreadable data
        raise TaskError(f"cannot read math problems from {path} (split {split!r}): {e}") from e


def _datasets():
    try:
        import datasets
    except ImportError as e:
        raise TaskError("reading datasets other than JSONL needs the datasets package: pip install datasets") from e
    datasets.disable_progress_bars()
    return datasets


def _to_prompts(
    rows, source: str, template: str, columns: dict[str, str], answer_pattern: str | None
) -> list[Prompt]:
    """Validate rows into prompts. JSONL rows need an id; a dataset without an id column (and
    none mapped) gets the hash of each problem's text, as stable as an id."""
    names = {k: columns.get(k, k) for k in ("id", "problem", "answer")}
    hash_ids = not source.endswith(".jsonl") and "id" not in columns
    pattern = re.compile(answer_pattern) if answer_pattern else None
    prompts: list[Prompt] = []
    seen: dict[str, str] = {}
    for where, row in rows:
        if not isinstance(row, dict):
            raise TaskError(f'{where}: expected an object {{"id", "problem", "answer"}}')
        values = {k: row.get(column) for k, column in names.items()}
        for key in ("id", "answer"):  # numeric ids and answers are fine as text
            if isinstance(values[key], (int, float)) and not isinstance(values[key], bool):
                values[key] = str(values[key])
        if hash_ids and names["id"] not in row and isinstance(values["problem"], str):
            values["id"] = hashlib.sha256(values["problem"].encode()).hexdigest()[:16]
        for key in ("problem", "answer", "id"):
            if not isinstance(values[key], str) or not values[key].strip():
                hint = "" if names[key] in row else f"; columns here: {sorted(row)} (map them with task.columns)"
                raise TaskError(f"{where}: {names[key]!r} must be a non-empty string, got {values[key]!r}{hint}")
        answer = values["answer"]
        if pattern is not None:
            match = pattern.search(answer)
            if match is None:
                raise TaskError(f"{where}: task.answer_pattern {pattern.pattern!r} finds no answer in {answer[:80]!r}")
            answer = match.group(1).strip()
        if values["id"] in seen:
            raise TaskError(f"{where}: id {values['id']!r} already used on {seen[values['id']]}")
        seen[values["id"]] = f"line {where.rsplit(':', 1)[-1]}" if source.endswith(".jsonl") else where
        # str.replace, not str.format, so LaTeX braces in a template need no escaping.
        prompts.append(Prompt(id=values["id"], text=template.replace("{problem}", values["problem"]), answer=answer))
    if not prompts:
        raise TaskError(f"{source} holds no problems; give a file with one problem per row")
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
                problems = self._read(o.split)
                if o.eval_path is not None or o.eval_split is not None:
                    if o.eval_path is not None:
                        evals, where = self._read(o.split, o.eval_path), str(o.eval_path)
                    else:
                        evals, where = self._read(o.eval_split), f"split {o.eval_split!r}"
                    train = problems
                    shared = {p.id for p in train} & {p.id for p in evals}
                    if shared:
                        raise TaskError(
                            f"ids {sorted(shared)[:5]} are in both {o.dataset or o.path or SAMPLE_PATH} and "
                            f"{where}; give eval problems their own ids"
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

    def _read(self, split: str, path: Path | None = None) -> list[Prompt]:
        o = self.options
        if o.dataset is not None and path is None:
            return read_hub(o.dataset, o.subset, split, o.template, o.columns, o.answer_pattern)
        return read_problems(path or o.path or SAMPLE_PATH, o.template, o.columns, o.answer_pattern, split)

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
