"""Task adapters: seeded prompt streams, fixed eval sets, rewards, option and file errors."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from echo.tasks import Prompt, Task, TaskError, TaskOptions, load_task, task_names
from echo.tasks.arith import ArithTask, evaluate
from echo.tasks.math import SAMPLE_PATH, MathTask, in_eval_split, read_problems


def take(stream: Iterator[Prompt], n: int) -> list[Prompt]:
    return list(itertools.islice(stream, n))


# ---- arith ---------------------------------------------------------------------------------


def test_arith_train_stream_is_seeded():
    task = load_task("arith", {"digits": 2, "operands": 3, "ops": "+-*"})
    first = take(task.train_prompts(seed=7), 50)
    assert first == take(task.train_prompts(seed=7), 50)
    assert [p.text for p in first] != [p.text for p in take(task.train_prompts(seed=8), 50)]
    assert [p.id for p in first[:2]] == ["arith-train-7-0", "arith-train-7-1"]
    assert len({p.id for p in first}) == 50


def test_arith_eval_set_is_fixed_and_sized():
    task = load_task("arith", {"digits": 3, "eval_size": 37})
    evals = task.eval_prompts()
    assert len(evals) == 37
    assert (
        evals
        == task.eval_prompts()
        == load_task("arith", {"digits": 3, "eval_size": 37}).eval_prompts()
    )
    assert [p.id for p in evals] == [f"arith-eval-{i}" for i in range(37)]
    evals.clear()  # a caller's copy; the task's own set is untouched
    assert len(task.eval_prompts()) == 37
    other_seed = load_task("arith", {"digits": 3, "eval_size": 37, "eval_seed": 99}).eval_prompts()
    assert [p.text for p in other_seed] != [p.text for p in task.eval_prompts()]


def test_arith_answers_are_correct_and_use_only_tokenizer_characters():
    task = load_task("arith", {"digits": 3, "operands": 4, "ops": "+-*"})
    prompts = take(task.train_prompts(seed=0), 300) + task.eval_prompts()
    for p in prompts:
        assert re.fullmatch(r"[0-9+\-*]+=", p.text), p.text
        # Python's own evaluation of the same text is the independent reference.
        assert p.answer == str(eval(p.text[:-1])), p  # noqa: S307 (our own digits and operators)
    assert any(p.answer.startswith("-") for p in prompts)


def test_arith_precedence_is_pythons():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([10, 2, 3], ["-", "-"]) == 5
    assert evaluate([2, 3, 4, 5], ["*", "-", "*"]) == -14
    assert evaluate([7, 0], ["*"]) == 0


def test_arith_difficulty_options_change_the_prompts():
    def operands_of(options: dict) -> list[list[str]]:
        prompts = take(load_task("arith", options).train_prompts(seed=1), 200)
        return [re.split(r"[+\-*]", p.text[:-1]) for p in prompts]

    easy = operands_of({})
    assert all(len(xs) == 2 and all(len(x) == 1 for x in xs) for xs in easy)
    wide = operands_of({"digits": 4})
    assert max(len(x) for xs in wide for x in xs) == 4
    long = operands_of({"operands": 4})
    assert all(len(xs) == 4 for xs in long)
    texts = [p.text for p in take(load_task("arith", {"ops": "*-"}).train_prompts(seed=1), 200)]
    assert "+" not in "".join(texts)
    assert "*" in "".join(texts) and "-" in "".join(texts)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"digits": 5}, "digits"),
        ({"operands": 1}, "operands"),
        ({"ops": "+/"}, "ops"),
        ({"ops": ""}, "ops"),
    ],
)
def test_arith_out_of_range_options_are_errors(options, key):
    with pytest.raises(TaskError, match=key):
        load_task("arith", options)


def test_arith_reward():
    task = ArithTask()
    p = Prompt(id="t", text="3+5=", answer="8")
    assert task.reward(p, "8") == 1.0
    assert task.reward(p, " 8\n") == 1.0
    assert task.reward(p, "8=12+") == 1.0  # reading stops at the first non-number character
    for wrong in ["9", "08", "80", "-8", "", "  ", "+8", "eight", "8.0"[1:], "="]:
        assert task.reward(p, wrong) == 0.0, wrong
    negative = Prompt(id="n", text="3-7=", answer="-4")
    assert task.reward(negative, "-4") == 1.0
    assert task.reward(negative, "4") == 0.0
    assert task.reward(negative, "-") == 0.0
    for weird in [None, 8, b"8", "\x00", "8" * 100_000, "ｘ８"]:
        assert task.reward(p, weird) == 0.0  # type: ignore[arg-type]


def test_a_one_turn_task_plays_unscored_where_the_answers_are_kept_and_an_environment_does_not(tiny_model):
    """A worker given no answers (the learner scores every group itself) plays a one-turn task
    with every return 0; a task with an environment of its own (its messages may need the
    answer) cannot be played so."""
    from transformers import AutoTokenizer

    from echo.episodes import Episodes
    from echo.hf import Sample

    tok = AutoTokenizer.from_pretrained(tiny_model)
    arith, calculator = load_task("arith", {}), load_task("calculator", {})
    assert arith.one_turn and not calculator.one_turn
    prompt = Prompt("p", "2+3=", "5")
    right = tok("5", add_special_tokens=False)["input_ids"]
    for scored, reward in ((True, 1.0), (False, 0.0)):  # unscored: the task's reward is never asked
        episodes = Episodes.of(arith, tok, chat_template="off", stop_ids=[tok.eos_token_id], max_new_tokens=4,
                               max_tokens=4, max_turns=1, scored=scored)
        played = episodes.play([(prompt, [1, 2])], lambda c, n, m: [[Sample(right, [-0.1] * len(right), "stop")] * n
                                                                    for _ in c], n=2)
        assert [e.reward for e in played[0]] == [reward, reward] and not any(e.truncated for e in played[0])
    with pytest.raises(ValueError, match="calculator.*unscored"):
        Episodes.of(calculator, tok, chat_template="off", stop_ids=[tok.eos_token_id], max_new_tokens=4,
                    max_tokens=16, max_turns=3, scored=False)


def test_a_tokenizer_that_cannot_play_the_task_is_refused_before_the_run(tiny_model, chat_model):
    """The calculator on the demo's digits-only tokenizer: its environment's "error" is no tokens,
    and the learner's first eval died of it (EpisodeError, a traceback) after it had printed its
    URL (an API-only tester, 2026-12-07). Checked when episodes are set up, it says what to do."""
    from transformers import AutoTokenizer

    from echo.chat import stop_ids
    from echo.episodes import Episodes
    from echo.tasks import TaskError

    def episodes(task, model):
        tok = AutoTokenizer.from_pretrained(model)
        return Episodes.of(task, tok, chat_template="auto", stop_ids=stop_ids(tok, model), max_new_tokens=12,
                           max_tokens=64, max_turns=task.max_turns)

    calculator = load_task("calculator", {"turns": 3})
    with pytest.raises(TaskError, match=r"reply 'error' .* no tokens.*echo-rl build-model"):
        episodes(calculator, tiny_model).check_playable()
    episodes(calculator, chat_model).check_playable()  # a byte-level tokenizer spells every reply and action
    episodes(load_task("arith", {}), tiny_model).check_playable()  # one turn: nothing of an environment to say


def test_arith_warmup_is_correct_deterministic_and_not_the_training_stream():
    task = load_task("arith", {"digits": 2, "ops": "+-"})
    examples = task.warmup_examples(100, seed=0)
    assert len(examples) == 100 and examples == task.warmup_examples(100, seed=0)
    assert all(answer == str(eval(text[:-1])) for text, answer in examples)  # noqa: S307
    train = [(p.text, p.answer) for p in take(task.train_prompts(seed=0), 100)]
    assert examples != train


# ---- loading tasks by name -----------------------------------------------------------------


def test_unknown_option_names_the_key():
    with pytest.raises(TaskError, match="digitz"):
        load_task("arith", {"digitz": 2})
    with pytest.raises(TaskError, match="pth"):
        load_task("math", {"pth": "x.jsonl"})


def test_unknown_task_lists_the_builtins():
    assert {"arith", "math"} <= set(task_names())
    with pytest.raises(TaskError, match=r"unknown task 'arithmetic'.*arith, calculator, math"):
        load_task("arithmetic")


class ShoutOptions(TaskOptions):
    word: str = "hello"


class ShoutTask(Task):
    """A user task defined outside echo, loaded by `module:Class`."""

    name = "shout"
    Options = ShoutOptions

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        return itertools.repeat(
            Prompt(id="s", text=self.options.word, answer=self.options.word.upper())
        )

    def eval_prompts(self) -> list[Prompt]:
        return [Prompt(id="s", text=self.options.word, answer=self.options.word.upper())]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return float(completion == prompt.answer)


class NotATask:
    pass


def test_user_task_by_import_path():
    task = load_task(f"{__name__}:ShoutTask", {"word": "hey"})
    assert isinstance(task, ShoutTask)
    [p] = task.eval_prompts()
    assert task.reward(p, "HEY") == 1.0
    with pytest.raises(TaskError, match="colour"):
        load_task(f"{__name__}:ShoutTask", {"colour": "red"})
    with pytest.raises(TaskError, match="not a subclass"):
        load_task(f"{__name__}:NotATask")
    with pytest.raises(TaskError, match="cannot import"):
        load_task(f"{__name__}:Missing")


# ---- math: data ----------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_math_sample_split_is_deterministic_and_disjoint():
    task = load_task("math")
    train, evals = take(task.train_prompts(seed=0), 35), task.eval_prompts()
    problems = read_problems(SAMPLE_PATH, "{problem}")
    assert len(problems) == 40
    train_ids, eval_ids = {p.id for p in train}, {p.id for p in evals}
    assert not train_ids & eval_ids
    assert train_ids | eval_ids == {p.id for p in problems}
    assert eval_ids == {p.id for p in problems if in_eval_split(p.id, 0.2)}
    assert evals == load_task("math").eval_prompts()
    bigger = load_task("math", {"eval_fraction": 0.5}).eval_prompts()
    assert eval_ids < {p.id for p in bigger}  # a problem never leaves the eval set as it grows


def test_math_train_prompts_cover_each_problem_once_per_epoch_in_seeded_order():
    task = load_task("math", {"template": "Q: {problem} \\boxed{} A:"})
    n = 40 - len(task.eval_prompts())
    stream = take(task.train_prompts(seed=3), 3 * n)
    epochs = [stream[i * n : (i + 1) * n] for i in range(3)]
    assert all(len({p.id for p in epoch}) == n for epoch in epochs)
    assert epochs[0] != epochs[1]  # reshuffled every epoch
    assert stream == take(task.train_prompts(seed=3), 3 * n)
    assert stream[:n] != take(task.train_prompts(seed=4), n)
    p = stream[0]
    assert p.text.startswith("Q: ") and p.text.endswith(" \\boxed{} A:")


def test_math_eval_path(tmp_path):
    evals = write_jsonl(tmp_path / "eval.jsonl", [{"id": "e1", "problem": "1+1?", "answer": "2"}])
    task = load_task("math", {"eval_path": str(evals)})
    assert [p.id for p in task.eval_prompts()] == ["e1"]
    assert len({p.id for p in take(task.train_prompts(seed=0), 40)}) == 40
    with pytest.raises(TaskError, match="not both"):
        load_task("math", {"eval_path": str(evals), "eval_fraction": 0.3})
    clash = write_jsonl(
        tmp_path / "clash.jsonl", [{"id": "sample-000", "problem": "?", "answer": "1"}]
    )
    with pytest.raises(TaskError, match="sample-000"):
        load_task("math", {"eval_path": str(clash)}).eval_prompts()


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"id": "b", "problem": "2+2?", "answer": null}', r"'answer' must be a non-empty string"),
        ('{"id": "b", "problem": ["2+2?"], "answer": "4"}', r"'problem' must be a non-empty string"),
        ('{"id": "b", "problem": "2+2?"', r"not valid JSON"),
        ('["b", "2+2?", "4"]', r"expected an object"),
        ('{"id": "a", "problem": "again?", "answer": "1"}', r"id 'a' already used on line 1"),
        ('{"problem": "2+2?", "answer": "4"}', r"'id' must be"),
    ],
)
def test_math_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "problems.jsonl"
    path.write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n\n' + bad_line + "\n")
    task = load_task("math", {"path": str(path), "eval_fraction": 0.5})
    with pytest.raises(TaskError, match=re.escape(f"{path}:3: ") + message):
        task.eval_prompts()


def test_math_reads_hugging_face_datasets_with_a_column_mapping(tmp_path):
    """Parquet files, a directory of them and a save_to_disk directory, with other column names,
    numeric answers, an answer inside a longer column (GSM8K's '#### 72'), an eval split."""
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"What is {i} + {i}?", "solution": f"Add them. #### {2 * i}"} for i in range(30)]
    tests = [{"question": f"What is {i} times 3?", "solution": f"#### {3 * i}"} for i in range(5)]
    opts = {"columns": {"problem": "question", "answer": "solution"}, "answer_pattern": r"####\s*(.+)"}
    (tmp_path / "pq").mkdir()
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "pq" / "train-00000.parquet"))
    datasets.Dataset.from_list(tests).to_parquet(str(tmp_path / "pq" / "test-00000.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(tests)}).save_to_disk(str(tmp_path / "arrow"))
    for source in ("pq", "arrow"):
        task = load_task("math", {"path": str(tmp_path / source), "eval_split": "test", **opts})
        train, evals = take(task.train_prompts(seed=0), 30), task.eval_prompts()
        assert len({p.id for p in train}) == 30 and len(evals) == 5
        by_text = {p.text: p.answer for p in train}
        assert by_text["What is 7 + 7?\nAnswer: "] == "14"
        assert task.reward(evals[0], f"It is {evals[0].answer}") == 1.0
        task.close()
    single = load_task("math", {"path": str(tmp_path / "pq" / "train-00000.parquet"), **opts})
    assert len(single.eval_prompts()) + 30 > 30  # a hash split of one file, ids from the text
    with pytest.raises(TaskError, match=r"'problem' must be.*columns here: \['question', 'solution'\]"):
        load_task("math", {"path": str(tmp_path / "pq")}).eval_prompts()
    with pytest.raises(TaskError, match="finds no answer"):
        load_task("math", {"path": str(tmp_path / "pq"), "columns": opts["columns"],
                           "answer_pattern": "=>(.+)"}).eval_prompts()
    with pytest.raises(TaskError, match="splits.*'validation'"):
        load_task("math", {"path": str(tmp_path / "arrow"), "eval_split": "validation", **opts}).eval_prompts()
    with pytest.raises(TaskError, match="not both"):
        load_task("math", {"path": str(tmp_path / "pq"), "eval_split": "test", "eval_fraction": 0.1})


def test_math_file_and_template_errors(tmp_path):
    with pytest.raises(TaskError, match="cannot read math problems from .*missing.jsonl"):
        load_task("math", {"path": str(tmp_path / "missing.jsonl")}).eval_prompts()
    with pytest.raises(TaskError, match=r"template.*\{problem\}"):
        load_task("math", {"template": "Answer: "})
    one = write_jsonl(tmp_path / "one.jsonl", [{"id": "a", "problem": "1+1?", "answer": "2"}])
    with pytest.raises(TaskError, match="leaves"):
        load_task("math", {"path": str(one)}).eval_prompts()


# ---- math: rewards -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def math_task() -> Iterator[MathTask]:
    task = load_task("math", {"verifier_processes": 2})
    assert isinstance(task, MathTask)
    yield task
    task.close()


@pytest.mark.parametrize(
    ("gold", "completion", "expected"),
    [
        ("\\frac{1}{2}", "0.5", 1.0),
        ("\\frac{1}{2}", "1/2", 1.0),
        ("\\frac{1}{2}", "\\frac{1}{2}", 1.0),
        ("\\frac{1}{2}", "$\\frac12$", 1.0),
        ("0.5", "\\frac{1}{2}", 1.0),
        ("\\frac{1}{2}", "0.6", 0.0),
        ("12", "The answer is 12.", 1.0),
        ("12", "12.0", 1.0),
        ("12", "\\boxed{12}", 1.0),
        ("12", "13", 0.0),
        ("-\\frac{1}{2}", "-0.5", 1.0),
        ("5\\sqrt{2}", "\\sqrt{50}", 1.0),
        ("5\\sqrt{2}", "5\\sqrt{2}", 1.0),
        ("5\\sqrt{2}", "5", 0.0),
        ("1000", "1,000", 1.0),
        ("12", "", 0.0),
        ("12", "banana", 0.0),
    ],
)
def test_math_reward_equivalences(math_task, gold, completion, expected):
    assert math_task.reward(Prompt(id="q", text="?", answer=gold), completion) == expected


def test_math_every_sample_answer_verifies_against_itself(math_task):
    for p in read_problems(SAMPLE_PATH, "{problem}"):
        assert math_task.reward(p, p.answer) == 1.0, p


def test_math_reward_from_threads(math_task):
    half = Prompt(id="q", text="?", answer="\\frac{1}{2}")
    completions = ["0.5", "1/2", "0.25", "nope"] * 5
    with ThreadPoolExecutor(max_workers=4) as pool:
        rewards = list(pool.map(lambda c: math_task.reward(half, c), completions))
    assert rewards == [1.0, 1.0, 0.0, 0.0] * 5
    out: list[float] = []
    thread = threading.Thread(target=lambda: out.append(math_task.reward(half, "0.5")))
    thread.start()
    thread.join()
    assert out == [1.0]


def test_math_reward_never_raises_on_weird_input(math_task):
    p = Prompt(id="q", text="?", answer="12")
    for weird in [
        None,
        12,
        "\\frac{",
        "$$$",
        "}{",
        "\x00\x01",
        "١٢",
        "12" * 20_000,
        "\\" * 1000,
        "\n" * 50,
    ]:
        assert math_task.reward(p, weird) in (0.0, 1.0)  # type: ignore[arg-type]
    assert math_task.reward(Prompt(id="q", text="?", answer="\\frac{"), "12") == 0.0
    assert math_task.reward(p, "12") == 1.0  # still healthy afterwards


def test_math_reward_times_out_on_a_runaway_check_and_recovers():
    # sympy evaluating 9^(9^9) holds the GIL for minutes: only a killable process can bound it.
    task = load_task("math", {"reward_timeout_s": 1.0})
    try:
        p = Prompt(id="q", text="?", answer="2")
        assert task.reward(p, "2") == 1.0  # starts the verifier outside the timed window
        start = time.monotonic()
        assert task.reward(p, "$9^{9^{9}}$") == 0.0
        assert time.monotonic() - start < 5.0
        assert task.reward(p, "2") == 1.0
    finally:
        task.close()


def test_the_calculator_has_an_expert_for_build_models_warm_start(tmp_path, monkeypatch):
    """`echo-rl build-model` warm-starts a multi-turn task on its environment's expert. The
    calculator had none: the build died with a traceback and left an untrained model directory
    that the next build took for a built one ('already exists')."""
    from echo.tasks.calculator import CalculatorEnv, CalculatorTask
    from learner.tinymodel import cli

    task = CalculatorTask(CalculatorTask.Options(digits=1, operands=2, turns=3))
    for prompt in task.eval_prompts()[:20]:
        env = task.environment(prompt)
        env.reset(prompt.seed)
        first = env.expert_action()
        assert first.startswith("calc ") and not env.step(first).done  # the tool, then the answer
        step = env.step(env.expert_action())
        assert step.done and step.reward == 1.0
    one_turn = task.environment(task.eval_prompts()[0])
    one_turn.turns = 1
    assert one_turn.expert_action().startswith("answer ")

    config = tmp_path / "calc.toml"
    out = tmp_path / "calc-model"
    config.write_text(f'[model]\npath = "{out}"\n[task]\nname = "calculator"\ndigits = 1\noperands = 2\n'
                      'turns = 2\neval_size = 2\n[eval]\nwhere = "learner"\n')
    monkeypatch.delattr(CalculatorEnv, "expert_action")  # a task without an expert
    assert cli(["--config", str(config), "--hidden", "32", "--layers", "1", "--positions", "256",
                "--warmup-steps", "2"]) == 2
    assert not out.exists()  # nothing left to pass for a built model


def test_build_model_takes_the_overrides_its_own_errors_suggest(tmp_path, capsys):
    """build-model told a user to pass `--eval.where learner`, then refused the flag. It takes
    the learner's `--section.key VALUE` overrides now, names an unknown flag, and calls an
    episode's score a return (with 0 warm-start steps there is no loss to print). A multi-turn
    task's eval is on the learner unless the config says otherwise (2026-12-07)."""
    from learner.tinymodel import cli

    config = tmp_path / "calc.toml"
    out = tmp_path / "calc-model"
    config.write_text(f'[model]\npath = "{out}"\n[task]\nname = "calculator"\ndigits = 1\noperands = 2\n'
                      'turns = 2\neval_size = 2\n')
    small = ["--config", str(config), "--hidden", "32", "--layers", "1", "--positions", "256", "--warmup-steps", "0"]
    assert cli([*small, "--eval.where", "workers"]) == 2
    assert "--eval.where learner" in capsys.readouterr().err
    assert cli([*small, "--bogus"]) == 2
    assert "unknown option --bogus" in capsys.readouterr().err
    assert cli(small) == 0
    assert "greedy eval return" in capsys.readouterr().out and (out / "config.json").exists()


def test_build_model_says_how_its_warm_start_goes_into_a_log(tmp_path, capsys):
    """Into a log (no terminal) the progress bar draws nothing: a 13-minute poker build printed
    not a line. A line every tenth of the warm start now."""
    from learner.tinymodel import cli

    config = tmp_path / "arith.toml"
    config.write_text(f'[model]\npath = "{tmp_path / "m"}"\n[task]\nname = "arith"\neval_size = 2\n')
    assert cli(["--config", str(config), "--hidden", "32", "--layers", "1", "--warmup-steps", "20",
                "--warmup-batch", "4"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warm start ")]
    assert [line.split(":")[0] for line in lines] == [f"warm start {k}/20" for k in range(2, 21, 2)]
