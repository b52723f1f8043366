"""Tests for transport/channel.py over ipc:// and tcp://, on uvloop and on asyncio's loop."""

from __future__ import annotations

import asyncio
import ipaddress
import os
from collections.abc import AsyncIterator

import pytest
import torch
import zmq
import zmq.asyncio

from tests.helpers.copy_spy import spy_on_copies
from transport.channel import (
    ChannelClosed,
    Receiver,
    Sender,
    WouldBlock,
    open_receiver,
    open_sender,
)
from transport.wire import WireError

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=["ipc://", "tcp://127.0.0.1:0", "tcp://[::1]:0"])  # IPv6 as well: the socket let onto it
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Receiver, Sender]]:
    async with open_receiver(request.param) as rx, open_sender(rx.address) as tx:
        yield rx, tx


async def test_message_with_tensors_arrives_intact(pair: tuple[Receiver, Sender]) -> None:
    rx, tx = pair
    big = torch.randn(4 << 20)  # 16 MiB: above ZeroMQ's copy threshold, travels zero-copy
    await tx.send({"step": 1, "t": [big, torch.arange(3)]})
    message = await rx.receive()
    assert message["step"] == 1
    assert torch.equal(message["t"][0], big) and torch.equal(message["t"][1], torch.arange(3))


async def test_a_large_tensor_is_copied_as_it_is_queued_unless_it_was_handed_over(
    pair: tuple[Receiver, Sender]
) -> None:
    """Not handed over, a tensor may change once send returns (it was copied): the receiver gets
    it as it was. Handed over, ZeroMQ reads it while sending, no copy made (as raw copy=False),
    unless it is below COPY_THRESHOLD (128 KiB), where a copy costs less than a zero-copy frame."""
    rx, tx = pair
    tensor = torch.zeros(1 << 18)  # 1 MiB: past the copy threshold
    with spy_on_copies() as spy:
        for value in range(3):
            tensor.fill_(value)
            await tx.send(tensor)  # the receiver is not reading yet: the messages wait in queues
        tensor.fill_(-1.0)
        await tx.send(tensor, handed_over=True)
        tx.send_nowait(tensor, handed_over=True)
        await tx.send({"small": torch.ones(4)}, handed_over=True)  # below the threshold: copied
        await tx.send(torch.ones(1 << 14), handed_over=True)  # 64 KiB, pyzmq's own threshold: still copied
        await tx.send(torch.ones(1 << 15), handed_over=True)  # 128 KiB: zero-copy
    assert spy.copies == [True, True, True, False, False, True, True, False]
    received = [await rx.receive() for _ in range(8)]
    assert [float(message[0]) for message in received[:3]] == [0.0, 1.0, 2.0]
    assert all(torch.equal(message, tensor) for message in received[3:5])
    assert torch.equal(received[6], torch.ones(1 << 14)) and torch.equal(received[7], torch.ones(1 << 15))


async def test_a_message_of_no_bytes_is_sent_once_and_counted(pair: tuple[Receiver, Sender]) -> None:
    """A send that found room returns the bytes it sent, none here: it must not take that for no room."""
    rx, tx = pair
    assert await asyncio.wait_for(tx.send_frames([b""]), 20) == 0
    assert tx.send_frames_nowait([b""]) == 0
    assert [bytes(frame.buffer) for frame in await rx.receive_frames()] == [b""]
    assert [bytes(frame.buffer) for frame in await rx.receive_frames()] == [b""]
    assert tx.statistics().messages == 2


async def test_order_is_kept(pair: tuple[Receiver, Sender]) -> None:
    rx, tx = pair

    async def produce() -> None:
        for i in range(200):
            await tx.send({"i": i, "t": torch.full((16,), float(i))})

    async with asyncio.TaskGroup() as tg:
        tg.create_task(produce())
        seen = [(await rx.receive()) for _ in range(200)]
    assert [m["i"] for m in seen] == list(range(200))
    assert all(m["t"][0].item() == m["i"] for m in seen)


async def test_tcp_port_zero_resolves_to_a_real_port() -> None:
    async with open_receiver("tcp://127.0.0.1:0") as rx:
        assert rx.address.startswith("tcp://127.0.0.1:") and not rx.address.endswith(":0")
        assert int(rx.address.rsplit(":", 1)[1]) > 0


@pytest.mark.parametrize("wildcard", ["tcp://0.0.0.0:0", "tcp://*:0", "tcp://[::]:0"])
async def test_a_receiver_bound_to_every_address_names_one_a_peer_can_reach(wildcard: str) -> None:
    """Its address named the wildcard (``tcp://0.0.0.0:P``), which a peer on another machine cannot
    connect to; it is now this host's address on its default route (tests/actors/test_remote.py
    trains across two network namespaces so)."""
    async with open_receiver(wildcard, allow_remote=True) as rx:
        host = rx.address.removeprefix("tcp://").rpartition(":")[0]
        assert not ipaddress.ip_address(host.strip("[]")).is_unspecified, rx.address
        async with open_sender(rx.address) as tx:
            await tx.send({"here": True})
            assert await asyncio.wait_for(rx.receive(), 10) == {"here": True}


async def test_ipc_socket_file_and_folder_are_removed_on_close() -> None:
    rx = open_receiver("ipc://")
    path = rx.address.removeprefix("ipc://")
    assert os.path.exists(path)
    await rx.aclose()
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:0", "tcp://*:0", "tcp://10.1.2.3:0", "tcp://example.com:1"])
def test_binding_beyond_loopback_needs_consent(address: str) -> None:
    with pytest.raises(ValueError, match="allow_remote=True"):
        open_receiver(address)


@pytest.mark.parametrize("address", ["127.0.0.1:5", "udp://127.0.0.1:5", "tcp://127.0.0.1"])
def test_malformed_address_is_a_value_error(address: str) -> None:
    with pytest.raises(ValueError):
        open_receiver(address)


async def test_slow_receiver_applies_backpressure() -> None:
    payload = torch.zeros(1 << 18)  # 1 MiB
    async with open_receiver("ipc://", hwm=2) as rx, open_sender(rx.address, hwm=2) as tx:
        await tx.send(payload)  # connection is up once one message went through
        await rx.receive()
        sent = 0
        with pytest.raises(TimeoutError):
            while sent < 1000:  # the receiver never reads: sending must stall, not queue
                await tx.send(payload, timeout=0.2)
                sent += 1
        assert sent < 100, f"{sent} MiB queued for a receiver that does not read"
        with pytest.raises(WouldBlock):
            tx.send_nowait(payload)
        for _ in range(sent):
            await rx.receive()
        await tx.send(payload, timeout=5)  # room again once the receiver caught up
        await rx.receive()


async def test_send_to_an_absent_peer_times_out_instead_of_queueing(tmp_path: object) -> None:
    async with open_sender(f"ipc://{tmp_path}/nobody") as tx:
        with pytest.raises(TimeoutError, match="within 0.05s"):
            await tx.send({"x": 1}, timeout=0.05)
        with pytest.raises(WouldBlock):
            tx.send_nowait({"x": 1})


async def test_malformed_frames_raise_wire_error_and_the_channel_keeps_serving() -> None:
    async with open_receiver("ipc://") as rx, open_sender(rx.address) as tx:
        raw = zmq.asyncio.Context.instance().socket(zmq.PUSH)
        try:
            raw.connect(rx.address)
            await raw.send_multipart([b"\xc1garbage", b"frame"])
            with pytest.raises(WireError):
                await rx.receive()
            await tx.send({"ok": True})
            assert await rx.receive() == {"ok": True}
        finally:
            raw.close(linger=0)


async def test_statistics_count_messages_and_bytes(pair: tuple[Receiver, Sender]) -> None:
    rx, tx = pair
    nbytes = await tx.send(torch.zeros(256))
    await rx.receive()
    assert nbytes > 1024
    assert tx.statistics().messages == 1 and tx.statistics().bytes == nbytes
    assert rx.statistics().messages == 1 and rx.statistics().bytes == nbytes


async def test_closed_ends_raise_channel_closed() -> None:
    rx = open_receiver("ipc://")
    tx = open_sender(rx.address)
    await tx.aclose()
    await rx.aclose()
    with pytest.raises(ChannelClosed):
        await tx.send({"x": 1})
    with pytest.raises(ChannelClosed):
        await rx.receive()


async def test_close_wakes_a_pending_receive() -> None:
    rx = open_receiver("ipc://")
    waiter = asyncio.ensure_future(rx.receive())
    await asyncio.sleep(0)
    await rx.aclose()
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(waiter, 5)
