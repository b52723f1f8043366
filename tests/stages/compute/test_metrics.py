# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/compute/test_metrics.py
"""An evaluation's metrics (stages.compute.metrics): named per micro-batch, averaged as one process would."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from stages.compute.metrics import mean_metrics, metric_values


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"accuracy": (logits.argmax(-1) == targets).float().mean(), "top_logit": logits.max()}


def test_a_number_is_named_after_its_function_and_a_dict_names_its_own() -> None:
    outputs, targets = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), torch.tensor([1, 1, 1])
    assert metric_values(accuracy, outputs, targets) == {"accuracy": pytest.approx(2 / 3), "top_logit": pytest.approx(0.9)}
    assert metric_values(F.l1_loss, torch.zeros(2), torch.ones(2)) == {"l1_loss": 1.0}
    assert metric_values(lambda o, t: 3, None, None) == {"<lambda>": 3.0}


@pytest.mark.parametrize(("returned", "error", "match"), [
    (torch.ones(2), ValueError, r"metric 'bad' must be one number, got a tensor of shape \(2,\)"),
    ("high", TypeError, r"metric 'bad' must be a number, got 'high'"),
    (True, TypeError, "must be a number"),
    ({1: 0.5}, TypeError, "names must be strings"),
])
def test_what_is_not_a_named_number_is_refused_saying_what(returned: object, error: type, match: str) -> None:
    def bad(outputs: object, targets: object) -> object:
        return returned

    with pytest.raises(error, match=match):
        metric_values(bad, None, None)


def test_micro_batches_average_weighted_by_their_items_as_one_process_over_the_whole_batch() -> None:
    # An accuracy over 3 samples and one over 1: the whole batch's is 3 right of 4, not the mean of the two.
    values = [{"accuracy": 1.0, "error": 0.0}, {"accuracy": 0.0}]
    assert mean_metrics(values, [3.0, 1.0]) == {"accuracy": 0.75, "error": 0.0}
    assert mean_metrics(values, []) == {"accuracy": 0.5, "error": 0.0}  # counts unknown: the plain mean
    assert mean_metrics([{"a": 2.0}, {"a": 4.0}], [0.0, 0.0]) == {"a": 3.0}  # nothing counted: the plain mean
    assert mean_metrics([], []) == {}


def test_a_micro_batch_that_counts_nothing_weighs_nothing_even_where_its_metric_is_nan() -> None:
    # loss_averaging="tokens", one micro-batch all padding: its masked accuracy is 0/0. One process over
    # the whole batch gets 3 right of 4; weighting it as 0 * nan made the whole metric nan.
    def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = targets != -100
        return {"accuracy": ((logits.argmax(-1) == targets) & mask).sum() / mask.sum()}

    logits = torch.tensor([[[0.0, 1.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]])
    counted, padding = torch.tensor([[1, 0], [1, 0]]), torch.full((2, 2), -100)
    values = [metric_values(accuracy, logits, counted), metric_values(accuracy, logits, padding)]
    assert math.isnan(values[1]["accuracy"])
    whole = accuracy(torch.cat([logits, logits]), torch.cat([counted, padding]))["accuracy"].item()
    assert mean_metrics(values, [4.0, 0.0]) == {"accuracy": whole} == {"accuracy": 0.75}
