"""How micro-batch losses average (stages.compute.averaging), without processes."""

from __future__ import annotations

import pytest
import torch

from examples.models import lm_loss
from stages.compute.averaging import check_summable, count_items, sample_weights, shard_batch, step_loss


def test_an_even_split_has_no_weights_and_an_uneven_one_weighs_by_samples() -> None:
    assert sample_weights([[2, 2], [2, 2]]) is None
    weights = sample_weights([[2, 2], [2, 1]])  # 7 samples over 2 replicas: R * n / B
    assert weights == [[4 / 7, 4 / 7], [4 / 7, 2 / 7]]
    # The replicas' average of their weighted sums is the mean over all seven samples.
    losses = [[1.0, 2.0], [3.0, 4.0]]
    per_replica = [sum(w * loss for w, loss in zip(ws, ls)) for ws, ls in zip(weights, losses)]
    assert sum(per_replica) / 2 == pytest.approx((2 * 1 + 2 * 2 + 2 * 3 + 1 * 4) / 7)


def test_a_global_batch_shards_in_order_and_refuses_too_few_samples() -> None:
    x, y = torch.arange(7).float().unsqueeze(1), torch.arange(7).float().unsqueeze(1)
    inputs, targets, weights = shard_batch(x, y, 2, 2)
    assert [[t.flatten().tolist() for t in shard] for shard in inputs] == [[[0, 1], [2, 3]], [[4, 5], [6]]]
    assert weights is not None and len(weights[1]) == 2
    with pytest.raises(ValueError, match="a batch of 3 samples cannot give 4 micro-batches"):
        shard_batch(x[:3], y[:3], 2, 2)


def test_tokens_count_what_is_not_ignored_and_average_over_them() -> None:
    y = torch.tensor([[1, 2, -100], [3, -100, -100]])
    assert int(count_items(y, -100)) == 3
    assert int(count_items(torch.zeros(2, 3), -100)) == 6  # floating-point targets: every element
    assert step_loss([6.0, 3.0], [2.0, 1.0], tokens=True) == 3.0
    assert step_loss([1.0, 4.0], [3.0, 1.0], tokens=False) == pytest.approx(7 / 4)  # sample-weighted
    assert step_loss([1.0, 4.0], [2.0, 2.0], tokens=False) == 2.5


def test_a_token_average_needs_a_loss_that_can_sum() -> None:
    check_summable(lm_loss, "examples.models:lm_loss")
    check_summable(torch.nn.functional.cross_entropy, "torch.nn.functional:cross_entropy")

    def mean_only(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).abs().mean()

    with pytest.raises(ValueError, match="takes no 'reduction' keyword"):
        check_summable(mean_only, "mine:mean_only")
