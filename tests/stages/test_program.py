"""Tests for stages/program.py: the action text form, its errors, and its place as a leaf."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.program import COMM_KINDS, TAIL_KINDS, Action, ActionKind, _parse_known, stage_to_rank, transfer_partner



@pytest.mark.parametrize(
    ("text", "stage", "kind", "microbatch"),
    [
        ("1F3", 1, ActionKind.F, 3),
        ("0B0", 0, ActionKind.B, 0),
        ("12I7", 12, ActionKind.I, 7),
        ("3W10", 3, ActionKind.W, 10),
        ("1SEND_F3", 1, ActionKind.SEND_F, 3),
        ("2RECV_F3", 2, ActionKind.RECV_F, 3),
        ("2SEND_B3", 2, ActionKind.SEND_B, 3),
        ("1RECV_B3", 1, ActionKind.RECV_B, 3),
        ("0BARRIER", 0, ActionKind.BARRIER, None),
        ("4REDUCE", 4, ActionKind.REDUCE, None),
        ("0STEP", 0, ActionKind.STEP, None),
    ],
)
def test_text_form_round_trips(
    text: str, stage: int, kind: ActionKind, microbatch: int | None
) -> None:
    action = Action(stage=stage, kind=kind, microbatch=microbatch)
    assert str(action) == text
    assert Action.parse(text) == action
    assert Action.parse(f"  {text}\n") == action


@pytest.mark.parametrize(
    "text",
    ["", "F3", "1X3", "1F", "1B", "0STEP3", "0BARRIER1", "1F-1", "1 F3", "1F3x", "1f3", "-1F3"],
)
def test_bad_text_is_a_value_error_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="not an action") as info:
        Action.parse(text)
    assert repr(text) in str(info.value)


def test_a_program_parsed_again_reuses_its_actions_and_a_bad_text_fails_every_time() -> None:
    # A stage parses its program at every step: the second time costs lookups, not parses.
    program = ["0RECV_F5", "0F5", "0I5", "0SEND_B5", "0W5", "0BARRIER"]
    first, second = [Action.parse(t) for t in program], [Action.parse(t) for t in program]
    assert first == second and all(a is b for a, b in zip(first, second))
    for _ in range(2):  # an error is not remembered as an answer
        with pytest.raises(ValueError, match="not an action"):
            Action.parse("0X5")
    assert _parse_known.cache_info().maxsize == 1 << 15  # bounded: a long run of new texts cannot grow it


@pytest.mark.parametrize(
    ("stage", "kind", "microbatch"),
    [
        (-1, ActionKind.F, 0),
        (0, ActionKind.F, None),
        (0, ActionKind.W, -2),
        (0, ActionKind.STEP, 0),
    ],
)
def test_constructor_rejects_impossible_actions(
    stage: int, kind: ActionKind, microbatch: int | None
) -> None:
    with pytest.raises(ValueError):
        Action(stage=stage, kind=kind, microbatch=microbatch)


def test_actions_are_frozen_keyword_only_values() -> None:
    action = Action(stage=1, kind=ActionKind.F, microbatch=3)
    assert action == Action.parse("1F3") and hash(action) == hash(Action.parse("1F3"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        action.stage = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        Action(1, ActionKind.F, 3)  # type: ignore[misc]
    assert not hasattr(action, "__dict__")  # slotted


@settings(max_examples=200)
@given(stage=st.integers(0, 10_000), kind=st.sampled_from(ActionKind), micro=st.integers(0, 10_000))
def test_every_action_round_trips(stage: int, kind: ActionKind, micro: int) -> None:
    action = Action(stage=stage, kind=kind, microbatch=None if kind in TAIL_KINDS else micro)
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize(
    ("stage", "num_ranks", "rank"), [(0, 1, 0), (3, 4, 3), (4, 4, 0), (7, 4, 3), (5, 2, 1)]
)
def test_stage_to_rank_is_round_robin(stage: int, num_ranks: int, rank: int) -> None:
    assert stage_to_rank(stage, num_ranks) == rank


@pytest.mark.parametrize(("num_ranks", "ranks"), [(1, [0, 0]), (2, [0, 1, 1, 0]), (4, [0, 1, 2, 3, 3, 2, 1, 0]),
                                                   (2, [0, 1, 1, 0, 0, 1])])
def test_stage_to_rank_in_a_v_runs_down_the_ranks_and_back(num_ranks: int, ranks: list[int]) -> None:
    # As torch's pipelining places ZB-V's and DualPipeV's stages (style="v"); a third chunk goes down again.
    assert [stage_to_rank(s, num_ranks, "v") for s in range(len(ranks))] == ranks


@pytest.mark.parametrize(("stage", "num_ranks", "placement"), [(0, 0, "loop"), (-1, 2, "loop"), (3, 2, "zigzag"),
                                                               (0, 2, "zigzag")])
def test_stage_to_rank_rejects_bad_arguments(stage: int, num_ranks: int, placement: Any) -> None:
    with pytest.raises(ValueError):
        stage_to_rank(stage, num_ranks, placement)


@pytest.mark.parametrize(
    ("action", "num_ranks", "rank", "partner"),
    [
        # One stage per rank: activations go to the next stage, gradients to the previous.
        ("0SEND_F3", 4, 1, "1RECV_F3"),
        ("1RECV_F3", 4, 0, "0SEND_F3"),
        ("2SEND_B0", 4, 1, "1RECV_B0"),
        ("1RECV_B0", 4, 2, "2SEND_B0"),
        ("3RECV_F7", 4, 2, "2SEND_F7"),
        # Interleaved, 2 ranks x 2 virtual stages: stage 2 lives on rank 0, stage 3 on rank 1.
        ("1SEND_F0", 2, 0, "2RECV_F0"),
        ("2RECV_F0", 2, 1, "1SEND_F0"),
        ("2SEND_B5", 2, 1, "1RECV_B5"),
        ("1RECV_B5", 2, 0, "2SEND_B5"),
        ("3SEND_B1", 2, 0, "2RECV_B1"),
        # Past the last stage is the caller's to reject: only the schedule knows how many there are.
        ("3SEND_F0", 4, 0, "4RECV_F0"),
    ],
)
def test_transfer_partner_pairs_sends_with_receives(
    action: str, num_ranks: int, rank: int, partner: str
) -> None:
    assert transfer_partner(Action.parse(action), num_ranks) == (rank, Action.parse(partner))
    # The pairing is symmetric: the partner's partner is the action, on its own rank.
    own_rank = stage_to_rank(Action.parse(action).stage, num_ranks)
    assert transfer_partner(Action.parse(partner), num_ranks) == (own_rank, Action.parse(action))


@pytest.mark.parametrize(("action", "rank", "partner"), [
    # In a V over 2 ranks: stages 0, 1, 2, 3 on ranks 0, 1, 1, 0.
    ("0SEND_F1", 1, "1RECV_F1"), ("2SEND_F1", 0, "3RECV_F1"), ("3SEND_B1", 1, "2RECV_B1"), ("2RECV_F0", 1, "1SEND_F0"),
])
def test_transfer_partner_in_a_v(action: str, rank: int, partner: str) -> None:
    assert transfer_partner(Action.parse(action), 2, "v") == (rank, Action.parse(partner))


@pytest.mark.parametrize(
    ("action", "num_ranks", "message"),
    [
        ("0SEND_B2", 4, "no stage comes before stage 0"),
        ("0RECV_F2", 4, "no stage comes before stage 0"),
        ("1F2", 4, "not a send or receive"),
        ("0STEP", 4, "not a send or receive"),
        ("0SEND_F0", 0, "num_ranks"),
    ],
)
def test_transfer_partner_rejects_actions_without_one(action: str, num_ranks: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        transfer_partner(Action.parse(action), num_ranks)


def test_every_comm_kind_has_a_partner_and_the_tail_is_ordered() -> None:
    for kind in COMM_KINDS:
        _, partner = transfer_partner(Action(stage=1, kind=kind, microbatch=0), 2)
        assert partner.kind in COMM_KINDS and partner.kind is not kind
    assert TAIL_KINDS == (ActionKind.BARRIER, ActionKind.REDUCE, ActionKind.STEP)
