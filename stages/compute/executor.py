"""The one executor: runs a stage actor's program (any schedule) for one training step.

Compute (F, B, I, W, the optimizer step) runs on one worker thread per stage actor,
so the event loop stays free to receive activations, answer heartbeats and serve
control calls while the stage computes; transfers therefore overlap compute. An
action known to be short (:mod:`stages.compute.inline`) runs on the loop's own thread
instead, when the compute thread is idle: the hand-off would cost more than the action.
Sends are posted as soon as the value exists and never wait for the receiver to
use it; a RECV waits only until its value has arrived. The passes themselves (forward,
backward, weight backward) and what a micro-batch holds between them are
:class:`~stages.compute.passes.StagePasses`; :class:`StageModel` and
:func:`check_target_shape` live there too and are re-exported here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from stages.compute import activations as _activations
from stages.compute import inline as _inline
from stages.comm import overlap as _overlap
from stages.comm import boundary
from stages.comm.boundary import Payload
from stages.comm.device_io import DeviceIO
from stages.compute.passes import StageModel, StagePasses, check_target_shape, handed_over
from actors._errors import error_to_wire
from stages.program import Action, ActionKind
from stages.records import StageReport

log = logging.getLogger(__name__)

__all__ = ["Inbox", "StageModel", "StepExecutor", "StepTrace", "check_target_shape", "nonfinite_gradients"]

T = TypeVar("T")
_K = ActionKind
_COMPUTE = frozenset({_K.F, _K.B, _K.I, _K.W})  # only these change what the stage holds
# ...and of those only F (a micro-batch's activations) and I (its output gradients, kept for W) add to it.
_GROWS = frozenset({_K.F, _K.I})


class Inbox:
    """Values other stages sent here, keyed (step, kind, stage, micro-batch), bounded."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._slots: dict[tuple[int, str, int, int], asyncio.Future[Payload]] = {}
        self._poisoned: dict[int, BaseException] = {}  # step -> why its values not yet in never come

    def _slot(self, key: tuple[int, str, int, int]) -> asyncio.Future[Payload]:
        slot = self._slots.get(key)
        if slot is None:
            if len(self._slots) >= self._limit:
                raise RuntimeError(f"inbox full ({self._limit} values waiting); a peer sends what no program needs")
            slot = self._slots[key] = asyncio.get_running_loop().create_future()
            if key[0] in self._poisoned:
                slot.set_exception(self._poisoned[key[0]])
        return slot

    def resize(self, limit: int) -> None:
        """Sets how many values may wait at once (it scales with the micro-batch count)."""
        self._limit = limit

    def put(self, key: tuple[int, str, int, int], value: Payload) -> None:
        if key[0] in self._poisoned:
            return  # its step fails: the value has no taker
        slot = self._slot(key)
        if slot.done():
            raise ValueError(f"value {key} delivered twice")
        slot.set_result(value)

    async def take(self, key: tuple[int, str, int, int]) -> Payload:
        slot = self._slot(key)
        try:
            value = await slot
        except asyncio.CancelledError:
            # The step was aborted while this waited, which cancelled the slot too: a value that
            # arrives now is its step's leftover (the reset drops it), not a second delivery.
            if self._slots.get(key) is slot:
                del self._slots[key]
            raise
        del self._slots[key]
        return value

    def fail(self, key: tuple[int, str, int, int], error: BaseException) -> None:
        """Makes the RECV waiting for ``key`` raise ``error`` (its transfer failed)."""
        slot = self._slot(key)
        if not slot.done():
            slot.set_exception(error)

    def poison(self, steps: Iterable[int], error: BaseException) -> None:
        """Makes every RECV of ``steps`` for a value not yet in raise ``error``, now or when it comes to
        wait: a transfer lost a value, and nobody can say which."""
        self._poisoned.update(dict.fromkeys(steps, error))
        for key, slot in self._slots.items():
            if key[0] in self._poisoned and not slot.done():
                slot.set_exception(self._poisoned[key[0]])

    def drop_step(self, step: int) -> None:
        """Forgets everything of ``step`` (an aborted step's leftovers)."""
        for key in [k for k in self._slots if k[0] <= step]:
            self._slots.pop(key).cancel()
        for old in [s for s in self._poisoned if s <= step]:
            del self._poisoned[old]


@dataclass(slots=True)
class StepTrace:
    """What one step did on one stage actor, for StepStats and traces."""

    spans: list[tuple[str, float, float]] = field(default_factory=list)  # action, start, end (s from step start)
    losses: dict[int, float] = field(default_factory=dict)
    items: dict[int, float] = field(default_factory=dict)  # samples, or counted tokens, per micro-batch
    outputs: dict[int, Any] | None = None  # an evaluation's last-stage outputs, when asked for
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)  # an evaluation's eval_metrics, per micro-batch
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
        self.inbox = inbox
        self._send = send
        self.num_microbatches = num_microbatches  # read by each step's run
        self.loss_scale = 1.0  # fp16: the step's loss scale (set by the stage before each step)
        self._thread = thread  # one worker: compute runs in program order
        self.current: Action | None = None
        self.done_actions: int = 0
        self.step_started = 0.0  # time.perf_counter() at the last step's start: its spans' clock is from there
        # The passes and everything a micro-batch holds between them (stash, values, pending Ws).
        passes = self._passes = StagePasses(model, self.io, overlap)
        # Bound once, so that the per-action path makes no bound method (values is never rebound).
        self._values = passes.values
        self._inline_key, self._tracked = passes.inline_key, passes.tracked
        self._input_of, self._target_of = passes.input_of, passes.target_of
        self._forward_held, self._backward, self._weight_backward = \
            passes.forward_held, passes.backward, passes.weight_backward
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

    @property
    def overlap(self) -> _overlap.OverlappedReduction | None:
        """The data-parallel reduction that starts during backward, if there is one (tests replace it)."""
        return self._passes.overlap

    @overlap.setter
    def overlap(self, overlap: _overlap.OverlappedReduction | None) -> None:
        self._passes.overlap = overlap

    @property
    def w_batching(self) -> bool:
        """Whether this step runs its runs of consecutive Ws as one GEMM per weight."""
        return self._passes.w_batching

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs ``fn`` on the compute thread, or, for a short action, inline on the loop's thread.

        The first compute a step's F, B, I, W or SEND action makes (its forward, backward,
        encode) is learnt per kind (:meth:`StagePasses.inline_key`) and runs inline once its kind is
        known to be short and the compute thread is idle (:class:`~stages.compute.inline.ComputeDispatcher`).
        Every other call (collectives, checkpoints, a sharded optimizer's step) runs on the
        compute thread; the tail's local work goes through :meth:`compute_local`.
        """
        if self._action_key is not None and self._action_task is asyncio.current_task():
            key, self._action_key = self._action_key, None
            return await self._dispatch.run(key, fn, *args)
        return await self._dispatch.submit(fn, *args)

    async def compute_local(self, key: str, fn: Callable[..., T], *args: Any) -> T:
        """Runs ``fn``, a computation on this stage's own tensors alone (no collective, nothing that
        waits on a peer), as :meth:`compute` runs an action's: learnt as kind ``key`` and inline once
        known short. The tail's checks, norms and a local optimizer step are such: on a model whose
        step takes a millisecond, each trip to the compute thread and back cost a fifth of it.
        """
        return await self._dispatch.run(("tail", key), fn, *args)

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
        self._passes.step_w_batching = w_batching
        if self.overlap is not None:
            await self.compute(self.overlap.begin, program, self.w_batching)

    async def run(
        self,
        step: int,
        program: Sequence[Action],
        inputs: Sequence[Any] | None,
        targets: Sequence[Any] | None,
        *,
        loss_weights: Sequence[float] | None = None,
        evaluating: bool = False,
        keep_outputs: bool = False,
        labels: Sequence[str] | None = None,
    ) -> StepTrace:
        """Runs ``program`` up to and including its BARRIER; the rest runs in :meth:`finish`.

        Args:
            loss_weights: the last stage's weight per micro-batch (see :mod:`stages.compute.averaging`).
            evaluating: forward only (a program of F and transfers), every module in eval mode
                meanwhile; ``keep_outputs``: the last stage's outputs come back in the trace.
            labels: each action's name for the trace's spans (a stage has the texts its program was
                parsed from); made here when None.

        Raises:
            ActionFailed: an action raised; it names the action.
        """
        if not evaluating:
            return await self._run(step, program, inputs, targets, labels, loss_weights=loss_weights)
        modules = list(self.model.modules.values())
        modes = [module.training for module in modules]
        for module in modules:
            module.eval()  # dropout off, batch norm on its running statistics, as DeepSpeed's eval_batch
        try:
            # An evaluation's weights only mark the stand-ins of a pass over the validation set (0); its
            # loss is averaged by the scheduler, from every micro-batch's count.
            return await self._run(step, program, inputs, targets, labels, evaluating=True,
                                   keep_outputs=keep_outputs, loss_weights=loss_weights)
        finally:
            for module, mode in zip(modules, modes):
                module.train(mode)
            self._passes.evaluating = False

    async def _run(self, step: int, program: Sequence[Action], inputs: Sequence[Any] | None,
                   targets: Sequence[Any] | None, labels: Sequence[str] | None, **options: Any) -> StepTrace:
        trace = StepTrace(started_at=time.time())
        start = self.step_started = time.perf_counter()
        self.inbox.drop_step(step - 1)  # late arrivals of an aborted earlier step
        passes = self._passes
        passes.start_step(inputs, targets, loss_scale=self.loss_scale, num_microbatches=self.num_microbatches,
                          **options)
        self.done_actions = 0
        self._losses = {}
        task = asyncio.current_task()
        if labels is None or len(labels) != len(program):
            labels = [str(action) for action in program]
        for index, action in enumerate(program):
            kind = action.kind
            if kind is _K.BARRIER:
                break
            self.current = action
            passes.upcoming = program[index + 1] if index + 1 < len(program) else None
            self._action_key, self._action_task = self._inline_key(action), task
            t0 = time.perf_counter()
            try:
                await self._execute(step, action, trace)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if kind is _K.F and isinstance(exc, (RuntimeError, TypeError)) and action.microbatch is not None:
                    if (note := passes.batch_dtype_note(action.stage, action.microbatch)) is not None:
                        exc.add_note(note)
                raise ActionFailed(action, exc) from exc
            finally:
                self._action_key = self._action_task = None
            t1 = time.perf_counter()
            trace.spans.append((labels[index], t0 - start, t1 - start))
            if kind in _COMPUTE:
                trace.busy_s += t1 - t0
                if kind in _GROWS:
                    # A micro-batch between I and W still holds its activations (as W's inputs).
                    trace.peak_stash = max(trace.peak_stash,
                                           len(passes.stash) + len(passes.pending_w) + len(passes.w_batch))
                    trace.peak_stash_bytes = max(trace.peak_stash_bytes,
                                                 _activations.union_bytes(passes.held.values()))
            self.done_actions += 1
        self.current = None
        trace.elapsed_s = time.perf_counter() - start
        # On a GPU the one sync for the losses waits on the compute thread, not on the loop.
        trace.losses = await self.compute(_as_floats, self._losses) if self.io.staged else _as_floats(self._losses)
        trace.items = {m: float(n) for m, n in sorted(passes.items.items())}
        trace.outputs = passes.outputs
        trace.metrics = passes.metrics
        leftover = passes.leftover()
        if leftover:
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

    async def apply(self, program: Sequence[Action], *, step: bool, local: bool = False) -> None:
        """Steps the optimizer if ``step`` and the program has a STEP; else drops the gradients.

        Dropping is how a step whose loss or gradients were not finite leaves every
        parameter (and the optimizer's state) as it was before the step.

        Args:
            local: the optimizer's step runs no collective (not a sharded optimizer's), so it
                may run inline when short (:meth:`compute_local`).
        """
        if step and any(action.kind is _K.STEP for action in program):
            if local:
                await self.compute_local("step", self._optimizer_step)
            else:
                await self.compute(self._optimizer_step)
        else:
            await self.compute(self.model.optimizer.zero_grad, True)

    async def reset(self, step: int) -> None:
        """Drops a failed or aborted step: stash, values, gradients (after any compute in flight).

        An overlapped reduction starts the buckets it had not started yet, so that every
        replica issues the same collectives; the next :meth:`begin` waits for them.
        """
        self.inbox.drop_step(step)
        await self.compute(self._passes.clear)

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
            grads = None if s == self.model.num_stages - 1 else handed_over(self._values.pop(("B", s + 1, m)))
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

    def _optimizer_step(self) -> None:
        self.model.optimizer.step()
        if self.model.lr_scheduler is not None:
            self.model.lr_scheduler.step()
        self.model.optimizer.zero_grad(set_to_none=True)


def _as_floats(losses: Mapping[int, torch.Tensor]) -> dict[int, float]:
    """The losses as numbers, with one device sync for all of them."""
    if not losses:
        return {}
    values = torch.stack([losses[m].reshape(()) for m in losses]).tolist()
    return dict(zip(losses, values))


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


async def ended_early(executor: StepExecutor, step: int, task: asyncio.Future[Any],
                      failed: type[BaseException]) -> StageReport | None:
    """The report of a part of step ``step`` (its program, or its tail) run by ``task`` when it did not
    finish: aborted (cancelled) or failed (it raised ``failed``, which carries ``action`` and ``cause``),
    the step's values and gradients dropped either way; None when it finished (or raised anything else,
    which ``task.result()`` raises again)."""
    if not task.cancelled() and not isinstance(task.exception(), failed):
        return None
    await executor.reset(step)
    if task.cancelled():
        return StageReport(status="aborted")
    failure: Any = task.exception()
    log.warning("step %d failed at %s: %s", step, failure.action, failure.cause)
    return StageReport(status="failed", action=str(failure.action), error=error_to_wire(failure.cause))
