"""The checkpoints a job makes by itself and resumes from (the spec's ``checkpointing`` section).

A part of the job's controller (:class:`~schedulers.control.JobController`): after every
``checkpoint_every`` applied optimizer steps it saves the job into ``checkpoint_dir`` as
``job.save`` does (:func:`schedulers.job_state.write_checkpoint`), within the hold of the
job that took the step, so nothing comes between the step and its save (a run sends no
step ahead of a save point: :func:`schedulers.runs.steps_ahead`), and says so
(``CheckpointSaved``); as the job starts, with ``resume_from_checkpoint``, it loads the
newest checkpoint there, if there is one. With ``keep_best``, the version saved at the job's
best evaluation so far (a save point is an evaluation point then, and the evaluation comes
first) stays out of the rotation of ``keep_checkpoints``, its own saves' and ``job.save``'s
alike, as the Trainer keeps its best checkpoint under ``save_total_limit``; the job's
description names it (``best_checkpoint``). Each save into the job's directory records how
its own evaluations stand (the best, the evaluations since, the best's version), and a
resume takes them up again, as the Trainer's state does: early stopping counts on and the
best version stays spared. See docs/checkpoints.md, "Saving by itself".
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Protocol

from stages import is_version
from schedulers import job_state
from schedulers.checkpoint_paths import CheckpointPath
from schedulers.events import CheckpointSaved, Evaluated
from schedulers.job_core import JobCore
from schedulers.recovery import may_recover
from schedulers.stepping import nodes_lost

__all__ = ["Judged", "SelfSaves"]

log = logging.getLogger(__name__)


class Judged(Protocol):
    """How the job's own evaluations stand (:class:`~schedulers.self_evaluations.SelfEvaluations`)."""

    best: Evaluated | None  # the best so far by metric_for_best
    stale: int  # the evaluations since it, none better


class SelfSaves:
    """One job's own saves into ``path`` (``checkpointing.checkpoint_dir``, resolved for its owner; None: none)."""

    def __init__(self, job: JobCore, path: CheckpointPath | None) -> None:
        self.job = job
        self.path = path
        self._saved_at = (0, -1)  # (loads, applied steps) of the last save made here (or of the resume)
        self.best_version: str | None = None  # the version saved at the best evaluation (keep_best), its path
        self.evaluations: Judged | None = None  # the job's own evaluations (set by BetweenSteps)

    def save_point(self, applied: int) -> bool:
        """Whether the job saves itself once ``applied`` optimizer steps are applied."""
        every = self.job.spec.checkpointing.checkpoint_every
        return (self.path is not None and every > 0 and applied % every == 0
                and (self.job.loads, applied) != self._saved_at)

    async def save_if_due(self) -> None:
        """Saves the job where the steps applied so far make a save point, and says so (``CheckpointSaved``);
        the caller holds the job (``JobCore.operation``), the one it took its step in (and made its evaluation
        due at the same step in: with ``keep_best``, the save after the best evaluation is the best).

        Raises:
            CheckpointError: the save failed (the step before it was applied); a run ends with it.
        """
        job, applied = self.job, self.job.applied
        if self.path is None or not self.save_point(applied):
            return
        # A member lost in this hold (in the evaluation before: it skips itself): the save's calls to it would
        # each wait out the checkpoint timeout, fifteen minutes. The next step recovers, or fails naming it.
        if (lost := await job.lost_member()) is not None:
            if not may_recover(job):
                raise nodes_lost(job.id, [lost], f" before its save after step {applied}")
            log.warning("%s: the save after step %d is skipped: node %s was lost; the next step recovers", job.id,
                        applied, lost)
            return
        before, self._saved_at = self._saved_at, (job.loads, applied)  # a step and a run that both ask save once
        try:
            version = await job_state.write_checkpoint(job, self.path, *self.save_args(self.path))
        except BaseException:
            self._saved_at = before
            raise
        job.publish(CheckpointSaved(job=job.id, step=applied, version=version, best=self._kept_as_best(version)))

    async def save(self, path: CheckpointPath) -> str:
        """``job.save(path)``: :func:`schedulers.job_state.write_checkpoint` as :meth:`save_args` says; a save into the
        job's own directory right after its best evaluation is its best version (``keep_best``), as its own
        save there would be, and as a resume from it takes it."""
        async with self.job.operation():
            version = await job_state.write_checkpoint(self.job, path, *self.save_args(path))
            if self.path is not None and path.directory == self.path.directory:
                self._kept_as_best(version)
            return version

    def _kept_as_best(self, version: str) -> bool:
        """Whether ``version``, just saved in the job's own directory, is its best (``keep_best``: saved
        right after the best evaluation so far); if so it is the version every rotation spares."""
        judged = self.evaluations.best if self.evaluations is not None else None
        best = self.job.spec.checkpointing.keep_best and judged is not None and judged.step == self.job.applied
        if best:
            self.best_version = version
        return best

    def save_args(self, path: CheckpointPath) -> tuple[int, str | None, dict[str, Any] | None]:
        """How a save into ``path`` goes: in the job's own directory it keeps ``keep_checkpoints`` of the newest
        versions and the best one (``keep_best``), and records how the job's own evaluations stand; elsewhere
        it keeps its newest alone."""
        if self.path is None or path.directory != self.path.directory:
            return 1, None, None
        spare = os.path.basename(self.best_version) if self.best_version is not None else None
        judge = self.evaluations
        standing = None if judge is None or judge.best is None else {
            "best": judge.best.to_wire(), "stale": judge.stale, "spare": spare}
        return self.job.spec.checkpointing.keep_checkpoints, spare, standing

    async def resume(self) -> tuple[str, int] | None:
        """Loads the newest checkpoint in ``path`` where there is one, as the job starts
        (``resume_from_checkpoint``): its version and step, or None (the job starts from its seed).

        Raises:
            CheckpointError: one that is there but does not load.
        """
        if self.path is None or not self.job.spec.checkpointing.resume_from_checkpoint:
            return None
        resumed = await job_state.resume(self.job, self.path)
        if resumed is None:
            return None
        version, step, written = resumed
        self._saved_at = (self.job.loads, self.job.applied)
        if self.evaluations is not None and written.get("evaluations") is not None:
            self._take_up(version, step, written["evaluations"])
        return version, step

    def _take_up(self, version: str, step: int, standing: Any) -> None:
        """The evaluations' standing a save recorded (:meth:`save_args`), taken up again by the resumed job."""
        judge = self.evaluations
        assert judge is not None
        try:
            best = dataclasses.replace(Evaluated.from_wire(standing["best"]), job=self.job.id)  # now this job's
            stale, spare = standing["stale"], standing["spare"]
            if isinstance(stale, bool) or not isinstance(stale, int) or stale < 0:
                raise ValueError(f"stale {stale!r:.20}")
            if spare is not None and not is_version(spare):
                raise ValueError(f"spare {spare!r:.40}")
        except (KeyError, TypeError, ValueError) as exc:  # another hand's manifest: the job judges afresh
            log.warning("%s: %s records its evaluations unreadably (%s); the job judges afresh", self.job.id,
                        version, exc)
            return
        judge.best, judge.stale = best, stale
        if not self.job.spec.checkpointing.keep_best:
            return
        if best.step == step:  # the best evaluation's save is the one resumed from
            self.best_version = version
        elif spare is not None:
            self.best_version = os.path.join(os.path.dirname(version), spare)
