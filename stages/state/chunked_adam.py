"""torch's Adam and AdamW on CPU, the same arithmetic a slice of each large parameter at a time.

torch's CPU Adam (its single-tensor path: CPU has no foreach kernels) computes each
parameter's update as a few whole-tensor expressions, and two of them make temporaries of
the parameter's size: the second moment's square root and its quotient by the bias
correction (a third, with L2 weight decay, the decayed gradient). glibc keeps freed memory
of that size for reuse, so a stage's peak holds two or three copies of its largest
parameter on top of parameters, gradients and moments: 0.67 of a slice in
``benchmarks.memory``'s 24-layer model, where each stage's three parameters are 16 MiB each.

:class:`ChunkedAdam` and :class:`ChunkedAdamW` are torch's own classes (same state, same
``state_dict``, same checkpoints) whose step hands torch's own functional ``adam`` the
parameter, gradient and moments of a large parameter as views of ``CHUNK`` elements, each
with a copy of the parameter's step count. Every operation of Adam is element-wise, so each
element is computed by the same expression on the same values: the result is torch's to
the bit (tests/stages/state/test_chunked_adam.py steps both side by side), and the
temporaries are ``CHUNK`` elements each. The stage builds them in place of
``torch.optim.Adam`` / ``AdamW`` on CPU (:func:`chunked`) unless the job asked for
``foreach``, ``fused``, ``capturable`` or ``differentiable``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim.adam import adam

__all__ = ["CHUNK", "ChunkedAdam", "ChunkedAdamW", "chunked"]

CHUNK = 1 << 18
"""Elements per slice (1 MiB of float32): the most each of Adam's temporaries then holds."""

_Lists = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
               list[torch.Tensor], list[torch.Tensor]]


class _ChunkedStep:
    """The step of :class:`ChunkedAdam` and :class:`ChunkedAdamW`, over ``torch.optim.Adam``'s own groups."""

    param_groups: list[dict[str, Any]]
    _init_group: Callable[..., bool]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # as torch.optim.Optimizer.step takes it
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            whole: _Lists = ([], [], [], [], [], [])
            has_complex = self._init_group(group, *whole)
            parts, counted = _sliced(whole, group["amsgrad"])
            beta1, beta2 = group["betas"]
            adam(*parts, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"], foreach=False,
                 capturable=False, differentiable=False, fused=False, grad_scale=None, found_inf=None,
                 decoupled_weight_decay=group["decoupled_weight_decay"])
            for step in counted:  # each slice counted a copy: the parameter's own count moves once
                step += 1
        return loss


def _sliced(whole: _Lists, amsgrad: bool) -> tuple[_Lists, list[torch.Tensor]]:
    """``whole``'s lists with each large parameter's tensors as slices of ``CHUNK`` elements, and
    the step counts of the parameters sliced so."""
    params, grads, avgs, sqs, maxes, steps = whole
    parts: _Lists = ([], [], [], [], [], [])
    counted = []
    for i, param in enumerate(params):
        tensors = [param, grads[i], avgs[i], sqs[i], *([maxes[i]] if amsgrad else [])]
        lists = [*parts[:4], *([parts[4]] if amsgrad else [])]  # where each of ``tensors`` goes
        if param.numel() <= CHUNK or param.is_complex() or not all(t.is_contiguous() for t in tensors):
            for into, tensor in zip(lists, tensors):
                into.append(tensor)
            parts[5].append(steps[i])
            continue
        flat = [t.view(-1) for t in tensors]
        for start in range(0, param.numel(), CHUNK):
            for into, tensor in zip(lists, flat):
                into.append(tensor[start:start + CHUNK])
            parts[5].append(steps[i].clone())
        counted.append(steps[i])
    return parts, counted


class ChunkedAdam(_ChunkedStep, torch.optim.Adam):
    """``torch.optim.Adam`` whose CPU step makes temporaries of ``CHUNK`` elements, not of a parameter."""


class ChunkedAdamW(_ChunkedStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose CPU step makes temporaries of ``CHUNK`` elements, not of a parameter."""


_REPLACES: dict[type, type[torch.optim.Optimizer]] = {torch.optim.Adam: ChunkedAdam, torch.optim.AdamW: ChunkedAdamW}


def chunked(cls: type, kwargs: Mapping[str, Any], device: torch.device) -> type:
    """The class a stage builds for the optimizer ``cls`` with ``kwargs`` on ``device``: the chunked
    Adam or AdamW in place of torch's on CPU when the job left torch's other paths alone, else ``cls``."""
    if device.type != "cpu" or any(kwargs.get(k) for k in ("foreach", "fused", "capturable", "differentiable")):
        return cls
    return _REPLACES.get(cls, cls)
