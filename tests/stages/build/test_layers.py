"""Tests for stages/build/layers.py's partition pattern: DeepSpeed's type:REGEX, at a bounded cost."""

from __future__ import annotations

import pytest

from stages.build.layers import match_layer_types

NAMES = ["Embedding", "TransformerBlock", "TransformerBlock", "LayerNorm", "Linear"]


@pytest.mark.parametrize(("pattern", "expected"), [
    ("transformerblock", [0, 1, 1, 0, 0]),  # case-insensitive, as DeepSpeed's
    ("block|norm", [0, 1, 1, 1, 0]),
    ("^lin", [0, 0, 0, 0, 1]),
    (r"(\w|\w|\w|\w)*!", [0, 0, 0, 0, 0]),  # held re.search for ever; regex's matcher is linear here
])
def test_a_pattern_marks_the_layers_whose_class_it_matches(pattern: str, expected: list[int]) -> None:
    assert match_layer_types(pattern, NAMES) == expected


def test_a_pattern_that_backtracks_without_end_runs_out_of_time_with_an_error() -> None:
    with pytest.raises(ValueError, match=r"took more than 0.2s to match .* name the repeated block's class"):
        match_layer_types(r"(.*?a){20}!", ["ab" * 25] * 3, budget_s=0.2)


@pytest.mark.parametrize("pattern", ["", "x" * 201, "(unclosed"])
def test_a_pattern_that_is_not_one_is_refused(pattern: str) -> None:
    with pytest.raises(ValueError):
        match_layer_types(pattern, NAMES)
