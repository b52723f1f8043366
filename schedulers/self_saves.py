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
description names it (``best_checkpoint``). See docs/checkpoints.md, "Saving by itself".
"""

from __future__ import annotations

import os

from schedulers import job_state
from schedulers.checkpoint_paths import CheckpointPath
from schedulers.events import CheckpointSaved
from schedulers.job_core import JobCore

__all__ = ["SelfSaves"]


class SelfSaves:
    """One job's own saves into ``path`` (``checkpointing.checkpoint_dir``, resolved for its owner; None: none)."""

    def __init__(self, job: JobCore, path: CheckpointPath | None) -> None:
        self.job = job
        self.path = path
        self._saved_at = -1  # the applied steps of the last save made here (or of the resume)
        self.best_version: str | None = None  # the version saved at the best evaluation (keep_best), its path

    def save_point(self, applied: int) -> bool:
        """Whether the job saves itself once ``applied`` optimizer steps are applied."""
        every = self.job.spec.checkpointing.checkpoint_every
        return self.path is not None and every > 0 and applied % every == 0 and applied != self._saved_at

    async def save_if_due(self, best_step: int | None = None) -> None:
        """Saves the job where the steps applied so far make a save point, and says so (``CheckpointSaved``);
        the caller holds the job (``JobCore.operation``), the one it took its step in. ``best_step``: the
        applied steps of the job's best evaluation so far (with ``keep_best``, a save at that step is the best).

        Raises:
            CheckpointError: the save failed (the step before it was applied); a run ends with it.
        """
        job, applied = self.job, self.job.applied
        if self.path is None or not self.save_point(applied):
            return
        before, self._saved_at = self._saved_at, applied  # taken now: a step and a run that both ask save once
        try:
            version = await job_state.write_checkpoint(job, self.path, *self.rotation(self.path))
        except BaseException:
            self._saved_at = before
            raise
        best = job.spec.checkpointing.keep_best and best_step == applied
        if best:
            self.best_version = version
        job.publish(CheckpointSaved(job=job.id, step=applied, version=version, best=best))

    def rotation(self, path: CheckpointPath) -> tuple[int, str | None]:
        """What a save into ``path`` keeps: in the job's own directory ``keep_checkpoints`` of the newest versions
        and the best one (``keep_best``); elsewhere its newest alone."""
        if self.path is None or path.directory != self.path.directory:
            return 1, None
        best = self.best_version
        return self.job.spec.checkpointing.keep_checkpoints, os.path.basename(best) if best is not None else None

    async def resume(self) -> tuple[str, int] | None:
        """Loads the newest checkpoint in ``path`` where there is one, as the job starts
        (``resume_from_checkpoint``): its version and step, or None (the job starts from its seed).

        Raises:
            CheckpointError: one that is there but does not load.
        """
        if self.path is None or not self.job.spec.checkpointing.resume_from_checkpoint:
            return None
        resumed = await job_state.resume(self.job, self.path)
        if resumed is not None:
            self._saved_at = self.job.applied
        return resumed
