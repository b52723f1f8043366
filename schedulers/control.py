"""One job's controller: its steps, runs, settings, views, state and close, each delegated to a part.

The job's actor (:class:`~schedulers.job_actor.JobActor`) hands each call to its
:class:`JobController`, which holds the job (:class:`~schedulers.job_core.JobCore`:
members, position in training, lock) and its parts, one per concern:

- the step path (:class:`~schedulers.step_path.StepPath`, its calls in
  :mod:`schedulers.stage_calls`): orders to every stage, the barrier, the tail's
  decision, failures that name the stage, action and cause;
- runs (:class:`~schedulers.runs.Runs`): N steps from the data factory in a task it
  owns, paused, resumed and stopped;
- settings (:class:`~schedulers.settings.Settings`): checked at once, applied before
  the next step, so the stages never see a half-changed job;
- views (:class:`~schedulers.job_views.JobViews`): where, trace, plan;
- monitors (:class:`~schedulers.monitors.Monitors`): each step's scalars and each
  evaluation's loss to TensorBoard, W&B and CSV, written on a thread of their own;
- evaluations (:class:`~schedulers.self_evaluations.SelfEvaluations`): ``job.evaluate``'s and the
  job's own every ``eval_every`` steps, recorded and told;
- the job's own saves (:class:`~schedulers.self_saves.SelfSaves`): every ``checkpoint_every``
  steps, and the resume from the last one as the job starts;
- recovery (:mod:`schedulers.recovery`) and state and checkpoints (:mod:`schedulers.job_state`),
  functions of the job.

The controller is never in the per-action path: activations and gradients go
directly between stage actors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from actors import ActorError, ActorRef, Event, Host, NodeLost, StageLost, StepFailed
from stages import StageActor
from schedulers import job_state, recovery
from schedulers.checkpoint_paths import CheckpointPath
from schedulers.job_core import JobCore, Placer
from schedulers.job_views import JobViews
from schedulers.jobs import JobSpec
from schedulers.limits import Limits
from schedulers.monitors import Monitors
from schedulers.records import EvalResult, JobDescription, Plan, Recovery, RunInfo, SettingChange, StepStats, WhereReport
from schedulers.runs import Runs, steps_ahead
from schedulers.self_evaluations import BetweenSteps, SelfEvaluations
from schedulers.self_saves import SelfSaves
from schedulers.settings import Settings
from schedulers.step_path import StepPath
from schedulers.stepping import nodes_lost, stage_lost

__all__ = ["JobController"]

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 2.0  # how long close waits for a cancelled operation to let go of the job


class JobController:
    """Everything about one job on the head: its stage actors, steps, run, settings and last trace.

    Events go to ``publish`` (records of :mod:`schedulers.events`): ``StepFinished`` (loss,
    time, bubble, run progress), ``JobFailed`` (the step's error), ``RunStarted``,
    ``RunFinished``, ``JobPaused``, ``JobResumed``, ``SettingPending``,
    ``SettingsApplied``, ``SettingRejected``, ``SchedulePlanned``, ``JobRecovered``, ``MonitorFailed``,
    ``CheckpointSaved``, ``Evaluated``.
    """

    def __init__(
        self, *, runtime: Host, job_id: str, spec: JobSpec, stages: list[ActorRef], nodes: list[str],
        bounds: list[list[int]], publish: Callable[[Event], None], alive_nodes: Callable[[], Awaitable[set[str]]],
        rendezvous: str | None = None, owner: str = "", placer: Placer | None = None,
        identities: list[str] | None = None, limits: Limits | None = None, monitors: Monitors | None = None,
        checkpoints: CheckpointPath | None = None,
    ) -> None:
        self.core = JobCore(runtime=runtime, job_id=job_id, spec=spec, stages=stages, nodes=nodes, bounds=bounds,
                            publish=publish, alive_nodes=alive_nodes, check_members=self._check_members,
                            rendezvous=rendezvous, owner=owner, placer=placer, identities=identities)
        self.views = JobViews(self.core)
        self.steps = StepPath(self.core, self.views)
        self.settings = Settings(self.core, limits or Limits())
        self.saves = SelfSaves(self.core, checkpoints)
        self.evals = SelfEvaluations(self.core, self.steps, monitors)
        self.between = BetweenSteps(self.evals, self.saves)
        self.runs = Runs(self.core, functools.partial(self.step, by_driver=False),
                         functools.partial(steps_ahead, self.core, self.steps, self.settings,
                                           functools.partial(self._step_ended, by_run=True),
                                           self._recover_to, self.between))
        self.evals.on_early_stop = self.runs.stop_early
        self._recovery: Recovery | None = None  # what the last recovery did, for the next StepStats
        self.monitors = monitors  # the job's TensorBoard, W&B and CSV writers (None: none configured)

    @property
    def id(self) -> str:
        return self.core.id

    # -- steps ---------------------------------------------------------------------------

    async def step(self, inputs: Any = None, targets: Any = None, *, by_driver: bool = True) -> StepStats:
        """Runs one optimizer step on a global batch (or the job's data factory).

        With ``max_restarts``, a node lost during the step (or before it) is replaced, and a
        stage whose process ended is built again on its node (see
        :func:`schedulers.recovery.recover`); the step runs again, and the stats say so. A step
        after which the job evaluates or saves itself (``eval_every``, ``checkpoint_every``) returns once
        that is done.

        Raises:
            ValueError: a batch that does not split into the job's micro-batches.
            NodeLost: a node of the job was lost, and the job cannot (or may no more) recover.
            StepFailed: a stage failed or the step timed out; or the evaluation after the step
                failed (the step was applied).
            CheckpointError: the save after the step failed (the step was applied).

        ``by_driver``: a driver's call, which ``cancel_step`` cancels (a run's steps are not).
        """
        job = self.core
        async with job.operation(stepping=by_driver):
            await self.settings.apply_pending()  # settings changed with set take effect here, between steps
            goal = job.keep_batch(inputs, targets)
            try:
                stats = await self._catch_up(goal)
            except (NodeLost, StageLost) as lost:
                if not recovery.may_recover(job):
                    raise
                stats = await self._recover_to(lost, goal)
            job.completed(goal, driver_batch=inputs is not None)
            # In the step's hold, nothing coming between: the evaluation due (its loss joins the step's
            # statistics), the step's end (the monitors' x: the steps applied, this one too), the save due.
            evaluated = await self.between.evaluate()
            stats = self._step_ended(stats, job.applied, evaluated, by_run=not by_driver)
            await self.between.save()
        return stats

    async def _recover_to(self, lost: NodeLost | StageLost, goal: int) -> StepStats:
        """Recovers from ``lost`` (see :func:`schedulers.recovery.recover`) and replays the steps up to
        ``goal``, recovering again from a loss during the replay while ``max_restarts`` allows; the
        last replayed step's statistics.

        Raises:
            NodeLost, StageLost: the job cannot (or may no more) recover.
        """
        job = self.core
        while True:
            self._recovery = await recovery.recover(job, lost)
            try:
                return await self._catch_up(goal)
            except (NodeLost, StageLost) as again:
                if not recovery.may_recover(job):
                    raise
                lost = again

    def _step_ended(self, stats: StepStats, applied: int, evaluated: EvalResult | None = None, *,
                    by_run: bool = False) -> StepStats:
        """A step ended (one by one or in a run: ``by_run``): what a recovery did and the evaluation made
        after it (its loss and metrics) join its statistics, which become the job's last (the views'
        describe, trace and plan), and its event goes out (with the run's progress, for a run's step)."""
        if self._recovery is not None:
            stats = dataclasses.replace(stats, recovery=self._recovery)
            self._recovery = None
        if evaluated is not None:
            stats = dataclasses.replace(stats, eval_loss=evaluated.loss, eval_metrics=evaluated.metrics,
                                        stop_early=self.evals.stop_early)
        job = self.core
        job.last_stats = stats
        job.publish(stats.finished(job.id, self.runs.progress() if by_run else None))
        if self.monitors is not None:
            self.monitors.record_step(stats, applied)
        return stats

    async def evaluate(self, inputs: Any = None, targets: Any = None, outputs: bool = False,
                       data_step: int | None = None) -> EvalResult:
        """One forward-only pass over a batch (see :mod:`schedulers.evaluation`); between steps, never
        during one, and it changes nothing of the job.

        Raises:
            ValueError: a batch the job cannot split.
            NodeLost: a node of the job is lost (an evaluation recovers nothing: the next step does).
            StepFailed: a stage failed or it timed out.
        """
        async with self.core.operation(stepping=True):  # a driver that gives up on it cancels it, as a step
            return await self.evals.evaluate(inputs, targets, bool(outputs), data_step)

    async def _catch_up(self, goal: int) -> StepStats:
        """Applies steps until ``goal`` are applied (more than one only when replaying after a recovery)."""
        job = self.core
        stats: StepStats | None = None
        while job.applied < goal:
            inputs, targets = job.history[job.applied]
            stats = await self.steps.attempt(inputs, targets)
        assert stats is not None
        return stats

    async def _check_members(self, diverged_ok: bool) -> None:
        """Before each operation: fails fast on a lost node (or recovers from it); a node that came
        back is told to abort the step it missed."""
        job = self.core
        for rank, ref in enumerate(job.stages):
            if (gone := job.runtime.lost(ref.address)) is not None:
                if not recovery.may_recover(job):
                    raise stage_lost(job.mesh, rank, gone, job.id)
                self._recovery = await recovery.recover(job, stage_lost(job.mesh, rank, gone))
                if job.applied < job.steps_done:  # none to replay after a recovery to the checkpoint loaded last
                    await self._catch_up(job.steps_done)
                return
        alive = await job.alive_nodes()
        recovery.stop_retired(job, alive)
        lost = [node for node in job.nodes if node not in alive]
        if lost and recovery.may_recover(job):
            cause = NodeLost(f"node {lost[0]} was lost", details={"node": lost[0]})
            self._recovery = await recovery.recover(job, cause)
            if job.applied < job.steps_done:
                await self._catch_up(job.steps_done)
            return
        if lost:
            raise nodes_lost(job.id, lost)
        for rank, step in sorted(job.fenced.items()):
            try:  # a member that was presumed lost and came back: stop whatever it still runs
                await job.stages[rank].endpoint(StageActor.abort_step, timeout=3).call(step)
            except ActorError as exc:
                raise NodeLost(f"node {job.nodes[rank]} came back, but its stage of {job.id} did not answer: "
                               f"{exc}", details={"node": job.nodes[rank], "job": job.id}) from None
            del job.fenced[rank]
        if job.broken is not None and not diverged_ok:
            raise StepFailed(f"{job.id} cannot go on: {job.broken}; load a checkpoint (job.load) or close it",
                             details={"stage": None, "action": None, "cause": "diverged"})

    def cancel_step(self) -> bool:
        """Cancels a driver's step (or evaluation), running (its stages abort it) or waiting for the job;
        False when there is none. A run's steps are not a driver's: they go on (``stop`` ends a run), where
        this once cancelled whichever step held the job, and with it the run."""
        calls = list(self.core.driver_calls)
        for task in calls:
            task.cancel()
        return bool(calls)

    # -- runs, pause and resume (schedulers.runs) ---------------------------------------------

    def run(self, num_steps: int) -> RunInfo:
        """Starts ``num_steps`` steps from the job's data factory, in the background.

        Raises:
            ValueError: no data factory, a bad count, or a run already going.
        """
        return self.runs.start(num_steps)

    async def wait(self) -> RunInfo | None:
        """The run going on, once it has ended; the last run if none is; None if the job never ran."""
        return await self.runs.wait()

    def pause(self) -> JobDescription:
        """Holds the job's run before its next step (the current one finishes, optimizer step included)."""
        self.runs.pause()
        return self.describe()

    def resume(self) -> JobDescription:
        """Lets a paused run go on."""
        self.runs.resume()
        return self.describe()

    def stop(self) -> JobDescription:
        """Ends the job's run after its current step (and out of a pause)."""
        self.runs.stop()
        return self.describe()

    # -- settings, applied at the barrier (schedulers.settings) ---------------------------------

    async def set(self, key: str, value: Any) -> SettingChange:
        """Changes ``key`` (one of :data:`~schedulers.settings.SETTABLE`) from the next step on.

        Raises:
            ValueError: the key cannot change, or the value does not fit; nothing changes.
            LimitExceeded: the value is past the operator's limits.
        """
        return await self.settings.set(key, value)

    # -- views (schedulers.job_views) ----------------------------------------------------------

    def describe(self) -> JobDescription:
        """Everything the console shows about the job."""
        job, run = self.core, self.runs.state
        return JobDescription(
            job=job.id, spec=job.spec, bounds=job.bounds, nodes=job.nodes,
            mesh=[job.mesh.pipeline, job.mesh.tensor, job.mesh.data],
            stages=[ref.to_wire() for ref in job.stages], steps=job.steps_done,
            programs=[job.programs[rank] for rank in sorted(job.programs)], stepping=job.lock.locked(),
            traced=bool(job.last_reports), paused=self.runs.paused, pending=dict(self.settings.pending),
            run=run.info() if run else None, last_stats=job.last_stats, running=job.auto.running(job.spec),
            last_eval=self.evals.last, best_eval=self.evals.best, best_checkpoint=self.saves.best_version,
        )

    async def where(self) -> WhereReport:
        """Hang forensics: each stage's current action, what it waits for, and the marked grid."""
        return await self.views.where()

    async def plan(self) -> Plan:
        """The candidate schedules with their predicted step time and stash (see :meth:`JobViews.plan`)."""
        return await self.views.plan()

    async def trace(self) -> dict[str, Any]:
        """The last step's measured timeline as Chrome/Perfetto trace JSON, on the head's clock.

        Raises:
            ValueError: the job has not finished a step yet.
        """
        return await self.views.trace()

    # -- state (schedulers.job_state) -------------------------------------------------------

    async def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state, gathered from the stages (see :func:`schedulers.job_state.state_dict`)."""
        return await job_state.state_dict(self.core)

    async def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads a whole-model state into every member (see :func:`schedulers.job_state.load_state_dict`)."""
        await job_state.load_state_dict(self.core, state)

    async def save(self, path: CheckpointPath) -> str:
        """Checkpoints the job into ``path`` (see :meth:`schedulers.self_saves.SelfSaves.save`)."""
        return await self.saves.save(path)

    async def export(self, path: CheckpointPath, format: str = "safetensors") -> str:
        """Writes the weights as a model directory (see :func:`schedulers.job_state.export`)."""
        return await job_state.export(self.core, path, format)

    async def load(self, path: CheckpointPath, weights_only: bool = False) -> int:
        """Loads a checkpoint, all or nothing (see :func:`schedulers.job_state.load`)."""
        return await job_state.load(self.core, path, weights_only)

    # -- life ----------------------------------------------------------------------------------

    async def close(self, stop_stages: Callable[[list[ActorRef]], Awaitable[None]]) -> None:
        """Ends the job within a few seconds, whatever it was doing: the run and the operation in
        progress are cancelled (a step is aborted on its stages), then the stage actors stop and
        the monitors flush and close."""
        job = self.core
        self.runs.cancel()
        if job.operation_task is not None:
            job.operation_task.cancel()
        try:
            await asyncio.wait_for(job.lock.acquire(), CLOSE_WAIT_S)
            held = True
        except TimeoutError:
            log.warning("%s: closing while an operation still holds it", job.id)
            held = False
        try:
            await stop_stages(job.stages)
            if job.rendezvous is not None:
                await job.runtime.stop_actor(job.rendezvous)
                job.renewed_rendezvous(None)
        finally:
            if held:
                job.lock.release()
            if self.monitors is not None:
                await self.monitors.aclose()
