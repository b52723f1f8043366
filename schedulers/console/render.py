"""What the console prints: tables, one-line events, progress bars. Pure functions of the data."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

from stages import Action
from schedulers.grid import format_grid

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
    if value is None or (isinstance(value, float) and math.isnan(value)):
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


def nodes_table(nodes: Sequence[Mapping[str, Any]]) -> Table:
    """The head's nodes: name, state, device, host, pid, memory, last heartbeat."""
    table = Table(title="nodes", title_justify="left")
    for column in ("name", "state", "device", "host", "pid", "memory", "last heartbeat"):
        table.add_column(column, justify="right" if column in ("pid", "memory", "last heartbeat") else "left")
    for n in sorted(nodes, key=lambda n: str(n.get("name"))):
        table.add_row(str(n.get("name")), str(n.get("state")), str(n.get("device")), str(n.get("host")),
                      str(n.get("pid")), format_bytes(n.get("memory_bytes")),
                      f"{float(n.get('last_heartbeat_age_s', 0.0)):.1f} s ago")
    return table


def job_status(info: Mapping[str, Any]) -> str:
    """One word for where a job is: running 3/10, paused, failed, idle."""
    run = info.get("run") or {}
    if run.get("active"):
        state = f"running {run.get('done', 0)}/{run.get('target', 0)}"
        return state + (" (paused)" if info.get("paused") else "")
    if info.get("paused"):
        return "paused"
    if run.get("error"):
        return "failed"
    return "idle"


def jobs_table(infos: Sequence[Mapping[str, Any]]) -> Table:
    """Every job: schedule, mesh, nodes, steps taken, state."""
    table = Table(title="jobs", title_justify="left")
    for column in ("job", "schedule", "micro-batches", "mesh (p x t x d)", "nodes", "steps", "state"):
        table.add_column(column)
    for info in infos:
        table.add_row(str(info["job"]), _schedule(info), str(_setting(info, "parallelism", "micro_batches")),
                      " x ".join(map(str, info.get("mesh", []))), ", ".join(info.get("nodes", [])),
                      str(info.get("steps")), job_status(info))
    return table


def status_table(infos: Sequence[Mapping[str, Any]]) -> Table:
    """Every job's last step: loss, step time, samples/s, bubble."""
    table = Table(title="status", title_justify="left")
    for column in ("job", "step", "loss", "step time", "samples/s", "bubble", "state"):
        table.add_column(column, justify="left" if column in ("job", "state") else "right")
    for info in infos:
        stats = info.get("last_stats") or {}
        table.add_row(str(info["job"]), _number(stats.get("step"), "d"), _number(stats.get("loss")),
                      _number(stats.get("step_time_s"), ".3f") + " s" if stats else "-",
                      _number(stats.get("samples_per_s"), ".1f"),
                      _number(stats.get("bubble_fraction"), ".1%"), job_status(info))
    return table


def job_detail(info: Mapping[str, Any]) -> list[str]:
    """A job's status as lines: layout, last step, run, pending settings, bytes per edge."""
    stats = info.get("last_stats") or {}
    mesh = info.get("mesh", [1, 1, 1])
    codecs = "/".join(str(_setting(info, "communication", key)) for key in ("activation_codec", "gradient_codec"))
    lines = [
        f"{info['job']}: {_setting(info, 'training', 'model')} | schedule {_schedule(info)}, "
        f"{_setting(info, 'parallelism', 'micro_batches')} micro-batches | {mesh[0]} stages x {mesh[1]} tp x "
        f"{mesh[2]} dp on {', '.join(info.get('nodes', []))} | codecs {codecs} | {job_status(info)}",
    ]
    if stats:
        lines.append(
            f"step {stats.get('step')}: loss {_number(stats.get('loss'))}, step time "
            f"{_number(stats.get('step_time_s'), '.3f')} s"
            + ("" if stats.get("predicted_step_s") is None else
               f" (predicted {_number(stats.get('predicted_step_s'), '.3f')} s, "
               f"{_error(stats.get('prediction_error'))})")
            + f", {_number(stats.get('samples_per_s'), '.1f')} samples/s, "
            f"bubble {_number(stats.get('bubble_fraction'), '.1%')}{_rates(stats.get('lr'))}, "
            f"{format_bytes(stats.get('bytes_sent'))} "
            f"between stages (schedule {stats.get('schedule')}, {stats.get('micro_batches')} micro-batches)")
        if stats.get("skipped"):
            lines.append("step skipped, nothing applied; not finite: " + "; ".join(stats.get("nonfinite") or []))
        training = [f"grad norm {_number(stats.get('grad_norm'), '.4g')}"] if stats.get("grad_norm") is not None else []
        if stats.get("loss_scale") is not None:
            training.append(f"loss scale {_number(stats.get('loss_scale'), 'g')} "
                            f"({stats.get('skipped_steps', 0)} steps skipped for overflow)")
        precision = _setting(info, "mixed_precision", "precision") or "fp32"
        if precision != "fp32":
            training.append(f"precision {precision}")
        if training:
            lines.append(", ".join(training))
        for names in stats.get("tied") or []:
            lines.append("tied across stages: " + " = ".join(names) + " (gradients summed before each step)")
        recovery = stats.get("recovery")
        if recovery:
            moved = ", ".join(f"{old} -> {new}" for old, new in sorted((recovery.get("moved") or {}).items()))
            lines.append(f"recovered before this step: {moved}, from step {recovery.get('from_step')}, "
                         f"{recovery.get('replayed')} replayed, {_number(recovery.get('seconds'), '.1f')} s")
        edges = stats.get("bytes_per_edge") or {}
        if edges:
            lines.append("bytes per edge: " + ", ".join(f"{edge} {format_bytes(n)}" for edge, n in sorted(edges.items())))
    else:
        lines.append(f"no step finished yet ({info.get('steps', 0)} started)")
    run = info.get("run")
    if run:
        outcome = "running" if run.get("active") else ("failed: " + str(run["error"]) if run.get("error") else "finished")
        lines.append(f"run: {progress_bar(run.get('done', 0), run.get('target', 0))} {outcome}")
    if info.get("pending"):
        lines.append("pending until the next barrier: "
                     + ", ".join(f"{k}={v}" for k, v in sorted(info["pending"].items())))
    return lines


def _setting(info: Mapping[str, Any], section: str, name: str) -> Any:
    """One field of a job description's spec (as it travels: one map per section), None if absent."""
    return (info.get("spec") or {}).get(section, {}).get(name)


def _schedule(info: Mapping[str, Any]) -> str:
    """``1f1b``, or ``auto (zero_bubble)``: the setting and, where auto chose, what runs."""
    setting, running = _setting(info, "parallelism", "schedule"), info.get("running")
    return f"{setting} ({running})" if running and running != setting else str(setting)


def schedule_grid(info: Mapping[str, Any]) -> str:
    """The job's compiled programs as a stage-by-time grid, with a one-line header."""
    programs = {rank: [Action.parse(a) for a in program] for rank, program in enumerate(info.get("programs", []))}
    micro_batches = _setting(info, "parallelism", "micro_batches")
    header = (f"{info['job']}: {_schedule(info)}, {len(programs)} stages, {micro_batches} "
              "micro-batches (one column per action slot; - idle)")
    return header + "\n" + format_grid(programs)


def _label(candidate: Mapping[str, Any]) -> str:
    virtual = candidate.get("virtual_stages")
    return (str(candidate.get("schedule")) + (f" x{virtual}" if virtual else "")
            + (" +wbatch" if candidate.get("w_batching") else ""))


def _error(error: Any) -> str:
    """``+3.1%``: a relative prediction error."""
    return _number(error * 100 if isinstance(error, (int, float)) else None, "+.1f") + "%"


def plan_lines(plan: Mapping[str, Any]) -> list[str]:
    """``job.plan()`` as lines: the candidates fastest first (``*`` the chosen), the costs, the last step's error."""
    job, state, schedule = plan.get("job"), plan.get("state"), plan.get("schedule")
    if state == "measuring":
        return [f"{job}: schedule auto: measuring; the next steps run {plan.get('running')} and time every stage, "
                "then it runs the fastest schedule predicted"]
    if state == "no_steps":
        return [f"{job}: schedule {schedule}; after a step, this predicts every candidate schedule from its costs"]
    costs = plan.get("costs") or {}
    limit = plan.get("max_stash_bytes")
    if state == "planned":
        head = (f"{job}: schedule auto runs {plan.get('chosen')}, planned from step {costs.get('step')} "
                f"(max_stash_bytes {format_bytes(limit) if limit else 'none'})")
    else:
        head = f"{job}: schedule {schedule}; from step {costs.get('step')}'s costs, auto would run {plan.get('chosen')}"
    lines = [head, f"  {'schedule':<20} {'predicted':>10} {'bubble':>7}  peak stash per stage"]
    for c in plan.get("candidates") or []:
        stash = " ".join(str(n) for n in c.get("stash", []))
        sizes = ", ".join(format_bytes(n) for n in c.get("stash_bytes", []))
        notes = []
        if not c.get("runnable", True):
            notes.append(f"re-partitions the model: a new job with schedule='{c.get('schedule')}', "
                         f"virtual_stages={c.get('virtual_stages')}")
        if not c.get("fits", True):
            notes.append("over max_stash_bytes")
        if c.get("schedule") == plan.get("running") and state == "advice" and not c.get("virtual_stages"):
            notes.append("running")
        lines.append(f"{'*' if c.get('chosen') else ' '} {_label(c):<20} {_number(c.get('predicted_step_s'), '.3f'):>8} s "
                     f"{_number(c.get('bubble_fraction'), '.1%'):>7}  {stash} ({sizes})"
                     + (f"  [{'; '.join(notes)}]" if notes else ""))
    if costs:
        kinds = [("F", "forward"), ("B", "backward"), ("I", "input_grad"), ("W", "weight_grad")]
        if costs.get("weight_grad_batched"):
            kinds.append(("W batched", "weight_grad_batched"))
        per_stage = " | ".join(f"{kind} " + " ".join(_number(v, ".4f") for v in costs.get(key, []))
                               for kind, key in kinds)
        bandwidth = costs.get("bandwidth")
        link = "free" if not isinstance(bandwidth, (int, float)) or math.isinf(bandwidth) else \
            f"{format_bytes(bandwidth)}/s"
        lines.append(f"costs per stage, s per micro-batch: {per_stage}; link {link}, "
                     f"{format_bytes(costs.get('transfer_bytes'))} a value; outside the programs "
                     f"{_number(costs.get('overhead_s'), '.3f')} s")
    if plan.get("prediction_error") is not None:
        lines.append(f"last step {_number(plan.get('last_step_s'), '.3f')} s, "
                     f"{_error(plan.get('prediction_error'))} against the prediction")
    return lines


def event_line(event: Mapping[str, Any]) -> str | None:
    """One line for an event from the head or the scheduler (None: not worth a line)."""
    kind, job = event.get("type"), event.get("job")
    if kind == "node_joined":
        return f"+ node {event.get('node')} joined"
    if kind == "node_left":
        return f"- node {event.get('node')} left"
    if kind == "node_lost":
        return f"! node {event.get('node')} lost (silent {_number(event.get('silent_s'), '.1f')} s)"
    if kind == "step_finished":
        run = event.get("run")
        where = f" [{run['done']}/{run['target']}]" if run else ""
        skipped = " (skipped: not finite, nothing applied)" if event.get("skipped") else ""
        predicted = "" if event.get("predicted_step_s") is None else \
            f" (predicted {_number(event.get('predicted_step_s'), '.3f')} s, {_error(event.get('prediction_error'))})"
        return (f"{job} step {event.get('step')}{where} {event.get('schedule')}: loss {_number(event.get('loss'))}, "
                f"{_number(event.get('step_time_s'), '.3f')} s{predicted}, bubble "
                f"{_number(event.get('bubble_fraction'), '.0%')}{_rates(event.get('lr'))}{skipped}")
    if kind == "schedule_planned":
        return (f"{job}: schedule auto plans {event.get('schedule')} from step {event.get('step')} on "
                f"(predicted {_number(event.get('predicted_step_s'), '.3f')} s a step; 'schedule {job}' shows why)")
    if kind == "job_failed":
        return f"! {job} step {event.get('step')} failed: {event.get('error')}"
    if kind == "job_recovered":
        moved = ", ".join(f"{old} -> {new}" for old, new in sorted((event.get("moved") or {}).items()))
        return (f"* {job} recovered: {moved}; rolled back to step {event.get('from_step')}, "
                f"replaying {event.get('replayed')} in {_number(event.get('seconds'), '.1f')} s "
                f"({event.get('restarts_left')} restarts left)")
    if kind == "job_created":
        return f"+ {job} created on {', '.join(event.get('nodes', []))}"
    if kind == "job_closed":
        return f"- {job} closed"
    if kind == "job_paused":
        return f"{job} paused before step {event.get('step')}"
    if kind == "job_resumed":
        return f"{job} resumed at step {event.get('step')}"
    if kind == "run_started":
        return f"{job} run of {event.get('steps')} steps started" + (" (paused)" if event.get("paused") else "")
    if kind == "run_finished":
        outcome = {"done": "finished", "stopped": "stopped", "failed": "failed", "cancelled": "cancelled"}
        return f"{job} run {outcome.get(str(event.get('reason')), event.get('reason'))} after {event.get('done')}/" \
               f"{event.get('target')} steps"
    if kind == "setting_pending":
        return f"{job}: {event.get('key')}={event.get('value')} requested; it applies at the next barrier"
    if kind == "settings_applied":
        changes = ", ".join(f"{k}={v}" for k, v in sorted((event.get("changes") or {}).items()))
        return f"{job}: now {changes}, from step {event.get('step')} on"
    if kind == "setting_rejected":
        return f"! {job}: {event.get('error')}"
    return None
