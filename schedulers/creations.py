"""Job creations a caller may give up on: a ``train()`` cancelled or timed out ends its job too.

Creating a job takes seconds (its stages build the model) to minutes (a large one). A driver
that stops waiting (Ctrl-C, ``asyncio.wait_for``, the call's own timeout) gets no job handle,
so the job it started would run on, holding its nodes, with no one to close it. Each
``create_job`` therefore carries a *ticket*, a random name the caller chose; the caller that
gives up sends ``abandon_job(ticket)``, and the scheduler cancels the creation still under
way (it stops whatever stage actors it had spawned) or closes the job it made. Only the key
that created a job may abandon it; a ticket that comes before its creation (a message
overtaken) stops that creation when it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import TypeVar

from actors import ActorStopped

V = TypeVar("V")

__all__ = ["Creations", "checked_ticket"]

TICKET_CHARS = 64  # a client's is 32 hex digits


def checked_ticket(value: object) -> str:
    """A caller's ticket as it came off the wire, refused before anything is done with it.

    Raises:
        TypeError: not a string.
        ValueError: longer than :data:`TICKET_CHARS`.
    """
    if not isinstance(value, str):
        raise TypeError(f"a creation's ticket is a string, got {type(value).__name__}")
    if len(value) > TICKET_CHARS:
        raise ValueError(f"a creation's ticket is at most {TICKET_CHARS} characters, got {len(value)}")
    return value


class Creations:
    """The scheduler's creations by ticket: those under way, and the jobs recently made."""

    KEEP = 256  # tickets remembered after their creation ended (a late abandon_job), and abandoned early

    def __init__(self) -> None:
        self._running: dict[str, tuple[str, asyncio.Task[object]]] = {}  # ticket -> (caller, creating task)
        self._made: OrderedDict[str, tuple[str, str]] = OrderedDict()  # ticket -> (caller, job id)
        self._abandoned: OrderedDict[str, str] = OrderedDict()  # ticket -> caller, before its creation came

    @contextlib.contextmanager
    def running(self, ticket: str, caller: str) -> Iterator[None]:
        """Around a creation: it may be cancelled by :meth:`abandon` meanwhile.

        Raises:
            ActorStopped: its caller abandoned it already.
        """
        if not ticket:
            yield
            return
        if self._abandoned.pop(ticket, None) == caller:
            raise ActorStopped("the caller abandoned this job's creation before it began")
        task = asyncio.current_task()
        assert task is not None
        self._running[ticket] = (caller, task)
        try:
            yield
        finally:
            self._running.pop(ticket, None)

    def made(self, ticket: str, caller: str, job: str) -> None:
        """The creation ``ticket`` made ``job``."""
        if ticket:
            _remember(self._made, ticket, (caller, job))

    def abandon(self, ticket: str, caller: str) -> str | None:
        """``caller`` gave up on creation ``ticket``: cancels it if it is under way; the job it made
        (for the caller to close), or None."""
        running = self._running.get(ticket)
        if running is not None:
            if running[0] == caller:
                running[1].cancel()
            return None
        made = self._made.get(ticket)
        if made is not None:
            if made[0] != caller:
                return None
            del self._made[ticket]
            return made[1]
        _remember(self._abandoned, ticket, caller)
        return None


def _remember(kept: OrderedDict[str, V], key: str, value: V) -> None:
    kept[key] = value
    while len(kept) > Creations.KEEP:
        kept.popitem(last=False)
