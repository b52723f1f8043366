"""One step of a job, from its orders to its statistics: run to the barrier, release, failures.

For each step the controller sends every stage actor its program (and the
micro-batches the first and last stage need) as a :class:`~stages.StepOrder`, and
the stages run it up to the accumulation barrier and then the step's tail
themselves. :class:`StepPath` decides what the orders say, waits for them through
:class:`~schedulers.stage_calls.StageCalls` (which names a stage that failed, a node
that was lost or a step that outlived its timeout, after every stage aborted the
step), and makes the same decision from the same numbers as the stages (for the
statistics and the fp16 loss scale).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from typing import Any

from actors import StepFailed
from stages import batch_size, FinishReport, ReduceReport, StageActor, StageReport
from stages.compute.agreement import decide_votes, vote_of
from schedulers.events import JobFailed, SchedulePlanned
from schedulers.job_core import JobCore
from schedulers.job_views import JobViews
from schedulers.stage_calls import StageCalls
from schedulers.planning import NoScheduleFits
from schedulers.records import Candidate, StepStats
from schedulers.scaling import LossScaler
from schedulers.stepping import describe_findings, nonfinite_failed, nonfinite_findings, step_calls, step_stats

__all__ = ["Dispatched", "StepPath"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Dispatched:
    """A step whose orders are out (:meth:`StepPath.dispatch`): its number, its calls and what its statistics need."""

    step: int
    inputs: Any
    started: float  # perf_counter when its orders went out
    used_scale: float
    prescale: float  # what the order's loss scale was divided by beyond the fp16 scale (see StepPath.token_prescale)
    ran: str
    tasks: dict[int, asyncio.Future[StageReport]]


class StepPath:
    """Attempts a job's steps on its stages; keeps what the last release reported."""

    def __init__(self, job: JobCore, views: JobViews) -> None:
        self.job = job
        self.views = views
        self.calls = StageCalls(job, views)  # the orders out and the answers in
        self.tied: list[tuple[str, ...]] = []  # parameters shared across pipeline ranks, as the stages report
        self.grad_norm: float | None = None  # the last step's
        # fp16 with loss_averaging="tokens": a loss is a sum over a micro-batch's tokens, divided by the step's
        # count only after backward, so its gradients were the count times one process's and the dynamic
        # scale overflowed until it had fallen that far (five steps skipped at the start, a floor reached).
        # The order's scale is divided by this power of two near the last step's count per replica, and the
        # decision divides by that scale: exact, as scaling by a power of two is.
        self.token_prescale = 1.0
        self._prescale_counted = False  # whether token_prescale comes of a step's count (else: of targets' size)
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
        position = job.applied + 1 if after is not None else job.applied
        calls = step_calls(job.spec, position, inputs, targets, data_position=job.data.at(position))
        scaler = job.scaler
        prescale = 1.0
        if scaler is not None:
            # A replica's loss is the mean over its own share, so its fp16 gradients were the replicas' count
            # times one process's on the whole batch, and overflowed at a scale that many times lower: which
            # steps were skipped depended on the mesh. Divided by a power of two near the count, they meet fp16
            # at one process's size (exactly so for a power of two), and the decision divides by that scale.
            prescale = _power_of_two(job.mesh.data)
        if scaler is not None and job.spec.training.loss_averaging == "tokens":
            size = getattr(targets, "numel", None)  # a tensor's (torch is not imported here: see job_core)
            if not self._prescale_counted and callable(size) and size():
                # The first step, from a driver's batch: its targets' size per replica bounds the count.
                self.token_prescale = _power_of_two(size() / job.mesh.data)
            prescale *= self.token_prescale
        if scaler is not None and after is not None:
            # A step sent ahead runs only once the step before is applied (StepOrder.after), which moves
            # the fp16 scale as every applied step does; one that overflowed is skipped, and the run
            # sends this step again with the scale it left.
            scaler = dataclasses.replace(scaler)
            scaler.update(overflow=False)
        for call in calls.values():
            if after is not None:
                call["after"] = after.step
            # Every order says it: a stage keeps the count it was told last, so one sent only when it
            # differed from the count the stages were built with never took a job set back to that count.
            call["micro_batches"] = job.spec.parallelism.micro_batches
            faults = job.spec.fault_tolerance
            if faults.max_restarts and (job.snapshot_due or position % faults.snapshot_every == 0):
                call["snapshot"] = position
            if scaler is not None:
                call["loss_scale"] = scaler.scale / prescale
            if (lr := job.learning_rate(position)) is not None:
                call["lr"] = lr
            if job.spec.parallelism.schedule == "auto":  # the plan turns W batching on or off per step
                call["w_batching"] = job.auto.running_w_batching(job.spec)
            # The stages run the tail themselves (one answer per step), except on the step that
            # schedule="auto" plans from: there nothing applies before the plan fits max_stash_bytes.
            call.update(self.tail_order(scaler) if not job.auto.timed else {})
        # The number last, once the orders are made: a batch refused above (it does not split, a list where a
        # tensor goes) used one up that the stages never heard of, and a stage takes deliveries for its current
        # step or the next alone, so the next step's first activation could be refused and wait out the timeout.
        programs = job.programs
        step = job.attempted()
        return Dispatched(step=step, inputs=inputs, started=time.perf_counter(),
                          used_scale=scaler.scale if scaler is not None else 1.0, prescale=prescale,
                          ran=job.auto.running(job.spec), tasks=self.calls.start_programs(step, calls, programs))

    def may_step_ahead(self) -> bool:
        """Whether the next step's orders may go out before this one's answers are in: nothing in them
        depends on how this step ends (no plan being measured; an fp16 scale moves as the step before
        applies: see :meth:`dispatch`), and the data factory gives the batch (a recovery replays it from
        there: see :func:`~schedulers.runs.steps_ahead`)."""
        job = self.job
        return (not job.auto.measuring and not job.auto.timed and job.broken is None
                and job.spec.training.data is not None)

    async def drop(self, dispatched: Dispatched) -> None:
        """Stops a step that :meth:`dispatch` sent ahead and that will not be collected."""
        try:
            await self.calls.abort(dispatched.step, dispatched.tasks)
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
        job.collecting = step
        try:
            return await self._collected(dispatched, since)
        finally:
            job.collecting = None

    async def _collected(self, dispatched: Dispatched, since: float | None) -> StepStats:
        job = self.job
        step, inputs = dispatched.step, dispatched.inputs
        started = dispatched.started if since is None else max(dispatched.started, since)
        used_scale, ran, ranked, planning_s = dispatched.used_scale, dispatched.ran, None, 0.0
        try:
            try:
                reports = await self.calls.reports(step, dispatched.tasks)
                if job.auto.timed:  # schedule="auto": plan now, so that a max_stash_bytes nothing fits applies nothing
                    planning_s = time.perf_counter()
                    ranked = await self._rank_candidates(step, reports)
                    planning_s = time.perf_counter() - planning_s
                reduce_bytes, nonfinite, finished = await self._release(step, reports,
                                                                        dispatched.used_scale / dispatched.prescale)
            except StepFailed as failure:
                if failure.action == "STEP":  # some stages may have stepped their optimizer and others not
                    job.diverged(f"step {step} failed while the stages applied it ({failure.message})")
                raise
        except StepFailed as failure:
            job.publish(JobFailed(job=job.id, step=step, error=str(failure)))
            raise
        elapsed = time.perf_counter() - started
        job.applied_one(reports)
        # The data factory's batch: as its last stages read it (a DataLoader's batch_size is one micro-batch's).
        samples = batch_size(inputs) if inputs is not None else sum(
            r.samples for rank, r in enumerate(reports) if job.mesh.coords(rank).tensor == 0) or None
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
            await self.calls.abort(step, {})
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

    def tail_order(self, scaler: LossScaler | None) -> dict[str, Any]:
        """What a stage needs to decide the step's tail itself (see :mod:`stages.compute.agreement`), with
        the fp16 loss scale ``scaler`` (the job's, or what it will be when a step sent ahead runs)."""
        job = self.job
        return {"finish": True, "max_norm": float(job.spec.optimization.gradient_clipping),
                "per_item": job.spec.training.loss_averaging == "tokens",
                "fp16": scaler is not None, "scale_at_floor": scaler is not None and scaler.dynamic and scaler.at_minimum}

    async def _release(self, step: int, reports: list[StageReport], ordered_scale: float = 1.0
                       ) -> tuple[int, list[str], list[FinishReport]]:
        """The step's tail: every stage reduces and checks, then all step or none does (``ordered_scale``:
        the loss scale the step's orders gave, by which the stages' gradients are unscaled).

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
            await self.calls.on_every_stage(StageActor.reduce_step, "REDUCE", step)
        found = nonfinite_findings(job.mesh, reports, reduced)
        self.reduce_wait_s = [r.wait_s for r in reduced]
        self.tied = sorted({tuple(names) for r in reduced for names in r.tied})
        scaler = job.scaler
        order = self.tail_order(scaler)
        decision = decide_votes(job.mesh, [vote_of(s, r) for s, r in zip(reports, reduced)],
                                loss_scale=ordered_scale if scaler is not None else 1.0, fp16=order["fp16"],
                                scale_at_floor=order["scale_at_floor"], max_norm=order["max_norm"],
                                per_item=order["per_item"])
        self.grad_norm = decision.grad_norm
        if scaler is not None and order["per_item"]:  # the next step's prescale: near this one's count per replica
            self.token_prescale = _power_of_two(decision.unscale / ordered_scale)
            self._prescale_counted = True
        finished: list[FinishReport] = [r.finished for r in reports if r.finished is not None] if ran_tail else \
            await self.calls.on_every_stage(StageActor.finish_step, "STEP", step, decision.apply, decision.unscale,
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


def _power_of_two(count: float) -> float:
    """The power of two nearest ``count`` (at least 1): a scale whose division is exact."""
    return 2.0 ** round(math.log2(max(1.0, count)))
