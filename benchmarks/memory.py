# Run: python -m benchmarks.memory            (add --steps 2 for a quicker look; --only slices|states|checkpointing)
"""Memory: what a stage holds of a model too big for one process, and what activation checkpointing saves.

**Slices.** A model too big to build whole in every stage: 24 ``Linear(2048, 2048)`` (100.7M parameters, 384 MiB
in fp32) trained two steps over 8 stages (one node each, 1F1B, 8 micro-batches of 2 rows),
given two ways: whole (``examples.models:linear_stack``, which every stage builds before it
keeps its slice) and as layer specs (``linear_stack(specs=True)``: each stage builds only
its own 3 layers; ``docs/models.md``), each with SGD and with Adam. Each stage runs in a
process of its own, forked from its node's zygote (torch imported): a stage's *added peak*
is its process's peak RSS over an idle stage's (the same job with ``Linear(4, 4)`` layers,
first, on the same nodes: the stage's own runtime, threads and imports), in slices of the
model (1/8 of it, 48 MiB); ``..._over_zygote`` counts it over the zygote's peak instead.
Parameters and gradients are 2 slices, Adam's two moments 2 more.
``added_peak_slices_{sgd,adam}_8stages``: the largest over the stages, as layer specs;
``..._whole`` the same for the model built whole (9.8 before, for both); ``..._release`` as
layer specs with ``keep_freed_memory=False`` (glibc then gives freed temporaries, such as
each micro-batch's weight gradient before it is added and Adam's ``sqrt`` of its second
moment, back to the kernel instead of keeping up to 1 GiB of them for the next micro-batch).

**DeepSpeed's pipeline engine** on the same model, where ``deepspeed`` is installed (it is
no dependency; ``--only deepspeed`` runs this alone): one process per stage over gloo
(:mod:`benchmarks._deepspeed_peer`), the layers given as ``LayerSpec``s, torch's SGD and
Adam as client optimizers, two steps of 8 micro-batches of 2 rows, each stage's peak RSS
over the same run's with ``Linear(4, 4)`` layers: ``deepspeed_added_peak_slices_{sgd,adam}_8stages``.

**Activation checkpointing.**

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

from benchmarks import _memory_states
from examples import positive_int as count
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


SLICE_STAGES, SLICE_LAYERS, SLICE_DIM = 8, 24, 2048
# torch's CPU Adam makes temporaries of a parameter's size (its second moment's square root and
# quotient); a stage runs it a 256K-element slice at a time (stages.state.chunked_adam, the same
# bits); fused=True (torch's fused CPU kernel, as DeepSpeed users take FusedAdam) makes none.
SLICE_OPTIMIZERS = {"sgd": ("torch.optim:SGD", {"lr": 0.01}), "adam": ("torch.optim:Adam", {"lr": 1e-4}),
                    "adam_fused": ("torch.optim:Adam", {"lr": 1e-4, "fused": True}),
                    "adam_int8": ("torch.optim:Adam", {"lr": 1e-4})}
SLICE_OPTIONS: dict[str, dict[str, Any]] = {"adam_int8": {"optimizer_states": "int8"}}  # Adam's moments in 8 bits


def _status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/{pid}/status has no {field}")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


async def _two_steps(cluster: Any, model_kwargs: dict[str, Any], optimizer: str, keep_freed_memory: bool,
                     inputs: torch.Tensor, targets: torch.Tensor) -> tuple[Any, list[int]]:
    """A job of ``linear_stack(**model_kwargs)`` over the 8 stages, two steps: its last stats and
    the peak RSS of each stage's zygote (rank order)."""
    from actors import NODE, NodeActor

    job = await cluster.train(
        model="examples.models:linear_stack", model_kwargs=model_kwargs,
        loss="torch.nn.functional:mse_loss", optimizer=SLICE_OPTIMIZERS[optimizer],
        pipeline_stages=SLICE_STAGES, micro_batches=8, schedule="1f1b", seed=0,
        partition_method="uniform", threads_per_stage=1, keep_freed_memory=keep_freed_memory,
        **SLICE_OPTIONS.get(optimizer, {}))
    try:
        await job.step(inputs, targets)
        # A stage reports its peak at the barrier, before its optimizer steps: the second step's
        # report holds the first's optimizer step (Adam's moments are made there).
        stats = await job.step(inputs, targets)
        by_node = {n.name: n for n in await cluster.nodes()}
        pids = []
        for rank, node in enumerate(job.nodes):
            described = await cluster.runtime.ref(by_node[node].address, NODE).endpoint(
                NodeActor.describe, timeout=10).call()
            assert described.processes is not None
            pids.append(_status_bytes(_parent(described.processes[f"{job.id}.rank{rank}"]), "VmHWM"))
        return stats, pids
    finally:
        await job.close()


async def measure_slices(optimizer: str, specs: bool, keep_freed_memory: bool = True
                         ) -> tuple[list[float], list[float]]:
    """Each stage's added peak RSS in slices, for two steps of the 24-layer model over 8 stages:
    over an idle stage's (the same job with ``Linear(4, 4)`` layers, on the same nodes), and
    over its node's zygote's."""
    from schedulers import LocalCluster

    slice_bytes = SLICE_LAYERS * (SLICE_DIM * SLICE_DIM + SLICE_DIM) * 4 / SLICE_STAGES
    generator = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randn(16, SLICE_DIM, generator=generator) for _ in range(2))
    async with LocalCluster(nodes=SLICE_STAGES) as cluster:
        idle, _ = await _two_steps(cluster, {"layers": SLICE_LAYERS, "dim": 4, "specs": True}, optimizer,
                                   keep_freed_memory, inputs[:, :4], targets[:, :4])
        stats, zygotes = await _two_steps(cluster, {"layers": SLICE_LAYERS, "dim": SLICE_DIM, "specs": specs}, optimizer,
                                       keep_freed_memory, inputs, targets)
        over_idle = [round((peak - base) / slice_bytes, 2) for peak, base in zip(stats.peak_rss_bytes, idle.peak_rss_bytes)]
        over_zygote = [round((peak - zygote) / slice_bytes, 2) for peak, zygote in zip(stats.peak_rss_bytes, zygotes)]
    return over_idle, over_zygote


def slices_summary() -> dict[str, Any]:
    summary: dict[str, Any] = {}
    variants = {"": (True, True), "_release": (True, False), "_whole": (False, True)}
    for optimizer in SLICE_OPTIMIZERS:
        for suffix, (specs, keep) in variants.items():
            if optimizer in ("adam_fused", "adam_int8") and suffix:  # as layer specs only: the others are Adam's
                continue
            added, over_zygote = run(measure_slices(optimizer, specs, keep))
            label = ("layer specs" if specs else "whole model") + ("" if keep else ", keep_freed_memory=False")
            print(f"{optimizer:>4} {label:<38} added peak per stage, in slices: " + " / ".join(f"{a:.1f}" for a in added)
                  + " (over the zygote: " + " / ".join(f"{a:.1f}" for a in over_zygote) + ")")
            summary[f"added_peak_slices_{optimizer}_{SLICE_STAGES}stages{suffix}_over_zygote"] = max(over_zygote)
            summary[f"added_peak_slices_{optimizer}_{SLICE_STAGES}stages{suffix}"] = max(added)
            summary[f"added_peak_slices_{optimizer}_{SLICE_STAGES}stages{suffix}_per_stage"] = added
    return summary


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
    parser.add_argument("--steps", type=count, default=3,
                        help="steps per setting (the first one's time is not counted)")
    parser.add_argument("--interval2", action="store_true", help="also activation_checkpointing=2, fused")
    parser.add_argument("--only", choices=("slices", "checkpointing", "states", "deepspeed"),
                        help="run one part only (deepspeed: its pipeline engine's slices alone, where it is installed)")
    parser.add_argument("--loss-steps", type=count, default=300, help="GPT steps per setting in the states part")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    started = time.perf_counter()
    summary: dict[str, Any] = {}
    if args.only in (None, "slices"):
        summary.update(slices_summary())
    if args.only in (None, "slices", "deepspeed"):
        summary.update(_memory_states.deepspeed_peer(SLICE_STAGES, SLICE_LAYERS, SLICE_DIM))
        for optimizer in ("sgd", "adam"):  # ours over DeepSpeed's, where both ran (below 1: less memory)
            ours, theirs = (summary.get(f"{who}added_peak_slices_{optimizer}_{SLICE_STAGES}stages")
                            for who in ("", "deepspeed_"))
            if ours is not None and theirs:
                summary[f"added_peak_{optimizer}_vs_deepspeed_{SLICE_STAGES}stages"] = round(ours / theirs, 3)
    if args.only in (None, "states"):
        summary.update(run(_memory_states.state_bytes()))
        summary.update(run(_memory_states.stash()))
        summary.update(run(_memory_states.losses(args.loss_steps)))
    if args.only in (None, "checkpointing"):
        fused = {**FUSED, **({"interval2": 2} if args.interval2 else {})}
        results = {result.name: result for group, fusion in ((fused, True), (UNSPLIT, False))
                   for result in run(measure(group, fusion, args.steps))}
        print_table(results)
        summary.update(summarize(results))
    summary.update(steps=args.steps, wall_s=round(time.perf_counter() - started, 1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
