"""The eval part is picked once from `[eval] where` (a tagged union); each variant evaluates when
the loop's old branches did: on the workers, a round opens at a publication `eval_every` updates
after the last one (and always at the last version); on the learner, every `eval_every` updates."""

from __future__ import annotations

import asyncio

from broadcast.star import BlobStore
from echo.config import load_config
from echo.tasks import load_task
from learner.api.run import Run
from learner.config import LearnerConfig, LearnerEval, WorkersEval
from learner.evaluation import EvalParts, LearnerEvaluation, WorkerEvaluation, make_evaluation
from learner.evals import EvalResult
from learner.metrics import LearnerMetrics
from scheduler.cost import CostMeter


def parts(eval_every: int, resumed: dict | None = None, log=None, woken=None, accuracies=None) -> EvalParts:
    async def evaluate() -> float:
        return accuracies.pop(0)

    return EvalParts(load_task("arith", {}).eval_prompts()[:8], eval_every, resumed or {}, CostMeter(0.0),
                     LearnerMetrics(), log=(log if log is not None else []).append, note=lambda text: None,
                     run=Run(BlobStore(keep=2)), changed=lambda: woken.append(1) if woken is not None else None,
                     evaluate=evaluate, lease_ttl=20.0)


def test_where_picks_the_variant_and_keeps_old_spellings():
    assert isinstance(load_config(LearnerConfig, None, []).eval, WorkersEval)
    cfg = load_config(LearnerConfig, None, ["--eval.where", "learner", "--eval.prompts_per_lease", "8"])
    assert isinstance(cfg.eval, LearnerEval)  # a workers-only key is accepted (and means nothing here)
    assert isinstance(make_evaluation(cfg.eval, parts(5)), LearnerEvaluation)
    workers = make_evaluation(WorkersEval(prompts_per_lease=4), parts(5))
    assert isinstance(workers, WorkerEvaluation) and workers.book.per_lease == 4


def test_a_multi_turn_task_is_evaluated_on_the_learner_unless_told_otherwise():
    """A config naming the calculator and no `[eval] where` was refused (its returns are scored on
    the learner only); it is evaluated there now. Saying `workers` is still refused, saying why."""
    import pytest

    cfg = load_config(LearnerConfig, None, ["--task.name", "calculator"])
    assert isinstance(cfg.eval, LearnerEval)
    assert isinstance(load_config(LearnerConfig, None, ["--task.name", "arith"]).eval, WorkersEval)
    with pytest.raises(Exception, match="evaluated by their return on the learner"):
        load_config(LearnerConfig, None, ["--task.name", "calculator", "--eval.where", "workers"])


def test_rounds_on_the_workers_open_at_publications_when_due():
    woken = []
    ev = WorkerEvaluation(WorkersEval(), parts(eval_every=4, woken=woken))
    opened = []
    book_open = ev.book.open
    ev.book.open = lambda version, now: (opened.append(version), book_open(version, now))

    async def run():
        await ev.start(0)
        for version in range(1, 11):
            if version in (3, 9):
                ev.book.round = None  # the workers answered the open round
            await ev.stepped(version, version % 2 == 0 or version == 10, version == 10)

    asyncio.run(run())
    # v4: due and v0's round answered; v6: not due; v8: due, but v4's round still runs; v10: the last, always.
    assert opened == [0, 4, 10] and len(woken) == 2  # a round opened mid-run wakes the waiting workers


def test_on_the_learner_every_n_updates_and_the_last():
    log = []
    ev = make_evaluation(LearnerEval(), parts(eval_every=3, log=log, accuracies=[0.1, 0.2, 0.3, 0.4]))

    async def run():
        await ev.start(0)
        return [await ev.stepped(v, v % 2 == 0, v == 7) for v in range(1, 8)]

    assert asyncio.run(run()) == [None, None, 0.2, None, None, 0.3, 0.4]
    # Every eval is an event, as on the workers (they rode only on the step record, with no line)
    assert [(e["version"], e["eval_accuracy"], e["where"]) for e in log] == [
        (0, 0.1, "learner"), (3, 0.2, "learner"), (6, 0.3, "learner"), (7, 0.4, "learner")]
    assert all(e["seconds"] >= 0 for e in log)
    assert ev.first_accuracy == 0.1 and ev.checkpoint_state() == {
        "eval_accuracy": 0.4, "eval_version": 7, "eval_update": 7, "first_eval_accuracy": 0.1}


def test_a_resumed_run_keeps_its_first_accuracy():
    ev = WorkerEvaluation(WorkersEval(), parts(5, resumed={"first_eval_accuracy": 0.05}))
    ev.finished(EvalResult(3, 0.5, 8, 1.0, 1, 0))
    assert (ev.first_accuracy, ev.last.accuracy) == (0.05, 0.5)


def test_a_resume_does_not_evaluate_again_the_weights_its_checkpoint_evaluated():
    """The checkpoint's eval was of the version it resumes from: carried over (shown, counted, in
    the next checkpoint), with no second round and no second event of the same accuracy. Of an
    older version, the resumed weights are evaluated: they never were."""
    resumed = {"eval_accuracy": 0.6, "eval_version": 12, "first_eval_accuracy": 0.1}
    log, opened = [], []

    def resume_both(state: dict) -> tuple[WorkerEvaluation, LearnerEvaluation]:
        workers = WorkerEvaluation(WorkersEval(), parts(eval_every=4, resumed=state, log=log))
        workers.book.open = lambda version, now: opened.append(version)
        learner = LearnerEvaluation(LearnerEval(), parts(eval_every=4, resumed=state, log=log, accuracies=[0.7]))

        async def run():
            await workers.start(12)
            await learner.start(12)

        asyncio.run(run())
        return workers, learner

    both = resume_both(resumed)
    assert opened == [] and log == [] and both[0].book.round is None
    for ev in both:
        assert (ev.last.version, ev.last.accuracy, ev.first_accuracy) == (12, 0.6, 0.1)
        assert ev.checkpoint_state() == {**resumed, "eval_update": 12}
        assert ev.parts.metrics.eval_accuracy._value.get() == 0.6
    _, learner = resume_both({**resumed, "eval_version": 11})
    assert opened == [12] and [(e["version"], e["eval_accuracy"]) for e in log] == [(12, 0.7)]
    assert learner.first_accuracy == 0.1
    # Killed mid-run, the resume numbers its versions past the lost ones (v8's weights come back as
    # v10): the checkpoint's eval is known by its update, and was run again and logged twice
    opened.clear(), log.clear()
    for ev in (WorkerEvaluation(WorkersEval(), parts(4, resumed={**resumed, "eval_version": 8, "eval_update": 8})),
               LearnerEvaluation(LearnerEval(), parts(4, resumed={**resumed, "eval_version": 8, "eval_update": 8},
                                                      log=log, accuracies=[0.7]))):
        ev.parts.updates = lambda: 8
        if isinstance(ev, WorkerEvaluation):
            ev.book.open = lambda version, now: opened.append(version)
        asyncio.run(ev.start(10))
        assert (ev.last.version, ev.last.accuracy) == (10, 0.6) and ev.checkpoint_state()["eval_update"] == 8
    assert opened == [] and log == []


def test_a_checked_round_reports_the_checked_accuracy_everywhere():
    """One answer of three is not the held version's greedy one: it is left out, its worker
    quarantined, and the accuracy the log, the checkpoint and the Prometheus gauge show is over
    the two kept answers (0.5), not the round's raw 2/3."""
    p = parts(5)
    quarantined = []

    async def hold() -> int:
        return 3

    async def gaps(prompts, completions) -> list[float]:
        return [0.0, 5.0, 0.0]  # the second answer (sorted by prompt id) was written by its worker

    p.hold, p.greedy_gaps, p.encode = hold, gaps, lambda prompt: [1]
    p.quarantine = lambda worker_id, why: quarantined.append(worker_id)
    notes = []
    p.note = notes.append
    ev = WorkerEvaluation(WorkersEval(), p)
    ids = sorted(pr.id for pr in p.prompts[:3])
    result = EvalResult(3, 2 / 3, 3, 1.0, 2, 0, answers={ids[0]: ("a", [1]), ids[1]: ("liar", [1]), ids[2]: ("a", [1])},
                        scores={ids[0]: 1.0, ids[1]: 1.0, ids[2]: 0.0})

    async def run():
        await ev.start(3)
        ev.finished(result)
        await ev.checking

    asyncio.run(run())
    assert quarantined == ["liar"] and ev.last.accuracy == 0.5 and ev.last.prompts == 2
    # Re-asked (here: nobody else held the version), so left out; said apart from answered-again ones
    assert any("1 forged answers left out, 6 unanswered" in n for n in notes), notes
    assert p.metrics.eval_accuracy._value.get() == 0.5


def test_checked_rounds_rescore_near_ties_forge_on_unterminated_answers_and_never_record_unchecked():
    """A worker that loads the weights can pick, among near-tie tokens, the digits that make an
    answer right, and leave out the end-of-text token greedy decoding would add: a near-tie is
    scored by the learner's own greedy answer, an answer that stops short is a forgery. A round
    whose version the learner does not hold is never recorded; one nobody could finish is
    replaced by a round at the next publication."""
    log, quarantined, redecoded = [], [], []
    p = parts(eval_every=100, log=log)
    prompts = {q.id: q for q in p.prompts}
    ids = sorted(prompts)
    p.encode = lambda prompt: [1, 2]
    p.stop_ids, p.max_new_tokens, p.max_gap = frozenset({2}), 4, 1.0
    gaps = {ids[0]: 0.0, ids[1]: 0.6, ids[2]: 0.0, ids[3]: 5.0}  # honest, near-tie, unterminated, far off

    async def greedy_gaps(prompt_ids, completions):
        return [gaps.get(k, 0.0) for k in ids]

    async def redecode(qs):
        redecoded.extend(q.id for q in qs)
        return [0.0] * len(qs)  # the learner's own greedy answer is wrong

    async def hold():
        return 7

    p.greedy_gaps, p.redecode, p.hold = greedy_gaps, redecode, hold
    p.quarantine = lambda worker_id, why: quarantined.append((worker_id, why))
    ev = WorkerEvaluation(WorkersEval(), p)
    answers = {k: ("liar" if k in (ids[1], ids[2], ids[3]) else "honest", [5, 2]) for k in ids}
    answers[ids[2]] = ("liar", [5])  # no stop id, shorter than max_new_tokens

    async def run():
        await ev.start(7)
        ev.book.round = None
        ev.finished(EvalResult(7, 1.0, 8, 1.0, 2, 0, answers, {k: 1.0 for k in ids}))
        await ev.checking
        # forged answers are asked again; nobody answers, the round is abandoned, and the next
        # publication opens a round the learner holds (a hold per round)
        assert ev.book.round is not None and set(ev.book.round.pending) == {ids[2], ids[3]}
        ev.book.round, ev.book.abandoned = None, ev.book.round
        await ev.stepped(8, True, False)
        assert ev.book.version == 8 and ev.book.abandoned is None
        ev.finished(EvalResult(5, 1.0, 8, 1.0, 1, 0, {}, {}))  # a round of a version not held (7)

    asyncio.run(run())
    assert redecoded == [ids[1]]  # the near-tie, scored by the learner
    assert [w for w, _ in quarantined] == ["liar"] and "2 of its eval answers" in quarantined[0][1]
    assert not [e for e in log if e.get("event") == "eval"]  # nothing recorded: not v5, and v7 went back out


def test_an_eval_event_names_the_update_that_made_its_version_not_only_the_version():
    """After a resume the versions skip ahead of the updates (they restart at the newest published
    version + 1): an eval event's `step` is the update, as in the step records, and its `version`
    the version, so a plot of accuracy against steps puts the point where it belongs."""
    log, updates = [], [4]
    p = parts(5, resumed={"eval_accuracy": 0.3, "eval_version": 9}, log=log)  # carried over: no event
    p.updates = lambda: updates[0]
    learner = make_evaluation(LearnerEval(), p)
    workers = WorkerEvaluation(WorkersEval(), p)

    async def run():
        await learner.start(9)  # a resume after 4 updates, at v9
        await workers.start(9)
        updates[0] = 5
        await workers.stepped(10, True, True)

    asyncio.run(run())
    workers.finished(EvalResult(10, 0.5, 8, 1.0, 1, 0))  # no check configured: recorded, marked unchecked
    assert [(e["where"], e["step"], e["version"]) for e in log] == [("workers", 5, 10)]


def test_the_update_of_each_version_is_kept_for_the_recent_ones_only():
    from learner.evaluation import STEPS_KEPT

    ev = make_evaluation(LearnerEval(), parts(eval_every=0, accuracies=[0.1, 0.2]))

    async def run():
        await ev.start(0)
        for v in range(1, 3 * STEPS_KEPT):
            await ev.stepped(v, True, False)

    asyncio.run(run())
    assert len(ev._step_of) == STEPS_KEPT and max(ev._step_of) == 3 * STEPS_KEPT - 1


def test_a_resumed_run_keeps_the_eval_schedule_of_its_updates():
    """Resumed after update 20 with eval_every 30, its versions two ahead of its updates: a new
    user's run evaluated v52 and v60 on the workers (and v45, v96 for eval_every 50), never the
    30th update. Both variants now count updates."""
    updates = [20]
    p = parts(30, resumed={"eval_accuracy": 0.3, "eval_version": 22, "updates": 20}, accuracies=[0.4, 0.5, 0.6])
    p.updates = lambda: updates[0]
    learner = make_evaluation(LearnerEval(), p)
    workers = WorkerEvaluation(WorkersEval(), p)
    opened, evaluated = [], []
    book_open = workers.book.open
    workers.book.open = lambda version, now: (opened.append((updates[0], version)), book_open(version, now))

    async def run():
        await learner.start(22)
        await workers.start(22)
        for u in range(21, 71):
            updates[0] = u
            workers.book.round = None  # every round answered at once
            if await learner.stepped(u + 2, u % 2 == 0, u == 70) is not None:
                evaluated.append(u)
            await workers.stepped(u + 2, u % 2 == 0 or u == 70, u == 70)

    asyncio.run(run())
    assert evaluated == [30, 60, 70]
    assert opened == [(30, 32), (60, 62), (70, 72)]  # v22's eval came with the checkpoint


def test_a_resume_takes_its_checkpoints_eval_from_the_run_log_when_it_came_back_after_the_save(tmp_path):
    """The workers' eval of v20 came back after checkpoint 20 was written, so its state held the
    eval of v10, and the resume evaluated v20's weights again (a new user, 2026-12-07). The run
    log's event for update 20 is taken, unless a resume to an earlier update came after it (that
    attempt's update 20 had other weights)."""
    import json

    from learner.evaluation import with_logged_eval

    log = tmp_path / "metrics.jsonl"
    events = [{"event": "eval", "step": 10, "version": 10, "eval_accuracy": 0.3},
              {"step": 20, "version": 20, "loss": 0.1},
              {"event": "eval", "step": 20, "version": 20, "eval_accuracy": 0.43}]
    log.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "eval", "step": 20, "ver')  # cut by a kill
    saved = {"eval_accuracy": 0.3, "eval_version": 10, "eval_update": 10, "lr_resumed": 1e-3}
    got = with_logged_eval(saved, log, update=20)
    assert got == {**saved, "eval_accuracy": 0.43, "eval_version": 20, "eval_update": 20}
    assert with_logged_eval(saved, log, update=30) == saved  # no event of that update: evaluated again
    with log.open("a") as f:  # resumed from update 10 since: its update 20 is another's weights
        f.write("\n")
        f.write(json.dumps({"event": "resume", "step": 10, "version": 12}) + "\n")
    assert with_logged_eval(saved, log, update=20) == saved
    with log.open("a") as f:  # ...resumed from 20 itself (the same weights): still good
        f.write(json.dumps({"event": "eval", "step": 20, "version": 24, "eval_accuracy": 0.5}) + "\n")
        f.write(json.dumps({"event": "resume", "step": 20, "version": 30}) + "\n")
    assert with_logged_eval(saved, log, update=20)["eval_accuracy"] == 0.5


def test_an_environment_that_errs_in_a_learner_eval_is_said_and_training_goes_on():
    """An eval on the learner whose environment fails (`EpisodeError`, beyond what the start's
    check reached) ended the run in a traceback. Now the eval is said to have failed, logged as
    such, and the next eval is tried; the first accuracy stays unknown rather than made up."""
    from echo.episodes import EpisodeError

    log, notes, outcomes = [], [], [EpisodeError("the environment gave a non-finite reward nan"), 0.25]
    p = parts(1, log=log)
    p.note = notes.append

    async def evaluate():
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    p.evaluate = evaluate
    ev = make_evaluation(LearnerEval(), p)

    async def run():
        await ev.start(0)
        return await ev.stepped(1, True, False)

    assert asyncio.run(run()) == 0.25
    assert ev.first_accuracy is None and ev.last.version == 1
    assert [(e["event"], e["version"]) for e in log] == [("eval_failed", 0), ("eval", 1)]
    assert "non-finite reward" in log[0]["error"]
    assert notes[0].startswith("eval v0 failed, training goes on: the environment gave a non-finite reward")
