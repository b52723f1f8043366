"""How a step's loss averages over its micro-batches and replicas (``training.loss_averaging``).

One process computes its loss on the whole global batch; a pipeline computes it per
micro-batch, on each data-parallel replica, and the gradients add up across them. For the
two to agree, each micro-batch's loss is weighted before its backward:

``samples`` (the default)
    a micro-batch's mean loss counts by its share of the global batch's samples: with
    ``n`` samples of ``B`` on one of ``R`` replicas (whose gradients are averaged), by
    ``R * n / B``. An even split gives every micro-batch ``1 / micro_batches``, as before;
    an uneven one (a short last batch) stays one process's mean over the batch.
    :func:`shard_batch` cuts a global batch and says the weights; where only one replica's
    micro-batches are known (a data loader), each replica averages its own, as
    ``DistributedDataParallel`` does.
``tokens``
    the loss is summed (``reduction="sum"``) and each micro-batch counts its target
    elements other than ``ignore_index`` (:func:`count_items`). The stages learn the
    global batch's count in their tail's vote (:mod:`stages.compute.agreement`) and divide
    the summed gradients by it (times ``R``, which the replicas' average divides by), so
    that the step's gradient is the sum of every per-token loss's over the count of
    counted tokens in the whole batch, whatever the micro-batches and replicas hold
    (Hugging Face's ``num_items_in_batch``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stages.comm.boundary import batch_size, split_batch, tree_tensors
from transport.wire import excerpt

__all__ = ["check_summable", "count_items", "loss_of", "sample_weights", "shard_batch", "shard_replicas", "split_sizes",
           "step_loss"]


def sample_weights(sizes: Sequence[Sequence[int]]) -> list[list[float]] | None:
    """Each micro-batch's loss weight under ``samples``, per replica: ``R * n / B``; None when the
    split is even (every micro-batch then weighs ``1 / micro_batches``).

    Args:
        sizes: per replica, its micro-batches' sample counts.
    """
    counts = [n for replica in sizes for n in replica]
    if len(set(counts)) <= 1:
        return None
    total, replicas = sum(counts), len(sizes)
    return [[replicas * n / total for n in replica] for replica in sizes]


def shard_batch(inputs: Any, targets: Any, replicas: int, micro_batches: int
                ) -> tuple[list[list[Any]], list[list[Any]], list[list[float]] | None]:
    """A global batch cut into each replica's micro-batches (inputs and targets), with their
    :func:`sample_weights` (None for an even split).

    Raises:
        ValueError: fewer samples than ``replicas * micro_batches``.
        TypeError, ValueError: see :func:`~stages.comm.boundary.split_batch`.
    """
    input_shards, target_shards, weights = shard_replicas(inputs, targets, replicas, micro_batches)
    return ([split_batch(shard, micro_batches, "inputs") for shard in input_shards],
            [split_batch(shard, micro_batches, "targets") for shard in target_shards], weights)


def shard_replicas(inputs: Any, targets: Any, replicas: int, micro_batches: int
                   ) -> tuple[list[Any], list[Any], list[list[float]] | None]:
    """A global batch cut into each replica's whole share (inputs and targets), with the
    :func:`sample_weights` of the ``micro_batches`` parts a stage will cut each share into
    (:func:`~stages.comm.boundary.split_batch`, as :func:`torch.tensor_split` cuts; None for an
    even split): :func:`shard_batch` but its last cut, which the share's stages make themselves.

    Raises:
        ValueError: fewer samples than ``replicas * micro_batches``, or targets with another number of
            samples than the inputs.
        TypeError, ValueError: see :func:`~stages.comm.boundary.split_batch`.
    """
    given = batch_size(inputs), batch_size(targets)
    if None not in given and given[0] != given[1]:  # each would be cut on its own, out of step with the other
        raise ValueError(f"inputs hold {given[0]} samples and targets {given[1]}: a batch's targets are cut into "
                         "micro-batches with its inputs, sample by sample, so their first dims must be equal")
    for what, size in zip(("inputs", "targets"), given):
        if size is not None and 0 < size < replicas * micro_batches:
            raise ValueError(f"{what}: a batch of {size} samples cannot give {replicas * micro_batches} micro-batches "
                             f"(data_parallel {replicas} x micro_batches {micro_batches}) one sample each; give at "
                             f"least {replicas * micro_batches} samples or lower micro_batches")
    input_shards = split_batch(inputs, replicas, "inputs", "data_parallel")
    target_shards = split_batch(targets, replicas, "targets", "data_parallel")
    sizes = [split_sizes(batch_size(shard) or 1, micro_batches) for shard in target_shards]
    return input_shards, target_shards, sample_weights(sizes)


def split_sizes(size: int, parts: int) -> list[int]:
    """The sizes of ``parts`` pieces of ``size`` samples as :func:`torch.tensor_split` cuts them
    (the first ``size % parts`` one larger); a piece is never empty (at least one sample each)."""
    base, extra = divmod(size, parts)
    return [max(1, base + (k < extra)) for k in range(parts)]


def count_items(target: Any, ignore_index: int) -> torch.Tensor:
    """The target elements a ``tokens`` average counts: those of the targets' first tensor other than
    ``ignore_index`` (integer targets), or all of them (floating-point ones); an int64 scalar on its device."""
    tensors = tree_tensors(target)
    if not tensors:
        raise TypeError(f"loss_averaging='tokens' counts the targets' elements; got {type(target).__name__}")
    first = tensors[0]
    if first.is_floating_point():
        return torch.tensor(first.numel(), dtype=torch.int64, device=first.device)
    return (first != ignore_index).sum().to(torch.int64)


def check_summable(loss_fn: Callable[..., Any], name: str) -> None:
    """Refuses a loss that cannot sum (``loss_averaging="tokens"`` calls it with ``reduction="sum"``).

    Raises:
        ValueError: the loss takes no ``reduction`` keyword (nor ``**kwargs``).
    """
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: let the first call say
        return
    if not any(p.name == "reduction" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise ValueError(f"loss_averaging='tokens' calls the loss with reduction='sum', but {name} takes no "
                         "'reduction' keyword: add one (reduction='mean' by default), or use "
                         "loss_averaging='samples'")


def loss_of(loss_fn: Callable[..., Any], output: Any, target: Any, tokens: bool) -> torch.Tensor:
    """One micro-batch's loss as the averaging needs it: the mean (``samples``) or the sum (``tokens``)."""
    try:
        loss = loss_fn(output, target, reduction="sum") if tokens else loss_fn(output, target)
    except Exception as exc:
        # torch's own error names neither the function nor what it was given ("'tuple' object
        # has no attribute 'size'" for a model whose last module returns a tuple)
        exc.add_note(f"in the loss function {_named(loss_fn)}, called with the model's output "
                     f"{excerpt(output, 160)} and the targets {excerpt(target, 160)}")
        raise
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        # Caught here, the error names the loss; left to backward it would say only "grad
        # can be implicitly created only for scalar outputs", to evaluate "a Tensor with
        # 4 elements cannot be converted to Scalar".
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else \
            f"a {type(loss).__name__}"
        called = ' with reduction="sum" (loss_averaging="tokens")' if tokens else ""
        raise (ValueError if isinstance(loss, torch.Tensor) else TypeError)(
            f"the loss function {_named(loss_fn)} returned {got}{called}: a loss is one number per "
            f"micro-batch, a tensor with one element (reduce it, e.g. with .mean() or .sum())")
    return loss.float()


def _named(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a function or class, as a factory path names it; else its repr."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{name}" if module and name else repr(fn)


def step_loss(losses: Sequence[float], items: Sequence[float], tokens: bool) -> float:
    """The step's loss from its micro-batches' (every replica's): their losses weighted by their
    samples (``samples``), or their sums over the counted tokens (``tokens``); the plain mean of
    the losses when the micro-batches are of one size (or their sizes are not known)."""
    if not losses:
        return float("nan")
    if tokens:
        return sum(losses) / max(1.0, sum(items))
    if len(items) != len(losses) or len(set(items)) <= 1:
        return sum(losses) / len(losses)
    return sum(loss * n for loss, n in zip(losses, items)) / sum(items)
