"""The loop-driven stream link: sealed messages in order, and everything else refused.

The attacks play the peer by hand: a raw connection to the server writes what the test
chooses (no session, a bad tag, a replay, sizes over the limit), and the server must
close that connection, write nothing back, and keep taking a good link's messages.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

import transport.stream as stream_module
from transport.sealed import SessionKey
from transport.stream import MAX_FRAMES, SEAL_AWAY_BYTES, StreamBroken, StreamLink, StreamServer, stream_bind_address
from transport.wire import encode_message

pytestmark = pytest.mark.timeout(60)


class Taken:
    def __init__(self) -> None:
        self.payloads: list[Any] = []
        self.refusals: list[str] = []
        self.losses: list[tuple[str, str]] = []  # (sender, why): on_lost
        self.arrived = asyncio.Event()

    def message(self, payload: Any) -> None:
        self.payloads.append(payload)
        self.arrived.set()

    def refused(self, reason: str) -> None:
        self.refusals.append(reason)
        self.arrived.set()

    def lost(self, sender: str, why: str) -> None:
        self.losses.append((sender, why))
        self.arrived.set()

    async def wait(self, payloads: int = 0, refusals: int = 0, losses: int = 0) -> None:
        while len(self.payloads) < payloads or len(self.refusals) < refusals or len(self.losses) < losses:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 30)


@pytest.fixture(params=["ipc", "tcp"])
async def served(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[tuple[StreamServer, Taken]]:
    taken = Taken()
    server = StreamServer(taken.message, max_bytes=8 << 20, on_refused=taken.refused, on_lost=taken.lost)
    endpoint = f"ipc://{tmp_path}/sock" if request.param == "ipc" else "tcp://127.0.0.1:5555"
    await server.start(endpoint)
    yield server, taken
    server.close()


async def open_link(server: StreamServer, sender: str = "node:a", *, encrypt: bool = True) -> StreamLink:
    key = SessionKey.new(encrypt=encrypt)
    server.open(key.open_message(), sender)
    assert server.address is not None
    return await StreamLink.connect(server.address, key)


async def raw(server: StreamServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    assert server.address is not None
    scheme, _, rest = server.address.partition("://")
    if scheme == "ipc":
        return await asyncio.open_unix_connection(rest)
    host, _, port = rest.rpartition(":")
    return await asyncio.open_connection(host, int(port))


def framed(frames: list[Any]) -> bytes:
    views = [memoryview(f).cast("B") for f in frames]
    return struct.pack(f"<I{len(views)}I", len(views), *(v.nbytes for v in views)) + b"".join(bytes(v) for v in views)


async def closed_without_answer(reader: asyncio.StreamReader) -> None:
    assert await asyncio.wait_for(reader.read(), 30) == b""  # EOF: closed, and nothing was written back


@pytest.mark.parametrize("encrypt", [True, False])
async def test_messages_arrive_in_order_with_their_tensors(served: tuple[StreamServer, Taken], encrypt: bool) -> None:
    server, taken = served
    link = await open_link(server, encrypt=encrypt)
    big = torch.randn(1 << 18)  # 1 MiB: read straight into its buffer
    sent = [[0, "F", 1, 0, [torch.arange(6.0).view(2, 3)], {"s": 1}],
            [0, "F", 1, 1, [big, torch.empty(0)], None],
            [1, "B", 0, 3, [], "x" * 70_000]]
    for payload in sent:
        assert await link.send(encode_message(payload)) > 0
    await taken.wait(payloads=3)
    for got, want in zip(taken.payloads, sent):
        assert got[:4] == want[:4] and got[5] == want[5]
        assert len(got[4]) == len(want[4]) and all(torch.equal(a, b) for a, b in zip(got[4], want[4]))
    assert taken.refusals == []
    link.close()


async def test_many_small_messages_split_across_reads(served: tuple[StreamServer, Taken]) -> None:
    server, taken = served
    link = await open_link(server)
    for index in range(300):
        await link.send(encode_message([index, torch.full((index % 7,), float(index))]))
    await taken.wait(payloads=300)
    assert [p[0] for p in taken.payloads] == list(range(300))
    assert all(torch.equal(p[1], torch.full((i % 7,), float(i))) for i, p in enumerate(taken.payloads))
    link.close()


async def attack(server: StreamServer, taken: Taken, data: bytes, reason: str) -> None:
    reader, writer = await raw(server)
    writer.write(data)
    await writer.drain()
    await closed_without_answer(reader)
    writer.close()
    await taken.wait(refusals=1)
    assert reason in taken.refusals[-1]
    taken.refusals.clear()


async def test_a_flood_of_bad_connections_is_counted_and_logged_sparsely(
    served: tuple[StreamServer, Taken], caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that reconnects and sends garbage in a loop filled the log with a warning a connection;
    now the 1st, 2nd, 4th, 8th... refusal is logged, with the count, and every one is counted."""
    server, taken = served
    with caplog.at_level(logging.WARNING, logger="transport.stream"):
        for _ in range(40):
            await attack(server, taken, framed([b"not a sealed message head"]), "")
    warnings = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert server.refusals == 40
    assert [w.partition("(")[2].partition(" so far")[0] for w in warnings] == ["1", "2", "4", "8", "16", "32"]
    link = await open_link(server)  # and it goes on serving
    await link.send(encode_message(["after"]))
    await taken.wait(payloads=1)
    assert taken.payloads[-1] == ["after"]
    link.close()


async def test_bad_input_closes_that_connection_only(served: tuple[StreamServer, Taken]) -> None:
    server, taken = served
    good = await open_link(server)
    await good.send(encode_message(["before"]))
    key = SessionKey.new()
    server.open(key.open_message(), "node:b")
    message = key.seal(1, encode_message(["hello"]))
    await attack(server, taken, struct.pack("<I", 0), "0 frames")
    await attack(server, taken, struct.pack("<I", MAX_FRAMES + 1), "frames")
    await attack(server, taken, struct.pack("<II", 1, 1 << 30), "over the limit")
    await attack(server, taken, framed(SessionKey.new().seal(1, encode_message(["x"]))), "no session")
    tampered = [bytearray(memoryview(f).cast("B")) for f in message]
    tampered[0][-1] ^= 1
    await attack(server, taken, framed(tampered), "fails its tag")
    await attack(server, taken, framed(key.seal(2, encode_message(["skips one"]))), "where 1 was next")
    # The session is still to be had, and a good link's messages still come, in order.
    reader, writer = await raw(server)
    writer.write(framed(message))
    writer.write(framed(key.seal(1, encode_message(["replayed"]))))
    await good.send(encode_message(["after"]))
    await closed_without_answer(reader)
    writer.close()
    await taken.wait(payloads=3, refusals=1, losses=1)
    assert [p[0] for p in taken.payloads] == ["before", "hello", "after"]
    assert "where 2 was next" in taken.refusals[0]
    # A message of a proven session was refused: its receiver hears that something of node:b's was
    # lost. The strangers' refusals above proved no session, and lost nobody's message.
    assert len(taken.losses) == 1 and taken.losses[0][0] == "node:b" and "where 2 was next" in taken.losses[0][1]
    good.close()


async def test_a_session_whose_connection_ends_mid_message_is_reported_lost(served: tuple[StreamServer, Taken]) -> None:
    """What a sender wrote before a clean close all came; a connection that ends inside a message (its
    sender died, or the path broke) lost that message, which its receiver would otherwise wait for until
    a timeout. The receiver is told whose session it was (``on_lost``)."""
    server, taken = served
    key = SessionKey.new()
    server.open(key.open_message(), "node:b")
    reader, writer = await raw(server)
    writer.write(framed(key.seal(1, encode_message(["whole"]))))  # proves the session
    await taken.wait(payloads=1)
    writer.write(framed(key.seal(2, encode_message(["cut", torch.ones(1000)])))[:-100])
    await writer.drain()
    writer.close()
    await taken.wait(losses=1)
    assert taken.losses[0][0] == "node:b" and "middle of a message" in taken.losses[0][1]
    # A link closed by its sender after whole messages lost nothing.
    link = await open_link(server, "node:c")
    await link.send(encode_message(["all of it"]))
    link.close()
    await taken.wait(payloads=2)
    for _ in range(3000):
        if not server._connections:  # the server saw that connection end
            break
        await asyncio.sleep(0.01)
    assert not server._connections and len(taken.losses) == 1


async def test_a_bound_session_is_not_taken_by_another_connection(served: tuple[StreamServer, Taken]) -> None:
    server, taken = served
    key = SessionKey.new()
    server.open(key.open_message(), "node:a")
    assert server.address is not None
    link = await StreamLink.connect(server.address, key)
    await link.send(encode_message([1]))
    await taken.wait(payloads=1)
    await attack(server, taken, framed(key.seal(2, encode_message([2]))), "another connection")
    await link.send(encode_message([3]))  # the numbers the intruder used are its own: 2 comes from the link
    await taken.wait(payloads=2)
    assert [p[0] for p in taken.payloads] == [1, 3]
    link.close()


async def test_a_refused_link_fails_its_sender_with_a_named_error(served: tuple[StreamServer, Taken]) -> None:
    server, taken = served
    link = await open_link(server, "node:a")
    await link.send(encode_message([1]))
    await taken.wait(payloads=1)
    await open_link(server, "node:a")  # the same sender opens afresh: its old session and connection go
    with pytest.raises(StreamBroken, match="closed"):
        for _ in range(1000):  # the close reaches the sender after some sends at most
            await link.send(encode_message([2]))
            await asyncio.sleep(0.001)


async def test_a_message_over_the_limit_is_refused(served: tuple[StreamServer, Taken]) -> None:
    server, taken = served
    link = await open_link(server)
    with pytest.raises(StreamBroken):
        for _ in range(100):
            await link.send(encode_message([torch.zeros(3 << 20)]))  # 12 MiB, over the 8 MiB limit
            await asyncio.sleep(0.01)
    await taken.wait(refusals=1)
    assert "over the limit" in taken.refusals[0]
    assert taken.payloads == []


async def test_unreachable_server_is_a_named_error(tmp_path: Any) -> None:
    with pytest.raises(StreamBroken, match="cannot reach"):
        await StreamLink.connect(f"ipc://{tmp_path}/nothing", SessionKey.new())


async def test_close_removes_the_socket_file(tmp_path: Any) -> None:
    server = StreamServer(lambda payload: None)
    address = await server.start(f"ipc://{tmp_path}/sock")
    path = address.partition("://")[2]
    assert os.path.exists(path) and os.path.dirname(path) == str(tmp_path)
    server.close()
    assert not os.path.exists(path)


def test_bind_address_stays_beside_the_runtime() -> None:
    assert stream_bind_address("tcp://127.0.0.1:4000") == ("tcp://127.0.0.1:0", None)
    assert stream_bind_address("tcp://[::1]:4000") == ("tcp://[::1]:0", None)
    address, folder = stream_bind_address("ipc:///run/x/sock")
    assert address.startswith("ipc:///run/x/stream-") and folder is None


async def test_a_path_too_long_binds_in_a_folder_of_its_own_that_close_removes() -> None:
    server = StreamServer(lambda payload: None)
    address = await server.start("ipc:///" + "d" * 100 + "/sock")
    path = address.partition("://")[2]
    assert len(path) <= 107 and os.path.exists(path)
    server.close()
    assert not os.path.exists(os.path.dirname(path))


@pytest.mark.parametrize("encrypt", [True, False])
async def test_an_encrypted_send_is_queued_and_a_clear_one_waits_for_the_kernel(tmp_path: Any, encrypt: bool) -> None:
    """Encrypted, the bytes written are the seal's own copy: the send returns with them queued and
    the stage computes on. In the clear they are the caller's tensors: it returns once the kernel
    took them all, so the caller may reuse them."""
    path = f"{tmp_path}/held"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # accepts nothing, reads nothing until told
    listener.bind(path)
    listener.listen(1)
    listener.setblocking(False)
    link = await StreamLink.connect(f"ipc://{path}", SessionKey.new(encrypt=encrypt))
    value = torch.ones(2 << 20)  # 8 MiB: more than a socket's buffers hold
    sending = asyncio.ensure_future(link.send(encode_message([value])))
    if encrypt:  # queued (perhaps sealed on the worker first): it ends though the peer reads nothing
        await asyncio.wait_for(asyncio.shield(sending), 30)
    else:  # in the clear it can only end once the peer reads
        await asyncio.sleep(0.05)
        assert not sending.done()
    loop = asyncio.get_running_loop()
    peer, _ = await loop.sock_accept(listener)
    received = 0
    while not sending.done() or received < 8 << 20:
        received += len(await loop.sock_recv(peer, 1 << 20))
    assert await sending > value.numel() * 4
    link.close()
    peer.close()
    listener.close()


class SlowSeals:
    """SessionKey.seal, slowed on the worker thread (so what is sent meanwhile must wait behind it),
    with the thread each message was sealed on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds: float = 0.2) -> None:
        self.threads: dict[int, str] = {}  # message number -> the thread that sealed it
        seal = SessionKey.seal

        def slow(key: SessionKey, seq: int, frames: list[Any], **kwargs: Any) -> list[Any]:
            self.threads[seq] = threading.current_thread().name
            if threading.current_thread() is not threading.main_thread():
                time.sleep(seconds)
            return seal(key, seq, frames, **kwargs)

        monkeypatch.setattr(SessionKey, "seal", slow)
        monkeypatch.setattr(stream_module, "_seal_away_bytes", lambda sock: SEAL_AWAY_BYTES)


async def test_a_large_message_sealed_away_keeps_its_place(served: tuple[StreamServer, Taken],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A large encrypted message is sealed on the worker while the loop goes on; what is sent
    meanwhile (by send or try_send) leaves after it, and a cancelled send's message still leaves."""
    server, taken = served
    seals = SlowSeals(monkeypatch)
    link = await open_link(server)
    big = torch.randn(SEAL_AWAY_BYTES // 4 + 1)
    first = asyncio.ensure_future(link.send(encode_message(["first", big])))
    await asyncio.sleep(0)  # it numbered its message and handed it to the worker
    assert link.try_send(encode_message(["second"])) is not None  # queued behind it
    third = asyncio.ensure_future(link.send(encode_message(["third"])))
    fourth = asyncio.ensure_future(link.send(encode_message(["fourth", big * 2])))
    await asyncio.sleep(0)
    fourth.cancel()  # the caller gives up: the message is numbered, so it still leaves, in its place
    fifth = asyncio.ensure_future(link.send(encode_message(["fifth"])))
    assert await first > big.numel() * 4 and await third > 0 and await fifth > 0
    await taken.wait(payloads=5)
    assert [payload[0] for payload in taken.payloads] == ["first", "second", "third", "fourth", "fifth"]
    assert torch.equal(taken.payloads[0][1], big) and torch.equal(taken.payloads[3][1], big * 2)
    assert [seals.threads[seq] for seq in sorted(seals.threads)] == [
        "stream-seal_0", "MainThread", "MainThread", "stream-seal_0", "MainThread"]
    assert taken.refusals == []
    link.close()


async def test_closing_a_link_fails_a_send_still_being_sealed(served: tuple[StreamServer, Taken],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    server, taken = served
    SlowSeals(monkeypatch)
    link = await open_link(server)
    await link.send(encode_message(["before"]))
    sending = asyncio.ensure_future(link.send(encode_message([torch.ones(SEAL_AWAY_BYTES // 4)])))
    await asyncio.sleep(0)
    link.close()
    with pytest.raises(StreamBroken, match="closed here"):
        await asyncio.wait_for(sending, 30)
    await asyncio.sleep(0.01)  # the connection's end has come back by now, most likely
    with pytest.raises(StreamBroken, match="closed here"):
        await link.send(encode_message(["after"]))
    await taken.wait(payloads=1)  # what was written before it still left
    assert taken.payloads == [["before"]] and taken.refusals == []


async def test_a_seal_that_fails_on_the_worker_fails_its_send_and_the_link(served: tuple[StreamServer, Taken],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    server, taken = served
    monkeypatch.setattr(stream_module, "_seal_away_bytes", lambda sock: SEAL_AWAY_BYTES)
    seal = SessionKey.seal

    def failing(key: SessionKey, seq: int, frames: list[Any], **kwargs: Any) -> list[Any]:
        if threading.current_thread() is not threading.main_thread():
            raise MemoryError("no room for the sealed copy")
        return seal(key, seq, frames, **kwargs)

    monkeypatch.setattr(SessionKey, "seal", failing)
    link = await open_link(server)
    await link.send(encode_message(["before"]))
    with pytest.raises(StreamBroken, match="sealing a message failed: MemoryError"):
        await asyncio.wait_for(link.send(encode_message([torch.ones(SEAL_AWAY_BYTES // 4)])), 30)
    with pytest.raises(StreamBroken, match="sealing a message failed"):
        await link.send(encode_message(["after"]))
    await taken.wait(payloads=1)
    assert taken.payloads == [["before"]]


def test_a_unix_link_seals_away_only_where_the_kernel_keeps_its_buffer_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel grants a Unix socket's send buffer up to net.core.wmem_max: granted, the buffer
    carries the receiver through a seal on the loop; refused, large messages are sealed away."""
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with here, there:
        monkeypatch.setattr(stream_module, "SEND_BUFFER_BYTES", 64 << 10)  # below any wmem_max
        assert stream_module._seal_away_bytes(here) is None
        assert here.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 64 << 10
        monkeypatch.setattr(stream_module, "SEND_BUFFER_BYTES", 1 << 30)  # above any wmem_max
        assert stream_module._seal_away_bytes(there) == SEAL_AWAY_BYTES
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        before = tcp.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert stream_module._seal_away_bytes(tcp) == SEAL_AWAY_BYTES
        assert tcp.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == before  # TCP sizes its own
