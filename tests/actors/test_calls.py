"""A runtime's pending calls (actors/_calls.py), in one process: failing them at once when their target is lost."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors._actor import _resumed
from actors._calls import MAX_LOST_ADDRESSES, PendingCalls
from actors._errors import ActorStopped, ActorTimeout, NodeLost

pytestmark = pytest.mark.timeout(30)


async def test_a_reply_finds_its_call_by_id_and_an_answered_or_unknown_id_finds_none() -> None:
    calls = PendingCalls()
    first, future = calls.open("ipc://a")
    second, _ = calls.open("ipc://a")
    assert first != second and calls.waiting(first) == (future, "ipc://a")  # and where it went
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


async def test_a_send_begun_in_no_task_still_ends_when_its_address_is_lost() -> None:
    # Before Python 3.12 a call's first step runs on the deliverer's stack, in no task; an ask
    # made there that waited for room asserted it had one.
    calls = PendingCalls()
    call_id, future = calls.open("ipc://a")
    asking = calls.send_unless_failed(call_id, future, asyncio.Event().wait())
    loop = asyncio.get_running_loop()
    first: asyncio.Future[Any] = loop.create_future()

    def first_step() -> None:  # as the receiver's callback runs it
        try:
            first.set_result(asking.send(None))
        except BaseException as exc:  # noqa: BLE001 - the test's failure, handed to it
            first.set_exception(exc)

    loop.call_soon(first_step)
    rest = asyncio.ensure_future(_resumed(asking, await first))
    await asyncio.sleep(0)
    calls.mark_lost("ipc://a", NodeLost("node0 was lost"))
    with pytest.raises(NodeLost, match="node0 was lost"):
        await rest


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


async def test_a_deadline_fails_its_call_while_it_waits_for_room_and_while_it_waits_for_its_reply() -> None:
    calls = PendingCalls()
    long_id, long_future = calls.open("ipc://a", 60.0, "slow.ask")
    call_id, future = calls.open("ipc://a", 0.01, "probe.ping")  # earlier than the armed deadline: re-armed
    with pytest.raises(ActorTimeout, match=r"no reply from probe\.ping at ipc://a within 0\.01s"):
        await future
    assert not long_future.done()
    sending_id, sending = calls.open("ipc://b", 0.01, "probe.ping")
    with pytest.raises(ActorTimeout, match="ipc://b"):  # its send never gets room: the deadline ends it
        await calls.send_unless_failed(sending_id, sending, asyncio.Event().wait())
    answered_id, answered = calls.open("ipc://c", 0.01, "probe.ping")
    answered.set_result("pong")
    await asyncio.sleep(0.05)  # past its deadline: an answered call keeps its answer
    assert answered.result() == "pong"
    for done in (call_id, sending_id, answered_id, long_id):
        calls.close(done)


async def test_answered_calls_leave_no_pile_of_deadlines_behind() -> None:
    calls = PendingCalls()
    for _ in range(10_000):
        call_id, future = calls.open("ipc://a", 60.0, "probe.ping")
        future.set_result(None)
        calls.close(call_id)
    live = [calls.open("ipc://a", 60.0, "probe.ping") for _ in range(3)]
    assert len(calls._deadlines) <= 2 * len(live) + 65
    calls.fail_all(lambda: ActorStopped("closed"))
    assert calls._timer is None and all(isinstance(f.exception(), ActorStopped) for _, f in live)


async def test_the_mailboxs_positional_check_accepts_exactly_the_calls_bind_accepts() -> None:
    """The mailbox checks positional-only calls without ``Signature.bind``; it must never take a call
    bind refuses, nor refuse one bind takes (bind decides whatever the fast check hands back)."""
    import inspect

    from actors._actor import _PositionalPlan

    class Record:
        pass

    async def plain(a: int, b: int = 2, c: str = "c") -> None: ...
    async def keyword_only(a: int, *, b: int = 1) -> None: ...
    async def needs_keyword(a: int, *, b: int) -> None: ...
    async def star(a: int, *rest: int) -> None: ...
    async def nothing() -> None: ...

    for fn in (plain, keyword_only, needs_keyword, star, nothing):
        signature = inspect.signature(fn)
        plan = _PositionalPlan.of(signature, {})
        for count in range(5):
            args = list(range(count))
            try:
                signature.bind(*args)
                binds = True
            except TypeError:
                binds = False
            if plan is not None and plan.takes(args):
                assert binds, (fn.__name__, count)
            elif plan is not None:
                assert not binds, (fn.__name__, count)  # a count it does not take is one bind refuses
    async def with_record(order: Record, count: int = 1) -> None: ...
    plan = _PositionalPlan.of(inspect.signature(with_record), {"order": (Record,)})
    assert plan is not None and plan.takes([Record()]) and plan.takes([Record(), 3])
    with pytest.raises(TypeError, match="order must be Record, not dict"):
        plan.takes([{"forged": True}])


def test_an_endpoint_table_is_made_once_per_class_with_each_endpoints_bound_signature() -> None:
    """Mailboxes share their class's table (made in a node's zygote before it forks); each signature is
    the one ``inspect.signature`` gives the endpoint bound to an instance, for every class a worker or
    the head hosts."""
    import inspect
    import types

    import schedulers.scheduler  # noqa: F401  (the scheduler's and the jobs' actor classes)
    import stages.worker  # noqa: F401  (registers the stage's actor classes)
    from actors import Actor
    from actors._actor import endpoint_table

    def subclasses(cls: type) -> list[type]:
        return [c for sub in cls.__subclasses__() for c in (sub, *subclasses(sub))]

    classes = [c for c in subclasses(Actor) if c.__module__.split(".")[0] in ("actors", "stages", "schedulers")]
    assert {"HeadActor", "NodeActor", "StageActor", "SchedulerActor"} <= {c.__name__ for c in classes}
    for cls in classes:
        table = endpoint_table(cls)
        assert endpoint_table(cls) is table
        assert table.concurrent == cls.endpoints() and table.concurrent
        for name, signature in table.signatures.items():
            assert signature == inspect.signature(types.MethodType(getattr(cls, name), object())), (cls, name)


async def test_a_timeout_shows_the_endpoint_not_the_key_and_bulk_parts_of_a_secure_address() -> None:
    """Found connecting with the wrong keys: the message carried 64 hex digits and a second endpoint."""
    calls = PendingCalls()
    _, future = calls.open(f"ipc:///tmp/c/head|{'ab' * 32}|ipc:///tmp/c/head.bulk", 0.01, "head.nodes")
    with pytest.raises(ActorTimeout) as info:
        await future
    assert info.value.message == "no reply from head.nodes at ipc:///tmp/c/head within 0.01s"
