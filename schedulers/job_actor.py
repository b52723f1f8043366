"""One job's actor, on the head: each operation on a job is one of its endpoints, written once.

:meth:`SchedulerActor.create_job <schedulers.scheduler.SchedulerActor.create_job>` spawns
one :class:`JobActor` per job (named ``<job>.control``) and returns its address in
:class:`~schedulers.records.JobInfo`; the driver's :class:`~schedulers.client.Job` calls
it by a typed ref (``ref.endpoint(JobActor.step).call(...)``). Only the client that
created the job, or the admin key, may call it, and a client's checkpoints stay in its
own subtree of the head's checkpoint root (:mod:`schedulers.checkpoint_paths`).
Closing the job stops the actor.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from actors import Actor, ActorRef, NotAllowed, current_caller, endpoint, may_see
from schedulers.checkpoint_paths import CheckpointPath, resolve
from schedulers.control import JobController
from schedulers.records import EvalResult, JobDescription, Plan, RunInfo, SettingChange, StepStats, WhereReport

__all__ = ["JobActor", "may_act_on"]

log = logging.getLogger(__name__)


def may_act_on(owner: str) -> bool:
    """Whether the caller of the endpoint being served is ``owner`` (or may act on every job)."""
    return may_see(current_caller(), owner)


class JobActor(Actor):
    """The operations on one job: steps, runs, settings, queries, state and checkpoints, close.

    Each endpoint hands the call to the job's :class:`~schedulers.control.JobController`
    after checking that the caller owns the job.
    """

    def __init__(
        self, job: JobController, *, stop_stages: Callable[[list[ActorRef]], Awaitable[None]],
        closed: Callable[[str], Awaitable[None]], checkpoint_root: str,
    ) -> None:
        """
        Args:
            job: the job's controller.
            stop_stages: stops stage actors (the scheduler's; a lost node's go with it).
            closed: told the job's id once it is closed (the scheduler forgets the job and stops this actor).
            checkpoint_root: the head's checkpoint root (absolute): a client's checkpoints stay under
                ``checkpoint_root/NAME``.
        """
        self.controller = job
        self.checkpoint_root = checkpoint_root
        self._stop_stages = stop_stages
        self._closed = closed
        self._closing = False

    @property
    def id(self) -> str:
        return self.controller.core.id

    @property
    def owner(self) -> str:
        """``role:name`` of the key that created the job."""
        return self.controller.core.owner

    @property
    def nodes(self) -> list[str]:
        """The job's nodes by global rank."""
        return self.controller.core.nodes

    def _controller(self) -> JobController:
        """The job, if the caller owns it (or holds the admin key).

        Raises:
            NotAllowed: another client's job.
        """
        if not may_act_on(self.owner):
            self.refused_calls += 1
            raise NotAllowed(f"{self.id} belongs to {self.owner}; only its owner or the admin key may act on it")
        return self.controller

    def _checkpoint_path(self, directory: str, relative_to: str | None) -> CheckpointPath:
        """``directory`` resolved for the caller (see :func:`schedulers.checkpoint_paths.resolve`).

        Raises:
            NotAllowed: a client's path outside its own subtree of the checkpoint root.
        """
        try:
            return resolve(directory, relative_to, caller=current_caller(), root=self.checkpoint_root)
        except NotAllowed:
            self.refused_calls += 1
            raise

    # -- training ---------------------------------------------------------------------------

    @endpoint(concurrent=True, roles=("client",))
    async def step(self, inputs: Any = None, targets: Any = None) -> StepStats:
        """One optimizer step. See :meth:`JobController.step <schedulers.control.JobController.step>`."""
        return await self._controller().step(inputs, targets)

    @endpoint(concurrent=True, roles=("client",))
    async def evaluate(self, inputs: Any = None, targets: Any = None, outputs: bool = False,
                       data_step: int | None = None) -> EvalResult:
        """A forward-only pass. See :meth:`JobController.evaluate <schedulers.control.JobController.evaluate>`."""
        return await self._controller().evaluate(inputs, targets, outputs, data_step)

    @endpoint(concurrent=True, roles=("client",))
    async def cancel_step(self) -> bool:
        """Cancels the step or evaluation in progress (a driver that cancelled ``job.step`` or
        ``job.evaluate``); every stage aborts it.

        Returns:
            Whether one was running.
        """
        return self._controller().cancel_step()

    @endpoint(concurrent=True, roles=("client",))
    async def run(self, num_steps: int) -> RunInfo:
        """Starts ``num_steps`` steps from the job's data factory in the background."""
        return self._controller().run(num_steps)

    @endpoint(concurrent=True, roles=("client",))
    async def wait(self) -> RunInfo | None:
        """The run going on, once it has ended. See :meth:`JobController.wait <schedulers.control.JobController.wait>`."""
        return await self._controller().wait()

    @endpoint(concurrent=True, roles=("client",))
    async def pause(self) -> JobDescription:
        """Holds the job's run before its next step."""
        return self._controller().pause()

    @endpoint(concurrent=True, roles=("client",))
    async def resume(self) -> JobDescription:
        """Lets a paused run go on."""
        return self._controller().resume()

    @endpoint(concurrent=True, roles=("client",))
    async def stop(self) -> JobDescription:
        """Ends the job's run after its current step (the job stays)."""
        return self._controller().stop()

    @endpoint(concurrent=True, roles=("client",))
    async def set(self, key: str, value: Any) -> SettingChange:
        """Changes ``key`` from the next step on."""
        return await self._controller().set(key, value)

    # -- looking at it ----------------------------------------------------------------------

    @endpoint(concurrent=True, roles=("client",))
    async def describe(self) -> JobDescription:
        """The job's spec, layout, programs, run and last step."""
        return self._controller().describe()

    @endpoint(concurrent=True, roles=("client",))
    async def where(self) -> WhereReport:
        """Each stage's current action, what it waits for, the marked grid."""
        return await self._controller().where()

    @endpoint(concurrent=True, roles=("client",))
    async def plan(self) -> Plan:
        """The candidate schedules with predicted step time and stash, the chosen one marked."""
        return await self._controller().plan()

    @endpoint(concurrent=True, roles=("client",))
    async def trace(self) -> dict[str, Any]:
        """The last step's measured timeline as Chrome/Perfetto trace JSON, on the head's clock."""
        return await self._controller().trace()

    # -- state ------------------------------------------------------------------------------

    @endpoint(concurrent=True, roles=("client",))
    async def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state under the unpartitioned keys."""
        return await self._controller().state_dict()

    @endpoint(concurrent=True, roles=("client",))
    async def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads a whole-model state into every member; every key must be taken."""
        await self._controller().load_state_dict(state)

    @endpoint(concurrent=True, roles=("client",))
    async def save(self, directory: str, relative_to: str | None = None) -> str:
        """Writes a checkpoint to ``directory``; the new version's path.

        A client's ``directory`` is taken under its own subtree of the checkpoint root
        (relative) or must lie inside it (absolute); the admin's is any absolute path, or
        a relative one under ``relative_to`` (the driver's working directory). The
        stages write, the head only coordinates (see :func:`schedulers.job_state.write_checkpoint`).

        Raises:
            NotAllowed: another client's job, or a client's path outside its subtree.
        """
        job = self._controller()
        return await job.save(self._checkpoint_path(directory, relative_to))

    @endpoint(concurrent=True, roles=("client",))
    async def export(self, directory: str, relative_to: str | None = None, format: str = "safetensors") -> str:
        """Writes the weights as a model directory ``from_pretrained`` loads, to ``directory`` (as
        for :meth:`save`); its path.

        Raises:
            NotAllowed: another client's job, or a client's path outside its subtree.
        """
        job = self._controller()
        return await job.export(self._checkpoint_path(directory, relative_to), str(format))

    @endpoint(concurrent=True, roles=("client",))
    async def load(self, directory: str, weights_only: bool = False, relative_to: str | None = None) -> int:
        """Loads the checkpoint in ``directory`` (as for :meth:`save`), all or nothing; returns its step.

        Raises:
            NotAllowed: another client's job, or a client's path outside its subtree.
        """
        job = self._controller()
        return await job.load(self._checkpoint_path(directory, relative_to), bool(weights_only))

    # -- life -------------------------------------------------------------------------------

    @endpoint(concurrent=True, roles=("client",))
    async def close(self) -> None:
        """Stops the job's run and its stage actors (after a step in progress), then this actor; twice is fine."""
        job = self._controller()
        if self._closing:
            return
        self._closing = True
        await job.close(self._stop_stages)
        await self._closed(self.id)
