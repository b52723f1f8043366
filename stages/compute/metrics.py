"""An evaluation's own metrics (``evaluation.eval_metrics``): the Trainer's ``compute_metrics``, per micro-batch.

The job's metrics function takes a micro-batch's outputs and targets on the last stage,
as the loss does, and returns a number or a dict of named numbers (an accuracy, a mean
error). Each is a mean over its micro-batch; the micro-batches' values average weighted
by their items, the samples (or, under ``loss_averaging="tokens"``, the counted target
elements) each holds (:func:`mean_metrics`), so a metric that is a mean over samples (or
tokens) comes out as it would over the whole batch in one process, however the batch was
split over micro-batches and replicas.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from transport.wire import excerpt

__all__ = ["mean_metrics", "metric_values"]


def metric_values(fn: Callable[[Any, Any], Any], outputs: Any, targets: Any) -> dict[str, float]:
    """``fn(outputs, targets)`` as named floats: a number (or a one-element tensor) is named after ``fn``;
    a dict names its own.

    Raises:
        TypeError: a value that is not a number, or a name that is not a string.
        ValueError: a tensor of more than one element.
    """
    value = fn(outputs, targets)
    named = value if isinstance(value, Mapping) else {getattr(fn, "__name__", "metric"): value}
    found: dict[str, float] = {}
    for name, number in named.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"the metrics function's names must be strings, got {excerpt(name)}")
        if isinstance(number, torch.Tensor):
            if number.numel() != 1:
                raise ValueError(f"metric {name!r} must be one number, got a tensor of shape {tuple(number.shape)}")
            number = number.item()
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise TypeError(f"metric {name!r} must be a number, got {excerpt(number)}")
        found[name] = float(number)
    return found


def mean_metrics(values: Sequence[Mapping[str, float]], items: Sequence[float]) -> dict[str, float]:
    """Each metric averaged over the micro-batches that gave it, weighted by their ``items`` (one per
    micro-batch, in the same order; the plain mean where the counts are unknown or all zero). A
    micro-batch that counts nothing (every target masked, with ``loss_averaging="tokens"``) weighs
    nothing, even where its metric is 0/0: one process over the whole batch never sees it."""
    totals: dict[str, list[float]] = {}
    for index, named in enumerate(values):
        weight = items[index] if len(items) == len(values) else 1.0
        for name, number in named.items():
            total = totals.setdefault(name, [0.0, 0.0, 0.0, 0.0])  # weighted sum, weights, plain sum, count
            if weight:  # 0 * nan would be nan
                total[0] += number * weight
                total[1] += weight
            total[2] += number
            total[3] += 1
    return {name: (s / w if w > 0 and math.isfinite(w) else plain / n) for name, (s, w, plain, n) in totals.items()}
