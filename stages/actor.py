"""The stage actor: owns a slice of the model and runs the programs the scheduler sends.

A stage actor builds its layers from a model factory named by import path (only
those its node's allow-list admits), takes one program per step, trades activations
and gradients directly with its neighbour stages, and steps its optimizer only when
the scheduler releases the accumulation barrier.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import gc
import logging
import resource
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch import nn

from stages.comm import overlap as _overlap
from stages.compute import wgrad as _wgrad
from stages.comm import boundary
from stages.state import checkpoint
from stages.state import snapshots
from stages.build import tied
from stages.comm import zero
from actors._actor import Actor, caller_among, current_caller, endpoint
from stages.compute.activations import checkpoint_interval
from stages.compute.allocator import keep_freed_memory
from stages.build.layers import Chain, build_layers
from stages.devices import pin_device
from stages.comm.boundary import Payload
from actors._errors import ActorError, NotAllowed, error_to_wire
from stages.compute.executor import ActionFailed, Inbox, StageModel, StepExecutor, nonfinite_gradients
from stages.compute.inline import INLINE_MAX_S
from stages.state.lr_scheduler import build_scheduler, learning_rates
from actors._registry import DEFAULT_ALLOW, load_object, register_actor
from stages.state.stage_checkpoint import PreparedLoad, apply_load, layer_key, prepare_load, write_stage
from actors._ref import ActorRef
from stages.mesh import Coords, Mesh
from stages.comm.p2p import DistLink, open_link
from stages.comm.parallel import (
    ProcessGroups, average_gradients, join_process_groups, leave_process_groups, pipeline_pairs, start_average,
)
from stages.program import Action, ActionKind, stage_to_rank
from stages.records import FinishReport, ReduceReport, StageConfig, StageReport
from stages.comm.rendezvous import ActorStore
from stages.state.snapshots import SnapshotShelf
from stages.build.traced import TracedStage
from stages.build.tensor_parallel import ShardSpec, shard_for_tensor_parallel, tp_shard_specs
from transport.codecs import Encoded, ErrorFeedback, get_codec

__all__ = ["StageActor", "StageConfig"]


def _squared_norm(params: Sequence[torch.Tensor]) -> float:
    """The sum of the squares of these parameters' gradients, in float64 (inf or nan when one is).

    The norms are computed on the device and read in one sync (not one per parameter);
    the squares are summed on the host, in order, as a float64 scalar would.
    """
    norms = [torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float64) for p in params if p.grad is not None]
    total = 0.0
    if norms:
        for square in (torch.stack(norms).cpu() ** 2).tolist():
            total += square
    return total


@torch.no_grad()
def _rescale_gradients(params: Sequence[torch.Tensor], unscale: float, clip: float) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if grads and unscale != 1.0:
        torch._foreach_mul_(grads, 1.0 / unscale)
    if grads and clip != 1.0:
        torch._foreach_mul_(grads, clip)


def _original_key(layer: int, name: str) -> str:
    return name

log = logging.getLogger(__name__)

T = TypeVar("T")


@register_actor("stage")
class StageActor(Actor):
    """One pipeline stage (or several, interleaved) of one job, on one node."""

    def __init__(self, **config: Any) -> None:
        self.config = StageConfig.from_wire(config)
        edges = self.config.num_stages - 1
        for codecs in (self.config.activation_codec, self.config.gradient_codec):
            if len(codecs) != edges:
                raise ValueError(f"expected one codec per boundary ({edges}), got {codecs}")
            for codec in codecs:
                get_codec(codec)  # fail at build time, not mid-step
        # Gradient error feedback: one residual per boundary and micro-batch slot.
        self._feedback = {edge: ErrorFeedback(codec) for edge, codec in enumerate(self.config.gradient_codec)}
        self._edge_stats: dict[str, dict[str, Any]] = {}
        self._groups: ProcessGroups | None = None
        self._specs: dict[str, list[int]] = {}
        self._link: DistLink | None = None  # transport="dist": made with the process groups (see _build)
        self._step = -1
        self._codecs = {"F": list(self.config.activation_codec), "B": list(self.config.gradient_codec)}
        self._mesh = Mesh(**dict(zip(("pipeline", "tensor", "data"), self.config.mesh)))
        codec = self.config.reduce_codec
        self._reduce_feedback = ErrorFeedback(codec) if get_codec(codec).lossy else None
        self._reduced_bytes = 0
        self._overlap: _overlap.OverlappedReduction | None = None  # the reduction during backward, when it serves
        self._reduce_params: list[torch.Tensor] = []  # what the reduction averages, in bucket order
        self._reduce_nonfinite: list[str] = []  # the overlapped reduction's findings (local gradients)
        self.peers: list[ActorRef] = []
        self.executor: StepExecutor | None = None
        self._layer_names: dict[int, int] = {}  # id(layer) -> global layer index
        self._data: Any = None
        self._program: list[Action] = []
        self._running: tuple[int, asyncio.Task[Any]] | None = None
        self._peer_identities: frozenset[str] = frozenset()  # the job's nodes' keys (see connect)
        self._own_snapshots = SnapshotShelf()  # this stage's newest states, by applied-step count
        self._held_snapshots: dict[int, SnapshotShelf] = {}  # a pipeline neighbour's, by its rank
        self._tied = tied.TiedSync(self.config.pipeline_rank, [])  # parameters shared with other ranks
        self._prepared_load: PreparedLoad | None = None  # a checked checkpoint part (see checkpoint_check)
        # A held layer's tensor's name in the whole model: "LAYER.name" (a Sequential's own keys), or the
        # name alone for a traced model, whose stage modules keep the original model's names.
        self.key: Callable[[int, str], str] = layer_key
        self._aliases: dict[str, list[str]] = {}  # a tied tensor's name -> its other names in the model
        self._norm_params: list[torch.Tensor] = []  # whose gradients this stage counts in the global norm

    async def on_start(self) -> None:
        context = self.node_context
        allow = context.allow if context is not None else DEFAULT_ALLOW
        device = torch.device(context.device if context is not None else "cpu")
        # Importing the factory and building the model take seconds: on the compute
        # thread, so that this node keeps heartbeating meanwhile.
        # CUDA's current device is per thread: the compute thread pins itself as the node did.
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{self.config.pipeline_rank}-compute",
                                    initializer=pin_device, initargs=(str(device),))
        try:
            loop = asyncio.get_running_loop()
            model = await loop.run_in_executor(thread, self._build_or_leave, allow, device, loop)
        except BaseException as exc:
            thread.shutdown(wait=False)
            where = f"node {context.name} (a worker)" if context is not None else "this process"
            if isinstance(exc, NotAllowed):
                raise NotAllowed(f"{where} refused it: {exc.message}") from None
            if isinstance(exc, ModuleNotFoundError):
                raise ModuleNotFoundError(f"{where}: {exc}", name=exc.name) from None
            raise
        cfg = self.config
        self.executor = StepExecutor(model, Inbox(self._inbox_limit(cfg.micro_batches)), self._send,
                                     cfg.micro_batches, thread, overlap=self._overlap)

    def _build_or_leave(
        self, allow: Sequence[str], device: torch.device, loop: asyncio.AbstractEventLoop
    ) -> StageModel:
        """``_build``; one that fails after joining the job's process groups (a refused
        tensor-parallel split, a factory that raised) leaves them, or this node would refuse
        every later job's groups."""
        joined_before = torch.distributed.is_initialized()  # another job's: never ours to leave
        try:
            return self._build(allow, device, loop)
        except BaseException:
            if not joined_before:
                self._groups = None
                leave_process_groups()
            raise

    def _inbox_limit(self, num_microbatches: int) -> int:
        # Each micro-batch brings at most one activation and one gradient per held stage.
        return 4 * num_microbatches * max(1, len(self.config.stages)) + 16

    def _build(self, allow: Sequence[str], device: torch.device, loop: asyncio.AbstractEventLoop) -> StageModel:
        cfg = self.config
        if cfg.threads_per_stage:
            torch.set_num_threads(cfg.threads_per_stage)
        if cfg.keep_freed_memory:
            keep_freed_memory()
        shard = None
        if cfg.dist is not None:
            mesh = Mesh(**dict(zip(("pipeline", "tensor", "data"), cfg.mesh)))
            address, name = cfg.dist["rendezvous"]
            store = ActorStore(self.runtime.ref(address, name), loop,
                               datetime.timedelta(seconds=float(cfg.dist.get("timeout_s", 600))))
            groups = self._groups = join_process_groups(cfg.dist, mesh, cfg.global_rank, cfg.job, store,
                                                        own_address=self.runtime.address, pairs=self._pairs(),
                                                        device=device)
            if cfg.transport == "dist":  # here, on the compute thread: a GPU link waits on its stream
                self._link = open_link(device, groups.pairs, cfg.global_rank)
            if mesh.tensor > 1:
                tp_rank = mesh.coords(cfg.global_rank).tensor
                shard = functools.partial(shard_for_tensor_parallel, rank=tp_rank, world=mesh.tensor,
                                          group=groups.tensor)
        built = build_layers(cfg, allow, shard)
        every = checkpoint_interval(cfg.activation_checkpointing)  # layers per activation checkpoint; 0: off
        modules: dict[int, nn.Module] = {}
        if cfg.split_points is not None:
            # A traced model: one stage module per model stage; its graph module holds the
            # parameters under the original model's names.
            traced = [stage for stage in built if isinstance(stage, TracedStage)]
            for s in cfg.stages:
                modules[s] = traced[s].to(device)
                traced[s].checkpoint_activations = bool(every)  # the whole stage is one segment
            layers: list[nn.Module] = [stage.module for stage in traced]
            self.key = _original_key
        else:
            layers = built
            for s in cfg.stages:
                first, end = cfg.bounds[s]
                modules[s] = Chain(*layers[first:end], checkpoint_every=every).to(device)
        self._held = {i: layers[i] for s in cfg.stages for i in range(*cfg.bounds[s])}
        self._named_parameters = [(self.key(i, name), p) for i, layer in self._held.items()
                                  for name, p in layer.named_parameters()]
        layer_rank = {i: stage_to_rank(s, cfg.pipeline_stages) for s, (first, end) in enumerate(cfg.bounds)
                      for i in range(first, end)}
        self._tied = tied.TiedSync(cfg.pipeline_rank,
                                   tied.tied_for_rank(layers, layer_rank.__getitem__, cfg.pipeline_rank, self._held))
        # Another name of a tensor held here, under which a state dict may give it (tied weights saved once).
        self._aliases = {}
        for names in tied.tied_groups(layers):
            shown = self._tied_names(names)
            for name in shown:
                self._aliases[name] = [other for other in shown if other != name]
        self._specs = {self.key(i, key): list(spec) for i, layer in self._held.items()
                       for key, spec in tp_shard_specs(layer).items()}
        weight_grads = None
        if cfg.gradient_accumulation_fusion:
            weight_grads = _wgrad.WeightGradients()
            for module in modules.values():
                _wgrad.install(module, weight_grads)
        # A parameter two held layers share is one tensor: the optimizer takes it once.
        params = list({id(p): p for module in modules.values() for p in module.parameters()}.values())
        optimizer_cls = load_object(cfg.optimizer[0], allow)
        optimizer_kwargs = dict(cfg.optimizer[1] if len(cfg.optimizer) > 1 else {})
        if cfg.zero_stage == 1 and self._mesh.data > 1:  # with one replica there is nothing to shard
            me = self._mesh.coords(cfg.global_rank)
            optimizer: torch.optim.Optimizer = zero.ShardedOptimizer(
                params, optimizer_cls, optimizer_kwargs, shard=me.data, group=self._data_group,
                ranks=[self._mesh.rank(Coords(d, me.pipeline, me.tensor)) for d in range(self._mesh.data)],
                bucket_bytes=cfg.bucket_bytes)
        else:
            optimizer = optimizer_cls(params, **optimizer_kwargs)
        scheduler = build_scheduler(cfg.lr_scheduler, optimizer, allow) if cfg.lr_scheduler is not None else None
        loss_fn = load_object(cfg.loss, allow)
        if cfg.data is not None and (0 in cfg.stages or cfg.num_stages - 1 in cfg.stages):
            self._data = load_object(cfg.data, allow)(**cfg.data_kwargs)
        log.info("stage %s/%d of job %s: model stages %s, %d parameters", cfg.pipeline_rank, cfg.pipeline_stages,
                 cfg.job, cfg.stages, sum(p.numel() for p in params))
        compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        self._reduce_params = _overlap.backward_order(modules)
        self._overlap = self._build_overlap(modules, weight_grads, cfg.w_batching)
        # Each parameter's share of the global norm: replicated tensor-parallel ones on tensor
        # rank 0, tied ones on the lowest pipeline rank holding them (see reduce_step).
        tied_elsewhere = {id(g.param) for g in self._tied.groups if g.ranks[0] != cfg.pipeline_rank}
        tp_rank = self._mesh.coords(cfg.global_rank).tensor
        self._norm_params = list({id(p): p for name, p in self._named_parameters
                                  if id(p) not in tied_elsewhere and (name in self._specs or tp_rank == 0)}.values())
        return StageModel(modules=modules, num_stages=cfg.num_stages, loss_fn=loss_fn,
                          optimizer=optimizer, device=device, weight_grads=weight_grads,
                          w_batching=cfg.w_batching,
                          compute_dtype=compute_dtype, lr_scheduler=scheduler,
                          # Tensor-parallel layers wait for their peers inside an action: on the thread.
                          inline_max_s=0.0 if self._mesh.tensor > 1 else INLINE_MAX_S)

    def _build_overlap(self, modules: dict[int, nn.Module], weight_grads: _wgrad.WeightGradients | None,
                       w_batching: bool) -> _overlap.OverlappedReduction | None:
        """The data-parallel reduction that starts during backward, where it serves: with replicas,
        ``overlap_reduce`` on and an exact all-reduce (a lossy ``reduce_codec`` encodes each bucket
        with error feedback after the barrier instead, in :func:`average_gradients`)."""
        groups = self._groups
        if groups is None or groups.data_size < 2 or not self.config.overlap_reduce \
                or self._reduce_feedback is not None:
            return None
        names: dict[int, list[str]] = {}
        for name, p in self._named_parameters:
            names.setdefault(id(p), []).append(name)
        return _overlap.OverlappedReduction(
            self._reduce_params, modules, names, bucket_bytes=self.config.bucket_bytes,
            reduce=functools.partial(self._start_average, groups.data_size),
            weight_grads=weight_grads, w_batching=w_batching)

    def _pairs(self) -> list[tuple[int, int]]:
        """The pipeline neighbours' two-rank groups every member builds: with transport="dist" only."""
        cfg = self.config
        return pipeline_pairs(self._mesh, cfg.num_stages) if cfg.transport == "dist" else []

    def _start_average(self, world: int, flat: torch.Tensor) -> Any:
        return start_average(flat, self._data_group(), world)

    def _data_group(self) -> Any:
        """The data-parallel process group as it is now (a recovery forms it again)."""
        assert self._groups is not None
        return self._groups.data

    async def on_stop(self) -> None:
        if self.executor is not None:
            if self._groups is not None:
                try:  # a collective stuck on a lost peer must not hold up the stop
                    await asyncio.wait_for(self.executor.compute(leave_process_groups), 5.0)
                except TimeoutError:
                    log.warning("could not leave the process group cleanly (a collective is stuck); stopping anyway")
            self.executor.close()
        if self._link is not None:
            self._link.close()
        # A gloo group's threads and listening sockets live as long as its Python object:
        # drop every reference (the groups, tensor-parallel layers holding them), now.
        self._groups = None
        if self._overlap is not None:
            self._overlap.close()
        self._overlap = None
        self.executor = None
        self._held = {}
        self._named_parameters = []
        # Parameters carry the overlapped reduction's gradient hooks, and those hold the group.
        self._reduce_params = []
        self._norm_params = []
        self._tied = tied.TiedSync(self.config.pipeline_rank, [])
        # Those hooks and the parameters they watch form reference cycles, which refcounting
        # alone never frees: collect them now, so the group's threads and sockets go with the job.
        gc.collect()

    # -- set-up ----------------------------------------------------------------------

    @endpoint(roles=("head",))
    async def connect(self, peers: list[list[str]], identities: list[str] | None = None) -> None:
        """Learns every rank's stage actor, indexed by rank, and the keys their nodes hold.

        Args:
            identities: the ``role:name`` of the keys the job's nodes registered with;
                ``deliver`` then takes tensors only from those keys.
        """
        if len(peers) != self.config.pipeline_stages:
            raise ValueError(f"expected {self.config.pipeline_stages} peers, got {len(peers)}")
        self.peers = [self.runtime.ref(address, name) for address, name in peers]
        self._peer_identities = frozenset(i for i in identities or () if i)

    # -- one step ----------------------------------------------------------------------

    @endpoint(roles=("head",))
    async def run_step(
        self,
        step: int,
        program: list[str],
        inputs: list[Any] | None = None,
        targets: list[Any] | None = None,
        data_step: int | None = None,
        data_shard: list[int] | None = None,
        micro_batches: int | None = None,
        snapshot: int | None = None,
        loss_scale: float | None = None,
        w_batching: bool | None = None,
    ) -> dict[str, Any]:
        """Runs ``program`` up to its barrier.

        Args:
            snapshot: first keep a copy of this stage's state (parameters and optimizer)
                as it is now, after ``snapshot`` applied steps, and send one to the next
                pipeline rank in the background (see :meth:`keep_snapshot`).
            micro_batches: a count other than the one the stage was built with (changed
                on a running job, at the barrier, by the scheduler).
            loss_scale: with fp16, the scale the last stage multiplies each loss by.
            w_batching: run this step's runs of consecutive Ws as one GEMM per weight, or not
                (``schedule="auto"`` decides per step; None: as the stage was built).

        Returns:
            A :class:`~stages.records.StageReport` as a map: the step's trace, or which
            action failed and why, or that :meth:`abort_step` stopped it.
        """
        assert self.executor is not None
        if w_batching is not None and not isinstance(w_batching, bool):
            raise ValueError(f"w_batching must be a bool, got {w_batching!r:.40}")
        actions = [Action.parse(text) for text in program]
        self._step = step
        if micro_batches is not None:
            if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
                raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r:.40}")
            self.executor.num_microbatches = micro_batches
            self.executor.inbox.resize(self._inbox_limit(micro_batches))
        if loss_scale is not None:
            if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not loss_scale > 0:
                raise ValueError(f"loss_scale must be a number > 0, got {loss_scale!r:.40}")
            self.executor.loss_scale = float(loss_scale)
        await self.executor.begin(actions, w_batching=w_batching)
        if data_step is not None:
            inputs, targets = self._read_data(data_step, data_shard or [0, 1])
        if snapshot is not None:
            await self._snapshot(snapshot)
        self._edge_stats = {}
        # The program runs in a task of its own so that abort_step can cancel it
        # without cancelling this endpoint (and with it the mailbox).
        task = self.runtime.spawn_task(self.executor.run(step, actions, inputs, targets), name=f"step {step}")
        self._running = (step, task)
        try:
            await asyncio.wait({task})
        finally:
            self._running = None
        if task.cancelled() or isinstance(task.exception(), ActionFailed):
            await self.executor.reset(step)
        if task.cancelled():
            return StageReport(status="aborted").to_wire()
        failure = task.exception()
        if isinstance(failure, ActionFailed):
            log.warning("step %d failed at %s: %s", step, failure.action, failure.cause)
            return StageReport(status="failed", action=str(failure.action),
                               error=error_to_wire(failure.cause)).to_wire()
        trace = task.result()
        if self._link is not None:
            await self._link.flush()
        self._program = actions
        return StageReport(
            status="done",
            losses=[trace.losses[m] for m in sorted(trace.losses)],
            busy_s=trace.busy_s,
            elapsed_s=trace.elapsed_s,
            peak_stash=trace.peak_stash,
            peak_stash_bytes=trace.peak_stash_bytes,
            bytes_sent=trace.bytes_sent,
            spans=[list(span) for span in trace.spans],
            started_at=trace.started_at,
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            codec_stats=self._edge_stats,
            optimizer_state_bytes=zero.state_bytes(self.executor.model.optimizer),
            device=str(self.executor.model.device),
        ).to_wire()

    @endpoint(roles=("head",))
    async def reduce_step(self, step: int) -> dict[str, Any]:
        """The barrier is released: check this stage's gradients, then reduce them across replicas.

        The check comes first so that a NaN is blamed on the replica it came from (the
        average would spread it to all); the reduction runs regardless, as every replica
        must take part in it. Nothing is applied: :meth:`finish_step` does that once the
        scheduler has heard every stage.

        Returns:
            A :class:`~stages.records.ReduceReport` as a map.
        """
        assert self.executor is not None
        self._reduced_bytes = 0
        named = self._named_parameters
        overlapped = self._overlap is not None and self._overlap.active
        # Overlapped, each bucket was checked before it went on the wire (see stages.comm.overlap).
        found = [] if overlapped else await self.executor.compute(nonfinite_gradients, named)
        started = time.perf_counter()
        await self.executor.reduce(self._program, self._reduce)
        wait_s = time.perf_counter() - started
        if overlapped:
            bad = set(self._reduce_nonfinite)
            found = [name for name, _ in named if name in bad]
        await self._tied.sum(step, self._send_tied)
        if not found and self._reduce_feedback is not None and self._reduced_bytes:
            # A lossy reduce codec can overflow (fp16 past 65504) where the raw gradients did not.
            reduced = await self.executor.compute(nonfinite_gradients, named)
            found = [f"{name} (after the data-parallel reduction)" for name in reduced]
        grad_sq = await self.executor.compute(_squared_norm, self._norm_params)
        return ReduceReport(reduced_bytes=self._reduced_bytes, nonfinite=found, grad_sq=grad_sq, wait_s=wait_s,
                            tied=[self._tied_names(group.names) for group in self._tied.groups]).to_wire()

    def _tied_names(self, names: Sequence[str]) -> list[str]:
        """A tied group's names as the whole model gives them (a traced model's own names)."""
        shown = []
        for name in names:
            layer, _, rest = name.partition(".")
            shown.append(self.key(int(layer), rest))
        return list(dict.fromkeys(shown))

    async def _send_tied(self, rank: int, step: int, name: str, grad: torch.Tensor) -> None:
        await self.peers[rank].endpoint(StageActor.deliver_tied, timeout=600).call(
            step, name, self.config.pipeline_rank, grad)

    @endpoint(concurrent=True, roles=("node",))
    async def deliver_tied(self, step: int, name: str, rank: int, grad: torch.Tensor) -> None:
        """Pipeline rank ``rank``'s gradient of the tied parameter ``name``, for this step's sum."""
        self._check_member()
        try:
            self._tied.receive(step, self._step, name, rank, grad)
        except ValueError as exc:
            self.refused_calls += 1
            raise NotAllowed(str(exc)) from None

    @endpoint(roles=("head",))
    async def finish_step(self, step: int, apply: bool = True, unscale: float = 1.0, clip: float = 1.0
                          ) -> dict[str, Any]:
        """Steps the optimizer and the learning-rate schedule (``apply``) or drops the step's gradients,
        as the scheduler decided.

        Before the step the gradients are divided by ``unscale`` (fp16's loss scale) and
        then multiplied by ``clip`` (the global-norm clipping coefficient), in that order,
        as ``GradScaler.unscale_`` then ``clip_grad_norm_`` do on one process.

        A dropped step also forgets the error-feedback residuals: those of a step with
        non-finite gradients hold NaN, which would poison every later step. The schedule
        does not advance on a dropped step (DeepSpeed skips it on an overflow too).

        Returns:
            A :class:`~stages.records.FinishReport` as a map: the learning rates now.
        """
        assert self.executor is not None
        for name, value in (("unscale", unscale), ("clip", clip)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r:.40}")
        if apply and (unscale != 1.0 or clip != 1.0):
            params = list({id(p): p for m in self.executor.model.modules.values() for p in m.parameters()}.values())
            await self.executor.compute(_rescale_gradients, params, float(unscale), float(clip))
        await self.executor.apply(self._program, step=bool(apply))
        if not apply:
            self._feedback = {edge: ErrorFeedback(codec) for edge, codec in enumerate(self._codecs["B"])}
            if self._reduce_feedback is not None:
                self._reduce_feedback = ErrorFeedback(self.config.reduce_codec)
        return FinishReport(lr=learning_rates(self.executor.model.optimizer)).to_wire()

    @endpoint(concurrent=True, roles=("head",))
    async def abort_step(self, step: int) -> None:
        """Another member failed (or the step was cancelled): stop step ``step``, or any older one
        still running, and forget its values and gradients.

        Step numbers are never reused (a retried step gets a new one), so they fence: a
        member that was cut off mid-step is told to abort when it comes back, and a
        delivery for a step other than the current or next is refused.
        """
        assert self.executor is not None
        running = self._running
        if running is not None and running[0] <= step:
            running[1].cancel()  # run_step resets once the program has stopped
        elif running is None:
            await self.executor.reset(step)

    @endpoint(concurrent=True, roles=("node",))
    async def deliver(self, step: int, kind: str, stage: int, microbatch: int, leaves: list[torch.Tensor],
                      spec: Any) -> None:
        """A neighbour's activation (kind "F") or input gradients ("B") for ``stage``: the tensors
        of one boundary value and the spec that rebuilds it (:mod:`stages.comm.boundary`).

        Raises:
            NotAllowed: not a slot this stage's programs expect, or not a well-formed value
                (counted in ``refused_calls``).
        """
        assert self.executor is not None
        self._check_slot(step, kind, stage, microbatch)
        if not isinstance(leaves, list) or not all(isinstance(v, torch.Tensor) for v in leaves):
            self.refused_calls += 1
            raise NotAllowed(f"a delivery carries a list of tensors, got {type(leaves).__name__}")
        self.executor.inbox.put((step, kind, stage, microbatch), self._payload(leaves, spec))

    def _payload(self, leaves: list[torch.Tensor], spec: Any) -> Payload:
        try:
            boundary.check_spec(spec, len(leaves))
        except ValueError as exc:
            self.refused_calls += 1
            raise NotAllowed(str(exc)) from None
        return Payload(leaves, spec)

    def _check_member(self) -> None:
        """Refuses a caller whose key is none of this job's nodes' (see :meth:`connect`)."""
        if not caller_among(self._peer_identities):
            self.refused_calls += 1
            raise NotAllowed(f"{current_caller()[:60]!r} holds no key of job {self.config.job}'s nodes; only its stages "
                             "deliver")

    def _check_slot(self, step: Any, kind: Any, stage: Any, microbatch: Any) -> None:
        """Refuses a delivery for a step other than the current or next, or a slot no program has.

        An activation ("F") comes to a held stage with one before it, a gradient ("B")
        to a held stage with one after it; the micro-batch is one of the current step's
        (the next step may use up to 4x as many: micro_batches can change at the barrier).
        """
        assert self.executor is not None
        self._check_member()
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (step, stage, microbatch))
        limit = self.executor.num_microbatches * (1 if ints and step == self._step else 4)
        fits = ints and kind in ("F", "B") and stage in self.config.stages and \
            (stage > 0 if kind == "F" else stage < self.config.num_stages - 1) and \
            step in (self._step, self._step + 1) and step >= 0 and 0 <= microbatch < limit
        if not fits:
            self.refused_calls += 1
            raise NotAllowed(
                f"rank {self.config.pipeline_rank} (step {self._step}, stages {self.config.stages}) expects no "
                f"{str(kind)[:4]!r} for stage {str(stage)[:12]}, micro-batch {str(microbatch)[:12]} "
                f"of step {str(step)[:12]}")

    @endpoint(concurrent=True, roles=("node",))
    async def deliver_header(self, step: int, kind: str, stage: int, microbatch: int, header: dict[str, Any]) -> None:
        """A neighbour posted a tensor over torch.distributed: post the matching receive."""
        assert self.executor is not None and self._link is not None
        self._check_slot(step, kind, stage, microbatch)
        me = self._mesh.coords(self.config.global_rank)
        source_stage = stage - 1 if kind == "F" else stage + 1
        src = self._mesh.rank(Coords(me.data, stage_to_rank(source_stage, self.config.pipeline_stages), me.tensor))
        key = (step, kind, stage, microbatch)
        if not isinstance(header, dict) or not isinstance(header.get("leaves"), list):
            self.refused_calls += 1
            raise NotAllowed("a dist header is a map with the value's leaves")
        self._payload([torch.empty(0)] * len(header["leaves"]), header.get("spec"))
        self.runtime.spawn_task(self._receive_dist(key, header, src), name=f"p2p {key}")

    async def _receive_dist(self, key: tuple[int, str, int, int], header: dict[str, Any], src: int) -> None:
        assert self.executor is not None and self._link is not None
        step, kind, stage, microbatch = key
        try:
            leaves = await self._link.receive(header, src, step, kind, stage, microbatch)
        except Exception as exc:
            self.executor.inbox.fail(key, exc)
            return
        self.executor.inbox.put(key, Payload(leaves, header["spec"]))

    @endpoint(roles=("head",))
    async def set_codecs(self, activation_codec: list[str], gradient_codec: list[str]) -> None:
        """Changes the boundaries' codecs from the next step on (called at the barrier).

        A gradient boundary whose codec changes starts its error feedback afresh.
        """
        for codecs in (activation_codec, gradient_codec):
            if len(codecs) != self.config.num_stages - 1:
                raise ValueError(f"expected one codec per boundary ({self.config.num_stages - 1}), got {codecs}")
            for codec in codecs:
                get_codec(codec)
        for edge, codec in enumerate(gradient_codec):
            if codec != self._codecs["B"][edge]:
                self._feedback[edge] = ErrorFeedback(codec)
        self._codecs = {"F": list(activation_codec), "B": list(gradient_codec)}

    @endpoint(concurrent=True, roles=("head",))
    async def clock(self) -> float:
        """This node's wall clock, for estimating its offset from the head's by round trips."""
        return time.time()

    @endpoint(concurrent=True, roles=("head",))
    async def progress(self) -> dict[str, Any]:
        """What the stage is doing now (answered even mid-step)."""
        executor = self.executor
        return {
            "rank": self.config.pipeline_rank,
            "step": self._step,
            "current": None if executor is None or executor.current is None else str(executor.current),
            "done": 0 if executor is None else executor.done_actions,
            # Compute actions run on the loop's thread so far (stages.compute.inline), and on the compute thread.
            "inline_actions": 0 if executor is None else executor.inline_policy.inline_runs,
            "thread_actions": 0 if executor is None else executor.inline_policy.thread_runs,
        }

    # -- state -------------------------------------------------------------------------

    async def _snapshot(self, index: int) -> None:
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"snapshot takes a step count >= 0, got {index!r:.40}")
        if index in self._own_snapshots:
            return
        assert self.executor is not None
        model = self.executor.model
        state = await self.executor.compute(self._capture, model)
        self._own_snapshots.put(index, state)
        if len(self.peers) > 1:  # off the step's path: the copy travels while the step computes
            buddy = self.peers[(self.config.pipeline_rank + 1) % len(self.peers)]
            self.runtime.spawn_task(self._send_snapshot(buddy, index, state), name=f"snapshot {index}")

    def _capture(self, model: StageModel) -> dict[str, torch.Tensor]:
        """A snapshot, on the host: from a GPU it would hold device memory twice over (two are kept) and
        block the loop when sent to the buddy."""
        assert self.executor is not None
        state = snapshots.capture(self._held, model.optimizer, model.lr_scheduler)
        if not self.executor.io.staged:
            return state
        return dict(zip(state, self.executor.io.copy_to_cpu(list(state.values()))))

    async def _send_snapshot(self, buddy: ActorRef, index: int, state: dict[str, torch.Tensor]) -> None:
        try:
            await buddy.endpoint(StageActor.keep_snapshot, timeout=60).call(self.config.pipeline_rank, index, state)
        except ActorError as exc:
            log.warning("could not send snapshot %d to %s: %s", index, buddy.name, exc)

    @endpoint(concurrent=True, roles=("node",))
    async def keep_snapshot(self, owner: int, index: int, state: dict[str, torch.Tensor]) -> None:
        """Keeps pipeline rank ``owner``'s snapshot after ``index`` applied steps, to restore it elsewhere."""
        self._check_member()
        if not (isinstance(owner, int) and 0 <= owner < self.config.pipeline_stages and owner !=
                self.config.pipeline_rank and isinstance(index, int) and index >= 0 and isinstance(state, dict)
                and all(isinstance(v, torch.Tensor) for v in state.values())):
            self.refused_calls += 1
            raise NotAllowed(f"a snapshot comes from another rank of this pipeline, for a step count >= 0, "
                             f"as tensors; got owner {str(owner)[:12]}, index {str(index)[:12]}")
        self._held_snapshots.setdefault(owner, SnapshotShelf()).put(index, state)

    @endpoint(concurrent=True, roles=("head",))
    async def snapshots(self) -> dict[str, Any]:
        """The snapshot step counts this stage has: ``{"own": [...], "held": {"RANK": [...]}}``."""
        return {"own": self._own_snapshots.indices(),
                "held": {str(owner): shelf.indices() for owner, shelf in self._held_snapshots.items()}}

    @endpoint(roles=("head",))
    async def held_snapshot(self, owner: int, index: int) -> dict[str, torch.Tensor]:
        """Pipeline rank ``owner``'s snapshot after ``index`` applied steps (for its replacement)."""
        shelf = self._held_snapshots.get(owner)
        if shelf is None:
            raise KeyError(f"rank {self.config.pipeline_rank} holds no snapshot of rank {owner}")
        return shelf.get(index)

    @endpoint(roles=("head",))
    async def own_snapshot(self, index: int) -> dict[str, torch.Tensor]:
        """This stage's own snapshot after ``index`` applied steps (a lost data-parallel replica's
        replacement restores it: replicas hold the same state, unless ZeRO-1 shards it)."""
        return self._own_snapshots.get(index)

    @endpoint(roles=("head",))
    async def rejoin(self, dist: dict[str, Any]) -> None:
        """Leaves the job's process groups and joins them again through a new rendezvous: a lost
        member was replaced. Blocks until every member has joined."""
        assert self.executor is not None
        cfg = self.config
        if cfg.dist is None or cfg.mesh[1] > 1:
            raise ValueError("only a data-parallel job's groups form again (tensor-parallel layers hold theirs)")
        mesh = Mesh(**dict(zip(("pipeline", "tensor", "data"), cfg.mesh)))
        address, name = dist["rendezvous"]
        store = ActorStore(self.runtime.ref(address, name), asyncio.get_running_loop(),
                           datetime.timedelta(seconds=float(dist.get("timeout_s", 600))))

        device = self.executor.model.device

        def rejoin() -> ProcessGroups:
            self._groups = None
            if self._overlap is not None:  # the old group's collectives end with it
                self._overlap.forget()
            leave_process_groups()
            return join_process_groups(dist, mesh, cfg.global_rank, cfg.job, store, own_address=self.runtime.address,
                                       pairs=self._pairs(), device=device)

        self._groups = await self.executor.compute(rejoin)
        if self._link is not None:
            self._link.rebind(self._groups.pairs)
        self.config = dataclasses.replace(cfg, dist=dict(dist))

    @endpoint(roles=("head",))
    async def restore_snapshot(self, index: int, state: dict[str, torch.Tensor] | None = None) -> None:
        """Rolls this stage back to its snapshot after ``index`` applied steps (or to ``state``, its
        lost predecessor's): parameters and optimizer state exactly, nothing of any step in flight."""
        assert self.executor is not None
        if state is None:
            state = self._own_snapshots.get(index)
        zero.check_snapshot(self.executor.model.optimizer, state)
        await self.executor.reset(self._step)
        model = self.executor.model
        await self.executor.compute(snapshots.restore, self._held, model.optimizer, state, model.lr_scheduler)
        self._own_snapshots.put(index, state)


    @endpoint(roles=("head",))
    async def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's share of the model's state, under the unpartitioned model's keys."""
        assert self.executor is not None
        return await self.executor.compute(self._state_dict)

    @endpoint(roles=("head",))
    async def shard_specs(self) -> dict[str, list[int]]:
        """How this stage's tensor-parallel parameters are split: key -> [dim, world, num_fused]."""
        return self._specs

    @endpoint(roles=("head",))
    async def load_state_dict(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Loads the entries this stage holds; returns the keys it took (snapshots before it are dropped)."""
        assert self.executor is not None
        taken = await self.executor.compute(self._load_state_dict, state)
        self._forget_snapshots()
        return taken

    @endpoint(roles=("head",))
    async def state_keys(self, aliases: bool = True) -> list[str]:
        """The keys of the whole model's state this stage holds, and (``aliases``) the other names of
        its tied tensors: where a state dict's entries go; a checkpoint holds every held key."""
        held = [self.key(i, k) for i, layer in self._held.items() for k in layer.state_dict()]
        if not aliases:
            return held
        return list(dict.fromkeys(held + [a for k in held for a in self._aliases.get(k, [])]))

    def _state_dict(self) -> dict[str, torch.Tensor]:
        """The held layers' state on the CPU (from a GPU: moved once, in pinned chunks)."""
        assert self.executor is not None
        named = [(self.key(i, k), v) for i, layer in self._held.items() for k, v in layer.state_dict().items()]
        return dict(zip([k for k, _ in named], self.executor.io.copy_to_cpu([v for _, v in named])))

    def _load_state_dict(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Checks every held layer's entries first, then loads them; errors name keys as the whole model has them.

        A key the state lacks is filled from another name of the same tensor (tied
        weights saved once, as ``save_pretrained`` does) when the state has that one.

        Raises:
            KeyError: a key missing for a held layer (``3.fc1.weight``), or unknown to all of them.
            ValueError: a tensor whose shape is not the parameter's.
        """
        parts: dict[int, dict[str, torch.Tensor]] = {}
        known: set[str] = set()
        for i, layer in self._held.items():
            own = layer.state_dict(keep_vars=True)
            aliases: dict[int, list[str]] = {}
            for k, v in own.items():
                aliases.setdefault(id(v), []).append(self.key(i, k))
            mine: dict[str, torch.Tensor] = {}
            missing = []
            for k, v in own.items():
                name = self.key(i, k)
                known.add(name)
                names = [name, *aliases[id(v)], *self._aliases.get(name, [])]
                known.update(names)
                given = next((state[a] for a in names if a in state), None)
                if given is None:
                    missing.append(name)
                    continue
                if not isinstance(given, torch.Tensor) or given.shape != v.shape:
                    shape = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
                    raise ValueError(f"{name}: expected shape {tuple(v.shape)}, got {shape}")
                mine[k] = given
            if missing:
                raise KeyError(f"layer {i}: missing {missing[:10]}")
            parts[i] = mine
        unknown = [k for k in state if k not in known]
        if unknown:
            raise KeyError(f"keys this stage does not hold: {unknown[:10]}")
        if self.executor is not None and self.executor.io.staged:  # to the device at once, not one by one
            flat = [(i, k, v) for i, mine in parts.items() for k, v in mine.items()]
            for (i, k, _), moved in zip(flat, self.executor.io.copy_to_device([v for _, _, v in flat])):
                parts[i][k] = moved
        for i, mine in parts.items():
            self._held[i].load_state_dict(mine, strict=True)
        return [k for k in state if k in known]

    # -- checkpoints (the format: stages.state.checkpoint; the two load phases: schedulers.control) ----

    @endpoint(roles=("head",))
    async def checkpoint_begin(self, directory: str) -> str:
        """As the job's coordinator: makes the next version's staging directory in ``directory``; returns it."""
        return await self._compute(checkpoint.begin_version, directory)

    @endpoint(roles=("head",))
    async def checkpoint_write(self, staging: str, file: str) -> dict[str, Any]:
        """Writes this stage's tensors and optimizer state to ``staging/file``; returns their manifest items
        and the learning-rate schedule's state."""
        assert self.executor is not None
        # Replica 0 writes the weights; with ZeRO-1 every replica writes its shard's optimizer state.
        write = functools.partial(write_stage, key=self.key, model=self._mesh.coords(self.config.global_rank).data == 0,
                                  scheduler=self.executor.model.lr_scheduler, io=self.executor.io)
        return await self._compute(write, staging, file, self._held, self.executor.model.optimizer,
                                   self._shard_spec_map(), self._tensor_rank())

    @endpoint(roles=("head",))
    async def checkpoint_commit(self, directory: str, staging: str, manifest: dict[str, Any]) -> str:
        """As the coordinator: completes the save (manifest, fsyncs, rename, pointer); returns the version."""
        return await self._compute(checkpoint.commit_version, directory, staging,
                                   checkpoint.Manifest.from_wire(manifest))

    @endpoint(roles=("head",))
    async def checkpoint_manifest(self, directory: str) -> list[Any]:
        """As the coordinator: ``[version directory, manifest]`` of the checkpoint ``LATEST`` names."""
        version, manifest = await self._compute(checkpoint.read_manifest, directory)
        return [version, manifest.to_wire()]

    @endpoint(roles=("head",))
    async def checkpoint_check(self, version: str, plan: dict[str, Any]) -> list[str]:
        """Load, phase one: reads and checks this stage's part (``plan``) and keeps it; changes nothing.

        Returns:
            Every problem found; none means :meth:`checkpoint_apply` may follow.
        """
        assert self.executor is not None
        self._prepared_load = None
        optimizer = self.executor.model.optimizer
        owns = optimizer.owns if isinstance(optimizer, zero.ShardedOptimizer) else None  # ZeRO-1: the shard's state
        prepare = functools.partial(prepare_load, key=self.key, owns=owns, scheduler=self.executor.model.lr_scheduler)
        prepared, problems = await self._compute(prepare, checkpoint.check_version(version),
                                                 checkpoint.Manifest.from_wire(plan), self._held,
                                                 self._shard_spec_map(), self._tensor_rank())
        self._prepared_load = None if problems else prepared
        return problems

    @endpoint(roles=("head",))
    async def checkpoint_apply(self, weights_only: bool) -> None:
        """Load, phase two: copies what :meth:`checkpoint_check` prepared.

        Step numbers go on rising (they fence stale messages); the scheduler moves the
        job's data position to the checkpoint's step instead. Snapshots taken before
        belong to another history: they are dropped.
        """
        assert self.executor is not None
        prepared, self._prepared_load = self._prepared_load, None
        if prepared is None:
            raise checkpoint.CheckpointError("nothing to apply: checkpoint_check found problems or did not run")
        model = self.executor.model
        await self._compute(functools.partial(apply_load, weights_only=bool(weights_only), key=self.key,
                                              scheduler=model.lr_scheduler, io=self.executor.io),
                            prepared, self._held, model.optimizer)
        self._forget_snapshots()

    def _forget_snapshots(self) -> None:
        self._own_snapshots = SnapshotShelf()
        self._held_snapshots = {}

    @endpoint(roles=("head",))
    async def checkpoint_discard(self) -> None:
        """Load, abandoned (another stage found problems): forgets what :meth:`checkpoint_check` read."""
        self._prepared_load = None

    async def _compute(self, fn: Callable[..., T], *args: Any) -> T:
        assert self.executor is not None
        return await self.executor.compute(fn, *args)

    def _shard_spec_map(self) -> dict[str, ShardSpec]:
        return {key: ShardSpec(*spec) for key, spec in self._specs.items()}

    def _tensor_rank(self) -> int:
        return self._mesh.coords(self.config.global_rank).tensor

    # -- helpers ----------------------------------------------------------------------

    async def _send(self, step: int, action: Action, value: Payload) -> int:
        cfg = self.config
        forward = action.kind is ActionKind.SEND_F
        target_stage = action.stage + 1 if forward else action.stage - 1
        edge = min(action.stage, target_stage)
        codec = self._codecs["F" if forward else "B"][edge]
        assert self.executor is not None and action.microbatch is not None
        leaves: list[Any] = list(value.leaves)
        sq_err = 0.0
        if codec != "none" and any(t.is_floating_point() for t in leaves):
            # Quantize on the compute thread: the loop stays free to receive.
            leaves, sq_err = await self.executor.compute(self._encode, forward, edge, action.microbatch,
                                                         value.leaves, codec)
        target_rank = stage_to_rank(target_stage, cfg.pipeline_stages)
        peer = self.peers[target_rank]
        tag = "F" if forward else "B"
        if self._link is None:
            # On a GPU: the (encoded) tensors are copied to pinned host buffers on the copy stream while
            # compute goes on; only this send waits for the copy, on a thread of its own.
            io = self.executor.io
            host = io.to_host(leaves)
            await io.wait(host.event)
            nbytes = await peer.tell("deliver", step, tag, target_stage, action.microbatch, host.values, value.spec)
        else:
            none = get_codec("none")
            encoded = [leaf if isinstance(leaf, Encoded) else none.encode(leaf) for leaf in leaves]
            me = self._mesh.coords(cfg.global_rank)
            dst = self._mesh.rank(Coords(me.data, target_rank, me.tensor))
            header = self._link.send(encoded, dst, step, tag, target_stage, action.microbatch)
            header["spec"] = value.spec
            nbytes = sum(e.nbytes for e in encoded) + await peer.tell(
                "deliver_header", step, tag, target_stage, action.microbatch, header)
        name = f"{'F' if forward else 'B'} {action.stage}->{target_stage}"
        stats = self._edge_stats.setdefault(name, {"codec": codec, "bytes": 0, "raw_bytes": 0,
                                                   "sq_err": 0.0, "sq_norm": 0.0})
        stats["bytes"] += nbytes
        stats["raw_bytes"] += value.nbytes
        stats["sq_err"] += sq_err
        if codec != "none" and cfg.measure_codec_error:
            stats["sq_norm"] += sum(float(t.double().pow(2).sum()) for t in value.leaves if t.is_floating_point())
        return nbytes

    def _encode(self, forward: bool, edge: int, microbatch: int, leaves: list[torch.Tensor],
                codec: str) -> tuple[list[Any], float]:
        """Encodes one value's floating-point tensors for the wire (others travel exact); returns
        them and their squared error (0 unless measured)."""
        out: list[Any] = []
        sq_err = 0.0
        for index, value in enumerate(leaves):
            if not value.is_floating_point():
                out.append(value)
                continue
            if not forward and self.config.error_feedback:
                encoded = self._feedback[edge].encode(value, stream=(microbatch, index))
            else:
                encoded = get_codec(codec).encode(value)
            out.append(encoded)
            if self.config.measure_codec_error:
                decoded = get_codec(codec).decode(encoded).to(value.device)
                sq_err += float((decoded.double() - value.double()).pow(2).sum())
        return out, sq_err

    async def _reduce(self) -> None:
        """Data-parallel gradient reduction: bucketed all-reduce averages across replicas, started
        during backward (``stages.comm.overlap``) where that serves, else all of it now."""
        assert self.executor is not None
        overlap = self._overlap
        if overlap is not None and overlap.active:
            self._reduce_nonfinite = await self.executor.compute(overlap.finish)
            self._reduced_bytes = overlap.num_bytes
        elif self._groups is not None and self._groups.data_size > 1:
            self._reduced_bytes = await self.executor.compute(
                average_gradients, self._reduce_params, self._groups, self.config.bucket_bytes,
                self._reduce_feedback)

    def _read_data(self, data_step: int, shard: list[int]) -> tuple[list[Any] | None, list[Any] | None]:
        if self._data is None:
            raise ValueError(f"job {self.config.job} has no data factory")
        inputs, targets = self._data(data_step)
        index, count = shard  # this replica's share of the global batch
        assert self.executor is not None
        m = self.executor.num_microbatches
        return (boundary.split_batch(boundary.split_batch(inputs, count, "inputs", "data_parallel")[index], m,
                                     "inputs") if 0 in self.config.stages else None,
                boundary.split_batch(boundary.split_batch(targets, count, "targets", "data_parallel")[index], m,
                                     "targets") if self.config.num_stages - 1 in self.config.stages else None)
