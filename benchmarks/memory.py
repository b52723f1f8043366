# Run: python -m benchmarks.memory            (add --steps 2 for a quicker look)
"""Activation checkpointing on the reference workload: the memory it saves, and what the recompute costs.

The reference workload (docs/design.md) at 4 stages, 1F1B, 8 micro-batches, trained with
``activation_checkpointing`` off and ``True`` (every layer: each block keeps its
input) side by side, each on a fresh ``LocalCluster`` of 4 nodes, their steps taking
turns. Fresh, because peak RSS is a process's peak since it started; side by side,
so that the shared machine's noise hits both alike. Two such pairs run, one after
the other:

- fused weight gradients (the default): a backward whose input gradient leaves the
  rank runs as ``I`` then ``W``, and between the two the micro-batch holds what ``W``
  needs, the linears' inputs (recomputed, with checkpointing) and output gradients;
- ``gradient_accumulation_fusion=False`` (``_unsplit``): one ``B``, nothing held after it.

``--interval2`` adds ``activation_checkpointing=2`` to the first pair: here each
stage's two blocks as one segment, so that a stage keeps only its boundary values.

Per stage: ``peak_stash_bytes`` (activations held for backward at the step's peak:
what autograd saved and the stashed boundary values, parameters and the batch left
out), the stage process's peak RSS (which also holds torch itself, the parameters,
gradients, the allocator's slack, and the whole model every stage builds before it
keeps its slice: that can be the peak) and the median step time (the recompute adds
about one forward). ``checkpointing_stash_ratio`` is the stash bytes of all 4 stages
with ``True`` over those without (fused, the default); ``checkpointing_rss_ratio``
the same for peak RSS. The trained parameters must be bit for bit the same with and
without (``exact``). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from typing import Any

import torch

from benchmarks._torch_pipelining import BATCH_SHAPE, NUM_BLOCKS, NUM_MICROBATCHES, reference_batch
from transport.loop import run

NUM_STAGES = 4
# Groups whose members run side by side, each on its own cluster, their steps alternating,
# so that the machine's noise hits them alike: name -> activation_checkpointing.
FUSED: dict[str, bool | int] = {"off": False, "every_layer": True}
UNSPLIT: dict[str, bool | int] = {"off_unsplit": False, "every_layer_unsplit": True}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """What one setting measured, per stage, and the parameters it trained."""

    name: str
    setting: bool | int
    peak_stash_bytes: list[int]  # the largest over the steps
    peak_rss_bytes: list[int]
    step_times_s: list[float]
    state: dict[str, torch.Tensor]


async def measure(group: dict[str, bool | int], fusion: bool, num_steps: int) -> list[Result]:
    """Trains ``num_steps`` steps of each setting in ``group``, each on a fresh cluster, in turns."""
    from schedulers import LocalCluster

    inputs, targets = reference_batch()
    async with contextlib.AsyncExitStack() as stack:
        jobs = []
        for setting in group.values():
            cluster = await stack.enter_async_context(LocalCluster(nodes=NUM_STAGES))
            job = await cluster.train(
                model="examples.models:residual_mlp", model_kwargs={"blocks": NUM_BLOCKS, "dim": BATCH_SHAPE[-1]},
                loss="torch.nn.functional:mse_loss", optimizer=("torch.optim:SGD", {"lr": 0.01}),
                pipeline_stages=NUM_STAGES, schedule="1f1b", micro_batches=NUM_MICROBATCHES, seed=0,
                activation_checkpointing=setting, gradient_accumulation_fusion=fusion)
            stack.push_async_callback(job.close)
            jobs.append(job)
        stats: list[list[Any]] = [[] for _ in jobs]
        for step in range(num_steps):
            for i in (range(len(jobs)) if step % 2 == 0 else reversed(range(len(jobs)))):
                stats[i].append(await jobs[i].step(inputs, targets))
        states = [dict(await job.state_dict()) for job in jobs]
    return [Result(name=name, setting=setting,
                   peak_stash_bytes=[max(per) for per in zip(*(s.peak_stash_bytes for s in steps))],
                   peak_rss_bytes=list(steps[-1].peak_rss_bytes),
                   step_times_s=[s.step_time_s for s in steps[1:] or steps],  # the first one warms up
                   state=state)
            for (name, setting), steps, state in zip(group.items(), stats, states)]


def ratio(ours: list[int] | float, theirs: list[int] | float) -> float:
    if isinstance(ours, list) and isinstance(theirs, list):
        ours, theirs = sum(ours), sum(theirs)
    assert isinstance(ours, (int, float)) and isinstance(theirs, (int, float))
    return round(ours / theirs, 4) if theirs else float("nan")


def mib(values: list[int]) -> list[float]:
    return [round(v / 2**20, 2) for v in values]


def summarize(results: dict[str, Result]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, result in results.items():
        if name.startswith("off"):
            continue
        off = results["off_unsplit" if name.endswith("_unsplit") else "off"]
        suffix = {"every_layer": "", "every_layer_unsplit": "_unsplit"}.get(name, f"_{name}")
        summary[f"checkpointing_stash_ratio{suffix}"] = ratio(result.peak_stash_bytes, off.peak_stash_bytes)
        summary[f"checkpointing_rss_ratio{suffix}"] = ratio(result.peak_rss_bytes, off.peak_rss_bytes)
        summary[f"checkpointing_step_time_ratio{suffix}"] = ratio(statistics.median(result.step_times_s),
                                                                  statistics.median(off.step_times_s))
    for name, result in results.items():
        summary[f"{name}_peak_stash_mib"] = mib(result.peak_stash_bytes)
        summary[f"{name}_peak_rss_mib"] = mib(result.peak_rss_bytes)
        summary[f"{name}_median_step_ms"] = round(statistics.median(result.step_times_s) * 1e3, 1)
    # Fused and plain weight gradients sum in different orders: each is compared with its own "off".
    summary["exact"] = all(
        torch.equal(value, result.state[key]) for result in results.values()
        for key, value in results["off_unsplit" if result.name.endswith("_unsplit") else "off"].state.items())
    return summary


def print_table(results: dict[str, Result]) -> None:
    print(f"{'activation_checkpointing':<26} {'peak stash MiB per stage':<32} {'peak RSS MiB per stage':<28} step ms")
    for name, result in results.items():
        stash = " / ".join(f"{v:.1f}" for v in mib(result.peak_stash_bytes))
        rss = " / ".join(f"{v:.0f}" for v in mib(result.peak_rss_bytes))
        label = f"{name} ({result.setting})"
        print(f"{label:<26} {stash:<32} {rss:<28} {statistics.median(result.step_times_s) * 1e3:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per setting (the first one's time is not counted)")
    parser.add_argument("--interval2", action="store_true", help="also activation_checkpointing=2, fused")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    started = time.perf_counter()
    fused = {**FUSED, **({"interval2": 2} if args.interval2 else {})}
    results = {result.name: result for group, fusion in ((fused, True), (UNSPLIT, False))
               for result in run(measure(group, fusion, args.steps))}
    print_table(results)
    summary = summarize(results)
    summary.update(steps=args.steps, wall_s=round(time.perf_counter() - started, 1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
