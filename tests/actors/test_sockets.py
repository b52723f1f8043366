"""Tests for actors/_senders.py: the runtime's outgoing sockets stay bounded.

The pool on its own (least recently used out, idle expiry, a sender in use never
closed under its caller, replies dropped after their timeout), then a runtime under
5,000 short-lived clients and under requests with made-up reply addresses.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from actors import open_runtime
from actors._senders import SenderPool, SenderPoolConfig, _is_numeric_address
from actors.probe import ProbeActor
from tests.helpers.clock import ManualClock
from transport.channel import ChannelClosed, Receiver, open_receiver, open_sender
from transport.wire import encode_message

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts file descriptors in /proc"),
]


def _num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _yield_until(condition: Callable[[], bool], *, max_turns: int = 100) -> None:
    """Lets other tasks run until ``condition`` holds (loop turns, not time)."""
    for _ in range(max_turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not reached within {max_turns} loop turns")


@pytest.fixture
async def context() -> AsyncIterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
async def receivers(context: zmq.Context[Any]) -> AsyncIterator[list[Receiver]]:
    rxs = [open_receiver("ipc://", context=context) for _ in range(3)]
    yield rxs
    for rx in rxs:
        await rx.aclose()


@pytest.fixture
def dead(tmp_path: Path) -> str:
    """An address nobody listens at."""
    return f"ipc://{tmp_path}/nobody"


@pytest.fixture
async def make_pool(context: zmq.Context[Any]) -> AsyncIterator[Callable[..., SenderPool]]:
    pools: list[SenderPool] = []

    def make(clock: Callable[[], float] = time.monotonic, **config: Any) -> SenderPool:
        pool = SenderPool(
            lambda address: open_sender(address, linger_ms=0, context=context),
            SenderPoolConfig(**config),
            spawn_task=asyncio.get_running_loop().create_task,  # the pool owns and cancels them
            clock=clock,
        )
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.aclose()


def _frames(value: Any) -> list[Any]:
    return encode_message({"t": "rep", "id": 1, "ok": True, "v": value})


# -- the pool ------------------------------------------------------------------------


async def test_the_least_recently_used_idle_sender_makes_room(
    make_pool: Callable[..., SenderPool], receivers: list[Receiver]
) -> None:
    a, b, c = receivers
    pool = make_pool(max_senders=2)
    for rx, value in [(a, 1), (b, 2), (a, 3), (c, 4), (b, 5)]:
        await pool.send_frames(rx.address, encode_message({"v": value}))
    # a, b; a again; c evicts b (least recently used); b again evicts a.
    stats = pool.statistics()
    assert stats.addresses == (c.address, b.address)
    assert (stats.num_open, stats.num_opened, stats.num_evicted) == (2, 4, 2)
    assert [(await a.receive())["v"], (await a.receive())["v"]] == [1, 3]
    assert [(await b.receive())["v"], (await b.receive())["v"]] == [2, 5]
    assert (await c.receive())["v"] == 4


async def test_a_sender_in_use_is_never_closed_to_make_room(
    make_pool: Callable[..., SenderPool], receivers: list[Receiver], dead: str
) -> None:
    pool = make_pool(max_senders=1)
    stuck = asyncio.get_running_loop().create_task(pool.send_frames(dead, encode_message({"v": 1})))  # waits for a peer
    await _yield_until(lambda: pool.statistics().num_in_use == 1)
    assert await pool.acquire(receivers[0].address, wait=False) is None
    waiter = asyncio.get_running_loop().create_task(pool.acquire(receivers[0].address))
    await asyncio.sleep(0)
    assert not waiter.done() and not stuck.done()  # neither closed under the send nor let past the bound

    stuck.cancel()  # the send ends (its caller gave up): now its sender may go
    await asyncio.gather(stuck, return_exceptions=True)
    entry = await waiter
    assert entry is not None and entry.address == receivers[0].address
    await pool.release(entry)
    assert pool.statistics().addresses == (receivers[0].address,)


async def test_a_reply_to_a_peer_that_never_came_gives_its_socket_up(
    make_pool: Callable[..., SenderPool], receivers: list[Receiver], dead: str
) -> None:
    pool = make_pool(max_senders=1, reply_timeout_s=60)
    waiting = await pool.reply(dead, _frames("lost"))
    assert waiting is not None
    await _yield_until(lambda: pool.statistics().num_in_use == 1)
    await pool.send_frames(receivers[0].address, encode_message({"v": "ask"}))  # needs the one socket: the reply is dropped
    await waiting
    assert (await receivers[0].receive())["v"] == "ask"
    stats = pool.statistics()
    assert (stats.num_dropped_replies, stats.num_open, stats.addresses) == (1, 1, (receivers[0].address,))


async def test_a_reply_nobody_takes_is_dropped_after_its_timeout_and_its_socket_closed(
    make_pool: Callable[..., SenderPool], dead: str, caplog: pytest.LogCaptureFixture
) -> None:
    pool = make_pool(reply_timeout_s=0.05)
    waiting = await pool.reply(dead, _frames("lost"))
    assert waiting is not None
    await waiting
    stats = pool.statistics()
    assert (stats.num_dropped_replies, stats.num_open, stats.num_waiting_replies) == (1, 0, 0)
    assert "no peer took it within 0.05s" in caplog.text


@pytest.mark.parametrize(
    "num_addresses,max_waiting_replies,num_waiting",
    [
        (1, 1024, 64),  # one peer that does not read: 64 wait, the rest are dropped
        (70, 10, 10),  # many: the pool's bound
    ],
)
async def test_waiting_replies_are_bounded(
    make_pool: Callable[..., SenderPool], tmp_path: Path, num_addresses: int, max_waiting_replies: int,
    num_waiting: int,
) -> None:
    pool = make_pool(reply_timeout_s=60, max_waiting_replies=max_waiting_replies)
    for i in range(70):
        await pool.reply(f"ipc://{tmp_path}/nobody-{i % num_addresses}", _frames(i))
    stats = pool.statistics()
    assert (stats.num_waiting_replies, stats.num_dropped_replies) == (num_waiting, 70 - num_waiting)


async def test_a_reply_leaves_at_once_on_a_connected_sender(
    make_pool: Callable[..., SenderPool], receivers: list[Receiver]
) -> None:
    pool = make_pool()
    first = await pool.reply(receivers[0].address, _frames(1))  # not connected yet: from a task
    if first is not None:
        await first
    assert await pool.reply(receivers[0].address, _frames(2)) is None
    assert [(await receivers[0].receive())["v"] for _ in range(2)] == [1, 2]


async def test_idle_senders_expire_but_not_while_in_use(
    make_pool: Callable[..., SenderPool], receivers: list[Receiver]
) -> None:
    clock = ManualClock(1000.0)
    pool = make_pool(clock=clock, idle_timeout_s=30)
    a, b, _ = receivers
    await pool.send_frames(a.address, encode_message({"v": 1}))
    held = await pool.acquire(b.address)
    assert held is not None
    clock.now += 29
    assert await pool.evict_idle() == 0
    clock.now += 100
    assert await pool.evict_idle() == 1  # a; b is in use however old
    assert pool.statistics().addresses == (b.address,)
    await pool.release(held)
    assert await pool.evict_idle(now=clock.now + 31) == 1
    stats = pool.statistics()
    assert (stats.num_open, stats.num_expired) == (0, 2)


@pytest.mark.parametrize(
    "address,why",
    [
        ("tcp://no-such-host.invalid:1", "not a numeric"),  # a name lookup would block libzmq's I/O thread
        ("garbage", "not a numeric"),
        ("tcp://127.0.0.1:1;eth0", "not a numeric"),
        ("ipc:///" + "\n\x1b[31m" + "x" * 5000, "cannot connect: File name too long"),
    ],
)
async def test_a_reply_to_a_bad_address_is_dropped_at_once_and_logged_short(
    make_pool: Callable[..., SenderPool], caplog: pytest.LogCaptureFixture, address: str, why: str
) -> None:
    pool = make_pool()
    assert await pool.reply(address, _frames(None)) is None
    assert pool.statistics().num_dropped_replies == 1 and pool.statistics().num_open == 0
    (record,) = [r for r in caplog.records if r.name == "actors._senders"]
    line = record.getMessage()
    assert why in line and len(line) < 300 and "\n" not in line and "\x1b" not in line


@pytest.mark.parametrize(
    "address,numeric",
    [
        ("ipc:///tmp/x/sock", True),
        ("tcp://127.0.0.1:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://10.0.0.1:5555|" + "ab" * 32, True),
        ("tcp://localhost:5555", False),
        ("tcp://*:5555", False),
        ("tcp://127.0.0.1", False),
        ("ipc://", False),
        ("udp://127.0.0.1:5555", False),
    ],
)
def test_numeric_addresses(address: str, numeric: bool) -> None:
    assert _is_numeric_address(address) is numeric


async def test_a_closed_pool_refuses(make_pool: Callable[..., SenderPool], receivers: list[Receiver]) -> None:
    pool = make_pool()
    await pool.send_frames(receivers[0].address, encode_message({"v": 1}))
    await pool.aclose()
    assert pool.statistics().num_open == 0
    with pytest.raises(ChannelClosed):
        await pool.acquire(receivers[0].address)
    assert await pool.reply(receivers[0].address, _frames(1)) is None


@pytest.mark.parametrize(
    "config", [{"max_senders": 0}, {"idle_timeout_s": 0}, {"reply_timeout_s": -1}, {"max_waiting_replies": -1}]
)
def test_config_refuses_nonsense(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SenderPoolConfig(**config)


# -- a runtime ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_5000_short_lived_clients_all_get_answers_and_the_fds_stay_flat() -> None:
    config = SenderPoolConfig(max_senders=16)
    async with open_runtime("ipc://", sender_pool=config) as server:
        await server.spawn(ProbeActor(), "probe")

        async def lane(bind: str, num_clients: int) -> int:
            answered = 0
            for _ in range(num_clients):
                async with open_runtime(bind) as client:
                    await client.ref(server.address, "probe").ask("ping", timeout=10)
                answered += 1
            return answered

        await lane("ipc://", 1)  # the first sender starts the pool's sweep
        before = _num_fds()
        binds = ["ipc://", "tcp://127.0.0.1:0"] * 2
        answered = await asyncio.gather(*(lane(bind, 5000 // len(binds)) for bind in binds))
        assert sum(answered) == 5000
        assert server._senders.statistics().num_open <= config.max_senders
        # Each client's sender stays until evicted: the count grows by at most the bound.
        assert _num_fds() - before <= config.max_senders + 8
        assert await server._senders.evict_idle(now=math.inf) == server._senders.statistics().num_expired > 0
        assert server._senders.statistics().num_open == 0


@pytest.fixture
def refusing_ports() -> Iterator[list[int]]:
    """Loopback ports bound but not listening: connections are refused, and no one else gets them."""
    sockets = [socket.socket() for _ in range(366)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        yield [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _made_up_reply_addresses(tmp_path: Path, ports: list[int], count: int) -> list[str]:
    junk = ["garbage", "tcp://no-such-host.invalid:1", "ipc:///" + "\n\x1b" + "x" * 900]  # too long a path
    tcp = [f"tcp://127.0.0.1:{port}" for port in ports]
    ipc = [f"ipc://{tmp_path}/gone-{i}" for i in range(count - len(tcp) - len(junk))]
    return [*junk, *tcp, *ipc]


async def test_requests_with_made_up_reply_addresses_leave_the_node_answering_within_bounds(
    tmp_path: Path, refusing_ports: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    # A long reply timeout: the node must keep answering without waiting for it to pass.
    config = SenderPoolConfig(reply_timeout_s=60)
    caplog.set_level(logging.WARNING, logger="actors._senders")
    async with open_runtime("ipc://", sender_pool=config) as server:
        await server.spawn(ProbeActor(), "probe")
        before = _num_fds()
        addresses = _made_up_reply_addresses(tmp_path, refusing_ports, 1100)
        async with open_runtime("tcp://127.0.0.1:0") as client:
            # Raw requests on the client's own socket, so its real call comes after all of them.
            for call_id, reply_to in enumerate(addresses, start=1_000_000):
                await client._send(server.address, {"t": "req", "id": call_id, "to": "probe", "m": "ping",
                                                     "a": [], "k": {}, "r": reply_to})
            assert await client.ref(server.address, "probe").ask("ping", timeout=10) is None
        stats = server._senders.statistics()
        assert stats.num_open <= config.max_senders
        assert stats.num_dropped_replies + stats.num_waiting_replies == len(addresses)  # none went anywhere
        assert stats.num_evicted >= len(addresses) - config.max_senders - 3  # the 3 junk ones opened none
        assert _num_fds() - before <= config.max_senders + 16
    lines = [r.getMessage() for r in caplog.records if r.name == "actors._senders"]
    assert 1 <= len(lines) <= 20  # at most one a second, each short and escaped
    assert all(len(line) < 300 and "\n" not in line for line in lines)
