"""Tests for actors/program.py: the action text form, its errors, and its place as a leaf."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.program import TAIL_KINDS, Action, ActionKind, stage_to_rank

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize(("stage", "num_ranks"), [(0, 0), (-1, 2)])
def test_stage_to_rank_rejects_bad_arguments(stage: int, num_ranks: int) -> None:
    with pytest.raises(ValueError):
        stage_to_rank(stage, num_ranks)


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_program_is_a_stdlib_only_leaf() -> None:
    roots = {name.split(".")[0] for name in _imported_modules(ROOT / "actors" / "program.py")}
    assert roots <= set(sys.stdlib_module_names) | {"__future__"}, roots


@pytest.mark.parametrize("package", ["actors", "transport"])
def test_lower_layers_never_import_schedulers(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        roots = {name.split(".")[0] for name in _imported_modules(path)}
        assert "schedulers" not in roots, path
