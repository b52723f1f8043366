"""A console's connection to a cluster: the scheduler, the live event feed, what completion knows."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from rich.console import Console

from actors import (ActorError, ActorRef, Event, EventSink, HeadUnreachable, NodeJoined, NodeLeft, NodeSilent,
                    SecurityMismatch)
from schedulers.client import Cluster, Job
from schedulers.events import JobClosed, JobCreated, JobEvent, JobPaused, JobResumed, RunFinished, RunStarted, StepFinished
from schedulers.records import JobDescription
from transport.security import shown

__all__ = ["CommandError", "Session", "open_session"]

EventHandler = Callable[[Event], None]


class CommandError(Exception):
    """A command the user got wrong, or that failed; the message says what to do."""


@dataclass(slots=True, kw_only=True)
class RunView:
    """A job's run as the toolbar shows it, kept current from the events."""

    done: int
    target: int
    active: bool
    paused: bool = False
    loss: float | None = None


class Session:
    """What every command works with.

    Attributes:
        cluster: the connection to the head.
        out: where commands print (stdout, through prompt_toolkit when interactive).
        interactive: a person at a prompt (``run`` returns at once) or a script (``run`` waits).
        job_ids: the jobs the scheduler had when last asked (for completion).
        runs: per job, the latest run progress the feed reported (for the toolbar).
    """

    def __init__(self, cluster: Cluster, out: Console, *, interactive: bool) -> None:
        self.cluster = cluster
        self.out = out
        self.interactive = interactive
        self.job_ids: list[str] = []
        self.runs: dict[str, RunView] = {}
        self.num_nodes = 0
        self.last_submitted: str | None = None  # what the job name "last" stands for
        self.on_event: EventHandler | None = None
        self._feed: ActorRef | None = None

    @property
    def address(self) -> str:
        return self.cluster.head.address

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """A remote error inside the block becomes a :class:`CommandError` with its message."""
        try:
            yield
        except ActorError as exc:
            raise CommandError(_message(exc)) from None

    async def job(self, job_id: str) -> Job:
        """A handle on job ``job_id``.

        Raises:
            CommandError: no such job (the message lists the running ones).
        """
        with self.reporting():
            return await self.cluster.job(job_id)

    async def refresh(self) -> list[JobDescription]:
        """Fetches every job's description (and remembers the names and node count)."""
        with self.reporting():
            infos = await self.cluster.jobs()
            nodes = await self.cluster.nodes()
        self.job_ids = [info.job for info in infos]
        for info in infos:
            if info.run is not None:
                self.runs[info.job] = RunView(done=info.run.done, target=info.run.target, active=info.run.active,
                                              paused=info.paused,
                                              loss=info.last_stats.loss if info.last_stats else None)
        self.num_nodes = sum(1 for n in nodes if n.alive)
        return infos

    async def describe(self, job_id: str) -> JobDescription:
        with self.reporting():
            return await (await self.cluster.job(job_id)).describe()

    def resolve_job(self, name: str) -> str:
        """A job name as typed: ``last`` is the job this console submitted last.

        Raises:
            CommandError: ``last`` before any ``submit``.
        """
        if name != "last":
            return name
        if self.last_submitted is None:
            raise CommandError("'last' names the job this console submitted last, but it has submitted none")
        return self.last_submitted

    def job_arg(self, args: list[str], usage: str) -> str:
        """The job a command names, or the only one there is."""
        if args:
            return args[0]
        if len(self.job_ids) == 1:
            return self.job_ids[0]
        raise CommandError(f"which job? usage: {usage}; jobs: {', '.join(self.job_ids) or 'none'}")

    async def start_feed(self) -> None:
        """Subscribes to the head's node events and the scheduler's job events."""
        self._feed = await self.cluster.runtime.spawn(EventSink(self._dispatch), "console-feed")
        await self.cluster.subscribe(self._feed)

    async def stop_feed(self) -> None:
        if self._feed is None:
            return
        with contextlib.suppress(ActorError, OSError):
            await self.cluster.unsubscribe(self._feed)
        self._feed = None

    def _dispatch(self, event: Event) -> None:
        self._track(event)
        if self.on_event is not None:
            self.on_event(event)

    def _track(self, event: Event) -> None:
        """Keeps completion and the toolbar current from the events alone."""
        if isinstance(event, NodeJoined):
            self.num_nodes += 1
        elif isinstance(event, (NodeLeft, NodeSilent)):
            self.num_nodes = max(0, self.num_nodes - 1)
        elif not isinstance(event, JobEvent):
            return
        elif isinstance(event, JobCreated):
            if event.job not in self.job_ids:
                self.job_ids.append(event.job)
        elif isinstance(event, JobClosed):
            self.job_ids = [j for j in self.job_ids if j != event.job]
            self.runs.pop(event.job, None)
        elif isinstance(event, RunStarted):
            self.runs[event.job] = RunView(done=0, target=event.steps, active=True, paused=event.paused)
        elif event.job in self.runs:
            run = self.runs[event.job]
            if isinstance(event, StepFinished) and event.run is not None:
                run.done, run.loss = event.run.done, event.loss
            elif isinstance(event, JobPaused):
                run.paused = True
            elif isinstance(event, JobResumed):
                run.paused = False
            elif isinstance(event, RunFinished):
                run.active, run.done = False, event.done


def _message(exc: ActorError) -> str:
    """The remote error's message; a KeyError's comes quoted (its str is the key's repr)."""
    message = exc.message
    if exc.remote_type == "KeyError" and len(message) > 1 and message[0] == message[-1] and message[0] in "'\"":
        return message[1:-1]
    return message


@contextlib.asynccontextmanager
async def open_session(address: str, out: Console, *, interactive: bool, bind: str = "tcp://127.0.0.1:0",
                       allow_remote: bool = False, timeout: float = 10.0, keys: str | None = None,
                       identity: str = "client", insecure: bool = False) -> AsyncIterator[Session]:
    """Connects to the head at ``address`` and subscribes to its events, for the life of the block.

    Raises:
        CommandError: the head did not answer.
    """
    try:
        cluster = await Cluster.connect(address, bind=bind, allow_remote=allow_remote, timeout=timeout, keys=keys,
                                        identity=identity, insecure=insecure)
    except SecurityMismatch:
        raise CommandError(f"the head at {shown(address)} is secure (its address carries its public key): run the "
                           f"console with --keys DIR (the cluster's key directory), not --insecure") from None
    except HeadUnreachable as exc:  # it says what a look at the address found
        raise CommandError(f"cannot reach the head: {exc}") from None
    except (ActorError, OSError, ValueError) as exc:
        raise CommandError(f"cannot reach the head at {shown(address)}: {exc}; is `python -m actors.node --head` "
                           "running there?") from None
    session = Session(cluster, out, interactive=interactive)
    try:
        if interactive:
            await session.start_feed()
        await session.refresh()
        yield session
    finally:
        await session.stop_feed()
        await cluster.close()
