"""A job's evaluations, and the ones it makes by itself (the spec's ``evaluation`` section).

A part of the job's controller (:class:`~schedulers.control.JobController`). Every
evaluation (:func:`schedulers.evaluation.evaluate`: ``job.evaluate``, or one the job
makes by itself) goes to the monitors as ``Eval/loss`` at the steps applied before it and
out as an :class:`~schedulers.events.Evaluated` event. After every ``eval_every`` applied
optimizer steps the job evaluates on its validation data (``eval_data``, the same
``eval_batches`` batches each time) within the hold of the job that took the step, so
nothing comes between the step and its evaluation; a run sends no step ahead of it
(:func:`schedulers.runs.steps_ahead`). A save due after the same step comes after the
evaluation (:class:`BetweenSteps`), as the Trainer evaluates before it saves.

A periodic evaluation that loses a node of a job that may recover (``max_restarts``) is
passed over with a warning: the next step recovers, as it would have without it.

The job's own evaluations are judged by ``metric_for_best`` (the loss, or one of its
``eval_metrics``); the best so far is kept (``best_eval`` in the job's description), and
after ``early_stopping_patience`` of them in a row that did not beat it by more than
``early_stopping_threshold`` the job stops early (the Trainer's ``EarlyStoppingCallback``):
it says so (``EarlyStopped``) and asks its run to stop after this step (``on_early_stop``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from actors import NodeLost, StageLost
from schedulers import evaluation
from schedulers.events import EarlyStopped, Evaluated
from schedulers.job_core import JobCore
from schedulers.monitors import Monitors
from schedulers.records import EvalResult
from schedulers.recovery import may_recover
from schedulers.self_saves import SelfSaves
from schedulers.step_path import StepPath

__all__ = ["BetweenSteps", "SelfEvaluations"]

log = logging.getLogger(__name__)


class SelfEvaluations:
    """One job's evaluations, recorded by its ``monitors`` (None: none), and its own every ``eval_every`` steps."""

    def __init__(self, job: JobCore, path: StepPath, monitors: Monitors | None) -> None:
        self.job = job
        self.path = path
        self.monitors = monitors
        self._evaluated_at = (0, 0)  # (loads, applied steps) of the last periodic evaluation (none before a step)
        self.last: Evaluated | None = None  # the last evaluation, as told (the job's description shows it)
        self.best: Evaluated | None = None  # the best of the job's own evaluations by metric_for_best
        self.stale = 0  # the job's own evaluations since the best, none of them better
        self.on_early_stop: Callable[[], None] = lambda: None  # the controller's: the run stops after this step

    def eval_point(self, applied: int) -> bool:
        """Whether the job evaluates itself once ``applied`` optimizer steps are applied."""
        every = self.job.spec.evaluation.eval_every
        return every > 0 and applied % every == 0 and (self.job.loads, applied) != self._evaluated_at

    @property
    def stop_early(self) -> bool:
        """Whether the job's own evaluations have gone ``early_stopping_patience`` in a row without beating the best."""
        patience = self.job.spec.evaluation.early_stopping_patience
        return bool(patience) and self.stale >= patience

    async def evaluate(self, inputs: Any = None, targets: Any = None, outputs: bool = False,
                       data_step: int | None = None, *, periodic: bool = False) -> EvalResult:
        """:func:`schedulers.evaluation.evaluate`, recorded and told; the caller holds the job.

        Raises:
            as :func:`schedulers.evaluation.evaluate`.
        """
        job = self.job
        validation = evaluation.on_validation(job.spec, inputs, targets, data_step)
        result = await evaluation.evaluate(job, self.path, inputs, targets, outputs=outputs, data_step=data_step)
        if self.monitors is not None:  # at the steps applied before it (see schedulers.monitors)
            self.monitors.record_evaluation(result, job.applied)
        self.last = Evaluated(time=time.time(), job=job.id, step=job.applied, loss=result.loss, items=result.items,
                              batches=result.batches,
                              eval_time_s=result.eval_time_s, periodic=periodic, validation=validation,
                              metrics=result.metrics)
        job.publish(self.last)
        return result

    async def evaluate_if_due(self) -> EvalResult | None:
        """Evaluates on the validation data where the steps applied so far make an evaluation point; the
        caller holds the job (``JobCore.operation``), the one it took its step in. Its result, or None:
        none was due, or it was passed over.

        Raises:
            StepFailed, NodeLost: the evaluation failed (the step before it was applied); a run ends with it.
        """
        job, applied = self.job, self.job.applied
        if not self.eval_point(applied):
            return None
        self._evaluated_at = (job.loads, applied)  # once per point, whoever asks (a step and a run that both ask)
        try:
            result = await self.evaluate(periodic=True)
        except (NodeLost, StageLost) as lost:
            if not may_recover(job):
                raise
            log.warning("%s: the evaluation after step %d lost a stage (%s); the next step recovers", job.id, applied,
                        lost)
            return None
        self._judge()
        return result

    def _judge(self) -> None:
        """Weighs the last evaluation (the job's own) against the best so far, and stops early where due.

        Raises:
            ValueError: ``metric_for_best`` is neither the loss nor one of the evaluation's metrics.
        """
        rules, last = self.job.spec.evaluation, self.last
        assert last is not None
        value = _judged(last, rules.metric_for_best)
        best = None if self.best is None else _judged(self.best, rules.metric_for_best)
        margin = rules.early_stopping_threshold
        if best is None or (value > best + margin if rules.greater_is_better else value < best - margin):
            self.best, self.stale = last, 0
        else:
            self.stale += 1
        patience = rules.early_stopping_patience
        if self.stop_early and self.best is not None:
            self.job.publish(EarlyStopped(job=self.job.id, step=last.step, metric=rules.metric_for_best,
                                          best=_judged(self.best, rules.metric_for_best), best_step=self.best.step,
                                          patience=patience))
            self.on_early_stop()


def _judged(evaluated: Evaluated, metric: str) -> float:
    """``evaluated``'s loss, or its metric ``metric``.

    Raises:
        ValueError: it has no such metric.
    """
    if metric == "loss":
        return evaluated.loss
    if metric not in evaluated.metrics:
        known = ", ".join(["loss", *evaluated.metrics])
        raise ValueError(f"evaluation.metric_for_best {metric!r} is not among the evaluation's figures ({known}); "
                         "name the loss or a metric eval_metrics returns")
    return evaluated.metrics[metric]


class BetweenSteps:
    """What a job does by itself between two steps, where due: its evaluation as the step ends (its loss
    joins the step's statistics), then its save."""

    def __init__(self, evals: SelfEvaluations, saves: SelfSaves) -> None:
        self.evals = evals
        self.saves = saves
        saves.evaluations = evals  # which save is the best, and the standing a save records and a resume takes up

    def due(self, applied: int) -> bool:
        """Whether anything is due once ``applied`` optimizer steps are applied (a run sends no step ahead)."""
        return self.evals.eval_point(applied) or self.saves.save_point(applied)

    async def evaluate(self) -> EvalResult | None:
        """:meth:`SelfEvaluations.evaluate_if_due`; the caller holds the job."""
        return await self.evals.evaluate_if_due()

    async def save(self) -> None:
        """:meth:`~schedulers.self_saves.SelfSaves.save_if_due`, after the evaluation (its save is the best where
        the evaluation was); the caller holds the job."""
        await self.saves.save_if_due()
