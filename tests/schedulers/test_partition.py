"""Tests for schedulers/partition.py: contiguous, non-empty stages, exactly balanced."""

from __future__ import annotations

from collections.abc import Callable
from itertools import combinations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schedulers.partition import partition_by_parameters, partition_by_weights, partition_uniform


def _heaviest(weights: list[int], bounds: list[tuple[int, int]]) -> int:
    return max(sum(weights[a:b]) for a, b in bounds)


def _brute_force(weights: list[int], num_stages: int) -> int:
    n = len(weights)
    return min(
        _heaviest(weights, list(zip((0, *cuts), (*cuts, n))))
        for cuts in combinations(range(1, n), num_stages - 1)
    )


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "bounds"),
    [
        (1, 1, [(0, 1)]),
        (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
        (7, 1, [(0, 7)]),
    ],
)
def test_uniform(num_layers: int, num_stages: int, bounds: list[tuple[int, int]]) -> None:
    assert partition_uniform(num_layers, num_stages) == bounds


@pytest.mark.parametrize(
    ("weights", "num_stages", "bounds"),
    [
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [(0, 5), (5, 7), (7, 9)]),  # 15 | 13 | 17
        ([10, 1, 1, 1, 1], 2, [(0, 1), (1, 5)]),  # one heavy layer stands alone
        ([0, 0, 0, 5], 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),  # zero-weight stages still get a layer
        ([3, 3, 3, 3], 2, [(0, 2), (2, 4)]),
        ([0.5, 0.25, 0.25], 2, [(0, 1), (1, 3)]),
    ],
)
def test_by_weights(weights: list[float], num_stages: int, bounds: list[tuple[int, int]]) -> None:
    assert partition_by_weights(weights, num_stages) == bounds


@settings(max_examples=300)
@given(data=st.data(), weights=st.lists(st.integers(0, 50), min_size=1, max_size=9))
def test_by_weights_is_exactly_optimal(data: st.DataObject, weights: list[int]) -> None:
    num_stages = data.draw(st.integers(1, len(weights)))
    bounds = partition_by_weights(weights, num_stages)
    assert len(bounds) == num_stages
    assert bounds[0][0] == 0 and bounds[-1][1] == len(weights)
    assert all(start < end for start, end in bounds)
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(num_stages - 1))
    assert _heaviest(weights, bounds) == _brute_force(weights, num_stages)


def test_by_parameters_balances_parameter_counts() -> None:
    layers = [
        torch.nn.Linear(10, 10),  # 110 parameters
        torch.nn.ReLU(),  # 0
        torch.nn.Linear(10, 100),  # 1100
        torch.nn.Linear(100, 10),  # 1010
    ]
    # A stage node measures the counts (NodeActor.describe_model); the head splits them.
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert partition_by_parameters(counts, 2) == [(0, 3), (3, 4)]  # 1210 | 1010
    assert partition_by_parameters(counts, 4) == partition_uniform(4, 4)
    assert partition_by_parameters(counts, 1) == [(0, 4)]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: partition_uniform(3, 4), "cannot split 3 layers into 4 stages.*num_stages <= 3"),
        (lambda: partition_uniform(3, 0), "num_stages must be >= 1, got 0"),
        (lambda: partition_by_weights([], 1), "cannot split 0 layers"),
        (lambda: partition_by_weights([1, -1], 1), "weights must be >= 0"),
        (lambda: partition_by_parameters([0], 2), "cannot split 1 layers into 2"),
        (lambda: partition_by_parameters([3, -1], 1), "weights must be >= 0"),
        (lambda: partition_by_parameters([3, 1.5], 1), "parameter counts must be whole numbers"),
    ],
)
def test_impossible_requests_are_clear_errors(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
