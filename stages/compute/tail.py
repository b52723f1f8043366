"""A step's tail on one stage, after the barrier: check, reduce, decide, step.

:class:`StepTail` runs a stage's half of it: :meth:`~StepTail.reduce` checks this
stage's gradients for NaN and infinity (before the average could spread one to every
replica), averages them across the data-parallel replicas, sums the tied parameters'
across pipeline ranks and reports this stage's share of the squared global norm;
:meth:`~StepTail.finish` then unscales and clips the gradients and steps the optimizer
and the learning-rate schedule, or drops the step.

Between the two, one decision holds for every stage of the job: whether the step
applies, the unscale and clip factors, an fp16 overflow. :func:`decide_step` makes it
from the numbers the stages reported and nothing else, so it can run wherever those
numbers meet: in the scheduler today, or on every stage after a small collective.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stages.build import tied
from stages.build.stage import BuiltStage
from stages.comm import zero
from stages.comm.groups import StageGroups
from stages.comm.parallel import average_gradients
from stages.compute.executor import StepExecutor, nonfinite_gradients
from stages.program import Action
from stages.records import FinishReport, ReduceReport, StageConfig
from stages.state.lr_scheduler import learning_rates
from transport.codecs import ErrorFeedback, get_codec

__all__ = ["StepDecision", "StepTail", "check_factor", "checked_norm", "clip_coefficient", "decide_step",
           "FOREACH_NORM_MAX", "norms64", "rescale_gradients", "sharded_squared_norm", "squared_norm"]


# -- the decisions: pure functions of the reported numbers ---------------------------------


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor ``clip_grad_norm_`` multiplies gradients by: ``max_norm / (norm + 1e-6)``, at most 1."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDecision:
    """What every stage of a job does with one step's gradients (the same on all of them)."""

    apply: bool
    """Step the optimizer and the schedule; False drops the step's gradients."""
    unscale: float
    """Divide the gradients by this first (fp16's loss scale, times the token count per replica with
    ``loss_averaging="tokens"``; 1.0 otherwise)."""
    clip: float
    """Then multiply them by this (the global-norm clipping coefficient; 1.0 when off or not needed)."""
    grad_norm: float
    """The global gradient norm, unscaled (inf when a gradient is not finite)."""
    overflow: bool
    """fp16: the gradients overflowed at this scale; the step is skipped and the scale lowered."""


def decide_step(*, nonfinite_loss: bool, nonfinite_gradient: bool, grad_sq: float, loss_scale: float = 1.0,
                fp16: bool = False, scale_at_floor: bool = False, max_norm: float = 0.0,
                divisor: float = 1.0) -> StepDecision:
    """One step's decision, from what every stage reported.

    Args:
        nonfinite_loss: some micro-batch's loss on some stage is NaN or infinite.
        nonfinite_gradient: some stage found a NaN or infinity in a gradient.
        grad_sq: the squared global norm: the sum of the :class:`~stages.records.ReduceReport`
            ``grad_sq`` shares of data-parallel replica 0.
        loss_scale: the scale the step's losses were multiplied by (fp16).
        fp16: the job scales its losses; a gradient that is not finite while every loss is
            then an overflow, not an error.
        scale_at_floor: a dynamic scale already at its lowest: there an overflow is a real
            non-finite value.
        max_norm: ``gradient_clipping``; 0 is off.
        divisor: what the gradients are divided by beyond the loss scale (``loss_averaging="tokens"``:
            the step's counted tokens per replica; see :mod:`stages.compute.averaging`).
    """
    found = nonfinite_loss or nonfinite_gradient
    unscale = loss_scale * divisor
    grad_norm = math.sqrt(grad_sq) / unscale if math.isfinite(grad_sq) else float("inf")
    overflow = fp16 and found and not nonfinite_loss and not scale_at_floor
    return StepDecision(apply=not found, unscale=unscale, clip=clip_coefficient(grad_norm, max_norm),
                        grad_norm=grad_norm, overflow=overflow)


def check_factor(name: str, value: object) -> float:
    """``value`` as a float, or ValueError unless it is a finite number > 0 (an unscale or clip factor)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r:.40}")
    return float(value)


# -- the gradients --------------------------------------------------------------------------


def squared_norm(params: Sequence[torch.Tensor]) -> float:
    """The sum of the squares of these parameters' gradients, in float64 (inf or nan when one is).

    The norms are computed on the device and read in one sync (not one per parameter);
    the squares are summed on the host, in order, as a float64 scalar would.
    """
    norms = norms64([p.grad.detach() for p in params if p.grad is not None])
    return _added_in_order((torch.stack(norms).cpu() ** 2).tolist()) if norms else 0.0


def _added_in_order(values: list[float]) -> float:
    """``values`` added one after the other from 0.0, as a float64 accumulator would: not ``sum``, which
    from Python 3.12 compensates its rounding, nor ``math.fsum`` (a sharded and an unsharded job must
    add alike wherever they run)."""
    total = 0.0
    for value in values:
        total += value
    return total


# A CPU gradient's float64 norm is taken over its values copied, a chunk at a time, into a
# float64 buffer each computing thread keeps. vector_norm(dtype=float64) first copies the whole
# gradient into fresh float64 memory: on a stage of 8.4M parameters the page faults of those
# copies made the tail's norm 4 to 31 ms a step, the norm itself being 4; and the copy of a
# stage's largest gradient was part of its peak memory (Adam's, in benchmarks.memory). Up to
# this many values a gradient's norm is the one vector_norm gives, to the bit; a longer one's
# combines its chunks' norms. 2 MiB a thread; a million values a chunk ran 5% faster and held 8.
NORM_CHUNK = 1 << 18
_kept = threading.local()


def norm64(grad: torch.Tensor) -> torch.Tensor:
    """``grad``'s 2-norm in float64, as a scalar tensor on its device (see :data:`NORM_CHUNK`)."""
    if grad.device.type != "cpu" or grad.dtype == torch.float64:  # no copy to fresh host memory
        return torch.linalg.vector_norm(grad, dtype=torch.float64)
    flat = grad.reshape(-1)
    parts = []
    for start in range(0, max(flat.numel(), 1), NORM_CHUNK):
        piece = flat[start:start + NORM_CHUNK]
        held = _float64_buffer(piece.numel())
        held.copy_(piece)
        parts.append(torch.linalg.vector_norm(held))
    return parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts))


# Up to this many values a CPU gradient's float64 norm is taken with the others' in one call (see norms64):
# the float64 copy vector_norm makes of it is 32 KiB at most, below malloc's threshold for fresh pages.
FOREACH_NORM_MAX = 1 << 12


def norms64(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`norm64` of each of ``grads``, in order: the contiguous CPU gradients of at most
    :data:`FOREACH_NORM_MAX` values by one ``_foreach_norm`` for all of them (one call into torch
    instead of four a gradient: on a stage of small layers the tail's norms took 80 us a step,
    35 so), every other as norm64 does.

    On the CPU ``_foreach_norm`` takes each tensor's ``vector_norm(dtype=float64)`` in turn, so
    every norm is norm64's to the bit (tested); it sums a strided tensor in its memory's order, which
    norm64, reading it in order, would not, so a gradient that is not contiguous goes apart.
    """
    small = [i for i, g in enumerate(grads)
             if g.device.type == "cpu" and g.dtype != torch.float64 and g.numel() <= FOREACH_NORM_MAX
             and g.is_contiguous()]
    fused = dict(zip(small, torch._foreach_norm([grads[i] for i in small], 2, dtype=torch.float64))) if small else {}
    return [fused[i] if i in fused else norm64(grad) for i, grad in enumerate(grads)]


def _float64_buffer(numel: int) -> torch.Tensor:
    """``numel`` float64 values of this thread's buffer, grown to the longest asked for."""
    buffer: torch.Tensor | None = getattr(_kept, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = _kept.buffer = torch.empty(numel, dtype=torch.float64)
    return buffer[:numel]


def checked_norm(named: Sequence[tuple[str, torch.Tensor]], norm_params: Sequence[torch.Tensor]
                 ) -> tuple[list[str], float]:
    """:func:`~stages.compute.executor.nonfinite_gradients` and :func:`squared_norm` in one pass over
    the gradients, for a stage whose gradients nothing changes between the two (no reduction, no tied sum).

    Each gradient's float64 norm is finite exactly when every value in it is (NaN and infinity
    carry through; a float32 or narrower value cannot overflow a float64 sum of squares), so a
    finite set of norms is the check passed, read in the one sync the norm needs. Only when one
    is not finite does the exact check run, to name the parameters (a float64 gradient can overflow
    its norm and still be finite). The squared norm is :func:`squared_norm`'s, to the bit.
    """
    grads = {id(p): p.grad for _, p in named if p.grad is not None}  # norm_params are some of named's
    if not grads:
        return [], 0.0
    norms = dict(zip(grads, torch.stack(norms64([g.detach() for g in grads.values()])).tolist()))
    found = [] if all(map(math.isfinite, norms.values())) else nonfinite_gradients(named)
    total = 0.0
    for p in norm_params:
        if p.grad is not None:
            norm = norms[id(p)]
            total += norm * norm  # one rounding, as squared_norm's float64 square on the device
    return found, total


@torch.no_grad()
def rescale_gradients(params: Sequence[torch.Tensor], unscale: float, clip: float) -> None:
    """Divides the gradients by ``unscale``, then multiplies them by ``clip`` (``GradScaler.unscale_``,
    then ``clip_grad_norm_``)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and unscale != 1.0:
        torch._foreach_mul_(grads, 1.0 / unscale)
    if grads and clip != 1.0:
        torch._foreach_mul_(grads, clip)


def sharded_squared_norm(params: Sequence[torch.Tensor], shards: zero.GradientShards, replica: int,
                         group: Any) -> float:
    """:func:`squared_norm` of ``params``' whole gradients, over data-parallel replicas that each keep
    some of them (ZeRO's gradient shards), to the bit.

    Each parameter's float64 square comes from the one replica that steps it (``shards.owners``;
    a parameter every replica keeps whole, tied across pipeline ranks, from its owner alone, not
    once per replica): a vector of one square per parameter, zero elsewhere, summed over the
    replicas (a sum of one value and zeros, exact in any order). Every replica then adds the
    squares in the parameters' order, as squared_norm does on one replica holding them all: adding
    each replica's own sum instead regroups the additions, and the norm, its clip factor and so
    every parameter after a clipped step came out an ulp away from the unsharded job's.
    """
    squares = torch.zeros(len(params), dtype=torch.float64)
    mine = [(i, p.grad.detach()) for i, p in enumerate(params)
            if p.grad is not None and shards.owners.get(id(p), 0) == replica]
    if mine:
        squares[[i for i, _ in mine]] = torch.stack(norms64([grad for _, grad in mine])).cpu() ** 2
    dist.all_reduce(squares, group=group)
    return _added_in_order(squares.tolist())


class StepTail:
    """One stage's tail of every step: :meth:`reduce` after the barrier, :meth:`finish` once decided.

    Args:
        config: the stage's config (its reduce codec and bucket size).
        built: the stage's parts.
        executor: runs the compute, and the program's REDUCE and STEP.
        groups: the job's process groups (None without ``config.dist``).
        send_tied: sends this rank's gradient of a tied parameter to another pipeline rank.
        on_drop: called when a step is dropped (the boundaries' error feedback forgets its residuals).
    """

    def __init__(self, config: StageConfig, built: BuiltStage, executor: StepExecutor, groups: StageGroups | None,
                 send_tied: tied.Send, on_drop: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.built = built
        self.executor = executor
        self.groups = groups
        self.send_tied = send_tied
        self.on_drop = on_drop
        codec = config.communication.reduce_codec
        self.reduce_feedback = ErrorFeedback(codec) if get_codec(codec).lossy else None
        self._reduced_bytes = 0
        self._nonfinite_overlapped: list[str] = []  # the overlapped reduction's findings (local gradients)
        self.gradient_bytes = 0  # gradient memory held when the last optimizer step began
        self.applied = False  # the last finish stepped (False: it dropped the step)
        # The stage's parameters, each once: its layers hold the same ones from build to stop.
        self._params = list({id(p): p for m in executor.model.modules.values() for p in m.parameters()}.values())

    async def reduce(self, step: int, program: Sequence[Action]) -> ReduceReport:
        """Checks this stage's gradients, then reduces them across replicas and tied ranks; applies nothing.

        The check comes first so that a NaN is blamed on the replica it came from (the
        average would spread it to all); the reduction runs regardless, as every replica
        must take part in it.
        """
        executor, built = self.executor, self.built
        self._reduced_bytes = 0
        named = built.named_parameters
        overlapped = built.overlap is not None and built.overlap.active
        if not overlapped and not self._changes_gradients():
            found, grad_sq = await executor.compute_local("check_norm", checked_norm, named, built.norm_params)
            return ReduceReport(reduced_bytes=0, nonfinite=found, grad_sq=grad_sq, wait_s=0.0, tied=[])
        # Overlapped, each bucket was checked before it went on the wire (see stages.comm.overlap).
        found = [] if overlapped else await executor.compute_local("check", nonfinite_gradients, named)
        started = time.perf_counter()
        await executor.reduce(program, self._reduce)
        wait_s = time.perf_counter() - started
        if overlapped:
            bad = set(self._nonfinite_overlapped)
            found = [name for name, _ in named if name in bad]
        await built.tied.sum(step, self.send_tied)
        if not found and self.reduce_feedback is not None and self._reduced_bytes:
            # A lossy reduce codec can overflow (fp16 past 65504) where the raw gradients did not.
            reduced = await executor.compute_local("check", nonfinite_gradients, named)
            found = [f"{name} (after the data-parallel reduction)" for name in reduced]
        if built.gradient_shards is not None and self.groups is not None and self.groups.groups is not None:
            # Each replica holds its runs' gradients only: their squares meet on every replica.
            replica = self.config.mesh.coords(self.config.global_rank).data
            grad_sq = await executor.compute(sharded_squared_norm, built.norm_params, built.gradient_shards, replica,
                                             self.groups.data_group())
        else:
            grad_sq = await executor.compute_local("norm", squared_norm, built.norm_params)
        return ReduceReport(reduced_bytes=self._reduced_bytes, nonfinite=found, grad_sq=grad_sq, wait_s=wait_s,
                            tied=[built.tied_names(group.names) for group in built.tied.groups])

    def _changes_gradients(self) -> bool:
        """The tail changes this stage's gradients between its check and its norm: a data-parallel
        reduction, a sharded one, or a tied parameter's sum across pipeline ranks."""
        groups = self.groups
        return bool(self.built.tied.groups) or self.built.gradient_shards is not None or (
            groups is not None and groups.groups is not None and groups.data_size > 1)

    async def _reduce(self) -> None:
        """Data-parallel gradient reduction: bucketed all-reduce averages across replicas, started
        during backward (``stages.comm.overlap``) where that serves, else all of it now."""
        overlap, groups = self.built.overlap, self.groups
        if overlap is not None and overlap.active:
            self._nonfinite_overlapped = await self.executor.compute(overlap.finish)
            self._reduced_bytes = overlap.num_bytes
        elif groups is not None and groups.groups is not None and groups.data_size > 1:
            self._reduced_bytes = await self.executor.compute(
                average_gradients, self.built.reduce_params, groups.groups, self.config.communication.bucket_bytes,
                self.reduce_feedback, self.built.gradient_shards)

    async def finish(self, program: Sequence[Action], *, apply: bool, unscale: float = 1.0,
                     clip: float = 1.0) -> FinishReport:
        """Steps the optimizer and the schedule (``apply``), or drops the step's gradients.

        Before the step the gradients are divided by ``unscale``, then multiplied by
        ``clip``, in that order. A dropped step also forgets the error-feedback residuals
        (those of a step with non-finite gradients hold NaN); the schedule does not advance
        on a dropped step (DeepSpeed skips it on an overflow too).

        Raises:
            ValueError: ``unscale`` or ``clip`` not a finite number > 0; nothing changed.
        """
        unscale, clip = check_factor("unscale", unscale), check_factor("clip", clip)
        model = self.executor.model
        if apply and (unscale != 1.0 or clip != 1.0):
            await self.executor.compute_local("rescale", rescale_gradients, self._params, unscale, clip)
        if apply:
            buckets = self.built.overlap.flats if self.built.overlap is not None else []
            self.gradient_bytes = await self.executor.compute_local("gradient_bytes", zero.gradient_bytes,
                                                                    self._params, buckets)
        # A sharded optimizer broadcasts its updated shards: a collective, never inline.
        self.applied = False
        await self.executor.apply(program, step=bool(apply),
                                  local=not isinstance(model.optimizer, zero.ShardedOptimizer))
        self.applied = bool(apply)
        if not apply:
            self.on_drop()
            if self.reduce_feedback is not None:
                self.reduce_feedback = ErrorFeedback(self.config.communication.reduce_codec)
        return FinishReport(lr=learning_rates(model.optimizer))
