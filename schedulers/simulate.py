"""Timed simulation of a schedule, and its timeline as a trace or an ASCII chart.

Time is in seconds of the caller's choosing; the defaults are unit costs (``F=1``,
``B=2``, ``I=W=1``, free links). Each rank runs its program in order; an action starts
when its rank is free and what it needs has finished or, from another rank, arrived.

Links: a value that crosses ranks (an activation forward, an input gradient
backward) leaves when the producing action (or its ``SEND``) ends, occupies the
directed link for ``bytes / bandwidth`` and arrives ``latency_s`` later, with
``bytes = activation_bytes * codec_ratio`` forward and ``activation_bytes *
gradient_codec_ratio`` backward (an input gradient has its activation's shape). Transfers overlap compute: a ``SEND``
takes no rank time and a ``RECV`` only waits. Neighbouring stages on one rank hand
values over locally, for free. The step tail (barrier, reduce, step) takes no time.

Stash: a micro-batch's activations are stashed on a stage from its ``F`` until its
``B`` or, for a split backward, until its ``W`` (the weight gradient still needs the
stage's input, so the memory is not free after ``I``). The peak is per rank, summed
over the rank's virtual stages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stages import Action, ActionKind, COMPUTE_KINDS
from schedulers import trace
from schedulers.dataflow import Schedule, infer_layout, play
from schedulers.validate import deadlock_error, validate

__all__ = ["Costs", "Event", "RankStats", "SimResult", "simulate", "to_ascii", "to_chrome_trace"]

PerStage = float | Sequence[float]


@dataclass(frozen=True, slots=True, kw_only=True)
class Costs:
    """Per-action costs for :func:`simulate`.

    Attributes:
        forward, backward, input_grad, weight_grad: time of ``F``, ``B``, ``I``, ``W``;
            one number for every stage or one per model stage.
        latency_s: a link's latency.
        bandwidth: a link's bandwidth in bytes per second.
        activation_bytes: size of one micro-batch's activation (and of its
            gradient) between two stages, before encoding.
        codec_ratio: encoded size over raw size (``0.25`` for int8 of float32).
        gradient_codec_ratio: the same for input gradients; ``None``: ``codec_ratio``.
    """

    forward: PerStage = 1.0
    backward: PerStage = 2.0
    input_grad: PerStage = 1.0
    weight_grad: PerStage = 1.0
    latency_s: float = 0.0
    bandwidth: float = math.inf
    activation_bytes: float = 0.0
    codec_ratio: float = 1.0
    gradient_codec_ratio: float | None = None

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "input_grad", "weight_grad"):
            value = getattr(self, name)
            values = [value] if isinstance(value, (int, float)) else list(value)
            if not values or any(v < 0 for v in values):
                raise ValueError(
                    f"Costs.{name} must be >= 0 (one value or one per stage), got {value!r}"
                )
            if not isinstance(value, (int, float)):
                object.__setattr__(self, name, tuple(values))  # frozen and hashable
        if self.latency_s < 0 or self.activation_bytes < 0:
            raise ValueError("Costs.latency_s and Costs.activation_bytes must be >= 0")
        gradient_ratio = self.codec_ratio if self.gradient_codec_ratio is None else self.gradient_codec_ratio
        if self.bandwidth <= 0 or self.codec_ratio <= 0 or gradient_ratio <= 0:
            raise ValueError("Costs.bandwidth, Costs.codec_ratio and Costs.gradient_codec_ratio must be > 0")

    def compute_time(self, action: Action) -> float:
        """How long ``action`` keeps its rank busy."""
        value = {
            ActionKind.F: self.forward,
            ActionKind.B: self.backward,
            ActionKind.I: self.input_grad,
            ActionKind.W: self.weight_grad,
        }.get(action.kind, 0.0)
        if isinstance(value, (int, float)):
            return float(value)
        if action.stage >= len(value):
            raise ValueError(
                f"Costs give {len(value)} per-stage values, "
                f"but the schedule has stage {action.stage}"
            )
        return float(value[action.stage])

    def link(self, leaves: float, free_at: float, action: Action | None = None) -> tuple[float, float]:
        """Send one value over a link: returns (link busy until, arrival time).

        ``action`` is what produced the value: a backward one (``B``, ``I``, ``SEND_B``)
        sends an input gradient, anything else an activation.
        """
        backward = action is not None and action.kind in (ActionKind.B, ActionKind.I, ActionKind.SEND_B)
        ratio = self.gradient_codec_ratio if backward and self.gradient_codec_ratio is not None else self.codec_ratio
        size = self.activation_bytes * ratio
        start = max(leaves, free_at)
        done = start + (size / self.bandwidth if size else 0.0)
        return done, done + self.latency_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One action's span on the simulated timeline."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStats:
    """One rank's share of the step: ``busy + idle == makespan``."""

    busy: float
    idle: float
    bubble_fraction: float
    peak_stash: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """What :func:`simulate` found.

    Attributes:
        makespan: time from the first action's start to the last one's end.
        bubble_fraction: ``1 - total busy / (num_ranks * makespan)``.
        ranks: per-rank busy and idle time, bubble fraction and peak stash.
        events: every action's span, rank by rank in program order.
        transfers: ``(source rank, destination rank, leaves, arrives, producer)``
            for every value that crossed a link.
    """

    makespan: float
    bubble_fraction: float
    ranks: tuple[RankStats, ...]
    events: tuple[Event, ...] = field(repr=False)
    transfers: tuple[tuple[int, int, float, float, Action], ...] = field(repr=False)

    @property
    def peak_stash(self) -> tuple[int, ...]:
        """Peak stashed micro-batch activations, per rank."""
        return tuple(r.peak_stash for r in self.ranks)


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Time ``schedule`` under ``costs`` (unit costs by default).

    Raises:
        ScheduleError: the schedule is invalid (see :func:`validate`).
        DeadlockError: the programs deadlock; the message names the blocked actions.
        ValueError: per-stage costs do not cover every stage.
    """
    costs = costs or Costs()
    layout = validate(schedule)
    timeline = play(schedule, costs.compute_time, costs.link, layout=layout)
    if timeline.blocked:  # validate() already rules this out; kept for safety
        raise deadlock_error(schedule, timeline.blocked)
    events = tuple(
        Event(rank=rank, action=action, start=timeline.start[rank, i], end=timeline.end[rank, i])
        for rank, program in schedule.items()
        for i, action in enumerate(program)
    )
    makespan = max((e.end for e in events), default=0.0)
    stats = []
    for rank, program in schedule.items():
        spans = [e for e in events if e.rank == rank and e.action.kind in COMPUTE_KINDS]
        busy = sum(e.end - e.start for e in spans)
        stats.append(
            RankStats(
                busy=busy,
                idle=makespan - busy,
                bubble_fraction=1 - busy / makespan if makespan else 0.0,
                peak_stash=_peak_stash(program),
            )
        )
    total_busy = sum(r.busy for r in stats)
    transfers = tuple(
        (src, dst, leaves, arrives, schedule[src][i])
        for (src, i), dst, leaves, arrives in timeline.transfers
    )
    return SimResult(
        makespan=makespan,
        bubble_fraction=1 - total_busy / (len(stats) * makespan) if makespan else 0.0,
        ranks=tuple(stats),
        events=events,
        transfers=transfers,
    )


def _peak_stash(program: Sequence[Action]) -> int:
    # A rank runs its program in order, so the peak follows from the order alone.
    held = peak = 0
    for action in program:
        if action.kind is ActionKind.F:
            held += 1
            peak = max(peak, held)
        elif action.kind in (ActionKind.B, ActionKind.W):
            held -= 1
    return peak


def to_chrome_trace(result: SimResult, *, title: str = "pipeline schedule") -> dict[str, Any]:
    """The timeline as Chrome/Perfetto trace JSON, in the format of a measured step.

    Each rank becomes a :class:`~schedulers.trace.StageRecord` (track ``rank r``)
    and :func:`schedulers.trace.to_chrome_trace` writes them: a span per action and a
    flow arrow from each ``SEND`` to the ``RECV`` that took its value. Times are
    microseconds (1 s -> 1e6 us). A compute-only schedule has no sends, so its trace
    has no arrows; lower it with ``add_send_recv`` to see them. ``otherData`` says
    ``clock: simulated`` and holds the makespan and bubble fraction.
    """
    records = [
        trace.StageRecord(
            member=rank,
            name=f"rank {rank}",
            pipeline_rank=rank,
            started_at=0.0,
            spans=[(str(e.action), e.start, e.end) for e in result.events if e.rank == rank],
        )
        for rank in range(len(result.ranks))
    ]
    metadata = {
        "clock": "simulated",
        "makespan": result.makespan,
        "bubble_fraction": result.bubble_fraction,
    }
    programs = {rank: [e.action for e in result.events if e.rank == rank] for rank in range(len(result.ranks))}
    return trace.to_chrome_trace(
        records, num_ranks=len(result.ranks), title=title, metadata=metadata,
        placement=infer_layout(programs).placement,
    )


def to_ascii(result: SimResult, width: int = 72) -> str:
    """The timeline as text: one row per rank, a letter per busy slice, ``.`` idle.

    Each of the ``width`` columns shows the compute kind (F/B/I/W) running at the
    column's midpoint; a rank's bubble fraction ends its row.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    label = len(str(len(result.ranks) - 1))
    step = result.makespan / width
    lines = [f"{'':>{label}}  makespan {result.makespan:g}, one column = {step:.3g}"]
    for rank, stats in enumerate(result.ranks):
        spans = [e for e in result.events if e.rank == rank and e.action.kind in COMPUTE_KINDS]
        row = []
        for column in range(width):
            t = (column + 0.5) * step
            hit = next((e for e in spans if e.start <= t < e.end), None)
            row.append(hit.action.kind.value if hit else ".")
        lines.append(f"{rank:>{label}} |{''.join(row)}| bubble {stats.bubble_fraction:.3f}")
    return "\n".join(lines)
