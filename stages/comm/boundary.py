"""What crosses a stage boundary: any tree of tensors, flattened for the wire.

A stage's output may be a tensor, a tuple or list, a dict with string keys, or any
nesting of those, with ``None`` and plain constants (int, float, bool, str) among the
tensors: several activations, integer ids, attention masks, tensors that need no
gradient. :func:`pack` flattens such a tree into its tensors and a *spec*, a small
msgpack-safe description of the structure that also records which tensors carry a
gradient; :func:`unpack` builds the tree again on the receiving stage, where each
such tensor becomes a fresh leaf whose ``.grad`` is what goes back upstream.

Gradients travel the same way, as the list of the gradients of those tensors (``None``
where the downstream stage did not use one). A spec that comes from the wire is
checked (:func:`check_spec`) before anything is built from it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from transport import codecs

__all__ = ["MAX_LEAVES", "Payload", "batch_size", "call_module", "cast_floating", "check_spec", "grad_leaves", "pack",
           "split_batch", "tree_tensors", "unpack"]

MAX_LEAVES = 256  # tensors per boundary value
_MAX_NODES = 4096
_MAX_DEPTH = 32
_MAX_KEY = 200
_CONSTANTS = (bool, int, float, str)


@dataclass(frozen=True, slots=True)
class Payload:
    """A boundary value as it travels: its tensors in order, and the spec to rebuild it."""

    leaves: list[torch.Tensor]  # or, received on a GPU's process, codecs.Encoded until it reaches the device
    spec: Any

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes if isinstance(t, codecs.Encoded) else t.numel() * t.element_size() for t in self.leaves)


def pack(tree: Any) -> Payload:
    """Flattens ``tree`` into detached tensors and its spec.

    A tensor that requires grad is marked (spec ``1``; others ``0``): the receiver
    makes it a leaf that collects the gradient to send back.

    Raises:
        TypeError: a value that is neither a tensor, None, a constant nor a container
            of those; the message gives its path in the tree.
    """
    leaves: list[torch.Tensor] = []
    spec = _walk(tree, leaves, "", 0)
    if len(leaves) > MAX_LEAVES:
        raise TypeError(f"a stage boundary value holds {len(leaves)} tensors; at most {MAX_LEAVES} can cross")
    return Payload(leaves, spec)


# pack's and unpack's recursions are module functions, not closures: a closure that calls
# itself is a reference cycle, which would keep the value's tensors alive until the
# garbage collector found it (a boundary value held past its send, or its backward).
def _walk(value: Any, leaves: list[torch.Tensor], path: str, depth: int) -> Any:
    """The spec of ``value``, its tensors appended to ``leaves`` (detached)."""
    if depth > _MAX_DEPTH:
        raise TypeError(f"a stage boundary value nests deeper than {_MAX_DEPTH} levels (at {path or 'the top'})")
    if isinstance(value, torch.Tensor):
        leaves.append(value.detach())
        return 1 if value.requires_grad else 0
    if value is None:
        return None
    if isinstance(value, _CONSTANTS):
        return {"c": value}
    if isinstance(value, Mapping):
        items = []
        for key, item in value.items():
            if not isinstance(key, str) or len(key) > _MAX_KEY:
                raise TypeError(f"a dict crossing a stage boundary needs string keys of at most {_MAX_KEY} "
                                f"characters; {path or 'the value'} has the key {str(key)[:40]!r}")
            items.append([key, _walk(item, leaves, f"{path}[{key!r}]", depth + 1)])
        return {"d": items}
    if isinstance(value, (tuple, list)):
        children = [_walk(item, leaves, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
        return {"t" if isinstance(value, tuple) else "l": children}
    raise TypeError(f"a stage's output can cross a boundary as tensors, tuples, lists, dicts, None and "
                    f"constants; {path or 'it'} is a {type(value).__name__}")


def unpack(payload: Payload, device: torch.device | None = None, *, as_leaves: bool = False) -> Any:
    """The tree ``payload`` describes, its tensors on ``device``.

    With ``as_leaves``, each tensor marked as carrying a gradient becomes a fresh leaf
    that requires grad (a stage's input: its ``.grad`` is sent back upstream).
    """
    return _build(payload.spec, iter(payload.leaves), device, as_leaves)


def _build(spec: Any, leaves: Iterator[torch.Tensor], device: torch.device | None, as_leaves: bool) -> Any:
    """The tree ``spec`` describes, taking its tensors from ``leaves`` in order."""
    if spec is None:
        return None
    if isinstance(spec, int):
        tensor = next(leaves)
        if device is not None:
            tensor = tensor.to(device, non_blocking=True)
        if as_leaves and spec == 1 and (tensor.is_floating_point() or tensor.is_complex()):
            tensor = tensor.detach().requires_grad_(True)
        return tensor
    (kind, body), = spec.items()
    if kind == "c":
        return body
    if kind == "d":
        return {key: _build(child, leaves, device, as_leaves) for key, child in body}
    children = [_build(child, leaves, device, as_leaves) for child in body]
    return tuple(children) if kind == "t" else children


def check_spec(spec: Any, leaves: int) -> None:
    """Refuses a spec from the wire that is malformed, too large, or not for ``leaves`` tensors.

    Raises:
        ValueError: what is wrong with it.
    """
    count = 0
    nodes = 0

    def walk(node: Any, depth: int) -> None:
        nonlocal count, nodes
        nodes += 1
        if nodes > _MAX_NODES or depth > _MAX_DEPTH:
            raise ValueError(f"a boundary spec has more than {_MAX_NODES} nodes or {_MAX_DEPTH} levels")
        if node is None:
            return
        if isinstance(node, int) and not isinstance(node, bool):
            if node not in (0, 1):
                raise ValueError(f"a boundary spec marks a tensor with {node}, not 0 or 1")
            count += 1
            return
        if not isinstance(node, dict) or len(node) != 1:
            raise ValueError(f"a boundary spec node is a {type(node).__name__}, not a one-entry map")
        (kind, body), = node.items()
        if kind == "c":
            if not isinstance(body, _CONSTANTS) or (isinstance(body, str) and len(body) > _MAX_KEY):
                raise ValueError("a boundary spec constant is not a short str, int, float or bool")
        elif kind in ("t", "l") and isinstance(body, list):
            for child in body:
                walk(child, depth + 1)
        elif kind == "d" and isinstance(body, list):
            for item in body:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                        and len(item[0]) <= _MAX_KEY):
                    raise ValueError("a boundary spec dict entry is not [short string key, node]")
                walk(item[1], depth + 1)
        else:
            raise ValueError(f"a boundary spec node of kind {str(kind)[:8]!r} is not one of c, t, l, d")

    walk(spec, 0)
    if count != leaves:
        raise ValueError(f"a boundary spec describes {count} tensors but {leaves} came")


def tree_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree``, in :func:`pack`'s order (not detached)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [t for item in tree.values() for t in tree_tensors(item)]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in tree_tensors(item)]
    return []


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor in ``dtype`` (differentiably); other values as they are."""
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() and tree.dtype != dtype else tree
    if isinstance(tree, Mapping):
        return {key: cast_floating(value, dtype) for key, value in tree.items()}
    if isinstance(tree, (tuple, list)):
        items = [cast_floating(value, dtype) for value in tree]
        return tuple(items) if isinstance(tree, tuple) else items
    return tree


def grad_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of a stage's input tree that collect a gradient for the upstream stage."""
    return [t for t in tree_tensors(tree) if t.requires_grad and t.is_leaf]


def call_module(module: torch.nn.Module, inputs: Any) -> Any:
    """Calls the first stage's module on a batch: a tensor as is, a tuple or list as positional
    arguments, a dict as keyword arguments."""
    if isinstance(inputs, Mapping):
        return module(**inputs)
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    return module(inputs)


def batch_size(batch: Any) -> int | None:
    """Samples in a batch (the first dim of its first tensor), or None for a batch without tensors."""
    tensors = tree_tensors(batch)
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else None


def split_batch(batch: Any, parts: int, what: str, name: str = "micro_batches", *, aligned: bool = False) -> list[Any]:
    """``batch`` (a tensor, a tuple/list of tensors, or a dict of them) cut into ``parts`` along dim 0.

    A batch that does not divide evenly is cut as :func:`torch.tensor_split` cuts it: the
    first ``size % parts`` parts hold one sample more (a short last batch trains, each
    micro-batch's loss weighted by its samples: see :func:`stages.compute.averaging.sample_weights`).
    The parts are views of the batch; with ``aligned``, a part that starts off the alignment
    a received tensor has (:data:`~transport.codecs.FRAME_ALIGNMENT`) is copied to one that
    does not, so that a stage that cuts its share computes as one that received each part.

    Raises:
        TypeError: a batch with no tensor, or with values other than tensors, containers and constants.
        ValueError: fewer samples than parts (a part would be empty), or tensors whose first dims differ.
    """
    tensors = tree_tensors(batch)
    if not tensors:
        raise TypeError(f"{what} must be a tensor, or a tuple or dict of tensors; got {type(batch).__name__}")
    try:
        payload = pack(batch)
    except TypeError as exc:
        raise TypeError(f"{what}: {exc}") from None
    sizes = {tuple(t.shape[:1]) for t in tensors}
    for tensor in tensors:
        if tensor.dim() > 0 and tensor.shape[0] == 0:
            raise ValueError(f"{what} of shape {tuple(tensor.shape)} hold no samples; a step needs a non-empty batch")
        if tensor.dim() == 0 or tensor.shape[0] < parts:
            raise ValueError(
                f"{what} of shape {tuple(tensor.shape)} do not fill {parts} parts of at least one sample; "
                f"the batch needs as many samples as {name}"
                + (" times data_parallel" if name == "micro_batches" else " (times micro_batches)")
                + ": give a larger batch or lower micro_batches")
    if len(sizes) > 1:
        raise ValueError(f"{what} hold tensors of different batch sizes {sorted(s[0] for s in sizes)}; every "
                         "tensor of a batch has the samples along its first dim")
    chunks = [t.tensor_split(parts) for t in tensors]
    if aligned:
        chunks = [tuple(codecs.aligned(c) for c in cut) for cut in chunks]
    return [unpack(Payload([c[k] for c in chunks], payload.spec)) for k in range(parts)]

