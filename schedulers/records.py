"""What the scheduler answers its clients: typed records both sides import.

The scheduler actor's endpoints return these, and they travel as records (see
:mod:`actors.records`): the client (:class:`~schedulers.client.Job`) gets the same
classes back, rebuilt by ``from_wire``, which refuses an unknown key, so nothing the
scheduler reports is dropped on the way. A :class:`~schedulers.jobs.JobSpec` travels
too, checked by its own ``from_wire``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from actors import WireRecord
from schedulers.events import Evaluated, RunProgress, StepFinished
from schedulers.jobs import JobSpec
from transport.records import register_record

__all__ = ["Candidate", "EvalResult", "JobDescription", "JobInfo", "MeasuredCosts", "Plan", "RunInfo", "SettingChange", "StepStats",
           "WhereReport"]

# A spec is checked by its own from_wire (every field, as at the call), not WireRecord's.
register_record(JobSpec, "JobSpec", fields=JobSpec.to_wire)


@dataclass(frozen=True, slots=True, kw_only=True)
class Recovery(WireRecord):
    """What a recovery did before a step completed (``StepStats.recovery``; the ``job_recovered`` event says the same)."""

    lost: list[str]
    """The nodes lost."""
    moved: dict[str, str]
    """Each lost node -> its replacement."""
    from_step: int
    """The snapshot (or checkpoint) every stage rolled back to, in applied steps."""
    replayed: int
    """Steps run again before this one."""
    from_checkpoint: str | None = None
    """The checkpoint directory it went back to, when no snapshot could serve."""
    seconds: float = 0.0
    """Respawn and restore, without the replay."""
    restarts_left: int = 0
    """Recoveries the job may still make."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepStats(WireRecord):
    """What one optimizer step did.

    Attributes:
        step: the step's number within the job (from 0). Every attempt takes the next number, a
            failed or aborted one too, and no number is used twice (it fences a late message of an
            aborted step): after a failed step, or an evaluation (it runs programs under a number of
            its own), the next completed one skips a number; ``JobDescription.steps`` counts the steps
            applied.
        loss: the global batch's mean loss, as one process would compute it.
        step_time_s: wall time from sending the programs to the optimizer step done.
        bubble_fraction: the share of stage time spent idle, from the stages' own timings.
        bytes_sent: bytes that crossed between stages (activations and gradients).
        bytes_per_edge: the same per edge and direction, e.g. ``{"F 0->1": n, "B 1->0": n}``.
        peak_stash: per stage actor, the most micro-batch activations held at once.
        peak_stash_bytes: per stage actor, the most bytes of activations held at once
            for backward (what autograd saved, the stashed boundary values; not the
            parameters or the batch): what activation checkpointing reduces.
        peak_rss_bytes: per stage actor, the stage process's peak resident memory.
        optimizer_state_bytes: per stage actor, the bytes of optimizer state it held when
            the step began (torch optimizers make theirs at their first step; with
            ``zero_stage=1``, each replica holds its shard: about 1/``data_parallel``).
        gradient_bytes: per stage actor, the bytes of gradient memory it held when its
            last optimizer step began (with ``zero_stage=2``, its shard's only).
        parameter_bytes: per stage actor, the bytes of its parameters.
        busy_s: per stage actor, seconds spent computing.
        devices: per stage actor, the device it computes on (``cpu``, ``cuda:0``); empty
            in a record from before the field.
        codec_stats: per edge and direction (``"F 0->1"``, ``"B 1->0"``): the codec,
            ``bytes`` on the wire, ``raw_bytes`` (the tensors' own size), their
            ``ratio``, and ``rel_error``, the norm of (decoded - sent) over the norm
            of what was sent (0 for ``none``).
        reduce_bytes: bytes all replicas put on the wire for the data-parallel
            gradient reduction (encoded bytes with a lossy ``reduce_codec``).
        reduce_wait_s: per stage actor, seconds the data-parallel reduction took after
            the barrier: what backward did not hide with ``overlap_reduce`` (the
            reduction started during backward), all of it without.
        samples: the global batch size, when known (a batch given, or the samples the
            data's batch held, as the last stages read it).
        samples_per_s: ``samples / step_time_s``, when ``samples`` is known.
        schedule, micro_batches: the schedule and micro-batch count this step ran with.
        recovery: set when the job recovered from a lost node before this step
            completed: ``lost`` (the nodes), ``moved`` (each lost node -> its
            replacement), ``from_step`` (the snapshot every stage rolled back to),
            ``replayed`` (steps run again before this one), ``seconds`` (respawn and
            restore, without the replay).
        skipped: a loss or gradient was NaN or infinite and the job has
            ``on_nonfinite="skip"``: no stage stepped, the parameters are as before.
        nonfinite: what was not finite, e.g. ``"stage 1 dp 0: gradient of 3.fc1.weight"``.
        tied: parameters shared by layers on different pipeline ranks (tied embeddings),
            each as every name the model gives it; their gradients were summed across
            those ranks before the step, so every copy stays the same.
        grad_norm: the global gradient norm over every stage, tensor shard (replicated
            parameters once) and replica, before clipping (None until it is measured).
        loss_scale: with ``precision="fp16"``, the loss scale this step used.
        skipped_steps: with fp16, the steps skipped so far because gradients overflowed.
        lr: the learning rate of each optimizer parameter group after this step.
        predicted_step_s: with ``schedule="auto"``, the step time the plan predicted for
            the schedule this step ran (None while the job measures its stages).
        prediction_error: ``(step_time_s - predicted_step_s) / predicted_step_s``.
        eval_loss: the loss on the validation data of the evaluation the job made by itself right
            after this step (``evaluation.eval_every``); None after the other steps.
        eval_metrics: that evaluation's ``eval_metrics`` by name (empty without them).
        stop_early: that evaluation was the last that early stopping waits for
            (``evaluation.early_stopping_patience``): a driver's loop stops here, as a run does.
    """

    nested: ClassVar[dict[str, Any]] = {"recovery": Recovery}


    step: int
    loss: float
    step_time_s: float
    bubble_fraction: float
    bytes_sent: int
    bytes_per_edge: dict[str, int] = field(default_factory=dict)
    peak_stash: list[int] = field(default_factory=list)
    peak_stash_bytes: list[int] = field(default_factory=list)
    peak_rss_bytes: list[int] = field(default_factory=list)
    optimizer_state_bytes: list[int] = field(default_factory=list)
    gradient_bytes: list[int] = field(default_factory=list)
    parameter_bytes: list[int] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    codec_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    reduce_bytes: int = 0
    reduce_wait_s: list[float] = field(default_factory=list)
    samples: int | None = None
    samples_per_s: float | None = None
    schedule: str = ""
    micro_batches: int = 0
    recovery: Recovery | None = None
    skipped: bool = False
    nonfinite: list[str] = field(default_factory=list)
    tied: list[list[str]] = field(default_factory=list)
    grad_norm: float | None = None
    loss_scale: float | None = None
    skipped_steps: int = 0
    lr: list[float] = field(default_factory=list)
    predicted_step_s: float | None = None
    prediction_error: float | None = None
    eval_loss: float | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    stop_early: bool = False

    def finished(self, job: str, run: RunProgress | None) -> StepFinished:
        """This step's :class:`~schedulers.events.StepFinished` event, of job ``job`` (``run``: the run's progress
        when a run took it)."""
        return StepFinished(job=job, step=self.step, loss=self.loss, step_time_s=self.step_time_s,
                            bubble_fraction=self.bubble_fraction, samples_per_s=self.samples_per_s,
                            schedule=self.schedule, run=run, skipped=self.skipped, lr=list(self.lr),
                            predicted_step_s=self.predicted_step_s, prediction_error=self.prediction_error,
                            eval_loss=self.eval_loss, eval_metrics=dict(self.eval_metrics))


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalResult(WireRecord):
    """What ``Job.evaluate`` returns: one forward-only pass over a batch, nothing trained.

    Attributes:
        loss: the batch's loss, averaged as the job's ``loss_averaging`` says (the sample-weighted
            mean of its micro-batches' means, or every token's loss over the counted tokens).
        items: the samples (or counted tokens) that loss averages over.
        outputs: with ``outputs=True``, the last stage's outputs for the whole batch, in its
            order (every replica's micro-batches joined along the first dim), on the CPU.
        eval_time_s: seconds from the scheduler's orders to the last stage's answer.
        bytes_sent: bytes the stages put on the wire, every edge.
        metrics: the job's ``eval_metrics`` by name, each averaged over the micro-batches as the
            loss is (weighted by their samples or counted tokens); empty without them.
        batches: the global batches evaluated (the validation set's ``eval_batches``, or the
            length of one pass over it).
    """

    loss: float
    items: float = 0.0
    outputs: Any = None
    eval_time_s: float = 0.0
    bytes_sent: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    batches: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class JobInfo(WireRecord):
    """A job's layout: its id, each model stage's ``[first, end)`` layers, its nodes by global rank, and its actor.

    Attributes:
        actor: ``[address, name]`` of the job's actor on the head
            (:class:`~schedulers.job_actor.JobActor`), which every operation on the job calls.
        notices: what the scheduler warns about the placement (stage actors that share a
            GPU because every GPU is taken; CPU and GPU nodes in one job); the driver
            warns each as a :class:`~schedulers.placement.PlacementWarning`.
        creation_s: where the job's creation went on the head, in seconds per phase, in order:
            ``compile`` (the schedule), ``place``, ``partition`` (a model inspector's
            parameter counts or profile), ``rendezvous``, ``spawn`` (every stage built),
            ``connect`` (stages told their peers), ``resume`` (with ``resume_from_checkpoint``)
            and ``actor`` (the job's own actor).
        resumed_from: the checkpoint version the job loaded as it started
            (``checkpointing.resume_from_checkpoint``); None: none was there, or none asked for.
        resumed_step: that checkpoint's step (the job goes on from it); 0 without one.
    """

    job: str
    bounds: list[list[int]]
    nodes: list[str]
    actor: list[str]
    notices: list[str] = field(default_factory=list)
    creation_s: dict[str, float] = field(default_factory=dict)
    resumed_from: str | None = None
    resumed_step: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RunInfo(WireRecord):
    """A run of ``target`` steps from the job's data factory (``Job.run``); ``ahead``: how many of the
    ``done`` steps went out while the step before them was still in flight (see :mod:`schedulers.runs`);
    ``elapsed_s``: seconds from its start to its end (so far, while active), on the head's clock;
    ``stopped_early``: the job's evaluations stopped improving (``evaluation.early_stopping_patience``)."""

    target: int
    first_step: int
    done: int = 0
    active: bool = True
    stopping: bool = False
    error: str | None = None
    ahead: int = 0
    elapsed_s: float = 0.0
    stopped_early: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class JobDescription(WireRecord):
    """Everything the console shows about a job.

    Attributes:
        mesh: ``[pipeline, tensor, data]``.
        stages: each stage actor as ``[address, name]``, by global rank.
        steps: steps completed (a failed try does not count; a load sets it to the checkpoint's).
        programs: each pipeline rank's program for one step, as action text.
        running: the schedule those programs are (what ``schedule="auto"`` runs now).
        stepping: a step is in progress.
        traced: a step has finished, so ``Job.trace`` has a timeline to give.
        paused: a run holds before its next step.
        pending: settings that apply before the next step.
        run: the current or last run.
        last_stats: the last step's statistics.
        last_eval: the last evaluation (``job.evaluate``'s or the job's own), as its event told it.
        best_eval: the best of the job's own evaluations by ``evaluation.metric_for_best``.
        best_checkpoint: the version the job saved at its best evaluation (``checkpointing.keep_best``), kept
            out of the rotation; ``job.load`` takes its path.
    """

    nested: ClassVar[dict[str, Any]] = {"spec": JobSpec, "run": RunInfo, "last_stats": StepStats,
                                        "last_eval": Evaluated, "best_eval": Evaluated}

    job: str
    spec: JobSpec
    bounds: list[list[int]]
    nodes: list[str]
    mesh: list[int]
    stages: list[list[str]]
    steps: int
    programs: list[list[str]]
    stepping: bool
    traced: bool
    paused: bool = False
    pending: dict[str, Any] = field(default_factory=dict)
    run: RunInfo | None = None
    last_stats: StepStats | None = None
    running: str = ""
    last_eval: Evaluated | None = None
    best_eval: Evaluated | None = None
    best_checkpoint: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SettingChange(WireRecord):
    """A setting accepted by ``Job.set``: it applies before step ``next_step`` (after the one in progress)."""

    job: str
    key: str
    value: Any
    stepping: bool
    next_step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WhereReport(WireRecord):
    """Hang forensics: each stage's place in its program and the marked grid (``report``), and its lines."""

    job: str
    stepping: bool
    report: str
    lines: list[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredCosts(WireRecord):
    """What one step measured, per pipeline rank, for the schedule simulator (``schedulers.planning``).

    Attributes:
        forward, backward, input_grad, weight_grad: seconds one micro-batch's ``F``,
            ``B``, ``I`` and ``W`` take through all of the rank's layers (the median over
            the step's micro-batches; a send's encoding counts to the action whose value
            it sends). A kind the step did not run is estimated: ``B = I + W``, and ``I``
            and ``W`` split ``B`` as they split it where both were measured.
        stash_bytes: bytes one micro-batch's activations hold on the rank for backward.
        transfer_bytes: raw bytes of one value crossing a stage boundary.
        forward_ratio, backward_ratio: bytes on the wire over raw bytes (the codecs).
        bandwidth: bytes per second of the fastest transfer seen (send start to
            receive end, on the head's clock); infinite when nothing crossed.
        overhead_s: the step's time outside the stage programs (dispatch, the
            barrier, reduction and optimizer step).
        step: the step measured.
        weight_grad_batched: per rank, seconds per micro-batch of ``W`` when a run of
            them computes each weight's gradient as one GEMM (W batching), from a probe
            step that ran so; None when not measured (no fused weight gradients).
    """

    forward: list[float]
    backward: list[float]
    input_grad: list[float]
    weight_grad: list[float]
    stash_bytes: list[float]
    transfer_bytes: float = 0.0
    forward_ratio: float = 1.0
    backward_ratio: float = 1.0
    bandwidth: float = float("inf")
    overhead_s: float = 0.0
    step: int = 0
    weight_grad_batched: list[float] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate(WireRecord):
    """One schedule the plan simulated with the measured costs.

    Attributes:
        schedule: its name; ``virtual_stages`` for ``interleaved``.
        predicted_step_s: the simulated makespan plus the measured overhead.
        bubble_fraction: the simulated share of idle stage time.
        stash: per pipeline rank, the most micro-batch activations held at once
            (per model-stage chunk when interleaved).
        stash_bytes: per pipeline rank, those in bytes.
        runnable: the job's partition runs it (interleaving cuts the model anew: a new job).
        fits: within the job's ``max_stash_bytes``.
        chosen: the one auto runs (or, on a job with a fixed schedule, would run).
        w_batching: with W batching (every ``W`` deferred to the rank's tail, a run of
            them computed as one GEMM per weight).
    """

    schedule: str
    virtual_stages: int | None = None
    predicted_step_s: float
    bubble_fraction: float
    stash: list[int]
    stash_bytes: list[int]
    runnable: bool = True
    fits: bool = True
    chosen: bool = False
    w_batching: bool = False

    @property
    def label(self) -> str:
        """``zero_bubble``, ``interleaved x3`` for 3 virtual stages, ``1f1b +wbatch`` with W batching."""
        name = self.schedule if self.virtual_stages is None else f"{self.schedule} x{self.virtual_stages}"
        return f"{name} +wbatch" if self.w_batching else name


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan(WireRecord):
    """What ``job.plan()`` returns: the candidate schedules, predicted from measured costs.

    Attributes:
        schedule: the job's setting (``auto`` or a schedule's name).
        running: the schedule its next step runs.
        state: ``measuring`` (auto: the next steps run the probe schedule and time the
            stages), ``planned`` (auto chose from the candidates), ``advice`` (a fixed
            schedule; the candidates come from its last step) or ``no_steps`` (nothing
            measured yet).
        candidates: fastest first.
        chosen: the chosen candidate's label.
        max_stash_bytes: the job's limit (None: none).
        costs: what the candidates were simulated with.
        last_step_s, prediction_error: the last step's measured time and its error
            against the plan's prediction (auto only).
    """

    nested: ClassVar[dict[str, Any]] = {"candidates": Candidate, "costs": MeasuredCosts}

    job: str
    schedule: str
    running: str
    state: str
    candidates: list[Candidate] = field(default_factory=list)
    chosen: str | None = None
    max_stash_bytes: int | None = None
    costs: MeasuredCosts | None = None
    last_step_s: float | None = None
    prediction_error: float | None = None
