"""The stage actor: owns a slice of the model and runs the programs the scheduler sends.

A stage actor builds its layers from a model factory named by import path (only
those its node's allow-list admits), takes one program per step, trades activations
and gradients directly with its neighbour stages, and steps its optimizer only when
the scheduler releases the accumulation barrier.

The actor is a layer of endpoints: who may call what, and in which order. The work is
done by parts that each run in one process without it — :func:`~stages.build.stage.build_stage`
(building), :class:`~stages.compute.executor.StepExecutor` (the program),
:class:`~stages.comm.delivery.Sender` and :class:`~stages.comm.delivery.Receiver`
(tensors to and from the neighbours), :class:`~stages.compute.tail.StepTail` (reduce,
check, step) and :class:`~stages.state.stage_state.StageState` (state dicts,
checkpoints, snapshots).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gc
import logging
import resource
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from actors._actor import Actor, Host, caller_among, current_caller, endpoint
from actors._errors import ActorError, NotAllowed, contained
from actors._ref import ActorRef
from actors._registry import DEFAULT_ALLOW, EXAMPLE_FACTORIES, register_actor
from stages.build import tied, traced
from stages.build.reads import DataReads
from stages.build.stage import BuiltStage, build_stage
from stages.comm import zero
from stages.comm.boundary import split_batch
from stages.comm.delivery import DeliverTell, PeerEndpoints, Receiver, Sender, check_codecs
from stages.comm.device_io import DeviceIO
from stages.comm.groups import StageGroups
from stages.comm.parallel import leave_process_groups
from stages.comm.rendezvous import ActorStore
from stages.comm.stream_endpoints import StreamEndpoints
from stages.comm.streams import StageStreams
from stages.compute.executor import ActionFailed, ended_early, Inbox, StepExecutor, StepTrace
from stages.compute.agreement import Ballot, SendVote, run_tail, tail_report
from stages.compute.tail import StepTail
from stages.devices import pin_device
from stages.program import Action
from stages.records import (FinishReport, ReduceReport, StageConfig, ProgressReport, StageReport, StepOrder,
                            TailVote)
from stages.state.endpoints import SnapshotEndpoints, StateEndpoints
from stages.state.stage_state import StageState
from transport.codecs import get_codec

__all__ = ["StageActor", "StageConfig"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StageParts:
    """A started stage's parts (see the module docstring)."""

    built: BuiltStage
    executor: StepExecutor
    groups: StageGroups | None
    sender: Sender
    receiver: Receiver
    tail: StepTail
    state: StageState
    data: DataReads
    eval_data: DataReads
    """Reads of the job's validation data (``evaluation.eval_data``)."""


def assemble(config: StageConfig, built: BuiltStage, groups: StageGroups | None, thread: ThreadPoolExecutor,
             spawn: Callable[[Coroutine[Any, Any, None], str], Any], send_tied: tied.Send,
             peers: list[PeerEndpoints]) -> StageParts:
    """Puts a built stage's parts together around one executor that owns ``thread``.

    Args:
        spawn: starts a task the actor owns.
        send_tied: sends a tied parameter's gradient to another pipeline rank.
        peers: the neighbours' delivery endpoints, by rank (filled at connect; the sender reads this list).
    """
    link = groups.link if groups is not None else None
    io = DeviceIO(built.model.device)
    sender = Sender(config, lambda fn, *args: executor.compute(fn, *args), io, link)
    sender.peers = peers
    executor = StepExecutor(built.model, Inbox(inbox_limit(config, config.micro_batches)), sender.send,
                            config.micro_batches, thread, overlap=built.overlap, io=io)
    return StageParts(
        built=built, executor=executor, groups=groups, sender=sender,
        receiver=Receiver(config, executor.inbox, spawn, link),
        tail=StepTail(config, built, executor, groups, send_tied, on_drop=sender.forget_feedback),
        state=StageState(built, executor, pipeline_rank=config.pipeline_rank, pipeline_stages=config.pipeline_stages,
                         job=config.job),
        data=DataReads(built.data, config), eval_data=DataReads(built.eval_data, config, what="eval_data",
                                                          once=config.evaluation.eval_batches == 0))


async def close_parts(parts: StageParts) -> None:
    """Leaves the process groups, stops the compute thread, closes the link and the overlapped reduction."""
    if parts.groups is not None:
        try:  # a collective stuck on a lost peer must not hold up the stop
            await asyncio.wait_for(parts.executor.compute(leave_process_groups), 5.0)
        except TimeoutError:
            log.warning("could not leave the process group cleanly (a collective is stuck); stopping anyway")
    parts.executor.close()
    if parts.groups is not None:
        parts.groups.close()  # a gloo group's threads and sockets live as long as its Python object
    if parts.built.overlap is not None:
        parts.built.overlap.close()
    for source in (parts.built.data, parts.built.eval_data):
        if source is not None:
            source.close()


def open_store(runtime: Any, dist: dict[str, Any], loop: asyncio.AbstractEventLoop) -> ActorStore:
    """The torch.distributed store of the rendezvous actor ``dist`` names."""
    address, name = dist["rendezvous"]
    return ActorStore(runtime.ref(address, name), loop, datetime.timedelta(seconds=float(dist.get("timeout_s", 600))))


def _where(exc: BaseException, where: str, building: str) -> BaseException:
    """A build failure, saying where it happened (a refused factory names the node that refused it;
    the job's own code's errors, which stage it was building: see :func:`actors._errors.calling`)."""
    if isinstance(exc, NotAllowed):
        return NotAllowed(f"{where} refused it: {exc.message}")
    if isinstance(exc, ModuleNotFoundError):
        return ModuleNotFoundError(f"{where}: {exc}", name=exc.name)
    if isinstance(exc, Exception) and not isinstance(exc, ActorError):
        exc.add_note(building)
    return exc


def progress_of(config: StageConfig, step: int, executor: StepExecutor | None) -> ProgressReport:
    """What a stage is doing now, as ``progress`` answers."""
    if executor is None:
        return ProgressReport(rank=config.pipeline_rank, step=step)
    return ProgressReport(rank=config.pipeline_rank, step=step,
                         current=None if executor.current is None else str(executor.current),
                         done=executor.done_actions, inline_actions=executor.inline_policy.inline_runs,
                         thread_actions=executor.inline_policy.thread_runs)


def inbox_limit(config: StageConfig, num_microbatches: int) -> int:
    """The most values a stage's inbox holds: at most one activation and one gradient per micro-batch and
    held stage, twice over (the next step's may come early)."""
    return 4 * num_microbatches * max(1, len(config.stages)) + 16


@dataclass(frozen=True, slots=True)
class StepBatch:
    """What a stage runs a step (or an evaluation) on: its actions, its batch and its loss weights."""

    actions: list[Action]
    inputs: list[Any] | None
    targets: list[Any] | None
    loss_weights: list[float] | None


async def begin_step(config: StageConfig, parts: StageParts, order: StepOrder) -> StepBatch:
    """Prepares the stage for ``order``'s step: its micro-batch count and loss scale, the program's
    start (before anything of the step can fail; an evaluation starts no reduction) and its batch."""
    executor = parts.executor
    actions = [Action.parse(text) for text in order.program]
    if order.micro_batches is not None:
        executor.num_microbatches = order.micro_batches
        executor.inbox.resize(inbox_limit(config, order.micro_batches))
    if order.loss_scale is not None:
        executor.loss_scale = float(order.loss_scale)
    if order.lr is not None and not order.evaluate:  # set on the running job: this step's, whatever it was
        for group in executor.model.optimizer.param_groups:
            group["lr"] = float(order.lr)
    if not order.evaluate:
        await executor.begin(actions, w_batching=order.w_batching)
    parts.sender.edge_stats = {}
    if order.data_step is None:
        inputs, targets = order.inputs, order.targets
        if order.whole:  # the replica's share, cut here as the head would have
            count = executor.num_microbatches
            inputs, targets = (None if share is None else split_batch(share, count, what, aligned=True)
                               for share, what in ((inputs, "inputs"), (targets, "targets")))
        batch = StepBatch(actions, inputs, targets, order.loss_weights)
    else:
        # On a thread unless known short (stages.build.reads).
        reads = parts.eval_data if order.eval_data else parts.data
        inputs, targets, weights = await reads.read(order.data_step, order.data_shard or [0, 1],
                                                    executor.num_microbatches, order.data_position)
        batch = StepBatch(actions, inputs, targets, weights)
    if batch.inputs is not None and 0 in executor.model.modules:  # a shape the traced graph cannot run: refused now
        traced.check_batch(executor.model.modules[0], batch.inputs)
    return batch


async def end_step(parts: StageParts, step: int, task: asyncio.Task[StepTrace]) -> StageReport:
    """The report of step ``step``'s program, run by ``task``: done, failed (its values dropped), or aborted."""
    ended = await ended_early(parts.executor, step, task, ActionFailed)
    if ended is not None:
        return ended
    trace = task.result()
    if parts.groups is not None and parts.groups.link is not None:
        await parts.groups.link.flush()
    return stage_report(trace, parts)


def stage_report(trace: StepTrace, parts: StageParts) -> StageReport:
    """A step that reached its barrier, as ``run_step`` reports it."""
    model = parts.executor.model
    return StageReport(
        status="done", losses=[trace.losses[m] for m in sorted(trace.losses)],
        items=[trace.items[m] for m in sorted(trace.items)],
        outputs=None if trace.outputs is None else [trace.outputs[m] for m in sorted(trace.outputs)], busy_s=trace.busy_s,
        metrics=[trace.metrics[m] for m in sorted(trace.metrics)],
        elapsed_s=trace.elapsed_s, peak_stash=trace.peak_stash, peak_stash_bytes=trace.peak_stash_bytes,
        bytes_sent=trace.bytes_sent, spans=[list(span) for span in trace.spans], started_at=trace.started_at,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        codec_stats=parts.sender.edge_stats, optimizer_state_bytes=zero.state_bytes(model.optimizer),
        gradient_bytes=parts.tail.gradient_bytes, parameter_bytes=zero.parameter_bytes(model.optimizer),
        device=str(model.device), samples=parts.data.samples, pass_batches=parts.eval_data.pass_batches)


def join_and_build(config: StageConfig, runtime: Host, allow: Sequence[str], device: torch.device,
               loop: asyncio.AbstractEventLoop) -> tuple[StageGroups | None, BuiltStage]:
    """On the compute thread: joins the job's process groups (``config.dist``), then builds the stage."""
    cfg, groups = config, None
    if cfg.dist is not None:
        groups = StageGroups(cfg, runtime.address, device)
        groups.join(cfg.dist, open_store(runtime, cfg.dist, loop))
    try:
        return groups, build_stage(cfg, allow, device, groups, reduce_exact=not get_codec(cfg.communication.reduce_codec).lossy)
    except BaseException:
        # Joined, then refused (a tensor-parallel split that would untie a parameter, a factory
        # that raised): leave, or this node refuses every later job's groups.
        if groups is not None:
            leave_process_groups()
            groups.close()
        raise


@register_actor("stage")
class StageActor(StateEndpoints, SnapshotEndpoints, StreamEndpoints, Actor):
    """One pipeline stage (or several, interleaved) of one job, on one node."""

    def __init__(self, **config: Any) -> None:
        self.config = StageConfig.from_wire(config)
        check_codecs(self.config, self.config.activation_codec, self.config.gradient_codec)  # fail at build time
        self.parts: StageParts | None = None  # once started
        self.peers: list[ActorRef] = []  # every pipeline rank's stage actor (see connect)
        self._peer_endpoints: list[PeerEndpoints] = []  # their delivery endpoints, made once (the sender's)
        self._peer_identities: frozenset[str] = frozenset()  # the job's nodes' keys (see connect)
        self._step = -1
        self._program: list[Action] = []  # the last step's, whose tail reduce_step and finish_step run
        self._running: tuple[int, asyncio.Task[Any]] | None = None
        self._in_step = False  # inside run_step (its program, or its tail with StepOrder.finish)
        self._lost_in_step: tuple[str, str, type[Exception]] | None = None  # a loss during it: (source, why, kind)
        self._aborted = -1  # the newest step abort_step named: a part of it not yet begun never runs
        self._applied = -1  # the newest step whose tail stepped the optimizer here (StepOrder.after)
        self.ballot = Ballot(self.config.mesh, self.config.global_rank)  # the tail's votes (stages.compute.agreement)
        self._streams: StageStreams | None = None  # transport="stream": its server and links (see open_stream)

    async def on_start(self) -> None:
        context = self.node_context
        # No node: an actor in the driver's own process (tests, notebooks), which admits the examples too.
        allow = context.allow if context is not None else DEFAULT_ALLOW + EXAMPLE_FACTORIES
        device = torch.device(context.device if context is not None else "cpu")
        # Importing the factory and building the model take seconds: on the compute thread, so that this
        # node keeps heartbeating meanwhile. CUDA's current device is per thread: it pins itself as the node did.
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{self.config.pipeline_rank}-compute",
                                    initializer=pin_device, initargs=(str(device),))
        try:
            groups, built = await asyncio.get_running_loop().run_in_executor(
                thread, contained, join_and_build, self.config, self.runtime, allow, device, asyncio.get_running_loop())
        except BaseException as exc:
            thread.shutdown(wait=False)
            where = f"node {context.name} (a worker)" if context is not None else "this process"
            raise _where(exc, where, f"building stage {self.config.pipeline_rank} of job {self.config.job} on {where}") from None
        spawn = self.runtime.spawn_task
        self.parts = assemble(self.config, built, groups, thread, lambda coro, name: spawn(coro, name=name),
                              self._send_tied, self._peer_endpoints)

    def _parts(self) -> StageParts:
        assert self.parts is not None, "the stage has not started"
        return self.parts

    async def on_stop(self) -> None:
        self._close_streams()
        parts, self.parts = self.parts, None
        if parts is not None:
            await close_parts(parts)
            # The overlapped reduction's hooks and the parameters they watch form reference cycles, which
            # refcounting alone never frees: drop every part and collect now, so the group goes with the job.
            del parts
            gc.collect()

    @contextlib.contextmanager
    def _refusing(self) -> Iterator[None]:
        """Refuses a caller whose key is none of this job's nodes' (see :meth:`connect`), then runs the
        checks inside; counts every refusal (NotAllowed) in ``refused_calls``."""
        try:
            if not caller_among(self._peer_identities):
                raise NotAllowed(f"{current_caller()[:60]!r} holds no key of job {self.config.job}'s nodes; "
                                 "only its stages deliver")
            yield
        except NotAllowed:
            self.refused_calls += 1
            raise

    # -- set-up and one step ----------------------------------------------------------

    @endpoint(roles=("head",))
    async def connect(self, peers: list[list[str]], identities: list[str] | None = None,
                      members: list[list[str]] | None = None, step: int = -1) -> None:
        """Learns every pipeline rank's stage actor, by rank, the keys (``role:name``) their nodes hold
        (deliveries and votes are taken only from those keys) and, for a tail the stages run
        themselves, every stage actor of the job by global rank (``members``).

        ``step`` is the newest step number the job has issued (a recovery's): a stage that has run
        fewer (a replacement, at -1) takes it as its own, so that a neighbour's value for the next
        step that comes before its own order is kept, not refused (the step would wait for it)."""
        if len(peers) != self.config.pipeline_stages:
            raise ValueError(f"expected {self.config.pipeline_stages} peers, got {len(peers)}")
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        self._step = max(self._step, step)
        self.peers = [self.runtime.ref(address, name) for address, name in peers]
        # The hot path's endpoints, made once here, not per micro-batch.
        streams = self._connect_streams()
        delivers: list[DeliverTell] = [ref.endpoint(StageActor.deliver).tell if streams is None
                                       else self._stream_peer(streams, ref).deliver for ref in self.peers]
        self._peer_endpoints[:] = [PeerEndpoints(deliver=deliver, deliver_header=ref.endpoint(StageActor.deliver_header).tell)
                                   for deliver, ref in zip(delivers, self.peers)]
        self._peer_identities = frozenset(i for i in identities or () if i)
        if members is not None:
            refs = [self.runtime.ref(address, name) for address, name in members]
            tallies = [ref.endpoint(StageActor.tally).tell for ref in refs] if self.ballot.through_root else []
            votes: list[SendVote] = [ref.endpoint(StageActor.vote).tell if streams is None
                                     else self._stream_peer(streams, ref).vote for ref in refs]
            self.ballot.connect(votes, tallies)  # no answers awaited

    @endpoint(roles=("head",), taskless_start=True)
    async def run_step(self, order: StepOrder | dict[str, Any]) -> StageReport:
        """Runs a :class:`~stages.records.StepOrder` up to its barrier (and its tail, with ``finish``).

        Returns:
            The step's trace, or which action failed and why, or that :meth:`abort_step` stopped it.

        Raises:
            ValueError, RecordError: not a well-formed order; the stage did not move to its step.
        """
        checked = order if isinstance(order, StepOrder) else StepOrder.from_wire(order)
        self._in_step = True
        try:
            report = await self._run_step(checked)
        finally:
            self._in_step = False
            lost, self._lost_in_step = self._lost_in_step, None
        if lost is not None and report.status == "done":  # all of this step's came: what was lost is the next's
            self._poison_lost(self._step + 1, *lost)
        return report

    async def _run_step(self, checked: StepOrder) -> StageReport:
        parts, step = self._parts(), checked.step
        self._step = step
        if checked.after is not None and checked.after != self._applied:
            # Sent ahead of a step not applied here (failed, aborted or dropped; a reset cleared what
            # it left): what neighbours sent for this one is dropped, nothing runs, no collective starts.
            parts.executor.inbox.drop_step(step)
            self.ballot.forget(step)
            return StageReport(status="aborted")
        batch = await begin_step(self.config, parts, checked)
        if checked.snapshot is not None and not checked.evaluate:
            await self._snapshot(checked.snapshot)
        report = await end_step(parts, step, await self._abortable(
            step, parts.executor.run(step, batch.actions, batch.inputs, batch.targets, loss_weights=batch.loss_weights,
                                     evaluating=checked.evaluate, keep_outputs=checked.keep_outputs,
                                     labels=checked.program), f"step {step}"))
        if report.status == "done" and not checked.evaluate:
            self._program = batch.actions
            if checked.finish:
                report = await tail_report(parts.executor, self.ballot, step, await self._abortable(
                    step, run_tail(parts.tail, self.ballot, step, batch.actions, checked, report), f"step {step} tail"))
                if report.status == "done" and report.finished is not None and parts.tail.applied:
                    self._applied = step
        return report

    async def _abortable(self, step: int, work: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Runs ``work`` in a task of its own, so that :meth:`abort_step` can cancel it without cancelling
        this endpoint (and with it the mailbox); returns the task once it has ended, for the caller to
        take its outcome (a failed step is reported, and logged once, by :func:`ended_early`)."""
        task = self.runtime.spawn_task(work, name=name, awaited=True)
        self._running = (step, task)
        if step <= self._aborted:  # abort_step came between the program and the tail, or before both
            task.cancel()
        try:
            await asyncio.wait({task})
        finally:
            self._running = None
        return task

    @endpoint(concurrent=True, roles=("node",), taskless_start=True)
    async def vote(self, step: int, rank: int, vote: TailVote | dict[str, Any]) -> None:
        """Stage actor ``rank``'s vote on step ``step``'s decision (see :mod:`stages.compute.agreement`).
        NotAllowed: not a member's key, not this step or the next, a rank outside the mesh, a second vote."""
        with self._refusing():
            self._take_vote(step, rank, vote)

    def _take_vote(self, step: int, rank: int, vote: TailVote | dict[str, Any]) -> None:
        try:
            checked = vote if isinstance(vote, TailVote) else TailVote.from_wire(vote)
        except ValueError as exc:
            raise NotAllowed(f"not a vote: {exc}") from None
        self.ballot.receive(self._step, step, rank, checked)

    @endpoint(concurrent=True, roles=("node",), taskless_start=True)
    async def tally(self, step: int, votes: list[Any]) -> None:
        """Every member's vote on step ``step``, by global rank, from the root of a mesh past
        :data:`~stages.compute.agreement.ALL_TO_ALL_MAX` members (see :mod:`stages.compute.agreement`).
        NotAllowed: not a member's key, not a list of votes, a ballot that takes votes one by one,
        not this step or the next, not one vote per member, a second tally."""
        with self._refusing():
            if not isinstance(votes, list) or len(votes) > self.ballot.mesh.size:
                raise NotAllowed(f"a tally is a list of at most {self.ballot.mesh.size} votes")
            try:
                checked = [vote if isinstance(vote, TailVote) else TailVote.from_wire(vote) for vote in votes]
            except (ValueError, TypeError) as exc:
                raise NotAllowed(f"not a tally: {exc}") from None
            self.ballot.receive_tally(self._step, step, checked)

    @endpoint(roles=("head",), taskless_start=True)
    async def reduce_step(self, step: int) -> ReduceReport:
        """The barrier is released: checks this stage's gradients, then reduces them across replicas and
        tied ranks; applies nothing (see :meth:`StepTail.reduce`)."""
        return await self._parts().tail.reduce(step, self._program)

    @endpoint(roles=("head",), taskless_start=True)
    async def finish_step(self, step: int, apply: bool = True, unscale: float = 1.0, clip: float = 1.0
                          ) -> FinishReport:
        """Steps the optimizer and the learning-rate schedule (``apply``), gradients first divided by
        ``unscale`` and multiplied by ``clip``, or drops the step (see :meth:`StepTail.finish`).
        Returns the learning rates now."""
        return await self._parts().tail.finish(self._program, apply=apply, unscale=unscale, clip=clip)

    @endpoint(concurrent=True, roles=("head",), taskless_start=True)
    async def abort_step(self, step: int) -> None:
        """Stops step ``step``, or any older one still running, and forgets its values and gradients.

        Step numbers are never reused (a retried step gets a new one), so they fence: a
        member cut off mid-step is told to abort when it comes back, and a delivery for a
        step other than the current or next is refused.
        """
        self._aborted = max(self._aborted, step)
        running = self._running
        if running is not None and running[0] <= step:
            running[1].cancel()  # run_step resets once the program has stopped
        elif running is None:
            await self._parts().executor.reset(step)

    # -- tensors from the neighbours (stages.comm.delivery) ------------------------------

    @endpoint(concurrent=True, roles=("node",), taskless_start=True)
    async def deliver(self, step: int, kind: str, stage: int, microbatch: int, leaves: list[torch.Tensor],
                      spec: Any) -> None:
        """A neighbour's activation ("F") or input gradients ("B") for ``stage``: one boundary value's
        tensors (a lossy one still encoded in a GPU's process) and the spec that rebuilds it.
        NotAllowed: not a slot or value this stage expects."""
        parts = self._parts()
        with self._refusing():
            parts.receiver.deliver(self._step, parts.executor.num_microbatches, step, kind, stage, microbatch,
                                   leaves, spec)

    @endpoint(concurrent=True, roles=("node",), taskless_start=True)
    async def deliver_header(self, step: int, kind: str, stage: int, microbatch: int, header: dict[str, Any]) -> None:
        """A neighbour posted a value over torch.distributed: posts the matching receive."""
        parts = self._parts()
        with self._refusing():
            parts.receiver.deliver_header(self._step, parts.executor.num_microbatches, step, kind, stage,
                                          microbatch, header)

    @endpoint(concurrent=True, roles=("node",), taskless_start=True)
    async def deliver_tied(self, step: int, name: str, rank: int, grad: torch.Tensor) -> None:
        """Pipeline rank ``rank``'s gradient of the tied parameter ``name``, for this step's sum."""
        with self._refusing():
            try:
                self._parts().built.tied.receive(step, self._step, name, rank, grad)
            except ValueError as exc:
                raise NotAllowed(str(exc)) from None

    async def _send_tied(self, rank: int, step: int, name: str, grad: torch.Tensor) -> None:
        await self.peers[rank].endpoint(StageActor.deliver_tied, timeout=600).call(
            step, name, self.config.pipeline_rank, grad)

    @endpoint(roles=("head",))
    async def set_codecs(self, activation_codec: list[str], gradient_codec: list[str]) -> None:
        """Changes the boundaries' codecs from the next step on (called at the barrier)."""
        self._parts().sender.set_codecs(activation_codec, gradient_codec)

    @endpoint(concurrent=True, roles=("head",))
    async def clock(self) -> float:
        """This node's wall clock, for estimating its offset from the head's by round trips."""
        return time.time()

    @endpoint(concurrent=True, roles=("head",))
    async def progress(self) -> ProgressReport:
        """What the stage is doing now (answered even mid-step)."""
        return progress_of(self.config, self._step, self.parts.executor if self.parts is not None else None)

    # -- snapshots and recovery (stages.state.stage_state; the endpoints: SnapshotEndpoints) -------------

    async def _snapshot(self, index: int) -> None:
        state = await self._parts().state.take_snapshot(index)
        if state is not None and len(self.peers) > 1:  # off the step's path: the copy travels while it computes
            buddy = self.peers[(self.config.pipeline_rank + 1) % len(self.peers)]
            self.runtime.spawn_task(self._send_snapshot(buddy, index, state), name=f"snapshot {index}")

    async def _send_snapshot(self, buddy: ActorRef, index: int, state: dict[str, torch.Tensor]) -> None:
        try:
            await buddy.endpoint(StageActor.keep_snapshot, timeout=60).call(self.config.pipeline_rank, index, state)
        except ActorError as exc:
            log.warning("could not send snapshot %d to %s: %s", index, buddy.name, exc)

    @endpoint(roles=("head",))
    async def rejoin(self, dist: dict[str, Any]) -> None:
        """Leaves the job's process groups and joins them again through a new rendezvous (a lost member was
        replaced). Blocks until every member has joined."""
        parts = self._parts()
        groups = parts.groups
        if groups is None:
            raise ValueError("only a data-parallel job's groups form again (tensor-parallel layers hold theirs)")
        groups.check_rejoin()
        store = open_store(self.runtime, dist, asyncio.get_running_loop())
        overlap = parts.built.overlap
        await parts.executor.compute(groups.rejoin, dict(dist), store, overlap.forget if overlap else None)
        groups.rebind_link()
