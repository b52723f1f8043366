"""Fused and deferred nn.Linear weight gradients (stages.compute.wgrad) against plain autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stages.compute import wgrad as _wgrad


class Block(nn.Module):
    """Linears with and without bias, nested, next to a LayerNorm that stays on autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.inner = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(self.norm(x))


def models() -> tuple[nn.Module, nn.Module, _wgrad.WeightGradients]:
    torch.manual_seed(0)
    reference = nn.Sequential(Block(), Block())
    torch.manual_seed(0)
    fused = nn.Sequential(Block(), Block())
    grads = _wgrad.WeightGradients()
    assert _wgrad.install(fused, grads) == 4
    return reference, fused, grads


def micro_batches(n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(2, 5, 6, generator=gen) for _ in range(n)]


def assert_same_grads(reference: nn.Module, fused: nn.Module) -> None:
    for (name, a), (_, b) in zip(reference.named_parameters(), fused.named_parameters()):
        assert b.grad is not None, name
        assert not b.grad.requires_grad, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_fused_accumulation_over_micro_batches_equals_autograd() -> None:
    reference, fused, _ = models()
    for x in micro_batches():
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        reference(xa).square().mean().backward()
        fused(xb).square().mean().backward()
        torch.testing.assert_close(xb.grad, xa.grad)
    assert_same_grads(reference, fused)


def test_deferred_weight_grads_wait_for_apply_and_then_match() -> None:
    reference, fused, grads = models()
    held = []
    for x in micro_batches():
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        reference(xa).square().mean().backward()
        with grads.deferring() as pending:
            fused(xb).square().mean().backward()
        # I: the input gradient and the LayerNorm's are there, no linear's yet.
        torch.testing.assert_close(xb.grad, xa.grad)
        assert fused[0].norm.weight.grad is not None
        assert len(pending) == 4
        held.append(pending)
    assert all(p.grad is None for m in fused.modules() if type(m) is nn.Linear for p in m.parameters())
    for pending in held:  # W, in any order after its I
        _wgrad.apply(pending)
        assert pending == []
    assert_same_grads(reference, fused)


def test_frozen_weights_get_no_gradient() -> None:
    _, fused, _ = models()
    first = fused[0].inner[0]
    first.weight.requires_grad_(False)
    fused(micro_batches(1)[0]).sum().backward()
    assert first.weight.grad is None and first.bias.grad is not None


def test_no_grad_forward_is_plain_linear() -> None:
    reference, fused, _ = models()
    x = micro_batches(1)[0]
    with torch.no_grad():
        out = fused(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, reference(x).detach())


def test_only_exact_linears_are_taken_over() -> None:
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(3, 3), nn.Linear(3, 3))
    assert _wgrad.install(model, _wgrad.WeightGradients()) == 1
    assert "forward" not in vars(model[0]) and "forward" in vars(model[1])


def test_linears_under_the_size_bound_keep_plain_autograd_and_their_gradients_come_with_the_backward() -> None:
    """A stage takes over only linears of ``fusion_min_weight_elements`` or more: a small one's gradient
    is autograd's, computed in the (input) backward itself, so deferring leaves nothing of it for ``W``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 16))  # weights of 64 and 128 elements
    plain = copy.deepcopy(model)
    grads = _wgrad.WeightGradients()
    assert _wgrad.install(model, grads, min_weight_elements=100) == 1
    assert not grads.owns(model[0]) and grads.owns(model[2])
    assert _wgrad.install(model, grads, min_weight_elements=100) == 0  # not wrapped twice
    x = torch.randn(4, 8)
    with grads.deferring() as pending:
        model(x).square().mean().backward()
    assert [(w is model[2].weight, b is model[2].bias) for w, b, _, _ in pending] == [(True, True)]
    assert model[0].weight.grad is not None and model[2].weight.grad is None  # the small one's came with backward
    _wgrad.apply(pending)
    plain(x).square().mean().backward()
    for fused_p, plain_p in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(fused_p.grad, plain_p.grad)


def test_deferring_does_not_nest() -> None:
    grads = _wgrad.WeightGradients()
    with grads.deferring(), pytest.raises(RuntimeError, match="already deferring"):
        with grads.deferring():
            pass
    with grads.deferring() as pending:  # usable again after the error
        assert pending == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_weight_gradients_stay_on_under_cpu_autocast_and_match_autocasts_own(dtype: torch.dtype) -> None:
    """Mixed precision: ``torch.is_autocast_enabled()`` without a device type asks about CUDA, so CPU
    autocast used to mix a bf16 input with the float32 weight at the first backward
    (``expected m1 and m2 to have the same dtype``). Now the taken-over linears compute as
    autocast's own linear does, and their weight GEMMs can still be deferred."""
    torch.manual_seed(0)
    fused = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))
    plain = copy.deepcopy(fused)
    grads = _wgrad.WeightGradients()
    assert _wgrad.install(fused, grads) == 2
    for _ in range(3):  # accumulation over micro-batches, as a stage does
        x = torch.randn(4, 16)
        with torch.autocast("cpu", dtype=dtype):
            out = fused(x)
        assert out.dtype == dtype
        with grads.deferring() as pending:
            out.float().pow(2).mean().backward()
        assert len(pending) == 2  # the weight GEMMs waited for W: the fused path ran
        _wgrad.apply(pending)
        with torch.autocast("cpu", dtype=dtype):
            reference = plain(x)
        reference.float().pow(2).mean().backward()
    for (name, p), (_, q) in zip(fused.named_parameters(), plain.named_parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32
        assert torch.equal(p.grad, q.grad), name
