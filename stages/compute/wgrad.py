"""Weight gradients of ``nn.Linear`` outside autograd's accumulation: fused, and deferrable.

Two things plain autograd does not do (Megatron-LM does both, as "gradient
accumulation fusion" and in its zero-bubble schedules):

- **Fused accumulation.** Autograd computes each micro-batch's weight gradient into a
  fresh buffer and then adds it into ``.grad`` in a second pass over memory. Here the
  GEMM accumulates into ``.grad`` itself (``addmm_``), one pass, no temporary.
- **Deferral.** A backward run inside :meth:`WeightGradients.deferring` computes
  everything except the ``nn.Linear`` weight (and bias) gradients, which it records as
  (output gradient, input) pairs. That is the ``I`` of a split backward: the input
  gradient exists, and can be sent upstream, before the weight GEMMs run. ``W`` is
  then :func:`apply` on the recorded pairs: only the weight GEMMs, without walking
  the autograd graph again (which is released at ``I``).

Only modules whose type is exactly ``nn.Linear`` are taken over (see :func:`install`), and a
stage takes over only those whose weight has at least ``min_weight_elements`` elements (the job's
``fusion_min_weight_elements``): below that the Python autograd Function costs more than the
memory pass it saves. Subclasses, small and tensor-parallel linears and other layers keep plain
autograd, and :meth:`WeightGradients.owns` tells them apart. Hooks
registered on a taken-over weight (``register_hook``, post-accumulate-grad hooks) do
not fire, since autograd never accumulates that weight's gradient; double backward
through these layers is not supported. What must know when such a gradient changes
(the overlapped data-parallel reduction, ``stages.comm.overlap``) sets
:attr:`WeightGradients.on_write` instead, and counts a forward's uses of each weight
with :meth:`WeightGradients.counting_uses`: a backward writes a weight at most once per use.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stages.compute.activations import Packed, restore

__all__ = ["PendingWeightGrad", "WeightGradients", "apply", "apply_batched", "install", "takes_over"]

# One deferred weight GEMM: (weight or None, bias or None, output gradient, input). The output
# gradient and the input may wait encoded, with a stash codec (stages.compute.activations): W decodes them.
PendingWeightGrad = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | Packed, torch.Tensor | Packed]
OnWrite = Callable[[torch.Tensor], None]  # called with a parameter right after its .grad changed


def _accumulate(param: torch.Tensor, value: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = value
    else:
        param.grad.add_(value)


@torch.no_grad()
def _weight_grad(weight: torch.Tensor | None, bias: torch.Tensor | None,
                 grad_out: torch.Tensor, inputs: torch.Tensor, on_write: OnWrite | None = None) -> None:
    """``weight.grad += grad_outᵀ · inputs`` (one GEMM into ``.grad``) and ``bias.grad += Σ grad_out``."""
    g = grad_out.reshape(-1, grad_out.shape[-1])
    if weight is not None:
        x = inputs.reshape(-1, inputs.shape[-1])
        if g.dtype != weight.dtype:
            # Under autocast: the GEMM in the compute dtype, then into the float32 master
            # gradient, as autograd's cast back does (one temporary; the numbers autocast gives).
            _accumulate(weight, g.t().mm(x).to(weight.dtype))
        elif weight.grad is None:
            weight.grad = g.t().mm(x)
        else:
            weight.grad.addmm_(g.t(), x)
        if on_write is not None:
            on_write(weight)
    if bias is not None:
        _accumulate(bias, g.sum(0).to(bias.dtype))
        if on_write is not None:
            on_write(bias)


def apply(pending: list[PendingWeightGrad], on_write: OnWrite | None = None) -> None:
    """Runs deferred weight GEMMs (a ``W``) into the parameters' ``.grad``, telling ``on_write`` of each."""
    for weight, bias, grad_out, inputs in pending:
        _weight_grad(weight, bias, restore(grad_out), restore(inputs), on_write)
    pending.clear()


def apply_batched(batches: list[list[PendingWeightGrad]], on_write: OnWrite | None = None) -> None:
    """Runs several Ws at once: each weight's recorded pairs from every batch as one GEMM whose
    K is all their rows together (as one process computes it over the whole batch).

    The concatenated output gradients and inputs are a temporary of the size of the pairs
    themselves; the per-micro-batch GEMMs they replace each stream the weight through the
    cache again, which is what a larger K saves.
    """
    groups: dict[tuple[int, int], list[PendingWeightGrad]] = {}
    for pending in batches:
        for entry in pending:
            weight, bias = entry[0], entry[1]
            groups.setdefault((id(weight), id(bias)), []).append(entry)
        pending.clear()
    for entries in groups.values():
        weight, bias = entries[0][0], entries[0][1]
        if len(entries) == 1:
            _weight_grad(weight, bias, restore(entries[0][2]), restore(entries[0][3]), on_write)
            continue
        grad_out = torch.cat([restore(g).reshape(-1, g.shape[-1]) for _, _, g, _ in entries])
        inputs = torch.cat([restore(x).reshape(-1, x.shape[-1]) for _, _, _, x in entries])
        _weight_grad(weight, bias, grad_out, inputs, on_write)


class WeightGradients:
    """Where the taken-over linears of one stage put their weight gradients: straight
    into ``.grad`` (fused), or, inside :meth:`deferring`, into a list for later."""

    def __init__(self) -> None:
        self._owned: set[int] = set()  # id() of each module install took over (the stage holds them)
        self._deferred: list[PendingWeightGrad] | None = None
        self._uses: dict[int, int] | None = None
        # Called with each parameter whose .grad a GEMM (run now, or deferred and run by
        # :func:`apply` with it) has just changed.
        self.on_write: OnWrite | None = None

    def owns(self, module: nn.Module) -> bool:
        """Whether :func:`install` took ``module`` over: its parameter gradients come through here."""
        return id(module) in self._owned

    def take(self, module: nn.Module) -> None:
        """Routes ``module``'s forward through the fused linear, its gradients through here."""
        grads = self
        module.forward = types.MethodType(lambda linear, x: _forward(linear, grads, x), module)  # type: ignore[method-assign]
        self._owned.add(id(module))

    @contextlib.contextmanager
    def counting_uses(self) -> Iterator[dict[int, int]]:
        """Forwards inside count how often each taken-over linear's weight and bias are used
        (``id(param) -> uses``): the backward of that forward writes each at most that often."""
        uses: dict[int, int] = {}
        self._uses = uses
        try:
            yield uses
        finally:
            self._uses = None

    def note_use(self, module: nn.Linear) -> None:
        if self._uses is not None:
            for param in (module.weight, module.bias):
                if param is not None:
                    self._uses[id(param)] = self._uses.get(id(param), 0) + 1

    @contextlib.contextmanager
    def deferring(self) -> Iterator[list[PendingWeightGrad]]:
        """Backward passes inside record their linear weight GEMMs in the yielded list
        instead of running them; pass it to :func:`apply` later."""
        if self._deferred is not None:
            raise RuntimeError("already deferring weight gradients")
        pending: list[PendingWeightGrad] = []
        self._deferred = pending
        try:
            yield pending
        finally:
            self._deferred = None

    def record(self, weight: torch.Tensor | None, bias: torch.Tensor | None,
               grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
        if weight is None and bias is None:
            return
        if self._deferred is None:
            _weight_grad(weight, bias, grad_out, inputs, self.on_write)
        else:
            self._deferred.append((weight, bias, grad_out, inputs))


class _Linear(torch.autograd.Function):
    """``F.linear`` whose backward returns the input gradient and hands the parameter
    gradients to a :class:`WeightGradients` (autograd never accumulates them).

    With ``dtype`` (autocast's compute dtype) it computes as autocast's ``linear`` does:
    input, weight and bias cast to ``dtype``; the input gradient goes back in the input's
    own dtype and the parameter gradients reach the float32 masters.
    """

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                grads: WeightGradients, dtype: torch.dtype | None) -> torch.Tensor:
        ctx.input_dtype, ctx.dtype = inputs.dtype, dtype
        if dtype is not None:
            with torch.autocast(inputs.device.type, enabled=False):
                inputs = inputs.to(dtype)
                out = F.linear(inputs, weight.to(dtype), bias.to(dtype) if bias is not None else None)
        else:
            out = F.linear(inputs, weight, bias)
        # The weight itself, not its cast: backward casts it again (the same bits), so no copy
        # waits for backward, and a stash codec (stages.compute.activations) never encodes one.
        ctx.save_for_backward(inputs, weight)
        ctx.bias, ctx.grads, ctx.weight = bias, grads, weight
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        inputs, weight = ctx.saved_tensors
        grad_in = None
        if ctx.needs_input_grad[0]:
            grad_in = grad_out.matmul(weight if ctx.dtype is None else weight.to(ctx.dtype)).to(ctx.input_dtype)
        bias = ctx.bias if ctx.needs_input_grad[2] else None
        ctx.grads.record(ctx.weight if ctx.needs_input_grad[1] else None, bias, grad_out, inputs)
        return grad_in, None, None, None, None


def _forward(module: nn.Linear, grads: WeightGradients, inputs: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return F.linear(inputs, module.weight, module.bias)
    device = inputs.device.type
    # Autocast is per device type: torch.is_autocast_enabled() alone asks about CUDA only.
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    grads.note_use(module)
    out: torch.Tensor = _Linear.apply(inputs, module.weight, module.bias, grads, dtype)
    return out


def takes_over(module: nn.Module, min_weight_elements: int = 0) -> bool:
    """Whether :func:`install` routes this module's parameter gradients (exact ``nn.Linear`` only,
    with a weight of at least ``min_weight_elements`` elements)."""
    return type(module) is nn.Linear and module.weight.numel() >= min_weight_elements


def install(module: nn.Module, grads: WeightGradients, *, min_weight_elements: int = 0) -> int:
    """Routes the weight gradients of every ``nn.Linear`` in ``module`` (exact type only, with
    at least ``min_weight_elements`` weight elements) through ``grads``; returns how many
    linears were taken over."""
    count = 0
    for sub in module.modules():
        if takes_over(sub, min_weight_elements) and not grads.owns(sub):
            grads.take(sub)
            count += 1
    return count
