"""The calls a runtime waits on: one future per call, the sends still under way, the addresses lost."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from actors._errors import ActorError

__all__ = ["MAX_LOST_ADDRESSES", "PendingCalls"]

MAX_LOST_ADDRESSES = 4096  # the ended processes a runtime remembers (the oldest is forgotten first)


class PendingCalls:
    """A runtime's outstanding calls, by call id, with the address each went to.

    A call fails at once, instead of at its timeout, when its target's process is known
    to have ended: before it is sent (:meth:`open`), while it waits for room to be sent
    (:meth:`send_unless_failed`), or while it waits for its reply (:meth:`fail_calls_to`).
    """

    def __init__(self) -> None:
        self._pending: dict[int, tuple[asyncio.Future[Any], str]] = {}
        self._sending: dict[int, asyncio.Task[Any]] = {}  # asks still in their send, by call id
        self._lost = _LostAddresses()  # addresses whose process ended
        self._ids = itertools.count(1)

    def open(self, address: str) -> tuple[int, asyncio.Future[Any]]:
        """A new call to ``address``: its id, and the future its reply resolves.

        Raises:
            ActorError: why the process at ``address`` ended, when its node said so.
        """
        self._lost.refuse(address)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        call_id = next(self._ids)
        self._pending[call_id] = (future, address)
        return call_id, future

    def close(self, call_id: int) -> None:
        self._pending.pop(call_id, None)

    def waiting(self, call_id: Any) -> asyncio.Future[Any] | None:
        """The future of call ``call_id`` while it still waits for its reply; None for an unknown id
        (one that is not an int included: the id comes off the wire) or an answered call."""
        entry = self._pending.get(call_id) if type(call_id) is int else None
        return None if entry is None or entry[0].done() else entry[0]

    async def send_unless_failed(self, call_id: int, future: asyncio.Future[Any], send: Awaitable[Any]) -> None:
        """Awaits ``send`` (a request's send), unless its call fails first.

        A send to a peer whose connection is gone waits for room, and a node declared
        lost (:meth:`fail_calls_to`, which cancels the send) must end such a call at once,
        not at its timeout (a step begun between a node's death and its detection waited
        it out). The send runs in the asking task itself: no task of its own on this path.
        """
        task = asyncio.current_task()
        assert task is not None
        self._sending[call_id] = task
        try:
            await send
        except asyncio.CancelledError:
            if call_id in self._sending or not future.done() or future.exception() is None:
                raise  # not the loss's cancel: a timeout's, or the caller's
            task.uncancel()
            raise future.exception() from None  # type: ignore[misc]
        finally:
            self._sending.pop(call_id, None)

    def fail_calls_to(self, address: str, error: ActorError) -> int:
        """Fails every pending call to the runtime at ``address`` (it was lost); returns how many."""
        waiting = [(call_id, future) for call_id, (future, target) in self._pending.items()
                   if target == address and not future.done()]
        for call_id, future in waiting:
            future.set_exception(error)
            sending = self._sending.pop(call_id, None)
            if sending is not None:  # still waiting to send: it ends now (see send_unless_failed)
                sending.cancel()
        return len(waiting)

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
