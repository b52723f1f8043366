"""The calls a runtime waits on: one future per call, their deadlines, the sends still under way, the addresses lost."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from actors._errors import ActorError, ActorTimeout
from transport.security import shown

__all__ = ["MAX_LOST_ADDRESSES", "PendingCalls"]

MAX_LOST_ADDRESSES = 4096  # the ended processes a runtime remembers (the oldest is forgotten first)


class PendingCalls:
    """A runtime's outstanding calls, by call id, with the address each went to.

    A call fails at once, instead of at its timeout, when its target's process is known
    to have ended: before it is sent (:meth:`open`), while it waits for room to be sent
    (:meth:`send_unless_failed`), or while it waits for its reply (:meth:`fail_calls_to`).

    A call's timeout fails it the same way (:class:`~actors.ActorTimeout`, in its send or
    while it waits). The deadlines share one timer, armed for the earliest: a timer per
    call (``asyncio.timeout``) cost about 5 µs of every call, a fifth of the Python a
    request costs its caller.
    """

    def __init__(self) -> None:
        self._pending: dict[int, tuple[asyncio.Future[Any], str]] = {}
        self._sending: dict[int, asyncio.Task[Any]] = {}  # asks still in their send, by call id
        self._lost = _LostAddresses()  # addresses whose process ended
        self._ids = itertools.count(1)
        # (deadline, call id, timeout, what was called): a heap; an answered call's entry
        # stays until the timer passes it or the heap is compacted (see _add_deadline).
        self._deadlines: list[tuple[float, int, float, str]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def open(self, address: str, timeout: float | None = None, what: str = "the call"
             ) -> tuple[int, asyncio.Future[Any]]:
        """A new call to ``address``: its id, and the future its reply resolves.

        Args:
            timeout: seconds until the call fails with ActorTimeout, naming ``what``
                (``name.method``) and ``address``; None waits for ever.

        Raises:
            ActorError: why the process at ``address`` ended, when its node said so.
        """
        self._lost.refuse(address)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        call_id = next(self._ids)
        self._pending[call_id] = (future, address)
        if timeout is not None:
            self._add_deadline(loop, call_id, timeout, what)
        return call_id, future

    def _add_deadline(self, loop: asyncio.AbstractEventLoop, call_id: int, timeout: float, what: str) -> None:
        deadlines = self._deadlines
        if len(deadlines) > 2 * len(self._pending) + 64:  # mostly answered calls: keep the heap near the live ones
            deadlines[:] = [entry for entry in deadlines if entry[1] in self._pending]
            heapq.heapify(deadlines)
        when = loop.time() + timeout
        heapq.heappush(deadlines, (when, call_id, timeout, what))
        if when < self._timer_at:
            self._arm(loop, when)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(when, self._expire, loop), when

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer: fails every call past its deadline, drops answered calls' entries, arms for the next."""
        self._timer, self._timer_at = None, float("inf")
        deadlines = self._deadlines
        now = loop.time() + 0.001  # a timer may fire a little before its time (the loop's clock resolution)
        while deadlines:
            when, call_id, timeout, what = deadlines[0]
            entry = self._pending.get(call_id)
            waiting = entry is not None and not entry[0].done()
            if waiting and when > now:
                break
            heapq.heappop(deadlines)
            if entry is not None and waiting:
                self._fail(call_id, entry[0], ActorTimeout(f"no reply from {what} at {shown(entry[1])} within {timeout}s"))
        if deadlines:
            self._arm(loop, deadlines[0][0])

    def _fail(self, call_id: int, future: asyncio.Future[Any], error: ActorError) -> None:
        """Fails a waiting call; a call still in its send ends there (see :meth:`send_unless_failed`)."""
        future.set_exception(error)
        sending = self._sending.pop(call_id, None)
        if sending is not None:
            sending.cancel()

    def close(self, call_id: int) -> None:
        self._pending.pop(call_id, None)

    def waiting(self, call_id: Any) -> tuple[asyncio.Future[Any], str] | None:
        """The future of call ``call_id`` and the address it went to, while it still waits for its reply;
        None for an unknown id (one that is not an int included: the id comes off the wire) or an answered
        call."""
        entry = self._pending.get(call_id) if type(call_id) is int else None
        return None if entry is None or entry[0].done() else entry

    async def send_unless_failed(self, call_id: int, future: asyncio.Future[Any], send: Awaitable[Any]) -> None:
        """Awaits ``send`` (a request's send), unless its call fails first.

        A send to a peer whose connection is gone waits for room, and a node declared
        lost (:meth:`fail_calls_to`, which cancels the send) must end such a call at once,
        not at its timeout (which, when it comes first, ends the send the same way) (a step begun between a node's death and its detection waited
        it out). The send runs in the asking task itself: no task of its own on this path.
        """
        task = asyncio.current_task()
        if task is None:  # a call's first step before Python 3.12 runs in no task (actors/_actor.py)
            task = asyncio.ensure_future(send)
            send = task
        self._sending[call_id] = task
        try:
            await send
        except asyncio.CancelledError:
            if call_id in self._sending or not future.done() or future.exception() is None:
                raise  # not the call's failure: the caller's own cancel (or its own timeout)
            task.uncancel()
            raise future.exception() from None  # type: ignore[misc]
        finally:
            self._sending.pop(call_id, None)

    def fail_calls_to(self, address: str, error: ActorError) -> int:
        """Fails every pending call to the runtime at ``address`` (it was lost); returns how many."""
        waiting = [(call_id, future) for call_id, (future, target) in self._pending.items()
                   if target == address and not future.done()]
        for call_id, future in waiting:
            self._fail(call_id, future, error)
        return len(waiting)

    def fail_calls_where(self, chosen: Callable[[str], bool], error: Callable[[str], ActorError]) -> int:
        """Fails every pending call to an address ``chosen`` picks, each with ``error(address)``; how many."""
        waiting = {target for future, target in self._pending.values() if not future.done()}
        return sum(self.fail_calls_to(address, error(address)) for address in waiting if chosen(address))

    def mark_lost(self, address: str, error: ActorError) -> None:
        """The process at ``address`` ended for good: its pending calls fail with ``error``, and so
        does every later call to it."""
        self._lost.mark(address, error)
        self.fail_calls_to(address, error)

    def lost(self, address: str) -> ActorError | None:
        """Why the process at ``address`` ended (a fresh copy), or None."""
        return self._lost.get(address)

    def refuse(self, address: str) -> None:
        """Raises why ``address``'s process ended, if it did."""
        self._lost.refuse(address)

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """Fails every call still waiting, each with a new ``error()`` (the runtime closes)."""
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(error())
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, float("inf")


class _LostAddresses:
    """The addresses whose process ended, with why: the newest :data:`MAX_LOST_ADDRESSES` of them."""

    def __init__(self) -> None:
        self._errors: dict[str, ActorError] = {}

    def mark(self, address: str, error: ActorError) -> None:
        self._errors[address] = error
        while len(self._errors) > MAX_LOST_ADDRESSES:
            del self._errors[next(iter(self._errors))]

    def get(self, address: str) -> ActorError | None:
        """A fresh copy of the error (each raise gets its own traceback), or None."""
        error = self._errors.get(address)
        return None if error is None else type(error)(error.message, details=dict(error.details))

    def refuse(self, address: str) -> None:
        """Raises why ``address``'s process ended, if it did."""
        if (error := self.get(address)) is not None:
            raise error
