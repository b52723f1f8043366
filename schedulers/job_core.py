"""One job's members, its position in training and its hold on them: what every part of its controller shares.

:class:`JobCore` is the state the parts of :class:`~schedulers.control.JobController`
(the step path, runs, settings) and its helper modules (:mod:`schedulers.recovery`,
:mod:`schedulers.job_state`) work on. They read its attributes and change it only
through its methods, each named for what happened (``rolled_back``, ``moved``,
``loaded``), so that no part writes another's bookkeeping by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from actors import ActorRef, Event, Host
from stages import Mesh, StageReport
from schedulers.checkpoint_paths import CheckpointPath
from schedulers.data_positions import DataPositions
from schedulers.jobs import AUTO_PROBE, JobSpec
from schedulers.planning import AutoSchedule
from schedulers.records import StepStats
from schedulers.scaling import LossScaler
from schedulers.schedules import build_schedule, forward_only

__all__ = ["JobCore", "Placer", "compile_programs", "evaluation_programs"]

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
    programs = _compiled(name, spec.parallelism.pipeline_stages, spec.parallelism.micro_batches,
                         spec.num_virtual_stages if spec.parallelism.schedule != "auto" else None,
                         spec.runtime.gradient_accumulation_fusion,
                         spec.parallelism.w_batching if w_batching is None else w_batching)
    return {rank: list(program) for rank, program in programs.items()}


def evaluation_programs(spec: JobSpec) -> dict[int, list[str]]:
    """The forward-only programs ``spec``'s evaluations run, one per pipeline rank, as action text
    (see :func:`~schedulers.schedules.forward_only`)."""
    programs = forward_only(spec.parallelism.pipeline_stages, spec.parallelism.micro_batches, spec.num_virtual_stages,
                            spec.parallelism.placement)
    return {rank: [str(a) for a in program] for rank, program in programs.items()}


@functools.lru_cache(maxsize=64)
def _compiled(name: str, stages: int, micro_batches: int, virtual: int | None, split: bool,
              batch_w: bool) -> dict[int, tuple[str, ...]]:
    # Once per schedule: the head compiles a new spec off its loop (schedulers.limits.off_loop),
    # and the job's own compile of the same sizes then finds it here.
    schedule = build_schedule(name, stages, micro_batches, virtual, split=split, batch_w=batch_w)
    return {rank: tuple(str(a) for a in program) for rank, program in schedule.items()}


@dataclass(frozen=True, slots=True)
class Placer:
    """What a recovery asks of the scheduler: free nodes, a stage spawned, a fresh rendezvous, stages stopped."""

    # ``count`` alive nodes no job uses, none of ``taken``: (name, key identity) each.
    free_nodes: Callable[[int, set[str]], Awaitable[list[tuple[str, str]]]]
    # Rank R's stage actor of the job, built on node N with this dist config.
    spawn: Callable[[JobCore, int, str, dict[str, Any] | None], Awaitable[ActorRef]]
    # A new rendezvous for the job's (new) members: (its name, the stages' dist config); the old one stops.
    renew_rendezvous: Callable[[JobCore], Awaitable[tuple[str, dict[str, Any]]]]
    # Stops stage actors through their nodes' agents (those of nodes still alive).
    stop: Callable[[list[ActorRef]], Awaitable[None]]


class JobCore:
    """A job's members (stage actors, nodes, rendezvous), its position in training, and its lock.

    Every attribute is public to read; the helpers change the job through the methods.

    Args:
        check_members: run at the start of every :meth:`operation`, under the lock (the
            controller's: fail fast on a lost node, or recover from it).
    """

    def __init__(
        self, *, runtime: Host, job_id: str, spec: JobSpec, stages: list[ActorRef], nodes: list[str],
        bounds: list[list[int]], publish: Publish, alive_nodes: Callable[[], Awaitable[set[str]]],
        check_members: Callable[[bool], Awaitable[None]], rendezvous: str | None = None, owner: str = "",
        placer: Placer | None = None, identities: list[str] | None = None,
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
        self.programs = self.compile(spec)
        self.rendezvous = rendezvous  # the name of the job's torch.distributed rendezvous actor, if any
        self.placer = placer
        self.identities = sorted(set(identities or ()) - {""})  # the keys of the job's nodes
        self.lock = asyncio.Lock()
        self.waiting = 0  # operations waiting for the lock (a run that steps ahead lets them in: see StepPath.dispatch)
        self.operation_task: asyncio.Task[Any] | None = None  # the call holding the lock (close cancels it)
        # A driver's steps and evaluations, holding the job or waiting for it: what a driver that gave up
        # on its call cancels (cancel_step), never a run's steps.
        self.driver_calls: set[asyncio.Task[Any]] = set()
        # Ranks whose node was lost during a step they were not told to abort: aborted when it comes back.
        self.fenced: dict[int, int] = {}
        self.broken: str | None = None  # set when stages may disagree (a release failed): only load or close help
        self.next_step = 0  # the next step number: one per attempt, never reused (it fences stale messages)
        self.collecting: int | None = None  # the step whose answers are awaited (a run may send the next ahead)
        self.applied = 0  # steps the stages' state holds (rolled back by a recovery)
        self.steps_done = 0  # steps the job has completed (what a recovery replays up to)
        # Whole checkpoints loaded so far: a step count reached again after one (job.load of an older
        # version) is a new save and evaluation point, where a recovery's replay of the same steps is not.
        self.loads = 0
        # Each step's batch since the snapshot a recovery would roll back to ((None, None): the data factory).
        self.history: dict[int, tuple[Any, Any]] = {}  # applied-step index -> (inputs, targets)
        self.restarts = 0
        self.retired: list[tuple[str, ActorRef]] = []  # stage actors replaced by a recovery, stopped if their node returns
        # fp16: the loss scale every stage's next step uses (None: no scaling).
        mp = spec.mixed_precision
        self.scaler: LossScaler | None = None if mp.precision != "fp16" else LossScaler.for_spec(
            mp.loss_scale, mp.initial_scale_power, mp.loss_scale_window, mp.hysteresis, mp.min_loss_scale)
        # The scaler as it was with each number of steps applied since the snapshot a recovery would roll
        # back to: the scale goes back with the stages, or each replayed step would move it again.
        self.scales: dict[int, dict[str, float | int]] = {}
        self._keep_scale()
        # Learning rates ``set lr`` gave the running job, by the applied step each holds from: every
        # step's order carries its own (StepOrder.lr), so that a replay after a recovery steps as the
        # first time did, on either side of a change.
        self.learning_rates: dict[int, float] = {}
        self.data = DataPositions(self.mesh.data * spec.parallelism.micro_batches)  # where each step's batch begins
        self.last_checkpoint: tuple[CheckpointPath, int] | None = None  # (where, step) of this job's newest save
        self.driver_batches = False  # a step took the driver's batch (so the data factory cannot replay it)
        self.snapshot_due = False  # take one at the next step whatever snapshot_every says (after a load)
        self.last_reports: list[StageReport] = []
        self.last_stats: StepStats | None = None
        self._publish = publish
        self._alive_nodes = alive_nodes
        self._check_members = check_members

    def compile(self, spec: JobSpec) -> dict[int, list[str]]:
        """The programs of the job's next step (with ``schedule="auto"``: what the plan runs now)."""
        return compile_programs(spec, self.auto.running(spec), self.auto.running_w_batching(spec))

    def publish(self, event: Event) -> None:
        """Tells the scheduler's subscribers ``event``."""
        self._publish(event)

    async def alive_nodes(self) -> set[str]:
        """The names of the cluster's alive nodes (the head's view)."""
        return await self._alive_nodes()

    async def lost_member(self) -> str | None:
        """The node of a member this job has lost (its stage process ended, or the head lost the node);
        None while every member is there. A call to a lost member that was not already waiting when it was
        lost waits out its timeout: ask this first where nothing else has (a save in a step's hold)."""
        for rank, ref in enumerate(self.stages):
            if self.runtime.lost(ref.address) is not None:
                return self.nodes[rank]
        alive = await self.alive_nodes()
        return next((node for node in self.nodes if node not in alive), None)

    @contextlib.asynccontextmanager
    async def operation(self, *, stepping: bool = False, repairs: bool = False) -> AsyncIterator[None]:
        """Holds the job for one operation (a step, a state read or load) that ``close`` may cancel.

        Args:
            stepping: the operation is a driver's step or evaluation (``cancel_step`` may cancel it, held
                or waiting for the job).
            repairs: the operation may run on stages that disagree (a load).

        Raises:
            NodeLost: a node of the job is lost (at once: nothing is sent to the others).
            StepFailed: the stages may disagree after a failed release (load a checkpoint).
        """
        task = asyncio.current_task()
        if stepping and task is not None:
            self.driver_calls.add(task)
        try:
            self.waiting += 1
            try:
                await self.lock.acquire()
            finally:
                self.waiting -= 1
            try:
                await self._check_members(repairs)
                self.operation_task = task
                try:
                    yield
                finally:
                    self.operation_task = None
            finally:
                self.lock.release()
        finally:
            self.driver_calls.discard(task)  # type: ignore[arg-type]

    def respecified(self, spec: JobSpec, *, costs_moved: bool = True) -> None:
        """The job runs ``spec`` from its next step on (settings changed at the barrier); ``costs_moved``:
        what changed moves the step's costs (a learning rate does not), and ``auto`` measures again."""
        self.spec = spec
        if costs_moved:
            self.auto.reset(spec)  # the costs it planned with may have changed
        self.programs = self.compile(spec)

    # -- what a step did -------------------------------------------------------------------

    def keep_batch(self, inputs: Any, targets: Any) -> int:
        """The next step's batch ((None, None): the data factory's), kept for a replay; the step count it reaches."""
        self.history[self.steps_done] = (inputs, targets)
        return self.steps_done + 1

    def completed(self, goal: int, *, driver_batch: bool) -> None:
        """The job completed ``goal`` steps; batches older than a recovery could replay are dropped."""
        self.steps_done = goal
        self.driver_batches = self.driver_batches or driver_batch
        oldest = self.applied - 2 * self.spec.fault_tolerance.snapshot_every
        for old in [k for k in self.history if k < oldest]:
            del self.history[old]
        for old in [k for k in self.scales if k < oldest]:
            del self.scales[old]

    def learning_rate(self, position: int) -> float | None:
        """The learning rate of the step that applies step ``position`` (None: never set before it)."""
        since = [start for start in self.learning_rates if start <= position]
        return self.learning_rates[max(since)] if since else None

    def attempted(self) -> int:
        """A new attempt at a step: its number (one per attempt, never reused)."""
        step = self.next_step
        self.next_step += 1
        return step

    def applied_one(self, reports: list[StageReport]) -> None:
        """The stages applied one more step; ``reports`` are theirs (the trace and the plan read them)."""
        self.applied += 1
        self.snapshot_due = False
        self.last_reports = reports
        self._keep_scale()

    def _keep_scale(self) -> None:
        """Keeps the fp16 scaler's state as it is with ``applied`` steps applied (see ``scales``)."""
        if self.scaler is not None:
            self.scales[self.applied] = self.scaler.state_dict()

    def diverged(self, why: str) -> None:
        """The stages may disagree (a release failed part-way): only a load or close helps."""
        self.broken = why

    def fence(self, rank: int, step: int) -> None:
        """Rank ``rank``'s node was lost during step ``step``: it is told to abort it if it comes back."""
        self.fenced[rank] = max(step, self.fenced.get(rank, step))

    def recompile(self) -> None:
        """The programs follow what ``schedule="auto"`` runs now."""
        self.programs = self.compile(self.spec)

    # -- what a recovery does (schedulers.recovery) -------------------------------------------

    def restarting(self) -> None:
        """A recovery begins: it counts against ``max_restarts``."""
        self.restarts += 1

    def moved(self, rank: int, node: str, identity: str) -> None:
        """Rank ``rank`` moves to ``node`` (key ``identity``); its old actor is retired (stopped if its node
        returns)."""
        self.retired.append((self.nodes[rank], self.stages[rank]))
        self.nodes[rank] = node
        self.identities = sorted({*self.identities, identity} - {""})

    def renewed_rendezvous(self, name: str | None) -> None:
        """The job's process groups form again through rendezvous actor ``name`` (None: it stopped)."""
        self.rendezvous = name

    def replaced(self, rank: int, ref: ActorRef) -> None:
        """Rank ``rank``'s stage actor is now ``ref``."""
        self.stages[rank] = ref

    def replays_from_factory(self, start: int) -> None:
        """The steps from ``start`` on are replayed from the data factory (their batches were not kept)."""
        for k in range(start, self.steps_done):
            self.history.setdefault(k, (None, None))

    def rolled_back(self, step: int) -> None:
        """Every stage holds step ``step``'s state again, all agreeing; the steps since are to replay."""
        self.fenced.clear()
        self.broken = None
        self.applied = step
        if self.scaler is not None and step in self.scales:  # else a checkpoint's, loaded with it
            self.scaler.load_state_dict(self.scales[step])

    def returned(self, alive: set[str]) -> list[ActorRef]:
        """Retired stage actors whose node is alive again (no longer retired: the caller stops them)."""
        back = [(node, ref) for node, ref in self.retired if node in alive]
        for entry in back:
            self.retired.remove(entry)
        return [ref for _, ref in back]

    # -- what state and checkpoints do (schedulers.job_state) -----------------------------------

    def restarted_history(self) -> None:
        """After a load the stages hold another history: no batch kept and no snapshot from
        before counts, nor the job's last save (a recovery went back to it and dropped what was
        loaded, or replayed a range it no longer had: an assertion failed on every later step); the
        next step takes a snapshot whatever ``snapshot_every`` says."""
        self.broken = None
        self.last_checkpoint = None
        self.history.clear()
        self.scales.clear()
        self._keep_scale()
        self.snapshot_due = True
        if self.learning_rates:  # the rate set last holds on, from wherever the loaded steps stand
            self.learning_rates = {0: self.learning_rates[max(self.learning_rates)]}

    def checkpoint_applied(self) -> None:
        """Every stage took a checkpoint's state: they agree again, and drop their snapshots."""
        self.broken = None
        self.snapshot_due = True

    def loaded(self, step: int) -> None:
        """A whole checkpoint of step ``step`` was loaded: the data factory goes on from there."""
        self.applied = self.steps_done = step
        self.loads += 1

    def saved(self, path: CheckpointPath, step: int) -> None:
        """A checkpoint of step ``step`` is in ``path``: what a recovery falls back to."""
        self.last_checkpoint = (path, step)
