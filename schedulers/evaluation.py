"""A job's evaluation: one forward-only pass over a batch (``Job.evaluate``), nothing trained.

DeepSpeed's ``eval_batch`` and torch's ``schedule.eval``: every stage runs its share of
the :func:`~schedulers.schedules.forward_only` programs under ``torch.no_grad``, its
modules in eval mode meanwhile, with the job's transport and codecs; no stash, no
gradient, no tail, and neither the training state nor the data position moves, so an
evaluation fits between any two steps. The loss averages as the job's
``loss_averaging`` says (:func:`~stages.compute.averaging.step_loss`); the last stage's
outputs come back on request, joined in the batch's order. A job with validation data
(the spec's ``evaluation`` section) evaluates on it when no batch is named, and by itself
every ``eval_every`` steps (:mod:`schedulers.self_evaluations`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from actors import StepFailed
from stages.comm.boundary import Payload, pack, unpack
from stages.compute.averaging import step_loss
from stages.compute.metrics import mean_metrics
from schedulers.job_core import JobCore, evaluation_programs
from schedulers.jobs import JobSpec
from schedulers.records import EvalResult
from schedulers.step_path import StepPath
from schedulers.stepping import step_calls

__all__ = ["evaluate", "evaluation_failed", "join_outputs", "on_validation", "validation_calls"]


async def evaluate(job: JobCore, path: StepPath, inputs: Any, targets: Any, *, outputs: bool = False,
                   data_step: int | None = None) -> EvalResult:
    """Evaluates the job's model on a batch, with the job's micro-batches and mesh: the one given; else,
    without ``data_step``, the validation set where the job has one (``evaluation.eval_data``'s batches 0 to
    ``eval_batches - 1``, or with ``eval_batches=0`` one pass over it, every sample once; their loss as one
    batch of them all would average it); else the data factory's batch ``data_step`` (by default the next
    step's). Call under the job's operation lock.

    Raises:
        ValueError: a batch the job cannot split (as for a step), or a ``data_step`` below 0.
        StepFailed, NodeLost: a stage failed, a node was lost or it timed out; nothing changed.
    """
    spec = job.spec
    if data_step is not None and (isinstance(data_step, bool) or not isinstance(data_step, int) or data_step < 0):
        raise ValueError(f"data_step must be an int >= 0, got {data_step!r:.40}")
    validation = on_validation(spec, inputs, targets, data_step)
    count = spec.evaluation.eval_batches if validation else 1  # 0: one pass, its length as the stages find it
    losses: list[float] = []
    items: list[float] = []
    metrics: list[dict[str, float]] = []
    parts: list[Any] = []
    sent = 0
    started = time.perf_counter()
    batch = 0
    while batch < count or not count:
        if validation:
            calls = validation_calls(spec, batch)
        else:
            step = job.applied if data_step is None else data_step
            calls = step_calls(spec, step, inputs, targets, operation="evaluate", data_position=job.data.at(step))
        for call in calls.values():
            call.pop("loss_weights", None)  # the loss is averaged here, from every micro-batch's
            call.update(evaluate=True, keep_outputs=outputs)
            call["micro_batches"] = spec.parallelism.micro_batches  # the count the stage keeps (see step_path)
        try:
            reports = await path.calls.run_programs(job.attempted(), calls, evaluation_programs(spec))
        except StepFailed as failure:
            raise evaluation_failed(failure) from None
        last = [r for rank, r in enumerate(reports) if job.mesh.coords(rank).tensor == 0 and r.losses]
        losses += [loss for r in last for loss in r.losses]
        items += [n for r in last for n in r.items]
        metrics += [named for r in last for named in r.metrics]
        parts += [out for r in last for out in r.outputs or ()]
        sent += sum(n for r in reports for n in r.bytes_sent.values())
        batch += 1
        if not count:
            count = max((r.pass_batches or 0 for r in reports), default=0)
            if not count:
                raise StepFailed("evaluation failed: no stage said how long a pass over the validation set is")
    return EvalResult(loss=step_loss(losses, items, spec.training.loss_averaging == "tokens"), items=float(sum(items)),
                      outputs=join_outputs(parts) if outputs else None, eval_time_s=time.perf_counter() - started,
                      bytes_sent=sent, metrics=mean_metrics(metrics, items), batches=batch)


def on_validation(spec: JobSpec, inputs: Any, targets: Any, data_step: int | None) -> bool:
    """Whether an evaluation so asked is of the job's validation data: no batch, no ``data_step``, and the job
    has one."""
    return inputs is None and targets is None and data_step is None and spec.evaluation.eval_data is not None


def validation_calls(spec: JobSpec, batch: int) -> dict[int, dict[str, Any]]:
    """Each stage actor's order to read batch ``batch`` of the job's validation data (its replica's share)."""
    mesh = spec.mesh
    return {rank: {"data_step": batch, "data_shard": [mesh.coords(rank).data, mesh.data], "eval_data": True}
            for rank in range(mesh.size)}


def evaluation_failed(failure: StepFailed) -> StepFailed:
    """``failure`` (of the stages' forward-only programs), said of the evaluation it failed rather
    than of a step: the same type, details and remote traceback."""
    message = failure.message
    for said in ("step failed", "step timed out", "step aborted"):
        if message.startswith(said):
            message = "evaluation" + message[len("step"):]
            break
    return type(failure)(message, remote_type=failure.remote_type, remote_traceback=failure.remote_traceback,
                         details=failure.details)


def join_outputs(parts: Sequence[Any]) -> Any:
    """Micro-batches' outputs (each a tensor, or a tuple or dict of them) joined along the first dim into
    the batch's; the list itself when they do not join (another structure, or shapes that differ)."""
    if not parts:
        return None
    packed = [pack(part) for part in parts]
    spec = packed[0].spec
    if any(p.spec != spec or len(p.leaves) != len(packed[0].leaves) for p in packed):
        return list(parts)
    try:
        leaves = [torch.cat([p.leaves[i] for p in packed]) for i in range(len(packed[0].leaves))]
    except RuntimeError:
        return list(parts)
    return unpack(Payload(leaves, spec))

