"""Compiling a stage's layers with ``torch.compile``, one layer at a time (``runtime.torch_compile``).

As torchtitan compiles each transformer block, a stage compiles each layer it holds
(a traced stage: its graph module, as one), in place (``nn.Module.compile``): the
parameters, their names and the ``state_dict`` keys stay as they were, so checkpoints,
snapshots, tied parameters and the data-parallel reduction see the same tensors. Each
layer keeps its own compiled entries and recompile limit (``isolate_recompiles``: every
layer's call is the one ``Module._call_impl``, whose shared limit a long-lived node
process would exhaust job after job); equal blocks trace once each, and inductor's
on-disk graph cache serves the second and later ones their kernels.

Two kinds of module stay eager, each a graph break between compiled regions:

- **the fused linears** (:mod:`stages.compute.wgrad`): an autograd Function whose
  backward hands its weight GEMMs to the stage, to run now, in a later ``W`` (the split
  backward of zero-bubble schedules) or batched over micro-batches (W batching).
  torch.compile cannot trace a backward with such effects; left eager, every split of
  backward works as it does without compile, and the GEMMs are the same GEMMs.
- **tensor-parallel layers** (:mod:`stages.build.tensor_parallel`): they all-reduce and
  gather inside forward and backward, over process groups compile does not know.

So with ``gradient_accumulation_fusion`` on (the default) what compile fuses is what lies
between the linears: norms, activations, residual adds, attention. With it off a layer
compiles whole, forward and backward into one autograd node each; a split backward then
runs that node's backward for ``I`` and again for ``W`` (it cannot compute part of its
gradients), which :mod:`stages.compute.passes` already does for plain autograd: the
results are the same, the time is one more backward of each compiled layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stages.build.tensor_parallel import ParallelCausalSelfAttention, ColumnParallelLinear, RowParallelLinear, \
    VocabParallelEmbedding
from stages.build.traced import TracedStage
from stages.compute import wgrad

__all__ = ["EAGER_MODULES", "compile_kwargs", "compile_stage", "stays_eager"]

# Tensor-parallel layers: collectives inside forward and backward.
EAGER_MODULES: tuple[type[nn.Module], ...] = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                              ParallelCausalSelfAttention)


def compile_kwargs(setting: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """torch.compile's keyword arguments for a job's ``runtime.torch_compile`` (None: off).

    ``True`` is torch's defaults (inductor); a dict gives its own arguments, checked by the
    spec (:func:`stages.spec_checks.check_torch_compile`).
    """
    if setting is False:
        return None
    if setting is True:
        return {}
    return {key: value for key, value in setting.items() if value is not None}


def stays_eager(module: nn.Module, *, fused_linears: wgrad.WeightGradients | None) -> bool:
    """Whether compile leaves ``module`` out: a linear the stage's fused weight gradients took over,
    or a tensor-parallel layer (see the module doc)."""
    return (fused_linears is not None and fused_linears.owns(module)) or isinstance(module, EAGER_MODULES)


def compile_stage(modules: Mapping[int, nn.Module], setting: bool | Mapping[str, Any], *,
                  fused_linears: wgrad.WeightGradients | None) -> int:
    """Compiles, in place, each layer of each model stage in ``modules``; returns how many were compiled.

    Call after the layers are built, placed on their device and their fused linears
    installed (:func:`stages.compute.wgrad.install`). Compilation itself happens at each
    layer's first call (the first step's forward), on the stage's compute thread.

    Every layer compiles without AOTAutograd's donated buffers (which reuse saved tensors
    in place in backward, and refuse ``retain_graph=True``): without fused linears a
    backward runs twice over one forward (the ``I`` and ``W`` of plain autograd), and
    compiled graphs outlive the job that made them (in torch's caches, in process and on
    disk), so every graph must allow it.

    Args:
        fused_linears: the stage's fused weight gradients (``gradient_accumulation_fusion``),
            if any: the linears they took over stay eager.
    """
    kwargs = compile_kwargs(setting)
    if kwargs is None:
        return 0
    kwargs = _keeping_saved_tensors(kwargs)
    count = 0
    for stage in modules.values():
        for sub in stage.modules():
            if stays_eager(sub, fused_linears=fused_linears):
                # Called through torch.compiler.disable: the compiled graph around it breaks
                # here and calls it as it is (its forward, and its own backward).
                sub.forward = torch.compiler.disable(sub.forward)  # type: ignore[method-assign]
        for layer in _layers(stage):
            if not stays_eager(layer, fused_linears=fused_linears):
                layer.compile(**kwargs)
                count += 1
    return count


def _layers(stage: nn.Module) -> list[nn.Module]:
    """The units a stage compiles: a traced stage's graph module, else each layer of its chain."""
    if isinstance(stage, TracedStage):
        return [stage.module]
    return list(stage.children())


class _KeepingSavedTensors:
    """A torch.compile backend that compiles as ``inner`` does, without AOTAutograd's donated buffers, so that its
    backward may run twice over one forward (``retain_graph=True``). The setting is patched around the compile
    itself: torch's config is per thread and context, and a stage computes on two threads."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, graph: Any, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._functorch import config as functorch_config

        # Not from AOTAutograd's on-disk cache either: its key leaves donated buffers out, so it would hand back
        # a graph an earlier process compiled with them. Inductor's own cache (the kernels) still serves.
        with functorch_config.patch(donated_buffer=False, enable_autograd_cache=False):
            return self.inner(graph, example_inputs, **kwargs)


def _keeping_saved_tensors(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the backend (its mode and options with it) wrapped in :class:`_KeepingSavedTensors`,
    built as torch.compile builds it."""
    kwargs = dict(kwargs)
    backend, mode, options = kwargs.pop("backend", "inductor"), kwargs.pop("mode", None), kwargs.pop("options", None)
    dynamic = kwargs.get("dynamic")
    inner = torch._TorchCompileInductorWrapper(mode, options, dynamic) if backend == "inductor" else \
        torch._TorchCompileWrapper(backend, mode, options, dynamic)
    # Its own compiled entries, and its own recompile limit: every layer's call is Module._call_impl, one code object
    # that every layer of every job in this process shares, whose shared limit (8) would otherwise run out.
    return {**kwargs, "backend": _KeepingSavedTensors(inner), "isolate_recompiles": True}
