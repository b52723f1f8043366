"""One job's controller: its steps, runs, pause and resume, settings changed at the barrier, state and traces.

The scheduler actor owns one :class:`JobController` per job and hands each call to
it. For each step the controller sends every stage actor its program (and the
micro-batches the first and last stage need), waits at the accumulation barrier for
all of them, then releases the optimizer step. It is never in the per-action path:
activations and gradients go directly between stage actors. A stage that fails, a
node that is lost or a step that outlives its timeout fails the step everywhere with
a :class:`~actors.StepFailed` that names the stage, the action and the cause.

A *run* is N steps the controller takes on its own from the job's data factory, in
a task it owns; ``pause`` holds the run before its next step, ``resume`` lets it go
on. ``set`` checks a new setting at once and applies it before the next step
begins, so the stages never see a half-changed job and keep their weights and
optimizer state.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from actors import ActorError, ActorRef, Event, Host, NodeLost, StepFailed, error_from_wire
from stages import batch_size, FinishReport, Mesh, ReduceReport, StageActor, StageReport, StepOrder
from schedulers.hang import StageProgress, diagnose
from schedulers import job_state, recovery
from schedulers.events import (
    JobFailed, JobPaused, JobResumed, RunFinished, RunProgress, RunStarted, SchedulePlanned, SettingPending,
    SettingRejected, SettingsApplied, StepFinished,
)
from schedulers.jobs import AUTO_PROBE, JobSpec
from schedulers._job import Placer
from schedulers.planning import AutoSchedule, NoScheduleFits, advise
from schedulers.records import Candidate, JobDescription, Plan, RunInfo, SettingChange, StepStats, WhereReport
from schedulers.scaling import LossScaler
from stages.compute.agreement import decide_votes, vote_of
from schedulers.schedules import build_schedule
from schedulers.stepping import (
    describe_findings,
    nonfinite_failed,
    nonfinite_findings,
    step_calls,
    step_failed,
    step_stats,
)
from schedulers.trace import StageRecord, estimate_offset, to_chrome_trace

__all__ = ["SETTABLE", "JobController", "RunState", "compile_programs", "plan_setting"]

log = logging.getLogger(__name__)

# How long a step whose reduction failed waits for the failure detector to name a lost node
# (the head's heartbeat timeout, 2 s by default, and a margin): see JobController._lost_instead.
LOSS_GRACE_S = 5.0

# What `set JOB KEY VALUE` may change on a running job.
SETTABLE = ("micro_batches", "schedule", "activation_codec", "gradient_codec")
CLOCK_PROBES = 5  # round trips per stage when estimating its clock offset
CLOSE_WAIT_S = 2.0  # how long close waits for a cancelled operation to let go of the job

Publish = Callable[[Event], None]


def compile_programs(spec: JobSpec, schedule_name: str | None = None,
                     w_batching: bool | None = None) -> dict[int, list[str]]:
    """The programs ``spec`` runs, one per pipeline rank, as action text.

    Args:
        schedule_name: the schedule to run, where ``spec.parallelism.schedule`` is ``auto``
            (default: the probe schedule, :data:`~schedulers.jobs.AUTO_PROBE`).
        w_batching: every W deferred to the rank's tail (default: ``spec.parallelism.w_batching``).

    Raises:
        ValueError: the schedule cannot take these sizes.
    """
    name = spec.parallelism.schedule if spec.parallelism.schedule != "auto" else schedule_name or AUTO_PROBE
    schedule = build_schedule(name, spec.parallelism.pipeline_stages, spec.parallelism.micro_batches,
                              spec.num_virtual_stages if spec.parallelism.schedule == "interleaved" else None,
                              split=spec.runtime.gradient_accumulation_fusion,
                              batch_w=spec.parallelism.w_batching if w_batching is None else w_batching)
    return {rank: [str(a) for a in program] for rank, program in schedule.items()}


def plan_setting(spec: JobSpec, key: str, value: Any) -> JobSpec:
    """The spec a running job would have after ``set key value``, checked now.

    Args:
        spec: the job's spec, with any earlier pending settings applied.
        key: one of :data:`SETTABLE`.
        value: the new value; text is parsed (``"8"``, ``"gpipe"``, ``"int8"`` or ``"int8,none"``).
            A fixed schedule drops ``max_stash_bytes`` (a limit on what ``auto`` chooses).

    Raises:
        ValueError: an unknown key, or a value that does not parse or fit the job
            (the message says which and what would).
    """
    if key not in SETTABLE:
        raise ValueError(f"cannot set {key!r} on a running job; settable: {', '.join(SETTABLE)}")
    changes: dict[str, Any] = {}
    if key == "micro_batches":
        value = _parse_int(key, value)
        batch = spec.training.data_kwargs.get("batch_size")
        if isinstance(batch, int) and batch % (value * spec.parallelism.data_parallel):
            raise ValueError(
                f"micro_batches={value}: the data factory's batch_size {batch} does not split into "
                f"{value} micro-batches x data_parallel {spec.parallelism.data_parallel}; pick a divisor of "
                f"{batch // spec.parallelism.data_parallel}")
    elif key == "schedule":
        value = str(value)
        if (value == "interleaved") != (spec.parallelism.schedule == "interleaved"):
            raise ValueError(
                f"schedule={value}: switching between interleaved and one-stage-per-rank schedules "
                "re-partitions the model (auto runs one stage per rank); start a new job with that schedule "
                "instead")
        if value != "auto":
            changes["max_stash_bytes"] = None  # the limit is auto's; a fixed schedule drops it
    elif isinstance(value, str) and "," in value:
        value = value.split(",")
    try:
        new = spec.replace(**{key: value}, **changes)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    compile_programs(new)  # e.g. interleaved needs micro_batches to be a multiple of the stages
    return new


def _parse_int(key: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be an integer >= 1, got {value!r:.40}") from None
    if number < 1 or isinstance(value, bool):
        raise ValueError(f"{key} must be an integer >= 1, got {value!r:.40}")
    return number


@dataclass(slots=True)
class RunState:
    """A run of ``target`` steps the controller takes from the job's data factory."""

    target: int
    first_step: int
    done: int = 0
    stop: bool = False
    finished: bool = False
    error: str | None = None
    task: asyncio.Task[Any] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set by resume and stop

    def info(self) -> RunInfo:
        return RunInfo(target=self.target, first_step=self.first_step, done=self.done, active=not self.finished,
                       stopping=self.stop, error=self.error)


class JobController:
    """Everything about one job on the head: its stage actors, steps, run, settings and last trace.

    Events go to ``publish`` (records of :mod:`schedulers.events`): ``StepFinished`` (loss,
    time, bubble, run progress), ``JobFailed`` (the step's error), ``RunStarted``,
    ``RunFinished``, ``JobPaused``, ``JobResumed``, ``SettingPending``,
    ``SettingsApplied``, ``SettingRejected``, ``SchedulePlanned``.
    """

    def __init__(
        self,
        *,
        runtime: Host,
        job_id: str,
        spec: JobSpec,
        stages: list[ActorRef],
        nodes: list[str],
        bounds: list[list[int]],
        publish: Publish,
        alive_nodes: Callable[[], Awaitable[set[str]]],
        rendezvous: str | None = None,
        owner: str = "",
        placer: Placer | None = None,
        identities: list[str] | None = None,
    ) -> None:
        self.runtime = runtime
        self.id = job_id
        self.owner = owner  # role:name of the key that created the job
        self.spec = spec
        self.mesh: Mesh = spec.mesh
        self.stages = stages  # by global rank in the mesh
        self.nodes = nodes  # by global rank
        self.bounds = bounds
        self.auto = AutoSchedule(spec)  # schedule="auto": measuring, then the plan
        self._advice: tuple[tuple[int, JobSpec], Plan] | None = None  # job.plan() of a fixed schedule, per step
        self.programs = self._compile(spec)
        self.rendezvous = rendezvous  # the name of the job's torch.distributed rendezvous actor, if any
        self.lock = asyncio.Lock()
        self.operation: asyncio.Task[Any] | None = None  # the call holding the lock (close cancels it)
        self.stepping = False  # the operation is a step (a driver may cancel it)
        # Ranks whose node was lost during a step they were not told to abort: aborted when it comes back.
        self.fenced: dict[int, int] = {}
        self.broken: str | None = None  # set when stages may disagree (a release failed): only load or close help
        self.next_step = 0  # the next step number: one per attempt, never reused (it fences stale messages)
        self.applied = 0  # steps the stages' state holds (rolled back by a recovery)
        self.steps_done = 0  # steps the job has completed (what a recovery replays up to)
        # Each step's batch since the snapshot a recovery would roll back to ((None, None): the data factory).
        self.history: dict[int, tuple[Any, Any]] = {}  # applied-step index -> (inputs, targets)
        self.restarts = 0
        self.tied: list[tuple[str, ...]] = []  # parameters shared across pipeline ranks, as the stages report
        # fp16: the loss scale every stage's next step uses (None: no scaling); the last step's norm.
        mp = spec.mixed_precision
        self.scaler: LossScaler | None = None if mp.precision != "fp16" else LossScaler.for_spec(
            mp.loss_scale, mp.initial_scale_power, mp.loss_scale_window, mp.hysteresis, mp.min_loss_scale)
        self.grad_norm: float | None = None
        self.reduce_wait_s: list[float] = []  # the last release's, per stage actor
        self.last_checkpoint: tuple[str, int] | None = None  # (directory, step) of this job's newest save
        self.driver_batches = False  # a step took the driver's batch (so the data factory cannot replay it)
        self.snapshot_due = False  # take one at the next step whatever snapshot_every says (after a load)
        self.recovery: dict[str, Any] | None = None  # what the last recovery did, for the next StepStats
        self.placer = placer
        self.identities = sorted(set(identities or ()) - {""})  # the keys of the job's nodes
        self.retired: list[tuple[str, ActorRef]] = []  # stage actors replaced by a recovery, stopped if their node returns
        self.last_reports: list[StageReport] = []
        self.last_stats: StepStats | None = None
        self.stage_micro_batches = spec.parallelism.micro_batches  # what the stage actors were built with
        self.paused = False
        self.pending: dict[str, Any] = {}
        self.pending_spec: JobSpec | None = None
        self.run_state: RunState | None = None
        self._publish = publish
        self._alive_nodes = alive_nodes

    @property
    def running(self) -> bool:
        return self.run_state is not None and not self.run_state.finished

    def _compile(self, spec: JobSpec) -> dict[int, list[str]]:
        """The programs of the job's next step (with ``schedule="auto"``: what the plan runs now)."""
        return compile_programs(spec, self.auto.running(spec), self.auto.running_w_batching(spec))

    # -- steps ---------------------------------------------------------------------------

    async def step(self, inputs: Any = None, targets: Any = None) -> StepStats:
        """Runs one optimizer step on a global batch (or the job's data factory).

        With ``max_restarts``, a node lost during the step (or before it) is replaced
        (see :meth:`_recover`) and the step runs again; the stats say so.

        Raises:
            ValueError: a batch that does not split into the job's micro-batches.
            NodeLost: a node of the job was lost, and the job cannot (or may no more) recover.
            StepFailed: a stage failed or the step timed out.
        """
        async with self._operation(stepping=True):
            await self._apply_pending()  # settings changed with set take effect here, between steps
            self.history[self.steps_done] = (inputs, targets)
            goal = self.steps_done + 1
            while True:
                try:
                    stats = await self._catch_up(goal)
                    break
                except NodeLost as lost:
                    if not recovery.may_recover(self):
                        raise
                    self.recovery = await recovery.recover(self, lost)
            self.steps_done = goal
            self.driver_batches = self.driver_batches or inputs is not None
            for old in [k for k in self.history if k < self.applied - 2 * self.spec.fault_tolerance.snapshot_every]:
                del self.history[old]
        if self.recovery is not None:
            stats = dataclasses.replace(stats, recovery=self.recovery)
            self.recovery = None
        self.last_stats = stats
        self._step_finished(stats)
        return stats

    async def _catch_up(self, goal: int) -> StepStats:
        """Applies steps until ``goal`` are applied (more than one only when replaying after a recovery)."""
        stats: StepStats | None = None
        while self.applied < goal:
            inputs, targets = self.history[self.applied]
            stats = await self._attempt(inputs, targets)
        assert stats is not None
        return stats

    async def _attempt(self, inputs: Any, targets: Any) -> StepStats:
        """One try at applying step ``self.applied``, under a step number of its own (never reused)."""
        step = self.next_step
        calls = step_calls(self.spec, self.applied, inputs, targets)
        self.next_step += 1
        for call in calls.values():
            if self.spec.parallelism.micro_batches != self.stage_micro_batches:
                call["micro_batches"] = self.spec.parallelism.micro_batches
            faults = self.spec.fault_tolerance
            if faults.max_restarts and (self.snapshot_due or self.applied % faults.snapshot_every == 0):
                call["snapshot"] = self.applied
            if self.scaler is not None:
                call["loss_scale"] = self.scaler.scale
            if self.spec.parallelism.schedule == "auto":  # the plan turns W batching on or off per step
                call["w_batching"] = self.auto.running_w_batching(self.spec)
            # The stages run the tail themselves (one answer per step), except on the step that
            # schedule="auto" plans from: there nothing applies before the plan fits max_stash_bytes.
            call.update(self._tail_order() if not self.auto.timed else {})
        started = time.perf_counter()
        used_scale = self.scaler.scale if self.scaler is not None else 1.0
        ran, ranked, planning_s = self.auto.running(self.spec), None, 0.0
        try:
            try:
                reports = await self._run_to_barrier(step, calls)
                if self.auto.timed:  # schedule="auto": plan now, so that a max_stash_bytes nothing fits applies nothing
                    planning_s = time.perf_counter()
                    ranked = await self._rank_candidates(step, reports)
                    planning_s = time.perf_counter() - planning_s
                reduce_bytes, nonfinite, finished = await self._release(step, reports)
            except StepFailed as failure:
                if failure.action == "STEP":  # some stages may have stepped their optimizer and others not
                    self.broken = f"step {step} failed while the stages applied it ({failure.message})"
                raise
        except StepFailed as failure:
            self._publish(JobFailed(job=self.id, step=step, error=str(failure)))
            raise
        self.applied += 1
        self.snapshot_due = False
        elapsed = time.perf_counter() - started
        self.last_reports = reports
        samples = batch_size(inputs) if inputs is not None else self.spec.training.data_kwargs.get("batch_size")
        stats = step_stats(self.spec, step, reports, elapsed, reduce_bytes,
                           samples if isinstance(samples, int) else None, nonfinite, finished)
        scaler = self.scaler
        predicted, error = self.auto.prediction(ran, elapsed)
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
        try:  # off the loop: simulating every candidate of a deep pipeline takes seconds
            return await asyncio.to_thread(self.auto.rank, self.spec, reports, self.mesh, step)
        except NoScheduleFits as exc:
            await self._abort(step, {})
            self._publish(JobFailed(job=self.id, step=step, error=str(exc)))
            raise

    async def _after_probe(self, reports: list[StageReport], step_time_s: float,
                           ranked: list[Candidate] | None) -> None:
        """After a probe step: take the clocks (after the warm-up) or adopt the plan (after the timed one)."""
        if ranked is not None:
            self.auto.adopt(ranked, step_time_s - max(r.elapsed_s for r in reports))
            self.programs = self._compile(self.spec)
            chosen = self.auto.chosen
            self._publish(SchedulePlanned(job=self.id, step=self.next_step, schedule=chosen.label if chosen else None,
                                          predicted_step_s=chosen.predicted_step_s if chosen else None))
        elif self.auto.measuring:
            self.auto.probed(reports, self.mesh)
            timed_next = self.auto.warmed_up()
            self.programs = self._compile(self.spec)  # the next probe step's (with W batching or not)
            if timed_next:  # the clocks, for the link's speed; outside any step
                self.auto.offsets = await self._clock_offsets()

    async def _clock_offsets(self) -> list[float]:
        return [offset for offset, _ in await asyncio.gather(*(self._clock_offset(ref) for ref in self.stages))]

    async def plan(self) -> Plan:
        """The candidate schedules with their predicted step time and stash, the chosen one marked.

        With ``schedule="auto"``: the plan made from the timed probe step (none while the job
        still measures). With a fixed schedule: predicted from the last step, marking
        what auto would run.
        """
        spec, stats, reports = self.spec, self.last_stats, self.last_reports
        if spec.parallelism.schedule == "auto":
            return self.auto.plan(self.id, spec)
        if stats is None or not reports:
            schedule = spec.parallelism.schedule
            return Plan(job=self.id, schedule=schedule, running=schedule, state="no_steps")
        if self._advice is None or self._advice[0] != (stats.step, spec):
            offsets = await self._clock_offsets()
            plan = await asyncio.to_thread(advise, self.id, spec, reports, self.mesh, offsets=offsets,
                                           step_time_s=stats.step_time_s, step=stats.step)
            self._advice = ((stats.step, spec), plan)  # asked again before the next step: the same answer
        return self._advice[1]

    async def _run_to_barrier(self, step: int, calls: dict[int, dict[str, Any]]) -> list[StageReport]:
        tasks = {
            rank: asyncio.ensure_future(self.stages[rank].endpoint(StageActor.run_step).call(
                StepOrder(step=step, program=self.programs[self.mesh.coords(rank).pipeline], **kwargs)))
            for rank, kwargs in calls.items()
        }
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.spec.fault_tolerance.step_timeout_s
        try:
            pending: set[asyncio.Future[Any]] = set(tasks.values())
            failure: StepFailed | None = None
            while pending and failure is None:
                done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()),
                                                   return_when=asyncio.FIRST_COMPLETED)
                failure = self._first_failure(tasks) if done else await self._timeout_failure()
            if failure is not None and failure.action == "REDUCE" and not isinstance(failure, NodeLost):
                failure = await self._lost_instead(tasks, failure, deadline)
            reports = [] if failure else [StageReport.from_wire(tasks[rank].result()) for rank in sorted(tasks)]
            if failure is None and not all(r.status == "done" for r in reports):
                failure = StepFailed("step aborted on request", details={"stage": None, "action": None,
                                                                          "cause": "aborted"})
            if failure is not None:
                await self._abort(step, tasks)
                raise failure
            return reports
        except asyncio.CancelledError:  # the driver cancelled the step, or the job is closing
            await asyncio.shield(self._abort(step, tasks))
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
        reduction came after every stage's barrier; else the reduction's own failure."""
        loop = asyncio.get_running_loop()
        pending = [task for task in tasks.values() if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, min(LOSS_GRACE_S, deadline - loop.time())))
        lost = self._first_failure({rank: task for rank, task in tasks.items()
                                    if task.done() and isinstance(task.exception(), NodeLost)})
        if lost is None and (alive := await self._alive_nodes()) and set(self.nodes) - alive:
            gone = sorted(set(self.nodes) - alive)[0]
            lost = NodeLost(f"node {gone} was lost during the step ({failure.message})",
                            details={**failure.details, "node": gone})
        return lost or failure

    def _first_failure(self, tasks: Mapping[int, asyncio.Future[Any]]) -> StepFailed | None:
        for rank, task in tasks.items():
            if not task.done():
                continue
            exc = task.exception()
            if isinstance(exc, NodeLost):
                where = step_failed(self.mesh, rank, None, exc.message)
                return NodeLost(where.message, details={**where.details, "node": exc.node})
            if exc is not None:
                cause = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ActorError) else \
                    f"{exc.remote_type}: {exc.message}"
                return step_failed(self.mesh, rank, None, cause)
            report = StageReport.from_wire(task.result())
            if report.status == "failed":
                error = error_from_wire(report.error)
                return step_failed(self.mesh, rank, report.action, f"{error.remote_type}: {error.message}",
                                   error.remote_traceback)
        return None

    async def _timeout_failure(self) -> StepFailed:
        # Hang forensics: where each stage is, which send or receive never matched, the marked grid.
        report, lines = await self._hang_report()
        return StepFailed(
            f"step timed out after {self.spec.fault_tolerance.step_timeout_s}s:\n{report}",
            details={"stage": None, "action": None, "cause": "timeout", "where": lines},
        )

    async def _abort(self, step: int, tasks: Mapping[int, asyncio.Future[Any]]) -> None:
        async def abort(ref: ActorRef) -> None:
            try:
                await ref.endpoint(StageActor.abort_step, timeout=5).call(step)
            except ActorError as exc:
                log.info("abort of %s: %s", ref.name, exc)

        alive = await self._alive_nodes()
        reachable = [rank for rank, node in enumerate(self.nodes) if node in alive]
        for rank, node in enumerate(self.nodes):
            if node not in alive:  # told when (if) it comes back: see _check_members
                self.fenced[rank] = max(step, self.fenced.get(rank, step))
        await asyncio.gather(*(abort(self.stages[rank]) for rank in reachable))
        waiting = [tasks[rank] for rank in reachable if rank in tasks]
        if waiting:
            await asyncio.wait(waiting, timeout=5)

    @contextlib.asynccontextmanager
    async def _operation(self, *, stepping: bool = False, repairs: bool = False) -> AsyncIterator[None]:
        """Holds the job for one operation (a step, a state read or load) that ``close`` may cancel.

        Raises:
            NodeLost: a node of the job is lost (at once: nothing is sent to the others).
            StepFailed: the stages may disagree after a failed release (load a checkpoint).
        """
        async with self.lock:
            await self._check_members(diverged_ok=repairs)
            self.operation, self.stepping = asyncio.current_task(), stepping
            try:
                yield
            finally:
                self.operation, self.stepping = None, False

    async def _check_members(self, *, diverged_ok: bool = False) -> None:
        """Fails fast on a lost node; a node that came back is told to abort the step it missed."""
        alive = await self._alive_nodes()
        recovery.stop_retired(self, alive)
        lost = [node for node in self.nodes if node not in alive]
        if lost and recovery.may_recover(self):
            cause = NodeLost(f"node {lost[0]} was lost", details={"node": lost[0]})
            self.recovery = await recovery.recover(self, cause)
            await self._catch_up(self.steps_done)
            return
        if lost:
            raise NodeLost(f"{self.id} lost node {lost[0]}"
                           + (f" (and {len(lost) - 1} more)" if len(lost) > 1 else "")
                           + "; close the job, or start it with max_restarts and a spare node to recover",
                           details={"node": lost[0], "job": self.id, "stage": None, "action": None,
                                    "cause": "node lost"})
        for rank, step in sorted(self.fenced.items()):
            try:  # a member that was presumed lost and came back: stop whatever it still runs
                await self.stages[rank].endpoint(StageActor.abort_step, timeout=3).call(step)
            except ActorError as exc:
                raise NodeLost(f"node {self.nodes[rank]} came back, but its stage of {self.id} did not answer: "
                               f"{exc}", details={"node": self.nodes[rank], "job": self.id}) from None
            del self.fenced[rank]
        if self.broken is not None and not diverged_ok:
            raise StepFailed(f"{self.id} cannot go on: {self.broken}; load a checkpoint (job.load) or close it",
                             details={"stage": None, "action": None, "cause": "diverged"})

    def cancel_step(self) -> bool:
        """Cancels the step in progress (its stages abort it); False when no step runs."""
        if self.operation is None or not self.stepping:
            return False
        self.operation.cancel()
        return True

    def _tail_order(self) -> dict[str, Any]:
        """What a stage needs to decide the step's tail itself (see :mod:`stages.compute.agreement`)."""
        scaler = self.scaler
        return {"finish": True, "max_norm": float(self.spec.optimization.gradient_clipping),
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
        ran_tail = all(r.reduced is not None and r.finished is not None for r in reports)
        reduced = [r.reduced for r in reports if r.reduced is not None] if ran_tail else [
            ReduceReport.from_wire(r) for r in await self._on_every_stage(StageActor.reduce_step, "REDUCE", step)]
        found = nonfinite_findings(self.mesh, reports, reduced)
        self.reduce_wait_s = [r.wait_s for r in reduced]
        self.tied = sorted({tuple(names) for r in reduced for names in r.tied})
        scaler = self.scaler
        order = self._tail_order()
        decision = decide_votes(self.mesh, [vote_of(s.losses, r) for s, r in zip(reports, reduced)],
                                loss_scale=scaler.scale if scaler is not None else 1.0, fp16=order["fp16"],
                                scale_at_floor=order["scale_at_floor"], max_norm=order["max_norm"])
        self.grad_norm = decision.grad_norm
        finished = [r.finished for r in reports if r.finished is not None] if ran_tail else [
            FinishReport.from_wire(r) for r in await self._on_every_stage(
                StageActor.finish_step, "STEP", step, decision.apply, decision.unscale, decision.clip)]
        if scaler is not None and (decision.overflow or decision.apply):
            scaler.update(decision.overflow)
        if decision.overflow:
            log.info("%s step %d skipped: fp16 gradients overflowed at loss scale %g", self.id, step, decision.unscale)
        elif found and self.spec.fault_tolerance.on_nonfinite == "raise":
            raise nonfinite_failed(self.mesh, step, found)
        elif found:
            log.warning("%s step %d skipped: %s", self.id, step, "; ".join(describe_findings(self.mesh, found)[:5]))
        return sum(r.reduced_bytes for r in reduced), describe_findings(self.mesh, found), finished

    async def _on_every_stage(self, method: Callable[..., Awaitable[Any]], action: str, *args: Any) -> list[Any]:
        """Calls a stage endpoint on every stage at once; the first failure fails the step, naming the stage."""
        timeout = self.spec.fault_tolerance.step_timeout_s
        results = await asyncio.gather(*(ref.endpoint(method, timeout=timeout).call(*args) for ref in self.stages),
                                       return_exceptions=True)
        for rank, result in enumerate(results):
            if isinstance(result, NodeLost):
                where = step_failed(self.mesh, rank, action, result.message)
                raise NodeLost(where.message, details={**where.details, "node": result.node})
            if isinstance(result, BaseException):
                raise step_failed(self.mesh, rank, action, f"{type(result).__name__}: {result}")
        return results

    def _step_finished(self, stats: StepStats) -> None:
        run = self.run_state
        progress = None
        if run is not None and not run.finished and self.steps_done > run.first_step:
            progress = RunProgress(done=self.steps_done - run.first_step, target=run.target)
        self._publish(StepFinished(job=self.id, step=stats.step, loss=stats.loss, step_time_s=stats.step_time_s,
                                   bubble_fraction=stats.bubble_fraction, samples_per_s=stats.samples_per_s,
                                   schedule=stats.schedule, run=progress, skipped=stats.skipped, lr=stats.lr,
                                   predicted_step_s=stats.predicted_step_s, prediction_error=stats.prediction_error))

    # -- queries ----------------------------------------------------------------------

    def describe(self) -> JobDescription:
        """Everything the console shows about the job."""
        return JobDescription(
            job=self.id, spec=self.spec, bounds=self.bounds, nodes=self.nodes,
            mesh=[self.mesh.pipeline, self.mesh.tensor, self.mesh.data],
            stages=[ref.to_wire() for ref in self.stages], steps=self.steps_done,
            programs=[self.programs[rank] for rank in sorted(self.programs)], stepping=self.lock.locked(),
            traced=bool(self.last_reports), paused=self.paused, pending=dict(self.pending),
            run=self.run_state.info() if self.run_state else None, last_stats=self.last_stats,
            running=self.auto.running(self.spec),
        )

    async def where(self) -> WhereReport:
        """Hang forensics: each stage's current action, what it waits for, and the marked grid."""
        text, lines = await self._hang_report()
        return WhereReport(job=self.id, stepping=self.lock.locked(), report=text, lines=lines)

    async def _hang_report(self) -> tuple[str, list[str]]:
        """Asks every stage where it is; returns the full report and its per-stage lines."""
        async def progress(ref: ActorRef) -> dict[str, Any] | str:
            try:
                return await ref.endpoint(StageActor.progress, timeout=5).call()
            except ActorError as exc:
                return f"{ref.name} did not answer ({exc.message})"

        answers = await asyncio.gather(*(progress(ref) for ref in self.stages))
        running = self.lock.locked()
        step = self.next_step - 1 if running else None
        replicas: dict[tuple[int, int], dict[int, StageProgress | str]] = {}
        for member, answer in enumerate(answers):
            c = self.mesh.coords(member)
            replicas.setdefault((c.data, c.tensor), {})[c.pipeline] = answer if isinstance(answer, str) else \
                StageProgress(rank=c.pipeline, current=answer.get("current"), done=int(answer.get("done", 0)),
                              stale=step is not None and answer.get("step", step) != step)
        lines: list[str] = []
        grids: list[tuple[bool, str]] = []
        for (data, tensor), found in sorted(replicas.items()):
            report = diagnose(self.programs, found, running=running)
            prefix = "" if len(replicas) == 1 else f"[dp {data} tp {tensor}] "
            lines += [prefix + line for line in report.lines]
            grids.append((report.settled, f"{prefix}programs, each stage's place marked >like this<:\n{report.grid}"))
        grid = next((g for settled, g in grids if not settled), grids[0][1] if grids else "")
        return "\n".join([*lines, grid]), lines

    # -- runs, pause and resume ---------------------------------------------------------

    def run(self, num_steps: int) -> RunInfo:
        """Starts ``num_steps`` steps from the job's data factory, in the background.

        Raises:
            ValueError: no data factory, a bad count, or a run already going.
        """
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"run needs a number of steps >= 1, got {num_steps!r:.40}")
        if self.spec.training.data is None:
            raise ValueError(f"{self.id} has no data factory to run from; start it with data='pkg.mod:factory' "
                             "(or drive it with job.step(inputs, targets))")
        if self.running:
            assert self.run_state is not None
            raise ValueError(f"{self.id} is already running ({self.run_state.done}/{self.run_state.target} steps); "
                             f"wait for it or stop it first")
        state = self.run_state = RunState(target=num_steps, first_step=self.steps_done)
        state.task = self.runtime.spawn_task(self._run_steps(state), name=f"{self.id} run")
        self._publish(RunStarted(job=self.id, steps=num_steps, paused=self.paused))
        return state.info()

    async def _run_steps(self, state: RunState) -> None:
        reason = "cancelled"
        try:
            while state.done < state.target and not state.stop:
                if self.paused:
                    self._publish(JobPaused(job=self.id, step=self.next_step))
                    while self.paused and not state.stop:
                        state.wake.clear()
                        await state.wake.wait()
                    if state.stop:
                        break
                    self._publish(JobResumed(job=self.id, step=self.next_step))
                await self.step()
                state.done += 1
            reason = "done" if state.done == state.target else "stopped"
        except Exception as exc:  # noqa: BLE001 - a run reports whatever ended it
            state.error = str(exc) if isinstance(exc, ActorError) else f"{type(exc).__name__}: {exc}"
            reason = "failed"
        finally:
            state.finished = True
            self._publish(RunFinished(job=self.id, done=state.done, target=state.target, reason=reason,
                                      error=state.error))

    def pause(self) -> JobDescription:
        """Holds the job's run before its next step (the current one finishes, optimizer step included)."""
        self.paused = True
        if not self.running:
            self._publish(JobPaused(job=self.id, step=self.next_step))
        return self.describe()

    def resume(self) -> JobDescription:
        """Lets a paused run go on."""
        self.paused = False
        if self.run_state is not None:
            self.run_state.wake.set()
        if not self.running:
            self._publish(JobResumed(job=self.id, step=self.next_step))
        return self.describe()

    def stop(self) -> JobDescription:
        """Ends the job's run after its current step (and out of a pause)."""
        if self.run_state is not None:
            self.run_state.stop = True
            self.run_state.wake.set()
        return self.describe()

    # -- settings, applied at the barrier ---------------------------------------------------

    def set(self, key: str, value: Any) -> SettingChange:
        """Changes ``key`` (one of :data:`SETTABLE`) from the next step on.

        Raises:
            ValueError: the key cannot change, or the value does not fit; nothing changes.
        """
        new = plan_setting(self.pending_spec or self.spec, key, value)
        self.pending_spec = new
        self.pending[key] = value = new.get(key)
        self._publish(SettingPending(job=self.id, key=key, value=value))
        return SettingChange(job=self.id, key=key, value=value, stepping=self.lock.locked(),
                             next_step=self.next_step)

    async def _apply_pending(self) -> None:
        """Before a step, under the job's lock: the pending settings take effect."""
        new = self.pending_spec
        if new is None:
            return
        changes = dict(self.pending)
        self.pending.clear()
        self.pending_spec = None
        if "activation_codec" in changes or "gradient_codec" in changes:
            try:
                await asyncio.gather(*(ref.endpoint(StageActor.set_codecs, timeout=30).call(
                    new.edge_codecs("activation_codec"), new.edge_codecs("gradient_codec")) for ref in self.stages))
            except ActorError as exc:
                self._publish(SettingRejected(job=self.id, key="codecs",
                                              error=f"the stages refused the new codecs: {exc}"))
                return
        self.spec = new
        self.auto.reset(new)  # auto measures again: the costs it planned with may have changed
        self.programs = self._compile(new)
        self._publish(SettingsApplied(job=self.id, step=self.next_step, changes=changes))

    # -- state (schedulers.job_state) -------------------------------------------------------

    async def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state, gathered from the stages (see :func:`schedulers.job_state.state_dict`)."""
        return await job_state.state_dict(self)

    async def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads a whole-model state into every member (see :func:`schedulers.job_state.load_state_dict`)."""
        await job_state.load_state_dict(self, state)

    async def save(self, directory: str) -> str:
        """Checkpoints the job into ``directory`` (see :func:`schedulers.job_state.save`)."""
        return await job_state.save(self, directory)

    async def load(self, directory: str, weights_only: bool = False) -> int:
        """Loads a checkpoint, all or nothing (see :func:`schedulers.job_state.load`)."""
        return await job_state.load(self, directory, weights_only)

    # -- traces -----------------------------------------------------------------------------

    async def trace(self) -> dict[str, Any]:
        """The last step's measured timeline as Chrome/Perfetto trace JSON, on the head's clock.

        Raises:
            ValueError: the job has not finished a step yet.
        """
        reports, stats = self.last_reports, self.last_stats
        if not reports or stats is None:
            raise ValueError(f"{self.id} has not finished a step yet; run one ('run {self.id} 1'), then trace it")
        clocks = await asyncio.gather(*(self._clock_offset(ref) for ref in self.stages))
        mesh = self.mesh
        records = [
            StageRecord(member=g, name=f"{mesh.describe(g)} ({self.nodes[g]})", pipeline_rank=mesh.coords(g).pipeline,
                        replica=(mesh.coords(g).data, mesh.coords(g).tensor), started_at=float(r.started_at),
                        offset_s=clocks[g][0], spans=r.spans)
            for g, r in enumerate(reports)
        ]
        title = f"{self.id} step {stats.step}"
        metadata = {"title": title, "job": self.id, "step": stats.step,
                    "schedule": stats.schedule, "micro_batches": stats.micro_batches,
                    "bubble_fraction": stats.bubble_fraction,
                    "clock_round_trips_s": {rec.name: rtt for rec, (_, rtt) in zip(records, clocks)}}
        return to_chrome_trace(records, num_ranks=mesh.pipeline, title=title, metadata=metadata)

    async def _clock_offset(self, ref: ActorRef) -> tuple[float, float]:
        samples = []
        clock = ref.endpoint(StageActor.clock, timeout=5)
        for _ in range(CLOCK_PROBES):
            sent = time.time()
            remote = float(await clock.call())
            samples.append((sent, remote, time.time()))
        return estimate_offset(samples)

    # -- life ----------------------------------------------------------------------------------

    async def close(self, stop_stages: Callable[[list[ActorRef]], Awaitable[None]]) -> None:
        """Ends the job within a few seconds, whatever it was doing: the run and the operation in
        progress are cancelled (a step is aborted on its stages), then the stage actors stop."""
        if self.run_state is not None and self.run_state.task is not None:
            self.run_state.task.cancel()
        if self.operation is not None:
            self.operation.cancel()
        try:
            await asyncio.wait_for(self.lock.acquire(), CLOSE_WAIT_S)
            held = True
        except TimeoutError:
            log.warning("%s: closing while an operation still holds it", self.id)
            held = False
        try:
            await stop_stages(self.stages)
            if self.rendezvous is not None:
                await self.runtime.stop_actor(self.rendezvous)
                self.rendezvous = None
        finally:
            if held:
                self.lock.release()
