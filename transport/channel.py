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
import enum
import logging
import shutil
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import zmq

from transport._sockets import ChannelClosed, Readiness, gather, measure, reach, readable, send_nowait, writable
from transport.addresses import advertised, bind_address, bulk_bind_address
from transport.sealed import (
    CLAIM_RETRY_S,
    TAG_BYTES,
    UNSENT_POLL_S,
    BulkInbox,
    BulkLink,
    SealRefused,
    is_open_message,
)
from transport.security import (
    Keypair,
    bulk_endpoint,
    configure_client,
    configure_server,
    join_address,
    split_address,
)
from transport.wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_FRAMES_PER_MESSAGE,
    MessageTooLarge,
    decode_message,
    encode_message,
    worth_logging,
)

__all__ = [
    "BulkMode",
    "ChannelClosed",
    "ChannelStatistics",
    "Receiver",
    "Sender",
    "WouldBlock",
    "open_receiver",
    "open_sender",
    "reach",
]

log = logging.getLogger(__name__)

DEFAULT_HWM = 64
BulkMode = Literal["encrypt", "authenticate", "curve"]
DEFAULT_LINGER_MS = 2000


class WouldBlock(RuntimeError):
    """``send_nowait`` found the high-water mark reached (or no peer connected yet)."""


@dataclass(slots=True, kw_only=True)
class ChannelStatistics:
    """Counters of one channel end since it was opened."""

    address: str
    messages: int = 0
    bytes: int = 0
    refused: int = 0  # sealed messages refused (unknown session, bad tag, replayed or reordered)


def open_receiver(
    address: str = "tcp://127.0.0.1:0",
    *,
    hwm: int = DEFAULT_HWM,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    allow_remote: bool = False,
    context: zmq.Context[Any] | None = None,
    curve: Keypair | None = None,
    bulk: bool = True,
) -> Receiver:
    """Binds a receiving channel.

    Args:
        address: ``tcp://HOST:PORT`` (port 0 picks a free one) or ``ipc://PATH``
            (an empty path makes a socket file in a new temporary folder).
        hwm: messages queued in this process before the sender must wait (at least
            2 on a secure channel: libzmq's CURVE delivers nothing at 1).
        max_message_bytes: larger frames are refused by libzmq, larger messages by
            the decoder.
        allow_remote: permit binding an address that is not loopback.
        context: the ZeroMQ context; the process-wide one when None.
        curve: listen as a CURVE server with this keypair (see :mod:`transport.security`;
            the context needs a :class:`~transport.security.Gate`); the address then
            ends in ``|<public key>``.
        bulk: with ``curve``, also bind a socket for sealed messages
            (:mod:`transport.sealed`: CURVE opens a session, AES-GCM carries the
            messages at several times CURVE's speed); the address then ends in
            ``|<public key>|<bulk endpoint>``. Senders that do not seal still use CURVE.

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
        bulk=bulk,
    )


def open_sender(
    address: str,
    *,
    hwm: int = DEFAULT_HWM,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    linger_ms: int = DEFAULT_LINGER_MS,
    context: zmq.Context[Any] | None = None,
    curve: Keypair | None = None,
    bulk: BulkMode = "encrypt",
) -> Sender:
    """Connects a sending channel to a receiver's address (the receiver may come later).

    Args:
        curve: connect as a CURVE client with this keypair; ``address`` must then carry
            the receiver's public key (``...|<hex>``), which the receiver must prove.
        bulk: with ``curve`` and an address that names a bulk endpoint, how messages
            travel: ``"encrypt"`` sealed with AES-GCM (a session opened over CURVE, see
            :mod:`transport.sealed`), ``"authenticate"`` in the clear with a GCM tag (for
            a trusted network only), ``"curve"`` every message through CURVE.

    Raises:
        ValueError: ``curve`` given for an address without a key.
    """
    return Sender(
        address, hwm=hwm, max_message_bytes=max_message_bytes, linger_ms=linger_ms, context=context,
        curve=curve, bulk=bulk,
    )


class _Drained(enum.Enum):
    DRAINED = 0  # what Receiver._next returns when no message waits (an enum: type checkers narrow it)


DRAINED = _Drained.DRAINED


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
        bulk: bool = True,
    ) -> None:
        bind_at, self._tempdir = bind_address(split_address(address)[0], allow_remote=allow_remote)
        self._max_message_bytes = max_message_bytes
        context = context or zmq.Context.instance()
        self._socket: zmq.Socket[Any] = context.socket(zmq.PULL)
        if curve is not None:
            configure_server(self._socket, curve)
        self.secure = curve is not None
        if curve is not None:
            # libzmq 4.3.5 hands nothing on from a CURVE socket whose RCVHWM is 1 (a clear
            # one it does): a secure channel of hwm=1 delivered no message at all.
            hwm = max(hwm, 2)
        self._socket.setsockopt(zmq.RCVHWM, hwm)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            reach(self._socket, bind_at)
            self._socket.bind(bind_at)
        except BaseException:
            self._socket.close()
            self._remove_tempdir()
            raise
        endpoint = advertised(self._socket.getsockopt_string(zmq.LAST_ENDPOINT))
        self._bulk: BulkInbox | None = None
        if curve is not None and bulk:
            try:
                self._bulk = BulkInbox(context, bulk_bind_address(bind_at), hwm=hwm,
                                       max_frame_bytes=max_message_bytes + TAG_BYTES)
            except BaseException:
                self._socket.close()
                self._remove_tempdir()
                raise
        self.address: str = (
            join_address(endpoint, curve.public, self._bulk.endpoint if self._bulk is not None else None)
            if curve is not None else endpoint
        )
        self._sockets = (self._socket,) if self._bulk is None else (self._socket, self._bulk.socket)
        if self._bulk is not None:
            self._bulk.on_overdue = self._overdue
        self._bulk_first = False  # which socket _next asks first (they take turns)
        # Whether each socket may hold a message: set by its fd's notification (and where this end
        # used it, which may consume one), cleared once its events said it holds none.
        self._maybe = [True, True]
        self._through: deque[list[Any]] = deque()  # messages a session let through at once, after the first
        self._readiness: Readiness | None = None
        self._pumping: Callable[[], None] | None = None
        self._reading = False
        self._stats = ChannelStatistics(address=self.address)
        self.rounds = 0  # the pump's reader callbacks so far: the messages one hands on came together

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
        # Between two calls the sticky reader may have read a socket's events (and so taken its
        # notification) with nobody waiting: ask both.
        self._maybe[0] = self._maybe[1] = True
        try:
            while True:
                if self._socket.closed:
                    raise ChannelClosed(f"receiver {self.address} is closed")
                frames = self._next()
                if frames is DRAINED:  # every socket's events were just read: wait for their next change
                    if self._readiness is None:
                        self._readiness = Readiness(*self._sockets, sticky=True)
                    await self._readiness.notified()
                    self._maybe[0] = self._maybe[1] = True  # one of them, or both
                elif frames is not None:
                    return frames
        finally:
            self._reading = False

    def _next(self) -> list[Any] | None | _Drained:
        """One message read without waiting: its frames, None for one used up here, or
        :data:`DRAINED` when nothing waits.

        Used up here: a sealed session's opening or claim, and a sealed message that
        was refused (counted in ``statistics().refused``). Frames of a sealed message
        are :class:`~transport.sealed.OpenedFrame` objects, which give the CURVE name
        of the session's sender as ``get("User-Id")`` as a CURVE frame does.

        Which socket is asked first alternates, so neither starves the other. Each is asked
        by its events, not by a receive that fails (pyzmq's ``Again`` costs more than a
        message's decoding), and only where it may hold a message (``_maybe``): a
        ``ZMQ_EVENTS`` read costs a few microseconds, as much as opening a small message.

        Raises:
            MessageTooLarge: a message over the limits; it was dropped.
        """
        bulk = self._bulk
        if bulk is None:
            return self._next_curve() if readable(self._socket) else DRAINED
        if self._through:
            return self._through.popleft()
        maybe = self._maybe
        self._bulk_first = not self._bulk_first
        for which in (1, 0) if self._bulk_first else (0, 1):
            if maybe[which]:
                if readable(self._sockets[which]):
                    return self._next_bulk(bulk) if which else self._next_curve()
                # Drained: tell the senders what was taken. A send may consume the notification of
                # a message that came meanwhile, so the socket is asked once more.
                if which == 1 and bulk.tell_taken() and readable(bulk.socket):
                    return self._next_bulk(bulk)
                maybe[which] = False
        return DRAINED

    def _next_bulk(self, bulk: BulkInbox) -> list[Any] | None | _Drained:
        """The next message of the bulk socket, whose events said one waits (see :meth:`_next`)."""
        try:
            frame = bulk.socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:  # ZMQ_EVENTS says a message *may* wait
            return DRAINED
        # routing id, the first frame (head and tags or ciphertext), and a tag per frame
        frames, nbytes = gather(bulk.socket, frame, self._max_message_bytes + TAG_BYTES * MAX_FRAMES_PER_MESSAGE,
                                MAX_FRAMES_PER_MESSAGE + 2, self.address)
        try:
            through = bulk.take(frames)
        except SealRefused as exc:
            self._refuse(exc)
            return None
        if through is not None:
            self._stats.bytes += nbytes
        return self._hand_on(through)

    def _hand_on(self, through: list[list[Any]] | None) -> list[Any] | None:
        """The first of the messages a session let through (the rest wait in ``_through``), or None."""
        if not through:
            return None
        self._stats.messages += len(through)
        if len(through) > 1:
            self._through.extend(through[1:])
        return through[0]  # OpenedFrame stands in for zmq.Frame

    def _next_curve(self) -> list[Any] | None | _Drained:
        """The next message of the CURVE (or plain) socket, whose events said one waits (see :meth:`_next`)."""
        try:
            frame = self._socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:  # ZMQ_EVENTS says a message *may* wait (a CURVE command may have been all)
            return DRAINED
        frames, nbytes = gather(self._socket, frame, self._max_message_bytes, MAX_FRAMES_PER_MESSAGE, self.address)
        bulk = self._bulk
        if bulk is not None:
            try:
                through = bulk.take_direct(frames)
                if through is not None:
                    self._stats.bytes += nbytes
                    return self._hand_on(through)
                if is_open_message(frames):
                    self._maybe[1] = True  # a claim that waited for the opening is answered on the bulk socket
                    bulk.on_open(frames[0])
                    return None
            except SealRefused as exc:
                self._refuse(exc)
                return None
        self._stats.messages += 1
        self._stats.bytes += nbytes
        return frames

    def _overdue(self, through: list[list[Any]]) -> None:
        """Messages a session held for one that never came (``BulkInbox.on_overdue``): read next."""
        self._stats.messages += len(through)
        self._through.extend(through)
        if self._pumping is not None:
            self._pumping()
        elif self._readiness is not None:
            self._readiness.wake()

    def _refuse(self, exc: SealRefused) -> None:
        self._stats.refused += 1
        if worth_logging(self._stats.refused):
            log.warning("refused a sealed message on %s (%d so far): %s", self.address, self._stats.refused, exc)

    def on_lost(self, callback: Callable[[str, str], None]) -> None:
        """Tells ``callback(sender's CURVE name, why)`` of each sealed message lost (``BulkInbox.on_lost``)."""
        if self._bulk is not None:
            self._bulk.on_lost = callback

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
            self.rounds += 1
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
                    frames = self._next()
                except MessageTooLarge as exc:
                    log.warning("%s", exc)
                    continue
                if frames is DRAINED:
                    return  # the fds fire again on the next message
                if frames is None:
                    continue
                try:
                    on_frames(frames)
                except Exception:
                    log.exception("message handler raised")
                if loop.time() > deadline:
                    break
            loop.call_soon(ready)  # more may be waiting: come back after others had a turn

        def notified(which: int) -> Callable[[], None]:
            def callback() -> None:
                self._maybe[which] = True
                ready()
            return callback

        self._pumping = ready
        for which, fd in enumerate(self._fds()):
            loop.add_reader(fd, notified(which))
        loop.call_soon(ready)  # messages that came before the reader

    def _fds(self) -> list[int]:
        return [socket.getsockopt(zmq.FD) for socket in self._sockets]  # type: ignore[misc]

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
                for fd in self._fds():
                    asyncio.get_running_loop().remove_reader(fd)
                self._pumping = None
            self._socket.close(linger=0)
            if self._bulk is not None:
                self._bulk.close()
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
        bulk: BulkMode = "encrypt",
    ) -> None:
        endpoint, server_public = split_address(address)
        bulk_at = bulk_endpoint(address)
        if curve is not None and server_public is None:
            raise ValueError(f"{address[:120]!r} carries no CURVE key (a secure peer's address ends in |<key>); "
                             "is the peer started without keys (--insecure)?")
        self.address = address
        self._max_message_bytes = max_message_bytes
        self._linger_ms = linger_ms
        context = context or zmq.Context.instance()
        self._socket: zmq.Socket[Any] = context.socket(zmq.PUSH)
        try:
            if curve is not None and server_public is not None:
                configure_client(self._socket, curve, server_public)
            self._socket.setsockopt(zmq.SNDHWM, hwm)
            # Queue nothing for a peer that is not connected: an unreachable peer makes
            # send wait (and time out) instead of piling messages up in memory.
            self._socket.setsockopt(zmq.IMMEDIATE, 1)
            reach(self._socket, endpoint)
            self._socket.connect(endpoint)
        except BaseException:  # an address libzmq refuses ("foo"): left open, the socket kept Context.term waiting
            self._socket.close(linger=0)
            raise
        # Sealed: CURVE carries the session's opening, the bulk socket every message.
        self._link: BulkLink | None = None
        if curve is not None and bulk_at is not None and bulk != "curve":
            if bulk == "authenticate":
                log.warning("messages to %s leave in the clear, authenticated but not encrypted "
                            "(bulk=%r): for a trusted network only", address[:120], bulk)
            try:
                self._link = BulkLink(context, self._socket, bulk_at, hwm=hwm, encrypt=bulk == "encrypt")
            except BaseException:
                self._socket.close(linger=0)
                raise
        self._waiting_on = self._socket  # where the last message that found no room would have left
        self._held_back = False  # the last send found too much ciphertext queued (BulkLink.room_for)
        self._rooms: dict[zmq.Socket[Any], Readiness] = {}  # a socket's, once a send had to wait for it
        self._queue: asyncio.Lock | None = None
        self._num_queued = 0
        self._stats = ChannelStatistics(address=address)

    async def send(self, payload: Any, *, codec: str = "none", timeout: float | None = None,
                   handed_over: bool = False) -> int:
        """Encodes and sends one message; waits while the high-water mark is reached.

        Args:
            payload: msgpack types and tensors (see :func:`transport.wire.encode_message`).
                A sent tensor may be modified in place once this returns, unless ``handed_over``.
            codec: codec for floating tensors not marked with ``Coded``.
            timeout: seconds to wait for room; None waits for ever.
            handed_over: the caller gives the payload's tensors up: none of them is modified in
                place again, so a large one leaves without a copy (ZeroMQ reads its memory while
                it sends, after this has returned), as raw pyzmq's ``copy=False``. Without it, a
                large tensor is copied as it is queued, except by a sealed, encrypted channel,
                whose frames are its own ciphertext.

        Returns:
            The number of bytes sent.

        Raises:
            TimeoutError: no room (or no connected peer) within ``timeout``.
            ChannelClosed: the sender was closed.
            transport.wire.MessageTooLarge, TypeError, CodecError: from encoding.
        """
        frames = encode_message(payload, codec=codec, max_bytes=self._max_message_bytes)
        return await self.send_frames(frames, timeout=timeout, handed_over=handed_over)

    async def send_frames(self, frames: list[Any], *, timeout: float | None = None,
                          handed_over: bool = False) -> int:
        """Sends already encoded frames (see :meth:`send`)."""
        size = measure(frames)
        if self._num_queued == 0 and (nbytes := self._try_send(frames, size, handed_over)) is not None:
            return self._count(nbytes)
        if self._queue is None:
            self._queue = asyncio.Lock()
        self._num_queued += 1
        try:
            async with asyncio.timeout(timeout), self._queue:
                while (nbytes := self._try_send(frames, size, handed_over)) is None:
                    await self._wait_room()
        except TimeoutError:
            raise TimeoutError(
                f"no room to send to {self.address} within {timeout}s: the receiver is "
                "slow, gone or not yet bound"
            ) from None
        finally:
            self._num_queued -= 1
        return self._count(nbytes)

    def send_nowait(self, payload: Any, *, codec: str = "none", handed_over: bool = False) -> int:
        """Sends one message now or raises :class:`WouldBlock`; never waits (``handed_over``: see
        :meth:`send`)."""
        frames = encode_message(payload, codec=codec, max_bytes=self._max_message_bytes)
        return self.send_frames_nowait(frames, handed_over=handed_over)

    def send_frames_nowait(self, frames: list[Any], *, handed_over: bool = False) -> int:
        """Sends already encoded frames now or raises :class:`WouldBlock` (see :meth:`send_nowait`)."""
        if self._num_queued or (nbytes := self._try_send(frames, measure(frames), handed_over)) is None:
            raise WouldBlock(f"send queue to {self.address} is full, or its sealed session is not open yet")
        return self._count(nbytes)

    def _must_copy(self, large: bool, handed_over: bool) -> bool:
        """Whether frames (sealed already, if the channel seals) are copied as they are queued:
        small ones always (``large`` false: ZeroMQ copies them anyway, and a zero-copy frame costs a
        Frame object and a release callback), large ones unless nobody else writes to them (the
        caller handed them over, or they are this channel's own ciphertext)."""
        if not large:
            return True
        return not (handed_over or (self._link is not None and self._link.key.encrypt))

    def _try_send(self, frames: list[Any], size: tuple[int, bool], handed_over: bool) -> int | None:
        """Sends the message now if there is room: the bytes that left, or None.

        A sealed channel numbers a message only as it leaves, so the numbers the receiver
        sees have no gaps (it hands messages on in their order): a small one goes over CURVE
        (:meth:`~transport.sealed.BulkLink.direct`), any other sealed over the bulk socket,
        where a large one is sealed only once there is room for it.
        """
        if self._socket.closed:
            raise ChannelClosed(f"sender to {self.address} is closed")
        nbytes, large = size
        link = self._link
        try:
            if link is None:
                send_nowait(self._socket, frames, copy=self._must_copy(large, handed_over))
                return nbytes
            if not link.ready:
                link.advance()
            self._waiting_on = self._socket
            if link.send_direct(frames, nbytes):
                return nbytes
            self._waiting_on = link.socket
            if not link.ready or (large and not writable(link.socket)):
                return None
            if large and not link.room_for(nbytes):
                self._held_back = True  # room on the socket, but too much ciphertext still queued
                return None
            sealed = link.seal(frames)
            copy = self._must_copy(large, handed_over)
            send_nowait(link.socket, sealed, copy=copy)
            link.sent_sealed(() if copy else sealed)
            return measure(sealed)[0]
        except zmq.Again:
            return None  # nothing left (libzmq takes a message whole or not at all), its number is the next one's

    async def _wait_room(self) -> None:
        """Waits until a send may succeed: room on the socket the message would leave by, or the
        sealed session's next step."""
        link = self._link
        if link is None or (link.opened and self._waiting_on is self._socket):
            await self._room(self._socket).wait(zmq.POLLOUT)  # plain, or a small message over CURVE
            return
        if link.ready:
            if self._held_back:  # ZeroMQ says nothing when it lets go of a frame: look again soon
                self._held_back = False
                await asyncio.sleep(UNSENT_POLL_S)
            else:
                await self._room(link.socket).wait(zmq.POLLOUT)
            return
        if not link.opened:  # the CURVE handshake: the opening leaves once it is done
            waiting, event, seconds = self._room(self._socket), zmq.POLLOUT, CLAIM_RETRY_S[1]
        elif not link.claimed:  # the bulk socket's connection: the claim leaves once it is made
            waiting, event, seconds = self._room(link.socket), zmq.POLLOUT, CLAIM_RETRY_S[1]
        else:  # the ack, or the time to claim again
            waiting, event, seconds = self._room(link.socket), zmq.POLLIN, link.seconds_to_next_claim()
        try:
            async with asyncio.timeout(seconds):
                await waiting.wait(event)
        except TimeoutError:
            pass

    def _room(self, socket: zmq.Socket[Any]) -> Readiness:
        readiness = self._rooms.get(socket)
        if readiness is None:
            readiness = self._rooms[socket] = Readiness(socket)
        return readiness

    def _count(self, nbytes: int) -> int:
        self._stats.messages += 1
        self._stats.bytes += nbytes
        return nbytes

    def statistics(self) -> ChannelStatistics:
        return replace(self._stats)  # a snapshot

    async def aclose(self) -> None:
        """Closes the socket; messages already queued get up to ``linger_ms`` to leave."""
        if not self._socket.closed:
            for readiness in self._rooms.values():
                readiness.close()
            if self._link is not None:
                self._link.close(self._linger_ms)
            self._socket.close(linger=self._linger_ms)

    async def __aenter__(self) -> Sender:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
