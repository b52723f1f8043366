"""The console's two ways to take commands: a prompt for a person, ``--exec`` for a script.

At the prompt (prompt_toolkit): history across sessions, tab completion of commands,
job names, settings and paths, a bottom bar with the cluster and every run's
progress, and the live event feed printed above the prompt without disturbing what
is being typed (``patch_stdout``). Ctrl-C abandons the line or stops waiting for a
command; Ctrl-D or ``quit`` leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterable

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completer, Completion, PathCompleter
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.patch_stdout import patch_stdout
from rich.console import Console

from actors import ActorError, Event, NodeSilent
from schedulers.console import render
from schedulers.console.commands import COMMANDS, execute, split_commands
from schedulers.console.session import CommandError, Session, open_session
from schedulers.settings import SETTABLE
from schedulers.events import JobFailed, JobPaused, JobRecovered, JobResumed, SettingRejected, SettingsApplied
from schedulers.schedules import SCHEDULES
from transport.security import split_address
from transport.codecs import CODEC_NAMES

__all__ = ["ConsoleCompleter", "console_main", "interact", "run_script"]

log = logging.getLogger(__name__)

PROMPT = "actorpipe> "
_VALUES = {"schedule": (*SCHEDULES, "auto"), "activation_codec": tuple(CODEC_NAMES),
           "gradient_codec": tuple(CODEC_NAMES), "micro_batches": ("1", "2", "4", "8", "16")}


class ConsoleCompleter(Completer):
    """Completes the command being typed (after the last ``;``) from the session's knowledge."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._paths = PathCompleter(expanduser=True)

    def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterable[Completion]:
        segment = document.text_before_cursor.rsplit(";", 1)[-1].lstrip()
        words = segment.split()
        if not segment.endswith(" "):
            prefix = words.pop() if words else ""
        else:
            prefix = ""
        if not words:
            yield from _starting(prefix, sorted(COMMANDS))
            return
        cmd = COMMANDS.get(words[0])
        position = len(words) - 1
        if cmd is None or position >= len(cmd.args):
            return
        kind = cmd.args[position]
        if kind == "path":
            sub = Document(prefix, len(prefix))
            yield from self._paths.get_completions(sub, complete_event)
            return
        choices: Iterable[str] = {
            "job": self.session.job_ids, "command": sorted(COMMANDS), "key": SETTABLE, "flag": cmd.flags,
            "value": _VALUES.get(words[2] if len(words) > 2 else "", ()),
        }.get(kind, ())
        if kind == "job" and cmd.name == "status":
            choices = [*self.session.job_ids, *cmd.flags]
        yield from _starting(prefix, choices)


def _starting(prefix: str, choices: Iterable[str]) -> Iterable[Completion]:
    for choice in choices:
        if choice.startswith(prefix):
            yield Completion(choice, start_position=-len(prefix))


def _toolbar(session: Session) -> str:
    runs = [f"{job} {render.progress_bar(r.done, r.target, 12)}"
            + (f" loss {r.loss:.3f}" if isinstance(r.loss, float) else "")
            + (" paused" if r.paused else "")
            for job, r in sorted(session.runs.items()) if r.active]
    where = split_address(session.address)[0]  # the head's endpoint; its key and bulk socket are noise here
    return f" {where} | {session.num_nodes} nodes | {len(session.job_ids)} jobs" + \
        (" | " + " | ".join(runs) if runs else "") + " | help, Tab, Ctrl-D "


async def run_line(session: Session, line: str) -> bool:
    """Runs every command on ``line`` in order; returns True to leave.

    Raises:
        CommandError: a command failed; the ones after it did not run.
    """
    for words in split_commands(line):
        try:
            if await execute(session, words):
                return True
        except CommandError:
            raise
        except ActorError as exc:  # a call the session did not wrap, e.g. to the head
            raise CommandError(exc.message) from None
        except Exception as exc:  # a command's defect or an input it did not foresee: said, and the console serves on
            log.debug("%s failed", words[0], exc_info=True)
            raise CommandError(f"{words[0]} failed: {type(exc).__name__}: {exc}") from None
    return False


def _report(session: Session, error: BaseException) -> None:
    session.out.print(f"error: {error}", style="bold red", markup=False, highlight=False, soft_wrap=True)


async def run_script(session: Session, script: str) -> int:
    """``--exec``: runs the commands without a prompt; 1 at the first that fails, else 0."""
    try:
        await run_line(session, script)
    except CommandError as exc:
        _report(session, exc)
        return 1
    return 0


async def interact(session: Session, history: History) -> int:
    """The prompt: reads and runs lines until ``quit`` or Ctrl-D; returns 0."""
    prompt: PromptSession[str] = PromptSession(
        history=history, completer=ConsoleCompleter(session), complete_while_typing=False,
        bottom_toolbar=lambda: _toolbar(session), refresh_interval=0.5)
    loop = asyncio.get_running_loop()
    with patch_stdout(raw=True):
        # Log lines (e.g. a lost connection) go above the prompt too, not through it.
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True,
                            format="%(levelname)s %(name)s: %(message)s")

        def show(event: Event) -> None:
            line = render.event_line(event)
            if line is not None:
                session.out.print(line, markup=False, highlight=False, soft_wrap=True, style=_style(event))

        session.on_event = show
        session.out.print(f"connected to {session.address}: {session.num_nodes} nodes, "
                          f"{len(session.job_ids)} jobs. Type 'help' for the commands.", markup=False)
        while True:
            try:
                line = await prompt.prompt_async(PROMPT)
            except KeyboardInterrupt:
                continue
            except EOFError:
                break
            if not line.strip():
                continue
            # Ctrl-C while a command runs (the prompt is not reading keys then) stops waiting for it.
            task = asyncio.ensure_future(run_line(session, line))
            loop.add_signal_handler(signal.SIGINT, task.cancel)
            try:
                if await task:
                    break
            except CommandError as exc:
                _report(session, exc)
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise
                session.out.print("interrupted", markup=False)
            finally:
                loop.remove_signal_handler(signal.SIGINT)
        session.on_event = None
    return 0


def _style(event: Event) -> str | None:
    if isinstance(event, (JobFailed, NodeSilent, SettingRejected)):
        return "bold red"
    if isinstance(event, (SettingsApplied, JobPaused, JobResumed, JobRecovered)):
        return "bold"
    return None


async def console_main(address: str, *, script: str | None, history_path: str | None, bind: str,
                       allow_remote: bool = False, keys: str | None = None, identity: str = "client",
                       insecure: bool = False) -> int:
    """Connects, then runs ``script`` or the prompt; the exit status (2: could not connect)."""
    out = Console(highlight=False)
    interactive = script is None
    try:
        async with open_session(address, out, interactive=interactive, bind=bind, allow_remote=allow_remote,
                                keys=keys, identity=identity, insecure=insecure) as session:
            if script is not None:
                return await run_script(session, script)
            history: History = InMemoryHistory()
            if history_path:
                with contextlib.suppress(OSError):
                    os.makedirs(os.path.dirname(os.path.abspath(history_path)), exist_ok=True)
                history = FileHistory(history_path)
            return await interact(session, history)
    except CommandError as exc:
        out.print(f"error: {exc}", style="bold red", markup=False, highlight=False, soft_wrap=True)
        return 2
