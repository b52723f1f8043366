"""The fp16 loss scaler follows DeepSpeed's DynamicLossScaler; clipping follows clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch

from schedulers.scaling import LossScaler, clip_coefficient


def test_the_dynamic_scale_halves_after_hysteresis_and_doubles_after_a_clean_window() -> None:
    scaler = LossScaler.for_spec(0.0, initial_scale_power=4, window=3, hysteresis=2, min_scale=2.0)
    seen = []
    for overflow in [False, False, False, True, True, False, False, True, True, True, True]:
        scaler.update(overflow)
        seen.append(scaler.scale)
    # 3 clean steps double (16 -> 32); the first overflow spends the hysteresis, the second
    # halves; 2 clean steps are not a window; two more overflows: the hysteresis is used up,
    # so each halves, down to the minimum, where it stays.
    assert seen == [16, 16, 32, 32, 16, 16, 16, 8, 4, 2, 2]
    assert scaler.skipped == 6 and scaler.at_minimum


def test_a_static_scale_never_moves_and_the_state_round_trips() -> None:
    scaler = LossScaler.for_spec(128.0, initial_scale_power=16, window=1, hysteresis=1, min_scale=1.0)
    for overflow in (True, False, False):
        scaler.update(overflow)
    assert scaler.scale == 128.0 and scaler.skipped == 1
    other = LossScaler.for_spec(0.0, 16, 1000, 2, 1.0)
    other.load_state_dict(LossScaler.for_spec(0.0, 3, 10, 2, 1.0).state_dict())
    assert other.scale == 8.0


def test_the_clip_coefficient_is_clip_grad_norm_s() -> None:
    grads = [torch.randn(5, 3) * 10, torch.randn(7)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = float(torch.nn.utils.clip_grad_norm_(params, 1.5))
    coefficient = clip_coefficient(norm, 1.5)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * coefficient, rtol=1e-6, atol=0)
    assert clip_coefficient(0.5, 1.5) == 1.0 and clip_coefficient(float("inf"), 1.0) == 1.0
    assert clip_coefficient(3.0, 0.0) == 1.0  # off
    with pytest.raises(AssertionError):
        assert clip_coefficient(3.0, 1.0) == 1.0
