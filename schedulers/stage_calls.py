"""A step's calls to every stage actor and their answers: orders out, reports in, failures named.

:class:`StageCalls` sends each stage actor its :class:`~stages.StepOrder` (``run_step``)
and waits for the answers within the step's timeout; it turns a stage that failed, a
node that was lost or a step that outlived its timeout into a :class:`~actors.StepFailed`
that names the stage, the action and the cause, after every stage aborted the step
(:meth:`StageCalls.abort`). :class:`~schedulers.step_path.StepPath` decides what the
orders say and what the answers mean.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from actors import ActorError, ActorLost, NodeLost, StepFailed, error_from_wire, names_type
from stages import StageActor, StageReport, StepOrder
from schedulers.job_core import JobCore
from schedulers.job_views import JobViews
from schedulers.stepping import stage_lost, step_failed
from stages.comm.p2p import PeerClosed
from transport.stream import StreamBroken

__all__ = ["LOSS_GRACE_S", "StageCalls"]

log = logging.getLogger(__name__)

# How long a step whose reduction failed, or whose stage's link to a neighbour closed, waits for the failure
# detector to name a lost node (the head's heartbeat timeout, 2 s by default, and a margin): see
# StageCalls._lost_instead.
LOSS_GRACE_S = 5.0


class StageCalls:
    """One job's calls to its stage actors for a step (see the module docstring)."""

    def __init__(self, job: JobCore, views: JobViews) -> None:
        self.job = job
        self.views = views

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
            if failure is not None and not isinstance(failure, NodeLost) and _may_be_a_loss(failure):
                failure = await self._lost_instead(tasks, failure, deadline)
            reports = [] if failure else [tasks[rank].result() for rank in sorted(tasks)]
            if failure is None and not all(r.status == "done" for r in reports):
                failure = StepFailed("step aborted on request", details={"stage": None, "action": None,
                                                                          "cause": "aborted"})
            if failure is not None:
                await self.abort(step, tasks, failure.details.get("silent", ()), failure.details.get("busy", ()))
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
        marked its node lost. A stage whose link to a neighbour closed under its send (``StreamBroken``,
        or gloo's ``PeerClosed`` on ``transport="dist"``) most often lost that neighbour, and its report
        can reach the head before the lost node's news does. Waits for that (at most :data:`LOSS_GRACE_S`)
        so that the step fails with ``NodeLost``, which a job with ``max_restarts`` recovers from, as it did
        when the reduction came after every stage's barrier; else the stage's own failure.

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
        report, lines, silent, busy = await self.views.hang_report()
        return StepFailed(
            f"step timed out after {job.spec.fault_tolerance.step_timeout_s}s:\n{report}",
            details={"stage": None, "action": None, "cause": "timeout", "where": lines, "silent": silent,
                     "busy": busy},
        )

    async def abort(self, step: int, tasks: Mapping[int, asyncio.Future[Any]], silent: Sequence[int] = (),
                    busy: Sequence[int] = ()) -> None:
        """Tells every stage to abort step ``step`` and waits (a while) for the calls in ``tasks`` to end.

        A stage in ``silent`` (global ranks) did not answer the hang report's question: it holds its
        interpreter, so it is told without waiting for a reply that would come only after the wait
        (which held a timed-out step's error back by 5 s). A stage in ``busy`` computed one action for
        the whole timeout: it takes the abort, but ends its step only once the action does, so its call
        is not waited for either.
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
        # end its step either: waiting for it only delays the error; nor will one that has computed one action
        # for the whole step timeout (``busy``: its thread ends the action first; the error came 5 s late).
        waiting = [tasks[rank] for rank, ok in zip(reachable, told) if ok and rank in tasks and rank not in busy]
        if waiting:
            await asyncio.wait(waiting, timeout=5)

    async def on_every_stage(self, method: Callable[..., Awaitable[Any]], action: str, *args: Any) -> list[Any]:
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


def _may_be_a_loss(failure: StepFailed) -> bool:
    """Whether ``failure`` is what a lost peer causes before the failure detector names it (see
    :meth:`StageCalls._lost_instead`): a reduction's collective broken, or a link to a neighbour closed."""
    # The cause reads e.g. "transport.stream.StreamBroken: the stream link to ... closed while sending"
    return failure.action == "REDUCE" or names_type(str(failure.details.get("cause", "")), StreamBroken, PeerClosed)


def _lost_calls(tasks: Mapping[int, asyncio.Future[Any]]) -> dict[int, asyncio.Future[Any]]:
    """The stage calls, by rank, that ended in ``NodeLost`` or :class:`ActorLost` (its process ended)."""
    return {rank: task for rank, task in tasks.items()
            if task.done() and not task.cancelled() and isinstance(task.exception(), NodeLost | ActorLost)}
