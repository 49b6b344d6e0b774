"""The eval room: workers' answers to eval leases, scored here.

    POST /v1/eval   an eval lease's rewards (learner.evals), with the completions to score them by

With `[eval] where = "workers"` the learner's `EvalBook` hands out eval leases (the lease room,
without the answers) and collects the completions here, which the learner scores itself
(`score`: a `Rescorer`); the rewards a worker sends mean nothing. Each finished round goes to
`on_result`, which checks the completions are the version's greedy ones
(`learner.evaluation`). With `where = "learner"` there is no book and this route answers 409.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor

from aiohttp import web

from echo import protocol as P
from echo.wire import Rejected
from learner.api.http import Auth, continue_later, json_error, read_body, reply
from learner.api.run import Run
from learner.api.workers import WorkerInfo
from learner.config import LearnerConfig
from learner.evals import EvalBook
from learner.metrics import LearnerMetrics


class EvalRoom:
    def __init__(self, cfg: LearnerConfig, book: EvalBook | None, *, run: Run, metrics: LearnerMetrics,
                 vocab_size: int, offload: Executor, rescore=None, on_result=lambda result: None):
        self.max_tokens = cfg.rollout.max_new_tokens
        self.book, self.run, self.metrics = book, run, metrics
        self.vocab_size, self.offload, self.rescore, self.on_result = vocab_size, offload, rescore, on_result

    def reap(self, now: float, alive: list[WorkerInfo]) -> None:
        """Expired eval leases' prompts go back; a round nobody alive can answer restarts at the newest version."""
        if self.book is not None:
            self.book.expire(now, {w.id: w.version for w in alive if w.active}, self.run.published_version)

    def routes(self, auth: Auth) -> list[web.RouteDef]:
        async def eval_results(request: web.Request) -> web.Response:
            worker = auth.worker(request)
            req = await read_body(request, P.EvalSubmission, self.metrics.rejected)
            if worker.quarantined:
                return json_error(403, "quarantined", f"this worker is quarantined: {worker.quarantined}")
            if self.book is None:
                return json_error(409, "no-eval", "this learner evaluates on itself ([eval] where = 'learner')")
            try:
                self.book.check(worker.id, req.lease_id, req.version, req.rewards)  # before any scoring work
                rewards = await self.score(req)  # the learner's own scores: workers never see the answers
                result = self.book.submit(worker.id, req.lease_id, req.version, rewards, time.monotonic(),
                                          req.completions)
            except Rejected as e:
                if e.reason != "answered":  # a backup's or its original's late answer: by design, no fault
                    self.metrics.rejected.labels(f"eval-{e.reason}").inc()
                return json_error(e.status, e.reason, e.message)
            if result is not None:  # checked and recorded (the accuracy gauge too) by learner.evaluation
                self.on_result(result)
            return reply(P.EvalReply(accepted=len(req.rewards)))

        return [web.post("/v1/eval", eval_results, expect_handler=continue_later)]

    async def score(self, req: P.EvalSubmission) -> dict[str, float]:
        prompts = self.book.prompts
        if set(req.completions) != set(req.rewards) or not set(req.completions) <= set(prompts):
            raise Rejected(422, "wrong-prompts", "send the completion token ids of exactly the eval lease's prompts "
                                                 "(`completions`), one per reward")
        for pid, ids in req.completions.items():
            if not 0 < len(ids) <= self.max_tokens or min(ids) < 0 or max(ids) >= self.vocab_size:
                raise Rejected(422, "bad-token", f"eval completion {pid!r}: 1..{self.max_tokens} token ids "
                                                 f"in [0, {self.vocab_size})")
        ids = list(req.completions)
        truth = await asyncio.get_running_loop().run_in_executor(
            self.offload, self.rescore.score, [(prompts[k], req.completions[k]) for k in ids])
        return dict(zip(ids, truth))
