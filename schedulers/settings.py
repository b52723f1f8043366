"""Settings a running job changes: checked at once, applied before its next step.

``set`` checks a new setting at once (:func:`plan_setting`) and :class:`Settings`
applies it before the next step begins, so the stages never see a half-changed job
and keep their weights and optimizer state.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from actors import ActorError
from stages import StageActor
from stages.sections import V_SCHEDULES
from stages.spec_checks import nearest
from schedulers.events import SettingPending, SettingRejected, SettingsApplied
from schedulers.job_core import JobCore
from schedulers.limits import Limits, check_spec, off_loop
from schedulers.jobs import JobSpec
from schedulers.records import SettingChange

__all__ = ["SETTABLE", "Settings", "plan_setting"]

log = logging.getLogger(__name__)

# What `set JOB KEY VALUE` may change on a running job.
SETTABLE = ("micro_batches", "schedule", "activation_codec", "gradient_codec", "lr")
_CODECS = ("activation_codec", "gradient_codec")  # the settings the stages are told themselves (set_codecs)


def plan_setting(spec: JobSpec, key: str, value: Any) -> JobSpec:
    """The spec a running job would have after ``set key value``, checked now.

    Args:
        spec: the job's spec, with any earlier pending settings applied.
        key: one of :data:`SETTABLE`.
        value: the new value; text is parsed (``"8"``, ``"gpipe"``, ``"int8"`` or ``"int8,none"``).
            A fixed schedule drops ``max_stash_bytes`` (a limit on what ``auto`` chooses).

    Raises:
        ValueError: an unknown key, or a value that does not parse or fit the job
            (the message says which and what would).
    """
    if key not in SETTABLE:
        near = nearest(str(key), SETTABLE)
        raise ValueError(f"cannot set {key!r} on a running job{f' (did you mean {near!r}?)' if near else ''}; "
                         f"settable: {', '.join(SETTABLE)}")
    changes: dict[str, Any] = {}
    if key == "micro_batches":
        # Any count: a batch that does not divide is cut as tensor_split cuts it, and a DataLoader's batch_size
        # is one micro-batch's. (The factory's batch_size, read as the global batch, refused these.)
        value = _parse_int(key, value)
    elif key == "schedule":
        value = str(value)
        if _stage_layout(value) != _stage_layout(spec.parallelism.schedule):
            raise ValueError(
                f"schedule={value}: switching between interleaved, V-shaped (zbv, dualpipev) and "
                "one-stage-per-rank schedules re-partitions the model (auto runs one stage per rank); start "
                "a new job with that schedule instead")
        if value != "auto":
            changes["max_stash_bytes"] = None  # the limit is auto's; a fixed schedule drops it
    elif key == "lr":
        return spec.replace(optimizer=_with_lr(spec, value))
    elif isinstance(value, str) and "," in value:
        value = value.split(",")
    try:
        return spec.replace(**{key: value}, **changes)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def _with_lr(spec: JobSpec, value: Any) -> tuple[str, dict[str, Any]]:
    """The job's optimizer with learning rate ``value`` (text is parsed).

    Raises:
        ValueError: not a finite number > 0, or a job whose rate follows its ``lr_scheduler``.
    """
    optimization = spec.optimization
    if optimization.lr_scheduler is not None:
        raise ValueError(f"lr: this job's learning rate follows its lr_scheduler "
                         f"({str(optimization.lr_scheduler[0])[:60]}); set lr on a job without one")
    try:
        lr = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"lr must be a number > 0, got {value!r:.40}") from None
    if isinstance(value, bool) or not 0 < lr < float("inf"):
        raise ValueError(f"lr must be a finite number > 0, got {value!r:.40}")
    name, *kwargs = optimization.optimizer
    return str(name), {**(kwargs[0] if kwargs else {}), "lr": lr}


def _stage_layout(schedule: str) -> str:
    """What a schedule asks of the partition: several stages per rank round-robin, two in a V, or one."""
    return "interleaved" if schedule == "interleaved" else "v" if schedule in V_SCHEDULES else "one per rank"


def _parse_int(key: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be an integer >= 1, got {value!r:.40}") from None
    if number < 1 or isinstance(value, bool):
        raise ValueError(f"{key} must be an integer >= 1, got {value!r:.40}")
    return number



class Settings:
    """A job's pending settings: checked when set, applied at the start of its next step."""

    def __init__(self, job: JobCore, limits: Limits) -> None:
        self.job = job
        self.limits = limits
        self.pending: dict[str, Any] = {}
        self.pending_spec: JobSpec | None = None
        self._setting = asyncio.Lock()

    async def set(self, key: str, value: Any) -> SettingChange:
        """Changes ``key`` (one of :data:`SETTABLE`) from the next step on.

        The new spec is checked against the operator's limits, then its schedule compiled
        off the head's loop (e.g. interleaved needs micro_batches to be a multiple of the
        stages), before anything changes.

        Raises:
            ValueError: the key cannot change, or the value does not fit; nothing changes.
            LimitExceeded: past the operator's limits, or the schedule took too long to compile.
        """
        job = self.job
        async with self._setting:  # one at a time: each builds on the pending spec the last one left
            new = plan_setting(self.pending_spec or job.spec, key, value)
            check_spec(new, self.limits)
            await off_loop(job.compile, new, timeout_s=self.limits.compile_timeout_s,
                           what=f"compiling the schedule for {key}={value}")
            self.pending_spec = new
            self.pending[key] = value = new.optimization.optimizer[1]["lr"] if key == "lr" else new.get(key)
        job.publish(SettingPending(job=job.id, key=key, value=value))
        return SettingChange(job=job.id, key=key, value=value, stepping=job.lock.locked(),
                             next_step=job.next_step)

    async def _set_codecs(self, spec: JobSpec) -> None:
        """Every stage actor encodes with ``spec``'s codecs from the next step on."""
        await asyncio.gather(*(ref.endpoint(StageActor.set_codecs, timeout=30).call(
            spec.edge_codecs("activation_codec"), spec.edge_codecs("gradient_codec")) for ref in self.job.stages))

    async def apply_pending(self) -> None:
        """Before a step, under the job's lock: the pending settings take effect."""
        job, new = self.job, self.pending_spec
        if new is None:
            return
        changes = dict(self.pending)
        self.pending.clear()
        self.pending_spec = None
        if any(key in changes for key in _CODECS):
            try:
                await self._set_codecs(new)
            except ActorError as exc:
                job.publish(SettingRejected(job=job.id, key="codecs",
                                            error=f"the stages refused the new codecs: {exc}"))
                # The rest still applies (it was dropped with them); stages that took the new codecs go back.
                new = new.replace(**{key: job.spec.get(key) for key in _CODECS})
                changes = {key: value for key, value in changes.items() if key not in _CODECS}
                try:
                    await self._set_codecs(new)
                except ActorError as again:
                    log.warning("%s: the stages refused their codecs back too (%s); they may now encode with "
                                "different codecs until a set of the codecs takes", job.id, again)
                if not changes:
                    return
        if "lr" in changes:
            if not job.learning_rates and job.last_stats is not None and job.last_stats.lr:
                job.learning_rates[0] = job.last_stats.lr[0]  # the rate before it, for a replay of the steps before
            job.learning_rates[job.applied] = float(changes["lr"])
        if "micro_batches" in changes:  # a dataset's steps take another count of micro-batches from here on
            job.data.change(job.applied, new.mesh.data * new.parallelism.micro_batches)
        job.respecified(new, costs_moved=bool(set(changes) - {"lr"}))
        if set(changes) - {"lr"}:
            # A recovery replays the steps since a snapshot with the job's settings as they are now (only the
            # rate is kept per step): a snapshot at the next step keeps such a replay after the change (a
            # micro-batch count or a codec set before it moved the replayed weights off the uninterrupted run's).
            job.snapshot_due = True
        job.publish(SettingsApplied(job=job.id, step=job.next_step, changes=changes))
