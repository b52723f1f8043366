"""A stage actor's forward and backward passes, one micro-batch at a time, and what each holds in between.

:class:`StagePasses` is the compute-thread half of :class:`~stages.compute.executor.StepExecutor`:
F (forward), B (the whole backward), I (the input gradient alone) and W (the weight
gradients I left), with the stash of inputs and outputs a micro-batch keeps from its F
to its B (or W), the values waiting to be sent or used, and the storages each micro-batch
holds (``peak_stash_bytes``). The executor decides when each runs and where; nothing
here awaits, sends or receives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch._functorch import config as _functorch_config
from torch.optim.lr_scheduler import LRScheduler

from stages.comm import boundary
from stages.comm import overlap as _overlap
from stages.comm.boundary import Payload
from stages.comm.device_io import DeviceIO
from stages.compute import activations as _activations
from stages.compute import averaging as _averaging
from stages.compute import inline as _inline
from stages.compute import wgrad as _wgrad
from stages.compute.metrics import metric_values
from stages.program import Action, ActionKind

__all__ = ["StageModel", "StagePasses", "broadcasting_loss", "check_target_shape"]

T = TypeVar("T")
_K = ActionKind
# The kinds whose compute may run inline: the step's own actions (a SEND's compute is its codec's encode).
_INLINE_KINDS = frozenset({_K.F, _K.B, _K.I, _K.W, _K.SEND_F, _K.SEND_B})


@dataclass(slots=True)
class StageModel:
    """What one stage actor computes with: its model stages, loss and optimizer."""

    modules: Mapping[int, nn.Module]  # model stage -> its layers
    num_stages: int  # model stages in the whole pipeline
    loss_fn: Callable[[Any, Any], torch.Tensor]
    optimizer: torch.optim.Optimizer
    device: torch.device
    # Set when the stage's nn.Linear weight gradients are fused (stages.compute.wgrad): then I
    # defers just the weight GEMMs and W runs them, without a second pass over the graph.
    weight_grads: _wgrad.WeightGradients | None = None
    # The job's learning-rate schedule: stepped once per applied optimizer step, never on a dropped one.
    lr_scheduler: LRScheduler | None = None
    # Mixed precision: compute under autocast in this dtype (float32 master weights), and
    # send floating-point boundary values in it. None: float32 throughout.
    compute_dtype: torch.dtype | None = None
    # W batching: a run of consecutive Ws computes each weight's gradient as one GEMM.
    w_batching: bool = False
    # The fast path (stages.compute.inline): an action estimated under this runs on the loop's thread.
    # 0 turns it off: for a stage whose compute waits on other processes (tensor-parallel
    # collectives inside forward and backward), which must never hold up the loop's heartbeats.
    inline_max_s: float = _inline.INLINE_MAX_S
    # The codec (transport.codecs) that holds what a forward saves for backward (stages.compute.activations);
    # "none": as it is, exactly.
    stash_codec: str = "none"
    # loss_averaging="tokens": each loss is a sum over its targets' elements other than ignore_index,
    # which the stages count (stages.compute.averaging); None: "samples", each a mean.
    token_ignore_index: int | None = None
    # evaluation.eval_metrics, on the last stage: (outputs, targets) -> a number or a dict of them, per micro-batch.
    metrics_fn: Callable[[Any, Any], Any] | None = None
    # Whether targets must fit the output (check_target_shape): for torch's losses that broadcast the two without a
    # word (mse_loss); a loss of the user's own takes what it is given (a [B] target for a [B, 2] mean and variance).
    checks_target_shape: bool = True

    def autocast(self) -> Any:
        """The context a forward (and a recompute) runs in."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)


class StagePasses:
    """The passes of one stage actor's micro-batches, and the per-step state between them.

    Args:
        model: the stage's modules, loss and optimizer.
        io: how the batch's tensors reach the model's device.
        overlap: the data-parallel reduction that starts during backward, if there is one;
            each forward and backward reports to it.
    """

    def __init__(self, model: StageModel, io: DeviceIO, overlap: _overlap.OverlappedReduction | None) -> None:
        self.model = model
        self.io = io
        self.overlap = overlap
        # Per-step state; the executor reads these containers (never rebound, except w_batch).
        # (stage, micro-batch) -> (the input leaves that collect gradients, the outputs that need one)
        self.stash: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.pending_w: dict[tuple[int, int], list[_wgrad.PendingWeightGrad]] = {}  # I -> W, fused
        self.values: dict[tuple[str, int, int], Any] = {}  # received trees, and payloads to send
        self.w_batch: list[tuple[tuple[int, int], list[_wgrad.PendingWeightGrad]]] = []
        # (stage, micro-batch) -> the storages it holds for its backward, from F until B (or W).
        self.held: dict[tuple[int, int], _activations.Storages] = {}
        self.upcoming: Action | None = None  # the action after the one running (W batching looks ahead)
        self.step_w_batching: bool | None = None  # this step's, when it differs from the model's (schedule="auto")
        self._pending_grads: dict[tuple[int, int], list[torch.Tensor | None] | None] = {}  # I -> W, plain autograd
        self._resident: _activations.Storages = {}  # what lives anyway: parameters, buffers, the batch
        self._inputs: Sequence[Any] | None = None
        self._targets: Sequence[Any] | None = None
        self._loss_scale = 1.0
        self._num_microbatches = 1
        self._loss_weights: Sequence[float] | None = None  # per micro-batch (None: 1 / micro-batches each)
        # The step's count per micro-batch (samples, or counted tokens), as the device left it.
        self.items: dict[int, torch.Tensor | int] = {}
        # Forward only (job.evaluate): no stash, no graph; the outputs, per micro-batch, when asked for.
        self.evaluating = False
        self.outputs: dict[int, Any] | None = None
        self.metrics: dict[int, dict[str, float]] = {}  # an evaluation's metrics per micro-batch (eval_metrics)

    @property
    def w_batching(self) -> bool:
        """Whether this step runs its runs of consecutive Ws as one GEMM per weight."""
        return self.model.w_batching if self.step_w_batching is None else self.step_w_batching

    def start_step(self, inputs: Sequence[Any] | None, targets: Sequence[Any] | None, *,
                   loss_scale: float, num_microbatches: int, loss_weights: Sequence[float] | None = None,
                   evaluating: bool = False, keep_outputs: bool = False) -> None:
        """Takes the step's batch (stage 0's inputs, the last stage's targets) and its loss scaling
        (``loss_weights``: per micro-batch, see :mod:`stages.compute.averaging`); ``evaluating``:
        forward only, keeping the last stage's outputs if ``keep_outputs``."""
        self._inputs, self._targets = inputs, targets
        self._loss_scale, self._num_microbatches = loss_scale, num_microbatches
        if loss_weights is not None and len(loss_weights) != num_microbatches:
            raise ValueError(f"{len(loss_weights)} loss weights for {num_microbatches} micro-batches")
        self._loss_weights = loss_weights
        self.items = {}
        self.metrics = {}
        self.evaluating, self.outputs = evaluating, {} if keep_outputs else None
        modules = self.model.modules.values()
        self._resident = _activations.storages([*boundary.tree_tensors(inputs), *boundary.tree_tensors(targets),
                                                *(t for m in modules for t in (*m.parameters(), *m.buffers()))])

    def leftover(self) -> list[str]:
        """What the step still holds that its program should have used up (sorted; empty when none)."""
        if not (self.stash or self.values or self.pending_w or self.w_batch):
            return []
        return sorted(map(str, list(self.stash) + list(self.values) + list(self.pending_w)
                          + [key for key, _ in self.w_batch]))

    def inline_key(self, action: Action) -> Hashable | None:
        """What an action's compute is learnt by (None: it never runs inline): its kind and stage;
        a W also by whether it only joins a W batch (near free) or runs the batch's GEMMs."""
        if action.kind not in _INLINE_KINDS:
            return None
        if action.kind is _K.W:
            joins = self.w_batching and (action.stage, action.microbatch) in self.pending_w \
                and self._w_batch_continues()
            return (action.kind, action.stage, joins)
        return (action.kind, action.stage)

    # -- the step's values ---------------------------------------------------------

    def input_of(self, stage: int, mb: int) -> Any:
        if stage == 0:
            if self._inputs is None:
                raise RuntimeError("stage 0 has no inputs for this step")
            return self._to_device(self._inputs[mb])
        return handed_over(self.values.pop(("F", stage - 1, mb)), as_leaves=True)

    def batch_dtype_note(self, stage: int, mb: int) -> str | None:
        """Why the first stage's forward on micro-batch ``mb`` may have failed: its batch carries floating
        tensors of a dtype the stage's parameters are not (float64 inputs to a float32 model: torch says
        only "mixed dtype" or "expected ... Float but found Double"); None otherwise, or for a later stage."""
        if stage != 0 or self._inputs is None:
            return None
        given = {t.dtype for t in boundary.tree_tensors(self._inputs[mb]) if t.is_floating_point()}
        held = {p.dtype for m in self.model.modules.values() for p in m.parameters() if p.is_floating_point()}
        if not given or not held or given <= held:
            return None
        names = {which: sorted(str(d).removeprefix("torch.") for d in dtypes) for which, dtypes in
                 (("given", given), ("held", held))}
        return (f"the batch's floating tensors are {' and '.join(names['given'])} and the first stage's parameters "
                f"{' and '.join(names['held'])}: cast the batch (inputs.to(torch.{names['held'][0]})) or build the "
                "model in that dtype")

    def target_of(self, stage: int, mb: int) -> Any:
        if stage != self.model.num_stages - 1:
            return None
        if self._targets is None:
            raise RuntimeError("the last stage has no targets for this step")
        return self._to_device(self._targets[mb])

    def _to_device(self, tree: Any) -> Any:
        """A micro-batch of the batch on the model's device (through the copy stream on a GPU)."""
        if not self.io.staged:
            return _to_device(tree, self.model.device)
        payload = boundary.pack(tree)
        return boundary.unpack(Payload(self.io.to_device(payload.leaves), payload.spec), self.model.device)

    # -- compute (on the compute thread) --------------------------------------------

    def tracked(self, action: Action, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a backward action, reported to the overlapped reduction."""
        if self.overlap is None:
            return fn(*args)
        with self.overlap.action(action):
            return fn(*args)

    def forward_held(self, stage: int, mb: int, x: Any, target: Any) -> torch.Tensor | None:
        """:meth:`_forward`, noting what the micro-batch now holds for its backward (``peak_stash_bytes``);
        when evaluating, :meth:`_evaluate` instead."""
        if self.evaluating:
            return self._evaluate(stage, mb, x, target)
        counting = self.overlap.forward(stage, mb) if self.overlap is not None else contextlib.nullcontext()
        with _activations.SavedActivations(self._resident, self.model.stash_codec) as saved, counting:
            loss = self._forward(stage, mb, x, target)
        inputs, outs = self.stash[(stage, mb)]
        # With a stash codec, autograd's copies of these are encoded, and backward needs
        # the stash's own only as places in the graph: their values are freed too.
        saved.add(saved.drop_values(inputs + outs))
        self.held[(stage, mb)] = saved.storages
        return loss

    def _loss(self, mb: int, out: Any, target: Any) -> torch.Tensor:
        """Micro-batch ``mb``'s loss (a mean, or a sum under ``tokens``), its count noted in :attr:`items`."""
        if self.model.checks_target_shape:
            check_target_shape(out, target)
        ignore = self.model.token_ignore_index
        if ignore is not None:
            self.items[mb] = _averaging.count_items(target, ignore)
        else:
            self.items[mb] = boundary.batch_size(target) or 1
        return _averaging.loss_of(self.model.loss_fn, out, target, ignore is not None)

    def _evaluate(self, stage: int, mb: int, x: Any, target: Any) -> torch.Tensor | None:
        """Forward only: the output goes on (or, on the last stage, its loss back, the output kept if asked)."""
        module = self.model.modules[stage]
        with torch.no_grad(), self.model.autocast():
            out = boundary.call_module(module, x) if stage == 0 else module(x)
            if target is None:
                if self.model.compute_dtype is not None:
                    out = boundary.cast_floating(out, self.model.compute_dtype)
                self.values[("F", stage, mb)] = boundary.pack(out)
                return None
            if self._loss_weights is not None and not self._loss_weights[mb]:
                # A stand-in in the last batch of a pass over the validation set (data_source.read_once):
                # no sample's, so no loss, count, metric or output of it is reported.
                return None
            loss = self._loss(mb, out, target)
            if self.model.metrics_fn is not None:
                self.metrics[mb] = metric_values(self.model.metrics_fn, out, target)
        if self.outputs is not None:
            self.outputs[mb] = boundary.unpack(boundary.pack(out), torch.device("cpu"))
        return loss

    def _forward(self, stage: int, mb: int, x: Any, target: Any) -> torch.Tensor | None:
        module = self.model.modules[stage]
        with torch.enable_grad():
            with self.model.autocast():
                # Stage 0 takes the batch as the model takes it (tensor, positional tuple or
                # keyword dict); a later stage takes what the one before it returned.
                out = boundary.call_module(module, x) if stage == 0 else module(x)
                if target is not None:
                    loss = self._loss(mb, out, target)
            inputs = boundary.grad_leaves(x) if stage > 0 else []
            if target is None:
                if self.model.compute_dtype is not None:
                    # The boundary travels in the compute dtype (half the bytes); the cast is
                    # part of the graph, so the gradient that comes back meets it.
                    out = boundary.cast_floating(out, self.model.compute_dtype)
                sent = boundary.pack(out)
                self.stash[(stage, mb)] = (inputs, [t for t in boundary.tree_tensors(out) if t.requires_grad])
                self.values[("F", stage, mb)] = sent
                return None
            # The step's loss is the mean over the global batch, as one process computes it on the
            # whole batch; each micro-batch's gradient is weighted to match (stages.compute.averaging):
            # by 1 / micro-batches when they are even, by its samples' share when not, and not at all
            # for a sum (tokens: the tail divides by the count).
            scaled = loss * self._loss_scale if self._loss_scale != 1.0 else loss
            if self.model.token_ignore_index is None:
                weights = self._loss_weights
                scaled = scaled / self._num_microbatches if weights is None else scaled * weights[mb]
            self.stash[(stage, mb)] = (inputs, [scaled])
            return loss.detach()

    def backward(self, stage: int, mb: int, grads: list[torch.Tensor | None] | None,
                 input_only: bool) -> list[torch.Tensor | None] | None:
        """The stage's backward for one micro-batch; returns its inputs' gradients (None on stage 0).

        ``grads`` pairs with the outputs that need a gradient (None: the loss); an output
        the next stage did not use gets None and no backward.
        """
        key = (stage, mb)
        weight_grads = self.model.weight_grads
        if not input_only:
            inputs, outs = self.stash.pop(key)
            del self.held[key]
            _run_backward(outs, grads)
            return None if stage == 0 else [x.grad for x in inputs]
        if weight_grads is not None:
            # I: the whole backward except the linears' weight GEMMs, which wait for W;
            # the graph is released here, W needs only the recorded pairs.
            inputs, outs = self.stash.pop(key)
            with weight_grads.deferring() as pending:
                _run_backward(outs, grads)
            self.pending_w[key] = pending
            # The linears' inputs and output gradients wait for W as saved activations do: with a stash
            # codec, encoded (a decoded input again: a decoded block encodes back to its codes, its scale
            # to within an ulp; one recomputed in a checkpoint for the first time).
            holder = _activations.SavedActivations(self._resident, self.model.stash_codec)
            pending[:] = [(w, b, holder.hold(_activations.restore(g)), holder.hold(_activations.restore(x)))
                          for w, b, g, x in pending]
            self.held[key] = holder.storages
            return None if stage == 0 else [x.grad for x in inputs]
        # I without fused linears: the input gradient alone, which the upstream stage is
        # waiting for; the graph stays alive and W walks it again for the parameters.
        inputs, outs = self.stash[key]
        self._pending_grads[key] = grads
        self.held[key] |= _activations.storages((g for g in grads or () if g is not None), self._resident)
        if stage == 0:
            return None
        pairs = _with_grads(outs, grads)
        if not inputs or not pairs:
            return [None] * len(inputs)
        with _keeping_saved_tensors():
            return list(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs],
                                            retain_graph=True, allow_unused=True))

    def weight_backward(self, stage: int, mb: int) -> None:
        key = (stage, mb)
        if key in self.pending_w and self.w_batching:
            # W batching: consecutive Ws (the tail defer_weight_grads makes) run each weight's
            # GEMM once, over all their micro-batches' rows.
            self.w_batch.append((key, self.pending_w.pop(key)))
            if self._w_batch_continues():
                return
            batch, self.w_batch = self.w_batch, []
            assert self.model.weight_grads is not None
            _wgrad.apply_batched([pending for _, pending in batch], self.model.weight_grads.on_write)
            for done, _ in batch:
                del self.held[done]
            return
        del self.held[key]
        if key in self.pending_w:
            assert self.model.weight_grads is not None
            _wgrad.apply(self.pending_w.pop(key), self.model.weight_grads.on_write)
            return
        _, outs = self.stash.pop(key)
        grads = self._pending_grads.pop(key)
        params = [p for p in self.model.modules[stage].parameters() if p.requires_grad]
        pairs = _with_grads(outs, grads)
        if params and pairs:
            with _keeping_saved_tensors():
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=params)

    def _w_batch_continues(self) -> bool:
        """Whether the W batch takes in the next action too (a W whose weight GEMMs wait)."""
        upcoming = self.upcoming
        return upcoming is not None and upcoming.kind is _K.W and \
            (upcoming.stage, upcoming.microbatch) in self.pending_w

    def clear(self) -> None:
        """Drops a failed or aborted step's stash, values and gradients (an evaluation's values alone)."""
        evaluating, self.evaluating = self.evaluating, False
        if self.overlap is not None and not evaluating:
            self.overlap.abandon()
        self.stash.clear()
        self._pending_grads.clear()
        self.pending_w.clear()
        self.w_batch = []  # a run of batched Ws cut short by the abort
        self.held.clear()
        self.values.clear()
        self.items = {}
        self.outputs = None
        if not evaluating:
            self.model.optimizer.zero_grad(set_to_none=True)


def handed_over(value: Any, *, as_leaves: bool = False) -> Any:
    """A value the stage before (or after) on this rank left packed, as the wire would deliver it: an
    activation's tensors fresh leaves whose ``.grad`` goes back, a gradient plain (a V's turn, where
    two neighbouring stages share a rank). A value that came off the wire is unpacked already."""
    return boundary.unpack(value, as_leaves=as_leaves) if isinstance(value, Payload) else value


def _to_device(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(device, non_blocking=True)
    return boundary.unpack(boundary.pack(tree), device)


def _with_grads(outs: list[torch.Tensor], grads: Sequence[torch.Tensor | None] | None
                ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Outputs paired with their incoming gradients, leaving out those that got none (unused downstream)."""
    if grads is None:  # the loss
        return [(out, None) for out in outs]
    if len(grads) != len(outs):
        raise ValueError(f"{len(grads)} gradients came back for the {len(outs)} outputs that need one")
    return [(out, grad) for out, grad in zip(outs, grads) if grad is not None]


def _keeping_saved_tensors() -> Any:
    """The context of a backward that walks a graph twice (plain autograd's I, then W): a compiled layer's
    backward is compiled without donated buffers (stages.build.compiled), and where shapes are compiled
    symbolically (``dynamic``, or a batch of another size) it is compiled at its first call, here, whose check
    reads this setting; with its default it refused the walk that keeps the graph."""
    return _functorch_config.patch(donated_buffer=False)


def _run_backward(outs: list[torch.Tensor], grads: Sequence[torch.Tensor | None] | None) -> None:
    pairs = _with_grads(outs, grads)
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])  # type: ignore[arg-type]


def broadcasting_loss(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` is one of torch's element-wise losses, which broadcast a target of another shape
    against the output (with a warning at most): the losses :func:`check_target_shape` guards."""
    functional = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss)
    modules = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss)
    return any(loss_fn is f for f in functional) or isinstance(loss_fn, modules) or \
        (isinstance(loss_fn, type) and issubclass(loss_fn, modules))


def check_target_shape(output: torch.Tensor, target: torch.Tensor) -> None:
    """Refuses a target that an element-wise loss would silently broadcast against the output.

    ``mse_loss([4, 8] output, [4, 1] target)`` trains on a 32-element broadcast without a
    word. A target of the output's shape always passes; so does one with fewer dims and
    integer values (class indices: ``[N]`` for ``[N, C]`` logits, ``[B, T]`` for ``[B, T, V]``).
    Refused are a floating-point target of another shape, and any target with the
    output's number of dims but another shape: for those the loss either broadcasts or
    needs a reshape the model should do itself.

    Raises:
        ValueError: names both shapes.
    """
    if not isinstance(output, torch.Tensor) or not isinstance(target, torch.Tensor) or output.shape == target.shape:
        return
    if target.is_floating_point() or target.dim() == output.dim():
        raise ValueError(
            f"targets of shape {tuple(target.shape)} do not match the model's output of shape "
            f"{tuple(output.shape)}; the loss would broadcast one against the other. Give targets "
            f"shaped like the output (or integer class indices with fewer dims)")
