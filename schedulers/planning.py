"""Choosing a schedule from measured costs: what ``schedule="auto"`` runs and ``job.plan()`` shows.

A step's stage reports say how long every action took on every stage actor.
:func:`measure_costs` turns them into each pipeline rank's cost of one micro-batch's
``F``, ``B``, ``I`` and ``W``, the bytes a micro-batch's activations hold there, the
link's speed and the step's time outside the stage programs (a
:class:`~schedulers.records.MeasuredCosts`). :func:`rank_candidates` runs the timed
simulator (:func:`~schedulers.simulate.simulate`) over every candidate schedule with
those costs and marks the fastest that the job's partition runs and its
``max_stash_bytes`` admits; :class:`NoScheduleFits` says when none does.

The candidates are GPipe, 1F1B and ZB-H1 on the job's one-stage-per-rank partition,
interleaved 1F1B with 2, 3 and 4 virtual stages where the micro-batches allow, and the
V-shaped ZB-V and DualPipeV (two stages per rank, rank 0 holding the first and the last).
These cut the model into more stages, which a running job cannot do, so such a candidate
is predicted (each chunk costing ``1/V`` of its rank, boundaries as large as the
measured ones) but only ever advised, never run, unless the job was partitioned for it. With fused weight
gradients each schedule is a candidate twice, with and without W batching (every W
deferred to the rank's tail, a run of them computed as one GEMM per weight: faster
GEMMs, more activations held): a probe step runs with it to measure what a batched W
costs per micro-batch (:data:`PROBE_STEPS`), and the stages turn it on or off per step.
A job with a fixed schedule is advised with its own ``w_batching``.

Pure functions: no actors, no sockets.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence

from stages import Action, ActionKind, Mesh, Placement, stage_to_rank, StageReport
from stages.sections import V_SCHEDULES
from schedulers.jobs import AUTO_PROBE, JobSpec
from schedulers.records import Candidate, MeasuredCosts, Plan
from schedulers.schedules import build_schedule
from schedulers.simulate import Costs, simulate
from schedulers.trace import StageRecord, match_transfers

__all__ = [
    "CANDIDATES",
    "PROBE_STEPS",
    "AutoSchedule",
    "NoScheduleFits",
    "advise",
    "choose",
    "measure_costs",
    "probe_steps",
    "rank_candidates",
    "simulation_costs",
    "with_overhead",
]

# (schedule, virtual stages) in the order a tie goes.
CANDIDATES: tuple[tuple[str, int | None], ...] = (
    ("1f1b", None), ("zero_bubble", None), ("gpipe", None),
    ("interleaved", 2), ("interleaved", 3), ("interleaved", 4), ("zbv", 2), ("dualpipev", 2),
)
# Steps a job with schedule="auto" runs the probe schedule for before it plans: the first
# warms the stages up (allocator, caches, the optimizer's state), the last is timed. With
# fused weight gradients one more comes between them, with W batching (as the warm-up): its
# Ws' cost.
PROBE_STEPS = 2
_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
_SENT_BY = {ActionKind.SEND_F: (_F,), ActionKind.SEND_B: (_B, _I)}  # a send's encoding counts to these


def probe_steps(spec: JobSpec) -> int:
    """How many steps a job with ``schedule="auto"`` runs the probe schedule before it plans."""
    return PROBE_STEPS + batched_probe(spec)


def batched_probe(spec: JobSpec) -> bool:
    """Whether ``schedule="auto"`` probes W batching too (a step that times the batched Ws, and its warm-up):
    with fused weight gradients, unless ``max_stash_bytes`` is set: a W-batched step holds every micro-batch
    until its tail, which the limit may not admit (it held three times the limit before any plan existed),
    and a plan under a limit then weighs W batching only where the job asks for it."""
    return spec.runtime.gradient_accumulation_fusion and spec.parallelism.max_stash_bytes is None


class NoScheduleFits(ValueError):
    """No schedule the job can run is predicted to hold its activations within ``max_stash_bytes``."""


def measure_costs(
    reports: Sequence[StageReport], mesh: Mesh, *, offsets: Sequence[float] | None = None,
    step_time_s: float | None = None, step: int = 0, placement: Placement = "loop",
) -> MeasuredCosts:
    """Each pipeline rank's costs, from one step's stage reports (by global rank).

    Args:
        reports: every stage actor's report of the step, by global rank in ``mesh``.
        offsets: each member's clock minus the head's (see ``schedulers.trace``); zeros
            when not given (one machine).
        step_time_s: the step's wall time on the head, for ``overhead_s`` (0 without it).
        step: the step's number, kept in the result.
        placement: how the step's model stages sat on the ranks (to pair its sends and receives).

    Raises:
        ValueError: a report of another size than the mesh, or one without spans.
    """
    if len(reports) != mesh.size or any(not r.spans for r in reports):
        raise ValueError(f"measure_costs needs a finished step's report from each of the {mesh.size} stage actors")
    per_member = [_member_costs(r) for r in reports]
    ratio = _input_share(per_member)
    kinds: dict[ActionKind, list[float]] = {k: [0.0] * mesh.pipeline for k in (_F, _B, _I, _W)}
    stash = [0.0] * mesh.pipeline
    for g, (report, stages) in enumerate(zip(reports, per_member)):
        rank = mesh.coords(g).pipeline
        for kind, value in _rank_totals(stages, ratio).items():
            kinds[kind][rank] = max(kinds[kind][rank], value)  # a rank is as slow as its slowest member
        if report.peak_stash:  # the peak counts (stage, micro-batch) pairs: a micro-batch holds one per chunk
            stash[rank] = max(stash[rank], report.peak_stash_bytes / report.peak_stash * len(stages))
    transfer_bytes, forward_ratio, backward_ratio, encoded = _wire_sizes(reports)
    elapsed = max(r.elapsed_s for r in reports)
    return MeasuredCosts(
        forward=kinds[_F], backward=kinds[_B], input_grad=kinds[_I], weight_grad=kinds[_W], stash_bytes=stash,
        transfer_bytes=transfer_bytes, forward_ratio=forward_ratio, backward_ratio=backward_ratio,
        bandwidth=_bandwidth(reports, mesh, offsets, encoded, placement),
        overhead_s=max(0.0, step_time_s - elapsed) if step_time_s is not None else 0.0, step=step,
    )


def _member_costs(report: StageReport) -> dict[int, dict[ActionKind, float]]:
    """One member's seconds per micro-batch, per model stage and compute kind, its sends' encoding included.

    The median over the step's micro-batches (a spike of the machine's load hits one),
    except for ``W``: its mean, since W batching runs a whole run of Ws in the last one.
    """
    durations: dict[int, dict[ActionKind, list[float]]] = defaultdict(lambda: defaultdict(list))
    for text, start, end in report.spans:
        action = Action.parse(str(text))
        durations[action.stage][action.kind].append(float(end) - float(start))
    costs: dict[int, dict[ActionKind, float]] = {}
    for stage, by_kind in durations.items():
        measured = {kind: statistics.fmean(values) if kind is _W else statistics.median(values)
                    for kind, values in by_kind.items()}
        costs[stage] = {kind: measured[kind] for kind in (_F, _B, _I, _W) if kind in measured}
        for send, producers in _SENT_BY.items():
            for kind in producers:
                if send in measured and kind in costs[stage]:
                    costs[stage][kind] += measured[send]
    return costs


def _input_share(members: Sequence[Mapping[int, Mapping[ActionKind, float]]]) -> float:
    """``I / (I + W)`` where both were measured (0.5 when nowhere): how an unsplit ``B`` divides."""
    both = [(c[_I], c[_W]) for stages in members for c in stages.values() if _I in c and _W in c]
    total = sum(i + w for i, w in both)
    return sum(i for i, _ in both) / total if total > 0 else 0.5


def _rank_totals(stages: Mapping[int, Mapping[ActionKind, float]], share: float) -> dict[ActionKind, float]:
    """The member's costs summed over its model stages, each missing kind estimated."""
    totals = dict.fromkeys((_F, _B, _I, _W), 0.0)
    for costs in stages.values():
        backward = costs.get(_B, costs.get(_I, 0.0) + costs.get(_W, 0.0))
        totals[_F] += costs.get(_F, 0.0)
        totals[_B] += backward
        totals[_I] += costs.get(_I, backward * share)
        totals[_W] += costs.get(_W, backward * (1 - share))
    return totals


def _wire_sizes(reports: Sequence[StageReport]) -> tuple[float, float, float, dict[str, float]]:
    """Raw bytes per boundary value, the forward and backward codec ratios, and encoded bytes per direction."""
    raw: dict[str, float] = defaultdict(float)
    sent: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for report in reports:
        for edge, stats in report.codec_stats.items():
            raw[edge[0]] += float(stats.get("raw_bytes", 0))
            sent[edge[0]] += float(stats.get("bytes", 0))
        for text, *_ in report.spans:
            kind = Action.parse(str(text)).kind
            if kind in _SENT_BY:
                count["F" if kind is ActionKind.SEND_F else "B"] += 1
    values = sum(count.values())
    transfer = sum(raw.values()) / values if values else 0.0
    encoded = {d: sent[d] / count[d] for d in count}

    def ratio(direction: str) -> float:
        return sent[direction] / raw[direction] if raw[direction] > 0 and sent[direction] > 0 else 1.0

    return transfer, ratio("F"), ratio("B"), encoded


def _bandwidth(reports: Sequence[StageReport], mesh: Mesh, offsets: Sequence[float] | None,
               encoded: Mapping[str, float], placement: Placement) -> float:
    """Bytes per second of the fastest transfer each way: a send's start to its receive's end.

    A receive ends no earlier than its value arrived (it waits for it), so the fastest
    of a step's transfers is the tightest bound the spans give on the link's time.
    """
    records = [StageRecord(member=g, name="", pipeline_rank=mesh.coords(g).pipeline,
                           replica=(mesh.coords(g).data, mesh.coords(g).tensor), started_at=r.started_at,
                           offset_s=offsets[g] if offsets else 0.0, spans=r.spans) for g, r in enumerate(reports)]
    fastest: dict[str, float] = {}
    for i, j, k, m in match_transfers(records, mesh.pipeline, placement):
        send, recv = records[i], records[k]
        direction = "F" if Action.parse(str(send.spans[j][0])).kind is ActionKind.SEND_F else "B"
        seconds = (recv.head_start + float(recv.spans[m][2])) - (send.head_start + float(send.spans[j][1]))
        fastest[direction] = min(fastest.get(direction, math.inf), seconds)
    seconds = sum(max(0.0, t) for t in fastest.values())
    nbytes = sum(encoded.get(d, 0.0) for d in fastest)
    return nbytes / seconds if seconds > 0 and nbytes > 0 else math.inf


def simulation_costs(costs: MeasuredCosts, virtual_stages: int = 1, *, batched_w: bool = False,
                     placement: Placement = "loop") -> Costs:
    """The simulator's costs for ``virtual_stages`` model stages per rank placed by ``placement``, each
    ``1/V`` of its rank's (``batched_w``: a ``W`` costs what it does with W batching, where that was
    measured)."""
    ranks = len(costs.forward)
    weight_grad = costs.weight_grad_batched if batched_w and costs.weight_grad_batched is not None \
        else costs.weight_grad

    def per_stage(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(values[stage_to_rank(s, ranks, placement)] / virtual_stages for s in range(ranks * virtual_stages))

    return Costs(forward=per_stage(costs.forward), backward=per_stage(costs.backward),
                 input_grad=per_stage(costs.input_grad), weight_grad=per_stage(weight_grad),
                 bandwidth=costs.bandwidth, activation_bytes=costs.transfer_bytes,
                 codec_ratio=costs.forward_ratio, gradient_codec_ratio=costs.backward_ratio)


def rank_candidates(
    costs: MeasuredCosts, *, num_microbatches: int, virtual_stages: int = 1, split: bool = True,
    batch_w: bool = False, max_stash_bytes: int | None = None, placement: Placement = "loop",
    own: tuple[str, int | None] | None = None,
) -> list[Candidate]:
    """Every candidate schedule simulated with ``costs``, fastest first, the chosen one marked.

    Args:
        costs: per pipeline rank, as :func:`measure_costs` gives them.
        num_microbatches: micro-batches per step.
        virtual_stages: model stages per rank of the job's partition, and ``placement``
            how they sit on the ranks: the candidates that cut and place as it does are the
            ones it runs.
        split: backward split into ``I`` and ``W`` where the input gradient leaves the
            rank (the job's ``gradient_accumulation_fusion``).
        batch_w: every ``W`` deferred to the rank's tail (the job's ``w_batching``), where
            W batching is no candidate of its own: without ``split``, or without a
            measured batched W (``costs.weight_grad_batched``). With both, every
            schedule is a candidate with and without it.
        max_stash_bytes: the most bytes of activations one rank may hold (None: no limit).
        own: the job's own schedule and virtual stages (a fixed schedule's advice): a candidate
            too, where :data:`CANDIDATES` has it not (interleaved x5 and more) or leaves it out
            (several chunks on one rank), so the job's partition always runs one.

    Raises:
        NoScheduleFits: no runnable candidate fits ``max_stash_bytes`` (the message names
            the smallest and what would help).
    """
    num_stages = len(costs.forward)
    options = (False, True) if split and costs.weight_grad_batched is not None else (batch_w,)
    ranked: list[Candidate] = []
    for name, virtual in (*CANDIDATES, *([own] if own is not None and own not in CANDIDATES else [])):
        if virtual is not None and num_stages == 1 and (name, virtual) != own:
            continue  # every chunk on the one rank: nothing to interleave
        for batched in options:
            try:
                program = build_schedule(name, num_stages, num_microbatches, virtual, split=split, batch_w=batched)
            except ValueError:
                break  # e.g. interleaving needs micro-batches in multiples of the stages
            chunks = virtual or 1
            placed: Placement = "v" if name in V_SCHEDULES else "loop"
            result = simulate(program, simulation_costs(costs, chunks, batched_w=batched, placement=placed))
            stash_bytes = [int(n * costs.stash_bytes[r] / chunks) for r, n in enumerate(result.peak_stash)]
            ranked.append(Candidate(
                schedule=name, virtual_stages=virtual, predicted_step_s=result.makespan + costs.overhead_s,
                bubble_fraction=result.bubble_fraction, stash=list(result.peak_stash), stash_bytes=stash_bytes,
                runnable=chunks == virtual_stages and (placed == placement or chunks == 1), w_batching=batched,
                fits=max_stash_bytes is None or max(stash_bytes) <= max_stash_bytes))
    ranked.sort(key=lambda c: (c.predicted_step_s, max(c.stash_bytes)))  # stable: CANDIDATES' order breaks ties
    best = choose(ranked, max_stash_bytes)
    return [dataclasses.replace(c, chosen=True) if c is best else c for c in ranked]


def choose(candidates: Sequence[Candidate], max_stash_bytes: int | None = None) -> Candidate:
    """The first runnable candidate that fits, of candidates sorted fastest first.

    Raises:
        NoScheduleFits: none is runnable, or none of those fits ``max_stash_bytes``.
    """
    runnable = [c for c in candidates if c.runnable]
    fitting = [c for c in runnable if c.fits]
    if fitting:
        return fitting[0]
    if not runnable:
        raise NoScheduleFits("no candidate schedule runs on this job's partition")
    least = min(runnable, key=lambda c: max(c.stash_bytes))
    need = max(least.stash_bytes)
    raise NoScheduleFits(
        f"no schedule fits max_stash_bytes={max_stash_bytes}: the least any would hold on one stage actor is "
        f"{need} bytes ({least.label}, {max(least.stash)} micro-batches of activations); raise max_stash_bytes to "
        f"at least {need}, or hold less: more micro-batches (each smaller), more pipeline stages, or "
        "activation_checkpointing")


def with_overhead(candidates: Sequence[Candidate], overhead_s: float) -> list[Candidate]:
    """The candidates with ``overhead_s`` (the step's time outside the programs) added to each prediction."""
    return [dataclasses.replace(c, predicted_step_s=c.predicted_step_s + overhead_s) for c in candidates]


class AutoSchedule:
    """One job's ``schedule="auto"``: measuring, then planned; the controller asks it what to run.

    While it measures, the job's steps run :data:`~schedulers.jobs.AUTO_PROBE`; the last
    of :data:`PROBE_STEPS` is timed, and between its barrier and its optimizer step
    :meth:`rank` simulates the candidates (so that a ``max_stash_bytes`` nothing fits
    fails that step before anything is applied). Once the step is done, :meth:`adopt`
    adds the measured overhead and from the next step on the chosen schedule runs;
    :meth:`prediction` compares each of its steps with what the plan predicted.
    """

    def __init__(self, spec: JobSpec) -> None:
        self.reset(spec)

    def reset(self, spec: JobSpec) -> None:
        """Starts over (a new job, or settings changed at the barrier): measure again if auto."""
        # With fused weight gradients, a probe step with W batching between the warm-up and the timed one.
        self.batched_probe = batched_probe(spec)
        self.probe_steps_left = probe_steps(spec) if spec.parallelism.schedule == "auto" else 0
        self.weight_grad_batched: list[float] | None = None  # per rank, from the batched probe step
        self.candidates: list[Candidate] = []
        self.costs: MeasuredCosts | None = None
        self.offsets: list[float] | None = None  # each member's clock offset, taken after the warm-up probe
        self.last_step_s: float | None = None
        self.last_error: float | None = None

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.chosen), None)

    @property
    def measuring(self) -> bool:
        """The next step runs the probe schedule."""
        return self.probe_steps_left > 0

    @property
    def timed(self) -> bool:
        """The next step is the probe step the plan is made from."""
        return self.probe_steps_left == 1

    def warmed_up(self) -> bool:
        """A probe step before the timed one is done; True when the next is the timed one."""
        assert self.probe_steps_left > 1, "the timed probe step ends in adopt()"
        self.probe_steps_left -= 1
        return self.timed

    @property
    def batched_step(self) -> bool:
        """The next step is a probe step with W batching: the warm-up (which also warms the batched
        GEMMs' buffers: measured cold, a batched W cost a third more than warm) and the one its Ws'
        cost is measured from."""
        return self.batched_probe and self.probe_steps_left >= 2

    def running(self, spec: JobSpec) -> str:
        """The schedule the job's next step runs."""
        if spec.parallelism.schedule != "auto":
            return spec.parallelism.schedule
        chosen = self.chosen
        return chosen.schedule if chosen is not None and not self.measuring else AUTO_PROBE

    def running_w_batching(self, spec: JobSpec) -> bool:
        """Whether the job's next step runs with W batching."""
        if spec.parallelism.schedule != "auto":
            return spec.parallelism.w_batching
        chosen = self.chosen
        if self.measuring or chosen is None:
            return self.batched_step
        return chosen.w_batching

    def probed(self, reports: Sequence[StageReport], mesh: Mesh) -> None:
        """A probe step before the timed one is done: keep its Ws' cost if it batched them."""
        if self.batched_step:
            self.weight_grad_batched = measure_costs(reports, mesh).weight_grad

    def rank(self, spec: JobSpec, reports: Sequence[StageReport], mesh: Mesh, step: int) -> list[Candidate]:
        """The candidates, from the timed probe step's reports (before its optimizer step; no overhead yet).

        Raises:
            NoScheduleFits: nothing fits ``spec.parallelism.max_stash_bytes``.
        """
        costs = dataclasses.replace(measure_costs(reports, mesh, offsets=self.offsets, step=step),
                                    weight_grad_batched=self.weight_grad_batched)
        p = spec.parallelism
        ranked = rank_candidates(costs, num_microbatches=p.micro_batches, virtual_stages=spec.num_virtual_stages,
                                 split=spec.runtime.gradient_accumulation_fusion, batch_w=p.w_batching,
                                 max_stash_bytes=p.max_stash_bytes)
        self.costs = costs
        return ranked

    def adopt(self, ranked: Sequence[Candidate], overhead_s: float) -> None:
        """The timed probe step is done: its plan (with ``overhead_s``) holds from the next step."""
        assert self.costs is not None
        self.costs = dataclasses.replace(self.costs, overhead_s=max(0.0, overhead_s))
        self.candidates = with_overhead(ranked, self.costs.overhead_s)
        self.probe_steps_left = 0

    def prediction(self, ran: str, step_time_s: float) -> tuple[float | None, float | None]:
        """``(predicted_step_s, prediction_error)`` of a step that ran ``ran`` (Nones while measuring)."""
        chosen = self.chosen
        if chosen is None or self.measuring or chosen.schedule != ran:
            return None, None
        error = (step_time_s - chosen.predicted_step_s) / chosen.predicted_step_s
        self.last_step_s, self.last_error = step_time_s, error
        return chosen.predicted_step_s, error

    def plan(self, job: str, spec: JobSpec) -> Plan:
        """The plan as ``job.plan()`` shows it, for a job with ``schedule="auto"``."""
        chosen, p = self.chosen, spec.parallelism
        return Plan(job=job, schedule=p.schedule, running=self.running(spec),
                    state="measuring" if self.measuring else "planned", candidates=list(self.candidates),
                    chosen=chosen.label if chosen is not None else None, max_stash_bytes=p.max_stash_bytes,
                    costs=self.costs, last_step_s=self.last_step_s, prediction_error=self.last_error)


def advise(job: str, spec: JobSpec, reports: Sequence[StageReport], mesh: Mesh, *,
           offsets: Sequence[float] | None, step_time_s: float, step: int) -> Plan:
    """The plan for a job with a fixed schedule, from its last step: what auto would run, and why."""
    p = spec.parallelism
    costs = measure_costs(reports, mesh, offsets=offsets, step_time_s=step_time_s, step=step, placement=p.placement)
    ranked = rank_candidates(costs, num_microbatches=p.micro_batches, virtual_stages=spec.num_virtual_stages,
                             split=spec.runtime.gradient_accumulation_fusion, batch_w=p.w_batching,
                             placement=p.placement,
                             own=(p.schedule, spec.num_virtual_stages if spec.num_virtual_stages > 1 else None))
    chosen = next(c for c in ranked if c.chosen)
    return Plan(job=job, schedule=p.schedule, running=p.schedule, state="advice", candidates=ranked,
                chosen=chosen.label, costs=costs, last_step_s=step_time_s)
