"""ZeRO stage 1: a stage's optimizer state sharded across its data-parallel replicas.

Every replica of a (pipeline, tensor) coordinate holds the same parameters and, after
the data-parallel reduction, the same averaged gradients; without ZeRO each of them
also runs the same optimizer step on a full copy of the optimizer state. With
``zero_stage=1`` the held parameters are partitioned among the replicas (whole
parameters, balanced by element count, the same partition on every replica); each
replica keeps optimizer state for its own shard only and steps only that shard, and
then every shard's owner broadcasts its updated parameters (large ones in place, small
ones packed in flat buckets), so that every replica again holds identical parameters. This is DeepSpeed's ZeRO-1 and
torch's ``ZeroRedundancyOptimizer``; like the latter, the unit of partition is a
whole parameter, so one parameter larger than the rest bounds how even the shards are.

The update is exact: a parameter's new value is the one the unsharded optimizer
computes from the same gradient and state, and a broadcast copies bits.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradientShards", "ShardedOptimizer", "check_snapshot", "gradient_bytes", "parameter_bytes", "partition",
           "plan_gradient_shards", "state_bytes"]

# A parameter this large is broadcast in place, alone: its collective costs far more than
# the call, and flat copies of the large ones would take as much memory as ZeRO saves.
IN_PLACE_BYTES = 1 << 20


def partition(numels: Sequence[int], num_shards: int) -> list[int]:
    """The shard that owns each parameter, given their element counts.

    Largest first, each goes to the shard with the fewest elements so far (the lowest
    index on a tie), as ``ZeroRedundancyOptimizer`` does: deterministic, so every
    replica computes the same partition from the same parameters.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    owners = [0] * len(numels)
    totals = [0] * num_shards
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        shard = min(range(num_shards), key=lambda s: (totals[s], s))
        owners[index] = shard
        totals[shard] += numels[index]
    return owners


@dataclass(frozen=True, slots=True)
class GradientShards:
    """ZeRO's reduce-scatter: which replica reduces, keeps and steps each parameter's gradient.

    The data-parallel reduction's buckets (:attr:`layout`, parameter indices) are each cut
    into one contiguous run of whole parameters per replica, balanced by elements; a
    reduce-scatter then leaves each replica the average of its own run only, half the
    bytes of an all-reduce, and a replica's runs are the parameters it steps (its ZeRO
    shard). A bucket of parameters tied across pipeline ranks is all-reduced instead
    (``None`` in :attr:`ranges`): the tied ranks sum whole gradients after the reduction.
    """

    layout: list[list[int]]
    """The buckets: indices into the parameters in reduction (backward) order."""
    ranges: list[list[tuple[int, int]] | None]
    """Per bucket, each replica's ``[start, end)`` in the bucket's flat gradient (None: all-reduced)."""
    owners: dict[int, int]
    """``id(param)`` -> the replica that steps it (and keeps its reduced gradient)."""

    def owned(self, replica: int, params: Sequence[torch.Tensor]) -> list[bool]:
        """Whether ``replica`` keeps each of ``params``' reduced gradient (every one of an all-reduced bucket)."""
        kept = {i for members, ranges in zip(self.layout, self.ranges) for i in members
                if ranges is None or self.owners[id(params[i])] == replica}
        return [i in kept for i in range(len(params))]

    def keep_own(self, replica: int, params: Sequence[torch.Tensor], flats: Sequence[torch.Tensor],
                 views: Sequence[torch.Tensor], *, release: bool) -> None:
        """After the reduce-scatter of gradients living in ``flats`` (``views``: each parameter's place in its
        bucket): drops the gradients other replicas reduced; with ``release`` (ZeRO-2), moves this
        replica's runs to gradients of their own and gives the buckets' memory back (until the
        reduction's next step resizes them)."""
        kept = self.owned(replica, params)
        for p, mine in zip(params, kept):
            if not mine:
                p.grad = None
        if not release:
            return
        for flat, members, ranges in zip(flats, self.layout, self.ranges):
            if ranges is None:
                continue  # all-reduced (tied parameters): every replica keeps the whole bucket
            start, end = ranges[replica]
            own = flat[start:end].clone()
            for i in members:
                if kept[i]:
                    offset = views[i].storage_offset() - flat.storage_offset() - start
                    params[i].grad = own[offset:offset + views[i].numel()].view_as(views[i])
            flat.untyped_storage().resize_(0)


def plan_gradient_shards(params: Sequence[torch.Tensor], bucket_bytes: int, replicas: int,
                         replicated: Container[int] = ()) -> GradientShards:
    """The buckets of ``params`` (reduction order) and each replica's runs of them.

    ``replicated``: ``id``s of parameters every replica must keep whole (tied across
    pipeline ranks): they go in buckets of their own, all-reduced. Every replica computes
    the same plan from the same parameters. A parameter goes to the run its middle
    element falls in (so runs are contiguous and as even as whole parameters allow), and
    a bucket's runs go to the replicas largest first, each to the replica with the fewest
    elements so far (the lowest index on a tie), so that the replicas' shards stay even
    across buckets: a parameter larger than a bucket is a bucket, and a run, of its own.
    """
    kinds = [(p.dtype, id(p) in replicated) for p in params]
    layout = _layout(params, bucket_bytes, kinds)
    ranges: list[list[tuple[int, int]] | None] = []
    owners: dict[int, int] = {}
    load = [0] * replicas  # elements each replica steps so far
    for members in layout:
        total = sum(params[i].numel() for i in members)
        runs: list[list[int]] = [[] for _ in range(replicas)]
        offset = 0
        for i in members:
            n = params[i].numel()
            runs[min(replicas - 1, int((offset + n / 2) * replicas // max(total, 1)))].append(i)
            offset += n
        sizes = [sum(params[i].numel() for i in run) for run in runs]
        replica_of = [0] * replicas
        free = list(range(replicas))
        for k in sorted(range(replicas), key=lambda k: (-sizes[k], k)):
            replica_of[k] = min(free, key=lambda r: (load[r], r))
            free.remove(replica_of[k])
            load[replica_of[k]] += sizes[k]
            for i in runs[k]:
                owners[id(params[i])] = replica_of[k]
        if kinds[members[0]][1]:
            ranges.append(None)
            continue
        bounds, start = [], 0
        for size in sizes:
            bounds.append((start, start + size))
            start += size
        by_replica = [(0, 0)] * replicas
        for k, r in enumerate(replica_of):
            by_replica[r] = bounds[k]
        ranges.append(by_replica)
    return GradientShards(layout=layout, ranges=ranges, owners=owners)


def _layout(params: Sequence[torch.Tensor], bucket_bytes: int, kinds: Sequence[object]) -> list[list[int]]:
    """Parameters packed in order into buckets of at most ``bucket_bytes``, one kind a bucket (as
    :func:`stages.comm.parallel.bucket_layout`, whose kind is the dtype)."""
    buckets: list[list[int]] = []
    size = 0
    for index, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > bucket_bytes or kinds[index] != kinds[buckets[-1][0]]:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += nbytes
    return buckets


def _settings(group: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter group's settings: all but its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


class ShardedOptimizer(torch.optim.Optimizer):
    """An optimizer over every held parameter that keeps state for, and steps, one shard of them.

    Its ``param_groups`` hold every parameter (so ``zero_grad``, learning-rate schedules
    and gradient clipping see the whole stage), and its ``state`` is the inner
    optimizer's: this replica's shard alone. The inner optimizer has a group for each
    of the outer ones, each with this replica's share of that group's parameters (an
    empty share too, so the groups stay paired). :meth:`step` hands each group's
    settings to its inner group, steps it, then broadcasts every shard from its owner.

    Args:
        params: the stage's parameters, each once, in the same order on every replica; or
            parameter groups (dicts with ``"params"`` and their own settings), as a torch
            optimizer takes them.
        optimizer_cls, kwargs: the optimizer each replica runs on its shard.
        shard: this replica's index among ``ranks``.
        ranks: the global ranks of the data-parallel replicas, by shard index (the
            broadcasts' sources).
        group: returns the data-parallel process group now (a recovery forms it again).
        bucket_bytes: the most bytes one broadcast of small parameters carries, packed flat
            (a parameter of ``IN_PLACE_BYTES`` or more goes alone, in place).
        owners: ``id(param)`` -> the shard that steps it, as the reduce-scatter left the
            gradients (:class:`GradientShards`); None: :func:`partition` by element counts.
    """

    def __init__(
        self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: Callable[..., torch.optim.Optimizer], kwargs: Mapping[str, Any], *,
        shard: int, ranks: Sequence[int], group: Callable[[], Any], bucket_bytes: int,
        owners: Mapping[int, int] | None = None,
    ) -> None:
        given: list[Any] = list(params)
        group_specs: list[dict[str, Any]] = given if given and isinstance(given[0], dict) else [{"params": given}]
        params = [p for group in group_specs for p in group["params"]]
        if not 0 <= shard < len(ranks):
            raise ValueError(f"shard {shard} is not one of {len(ranks)} replicas")
        self.shard = shard
        self._ranks = list(ranks)
        self._group = group
        self._bucket_bytes = bucket_bytes
        by_id = owners if owners is not None else dict(zip(map(id, params), partition([p.numel() for p in params], len(ranks))))
        owner_of = [by_id.get(id(p), 0) for p in params]
        self._shards = [[p for p, owner in zip(params, owner_of) if owner == s] for s in range(len(ranks))]
        self._owned = {id(p) for p in self._shards[shard]}
        # Groups of dicts, so that a replica whose share of a group (or of all) is empty still gets it.
        self.inner = optimizer_cls([{**group, "params": [p for p in group["params"] if id(p) in self._owned]}
                                    for group in group_specs], **dict(kwargs))
        self._building = True
        super().__init__([{**_settings(inner), "params": list(group["params"])}
                          for inner, group in zip(self.inner.param_groups, group_specs)], self.inner.defaults)
        self._building = False
        self.state = self.inner.state  # type: ignore[assignment]  # one dict: snapshots and checkpoints see the shard
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # one flat bucket's room

    def owns(self, param: torch.Tensor) -> bool:
        """Whether this replica keeps ``param``'s optimizer state and computes its update."""
        return id(param) in self._owned

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise NotImplementedError("a ZeRO-sharded optimizer takes its parameters when it is built")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Steps this replica's shard, then makes every replica's parameters the owners' (collective)."""
        self._hand_settings_in()  # a learning-rate schedule sets the outer groups
        loss = self.inner.step(closure)  # type: ignore[func-returns-value]
        self._broadcast()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads an optimizer state dict (sharded or whole); keeps the state of this replica's shard."""
        super().load_state_dict(state_dict)
        whole, self.state = self.state, self.inner.state  # type: ignore[assignment]
        self.inner.state.clear()
        self.inner.state.update({p: s for p, s in whole.items() if self.owns(p)})
        self._hand_settings_in()

    def _hand_settings_in(self) -> None:
        """Each outer group's settings (learning rate, weight decay...) into its inner group."""
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update(_settings(outer))

    def _broadcast(self) -> None:
        """Every shard's parameters from its owner: large ones in place, small ones packed in flat buckets."""
        group = self._group()
        for shard, params in enumerate(self._shards):
            src, mine = self._ranks[shard], shard == self.shard
            for bucket in _buckets(params, self._bucket_bytes):
                if len(bucket) == 1 and bucket[0].is_contiguous():
                    dist.broadcast(bucket[0].detach(), src=src, group=group)
                    continue
                flat = self._flat(bucket)
                if mine:
                    torch.cat([p.detach().reshape(-1) for p in bucket], out=flat)
                dist.broadcast(flat, src=src, group=group)
                if not mine:
                    offset = 0
                    for p in bucket:
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()

    def _flat(self, bucket: list[torch.Tensor]) -> torch.Tensor:
        """Room for ``bucket`` flat, in one buffer kept across steps (grown when a bucket needs more)."""
        numel = sum(p.numel() for p in bucket)
        like = bucket[0]
        scratch = self._scratch.get((like.dtype, like.device))
        if scratch is None or scratch.numel() < numel:
            scratch = self._scratch[(like.dtype, like.device)] = like.new_empty(numel)
        return scratch[:numel]


def _buckets(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """``params`` in order: each of ``IN_PLACE_BYTES`` or more alone, the rest packed into runs of one
    dtype and device of at most ``bucket_bytes``."""
    buckets: list[list[torch.Tensor]] = []
    small: list[torch.Tensor] = []  # the open bucket of small parameters
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if nbytes >= IN_PLACE_BYTES:
            buckets.append([p])
            continue
        if small and (size + nbytes > bucket_bytes or (p.dtype, p.device) != (small[0].dtype, small[0].device)):
            small = []
        if not small:
            buckets.append(small)
            size = 0
        small.append(p)
        size += nbytes
    return buckets


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the tensors in ``optimizer``'s state (a sharded optimizer: its shard's)."""
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor))


def parameter_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the parameters ``optimizer`` steps (a sharded optimizer: all of them), each once."""
    params = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    return sum(p.numel() * p.element_size() for p in params.values())


def gradient_bytes(params: Iterable[torch.Tensor], buckets: Iterable[torch.Tensor] = ()) -> int:
    """The bytes of gradient memory held: the storages of ``params``' gradients and the reduction's
    ``buckets`` (each storage once; a bucket given back holds none)."""
    storages: dict[int, int] = {}
    for tensor in [p.grad for p in params if p.grad is not None] + list(buckets):
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def check_snapshot(optimizer: torch.optim.Optimizer, snapshot: Mapping[str, torch.Tensor]) -> None:
    """Refuses a snapshot (:mod:`stages.state.snapshots`) with optimizer state of parameters another shard owns.

    Raises:
        ValueError: the snapshot came from another data-parallel replica of a sharded
            optimizer (its state is that replica's shard, not this one's).
    """
    if not isinstance(optimizer, ShardedOptimizer):
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for key in snapshot:
        kind, _, rest = key.partition("/")
        index = rest.partition("/")[0]
        if kind not in ("optim", "optimpy") or not index.isdigit() or int(index) >= len(params):
            continue  # not optimizer state, or not this stage's at all (left to snapshots.restore)
        if not optimizer.owns(params[int(index)]):
            raise ValueError(f"the snapshot holds optimizer state ({key}) of a parameter ZeRO shard "
                             f"{optimizer.shard} does not own: it is another data-parallel replica's")
