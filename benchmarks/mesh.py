# Run: .venv/bin/python -m benchmarks.mesh          (add --steps 4 --meshes 2,1,1 1,1,2 for a quick look)
"""The reference workload on pipeline x tensor x data meshes against one process.

Peers, all measured in one run on the reference workload (docs/design.md):
- one process: the plain full-batch training step, one thread;
- actorpipe: a ``LocalCluster`` of ``P * T * D`` nodes running one 1F1B job per mesh of
  ``--meshes`` (default (2,1,1), (1,2,1), (1,1,2) and (2,2,1)). Every micro-batch
  holds 8 samples: 8 micro-batches with one replica, 4 per replica with two. With
  data parallelism the replicas reduce their gradients during the last micro-batch's
  backward (``overlap_reduce``, the default); one more peer of the first such mesh
  reduces them after the barrier (``overlap_reduce=False``, ``..._barrier``) unless
  ``--no-barrier-peer``.

Every peer starts and stays up; after the warm-up steps the timed steps run in rounds,
each round a few steps of every peer in a rotated order, so that the machine's noise
hits every peer alike. A step time is the driver's wall time of ``job.step`` for
actorpipe and the step's own wall time for one process; samples/s is 64 / the median
step time. Peak RSS is per rank, by global mesh rank ((d * P + p) * T + t); "rel diff"
is the trained parameters' distance from one process's after the same steps. A mesh whose degree the library does not offer yet (``tensor_parallel > 1``
until it lands) is reported as null with the library's message.

Then the data-parallel gradient reduction alone: two spawned gloo processes reduce the
reference model's 16.8M gradients (67 MB) per bucket size, against one raw
``all_reduce`` of one flat tensor of the same bytes; bandwidth is bytes / median time.
``overlapped`` is the overlapped reduction's work when backward started nothing (each
bucket all-reduced and divided, the gradients already living in the buckets);
``overlapped + NaN check`` adds the check a stage makes on each bucket before it
leaves (during backward, in a step); ``average_gradients`` is the copy-in, all-reduce,
divide, copy-out of the reduction after the barrier.

Keys: ``dp_allreduce_vs_raw_gloo`` is the overlapped reduction's bandwidth at the
default bucket size over raw gloo's (``dp_allreduce_checked_vs_raw_gloo`` with the
check, ``dp_allreduce_vs_raw_gloo_after_barrier`` for ``average_gradients``);
``dp_overlap_fraction`` is the share of that
reduction's time (``dp_reduce_standalone_ms``) that the (1,1,2) job's steps did not
spend waiting for it after the barrier (``dp_reduce_exposed_ms``: per step the
slowest stage's ``StepStats.reduce_wait_s``, median over the timed steps), that is,
the share hidden behind backward. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Protocol

from benchmarks._mesh_peers import MeshPeer, MeshShape, ReductionResult, measure_reduction, unavailable_reason
from benchmarks._torch_pipelining import BATCH_SHAPE, TorchPeer
from benchmarks.pipeline import max_rel_diff, run_rounds
from transport.loop import run

DEFAULT_MESHES = ("2,1,1", "1,2,1", "1,1,2", "2,2,1")
HEADLINE_MESHES = {"pp2": MeshShape(2, 1, 1), "tp2": MeshShape(1, 2, 1), "dp2": MeshShape(1, 1, 2),
                   "pp2tp2": MeshShape(2, 2, 1)}
DEFAULT_BUCKETS_MIB = (4, 25, 100)
BARRIER_SUFFIX = "_barrier"  # a peer reducing after the barrier (overlap_reduce=False)
LABELS = {"overlap": "overlapped", "checked": "overlapped, NaN-checked", "bucket": "average_gradients"}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PeerResult:
    """What one peer measured; ``skipped`` says why a peer that could not run did not."""

    name: str
    shape: MeshShape | None  # None for one process
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    peak_rss_bytes: list[int] = dataclasses.field(default_factory=list)
    bubble_fraction: float | None = None
    max_rel_diff: float | None = None
    skipped: str | None = None
    reduce_wait_s: float | None = None  # median over timed steps of the slowest stage's wait after the barrier

    @property
    def samples_per_s(self) -> float | None:
        return BATCH_SHAPE[0] / statistics.median(self.step_times_s) if self.step_times_s else None

    @property
    def median_step_ms(self) -> float | None:
        return statistics.median(self.step_times_s) * 1e3 if self.step_times_s else None


class Peer(Protocol):
    """One contender, kept up for the whole run so that its rounds can interleave."""

    name: str

    async def start(self) -> None: ...
    async def run(self, num_steps: int) -> list[float]: ...
    async def finish(self) -> list[int]: ...
    def trained_state(self) -> dict[str, Any] | None: ...
    async def aclose(self) -> None: ...


async def start_peers(peers: list[Peer], stack: contextlib.AsyncExitStack) -> dict[str, str]:
    """Starts every peer, closing each on ``stack``; returns why each peer that cannot run did not."""
    skipped: dict[str, str] = {}
    for peer in peers:
        print(f"starting {peer.name}", flush=True)
        try:
            await peer.start()
        except Exception as exc:
            reason = unavailable_reason(exc)
            if reason is None:
                raise
            print(f"  {peer.name} skipped: {reason}", flush=True)
            skipped[peer.name] = reason
            continue
        stack.push_async_callback(peer.aclose)
    return skipped


@contextlib.contextmanager
def cancelled_by_sigterm() -> Iterator[None]:
    """Within the block a SIGTERM cancels the current task, so that its clean-up runs like Ctrl-C's."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    previous = signal.getsignal(signal.SIGTERM)
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)


async def measure(peers: list[Peer], *, warmup: int, steps: int, rounds: int) -> list[PeerResult]:
    """Starts every peer, runs warm-up then interleaved timed rounds, stops them; returns results."""
    with cancelled_by_sigterm():
        return await _measure(peers, warmup=warmup, steps=steps, rounds=rounds)


async def _measure(peers: list[Peer], *, warmup: int, steps: int, rounds: int) -> list[PeerResult]:
    async with contextlib.AsyncExitStack() as stack:
        skipped = await start_peers(peers, stack)
        running = [peer for peer in peers if peer.name not in skipped]
        times = await run_rounds(running, warmup=warmup, steps=steps, rounds=rounds)
        rss = {peer.name: await peer.finish() for peer in running}
        reference = peers[0].trained_state()
        assert reference is not None  # one process always saves its parameters
        results = []
        for peer in peers:
            shape = getattr(peer, "shape", None)
            if peer.name in skipped:
                results.append(PeerResult(name=peer.name, shape=shape, skipped=skipped[peer.name]))
                continue
            bubbles = getattr(peer, "bubble_fractions", None)
            bubbles = bubbles[warmup:] if bubbles else bubbles  # the timed steps', as the times and waits
            waits = getattr(peer, "reduce_waits", [])[warmup:]
            results.append(PeerResult(
                name=peer.name, shape=shape, step_times_s=times[peer.name], peak_rss_bytes=rss[peer.name],
                bubble_fraction=statistics.median(bubbles) if bubbles else None,
                max_rel_diff=None if peer is peers[0] else distance(peer, reference),
                reduce_wait_s=statistics.median(waits) if waits and shape is not None and shape.data > 1 else None))
    return results


def distance(peer: Peer, reference: dict[str, Any]) -> float | None:
    """How far the peer's trained parameters are from one process's (None where it cannot say)."""
    state = peer.trained_state()
    try:
        return None if state is None else max_rel_diff(state, reference)
    except ValueError as exc:  # a state dict with other keys is worth a line, not the run's figures
        print(f"warning: {peer.name}: {exc}", flush=True)
        return None


def ratio(numerator: PeerResult | None, denominator: PeerResult) -> float | None:
    """samples/s of ``numerator`` over ``denominator``'s; None where either did not run."""
    if numerator is None or numerator.samples_per_s is None or denominator.samples_per_s is None:
        return None
    return round(numerator.samples_per_s / denominator.samples_per_s, 3)


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: list[PeerResult]) -> None:
    """One row per peer: throughput, median step, bubble, distance from one process, peak RSS per rank."""
    print(f"\n{'peer':<24} {'(P,T,D)':>7} {'procs':>5} {'samples/s':>9} {'median ms':>9} {'bubble':>6} "
          f"{'rel diff':>8}  peak RSS MiB per rank")
    for r in results:
        rss = " / ".join(f"{b / 2**20:.0f}" for b in r.peak_rss_bytes) if r.peak_rss_bytes else f"({r.skipped})"
        print(f"{r.name:<24} {str(r.shape or '-'):>7} {r.shape.size if r.shape else 1:>5} "
              f"{_cell(r.samples_per_s, '.1f'):>9} {_cell(r.median_step_ms, '.0f'):>9} "
              f"{_cell(r.bubble_fraction, '.2f'):>6} {_cell(r.max_rel_diff, '.1e'):>8}  {rss}")
    crowded = [r for r in results if r.shape and r.shape.size > (os.cpu_count() or 1) and not r.skipped]
    if crowded:
        print(f"note: {', '.join(str(r.shape) for r in crowded)} run more stage processes than this machine's "
              f"{os.cpu_count()} cores (oversubscribed): their figures say little about the mesh itself")


def print_reduction(reduction: ReductionResult, default_mib: int) -> None:
    """One row per variant: median time, bandwidth, and bandwidth against raw gloo."""
    print(f"\n{'DP reduction of ' + format(reduction.num_bytes / 1e6, '.1f') + ' MB, 2 ranks':<52} "
          f"{'median ms':>9} {'GB/s':>6} {'vs raw':>7}")
    raw = reduction.gbps("raw")
    for variant in reduction.median_s:
        kind, _, mib = variant.partition("_")
        label = "raw gloo all_reduce, one tensor" if variant == "raw" else (
            f"{LABELS[kind]}, {mib} MiB buckets"
            + (" (default)" if mib == str(default_mib) else ""))
        print(f"{label:<52} {reduction.median_s[variant] * 1e3:>9.1f} {reduction.gbps(variant):>6.2f} "
              f"{reduction.gbps(variant) / raw:>6.3f}x")


def summarize(results: list[PeerResult], reduction: ReductionResult | None, default_mib: int) -> dict[str, Any]:
    """The JSON summary: the headline ratios first, then each peer's and the reduction's raw figures."""
    single = results[0]
    by_shape = {r.shape: r for r in results if r.shape is not None and not r.name.endswith(BARRIER_SUFFIX)}
    summary: dict[str, Any] = {f"{key}_vs_single": ratio(by_shape.get(shape), single)
                               for key, shape in HEADLINE_MESHES.items()}
    barrier = next((r for r in results if r.name.endswith(BARRIER_SUFFIX)), None)
    if barrier is not None and barrier.shape == HEADLINE_MESHES["dp2"]:
        summary["dp2_barrier_vs_single"] = ratio(barrier, single)
    for r in results:
        if r.shape is not None and r.shape not in HEADLINE_MESHES.values():
            summary[f"{r.name}_vs_single"] = ratio(r, single)
    summary["dp_allreduce_vs_raw_gloo"] = None
    summary["dp_overlap_fraction"] = None
    if reduction is not None:
        raw = reduction.gbps("raw")
        default = f"overlap_{default_mib}"
        summary["dp_allreduce_vs_raw_gloo"] = round(reduction.gbps(default) / raw, 3)
        standalone = reduction.median_s[default]
        overlapped = next((r for r in results if r.shape is not None and r.shape.data > 1
                           and r.reduce_wait_s is not None and not r.name.endswith(BARRIER_SUFFIX)), None)
        if overlapped is not None:
            assert overlapped.reduce_wait_s is not None
            summary["dp_overlap_fraction"] = round(min(1.0, max(0.0, 1 - overlapped.reduce_wait_s / standalone)), 3)
            summary["dp_overlap_mesh"] = str(overlapped.shape)
            summary["dp_reduce_exposed_ms"] = round(overlapped.reduce_wait_s * 1e3, 1)
        summary["dp_reduce_standalone_ms"] = round(standalone * 1e3, 1)
        summary["dp_allreduce_vs_raw_gloo_after_barrier"] = round(
            reduction.gbps(f"bucket_{default_mib}") / raw, 3)
        summary["dp_allreduce_checked_vs_raw_gloo"] = round(reduction.gbps(f"checked_{default_mib}") / raw, 3)
        summary["dp_reduce_bytes"] = reduction.num_bytes
        summary["dp_default_bucket_mib"] = default_mib
        summary["raw_gloo_allreduce_gbps"] = round(raw, 3)
        for variant in reduction.median_s:
            if variant != "raw":
                summary[f"dp_allreduce_gbps_{variant}mib"] = round(reduction.gbps(variant), 3)
                summary[f"dp_allreduce_vs_raw_gloo_{variant}mib"] = round(reduction.gbps(variant) / raw, 3)
    for r in results:
        summary[f"{r.name}_samples_per_s"] = None if r.samples_per_s is None else round(r.samples_per_s, 2)
        summary[f"{r.name}_median_step_ms"] = None if r.median_step_ms is None else round(r.median_step_ms, 1)
        summary[f"{r.name}_peak_rss_mib"] = [round(b / 2**20) for b in r.peak_rss_bytes] or None
        if r.bubble_fraction is not None:
            summary[f"{r.name}_bubble_fraction"] = round(r.bubble_fraction, 3)
        if r.max_rel_diff is not None:
            summary[f"{r.name}_max_rel_diff"] = float(f"{r.max_rel_diff:.2g}")
        if r.skipped is not None:
            summary[f"{r.name}_skipped"] = r.skipped
        if r.reduce_wait_s is not None:
            summary[f"{r.name}_reduce_wait_ms"] = round(r.reduce_wait_s * 1e3, 1)
    return summary


def print_ratios(summary: dict[str, Any]) -> None:
    """The headline ratios, one a line, before the JSON."""
    print()
    for key, value in summary.items():
        if key.endswith("_vs_single") or key in ("dp_allreduce_vs_raw_gloo", "dp_allreduce_vs_raw_gloo_after_barrier",
                                                 "dp_allreduce_checked_vs_raw_gloo"):
            print(f"{key:<38} {'-' if value is None else f'{value:.3f}x'}")
        elif key == "dp_overlap_fraction":
            print(f"{key:<38} {'-' if value is None else f'{value:.3f}'}")


def busy_cores(interval: float = 1.0) -> float | None:
    """How many cores other work kept busy over ``interval`` seconds (Linux ``/proc/stat``), or None."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(t) for t in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(interval)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / max(1, total1 - total0))


def default_bucket_mib() -> int:
    """The bucket size a stage actor reduces with (``JobSpec.bucket_bytes``), in MiB."""
    from schedulers import JobSpec

    default = next(f.default for f in dataclasses.fields(JobSpec) if f.name == "bucket_bytes")
    assert isinstance(default, int)
    return default >> 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per peer")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per peer first")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds the timed steps are split into")
    parser.add_argument("--meshes", nargs="*", default=list(DEFAULT_MESHES), metavar="P,T,D",
                        help="actorpipe meshes to measure (none: one process and the reduction only)")
    parser.add_argument("--skip-reduce", action="store_true", help="no data-parallel reduction benchmark")
    parser.add_argument("--no-barrier-peer", action="store_true",
                        help="no peer that reduces after the barrier (overlap_reduce=False)")
    parser.add_argument("--buckets", type=int, nargs="+", default=list(DEFAULT_BUCKETS_MIB), metavar="MIB",
                        help="bucket sizes for average_gradients (the stage actor's default is always added)")
    parser.add_argument("--reduce-reps", type=int, default=7, help="timed repetitions of each reduction variant")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 0")
    if not 1 <= args.reduce_reps <= 50 or min(args.buckets) < 1:
        parser.error("--reduce-reps must be 1..50 and --buckets >= 1 MiB")
    try:
        args.meshes = list(dict.fromkeys(MeshShape.parse(text) for text in args.meshes))
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main() -> None:
    args = parse_args()
    # A kill unwinds like Ctrl-C, so that every cluster, worker and temp dir is removed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started, busy_at_start = time.perf_counter(), busy_cores()
    crowded = [str(shape) for shape in args.meshes if shape.size > (os.cpu_count() or 1)]
    if crowded:
        print(f"note: {', '.join(crowded)} run more processes than this machine's {os.cpu_count()} cores: "
              "oversubscribed, so expect less from them here than on a machine with a core each", flush=True)
    with tempfile.TemporaryDirectory(prefix="actorpipe-bench-mesh-") as state_dir:
        peers: list[Peer] = [TorchPeer(num_stages=1, schedule="-", state_dir=state_dir)]
        peers += [MeshPeer(shape) for shape in args.meshes]
        data_parallel = [shape for shape in args.meshes if shape.data > 1]
        if data_parallel and not args.no_barrier_peer:
            peers.append(MeshPeer(data_parallel[0], overlap_reduce=False))
        try:
            results = run(measure(peers, warmup=args.warmup, steps=args.steps, rounds=args.rounds))
        except asyncio.CancelledError:  # by SIGTERM; everything is closed by now
            sys.exit(143)
    reduction, default_mib = None, default_bucket_mib()
    if not args.skip_reduce:
        print("timing the data-parallel reduction (2 processes)", flush=True)
        reduction = measure_reduction(sorted(set(args.buckets) | {default_mib}), default_mib, reps=args.reduce_reps)
    print_table(results)
    if reduction is not None:
        print_reduction(reduction, default_mib)
    summary = summarize(results, reduction, default_mib)
    print_ratios(summary)
    if busy_at_start is not None and busy_at_start > 0.25:
        print(f"note: other work kept {busy_at_start:.1f} of {os.cpu_count()} cores busy just before this run: "
              "peers of 2 or more processes feel it most")
    summary.update(steps=args.steps, warmup=args.warmup, rounds=args.rounds, micro_batch_size=8,
                   cpu_count=os.cpu_count(), oversubscribed=crowded, wall_s=round(time.perf_counter() - started, 1),
                   busy_cores_before=None if busy_at_start is None else round(busy_at_start, 2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
