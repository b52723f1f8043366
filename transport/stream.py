"""A link the event loop drives itself: sealed messages over a Unix or TCP stream.

An actor message crosses two more threads than the bytes need: libzmq's I/O thread on
the way out and the receiver's on the way in, each a wake-up that waits for a core on a
busy machine (``benchmarks.hop``: 134 us a round trip against 37 for a socket each loop
reads and writes itself; docs/benchmarks.md). A pipeline step crosses each stage
boundary twice per micro-batch, on its critical path in the fill and the drain, so the
stages can send their boundary values over a :class:`StreamLink` instead
(``communication.transport = "stream"``).

Security is the bulk socket's (``transport.sealed``), with the stream's order:

1. The sender draws a :class:`~transport.sealed.SessionKey` and hands its opening to
   the receiver in an actor call (over CURVE on a secure cluster: only the receiver
   reads the key; the receiver's gate and the caller's role decide whether it is taken).
   The receiver answers with its :class:`StreamServer`'s address.
2. The sender connects and writes messages, each ``[u32 count][u32 size] * count`` (little
   endian) followed by the ``count`` frames: :meth:`SessionKey.seal`'s frames of the wire
   message, the head (session id, sequence number, frame count) at the start of the first.
3. The receiver refuses a count above :data:`MAX_FRAMES` or sizes over its limit before it
   allocates anything; takes a frame for the first only from a session it opened and not
   yet bound to another connection, numbered one past the last it took; opens every frame
   (a bad tag refuses); and decodes the message with the wire's checks
   (:func:`~transport.wire.decode_message`: nothing is unpickled).

A refusal closes that connection and nothing is ever written back, so a peer without the
session's key learns nothing. The sender sees a closed connection as
:class:`StreamBroken` on its next send (the step that sends fails with it); a link is not
repaired in place: the stage opens a fresh session when it is connected again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import struct
import tempfile
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from transport.addresses import Address, url_host
from transport.sealed import HEAD_BYTES, TAG_BYTES, SealRefused, SessionKey, aligned_buffer, byte_view, parse_head
from transport.wire import DEFAULT_MAX_MESSAGE_BYTES, WireError, decode_message, worth_logging

__all__ = ["MAX_FRAMES", "MAX_PARKED", "MAX_SESSIONS", "QUEUED_MAX_BYTES", "StreamBroken", "StreamLink", "StreamServer",
           "UNIX_PATH_MAX", "UnknownSession", "stream_bind_address"]

log = logging.getLogger(__name__)

MAX_FRAMES = 4096  # frames of one message (a boundary value has a few per tensor)
MAX_SESSIONS = 64  # sessions a server keeps; the oldest goes first
MAX_PARKED = 64  # new connections waiting at once for their session's opening
_MAX_BACKLOG_BYTES = 1 << 20  # what a waiting connection may send before it is refused
QUEUED_MAX_BYTES = 64 << 20  # sealed bytes a link queues before a send waits for the kernel to take them
_COUNT = struct.Struct("<I")
_WHOLE_MAX_FRAMES = 64  # a message of more frames is read piece by piece
# An encrypted message this large is sealed on a worker thread while the loop writes (see StreamLink).
SEAL_AWAY_BYTES = 1 << 20
# What a link asks of the kernel for a Unix socket's send buffer (it grants at most
# net.core.wmem_max, 208 KiB on many machines, 4 MiB on others): there the sender's buffer is all
# a message may have on its way, and at 208 KiB a 16 MiB message crossed it in 80 hand-offs
# (one stream at 16 MiB: 1.7 GB/s, against 3.3-3.4 with 4 MiB).
SEND_BUFFER_BYTES = 4 << 20


@functools.lru_cache(maxsize=_WHOLE_MAX_FRAMES)
def _sizes_struct(count: int) -> struct.Struct:
    """The frame sizes of a message of ``count`` frames (little-endian u32s)."""
    return struct.Struct(f"<{count}I")


@functools.lru_cache(maxsize=_WHOLE_MAX_FRAMES)
def _prefix_struct(count: int) -> struct.Struct:
    """A message's prefix: its frame count, then each frame's size."""
    return struct.Struct(f"<I{count}I")
_SCRATCH_BYTES = 1 << 16  # what the loop reads into at once while frames are small
_DIRECT_BYTES = 1 << 15  # a frame with this much left to come is read straight into its buffer
UNIX_PATH_MAX = 107  # bytes of a Unix socket's path on Linux (sun_path)


class StreamBroken(ConnectionError):
    """A stream link's connection closed or could not be opened; the link is done."""


def stream_bind_address(runtime_endpoint: str) -> tuple[str, str | None]:
    """Where a stream server beside a runtime bound at ``runtime_endpoint`` listens, and any
    folder made for it: a Unix socket in the same folder for ``ipc://`` (in a fresh private
    folder where that path would be too long), the same host on any port for ``tcp://``."""
    where = Address.parse(runtime_endpoint)
    if where.is_ipc:
        path = os.path.join(os.path.dirname(where.path), f"stream-{os.urandom(4).hex()}")
        if len(os.fsencode(path)) <= UNIX_PATH_MAX:
            return f"ipc://{path}", None
        folder = tempfile.mkdtemp(prefix="ap-")
        return f"ipc://{os.path.join(folder, 's')}", folder
    return where.on_port(0), None


class _Session:
    __slots__ = ("key", "sender", "last", "bound")

    def __init__(self, key: SessionKey, sender: str) -> None:
        self.key = key
        self.sender = sender
        self.last = 0  # the last sequence number taken
        self.bound: _Inbound | None = None  # the connection its messages come on, once one has proven it


class UnknownSession(SealRefused):
    """A message of a session the server has not opened (or no longer keeps)."""


class StreamServer:
    """Takes sealed messages from the sessions it opened and hands each on, decoded.

    Args:
        on_message: called with each message's payload, in each session's order; what it
            raises is logged and counted, the connection goes on. With ``decode=False``, called
            with the message's opened frames instead (:class:`~transport.sealed.OpenedFrame`,
            whose ``get("User-Id")`` names the session's sender), for the caller to decode.
        max_bytes: the largest message taken (as the runtime's limit for actor messages).
        on_refused: told why, each time a connection is refused or a message fails.
        on_lost: told a session's sender and why, each time the connection carrying the session
            ends where a message of it may have been lost on the way: a message of it refused, a
            connection that broke (an error, not a close), or one that ended in the middle of a
            message. Not told when the sender closed at a message's end (all it wrote came), nor
            when this side closed the connection (:meth:`close`, a session replaced by its sender's
            next one).
        max_frames: the most frames one message may have.
        max_sessions: sessions kept at once (the oldest goes first), and
            ``sessions_per_sender`` of them per sender (its oldest goes first).
        wait_for_open_s: how long a new connection whose first message names a session not
            opened yet waits for its opening (which may travel a slower path than the stream,
            see ``actors._streams``); 0 refuses it at once. At most :data:`MAX_PARKED` wait.
    """

    def __init__(self, on_message: Callable[[Any], None], *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 on_refused: Callable[[str], None] | None = None, on_lost: Callable[[str, str], None] | None = None,
                 decode: bool = True,
                 max_frames: int = MAX_FRAMES, max_sessions: int = MAX_SESSIONS, sessions_per_sender: int = 1,
                 wait_for_open_s: float = 0.0) -> None:
        self.on_message = on_message
        self.max_bytes = max_bytes
        self.on_refused = on_refused
        self.on_lost = on_lost
        self.decode = decode
        self.max_frames = max_frames
        self.max_sessions = max_sessions
        self.sessions_per_sender = sessions_per_sender
        self.wait_for_open_s = wait_for_open_s
        self.address: str | None = None
        self.rounds = 0  # reads so far: the messages one read hands on came together
        self.refusals = 0  # connections refused so far
        self._server: asyncio.AbstractServer | None = None
        self._path: str | None = None
        self._folder: str | None = None  # made for the socket file (see stream_bind_address)
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()
        self._connections: set[_Inbound] = set()
        self._parked: dict[bytes, tuple[_Inbound, asyncio.TimerHandle]] = {}  # waiting for their session's opening

    async def start(self, runtime_endpoint: str, *, exactly: str | None = None) -> str:
        """Listens beside the runtime bound at ``runtime_endpoint`` (see :func:`stream_bind_address`),
        or at ``exactly``; returns the address senders connect to."""
        if self.address is not None:
            return self.address
        loop = asyncio.get_running_loop()
        bind, self._folder = (exactly, None) if exactly is not None else stream_bind_address(runtime_endpoint)
        where = Address.parse(bind)
        if where.is_ipc:
            self._server = await loop.create_unix_server(lambda: _Inbound(self), where.path)
            self._path = where.path
            self.address = bind
        else:
            self._server = await loop.create_server(lambda: _Inbound(self), where.bare_host, 0)
            self.address = f"tcp://{url_host(where.bare_host)}:{self._server.sockets[0].getsockname()[1]}"
        return self.address

    def open(self, opening: Any, sender: str) -> None:
        """Opens the session whose opening (:meth:`SessionKey.open_message`) ``sender`` handed over;
        one session per sender: its earlier one, and that one's connection, go.

        Raises:
            SealRefused: not an opening this side speaks.
        """
        key = SessionKey.from_open_message(opening)
        if key.session_id in self._sessions:
            self._drop(key.session_id)
        own = [session_id for session_id, session in self._sessions.items() if session.sender == sender]
        for session_id in own[:max(0, len(own) - self.sessions_per_sender + 1)]:
            self._drop(session_id)
        while len(self._sessions) >= self.max_sessions:
            self._drop(next(iter(self._sessions)))
        self._sessions[key.session_id] = _Session(key, sender)
        parked = self._parked.pop(key.session_id, None)
        if parked is not None:
            parked[1].cancel()
            parked[0].resume()

    def park(self, connection: _Inbound, session_id: bytes) -> bool:
        """Whether ``connection``, whose first message names ``session_id`` (not opened yet), may wait
        for its opening; if so it waits, at most ``wait_for_open_s``."""
        if self.wait_for_open_s <= 0 or session_id in self._parked or len(self._parked) >= MAX_PARKED:
            return False
        timer = asyncio.get_running_loop().call_later(self.wait_for_open_s, self._unpark, session_id)
        self._parked[session_id] = (connection, timer)
        return True

    def _unpark(self, session_id: bytes, *, gone: bool = False) -> None:
        """A waiting connection's time is up (it is refused), or it went (``gone``)."""
        parked = self._parked.pop(session_id, None)
        if parked is not None:
            parked[1].cancel()
            if not gone:
                parked[0].refuse(f"no session was opened for its first message within {self.wait_for_open_s:g}s")

    def _drop(self, session_id: bytes) -> None:
        session = self._sessions.pop(session_id)
        if session.bound is not None:
            session.bound.close()

    def claim(self, connection: _Inbound, session_id: bytes, seq: int) -> _Session:
        """The session a message's head names, if ``connection`` may carry it with number ``seq``.

        Raises:
            SealRefused: an unknown session, one bound to another connection, or a number
                other than one past the last taken.
        """
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSession("a message of no session this stream server opened")
        if session.bound is not None and session.bound is not connection:
            raise SealRefused("a message of a session another connection carries")
        if seq != session.last + 1:
            raise SealRefused(f"message {seq} where {session.last + 1} was next")
        return session

    def refused(self, reason: str) -> None:
        self.refusals += 1
        if worth_logging(self.refusals):
            log.warning("stream server at %s refused a connection (%d so far): %s", self.address, self.refusals,
                        reason)
        if self.on_refused is not None:
            self.on_refused(reason)

    def close(self) -> None:
        """Stops listening, closes every connection, and removes the socket file."""
        for connection in list(self._connections):
            connection.close()
        for _, timer in self._parked.values():
            timer.cancel()
        self._parked.clear()
        self._sessions.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            self._path = None
        if self._folder is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self._folder)
            self._folder = None
        self.address = None


class _Inbound(asyncio.BufferedProtocol):
    """One connection to a :class:`StreamServer`: reads each message's sizes, then its frames,
    large ones straight into their buffers."""

    def __init__(self, server: StreamServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        self._prefix = bytearray()
        self._sizes: tuple[int, ...] | None = None
        self._frames: list[memoryview] = []
        self._filled = 0  # bytes of the frame being read
        self._direct = False  # the last buffer handed out was a frame's own
        self._session: _Session | None = None  # the session of the message being read
        self._head = (b"", 0)
        self._closed = False
        self._bound: bytes | None = None  # the id of the session it carries, once proven
        self._backlog: bytearray | None = None  # while it waits for its session's opening: what came meanwhile
        self._refused: str | None = None  # why this side refused what came (then closed the connection)

    # -- asyncio ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport's subclasses
        self._server._connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        closed_here = self._closed
        self._closed = True
        self._server._connections.discard(self)
        session = self._server._sessions.get(self._bound) if self._bound is not None else None
        if session is not None and session.bound is self:
            self._server._drop(session.key.session_id)  # a link is not repaired in place: its session goes too
            why = self._lost(exc, closed_here)
            if why is not None and self._server.on_lost is not None:
                self._server.on_lost(session.sender, why)
        if self._backlog is not None:
            self._server._unpark(self._head[0], gone=True)

    def _lost(self, exc: Exception | None, closed_here: bool) -> str | None:
        """Why a message of the session this connection carried may have been lost, or None (see
        ``StreamServer``'s ``on_lost``)."""
        if self._refused is not None:
            return f"a message was refused ({self._refused})"
        if closed_here:
            return None
        if exc is not None:
            return f"its connection broke ({exc!r:.120})"
        if self._sizes is not None or self._prefix:
            return "its connection ended in the middle of a message"
        return None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._sizes is not None and self._frames:
            frame = self._frames[-1]
            if frame.nbytes - self._filled >= _DIRECT_BYTES:
                self._direct = True
                return frame[self._filled:]
        self._direct = False
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._closed:
            return
        self._server.rounds += 1
        if self._backlog is not None:  # waiting for the session's opening: keep what comes, within bounds
            self._backlog += self._scratch[:nbytes]
            if len(self._backlog) > _MAX_BACKLOG_BYTES:
                self.refuse(f"over {_MAX_BACKLOG_BYTES} bytes came before its session was opened")
            return
        try:
            if self._direct:
                self._filled += nbytes
                self._frame_filled()
            else:
                self._consume(self._scratch[:nbytes])
        except (SealRefused, WireError) as exc:
            self.refuse(str(exc))

    def close(self) -> None:
        if not self._closed and self._transport is not None:
            self._closed = True
            self._transport.abort()

    def resume(self) -> None:
        """The session its first message named was opened: reads on from there."""
        backlog, self._backlog = self._backlog, None
        if backlog is None or self._closed or self._transport is None:
            return
        try:
            self._frame_filled()
            self._consume(memoryview(backlog))
        except (SealRefused, WireError) as exc:
            self.refuse(str(exc))
            return
        self._transport.resume_reading()

    # -- reading a message ------------------------------------------------------------

    def _consume(self, data: memoryview) -> None:
        at, end = 0, data.nbytes
        while at < end and not self._closed:
            if self._sizes is None:
                whole = self._take_whole(data, at, end) if not self._prefix else None
                at = whole if whole is not None else self._read_prefix(data, at)
            else:
                frame = self._frames[-1]
                take = min(frame.nbytes - self._filled, end - at)
                frame[self._filled:self._filled + take] = data[at:at + take]
                self._filled += take
                at += take
                self._frame_filled()
            if self._backlog is not None:  # parked at its first message: the rest waits with it
                self._backlog += data[at:]
                return

    def _take_whole(self, data: memoryview, at: int, end: int) -> int | None:
        """Takes the message at ``data[at:]`` in one go where all of it is there and its session is
        open (most small messages): where the next one starts; None to read it piece by piece (a
        message cut by the read, or one to refuse or to wait for, which that path does)."""
        if end - at < _COUNT.size:
            return None
        count = _COUNT.unpack_from(data, at)[0]
        start = at + _COUNT.size * (1 + count)
        if not 1 <= count <= _WHOLE_MAX_FRAMES or start > end:
            return None
        sizes = _sizes_struct(count).unpack_from(data, at + _COUNT.size)
        stop = start + sum(sizes)
        if stop > end or sizes[0] < HEAD_BYTES or stop - start > self._server.max_bytes:
            return None
        head, session_id, seq, _ = parse_head(data[start:start + sizes[0]])
        try:
            session = self._server.claim(self, session_id, seq)
        except SealRefused:
            return None
        frames = []
        for size in sizes:
            # Opened, an encrypted frame is a copy of its own; a frame only tagged is itself, so
            # it leaves the read buffer, which the next read fills.
            frame = data[start:start + size]
            frames.append(frame if session.key.encrypt else memoryview(bytearray(frame)))
            start += size
        self._session, self._head = session, (head, seq)
        self._take(frames)
        return stop

    def _read_prefix(self, data: memoryview, at: int) -> int:
        prefix = self._prefix
        need = _COUNT.size if len(prefix) < _COUNT.size else _COUNT.size * (1 + _COUNT.unpack_from(prefix)[0])
        take = min(need - len(prefix), data.nbytes - at)
        prefix += data[at:at + take]
        at += take
        if len(prefix) == _COUNT.size:
            count = _COUNT.unpack_from(prefix)[0]
            if not 1 <= count <= self._server.max_frames:
                raise SealRefused(f"a message of {count} frames (1 to {self._server.max_frames} are taken)")
        elif len(prefix) == need:
            sizes = struct.unpack_from(f"<{len(prefix) // 4 - 1}I", prefix, _COUNT.size)
            limit = self._server.max_bytes + HEAD_BYTES + TAG_BYTES * (len(sizes) + 1)
            if sum(sizes) > limit or sizes[0] < HEAD_BYTES:
                raise SealRefused(f"a message of {sum(sizes)} bytes in {len(sizes)} frames, over the limit of "
                                  f"{limit} or with no head")
            self._sizes = sizes
            self._prefix = bytearray()
            self._next_frame()
            self._frame_filled()
        return at

    def _next_frame(self) -> None:
        """Allocates the next frame's buffer: only once the ones before it are in and the first
        is checked (see :meth:`_frame_filled`)."""
        assert self._sizes is not None
        size = self._sizes[len(self._frames)]
        self._frames.append(aligned_buffer(size) if size >= _DIRECT_BYTES else memoryview(bytearray(size)))
        self._filled = 0

    def _frame_filled(self) -> None:
        """Moves on from each frame that is in: checks the first's head, allocates the next, and
        takes the message once its last is in."""
        sizes = self._sizes
        assert sizes is not None
        while self._filled == self._frames[-1].nbytes:
            if len(self._frames) == 1:  # the first: its head says whether the rest is worth reading
                head, session_id, seq, _ = parse_head(self._frames[0])
                try:
                    self._session = self._server.claim(self, session_id, seq)
                except UnknownSession:
                    if self._bound is not None or not self._server.park(self, session_id):
                        raise
                    self._head = (session_id, seq)  # (what _unpark is told, should the connection go)
                    self._backlog = bytearray()
                    if self._transport is not None:
                        self._transport.pause_reading()
                    return
                self._head = (head, seq)
            if len(self._frames) == len(sizes):
                frames, self._frames, self._sizes = self._frames, [], None
                self._take(frames)
                return
            self._next_frame()

    def _take(self, frames: list[memoryview]) -> None:
        session, (head, seq) = self._session, self._head
        assert session is not None
        self._session = None
        opened = session.key.unseal(head, seq, [frames[0][HEAD_BYTES:], *frames[1:]], session.sender)
        session.bound = self  # the key proved it: this connection carries the session from now on
        session.last = seq
        self._bound = session.key.session_id
        payload = decode_message(opened, max_bytes=self._server.max_bytes) if self._server.decode else opened
        try:
            self._server.on_message(payload)
        except Exception as exc:  # the receiver's own refusal of a value: counted there, the link goes on
            log.debug("stream server at %s: a message was not taken: %s", self._server.address, exc)

    def refuse(self, reason: str) -> None:
        self._refused = reason
        self._server.refused(reason)
        self.close()


class _Outbound(asyncio.Protocol):
    """The sending end's protocol: notices a closed connection and a full socket."""

    def __init__(self) -> None:
        self.broken: str | None = None
        self.drained: asyncio.Future[None] | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.broken is None:  # else the link closed it, and said why
            self.broken = f"the connection closed ({exc})" if exc is not None else "the receiver closed the connection"
        self._wake()

    def data_received(self, data: bytes) -> None:
        pass  # a stream server never writes: whatever comes is not ours to read

    def pause_writing(self) -> None:
        if self.drained is None:
            self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        self._wake()

    def _wake(self) -> None:
        drained, self.drained = self.drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)


class StreamLink:
    """One sender's link to one :class:`StreamServer`: sends messages sealed under ``key``.

    Made by :meth:`connect` once the receiver opened the session (step 1 of the module's
    protocol). Encrypted, what is written is the sealed copy, so :meth:`send` returns as
    soon as it is queued (the loop writes the rest while the stage computes, as libzmq's
    I/O thread would) unless ``queued_max_bytes`` (:data:`QUEUED_MAX_BYTES`) wait already;
    authenticated only, the frames are the caller's own buffers, and it returns once the
    kernel holds every byte, so the caller may reuse them.

    Sealed on the loop, a large message left the socket dry for the whole of its
    encryption (1.3 ms a 16 MiB message), and the receiver with it, wherever the socket's
    send buffer holds less than that time's worth. So on such a socket an encrypted
    message of :data:`SEAL_AWAY_BYTES` or more is sealed on a worker thread (AES-GCM lets
    go of the GIL) while the loop goes on writing what was queued before it (see
    :func:`_seal_away_bytes`). Messages still leave in the order they were sent: one sent
    meanwhile waits behind it, sealed.
    """

    def __init__(self, key: SessionKey, transport: asyncio.Transport, protocol: _Outbound, address: str, *,
                 queued_max_bytes: int = QUEUED_MAX_BYTES) -> None:
        self.key = key
        self.address = address
        self._transport = transport
        self._protocol = protocol
        self._seq = 0
        # Messages numbered but not yet written, in order: [sealed frames or None while a worker
        # seals them, the future their sender awaits]. Empty, a message is written as it is sealed.
        self._outbox: deque[list[Any]] = deque()
        # pause_writing (see _Outbound) comes once more than this waits in the transport
        transport.set_write_buffer_limits(high=queued_max_bytes if key.encrypt else 0)
        away = _seal_away_bytes(transport.get_extra_info("socket"))  # sizes the send buffer either way
        self._seal_away_bytes = away if key.encrypt else None  # only an encrypted message is sealed away
        self._away_key: SessionKey | None = None  # the key's twin the worker seals with

    @classmethod
    async def connect(cls, address: str, key: SessionKey, *, queued_max_bytes: int = QUEUED_MAX_BYTES
                      ) -> StreamLink:
        """Connects to the stream server at ``address`` (``queued_max_bytes``: see the class).

        Raises:
            StreamBroken: it cannot be reached.
            ValueError: not an ``ipc://`` or ``tcp://`` address.
        """
        loop = asyncio.get_running_loop()
        where = Address.parse(address)
        try:
            if where.is_ipc:
                transport, protocol = await loop.create_unix_connection(_Outbound, where.path)
            elif where.is_tcp and where.port_number is not None:
                transport, protocol = await loop.create_connection(_Outbound, where.bare_host, where.port_number)
                transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                raise ValueError(f"a stream address is ipc://PATH or tcp://HOST:PORT, not {address[:80]!r}")
        except OSError as exc:
            raise StreamBroken(f"cannot reach the stream server at {address}: {exc}") from None
        return cls(key, transport, protocol, address, queued_max_bytes=queued_max_bytes)

    async def send(self, frames: list[Any]) -> int:
        """Sends one wire message (:func:`~transport.wire.encode_message`'s frames); returns the bytes
        put on the wire.

        Raises:
            StreamBroken: the connection is closed (the receiver refused a message, or is gone).
        """
        protocol = self._protocol
        away = self._seal_away_bytes
        if away is not None and sum(byte_view(frame).nbytes for frame in frames) >= away:
            while protocol.drained is not None:  # room first, as try_send
                self._check_open()
                await asyncio.shield(protocol.drained)
            sent = await asyncio.shield(self._seal_away(frames))
        else:
            while (queued := self.try_send(frames)) is None:
                await asyncio.shield(protocol.drained)  # type: ignore[arg-type]  # try_send saw it set
            sent = queued
        while protocol.drained is not None and protocol.broken is None:
            await asyncio.shield(protocol.drained)
        if protocol.broken is not None:
            raise StreamBroken(f"the stream link to {self.address} closed while sending: {protocol.broken}")
        return sent

    def try_send(self, frames: list[Any]) -> int | None:
        """Puts one message on the link now, unless what waits to be written is over the link's
        limit: the bytes it puts on the wire, or None having sent nothing (:meth:`send` waits).
        Authenticated only, the frames are written as they are: a caller that may change them
        before the kernel took them (see :meth:`send`) passes copies.

        Raises:
            StreamBroken: the connection is closed.
        """
        self._check_open()
        if self._protocol.drained is not None:
            return None
        self._seq += 1
        sealed = self.key.seal(self._seq, frames)  # bytes, and flat byte views: len() is their size
        if self._outbox:  # behind a message a worker still seals
            self._outbox.append([sealed, None])
            return _wire_size(sealed)
        return self._write(sealed)

    def _seal_away(self, frames: list[Any]) -> asyncio.Future[int]:
        """Numbers the message now, seals it on the worker thread, and writes it once the ones
        before it are written; the future is its bytes on the wire."""
        self._check_open()
        loop = asyncio.get_running_loop()
        self._seq += 1
        entry: list[Any] = [None, loop.create_future()]
        self._outbox.append(entry)
        if self._away_key is None:
            self._away_key = self.key.twin()
        sealing = loop.run_in_executor(_sealer(), self._away_key.seal, self._seq, frames)

        def sealed(done: asyncio.Future[list[Any]]) -> None:
            if done.cancelled() or done.exception() is not None:
                why = "cancelled" if done.cancelled() else repr(done.exception())
                self._protocol.broken = self._protocol.broken or f"sealing a message failed: {why}"
                self._fail(self._protocol.broken)
                return
            entry[0] = done.result()
            self._flush()

        sealing.add_done_callback(sealed)
        return entry[1]  # type: ignore[no-any-return]

    def _flush(self) -> None:
        """Writes the sealed messages at the head of the outbox, in order."""
        outbox = self._outbox
        while outbox and outbox[0][0] is not None:
            sealed, waiter = outbox.popleft()
            if self._protocol.broken is not None or self._transport.is_closing():
                self._fail(self._protocol.broken or "closed here")
                return
            sent = self._write(sealed)
            if waiter is not None and not waiter.done():
                waiter.set_result(sent)

    def _fail(self, why: str) -> None:
        """The link cannot go on (a message could not be sealed, or it is closed meanwhile): every
        message still in the outbox fails (the ones before it are written), and the connection
        closes once what it queued has left."""
        error = StreamBroken(f"the stream link to {self.address} is closed: {why}")
        outbox, self._outbox = self._outbox, deque()
        for _, waiter in outbox:
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)
        self._transport.close()

    def _write(self, sealed: list[Any]) -> int:
        sizes = [len(frame) for frame in sealed]
        prefix = (_prefix_struct(len(sizes)).pack(len(sizes), *sizes) if len(sizes) <= _WHOLE_MAX_FRAMES
                  else struct.pack(f"<I{len(sizes)}I", len(sizes), *sizes))
        self._transport.writelines([prefix, *sealed])
        return len(prefix) + sum(sizes)

    def _check_open(self) -> None:
        protocol = self._protocol
        if protocol.broken is not None or self._transport.is_closing():
            raise StreamBroken(f"the stream link to {self.address} is closed: {protocol.broken or 'closed here'}")

    def close(self) -> None:
        """Closes the link once what it queued is written; a message a worker still seals is dropped."""
        self._protocol.broken = self._protocol.broken or "closed here"  # not "the receiver closed" once it has
        if self._outbox:
            self._fail("closed here")
        self._transport.close()


def _seal_away_bytes(sock: socket.socket | None) -> int | None:
    """From what size a link's encrypted messages are sealed on the worker thread; None: none is.

    A Unix socket asks the kernel for a send buffer of :data:`SEND_BUFFER_BYTES`. Where it
    gets one, the buffer carries the receiver through a seal on the loop, which was the
    faster on two busy cores (one link, 16 MiB messages: 3.3-3.4 GB/s against 2.6-3.2
    sealed away; 1 MiB: 2.2-2.7 against 1.8-2.0). Where the kernel keeps it small
    (``net.core.wmem_max``, often 208 KiB), sealing away was far ahead: 2.5-2.8 GB/s
    against 1.7 at 16 MiB, 1.5-1.7 against 1.2 at 1 MiB. A TCP socket keeps the kernel's
    own sizing, which grows its buffer as the link needs (a size set by hand would stop
    that), and seals away.
    """
    if sock is None or sock.family != socket.AF_UNIX:
        return SEAL_AWAY_BYTES
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)  # Linux reports twice what it keeps
    return None if granted >= SEND_BUFFER_BYTES else SEAL_AWAY_BYTES


def _wire_size(sealed: list[Any]) -> int:
    return _COUNT.size * (1 + len(sealed)) + sum(len(frame) for frame in sealed)


_SEALER: tuple[int, ThreadPoolExecutor] | None = None


def _sealer() -> ThreadPoolExecutor:
    """The thread that seals large messages for every link of the process (made on first use, and
    again in a forked child, which has no thread of its parent's)."""
    global _SEALER
    if _SEALER is None or _SEALER[0] != os.getpid():
        _SEALER = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-seal"))
    return _SEALER[1]
