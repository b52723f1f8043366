"""The runtime's outgoing sockets: a bounded pool of senders, one per peer address.

Every address a runtime sends to (a peer it asks, a caller it answers) needs a PUSH
socket, and a node answers whoever asks it: short-lived clients, or anyone who names
a made-up reply address. So the sockets are pooled:

- at most ``max_senders`` are open; to open one more, one is closed, the first found of:
  an idle sender that never delivered a message; one that replies alone have waited
  on for over a second without a peer (a made-up address, most likely); the least
  recently used idle one; and, last, the oldest on which replies alone wait for a
  peer that has not come yet. Its waiting replies are dropped. A sender that an
  ``ask`` or ``tell`` is sending on is never closed under it;
- a sender unused for ``idle_timeout_s`` is closed by a sweep;
- a reply never holds up the actor that answers: one that cannot leave at once
  waits in a task, at most ``reply_timeout_s`` (for its peer and for a socket),
  then it is dropped and its sender closed. So an address nobody listens at costs
  a socket for seconds, not for ever. At most ``max_waiting_replies`` wait at once,
  and 64 for any one peer; more are dropped at once.

Closing an idle sender lets what libzmq still holds leave within the sender's
linger; a later message to that address goes out on a fresh socket (and so could
pass one still lingering: only when more than ``max_senders`` peers are busy at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from transport.channel import ChannelClosed, WouldBlock
from transport.security import is_numeric_endpoint
from transport.wire import excerpt

__all__ = ["SenderPool", "SenderPoolConfig", "SenderPoolStatistics"]

log = logging.getLogger(__name__)

SpawnTask = Callable[..., "asyncio.Task[Any]"]


class PooledSender(Protocol):
    """What the pool needs of a sender: :class:`~transport.channel.Sender`, or a runtime's
    :class:`~actors._streams.StreamingSender`."""

    address: str

    def send_frames_nowait(self, frames: list[Any]) -> int: ...

    async def send_frames(self, frames: list[Any]) -> int: ...

    async def aclose(self) -> None: ...

_CONNECT_GRACE_S = 1.0
_MAX_WAITING_REPLIES_PER_PEER = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class SenderPoolConfig:
    """Bounds on a runtime's outgoing sockets."""

    max_senders: int = 256
    """Sockets open at once (libzmq allows 1,023 per context, each takes a file descriptor)."""
    idle_timeout_s: float = 30.0
    """A sender unused this long is closed (swept every half of it)."""
    reply_timeout_s: float = 5.0
    """A reply that cannot leave within this (peer gone, never there, or not reading) is dropped."""
    max_waiting_replies: int = 1024
    """Replies waiting for their peer at once (each holds its message); more are dropped at once."""

    def __post_init__(self) -> None:
        if self.max_senders < 1:
            raise ValueError(f"max_senders must be at least 1, not {self.max_senders}")
        if self.idle_timeout_s <= 0 or self.reply_timeout_s <= 0:
            raise ValueError(
                f"idle_timeout_s ({self.idle_timeout_s}) and reply_timeout_s "
                f"({self.reply_timeout_s}) must be positive"
            )
        if self.max_waiting_replies < 0:
            raise ValueError(f"max_waiting_replies must not be negative, not {self.max_waiting_replies}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SenderPoolStatistics:
    """Counters of one pool since it was made (a snapshot)."""

    num_open: int
    """Sockets open now, in the pool or closing once their last send ends."""
    num_in_use: int
    """Senders with a send in flight."""
    num_opened: int
    num_evicted: int
    """Closed to make room for another address."""
    num_expired: int
    """Closed after ``idle_timeout_s`` unused."""
    num_waiting_replies: int
    num_dropped_replies: int
    addresses: tuple[str, ...]
    """The pooled addresses, least recently used first."""


class _Entry:
    """One pooled sender and its lease count."""

    __slots__ = ("address", "sender", "num_users", "num_reply_users", "delivered", "opened_at", "last_used",
                 "detached", "closed")

    def __init__(self, address: str, sender: PooledSender, now: float) -> None:
        self.address = address
        self.sender = sender
        self.num_users = 0
        self.num_reply_users = 0  # of num_users: replies, which may be dropped to make room
        self.delivered = False  # a message went out on it: its peer was there
        self.opened_at = now
        self.last_used = now
        self.detached = False  # out of the pool: closes when its last user is done
        self.closed = False


class SenderPool:
    """Senders keyed by address, bounded, least recently used first out.

    Args:
        open_sender: connects a new sender to an address (may raise for a bad one).
        config: the bounds.
        spawn_task: starts a task (the runtime's ``spawn_task``); the pool keeps and
            cancels on :meth:`aclose` the ones it starts: its sweep and the replies
            that wait for their peer.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        open_sender: Callable[[str], PooledSender],
        config: SenderPoolConfig,
        *,
        spawn_task: SpawnTask,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._open_sender = open_sender
        self.config = config
        self._spawn_task = spawn_task
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._detached: set[_Entry] = set()  # out of the pool, still open while a send uses them
        self._num_open = 0
        self._room = asyncio.Event()
        self._num_waiting_for_room = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[Any] | None = None
        self._closed = False
        self._dropped = _DropLog()
        self._num_opened = self._num_evicted = self._num_expired = self._num_waiting_replies = 0

    # -- leasing ---------------------------------------------------------------------

    async def acquire(self, address: str, *, wait: bool = True, reply: bool = False) -> _Entry | None:
        """Leases the sender for ``address``, opening one (and closing another) if needed.

        Every lease must be given back with :meth:`release`. A sender leased for
        anything but a reply is never closed by eviction or the sweep.

        Args:
            wait: when no sender can be closed to make room, wait for one; else return None.
            reply: the lease sends a reply, which may be dropped (its sender closed) to
                make room while the sender has never delivered a message.

        Raises:
            ChannelClosed: the pool is closed.
            zmq.ZMQError, ValueError: ``address`` cannot be connected to.
        """
        while True:
            if self._closed:
                raise ChannelClosed("the runtime's senders are closed")
            entry = self._lease_pooled(address, reply)
            if entry is not None:
                return entry
            if self._num_open < self.config.max_senders or await self._evict_one():
                entry = self._open(address)
                entry.num_users += 1
                entry.num_reply_users += reply
                return entry
            if not wait:
                return None
            self._num_waiting_for_room += 1
            try:
                await self._room.wait()
            finally:
                self._num_waiting_for_room -= 1

    async def release(self, entry: _Entry, *, reply: bool = False) -> None:
        """Gives back a lease from :meth:`acquire` (with the same ``reply``)."""
        if self._unlease(entry, reply):
            await self._close(entry)

    async def discard(self, entry: _Entry) -> None:
        """Takes ``entry`` out of the pool; its socket closes once no send uses it."""
        if self._entries.get(entry.address) is entry:
            del self._entries[entry.address]
        if entry.closed:
            return
        entry.detached = True
        if entry.num_users == 0:
            await self._close(entry)
        else:
            self._detached.add(entry)

    # -- sending -----------------------------------------------------------------------

    def send_now(self, address: str, frames: list[Any]) -> int | None:
        """Sends encoded ``frames`` to ``address`` now, on its pooled sender: no lease, task or wait
        (every request's and ``tell``'s path while their peer keeps up). Returns the bytes sent; None,
        having sent nothing, when none is pooled or its queue is full (:meth:`send_frames` waits)."""
        entry = self._entries.get(address)
        if entry is None or self._closed:
            return None
        try:
            nbytes = entry.sender.send_frames_nowait(frames)
        except WouldBlock:
            return None
        self._entries.move_to_end(address)
        entry.last_used = self._clock()
        entry.delivered = True
        return nbytes

    async def send_frames(self, address: str, frames: list[Any]) -> int:
        """Sends encoded ``frames`` to ``address``, waiting for room as :meth:`Sender.send_frames` does
        (the path of a message :meth:`send_now` could not send)."""
        entry = self._lease_pooled(address, False) or await self.acquire(address)
        assert entry is not None
        try:
            nbytes = await entry.sender.send_frames(frames)
        finally:
            if self._unlease(entry, False):
                await self._close(entry)
        entry.delivered = True
        return nbytes

    async def reply(self, address: str, frames: list[Any]) -> asyncio.Task[None] | None:
        """Sends an encoded reply now if it can go now, else from a task, within the reply timeout.

        Never waits for the peer, so an actor answering a caller that is gone or slow
        goes on to its next call. A reply that cannot leave within ``reply_timeout_s``
        is dropped (logged, counted) and its sender closed; so is one waiting on a
        sender that never delivered anything, when another address needs its socket.

        Returns:
            The task sending it, or None when it left at once or was dropped.
        """
        entry = self._lease_pooled(address, True)
        if entry is None:
            if not _is_numeric_address(address):
                # libzmq would resolve a host name with a blocking lookup on its I/O thread;
                # a runtime's own address (its receiver's endpoint) is always numeric.
                self._dropped.note(address, "not a numeric tcp:// or an ipc:// address")
                return None
            try:
                entry = await self.acquire(address, wait=False, reply=True)
            except (zmq.ZMQError, ValueError) as exc:
                self._dropped.note(address, f"cannot connect: {_reason(exc)}")
                return None
            except ChannelClosed:
                return None
        if entry is not None:
            try:
                entry.sender.send_frames_nowait(frames)
            except WouldBlock:
                pass  # not connected yet, or the peer is not reading: wait, from a task, on this lease
            except BaseException:
                await self.release(entry, reply=True)
                raise
            else:
                entry.delivered = True
                if self._unlease(entry, True):
                    await self._close(entry)
                return None
        why = _no_room_to_wait(entry, self._num_waiting_replies, self.config.max_waiting_replies)
        if why is None:
            self._num_waiting_replies += 1  # here, not in the task: a burst counts before it runs
            return self._start(self._reply_later(address, frames, entry), name="reply")
        if entry is not None:
            await self.release(entry, reply=True)
        self._dropped.note(address, why)
        return None

    async def _reply_later(self, address: str, frames: list[Any], entry: _Entry | None) -> None:
        """Sends a reply within the reply timeout, on ``entry`` (leased for it) or one it leases."""
        try:
            async with asyncio.timeout(self.config.reply_timeout_s):
                if entry is None:
                    entry = await self.acquire(address, reply=True)
                    assert entry is not None
                await entry.sender.send_frames(frames)
                entry.delivered = True
        except TimeoutError:
            self._dropped.note(address, f"no peer took it within {self.config.reply_timeout_s}s")
            if entry is not None:
                await self.discard(entry)
        except (zmq.ZMQError, ValueError) as exc:
            self._dropped.note(address, f"cannot connect: {_reason(exc)}")
        except ChannelClosed:
            if self._closed:
                log.debug("the runtime closed before a reply left")
            else:
                self._dropped.note(address, "no peer yet, and its socket was needed for another")
        finally:
            self._num_waiting_replies -= 1
            if entry is not None:
                await self.release(entry, reply=True)

    # -- closing -------------------------------------------------------------------------

    async def evict_idle(self, *, now: float | None = None) -> int:
        """Closes every sender unused for ``idle_timeout_s``; returns how many."""
        deadline = (self._clock() if now is None else now) - self.config.idle_timeout_s
        expired = [e for e in self._entries.values() if e.num_users == 0 and e.last_used <= deadline]
        for entry in expired:
            del self._entries[entry.address]
            await self._close(entry)
        self._num_expired += len(expired)
        return len(expired)

    async def aclose(self) -> None:
        """Cancels the pool's tasks and closes every sender; idempotent."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        entries = [*self._entries.values(), *self._detached]
        self._entries.clear()
        for entry in entries:  # a send still in flight fails with ChannelClosed
            await self._close(entry)
        self._wake_room_waiters()

    def statistics(self) -> SenderPoolStatistics:
        return SenderPoolStatistics(
            num_open=self._num_open,
            num_in_use=sum(1 for e in self._entries.values() if e.num_users),
            num_opened=self._num_opened,
            num_evicted=self._num_evicted,
            num_expired=self._num_expired,
            num_waiting_replies=self._num_waiting_replies,
            num_dropped_replies=self._dropped.num_dropped,
            addresses=tuple(self._entries),
        )

    # -- internals -------------------------------------------------------------------------

    def _lease_pooled(self, address: str, reply: bool) -> _Entry | None:
        """Leases the pooled sender for ``address``; None if there is none (or the pool is closed)."""
        entry = self._entries.get(address)
        if entry is None or self._closed:
            return None
        self._entries.move_to_end(address)
        entry.num_users += 1
        entry.num_reply_users += reply
        return entry

    def _unlease(self, entry: _Entry, reply: bool) -> bool:
        """Gives a lease back; True when the sender must be closed now (it left the pool)."""
        entry.num_users -= 1
        entry.num_reply_users -= reply
        entry.last_used = self._clock()
        if entry.num_users:
            return False
        if not entry.detached:
            self._wake_room_waiters()  # it may be evicted now
        return entry.detached

    def _open(self, address: str) -> _Entry:
        sender = self._open_sender(address)
        entry = _Entry(address, sender, self._clock())
        self._entries[address] = entry
        self._num_open += 1
        self._num_opened += 1
        if self._sweeper is None:
            self._sweeper = self._start(self._sweep(), name="close idle senders")
        return entry

    async def _evict_one(self) -> bool:
        """Closes a sender to make room (see the module's docstring); False if none may go."""
        # A peer that sent a request is listening: its connection takes a few round trips.
        grace_s = min(_CONNECT_GRACE_S, self.config.reply_timeout_s / 5)
        victim = _eviction_victim(self._entries.values(), waited_since=self._clock() - grace_s)
        if victim is None:
            return False
        del self._entries[victim.address]
        await self._close(victim)  # a reply waiting on it fails with ChannelClosed: dropped
        self._num_evicted += 1
        return True

    async def _close(self, entry: _Entry) -> None:
        if entry.closed:
            return
        entry.closed = True
        self._detached.discard(entry)
        self._num_open -= 1
        await entry.sender.aclose()
        self._wake_room_waiters()

    def _wake_room_waiters(self) -> None:
        if self._num_waiting_for_room:
            self._room.set()  # wakes every waiter; each one checks again
            self._room.clear()

    async def _sweep(self) -> None:
        interval = self.config.idle_timeout_s / 2
        while True:
            await asyncio.sleep(interval)
            await self.evict_idle()

    def _start(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = self._spawn_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _eviction_victim(entries: Iterable[_Entry], *, waited_since: float) -> _Entry | None:
    """The sender to close for room, least recently used first: one idle that never delivered, then
    one that replies alone have waited on since before ``waited_since``, then one idle, then one
    replies wait on; never one an ask or tell is sending on. None if there is none."""
    firsts: list[_Entry | None] = [None] * 4  # the first candidate of each kind, in order of preference
    for entry in entries:
        if entry.num_users == 0:
            kind = 2 if entry.delivered else 0
        elif not entry.delivered and entry.num_users == entry.num_reply_users:
            kind = 1 if entry.opened_at <= waited_since else 3
        else:
            continue  # an ask or tell is sending on it
        if firsts[kind] is None:
            firsts[kind] = entry
            if kind == 0:
                break
    return next((entry for entry in firsts if entry is not None), None)


class _DropLog:
    """Counts dropped replies; logs the first, then at most one line a second."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.num_dropped = 0
        self._interval_s = interval_s
        self._last_logged = -float("inf")
        self._num_unlogged = 0

    def note(self, address: str, why: str) -> None:
        self.num_dropped += 1
        now = time.monotonic()
        if now - self._last_logged < self._interval_s:
            self._num_unlogged += 1
            return
        also = f" (and {self._num_unlogged} more dropped since the last report)" if self._num_unlogged else ""
        log.warning("dropped a reply to %s: %s%s", excerpt(address, 100), why, also)
        self._last_logged, self._num_unlogged = now, 0


def _reason(exc: Exception) -> str:
    """Why a connect failed, without the (untrusted) address that ZeroMQ's message repeats."""
    if isinstance(exc, zmq.ZMQError) and exc.errno:
        return zmq.strerror(exc.errno)
    return type(exc).__name__


def _is_numeric_address(address: str) -> bool:
    """True for ``ipc://PATH`` and ``tcp://IP:PORT``, with or without a ``|KEY`` suffix."""
    return is_numeric_endpoint(address.partition("|")[0])


def _no_room_to_wait(entry: _Entry | None, waiting: int, max_waiting: int) -> str | None:
    """Why a reply may not wait for its peer (None: it may). Waiting replies hold their frames
    (tensors too): they are bounded per peer and in all."""
    if entry is not None and entry.num_reply_users > _MAX_WAITING_REPLIES_PER_PEER:
        return f"{_MAX_WAITING_REPLIES_PER_PEER} replies wait for this peer already"
    if waiting >= max_waiting:
        return f"{waiting} replies wait already"
    return None
