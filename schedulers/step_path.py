"""One step of a job, from its orders to its statistics: run to the barrier, release, failures.

For each step the controller sends every stage actor its program (and the
micro-batches the first and last stage need) as a :class:`~stages.StepOrder`, and
the stages run it up to the accumulation barrier and then the step's tail
themselves. :class:`StepPath` waits for them, makes the same decision from the same
numbers (for the statistics and the fp16 loss scale), and turns a stage that failed,
a node that was lost or a step that outlived its timeout into a
:class:`~actors.StepFailed` that names the stage, the action and the cause, after
every stage aborted the step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from actors import ActorError, ActorLost, NodeLost, StageLost, StepFailed, error_from_wire
from stages import batch_size, FinishReport, ReduceReport, StageActor, StageReport, StepOrder
from stages.compute.agreement import decide_votes, vote_of
from schedulers.events import JobFailed, SchedulePlanned
from schedulers.job_core import JobCore
from schedulers.job_views import JobViews
from schedulers.planning import NoScheduleFits
from schedulers.records import Candidate, StepStats
from schedulers.stepping import (
    describe_findings, nonfinite_failed, nonfinite_findings, stage_lost, step_calls, step_failed, step_stats,
)

__all__ = ["LOSS_GRACE_S", "Dispatched", "StepPath"]

log = logging.getLogger(__name__)

# How long a step whose reduction failed waits for the failure detector to name a lost node
# (the head's heartbeat timeout, 2 s by default, and a margin): see StepPath._lost_instead.
LOSS_GRACE_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class Dispatched:
    """A step whose orders are out (:meth:`StepPath.dispatch`): its number, its calls and what its statistics need."""

    step: int
    inputs: Any
    started: float  # perf_counter when its orders went out
    used_scale: float
    ran: str
    tasks: dict[int, asyncio.Future[StageReport]]


class StepPath:
    """Attempts a job's steps on its stages; keeps what the last release reported."""

    def __init__(self, job: JobCore, views: JobViews) -> None:
        self.job = job
        self.views = views
        self.tied: list[tuple[str, ...]] = []  # parameters shared across pipeline ranks, as the stages report
        self.grad_norm: float | None = None  # the last step's
        self.reduce_wait_s: list[float] = []  # the last release's, per stage actor

    async def attempt(self, inputs: Any, targets: Any) -> StepStats:
        """One try at applying step ``job.applied``, under a step number of its own (never reused).

        Raises:
            NodeLost: a node of the job was lost during the step.
            StepFailed: a stage failed or the step timed out; nothing was applied (or, failed
                while the stages applied it, the job is marked diverged).
            NoScheduleFits: ``schedule="auto"`` found nothing that fits ``max_stash_bytes``.
        """
        return await self.collect(self.dispatch(inputs, targets))

    def dispatch(self, inputs: Any, targets: Any, *, after: Dispatched | None = None) -> Dispatched:
        """Sends a step's orders to every stage actor (see :meth:`attempt`); :meth:`collect` waits for them.

        Args:
            after: the step in flight: this one, from the data factory, goes out before that one's
                answers are in (where :meth:`may_step_ahead`), one data position past it. Each stage
                actor takes the order as soon as it has finished the step before (its mailbox holds
                it meanwhile), so the round trip to the head leaves the step's critical path; a stage
                that did not apply ``after`` does not begin it (:attr:`~stages.StepOrder.after`).
        """
        job = self.job
        step = job.attempted()
        position = job.applied + 1 if after is not None else job.applied
        calls = step_calls(job.spec, position, inputs, targets)
        for call in calls.values():
            if after is not None:
                call["after"] = after.step
            if job.spec.parallelism.micro_batches != job.stage_micro_batches:
                call["micro_batches"] = job.spec.parallelism.micro_batches
            faults = job.spec.fault_tolerance
            if faults.max_restarts and (job.snapshot_due or position % faults.snapshot_every == 0):
                call["snapshot"] = position
            if job.scaler is not None:
                call["loss_scale"] = job.scaler.scale
            if job.spec.parallelism.schedule == "auto":  # the plan turns W batching on or off per step
                call["w_batching"] = job.auto.running_w_batching(job.spec)
            # The stages run the tail themselves (one answer per step), except on the step that
            # schedule="auto" plans from: there nothing applies before the plan fits max_stash_bytes.
            call.update(self.tail_order() if not job.auto.timed else {})
        return Dispatched(step=step, inputs=inputs, started=time.perf_counter(),
                          used_scale=job.scaler.scale if job.scaler is not None else 1.0,
                          ran=job.auto.running(job.spec), tasks=self.start_programs(step, calls, job.programs))

    def may_step_ahead(self) -> bool:
        """Whether the next step's orders may go out before this one's answers are in: nothing in them
        depends on how this step ends (no loss scale to update, no plan being measured, no snapshot,
        no recovery to replay from)."""
        job = self.job
        return (job.scaler is None and not job.auto.measuring and not job.auto.timed and job.broken is None
                and not job.spec.fault_tolerance.max_restarts and job.spec.training.data is not None)

    async def drop(self, dispatched: Dispatched) -> None:
        """Stops a step that :meth:`dispatch` sent ahead and that will not be collected."""
        try:
            await self.abort(dispatched.step, dispatched.tasks)
        finally:
            for task in dispatched.tasks.values():
                task.cancel()

    async def collect(self, dispatched: Dispatched, since: float | None = None) -> StepStats:
        """The step :meth:`dispatch` sent, once every stage has answered: its statistics (see :meth:`attempt`).

        Args:
            since: when the step before it ended, for a step sent ahead: its time counts from then.
        """
        job = self.job
        step, inputs = dispatched.step, dispatched.inputs
        started = dispatched.started if since is None else max(dispatched.started, since)
        used_scale, ran, ranked, planning_s = dispatched.used_scale, dispatched.ran, None, 0.0
        try:
            try:
                reports = await self.reports(step, dispatched.tasks)
                if job.auto.timed:  # schedule="auto": plan now, so that a max_stash_bytes nothing fits applies nothing
                    planning_s = time.perf_counter()
                    ranked = await self._rank_candidates(step, reports)
                    planning_s = time.perf_counter() - planning_s
                reduce_bytes, nonfinite, finished = await self._release(step, reports)
            except StepFailed as failure:
                if failure.action == "STEP":  # some stages may have stepped their optimizer and others not
                    job.diverged(f"step {step} failed while the stages applied it ({failure.message})")
                raise
        except StepFailed as failure:
            job.publish(JobFailed(job=job.id, step=step, error=str(failure)))
            raise
        elapsed = time.perf_counter() - started
        job.applied_one(reports)
        samples = batch_size(inputs) if inputs is not None else job.spec.training.data_kwargs.get("batch_size")
        stats = step_stats(job.spec, step, reports, elapsed, reduce_bytes,
                           samples if isinstance(samples, int) else None, nonfinite, finished)
        scaler = job.scaler
        predicted, error = job.auto.prediction(ran, elapsed)
        await self._after_probe(reports, elapsed - planning_s, ranked)
        return dataclasses.replace(stats, tied=[list(names) for names in self.tied], grad_norm=self.grad_norm,
                                   reduce_wait_s=list(self.reduce_wait_s),
                                   loss_scale=used_scale if scaler is not None else None,
                                   skipped_steps=scaler.skipped if scaler is not None else 0, schedule=ran,
                                   predicted_step_s=predicted, prediction_error=error)

    # -- schedule="auto" (schedulers.planning) -------------------------------------------------

    async def _rank_candidates(self, step: int, reports: list[StageReport]) -> list[Candidate]:
        """The timed probe step is at its barrier: simulate the candidates with its costs.

        Raises:
            NoScheduleFits: nothing fits ``max_stash_bytes``; the step is dropped on every stage.
        """
        job = self.job
        try:  # off the loop: simulating every candidate of a deep pipeline takes seconds
            return await asyncio.to_thread(job.auto.rank, job.spec, reports, job.mesh, step)
        except NoScheduleFits as exc:
            await self.abort(step, {})
            job.publish(JobFailed(job=job.id, step=step, error=str(exc)))
            raise

    async def _after_probe(self, reports: list[StageReport], step_time_s: float,
                           ranked: list[Candidate] | None) -> None:
        """After a probe step: take the clocks (after the warm-up) or adopt the plan (after the timed one)."""
        job = self.job
        if ranked is not None:
            job.auto.adopt(ranked, step_time_s - max(r.elapsed_s for r in reports))
            job.recompile()
            chosen = job.auto.chosen
            job.publish(SchedulePlanned(job=job.id, step=job.next_step, schedule=chosen.label if chosen else None,
                                        predicted_step_s=chosen.predicted_step_s if chosen else None))
        elif job.auto.measuring:
            job.auto.probed(reports, job.mesh)
            timed_next = job.auto.warmed_up()
            job.recompile()  # the next probe step's (with W batching or not)
            if timed_next:  # the clocks, for the link's speed; outside any step
                job.auto.offsets = await self.views.clock_offsets()

    async def run_programs(self, step: int, calls: dict[int, dict[str, Any]],
                           programs: Mapping[int, list[str]]) -> list[StageReport]:
        """Runs ``programs`` (by pipeline rank) as step ``step`` on every stage actor, each with its
        ``calls`` (by global rank), up to their barrier (an evaluation's: to their end); their reports.

        Raises:
            StepFailed, NodeLost: a stage failed, a node was lost or the step timed out; every
                stage aborted it.
        """
        return await self.reports(step, self.start_programs(step, calls, programs))

    def start_programs(self, step: int, calls: dict[int, dict[str, Any]],
                       programs: Mapping[int, list[str]]) -> dict[int, asyncio.Future[StageReport]]:
        """Sends :meth:`run_programs`' orders; the calls, by global rank, that :meth:`reports` waits for."""
        job = self.job
        return {
            rank: asyncio.ensure_future(job.stages[rank].endpoint(StageActor.run_step).call(
                StepOrder(step=step, program=programs[job.mesh.coords(rank).pipeline], **kwargs)))
            for rank, kwargs in calls.items()
        }

    async def reports(self, step: int, tasks: dict[int, asyncio.Future[StageReport]]) -> list[StageReport]:
        """The reports of step ``step``'s calls (see :meth:`run_programs`), by global rank.

        Raises:
            StepFailed, NodeLost: a stage failed, a node was lost or the step timed out; every
                stage aborted it.
        """
        job = self.job
        loop = asyncio.get_running_loop()
        deadline = loop.time() + job.spec.fault_tolerance.step_timeout_s
        try:
            pending: set[asyncio.Future[Any]] = set(tasks.values())
            failure: StepFailed | None = None
            while pending and failure is None:
                done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()),
                                                   return_when=asyncio.FIRST_COMPLETED)
                failure = self._first_failure(tasks) if done else await self._timeout_failure()
            if failure is not None and failure.action == "REDUCE" and not isinstance(failure, NodeLost):
                failure = await self._lost_instead(tasks, failure, deadline)
            reports = [] if failure else [tasks[rank].result() for rank in sorted(tasks)]
            if failure is None and not all(r.status == "done" for r in reports):
                failure = StepFailed("step aborted on request", details={"stage": None, "action": None,
                                                                          "cause": "aborted"})
            if failure is not None:
                await self.abort(step, tasks, failure.details.get("silent", ()))
                raise failure
            return reports
        except asyncio.CancelledError:  # the driver cancelled the step, or the job is closing
            await asyncio.shield(self.abort(step, tasks))
            raise
        finally:
            for task in tasks.values():
                task.cancel()

    async def _lost_instead(self, tasks: Mapping[int, asyncio.Future[Any]], failure: StepFailed,
                            deadline: float) -> StepFailed:
        """A stage whose reduction failed, in the tail it runs itself, most often lost a replica: the
        collective breaks the moment a peer process dies, before the head's failure detector has
        marked its node lost. Waits for that (at most :data:`LOSS_GRACE_S`) so that the step fails
        with ``NodeLost``, which a job with ``max_restarts`` recovers from, as it did when the
        reduction came after every stage's barrier; else the reduction's own failure.

        The wait ends at the first call that fails with ``NodeLost``: the lost stage's pipeline
        neighbours wait for tensors that never come, so waiting for every call took the whole
        grace (about 3 s past the detector) before each such recovery."""
        job = self.job
        loop = asyncio.get_running_loop()
        give_up = loop.time() + max(0.0, min(LOSS_GRACE_S, deadline - loop.time()))
        pending = {task for task in tasks.values() if not task.done()}
        while pending and not _lost_calls(tasks) and (left := give_up - loop.time()) > 0:
            _, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        lost = self._first_failure(_lost_calls(tasks))
        if lost is None and (alive := await job.alive_nodes()) and set(job.nodes) - alive:
            gone = sorted(set(job.nodes) - alive)[0]
            lost = NodeLost(f"node {gone} was lost during the step ({failure.message})",
                            details={**failure.details, "node": gone})
        return lost or failure

    def _first_failure(self, tasks: Mapping[int, asyncio.Future[Any]]) -> StepFailed | None:
        job = self.job
        for rank, task in tasks.items():
            if not task.done():
                continue
            exc = task.exception()
            if isinstance(exc, NodeLost):
                where = step_failed(job.mesh, rank, None, exc.message)
                return NodeLost(where.message, details={**where.details, "node": exc.node})
            if isinstance(exc, ActorLost):
                return stage_lost(job.mesh, rank, exc)
            if exc is not None:
                cause = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ActorError) else \
                    f"{exc.remote_type}: {exc.message}"
                return step_failed(job.mesh, rank, None, cause)
            report = task.result()
            if report.status == "failed":
                error = error_from_wire(report.error)
                return step_failed(job.mesh, rank, report.action, f"{error.remote_type}: {error.message}",
                                   error.remote_traceback)
        return None

    async def _timeout_failure(self) -> StepFailed:
        job = self.job
        # Hang forensics: where each stage is, which send or receive never matched, the marked grid.
        report, lines, silent = await self.views.hang_report()
        return StepFailed(
            f"step timed out after {job.spec.fault_tolerance.step_timeout_s}s:\n{report}",
            details={"stage": None, "action": None, "cause": "timeout", "where": lines, "silent": silent},
        )

    async def abort(self, step: int, tasks: Mapping[int, asyncio.Future[Any]], silent: Sequence[int] = ()) -> None:
        """Tells every stage to abort step ``step`` and waits (a while) for the calls in ``tasks`` to end.

        A stage in ``silent`` (global ranks) did not answer the hang report's question: it holds its
        interpreter, so it is told without waiting for a reply that would come only after the wait
        (which held a timed-out step's error back by 5 s).
        """
        job = self.job
        async def abort(rank: int) -> bool:
            ref = job.stages[rank]
            try:
                if rank in silent:
                    await ref.endpoint(StageActor.abort_step).tell(step)
                    return False
                await ref.endpoint(StageActor.abort_step, timeout=5).call(step)
                return True
            except ActorError as exc:
                log.info("abort of %s: %s", ref.name, exc)
                return False

        alive = await job.alive_nodes()
        reachable = [rank for rank, node in enumerate(job.nodes) if node in alive]
        for rank, node in enumerate(job.nodes):
            if node not in alive:  # told when (if) it comes back: see _check_members
                job.fence(rank, step)
        told = await asyncio.gather(*(abort(rank) for rank in reachable))
        # A stage that did not take the abort (its process ended, or it holds its interpreter) will not
        # end its step either: waiting for it only delays the error.
        waiting = [tasks[rank] for rank, ok in zip(reachable, told) if ok and rank in tasks]
        if waiting:
            await asyncio.wait(waiting, timeout=5)

    def tail_order(self) -> dict[str, Any]:
        """What a stage needs to decide the step's tail itself (see :mod:`stages.compute.agreement`)."""
        job = self.job
        scaler = job.scaler
        return {"finish": True, "max_norm": float(job.spec.optimization.gradient_clipping),
                "per_item": job.spec.training.loss_averaging == "tokens",
                "fp16": scaler is not None, "scale_at_floor": scaler is not None and scaler.dynamic and scaler.at_minimum}

    async def _release(self, step: int, reports: list[StageReport]) -> tuple[int, list[str], list[FinishReport]]:
        """The step's tail: every stage reduces and checks, then all step or none does.

        The stages ran it themselves when their reports carry it (``StepOrder.finish``); this
        makes the same decision from the same numbers, for the statistics and the loss scale.
        Otherwise it releases the barrier everywhere by calls of its own. One NaN or infinity
        in any loss or gradient, on any stage or replica, means no stage steps
        (``on_nonfinite``: the step raises, or is skipped and reported).

        Returns:
            The bytes the data-parallel reduction sent, the non-finite findings (empty
            when the step was applied), and every stage's report after the step.

        Raises:
            NonFiniteError: a finding, with ``on_nonfinite="raise"``; nothing was applied.
            StepFailed: a stage failed to reduce or step.
        """
        job = self.job
        ran_tail = all(r.reduced is not None and r.finished is not None for r in reports)
        reduced: list[ReduceReport] = [r.reduced for r in reports if r.reduced is not None] if ran_tail else \
            await self._on_every_stage(StageActor.reduce_step, "REDUCE", step)
        found = nonfinite_findings(job.mesh, reports, reduced)
        self.reduce_wait_s = [r.wait_s for r in reduced]
        self.tied = sorted({tuple(names) for r in reduced for names in r.tied})
        scaler = job.scaler
        order = self.tail_order()
        decision = decide_votes(job.mesh, [vote_of(s, r) for s, r in zip(reports, reduced)],
                                loss_scale=scaler.scale if scaler is not None else 1.0, fp16=order["fp16"],
                                scale_at_floor=order["scale_at_floor"], max_norm=order["max_norm"],
                                per_item=order["per_item"])
        self.grad_norm = decision.grad_norm
        finished: list[FinishReport] = [r.finished for r in reports if r.finished is not None] if ran_tail else \
            await self._on_every_stage(StageActor.finish_step, "STEP", step, decision.apply, decision.unscale,
                                       decision.clip)
        if decision.overflow and scaler is not None:
            log.info("%s step %d skipped: fp16 gradients overflowed at loss scale %g", job.id, step, scaler.scale)
        if scaler is not None and (decision.overflow or decision.apply):
            scaler.update(decision.overflow)
        elif found and job.spec.fault_tolerance.on_nonfinite == "raise":
            raise nonfinite_failed(job.mesh, step, found)
        elif found:
            log.warning("%s step %d skipped: %s", job.id, step, "; ".join(describe_findings(job.mesh, found)[:5]))
        return sum(r.reduced_bytes for r in reduced), describe_findings(job.mesh, found), finished

    async def _on_every_stage(self, method: Callable[..., Awaitable[Any]], action: str, *args: Any) -> list[Any]:
        """Calls a stage endpoint on every stage at once; the first failure fails the step, naming the stage."""
        job = self.job
        timeout = job.spec.fault_tolerance.step_timeout_s
        results = await asyncio.gather(*(ref.endpoint(method, timeout=timeout).call(*args) for ref in job.stages),
                                       return_exceptions=True)
        for rank, result in enumerate(results):
            if isinstance(result, NodeLost):
                where = step_failed(job.mesh, rank, action, result.message)
                raise NodeLost(where.message, details={**where.details, "node": result.node})
            if isinstance(result, BaseException):
                raise step_failed(job.mesh, rank, action, f"{type(result).__name__}: {result}")
        return results


def _lost_calls(tasks: Mapping[int, asyncio.Future[Any]]) -> dict[int, asyncio.Future[Any]]:
    """The stage calls, by rank, that ended in ``NodeLost`` or :class:`ActorLost` (its process ended)."""
    return {rank: task for rank, task in tasks.items()
            if task.done() and not task.cancelled() and isinstance(task.exception(), NodeLost | ActorLost)}
