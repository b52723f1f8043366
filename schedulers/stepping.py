"""One step's arithmetic, as pure functions: batches into calls, reports into statistics, failures into errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import math

import torch

from actors import ActorError, NodeLost, NonFiniteError, StageLost, StepFailed
from stages import FinishReport, Mesh, ReduceReport, stage_to_rank, StageReport
from stages.compute.averaging import shard_replicas, step_loss
from schedulers.jobs import JobSpec
from schedulers.records import StepStats

__all__ = ["describe_findings", "key_order", "nonfinite_failed", "nonfinite_findings", "stage_lost", "step_calls", "step_failed",
           "step_stats"]


def step_calls(
    spec: JobSpec, step: int, inputs: Any, targets: Any, *, operation: str = "step", data_position: int | None = None
) -> dict[int, dict[str, Any]]:
    """Each stage actor's ``run_step`` keyword arguments beyond the program: its micro-batches, or the data step
    (``operation``: what the messages call the caller, ``step`` or ``evaluate``; ``data_position``: where a
    dataset's batch of that step begins, :class:`~schedulers.data_positions.DataPositions`).

    Raises:
        ValueError: only one of inputs and targets, neither without a data factory, or a
            batch of fewer samples than ``data_parallel * micro_batches``.
    """
    mesh = spec.mesh
    first, last = (stage_to_rank(s, mesh.pipeline, spec.parallelism.placement) for s in (0, spec.num_model_stages - 1))
    calls: dict[int, dict[str, Any]] = {rank: {} for rank in range(mesh.size)}
    if inputs is None and targets is None:
        if spec.training.data is None:
            raise ValueError(f"{operation}() needs inputs and targets, or a job started with data='pkg.mod:factory'")
        for rank, call in calls.items():
            call["data_step"] = step
            call["data_shard"] = [mesh.coords(rank).data, mesh.data]
            if data_position is not None:
                call["data_position"] = data_position
        return calls
    if inputs is None or targets is None:
        raise ValueError(f"{operation}() takes both inputs and targets, or neither (to read the data factory)")
    # Each data-parallel replica trains on its own shard of the global batch, which its first and last
    # stages receive whole and cut into micro-batches themselves (one tensor on the wire, not one a
    # micro-batch); the weights of those micro-batches come from their sizes.
    input_shards, target_shards, weights = shard_replicas(inputs, targets, mesh.data, spec.parallelism.micro_batches)
    for rank, call in calls.items():
        c = mesh.coords(rank)
        if c.pipeline == first:
            call["inputs"] = input_shards[c.data]
        if c.pipeline == last:
            call["targets"] = target_shards[c.data]
            if weights is not None:
                call["loss_weights"] = weights[c.data]
        if c.pipeline in (first, last):
            call["whole"] = True
    return calls


def step_failed(mesh: Mesh, rank: int, action: str | None, cause: str, traceback: str = "") -> StepFailed:
    """The error a step fails with when stage actor ``rank`` failed at ``action``."""
    where = mesh.describe(rank) + (f" at {action}" if action else "")
    coords = mesh.coords(rank)
    return StepFailed(f"step failed: {where}: {cause}", remote_traceback=traceback,
                      details={"stage": coords.pipeline, "member": rank, "tensor": coords.tensor,
                               "data": coords.data, "action": action, "cause": cause})


def stage_lost(mesh: Mesh, rank: int, lost: ActorError, job: str = "") -> StageLost:
    """The error a job fails with, at the step and at every call after it, once stage actor ``rank``'s
    own process has ended (its node told the head how: ``lost`` is its :class:`~actors.ActorLost`)."""
    coords = mesh.coords(rank)
    how = str(lost.details.get("how") or lost.message)
    head = f"{job} cannot go on: " if job else "step failed: "
    return StageLost(f"{head}{mesh.describe(rank)}'s process {how} (the job's own code, on node "
                     f"{lost.details.get('node', '?')}); the node and other jobs go on: close this job and "
                     "create it again, from a checkpoint (with max_restarts a job rebuilds such a stage itself)",
                     details={"stage": coords.pipeline, "member": rank, "tensor": coords.tensor, "data": coords.data,
                              "action": None, "cause": f"process {how}", "node": lost.details.get("node", "")})


def nodes_lost(job: str, lost: Sequence[str], when: str = "") -> NodeLost:
    """The error a job that may not recover fails with once it has lost ``lost`` (its nodes' names; ``when``:
    what it was doing, as `` before its save after step 4``)."""
    more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
    return NodeLost(f"{job} lost node {lost[0]}{more}{when}; close the job, or start it with max_restarts and a "
                    "spare node to recover",
                    details={"node": lost[0], "job": job, "stage": None, "action": None, "cause": "node lost"})


def nonfinite_findings(
    mesh: Mesh, reports: Sequence[StageReport], reduced: Sequence[ReduceReport]
) -> list[tuple[int, str]]:
    """Every NaN or infinity of the step, as ``(global rank, what)``: losses first, then gradients."""
    found = [(g, f"loss of micro-batch {m} is {loss}") for g, r in enumerate(reports)
             for m, loss in enumerate(r.losses) if not math.isfinite(loss)]
    found += [(g, f"gradient of {name}") for g, r in enumerate(reduced) for name in r.nonfinite]
    return found


def describe_findings(mesh: Mesh, found: Sequence[tuple[int, str]]) -> list[str]:
    """Findings as ``StepStats.nonfinite`` reports them: ``"stage 1 dp 0: gradient of 3.fc1.weight"``."""
    return [f"{mesh.describe(rank)}: {what}" for rank, what in found]


def nonfinite_failed(mesh: Mesh, step: int, found: Sequence[tuple[int, str]]) -> NonFiniteError:
    """The error a step fails with under ``on_nonfinite="raise"``; it names the first finding's stage."""
    lines = describe_findings(mesh, found)
    shown = "; ".join(lines[:5]) + (f"; and {len(lines) - 5} more" if len(lines) > 5 else "")
    rank, what = found[0]
    coords = mesh.coords(rank)
    return NonFiniteError(
        f"step {step} failed: non-finite values, so no stage stepped its optimizer (gradients dropped): {shown}. "
        "Lower the learning rate or check the inputs; on_nonfinite='skip' drops such steps and trains on",
        details={"stage": coords.pipeline, "member": rank, "tensor": coords.tensor, "data": coords.data,
                 "action": "loss" if what.startswith("loss") else "REDUCE", "cause": what, "nonfinite": lines})


def key_order(key: str) -> int:
    """Layer index of a state key; the sort is stable, so each layer keeps its own order."""
    head = key.partition(".")[0]
    return int(head) if head.isdigit() else 1 << 30


def step_stats(
    spec: JobSpec, step: int, reports: Sequence[StageReport], elapsed: float, reduce_bytes: int,
    samples: int | None, nonfinite: Sequence[str] = (), finished: Sequence[FinishReport] = (),
) -> StepStats:
    """The step's statistics from every stage actor's reports (by global rank), before and after the step.

    The learning rates are global rank 0's (pipeline rank 0, replica 0): every stage
    steps the same schedule, so all agree.
    """
    mesh = spec.mesh
    # One loss per replica: the last stage's first tensor-parallel shard reports it.
    losses = [loss for g, r in enumerate(reports) if mesh.coords(g).tensor == 0 for loss in r.losses]
    items = [n for g, r in enumerate(reports) if mesh.coords(g).tensor == 0 for n in r.items]
    span = max(r.elapsed_s for r in reports)
    busy = sum(r.busy_s for r in reports)
    bytes_per_edge: dict[str, int] = {}
    for r in reports:
        for edge, n in r.bytes_sent.items():
            bytes_per_edge[edge] = bytes_per_edge.get(edge, 0) + n
    return StepStats(
        step=step,
        loss=step_loss(losses, items, spec.training.loss_averaging == "tokens"),
        step_time_s=elapsed,
        bubble_fraction=max(0.0, 1.0 - busy / (len(reports) * span)) if span > 0 else 0.0,
        bytes_sent=sum(bytes_per_edge.values()),
        bytes_per_edge=bytes_per_edge,
        peak_stash=[r.peak_stash for r in reports],
        peak_stash_bytes=[r.peak_stash_bytes for r in reports],
        peak_rss_bytes=[r.peak_rss_bytes for r in reports],
        optimizer_state_bytes=[r.optimizer_state_bytes for r in reports],
        gradient_bytes=[r.gradient_bytes for r in reports],
        parameter_bytes=[r.parameter_bytes for r in reports],
        busy_s=[r.busy_s for r in reports],
        devices=[r.device for r in reports],
        codec_stats=_codec_stats(reports),
        reduce_bytes=reduce_bytes,
        samples=samples,
        samples_per_s=samples / elapsed if samples and elapsed > 0 else None,
        schedule=spec.parallelism.schedule,
        micro_batches=spec.parallelism.micro_batches,
        skipped=bool(nonfinite),
        nonfinite=list(nonfinite),
        lr=list(finished[0].lr) if finished else [],
    )


def _codec_stats(reports: Sequence[StageReport]) -> dict[str, dict[str, Any]]:
    """Per edge and direction: codec, bytes on the wire vs raw, and the relative error sent."""
    out: dict[str, dict[str, Any]] = {}
    for r in reports:
        for edge, e in r.codec_stats.items():
            out[edge] = {
                "codec": e["codec"],
                "bytes": e["bytes"],
                "raw_bytes": e["raw_bytes"],
                "ratio": e["bytes"] / e["raw_bytes"] if e["raw_bytes"] else 1.0,
                "rel_error": (e["sq_err"] / e["sq_norm"]) ** 0.5 if e["sq_norm"] > 0 else 0.0,
            }
    return dict(sorted(out.items()))
