"""Sealed bulk frames: a session opened over CURVE, messages sealed with AES-GCM on a plain socket.

The tests that attack the bulk socket play the peer by hand: a raw CURVE socket opens a
session, a raw DEALER claims it and sends what the test chooses (tampered, replayed,
reordered), and the receiver must refuse each and keep serving.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
import zmq

from tests.helpers.clock import ManualClock
from tests.helpers.copy_spy import spy_on_copies
from transport import sealed
from transport.channel import Receiver, WouldBlock, open_receiver, open_sender
from transport.sealed import (
    ACK_MAGIC,
    CLAIM_MAGIC,
    DIRECT_MAX_BYTES,
    GAP_WAIT_S,
    HEAD_BYTES,
    MAX_HELD,
    TAG_BYTES,
    BulkInbox,
    OpenedFrame,
    SealRefused,
    SessionKey,
    parse_head,
)
from transport.security import Gate, Keypair, bulk_endpoint, configure_client, join_address, split_address
from transport.wire import MessageTooLarge, decode_message, encode_message

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def secure() -> AsyncIterator[tuple[Receiver, Keypair, Keypair, zmq.Context[Any]]]:
    server, member = Keypair.generate(), Keypair.generate()
    context: zmq.Context[Any] = zmq.Context()
    gate = Gate(context, lambda: {member.public: "node:n0"})
    receiver = open_receiver("tcp://127.0.0.1:0", context=context, curve=server, max_message_bytes=4 << 20)
    try:
        yield receiver, server, member, context
    finally:
        await receiver.aclose()
        gate.stop()
        context.term()


class _Collector:
    """Reads a receiver in the background (a session opens only while the receiver reads)."""

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            try:
                frames = await self.receiver.receive_frames()
            except MessageTooLarge as exc:
                await self.queue.put(exc)
                continue
            await self.queue.put(frames)

    async def next(self) -> Any:
        return await asyncio.wait_for(self.queue.get(), 20)

    async def aclose(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


class _HandPlayedPeer:
    """A member that opens a session with raw sockets and sends whatever the test seals."""

    def __init__(self, receiver: Receiver, member: Keypair, context: zmq.Context[Any], *, encrypt: bool = True):
        endpoint, server_public = split_address(receiver.address)
        bulk = bulk_endpoint(receiver.address)
        assert server_public is not None and bulk is not None
        self.key = SessionKey.new(encrypt=encrypt)
        self.control = context.socket(zmq.PUSH)
        configure_client(self.control, member, server_public)
        self.control.connect(endpoint)
        self.bulk = context.socket(zmq.DEALER)
        self.bulk.connect(bulk)
        self.seq = 0

    async def open(self) -> None:
        self.control.send(self.key.open_message())
        self.bulk.send(self.key.token(CLAIM_MAGIC, 0, b"claim"))
        assert await _poll(self.bulk) == self.key.token(ACK_MAGIC, 1, b"ready")

    def sealed(self, payload: Any, seq: int | None = None) -> list[bytes]:
        if seq is None:
            self.seq += 1
            seq = self.seq
        return [bytes(memoryview(f)) for f in self.key.seal(seq, encode_message(payload))]

    def close(self) -> None:
        self.control.close(linger=0)
        self.bulk.close(linger=0)


async def _poll(socket: zmq.Socket[Any], seconds: float = 20) -> bytes | None:
    """The next frame on ``socket`` within ``seconds``, or None."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        try:
            return socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            await asyncio.sleep(0.01)
    return None


async def _refusals(receiver: Receiver, at_least: int) -> int:
    """The receiver's refusals once there are ``at_least``: another connection's messages
    are fair-queued with the ones the test waited for, so they may come after them."""
    async with asyncio.timeout(20):
        while receiver.statistics().refused < at_least:
            await asyncio.sleep(0.01)
    return receiver.statistics().refused


def _payload(frames: list[Any]) -> Any:
    return decode_message(frames, max_bytes=1 << 30)


@pytest.mark.parametrize("bulk", ["encrypt", "authenticate", "curve"])
async def test_messages_cross_in_order_and_carry_their_senders_name(secure: tuple, bulk: str) -> None:
    receiver, _, member, context = secure
    collector = _Collector(receiver)
    tensors = [torch.randn(n) for n in (3, 5000, 70000, 300000)]
    try:
        async with open_sender(receiver.address, curve=member, context=context, bulk=bulk) as sender:  # type: ignore[arg-type]
            for i, tensor in enumerate(tensors):
                await sender.send({"i": i, "t": tensor}, timeout=20)
            received = [await collector.next() for _ in tensors]
    finally:
        await collector.aclose()
    for i, frames in enumerate(received):
        assert frames[0].get("User-Id") == "node:n0"
        assert isinstance(frames[0], OpenedFrame) == (bulk != "curve")
        message = _payload(frames)
        assert message["i"] == i and torch.equal(message["t"], tensors[i])
    assert receiver.statistics().messages == len(tensors) and receiver.statistics().refused == 0


@pytest.mark.parametrize(("bulk", "copied"), [("encrypt", [False, False]), ("authenticate", [True, False]),
                                              ("curve", [True, False])])
async def test_a_large_frame_leaves_without_a_copy_when_nobody_else_writes_it(
    secure: tuple, bulk: str, copied: list[bool]
) -> None:
    """Sealed and encrypted, what leaves is the channel's own ciphertext: never copied. Authenticated
    only, or all over CURVE, the frames are the caller's tensor: copied unless it was handed over."""
    receiver, _, member, context = secure
    collector = _Collector(receiver)
    tensor = torch.randn(1 << 18)  # 1 MiB: past ZeroMQ's copy threshold
    flags = spy_on_copies(min_bytes=1 << 16)  # messages, not the session's claims and acks
    try:
        async with open_sender(receiver.address, curve=member, context=context, bulk=bulk) as sender:  # type: ignore[arg-type]
            with flags:
                await sender.send(tensor, timeout=20)
                await sender.send(tensor, timeout=20, handed_over=True)
            received = [_payload(await collector.next()) for _ in range(2)]
    finally:
        await collector.aclose()
    assert flags.copies == copied
    assert all(torch.equal(value, tensor) for value in received)


def _tamper(frames: list[bytes], how: str) -> list[bytes]:
    frames = list(frames)
    if how == "payload byte":
        last = bytearray(frames[-1])
        last[len(last) // 2] ^= 1
        frames[-1] = bytes(last)
    elif how == "tag":
        last = bytearray(frames[-1])
        last[-1] ^= 0x80
        frames[-1] = bytes(last)
    elif how == "sequence in the head":
        first = bytearray(frames[0])
        first[HEAD_BYTES - 5] ^= 1  # the sequence number's low byte: the nonces no longer match
        frames[0] = bytes(first)
    elif how == "flags in the head":
        first = bytearray(frames[0])
        first[5] ^= 1  # encrypted <-> authenticated only: a head the sender did not write
        frames[0] = bytes(first)
    elif how == "frame dropped":
        frames = frames[:-1]
    elif how == "frames swapped":
        frames[1], frames[2] = frames[2], frames[1]
    return frames


@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "authenticated"])
@pytest.mark.parametrize("how", ["payload byte", "tag", "sequence in the head", "flags in the head", "frame dropped",
                                 "frames swapped"])
async def test_a_tampered_message_is_refused_and_the_channel_keeps_serving(secure: tuple, encrypt: bool,
                                                                           how: str) -> None:
    receiver, _, member, context = secure
    collector = _Collector(receiver)
    peer = _HandPlayedPeer(receiver, member, context, encrypt=encrypt)
    try:
        await peer.open()
        payload = {"a": torch.arange(2000.0), "b": torch.ones(3000)}
        peer.bulk.send_multipart(_tamper(peer.sealed(payload), how))
        peer.bulk.send_multipart(peer.sealed({"after": 1}))
        assert _payload(await collector.next()) == {"after": 1}
    finally:
        peer.close()
        await collector.aclose()
    assert receiver.statistics().refused == 1 and receiver.statistics().messages == 1


async def test_a_replayed_or_reordered_message_is_refused(secure: tuple) -> None:
    receiver, _, member, context = secure
    collector = _Collector(receiver)
    peer = _HandPlayedPeer(receiver, member, context)
    try:
        await peer.open()
        one, two = peer.sealed({"n": 1}), peer.sealed({"n": 2})
        four, three = peer.sealed({"n": 4}, seq=4), peer.sealed({"n": 3}, seq=3)
        for message in (one, two, two, one, four, three):  # a replay of 2 and of 1; 3 after 4
            peer.bulk.send_multipart(message)
        peer.bulk.send_multipart(peer.sealed({"n": 5}, seq=5))
        received = [_payload(await collector.next())["n"] for _ in range(4)]
    finally:
        peer.close()
        await collector.aclose()
    assert received == [1, 2, 4, 5]
    assert receiver.statistics().refused == 3


async def test_a_stranger_on_the_bulk_socket_gets_nothing_and_changes_nothing(secure: tuple) -> None:
    receiver, _, member, context = secure
    collector = _Collector(receiver)
    peer = _HandPlayedPeer(receiver, member, context)
    stranger = context.socket(zmq.DEALER)
    stranger.connect(bulk_endpoint(receiver.address))
    try:
        await peer.open()
        stranger.send(SessionKey.new().token(CLAIM_MAGIC, 0, b"claim"))  # a session nobody opened
        stranger.send(peer.key.token(CLAIM_MAGIC, 0, b"claim"))  # the member's claim, replayed elsewhere
        stranger.send(peer.key.open_message())  # an opening belongs on CURVE, never here
        stranger.send_multipart([os.urandom(HEAD_BYTES + 16), os.urandom(100)])  # noise shaped like a message
        stranger.send_multipart(SessionKey.new().seal(1, [b"x" * 100]))  # sealed under a key of its own
        stranger.send_multipart(peer.sealed({"n": 1}, seq=1))  # the member's message, sent first by the stranger
        peer.bulk.send_multipart(peer.sealed({"n": 1}, seq=1))  # ...so the member's own copy is a replay
        peer.bulk.send_multipart(peer.sealed({"n": 2}, seq=2))
        first, second = _payload(await collector.next()), _payload(await collector.next())
        assert await _refusals(receiver, 5) == 5
        assert await _poll(stranger, 0.5) is None  # never answered
    finally:
        stranger.close(linger=0)
        peer.close()
        await collector.aclose()
    # The stranger's copy of message 1 opened (it is the member's, sealed by the member): what
    # the stranger cannot do is make anything of its own, or get any byte back.
    assert (first, second) == ({"n": 1}, {"n": 2})
    assert receiver.statistics().messages == 2


async def test_an_opening_twice_and_an_opening_from_outside_the_ring_are_refused(secure: tuple) -> None:
    receiver, server, member, context = secure
    collector = _Collector(receiver)
    peer = _HandPlayedPeer(receiver, member, context)
    outsider = _HandPlayedPeer(receiver, Keypair.generate(), context)  # CURVE refuses its handshake
    try:
        await peer.open()
        peer.control.send(peer.key.open_message())  # the same session again
        try:  # its handshake fails: the opening waits for it, or (once refused) for a peer there is none of
            outsider.control.send(outsider.key.open_message(), zmq.NOBLOCK)
        except zmq.Again:
            pass
        outsider.bulk.send(outsider.key.token(CLAIM_MAGIC, 0, b"claim"))
        outsider.bulk.send_multipart(outsider.sealed({"n": 0}))
        peer.bulk.send_multipart(peer.sealed({"n": 1}))
        assert _payload(await collector.next()) == {"n": 1}
        assert await _refusals(receiver, 2) == 2  # the second opening, the outsider's message
        assert await _poll(outsider.bulk, 0.3) is None
    finally:
        outsider.close()
        peer.close()
        await collector.aclose()


async def test_a_message_over_the_limit_on_the_bulk_socket_is_dropped(secure: tuple) -> None:
    receiver, _, member, context = secure  # max_message_bytes = 4 MiB
    collector = _Collector(receiver)
    peer = _HandPlayedPeer(receiver, member, context)
    try:
        await peer.open()
        peer.bulk.send_multipart(peer.sealed([torch.ones(600_000) for _ in range(3)]))  # 7.2 MB in 3 frames
        assert isinstance(await collector.next(), MessageTooLarge)
        peer.bulk.send_multipart(peer.sealed({"n": 2}))
        assert _payload(await collector.next()) == {"n": 2}
    finally:
        peer.close()
        await collector.aclose()


@pytest.mark.parametrize("encrypt", [True, False])
def test_a_session_key_seals_and_opens_frames_of_every_size(encrypt: bool) -> None:
    key = SessionKey.new(encrypt=encrypt)
    frames = [b"", b"h" * 7, os.urandom(4095), os.urandom(4096), os.urandom(1 << 20)]
    sealed = [bytes(memoryview(f)) for f in key.seal(7, frames)]
    head, session_id, seq, rest = parse_head(sealed[0])  # the head rides on the first frame
    assert (session_id, seq) == (key.session_id, 7) and len(sealed) == len(frames) + (not encrypt)
    opened = key.unseal(head, seq, [rest, *sealed[1:]], "node:n0")
    assert [bytes(memoryview(f.buffer)) for f in opened] == frames
    assert all(f.get("User-Id") == "node:n0" for f in opened)
    big = sealed[-1]
    if encrypt:
        assert len(big) == (1 << 20) + TAG_BYTES and big[: 1 << 10] != frames[-1][: 1 << 10]
    else:  # authenticated only: the bytes go as they are, the tags with the head
        assert big == frames[-1] and len(sealed[0]) == HEAD_BYTES + TAG_BYTES * (len(frames) + 1)  # the head's tag, each frame's
    with pytest.raises(SealRefused):
        SessionKey(key.session_id, os.urandom(32), encrypt=encrypt).unseal(head, seq, [rest, *sealed[1:]], "x")


def test_a_secure_address_carries_its_bulk_endpoint_and_refuses_a_host_name() -> None:
    keys = Keypair.generate()
    address = join_address("tcp://127.0.0.1:5555", keys.public, "tcp://127.0.0.1:5556")
    assert split_address(address) == ("tcp://127.0.0.1:5555", keys.public)
    assert bulk_endpoint(address) == "tcp://127.0.0.1:5556"
    assert bulk_endpoint(join_address("tcp://127.0.0.1:5555", keys.public)) is None
    assert bulk_endpoint(join_address("ipc:///tmp/a/sock", keys.public, "ipc:///tmp/a/sock.bulk")) == (
        "ipc:///tmp/a/sock.bulk"
    )
    with pytest.raises(ValueError, match="bulk part"):
        split_address(join_address("tcp://127.0.0.1:5555", keys.public, "tcp://example.com:5556"))


# -- small messages over CURVE, large ones sealed: one order -----------------------------


@pytest.fixture
def inbox() -> Any:
    """A bulk inbox with a session of ``node:n0`` opened and claimed, and a clock the test moves."""
    context: zmq.Context[Any] = zmq.Context()
    clock = ManualClock()
    box = BulkInbox(context, "tcp://127.0.0.1:*", hwm=16, max_frame_bytes=1 << 20, clock=clock)
    key = SessionKey.new()
    box.on_open(OpenedFrame(key.open_message(), "node:n0"))
    try:
        yield box, key, clock
    finally:
        box.close()
        context.term()


def _bulk(key: SessionKey, seq: int, n: int, *, after_direct: bool = False) -> list[Any]:
    return [b"routing-id", *key.seal(seq, encode_message({"n": n}), after_direct=after_direct)]


def _direct(key: SessionKey, seq: int, n: int, user: str = "node:n0") -> list[Any]:
    return [OpenedFrame(bytes(memoryview(f)), user) if i == 0 else f
            for i, f in enumerate(key.direct(seq, encode_message({"n": n})))]


def _numbers(through: list[list[Any]] | None) -> list[int]:
    return [_payload(message)["n"] for message in through or []]


def test_a_bulk_message_after_one_over_curve_waits_for_it_and_the_ones_behind_it_too(inbox: Any) -> None:
    box, key, _ = inbox
    assert _numbers(box.take(_bulk(key, 2, 2, after_direct=True))) == []  # 1 is still on its way over CURVE
    assert _numbers(box.take(_bulk(key, 3, 3))) == []  # behind 2
    assert _numbers(box.take_direct(_direct(key, 1, 1))) == [1, 2, 3]
    assert _numbers(box.take_direct(_direct(key, 4, 4))) == [4]


def test_a_gap_that_cannot_close_is_not_waited_for(inbox: Any) -> None:
    """Each socket keeps its order: a bulk message after a bulk one that never came (refused,
    say) goes on at once, and so does a message over CURVE, which leaves only once every bulk
    message before it was taken."""
    box, key, _ = inbox
    assert _numbers(box.take(_bulk(key, 2, 2))) == [2]
    assert _numbers(box.take_direct(_direct(key, 4, 4))) == [4]
    with pytest.raises(SealRefused, match="replayed"):
        box.take(_bulk(key, 3, 3))  # too late: handed on past it


def test_a_message_over_curve_lets_the_held_ones_below_it_go_first(inbox: Any) -> None:
    box, key, _ = inbox
    assert _numbers(box.take(_bulk(key, 3, 3, after_direct=True))) == []  # waits for 2 (1 never comes)
    assert _numbers(box.take_direct(_direct(key, 2, 2))) == [2, 3]


def test_held_messages_go_on_once_the_one_they_wait_for_is_given_up(inbox: Any) -> None:
    box, key, clock = inbox
    assert box.seconds_to_give_up() is None
    assert _numbers(box.take(_bulk(key, 2, 2, after_direct=True))) == []
    clock.now += GAP_WAIT_S / 2
    assert _numbers(box.take(_bulk(key, 3, 3))) == [] and box.seconds_to_give_up() == GAP_WAIT_S / 2
    assert box.overdue() == []
    clock.now += GAP_WAIT_S  # the connection that carried 1 broke
    assert _numbers(box.take(_bulk(key, 4, 4))) == []  # a late message does not give up by itself
    assert _numbers(box.overdue()) == [2, 3, 4] and not box.holding  # the owner's timer does
    with pytest.raises(SealRefused):
        box.take_direct(_direct(key, 1, 1))
    assert _numbers(box.take(_bulk(key, 6, 6, after_direct=True))) == []
    for n in range(7, 7 + MAX_HELD):  # too many held: nothing in a healthy session holds so many
        through = box.take(_bulk(key, n, n))
    assert _numbers(through) == list(range(6, 7 + MAX_HELD))


def test_what_will_not_come_is_told_once_naming_its_sender_and_a_strangers_noise_tells_nothing(inbox: Any) -> None:
    """A message known lost is told (``on_lost``) with the session's sender, so that whoever waits for it
    can stop waiting: a gap passed over (over either socket), messages given up on, and a message
    refused on the session's own connection (tampered with on the way), whose gap is not told again
    when the next one comes. A refused message on any other connection, a replay, and numbers in
    order tell nothing: they lose nothing."""
    box, key, clock = inbox
    told: list[tuple[str, str]] = []
    box.on_lost = lambda member, why: told.append((member, why))
    assert box.take([b"routing-id", key.token(CLAIM_MAGIC, 0, b"claim")]) is None  # the session's own connection
    assert _numbers(box.take(_bulk(key, 1, 1))) == [1] and _numbers(box.take_direct(_direct(key, 2, 2))) == [2]
    assert told == []
    assert _numbers(box.take(_bulk(key, 4, 4))) == [4]
    assert told == [("node:n0", "its message 3 never came")]
    with pytest.raises(SealRefused, match="fails its tag"):
        box.take([b"routing-id", *_tamper([bytes(memoryview(f)) for f in _bulk(key, 5, 5)[1:]], "tag")])
    assert told[1:] == [("node:n0", "message 5: frame 0 fails its tag")]
    assert _numbers(box.take(_bulk(key, 6, 6))) == [6] and len(told) == 2  # 5's gap: told as it was refused
    elsewhere = [b"another-connection", *_tamper([bytes(memoryview(f)) for f in _bulk(key, 7, 7)[1:]], "tag")]
    with pytest.raises(SealRefused):
        box.take(elsewhere)
    with pytest.raises(SealRefused, match="replayed"):
        box.take(_bulk(key, 6, 6))
    assert len(told) == 2
    assert _numbers(box.take_direct(_direct(key, 9, 9))) == [9]  # 7 and 8 never came on the session's connection
    assert told[2:] == [("node:n0", "2 of its messages 7 to 8 never came")]
    assert _numbers(box.take(_bulk(key, 11, 11, after_direct=True))) == []  # waits for 10, over CURVE
    clock.now += GAP_WAIT_S + 1
    assert _numbers(box.overdue()) == [11] and told[3:] == [("node:n0", "1 of its messages 10 to 11 never came")]


def test_a_message_over_curve_is_a_sessions_only_with_its_whole_prefix_and_version(inbox: Any) -> None:
    """Anything else over CURVE (a wire message, an opening) is left to its own reader; a message
    that says it is a session's but is cut short, or of another version, is refused."""
    box, key, _ = inbox
    assert box.take_direct(encode_message({"n": 1})) is None
    assert box.take_direct([OpenedFrame(key.open_message(), "node:n0")]) is None
    whole = bytes(memoryview(_direct(key, 1, 1)[0].buffer))
    with pytest.raises(SealRefused, match="shorter than its prefix"):
        box.take_direct([OpenedFrame(whole[:20], "node:n0")])
    with pytest.raises(SealRefused, match="version 2"):
        box.take_direct([OpenedFrame(whole[:4] + bytes([2]) + whole[5:], "node:n0")])
    assert _numbers(box.take_direct(_direct(key, 1, 1))) == [1]  # neither used up a number


def test_a_small_message_is_refused_for_a_session_not_its_senders_or_numbered_again(inbox: Any) -> None:
    box, key, _ = inbox
    with pytest.raises(SealRefused, match="another member"):
        box.take_direct(_direct(key, 1, 1, user="node:n1"))
    with pytest.raises(SealRefused, match="unknown session"):
        box.take_direct(_direct(SessionKey.new(), 1, 1))
    assert _numbers(box.take_direct(_direct(key, 1, 1))) == [1]
    with pytest.raises(SealRefused, match="replayed"):
        box.take_direct(_direct(key, 1, 1))
    with pytest.raises(SealRefused, match="replayed"):
        box.take(_bulk(key, 1, 1))
    assert _numbers(box.take(_bulk(key, 3, 3, after_direct=True))) == []
    with pytest.raises(SealRefused, match="replayed"):
        box.take(_bulk(key, 3, 3, after_direct=True))  # held already


def test_a_taken_word_names_its_number_only_under_its_sessions_key() -> None:
    key = SessionKey.new()
    word = key.taken(42)
    assert key.check_taken(word) == 42
    assert SessionKey(key.session_id, os.urandom(32), encrypt=True).check_taken(word) == 0
    assert key.check_taken(word[:-1] + bytes([word[-1] ^ 1])) == 0
    assert key.check_taken(word.replace((42).to_bytes(8, "big"), (43).to_bytes(8, "big"))) == 0
    assert key.check_taken(key.token(ACK_MAGIC, 1, b"ready")) == 0


class _Routes:
    """Counts how a sender's messages leave: over CURVE, or sealed for the bulk socket."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.direct = self.sealed = 0
        direct, seal = SessionKey.direct, SessionKey.seal

        def counted_direct(key: SessionKey, *args: Any, **kwargs: Any) -> Any:
            self.direct += 1
            return direct(key, *args, **kwargs)

        def counted_seal(key: SessionKey, *args: Any, **kwargs: Any) -> Any:
            self.sealed += 1
            return seal(key, *args, **kwargs)

        monkeypatch.setattr(SessionKey, "direct", counted_direct)
        monkeypatch.setattr(SessionKey, "seal", counted_seal)


async def test_small_and_large_messages_mixed_arrive_in_the_order_sent(secure: tuple,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    receiver, _, member, context = secure
    routes = _Routes(monkeypatch)
    collector = _Collector(receiver)
    sizes = [1, 20_000, 2, 3, 300_000, 5, 4000, 6, 7, 100_000, 8] * 4  # floats: 4 bytes each
    try:
        async with open_sender(receiver.address, curve=member, context=context) as sender:
            for i, size in enumerate(sizes):  # as fast as they go: small ones overtake nothing
                await sender.send({"i": i, "t": torch.full((size,), float(i))}, timeout=20)
            received = [_payload(await collector.next()) for _ in sizes]
    finally:
        await collector.aclose()
    assert [message["i"] for message in received] == list(range(len(sizes)))
    assert all(torch.equal(m["t"], torch.full((size,), float(i))) for i, (m, size) in enumerate(zip(received, sizes)))
    assert routes.direct > 0 and routes.sealed >= sum(size * 4 > DIRECT_MAX_BYTES for size in sizes)
    assert receiver.statistics().refused == 0


async def test_a_small_message_goes_over_curve_only_once_the_large_ones_before_it_were_taken(
        secure: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    receiver, _, member, context = secure
    routes = _Routes(monkeypatch)
    async with open_sender(receiver.address, curve=member, context=context) as sender:
        collector = _Collector(receiver)  # the session opens while the receiver reads
        link = sender._link
        assert link is not None
        try:
            await sender.send({"n": 0}, timeout=20)  # over CURVE at once: it waits for no claim
            assert _payload(await collector.next()) == {"n": 0} and routes.direct == 1
            async with asyncio.timeout(20):  # the bulk socket's claim is answered while the receiver reads
                while not link.advance():
                    await asyncio.sleep(0.01)
        finally:
            await collector.aclose()
        # Nobody reads now: the large message cannot be taken, so the small one goes behind it.
        await sender.send({"n": 1, "t": torch.ones(100_000)}, timeout=20)
        await sender.send({"n": 2}, timeout=20)
        assert (routes.direct, routes.sealed) == (1, 2)
        collector = _Collector(receiver)
        try:
            assert [_payload(await collector.next())["n"] for _ in range(2)] == [1, 2]
            async with asyncio.timeout(20):  # the receiver says it took them once it is drained
                while not link.direct(100):
                    await asyncio.sleep(0.01)
            await sender.send({"n": 3}, timeout=20)
            assert _payload(await collector.next()) == {"n": 3}
        finally:
            await collector.aclose()
    assert (routes.direct, routes.sealed) == (2, 2)


async def test_a_send_that_finds_no_room_leaves_no_gap_in_the_numbers(secure: tuple) -> None:
    receiver, _, member, context = secure
    async with open_sender(receiver.address, curve=member, context=context, hwm=1) as sender:
        collector = _Collector(receiver)
        try:
            await sender.send({"n": 0}, timeout=20)
            await collector.next()
        finally:
            await collector.aclose()
        sent = 1
        with pytest.raises(WouldBlock):  # nobody reads: the queues fill
            for _ in range(100_000):
                sender.send_nowait({"n": sent, "pad": b"x" * 3000})
                sent += 1
        link = sender._link
        assert link is not None and link.seq == sent  # the refused one took no number
        collector = _Collector(receiver)
        try:
            await sender.send({"n": sent}, timeout=20)
            received = [_payload(await collector.next())["n"] for _ in range(sent)]
        finally:
            await collector.aclose()
    assert received == list(range(1, sent + 1))
    assert receiver.statistics().refused == 0


async def test_a_sender_keeps_a_bounded_number_of_bytes_of_ciphertext_queued(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """ZeroMQ's high-water mark counts messages: without a bound in bytes a sender whose receiver
    does not read would queue 64 sealed copies here (128 MiB), each in fresh memory."""
    monkeypatch.setattr(sealed, "UNSENT_MAX_BYTES", 8 << 20)  # four of these messages
    server, member = Keypair.generate(), Keypair.generate()
    context: zmq.Context[Any] = zmq.Context()
    gate = Gate(context, lambda: {member.public: "node:n0"})
    receiver = open_receiver(f"ipc://{tmp_path}/r", hwm=2, context=context, curve=server,
                             max_message_bytes=4 << 20)
    tensors = [torch.full((1 << 19,), float(n)) for n in range(80)]  # 2 MiB each
    try:
        async with open_sender(receiver.address, curve=member, context=context, hwm=64) as sender:
            collector = _Collector(receiver)
            try:
                await sender.send(tensors[0], timeout=20)  # the session opens while the receiver reads
                await collector.next()
            finally:
                await collector.aclose()
            sent = 1
            with pytest.raises(WouldBlock):
                while sent < len(tensors) - 1:
                    sender.send_nowait(tensors[sent])
                    sent += 1
            # The bound's four, and what the receiver's queue and the socket between took meanwhile.
            assert sent - 1 <= 4 + 6, f"{sent - 1} messages of 2 MiB queued"
            collector = _Collector(receiver)
            try:
                await sender.send(tensors[sent], timeout=20)  # waits for ZeroMQ to write some out
                received = [_payload(await collector.next()) for _ in range(sent)]
            finally:
                await collector.aclose()
        assert all(torch.equal(value, tensors[n]) for n, value in enumerate(received, 1))
        assert receiver.statistics().refused == 0
    finally:
        await receiver.aclose()
        gate.stop()
        context.term()


@pytest.mark.parametrize("bulk", ["encrypt", "curve"])
async def test_a_secure_receiver_of_hwm_1_delivers(bulk: str) -> None:
    """libzmq handed nothing on from a CURVE socket of RCVHWM 1: every send waited for ever."""
    server, member = Keypair.generate(), Keypair.generate()
    context: zmq.Context[Any] = zmq.Context()
    gate = Gate(context, lambda: {member.public: "node:n0"})
    receiver = open_receiver(hwm=1, context=context, curve=server, bulk=bulk == "encrypt")
    collector = _Collector(receiver)
    payloads = [{"n": 0}, torch.arange(1 << 18, dtype=torch.float32), {"n": 2}]  # small, 1 MiB, small
    try:
        async with open_sender(receiver.address, curve=member, context=context, bulk=bulk) as sender:  # type: ignore[arg-type]
            for payload in payloads:
                await sender.send(payload, timeout=20)
            received = [_payload(await collector.next()) for _ in payloads]
    finally:
        await collector.aclose()
        await receiver.aclose()
        gate.stop()
        context.term()
    assert received[0] == {"n": 0} and torch.equal(received[1], payloads[1]) and received[2] == {"n": 2}


@pytest.mark.parametrize("reader", ["receive", "pump"])
async def test_messages_held_for_one_that_never_comes_are_handed_on_even_if_nothing_else_comes(
        secure: tuple, reader: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection that carried the message over CURVE broke: the receiver stops waiting for it."""
    import transport.sealed as sealed

    monkeypatch.setattr(sealed, "GAP_WAIT_S", 0.2)
    receiver, _, member, context = secure
    peer = _HandPlayedPeer(receiver, member, context)
    got: asyncio.Queue[Any] = asyncio.Queue()
    collector = None
    if reader == "pump":
        receiver.pump(got.put_nowait)
    else:
        collector = _Collector(receiver)
        got = collector.queue
    try:
        await peer.open()
        frames = [bytes(memoryview(f)) for f in peer.key.seal(2, encode_message({"n": 2}), after_direct=True)]
        peer.bulk.send_multipart(frames)  # 1 went over CURVE, and was lost with its connection
        assert _payload(await asyncio.wait_for(got.get(), 20)) == {"n": 2}
    finally:
        peer.close()
        if collector is not None:
            await collector.aclose()
    assert receiver.statistics().messages == 1


async def test_a_loop_held_up_past_the_deadline_reads_what_came_before_it_gives_up(
        secure: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gap timer fires late (the loop was busy elsewhere, and the message waited for may
    have come meanwhile, unread): it comes back once the loop has read its sockets instead of
    giving up, so nothing is handed on out of order or refused."""
    import transport.sealed as sealed

    monkeypatch.setattr(sealed, "GAP_WAIT_S", 0.2)
    receiver, _, member, context = secure
    peer = _HandPlayedPeer(receiver, member, context)
    got: asyncio.Queue[Any] = asyncio.Queue()
    receiver.pump(got.put_nowait)
    loop = asyncio.get_running_loop()
    try:
        await peer.open()
        peer.bulk.send_multipart([bytes(memoryview(f)) for f in
                                  peer.key.seal(2, encode_message({"n": 2}), after_direct=True)])
        inbox = receiver._bulk
        assert inbox is not None
        async with asyncio.timeout(20):
            while inbox._timer is None:
                await asyncio.sleep(0.01)
        inbox._timer.cancel()  # the timer as a held-up loop would run it: due long ago
        await asyncio.sleep(0.3)  # past GAP_WAIT_S
        inbox._timer_due = loop.time() - 1.0
        inbox._on_timer()
        assert inbox.holding and inbox._timer is not None
        peer.control.send_multipart(peer.key.direct(1, encode_message({"n": 1})))
        received = [_payload(await asyncio.wait_for(got.get(), 20))["n"] for _ in range(2)]
    finally:
        peer.close()
    assert received == [1, 2] and receiver.statistics().refused == 0
