"""Schedules as text: a rank-by-time grid that prints and parses back.

One row per rank, one column per time slot; every action takes one slot and starts
as soon as its rank is free and its requirements have finished, so the columns show
how the pipeline fills and drains. ``-`` marks an idle slot::

    0: 0F0 0F1 0F2 0F3 -   -   0B0 0B1 0B2 0B3
    1: -   1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3

Parsing reads each row in order and ignores the idle cells, so a hand-written grid
needs only the right order per rank; aligning the columns is for the reader.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from stages import Action
from schedulers.dataflow import Position, Schedule, play

__all__ = ["format_grid", "parse_grid"]

_IDLE = "-"
_ROW_RE = re.compile(r"\s*(?:rank\s*)?(\d+)\s*[:|](.*)")


def format_grid(schedule: Schedule, *, marks: Collection[Position] = ()) -> str:
    """Print ``schedule`` as a rank-by-time grid.

    Args:
        schedule: the programs, keyed by rank.
        marks: positions ``(rank, index)`` to flag as ``>1B3<``, e.g. the action a
            validation error is about.

    Returns:
        The grid, one line per rank, without a trailing newline. It also lays out
        schedules that are invalid or deadlock (a stuck action is placed as if its
        missing requirements were met), so errors can show them.
    """
    timeline = play(schedule, lambda action: 1.0, force=True)
    cells: dict[int, dict[int, str]] = {rank: {} for rank in schedule}
    for (rank, index), start in timeline.start.items():
        text = str(schedule[rank][index])
        cells[rank][int(start)] = f">{text}<" if (rank, index) in marks else text
    width = max((len(t) for row in cells.values() for t in row.values()), default=1)
    label = max((len(str(rank)) for rank in schedule), default=1)
    lines = []
    for rank in sorted(cells):
        row = cells[rank]
        slots = [row.get(t, _IDLE).ljust(width) for t in range(1 + max(row, default=-1))]
        lines.append(f"{rank:>{label}}: {' '.join(slots)}".rstrip())
    return "\n".join(lines)


def parse_grid(text: str) -> Schedule:
    """Parse a grid printed by :func:`format_grid` (or written by hand).

    Each non-blank line is one rank: ``"0: 0F0 0F1 - 0B0"``; the ``0:`` label may be
    written ``rank 0:`` or left out (rows are then ranks 0, 1, …). Cells are actions
    or ``-`` for idle; ``>`` and ``<`` marks are ignored; ``#`` starts a comment.

    Raises:
        ValueError: a cell is not an action, or rank labels repeat or leave gaps.
    """
    schedule: Schedule = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0]
        if not line.strip():
            continue
        match = _ROW_RE.fullmatch(line)
        rank, body = (int(match[1]), match[2]) if match else (len(schedule), line)
        if rank in schedule:
            raise ValueError(f"line {number}: rank {rank} appears twice")
        try:
            schedule[rank] = [
                Action.parse(cell.strip("><")) for cell in body.split() if cell != _IDLE
            ]
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
    if sorted(schedule) != list(range(len(schedule))):
        raise ValueError(f"rank labels must be 0..{len(schedule) - 1}, got {sorted(schedule)}")
    return dict(sorted(schedule.items()))
