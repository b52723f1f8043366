"""Activation memory: recomputing it in backward (activation checkpointing), and measuring what is kept.

**Checkpointing.** :func:`checkpointed` runs a function under
``torch.utils.checkpoint`` (non-reentrant): between forward and backward only the
function's tensor arguments (and the RNG state) are kept; backward runs the function
again, with the forward's RNG state, the first time it needs one of its saved tensors.
The recompute is the same ops on the same values, so gradients are bit-identical to
a run without checkpointing. The graph's structure stays as it was, so a backward
that asks for some gradients only (``autograd.grad(outputs, inputs)``, the ``I`` of
a split backward) works, and recomputes again for the next one (``W``).

**Measuring.** :class:`SavedActivations` is a ``saved_tensors_hooks`` pair that
notes every tensor autograd keeps for backward, by the storage it keeps alive (a
view counts as its whole storage, two views of one storage once). Inside a
checkpointed function torch's own hooks take over and nothing is stored, so what is
noted there is only the function's arguments. Like every saved-tensors hook, these
hand a saved tensor back as a new tensor object: an autograd Function that needs a
parameter's identity in backward keeps it on ``ctx`` instead (see stages.compute.wgrad).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

__all__ = ["SavedActivations", "Storages", "checkpoint_interval", "checkpointed", "run_layers", "run_segments",
           "storages", "union_bytes"]

Storages = dict[tuple[str, int], int]  # (device, data pointer) -> bytes


def checkpoint_interval(setting: bool | int) -> int:
    """Layers per checkpointed segment for a job's ``activation_checkpointing``: 0 is off, ``True`` is 1."""
    if isinstance(setting, bool):
        return 1 if setting else 0
    return int(setting)


def checkpointed(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, keeping only the arguments for backward and recomputing the rest there.

    The arguments are flattened first, so that every tensor in them, however deep in
    tuples and dicts (a stage boundary's tree), is one that torch's checkpoint saves,
    and that its RNG state is taken for the device the tensors are on.
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))

    def run(*flat: Any) -> Any:
        call_args, call_kwargs = pytree.tree_unflatten(list(flat), spec)
        return fn(*call_args, **call_kwargs)

    return checkpoint(run, *leaves, use_reentrant=False, preserve_rng_state=True)


def run_layers(layers: Iterable[Callable[..., Any]], /, *args: Any, **kwargs: Any) -> Any:
    """The first layer on the arguments as given, each later one on the value before it."""
    it = iter(layers)
    value = next(it)(*args, **kwargs)
    for layer in it:
        value = layer(value)
    return value


def run_segments(layers: Sequence[Callable[..., Any]], every: int, /, *args: Any, **kwargs: Any) -> Any:
    """:func:`run_layers`, each run of ``every`` layers as one checkpointed segment (DeepSpeed's
    ``activation_checkpoint_interval``): what is kept is each segment's input."""
    value: Any = None
    for start in range(0, len(layers), every):
        segment = functools.partial(run_layers, layers[start:start + every])
        value = checkpointed(segment, *args, **kwargs) if start == 0 else checkpointed(segment, value)
    return value


def _storage(tensor: torch.Tensor) -> tuple[tuple[str, int], int]:
    try:
        storage = tensor.untyped_storage()
        return (str(tensor.device), storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # no plain storage (sparse, nested): its own bytes
        return (str(tensor.device), id(tensor)), tensor.numel() * tensor.element_size()


def storages(tensors: Iterable[torch.Tensor], resident: Container[tuple[str, int]] = ()) -> Storages:
    """The storages ``tensors`` keep alive, with their sizes, leaving out those in ``resident``."""
    found = dict(_storage(t) for t in tensors)
    return {key: nbytes for key, nbytes in found.items() if key not in resident}


def union_bytes(parts: Iterable[Mapping[tuple[str, int], int]]) -> int:
    """Bytes of the storages of all ``parts`` together (one shared by two counts once)."""
    merged: dict[tuple[str, int], int] = {}
    for part in parts:
        merged.update(part)
    return sum(merged.values())


class SavedActivations:
    """Inside ``with``: notes the storage of every tensor autograd saves for backward.

    Args:
        resident: storages that live anyway (parameters, buffers, the step's batch): not counted.
    """

    def __init__(self, resident: Container[tuple[str, int]]) -> None:
        self._resident = resident
        self.storages: Storages = {}
        self._hooks = saved_tensors_hooks(self._pack, _unpack)

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Notes tensors held for backward other than through autograd (a stash's own references)."""
        for tensor in tensors:
            self._note(tensor)

    def _note(self, tensor: torch.Tensor) -> None:
        key, nbytes = _storage(tensor)
        if key not in self._resident:
            self.storages[key] = nbytes

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._note(tensor)
        # Detached: the packed tensor must not refer back to its own grad_fn (a cycle
        # that only the garbage collector would free); autograd restores it on unpack.
        return tensor.detach()

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._hooks.__exit__(kind, exc, tb)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
