"""ZeroMQ channels: one-way, ordered, zero-copy message streams between processes.

A :class:`Receiver` binds a PULL socket (its inbox); a :class:`Sender` connects a PUSH
socket to one receiver's address. Messages are encoded by :mod:`transport.wire`:
tensor frames leave without a copy (libzmq reads the tensor's memory, which stays
alive until libzmq releases it). High-water marks on both ends bound the queued
messages, so a slow receiver makes ``send`` wait instead of memory growing.

Sockets bind loopback unless ``allow_remote=True``. ``ipc://`` with no path binds a
socket file in a fresh temporary folder; ``aclose()`` removes both.

Example::

    async with open_receiver("ipc://") as rx, open_sender(rx.address) as tx:
        await tx.send({"x": torch.ones(3)})
        message = await rx.receive()
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import zmq

from transport.security import Keypair, configure_client, configure_server, join_address, split_address
from transport.wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_FRAMES_PER_MESSAGE,
    MessageTooLarge,
    decode_message,
    encode_message,
)

__all__ = [
    "ChannelClosed",
    "ChannelStatistics",
    "Receiver",
    "Sender",
    "WouldBlock",
    "is_local_address",
    "open_receiver",
    "open_sender",
]

log = logging.getLogger(__name__)

DEFAULT_HWM = 64
DEFAULT_LINGER_MS = 2000


class ChannelClosed(RuntimeError):
    """The channel was closed (by ``aclose``) before or during the call."""


class WouldBlock(RuntimeError):
    """``send_nowait`` found the high-water mark reached (or no peer connected yet)."""


@dataclass(slots=True, kw_only=True)
class ChannelStatistics:
    """Counters of one channel end since it was opened."""

    address: str
    messages: int = 0
    bytes: int = 0


def open_receiver(
    address: str = "tcp://127.0.0.1:0",
    *,
    hwm: int = DEFAULT_HWM,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    allow_remote: bool = False,
    context: zmq.Context[Any] | None = None,
    curve: Keypair | None = None,
) -> Receiver:
    """Binds a receiving channel.

    Args:
        address: ``tcp://HOST:PORT`` (port 0 picks a free one) or ``ipc://PATH``
            (an empty path makes a socket file in a new temporary folder).
        hwm: messages queued in this process before the sender must wait.
        max_message_bytes: larger frames are refused by libzmq, larger messages by
            the decoder.
        allow_remote: permit binding an address that is not loopback.
        context: the ZeroMQ context; the process-wide one when None.
        curve: listen as a CURVE server with this keypair (see :mod:`transport.security`;
            the context needs a :class:`~transport.security.Gate`); the address then
            ends in ``|<public key>``.

    Raises:
        ValueError: a non-loopback address without ``allow_remote``, or a malformed one.
        zmq.ZMQError: the bind failed (address in use, no permission).
    """
    return Receiver(
        address,
        hwm=hwm,
        max_message_bytes=max_message_bytes,
        allow_remote=allow_remote,
        context=context,
        curve=curve,
    )


def open_sender(
    address: str,
    *,
    hwm: int = DEFAULT_HWM,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    linger_ms: int = DEFAULT_LINGER_MS,
    context: zmq.Context[Any] | None = None,
    curve: Keypair | None = None,
) -> Sender:
    """Connects a sending channel to a receiver's address (the receiver may come later).

    Args:
        curve: connect as a CURVE client with this keypair; ``address`` must then carry
            the receiver's public key (``...|<hex>``), which the receiver must prove.

    Raises:
        ValueError: ``curve`` given for an address without a key.
    """
    return Sender(
        address, hwm=hwm, max_message_bytes=max_message_bytes, linger_ms=linger_ms, context=context,
        curve=curve,
    )


class _Readiness:
    """Waits for a ZeroMQ socket's events through the loop's reader on ZMQ_FD.

    ZMQ_FD is edge-triggered: it fires when the socket's events may have changed,
    and only ``ZMQ_EVENTS`` says what they are. So every wait re-checks the events
    after arming the reader. A ``sticky`` reader stays armed between waits (a
    receiver waits all the time, and re-arming costs two epoll_ctl calls a
    message); when it fires with nobody waiting it reads the events, which
    consumes the notification instead of letting it fire again.
    """

    def __init__(self, socket: zmq.Socket[Any], *, sticky: bool = False) -> None:
        self._socket = socket
        self._fd: int = socket.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._armed = False
        self._sticky = sticky

    async def wait(self, event: int) -> None:
        """Returns once ``event`` (POLLIN or POLLOUT) is set on the socket.

        Raises:
            ChannelClosed: :meth:`close` was called while waiting.
        """
        while not _events(self._socket) & event:
            waiter = self._waiter = self._loop.create_future()
            if not self._armed:
                self._loop.add_reader(self._fd, self._wake)
                self._armed = True
            try:
                if _events(self._socket) & event:
                    return
                await waiter
            finally:
                self._waiter = None
                if not self._sticky:
                    self._disarm()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        elif self._sticky and not self._socket.closed:
            _events(self._socket)

    def _disarm(self) -> None:
        # Only while armed: once the socket is closed its fd number may belong to
        # another socket, whose reader must not be removed.
        if self._armed:
            self._loop.remove_reader(self._fd)
            self._armed = False

    def close(self) -> None:
        """Disarms, and fails a pending wait with ChannelClosed; call before closing the socket."""
        waiter, self._waiter = self._waiter, None
        self._disarm()
        if waiter is not None and not waiter.done():
            waiter.set_exception(ChannelClosed("channel closed while waiting"))


class Receiver:
    """The bound end of a channel: ``await receive()`` yields messages in order."""

    def __init__(
        self,
        address: str,
        *,
        hwm: int,
        max_message_bytes: int,
        allow_remote: bool,
        context: zmq.Context[Any] | None,
        curve: Keypair | None = None,
    ) -> None:
        bind_address, self._tempdir = _bind_address(split_address(address)[0], allow_remote=allow_remote)
        self._max_message_bytes = max_message_bytes
        self._socket: zmq.Socket[Any] = (context or zmq.Context.instance()).socket(zmq.PULL)
        if curve is not None:
            configure_server(self._socket, curve)
        self.secure = curve is not None
        self._socket.setsockopt(zmq.RCVHWM, hwm)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(bind_address)
        except BaseException:
            self._socket.close()
            self._remove_tempdir()
            raise
        endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.address: str = join_address(endpoint, curve.public) if curve is not None else endpoint
        self._readiness: _Readiness | None = None
        self._pumping: Callable[[], None] | None = None
        self._reading = False
        self._stats = ChannelStatistics(address=self.address)

    async def receive_frames(self) -> list[zmq.Frame]:
        """Waits for the next message and returns its raw frames (no decoding).

        Frames are taken one at a time and their sizes summed: a message over
        ``max_message_bytes``, or over :data:`~transport.wire.MAX_FRAMES_PER_MESSAGE`
        frames, is refused once the sum passes the limit, and its remaining frames
        are received and released one by one. What this saves: the frames of a
        refused message are never held together or decoded, and each one's buffer
        is freed as it is read, instead of all of them staying referenced until the
        decoder has refused the whole. What it cannot save: ZeroMQ delivers a
        multipart message atomically, so before its first frame can be read every
        frame is already queued in libzmq (each at most ``max_message_bytes``, the
        per-frame ZMQ_MAXMSGSIZE libzmq enforces while reading the socket).

        Raises:
            ChannelClosed: the receiver is, or was while waiting, closed.
            RuntimeError: another task is already receiving on this channel.
            transport.wire.MessageTooLarge: the message was over a limit; it was
                dropped and the channel stays usable.
        """
        if self._reading:
            raise RuntimeError(f"two tasks receive on {self.address} at once; give the channel one reader")
        self._reading = True
        try:
            while True:
                if self._socket.closed:
                    raise ChannelClosed(f"receiver {self.address} is closed")
                try:
                    frame = self._socket.recv(zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    pass
                if self._readiness is None:
                    self._readiness = _Readiness(self._socket, sticky=True)
                await self._readiness.wait(zmq.POLLIN)
            frames, nbytes = self._gather(frame)
        finally:
            self._reading = False
        self._stats.messages += 1
        self._stats.bytes += nbytes
        return frames

    def _gather(self, frame: zmq.Frame) -> tuple[list[zmq.Frame], int]:
        """The rest of the message that ``frame`` starts, read frame by frame; returns it and its bytes.

        The rest is queued already (multipart delivery is atomic).

        Raises:
            MessageTooLarge: over ``max_message_bytes`` or ``MAX_FRAMES_PER_MESSAGE``; its
                remaining frames were read and released one by one.
        """
        limit = self._max_message_bytes
        frames, nbytes = [frame], len(frame)
        while frame.more and nbytes <= limit and len(frames) < MAX_FRAMES_PER_MESSAGE:
            frame = self._socket.recv(zmq.NOBLOCK, copy=False)
            nbytes += len(frame)
            frames.append(frame)
        if nbytes <= limit and not frame.more:
            return frames, nbytes
        num_frames = len(frames)
        frames.clear()
        while frame.more:  # drop the rest, one frame at a time
            frame = self._socket.recv(zmq.NOBLOCK, copy=False)
            nbytes += len(frame)
            num_frames += 1
        raise MessageTooLarge(
            f"refused a message of {nbytes} bytes in {num_frames} frames on {self.address}: over "
            f"the limit of {limit} bytes or {MAX_FRAMES_PER_MESSAGE} frames"
        )

    def pump(self, on_frames: Callable[[list[zmq.Frame]], None], *, batch: int = 64) -> None:
        """Delivers every message to ``on_frames`` from the loop's reader callback.

        For a consumer that never waits (it dispatches and returns): no task wakes per
        message, which saves a loop iteration on every hop of a request/reply. At most
        ``batch`` messages are read per callback before yielding to the loop.
        ``on_frames`` must not raise; what it does raise is logged and dropped.
        Use either :meth:`pump` or :meth:`receive`, not both.
        """
        loop = asyncio.get_running_loop()

        def ready() -> None:
            # Frame by frame, as in receive_frames: a message over the limit is dropped
            # frame by frame and never reaches on_frames. A batch also ends once it has
            # run 5 ms (after one message at least): a flood of costly messages must not
            # keep the loop from its other callbacks, among them the answers to the
            # small messages ZeroMQ fair-queues in between (heartbeats, pings).
            deadline = loop.time() + 0.005
            for _ in range(batch):
                if self._socket.closed:
                    return
                try:
                    frame = self._socket.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return  # drained: the fd fires again on the next message
                try:
                    frames, nbytes = self._gather(frame)
                except MessageTooLarge as exc:
                    log.warning("%s", exc)
                    continue
                self._stats.messages += 1
                self._stats.bytes += nbytes
                try:
                    on_frames(frames)
                except Exception:
                    log.exception("message handler raised")
                if loop.time() > deadline:
                    break
            loop.call_soon(ready)  # more may be waiting: come back after others had a turn

        self._pumping = ready
        loop.add_reader(self._socket.getsockopt(zmq.FD), ready)  # type: ignore[arg-type]
        loop.call_soon(ready)  # messages that came before the reader

    async def receive(self) -> Any:
        """Waits for the next message and decodes it.

        Raises:
            transport.wire.WireError: the message was malformed (it is dropped; the
                channel stays usable).
            ChannelClosed: the receiver was closed.
        """
        return decode_message(await self.receive_frames(), max_bytes=self._max_message_bytes)

    def statistics(self) -> ChannelStatistics:
        return replace(self._stats)  # a snapshot

    async def aclose(self) -> None:
        """Closes the socket and removes any socket file and folder this end made."""
        if not self._socket.closed:
            if self._readiness is not None:
                self._readiness.close()
            if self._pumping is not None:
                asyncio.get_running_loop().remove_reader(self._socket.getsockopt(zmq.FD))  # type: ignore[arg-type]
                self._pumping = None
            self._socket.close(linger=0)
        self._remove_tempdir()

    def _remove_tempdir(self) -> None:
        if self._tempdir is not None:
            shutil.rmtree(self._tempdir, ignore_errors=True)
            self._tempdir = None

    async def __aenter__(self) -> Receiver:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class Sender:
    """The connecting end of a channel: ``await send(payload)`` in order, with backpressure.

    Sends from several tasks leave in the order they were called: once one send has
    to wait for room, later ones queue behind it instead of overtaking it.
    """

    def __init__(
        self,
        address: str,
        *,
        hwm: int,
        max_message_bytes: int,
        linger_ms: int,
        context: zmq.Context[Any] | None,
        curve: Keypair | None = None,
    ) -> None:
        endpoint, server_public = split_address(address)
        if curve is not None and server_public is None:
            raise ValueError(f"{address[:120]!r} carries no CURVE key (a secure peer's address ends in |<key>); "
                             "is the peer started without keys (--insecure)?")
        self.address = address
        self._max_message_bytes = max_message_bytes
        self._linger_ms = linger_ms
        self._socket: zmq.Socket[Any] = (context or zmq.Context.instance()).socket(zmq.PUSH)
        if curve is not None and server_public is not None:
            configure_client(self._socket, curve, server_public)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        # Queue nothing for a peer that is not connected: an unreachable peer makes
        # send wait (and time out) instead of piling messages up in memory.
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.connect(endpoint)
        self._readiness: _Readiness | None = None
        self._queue: asyncio.Lock | None = None
        self._num_queued = 0
        self._stats = ChannelStatistics(address=address)

    async def send(self, payload: Any, *, codec: str = "none", timeout: float | None = None) -> int:
        """Encodes and sends one message; waits while the high-water mark is reached.

        Args:
            payload: msgpack types and tensors (see :func:`transport.wire.encode_message`).
                A sent tensor must not be modified in place until this returns.
            codec: codec for floating tensors not marked with ``Coded``.
            timeout: seconds to wait for room; None waits for ever.

        Returns:
            The number of bytes sent.

        Raises:
            TimeoutError: no room (or no connected peer) within ``timeout``.
            ChannelClosed: the sender was closed.
            transport.wire.MessageTooLarge, TypeError, CodecError: from encoding.
        """
        frames = encode_message(payload, codec=codec, max_bytes=self._max_message_bytes)
        return await self.send_frames(frames, timeout=timeout)

    async def send_frames(self, frames: list[Any], *, timeout: float | None = None) -> int:
        """Sends already encoded frames (see :meth:`send`)."""
        if self._num_queued == 0 and self._try_send(frames):
            return self._count(frames)
        if self._queue is None:
            self._queue = asyncio.Lock()
            self._readiness = _Readiness(self._socket)
        self._num_queued += 1
        try:
            async with asyncio.timeout(timeout), self._queue:
                assert self._readiness is not None
                while not self._try_send(frames):
                    await self._readiness.wait(zmq.POLLOUT)
        except TimeoutError:
            raise TimeoutError(
                f"no room to send to {self.address} within {timeout}s: the receiver is "
                "slow, gone or not yet bound"
            ) from None
        finally:
            self._num_queued -= 1
        return self._count(frames)

    def send_nowait(self, payload: Any, *, codec: str = "none") -> int:
        """Sends one message now or raises :class:`WouldBlock`; never waits."""
        frames = encode_message(payload, codec=codec, max_bytes=self._max_message_bytes)
        return self.send_frames_nowait(frames)

    def send_frames_nowait(self, frames: list[Any]) -> int:
        """Sends already encoded frames now or raises :class:`WouldBlock` (see :meth:`send_nowait`)."""
        if self._num_queued or not self._try_send(frames):
            raise WouldBlock(f"send queue to {self.address} is full")
        return self._count(frames)

    def _try_send(self, frames: list[Any]) -> bool:
        if self._socket.closed:
            raise ChannelClosed(f"sender to {self.address} is closed")
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK, copy=_zero_copy_pays(frames))
        except zmq.Again:
            return False
        return True

    def _count(self, frames: list[Any]) -> int:
        nbytes = sum(memoryview(f).nbytes for f in frames)
        self._stats.messages += 1
        self._stats.bytes += nbytes
        return nbytes

    def statistics(self) -> ChannelStatistics:
        return replace(self._stats)  # a snapshot

    async def aclose(self) -> None:
        """Closes the socket; messages already queued get up to ``linger_ms`` to leave."""
        if not self._socket.closed:
            if self._readiness is not None:
                self._readiness.close()
            self._socket.close(linger=self._linger_ms)

    async def __aenter__(self) -> Sender:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _events(socket: zmq.Socket[Any]) -> int:
    return int(socket.getsockopt(zmq.EVENTS))  # type: ignore[call-overload]


def _zero_copy_pays(frames: list[Any]) -> bool:
    """Zero-copy frames cost a Frame object and a release callback each; below
    ZeroMQ's own copy threshold copying is cheaper (and libzmq copies them anyway)."""
    return any(memoryview(f).nbytes >= zmq.COPY_THRESHOLD for f in frames)


def _bind_address(address: str, *, allow_remote: bool) -> tuple[str, str | None]:
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
    if not allow_remote and not _is_loopback(host):
        raise ValueError(
            f"refusing to bind {address!r}: it is not a loopback address; pass "
            "allow_remote=True (with CURVE keys, the default for a cluster) to listen beyond this machine"
        )
    if port == "0":
        port = "*"
    return f"tcp://{host}:{port}", None


def is_local_address(address: str) -> bool:
    """Whether a runtime's ``address`` (with or without its key part) is reachable only
    from this machine: ``ipc://`` or TCP on a loopback address."""
    endpoint = address.partition("|")[0]
    scheme, _, rest = endpoint.partition("://")
    return scheme == "ipc" or (scheme == "tcp" and _is_loopback(rest.rpartition(":")[0]))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
