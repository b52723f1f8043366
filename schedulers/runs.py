"""A job's runs: N steps it takes on its own from its data factory, paused, resumed and stopped.

A run is a task :class:`Runs` owns (the job's close cancels it); ``pause`` holds the
run before its next step, ``resume`` lets it go on, ``stop`` ends it after the
steps in flight. Where the job allows it (:meth:`~schedulers.step_path.StepPath.may_step_ahead`),
each step's orders go out while the step before it finishes, so a stage goes from one
step's tail straight into the next (:func:`steps_ahead`):
then two steps can be in flight, and a stop or pause ends the run after both.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from actors import ActorError, NodeLost, StageLost
from schedulers.events import JobPaused, JobResumed, RunFinished, RunProgress, RunStarted
from schedulers.job_core import JobCore
from schedulers.recovery import may_recover
from schedulers.records import EvalResult, RunInfo, StepStats
from schedulers.self_evaluations import BetweenSteps
from schedulers.settings import Settings
from schedulers.step_path import Dispatched, StepPath

__all__ = ["RunState", "Runs", "steps_ahead"]


@dataclass(slots=True)
class RunState:
    """A run of ``target`` steps the controller takes from the job's data factory."""

    target: int
    first_step: int
    done: int = 0
    ahead: int = 0  # of done, the steps sent while the one before was in flight
    stop: bool = False
    early: bool = False  # stopped by early stopping (evaluation.early_stopping_patience)
    error: str | None = None
    task: asyncio.Task[Any] | None = None
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set by resume and stop
    over: asyncio.Event = field(default_factory=asyncio.Event)  # set once the run has ended

    @property
    def finished(self) -> bool:
        return self.over.is_set()

    def info(self) -> RunInfo:
        return RunInfo(target=self.target, first_step=self.first_step, done=self.done, active=not self.finished,
                       stopping=self.stop, error=self.error, ahead=self.ahead, stopped_early=self.early,
                       elapsed_s=(self.ended if self.ended is not None else time.perf_counter()) - self.started)


class Runs:
    """One job's run (at most one at a time) and whether it is paused.

    Args:
        step: one step of the job from its data factory (the controller's).
        steps_ahead: steps while ``more(in_flight)``, each sent while the one before finishes, calling
            ``done(ahead)`` after each (``ahead``: it went out while the one before was in flight); False
            where the job cannot (:func:`steps_ahead`, bound to the job's parts by its controller).
    """

    def __init__(self, job: JobCore, step: Callable[[], Awaitable[Any]],
                 steps_ahead: Callable[[Callable[[int], bool], Callable[[bool], None]], Awaitable[bool]] | None = None
                 ) -> None:
        self.job = job
        self._step = step
        self._steps_ahead = steps_ahead
        self.paused = False
        self.state: RunState | None = None

    @property
    def running(self) -> bool:
        return self.state is not None and not self.state.finished

    def progress(self) -> RunProgress | None:
        """How far the run is with the step of its own that just ended, for that step's event (None: no run).
        A driver's step while the run is paused is no step of the run's (its event has none)."""
        run = self.state
        if run is not None and not run.finished:
            return RunProgress(done=run.done + 1, target=run.target)
        return None

    def start(self, num_steps: int) -> RunInfo:
        """Starts ``num_steps`` steps from the job's data factory, in the background.

        Raises:
            ValueError: no data factory, a bad count, or a run already going.
        """
        job = self.job
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"run needs a number of steps >= 1, got {num_steps!r:.40}")
        if job.spec.training.data is None:
            raise ValueError(f"{job.id} has no data factory to run from; start it with data='pkg.mod:factory' "
                             "(or drive it with job.step(inputs, targets))")
        if self.running:
            assert self.state is not None
            raise ValueError(f"{job.id} is already running ({self.state.done}/{self.state.target} steps); "
                             f"wait for it or stop it first")
        state = self.state = RunState(target=num_steps, first_step=job.steps_done)
        state.task = job.runtime.spawn_task(self._run_steps(state), name=f"{job.id} run")
        job.publish(RunStarted(job=job.id, steps=num_steps, paused=self.paused))
        return state.info()

    async def _run_steps(self, state: RunState) -> None:
        job = self.job

        def more(in_flight: int) -> bool:  # another step, with in_flight steps not yet done
            return not state.stop and not self.paused and state.done + in_flight < state.target

        def done(ahead: bool = False) -> None:
            state.done += 1
            state.ahead += ahead

        reason = "cancelled"
        try:
            while state.done < state.target and not state.stop:
                if self.paused:
                    job.publish(JobPaused(job=job.id, step=job.next_step))
                    while self.paused and not state.stop:
                        state.wake.clear()
                        await state.wake.wait()
                    if state.stop:
                        break
                    job.publish(JobResumed(job=job.id, step=job.next_step))
                if self._steps_ahead is None or not await self._steps_ahead(more, done):
                    await self._step()
                    done()
            reason = "done" if state.done == state.target else "stopped"
        except Exception as exc:  # noqa: BLE001 - a run reports whatever ended it
            state.error = str(exc) if isinstance(exc, ActorError) else f"{type(exc).__name__}: {exc}"
            reason = "failed"
        finally:
            state.ended = time.perf_counter()
            state.over.set()
            job.publish(RunFinished(job=job.id, done=state.done, target=state.target, reason=reason,
                                    error=state.error))

    async def wait(self) -> RunInfo | None:
        """The run going on when called, once it has ended (done, stopped, failed or cancelled with
        the job), or the last run if none is going on; None if the job never ran."""
        state = self.state
        if state is None:
            return None
        await state.over.wait()
        return state.info()

    def pause(self) -> None:
        """Holds the run before its next step (the current one finishes, optimizer step included)."""
        self.paused = True
        if not self.running:
            self.job.publish(JobPaused(job=self.job.id, step=self.job.next_step))

    def resume(self) -> None:
        """Lets a paused run go on."""
        self.paused = False
        if self.state is not None:
            self.state.wake.set()
        if not self.running:
            self.job.publish(JobResumed(job=self.job.id, step=self.job.next_step))

    def stop(self) -> None:
        """Ends the run after the steps in flight (and out of a pause)."""
        if self.state is not None:
            self.state.stop = True
            self.state.wake.set()

    def stop_early(self) -> None:
        """Ends the run going on after this step: the job's evaluations stopped improving."""
        if self.running:
            assert self.state is not None
            self.state.early = True
            self.stop()

    def cancel(self) -> None:
        """Cancels the run's task (the job is closing)."""
        if self.state is not None and self.state.task is not None:
            self.state.task.cancel()


async def steps_ahead(job: JobCore, path: StepPath, settings: Settings,
                      finished: Callable[[StepStats, int, EvalResult | None], Any],
                      recover: Callable[[NodeLost | StageLost, int], Awaitable[StepStats]], between: BetweenSteps,
                      more: Callable[[int], bool], done: Callable[[bool], None]) -> bool:
    """A run's steps from the data factory, each step's orders sent while the step before it finishes
    (:meth:`~schedulers.step_path.StepPath.dispatch` with ``after``), under one hold of the job, as
    long as ``more(n)`` (another step is wanted with ``n`` in flight) and nothing else waits for the
    job (a state read, a save: they come in between two steps); ``settings`` pending are applied
    first, ``finished(stats, applied, evaluated)`` and ``done(ahead)`` follow each step (``evaluated``: the
    evaluation due after it, or None; ``ahead``: it went out
    while the one before was in flight). False, having run nothing, where the job cannot step ahead
    (:meth:`~schedulers.step_path.StepPath.may_step_ahead`): the run takes its steps one by one.
    No step goes out ahead of one after which the job evaluates or saves itself (``between``): that
    comes right after the step, in this hold, and the next step goes out after it.

    A step that was not applied (skipped for a non-finite value, or failed) leaves the step sent
    after it refused by every stage (:attr:`~stages.StepOrder.after`): it is dropped, and the data
    position it would have read is read by the next step instead. A step that lost a node or a
    stage of a job that may recover (``max_restarts``) is followed by ``recover(lost, goal)``,
    which recovers and replays up to that step (the controller's, as its ``step`` does); the run
    then goes on sending each step ahead.

    Raises:
        NodeLost, StepFailed: as the controller's ``step``; the step sent ahead is stopped on every stage.
    """
    if not path.may_step_ahead():
        return False
    async with job.operation():  # not a driver's call: cancel_step leaves it alone, stop ends it
        await settings.apply_pending()
        if not path.may_step_ahead():
            return False
        goal = job.keep_batch(None, None)
        current: Dispatched | None = path.dispatch(None, None)
        ended, sent_ahead = None, False
        while current is not None:
            ahead = None
            if more(1) and not job.waiting and settings.pending_spec is None and not between.due(job.applied + 1) \
                    and path.may_step_ahead():
                ahead = path.dispatch(None, None, after=current)
            try:
                stats = await path.collect(current, since=ended)
            except BaseException as exc:
                if ahead is not None:
                    await asyncio.shield(path.drop(ahead))
                    ahead = None
                if not isinstance(exc, (NodeLost, StageLost)) or not may_recover(job):
                    raise
                stats = await recover(exc, goal)
            ended = time.perf_counter()
            job.completed(goal, driver_batch=False)
            finished(stats, job.applied, await between.evaluate())
            done(sent_ahead)
            await between.save()
            current, sent_ahead = ahead, ahead is not None
            if ahead is not None and stats.skipped:  # every stage refuses it: drop it, send it afresh
                await path.drop(ahead)
                current, sent_ahead = (path.dispatch(None, None) if more(0) else None), False
            if current is not None:
                goal = job.keep_batch(None, None)
    return True
