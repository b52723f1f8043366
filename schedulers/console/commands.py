"""The console's commands: one table, each entry with its usage, help and argument kinds.

A command is ``name ARG...``, words split like a shell's; ``;`` separates commands on
one line. Wherever a command takes a JOB, ``last`` names the job this console
submitted last (for scripts: ``submit cfg.json; run last 10``). Handlers raise :class:`~schedulers.console.session.CommandError` for what
the user should fix; the message says how.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from schedulers.deepspeed.config import ConfigError, load_config
from schedulers.console import render
from schedulers.console.session import CommandError, Session
from schedulers.settings import SETTABLE
from schedulers.placement import PlacementWarning
from schedulers.trace import plot_trace

__all__ = ["COMMANDS", "Command", "execute", "split_commands"]

Handler = Callable[[Session, list[str]], Awaitable[bool | None]]  # True: leave the console


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    """One console command.

    Attributes:
        usage: e.g. ``"run JOB N"``.
        summary: one line for ``help``.
        details: what ``help NAME`` adds.
        args: the kind of each positional argument, for completion: ``job``, ``key``,
            ``value``, ``path``, ``command``, ``int`` or ``flag``.
        min_args, max_args: how many words may follow the name.
        flags: the ``--options`` the command takes (what a ``flag`` argument completes to).
    """

    name: str
    usage: str
    summary: str
    details: str
    args: tuple[str, ...]
    min_args: int
    max_args: int
    handler: Handler
    flags: tuple[str, ...] = ()


COMMANDS: dict[str, Command] = {}


def command(usage: str, summary: str, details: str = "", *, args: tuple[str, ...] = (), min_args: int = 0,
            max_args: int | None = None, flags: tuple[str, ...] = ()) -> Callable[[Handler], Handler]:
    """Registers a handler under the first word of ``usage``."""
    def register(handler: Handler) -> Handler:
        name = usage.split()[0]
        COMMANDS[name] = Command(name=name, usage=usage, summary=summary, details=details, args=args,
                                 min_args=min_args, max_args=len(args) if max_args is None else max_args,
                                 handler=handler, flags=flags)
        return handler
    return register


def split_commands(line: str) -> list[list[str]]:
    """``'run job0 5; status'`` -> ``[["run", "job0", "5"], ["status"]]``, quoting as a shell does.

    Raises:
        CommandError: unbalanced quotes.
    """
    lexer = shlex.shlex(_uncommented(line), posix=True, punctuation_chars=";")
    lexer.whitespace_split = True
    lexer.commenters = ""  # shlex's own cut at any '#', inside a word too: 'trace job0 /tmp/a#b.json' wrote /tmp/a
    commands: list[list[str]] = [[]]
    try:
        for token in lexer:
            if token and set(token) == {";"}:
                commands.append([])
            else:
                commands[-1].append(token)
    except ValueError as exc:
        raise CommandError(f"cannot split {line!r}: {exc}") from None
    return [c for c in commands if c]


def _uncommented(line: str) -> str:
    """``line`` up to a ``#`` that starts a word outside quotes, as a shell reads a comment (``run#1`` is one word)."""
    quote, escaped, start = "", False, True
    for at, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and start:
            return line[:at]
        start = not quote and (char.isspace() or char == ";")
    return line


async def execute(session: Session, words: list[str]) -> bool:
    """Runs one command; returns True when the console should end.

    Raises:
        CommandError: unknown command, wrong arguments, or the command failed.
    """
    name, args = words[0], words[1:]
    cmd = COMMANDS.get(name)
    if cmd is None:
        raise CommandError(f"unknown command {name!r}; try 'help' (commands: {', '.join(sorted(COMMANDS))})")
    if not cmd.min_args <= len(args) <= cmd.max_args:
        raise CommandError(f"usage: {cmd.usage}")
    args = [session.resolve_job(a) if kind == "job" and a not in cmd.flags else a
            for a, kind in zip(args, cmd.args)] + args[len(cmd.args):]
    return bool(await cmd.handler(session, args))


def _print(session: Session, text: str) -> None:
    session.out.print(text, markup=False, highlight=False, soft_wrap=True)


# -- the cluster ------------------------------------------------------------------------


@command("help [COMMAND]", "list the commands, or explain one", args=("command",))
async def _help(session: Session, args: list[str]) -> None:
    if args:
        cmd = COMMANDS.get(args[0])
        if cmd is None:
            raise CommandError(f"no command {args[0]!r}; commands: {', '.join(sorted(COMMANDS))}")
        _print(session, f"{cmd.usage}\n  {cmd.summary}" + (f"\n  {cmd.details}" if cmd.details else ""))
        return
    unique = {cmd.name: cmd for cmd in COMMANDS.values()}.values()  # aliases (exit) once
    width = max(len(c.usage) for c in unique)
    for cmd in unique:
        _print(session, f"  {cmd.usage.ljust(width)}  {cmd.summary}")
    _print(session, "Separate commands with ';'. Tab completes commands, jobs, keys and paths.")


@command("nodes", "the cluster's nodes: name, state, device, host, pid, memory, last heartbeat")
async def _nodes(session: Session, args: list[str]) -> None:
    session.out.print(render.nodes_table(await session.cluster.nodes()))


@command("jobs", "every job: schedule, mesh, nodes, steps, state")
async def _jobs(session: Session, args: list[str]) -> None:
    infos = await session.refresh()
    if not infos:
        _print(session, "no jobs; start one with 'submit CONFIG.json'")
        return
    session.out.print(render.jobs_table(infos))


@command("status [JOB] [--actions]", "the last step: loss, step time, samples/s, bubble, bytes per edge",
         "Without JOB, one line per job. --actions asks every stage where it is now and prints the programs' "
         "grid with each stage's action marked, naming any send or receive that never matched (hang forensics).",
         args=("job", "flag"), max_args=2, flags=("--actions",))
async def _status(session: Session, args: list[str]) -> None:
    actions = "--actions" in args
    args = [session.resolve_job(a) for a in args if a != "--actions"]  # the flag first: the job came second
    if not args and not actions:
        infos = await session.refresh()
        if not infos:
            _print(session, "no jobs")
            return
        session.out.print(render.status_table(infos))
        return
    job = await session.job(session.job_arg(args, "status JOB [--actions]"))
    with session.reporting():
        info = await job.describe()
        where = await job.where() if actions else None
    for line in render.job_detail(info):
        _print(session, line)
    if where is not None:
        _print(session, where.report)


@command("schedule [JOB]", "the candidate schedules with predicted step time and stash, then the compiled grid",
         "The candidates (GPipe, 1F1B, zero-bubble; interleaved, ZB-V and DualPipeV as re-partitions to consider) "
         "simulated with the costs measured on the job's stages, fastest first, '*' marking the one schedule=auto "
         "runs (or would run); then the last step's time against the prediction, and the programs' stage-by-time grid. "
         "'set JOB schedule auto' lets the job choose.", args=("job",))
async def _schedule(session: Session, args: list[str]) -> None:
    job = await session.job(session.job_arg(args, "schedule JOB"))
    with session.reporting():
        plan = await job.plan()
        info = await job.describe()
    for line in render.plan_lines(plan):
        _print(session, line)
    _print(session, render.schedule_grid(info))


# -- jobs ---------------------------------------------------------------------------------


@command("submit CONFIG.json [--job JOB.json]", "start a job from a DeepSpeed config (and a job file)",
         "CONFIG.json is DeepSpeed's ds_config.json as it is (JSON or hjson), or one file with actorpipe's keys as "
         "well; --job JOB.json gives actorpipe's part (the spec's sections and fields: model, loss, data, "
         "pipeline_stages, ...) so that the DeepSpeed file "
         "needs no edit. Every problem is listed at once; keys that do something else here, or nothing, are "
         "printed as notes. See docs/deepspeed.md for the keys. Afterwards the job name 'last' "
         "stands for this job, e.g. 'submit cfg.json; run last 10'.",
         args=("path", "flag", "path"), min_args=1, max_args=3, flags=("--job",))
async def _submit(session: Session, args: list[str]) -> None:
    config_path, job_path = _submit_args(args)
    where = config_path + (f" with {job_path}" if job_path else "")
    try:
        config = load_config(config_path, job=job_path)
    except ConfigError as exc:  # a file that does not parse names itself already
        named = len(exc.problems) > 1 or exc.key in (config_path, job_path)
        raise CommandError(str(exc) if named else f"{where}: {exc}") from None
    except OSError as exc:
        raise CommandError(f"{exc.filename or where}: {exc.strerror or exc}") from None
    for line in config.notices:
        _print(session, f"note: {line}")
    spec = config.spec
    _print(session, f"submitting {spec.training.model} on {spec.parallelism.pipeline_stages} stages ...")
    try:
        with warnings.catch_warnings():  # printed below as console lines, not as Python warnings
            warnings.simplefilter("ignore", PlacementWarning)
            job = await session.cluster.train(spec)
    except Exception as exc:  # noqa: BLE001 - whatever refused the job, the user reads why
        raise CommandError(f"{where}: the scheduler refused the job: {getattr(exc, 'message', exc)}") from None
    if job.id not in session.job_ids:
        session.job_ids.append(job.id)
    session.last_submitted = job.id
    p = spec.parallelism
    _print(session, f"submitted {job.id}: {p.schedule}, {p.micro_batches} micro-batches, "
                    f"stages on {', '.join(job.nodes)}, layers {job.bounds}")
    for notice in job.notices:
        _print(session, f"warning: {job.id}: {notice}")


def _submit_args(args: list[str]) -> tuple[str, str | None]:
    """``CONFIG [--job JOB]`` (the flag before or after, or as ``--job=JOB``) -> (config, job)."""
    usage = "usage: submit CONFIG.json [--job JOB.json]"
    words: list[str] = []
    job: str | None = None
    rest = iter(args)
    for word in rest:
        if word == "--job" or word.startswith("--job="):
            if job is not None:
                raise CommandError(f"--job is given twice; {usage}")
            job = word.partition("=")[2] if word.startswith("--job=") else next(rest, "")
            if not job:
                raise CommandError(f"--job needs a file; {usage}")
        elif word.startswith("--"):
            raise CommandError(f"unknown option {word!r}; {usage}")
        else:
            words.append(word)
    if len(words) != 1:
        raise CommandError(usage)
    return os.path.expanduser(words[0]), os.path.expanduser(job) if job is not None else None


@command("run JOB N", "take N steps from the job's data factory, with a progress bar",
         "At the prompt the run goes on in the background (progress in the bottom bar, steps in the feed; "
         "'wait JOB' blocks until it ends). With --exec it waits, and a failed step fails the command.",
         args=("job", "int"), min_args=2)
async def _run(session: Session, args: list[str]) -> None:
    job_id, steps = args[0], _int_arg(args[1], "N")
    job = await session.job(job_id)
    with session.reporting():
        await job.run(steps)
    if session.interactive:
        _print(session, f"{job_id}: running {steps} steps ('pause {job_id}', 'wait {job_id}', 'stop {job_id}')")
        return
    await _wait_for_run(session, job_id)


@command("eval JOB [STEP]",
         "the model's loss on the job's validation data, or a batch of its data factory, forward only",
         "Every stage runs forward under no_grad with its modules in eval mode; nothing trains and the run's "
         "data position stays. Without STEP: the job's validation data (eval_data) where it has one, else the data "
         "factory's next batch; STEP names the data factory's batch.",
         args=("job", "int"), min_args=1)
async def _eval(session: Session, args: list[str]) -> None:
    job = await session.job(args[0])
    data_step = _int_arg(args[1], "STEP", least=0) if len(args) > 1 else None  # the factory's batch 0 is a batch
    with session.reporting():
        result = await job.evaluate(data_step=data_step)
    metrics = "".join(f", {name} {value:.6g}" for name, value in result.metrics.items())
    _print(session, f"{args[0]}: eval loss {result.loss:.6g}{metrics} over {result.items:g} "
                    f"{'tokens' if job.spec.training.loss_averaging == 'tokens' else 'samples'} "
                    f"in {result.eval_time_s:.3f}s")


@command("wait JOB", "block until the job's run ends; fails if it failed", args=("job",), min_args=1)
async def _wait(session: Session, args: list[str]) -> None:
    await _wait_for_run(session, args[0])


@command("pause JOB", "hold the job's run at the next accumulation barrier", args=("job",), min_args=1)
async def _pause(session: Session, args: list[str]) -> None:
    job = await session.job(args[0])
    with session.reporting():
        state = await job.pause()
    running = state.run is not None and state.run.active
    _print(session, f"{args[0]}: " + ("pausing after the step in progress" if running else "paused"))


@command("resume JOB", "let a paused run go on", args=("job",), min_args=1)
async def _resume(session: Session, args: list[str]) -> None:
    job = await session.job(args[0])
    with session.reporting():
        await job.resume()
    _print(session, f"{args[0]}: resumed")


@command("stop JOB", "end the job's run after the step in progress", args=("job",), min_args=1)
async def _stop(session: Session, args: list[str]) -> None:
    job = await session.job(args[0])
    with session.reporting():
        described = await job.stop()
    run = described.run
    if run is None or not run.active:  # nothing to stop: the run ended (or never began)
        how = "" if run is None else "failed" if run.error else "finished" if run.done >= run.target else "stopped"
        ended = "no run" if run is None else f"its run already {how} after {run.done}/{run.target} steps"
        _print(session, f"{args[0]}: {ended}; nothing to stop")
    else:
        _print(session, f"{args[0]}: stopping after the step in progress")


@command("set JOB KEY VALUE", f"change {', '.join(SETTABLE)} at the next barrier",
         "The job keeps its weights and optimizer state; the change applies before the next step. "
         "Codecs take a name or a comma-separated list (one per stage boundary).",
         args=("job", "key", "value"), min_args=3)
async def _set(session: Session, args: list[str]) -> None:
    job_id, key, value = args
    job = await session.job(job_id)
    with session.reporting():
        answer = await job.set(key, value)
    when = "after the step in progress reaches its barrier" if answer.stepping else f"before step {answer.next_step}"
    _print(session, f"{job_id}: {key}={answer.value} set; it applies at the next barrier ({when})")


@command("checkpoint JOB DIR", "save the whole model to DIR (atomically), at the next barrier",
         args=("job", "path"), min_args=2)
async def _checkpoint(session: Session, args: list[str]) -> None:
    job = await session.job(args[0])
    try:
        with session.reporting():
            version = await job.save(args[1])
            info = await job.describe()
    except OSError as exc:
        raise CommandError(f"cannot write {args[1]}: {exc}") from None
    # Where it went: a client's relative path lands in its own subtree of the head's checkpoint root.
    _print(session, f"{args[0]}: checkpoint of step {info.steps} written to {version}")


@command("export JOB DIR", "write the weights to DIR as a model directory from_pretrained loads",
         args=("job", "path"), min_args=2)
async def _export(session: Session, args: list[str]) -> None:
    job = await session.job(args[0])
    try:
        with session.reporting():
            directory = await job.export(args[1])
    except OSError as exc:
        raise CommandError(f"cannot write {args[1]}: {exc}") from None
    _print(session, f"{args[0]}: model written to {directory}")


@command("close JOB", "stop the job's stage actors", args=("job",), min_args=1)
async def _close(session: Session, args: list[str]) -> None:
    job = await session.job(args[0])
    with session.reporting():
        await job.close()
    session.job_ids = [j for j in session.job_ids if j != args[0]]
    _print(session, f"{args[0]}: closed")


# -- traces ---------------------------------------------------------------------------------


@command("trace JOB FILE", "write the last step's measured timeline as Chrome/Perfetto trace JSON",
         "One track per stage actor, a span per action, transfers as flow arrows, then each stage's tail "
         "(REDUCE, BARRIER: the wait for every stage's vote, STEP); every node's clock is aligned to the head's. "
         "Open it at https://ui.perfetto.dev.", args=("job", "path"), min_args=2)
async def _trace(session: Session, args: list[str]) -> None:
    job = await session.job(args[0])
    with session.reporting():
        trace = await job.trace()
    path = os.path.expanduser(args[1])
    _write_json(path, trace)
    events = trace["traceEvents"]
    tracks = sum(1 for e in events if e.get("name") == "thread_name")
    spans = sum(1 for e in events if e.get("ph") == "X")
    flows = sum(1 for e in events if e.get("ph") == "s")
    offsets = ", ".join(f"{name} {1e3 * off:+.2f} ms" for name, off in trace["otherData"]["clock_offsets_s"].items())
    _print(session, f"{args[0]}: wrote {path}: step {trace['otherData'].get('step')}, {tracks} tracks, "
                    f"{spans} spans, {flows} transfers (clock offsets: {offsets})")


@command("plot JOB FILE.png", "draw the last step's timeline as a PNG: stages as rows, idle time visible",
         args=("job", "path"), min_args=2)
async def _plot(session: Session, args: list[str]) -> None:
    path = os.path.expanduser(args[1])
    if not os.path.splitext(path)[1]:
        path += ".png"  # what matplotlib writes for a name without one
    job = await session.job(args[0])
    with session.reporting():
        trace = await job.trace()
    try:
        await asyncio.to_thread(plot_trace, trace, path)
    except ImportError:
        raise CommandError("plot needs matplotlib: pip install matplotlib") from None
    except (OSError, ValueError) as exc:  # ValueError: an extension matplotlib does not write
        raise CommandError(f"cannot write {path}: {exc}") from None
    _print(session, f"{args[0]}: wrote {path} ({os.path.getsize(path)} bytes)")


@command("quit", "leave the console, also 'exit' or Ctrl-D (jobs keep running)")
async def _quit(session: Session, args: list[str]) -> bool:
    return True


COMMANDS["exit"] = COMMANDS["quit"]


# -- helpers ---------------------------------------------------------------------------------


_MOST = 10**15  # beyond any step count, and within what the wire carries (an int of 64 bits)


def _int_arg(text: str, name: str, least: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise CommandError(f"{name} must be a whole number, got {text[:40]!r}") from None
    if value < least:
        raise CommandError(f"{name} must be >= {least}, got {value}")
    if value > _MOST:
        raise CommandError(f"{name} must be <= {_MOST}, got {text[:40]}{'...' if len(text) > 40 else ''}")
    return value


def _write_json(path: str, data: Any) -> None:
    path = os.path.expanduser(path)
    try:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError as exc:
        raise CommandError(f"cannot write {path}: {exc}") from None


async def _wait_for_run(session: Session, job_id: str) -> None:
    """Polls the job until its run ends; a bar on stderr when a script waits, the feed when a person does."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[loss]}"),
               TimeElapsedColumn())
    bar = Progress(*columns, console=Console(stderr=True), transient=True, disable=session.interactive)
    with bar:
        task = bar.add_task(job_id, total=None, loss="")
        job = await session.job(job_id)
        while True:
            with session.reporting():
                info = await job.describe()
            run = info.run
            loss = info.last_stats.loss if info.last_stats else None
            bar.update(task, completed=run.done if run else 0, total=run.target if run else None,
                       loss="" if loss is None else f"loss {loss:.4f}" + (" (paused)" if info.paused else ""))
            if run is None or not run.active:
                break
            await asyncio.sleep(0.2)
    if run is None:
        raise CommandError(f"{job_id} has no run; start one with 'run {job_id} N'")
    if run.error:
        raise CommandError(f"{job_id}: run failed after {run.done}/{run.target} steps: {run.error}")
    last = f", loss {loss:.4f}" if loss is not None else ""
    _print(session, f"{job_id}: ran {run.done}/{run.target} steps (now at step {info.steps}){last}")
