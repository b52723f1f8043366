"""Data-parallel gradient averaging overlapped with backward, as DDP does it.

After the barrier, :func:`stages.comm.parallel.average_gradients` copies every gradient
into flat buckets, all-reduces them and copies them back. Here the gradients live in
those buckets instead: each ``p.grad`` is a view of its bucket (no copy in or out),
and a bucket's all-reduce (``async_op``) starts as soon as its last gradient is final,
while backward goes on with the next layers; the division by the number of replicas
follows on the collective's thread as each completes. The barrier (``reduce_step``)
then only waits for what is still on the wire. Same buckets, same all-reduce, same
division: the same bits as after the barrier.

**When is a gradient final?** The program says which action last touches each
parameter: the last ``B``, ``I`` or ``W`` of its model stage that writes it (a ``B``
writes every parameter; with fused linears an ``I`` writes the autograd ones and a
``W`` the fused ones; without, a ``W`` writes them all; with W batching a run of
``W`` actions writes at its last). During that action each write is counted
(autograd's post-accumulate-grad hooks; the fused linears'
:attr:`~stages.compute.wgrad.WeightGradients.on_write`), and the gradient is final at its
last expected write: autograd accumulates a leaf once per backward, a fused linear
writes once per use in the micro-batch's forward (counted there), a batched ``W``
once per GEMM group. A parameter whose writes cannot be counted so (held by two
model stages, written both ways, or written fewer times than expected) is final when
its last action ends. Buckets start in index order, so every replica issues the same
collectives in the same order.

Every bucket's local gradients are checked for NaN and infinity before they go on
the wire, so a non-finite value is blamed on the replica it came from, as the check
before the barrier's reduction does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import nn

from stages.compute import wgrad as _wgrad
from stages.comm.parallel import bucket_layout
from stages.comm.zero import GradientShards
from stages.program import Action, ActionKind

__all__ = ["OverlappedReduction", "ReductionPlan", "backward_order", "plan_reduction"]

log = logging.getLogger(__name__)

Source = tuple[int, Literal["autograd", "fused"]]  # (model stage, how its gradient is written there)


class Work(Protocol):
    """A collective in flight (``torch.distributed``'s ``Work``)."""

    def wait(self) -> Any: ...


Reduce = Callable[[torch.Tensor], Work]  # starts averaging one flat bucket over the replicas, in place
# ZeRO: starts averaging one flat bucket into this replica's range of it (the replicas' ranges given).
Scatter = Callable[[torch.Tensor, Sequence[tuple[int, int]]], Work]


def backward_order(modules: Mapping[int, nn.Module]) -> list[torch.Tensor]:
    """The held parameters that train, each once, in the order backward finishes them: the last
    model stage first, and each stage's parameters last layer first (DDP's reverse of forward order).

    A parameter two held stages share comes where the earlier stage's backward, the last
    to touch it, puts it. A frozen one (``requires_grad=False``) is no part of any reduction,
    as in DDP: its gradient stays None, so the optimizer leaves it (weight decay included).
    """
    forward = {id(p): p for s in sorted(modules) for p in modules[s].parameters() if p.requires_grad}
    return list(reversed(forward.values()))


# An armed parameter: (index, how its gradient is written, the forward (stage, micro-batch) whose
# fused-linear uses bound its writes; None: one write, or one per GEMM group of a batched W).
Armed = tuple[int, Literal["autograd", "fused"], tuple[int, int] | None]


@dataclass(frozen=True, slots=True)
class ReductionPlan:
    """For one program: which writes to count in which action, and when gradients are final.

    Attributes:
        armed: per action, the parameters whose last write it makes, and how to count it.
        settled: per action, the parameters (by index) final once it ends.
        untouched: parameters no action writes (frozen ones): final from the start.
        counted: the forwards (stage, micro-batch) whose fused-linear uses an armed action needs.
    """

    armed: Mapping[Action, tuple[Armed, ...]]
    settled: Mapping[Action, tuple[int, ...]]
    untouched: tuple[int, ...]
    counted: frozenset[tuple[int, int]]


def _writes(kind: ActionKind, how: str, fused: bool) -> bool:
    """Whether an action of ``kind`` writes the gradients of parameters written ``how``."""
    if kind is ActionKind.B:
        return True
    if how == "fused":
        return kind is ActionKind.W
    # Autograd's: with fused linears I runs the whole backward but their GEMMs; without, I
    # computes the input gradient alone and W walks the graph again for every parameter.
    return kind is (ActionKind.I if fused else ActionKind.W)


def _write_points(program: Sequence[Action], batched_w: bool) -> list[int]:
    """Per action, the index of the action its writes happen in: its own, or with W batching a
    W's run's last (the executor runs a run of consecutive Ws' GEMMs together there)."""
    at = list(range(len(program)))
    if batched_w:
        for k in reversed(range(len(program) - 1)):
            if program[k].kind is ActionKind.W and program[k + 1].kind is ActionKind.W:
                at[k] = at[k + 1]
    return at


def plan_reduction(program: Sequence[Action], sources: Sequence[frozenset[Source]], fused: bool,
                   batched_w: bool = False) -> ReductionPlan:
    """When each parameter's gradient is final in ``program`` (a pure function of the program).

    Args:
        sources: per parameter, the (model stage, how) pairs that write its gradient;
            empty for a parameter that takes none.
        fused: the stage's ``nn.Linear`` weight gradients are fused (``stages.compute.wgrad``).
        batched_w: W batching (``StageModel.w_batching``): a run of Ws writes at its end.
    """
    at = _write_points(program, batched_w)
    last: dict[Source, int] = {}
    for index, action in enumerate(program):
        for how in ("autograd", "fused"):
            if _writes(action.kind, how, fused):
                key: Source = (action.stage, how)  # type: ignore[assignment]
                last[key] = max(last.get(key, -1), at[index])
    armed: dict[Action, list[Armed]] = {}
    settled: dict[Action, list[int]] = {}
    untouched = []
    counted = set()
    for param, writers in enumerate(sources):
        indices = [last[w] for w in writers if w in last]
        if not indices:
            untouched.append(param)
            continue
        final = program[max(indices)]
        settled.setdefault(final, []).append(param)
        if len(writers) != 1:
            continue  # written more than one way: final when its last action ends
        ((stage, how),) = writers
        forward = None
        if how == "fused" and not (batched_w and final.kind is ActionKind.W):
            assert final.microbatch is not None and final.stage == stage
            forward = (stage, final.microbatch)
            counted.add(forward)
        armed.setdefault(final, []).append((param, how, forward))
    return ReductionPlan(armed={a: tuple(v) for a, v in armed.items()},
                         settled={a: tuple(v) for a, v in settled.items()},
                         untouched=tuple(untouched), counted=frozenset(counted))


class LateGradientWrite(RuntimeError):
    """A gradient changed after its bucket's all-reduce had started."""


def _flat_buckets(params: Sequence[torch.Tensor], layout: Sequence[Sequence[int]]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Zeroed flat buckets for ``layout`` (each a list of indices into ``params``), each parameter's
    view of its bucket, shaped as the parameter, and each parameter's bucket."""
    flats = [torch.zeros(sum(params[i].numel() for i in members), dtype=params[members[0]].dtype,
                         device=params[members[0]].device) for members in layout]
    views: list[torch.Tensor] = [torch.empty(0)] * len(params)
    bucket = [0] * len(params)
    for b, members in enumerate(layout):
        offset = 0
        for i in members:
            n = params[i].numel()
            views[i] = flats[b][offset:offset + n].view_as(params[i])
            bucket[i] = b
            offset += n
    return flats, views, bucket


class OverlappedReduction:
    """One stage actor's gradients in flat buckets, each all-reduced as soon as it is final.

    Per step: :meth:`begin` (gradients become views of zeroed buckets), then the
    executor wraps each forward in :meth:`forward` and each backward action in
    :meth:`action`; at the barrier :meth:`finish` waits and averages. A step that is
    abandoned (:meth:`abandon`) still starts every bucket, so that every replica has
    issued the same collectives when the next step begins.

    Args:
        params: the parameters to average, each once, in bucket order (:func:`backward_order`).
        modules: the held model stages' modules, by model stage.
        names: each parameter's names (``id(param) -> names``), for non-finite findings.
        bucket_bytes: the most bytes one bucket holds (one larger parameter is alone).
        reduce: starts averaging a flat bucket in place over the replicas: a sum all-reduce,
            then the division by their number (:func:`stages.comm.parallel.start_average`).
        weight_grads: the stage's fused linears, if any: they report their writes here.
        w_batching: the executor runs a run of consecutive Ws' GEMMs together, at its last.
        check_finite: look for NaN and infinity in each bucket before it leaves (a stage
            always does; off, a benchmark times the reduction alone).
        shards: ZeRO's plan: its buckets replace :func:`bucket_layout`'s, each one with
            ranges is reduce-scattered by ``scatter`` (its flat gradient and the replicas'
            ranges), and at :meth:`finish` the gradients of other replicas' runs become None.
        replica: this replica's index (with ``shards``).
        release: with ``shards`` (ZeRO-2): at :meth:`finish` a replica's own runs move to
            gradients of their own and the buckets' memory is given back until the next
            :meth:`begin`, so that between steps a replica holds only its shard of gradients.
    """

    def __init__(self, params: Sequence[torch.Tensor], modules: Mapping[int, nn.Module],
                 names: Mapping[int, Sequence[str]], *, bucket_bytes: int, reduce: Reduce,
                 weight_grads: _wgrad.WeightGradients | None = None, w_batching: bool = False,
                 check_finite: bool = True, shards: GradientShards | None = None,
                 scatter: Scatter | None = None, replica: int = 0, release: bool = False) -> None:
        self.params = list(params)
        self._check_finite = check_finite
        self._names = [list(names.get(id(p), [])) for p in self.params]
        self._reduce = reduce
        self._weight_grads = weight_grads
        if shards is not None and scatter is None:
            raise ValueError("a reduction with ZeRO's shards needs scatter")
        self._shards, self._scatter, self._release = shards, scatter, release and shards is not None
        self._replica = replica
        self.layout = bucket_layout(self.params, bucket_bytes) if shards is None else shards.layout
        self.flats, self._views, self._bucket = _flat_buckets(self.params, self.layout)
        index = {id(p): i for i, p in enumerate(self.params)}
        self._index = index
        self._sources = _sources(self.params, modules, index, fused=weight_grads)
        self._w_batching = w_batching
        # Per parameter, the GEMMs a batched W runs into its gradient: one per (weight, bias) pair holding it.
        self._gemm_groups = [0] * len(index) if weight_grads is None else \
            _fused_groups(self.params, modules, index, weight_grads)
        self._plans: dict[tuple[tuple[Action, ...], bool], ReductionPlan] = {}
        self._unreliable: set[int] = set()  # written after they were thought final: final at the barrier only
        # Per step.
        self.active = False
        self._plan: ReductionPlan | None = None
        self._ready = [False] * len(self.params)
        self._waiting = [0] * len(self.layout)  # per bucket, parameters not final yet
        self._works: list[Work] = []  # of the buckets started, in index order
        self._extremes: list[torch.Tensor] = []  # per started bucket: each parameter's local [min, max]
        self._leftover: list[Work] = []  # an abandoned step's collectives, still on the wire
        self._uses: dict[tuple[int, int], dict[int, int]] = {}
        self._expected: dict[tuple[int, str], int] = {}  # (parameter, how) -> writes still to come in this action
        # Autograd runs a leaf's accumulation (and its post-accumulate hook) even when no gradient
        # came, as for a fused linear's weight: only one whose pre-hook saw a gradient was written.
        self._incoming: set[int] = set()
        # The hooks reach this object weakly and are removed by close(): a strong one would
        # make a cycle through autograd's C++ hook lists (parameter -> hook -> this object ->
        # parameter) that Python's collector cannot see, and with it the process group that
        # ``reduce`` holds (its threads and sockets) would outlive the job.
        coming, accumulated = weakref.WeakMethod(self._gradient_coming), weakref.WeakMethod(self._accumulated)
        self._handles: list[Any] = []
        for i, p in enumerate(self.params):
            if p.requires_grad:
                self._handles.append(p.register_hook(functools.partial(_call_weakly, coming, i)))
                self._handles.append(
                    p.register_post_accumulate_grad_hook(functools.partial(_call_weakly, accumulated, i)))
        if weight_grads is not None:
            weight_grads.on_write = self._fused_write

    @property
    def num_bytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for flat in self.flats)

    # -- one step (everything below runs on the stage's compute thread) ------------------

    def begin(self, program: Sequence[Action], w_batching: bool | None = None) -> None:
        """Starts a step that runs ``program``: overlapping only if it has a ``REDUCE``.

        ``w_batching``: whether the executor batches this step's runs of Ws (None: as built).

        Waits for an abandoned step's collectives first (their buckets are about to be
        zeroed), then makes every gradient a zeroed view of its bucket again:
        ``zero_grad(set_to_none=True)`` after each optimizer step drops the views.
        """
        self._wait_leftover()
        self.active = any(a.kind is ActionKind.REDUCE for a in program)
        if not self.active:
            return
        for flat in self.flats:  # given back by the last finish (ZeRO-2): the views see them again
            if flat.untyped_storage().nbytes() == 0:
                flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        batched = self._w_batching if w_batching is None else w_batching
        key = (tuple(program), batched)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_reduction(key[0], self._sources, self._weight_grads is not None,
                                                     batched)
        self._plan = plan
        for flat in self.flats:
            flat.zero_()
        for p, view in zip(self.params, self._views):
            if p.grad is not view:
                if p.grad is not None:  # something set a gradient of its own: keep its value
                    view.copy_(p.grad)
                p.grad = view
        self._ready = [False] * len(self.params)
        self._waiting = [len(members) for members in self.layout]
        self._works, self._extremes, self._uses, self._expected, self._incoming = [], [], {}, {}, set()
        for i in plan.untouched:
            self._settle(i)

    @contextlib.contextmanager
    def forward(self, stage: int, microbatch: int) -> Iterator[None]:
        """Around the forward of ``(stage, microbatch)``: counts fused-linear uses where the plan needs them."""
        if not self.active or self._weight_grads is None or self._plan is None \
                or (stage, microbatch) not in self._plan.counted:
            yield
            return
        with self._weight_grads.counting_uses() as uses:
            yield
        self._uses[(stage, microbatch)] = uses

    @contextlib.contextmanager
    def action(self, action: Action) -> Iterator[None]:
        """Around a backward action (B, I or W): counts the writes that make gradients final, and
        settles what the action was the last to write once it ends."""
        plan = self._plan
        if not self.active or plan is None:
            yield
            return
        for i, how, forward in plan.armed.get(action, ()):
            if how == "autograd":
                expected = 1  # autograd accumulates a leaf once per backward
            elif forward is None:
                expected = self._gemm_groups[i]
            else:
                expected = self._uses.get(forward, {}).get(id(self.params[i]), 0)
            if expected and i not in self._unreliable and not self._ready[i]:
                self._expected[(i, how)] = expected
        try:
            yield
        finally:
            self._expected.clear()  # fewer writes than expected: the action's end settles them
        for i in plan.settled.get(action, ()):
            self._settle(i)

    def finish(self) -> list[str]:
        """At the barrier: starts the buckets not started yet and waits for every bucket's average.

        Returns:
            The names of the parameters whose local gradient held a NaN or an infinity.
        """
        assert self.active, "finish() without begin() on a program with a REDUCE"
        self._start(len(self.flats))
        for work in self._works:
            work.wait()
        self.active, self._works = False, []  # a work keeps its process group's sockets alive
        found = self._nonfinite()
        if self._shards is not None:
            self._shards.keep_own(self._replica, self.params, self.flats, self._views, release=self._release)
        return found

    def abandon(self) -> None:
        """The step failed or was aborted: starts the buckets not started yet (every replica
        then has issued the same collectives) and lets them finish in the background."""
        if self.active:
            self.active = False
            try:
                self._start(len(self.flats))
            except Exception as exc:  # the group is broken (a member is lost): recovery forms a new one
                log.warning("could not start the abandoned step's remaining buckets: %s", exc)
            self._leftover, self._works = self._leftover + self._works, []
        self._expected.clear()

    def forget(self) -> None:
        """Drops an abandoned step's collectives unwaited: their process group is being replaced."""
        self._leftover = []
        self.active = False

    def close(self) -> None:
        """The job is over: removes the hooks and drops the buckets and the way to reduce them
        (which holds the process group), whatever still refers to this object."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._weight_grads is not None and self._weight_grads.on_write == self._fused_write:
            self._weight_grads.on_write = None
        self._weight_grads = None
        self._reduce = _closed
        self._works, self._leftover, self.active = [], [], False
        self.flats, self._views, self.params = [], [], []

    # -- internals -------------------------------------------------------------------

    def _gradient_coming(self, index: int, grad: torch.Tensor | None) -> None:
        if grad is not None and self.active:
            self._incoming.add(index)

    def _accumulated(self, index: int, _: torch.Tensor) -> None:
        if index in self._incoming:
            self._incoming.discard(index)
            self._written(index, "autograd")

    def _fused_write(self, param: torch.Tensor) -> None:
        index = self._index.get(id(param))
        if index is not None:
            self._written(index, "fused")

    def _written(self, index: int, how: str) -> None:
        """A write to parameter ``index``'s gradient (autograd's hook, or a fused linear)."""
        if not self.active:
            return
        if self._ready[index]:
            self._late(index)
            return
        key = (index, how)
        left = self._expected.get(key)
        if left is None:
            return
        if left > 1:
            self._expected[key] = left - 1
        else:
            del self._expected[key]
            self._settle(index)

    def _late(self, index: int) -> None:
        """A gradient thought final was written again: from now on it is final at the barrier only."""
        self._unreliable.add(index)
        bucket = self._bucket[index]
        if bucket < len(self._works):
            names = " = ".join(self._names[index]) or f"parameter {index}"
            raise LateGradientWrite(
                f"the gradient of {names} changed after its data-parallel all-reduce had started (a backward "
                "wrote it more often than its forward used it: a parameter shared in a way the program does not "
                "show?); this step fails, later steps reduce it after the barrier. overlap_reduce=False reduces "
                "every gradient after the barrier")
        self._ready[index] = False
        self._waiting[bucket] += 1

    def _settle(self, index: int) -> None:
        if self._ready[index] or index in self._unreliable:
            return
        self._ready[index] = True
        bucket = self._bucket[index]
        self._waiting[bucket] -= 1
        if bucket == len(self._works):
            ready = bucket
            while ready < len(self.flats) and self._waiting[ready] == 0:
                ready += 1
            self._start(ready)

    def _start(self, end: int) -> None:
        """Starts every bucket before ``end`` not started yet, in index order, each after its check."""
        for b in range(len(self._works), end):
            grads = [self._views[i] for i in self.layout[b] if self._views[i].numel() and self._check_finite]
            # Each parameter's local extremes, taken before the sum overwrites them; read at the
            # barrier, so that no device waits here (min and max propagate NaN and show infinities).
            self._extremes.append(torch.stack([torch.stack(torch.aminmax(g)) for g in grads]).float() if grads
                                  else torch.zeros(0, 2, device=self.flats[b].device))
            ranges = self._shards.ranges[b] if self._shards is not None else None
            if ranges is None:
                self._works.append(self._reduce(self.flats[b]))
            else:
                assert self._scatter is not None
                self._works.append(self._scatter(self.flats[b], ranges))

    def _nonfinite(self) -> list[str]:
        if not self._extremes or not self._check_finite:
            return []
        # Joined on the device first: one copy to the host (one sync on a GPU) per step, not one per bucket.
        finite = torch.isfinite(torch.cat(self._extremes).cpu()).all(dim=1)
        if bool(finite.all()):
            return []
        checked = [i for b in range(len(self.flats)) for i in self.layout[b] if self._views[i].numel()]
        return [name for i, ok in zip(checked, finite.tolist()) if not ok for name in self._names[i]]

    def _wait_leftover(self) -> None:
        leftover, self._leftover = self._leftover, []
        for work in leftover:
            try:
                work.wait()
            except Exception as exc:  # an abandoned step's sums are dropped anyway
                log.warning("a collective of an abandoned step failed: %s", exc)


def _call_weakly(method: weakref.WeakMethod[Any], index: int, value: torch.Tensor | None) -> None:
    """A parameter hook: passes ``value`` on to the reduction while it lives."""
    hook = method()
    if hook is not None:
        hook(index, value)


def _closed(flat: torch.Tensor) -> Work:
    raise RuntimeError("the overlapped reduction was closed: its job has stopped")


def _sources(params: Sequence[torch.Tensor], modules: Mapping[int, nn.Module], index: Mapping[int, int], *,
             fused: _wgrad.WeightGradients | None) -> list[frozenset[Source]]:
    """Per parameter: the (model stage, how) pairs that write its gradient."""
    found: list[set[Source]] = [set() for _ in params]
    for stage, module in modules.items():
        for sub in module.modules():
            how: Literal["autograd", "fused"] = "fused" if fused is not None and fused.owns(sub) else "autograd"
            for p in sub.parameters(recurse=False):
                if id(p) in index and p.requires_grad:
                    found[index[id(p)]].add((stage, how))
    return [frozenset(s) for s in found]


def _fused_groups(params: Sequence[torch.Tensor], modules: Mapping[int, nn.Module],
                  index: Mapping[int, int], weight_grads: _wgrad.WeightGradients) -> list[int]:
    """Per parameter, how many distinct (weight, bias) pairs of taken-over linears hold it: the
    GEMMs a batched W (:func:`stages.compute.wgrad.apply_batched`) runs into its gradient at most."""
    pairs: list[set[tuple[int, int]]] = [set() for _ in params]
    for module in modules.values():
        for sub in module.modules():
            if weight_grads.owns(sub):
                pair = (id(sub.weight), id(sub.bias))
                for p in (sub.weight, sub.bias):
                    if p is not None and id(p) in index:
                        pairs[index[id(p)]].add(pair)
    return [len(held) for held in pairs]
