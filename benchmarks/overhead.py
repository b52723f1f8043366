# Run: python -m benchmarks.overhead            (add --stages 2 --micro-batches 8 --steps 4 for a quick look)
"""Dispatch overhead: the control path alone, actorpipe against torch.distributed.pipelining.

The model does next to no work: 8 layers of ``Linear(4, 4)`` (:func:`tiny_linears`,
160 parameters) on a batch of 64 x 4, so a step's time is what it costs to run the
schedule: dispatching each action, moving the (tiny) activations and gradients, the
barrier and the optimizer step.
``compute_fraction`` says how close to zero the compute is: the whole model's forward
and backward over the batch's micro-batches, timed in this process on one thread,
divided by the stages, over the step time. ``compute_actions_fraction`` is the share
of the step the busiest actorpipe stage spent inside F, I and W actions as it reports
them, which includes handing each to its compute thread and back.

For each stage count (2, 4, 8; one node process per stage) and micro-batch count (8,
16, 32, 64) it runs 1F1B under actorpipe (one ``LocalCluster``; the micro-batches change
with ``job.set``) and torch's ``Schedule1F1B`` over gloo (one process per rank) on the
same model and batch, their rounds interleaved. A step time is the driver's wall time
for actorpipe and the slowest rank's (after a barrier) for torch, as in
``benchmarks.pipeline``. Actorpipe's stages read the batch from a data factory (as
torch's ranks hold theirs), and each configuration times actorpipe twice: steps the
driver calls one by one (``job.step``), and the same steps as one run (``job.run``:
the head takes them from the factory and sends each step's orders while the step
before finishes; the run's time on the head's clock over its steps). Torch's ranks
loop over their steps with no one to answer between two, which is what a run is; the
``run_`` keys compare that.

Per configuration it reports the median step time, the actions each stage runs (from
the compiled programs: F, I, W or B, each send and receive, and the barrier, reduction
and optimizer step) and ``us_per_action``: the step time over the busiest stage's
action count. Torch's ``us_per_action`` divides its step by the same count (the same
work: the same F, B and transfers), so ``vs_torch_overhead`` is the ratio of the two
step times. Growth: a least-squares line ``step = fixed + per_action * actions`` per
stage count, and how ``us_per_action`` changes from the fewest to the most
micro-batches and stages (1.0: flat). With more stage processes than cores the stages
take turns on the cores, so the wall time per action grows with the stages even when
each action costs the same; ``cpu_us_per_action`` (the step time times the cores the
stages can use, ``min(stages, cores)``, over every stage's actions together) is the
figure that stays flat then, and ``cpu_per_action_growth_stages_*`` its ratio.

With more stage processes than cores a step's wall time is bounded by the CPU all its
processes spend, so the CPU is also measured (Linux ``/proc``: the time every thread of
this process and of every process under it ran, over each peer's timed blocks; the
other peer's processes wait on a pipe meanwhile): ``cpu_ms_per_step_*`` and
``torch_cpu_ms_per_step_*`` per configuration, ``vs_torch_cpu`` (the median ratio), and
per stage count a line ``cpu = fixed + per_action * actions`` (``cpu_fit_fixed_ms_*``,
``torch_cpu_fit_fixed_ms_*``). Where a peer's cost grows faster than its actions (torch's
on oversubscribed cores), its fitted fixed part comes out low or negative: compare the
configurations' own figures there.

Headlines: ``overhead_us_per_action`` (actorpipe, median over the configurations),
``vs_torch_overhead`` (actorpipe's driven step over torch's, median over the
configurations; below 1 is less overhead than torch) and ``run_vs_torch_overhead``
(a run's step over torch's), with the fits ``fit_fixed_us_*``, ``run_fit_fixed_us_*`` and
``torch_fit_fixed_us_*``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._torch_pipelining import TorchPeer, Workload, build_model, reference_batch
from benchmarks.pipeline import DEFAULT_TRANSPORT, ActorpipePeer, split_steps
from stages.sections import TRANSPORTS
from transport.loop import run

SCHEDULE = "1f1b"


def tiny_linears(layers: int = 8, dim: int = 4) -> nn.Sequential:
    """``layers`` of ``Linear(dim, dim)``: a pipeline whose compute is next to nothing."""
    return nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))


# The nodes load the model from this module (the peers admit it).
WORKLOAD = Workload(model=f"{__spec__.name if __spec__ else __name__}:tiny_linears",
                    model_kwargs={"layers": 8, "dim": 4}, batch_shape=(64, 4))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ConfigResult:
    """One (stages, micro-batches) configuration: both peers' step times and the programs' sizes."""

    num_stages: int
    micro_batches: int
    actions_per_rank: list[int]
    actorpipe_step_s: list[float]
    torch_step_s: list[float]
    run_step_s: list[float]  # one per timed block: the run's time over its steps
    compute_actions_fraction: float
    compute_s: float  # the whole model's forward and backward over the batch, one thread, no pipeline
    cpu_ms_per_step: dict[str, float] = dataclasses.field(default_factory=dict)  # peer -> measured CPU (Linux)
    num_cores: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)

    @property
    def key(self) -> str:
        return f"{self.num_stages}stages_{self.micro_batches}mb"

    @property
    def actions_per_stage(self) -> int:
        """The busiest stage's action count: the longest program a step waits for."""
        return max(self.actions_per_rank)

    @property
    def actorpipe_ms(self) -> float:
        return statistics.median(self.actorpipe_step_s) * 1e3

    @property
    def torch_ms(self) -> float:
        return statistics.median(self.torch_step_s) * 1e3

    @property
    def run_ms(self) -> float:
        return statistics.median(self.run_step_s) * 1e3

    @property
    def compute_fraction(self) -> float:
        """One stage's share of the compute (an even split) over actorpipe's step time."""
        return self.compute_s / self.num_stages / (self.actorpipe_ms / 1e3)

    @property
    def us_per_action(self) -> float:
        return self.actorpipe_ms * 1e3 / self.actions_per_stage

    @property
    def torch_us_per_action(self) -> float:
        return self.torch_ms * 1e3 / self.actions_per_stage

    @property
    def run_us_per_action(self) -> float:
        return self.run_ms * 1e3 / self.actions_per_stage

    def cpu_us_per_action(self, step_ms: float) -> float:
        """Core time per action: the step times the cores the stages can use, over all their actions."""
        return step_ms * 1e3 * min(self.num_stages, self.num_cores) / sum(self.actions_per_rank)


async def measure_config(actorpipe: ActorpipePeer, torch_peer: TorchPeer, micro_batches: int, *,
                         warmup: int, steps: int, rounds: int) -> ConfigResult:
    """Both peers at ``micro_batches``: warm-up, then ``steps`` timed steps each (and as many in
    runs for actorpipe) in rounds whose order turns."""
    await actorpipe.job.set("micro_batches", micro_batches)
    await actorpipe.run(warmup)  # the first step compiles the new programs
    await actorpipe.run_ahead(warmup)
    await torch_peer.run(warmup, micro_batches=micro_batches)  # the first builds torch's schedule
    times: dict[str, list[float]] = {"actorpipe": [], "torch": [], "run": []}
    spent: dict[str, float] = {"actorpipe": 0.0, "torch": 0.0}
    pids = process_tree()  # both peers' processes (each waits on a pipe while the other runs)
    busy: list[float] = []
    order = ("actorpipe", "torch", "run")
    for index, block in enumerate(split_steps(steps, rounds)):
        for name in order[index % 3:] + order[:index % 3]:
            before = cpu_s(pids) if pids else 0.0
            if name == "torch":
                times[name] += await torch_peer.run(block, micro_batches=micro_batches)
            elif name == "run":
                times[name].append(await actorpipe.run_ahead(block))
            else:
                for step_time in await actorpipe.run(block):
                    times[name].append(step_time)
                    busy.append(max(actorpipe.last_stats.busy_s) / step_time)
            if name in spent and pids:
                spent[name] += cpu_s(pids) - before
    programs = (await actorpipe.job.describe()).programs
    return ConfigResult(num_stages=actorpipe.num_stages, micro_batches=micro_batches,
                        actions_per_rank=[len(program) for program in programs],
                        actorpipe_step_s=times["actorpipe"], torch_step_s=times["torch"], run_step_s=times["run"],
                        compute_actions_fraction=statistics.median(busy), compute_s=model_compute_s(micro_batches),
                        cpu_ms_per_step={name: seconds * 1e3 / steps for name, seconds in spent.items()}
                        if pids else {})


def process_tree(root: int | None = None) -> list[int] | None:
    """Process ``root`` (this one by default) and every process under it (Linux's ``/proc``), or None
    where there is no ``/proc``."""
    try:
        entries = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return None
    parent_of: dict[int, int] = {}
    for pid in entries:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:  # OSError: it ended meanwhile
            stat = f.read()
            parent_of[pid] = int(stat[stat.rindex(")") + 2:].split()[1])  # after the name, which may hold spaces
    tree, grew = [os.getpid() if root is None else root], True
    while grew:
        grew = False
        for pid, parent in parent_of.items():
            if parent in tree and pid not in tree:
                tree.append(pid)
                grew = True
    return tree


def cpu_s(pids: list[int]) -> float:
    """CPU seconds the threads of the processes ``pids`` have run, to the nanosecond (each thread's
    ``schedstat``; ``/proc/PID/stat`` counts in 10 ms ticks). A thread or process that ended counts 0."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
    return total / 1e9


def model_compute_s(micro_batches: int, *, repeats: int = 7) -> float:
    """The whole model's forward and backward over the batch in ``micro_batches``
    micro-batches, in this process on one thread, without a pipeline (median of repeats)."""
    torch.set_num_threads(1)
    model = build_model(WORKLOAD)
    inputs, targets = reference_batch(WORKLOAD)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for x, y in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)):
            (F.mse_loss(model(x), y) / micro_batches).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad()
    return statistics.median(times)


async def measure_stages(num_stages: int, micro_batch_counts: list[int], state_dir: str, *, warmup: int,
                         steps: int, rounds: int, max_step_s: float, transport: str = DEFAULT_TRANSPORT
                         ) -> tuple[list[ConfigResult], list[str]]:
    """Every micro-batch count at ``num_stages``, on one actorpipe cluster and one torch peer.

    Returns:
        The results, and a line saying which micro-batch counts were skipped, if any: those
        above one where a timed step of either peer took longer than ``max_step_s``.
    """
    actorpipe = ActorpipePeer(num_stages=num_stages, schedule=SCHEDULE, micro_batches=micro_batch_counts[0],
                              workload=WORKLOAD, data_on_stages=True, transport=transport)
    torch_peer = TorchPeer(num_stages=num_stages, schedule=SCHEDULE, state_dir=state_dir, workload=WORKLOAD,
                           timeout=120.0)
    results: list[ConfigResult] = []
    skipped: list[str] = []
    async with contextlib.AsyncExitStack() as stack:
        for peer in (actorpipe, torch_peer):
            stack.push_async_callback(peer.aclose)
            print(f"starting {peer.name}", flush=True)
            await peer.start()
        for index, micro_batches in enumerate(micro_batch_counts):
            result = await measure_config(actorpipe, torch_peer, micro_batches, warmup=warmup, steps=steps,
                                          rounds=rounds)
            print(f"{num_stages} stages x {micro_batches:>2} micro-batches: actorpipe {result.actorpipe_ms:7.1f} ms "
                  f"(run {result.run_ms:7.1f} ms), torch {result.torch_ms:7.1f} ms, {result.actions_per_stage} actions "
                  "on the busiest stage", flush=True)
            results.append(result)
            slowest = max(max(result.actorpipe_step_s), max(result.torch_step_s))
            left = micro_batch_counts[index + 1:]
            if slowest > max_step_s and left:
                skipped.append(f"{num_stages} stages x {left} micro-batches: a step at {micro_batches} took "
                               f"{slowest:.2f}s, over --max-step-s {max_step_s:g}")
                break
    return results, skipped


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least squares ``y = a + b * x``; returns ``(a, b)``, None with fewer than two distinct x."""
    if len(set(xs)) < 2:
        return None
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
             / sum((x - mean_x) ** 2 for x in xs))
    return mean_y - slope * mean_x, slope


def growth(results: list[ConfigResult], name: str) -> dict[str, Any]:
    """Fits and ratios of ``name``'s (``actorpipe``, ``run`` or ``torch``) per-action time."""
    prefix = "" if name == "actorpipe" else f"{name}_"
    per_action = "us_per_action" if name == "actorpipe" else f"{name}_us_per_action"
    step_ms = f"{name}_ms"
    out: dict[str, Any] = {}
    for num_stages in sorted({r.num_stages for r in results}):
        group = sorted((r for r in results if r.num_stages == num_stages), key=lambda r: r.micro_batches)
        actions = [r.actions_per_stage for r in group]
        line = fit_line(actions, [getattr(r, step_ms) * 1e3 for r in group])
        if line is not None:
            out[f"{prefix}fit_fixed_us_{num_stages}stages"] = round(line[0], 1)
            out[f"{prefix}fit_us_per_action_{num_stages}stages"] = round(line[1], 1)
            out[f"{prefix}per_action_growth_micro_batches_{num_stages}stages"] = round(
                getattr(group[-1], per_action) / getattr(group[0], per_action), 3)
        cpu = [r.cpu_ms_per_step[name] for r in group if name in r.cpu_ms_per_step]
        cpu_line = fit_line(actions, cpu) if len(cpu) == len(group) else None
        if cpu_line is not None:
            out[f"{prefix}cpu_fit_fixed_ms_{num_stages}stages"] = round(cpu_line[0], 2)
            out[f"{prefix}cpu_fit_ms_per_action_{num_stages}stages"] = round(cpu_line[1], 3)
    for micro_batches in sorted({r.micro_batches for r in results}):
        group = sorted((r for r in results if r.micro_batches == micro_batches), key=lambda r: r.num_stages)
        if len(group) > 1:
            out[f"{prefix}per_action_growth_stages_{micro_batches}mb"] = round(
                getattr(group[-1], per_action) / getattr(group[0], per_action), 3)
            first, last = (r.cpu_us_per_action(getattr(r, step_ms)) for r in (group[0], group[-1]))
            out[f"{prefix}cpu_per_action_growth_stages_{micro_batches}mb"] = round(last / first, 3)
    return out


def summarize(results: list[ConfigResult]) -> dict[str, Any]:
    """The JSON summary: headlines first, then growth, then each configuration's figures."""
    summary: dict[str, Any] = {
        "overhead_us_per_action": round(statistics.median(r.us_per_action for r in results), 1),
        "torch_overhead_us_per_action": round(statistics.median(r.torch_us_per_action for r in results), 1),
        "vs_torch_overhead": round(statistics.median(r.actorpipe_ms / r.torch_ms for r in results), 3),
        "run_vs_torch_overhead": round(statistics.median(r.run_ms / r.torch_ms for r in results), 3),
        "cpu_us_per_action": round(statistics.median(r.cpu_us_per_action(r.actorpipe_ms) for r in results), 1),
        "torch_cpu_us_per_action": round(statistics.median(r.cpu_us_per_action(r.torch_ms) for r in results), 1),
        "compute_fraction": round(statistics.median(r.compute_fraction for r in results), 3),
        "compute_actions_fraction": round(statistics.median(r.compute_actions_fraction for r in results), 3),
    }
    measured = [r for r in results if r.cpu_ms_per_step]
    if measured:
        summary["vs_torch_cpu"] = round(statistics.median(
            r.cpu_ms_per_step["actorpipe"] / r.cpu_ms_per_step["torch"] for r in measured), 3)
    summary |= growth(results, "actorpipe") | growth(results, "run") | growth(results, "torch")
    for r in results:
        summary[f"overhead_us_per_action_{r.key}"] = round(r.us_per_action, 1)
        summary[f"torch_overhead_us_per_action_{r.key}"] = round(r.torch_us_per_action, 1)
        summary[f"vs_torch_overhead_{r.key}"] = round(r.actorpipe_ms / r.torch_ms, 3)
        summary[f"run_vs_torch_overhead_{r.key}"] = round(r.run_ms / r.torch_ms, 3)
        summary[f"cpu_us_per_action_{r.key}"] = round(r.cpu_us_per_action(r.actorpipe_ms), 1)
        summary[f"torch_cpu_us_per_action_{r.key}"] = round(r.cpu_us_per_action(r.torch_ms), 1)
        summary[f"step_ms_{r.key}"] = round(r.actorpipe_ms, 2)
        summary[f"run_step_ms_{r.key}"] = round(r.run_ms, 2)
        summary[f"torch_step_ms_{r.key}"] = round(r.torch_ms, 2)
        if r.cpu_ms_per_step:
            summary[f"cpu_ms_per_step_{r.key}"] = round(r.cpu_ms_per_step["actorpipe"], 2)
            summary[f"torch_cpu_ms_per_step_{r.key}"] = round(r.cpu_ms_per_step["torch"], 2)
        summary[f"actions_per_rank_{r.key}"] = r.actions_per_rank
        summary[f"compute_fraction_{r.key}"] = round(r.compute_fraction, 3)
    return summary


def print_table(results: list[ConfigResult]) -> None:
    """One row per configuration."""
    print(f"\n{'stages':>6} {'micro':>5} {'actions':>7} {'actorpipe ms':>12} {'run ms':>7} {'torch ms':>9} "
          f"{'us/action':>9} {'torch us/action':>15} {'cpu us/action':>13} {'torch':>6} {'vs torch':>8} "
          f"{'compute':>7} {'in F/I/W':>8} {'cpu ms':>7} {'torch':>6}")
    for r in results:
        print(f"{r.num_stages:>6} {r.micro_batches:>5} {r.actions_per_stage:>7} {r.actorpipe_ms:>12.2f} "
              f"{r.run_ms:>7.2f} {r.torch_ms:>9.2f} {r.us_per_action:>9.1f} {r.torch_us_per_action:>15.1f} "
              f"{r.cpu_us_per_action(r.actorpipe_ms):>13.1f} {r.cpu_us_per_action(r.torch_ms):>6.1f} "
              f"{r.actorpipe_ms / r.torch_ms:>7.3f}x {r.compute_fraction:>7.3f} {r.compute_actions_fraction:>8.2f} "
              f"{r.cpu_ms_per_step.get('actorpipe', math.nan):>7.2f} {r.cpu_ms_per_step.get('torch', math.nan):>6.2f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8], help="pipeline stage counts")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16, 32, 64],
                        help="micro-batch counts (each divides the batch of 64)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per peer and configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per peer and configuration first")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds the timed steps are split into")
    parser.add_argument("--transport", choices=TRANSPORTS, default=DEFAULT_TRANSPORT,
                        help="how actorpipe's stages send their boundary values (communication.transport)")
    parser.add_argument("--max-step-s", type=float, default=2.0,
                        help="skip larger micro-batch counts at a stage count once a step took longer")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1 or args.max_step_s <= 0:
        parser.error("--steps, --warmup and --rounds must be >= 1, --max-step-s > 0")
    batch = WORKLOAD.batch_shape[0]
    layers = WORKLOAD.model_kwargs["layers"]
    if any(n < 2 or layers % n for n in args.stages):
        parser.error(f"--stages must divide the {layers} layers into 2 or more stages, got {args.stages}")
    if any(m < 1 or batch % m for m in args.micro_batches):
        parser.error(f"--micro-batches must divide the batch of {batch}, got {args.micro_batches}")
    args.micro_batches = sorted(set(args.micro_batches))
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    results: list[ConfigResult] = []
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="actorpipe-overhead-") as state_dir:
        for num_stages in args.stages:
            done, left_out = run(measure_stages(num_stages, args.micro_batches, state_dir, warmup=args.warmup,
                                                steps=args.steps, rounds=args.rounds, max_step_s=args.max_step_s,
                                                transport=args.transport))
            results += done
            skipped += left_out
    print_table(results)
    for line in skipped:
        print(f"skipped: {line}")
    summary = summarize(results)
    summary.update(skipped=skipped, transport=args.transport, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                   wall_s=round(time.perf_counter() - started, 1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
