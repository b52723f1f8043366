"""A runtime's pending calls (actors/_calls.py), in one process: failing them at once when their target is lost."""

from __future__ import annotations

import asyncio

import pytest

from actors._calls import MAX_LOST_ADDRESSES, PendingCalls
from actors._errors import ActorStopped, NodeLost

pytestmark = pytest.mark.timeout(30)


async def test_a_reply_finds_its_call_by_id_and_an_answered_or_unknown_id_finds_none() -> None:
    calls = PendingCalls()
    first, future = calls.open("ipc://a")
    second, _ = calls.open("ipc://a")
    assert first != second and calls.waiting(first) is future
    future.set_result(1)
    assert calls.waiting(first) is None  # answered
    for bad in (999, "1", None, 1.0, True):
        assert calls.waiting(bad) is None
    calls.close(second)
    assert calls.waiting(second) is None


async def test_a_lost_address_fails_its_waiting_calls_its_sends_and_every_later_call() -> None:
    calls = PendingCalls()
    _, elsewhere = calls.open("ipc://b")
    call_id, future = calls.open("ipc://a")
    room = asyncio.Event()  # a send that waits for room that never comes

    async def ask() -> None:
        await calls.send_unless_failed(call_id, future, room.wait())

    asking = asyncio.ensure_future(ask())
    await asyncio.sleep(0)  # the ask is in its send
    calls.mark_lost("ipc://a", NodeLost("node0 was lost"))
    with pytest.raises(NodeLost, match="node0 was lost"):
        await asking  # at once, not at a timeout
    assert future.done() and not elsewhere.done()
    with pytest.raises(NodeLost):
        calls.open("ipc://a")
    first, second = calls.lost("ipc://a"), calls.lost("ipc://a")
    assert isinstance(first, NodeLost) and first is not second  # each raise gets its own
    assert calls.lost("ipc://b") is None


async def test_a_timeouts_cancel_of_a_send_stays_a_cancel() -> None:
    calls = PendingCalls()
    call_id, future = calls.open("ipc://a")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):
            await calls.send_unless_failed(call_id, future, asyncio.Event().wait())
    assert not future.done()


async def test_closing_fails_every_waiting_call_with_its_own_error_and_lost_addresses_are_bounded() -> None:
    calls = PendingCalls()
    futures = [calls.open(f"ipc://{i}")[1] for i in range(3)]
    calls.fail_all(lambda: ActorStopped("closed"))
    errors = [f.exception() for f in futures]
    assert all(isinstance(e, ActorStopped) for e in errors) and len({id(e) for e in errors}) == 3
    for i in range(MAX_LOST_ADDRESSES + 1):
        calls.mark_lost(f"ipc://x{i}", NodeLost("gone"))
    assert calls.lost("ipc://x0") is None and calls.lost(f"ipc://x{MAX_LOST_ADDRESSES}") is not None
