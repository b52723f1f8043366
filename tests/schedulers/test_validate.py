"""Tests for schedulers/validate.py: broken schedules fail with the culprit marked on the grid."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.program import Action
from schedulers.dataflow import Schedule, infer_layout, requirements
from schedulers.grid import parse_grid
from schedulers.schedules import SCHEDULES, build_schedule
from schedulers.validate import DeadlockError, ScheduleError, validate


@pytest.mark.parametrize(
    ("grid", "reason", "marked"),
    [
        ("0: 0B0 0F0", "0B0 runs before 0F0 on rank 0", ">0B0<"),
        ("0: 0F0", "stage 0 runs micro-batch 0 as F x1, B x0, I x0, W x0", ">0F0<"),
        ("0: 0F0 0F0 0B0", "F x2", ">0F0<"),
        ("0: 0F0 0B0 0I0 0W0", "B x1, I x1, W x1", ">0I0<"),
        ("0: 0F0 0W0 0I0", "0W0 runs before 0I0", ">0W0<"),
        ("0: 1F0 1B0\n1: 0F0 0B0", "1F0 is on rank 0, but stage 1 lives on rank 1", ">1F0<"),
        ("0: 0F0 0B0 0F1\n1: 1F0 1B0 1F1 1B1", "stage 0 runs micro-batch 1", ">0F1<"),
        (
            "0: 0F0 0RECV_B0 0B0\n1: 1F0 1B0 1SEND_B0",
            "1F0 needs 1RECV_F0, which the schedule does not contain",
            ">1F0<",
        ),
        (
            "0: 0F0 0SEND_F0 0B0\n1: 1RECV_F0 1F0 1B0 1SEND_B0",
            "1SEND_B0 has no matching 0RECV_B0",
            ">1SEND_B0<",
        ),
        (
            "0: 0F0 0SEND_F0 1F0 1B0 0B0",
            "0SEND_F0 has no other rank to talk to: stage 1 is on the same rank",
            ">0SEND_F0<",
        ),
        ("0: 0F0 0B0 0RECV_B0", "stage 1 does not exist", ">0RECV_B0<"),
        ("0: 0F0 0B0 0SEND_B0\n1: 1F0 1B0", "no stage comes before stage 0", ">0SEND_B0<"),
        ("0: 0RECV_F0 0F0 0B0\n1: 1F0 1B0", "no stage comes before stage 0", ">0RECV_F0<"),
        ("0: 0F0 0B0 0REDUCE 0BARRIER 0STEP", "rank 0 must end with 0BARRIER 0REDUCE", ">0REDUCE<"),
        ("0: 0F0 0B0 0BARRIER 0REDUCE 0STEP\n1: 1F0 1B0", "rank 1 must end with", ">1B0<"),
        (
            "0: 0F0 0B0 0BARRIER 0REDUCE 0STEP 0BARRIER 0REDUCE 0STEP",
            "rank 0 has a second step tail",
            ">0BARRIER<",
        ),
        ("0: 0BARRIER 0REDUCE 0STEP", "no forward or backward at all", ""),
    ],
)
def test_broken_schedules_name_the_rule_and_mark_the_action(
    grid: str, reason: str, marked: str
) -> None:
    with pytest.raises(ScheduleError) as info:
        validate(parse_grid(grid))
    message = str(info.value)
    assert reason in message and marked in message
    assert isinstance(info.value, ValueError)


def test_uneven_stages_over_ranks_are_rejected() -> None:
    with pytest.raises(ScheduleError, match="3 stages do not spread evenly over 2 ranks"):
        validate(parse_grid("0: 0F0 2F0 2B0 0B0\n1: 1F0 1B0"))


@pytest.mark.parametrize("schedule", [{}, {1: []}, {0: ["0F0"]}, {0: (Action.parse("0F0"),)}])
def test_malformed_schedules_are_rejected(schedule: object) -> None:
    with pytest.raises(ScheduleError, match="maps ranks 0..P-1 to lists of Action"):
        validate(schedule)  # type: ignore[arg-type]


def test_deadlock_names_every_blocked_action() -> None:
    # Rank 1 starts with micro-batch 1, which rank 0 produces only after 0B0, which
    # needs 1B0, which rank 1 runs after 1F1.
    schedule = parse_grid("0: 0F0 0B0 0F1 0B1\n1: 1F1 1F0 1B0 1B1")
    with pytest.raises(DeadlockError) as info:
        validate(schedule)
    message = str(info.value)
    assert "rank 0 blocked at 0B0 waiting for 1B0" in message
    assert "rank 1 blocked at 1F1 waiting for 0F1" in message
    assert ">0B0<" in message and ">1F1<" in message
    assert info.value.marked == [(0, 1), (1, 0)]


def test_lowered_deadlock_through_sends_and_receives() -> None:
    schedule = parse_grid(
        """
        0: 0F0 0RECV_B0 0SEND_F0 0B0
        1: 1RECV_F0 1F0 1B0 1SEND_B0
        """
    )
    with pytest.raises(DeadlockError, match="rank 0 blocked at 0RECV_B0 waiting for 1SEND_B0"):
        validate(schedule)


# Mutation tests: a generated schedule with one action dropped, or with an action
# swapped with one it needs on the same rank, never validates.


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    num_stages = draw(st.integers(1, 4))
    virtual = draw(st.integers(2, 3)) if name == "interleaved" else None
    num_microbatches = num_stages * draw(st.integers(1, 3)) if virtual else draw(st.integers(1, 8))
    if name == "dualpipev":  # as many micro-batches as model stages, at least
        num_microbatches = max(num_microbatches, 2 * num_stages)
    if draw(st.booleans()):
        return build_schedule(name, num_stages, num_microbatches, virtual)
    return SCHEDULES[name](num_stages, num_microbatches, *([virtual] if virtual else []))


@settings(max_examples=200)
@given(schedule=schedules(), data=st.data())
def test_a_dropped_action_is_caught(schedule: Schedule, data: st.DataObject) -> None:
    rank = data.draw(st.sampled_from([r for r, p in schedule.items() if p]))
    index = data.draw(st.integers(0, len(schedule[rank]) - 1))
    mutated = {r: list(p) for r, p in schedule.items()}
    del mutated[rank][index]
    with pytest.raises(ScheduleError):
        validate(mutated)


@settings(max_examples=200)
@given(schedule=schedules(), data=st.data())
def test_a_swapped_dependent_pair_is_caught(schedule: Schedule, data: st.DataObject) -> None:
    layout = infer_layout(schedule)
    pairs = [
        (rank, i, j)
        for rank, program in schedule.items()
        for j, action in enumerate(program)
        for need in requirements(action, layout)
        for i in range(j)
        if program[i] == need
    ]
    rank, i, j = data.draw(st.sampled_from(pairs))
    mutated = {r: list(p) for r, p in schedule.items()}
    mutated[rank][i], mutated[rank][j] = mutated[rank][j], mutated[rank][i]
    with pytest.raises(ScheduleError):
        validate(mutated)


@settings(max_examples=100)
@given(schedule=schedules(), data=st.data())
def test_an_action_moved_to_another_rank_is_caught(schedule: Schedule, data: st.DataObject) -> None:
    if len(schedule) < 2:
        return
    source = data.draw(st.sampled_from([r for r, p in schedule.items() if p]))
    target = data.draw(st.sampled_from([r for r in schedule if r != source]))
    mutated = {r: list(p) for r, p in schedule.items()}
    action = mutated[source].pop(data.draw(st.integers(0, len(mutated[source]) - 1)))
    mutated[target].insert(data.draw(st.integers(0, len(mutated[target]))), action)
    with pytest.raises(ScheduleError):
        validate(mutated)


def test_errors_survive_pickling() -> None:
    with pytest.raises(DeadlockError) as info:
        validate(parse_grid("0: 0F0 0B0 0F1 0B1\n1: 1F1 1F0 1B0 1B1"))
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is DeadlockError and str(copy) == str(info.value)
