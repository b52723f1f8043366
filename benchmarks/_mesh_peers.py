"""The peers of ``benchmarks.mesh``: an actorpipe job on a (P, T, D) mesh, and the DP reduction.

``MeshPeer`` keeps a ``LocalCluster`` of ``P * T * D`` nodes and one job on it up for
the whole run, like the actorpipe peer of ``benchmarks.pipeline``, so that its timed
steps can interleave with the other peers'. ``measure_reduction`` times the stage
actors' two data-parallel reductions on the reference model's gradients against one
raw gloo ``all_reduce`` of the same bytes, in two spawned processes: the overlapped
one's work at the barrier when nothing was started during backward
(``stages.comm.overlap``: check, all-reduce and divide each bucket, gradients already in
their buckets) and ``stages.comm.parallel.average_gradients`` (copy in, all-reduce, divide,
copy out).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._torch_pipelining import BATCH_SHAPE, NUM_BLOCKS, build_model
from benchmarks.pipeline import ActorpipePeer

# A program with a reduction, to begin the overlapped reduction's step with (no action runs).
_PROGRAM_TEXT = "0F0 0B0 0BARRIER 0REDUCE 0STEP"

MICROBATCH_SIZE = 8  # docs/design.md: 8 micro-batches of 8; each data-parallel replica keeps micro-batches of 8


@dataclasses.dataclass(frozen=True, slots=True)
class MeshShape:
    """A job's mesh: pipeline stages, tensor-parallel and data-parallel degrees."""

    pipeline: int
    tensor: int
    data: int

    @classmethod
    def parse(cls, text: str) -> MeshShape:
        """``"P,T,D"`` to a shape.

        Raises:
            ValueError: not three positive integers, or a batch that does not split.
        """
        try:
            pipeline, tensor, data = (int(part) for part in text.split(","))
        except ValueError:
            raise ValueError(f"a mesh is P,T,D (three integers), got {text!r}") from None
        shape = cls(pipeline, tensor, data)
        if min(pipeline, tensor, data) < 1 or pipeline > NUM_BLOCKS:
            raise ValueError(f"mesh {text!r}: sizes must be >= 1 and P <= {NUM_BLOCKS} blocks")
        if BATCH_SHAPE[0] % (data * MICROBATCH_SIZE):
            raise ValueError(f"mesh {text!r}: the batch of {BATCH_SHAPE[0]} does not split into {data} replicas "
                             f"of micro-batches of {MICROBATCH_SIZE}")
        return shape

    @property
    def size(self) -> int:
        return self.pipeline * self.tensor * self.data

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per replica, so that every micro-batch holds ``MICROBATCH_SIZE`` samples."""
        return BATCH_SHAPE[0] // (self.data * MICROBATCH_SIZE)

    def __str__(self) -> str:
        return f"({self.pipeline},{self.tensor},{self.data})"


def unavailable_reason(exc: BaseException) -> str | None:
    """The message of an error that says a mesh degree is not built yet; None for any other error.

    A tree without tensor parallelism answers ``cluster.train(tensor_parallel=2)`` with a
    ``RemoteError`` saying ``tensor_parallel > 1 is not available yet``; that peer is then
    reported as null rather than failing the run. Every other error is a real failure.
    """
    message = str(getattr(exc, "message", exc))
    if "tensor_parallel" in message and "not available" in message:
        return message.splitlines()[0]
    return None


class MeshPeer(ActorpipePeer):
    """A ``LocalCluster`` of ``P * T * D`` nodes training the reference workload as one 1F1B job.

    ``overlap_reduce=False`` reduces the data-parallel gradients after the barrier (the
    name then ends in ``_barrier``). ``reduce_waits`` gets, per step, the most seconds
    any stage spent on the reduction after the barrier (``StepStats.reduce_wait_s``).
    """

    def __init__(self, shape: MeshShape, *, overlap_reduce: bool = True) -> None:
        suffix = "" if overlap_reduce else "_barrier"
        super().__init__(num_stages=shape.pipeline, schedule="1f1b", tensor_parallel=shape.tensor,
                         data_parallel=shape.data, micro_batches=shape.num_microbatches,
                         name=f"actorpipe_p{shape.pipeline}t{shape.tensor}d{shape.data}{suffix}",
                         options={"overlap_reduce": overlap_reduce})
        self.shape = shape
        self.overlap_reduce = overlap_reduce
        self.reduce_waits: list[float] = []

    async def run(self, num_steps: int) -> list[float]:
        times = []
        for _ in range(num_steps):  # one at a time, to keep each step's stats
            times += await super().run(1)
            self.reduce_waits.append(max(self.last_stats.reduce_wait_s, default=0.0))
        return times


# --- the data-parallel gradient reduction against raw gloo -------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ReductionResult:
    """Median seconds per variant to reduce ``num_bytes`` of gradients: ``raw`` (one all-reduce of
    one flat tensor), ``overlap_<MiB>`` (the overlapped reduction's all-reduces and divisions at
    the barrier), ``checked_<MiB>`` (the same with its NaN check, as a stage runs it) and
    ``bucket_<MiB>`` (``average_gradients``)."""

    num_bytes: int
    median_s: dict[str, float]
    reps: int

    def gbps(self, variant: str) -> float:
        return self.num_bytes / self.median_s[variant] / 1e9


def _reduction_worker(rank: int, store_path: str, bucket_mib: list[int], default_mib: int, reps: int,
                      results: Any) -> None:
    """One of two ranks: times every variant ``reps`` times, rotated; rank 0 reports the slowest rank's medians."""
    from stages.comm.overlap import OverlappedReduction, backward_order
    from stages.comm.parallel import ProcessGroups, average_gradients, start_average
    from stages.program import Action

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        groups = ProcessGroups(data=dist.new_group([0, 1]), tensor=None, data_size=2, tensor_size=1)
        params = list(build_model().parameters())
        generator = torch.Generator().manual_seed(rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        num_floats = sum(p.numel() for p in params)
        flat = torch.randn(num_floats, generator=generator)

        def raw() -> None:
            # Summing doubles the values each rep: 2**(reps + 1) stays far inside float32.
            dist.all_reduce(flat, group=groups.data)

        # The overlapped reduction on a model of its own (its gradients are views of its buckets).
        model = build_model()
        program = [Action.parse(text) for text in _PROGRAM_TEXT.split()]
        def overlapped(mib: int, check_finite: bool) -> OverlappedReduction:
            return OverlappedReduction(backward_order({0: model}), {0: model}, {}, bucket_bytes=mib << 20,
                                       reduce=lambda bucket: start_average(bucket, groups.data, 2),
                                       check_finite=check_finite)
        gradients = [torch.randn(p.shape, generator=generator) for p in model.parameters()]

        def begin(overlap: OverlappedReduction) -> None:
            """Untimed: a step whose backward left these gradients in the buckets and started none."""
            overlap.begin(program)
            for p, grad in zip(model.parameters(), gradients):
                assert p.grad is not None
                p.grad.copy_(grad)

        variants: dict[str, tuple[Any, Any]] = {"raw": (None, raw)}
        for mib in bucket_mib:
            reduction = overlapped(mib, check_finite=False)
            variants[f"overlap_{mib}"] = (functools.partial(begin, reduction), reduction.finish)
            variants[f"bucket_{mib}"] = (None, functools.partial(average_gradients, params, groups, mib << 20))
        # As a stage runs it at the barrier: each bucket checked for NaN before it leaves.
        checked = overlapped(default_mib, check_finite=True)
        variants[f"checked_{default_mib}"] = (functools.partial(begin, checked), checked.finish)
        names = list(variants)
        times: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(reps + 1):  # the first rep warms up and is dropped
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                setup, run = variants[name]
                if setup is not None:
                    setup()
                dist.barrier(group=groups.data)
                start = time.perf_counter()
                run()
                if rep:
                    times[name].append(time.perf_counter() - start)
        # The slowest rank's time per rep: a collective ends when its last member does.
        table = torch.tensor([times[name] for name in names], dtype=torch.float64)
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=groups.data)
        if rank == 0:
            medians = {name: statistics.median(row.tolist()) for name, row in zip(names, table)}
            results.put(("done", rank, (num_floats * 4, medians)))
        else:
            results.put(("done", rank, None))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure_reduction(bucket_mib: list[int], default_mib: int, *, reps: int = 7,
                      timeout: float = 300.0) -> ReductionResult:
    """Times the bucketed DP reduction per bucket size against a raw all-reduce, in two processes
    (and the overlapped one with its NaN check at ``default_mib``).

    Raises:
        RuntimeError: a rank failed (with its traceback), died, or the whole took over ``timeout``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="actorpipe-bench-reduce-") as tmp:
        store = os.path.join(tmp, "store")
        processes = [ctx.Process(target=_reduction_worker, args=(rank, store, bucket_mib, default_mib, reps, results),
                                 name=f"dp_reduce.rank{rank}", daemon=True) for rank in range(2)]
        replies: dict[int, Any] = {}
        try:
            for process in processes:
                process.start()
            replies = _collect(results, processes, time.monotonic() + timeout)
        finally:
            for process in processes:  # a rank left waiting in gloo for a failed peer never returns: kill it
                if process.pid is not None:
                    process.join(timeout=5.0 if len(replies) == len(processes) else 0.0)
                    if process.is_alive():
                        process.kill()
                        process.join()
            results.close()
            results.join_thread()
    num_bytes, medians = replies[0]
    return ReductionResult(num_bytes=num_bytes, median_s=medians, reps=reps)


def _collect(results: Any, processes: list[Any], deadline: float) -> dict[int, Any]:
    replies: dict[int, Any] = {}
    while len(replies) < len(processes):
        try:
            kind, rank, payload = results.get(timeout=0.5)
        except queue.Empty:
            for process in processes:
                if process.exitcode:
                    raise RuntimeError(f"{process.name} exited with code {process.exitcode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError("the reduction benchmark did not finish in time") from None
            continue
        if kind == "error":
            raise RuntimeError(f"dp_reduce rank {rank} failed:\n{payload}")
        replies[rank] = payload
    return replies
