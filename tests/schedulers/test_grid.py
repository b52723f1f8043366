"""Tests for schedulers/grid.py: the rank-by-time grid prints, parses back and marks actions."""

from __future__ import annotations

from textwrap import dedent

import pytest

from stages.program import Action
from schedulers.grid import format_grid, parse_grid
from schedulers.schedules import SCHEDULES, build_schedule

CASES = [(1, 1), (1, 3), (2, 4), (3, 6), (4, 8)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("num_stages", "num_microbatches"), CASES)
def test_format_then_parse_is_the_identity(
    name: str, num_stages: int, num_microbatches: int
) -> None:
    if name == "dualpipev":  # it needs as many micro-batches as model stages
        num_microbatches = max(num_microbatches, 2 * num_stages)
    compute = SCHEDULES[name](num_stages, num_microbatches)
    lowered = build_schedule(name, num_stages, num_microbatches)
    for schedule in (compute, lowered):
        assert parse_grid(format_grid(schedule)) == schedule


def test_grid_shows_time_slots() -> None:
    # 1B0 can only start once 1F0 (slot 1) is done; 0B0 waits for 1B0.
    schedule = parse_grid("0: 0F0 0B0\n1: 1F0 1B0")
    assert format_grid(schedule) == "0: 0F0 -   -   0B0\n1: -   1F0 1B0"


def test_receive_comes_after_its_send() -> None:
    lowered = build_schedule("gpipe", 2, 1)
    assert format_grid(lowered) == dedent(
        """\
        0: 0F0      0SEND_F0 -        -        -        -        0RECV_B0 0B0      0BARRIER \
0REDUCE  0STEP
        1: -        -        1RECV_F0 1F0      1B0      1SEND_B0 1BARRIER 1REDUCE  1STEP"""
    )


def test_parse_accepts_hand_written_grids() -> None:
    text = """
        # labels may be omitted, written "rank N:", or bare; '-' cells are idle
        rank 0: 0F0 0F1 -   0B0 0B1
        1 | -  1F0 1B0 1F1 1B1    # trailing comment
    """
    assert parse_grid(text) == {
        0: [Action.parse(t) for t in ("0F0", "0F1", "0B0", "0B1")],
        1: [Action.parse(t) for t in ("1F0", "1B0", "1F1", "1B1")],
    }
    assert parse_grid("0F0 0B0\n1F0 1B0") == parse_grid("0: 0F0 0B0\n1: 1F0 1B0")


def test_marks_print_and_parse_back() -> None:
    schedule = {0: [Action.parse("0F0"), Action.parse("0B0")]}
    text = format_grid(schedule, marks=[(0, 1)])
    assert text == "0: 0F0   >0B0<"
    assert parse_grid(text) == schedule


def test_broken_schedules_still_print() -> None:
    # 1F1 waits for 0F1, which waits behind 0B0, which waits for 1B0: a deadlock.
    deadlocked = parse_grid("0: 0F0 0B0 0F1 0B1\n1: 1F1 1F0 1B0 1B1")
    text = format_grid(deadlocked)
    assert parse_grid(text) == deadlocked


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0: 0F0 0X0", "line 1: not an action: '0X0'"),
        ("0: 0F0\n0: 0B0", "line 2: rank 0 appears twice"),
        ("0: 0F0\n2: 2F0", "rank labels must be 0..1"),
    ],
)
def test_parse_errors_say_where(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_grid(text)
