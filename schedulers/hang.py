"""Hang forensics: where each stage is in its program, and which send or receive never matched.

Given the programs a step runs and each stage's progress (its current action and
how many it has done), :func:`diagnose` says, stage by stage, what it waits for and
why it has not come: a stage at ``1RECV_F3`` waits for stage 0's ``0SEND_F3``, and
stage 0 either never got there (it is stuck earlier, at the action named) or sent it
and the value is lost on the way. The grid of the programs marks where every stage
is, as ``>1RECV_F3<``::

    stage 1 waits at 1RECV_F3: stage 0 never reached 0SEND_F3 (stuck at 0F3)
    stage 0 is computing 0F3 (6 of 20 actions done)
    0: 0F0 0SEND_F0 ... >0F3< ...
    1: -   -        ... >1RECV_F3< ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stages import Action, ActionKind, TAIL_KINDS, transfer_partner
from schedulers.dataflow import Layout, infer_layout
from schedulers.grid import format_grid

__all__ = ["HangReport", "StageProgress", "diagnose"]

_RECV_KINDS = (ActionKind.RECV_F, ActionKind.RECV_B)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageProgress:
    """What a stage's ``progress`` endpoint said: its current action (None between actions
    or at the barrier) and how many of its program's actions it has finished."""

    rank: int
    current: str | None
    done: int
    stale: bool = False  # its counts are from an earlier step: it has not started this one


@dataclass(frozen=True, slots=True, kw_only=True)
class HangReport:
    """One line per stage, waits first, and the programs' grid with every stage's place marked.

    ``settled`` is true when every stage is at its barrier (nothing is stuck).
    """

    lines: list[str]
    grid: str
    marks: list[tuple[int, int]]
    settled: bool = False

    def __str__(self) -> str:
        return "\n".join([*self.lines, self.grid])


def diagnose(
    programs: Mapping[int, Sequence[str]],
    progress: Mapping[int, StageProgress | str],
    *,
    running: bool = True,
) -> HangReport:
    """Explains where a step stands, stage by stage.

    Args:
        programs: each pipeline rank's program, as action text.
        progress: per rank, its progress, or a string saying why there is none
            (e.g. it did not answer).
        running: whether a step is in progress (otherwise an idle stage has simply
            finished its last step).

    Returns:
        The explanation and the marked grid.
    """
    schedule = {rank: [Action.parse(a) for a in program] for rank, program in programs.items()}
    layout = infer_layout(schedule)
    waits: list[str] = []
    others: list[str] = []
    marks: list[tuple[int, int]] = []
    settled = True
    for rank in sorted(schedule):
        program, state = schedule[rank], progress.get(rank)
        if not isinstance(state, StageProgress):
            others.append(f"stage {rank}: {state or 'no progress reported'}")
            settled = False
            continue
        position = None if state.stale else _position(program, state)
        settled = settled and state.current is None and position is not None
        if position is not None:
            marks.append((rank, position))
        line = _explain(rank, program, state, position, schedule, progress, layout, running)
        (waits if state.current is not None and _is_recv(state.current) else others).append(line)
    return HangReport(lines=waits + others, grid=format_grid(schedule, marks=marks), marks=marks, settled=settled)


def _is_recv(text: str) -> bool:
    return Action.parse(text).kind in _RECV_KINDS


def _position(program: Sequence[Action], state: StageProgress) -> int | None:
    """The index of the stage's current action (or the barrier it reached), if known."""
    if state.current is not None:
        if state.done < len(program) and str(program[state.done]) == state.current:
            return state.done
        texts = [str(a) for a in program]
        return texts.index(state.current) if state.current in texts else None
    barrier = next((i for i, a in enumerate(program) if a.kind is ActionKind.BARRIER), None)
    return barrier if barrier is not None and state.done >= barrier else None


def _where(rank: int, program: Sequence[Action], state: StageProgress | str | None, running: bool) -> str:
    if not isinstance(state, StageProgress):
        return "no progress reported"
    if state.current is not None:
        return f"stuck at {state.current}"
    if state.stale:
        return "not started this step"
    barrier = _position(program, state)
    if barrier is not None:
        return "at the barrier"
    return "not started" if running else "idle"


def _explain(
    rank: int,
    program: Sequence[Action],
    state: StageProgress,
    position: int | None,
    schedule: Mapping[int, Sequence[Action]],
    progress: Mapping[int, StageProgress | str],
    layout: Layout,
    running: bool,
) -> str:
    total = sum(1 for a in program if a.kind not in TAIL_KINDS)
    if state.current is None:
        if state.stale:
            return f"stage {rank} has not started this step"
        if position is not None:
            if not running:
                return f"stage {rank} is idle (its last step reached the barrier: {state.done} of {total} actions done)"
            return f"stage {rank} reached the barrier ({state.done} of {total} actions done)"
        if running:
            return f"stage {rank} has not started this step ({state.done} actions done)"
        return f"stage {rank} is idle"
    action = Action.parse(state.current)
    done = f"({state.done} of {total} actions done)"
    if action.kind not in _RECV_KINDS:
        verb = "is sending" if action.kind in (ActionKind.SEND_F, ActionKind.SEND_B) else "is computing"
        return f"stage {rank} {verb} {action} {done}"
    source, send = transfer_partner(action, layout.num_ranks, layout.placement)
    source_program = schedule.get(source, [])
    index = next((i for i, a in enumerate(source_program) if a == send), None)
    head = f"stage {rank} waits at {action}"
    if index is None:
        return f"{head}: no stage's program has {send}, so nothing will ever arrive (a schedule bug)"
    peer = progress.get(source)
    if not isinstance(peer, StageProgress):
        return f"{head}: stage {source} ({peer or 'no progress reported'}) should send it at {send}"
    if peer.current == str(send):
        return f"{head}: stage {source} is sending it now ({send})"
    if peer.done > index and not peer.stale:
        return f"{head}: stage {source} sent it ({send} done) but it has not arrived"
    return f"{head}: stage {source} never reached {send} ({_where(source, source_program, peer, running)})"
