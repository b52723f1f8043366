"""The scheduler's job events (``on_event(event)`` to every subscriber): one record class per kind.

Each is an :class:`~actors.Event` (the head adds its node events: ``NodeJoined``,
``NodeLeft``, ``NodeSilent``) with the job it is about. The scheduler publishes them
through :meth:`SchedulerActor.subscribe <schedulers.scheduler.SchedulerActor.subscribe>`;
the console shows them (``schedulers.console.render.event_line``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from actors import Event, WireRecord

__all__ = [
    "CheckpointSaved", "EarlyStopped", "Evaluated", "JobClosed", "JobCreated", "JobEvent", "JobFailed", "JobPaused",
    "JobRecovered", "JobResumed", "MonitorFailed",
    "RunFinished", "RunProgress", "RunStarted", "SchedulePlanned", "SettingPending", "SettingRejected", "SettingsApplied",
    "StepFinished",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobEvent(Event):
    """Base of the scheduler's events: ``job`` is the job's id."""

    kind: ClassVar[str] = "job_event"
    job: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JobCreated(JobEvent):
    """The job's stage actors are built on ``nodes`` (by global rank)."""

    kind: ClassVar[str] = "job_created"
    nodes: list[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobClosed(JobEvent):
    """The job's stage actors are stopped."""

    kind: ClassVar[str] = "job_closed"


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFailed(JobEvent):
    """Step ``step`` failed with ``error``; nothing of it was applied."""

    kind: ClassVar[str] = "job_failed"
    step: int
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulePlanned(JobEvent):
    """``schedule="auto"`` chose ``schedule`` from step ``step`` on (None: it keeps measuring)."""

    kind: ClassVar[str] = "schedule_planned"
    step: int
    schedule: str | None
    predicted_step_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunProgress(WireRecord):
    """Where a run stands: ``done`` of ``target`` steps."""

    done: int
    target: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFinished(JobEvent):
    """Step ``step`` is applied (the :class:`~schedulers.records.StepStats` figures a console shows).

    ``run`` is the run's progress when a run (``Job.run``) took the step; ``eval_loss`` and
    ``eval_metrics``, the job's own evaluation after it where one was due.
    """

    kind: ClassVar[str] = "step_finished"
    nested: ClassVar[dict[str, Any]] = {"run": RunProgress}
    step: int
    loss: float
    step_time_s: float
    bubble_fraction: float
    samples_per_s: float | None = None
    schedule: str = ""
    run: RunProgress | None = None
    skipped: bool = False
    lr: list[float] = field(default_factory=list)
    predicted_step_s: float | None = None
    prediction_error: float | None = None
    eval_loss: float | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStarted(JobEvent):
    """A run of ``steps`` steps started (``paused``: it waits for ``resume``)."""

    kind: ClassVar[str] = "run_started"
    steps: int
    paused: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class JobPaused(JobEvent):
    """The job's run holds before step ``step``."""

    kind: ClassVar[str] = "job_paused"
    step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class JobResumed(JobEvent):
    """The job's run goes on at step ``step``."""

    kind: ClassVar[str] = "job_resumed"
    step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFinished(JobEvent):
    """The run ended after ``done`` of ``target`` steps; ``reason``: done, stopped, failed or cancelled."""

    kind: ClassVar[str] = "run_finished"
    done: int
    target: int
    reason: str
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SettingPending(JobEvent):
    """``key`` will be ``value`` from the next step on (``Job.set``)."""

    kind: ClassVar[str] = "setting_pending"
    key: str
    value: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class SettingRejected(JobEvent):
    """A pending change of ``key`` could not be applied: ``error`` says why; the job keeps its setting."""

    kind: ClassVar[str] = "setting_rejected"
    key: str
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SettingsApplied(JobEvent):
    """The pending ``changes`` (key -> value) apply from step ``step`` on."""

    kind: ClassVar[str] = "settings_applied"
    step: int
    changes: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRecovered(JobEvent):
    """The job replaced its ``lost`` nodes (``moved``: each lost node -> its replacement).

    Every stage rolled back to step ``from_step`` (from the checkpoint ``from_checkpoint``
    when it is set) and ``replayed`` steps run again; the respawn and restore took
    ``seconds``, and ``restarts_left`` recoveries remain.
    """

    kind: ClassVar[str] = "job_recovered"
    lost: list[str]
    moved: dict[str, str]
    from_step: int
    replayed: int
    from_checkpoint: str | None
    seconds: float
    restarts_left: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSaved(JobEvent):
    """The job saved itself (``checkpointing.checkpoint_every``) after applied step ``step``, to ``version``;
    ``best``: at the job's best evaluation so far, kept out of the rotation (``checkpointing.keep_best``)."""

    kind: ClassVar[str] = "checkpoint_saved"
    step: int
    version: str
    best: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluated(JobEvent):
    """The job evaluated after ``step`` applied steps: ``loss`` over ``items`` samples (or counted tokens) in
    ``batches`` batches, in ``eval_time_s``; ``periodic``: by itself (``evaluation.eval_every``), else
    ``job.evaluate``; ``validation``: on the job's validation data (``evaluation.eval_data``);
    ``metrics``: the job's ``eval_metrics`` by name."""

    kind: ClassVar[str] = "evaluated"
    step: int
    loss: float
    items: float
    batches: int
    eval_time_s: float
    periodic: bool = False
    validation: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class EarlyStopped(JobEvent):
    """The job's own evaluation after ``step`` was the ``patience``-th in a row that did not improve
    ``metric`` on ``best`` (reached after ``best_step``): a run stops after this step
    (``evaluation.early_stopping_patience``)."""

    kind: ClassVar[str] = "early_stopped"
    step: int
    metric: str
    best: float
    best_step: int
    patience: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitorFailed(JobEvent):
    """The job's ``monitor`` (``tensorboard``, ``wandb`` or ``csv_monitor``) failed with ``error`` and is off
    from now on; training goes on (see :mod:`schedulers.monitors`). Published once per monitor."""

    kind: ClassVar[str] = "monitor_failed"
    monitor: str
    error: str
