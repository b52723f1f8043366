"""Sealed bulk frames: CURVE opens a session, AES-GCM carries the messages.

CURVE (libsodium's salsa20/poly1305 in libzmq) authenticates and encrypts every
frame at about 0.6 GB/s, a third of what the same socket carries in the clear. So a
secure channel uses CURVE only to open a *session*, and sends its messages over a
second, plain socket, each frame sealed with AES-256-GCM (OpenSSL through
``cryptography``, with the CPU's AES and carry-less multiply instructions):

1. The sender draws a random 16-byte session id and a 32-byte key, and sends them to
   the receiver over its CURVE socket: only the holder of the receiver's secret key
   can read them, and the receiver's gate names the sender (``User-Id``) as for any
   CURVE message.
2. The sender connects a plain DEALER to the receiver's bulk socket (a ROUTER, whose
   endpoint the receiver's address carries after its key) and *claims* the session
   with a token sealed under the key; the receiver answers with a sealed *ack*. A
   claim that comes before the session does waits (a few are kept), and the sender
   repeats its claim until it is acknowledged.
3. Every message then leaves as its frames sealed, the head (clear) at the start of
   the first. The head carries the session id, a sequence number that grows by one per
   message, and the frame count; it is the associated data of every frame, and each frame's nonce is
   made of its direction, index and sequence number, so a frame moved, dropped,
   swapped or altered fails its tag. The receiver takes only sequence numbers above
   the last it took, so a replayed or reordered message is refused.

4. A small message (at most :data:`DIRECT_MAX_BYTES`) goes over the CURVE socket
   itself, its first frame prefixed with the session id and its number: libzmq seals
   it in C, where sealing it here in Python cost more than the message. Both sockets
   number from one counter, and the receiver hands messages on in that order,
   holding a bulk message whose head says the one before it went over CURVE until
   that one came. So that a small message never waits behind a large one still on
   its way, the receiver says which numbers it took from the bulk socket (a sealed
   *taken* word), and the sender sends a small message over CURVE only once every
   message it sent over the bulk socket was taken; until then it goes sealed, behind
   them.

With ``encrypt=False`` (a trusted network, chosen explicitly) frames travel in the
clear and carry only a GCM tag over them (GMAC): authenticated, not secret.

What a peer without the cluster's key can do to the bulk socket: connect, and send
bytes that are refused (an unknown session, a bad tag, an old sequence number); it is
never answered and never sent anything. Threat model and design: docs/security.md.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from transport._buffers import aligned_empty, only_held_by
from transport._sockets import reach, send_nowait
from transport.addresses import advertised
from transport.wire import WireError

__all__ = ["DIRECT_MAX_BYTES", "HEAD_BYTES", "BulkInbox", "BulkLink", "OpenedFrame", "SealRefused", "SessionKey",
           "UNSENT_MAX_BYTES", "aligned_buffer", "byte_view", "is_open_message", "parse_head"]

log = logging.getLogger(__name__)

VERSION = 3  # 3: small messages over CURVE, numbered with the sealed ones; 2: a tag over the head
TAG_BYTES = 16
FLAG_ENCRYPTED = 1
FLAG_AFTER_DIRECT = 2  # in a data head: the message numbered one lower went over CURVE
_OPEN = struct.Struct("!4sBB16s32s")  # magic, version, flags, session id, key: over CURVE only
_TOKEN_HEAD = struct.Struct("!4sBB16s")  # magic, version, flags, session id; a sealed word follows
_HEAD = struct.Struct("!4sBB16sQI")  # magic, version, flags, session id, sequence, frame count
HEAD_BYTES = _HEAD.size
_DIRECT = struct.Struct("!4sB16sQ")  # magic, version, session id, sequence: before a small message over CURVE
_TAKEN = struct.Struct("!4sB16sQ")  # magic, version, session id, the number taken; its tag follows
_NONCE = struct.Struct("!IQ")  # direction (top bit) | frame index, sequence number
OPEN_MAGIC, CLAIM_MAGIC, ACK_MAGIC, DATA_MAGIC = b"APso", b"APsc", b"APsa", b"APsd"
DIRECT_MAGIC, TAKEN_MAGIC = b"APsm", b"APst"
_POLLIN = int(zmq.POLLIN)
_TAKEN_INDEX = 1  # the nonce's index of a taken word (claims and acks use 0)
# A message of at most this many bytes goes over CURVE, sealed by libzmq in C: below it the
# Python of sealing and opening (about 7 us a message) costs more than CURVE's salsa20.
DIRECT_MAX_BYTES = 8192
# Messages held for one that comes over CURVE, and how long, before the connection that
# carried it is taken as broken and they are handed on without it.
MAX_HELD = 64
GAP_WAIT_S = 10.0
_TO_RECEIVER, _TO_SENDER = 0, 1
_CLAIM_WORD, _ACK_WORD = b"claim", b"ready"
# A frame this small is sealed into a new bytes object; a larger one straight into an
# aligned buffer that the decoder uses as it is (no second copy).
_INTO_BYTES = 4096
MAX_SESSIONS = 4096
MAX_WAITING_CLAIMS = 64
CLAIM_RETRY_S = (0.01, 0.5)  # first and longest wait between claims
# Ciphertext a sender may keep queued in ZeroMQ before a large message waits: the high-water
# mark counts messages, and 64 queued messages of 16 MiB would hold 1 GiB of it (in fresh
# pages, each a fault). One message larger than this goes when nothing else is queued.
UNSENT_MAX_BYTES = 64 << 20
UNSENT_POLL_S = 0.001  # how often a sender waiting on it looks again (ZeroMQ says nothing when it lets go)


class SealRefused(WireError):
    """A frame on a bulk socket failed its check: unknown session, bad tag, or an old sequence number."""


def _nonce(direction: int, index: int, seq: int) -> bytes:
    return _NONCE.pack(direction << 31 | index, seq)


def byte_view(frame: Any) -> memoryview:
    """A frame (a zmq.Frame, bytes, any buffer) as a flat memoryview of bytes."""
    view = memoryview(getattr(frame, "buffer", frame))
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def aligned_buffer(nbytes: int) -> memoryview:
    """A fresh writable buffer at a 64-byte aligned address, not zeroed (see :func:`aligned_empty`)."""
    return memoryview(aligned_empty(nbytes).numpy())  # type: ignore[arg-type]


def is_open_message(frames: list[Any]) -> bool:
    """Whether a message that came over CURVE is a session's opening rather than a payload."""
    return len(frames) == 1 and len(frames[0]) == _OPEN.size and bytes(byte_view(frames[0])[:4]) == OPEN_MAGIC


class OpenedFrame:
    """A frame taken out of its seal: a buffer, and ``get("User-Id")`` as a CURVE frame has."""

    __slots__ = ("buffer", "_user_id")

    def __init__(self, buffer: memoryview | bytes, user_id: str) -> None:
        self.buffer = buffer
        self._user_id = user_id

    def get(self, name: str) -> str | None:
        return self._user_id if name == "User-Id" else None

    def __len__(self) -> int:
        return memoryview(self.buffer).nbytes


class SessionKey:
    """One session's key and id: seals a sender's messages, opens them at the receiver."""

    __slots__ = ("session_id", "encrypt", "_key", "_aead")

    def __init__(self, session_id: bytes, key: bytes, *, encrypt: bool) -> None:
        self.session_id = session_id
        self.encrypt = encrypt
        self._key = key
        self._aead = AESGCM(key)

    @classmethod
    def new(cls, *, encrypt: bool = True) -> SessionKey:
        return cls(os.urandom(16), AESGCM.generate_key(bit_length=256), encrypt=encrypt)

    def twin(self) -> SessionKey:
        """The same session's key with an AES-GCM object of its own, for another thread to seal with
        while this one is in use (``cryptography`` lets go of the GIL as it seals, and does not say
        that one object may seal on two threads at once)."""
        return SessionKey(self.session_id, self._key, encrypt=self.encrypt)

    @property
    def _flags(self) -> int:
        return FLAG_ENCRYPTED if self.encrypt else 0

    def open_message(self) -> bytes:
        """The frame that opens the session; it must travel over CURVE (it holds the key)."""
        return _OPEN.pack(OPEN_MAGIC, VERSION, self._flags, self.session_id, self._key)

    @classmethod
    def from_open_message(cls, data: Any) -> SessionKey:
        """Raises SealRefused: not an opening of a version this side speaks."""
        view = byte_view(data)
        if view.nbytes != _OPEN.size:
            raise SealRefused(f"a session opening has {_OPEN.size} bytes, not {view.nbytes}")
        magic, version, flags, session_id, key = _OPEN.unpack(view)
        if magic != OPEN_MAGIC or version != VERSION or flags & ~FLAG_ENCRYPTED:
            raise SealRefused(f"not a session opening of version {VERSION} (magic {magic!r}, version {version})")
        return cls(session_id, key, encrypt=bool(flags & FLAG_ENCRYPTED))

    # -- claim and ack: short sealed tokens -------------------------------------------

    def token(self, magic: bytes, direction: int, word: bytes) -> bytes:
        head = _TOKEN_HEAD.pack(magic, VERSION, self._flags, self.session_id)
        return head + self._aead.encrypt(_nonce(direction, 0, 0), word, head)

    def check_token(self, data: bytes, direction: int, word: bytes) -> bool:
        head, sealed = data[: _TOKEN_HEAD.size], data[_TOKEN_HEAD.size :]
        try:
            return self._aead.decrypt(_nonce(direction, 0, 0), sealed, head) == word
        except InvalidTag:
            return False

    def direct(self, seq: int, frames: list[Any]) -> list[Any]:
        """Message number ``seq`` to go over CURVE: its first frame prefixed with the session and the number."""
        # bytes + any contiguous buffer (a wire message's first frame is bytes) is one copy
        return [_DIRECT.pack(DIRECT_MAGIC, VERSION, self.session_id, seq) + frames[0], *frames[1:]]

    def taken(self, seq: int) -> bytes:
        """The receiver's word that it took message ``seq`` from the bulk socket (tagged, not secret)."""
        head = _TAKEN.pack(TAKEN_MAGIC, VERSION, self.session_id, seq)
        return head + self._aead.encrypt(_nonce(_TO_SENDER, _TAKEN_INDEX, seq), b"", head)

    def check_taken(self, data: bytes) -> int:
        """The number a taken word names, or 0 where it is not one of this session's."""
        if len(data) != _TAKEN.size + TAG_BYTES:
            return 0
        head = data[: _TAKEN.size]
        magic, version, session_id, seq = _TAKEN.unpack(head)
        if magic != TAKEN_MAGIC or version != VERSION or session_id != self.session_id:
            return 0
        try:
            self._aead.decrypt(_nonce(_TO_SENDER, _TAKEN_INDEX, seq), data[_TAKEN.size :], head)
        except InvalidTag:
            return 0
        return int(seq)

    # -- messages ---------------------------------------------------------------------

    def seal(self, seq: int, frames: list[Any], *, after_direct: bool = False) -> list[Any]:
        """The sealed frames of message number ``seq`` (from 1, one up per message); ``after_direct``:
        the message numbered one lower went over CURVE (the receiver waits for it before this one).

        The head rides at the start of the first frame, before its ciphertext (a wire
        message's first frame is its small msgpack header): one frame fewer to send and
        receive. Not encrypted, the first frame is the head, its tag and every frame's tag.
        """
        views = [byte_view(frame) for frame in frames]
        flags = self._flags | (FLAG_AFTER_DIRECT if after_direct else 0)
        head = _HEAD.pack(DATA_MAGIC, VERSION, flags, self.session_id, seq, len(views))
        if not self.encrypt:
            return [head + self._macs(head, seq, views), *views]
        sealed: list[Any] = []
        for index, view in enumerate(views):
            nonce = _nonce(_TO_RECEIVER, index, seq)
            if index == 0:
                sealed.append(head + self._aead.encrypt(nonce, view, head))
            elif view.nbytes < _INTO_BYTES:
                sealed.append(self._aead.encrypt(nonce, view, head))
            else:
                out = aligned_buffer(view.nbytes + TAG_BYTES)
                self._aead.encrypt_into(nonce, view, head, out)
                sealed.append(out)
        return sealed

    def unseal(self, head: bytes, seq: int, frames: list[Any], user_id: str) -> list[OpenedFrame]:
        """The frames of a message whose first frame :func:`parse_head` split: ``frames`` is the rest of
        that frame after the head, then the others.

        Raises:
            SealRefused: a frame is missing, extra, or fails its tag.
        """
        views = [byte_view(frame) for frame in frames]
        count = _HEAD.unpack(head)[5]
        if not self.encrypt:
            if len(views) != count + 1 or views[0].nbytes != TAG_BYTES * (count + 1):
                raise SealRefused(f"message {seq}: {len(views) - 1} frames and {views[0].nbytes} bytes of tags "
                                  f"for {count} frames")
            if not hmac.compare_digest(self._macs(head, seq, views[1:]), views[0]):
                raise SealRefused(f"message {seq}: its head or a frame fails its tag")
            return [OpenedFrame(view, user_id) for view in views[1:]]
        if len(views) != count:
            raise SealRefused(f"message {seq}: {len(views)} frames, its head says {count}")
        opened: list[OpenedFrame] = []
        for index, view in enumerate(views):
            nonce = _nonce(_TO_RECEIVER, index, seq)
            try:
                if view.nbytes < _INTO_BYTES:
                    plain: memoryview | bytes = self._aead.decrypt(nonce, view, head)
                else:
                    plain = aligned_buffer(view.nbytes - TAG_BYTES)
                    self._aead.decrypt_into(nonce, view, head, plain)
            except (InvalidTag, ValueError):
                raise SealRefused(f"message {seq}: frame {index} fails its tag") from None
            opened.append(OpenedFrame(plain, user_id))
        return opened

    def _macs(self, head: bytes, seq: int, views: list[memoryview]) -> bytes:
        """GCM's tags (GMAC: nothing encrypted) over the head and over each frame left in the clear.

        The head's tag comes first (index 0), then one per frame (index 1...), each under
        its own nonce (direction, index, sequence number), so a frame moved, dropped or
        swapped fails; the head carries the frame count. A frame is tagged where it lies,
        as the associated data of an empty message: no copy of it is made.
        """
        aead = self._aead
        tags = [aead.encrypt(_nonce(_TO_RECEIVER, 0, seq), b"", head)]
        tags += [aead.encrypt(_nonce(_TO_RECEIVER, index, seq), b"", view) for index, view in enumerate(views, 1)]
        return b"".join(tags)


def parse_head(data: Any) -> tuple[bytes, bytes, int, memoryview]:
    """A data message's first frame -> (its head, session id, sequence number, the rest of the frame).

    Raises:
        SealRefused: not a data head of this version.
    """
    view = byte_view(data)
    if view.nbytes < _HEAD.size:
        raise SealRefused(f"a sealed message's first frame has {view.nbytes} bytes, less than a head")
    head = bytes(view[: _HEAD.size])
    magic, version, flags, session_id, seq, _count = _HEAD.unpack(head)
    if magic != DATA_MAGIC or version != VERSION or flags & ~(FLAG_ENCRYPTED | FLAG_AFTER_DIRECT):
        raise SealRefused(f"not a sealed message of version {VERSION} (magic {magic!r})")
    return head, session_id, seq, view[_HEAD.size :]


@dataclass(slots=True)
class _Session:
    key: SessionKey
    user_id: str
    last_seq: int = 0  # the last number handed on
    claimant: bytes | None = None  # the routing id whose claim was taken first
    held: dict[int, list[Any]] | None = None  # messages that wait for one over CURVE
    gap_since: float = 0.0  # when the first of them came
    told_refused: bool = False  # a refused message was told as lost: the gap it leaves is not told again


class BulkInbox:
    """The receiving end of sealed sessions: a plain ROUTER that takes sealed messages only.

    Args:
        context: the ZeroMQ context.
        bind_address: where to bind (resolved: ``tcp://HOST:*`` or ``ipc://PATH``).
        hwm: messages queued in this process before senders must wait.
        max_frame_bytes: the largest sealed frame libzmq takes (ZMQ_MAXMSGSIZE).
    """

    def __init__(self, context: zmq.Context[Any], bind_address: str, *, hwm: int, max_frame_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.socket: zmq.Socket[Any] = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.RCVHWM, hwm)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            reach(self.socket, bind_address)
            self.socket.bind(bind_address)
        except BaseException:
            self.socket.close()
            raise
        self.endpoint: str = advertised(self.socket.getsockopt_string(zmq.LAST_ENDPOINT))
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()
        self._waiting_claims: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()  # session -> (routing id, claim)
        self._to_tell: dict[bytes, tuple[bytes, int]] = {}  # session -> (routing id, highest number taken)
        self._holding: dict[bytes, _Session] = {}  # the sessions that hold messages
        # Given the messages held past GAP_WAIT_S, from a timer while a session holds some;
        # without it (no loop) the owner calls overdue() itself.
        self.on_overdue: Callable[[list[list[Any]]], None] | None = None
        # Told a session's sender (its CURVE name) and why, each time a message of it was lost on the
        # way: a gap in its numbers passed over, or a message refused that came on the connection that
        # claimed the session (a stranger's refused message loses nothing, and is not told).
        self.on_lost: Callable[[str, str], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0  # the loop time it is due at

    def on_open(self, frame: Any) -> None:
        """Registers a session opened by a message that came over CURVE (``frame.get("User-Id")`` names its sender).

        Raises:
            SealRefused: not an opening, or one without a CURVE name.
        """
        key = SessionKey.from_open_message(frame)
        user_id = str(frame.get("User-Id") or "")
        if not user_id:
            raise SealRefused("a session opening came without a CURVE identity")
        if key.session_id in self._sessions:
            raise SealRefused("a session was opened twice")
        self._sessions[key.session_id] = _Session(key, user_id)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        waiting = self._waiting_claims.pop(key.session_id, None)
        if waiting is not None:
            self._claim(*waiting)

    def take(self, frames: list[Any]) -> list[list[Any]] | None:
        """One message read from the ROUTER (``[routing id, ...]``): the messages it lets through, in
        their senders' order (none while it waits for one over CURVE, several once it closed a gap),
        or None for a claim.

        Raises:
            SealRefused: refused; nothing was answered.
        """
        if len(frames) < 2:
            raise SealRefused("an empty message on a bulk socket")
        first = byte_view(frames[1])
        if first[:4] == CLAIM_MAGIC:
            if len(frames) != 2 or first.nbytes < _TOKEN_HEAD.size:
                raise SealRefused("a claim of the wrong shape on a bulk socket")
            self._claim(bytes(byte_view(frames[0])), bytes(first))
            return None
        head, session_id, seq, rest = parse_head(first)
        session = self._session(session_id, seq)
        routing_id = bytes(byte_view(frames[0]))
        try:
            opened = session.key.unseal(head, seq, [rest, *frames[2:]], session.user_id)
        except SealRefused as exc:
            if routing_id == session.claimant:  # the sender's own connection: what it sent is lost
                session.told_refused = True
                self._tell_lost(session, str(exc))
            raise
        # only once every frame passed its tag (the head's flags with them)
        through = self._in_order(session, seq, opened, after_direct=bool(head[5] & FLAG_AFTER_DIRECT))
        if routing_id == session.claimant:  # whoever else sent the sender's bytes gets nothing back
            self._to_tell[session_id] = (routing_id, seq)
        return through

    def tell_taken(self) -> bool:
        """Tells each sender the highest number taken from it since it was last told (the owner calls
        this once the bulk socket is drained: one word a burst, not one a message); returns whether
        anything was sent."""
        if not self._to_tell:
            return False
        for session_id, (routing_id, seq) in self._to_tell.items():
            session = self._sessions.get(session_id)
            if session is None:
                continue
            try:
                self.socket.send_multipart([routing_id, session.key.taken(seq)], zmq.NOBLOCK)
            except zmq.Again:
                pass  # a later word says as much (the sender keeps the highest)
        self._to_tell.clear()
        return True

    def take_direct(self, frames: list[Any]) -> list[list[Any]] | None:
        """A message that came over CURVE, if it is a session's small message: the messages it lets
        through, in order (see :meth:`take`), its first frame's prefix cut off; None where it is not
        one (a wire message, or a session's opening).

        Every message between two runtimes that are not moving tensors comes this way, so the
        common case (the next number of a session that holds nothing) takes one struct read, a
        dict lookup and the sender's CURVE name.

        Raises:
            SealRefused: not a session of the member CURVE names, or a number taken before.
        """
        first = frames[0]
        view = first.buffer if type(first) is zmq.Frame else byte_view(first)
        try:
            magic, version, session_id, seq = _DIRECT.unpack_from(view)
        except struct.error:
            if view[:4] == DIRECT_MAGIC:
                raise SealRefused("a small message shorter than its prefix") from None
            return None
        if magic != DIRECT_MAGIC:
            return None  # a wire message's first frame is a msgpack array, which never starts so
        if version != VERSION:
            raise SealRefused(f"a small message of version {version}, not {VERSION}")
        user_id = str(first.get("User-Id") or "")
        message = [OpenedFrame(view[_DIRECT.size :], user_id), *frames[1:]]
        session = self._sessions.get(session_id)
        if session is not None and user_id == session.user_id and seq == session.last_seq + 1 \
                and session.held is None:
            session.last_seq = seq
            self._sessions.move_to_end(session_id)
            return [message]
        session = self._session(session_id, seq)
        if user_id != session.user_id:
            raise SealRefused("a small message for a session another member opened")
        return self._in_order(session, seq, message, direct=True)

    def _session(self, session_id: bytes, seq: int) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SealRefused("a sealed message of an unknown session")
        if seq <= session.last_seq or (session.held is not None and seq in session.held):
            raise SealRefused(f"message {seq} of a session already past {session.last_seq}: replayed or reordered")
        self._sessions.move_to_end(session_id)
        return session

    def _in_order(self, session: _Session, seq: int, message: list[Any], *, direct: bool = False,
                  after_direct: bool = False) -> list[list[Any]]:
        """The messages that ``message`` (number ``seq``, new to the session) lets through, in order.

        A message waits only for one that went over the other socket and is still on its way:
        a bulk message whose head says the one before it went over CURVE (and the bulk messages
        behind it). Any other gap is a message that will not come (refused: tampered, say), as
        each socket keeps its order: a gap below a bulk message that came after a bulk one, and
        any gap below a message over CURVE, which the sender sends only once the receiver took
        every bulk message before it (:meth:`BulkLink.direct`).
        """
        through: list[list[Any]] = []
        held = session.held
        if seq != session.last_seq + 1:
            if direct:  # whatever is below it came, or will not: the ones held below it go first
                if held is not None:
                    through += [held.pop(number) for number in sorted(held) if number < seq]
                self._passed_over(session, seq, len(through))
            elif after_direct or held:  # wait for the one over CURVE (or behind the ones that do)
                if held is None:
                    held = session.held = {}
                    session.gap_since = self._clock()
                held[seq] = message
                self._holding[session.key.session_id] = session
                self._arm()
                # Given up on by time only from the timer (_on_timer), which runs once the loop
                # has read what came meanwhile: here the one waited for may be next in line.
                return through if len(held) <= MAX_HELD else through + self._give_up(session)
            else:
                self._passed_over(session, seq, 0)
        session.last_seq = seq
        through.append(message)
        while held and session.last_seq + 1 in held:
            session.last_seq += 1
            through.append(held.pop(session.last_seq))
        if held is not None and not held:
            session.held = None
            self._holding.pop(session.key.session_id, None)
        return through

    def _give_up(self, session: _Session) -> list[list[Any]]:
        """The messages a session holds, in order: the one they wait for is taken as lost."""
        held = session.held or {}
        log.warning("message %d of %s's session never came over CURVE; handing on the %d after it",
                    session.last_seq + 1, session.user_id, len(held))
        session.held = None
        self._holding.pop(session.key.session_id, None)
        if held:
            self._passed_over(session, max(held) + 1, len(held))
            session.last_seq = max(held)
        return [held[number] for number in sorted(held)]

    def _passed_over(self, session: _Session, below: int, came: int) -> None:
        """Tells (``on_lost``) that the session's numbers after its last one and below ``below``, but for
        the ``came`` among them that were held, are passed over: those messages will not come."""
        missing = below - 1 - session.last_seq - came
        if missing <= 0:
            return
        if session.told_refused:  # the gap a refused message left, told when it was refused
            session.told_refused = False
            if missing == 1:
                return
        first, last = session.last_seq + 1, below - 1
        self._tell_lost(session, f"its message {first} never came" if missing == last - first + 1 == 1 else
                        f"{missing} of its messages {first} to {last} never came")

    def _tell_lost(self, session: _Session, why: str) -> None:
        if self.on_lost is not None:
            try:
                self.on_lost(session.user_id, why)
            except Exception:  # the owner's: reading goes on
                log.exception("on_lost raised")

    @property
    def holding(self) -> bool:
        """Whether a session holds messages for one over CURVE."""
        return bool(self._holding)

    def seconds_to_give_up(self) -> float | None:
        """Seconds until the first session that holds messages gives up waiting; None where none holds any."""
        if not self._holding:
            return None
        return max(0.0, min(s.gap_since for s in self._holding.values()) + GAP_WAIT_S - self._clock())

    def _arm(self) -> None:
        """Comes back when the first session that holds messages would give up waiting, and hands
        them on then even if nothing else comes (a connection that broke)."""
        if self._timer is not None or self.on_overdue is None:
            return
        seconds = self.seconds_to_give_up()
        if seconds is None:
            return
        loop = asyncio.get_running_loop()
        self._timer_due = loop.time() + seconds + 0.01
        self._timer = loop.call_later(seconds + 0.01, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.socket.closed or self.on_overdue is None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() - self._timer_due > 0.5:
            # The loop was held up past the deadline: the message waited for may have come
            # meanwhile, unread. Come back once the loop has read its sockets again.
            self._timer_due = loop.time() + 0.05
            self._timer = loop.call_later(0.05, self._on_timer)
            return
        through = self.overdue()
        if through:
            self.on_overdue(through)
        self._arm()

    def overdue(self) -> list[list[Any]]:
        """The messages of every session that held them past :data:`GAP_WAIT_S`, in order."""
        now = self._clock()
        through: list[list[Any]] = []
        for session in list(self._holding.values()):
            if now - session.gap_since > GAP_WAIT_S:
                through += self._give_up(session)
        return through

    def _claim(self, routing_id: bytes, claim: bytes) -> None:
        session_id = _TOKEN_HEAD.unpack_from(claim)[3]
        session = self._sessions.get(session_id)
        if session is None:  # the opening may still be on its way over CURVE
            self._waiting_claims[session_id] = (routing_id, claim)
            while len(self._waiting_claims) > MAX_WAITING_CLAIMS:
                self._waiting_claims.popitem(last=False)
            return
        if session.claimant not in (None, routing_id):
            raise SealRefused("a second connection claimed a session")
        if not session.key.check_token(claim, _TO_RECEIVER, _CLAIM_WORD):
            raise SealRefused("a claim that fails its tag")
        session.claimant = routing_id
        try:
            self.socket.send_multipart([routing_id, session.key.token(ACK_MAGIC, _TO_SENDER, _ACK_WORD)], zmq.NOBLOCK)
        except zmq.Again:
            pass  # the claimant asks again

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.socket.close(linger=0)


class BulkLink:
    """A sender's sealed session: opened over its CURVE socket, claimed and used on a plain DEALER.

    Args:
        context: the ZeroMQ context.
        control: the sender's connected CURVE socket (the opening leaves through it).
        bulk_endpoint: the receiver's bulk socket.
        hwm: messages queued before a send must wait.
        encrypt: False leaves frames in the clear with a tag (authenticated only).
    """

    def __init__(self, context: zmq.Context[Any], control: zmq.Socket[Any], bulk_endpoint: str, *, hwm: int,
                 encrypt: bool) -> None:
        self.key = SessionKey.new(encrypt=encrypt)
        self._control = control
        self.socket: zmq.Socket[Any] = context.socket(zmq.DEALER)
        try:
            self.socket.setsockopt(zmq.SNDHWM, hwm)
            self.socket.setsockopt(zmq.RCVHWM, 4)
            self.socket.setsockopt(zmq.IMMEDIATE, 1)
            self.socket.setsockopt(zmq.MAXMSGSIZE, 256)  # what comes back: the claim's ack, the numbers taken
            reach(self.socket, bulk_endpoint)
            self.socket.connect(bulk_endpoint)
        except BaseException:  # closed here, or the context's term waits for it for ever
            self.socket.close(linger=0)
            raise
        self.opened = False  # the opening went out over CURVE: small messages may go
        self.claimed = False  # a claim went out on the bulk socket
        self.ready = False  # acknowledged: messages may go over the bulk socket
        self.seq = 0  # the number of the last message sent, over either socket
        self._bulk_seq = 0  # ...of the last sent over the bulk socket
        self._direct_seq = 0  # ...of the last sent over CURVE
        self._taken = 0  # the highest number the receiver said it took from the bulk socket
        self._claim = self.key.token(CLAIM_MAGIC, _TO_RECEIVER, _CLAIM_WORD)
        self._ack = self.key.token(ACK_MAGIC, _TO_SENDER, _ACK_WORD)
        self._next_claim = 0.0
        self._retry = CLAIM_RETRY_S[0]
        self._unsent: deque[memoryview] = deque()  # ciphertext queued without a copy, oldest first
        self._unsent_bytes = 0

    def room_for(self, nbytes: int) -> bool:
        """Whether a sealed message of ``nbytes`` may be queued now: the ciphertext ZeroMQ still holds
        and this message stay within :data:`UNSENT_MAX_BYTES`, or ZeroMQ holds none.

        ZeroMQ lets go of a frame sent without a copy once it has written it out; then only
        :attr:`_unsent` refers to its buffer.
        """
        unsent = self._unsent
        while unsent and only_held_by(unsent, 0):
            self._unsent_bytes -= unsent.popleft().nbytes
        return not unsent or self._unsent_bytes + nbytes <= UNSENT_MAX_BYTES

    def direct(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` may go over CURVE now: small, and no message sent over the
        bulk socket is still on its way (it would come after this one)."""
        if nbytes > DIRECT_MAX_BYTES or not self.opened:
            return False
        if self._taken < self._bulk_seq:
            self._read_answers()
        return self._taken >= self._bulk_seq

    def send_direct(self, frames: list[Any], nbytes: int) -> bool:
        """Sends the message over CURVE, numbered next, where it may go there now (:meth:`direct`);
        returns whether it went. Every message between two runtimes that are not moving tensors goes
        here, so this is the whole of the session's cost on the way out.

        Raises:
            zmq.Again: no room on the CURVE socket (the number stays the next message's).
        """
        if not self.direct(nbytes):
            return False
        seq = self.seq + 1
        send_nowait(self._control, self.key.direct(seq, frames), copy=True)
        self.seq = self._direct_seq = seq
        return True

    def seal(self, frames: list[Any]) -> list[Any]:
        """The next message sealed for the bulk socket, its head saying whether the one before went over CURVE."""
        seq = self.seq + 1
        return self.key.seal(seq, frames, after_direct=bool(self._direct_seq) and self._direct_seq == seq - 1)

    def sent_sealed(self, unsent: Sequence[Any] = ()) -> None:
        """The message :meth:`seal` sealed left: the next gets the next number. ``unsent``: its frames
        that ZeroMQ holds without a copy until they are written out."""
        self.seq = self._bulk_seq = self.seq + 1
        for frame in unsent:
            if isinstance(frame, memoryview):  # the head's frame is bytes, and small
                self._unsent.append(frame)
                self._unsent_bytes += frame.nbytes

    def advance(self) -> bool:
        """Takes the session's next step without waiting; returns whether it is ready."""
        if self.ready:
            return True
        if not self.opened:
            try:
                self._control.send(self.key.open_message(), zmq.NOBLOCK)
            except zmq.Again:
                return False  # CURVE is still shaking hands
            self.opened = True
        if self._read_answers():
            return True
        now = time.monotonic()
        if now >= self._next_claim:
            try:
                self.socket.send(self._claim, zmq.NOBLOCK)
            except zmq.Again:
                return False  # not connected yet: claim once it is (the sender waits for room)
            self.claimed = True
            self._next_claim = now + self._retry
            self._retry = min(self._retry * 2, CLAIM_RETRY_S[1])
        return False

    def _read_answers(self) -> bool:
        """Reads what the receiver said without waiting (the claim's ack, the numbers it took);
        returns whether the session is ready."""
        while int(self.socket.getsockopt(zmq.EVENTS)) & _POLLIN:  # type: ignore[call-overload]
            try:
                answer = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if answer == self._ack:
                self.ready = True
            else:
                self._taken = max(self._taken, self.key.check_taken(answer))
        return self.ready

    def seconds_to_next_claim(self) -> float:
        return max(0.0, self._next_claim - time.monotonic())

    def close(self, linger_ms: int) -> None:
        self.socket.close(linger=linger_ms)
