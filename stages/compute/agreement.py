"""A step's tail run by the stages themselves: reduce, agree on the decision, step.

Without it the scheduler drives the tail by two more round trips per step (every
stage's ``reduce_step``, its decision, every stage's ``finish_step``). With
:attr:`~stages.records.StepOrder.finish`, each stage runs its tail right after its
barrier: it reduces (:meth:`~stages.compute.tail.StepTail.reduce`), sends one small
:class:`~stages.records.TailVote` to every stage actor of the job and waits for
theirs (the collective: a few numbers each), makes the decision from the votes, in
rank order, with the same pure function the scheduler uses (:func:`decide_votes`),
and steps or drops. The driver gets one answer per step, and the scheduler makes the
same decision from the same numbers in the stages' reports, so its loss scale and
statistics follow without another message.

The votes of a step are fenced like deliveries: only for the stage's current step or
the next, at most one per member, so a stale or repeated vote is refused and what a
peer can make a stage hold is bounded by the mesh's size.

The tail shows in the step's trace, after the program's actions, as three spans named
by the program's own tail actions: ``REDUCE`` (the reduction, or what of it backward did
not hide), ``BARRIER`` (waiting for every stage's vote: where the stages meet) and
``STEP`` (the optimizer step, or the drop).

Up to :data:`ALL_TO_ALL_MAX` members each sends its vote to every other: one hop,
``n (n - 1)`` messages. Past it the messages would grow with the square of the mesh
(56 a step for 8 stage actors, 4,032 for 64), so every member sends its vote to the
first member (global rank 0) alone, which sends the whole tally, one vote per member
by rank, back to each: two hops, ``2 (n - 1)`` messages. Every member still decides
itself, from the same votes in the same order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

from actors._errors import NotAllowed
from stages.mesh import Mesh
from stages.program import Action, ActionKind
from stages.records import ReduceReport, StageReport, StepOrder, TailVote
from stages.compute.executor import StepExecutor, ended_early
from stages.compute.tail import StepDecision, StepTail, decide_step

__all__ = ["ALL_TO_ALL_MAX", "ROOT", "Ballot", "SendVote", "TailFailed", "decide_votes", "run_tail", "tail_report", "vote_of"]

SendVote = Callable[[int, int, TailVote], Awaitable[object]]
SendTally = Callable[[int, list[TailVote]], Awaitable[object]]

# The largest mesh whose members send their votes to one another; past it they go through ROOT.
ALL_TO_ALL_MAX = 4
ROOT = 0  # the global rank that gathers the votes of a larger mesh and sends back the tally


class TailFailed(Exception):
    """A stage's tail failed at ``action`` (``REDUCE`` or ``STEP``), for ``cause``."""

    def __init__(self, action: str, cause: BaseException) -> None:
        super().__init__(f"{action}: {cause}")
        self.action = action
        self.cause = cause


def vote_of(report: StageReport, reduced: ReduceReport) -> TailVote:
    """What a stage says of its step, from its report (losses, items) and its reduction's report."""
    return TailVote(nonfinite_loss=not all(math.isfinite(loss) for loss in report.losses),
                    nonfinite_gradient=bool(reduced.nonfinite), grad_sq=float(reduced.grad_sq),
                    items=float(sum(report.items)))


def decide_votes(mesh: Mesh, votes: Sequence[TailVote], *, loss_scale: float, fp16: bool, scale_at_floor: bool,
                 max_norm: float, per_item: bool = False) -> StepDecision:
    """The step's decision from every member's vote, by global rank: the squared norm adds the shares of
    data-parallel replica 0 in rank order (the replicas hold the same averaged gradients), so every stage
    and the scheduler compute the same float.

    Args:
        per_item: ``loss_averaging="tokens"``: the losses were sums, so the gradients are divided by
            the step's counted items (tensor rank 0's, every replica's) over the replicas their
            reduction averaged (at least one item, so a batch of nothing but padding steps nothing).
    """
    if len(votes) != mesh.size:
        raise ValueError(f"{len(votes)} votes for a mesh of {mesh.size}")
    grad_sq = sum(vote.grad_sq for rank, vote in enumerate(votes) if mesh.coords(rank).data == 0)
    items = sum(vote.items for rank, vote in enumerate(votes) if mesh.coords(rank).tensor == 0)
    return decide_step(nonfinite_loss=any(v.nonfinite_loss for v in votes),
                       nonfinite_gradient=any(v.nonfinite_gradient for v in votes), grad_sq=grad_sq,
                       loss_scale=loss_scale, fp16=fp16, scale_at_floor=scale_at_floor, max_norm=max_norm,
                       divisor=max(1.0, items) / mesh.data if per_item else 1.0)


class Ballot:
    """One stage's ballot box: its vote goes to every member (or, past :data:`ALL_TO_ALL_MAX` members,
    to :data:`ROOT`), theirs come in by :meth:`receive` (or all at once by :meth:`receive_tally`).

    Args:
        mesh: the job's mesh (its size is the number of votes a step needs).
        rank: this stage actor's global rank.
        all_to_all_max: the largest mesh whose members send their votes to one another.
    """

    def __init__(self, mesh: Mesh, rank: int, all_to_all_max: int = ALL_TO_ALL_MAX) -> None:
        self.mesh = mesh
        self.rank = rank
        self.through_root = mesh.size > all_to_all_max
        self.senders: list[SendVote] = []  # by global rank (see :meth:`connect`); this rank's is unused
        self.tally_senders: list[SendTally] = []  # likewise; the root's, through_root
        self._votes: dict[int, dict[int, TailVote]] = {}
        self._complete: dict[int, asyncio.Event] = {}
        self._poisoned: dict[int, BaseException] = {}  # step -> why a vote of it may never come

    def connect(self, senders: Sequence[SendVote], tally_senders: Sequence[SendTally] = ()) -> None:
        """Learns how to reach every member, by global rank: with its vote and, through the root,
        with the tally.

        Raises:
            ValueError: not one of each per member (tally senders: only through the root).
        """
        if len(senders) != self.mesh.size:
            raise ValueError(f"expected {self.mesh.size} members, got {len(senders)}")
        if self.through_root and len(tally_senders) != self.mesh.size:
            raise ValueError(f"a mesh of {self.mesh.size} votes through rank {ROOT}: expected "
                             f"{self.mesh.size} tally senders, got {len(tally_senders)}")
        self.senders = list(senders)
        self.tally_senders = list(tally_senders)

    def receive(self, current: int, step: int, rank: int, vote: TailVote) -> None:
        """Takes member ``rank``'s vote on ``step``, while this stage is at step ``current``.

        Raises:
            NotAllowed: a step other than the current or the next, a rank outside the mesh,
                a second vote of one member on one step, or a vote to a member other than the
                root of a mesh that votes through it.
        """
        if self.through_root and self.rank != ROOT:
            raise NotAllowed(f"a mesh of {self.mesh.size} votes through rank {ROOT}; rank {self.rank} takes its tally")
        self._fence(current, step, "a vote")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.mesh.size:
            raise NotAllowed(f"a vote from rank {rank!r:.20}, outside a mesh of {self.mesh.size}")
        box = self._votes.setdefault(step, {})
        if rank in box:
            raise NotAllowed(f"rank {rank} voted twice on step {step}")
        box[rank] = vote
        if len(box) == self.mesh.size:
            self._event(step).set()

    def receive_tally(self, current: int, step: int, votes: Sequence[TailVote]) -> None:
        """Takes every member's vote on ``step`` at once, from the root of a mesh that votes through it.

        Raises:
            NotAllowed: a ballot that takes votes one by one (or is the root's), a step other
                than the current or the next, not one vote per member, or a second tally.
        """
        if not self.through_root or self.rank == ROOT:
            raise NotAllowed(f"rank {self.rank} of a mesh of {self.mesh.size} takes votes, not a tally")
        self._fence(current, step, "a tally")
        if len(votes) != self.mesh.size:
            raise NotAllowed(f"a tally of {len(votes)} votes for a mesh of {self.mesh.size}")
        if step in self._votes:
            raise NotAllowed(f"a second tally of step {step}")
        self._votes[step] = dict(enumerate(votes))
        self._event(step).set()

    def _fence(self, current: int, step: object, what: str) -> None:
        """Refuses a step other than ``current`` or the next; drops what older steps left."""
        if isinstance(step, bool) or not isinstance(step, int) or not current <= step <= current + 1:
            raise NotAllowed(f"{what} on step {step!r:.20} while at step {current}: only this step's or the next's")
        for old in [s for s in self._votes if s < current]:
            self.forget(old)

    async def gather(self, step: int, vote: TailVote) -> list[TailVote]:
        """Sends this stage's ``vote`` to every other member (or to the root) and returns every member's,
        by rank, once all are in (cancelled by an abort; the scheduler aborts every stage when one fails)."""
        assert self.senders, "the ballot has no members (see connect)"
        if self.through_root and self.rank != ROOT:
            await self.senders[ROOT](step, self.rank, vote)
            return await self._counted(step)
        self.receive(step, step, self.rank, vote)
        if not self.through_root:
            await _send_all(send(step, self.rank, vote) for rank, send in enumerate(self.senders) if rank != self.rank)
            return await self._counted(step)
        votes = await self._counted(step)
        await _send_all(send(step, votes) for rank, send in enumerate(self.tally_senders) if rank != ROOT)
        return votes

    async def _counted(self, step: int) -> list[TailVote]:
        """Every member's vote on ``step``, by rank, once all are in; forgets them.

        Raises:
            What :meth:`poison` was given for ``step``.
        """
        await self._event(step).wait()
        poisoned = self._poisoned.get(step)
        box = self._votes.get(step, {})
        self.forget(step)
        if poisoned is not None and len(box) < self.mesh.size:
            raise poisoned
        return [box[rank] for rank in range(self.mesh.size)]

    def poison(self, steps: Iterable[int], error: BaseException) -> None:
        """A transfer lost a message, maybe a vote on one of ``steps``: a gather of one of them that has
        not every vote raises ``error``, now or when it comes to wait."""
        for step in steps:
            self._poisoned[step] = error
            self._event(step).set()

    def forget(self, step: int) -> None:
        """Drops ``step``'s votes (done, or aborted)."""
        self._votes.pop(step, None)
        self._complete.pop(step, None)
        self._poisoned.pop(step, None)

    def _event(self, step: int) -> asyncio.Event:
        event = self._complete.get(step)
        if event is None:
            event = self._complete[step] = asyncio.Event()
        return event


async def _send_all(sends: Iterable[Awaitable[object]]) -> None:
    """Awaits every send, one after the other (each made as the one before ended), and raises the
    first failure once all were tried.

    A vote is a tell of a few hundred bytes that leaves at once: sent in order from this task
    it costs no task and no turn of the loop (gathered, each took a task of its own, and the
    tail two turns of a busy loop more).
    """
    failure: Exception | None = None
    for send in sends:
        try:
            await send
        except Exception as exc:  # the other members still get this vote, as they did when gathered
            failure = failure or exc
    if failure is not None:
        raise failure


async def run_tail(tail: StepTail, ballot: Ballot, step: int, actions: Sequence[Action], order: StepOrder,
                   report: StageReport) -> StageReport:
    """Runs step ``step``'s tail after the barrier (see the module docstring); returns ``report`` with the
    tail's :class:`~stages.records.ReduceReport` and :class:`~stages.records.FinishReport`, and its
    spans after the actions'.

    Raises:
        TailFailed: the reduction (``REDUCE``) or the optimizer step (``STEP``) failed.
    """
    started = tail.executor.step_started
    times = [time.perf_counter() - started]  # on the spans' clock: seconds from the step's start
    try:
        reduced = await tail.reduce(step, actions)
    except Exception as exc:
        raise TailFailed("REDUCE", exc) from exc
    times.append(time.perf_counter() - started)
    votes = await ballot.gather(step, vote_of(report, reduced))
    times.append(time.perf_counter() - started)
    decision = decide_votes(ballot.mesh, votes, loss_scale=order.loss_scale if order.loss_scale is not None else 1.0,
                            fp16=order.fp16, scale_at_floor=order.scale_at_floor, max_norm=order.max_norm,
                            per_item=order.per_item)
    try:
        finished = await tail.finish(actions, apply=decision.apply, unscale=decision.unscale, clip=decision.clip)
    except Exception as exc:
        raise TailFailed("STEP", exc) from exc
    times.append(time.perf_counter() - started)
    named = {a.kind: str(a) for a in actions if a.kind in _TAIL_SPANS}
    spans = [[named[kind], start, end] for kind, start, end in zip(_TAIL_SPANS, times, times[1:]) if kind in named]
    return dataclasses.replace(report, reduced=reduced, finished=finished, spans=[*report.spans, *spans])


# The tail's spans, in the order they run: the reduction, the wait for every vote, the optimizer step.
_TAIL_SPANS = (ActionKind.REDUCE, ActionKind.BARRIER, ActionKind.STEP)


async def tail_report(executor: StepExecutor, ballot: Ballot, step: int, task: asyncio.Task[StageReport]
                      ) -> StageReport:
    """The report of step ``step``'s tail, run by ``task`` (:func:`run_tail`): done, failed (the step's
    values and votes dropped) or aborted."""
    ended = await ended_early(executor, step, task, TailFailed)
    if ended is not None:
        ballot.forget(step)
        return ended
    return task.result()
