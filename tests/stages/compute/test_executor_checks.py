"""The executor's guards: targets a loss would broadcast, and gradients that are not finite."""

from __future__ import annotations

import re

import pytest
import torch

from stages.compute.executor import check_target_shape, nonfinite_gradients

pytestmark = pytest.mark.timeout(30)

LONG, FLOAT = torch.long, torch.float32


@pytest.mark.parametrize("output,target,dtype", [
    ([4, 8], [4, 8], FLOAT),  # mse_loss
    ([4, 10], [4], LONG),  # cross_entropy with class indices
    ([4, 10], [4, 10], FLOAT),  # cross_entropy with class probabilities
    ([2, 5, 7], [2, 5], LONG),  # examples.models:lm_loss, [B, T, V] logits against [B, T] ids
    ([3, 3], [3], LONG),  # class indices even where they happen to broadcast
    ([2, 4, 6, 6], [2, 6, 6], LONG),  # per-pixel cross_entropy
])
def test_targets_every_repository_loss_takes_pass(output: list[int], target: list[int], dtype: torch.dtype) -> None:
    check_target_shape(torch.zeros(output), torch.zeros(target, dtype=dtype))


@pytest.mark.parametrize("output,target,dtype", [
    ([4, 8], [4, 1], FLOAT),  # mse_loss would broadcast to [4, 8]
    ([4, 1], [4], FLOAT),  # the classic [N, 1] vs [N]: broadcasts to [N, N]
    ([4, 8], [8], FLOAT),
    ([4, 8], [4, 1], LONG),  # same number of dims, another shape
])
def test_targets_the_loss_would_broadcast_are_refused(output: list[int], target: list[int], dtype: torch.dtype) -> None:
    shapes = rf"targets of shape {re.escape(str(tuple(target)))}.*output of shape {re.escape(str(tuple(output)))}"
    with pytest.raises(ValueError, match=shapes):
        check_target_shape(torch.zeros(output), torch.zeros(target, dtype=dtype))


def named_with_grads(*grads: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
    named = []
    for i, grad in enumerate(grads):
        p = torch.nn.Parameter(torch.zeros(grad.shape if grad is not None else (1,)))
        p.grad = grad
        named.append((f"{i}.weight", p))
    return named


def test_finite_gradients_report_nothing() -> None:
    big = torch.full((3,), 3e38)  # a norm would overflow here; min and max do not
    assert nonfinite_gradients(named_with_grads(torch.randn(5), big, None, torch.empty(0))) == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_each_kind_of_non_finite_value_is_named(bad: float) -> None:
    poisoned = torch.randn(6)
    poisoned[3] = bad
    named = named_with_grads(torch.randn(2), poisoned, None, torch.randn(4))
    assert nonfinite_gradients(named) == ["1.weight"]


def test_only_torchs_broadcasting_losses_have_their_targets_checked() -> None:
    """Found by review: a loss of the user's own that takes a [B] target for a [B, 2] output (a mean and a log
    variance) was refused at every step, though one process trains it: the check guards torch's element-wise
    losses, which broadcast the two without a word, and leaves a user's loss the shapes it is given."""
    import torch.nn.functional as F

    from stages.compute.passes import broadcasting_loss

    assert all(broadcasting_loss(f) for f in (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
                                                  torch.nn.MSELoss(), torch.nn.L1Loss))
    assert not any(broadcasting_loss(f) for f in (F.cross_entropy, F.nll_loss, lambda out, y: out.sum(), None))
