"""Check a schedule before anything runs it.

:func:`validate` accepts a compute-only schedule (F/B/I/W) or a lowered one (with
sends, receives and the step tail) and raises :class:`ScheduleError`, whose message
holds the whole grid with the offending action marked, at the first thing wrong:

- rank keys are ``0..P-1`` and every action sits on the rank that owns its stage;
- every stage runs every micro-batch's ``F`` exactly once, and either one ``B`` or one
  ``I`` and one ``W``;
- every send has its receive and the other way round, and only across ranks;
- every requirement (see :func:`schedulers.dataflow.requirements`) exists, and one on
  the same rank comes earlier in the program: a micro-batch's ``F`` on stage ``s``
  after its ``F`` on stage ``s-1``, its ``B`` after its own ``F`` and after the ``B`` of
  stage ``s+1``, ``W`` after ``I``;
- the tail, if any, is ``BARRIER REDUCE STEP`` at the end of every rank;
- run in order, the programs finish (else :class:`DeadlockError` names the stuck
  actions).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from stages import Action, ActionKind, COMM_KINDS, TAIL_KINDS, transfer_partner
from schedulers.dataflow import Layout, Position, Schedule, infer_layout, play, requirements
from schedulers.grid import format_grid

__all__ = ["DeadlockError", "ScheduleError", "validate"]


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message shows the grid with the culprit marked.

    Attributes:
        reason: what is wrong, in one sentence.
        marked: the offending actions' positions ``(rank, index)``.
    """

    def __init__(
        self, reason: str, schedule: Schedule | None = None, marks: Collection[Position] = ()
    ) -> None:
        self.reason = reason
        self.marked = sorted(marks)
        if schedule is None:  # also how pickle rebuilds it, from the full message
            super().__init__(reason)
            return
        grid = format_grid(schedule, marks=marks) if _is_well_formed(schedule) else repr(schedule)
        super().__init__(f"{reason}\n{grid}")


class DeadlockError(ScheduleError):
    """Run in order, the programs never finish; the message names the stuck actions."""


def validate(schedule: Schedule) -> Layout:
    """Check ``schedule`` and return its inferred layout.

    Raises:
        ScheduleError: a rule above is broken.
        DeadlockError: the programs deadlock when run in order.
    """
    if not _is_well_formed(schedule):
        raise ScheduleError(
            "a schedule maps ranks 0..P-1 to lists of Action, P >= 1", schedule
        )
    layout = infer_layout(schedule)
    _check_placement(schedule, layout)
    _check_tail(schedule)
    _check_counts(schedule, layout)
    _check_comm(schedule, layout)
    _check_requirements(schedule, layout)
    _check_progress(schedule, layout)
    return layout


def _is_well_formed(schedule: object) -> bool:
    return (
        isinstance(schedule, dict)
        and sorted(schedule) == list(range(len(schedule)))
        and len(schedule) > 0
        and all(
            isinstance(p, list) and all(isinstance(a, Action) for a in p)
            for p in schedule.values()
        )
    )


def _positions(schedule: Schedule) -> dict[Action, list[Position]]:
    found: dict[Action, list[Position]] = {}
    for rank, program in schedule.items():
        for index, action in enumerate(program):
            found.setdefault(action, []).append((rank, index))
    return found


def _check_placement(schedule: Schedule, layout: Layout) -> None:
    if layout.num_stages < 1:
        raise ScheduleError("the schedule has no forward or backward at all", schedule)
    if layout.num_stages % layout.num_ranks:
        raise ScheduleError(
            f"{layout.num_stages} stages do not spread evenly over {layout.num_ranks} "
            "ranks; use a multiple of the number of ranks",
            schedule,
        )
    for rank, program in schedule.items():
        for index, action in enumerate(program):
            if layout.rank_of(action.stage) != rank:
                raise ScheduleError(
                    f"{action} is on rank {rank}, but stage {action.stage} lives on "
                    f"rank {layout.rank_of(action.stage)}",
                    schedule,
                    [(rank, index)],
                )


def _check_tail(schedule: Schedule) -> None:
    has_tail = {rank: any(a.kind in TAIL_KINDS for a in p) for rank, p in schedule.items()}
    if not any(has_tail.values()):
        return
    size = len(TAIL_KINDS)
    for rank, program in schedule.items():
        tail = program[-size:]
        if tuple(a.kind for a in tail) != TAIL_KINDS or any(a.stage != rank for a in tail):
            bad = [(rank, i) for i, a in enumerate(program) if a.kind in TAIL_KINDS]
            if not bad and program:
                bad = [(rank, len(program) - 1)]
            expected = " ".join(f"{rank}{kind.value}" for kind in TAIL_KINDS)
            raise ScheduleError(
                f"rank {rank} must end with {expected}, "
                "after all its other actions, as every rank of a stepped schedule does",
                schedule,
                bad,
            )
        extra = [(rank, i) for i, a in enumerate(program[:-size]) if a.kind in TAIL_KINDS]
        if extra:
            raise ScheduleError(f"rank {rank} has a second step tail", schedule, extra)


def _check_counts(schedule: Schedule, layout: Layout) -> None:
    found = _positions(schedule)
    counts = Counter({a: len(p) for a, p in found.items()})
    for stage in range(layout.num_stages):
        for micro in range(layout.num_microbatches):
            f, b, i, w = (
                counts[Action(stage=stage, kind=k, microbatch=micro)]
                for k in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)
            )
            if (f, b, i, w) in ((1, 1, 0, 0), (1, 0, 1, 1)):
                continue
            what = f"F x{f}, B x{b}, I x{i}, W x{w}"
            dupes = [
                p
                for k in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)
                for p in found.get(Action(stage=stage, kind=k, microbatch=micro), [])
            ]
            raise ScheduleError(
                f"stage {stage} runs micro-batch {micro} as {what}; it needs F once and "
                "either B once or I and W once each",
                schedule,
                dupes,
            )


def _check_comm(schedule: Schedule, layout: Layout) -> None:
    found = _positions(schedule)
    for action, where in found.items():
        if action.kind not in COMM_KINDS:
            continue
        try:
            _, partner = transfer_partner(action, layout.num_ranks)
        except ValueError as exc:  # the first stage's partner upstream
            raise ScheduleError(str(exc), schedule, where) from None
        peer = partner.stage
        exists = peer < layout.num_stages
        if not exists or not layout.crosses_ranks(action.stage, peer):
            why = "is on the same rank" if exists else "does not exist"
            raise ScheduleError(
                f"{action} has no other rank to talk to: stage {peer} {why}", schedule, where
            )
        if len(where) > 1:
            raise ScheduleError(f"{action} appears {len(where)} times", schedule, where)
        if partner not in found:
            raise ScheduleError(f"{action} has no matching {partner}", schedule, where)


def _check_requirements(schedule: Schedule, layout: Layout) -> None:
    found = _positions(schedule)
    for rank, program in schedule.items():
        for index, action in enumerate(program):
            for need in requirements(action, layout):
                if need not in found:
                    raise ScheduleError(
                        f"{action} needs {need}, which the schedule does not contain",
                        schedule,
                        [(rank, index)],
                    )
                need_rank, need_index = found[need][0]
                if need_rank == rank and need_index > index:
                    raise ScheduleError(
                        f"{action} runs before {need} on rank {rank}, but needs its result",
                        schedule,
                        [(rank, index), (need_rank, need_index)],
                    )


def _check_progress(schedule: Schedule, layout: Layout) -> None:
    blocked = play(schedule, lambda action: 1.0, layout=layout).blocked
    if blocked:
        raise deadlock_error(schedule, blocked)


def deadlock_error(
    schedule: Schedule, blocked: list[tuple[Position, list[Action]]]
) -> DeadlockError:
    """Build the error for a deadlock that :func:`schedulers.dataflow.play` reported."""
    waits = "; ".join(
        f"rank {rank} blocked at {schedule[rank][index]} waiting for "
        + ", ".join(str(a) for a in needs)
        for (rank, index), needs in blocked
    )
    return DeadlockError(f"deadlock: {waits}", schedule, [pos for pos, _ in blocked])
