"""Split a model's layers into contiguous pipeline stages.

Every function returns half-open bounds, one ``(start, end)`` per stage, so stage
``s`` runs ``layers[start:end]``; the bounds cover all layers in order and no stage
is empty. Three ways to weigh the layers:

- :func:`partition_uniform`: the same number of layers per stage (DeepSpeed's
  ``"uniform"``; the first stages take the remainder);
- :func:`partition_by_parameters`: balance the per-layer parameter counts (DeepSpeed's
  ``"parameters"``);
- :func:`partition_by_weights`: balance any per-layer weight, e.g. measured forward
  plus backward time.

Balancing is exact: the slowest (heaviest) stage is as light as any contiguous
split allows.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate

__all__ = ["partition_by_parameters", "partition_by_weights", "partition_uniform"]

Bounds = list[tuple[int, int]]


def _check(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} stages: every stage "
            f"needs at least one layer; use num_stages <= {num_layers}"
        )


def partition_uniform(num_layers: int, num_stages: int) -> Bounds:
    """Split ``num_layers`` layers into ``num_stages`` stages whose sizes differ by at
    most one, the larger ones first.

    Raises:
        ValueError: ``num_stages`` < 1 or more stages than layers.
    """
    _check(num_layers, num_stages)
    size, extra = divmod(num_layers, num_stages)
    ends = list(accumulate(size + (s < extra) for s in range(num_stages)))
    return list(zip([0, *ends[:-1]], ends))


def partition_by_weights(weights: Sequence[float], num_stages: int) -> Bounds:
    """Split layers into contiguous stages minimising the heaviest stage's total weight.

    Exact, by dynamic programming: ``best[k][i]``, the lightest possible heaviest stage
    when the first ``i`` layers form ``k`` stages, is ``min over j`` of
    ``max(best[k-1][j], weight(j..i))``. The first term grows with ``j`` and the second
    shrinks, so the minimum sits where they cross and a binary search finds it:
    ``O(num_stages * n log n)``. Integer weights give exact integer sums.

    Args:
        weights: one non-negative weight per layer (parameter count, measured time…).
        num_stages: how many stages.

    Raises:
        ValueError: a negative weight, ``num_stages`` < 1 or more stages than layers.
    """
    n = len(weights)
    _check(n, num_stages)
    if any(w < 0 for w in weights):
        raise ValueError("layer weights must be >= 0")
    prefix: list[float] = [0, *accumulate(weights)]
    # best[k][i] for k stages over layers[:i]; cut[k][i] is where the last stage starts.
    best: list[list[float]] = [[0] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[1] = list(prefix)
    for k in range(2, num_stages + 1):
        previous = best[k - 1]
        for i in range(k, n - (num_stages - k) + 1):
            # j in [k-1, i-1]: the first k-1 stages need k-1 layers, the last one 1.
            lo, hi = k - 1, i - 1

            def cost(j: int) -> float:
                return max(previous[j], prefix[i] - prefix[j])

            cross = lo + bisect_left(
                range(lo, hi + 1), True, key=lambda j: previous[j] >= prefix[i] - prefix[j]
            )
            j = min((c for c in (cross - 1, cross) if lo <= c <= hi), key=cost)
            best[k][i], cut[k][i] = cost(j), j
    ends: list[int] = []
    end = n
    for k in range(num_stages, 0, -1):
        ends.append(end)
        end = cut[k][end]
    ends.reverse()
    return list(zip([0, *ends[:-1]], ends))


def partition_by_parameters(counts: Sequence[int], num_stages: int) -> Bounds:
    """Split layers into stages balanced by parameter count, exactly as :func:`partition_by_weights`.

    Args:
        counts: each layer's parameter count, in order (a stage node measures them:
            ``NodeActor.describe_model``; the head never builds the model).
        num_stages: how many stages.

    Raises:
        ValueError: a count that is not a whole number >= 0, ``num_stages`` < 1 or more
            stages than layers.
    """
    if any(isinstance(c, bool) or not isinstance(c, int) for c in counts):
        raise ValueError("parameter counts must be whole numbers, one per layer")
    return partition_by_weights(counts, num_stages)
