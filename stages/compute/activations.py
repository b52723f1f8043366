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

**Holding it in fewer bits.** Given a codec (a job's ``stash_codec``: ``bf16``, ``int8``,
``fp8``, ...; the wire's own, from transport.codecs), :class:`SavedActivations` encodes
each floating-point tensor autograd saves, as it is saved, and decodes it when backward
unpacks it: on the tensor's device, back to its dtype and shape (contiguous, as
``torch.autograd.graph.save_on_cpu`` gives it back). The full-precision tensor is then
freed as soon as the forward is done with it, and what is counted is the encoded frames.
Left as they are: what lives anyway (parameters, buffers, the batch), what was computed
from one parameter alone with its number of elements (autocast's cast of a weight, its
transpose: a parameter in another dtype is still a parameter), integer and bool tensors,
and tensors under :data:`MIN_ELEMENTS_TO_ENCODE` elements, where the scales and the
bookkeeping would cost about what they save. A tensor saved twice (``h`` and ``h.view(...)``
by two ops) is encoded once when both are contiguous views of the same elements; two
other views of one storage are encoded one each. Inside a checkpointed function torch's
hooks take over, so with checkpointing what is encoded is each segment's input, and the
recompute starts from the decoded input.

Lossy codecs change gradients by what the codec's error (int8: its block's absmax / 254
per element, fp8: 2**-4 of the value, bf16: 2**-8 of it) does to the saved values; the
forward is exact. A frozen parameter's autocast copy has no autograd history to tell it
from an activation by, and is encoded. The stash's own tensors, a stage's boundary input
leaves and its outputs, are needed in backward only as places in the graph:
:meth:`SavedActivations.drop_values` frees their values too (an output's once its send
lets go of it; a storage that a small saved view still holds stays, and is counted).
Between a fused ``I`` and its ``W`` the linears' inputs and output gradients wait
encoded (:meth:`SavedActivations.hold`), so a lossy codec moves the weight gradients by its
error of both; the output gradients the ``I`` of plain autograd keeps for ``W`` live inside
autograd's graph and stay as they are.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from transport.codecs import Encoded, decode, get_codec

__all__ = ["MIN_ELEMENTS_TO_ENCODE", "Packed", "SavedActivations", "StorageKey", "Storages", "checkpoint_interval",
           "checkpointed", "restore", "run_layers", "run_segments", "storages", "union_bytes"]

StorageKey = tuple[torch.device, int]  # (device, data pointer)
Storages = dict[StorageKey, int]  # -> bytes

# A smaller saved tensor stays as it is: a block's scale and the bookkeeping would cost about what it saves.
MIN_ELEMENTS_TO_ENCODE = 1024


def checkpoint_interval(setting: bool | int) -> int:
    """Layers per checkpointed segment for a job's ``activation_checkpointing``: 0 is off, ``True`` is 1."""
    if isinstance(setting, bool):
        return 1 if setting else 0
    return int(setting)


def checkpointed(fn: Callable[..., Any], /, *args: Any, modules: Sequence[nn.Module] = (), **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, keeping only the arguments for backward and recomputing the rest there.

    The arguments are flattened first, so that every tensor in them, however deep in
    tuples and dicts (a stage boundary's tree), is one that torch's checkpoint saves,
    and that its RNG state is taken for the device the tensors are on. ``modules``: what
    ``fn`` runs; the running statistics of their normalizations (BatchNorm's) are left as the
    forward left them by the recompute, which would otherwise count each batch twice
    (torch's own checkpoint does).
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))

    def run(*flat: Any) -> Any:
        call_args, call_kwargs = pytree.tree_unflatten(list(flat), spec)
        return fn(*call_args, **call_kwargs)

    statistics = [b for module in modules for b in _running_statistics(module)]
    if not statistics:
        return checkpoint(run, *leaves, use_reentrant=False, preserve_rng_state=True)
    return checkpoint(run, *leaves, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: (contextlib.nullcontext(), _StatisticsKept(statistics)))


# A normalization's running statistics (BatchNorm's and InstanceNorm's buffers, under these names in a traced
# stage too, where the norm is a graph module of its own).
_RUNNING = frozenset({"running_mean", "running_var", "num_batches_tracked"})


_STATISTICS: weakref.WeakKeyDictionary[nn.Module, list[torch.Tensor]] = weakref.WeakKeyDictionary()


def _running_statistics(module: nn.Module) -> list[torch.Tensor]:
    """``module``'s running-statistics buffers, each once; found once a module (every micro-batch's
    forward asks, and a walk of a stage's modules is not free)."""
    found = _STATISTICS.get(module)
    if found is None:
        found = _STATISTICS[module] = list({id(b): b for m in module.modules() for name, b in m._buffers.items()
                                            if name in _RUNNING and b is not None}.values())
    return found


class _StatisticsKept:
    """Inside (a recompute): whatever the running statistics become, they are put back.

    Entered at every recompute of one forward: torch's checkpoint makes the context once a
    forward, and a split backward under plain autograd (zero-bubble's I, then W) recomputes
    twice; a generator's context could be entered only once, and the second recompute failed."""

    def __init__(self, statistics: Sequence[torch.Tensor]) -> None:
        self.statistics = statistics
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        self.kept = [(buffer, buffer.clone()) for buffer in self.statistics]

    def __exit__(self, *exc_info: object) -> None:
        kept, self.kept = self.kept, []
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


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
        held = layers[start:start + every]
        segment = functools.partial(run_layers, held)
        modules = [layer for layer in held if isinstance(layer, nn.Module)]
        value = checkpointed(segment, *args, modules=modules, **kwargs) if start == 0 else \
            checkpointed(segment, value, modules=modules)
    return value


def _storage(tensor: torch.Tensor) -> tuple[StorageKey, int]:
    # Keyed by the device object: its str() cost a micro-second, and this runs for every tensor autograd saves.
    try:
        storage = tensor.untyped_storage()
        return (tensor.device, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # no plain storage (sparse, nested): its own bytes
        return (tensor.device, id(tensor)), tensor.numel() * tensor.element_size()


def storages(tensors: Iterable[torch.Tensor], resident: Container[StorageKey] = ()) -> Storages:
    """The storages ``tensors`` keep alive, with their sizes, leaving out those in ``resident``."""
    found = dict(_storage(t) for t in tensors)
    return {key: nbytes for key, nbytes in found.items() if key not in resident}


def union_bytes(parts: Iterable[Mapping[StorageKey, int]]) -> int:
    """Bytes of the storages of all ``parts`` together (one shared by two counts once)."""
    merged: Storages = {}
    for part in parts:
        merged.update(part)
    return sum(merged.values())


class SavedActivations:
    """Inside ``with``: notes the storage of every tensor autograd saves for backward, and encodes it with ``codec``.

    Args:
        resident: storages that live anyway (parameters, buffers, the step's batch): not counted, never encoded.
        codec: the name of the codec (transport.codecs) that holds saved activations; ``none`` keeps them
            as they are.

    Raises:
        CodecError: an unknown codec.
    """

    def __init__(self, resident: Container[StorageKey], codec: str = "none") -> None:
        self._resident = resident
        self._codec = None if codec == "none" else get_codec(codec)
        self.storages: Storages = {}
        # What this forward encoded, by what it was encoded from (see _source): a tensor saved twice is encoded once.
        self._encoded: dict[Hashable, Encoded] = {}
        # Kept out of torch.compile: dynamo traced these into compiled layers and recompiled them whenever a storage
        # key it had guarded on moved (27 recompiles over 12 batch shapes), up to its recompile limit.
        self._hooks = saved_tensors_hooks(torch.compiler.disable(self.hold), torch.compiler.disable(restore))

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Notes tensors held for backward other than through autograd (a stash's own references)."""
        for tensor in tensors:
            self._note(tensor)

    def drop_values(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Frees the values of stash tensors that backward needs only as places in the graph; returns the others.

        A stage keeps its boundary input leaves (their ``.grad`` goes upstream) and its
        outputs (the roots the gradient comes back to) until their backward, and autograd
        keeps each too (an input's gradient accumulator holds the leaf itself). Backward
        reads their shapes and places in the graph, never their values: where it needs
        those it saved them, through these hooks, encoded or as an alias of the old storage.
        So with a codec each large floating-point one gets in place of its values one NaN,
        expanded to its shape, and its storage is freed once nothing else (an output's
        send) holds it. Code that reads such a tensor after its forward anyway (a custom
        autograd Function that keeps its input on ``ctx`` instead of saving it) computes
        NaN, which the step's non-finite check refuses, not a quietly wrong gradient.
        Without a codec nothing changes, and every tensor is returned.
        """
        kept = []
        for tensor in tensors:
            if self._codec is None or type(tensor) is not torch.Tensor or not self._worth_encoding(tensor) \
                    or _storage(tensor)[0] in self._resident:
                kept.append(tensor)
                continue
            tensor.data = torch.full((), float("nan"), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)
        return kept

    def _note(self, tensor: torch.Tensor) -> None:
        key, nbytes = _storage(tensor)
        if key not in self._resident:
            self.storages[key] = nbytes

    def hold(self, tensor: torch.Tensor) -> torch.Tensor | Packed:
        """``tensor`` as it is held for backward (:func:`restore` gives it back), its storage or frames noted.

        The saved-tensors hook's pack; also what holds a tensor that waits for backward
        other than through autograd (a deferred weight gradient's input, between I and W).
        """
        key, nbytes = _storage(tensor)
        if key in self._resident:
            return tensor.detach()
        if self._codec is None or not self._worth_encoding(tensor) or self._copies_a_parameter(tensor):
            self.storages[key] = nbytes
            # Detached: the packed tensor must not refer back to its own grad_fn (a cycle
            # that only the garbage collector would free); autograd restores it on unpack.
            return tensor.detach()
        source = _source(tensor)
        encoded = self._encoded.get(source)
        if encoded is None:
            encoded = self._encoded[source] = self._codec.encode(tensor)
        self.add(encoded.frames)
        return Packed(encoded, tensor.shape)

    def _worth_encoding(self, tensor: torch.Tensor) -> bool:
        assert self._codec is not None
        return tensor.dtype in self._codec.dtypes and tensor.layout is torch.strided and not tensor.is_nested \
            and tensor.numel() >= MIN_ELEMENTS_TO_ENCODE

    def _copies_a_parameter(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (or what it is a view of) was computed from one resident leaf alone, with as many
        elements: autocast's cast of a weight, which a matmul saves for the input's gradient."""
        base = tensor if tensor._base is None else tensor._base
        inputs = [] if base.grad_fn is None else [fn for fn, _ in base.grad_fn.next_functions if fn is not None]
        leaf = getattr(inputs[0], "variable", None) if len(inputs) == 1 else None
        return isinstance(leaf, torch.Tensor) and leaf.numel() == base.numel() and _storage(leaf)[0] in self._resident

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._hooks.__exit__(kind, exc, tb)
        self._encoded.clear()  # the packed tensors keep what they need


@dataclass(frozen=True, slots=True)
class Packed:
    """A tensor as :class:`SavedActivations` holds it with a codec: encoded, and the shape to give it back in."""

    encoded: Encoded
    shape: torch.Size


def _source(tensor: torch.Tensor) -> Hashable:
    """What a tensor's values are read from: its storage (a weak reference, which no later storage can
    share), and where in it. A contiguous tensor is its elements in order, whatever its shape."""
    where = (tensor.storage_offset(), tensor.numel()) if tensor.is_contiguous() \
        else (tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
    return StorageWeakRef(tensor.untyped_storage()), tensor.dtype, where


def restore(held: torch.Tensor | Packed) -> torch.Tensor:
    """A tensor :meth:`SavedActivations.hold` held, as a tensor again (decoded, when it was encoded)."""
    if isinstance(held, torch.Tensor):
        return held
    return decode(held.encoded).view(held.shape)
