"""A runtime under hostile traffic (actors/_runtime.py): it keeps answering, and logs stay short.

A security probe found that 30 messages of 5 MB, each a msgpack list of five million empty
lists, kept a head from answering for over 60 s, and a 48 MiB bad codec name wrote
50 MB to the node's log. Here a raw ZeroMQ PUSH socket, as anyone who can reach the
address has, sends such messages while a ping's round trip is measured.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from actors import Runtime, open_runtime
from actors.probe import ProbeActor
from transport.wire import decode_message, encode_message

pytestmark = pytest.mark.timeout(60)

NUM_FLOOD_MESSAGES = 300  # enough that the pings and the flood meet
N = 5_000_000


def _array(n: int, item: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + item * n


def _message(body: bytes, table: list[Any] | None = None) -> list[bytes]:
    return [msgpack.packb([1, table or [], body])]


HOSTILE = {
    "5M empty lists as the body": _message(_array(N, b"\x90")),
    "5 lists of 1M empty lists as the body": _message(b"\x95" + _array(1 << 20, b"\x90") * 5),
    "5M empty lists as the header": [_array(N, b"\x90")],
    "a 5 MB codec name": [msgpack.packb([1, [["x" * N, "float32", [2], {}, 1]], b"\xc0"]), b"\0" * 8],
    "a request to a 5 MB actor name": encode_message(
        {"t": "req", "id": 1, "to": "x" * N, "m": "ping", "a": [], "k": {}, "r": None}
    ),
}


@pytest.fixture
async def runtimes() -> AsyncIterator[tuple[Runtime, Runtime]]:
    async with open_runtime("ipc://") as server, open_runtime("ipc://") as client:
        await server.spawn(ProbeActor(), "probe")
        yield server, client


def _flood(address: str, messages: list[list[bytes]], started: threading.Event) -> None:
    context: zmq.Context[Any] = zmq.Context()
    socket = context.socket(zmq.PUSH)
    try:
        socket.connect(address)
        for message in messages:
            socket.send_multipart(message, copy=False)
            started.set()
    finally:
        started.set()
        socket.close(linger=10_000)
        context.term()


async def test_pings_are_answered_under_a_flood(
    runtimes: tuple[Runtime, Runtime], caplog: pytest.LogCaptureFixture
) -> None:
    server, client = runtimes
    probe = client.ref(server.address, "probe")
    await probe.ask("ping", timeout=5)  # connected
    kinds = itertools.cycle(HOSTILE.values())
    messages = [next(kinds) for _ in range(NUM_FLOOD_MESSAGES)]
    received_before = server._receiver.statistics().messages
    started = threading.Event()
    flood = threading.Thread(target=_flood, args=(server.address, messages, started), daemon=True)
    flood.start()
    rtts: list[float] = []
    during: list[bool] = []
    try:
        await asyncio.to_thread(started.wait, 10)
        flood_began = time.perf_counter()
        # Ping until every flood message has reached the runtime, and at least 10 times. A busy machine
        # may hold the flood's thread back for as long as it likes: only once it has sent everything is
        # its arrival counted on (a bound in pings, not in seconds).
        sent_after: int | None = None  # pings when the flood's thread had sent its last message
        while len(rtts) < 10 or server._receiver.statistics().messages < received_before + len(rtts) + len(messages):
            if sent_after is None and not flood.is_alive():
                sent_after = len(rtts)
            assert sent_after is None or len(rtts) - sent_after < 5_000, "the flood was sent but never arrived"
            start = time.perf_counter()
            await probe.ask("ping", timeout=5)
            rtts.append(time.perf_counter() - start)
            # Whether flood messages were still to come when this ping was answered.
            during.append(server._receiver.statistics().messages - received_before - len(rtts) < len(messages))
        flood_s = time.perf_counter() - flood_began
    finally:
        await asyncio.to_thread(flood.join, 30)
    # Never starved behind the flood: pings were answered while it was still coming in. (Not a time
    # bound: a busy machine stretches a ping as it likes; a runtime that starved them would answer
    # none until the last flood message was through.)
    assert any(during), f"no ping of {len(rtts)} was answered before the flood ({flood_s:.2f} s) was through"
    assert not [r for r in caplog.records if r.exc_info], "a hostile message raised in the runtime"
    assert max((len(r.getMessage()) for r in caplog.records), default=0) < 500
    assert (await probe.ask("whoami", timeout=5))["name"] == "probe"


@pytest.fixture
async def raw() -> AsyncIterator[tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]]:
    """A raw PUSH socket, as a stranger has, and a PULL socket for the replies it asks for."""
    context = zmq.asyncio.Context.instance()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:*")
    try:
        yield push, pull
    finally:
        push.close(linger=0)
        pull.close(linger=0)


HUGE = 48 << 20
HOSTILE_FOR_LOGS = {
    "a bad codec name": lambda: [msgpack.packb([1, [["x" * HUGE, "float32", [2], {}, 1]], b"\xc0"]), b"\0" * 8],
    "an actor name": lambda: encode_message({"t": "req", "id": 1, "to": "x" * HUGE, "m": "ping", "a": [], "k": {}}),
    "a method name": lambda: encode_message({"t": "req", "id": 1, "to": "probe", "m": "x" * HUGE, "a": [], "k": {}}),
    "a keyword name": lambda: encode_message({"t": "req", "to": "probe", "m": "ping", "a": [], "k": {"x" * HUGE: 1}}),
    "a reply address": lambda: encode_message({"t": "req", "id": 1, "to": "nobody", "m": "x", "a": [], "k": {},
                                               "r": "x" * HUGE}),
    "neither request nor reply": lambda: encode_message({"t": "x" * HUGE, "v": ["\n\x1b[2J" * 1000]}),
    "a reply with a list for an id": lambda: encode_message({"t": "rep", "id": [1, 2], "ok": True, "v": "x" * HUGE}),
}


@pytest.mark.parametrize("make", HOSTILE_FOR_LOGS.values(), ids=HOSTILE_FOR_LOGS.keys())
async def test_hostile_values_reach_the_log_only_as_short_excerpts(
    runtimes: tuple[Runtime, Runtime],
    raw: tuple[zmq.asyncio.Socket, zmq.asyncio.Socket],
    make: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    server, _ = runtimes
    push, pull = raw
    push.connect(server.address)
    await push.send_multipart(make())
    # A ping on the same pipe comes after the hostile message: its reply means that was handled.
    reply_to = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    await push.send_multipart(encode_message({"t": "req", "id": 7, "to": "probe", "m": "ping", "a": [], "k": {},
                                              "r": reply_to}))
    reply = decode_message(await asyncio.wait_for(pull.recv_multipart(), 10))
    assert reply == {"t": "rep", "id": 7, "ok": True, "v": None}
    assert not [r for r in caplog.records if r.exc_info], "a hostile message raised in the runtime"
    assert max((len(r.getMessage()) for r in caplog.records), default=0) < 500
