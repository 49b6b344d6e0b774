"""Where eval rounds run, picked once from `[eval] where` (a tagged union: `learner.config.EvalSection`).

    workers  greedy, version-stamped eval leases (`learner.evals.EvalBook`, served by the control
             API); a round opens at the first publication after the run's updates pass a multiple of
             `[run] eval_every` (updates, not versions: a resume's versions skip ahead), and the last version's round is waited for before the run stops. The
             trainer holds the round's version aside (`Trainer.hold_for_eval`), and every answer
             is checked in one teacher-forced pass to be that version's greedy completion: an
             answer a worker wrote itself (a token far below the best, or one that stops where
             greedy decoding would not) quarantines its worker, and its prompt is asked again of
             the others (up to `REASKS` times; after that it is left out and counted). An answer
             whose tokens are near-ties (within `max_gap` but not the best, as bf16 numerics can
             make honest ones) is scored by the learner's own greedy answer instead: a near-tie is
             also where a worker could pick the right digit. A round nobody alive can finish is
             abandoned and the next one opened at the next publication: never a round the learner
             holds no copy of, whose answers it could not check. A round's last leases are backed
             up by other workers on its version, so one that sits on a lease does not hold it up
    learner  the trainer evaluates between steps on its own thread, every rank together (tiny models;
             multi-turn tasks, whose returns only the learner's environment scores)

Both keep the newest result, the first accuracy (across a resume) and what a checkpoint saves,
and count each accuracy in the cost of improvement. The loop calls `start`, `stepped` and `finish`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from echo.chat import ChatError
from echo.episodes import EpisodeError
from echo.tasks import Prompt
from learner.addresses import remember
from learner.api.run import Run
from learner.config import EvalSection, LearnerEval, WorkersEval
from learner.evals import EvalBook, EvalResult
from learner.metrics import LearnerMetrics
from scheduler.cost import CostMeter


@dataclass
class EvalParts:
    """What an eval part may use; each variant takes what it needs."""

    prompts: list[Prompt]
    eval_every: int  # [run] eval_every (0: only the start and the end)
    resumed: dict  # the checkpoint's saved eval state ({} on a fresh run)
    cost: CostMeter
    metrics: LearnerMetrics
    log: Callable[[dict], None]  # a run-log event
    note: Callable[[str], None]  # a line for the operator
    run: Run
    changed: Callable[[], None]  # wake every waiting lease request
    evaluate: Callable[[], Awaitable[float]]  # accuracy of the trainer's current weights, on its thread
    lease_ttl: float
    hold: Callable[[], Awaitable[int]] | None = None  # the trainer keeps its current weights aside; returns their version
    greedy_gaps: Callable[[list, list], Awaitable[list[float]]] | None = None  # per answer, logits below the argmax
    encode: Callable[[Prompt], list[int]] | None = None  # prompt -> token ids, as the workers were sent them
    quarantine: Callable[[str, str], None] = lambda worker_id, why: None
    max_gap: float = 1.0  # [verify] max_eval_logit_gap
    redecode: Callable[[list[Prompt]], Awaitable[list[float]]] | None = None  # greedy returns under the held version
    stop_ids: frozenset[int] = frozenset()  # the ids that end a turn: a greedy answer ends on one...
    max_new_tokens: int = 0  # ...or is this long
    updates: Callable[[], int] | None = None  # the trainer's update count (a resume's versions skip ahead of it)
    metric: str = "accuracy"  # what an eval's number is ("mean return": an episodic task's), named in its event


STEPS_KEPT = 1024  # versions whose update is remembered for eval events: no round lags that far
REASKS = 2  # times a round's forged answers are asked again of other workers before they are left out
TIE_LOGITS = 0.05  # a token this far below the best is a near-tie: the learner re-decodes the prompt itself


class Evaluation:
    book: EvalBook | None = None  # the eval leases the control API serves (workers only)

    def __init__(self, parts: EvalParts):
        self.parts = parts
        self.last: EvalResult | None = None
        self.first_accuracy: float | None = parts.resumed.get("first_eval_accuracy")
        self._step_of: dict[int, int] = {}  # version -> the update that made it

    def _updates(self, version: int) -> int:
        """The run's updates so far, which `[run] eval_every` counts: after a resume, versions skip
        numbers (a schedule by versions evaluated at v52 and v60 for eval_every 30, not at 30)."""
        return self.parts.updates() if self.parts.updates is not None else version

    def _made(self, version: int) -> None:
        # Bounded: an entry per update, for the run's whole length, was a week's growth
        remember(self._step_of, version, self._updates(version), keep=STEPS_KEPT)

    def _event(self, version: int, **fields) -> dict:
        """An eval event of the run log. Its `step` is the update that made `version`, as in the
        step records: after a resume, whose versions skip ahead, the two differ."""
        return {"event": "eval", "step": self._step_of.get(version, version), "version": version,
                "metric": self.parts.metric, **fields}

    def _carried(self, version: int) -> bool:
        """A resume from a checkpoint whose eval was of these very weights: its result carries over,
        shown and counted but not evaluated again nor logged again (the run log has its event)."""
        resumed = self.parts.resumed
        if resumed.get("eval_accuracy") is None:
            return False
        if "eval_update" in resumed:  # a killed run's resume numbers its versions past the lost ones: by update
            if resumed["eval_update"] != self._updates(version):
                return False
        elif resumed.get("eval_version") != version:
            return False
        accuracy = resumed["eval_accuracy"]
        self.last = EvalResult(version, accuracy, 0, 0.0, 0, 0)
        self.parts.cost.record_eval(accuracy)
        self.parts.metrics.eval_accuracy.set(accuracy)
        self.parts.note(f"eval v{version}: {accuracy:.3f} (from the checkpoint, which evaluated these weights)")
        return True

    @property
    def prompts(self) -> list[Prompt]:
        return self.parts.prompts

    def checkpoint_state(self) -> dict:
        last = self.last
        return {"eval_accuracy": last.accuracy if last else None, "eval_version": last.version if last else None,
                "eval_update": self._step_of.get(last.version) if last else None,
                "first_eval_accuracy": self.first_accuracy}

    def finished(self, result: EvalResult) -> None:
        """A round of eval leases came back (only where = "workers" hands them out)."""

    async def start(self, version: int) -> None:
        """Evaluate the first published version."""

    async def stepped(self, version: int, published: bool, last: bool) -> float | None:
        """After an update (`published`: it was published; `last`: the run's last); an accuracy computed now."""

    async def finish(self, version: int) -> None:
        """Training is over: the last version's eval, if it is still to come."""


class WorkerEvaluation(Evaluation):
    def __init__(self, section: WorkersEval, parts: EvalParts):
        super().__init__(parts)
        self.final_timeout_s = section.final_timeout_s
        self.book = EvalBook(parts.prompts, parts.lease_ttl, section.prompts_per_lease, lifetime=3 * parts.lease_ttl)
        self.opened_update = 0  # the run's updates when the newest round opened
        self.held = -1  # the version the trainer holds aside for checking answers
        self.checking: asyncio.Task | None = None  # the check of a finished round, on the trainer thread
        self.forged = 0  # answers over the run that were not the version's greedy completion
        self.check_s = 0.0  # the last round's teacher-forced check, seconds on the trainer thread
        self.reasks = 0  # times the open round's forged answers were asked again
        self.round_forged = 0  # forged answers found in the open round, re-asks included
        self.round_redecoded = 0  # near-tie answers the learner scored by its own greedy answer

    async def _open(self, version: int) -> None:
        if self.checking is not None:  # its check needs the held version: let it finish first
            await self.checking
        if self.parts.hold is not None:
            self.held = await self.parts.hold()
        self.book.open(version, time.monotonic())
        self.opened_update = self._updates(version)
        self.reasks = self.round_forged = self.round_redecoded = 0

    def finished(self, result: EvalResult) -> None:
        """A round came back: check its answers (on the trainer thread), then record it."""
        if self.parts.greedy_gaps is None:  # nothing to check with: recorded, and marked unchecked
            self._record(replace(result, answers={}, scores={}), checked=False)
        elif result.version != self.held:  # never recorded: an unchecked accuracy is what a forger would write
            self.parts.note(f"eval v{result.version}: not recorded, the learner holds v{self.held} to check against")
        else:
            self.checking = asyncio.get_running_loop().create_task(self._check(result))

    async def _check(self, result: EvalResult) -> None:
        ids = sorted(result.answers)
        prompts = {p.id: p for p in self.prompts}
        started = time.monotonic()
        gaps = await self.parts.greedy_gaps([self.parts.encode(prompts[k]) for k in ids],
                                            [result.answers[k][1] for k in ids])
        self.check_s = time.monotonic() - started  # on the trainer thread: it delays the next step this long
        gaps = [gap if self._terminated(result.answers[k][1]) else float("inf") for k, gap in zip(ids, gaps)]
        forged = {k: g for k, g in zip(ids, gaps) if g > self.parts.max_gap}
        disputed = [k for k, g in zip(ids, gaps) if TIE_LOGITS < g <= self.parts.max_gap]
        if disputed and self.parts.redecode is not None:  # scored by the learner's own greedy answers
            own = await self.parts.redecode([prompts[k] for k in disputed])
            result.scores.update(zip(disputed, own))
            self.round_redecoded += len(disputed)
        by_worker: dict[str, list[float]] = {}
        for k, gap in forged.items():
            by_worker.setdefault(result.answers[k][0], []).append(gap)
        for worker_id, worker_gaps in by_worker.items():
            worst = (f"a token {max(worker_gaps):.2f} logits below the best; allowed {self.parts.max_gap}"
                     if max(worker_gaps) < float("inf") else "one stops where greedy decoding would go on")
            self.parts.quarantine(worker_id, f"{len(worker_gaps)} of its eval answers for v{result.version} are not "
                                             f"that version's greedy completions ({worst})")
        self.forged += len(forged)
        self.round_forged += len(forged)
        verified = {k: v for k, v in result.scores.items() if k not in forged}  # a re-asked round's earlier scores too
        self.checking = None
        if forged and self.reasks < REASKS and self.book.round is None:
            # An accuracy over fewer prompts is another eval set's: the forged ones go to the others.
            self.reasks += 1
            self.book.reask(result, sorted(forged), verified, set(result.answered_by) - set(by_worker), time.monotonic())
            self.parts.note(f"eval v{result.version}: {len(forged)} forged answers asked again of other workers")
            self.parts.changed()
            return
        accuracy = sum(verified.values()) / len(verified) if verified else 0.0
        self._record(replace(result, accuracy=accuracy, prompts=len(verified), answers={}, scores={}),
                     checked=True, forged=self.round_forged)

    def _terminated(self, completion: list[int]) -> bool:
        """Does `completion` stop where greedy decoding stops: on a stop id, or at the token budget?"""
        if not self.parts.stop_ids or not completion:
            return True
        return completion[-1] in self.parts.stop_ids or len(completion) >= self.parts.max_new_tokens

    def _record(self, result: EvalResult, checked: bool, forged: int = 0) -> None:
        self.last = result
        self.parts.metrics.eval_accuracy.set(result.accuracy)  # the checked accuracy, not the round's raw one
        self.first_accuracy = result.accuracy if self.first_accuracy is None else self.first_accuracy
        self.parts.cost.record_eval(result.accuracy)
        self.parts.log(self._event(result.version, eval_accuracy=result.accuracy, where="workers", prompts=result.prompts,
                                   seconds=round(result.seconds, 3), waited=round(result.waited, 3),
                                   workers=result.workers, restarts=result.restarts,
                                   checked=checked, forged=forged, redecoded=self.round_redecoded if checked else 0,
                                   backups=result.backups, barred=len(self.book.barred),
                                   check_s=round(self.check_s, 4) if checked else None))
        self.parts.note(f"eval v{result.version}: {result.accuracy:.3f} ({result.prompts} prompts on "
                        f"{result.workers} worker{'s' if result.workers != 1 else ''}, {result.seconds:.1f} s"
                        # v0's round opens before any worker holds v0: its 20 s were mostly the wait (a new user)
                        + (f" of which {result.waited:.1f} s waiting for a worker on v{result.version}"
                           if result.waited >= 1.0 else "")
                        + (f", {result.restarts} restarts" if result.restarts else "")
                        + (f", {forged} forged answers " + ("answered again by others" if result.prompts == len(self.prompts)
                                                            else f"left out, {len(self.prompts) - result.prompts} unanswered")
                           if forged else "")
                        + (f", {self.round_redecoded} near-ties re-decoded here" if checked and self.round_redecoded else "")
                        + ("" if checked else ", answers not checked")
                        + ")")

    async def start(self, version: int) -> None:
        self._made(version)
        if self._carried(version):
            self.opened_update = self._updates(version)  # the schedule goes on from the checkpoint's update
            return
        await self._open(version)

    async def stepped(self, version: int, published: bool, last: bool) -> float | None:
        self._made(version)
        every, updates = self.parts.eval_every, self._updates(version)
        due = every and updates // every > self.opened_update // every  # a multiple of every passed since
        due = due or self.book.abandoned is not None  # nobody could finish the last one: evaluate this one
        if published and (last or (due and self.book.round is None)):
            await self._open(version)
            self.parts.changed()  # waiting workers holding this version can evaluate it
        return None

    async def finish(self, version: int) -> None:
        """Serve the workers until the last version's eval round is answered (or the timeout):
        they generate nothing else meanwhile."""
        self.parts.run.training_done = True
        self.parts.changed()
        deadline = time.monotonic() + self.final_timeout_s
        while (self.last is None or self.last.version < version) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.last is None or self.last.version < version:
            r = self.book.round
            answered = len(r.rewards) if r else 0
            self.parts.note(f"eval of v{version} incomplete after {self.final_timeout_s:.0f} s "
                            f"({answered}/{len(self.book.prompts)} answered; are workers holding v{version}?)")


class LearnerEvaluation(Evaluation):
    def __init__(self, section: LearnerEval, parts: EvalParts):
        super().__init__(parts)

    def _record(self, version: int, accuracy: float, seconds: float) -> None:
        """Every eval, the first included, is an event of the run log and a line for the
        operator, as on the workers."""
        self.last = EvalResult(version, accuracy, 0, seconds, 0, 0)
        self.parts.cost.record_eval(accuracy)
        self.parts.metrics.eval_accuracy.set(accuracy)
        self.parts.log(self._event(version, eval_accuracy=accuracy, where="learner", seconds=round(seconds, 3)))
        self.parts.note(f"eval v{version}: {accuracy:.3f} (on the learner, {seconds:.1f} s)")

    async def _evaluate(self, version: int) -> float | None:
        started = time.monotonic()
        try:
            accuracy = await self.parts.evaluate()
        except (EpisodeError, ChatError) as e:
            # The task's environment, not the model: a week's run does not end in a traceback for
            # it. No accuracy is recorded; the next eval tries again.
            self.parts.log({**self._event(version, where="learner"), "event": "eval_failed", "error": str(e)[:500]})
            self.parts.note(f"eval v{version} failed, training goes on: {e} (the task's environment erred "
                            f"while the model played it; fix the environment, then resume)")
            return None
        self._record(version, accuracy, time.monotonic() - started)
        return accuracy

    async def start(self, version: int) -> None:
        self._made(version)
        accuracy = self.last.accuracy if self._carried(version) else await self._evaluate(version)
        self.first_accuracy = self.parts.resumed.get("first_eval_accuracy", accuracy)

    async def stepped(self, version: int, published: bool, last: bool) -> float | None:
        self._made(version)
        every = self.parts.eval_every
        if not (last or (every and self._updates(version) % every == 0)):
            return None
        return await self._evaluate(version)  # the step's record carries it too


EVALUATIONS = {"workers": WorkerEvaluation, "learner": LearnerEvaluation}


def with_logged_eval(resumed: dict, run_log: Path, update: int) -> dict:
    """The checkpoint's state (`resumed`), with its own weights' eval taken from the run log where
    the checkpoint was saved before that eval came back: a round on the workers ends after the
    checkpoint of its version is written, so a resume evaluated those weights again (a new user,
    2026-12-07). An event from before a resume to an earlier update is not taken: that attempt's
    update of the same number had other weights."""
    if resumed.get("eval_update") == update or not run_log.exists():
        return resumed
    found = None
    with run_log.open() as lines:
        for line in lines:
            if '"event": "resume"' not in line and '"event": "eval"' not in line:
                continue  # steps, most of a long run's log: not parsed
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # the line a kill cut short (as `echo.report` skips it)
                continue
            if event.get("event") == "resume" and event.get("step", -1) < update:
                found = None
            elif event.get("event") == "eval" and event.get("step") == update and event.get("eval_accuracy") is not None:
                found = event
    if found is None:
        return resumed
    return {**resumed, "eval_accuracy": found["eval_accuracy"], "eval_version": found["version"], "eval_update": update}


def make_evaluation(section: EvalSection, parts: EvalParts) -> Evaluation:
    """The eval part `[eval] where` names."""
    return EVALUATIONS[section.where](section, parts)
