"""What the console prints: tables, one-line events, progress bars. Pure functions of the data."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from actors import Event, NodeInfo, NodeJoined, NodeLeft, NodeSilent
from stages import Action
from schedulers.events import (
    CheckpointSaved, EarlyStopped, Evaluated, JobClosed, JobCreated,
    JobFailed, JobPaused, JobRecovered, JobResumed, MonitorFailed,
    RunFinished, RunStarted, SchedulePlanned, SettingPending, SettingRejected, SettingsApplied, StepFinished,
)
from schedulers.grid import format_grid
from schedulers.records import JobDescription, MeasuredCosts, Plan, StepStats

__all__ = [
    "event_line", "format_bytes", "job_status", "jobs_table", "nodes_table", "plan_lines", "progress_bar",
    "schedule_grid", "status_table",
]


def format_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _number(value: Any, spec: str = ".4f", missing: str = "-") -> str:
    """``value`` formatted; ``missing`` where there is none. A NaN is shown as one (a loss that diverged
    is what a person most needs to see, and ``-`` said "no value")."""
    if value is None:
        return missing
    return format(value, spec)


def _rates(lrs: Any) -> str:
    """``, lr 0.001`` (``0.001/0.002``: one per parameter group when they differ); nothing when unknown."""
    if not lrs:
        return ""
    shown = lrs[:1] if len(set(lrs)) == 1 else lrs
    return ", lr " + "/".join(_number(lr, ".4g") for lr in shown)


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """``[######--------------] 6/20`` as plain text, for the toolbar and logs."""
    filled = 0 if total <= 0 else min(width, round(width * done / total))
    return f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total}"


def nodes_table(nodes: Sequence[NodeInfo]) -> Table:
    """The head's nodes: name, state, device, host, pid (``-`` for a client's key), memory, last heartbeat."""
    table = Table(title="nodes", title_justify="left")
    for column in ("name", "state", "device", "host", "pid", "memory", "last heartbeat"):
        table.add_column(column, justify="right" if column in ("pid", "memory", "last heartbeat") else "left")
    for n in sorted(nodes, key=lambda n: n.name):
        table.add_row(n.name, n.state, n.device, n.host, str(n.pid or "-"), format_bytes(n.memory_bytes),
                      f"{n.last_heartbeat_age_s:.1f} s ago")
    return table


def job_status(info: JobDescription) -> str:
    """One word for where a job is: running 3/10, paused, failed, idle."""
    run = info.run
    if run is not None and run.active:
        state = f"running {run.done}/{run.target}"
        return state + (" (paused)" if info.paused else "")
    if info.paused:
        return "paused"
    if run is not None and run.error:
        return "failed"
    return "idle"


def jobs_table(infos: Sequence[JobDescription]) -> Table:
    """Every job: schedule, mesh, nodes, steps taken, state."""
    table = Table(title="jobs", title_justify="left")
    for column in ("job", "schedule", "micro-batches", "mesh (p x t x d)", "nodes", "steps", "state"):
        table.add_column(column)
    for info in infos:
        table.add_row(info.job, _schedule(info), str(info.spec.parallelism.micro_batches), " x ".join(map(str, info.mesh)),
                      ", ".join(info.nodes), str(info.steps), job_status(info))
    return table


def status_table(infos: Sequence[JobDescription]) -> Table:
    """Every job's last step: loss, step time, samples/s, bubble."""
    table = Table(title="status", title_justify="left")
    for column in ("job", "step", "loss", "step time", "samples/s", "bubble", "state"):
        table.add_column(column, justify="left" if column in ("job", "state") else "right")
    for info in infos:
        stats = info.last_stats
        if stats is None:
            table.add_row(info.job, "-", "-", "-", "-", "-", job_status(info))
            continue
        table.add_row(info.job, _number(stats.step, "d"), _number(stats.loss),
                      _number(stats.step_time_s, ".3f") + " s", _number(stats.samples_per_s, ".1f"),
                      _number(stats.bubble_fraction, ".1%"), job_status(info))
    return table


def job_detail(info: JobDescription) -> list[str]:
    """A job's status as lines: layout, last step, run, pending settings, bytes per edge."""
    spec, stats, mesh = info.spec, info.last_stats, info.mesh
    codecs = f"{spec.communication.activation_codec}/{spec.communication.gradient_codec}"
    lines = [
        f"{info.job}: {spec.training.model} | schedule {_schedule(info)}, {spec.parallelism.micro_batches} "
        f"micro-batches | {mesh[0]} stages x {mesh[1]} tp x {mesh[2]} dp on {', '.join(info.nodes)} "
        f"| codecs {codecs} | {job_status(info)}",
    ]
    if stats is not None:
        lines.extend(_stats_lines(stats, spec.mixed_precision.precision))
    else:
        lines.append(f"no step finished yet ({info.steps} started)")
    run = info.run
    if run is not None:
        outcome = ("stopping" if run.stopping else "running") if run.active else \
            "failed: " + run.error if run.error else "finished" if run.done >= run.target else \
            "stopped early (the evaluations stopped improving)" if run.stopped_early else "stopped"
        lines.append(f"run: {progress_bar(run.done, run.target)} {outcome}")
    saving = spec.checkpointing
    if saving.checkpoint_every:
        kept = f"the newest {saving.keep_checkpoints}" if saving.keep_checkpoints else "every version"
        kept += " and the best" if saving.keep_best and saving.keep_checkpoints else ""
        lines.append(f"saves itself every {saving.checkpoint_every} steps into {saving.checkpoint_dir}, keeping {kept}")
        if info.best_checkpoint is not None:
            lines.append(f"best checkpoint: {info.best_checkpoint}")
    checking = spec.evaluation
    if checking.eval_every:
        on = f"{checking.eval_batches} batches of" if checking.eval_batches else "one pass over"
        lines.append(f"evaluates itself every {checking.eval_every} steps on {on} {checking.eval_data}")
    for said, evaluated in (("last", info.last_eval), ("best", info.best_eval)):
        if evaluated is not None and (said == "last" or evaluated != info.last_eval):
            lines.append(f"{said} " + (event_line(evaluated) or "").removeprefix(f"{info.job} "))
    if info.pending:
        lines.append("pending until the next barrier: "
                     + ", ".join(f"{k}={v}" for k, v in sorted(info.pending.items())))
    return lines


def _stats_lines(stats: StepStats, precision: str) -> list[str]:
    """The last step's lines of :func:`job_detail`."""
    lines = [
        f"step {stats.step}: loss {_number(stats.loss)}, step time {_number(stats.step_time_s, '.3f')} s"
        + ("" if stats.predicted_step_s is None else
           f" (predicted {_number(stats.predicted_step_s, '.3f')} s, {_error(stats.prediction_error)})")
        + f", {_number(stats.samples_per_s, '.1f')} samples/s, "
        f"bubble {_number(stats.bubble_fraction, '.1%')}{_rates(stats.lr)}, {format_bytes(stats.bytes_sent)} "
        f"between stages (schedule {stats.schedule}, {stats.micro_batches} micro-batches)"]
    if stats.skipped:
        lines.append("step skipped, nothing applied; not finite: " + "; ".join(stats.nonfinite))
    training = [f"grad norm {_number(stats.grad_norm, '.4g')}"] if stats.grad_norm is not None else []
    if stats.loss_scale is not None:
        training.append(f"loss scale {_number(stats.loss_scale, 'g')} "
                        f"({stats.skipped_steps} steps skipped for overflow)")
    if precision != "fp32":
        training.append(f"precision {precision}")
    if training:
        lines.append(", ".join(training))
    for names in stats.tied:
        lines.append("tied across stages: " + " = ".join(names) + " (gradients summed before each step)")
    recovery = stats.recovery
    if recovery:
        moved = ", ".join(f"{old} -> {new}" for old, new in sorted(recovery.moved.items()))
        lines.append(f"recovered before this step: {moved}, from step {recovery.from_step}, "
                     f"{recovery.replayed} replayed, {_number(recovery.seconds, '.1f')} s")
    if stats.bytes_per_edge:
        lines.append("bytes per edge: " + ", ".join(f"{edge} {format_bytes(n)}"
                                                    for edge, n in sorted(stats.bytes_per_edge.items())))
    return lines


def _schedule(info: JobDescription) -> str:
    """``1f1b``, or ``auto (zero_bubble)``: the setting and, where auto chose, what runs."""
    setting, running = info.spec.parallelism.schedule, info.running
    return f"{setting} ({running})" if running and running != setting else str(setting)


def schedule_grid(info: JobDescription) -> str:
    """The job's compiled programs as a stage-by-time grid, with a one-line header."""
    programs = {rank: [Action.parse(a) for a in program] for rank, program in enumerate(info.programs)}
    header = (f"{info.job}: {_schedule(info)}, {len(programs)} stages, {info.spec.parallelism.micro_batches} "
              "micro-batches (one column per action slot; - idle)")
    return header + "\n" + format_grid(programs)


def _error(error: Any) -> str:
    """``+3.1%``: a relative prediction error."""
    return _number(error * 100 if isinstance(error, (int, float)) else None, "+.1f") + "%"


def plan_lines(plan: Plan) -> list[str]:
    """``job.plan()`` as lines: the candidates fastest first (``*`` the chosen), the costs, the last step's error."""
    job, state, schedule = plan.job, plan.state, plan.schedule
    if state == "measuring":
        return [f"{job}: schedule auto: measuring; the next steps run {plan.running} and time every stage, "
                "then it runs the fastest schedule predicted"]
    if state == "no_steps":
        return [f"{job}: schedule {schedule}; after a step, this predicts every candidate schedule from its costs"]
    costs = plan.costs
    step = costs.step if costs is not None else None
    limit = plan.max_stash_bytes
    if state == "planned":
        head = (f"{job}: schedule auto runs {plan.chosen}, planned from step {step} "
                f"(max_stash_bytes {format_bytes(limit) if limit else 'none'})")
    else:
        head = f"{job}: schedule {schedule}; from step {step}'s costs, auto would run {plan.chosen}"
    width = max([len("schedule"), *(len(c.label) for c in plan.candidates)])  # "interleaved x4 +wbatch": 22
    lines = [head, f"  {'schedule':<{width}} {'predicted':>10} {'bubble':>7}  peak stash per stage"]
    for c in plan.candidates:
        stash = " ".join(str(n) for n in c.stash)
        sizes = ", ".join(format_bytes(n) for n in c.stash_bytes)
        notes = []
        if not c.runnable:
            virtual = f", virtual_stages={c.virtual_stages}" if c.schedule == "interleaved" else ""
            notes.append(f"re-partitions the model: a new job with schedule='{c.schedule}'{virtual}")
        if not c.fits:
            notes.append("over max_stash_bytes")
        if c.schedule == plan.running and state == "advice" and c.runnable:
            notes.append("running")
        lines.append(f"{'*' if c.chosen else ' '} {c.label:<{width}} {_number(c.predicted_step_s, '.3f'):>8} s "
                     f"{_number(c.bubble_fraction, '.1%'):>7}  {stash} ({sizes})"
                     + (f"  [{'; '.join(notes)}]" if notes else ""))
    if costs is not None:
        lines.append(_costs_line(costs))
    if plan.prediction_error is not None:
        lines.append(f"last step {_number(plan.last_step_s, '.3f')} s, "
                     f"{_error(plan.prediction_error)} against the prediction")
    return lines


def _costs_line(costs: MeasuredCosts) -> str:
    kinds: list[tuple[str, list[float]]] = [("F", costs.forward), ("B", costs.backward), ("I", costs.input_grad),
                                            ("W", costs.weight_grad)]
    if costs.weight_grad_batched:
        kinds.append(("W batched", costs.weight_grad_batched))
    per_stage = " | ".join(f"{kind} " + " ".join(_number(v, ".4f") for v in values) for kind, values in kinds)
    link = "free" if math.isinf(costs.bandwidth) else f"{format_bytes(costs.bandwidth)}/s"
    return (f"costs per stage, s per micro-batch: {per_stage}; link {link}, "
            f"{format_bytes(costs.transfer_bytes)} a value; outside the programs {_number(costs.overhead_s, '.3f')} s")


def event_line(event: Event) -> str | None:
    """One line for an event from the head or the scheduler (None: not worth a line)."""
    match event:
        case NodeJoined():
            return f"+ node {event.node} joined"
        case NodeLeft():
            return f"- node {event.node} left"
        case NodeSilent():
            return f"! node {event.node} lost (silent {_number(event.silent_s, '.1f')} s)"
        case StepFinished():
            run = event.run
            where = f" [{run.done}/{run.target}]" if run else ""
            skipped = " (skipped: not finite, nothing applied)" if event.skipped else ""
            predicted = "" if event.predicted_step_s is None else \
                f" (predicted {_number(event.predicted_step_s, '.3f')} s, {_error(event.prediction_error)})"
            return (f"{event.job} step {event.step}{where} {event.schedule}: loss {_number(event.loss)}, "
                    f"{_number(event.step_time_s, '.3f')} s{predicted}, bubble "
                    f"{_number(event.bubble_fraction, '.0%')}{_rates(event.lr)}{skipped}")
        case SchedulePlanned():
            return (f"{event.job}: schedule auto plans {event.schedule} from step {event.step} on "
                    f"(predicted {_number(event.predicted_step_s, '.3f')} s a step; 'schedule {event.job}' shows why)")
        case JobFailed():
            return f"! {event.job} step {event.step} failed: {event.error}"
        case JobRecovered():
            moved = ", ".join(f"{old} -> {new}" for old, new in sorted(event.moved.items()))
            return (f"* {event.job} recovered: {moved}; rolled back to step {event.from_step}, "
                    f"replaying {event.replayed} in {_number(event.seconds, '.1f')} s "
                    f"({event.restarts_left} restarts left)")
        case JobCreated():
            return f"+ {event.job} created on {', '.join(event.nodes)}"
        case JobClosed():
            return f"- {event.job} closed"
        case JobPaused():
            return f"{event.job} paused before step {event.step}"
        case JobResumed():
            return f"{event.job} resumed at step {event.step}"
        case RunStarted():
            return f"{event.job} run of {event.steps} steps started" + (" (paused)" if event.paused else "")
        case RunFinished():
            outcome = {"done": "finished", "stopped": "stopped", "failed": "failed", "cancelled": "cancelled"}
            return f"{event.job} run {outcome.get(event.reason, event.reason)} after {event.done}/{event.target} steps"
        case SettingPending():
            return f"{event.job}: {event.key}={event.value} requested; it applies at the next barrier"
        case SettingsApplied():
            changes = ", ".join(f"{k}={v}" for k, v in sorted(event.changes.items()))
            return f"{event.job}: now {changes}, from step {event.step} on"
        case SettingRejected():
            return f"! {event.job}: {event.error}"
        case MonitorFailed():
            return f"! {event.job}: monitor {event.monitor} is off ({event.error}); training goes on"
        case CheckpointSaved():
            return f"{event.job} saved itself after step {event.step}: {event.version}" + (
                " (its best evaluation so far: kept)" if event.best else "")
        case EarlyStopped():
            return (f"{event.job} stops early after step {event.step}: {event.metric} did not improve for "
                    f"{event.patience} evaluation{'s' if event.patience != 1 else ''} (best {event.best:.4g} after "
                    f"step {event.best_step})")
        case Evaluated():
            on = f"validation ({event.batches} batch{'es' if event.batches != 1 else ''})" if event.validation \
                else "a batch"
            metrics = "".join(f", {name} {value:.4g}" for name, value in event.metrics.items())
            return (f"{event.job} evaluated on {on} after step {event.step}: loss {event.loss:.4f}{metrics} "
                    f"({event.eval_time_s:.2f} s)")
    return None
