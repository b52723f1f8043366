"""The loop-driven stream link: sealed messages in order, and everything else refused.

The attacks play the peer by hand: a raw connection to the server writes what the test
chooses (no session, a bad tag, a replay, sizes over the limit), and the server must
close that connection, write nothing back, and keep taking a good link's messages.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from transport.sealed import SessionKey
from transport.stream import MAX_FRAMES, StreamBroken, StreamLink, StreamServer, stream_bind_address
from transport.wire import encode_message

pytestmark = pytest.mark.timeout(60)


class Taken:
    def __init__(self) -> None:
        self.payloads: list[Any] = []
        self.refusals: list[str] = []
        self.arrived = asyncio.Event()

    def message(self, payload: Any) -> None:
        self.payloads.append(payload)
        self.arrived.set()

    def refused(self, reason: str) -> None:
        self.refusals.append(reason)
        self.arrived.set()

    async def wait(self, payloads: int = 0, refusals: int = 0) -> None:
        while len(self.payloads) < payloads or len(self.refusals) < refusals:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 30)


@pytest.fixture(params=["ipc", "tcp"])
async def served(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[tuple[StreamServer, Taken]]:
    taken = Taken()
    server = StreamServer(taken.message, max_bytes=8 << 20, on_refused=taken.refused)
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
    await taken.wait(payloads=3, refusals=1)
    assert [p[0] for p in taken.payloads] == ["before", "hello", "after"]
    assert "where 2 was next" in taken.refusals[0]
    good.close()


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
    await asyncio.sleep(0.05)
    assert sending.done() is encrypt  # in the clear it can only end once the peer reads
    loop = asyncio.get_running_loop()
    peer, _ = await loop.sock_accept(listener)
    received = 0
    while not sending.done() or received < 8 << 20:
        received += len(await loop.sock_recv(peer, 1 << 20))
    assert await sending > value.numel() * 4
    link.close()
    peer.close()
    listener.close()
