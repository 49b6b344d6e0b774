"""The learner's composition root: every part built once from the typed config, in order, then
handed to the loop (`learner.loop`) and stopped in order.

    trainer (its thread)  custody ledger  lease book + buffer  publisher  eval part ([eval] where)
    control API (its rooms)  scheduler ([scheduler] provider)  accounting  run record  loop
"""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

from broadcast.star import BlobStore
from echo import dirfiles
from learner.accounting import Accounting
from learner.admission import Waiters
from learner.advice import startup_notes
from learner.api import ControlApi, Run, link_table, worker_connections
from learner.buffer import AsyncBuffer, StalenessBuffer
from learner.config import LearnerConfig
from learner.driver import TrainerDriver
from learner.evaluation import EvalParts, make_evaluation, with_logged_eval
from learner.leases import LeaseBook, WorkerCap
from learner.ledger import Ledger, unique_ids
from learner.local_workers import LocalWorkers
from learner.loop import Loop
from learner.metrics import LearnerMetrics, RunLog
from learner.publisher import make_publisher
from learner.publishing import Publishing
from learner.record import RunRecord
from learner.rundir import RunDir
from learner.scheduling import make_fleet, make_provider, schedule
from learner.stalls import AgedOut, NoInstalls, NoSignal, ThinSignal, watch_buffer
from learner.status import StatusDisplay, banner
from learner.train.dist import World
from learner.verify import Rescorer
from scheduler.cost import Budget, CostMeter


async def serve(cfg: LearnerConfig, world: World, run_dir: RunDir, workers: LocalWorkers, as_json: bool) -> int:
    """Build the parts, run the loop, stop the parts. One straight sequence of ~70 lines: each
    line builds one part from those above it, so the order of their dependencies is the order read."""
    import torch

    torch.set_num_threads(cfg.run.threads)
    run_dir.create(cfg)
    driver = TrainerDriver(world)
    checkpoint = run_dir.checkpoint()
    trainer = await driver.build(cfg, checkpoint)
    resumed_after = trainer.updates if run_dir.resumed else None
    task = cfg.task.build()
    # The custody record: a resumed run re-issues what was in flight and never reuses a version.
    ledger, recovery = Ledger.open_run(run_dir / "ledger.jsonl", trainer.version, run_dir.resumed)
    reissued_at_resume = len(recovery.pending)  # (the lease book takes them)
    if recovery.newest_published > trainer.version:  # the checkpoint's version had these weights; later ones were lost
        await driver.call("skip_to", recovery.newest_published + 1)
    S, G, b = cfg.buffer.max_staleness, cfg.trainer.batch_prompts, cfg.broadcast
    book = LeaseBook(unique_ids(task.train_prompts(cfg.run.seed + trainer.version), recovery.starts),
                     cfg.server.lease_ttl, cfg.server.max_inflight_prompts or (S + 1) * G,
                     retry=recovery.pending, on_lease=ledger.leased, per_worker=WorkerCap.of(cfg.server))
    buffer = AsyncBuffer(StalenessBuffer.from_section(
        cfg.buffer, G, seed=cfg.run.seed,
        on_drop=lambda group, reason: group.prompt and book.recycle(group.prompt),  # dropped: issue it again
        skip_uniform=cfg.dynamic_sampling,  # skipped: its prompt is done, as if trained now
        on_skip=lambda group: ledger.trained(driver.version, [group.prompt_id])))
    run, links = Run(BlobStore(keep=cfg.publish.keep), version=trainer.version), link_table(b)
    metrics, waiters, cost = LearnerMetrics(), Waiters(), CostMeter(cfg.scheduler.learner_price_per_hour)
    display, log = StatusDisplay(cfg.run.steps, enabled=not as_json), RunLog(run_dir / "metrics.jsonl")

    publisher = make_publisher(b, run.blobs, links, key_file=run_dir / "learner.key", host=cfg.server.host,
                               connection_limits=worker_connections(cfg.server),  # 21,000 on one address filled its fds
                               reports_s=3 * cfg.server.heartbeat_interval, publish_every=cfg.publish_every)
    await publisher.start()
    eval_prompts = task.eval_prompts()[: cfg.eval.limit or None]
    resumed = with_logged_eval(trainer.resumed, log.path, trainer.updates) if run_dir.resumed else trainer.resumed
    evaluation = make_evaluation(cfg.eval, EvalParts(
        eval_prompts, cfg.run.eval_every, resumed, cost, metrics, log=log.write, note=display.note, run=run,
        changed=waiters.wake_all, evaluate=partial(driver.call, "evaluate", task, eval_prompts),
        lease_ttl=cfg.server.lease_ttl, hold=partial(driver.call, "hold_for_eval"),
        greedy_gaps=partial(driver.call, "greedy_gaps"), encode=trainer.encode, max_gap=cfg.verify.max_eval_logit_gap,
        redecode=partial(driver.call, "held_greedy_returns"), stop_ids=frozenset(trainer.episodes.stop_ids),
        max_new_tokens=cfg.rollout.max_new_tokens, updates=lambda: driver.updates,
        metric="mean return" if task.episodic else "accuracy"))
    # Scores eval answers always, and replays [verify] rescore_fraction of the uploaded episodes (the verifier picks).
    rescore = Rescorer(task, trainer.tokenizer, cfg.verify.reward_tolerance, episodes=trainer.episodes)
    # The task's own model directories (poker's LLM opponent), served to workers without the same copy.
    task_dirs = {option: (Path(d), await asyncio.to_thread(dirfiles.digest, Path(d))) for option, d in task.model_dirs().items()}
    api = ControlApi(cfg, run_dir.token, run=run, buffer=buffer, lease_book=book, encode=trainer.encode,
                     vocab_size=trainer.vocab_size, model_dir=cfg.model.path, links=links, metrics=metrics,
                     waiters=waiters, evals=evaluation.book, on_eval=evaluation.finished, rescore=rescore,
                     broadcast=publisher.info, tickets=publisher.tickets,
                     placements=getattr(publisher, "forwarding", None), on_note=display.note, rollout=trainer.rollout_params(),
                     lora=trainer.lora_info(keep=cfg.buffer.max_staleness + 2), machine_key=run_dir.machine_key,
                     task_dirs=task_dirs)
    evaluation.parts.quarantine = lambda worker_id, why: api.registry.quarantine_id(worker_id, "eval", why)
    publisher.gate_pulls(api.registry.address_of, copies=2 * cfg.server.max_workers_per_address)  # as the star's downloads
    url = await api.start(cfg.server.host, run_dir.port(cfg.server.port), reap_every=min(1.0, cfg.server.lease_ttl / 4))
    # The scheduler comes once the address is known: its provider hands it to the machines it starts.
    provider = make_provider(cfg, url, run_dir.machine_key, run_dir.path) if cfg.scheduled else None
    try:
        fleet = None if provider is None else make_fleet(cfg, provider, run_dir.machine_key, run_dir.path)
        api.registry.fleet = fleet
        display.banner(banner(cfg, url, run_dir, run_dir.token, trainer.num_parameters, world.size, len(eval_prompts)))
        run_dir.announce(url)
        if run_dir.resumed:
            display.note(recovery.note(trainer.updates, cfg.run.steps, checkpoint))
            if lr := trainer.resumed.get("lr_resumed"):
                display.note(f"the learning-rate schedule spans [run] steps = {cfg.run.steps} now: update "
                             f"{trainer.updates + 1} runs at {lr['now']:.3g} (the checkpoint's schedule had {lr['was']:.3g})")
            # what the killed process logged after the checkpoint is redone from here: readers drop it
            log.write({"event": "resume", "step": trainer.updates, "version": trainer.version,
                       "checkpoint": checkpoint.name if checkpoint else None})

        accounting = Accounting(cost, b.done_fraction, registry=api.registry, publisher=publisher, metrics=metrics,
                                fleet=fleet, budget=Budget(cfg.scheduler.max_total_dollars), group_size=cfg.rollout.group_size)
        record = RunRecord(log, display, as_json, metrics=metrics, buffer=buffer, leases=book, registry=api.registry)
        publishing = Publishing(publisher, driver=driver, run=run, registry=api.registry, ledger=ledger,
                                accounting=accounting, metrics=metrics)
        loop = Loop(cfg, run_dir.path, driver=driver, buffer=buffer, run=run, ledger=ledger, leases=api.leases,
                    registry=api.registry, publishing=publishing, evaluation=evaluation, accounting=accounting,
                    record=record)
        await loop.begin()
        workers.spawn(url)
        for said in startup_notes(cfg):
            display.note(said)
        stalls = NoInstalls(60.0, display.note, run_dir / "workers")
        background = [api.reaping, asyncio.create_task(workers.watch()),
                      asyncio.create_task(stalls.watch(api.registry, run))]
        watched = []
        if cfg.dynamic_sampling:  # every group skipped for equal rewards: say why no batch fills; most: what it does
            watched += [NoSignal(8 * G, display.note), ThinSignal(16 * G, display.note)]
        if cfg.staleness_bound:  # much of the work dropped as too stale: say so, and what to change
            watched.append(AgedOut(16 * G, display.note, cfg.staleness_bound, cfg.publish_every))
        if watched:
            background.append(asyncio.create_task(watch_buffer(buffer.buffer, watched)))
        if fleet is not None:
            background.append(asyncio.create_task(schedule(fleet, api.registry, cfg.scheduler.tick_s, log.write,
                                                           display.note)))
        await loop.train(background)
        await loop.end()

        await workers.stop(api.registry, grace=2 * cfg.server.heartbeat_interval + 3)
        if provider is not None:
            await asyncio.to_thread(provider.close)  # waits for processes: not on the event loop
        await publisher.stop()
        await api.stop()
        summary = record.summary(run_dir, driver.updates, evaluation.first_accuracy, evaluation.last, cost.summary())
        summary["eval_metric"] = "mean return" if task.episodic else "accuracy"  # what eval_accuracy_* hold
        if resumed_after is not None:  # `steps` is the run's; wall time, groups and cost are this process's
            summary["resumed_after_update"] = resumed_after
            summary["resume_reissued"] = reissued_at_resume  # in flight or rolled back when the run stopped
        if loop.stopped:
            summary["stopped"] = loop.stopped
        if provider is not None and hasattr(provider, "destroyed"):
            summary["instances_destroyed"] = list(provider.destroyed)
        record.finish(run_dir, summary)
        return 0
    finally:
        # Interrupted (Ctrl-C, SIGTERM) as well: the machines it started go too. The demo's local
        # workers outlived the learner, retrying it forever; a market's would bill on.
        if provider is not None:  # a second close (after the end's) finds nothing left to stop
            await asyncio.to_thread(provider.close)
