"""Actor messages to a runtime on this host over a stream the event loop drives.

A message between two runtimes over ZeroMQ crosses four threads: the sender's loop,
libzmq's I/O thread on each side, and the receiver's loop; each hand-off is a wake-up
that waits for a core on a busy machine. A step's control path (driver, job actor,
stages and back) is a chain of such messages. Between two secure runtimes on one host
(``ipc://`` addresses), a runtime's sender moves its messages onto a
:class:`~transport.stream.StreamLink` instead: one Unix socket the loops read and
write themselves, every message sealed with AES-GCM under a session key (see
``docs/security.md``, "Actor messages on this host").

How a sender switches, without a round trip and without reordering anything:

1. It connects to the peer's stream server, at a path derived from the peer's address
   (:func:`stream_address_of`); no server there (another kind of runtime, or a path too
   long), and it stays on ZeroMQ.
2. It draws a session key and sends its opening over ZeroMQ (CURVE, or the sealed bulk
   socket: only the peer reads the key, and the peer's gate names the sender), as the
   last message it sends there; every later one goes on the stream.
3. The peer takes the opening after every earlier ZeroMQ message of the sender (a
   socket keeps its order), and only then the stream's messages: a stream whose first
   message names a session not opened yet waits for its opening (``wait_for_open_s``).

A stream that breaks (the peer went, or dropped the session) sends the sender back to
ZeroMQ for good; a message it held may be lost then, as one queued to a process that
died is.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from transport.addresses import Address
from transport.channel import ChannelClosed, Sender, WouldBlock
from transport.sealed import SealRefused, SessionKey
from transport.security import split_address
from transport.stream import UNIX_PATH_MAX, StreamBroken, StreamLink, StreamServer
from transport.wire import MAX_FRAMES_PER_MESSAGE, encode_message, excerpt

__all__ = ["OPEN_KIND", "OPENING_WAIT_S", "RuntimeStreams", "StreamingSender", "stream_address_of"]

log = logging.getLogger(__name__)

OPEN_KIND = "stream"  # the wire message that opens a sender's session: {"t": OPEN_KIND, "o": OPENING}
STREAM_SUFFIX = ".stream"
# A stream whose first message came before its session's opening (over ZeroMQ) waits this long
# for it: the opening is behind whatever the sender queued there before.
OPENING_WAIT_S = 30.0
# What a link to one peer queues before a send waits (a stage stream queues up to 64 MiB of values;
# a runtime talks to many peers, each of which may stop reading).
QUEUED_MAX_BYTES = 4 << 20

SpawnTask = Callable[..., "asyncio.Task[Any]"]


def stream_address_of(address: str) -> str | None:
    """Where the runtime at ``address`` takes streamed messages: a Unix socket beside its
    ``ipc://`` one; None for a ``tcp://`` runtime, or where that path would be too long."""
    try:
        endpoint = split_address(address)[0]
    except ValueError:
        return None
    where = Address.parse(endpoint)
    if not where.is_ipc or not where.path:
        return None
    path = where.path + STREAM_SUFFIX
    return f"ipc://{path}" if len(os.fsencode(path)) <= UNIX_PATH_MAX else None


class StreamingSender:
    """A :class:`~transport.channel.Sender` to a runtime on this host that moves onto a stream
    once it can (see the module docstring); the runtime's sender pool uses it as a sender."""

    def __init__(self, inner: Sender, stream_address: str, *, spawn_task: SpawnTask) -> None:
        self.inner = inner
        self.address = inner.address
        self._link: StreamLink | None = None
        self._closed = False
        self._opening: asyncio.Task[None] | None = spawn_task(self._open(stream_address),
                                                              name=f"stream to {stream_address}")

    @property
    def streaming(self) -> bool:
        """Whether its messages go on the stream now."""
        return self._link is not None

    async def _open(self, stream_address: str) -> None:
        key = SessionKey.new(encrypt=True)
        try:
            link = await StreamLink.connect(stream_address, key, queued_max_bytes=QUEUED_MAX_BYTES)
        except (StreamBroken, ValueError) as exc:
            log.debug("no stream to %s, ZeroMQ it is: %s", stream_address, exc)
            return
        if self._closed:
            link.close()
            return
        # From here on every message goes on the stream, the opening last over ZeroMQ: a message
        # that waits in the ZeroMQ sender's queue is ahead of it there.
        self._link = link
        try:
            await self.inner.send_frames(encode_message({"t": OPEN_KIND, "o": key.open_message()}))
        except ChannelClosed:
            pass  # closing: the stream's messages wait for an opening that will not come, then go
        finally:
            self._opening = None

    def _broken(self, exc: StreamBroken) -> None:
        log.warning("the stream to %s broke (%s); its messages go over ZeroMQ from now on", self.address, exc)
        if self._link is not None:
            self._link.close()
            self._link = None

    def send_frames_nowait(self, frames: list[Any]) -> int:
        """Sends encoded frames now or raises :class:`~transport.channel.WouldBlock`."""
        link = self._link
        if link is not None:
            try:
                sent = link.try_send(frames)
            except StreamBroken as exc:
                self._broken(exc)
            else:
                if sent is None:
                    raise WouldBlock(f"the stream to {self.address} has too much queued")
                return sent
        return self.inner.send_frames_nowait(frames)

    async def send_frames(self, frames: list[Any]) -> int:
        """Sends encoded frames, waiting for room."""
        link = self._link
        if link is not None:
            try:
                return await link.send(frames)
            except StreamBroken as exc:
                if self._link is link:
                    self._broken(exc)
        return await self.inner.send_frames(frames)

    async def aclose(self) -> None:
        """Closes the stream (what it queued is still written) and the ZeroMQ sender."""
        self._closed = True
        if self._opening is not None:
            self._opening.cancel()
            await asyncio.gather(self._opening, return_exceptions=True)
        if self._link is not None:
            self._link.close()
            self._link = None
        await self.inner.aclose()


class RuntimeStreams:
    """A runtime's side of the streams: its stream server (which hands each message's opened frames
    to ``on_frames``, as the runtime's ZeroMQ receiver hands its frames), the openings it takes, and
    the senders it makes.

    Args:
        address: the runtime's own address; with ``enabled`` false (an insecure runtime, or
            one whose messages are not all encrypted) it neither streams nor takes streams.
    """

    def __init__(self, address: str, on_frames: Callable[[Any], None], *, max_bytes: int, enabled: bool,
                 spawn_task: SpawnTask) -> None:
        self.enabled = enabled
        self._address = address
        self._spawn_task = spawn_task
        self._server = StreamServer(on_frames, decode=False, max_bytes=max_bytes, max_frames=MAX_FRAMES_PER_MESSAGE,
                                    max_sessions=1024, sessions_per_sender=256, wait_for_open_s=OPENING_WAIT_S)
        self.listening = False

    @property
    def rounds(self) -> int:
        """The stream server's reads so far (see :attr:`transport.stream.StreamServer.rounds`)."""
        return self._server.rounds

    async def start(self) -> None:
        """Listens beside the runtime's ``ipc://`` socket, where it streams and the path fits."""
        bind = stream_address_of(self._address) if self.enabled else None
        if bind is None:
            return
        try:
            await self._server.start(self._address, exactly=bind)
        except OSError as exc:
            log.warning("the runtime at %s takes no streams (%s): its peers use ZeroMQ", self._address, exc)
            self._server.close()
            return
        self.listening = True

    def sender(self, inner: Sender) -> Sender | StreamingSender:
        """``inner`` (a ZeroMQ sender to a peer), or a sender that moves onto a stream to that peer."""
        stream = stream_address_of(inner.address) if self.enabled else None
        return StreamingSender(inner, stream, spawn_task=self._spawn_task) if stream is not None else inner

    def open(self, opening: Any, caller: str) -> None:
        """Opens the session a sender named ``caller`` (its key's name here, from its ZeroMQ message)
        handed over; its streamed messages carry that name. A bad opening, or one this runtime does
        not take, is logged and dropped."""
        if not self.listening:
            log.warning("dropped a stream opening from %s: this runtime takes no streams", excerpt(caller))
            return
        try:
            self._server.open(opening, caller)
        except (SealRefused, TypeError, ValueError) as exc:
            log.warning("refused a stream opening from %s: %s", excerpt(caller), excerpt(str(exc), 200))

    def close(self) -> None:
        self._server.close()
        self.listening = False
