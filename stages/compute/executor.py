"""The one executor: runs a stage actor's program (any schedule) for one training step.

Compute (F, B, I, W, the optimizer step) runs on one worker thread per stage actor,
so the event loop stays free to receive activations, answer heartbeats and serve
control calls while the stage computes; transfers therefore overlap compute. An
action known to be short (:mod:`stages.compute.inline`) runs on the loop's own thread
instead, when the compute thread is idle: the hand-off would cost more than the action.
Sends are posted as soon as the value exists and never wait for the receiver to
use it; a RECV waits only until its value has arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from stages.compute import activations as _activations
from stages.compute import inline as _inline
from stages.comm import overlap as _overlap
from stages.compute import wgrad as _wgrad
from stages.comm import boundary
from stages.comm.boundary import Payload
from stages.comm.device_io import DeviceIO
from stages.program import Action, ActionKind

__all__ = ["Inbox", "StageModel", "StepExecutor", "StepTrace", "check_target_shape", "nonfinite_gradients"]

T = TypeVar("T")
_K = ActionKind
# The kinds whose compute may run inline: the step's own actions (a SEND's compute is its codec's encode).
_INLINE_KINDS = frozenset({_K.F, _K.B, _K.I, _K.W, _K.SEND_F, _K.SEND_B})


class Inbox:
    """Values other stages sent here, keyed (step, kind, stage, micro-batch), bounded."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._slots: dict[tuple[int, str, int, int], asyncio.Future[Payload]] = {}

    def _slot(self, key: tuple[int, str, int, int]) -> asyncio.Future[Payload]:
        slot = self._slots.get(key)
        if slot is None:
            if len(self._slots) >= self._limit:
                raise RuntimeError(f"inbox full ({self._limit} values waiting); a peer sends what no program needs")
            slot = self._slots[key] = asyncio.get_running_loop().create_future()
        return slot

    def resize(self, limit: int) -> None:
        """Sets how many values may wait at once (it scales with the micro-batch count)."""
        self._limit = limit

    def put(self, key: tuple[int, str, int, int], value: Payload) -> None:
        slot = self._slot(key)
        if slot.done():
            raise ValueError(f"value {key} delivered twice")
        slot.set_result(value)

    async def take(self, key: tuple[int, str, int, int]) -> Payload:
        value = await self._slot(key)
        del self._slots[key]
        return value

    def fail(self, key: tuple[int, str, int, int], error: BaseException) -> None:
        """Makes the RECV waiting for ``key`` raise ``error`` (its transfer failed)."""
        slot = self._slot(key)
        if not slot.done():
            slot.set_exception(error)

    def drop_step(self, step: int) -> None:
        """Forgets everything of ``step`` (an aborted step's leftovers)."""
        for key in [k for k in self._slots if k[0] <= step]:
            self._slots.pop(key).cancel()


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

    def autocast(self) -> Any:
        """The context a forward (and a recompute) runs in."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)


@dataclass(slots=True)
class StepTrace:
    """What one step did on one stage actor, for StepStats and traces."""

    spans: list[tuple[str, float, float]] = field(default_factory=list)  # action, start, end (s from step start)
    losses: dict[int, float] = field(default_factory=dict)
    bytes_sent: dict[str, int] = field(default_factory=dict)  # "F 0->1" / "B 1->0" -> bytes
    peak_stash: int = 0
    peak_stash_bytes: int = 0  # activations held for backward, between actions (see _activations)
    busy_s: float = 0.0
    elapsed_s: float = 0.0
    started_at: float = 0.0  # this node's wall clock (time.time()) at the step's start


Send = Callable[[int, Action, Payload], Awaitable[int]]  # step, action, value -> bytes


class StepExecutor:
    """Runs programs for one stage actor; one step at a time.

    Args:
        model: the stage's modules, loss and optimizer.
        inbox: where peers' values arrive.
        send: posts a value to the stage a SEND action names; returns bytes sent.
        num_microbatches: micro-batches per step (the loss of each is scaled by its inverse).
        thread: a one-worker pool for compute; the executor owns it from now on.
        overlap: the data-parallel reduction that starts during backward, if there is one:
            :meth:`begin` starts its step, each forward and backward action reports to it.
        io: how tensors cross between the host and the model's device (received values,
            the batch); a new :class:`~stages.comm.device_io.DeviceIO` for it when None.
    """

    def __init__(
        self, model: StageModel, inbox: Inbox, send: Send, num_microbatches: int, thread: ThreadPoolExecutor,
        *, overlap: _overlap.OverlappedReduction | None = None, io: DeviceIO | None = None,
    ) -> None:
        self.model = model
        self.io = io if io is not None else DeviceIO(model.device)
        self.overlap = overlap
        self.inbox = inbox
        self._send = send
        self.num_microbatches = num_microbatches
        self._thread = thread  # one worker: compute runs in program order
        self.current: Action | None = None
        self.done_actions: int = 0
        # Per-step state.
        # (stage, micro-batch) -> (the input leaves that collect gradients, the outputs that need one)
        self._stash: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._pending_grads: dict[tuple[int, int], list[torch.Tensor | None] | None] = {}  # I -> W, plain autograd
        self._pending_w: dict[tuple[int, int], list[_wgrad.PendingWeightGrad]] = {}  # I -> W, fused
        self._values: dict[tuple[str, int, int], Any] = {}  # received trees, and payloads to send
        self.loss_scale = 1.0  # fp16: the step's loss scale (set by the stage before each step)
        self._upcoming: Action | None = None  # the action after the one running (W batching looks ahead)
        self._w_batch: list[tuple[tuple[int, int], list[_wgrad.PendingWeightGrad]]] = []
        # (stage, micro-batch) -> the storages it holds for its backward, from F until B (or W).
        self._held: dict[tuple[int, int], _activations.Storages] = {}
        self._resident: _activations.Storages = {}  # what lives anyway: parameters, buffers, the batch
        self._w_batching: bool | None = None  # this step's, when it differs from the model's (schedule="auto")
        # The step's losses, as the device left them: read once, at the end of the step (one sync, not one
        # per micro-batch on the compute stream).
        self._losses: dict[int, torch.Tensor] = {}
        # The fast path (stages.compute.inline): which of the running action's compute may run on the loop's thread.
        self._dispatch = _inline.ComputeDispatcher(thread, _inline.InlinePolicy(max_s=model.inline_max_s),
                                                   model.device)
        self._action_key: Hashable | None = None  # the running action's, until its first compute
        self._action_task: asyncio.Task[Any] | None = None  # the task running it (others' compute is not its)

    @property
    def inline_policy(self) -> _inline.InlinePolicy:
        """What decides which actions run inline (tests replace it; the stage reports its counts)."""
        return self._dispatch.policy

    @inline_policy.setter
    def inline_policy(self, policy: _inline.InlinePolicy) -> None:
        self._dispatch.policy = policy

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs ``fn`` on the compute thread, or, for a short action, inline on the loop's thread.

        The first compute a step's F, B, I, W or SEND action makes (its forward, backward,
        encode) is learnt per kind (:meth:`_inline_key`) and runs inline once its kind is
        known to be short and the compute thread is idle (:class:`~stages.compute.inline.ComputeDispatcher`).
        Every other call (the optimizer step, checks, checkpoints, collectives) runs on the
        compute thread.
        """
        if self._action_key is not None and self._action_task is asyncio.current_task():
            key, self._action_key = self._action_key, None
            return await self._dispatch.run(key, fn, *args)
        return await self._dispatch.submit(fn, *args)

    def _inline_key(self, action: Action) -> Hashable | None:
        """What an action's compute is learnt by (None: it never runs inline): its kind and stage;
        a W also by whether it only joins a W batch (near free) or runs the batch's GEMMs."""
        if action.kind not in _INLINE_KINDS:
            return None
        if action.kind is _K.W:
            joins = self.w_batching and (action.stage, action.microbatch) in self._pending_w \
                and self._w_batch_continues()
            return (action.kind, action.stage, joins)
        return (action.kind, action.stage)

    async def begin(self, program: Sequence[Action], *, w_batching: bool | None = None) -> None:
        """Prepares a step that will run ``program``: before anything of the step can fail, so that a
        replica that fails still takes part in every collective the others start (see :meth:`reset`).

        Args:
            w_batching: run this step's runs of consecutive Ws as one GEMM per weight (None: the
                stage's own setting). Needs fused weight gradients.

        Raises:
            ValueError: W batching asked of a stage without fused weight gradients.
        """
        if w_batching and self.model.weight_grads is None:
            raise ValueError("w_batching runs the fused weight-gradient GEMMs together; this stage has none "
                             "(gradient_accumulation_fusion is off)")
        self._w_batching = w_batching
        if self.overlap is not None:
            await self.compute(self.overlap.begin, program, self.w_batching)

    @property
    def w_batching(self) -> bool:
        """Whether this step runs its runs of consecutive Ws as one GEMM per weight."""
        return self.model.w_batching if self._w_batching is None else self._w_batching

    async def run(
        self,
        step: int,
        program: Sequence[Action],
        inputs: Sequence[Any] | None,
        targets: Sequence[Any] | None,
    ) -> StepTrace:
        """Runs ``program`` up to and including its BARRIER; the rest runs in :meth:`finish`.

        Raises:
            ActionFailed: an action raised; it names the action.
        """
        trace = StepTrace(started_at=time.time())
        start = time.perf_counter()
        self.inbox.drop_step(step - 1)  # late arrivals of an aborted earlier step
        self._inputs, self._targets = inputs, targets
        modules = self.model.modules.values()
        self._resident = _activations.storages([*boundary.tree_tensors(inputs), *boundary.tree_tensors(targets),
                                                *(t for m in modules for t in (*m.parameters(), *m.buffers()))])
        self.done_actions = 0
        self._losses = {}
        for index, action in enumerate(program):
            if action.kind is _K.BARRIER:
                break
            self.current = action
            self._upcoming = program[index + 1] if index + 1 < len(program) else None
            self._action_key, self._action_task = self._inline_key(action), asyncio.current_task()
            t0 = time.perf_counter()
            try:
                await self._execute(step, action, trace)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                raise ActionFailed(action, exc) from exc
            finally:
                self._action_key = self._action_task = None
            t1 = time.perf_counter()
            trace.spans.append((str(action), t0 - start, t1 - start))
            if action.kind in (_K.F, _K.B, _K.I, _K.W):
                trace.busy_s += t1 - t0
            # A micro-batch between I and W still holds its activations (as W's inputs).
            trace.peak_stash = max(trace.peak_stash, len(self._stash) + len(self._pending_w) + len(self._w_batch))
            trace.peak_stash_bytes = max(trace.peak_stash_bytes, _activations.union_bytes(self._held.values()))
            self.done_actions += 1
        self.current = None
        trace.elapsed_s = time.perf_counter() - start
        # On a GPU the one sync for the losses waits on the compute thread, not on the loop.
        trace.losses = await self.compute(_as_floats, self._losses) if self.io.staged else _as_floats(self._losses)
        if self._stash or self._values or self._pending_w or self._w_batch:
            leftover = sorted(map(str, list(self._stash) + list(self._values) + list(self._pending_w)
                                  + [key for key, _ in self._w_batch]))
            raise ActionFailed(Action(stage=program[0].stage, kind=_K.BARRIER),
                               RuntimeError(f"program ended with values still held: {leftover}"))
        return trace

    async def finish(self, program: Sequence[Action], reduce: Callable[[], Awaitable[None]]) -> None:
        """Runs the tail after the barrier: gradient reduction, then the optimizer step."""
        await self.reduce(program, reduce)
        await self.apply(program, step=True)

    async def reduce(self, program: Sequence[Action], reduce: Callable[[], Awaitable[None]]) -> None:
        """Runs the tail's gradient reduction, if the program has one (the first half of :meth:`finish`)."""
        if any(action.kind is _K.REDUCE for action in program):
            await reduce()

    async def apply(self, program: Sequence[Action], *, step: bool) -> None:
        """Steps the optimizer if ``step`` and the program has a STEP; else drops the gradients.

        Dropping is how a step whose loss or gradients were not finite leaves every
        parameter (and the optimizer's state) as it was before the step.
        """
        if step and any(action.kind is _K.STEP for action in program):
            await self.compute(self._optimizer_step)
        else:
            await self.compute(self.model.optimizer.zero_grad, True)

    async def reset(self, step: int) -> None:
        """Drops a failed or aborted step: stash, values, gradients (after any compute in flight).

        An overlapped reduction starts the buckets it had not started yet, so that every
        replica issues the same collectives; the next :meth:`begin` waits for them.
        """
        self.inbox.drop_step(step)
        await self.compute(self._clear)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.io.close()

    # -- actions -------------------------------------------------------------------

    async def _execute(self, step: int, action: Action, trace: StepTrace) -> None:
        s, m, kind = action.stage, action.microbatch, action.kind
        assert m is not None
        if kind is _K.F:
            loss = await self.compute(self._forward_held, s, m, self._input_of(s, m), self._target_of(s, m))
            if loss is not None:
                self._losses[m] = loss
        elif kind in (_K.B, _K.I):
            grads = None if s == self.model.num_stages - 1 else self._values.pop(("B", s + 1, m))
            grad_in = await self.compute(self._tracked, action, self._backward, s, m, grads, kind is _K.I)
            if grad_in is not None:
                self._values[("B", s, m)] = boundary.pack(grad_in)
        elif kind is _K.W:
            await self.compute(self._tracked, action, self._weight_backward, s, m)
        elif kind in (_K.RECV_F, _K.RECV_B):
            tag = "F" if kind is _K.RECV_F else "B"
            source = s - 1 if tag == "F" else s + 1
            payload = await self.inbox.take((step, tag, s, m))
            # On a GPU: copied host->device on the copy stream now, the compute stream ordered after it.
            leaves = self.io.to_device(payload.leaves)
            # An activation's tensors that carry a gradient become leaves collecting it.
            self._values[(tag, source, m)] = boundary.unpack(Payload(leaves, payload.spec), self.model.device,
                                                             as_leaves=tag == "F")
        elif kind in (_K.SEND_F, _K.SEND_B):
            tag = "F" if kind is _K.SEND_F else "B"
            value = self._values.pop((tag, s, m))
            nbytes = await self._send(step, action, value)
            edge = f"{tag} {s}->{s + 1 if tag == 'F' else s - 1}"
            trace.bytes_sent[edge] = trace.bytes_sent.get(edge, 0) + nbytes

    def _input_of(self, stage: int, mb: int) -> Any:
        if stage == 0:
            if self._inputs is None:
                raise RuntimeError("stage 0 has no inputs for this step")
            return self._to_device(self._inputs[mb])
        return self._values.pop(("F", stage - 1, mb))

    def _target_of(self, stage: int, mb: int) -> Any:
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

    def _tracked(self, action: Action, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a backward action, reported to the overlapped reduction."""
        if self.overlap is None:
            return fn(*args)
        with self.overlap.action(action):
            return fn(*args)

    def _forward_held(self, stage: int, mb: int, x: Any, target: Any) -> torch.Tensor | None:
        """:meth:`_forward`, noting what the micro-batch now holds for its backward (``peak_stash_bytes``)."""
        counting = self.overlap.forward(stage, mb) if self.overlap is not None else contextlib.nullcontext()
        with _activations.SavedActivations(self._resident) as saved, counting:
            loss = self._forward(stage, mb, x, target)
        inputs, outs = self._stash[(stage, mb)]
        saved.add(inputs + outs)
        self._held[(stage, mb)] = saved.storages
        return loss

    def _forward(self, stage: int, mb: int, x: Any, target: Any) -> torch.Tensor | None:
        module = self.model.modules[stage]
        with torch.enable_grad():
            with self.model.autocast():
                # Stage 0 takes the batch as the model takes it (tensor, positional tuple or
                # keyword dict); a later stage takes what the one before it returned.
                out = boundary.call_module(module, x) if stage == 0 else module(x)
                if target is not None:
                    check_target_shape(out, target)
                    loss = self.model.loss_fn(out, target).float()
            inputs = boundary.grad_leaves(x) if stage > 0 else []
            if target is None:
                if self.model.compute_dtype is not None:
                    # The boundary travels in the compute dtype (half the bytes); the cast is
                    # part of the graph, so the gradient that comes back meets it.
                    out = boundary.cast_floating(out, self.model.compute_dtype)
                sent = boundary.pack(out)
                self._stash[(stage, mb)] = (inputs, [t for t in boundary.tree_tensors(out) if t.requires_grad])
                self._values[("F", stage, mb)] = sent
                return None
            # The step's loss is the mean over micro-batches, as one process computes
            # it on the whole batch; each micro-batch's gradient is scaled to match.
            scaled = loss * self.loss_scale if self.loss_scale != 1.0 else loss
            self._stash[(stage, mb)] = (inputs, [scaled / self.num_microbatches])
            return loss.detach()

    def _backward(self, stage: int, mb: int, grads: list[torch.Tensor | None] | None,
                  input_only: bool) -> list[torch.Tensor | None] | None:
        """The stage's backward for one micro-batch; returns its inputs' gradients (None on stage 0).

        ``grads`` pairs with the outputs that need a gradient (None: the loss); an output
        the next stage did not use gets None and no backward.
        """
        key = (stage, mb)
        weight_grads = self.model.weight_grads
        if not input_only:
            inputs, outs = self._stash.pop(key)
            del self._held[key]
            _run_backward(outs, grads)
            return None if stage == 0 else [x.grad for x in inputs]
        if weight_grads is not None:
            # I: the whole backward except the linears' weight GEMMs, which wait for W;
            # the graph is released here, W needs only the recorded pairs.
            inputs, outs = self._stash.pop(key)
            with weight_grads.deferring() as pending:
                _run_backward(outs, grads)
            self._pending_w[key] = pending
            self._held[key] = _activations.storages((t for _, _, *pair in pending for t in pair), self._resident)
            return None if stage == 0 else [x.grad for x in inputs]
        # I without fused linears: the input gradient alone, which the upstream stage is
        # waiting for; the graph stays alive and W walks it again for the parameters.
        inputs, outs = self._stash[key]
        self._pending_grads[key] = grads
        self._held[key] |= _activations.storages((g for g in grads or () if g is not None), self._resident)
        if stage == 0:
            return None
        pairs = _with_grads(outs, grads)
        if not inputs or not pairs:
            return [None] * len(inputs)
        return list(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs],
                                        retain_graph=True, allow_unused=True))

    def _weight_backward(self, stage: int, mb: int) -> None:
        key = (stage, mb)
        if key in self._pending_w and self.w_batching:
            # W batching: consecutive Ws (the tail defer_weight_grads makes) run each weight's
            # GEMM once, over all their micro-batches' rows.
            self._w_batch.append((key, self._pending_w.pop(key)))
            if self._w_batch_continues():
                return
            batch, self._w_batch = self._w_batch, []
            assert self.model.weight_grads is not None
            _wgrad.apply_batched([pending for _, pending in batch], self.model.weight_grads.on_write)
            for done, _ in batch:
                del self._held[done]
            return
        del self._held[key]
        if key in self._pending_w:
            assert self.model.weight_grads is not None
            _wgrad.apply(self._pending_w.pop(key), self.model.weight_grads.on_write)
            return
        _, outs = self._stash.pop(key)
        grads = self._pending_grads.pop(key)
        params = [p for p in self.model.modules[stage].parameters() if p.requires_grad]
        pairs = _with_grads(outs, grads)
        if params and pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=params)

    def _w_batch_continues(self) -> bool:
        """Whether the W batch takes in the next action too (a W whose weight GEMMs wait)."""
        upcoming = self._upcoming
        return upcoming is not None and upcoming.kind is _K.W and \
            (upcoming.stage, upcoming.microbatch) in self._pending_w

    def _optimizer_step(self) -> None:
        self.model.optimizer.step()
        if self.model.lr_scheduler is not None:
            self.model.lr_scheduler.step()
        self.model.optimizer.zero_grad(set_to_none=True)

    def _clear(self) -> None:
        if self.overlap is not None:
            self.overlap.abandon()
        self._stash.clear()
        self._pending_grads.clear()
        self._pending_w.clear()
        self._held.clear()
        self._values.clear()
        self.model.optimizer.zero_grad(set_to_none=True)


def _to_device(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(device, non_blocking=True)
    return boundary.unpack(boundary.pack(tree), device)


def _as_floats(losses: Mapping[int, torch.Tensor]) -> dict[int, float]:
    """The losses as numbers, with one device sync for all of them."""
    if not losses:
        return {}
    values = torch.stack([losses[m].reshape(()) for m in losses]).tolist()
    return dict(zip(losses, values))


def _with_grads(outs: list[torch.Tensor], grads: Sequence[torch.Tensor | None] | None
                ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Outputs paired with their incoming gradients, leaving out those that got none (unused downstream)."""
    if grads is None:  # the loss
        return [(out, None) for out in outs]
    if len(grads) != len(outs):
        raise ValueError(f"{len(grads)} gradients came back for the {len(outs)} outputs that need one")
    return [(out, grad) for out, grad in zip(outs, grads) if grad is not None]


def _run_backward(outs: list[torch.Tensor], grads: Sequence[torch.Tensor | None] | None) -> None:
    pairs = _with_grads(outs, grads)
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])  # type: ignore[arg-type]


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


def nonfinite_gradients(named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the parameters whose gradient holds a NaN or an infinity.

    One min/max pass per gradient and a single device sync for all of them: min and
    max propagate NaN and show either infinity, and unlike a norm they cannot overflow
    on large finite values.
    """
    with_grad = [(name, p.grad) for name, p in named if p.grad is not None and p.grad.numel()]
    if not with_grad:
        return []
    extremes = torch.stack([torch.stack(torch.aminmax(grad.detach())) for _, grad in with_grad])
    finite = torch.isfinite(extremes).all(dim=1)
    if bool(finite.all()):
        return []
    return [name for (name, _), ok in zip(with_grad, finite.tolist()) if not ok]


class ActionFailed(Exception):
    """An action of a program raised; carries the action and the cause."""

    def __init__(self, action: Action, cause: BaseException) -> None:
        super().__init__(f"{action}: {type(cause).__name__}: {cause}")
        self.action = action
        self.cause = cause
