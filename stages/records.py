"""Records that cross the wire between the scheduler and the stage actors, typed on both sides.

They are :class:`~actors.records.WireRecord` s: strict on the way in. This module is a
leaf (no torch, no ZeroMQ), so the scheduler imports it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from actors.records import RecordError, WireRecord
from transport.records import register_record
from stages.mesh import Mesh
from stages.program import stage_to_rank
from stages.sections import (SECTIONS, Communication, Evaluation, MixedPrecision, Optimization, Parallelism, Runtime,
                             Training)

__all__ = ["FinishReport", "ProgressReport", "RecordError", "ReduceReport", "StageConfig", "StageReport", "StepOrder",
           "TailVote", "WireRecord"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StageConfig(WireRecord):
    """What a stage actor is built from: where it sits in the job, and the spec's sections it reads.

    The sections are the job's own (:mod:`stages.sections`), as the scheduler's
    ``schedulers.jobs.stage_config`` takes them from the spec; the head's own
    sections (fault tolerance, checkpointing, monitoring) stay behind.
    """

    nested: ClassVar[dict[str, Any]] = {name: cls for name, cls in SECTIONS.items()
                                         if name not in ("fault_tolerance", "checkpointing", "monitoring")}

    job: str
    global_rank: int
    """This actor's rank in the job's mesh (``parallelism.mesh``)."""
    bounds: list[list[int]]
    """Per model stage: [first layer, end layer) (one "layer" per stage for a model cut at ``split_points``)."""
    dist: dict[str, Any] | None = None
    """torch.distributed: ``{"rendezvous": [ADDRESS, ACTOR], "backend": "gloo", "timeout_s": 600, "loopback":
    true}`` (see :func:`stages.comm.parallel.join_process_groups`); None: no process groups."""
    training: Training
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimization: Optimization = field(default_factory=Optimization)
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    communication: Communication = field(default_factory=Communication)
    runtime: Runtime = field(default_factory=Runtime)
    evaluation: Evaluation = field(default_factory=Evaluation)
    """Its validation data (``eval_data``), which a first or last stage reads."""

    def __post_init__(self) -> None:
        if not 0 <= self.global_rank < self.mesh.size:
            raise ValueError(f"StageConfig.global_rank {self.global_rank} is outside the mesh of {self.mesh.size}")

    @property
    def mesh(self) -> Mesh:
        return self.parallelism.mesh

    @property
    def pipeline_stages(self) -> int:
        return self.parallelism.pipeline_stages

    @property
    def pipeline_rank(self) -> int:
        return self.mesh.coords(self.global_rank).pipeline

    @property
    def micro_batches(self) -> int:
        """The micro-batches the stage is built for (a step may name another count)."""
        return self.parallelism.micro_batches

    @property
    def num_stages(self) -> int:
        """Model stages in the whole pipeline (more than ranks when interleaved)."""
        return len(self.bounds)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that holds model ``stage`` (placed as the schedule places them)."""
        return stage_to_rank(stage, self.pipeline_stages, self.parallelism.placement)

    @property
    def stages(self) -> list[int]:
        """The model stages this rank holds (several when interleaved or V-shaped)."""
        return [s for s in range(self.num_stages) if self.rank_of(s) == self.pipeline_rank]

    @property
    def activation_codec(self) -> list[str]:
        """One codec per stage boundary, forward."""
        return self.communication.edge_codecs("activation_codec", self.num_stages - 1)

    @property
    def gradient_codec(self) -> list[str]:
        """One codec per stage boundary, backward."""
        return self.communication.edge_codecs("gradient_codec", self.num_stages - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOrder(WireRecord):
    """What a stage's ``run_step`` runs: one step's program and what it reads, from the scheduler.

    Checked when it is made (and so when it comes off the wire), before the stage moves to the step.

    Raises:
        ValueError: a field of the wrong type or out of range (named in the message).
    """

    step: int
    """The step's number: unique per try (a retried step gets a new one), so it fences stale messages."""
    program: list[str]
    """This stage's actions in their text form (``0F3``), up to the barrier and the tail after it."""
    inputs: Any = None
    """The first stage's micro-batches of inputs, a list (or None: ``data_step`` reads them); with
    :attr:`whole`, its replica's whole share instead."""
    targets: Any = None
    """The last stage's micro-batches of targets, a list; with :attr:`whole`, the whole share."""
    whole: bool = False
    """``inputs`` and ``targets`` are the replica's whole share of the batch, one batch each: the stage
    cuts them into its micro-batches (:func:`~stages.comm.boundary.split_batch`, as
    :func:`torch.tensor_split` cuts), so that one tensor crosses the wire instead of one a micro-batch."""
    data_step: int | None = None
    """Read this step's batch from the job's data factory instead."""
    data_shard: list[int] | None = None
    """With ``data_step``: ``[replica, replicas]``, this replica's share of the global batch."""
    data_position: int | None = None
    """With ``data_step`` and a dataset: where the step's batch begins in its stream, in global micro-batches
    (every replica's) read before it. None: ``data_step * micro_batches * replicas``, as when the layout never
    changed; after a change of ``micro_batches`` or a load into another layout the scheduler says."""
    micro_batches: int | None = None
    """A count other than the one the stage was built with (changed at the barrier)."""
    snapshot: int | None = None
    """First keep a copy of the stage's state after this many applied steps (and send one to its buddy)."""
    loss_scale: float | None = None
    """fp16: the scale the last stage multiplies each loss by."""
    lr: float | None = None
    """The learning rate this step's optimizer step takes, every parameter group's (``set lr`` on a running
    job; None: as the optimizer has it). Each step's own, so that a replay after a recovery steps alike."""
    w_batching: bool | None = None
    """Run this step's runs of consecutive Ws as one GEMM per weight, or not (None: as built)."""
    finish: bool = False
    """Run the step's tail too, after the barrier: reduce, agree with every stage of the job on the
    step's decision (:class:`TailVote`), then step or drop; one answer per step."""
    max_norm: float = 0.0
    """With ``finish``: the global-norm clipping threshold (0: off)."""
    fp16: bool = False
    """With ``finish``: the losses are scaled, so a non-finite gradient with finite losses is an overflow."""
    scale_at_floor: bool = False
    """With ``finish``: the dynamic loss scale is at its lowest, where an overflow is a real non-finite value."""
    per_item: bool = False
    """With ``finish``: ``loss_averaging="tokens"``: the gradients are divided by the step's counted tokens
    (every last stage's :attr:`StageReport.items`, agreed in the vote), per replica."""
    loss_weights: list[float] | None = None
    """The last stage's weight per micro-batch under ``loss_averaging="samples"`` (None: an even split,
    ``1 / micro_batches`` each; see :mod:`stages.compute.averaging`)."""
    evaluate: bool = False
    """Forward only (``job.evaluate``): no stash, no gradient, no tail; the program holds F and transfers."""
    keep_outputs: bool = False
    """With ``evaluate``: the last stage returns its outputs (:attr:`StageReport.outputs`)."""
    eval_data: bool = False
    """With ``evaluate`` and ``data_step``: read that batch of the job's validation data (``eval_data``)."""
    after: int | None = None
    """Sent ahead, before step ``after``'s answers were in: begin only if step ``after`` was applied
    here (its tail stepped the optimizer), else answer aborted without running anything. Then no stage
    can finish this step unless every stage applied ``after``: a refusing stage's vote never comes."""

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"step must be an int >= 0, got {self.step!r:.40}")
        if not isinstance(self.program, list) or not all(isinstance(a, str) for a in self.program):
            raise ValueError(f"program must be a list of actions as text, got {self.program!r:.40}")
        if self.w_batching is not None and not isinstance(self.w_batching, bool):
            raise ValueError(f"w_batching must be a bool, got {self.w_batching!r:.40}")
        for flag in ("finish", "fp16", "scale_at_floor", "per_item", "evaluate", "keep_outputs", "whole", "eval_data"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r:.40}")
        norm = self.max_norm
        if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not 0 <= norm < float("inf"):
            raise ValueError(f"max_norm must be a finite number >= 0, got {norm!r:.40}")
        for name in ("micro_batches", "data_step", "data_position", "snapshot", "after"):
            value, least = getattr(self, name), 1 if name == "micro_batches" else 0
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"{name} must be an int >= {least}, got {value!r:.40}")
        for name in ("loss_scale", "lr"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < float("inf")):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r:.40}")
        weights = self.loss_weights
        if weights is not None and not (isinstance(weights, list) and all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w < float("inf") for w in weights)):
            raise ValueError(f"loss_weights must be a list of finite numbers >= 0, got {weights!r:.40}")
        shard = self.data_shard
        if shard is not None and not (isinstance(shard, list) and len(shard) == 2
                                      and all(isinstance(v, int) and not isinstance(v, bool) for v in shard)
                                      and 0 <= shard[0] < shard[1]):
            raise ValueError(f"data_shard must be [replica, replicas], got {shard!r:.40}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReduceReport(WireRecord):
    """What a stage's ``reduce_step`` returns, before the scheduler lets it step (or not).

    Attributes:
        reduced_bytes: the bytes this stage sent for the data-parallel reduction.
        nonfinite: the parameters (as the whole model names them, ``3.fc1.weight``)
            whose gradient holds a NaN or an infinity; a name ends in ``(after the
            data-parallel reduction)`` when only the reduced gradient is not finite.
        tied: the parameters this stage shares with other pipeline ranks, each as every
            name the model gives it; their gradients were summed across those ranks.
        grad_sq: this stage's share of the squared global gradient norm (after the
            reduction; a tensor-replicated parameter counted by tensor rank 0 only, a
            tied one by the lowest pipeline rank holding it); the scheduler adds the
            shares of data-parallel replica 0.
        wait_s: seconds the data-parallel reduction took after the barrier: all of it when
            it runs there, what backward did not hide when it started during backward.
    """

    reduced_bytes: int = 0
    nonfinite: list[str] = field(default_factory=list)
    tied: list[list[str]] = field(default_factory=list)
    grad_sq: float = 0.0
    wait_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishReport(WireRecord):
    """What a stage's ``finish_step`` returns, once it has applied the step (or dropped it).

    Attributes:
        lr: each optimizer parameter group's learning rate now, after the schedule
            stepped (unchanged when the step was dropped).
    """

    lr: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageReport(WireRecord):
    """What a stage's ``run_step`` returns: its step's trace, or what failed.

    Attributes:
        status: ``done`` (the program reached its barrier), ``failed`` (an action raised:
            ``action`` and ``error`` say which and what) or ``aborted`` (``abort_step``).
        losses: the last stage's loss per micro-batch, in micro-batch order (its sum with
            ``loss_averaging="tokens"``).
        items: the last stage's count per micro-batch: its samples, or with
            ``loss_averaging="tokens"`` its counted target elements.
        outputs: with :attr:`StepOrder.keep_outputs`, the last stage's output per micro-batch.
        metrics: an evaluation's ``eval_metrics`` on the last stage, per micro-batch (empty: none).
        busy_s, elapsed_s: seconds computing, and from the program's start to its barrier.
        peak_stash: the most micro-batch activations held at once.
        peak_stash_bytes: the most bytes of activations held at once for backward: the
            storages of the tensors autograd saved, the stashed outputs and boundary inputs
            (parameters and the step's batch left out), counted between actions.
        bytes_sent: per edge and direction (``"F 0->1"``), bytes put on the wire.
        spans: ``[action, start, end]`` per action, seconds from ``started_at``.
        started_at: the stage's wall clock when the program started.
        peak_rss_bytes: the stage process's peak resident memory.
        codec_stats: per edge and direction: codec, bytes, raw_bytes, sq_err, sq_norm.
        optimizer_state_bytes: the bytes of the optimizer state this stage holds at the
            barrier (the previous step's; with ZeRO-1, its shard's).
        gradient_bytes: the bytes of gradient memory this stage held when its last
            optimizer step began (the data-parallel buckets and any gradient outside them;
            with ZeRO-2, its runs' only).
        parameter_bytes: the bytes of this stage's parameters (each once).
        device: the device the stage computes on (``cpu``, ``cuda:1``); "" from a
            stage that predates the field.
        samples: from a last stage that read its step's batch from the job's data, the samples its
            micro-batches held (its replica's share of the global batch); 0 otherwise.
        pass_batches: from a stage that read a batch of one pass over the validation set
            (``evaluation.eval_batches=0``), how many batches the pass takes.
        reduced, finished: with :attr:`StepOrder.finish`, the step's tail as the stage ran it
            after its barrier (see :class:`ReduceReport`, :class:`FinishReport`); None when
            the scheduler drives the tail by calls of its own.
    """

    nested: ClassVar[dict[str, Any]] = {"reduced": ReduceReport, "finished": FinishReport}

    status: Literal["done", "failed", "aborted"]
    action: str | None = None
    error: dict[str, Any] | None = None
    losses: list[float] = field(default_factory=list)
    items: list[float] = field(default_factory=list)
    outputs: list[Any] | None = None
    metrics: list[dict[str, float]] = field(default_factory=list)
    busy_s: float = 0.0
    elapsed_s: float = 0.0
    peak_stash: int = 0
    peak_stash_bytes: int = 0
    bytes_sent: dict[str, int] = field(default_factory=dict)
    spans: list[list[Any]] = field(default_factory=list)
    started_at: float = 0.0
    peak_rss_bytes: int = 0
    codec_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    optimizer_state_bytes: int = 0
    gradient_bytes: int = 0
    parameter_bytes: int = 0
    device: str = ""
    samples: int = 0
    pass_batches: int | None = None
    reduced: ReduceReport | None = None
    finished: FinishReport | None = None

    @classmethod
    def from_wire(cls, data: Any) -> StageReport:
        """As :meth:`WireRecord.from_wire`, taking ``spans`` flat as well: ``[action, start, end,
        action, ...]``, as the wire carries them (:func:`_report_fields`).

        Raises:
            RecordError: as a record's; or flat spans that are not whole triples.
        """
        if isinstance(data, dict):
            spans = data.get("spans")
            if isinstance(spans, list) and spans and type(spans[0]) is not list:
                if len(spans) % 3:
                    raise RecordError(f"StageReport: flat spans hold whole [action, start, end] triples, not "
                                      f"{len(spans)} items")
                data = {**data, "spans": [spans[i:i + 3] for i in range(0, len(spans), 3)]}
        report: StageReport = WireRecord.from_wire.__func__(cls, data)  # type: ignore[attr-defined]
        return report


def _report_fields(report: StageReport) -> dict[str, Any]:
    """A :class:`StageReport`'s fields for the wire, its spans flat: a report holds one span per action
    (323 at 2 stages x 64 micro-batches), and the decoder pays a Python call for every list, the
    depth check a look at it; flat, they are one list."""
    data = report.wire_fields()
    data["spans"] = [item for span in report.spans for item in span]
    return data


register_record(StageReport, StageReport.wire_name, fields=_report_fields)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgressReport(WireRecord):
    """What a stage actor is doing now (``StageActor.progress``, answered even mid-step)."""

    rank: int
    """Its pipeline rank."""
    step: int
    """The step it is on (-1: none yet)."""
    current: str | None = None
    """The action it is running (``0F3``), or None between actions."""
    done: int = 0
    """The step's actions it has finished."""
    inline_actions: int = 0
    """Compute actions run on the loop's thread so far (``stages.compute.inline``)."""
    thread_actions: int = 0
    """Compute actions run on the compute thread so far."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TailVote(WireRecord):
    """One stage's numbers for a step's global decision, sent to every stage of the job after its
    reduction, so that each makes the same decision (:func:`stages.compute.tail.decide_step`).

    Raises:
        ValueError: a field of the wrong type.
    """

    nonfinite_loss: bool
    """A loss of this stage's micro-batches is NaN or infinite."""
    nonfinite_gradient: bool
    """A gradient on this stage is NaN or infinite (before or after the reduction)."""
    grad_sq: float
    """This stage's share of the squared global norm (:attr:`ReduceReport.grad_sq`)."""
    items: float = 0.0
    """A last stage's count of its micro-batches' items (:attr:`StageReport.items`); 0 elsewhere."""

    def __post_init__(self) -> None:
        for name in ("nonfinite_loss", "nonfinite_gradient"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r:.40}")
        for name in ("grad_sq", "items"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r:.40}")
