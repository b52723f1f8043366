"""The socket plumbing under :mod:`transport.channel`: readiness on ZMQ_FD, reading a message
frame by frame within limits, and the addresses a channel binds."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket as net
import tempfile
from typing import Any

import zmq

from transport.wire import MessageTooLarge

__all__ = ["COPY_THRESHOLD", "ChannelClosed", "Readiness", "bind_address", "bulk_bind_address", "events", "gather",
           "advertised", "is_local_address", "is_loopback", "is_own_address", "measure", "readable", "reach",
           "route_source", "send_nowait", "url_host", "writable"]


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


def bulk_bind_address(bind_address: str) -> str:
    """Where a receiver bound at ``bind_address`` binds its bulk socket: the same host, any port."""
    scheme, _, rest = bind_address.partition("://")
    if scheme == "ipc":
        return f"ipc://{rest}.bulk"
    return f"tcp://{rest.rpartition(':')[0]}:*"


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


def bind_address(address: str, *, allow_remote: bool) -> tuple[str, str | None]:
    """Returns the address to bind (ephemeral forms resolved) and any temp folder made."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        raise ValueError(f"address {address!r} must look like tcp://HOST:PORT or ipc://PATH")
    if scheme == "ipc":
        if rest:
            return address, None
        tempdir = tempfile.mkdtemp(prefix="actorpipe-")
        return f"ipc://{os.path.join(tempdir, 'sock')}", tempdir
    if scheme != "tcp":
        raise ValueError(f"unsupported transport {scheme!r} in {address!r}: use tcp:// or ipc://")
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        raise ValueError(f"address {address!r} needs a host and a port (port 0 for any free one)")
    if not allow_remote and not is_loopback(host):
        raise ValueError(
            f"refusing to bind {address!r}: it is not a loopback address; pass allow_remote=True "
            "(a node: --allow-remote; with CURVE keys, the default for a cluster) to listen beyond this machine"
        )
    if port == "0":
        port = "*"
    return f"tcp://{host}:{port}", None


def is_local_address(address: str) -> bool:
    """Whether a runtime's ``address`` (with or without its key part) is reachable only
    from this machine: ``ipc://`` or TCP on a loopback address."""
    endpoint = address.partition("|")[0]
    scheme, _, rest = endpoint.partition("://")
    return scheme == "ipc" or (scheme == "tcp" and is_loopback(rest.rpartition(":")[0]))


def url_host(host: str) -> str:
    """``host`` as it goes in a ``tcp://`` address: an IPv6 literal in brackets (``fd00::2`` ->
    ``[fd00::2]``), a name or an IPv4 address as it is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def advertised(endpoint: str) -> str:
    """``endpoint`` (a bound socket's ``LAST_ENDPOINT``) as peers are told to reach it.

    A socket bound to every address (``tcp://0.0.0.0:P``, ``tcp://*:P``, ``tcp://[::]:P``) names
    itself by the wildcard, which no other machine can connect to: a head bound so told its
    workers to answer it at ``0.0.0.0``. This host's address on its default route stands in (the
    one other machines most likely reach it by; the socket still listens on every address);
    with no default route the endpoint stays as it is.
    """
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or host not in ("0.0.0.0", "*", "[::]"):
        return endpoint
    # Documentation addresses (RFC 3849, RFC 5737): only a default route leads there.
    for outside in ("2001:db8::1", "192.0.2.1") if host == "[::]" else ("192.0.2.1",):
        source = route_source(outside)
        if source is not None:
            return f"tcp://{url_host(source)}:{port}"
    return endpoint


def route_source(host: str, port: int = 9) -> str | None:
    """The address this host sends from toward ``host`` (a name, or an address, bracketed or not): the
    kernel's choice of route, read from a UDP socket "connected" there, which sends nothing. None
    where ``host`` does not resolve or no route leads to it."""
    try:
        family, _, _, _, target = net.getaddrinfo(host.strip("[]"), port, type=net.SOCK_DGRAM)[0]
        with net.socket(family, net.SOCK_DGRAM) as probe:
            probe.connect(target)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def is_own_address(host: str) -> bool | None:
    """Whether ``host`` (a name or an address) is an address of this machine: one a socket here can
    bind. None where it does not resolve."""
    try:
        found = net.getaddrinfo(host.strip("[]"), None, type=net.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, address in found:
        try:
            with net.socket(family, net.SOCK_DGRAM) as probe:
                probe.bind((address[0], 0, *address[2:]))
            return True
        except OSError:
            continue
    return False


def reach(socket: zmq.Socket[Any], address: str) -> None:
    """Lets ``socket`` bind or connect ``address`` over IPv6 when its host is an IPv6 literal
    (``tcp://[::1]:5555``): libzmq refuses one otherwise ("No such device"). Call it before the
    bind or connect; every other address leaves the socket IPv4-only, as libzmq's default is (a
    host whose kernel has no IPv6 could not open the socket at all)."""
    scheme, _, rest = address.partition("://")
    if scheme == "tcp" and rest.startswith("["):
        socket.setsockopt(zmq.IPV6, 1)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
