"""The torch peers of ``benchmarks.pipeline``: one process, and ``torch.distributed.pipelining``.

Each peer is a group of spawned worker processes (one for the single-process peer, one
per stage for a pipelined one) that build the reference workload (docs/design.md), then wait
for commands from the parent: ``run`` some steps and report their times, or ``finish``:
save the trained parameters for the exactness check, report peak RSS and exit. The
peers stay up between commands so that ``benchmarks.pipeline`` can interleave their
measurements with actorpipe's: machine noise then hits every peer alike.

Torch's schedules run by the name :data:`TORCH_SCHEDULES` gives them. The multi-stage
ones (interleaved 1F1B, looped BFS, the zero-bubble pair, DualPipeV) hold two model
stages per rank, placed as torch places them (``loop``: stage ``s`` on rank ``s % P``;
``v``: rank ``r`` holds stages ``r`` and ``2P - 1 - r``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import multiprocessing as mp
import os
import queue
import resource
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


NUM_BLOCKS = 8
DIM = 512
BATCH_SHAPE = (64, 32, DIM)
NUM_MICROBATCHES = 8
LR = 0.01
SEED = 0
# The schedules actorpipe and torch both run, by these names.
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zbv", "dualpipev")
COMPUTE_ONLY = "compute_only"  # each rank computes its stage's micro-batches, with no transfers


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TorchSchedule:
    """One of torch's schedules: its class in ``torch.distributed.pipelining``, the model
    stages each rank holds, and torch's placement style for them."""

    class_name: str
    stages_per_rank: int = 1
    style: str = "loop"


TORCH_SCHEDULES = {
    "1f1b": TorchSchedule(class_name="Schedule1F1B"),
    "gpipe": TorchSchedule(class_name="ScheduleGPipe"),
    "interleaved": TorchSchedule(class_name="ScheduleInterleaved1F1B", stages_per_rank=2),
    "looped_bfs": TorchSchedule(class_name="ScheduleLoopedBFS", stages_per_rank=2),
    "interleaved_zb": TorchSchedule(class_name="ScheduleInterleavedZeroBubble", stages_per_rank=2),
    "zbv": TorchSchedule(class_name="ScheduleZBVZeroBubble", stages_per_rank=2, style="v"),
    "dualpipev": TorchSchedule(class_name="ScheduleDualPipeV", stages_per_rank=2, style="v"),
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What a peer trains: a model factory by import path (an ``nn.Sequential`` the
    stages split evenly by children), its arguments, and the global batch's shape
    (``randn`` inputs and targets); the reference workload by default."""

    model: str = "examples.models:residual_mlp"
    model_kwargs: dict[str, Any] = dataclasses.field(default_factory=lambda: {"blocks": NUM_BLOCKS, "dim": DIM})
    batch_shape: tuple[int, ...] = BATCH_SHAPE

    @property
    def module(self) -> str:
        """The module the factory lives in (what an actorpipe node must admit)."""
        return self.model.split(":", 1)[0]


REFERENCE = Workload()


def reference_batch(workload: Workload = REFERENCE) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets: ``randn`` twice after seeding 0 (own generator)."""
    generator = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(workload.batch_shape, generator=generator)
    targets = torch.randn(workload.batch_shape, generator=generator)
    return inputs, targets


def build_model(workload: Workload = REFERENCE) -> nn.Sequential:
    """The whole model, initialised after ``torch.manual_seed(0)``."""
    attribute = workload.model.split(":", 1)[1]
    factory = getattr(importlib.import_module(workload.module), attribute)
    torch.manual_seed(SEED)
    model = factory(**workload.model_kwargs)
    assert isinstance(model, nn.Sequential), f"{workload.model} built a {type(model).__name__}, not an nn.Sequential"
    return model


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """How a worker process trains: stages (1 means one plain process), schedule, rendezvous."""

    num_stages: int
    schedule: str
    init_method: str
    state_dir: str
    name: str
    workload: Workload = REFERENCE
    # Each block compiled in place with torch.compile on this backend (None: eager), as actorpipe's torch_compile.
    compiled: str | None = None


class _Trainer:
    """One rank's model slices and optimizer; ``timed_step`` runs one optimizer step.

    A pipelined rank builds one torch schedule (and its ``PipelineStage`` objects) per
    micro-batch count it is asked to run, on first use, over the same modules.
    """

    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        model = build_model(spec.workload)
        self.stage_indices = self._stage_indices()
        num_model_stages = spec.num_stages * self._kind().stages_per_rank
        per_stage = len(model) // num_model_stages
        self.modules = {i: model[i * per_stage:(i + 1) * per_stage] for i in self.stage_indices}
        self.module = nn.ModuleDict({str(i): m for i, m in self.modules.items()})
        if spec.compiled is not None:  # each block in place (names kept), as actorpipe's torch_compile compiles a stage
            for stage in self.modules.values():
                for block in stage:
                    block.compile(backend=spec.compiled)
        self.holds_first, self.holds_last = 0 in self.modules, num_model_stages - 1 in self.modules
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=LR)
        self.inputs, self.targets = reference_batch(spec.workload)
        self.schedules: dict[int, Any] = {}
        if spec.schedule == COMPUTE_ONLY:
            # Stand-ins for what a pipeline would hand this stage: an input activation and an
            # output gradient per micro-batch, of the real shapes.
            gen = torch.Generator().manual_seed(SEED + rank)
            batch_shape = spec.workload.batch_shape
            micro = (batch_shape[0] // NUM_MICROBATCHES, *batch_shape[1:])
            self.stand_ins = [(torch.randn(micro, generator=gen), torch.randn(micro, generator=gen))
                              for _ in range(NUM_MICROBATCHES)]

    def _kind(self) -> TorchSchedule:
        return TORCH_SCHEDULES.get(self.spec.schedule, TORCH_SCHEDULES["1f1b"])

    def _stage_indices(self) -> list[int]:
        """The model stages this rank holds, as torch places them for the schedule."""
        from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

        kind = self._kind()
        if self.spec.schedule == COMPUTE_ONLY or kind.stages_per_rank == 1:
            return [self.rank]
        mapping = generate_stage_to_rank_mapping(self.spec.num_stages, self.spec.num_stages * kind.stages_per_rank,
                                                 style=kind.style)
        return sorted(stage for stage, rank in mapping.items() if rank == self.rank)

    def _schedule(self, num_microbatches: int) -> Any:
        """Torch's schedule for ``num_microbatches`` over this rank's stages (built on first use)."""
        if num_microbatches not in self.schedules:
            import torch.distributed.pipelining as pipelining

            kind = self._kind()
            num_model_stages = self.spec.num_stages * kind.stages_per_rank
            stages = [pipelining.PipelineStage(self.modules[i], i, num_model_stages, torch.device("cpu"))
                      for i in self.stage_indices]
            schedule_class = getattr(pipelining, kind.class_name)
            # scale_grads (the default) averages over micro-batches: the full-batch mean loss.
            self.schedules[num_microbatches] = schedule_class(
                stages[0] if kind.stages_per_rank == 1 else stages,
                n_microbatches=num_microbatches, loss_fn=F.mse_loss)
        return self.schedules[num_microbatches]

    def timed_step(self, num_microbatches: int = NUM_MICROBATCHES) -> float:
        """Runs one training step; returns its wall time on this rank (after a barrier)."""
        schedule = None
        if self.spec.num_stages > 1 and self.spec.schedule != COMPUTE_ONLY:
            schedule = self._schedule(num_microbatches)  # outside the timed span: built once
        if self.spec.num_stages > 1:
            dist.barrier()
        start = time.perf_counter()
        if self.spec.schedule == COMPUTE_ONLY:
            self._compute_only()
        elif schedule is None:
            F.mse_loss(self.module["0"](self.inputs), self.targets).backward()
        else:
            args = (self.inputs,) if self.holds_first else ()
            if self.holds_last:
                schedule.step(*args, target=self.targets, losses=[], return_outputs=False)
            else:
                schedule.step(*args)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return time.perf_counter() - start

    def _compute_only(self) -> None:
        """This stage's share of a pipelined step without a pipeline: every micro-batch's
        forward and backward back to back, nothing sent or waited for."""
        last = self.rank == self.spec.num_stages - 1
        module = self.modules[self.rank]
        for x, grad in self.stand_ins:
            x = x.requires_grad_(self.rank > 0)
            out = module(x)
            if last:
                (F.mse_loss(out, grad) / NUM_MICROBATCHES).backward()
            else:
                out.backward(grad)

    def save(self) -> None:
        """Writes this rank's trained parameters for the parent's exactness check."""
        state = {}
        for module in self.modules.values():  # slices of an nn.Sequential keep the whole model's names
            state.update(module.state_dict())
        torch.save(state, state_path(self.spec.state_dir, self.spec.name, self.rank))


def state_path(state_dir: str, name: str, rank: int) -> str:
    """Where rank ``rank`` of peer ``name`` saves its parameters."""
    return os.path.join(state_dir, f"{name}.rank{rank}.pt")


def _serve(spec: WorkerSpec, rank: int, commands: Any, results: Any) -> None:
    """A worker process: build, then answer ``run``/``finish`` commands until told to stop."""
    try:
        torch.set_num_threads(1)
        if spec.num_stages > 1:
            dist.init_process_group("gloo", init_method=spec.init_method, rank=rank, world_size=spec.num_stages)
        trainer = _Trainer(spec, rank)
        results.put(("ready", rank, None))
        while True:
            command, arg = commands.get()
            if command == "run":
                num_steps, num_microbatches = arg
                results.put(("times", rank, [trainer.timed_step(num_microbatches) for _ in range(num_steps)]))
            elif command == "finish":
                trainer.save()
                results.put(("done", rank, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
                return
            else:  # "stop"
                return
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_context() -> Any:
    """The multiprocessing context the peers' workers start from: a fork server that imported torch
    and this module once, so that each worker starts in a fraction of a second rather than importing
    torch again (about 2 s of CPU each; a run starts dozens). Nothing the step times see changes:
    each worker is still a process of its own, timed only once it is ready."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__spec__.name if __spec__ else __name__])
    return ctx


class TorchPeer:
    """The parent's handle on one torch peer's worker processes.

    Args:
        num_stages: processes in the pipeline; 1 runs the plain single-process loop.
        schedule: a key of :data:`TORCH_SCHEDULES` or :data:`COMPUTE_ONLY` (ignored for one process).
        state_dir: a private folder for the rendezvous file and the trained parameters.
        timeout: seconds any one command may take before the peer is killed.
        workload: the model and batch; the reference workload by default.
        name: the peer's name; derived from the stages and schedule by default.
        compiled: compile each block with torch.compile on this backend (``"inductor"``,
            ``"aot_eager"``...) before the first step; None: eager.

    Raises:
        ValueError: an unknown schedule.
    """

    def __init__(self, *, num_stages: int, schedule: str, state_dir: str, timeout: float = 600.0,
                 workload: Workload = REFERENCE, name: str | None = None, compiled: str | None = None) -> None:
        if num_stages > 1 and schedule != COMPUTE_ONLY and schedule not in TORCH_SCHEDULES:
            raise ValueError(f"unknown torch schedule {schedule!r}; choose one of {', '.join(TORCH_SCHEDULES)}")
        self.num_stages, self.schedule, self.timeout = num_stages, schedule, timeout
        self.name = "single_process" if num_stages == 1 else f"torch_{schedule}_{num_stages}stages"
        if schedule == COMPUTE_ONLY:
            self.name = f"{COMPUTE_ONLY}_{num_stages}stages"
        self.name = name or self.name
        self._spec = WorkerSpec(num_stages=num_stages, schedule=schedule, state_dir=state_dir, name=self.name,
                                init_method=f"file://{os.path.join(state_dir, self.name + '.store')}",
                                workload=workload, compiled=compiled)
        ctx = worker_context()
        self._results = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(num_stages)]
        self._processes = [ctx.Process(target=_serve, args=(self._spec, rank, self._commands[rank], self._results),
                                       name=f"{self.name}.rank{rank}", daemon=True)
                           for rank in range(num_stages)]
        self._closed = False

    async def start(self) -> None:
        """Starts the workers and waits until every rank has built its stage."""
        for process in self._processes:
            process.start()
        await asyncio.to_thread(self.collect, "ready")

    def send(self, command: str, arg: Any = None) -> None:
        """Sends one command to every rank."""
        for commands in self._commands:
            commands.put((command, arg))

    def collect(self, kind: str) -> list[Any]:
        """Blocks for one ``kind`` reply from every rank; returns them in rank order.

        Raises:
            RuntimeError: a rank failed (with its traceback), died, or the peer timed out.
        """
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout
        while len(replies) < self.num_stages:
            try:
                got, rank, payload = self._results.get(timeout=0.5)
            except queue.Empty:
                if self._closed:  # the parent gave up on this peer while a thread waited here
                    raise RuntimeError(f"{self.name} was closed") from None
                self._check_alive(deadline)
                continue
            if got == "error":
                raise RuntimeError(f"{self.name} rank {rank} failed:\n{payload}")
            assert got == kind, (got, kind)
            replies[rank] = payload
        return [replies[rank] for rank in range(self.num_stages)]

    def _check_alive(self, deadline: float) -> None:
        for process in self._processes:
            if process.exitcode is not None:
                raise RuntimeError(f"{process.name} exited with code {process.exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{self.name} did not answer within {self.timeout:.0f}s")

    async def run(self, num_steps: int, *, micro_batches: int = NUM_MICROBATCHES) -> list[float]:
        """Runs ``num_steps`` steps of ``micro_batches`` each; each step's time is the slowest rank's."""
        self.send("run", (num_steps, micro_batches))
        per_rank = await asyncio.to_thread(self.collect, "times")
        return [max(times) for times in zip(*per_rank)]

    async def finish(self) -> list[int]:
        """Saves the parameters and stops the workers; returns peak RSS per rank (bytes)."""
        self.send("finish")
        return await asyncio.to_thread(self.collect, "done")

    def trained_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's parameters after ``finish``, merged from every rank's slice
        (None for the compute-only peer, which trains on stand-ins)."""
        if self.schedule == COMPUTE_ONLY:
            return None
        state: dict[str, torch.Tensor] = {}
        for rank in range(self.num_stages):
            state.update(torch.load(state_path(self._spec.state_dir, self.name, rank)))
        return state

    async def aclose(self) -> None:
        """Stops the workers (see ``close``) without blocking the event loop."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Tells the workers to stop, waits briefly, then kills any still running (stuck in gloo)."""
        self._closed = True
        self.send("stop")
        deadline = time.monotonic() + 5.0
        for process in self._processes:
            if process.pid is not None:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
                if process.is_alive():
                    process.kill()
                    process.join()
