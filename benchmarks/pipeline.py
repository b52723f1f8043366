# Run: python -m benchmarks.pipeline            (add --steps 4 --stages 2 for a quick look)
"""The reference workload under actorpipe, torch.distributed.pipelining and one process.

Peers, all measured in one run on the reference workload (docs/design.md):
- one process: the plain full-batch training step, one thread;
- ``torch.distributed.pipelining`` over gloo, one process per rank, 8 micro-batches:
  ``Schedule1F1B``, ``ScheduleGPipe``, and the schedules with two model stages per rank,
  ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``,
  ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``; ``--torch-schedules`` adds
  ``looped_bfs`` (``ScheduleLoopedBFS``), which also runs here but is left out by
  default: it was never torch's fastest, and it costs four more processes (about
  1.5 GB) in the 4-stage group, which already holds about 16 GB;
- actorpipe: a job per schedule on a ``LocalCluster`` with one node per stage (one cluster
  a group, which its peers' jobs share: each job's stages are processes of its own), schedules ``1f1b``, ``gpipe``,
  ``interleaved`` (2 virtual stages), ``zero_bubble``, and the V-shaped ``zbv`` and
  ``dualpipev`` (two model stages per rank, as torch's); at 2 stages also 1F1B over
  torch.distributed (``dist_vs_stream``), as ZeroMQ actor messages instead of the default
  stream (``stream_vs_zmq``), and 1F1B with plain autograd and glibc's default
  allocator (``defaults_vs_plain``: what ``gradient_accumulation_fusion`` and
  ``keep_freed_memory`` buy). Each job's first and last stages read the batch where they
  compute, from a data factory (:func:`reference_data`), as torch's ranks and the
  ``compute_only`` processes hold theirs; at 2 stages 1F1B also runs with the batch sent
  by the driver at every step, through the head (``driver_fed_vs_stage_data``: what
  moving 8 MiB twice a step costs);
- the ceiling at 2 stages (``compute_only``): two processes that each compute their
  stage's 8 micro-batches back to back at the same time, with nothing sent and no
  bubble. A 1F1B pipeline cannot beat it; ``*_vs_compute_only`` says how close each
  pipeline comes;
- compiled peers at 2 stages (unless ``--skip-compiled``): 1F1B of actorpipe with
  ``torch_compile`` and of torch with every block compiled in place, both on
  ``--compile-backend`` (inductor by default);
  ``compiled_vs_eager_2stages`` is each one's median step time over its eager 1F1B peer's
  (below 1: compile helps). The warm-up steps pay the compile and are not timed.

``vs_torch_best_Nstages`` is actorpipe's fastest schedule over torch's fastest at N
stages (``actorpipe_best_Nstages`` and ``torch_best_Nstages`` name them). A torch
schedule that fails to start or to run its warm-up steps is dropped from the run with
the reason printed and kept under ``torch_not_run``.

``--blocks N --dim D`` trains a smaller model of the same kind instead (``N`` residual
MLP blocks ``D`` wide on a ``[64, 32, D]`` batch), every peer alike: a run that checks
the plumbing (the test suite's) without paying for the reference model's compute. Its
figures are not the reference workload's; the JSON's ``workload`` says which it was.

The peers run in one group per stage count (each with its own one-process reference),
so that only one group's processes are up at a time. In a group every peer starts and
runs its warm-up steps; then the timed steps run in rounds, each round a few steps of
every peer in a rotated order, so that the machine's noise hits every peer alike. A
step time is the driver's wall time for actorpipe and the slowest rank's (after a
barrier) for torch; samples/s is 64 / the median step time. The trained parameters of
every peer are compared with its group's one process afterwards. The last line printed
is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import gc
import importlib.util
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from benchmarks._torch_pipelining import (
    BATCH_SHAPE,
    COMPUTE_ONLY,
    DIM,
    NUM_BLOCKS,
    NUM_MICROBATCHES,
    REFERENCE,
    SCHEDULES,
    TORCH_SCHEDULES,
    TorchPeer,
    Workload,
    reference_batch,
)
from stages.sections import Communication
from transport.loop import run

DEFAULT_TRANSPORT: str = Communication().transport  # what a job uses unless told

BATCH_SIZE = BATCH_SHAPE[0]
ACTORPIPE_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zero_bubble", "zbv", "dualpipev")
DEFAULT_TORCH_SCHEDULES = ("1f1b", "gpipe", "interleaved", "interleaved_zb", "zbv", "dualpipev")
MAX_REL_DIFF = 1e-4  # float32 reassociation across micro-batches stays far below this


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PeerResult:
    """What one peer measured: step times, peak RSS per rank, distance from one process."""

    name: str
    num_stages: int
    schedule: str
    step_times_s: list[float]
    peak_rss_bytes: list[int]
    bubble_fraction: float | None = None
    max_rel_diff: float | None = None

    @property
    def samples_per_s(self) -> float:
        return BATCH_SIZE / statistics.median(self.step_times_s)


DATA_MODULE = "benchmarks.pipeline"  # where the nodes find reference_data (this module, by its import name)


def reference_data(batch_shape: Sequence[int]) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """A data factory (a job's ``data=``) whose every step's batch is :func:`reference_batch`'s for
    ``batch_shape``, made once where the stage runs: the stages read the batch where they compute,
    as torch's ranks hold theirs, instead of the driver sending it each step."""
    inputs, targets = reference_batch(Workload(batch_shape=tuple(batch_shape)))
    return lambda step: (inputs, targets)


class Peer(Protocol):
    """One contender, kept up for the whole run so that its rounds can interleave."""

    name: str
    num_stages: int
    schedule: str

    async def start(self) -> None: ...
    async def run(self, num_steps: int) -> list[float]: ...
    async def finish(self) -> list[int]: ...
    def trained_state(self) -> dict[str, torch.Tensor] | None: ...
    async def aclose(self) -> None: ...


class SharedClusters:
    """The ``LocalCluster``s a group's actorpipe peers share, one per node count: each peer's job
    is its own (its stages' processes, forked for it), only the nodes are common, so a group starts
    one cluster rather than one a peer (seconds each). Closed after every peer's job."""

    def __init__(self) -> None:
        self._clusters: dict[tuple[int, str], Any] = {}
        self._stack = contextlib.AsyncExitStack()

    async def get(self, nodes: int, allow: str) -> Any:
        from schedulers import LocalCluster

        key = (nodes, allow)
        if key not in self._clusters:
            cluster = LocalCluster(nodes=nodes, allow=[allow, DATA_MODULE])
            self._clusters[key] = await self._stack.enter_async_context(cluster)
        return self._clusters[key]

    async def aclose(self) -> None:
        await self._stack.aclose()


class ActorpipePeer:
    """A ``LocalCluster`` of ``num_stages`` nodes training ``workload`` (the reference one
    by default) as one job; ``job`` is that job once started. With ``clusters`` set (as
    :func:`measure_group` sets it) the cluster is the group's shared one."""

    def __init__(
        self,
        *,
        num_stages: int,
        schedule: str,
        transport: str = DEFAULT_TRANSPORT,
        tensor_parallel: int = 1,
        data_parallel: int = 1,
        micro_batches: int = NUM_MICROBATCHES,
        name: str | None = None,
        options: dict[str, Any] | None = None,
        workload: Workload = REFERENCE,
        data_on_stages: bool = False,
    ) -> None:
        self.num_stages, self.schedule, self.transport = num_stages, schedule, transport
        self.data_on_stages = data_on_stages  # the stages read the batch (reference_data), else the driver sends it
        self.options = dict(options or {})  # more cluster.train arguments
        self.tensor_parallel, self.data_parallel, self.micro_batches = tensor_parallel, data_parallel, micro_batches
        suffix = "" if transport == DEFAULT_TRANSPORT else f"_{transport}"
        self.name = name or f"actorpipe_{schedule}_{num_stages}stages{suffix}"
        self.workload = workload
        self.inputs, self.targets = reference_batch(workload)
        self.bubble_fractions: list[float] = []
        self._stack = contextlib.AsyncExitStack()
        self.job: Any = None
        self.last_stats: Any = None
        self._state: dict[str, torch.Tensor] | None = None
        self.clusters: SharedClusters | None = None

    async def start(self) -> None:
        """Starts the cluster (unless shared) and submits the job (closes its own cluster again if that fails)."""
        try:
            clusters = self.clusters
            if clusters is None:  # a cluster of its own: closed with this peer
                clusters = SharedClusters()
                self._stack.push_async_callback(clusters.aclose)
            nodes = self.num_stages * self.tensor_parallel * self.data_parallel
            cluster = await clusters.get(nodes, self.workload.module)
            self.job = await cluster.train(
                model=self.workload.model, model_kwargs=dict(self.workload.model_kwargs),
                loss="torch.nn.functional:mse_loss", optimizer=("torch.optim:SGD", {"lr": 0.01}),
                pipeline_stages=self.num_stages, tensor_parallel=self.tensor_parallel,
                data_parallel=self.data_parallel, schedule=self.schedule, micro_batches=self.micro_batches,
                seed=0, transport=self.transport, **self._data(), **self.options)
            self._stack.push_async_callback(self.job.close)
        except BaseException:
            await self._stack.aclose()
            raise

    def _data(self) -> dict[str, Any]:
        """The job's data factory, when the stages read the batch themselves."""
        if not self.data_on_stages:
            return {}
        return {"data": f"{DATA_MODULE}:reference_data",
                "data_kwargs": {"batch_shape": list(self.workload.batch_shape)}}

    async def run(self, num_steps: int) -> list[float]:
        """Runs ``num_steps`` steps; returns the driver's wall time of each."""
        times = []
        for _ in range(num_steps):
            start = time.perf_counter()
            batch = () if self.data_on_stages else (self.inputs, self.targets)
            self.last_stats = await self.job.step(*batch)
            times.append(time.perf_counter() - start)
            self.bubble_fractions.append(float(self.last_stats.bubble_fraction))
        return times

    async def run_ahead(self, num_steps: int) -> float:
        """``num_steps`` steps as one run (``job.run``: the stages read the batch, and each step's orders
        go out while the step before finishes); the run's seconds per step, on the head's clock.

        Raises:
            RuntimeError: the run did not do them all.
        """
        assert self.data_on_stages, "a run reads the job's data factory"
        await self.job.run(num_steps)
        info = await self.job.wait()  # no polling: the head answers once, when the run ends
        assert info is not None, "a run was started"
        description = await self.job.describe()
        if info.error is not None or info.done != num_steps:
            raise RuntimeError(f"{self.name}: the run did {info.done} of {num_steps} steps: {info.error}")
        self.last_stats = description.last_stats
        return float(info.elapsed_s) / num_steps

    async def finish(self) -> list[int]:
        """Gathers the trained model (where the job offers it); returns peak RSS per stage."""
        if hasattr(self.job, "state_dict"):
            self._state = dict(await self.job.state_dict())
        return [int(rss) for rss in self.last_stats.peak_rss_bytes]

    def trained_state(self) -> dict[str, torch.Tensor] | None:
        return self._state

    async def aclose(self) -> None:
        await self._stack.aclose()
        # The parameters serve the exactness check, made before the peer closes; kept,
        # they would hold the whole model in the driver for each closed peer.
        self._state = None


def actorpipe_missing() -> str | None:
    """Why the actorpipe peer cannot run in this tree yet, or None when it can."""
    if importlib.util.find_spec("examples.models") is None:
        return "examples/models.py does not exist yet"
    try:
        from schedulers import Cluster
    except ImportError as exc:
        return f"the job API does not import: {exc}"
    if not hasattr(Cluster, "train"):
        return "schedulers.Cluster.train does not exist yet"
    return None


def workload_of(args: argparse.Namespace) -> Workload:
    """The model every peer trains: the reference workload, or ``--blocks`` x ``--dim`` of its kind."""
    if (args.blocks, args.dim) == (NUM_BLOCKS, DIM):
        return REFERENCE
    return Workload(model_kwargs={"blocks": args.blocks, "dim": args.dim},
                    batch_shape=(*BATCH_SHAPE[:-1], args.dim))


def make_groups(args: argparse.Namespace, state_dir: str) -> list[list[Peer]]:
    """Every peer the flags ask for, in one group per stage count; each group's first
    peer is its own one-process reference (the others' exactness is checked against it)."""
    workload = workload_of(args)
    groups: list[list[Peer]] = []
    for num_stages in args.stages:
        # Each group's reference trains as many steps as its peers; they pool as "single_process".
        peers: list[Peer] = [TorchPeer(num_stages=1, schedule="-", state_dir=state_dir, workload=workload,
                                       name=f"single_process.{num_stages}stages")]
        if num_stages == 2 and not args.skip_variants:
            # The ceiling: each stage's micro-batches computed back to back on both cores at
            # once, with no pipeline (no bubble, no transfers).
            peers.append(TorchPeer(num_stages=2, schedule=COMPUTE_ONLY, state_dir=state_dir, workload=workload))
        if not args.skip_torch:
            peers += [TorchPeer(num_stages=num_stages, schedule=schedule, state_dir=state_dir, workload=workload)
                      for schedule in args.torch_schedules]
        if not args.skip_actorpipe:
            peers += [ActorpipePeer(num_stages=num_stages, schedule=schedule, workload=workload, data_on_stages=True)
                      for schedule in args.actorpipe_schedules]
        if num_stages == 2 and not args.skip_compiled:
            # Each block compiled (torch.compile), against the same schedule eager.
            if not args.skip_torch and "1f1b" in args.torch_schedules:
                peers.append(TorchPeer(num_stages=2, schedule="1f1b", state_dir=state_dir, workload=workload,
                                       name="torch_1f1b_2stages_compiled", compiled=args.compile_backend))
            if not args.skip_actorpipe and "1f1b" in args.actorpipe_schedules:
                peers.append(ActorpipePeer(num_stages=2, schedule="1f1b", name="actorpipe_1f1b_2stages_compiled",
                                           options={"torch_compile": {"backend": args.compile_backend}},
                                           workload=workload, data_on_stages=True))
        if not args.skip_actorpipe and not args.skip_variants and num_stages == 2:
            # Stage-to-stage tensors over torch.distributed (gloo) instead of the stream...
            peers.append(ActorpipePeer(num_stages=2, schedule="1f1b", transport="dist", workload=workload,
                                       data_on_stages=True))
            # ... and as actor messages through ZeroMQ's I/O threads, the default before the stream.
            peers.append(ActorpipePeer(num_stages=2, schedule="1f1b", transport="zmq", workload=workload,
                                       data_on_stages=True))
            # W batching: each weight's gradient one GEMM over all micro-batches, at the step's tail.
            for schedule in ("1f1b", "zero_bubble"):
                peers.append(ActorpipePeer(num_stages=2, schedule=schedule, name=f"actorpipe_{schedule}_2stages_wbatch",
                                           options={"w_batching": True}, workload=workload, data_on_stages=True))
            # 1F1B with plain autograd and glibc's default allocator: what those two defaults buy.
            peers.append(ActorpipePeer(num_stages=2, schedule="1f1b", name="actorpipe_1f1b_2stages_plain",
                                       options={"gradient_accumulation_fusion": False, "keep_freed_memory": False},
                                       workload=workload, data_on_stages=True))
            # The batch sent by the driver each step (through the head) instead of read on the stages.
            peers.append(ActorpipePeer(num_stages=2, schedule="1f1b", name="actorpipe_1f1b_2stages_driver_fed",
                                       workload=workload))
        groups.append(peers)
    return groups


def split_steps(num_steps: int, num_rounds: int) -> list[int]:
    """``num_steps`` as ``num_rounds`` (or fewer) nearly equal, non-empty blocks."""
    base, extra = divmod(num_steps, num_rounds)
    return [base + (i < extra) for i in range(num_rounds) if base + (i < extra)]


async def run_rounds(peers: list[Any], *, warmup: int, steps: int, rounds: int) -> dict[str, list[float]]:
    """Warm-up, then ``steps`` timed steps of every peer in rounds whose order rotates,
    so that machine noise hits every peer alike; returns each peer's step times."""
    times: dict[str, list[float]] = {peer.name: [] for peer in peers}
    for peer in peers:
        await peer.run(warmup)
    for index, block in enumerate(split_steps(steps, rounds)):
        shift = index % len(peers)
        for peer in peers[shift:] + peers[:shift]:
            times[peer.name] += await peer.run(block)
        print(f"round {index + 1}: {block} steps of each peer done", flush=True)
    return times


async def start_and_warm_up(peers: list[Peer], stack: contextlib.AsyncExitStack, *,
                            warmup: int) -> tuple[list[Peer], dict[str, str]]:
    """Starts each peer and runs its warm-up steps, closing it on ``stack``.

    Returns:
        The peers that run, and why each torch peer that failed did not (its error's
        last line): a torch schedule that cannot run on CPU/gloo is reported, not fatal.
    """
    running: list[Peer] = []
    not_run: dict[str, str] = {}
    for peer in peers:
        print(f"starting {peer.name}", flush=True)
        stack.push_async_callback(peer.aclose)
        try:
            await peer.start()
            await peer.run(warmup)
        except RuntimeError as exc:
            if not peer.name.startswith("torch_"):
                raise
            reason = last_line(str(exc))
            print(f"  {peer.name} did not run: {reason}", flush=True)
            not_run[peer.name] = reason
            await peer.aclose()
            continue
        running.append(peer)
    return running, not_run


def last_line(text: str) -> str:
    """The last non-empty line of a traceback (the exception), at most 300 characters."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else text)[:300]


async def measure_group(peers: list[Peer], *, warmup: int, steps: int,
                        rounds: int) -> tuple[list[PeerResult], dict[str, str]]:
    """Starts one group's peers, runs warm-up then interleaved timed rounds, stops them.

    Returns:
        Each running peer's result, its distance from the group's one process included,
        and why each torch peer that could not run did not.
    """
    async with contextlib.AsyncExitStack() as stack:
        shared = SharedClusters()
        stack.push_async_callback(shared.aclose)  # first in, so last out: after every peer's job is closed
        for peer in peers:
            if isinstance(peer, ActorpipePeer) and peer.clusters is None:
                peer.clusters = shared
        running, not_run = await start_and_warm_up(peers, stack, warmup=warmup)
        times = await run_rounds(running, warmup=0, steps=steps, rounds=rounds)
        results = []
        for peer in running:
            rss = await peer.finish()
            bubbles = getattr(peer, "bubble_fractions", None)
            results.append(PeerResult(
                name=peer.name, num_stages=peer.num_stages, schedule=peer.schedule,
                step_times_s=times[peer.name], peak_rss_bytes=rss,
                bubble_fraction=statistics.median(bubbles[warmup:]) if bubbles and bubbles[warmup:] else None))
        return check_exactness(running, results), not_run


async def measure(groups: list[list[Peer]], *, warmup: int, steps: int,
                  rounds: int) -> tuple[list[PeerResult], dict[str, str]]:
    """Every group in turn (see :func:`measure_group`); the groups' one-process
    references pooled into one ``single_process`` result."""
    results: list[PeerResult] = []
    not_run: dict[str, str] = {}
    for peers in groups:
        gc.collect()  # the last group's trained parameters
        reset_peak_rss()
        group_results, group_not_run = await measure_group(peers, warmup=warmup, steps=steps, rounds=rounds)
        results += group_results
        not_run.update(group_not_run)
    return pool_references(results), not_run


def reset_peak_rss() -> None:
    """Resets this process's peak-RSS mark (Linux; a no-op elsewhere).

    Linux carries a process's ``ru_maxrss`` over ``fork`` and ``exec``: a worker this
    driver starts would report the driver's peak (or, after a reset, its resident size)
    as its own floor. After one group's peers have handed their trained parameters
    back, that peak is far above what a stage process of the next group uses.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)  # glibc: hand the freed heap back first, so the floor is low
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def pool_references(results: list[PeerResult]) -> list[PeerResult]:
    """``single_process``, all the groups' one-process step times pooled, first; then the rest."""
    references = [r for r in results if r.name.startswith("single_process.")]
    pooled = PeerResult(name="single_process", num_stages=1, schedule="-",
                        step_times_s=[t for r in references for t in r.step_times_s],
                        peak_rss_bytes=[max(b for r in references for b in r.peak_rss_bytes)])
    return [pooled, *results]


def max_rel_diff(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest ``|a - b| / |b|`` (Frobenius norms) over the tensors of two state dicts.

    Raises:
        ValueError: the two hold different tensor names.
    """
    if state.keys() != reference.keys():
        raise ValueError(f"different parameter names: {sorted(state.keys() ^ reference.keys())[:6]}")
    return max(float((state[k].float() - reference[k]).norm() / reference[k].norm().clamp_min(1e-30))
               for k in reference)


def check_exactness(peers: list[Peer], results: list[PeerResult]) -> list[PeerResult]:
    """Adds each peer's distance from the first (one process); asserts the torch peers' is float32 noise."""
    reference = peers[0].trained_state()
    assert reference is not None and peers[0].name.startswith("single_process")
    checked = []
    for peer, result in zip(peers, results):
        state = peer.trained_state()
        diff = None if state is None or peer is peers[0] else max_rel_diff(state, reference)
        if diff is not None and peer.name.startswith("torch_"):
            assert diff < MAX_REL_DIFF, f"{peer.name} trained to other parameters: {diff:.3g} relative"
        checked.append(dataclasses.replace(result, max_rel_diff=diff))
    return checked


def ratio(numerator: PeerResult | None, denominator: PeerResult | None) -> float | None:
    """samples/s of ``numerator`` over ``denominator``'s; None where either did not run."""
    if numerator is None or denominator is None:
        return None
    return round(numerator.samples_per_s / denominator.samples_per_s, 3)


def print_table(results: list[PeerResult]) -> None:
    """One row per peer: throughput, median step, bubble, peak RSS per rank, distance from one process."""
    print(f"\n{'peer':<28} {'stages':>6} {'schedule':>8} {'samples/s':>9} {'median ms':>9} {'bubble':>6} "
          f"{'rel diff':>8}  peak RSS MiB per rank")
    for r in results:
        bubble = "-" if r.bubble_fraction is None else f"{r.bubble_fraction:.2f}"
        diff = "-" if r.max_rel_diff is None else f"{r.max_rel_diff:.1e}"
        rss = " / ".join(f"{b / 2**20:.0f}" for b in r.peak_rss_bytes)
        print(f"{r.name:<28} {r.num_stages:>6} {r.schedule:>8} {r.samples_per_s:>9.1f} "
              f"{statistics.median(r.step_times_s) * 1e3:>9.0f} {bubble:>6} {diff:>8}  {rss}")


def summarize(results: list[PeerResult], stage_counts: list[int]) -> dict[str, Any]:
    """The JSON summary: ratios actorpipe/torch and actorpipe/one process, then each peer's raw figures."""
    by_name = {r.name: r for r in results}
    summary: dict[str, Any] = {}
    for num_stages in sorted(set(stage_counts) | {2, 4}):
        for schedule in SCHEDULES:
            key = f"{schedule}_{num_stages}stages"
            summary[f"vs_torch_{key}"] = ratio(by_name.get(f"actorpipe_{key}"), by_name.get(f"torch_{key}"))
        # Against the one process measured in the same group.
        single = by_name.get(f"single_process.{num_stages}stages")
        summary[f"vs_single_process_{num_stages}stages"] = ratio(by_name.get(f"actorpipe_1f1b_{num_stages}stages"), single)
        # W batching is a setting of any actorpipe schedule (schedule="auto" weighs it): its peers count.
        best = {"actorpipe": fastest(results, "actorpipe", ACTORPIPE_SCHEDULES, num_stages, ("", "_wbatch")),
                "torch": fastest(results, "torch", TORCH_SCHEDULES, num_stages)}
        summary[f"vs_torch_best_{num_stages}stages"] = ratio(best["actorpipe"], best["torch"])
        for name, result in best.items():
            summary[f"{name}_best_{num_stages}stages"] = None if result is None else \
                result.schedule + (" +wbatch" if result.name.endswith("_wbatch") else "")
    summary["dist_vs_stream_1f1b_2stages"] = ratio(by_name.get("actorpipe_1f1b_2stages_dist"),
                                                   by_name.get("actorpipe_1f1b_2stages"))
    summary["stream_vs_zmq_1f1b_2stages"] = ratio(by_name.get("actorpipe_1f1b_2stages"),
                                                  by_name.get("actorpipe_1f1b_2stages_zmq"))
    for name in ("actorpipe", "torch"):
        summary[f"{name}_1f1b_vs_compute_only_2stages"] = ratio(by_name.get(f"{name}_1f1b_2stages"),
                                                                by_name.get(f"{COMPUTE_ONLY}_2stages"))
    # The best actorpipe layout at 2 stages against the per-micro-batch compute alone (goal > 1).
    # Eager layouts only: the ceiling is eager compute (a compiled peer set against it "beat" what no pipeline can).
    two = [r for r in results if r.name.startswith("actorpipe_") and "_2stages" in r.name
           and not r.name.endswith("_compiled")]
    best_two = max(two, key=lambda r: r.samples_per_s, default=None)
    summary["vs_compute_only_2stages"] = ratio(best_two, by_name.get(f"{COMPUTE_ONLY}_2stages"))
    summary["best_actorpipe_layout_2stages"] = best_two.name if best_two is not None else None
    summary["wbatch_vs_plain_zero_bubble_2stages"] = ratio(by_name.get("actorpipe_zero_bubble_2stages_wbatch"),
                                                           by_name.get("actorpipe_zero_bubble_2stages"))
    summary["zero_bubble_vs_torch_1f1b_2stages"] = ratio(by_name.get("actorpipe_zero_bubble_2stages"),
                                                         by_name.get("torch_1f1b_2stages"))
    summary["defaults_vs_plain_1f1b_2stages"] = ratio(by_name.get("actorpipe_1f1b_2stages"),
                                                      by_name.get("actorpipe_1f1b_2stages_plain"))
    summary["driver_fed_vs_stage_data_1f1b_2stages"] = ratio(by_name.get("actorpipe_1f1b_2stages_driver_fed"),
                                                             by_name.get("actorpipe_1f1b_2stages"))
    # Time per step compiled over eager (a ratio of samples/s, eager's over compiled's): below 1, compile helps.
    summary["compiled_vs_eager_2stages"] = {
        name: ratio(by_name.get(f"{name}_1f1b_2stages"), by_name.get(f"{name}_1f1b_2stages_compiled"))
        for name in ("actorpipe", "torch")}
    for r in results:
        summary[f"{r.name}_samples_per_s"] = round(r.samples_per_s, 2)
        summary[f"{r.name}_median_step_ms"] = round(statistics.median(r.step_times_s) * 1e3, 1)
        summary[f"{r.name}_peak_rss_mib"] = [round(b / 2**20) for b in r.peak_rss_bytes]
        if r.bubble_fraction is not None:
            summary[f"{r.name}_bubble_fraction"] = round(r.bubble_fraction, 3)
        if r.max_rel_diff is not None:
            summary[f"{r.name}_max_rel_diff"] = float(f"{r.max_rel_diff:.2g}")
    return summary


def fastest(results: list[PeerResult], name: str, schedules: Iterable[str], num_stages: int,
            variants: Iterable[str] = ("",)) -> PeerResult | None:
    """The fastest of ``name``'s peers that ran one of ``schedules`` at ``num_stages`` with
    default options or one of ``variants`` (a name's suffix, e.g. ``_wbatch``; others such as
    ``_dist`` or ``_plain`` do not count); None if none ran."""
    candidates = {f"{name}_{schedule}_{num_stages}stages{variant}" for schedule in schedules for variant in variants}
    ran = [r for r in results if r.name in candidates]
    return max(ran, key=lambda r: r.samples_per_s, default=None)


def print_ratios(summary: dict[str, Any]) -> None:
    """The ratios, one a line, before the JSON."""
    print()
    for key, value in summary.items():
        if key.startswith("vs_") or "_vs_" in key:
            values = value.items() if isinstance(value, dict) else [("", value)]
            shown = ", ".join(f"{name} {'-' if v is None else f'{v:.3f}x'}".strip() for name, v in values)
            print(f"{key:<28} {shown}")


def print_not_run(not_run: dict[str, str], args: argparse.Namespace) -> None:
    """A line per torch schedule that did not run and why, or one saying every one ran."""
    print()
    for name, reason in not_run.items():
        print(f"{name} did not run on CPU/gloo: {reason}")
    if not not_run and not args.skip_torch:
        classes = ", ".join(TORCH_SCHEDULES[s].class_name for s in args.torch_schedules)
        print(f"every torch schedule asked for ran on CPU/gloo at {args.stages} stages: {classes}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per peer")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per peer first")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds the timed steps are split into")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="pipeline stage counts")
    parser.add_argument("--torch-schedules", nargs="+", choices=list(TORCH_SCHEDULES),
                        default=list(DEFAULT_TORCH_SCHEDULES), metavar="NAME",
                        help=f"torch's schedules to run, of {' '.join(TORCH_SCHEDULES)} "
                             f"(default: {' '.join(DEFAULT_TORCH_SCHEDULES)})")
    parser.add_argument("--actorpipe-schedules", nargs="+", choices=ACTORPIPE_SCHEDULES,
                        default=list(ACTORPIPE_SCHEDULES), metavar="NAME",
                        help=f"actorpipe's schedules to run (default all: {' '.join(ACTORPIPE_SCHEDULES)})")
    parser.add_argument("--skip-torch", action="store_true", help="no torch.distributed.pipelining peers")
    parser.add_argument("--skip-actorpipe", action="store_true", help="no actorpipe peers")
    parser.add_argument("--skip-variants", action="store_true",
                        help="no compute-only ceiling and no actorpipe variants (dist, W batching, plain) at 2 stages")
    parser.add_argument("--skip-compiled", action="store_true",
                        help="no compiled 1F1B peers (torch.compile per block) at 2 stages")
    parser.add_argument("--compile-backend", default="inductor", choices=("inductor", "aot_eager", "eager"),
                        help="the compiled peers' torch.compile backend (default %(default)s; aot_eager compiles in "
                             "a fraction of the time, to check the plumbing)")
    parser.add_argument("--blocks", type=int, default=NUM_BLOCKS,
                        help=f"residual MLP blocks of the model (default {NUM_BLOCKS}, the reference workload's)")
    parser.add_argument("--dim", type=int, default=DIM,
                        help=f"the model's width and the batch's last dimension (default {DIM}, the reference "
                             "workload's); a smaller model checks the plumbing, not the performance")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        # A warm-up step finds a torch schedule that cannot run before the timed rounds.
        parser.error("--steps, --warmup and --rounds must be >= 1")
    if args.blocks < 1 or args.dim < 1:
        parser.error(f"--blocks and --dim must be >= 1, got {args.blocks} and {args.dim}")
    if any(n < 2 or args.blocks % (2 * n) for n in args.stages):
        # The interleaved schedules hold two model stages per rank.
        parser.error(f"--stages must divide the {args.blocks} blocks into 2 model stages per rank, got {args.stages}")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    missing = None if args.skip_actorpipe else actorpipe_missing()
    if missing:
        print(f"actorpipe peers skipped: {missing}; their figures print as null")
        args.skip_actorpipe = True
    with tempfile.TemporaryDirectory(prefix="actorpipe-bench-") as state_dir:
        groups = make_groups(args, state_dir)
        results, not_run = run(measure(groups, warmup=args.warmup, steps=args.steps, rounds=args.rounds))
    print_table(results)
    summary = summarize(results, args.stages)
    print_ratios(summary)
    print_not_run(not_run, args)
    summary.update(workload={"blocks": args.blocks, "dim": args.dim}, steps=args.steps, warmup=args.warmup,
                   rounds=args.rounds, torch_not_run=not_run,
                   wall_s=round(time.perf_counter() - started, 1), actorpipe_skipped=missing)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
