"""The torch peers of ``benchmarks.pipeline``: one process, and ``torch.distributed.pipelining``.

Each peer is a group of spawned worker processes (one for the single-process peer, one
per stage for a pipelined one) that build the reference workload (DESIGN.md), then wait
for commands from the parent: ``run`` some steps and report their times, or ``finish``:
save the trained parameters for the exactness check, report peak RSS and exit. The
peers stay up between commands so that ``benchmarks.pipeline`` can interleave their
measurements with actorpipe's: machine noise then hits every peer alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
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

from examples.models import residual_mlp

NUM_BLOCKS = 8
DIM = 512
BATCH_SHAPE = (64, 32, DIM)
NUM_MICROBATCHES = 8
LR = 0.01
SEED = 0
SCHEDULES = ("1f1b", "gpipe")
COMPUTE_ONLY = "compute_only"  # each rank computes its stage's micro-batches, with no transfers


def reference_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The reference inputs and targets: ``randn`` twice after seeding 0 (own generator)."""
    generator = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(BATCH_SHAPE, generator=generator)
    targets = torch.randn(BATCH_SHAPE, generator=generator)
    return inputs, targets


def build_model() -> nn.Sequential:
    """The whole reference model, initialised after ``torch.manual_seed(0)``."""
    torch.manual_seed(SEED)
    return residual_mlp(blocks=NUM_BLOCKS, dim=DIM)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """How a worker process trains: stages (1 means one plain process), schedule, rendezvous."""

    num_stages: int
    schedule: str
    init_method: str
    state_dir: str
    name: str


class _Trainer:
    """One rank's model slice and optimizer; ``timed_step`` runs one optimizer step."""

    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        model = build_model()
        per_stage = NUM_BLOCKS // spec.num_stages
        self.module = model[rank * per_stage:(rank + 1) * per_stage]
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=LR)
        self.inputs, self.targets = reference_batch()
        self.schedule: Any = None
        if spec.schedule == COMPUTE_ONLY:
            # Stand-ins for what a pipeline would hand this stage: an input activation and an
            # output gradient per micro-batch, of the real shapes.
            gen = torch.Generator().manual_seed(SEED + rank)
            micro = (BATCH_SHAPE[0] // NUM_MICROBATCHES, *BATCH_SHAPE[1:])
            self.stand_ins = [(torch.randn(micro, generator=gen), torch.randn(micro, generator=gen))
                              for _ in range(NUM_MICROBATCHES)]
        elif spec.num_stages > 1:
            self.schedule = self._build_schedule()

    def _build_schedule(self) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = PipelineStage(self.module, self.rank, self.spec.num_stages, torch.device("cpu"))
        schedule_class = Schedule1F1B if self.spec.schedule == "1f1b" else ScheduleGPipe
        # scale_grads (the default) averages over micro-batches: the full-batch mean loss.
        return schedule_class(stage, n_microbatches=NUM_MICROBATCHES, loss_fn=F.mse_loss)

    def timed_step(self) -> float:
        """Runs one training step; returns its wall time on this rank (after a barrier)."""
        if self.spec.num_stages > 1:
            dist.barrier()
        start = time.perf_counter()
        if self.spec.schedule == COMPUTE_ONLY:
            self._compute_only()
        elif self.schedule is None:
            F.mse_loss(self.module(self.inputs), self.targets).backward()
        elif self.rank == 0:
            self.schedule.step(self.inputs)
        elif self.rank == self.spec.num_stages - 1:
            self.schedule.step(target=self.targets, losses=[], return_outputs=False)
        else:
            self.schedule.step()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return time.perf_counter() - start

    def _compute_only(self) -> None:
        """This stage's share of a pipelined step without a pipeline: every micro-batch's
        forward and backward back to back, nothing sent or waited for."""
        last = self.rank == self.spec.num_stages - 1
        for x, grad in self.stand_ins:
            x = x.requires_grad_(self.rank > 0)
            out = self.module(x)
            if last:
                (F.mse_loss(out, grad) / NUM_MICROBATCHES).backward()
            else:
                out.backward(grad)

    def save(self) -> None:
        """Writes this rank's trained parameters for the parent's exactness check."""
        torch.save(self.module.state_dict(), state_path(self.spec.state_dir, self.spec.name, self.rank))


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
                results.put(("times", rank, [trainer.timed_step() for _ in range(arg)]))
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


class TorchPeer:
    """The parent's handle on one torch peer's worker processes.

    Args:
        num_stages: processes in the pipeline; 1 runs the plain single-process loop.
        schedule: ``"1f1b"`` or ``"gpipe"`` (ignored for one process).
        state_dir: a private folder for the rendezvous file and the trained parameters.
        timeout: seconds any one command may take before the peer is killed.
    """

    def __init__(self, *, num_stages: int, schedule: str, state_dir: str, timeout: float = 600.0) -> None:
        self.num_stages, self.schedule, self.timeout = num_stages, schedule, timeout
        self.name = "single_process" if num_stages == 1 else f"torch_{schedule}_{num_stages}stages"
        if schedule == COMPUTE_ONLY:
            self.name = f"{COMPUTE_ONLY}_{num_stages}stages"
        self._spec = WorkerSpec(num_stages=num_stages, schedule=schedule, state_dir=state_dir, name=self.name,
                                init_method=f"file://{os.path.join(state_dir, self.name + '.store')}")
        ctx = mp.get_context("spawn")
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

    async def run(self, num_steps: int) -> list[float]:
        """Runs ``num_steps`` steps; each step's time is the slowest rank's."""
        self.send("run", num_steps)
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
