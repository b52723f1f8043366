"""The socket plumbing under :mod:`transport.channel`: readiness on ZMQ_FD, reading a message
frame by frame within limits (the addresses a channel binds: :mod:`transport.addresses`)."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

from transport.addresses import Address
from transport.wire import MessageTooLarge

__all__ = ["COPY_THRESHOLD", "ChannelClosed", "Readiness", "events", "gather", "measure", "readable", "reach",
           "send_nowait", "writable"]


class ChannelClosed(RuntimeError):
    """The channel was closed (by ``aclose``) before or during the call."""


class Readiness:
    """Waits for ZeroMQ sockets' events through the loop's readers on their ZMQ_FDs.

    ZMQ_FD is edge-triggered: it fires when the socket's events may have changed,
    and only ``ZMQ_EVENTS`` says what they are. So every wait re-checks the events
    after arming the reader. A ``sticky`` reader stays armed between waits (a
    receiver waits all the time, and re-arming costs two epoll_ctl calls a
    message); when it fires with nobody waiting it reads the events, which
    consumes the notification instead of letting it fire again. Given several
    sockets, a wait returns once any of them has the event.
    """

    def __init__(self, *sockets: zmq.Socket[Any], sticky: bool = False) -> None:
        self._sockets = sockets
        self._fds: list[int] = [socket.getsockopt(zmq.FD) for socket in sockets]  # type: ignore[misc]
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._armed = False
        self._sticky = sticky

    async def wait(self, event: int) -> None:
        """Returns once ``event`` (POLLIN or POLLOUT) is set on the socket.

        Raises:
            ChannelClosed: :meth:`close` was called while waiting.
        """
        event = int(event)  # pyzmq's enums make every & below a Python call (several a message)
        try:
            while not self._any(event):
                if not self._armed:
                    self._arm()
                    if self._any(event):  # what came between the check above and the arming
                        return
                waiter = self._waiter = self._loop.create_future()
                try:
                    await waiter
                finally:
                    self._waiter = None
        finally:
            if not self._sticky:
                self._disarm()

    async def notified(self) -> None:
        """Returns at the sockets' next notification, without reading their events first: for a
        sticky reader whose caller has just read every socket's events and found nothing to do
        (two ``ZMQ_EVENTS`` calls a wait fewer). A notification may be spurious: the caller reads
        the events again.

        Raises:
            ChannelClosed: :meth:`close` was called while waiting.
        """
        assert self._sticky, "notified() is for sticky readers"
        if not self._armed:
            # A notification that comes before the reader is armed still leaves ZMQ_FD readable
            # (libzmq reads it only when it processes the socket's commands, which nothing here
            # does before the wait), so the loop reports it once armed.
            self._arm()
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _any(self, event: int) -> bool:
        return any(events(socket) & event for socket in self._sockets)

    def wake(self) -> None:
        """Ends a pending :meth:`notified` as a notification would (for news from elsewhere)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        elif self._sticky:
            for socket in self._sockets:
                if not socket.closed:
                    events(socket)

    def _arm(self) -> None:
        for fd in self._fds:
            self._loop.add_reader(fd, self._wake)
        self._armed = True

    def _disarm(self) -> None:
        # Only while armed: once the socket is closed its fd number may belong to
        # another socket, whose reader must not be removed.
        if self._armed:
            for fd in self._fds:
                self._loop.remove_reader(fd)
            self._armed = False

    def close(self) -> None:
        """Disarms, and fails a pending wait with ChannelClosed; call before closing the socket."""
        waiter, self._waiter = self._waiter, None
        self._disarm()
        if waiter is not None and not waiter.done():
            waiter.set_exception(ChannelClosed("channel closed while waiting"))


def gather(socket: zmq.Socket[Any], frame: zmq.Frame, limit: int, max_frames: int,
            address: str) -> tuple[list[zmq.Frame], int]:
    """The rest of the message that ``frame`` starts, read frame by frame; returns it and its bytes.

    The rest is queued already (multipart delivery is atomic).

    Raises:
        MessageTooLarge: over ``limit`` bytes or ``max_frames`` frames; its remaining
            frames were read and released one by one.
    """
    frames, nbytes = [frame], len(frame)
    while frame.more and nbytes <= limit and len(frames) < max_frames:
        frame = socket.recv(zmq.NOBLOCK, copy=False)
        nbytes += len(frame)
        frames.append(frame)
    if nbytes <= limit and not frame.more:
        return frames, nbytes
    num_frames = len(frames)
    frames.clear()
    while frame.more:  # drop the rest, one frame at a time
        frame = socket.recv(zmq.NOBLOCK, copy=False)
        nbytes += len(frame)
        num_frames += 1
    raise MessageTooLarge(
        f"refused a message of {nbytes} bytes in {num_frames} frames on {address}: over "
        f"the limit of {limit} bytes or {max_frames} frames"
    )


# Plain ints: pyzmq's enums cost a call per operation.
_EVENTS, _POLLIN, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)
_NOBLOCK, _NOBLOCK_MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
# Below this a frame is copied as it is queued, even where the caller let it go zero-copy. A
# zero-copy frame costs a Frame object, and its release a message to pyzmq's garbage thread,
# which takes the GIL to drop it: at 64 KiB (pyzmq's own threshold) that was dearer than the
# copy (benchmarks.transport's channel, 8 alternating trials each: 0.91 against 0.66 GB/s
# plain, 0.56 against 0.39 sealed); at 128 KiB the two were even, and from 256 KiB zero-copy
# was ahead (2.05 against 1.78 GB/s, 3.2 against 1.7 at 1 MiB).
COPY_THRESHOLD = 128 << 10


def events(socket: zmq.Socket[Any]) -> int:
    """The socket's ZMQ_EVENTS (and its ZMQ_FD notification consumed)."""
    return socket.getsockopt(_EVENTS)  # type: ignore[return-value]


def readable(socket: zmq.Socket[Any]) -> bool:
    """Whether a message waits on ``socket`` (and the socket's ZMQ_FD notification is consumed)."""
    return bool(socket.getsockopt(_EVENTS) & _POLLIN)  # type: ignore[call-overload,operator]


def writable(socket: zmq.Socket[Any]) -> bool:
    """Whether ``socket`` has room for a message now."""
    return bool(socket.getsockopt(_EVENTS) & _POLLOUT)  # type: ignore[call-overload,operator]


def send_nowait(socket: zmq.Socket[Any], frames: list[Any], *, copy: bool) -> None:
    """``socket.send_multipart(frames, NOBLOCK, copy=copy)`` without its per-call enum arithmetic and
    type checks (the frames are bytes and buffers the wire made). A message is queued whole or not
    at all: libzmq checks the high-water mark at its first frame.

    Raises:
        zmq.Again: no room.
    """
    last = len(frames) - 1
    for index, frame in enumerate(frames):
        socket.send(frame, _NOBLOCK if index == last else _NOBLOCK_MORE, copy=copy)


def measure(frames: list[Any]) -> tuple[int, bool]:
    """The bytes of ``frames``, and whether sending them zero-copy pays: a zero-copy frame costs a
    Frame object and a release callback, so below :data:`COPY_THRESHOLD` copying is cheaper."""
    sizes = [memoryview(f).nbytes for f in frames]
    return sum(sizes), max(sizes, default=0) >= COPY_THRESHOLD


def reach(socket: zmq.Socket[Any], address: str) -> None:
    """Lets ``socket`` bind or connect ``address`` over IPv6 when its host is an IPv6 literal
    (``tcp://[::1]:5555``): libzmq refuses one otherwise ("No such device"). Call it before the
    bind or connect; every other address leaves the socket IPv4-only, as libzmq's default is (a
    host whose kernel has no IPv6 could not open the socket at all)."""
    where = Address.parse(address)
    if where.is_tcp and where.host.startswith("["):
        socket.setsockopt(zmq.IPV6, 1)
