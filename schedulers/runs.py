"""A job's runs: N steps it takes on its own from its data factory, paused, resumed and stopped.

A run is a task :class:`Runs` owns (the job's close cancels it); ``pause`` holds the
run before its next step, ``resume`` lets it go on, ``stop`` ends it after the
step in progress.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from actors import ActorError
from schedulers.events import JobPaused, JobResumed, RunFinished, RunProgress, RunStarted
from schedulers.job_core import JobCore
from schedulers.records import RunInfo

__all__ = ["RunState", "Runs"]


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


class Runs:
    """One job's run (at most one at a time) and whether it is paused.

    Args:
        step: one step of the job from its data factory (the controller's).
    """

    def __init__(self, job: JobCore, step: Callable[[], Awaitable[Any]]) -> None:
        self.job = job
        self._step = step
        self.paused = False
        self.state: RunState | None = None

    @property
    def running(self) -> bool:
        return self.state is not None and not self.state.finished

    def progress(self) -> RunProgress | None:
        """How far the run is, for a step's event (None: no run, or before its first step)."""
        run = self.state
        if run is not None and not run.finished and self.job.steps_done > run.first_step:
            return RunProgress(done=self.job.steps_done - run.first_step, target=run.target)
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
                await self._step()
                state.done += 1
            reason = "done" if state.done == state.target else "stopped"
        except Exception as exc:  # noqa: BLE001 - a run reports whatever ended it
            state.error = str(exc) if isinstance(exc, ActorError) else f"{type(exc).__name__}: {exc}"
            reason = "failed"
        finally:
            state.finished = True
            job.publish(RunFinished(job=job.id, done=state.done, target=state.target, reason=reason,
                                    error=state.error))

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
        """Ends the run after its current step (and out of a pause)."""
        if self.state is not None:
            self.state.stop = True
            self.state.wake.set()

    def cancel(self) -> None:
        """Cancels the run's task (the job is closing)."""
        if self.state is not None and self.state.task is not None:
            self.state.task.cancel()
