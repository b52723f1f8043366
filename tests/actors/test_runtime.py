"""Tests for the actor runtime in one process: two runtimes talk over real sockets."""

from __future__ import annotations

import asyncio
import logging
import collections.abc
import contextlib
import contextvars
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from actors import (
    Actor,
    ActorLost,
    ActorRef,
    ActorStopped,
    ActorTimeout,
    BadArguments,
    MailboxFull,
    MessageLost,
    NodeLost,
    RemoteError,
    Runtime,
    UnknownActor,
    UnknownEndpoint,
    UserCodeExit,
    contained,
    current_caller,
    endpoint,
    open_runtime,
)
from actors.probe import ProbeActor
from tests.helpers.tampered import TamperedKey
from transport.security import Keypair

pytestmark = pytest.mark.timeout(30)


class Counter(Actor):
    def __init__(self) -> None:
        self.value = 0
        self.events: list[str] = []
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def on_start(self) -> None:
        self.events.append("start")

    async def on_stop(self) -> None:
        self.events.append("stop")

    async def on_failure(self, method: str, error: BaseException) -> None:
        self.events.append(f"failure {method} {type(error).__name__}")

    @endpoint
    async def add(self, amount: int, *, times: int = 1) -> int:
        self.value += amount * times
        return self.value

    @endpoint
    async def slow_add(self, amount: int) -> int:
        before = self.value
        await asyncio.sleep(0.001)  # yields: a second call must still wait its turn
        self.value = before + amount
        return self.value

    @endpoint
    async def wait_gate(self) -> str:
        self.entered.set()
        await self.gate.wait()
        return "opened"

    @endpoint(concurrent=True)
    async def open_gate(self) -> None:
        self.gate.set()

    @endpoint
    async def divide(self, a: float, b: float) -> float:
        return a / b

    @endpoint
    async def scale(self, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        return tensor * factor

    @endpoint
    async def unsendable(self) -> object:
        return object()

    @endpoint
    async def ask_with_short_timeout(self, address: str, name: str) -> str:
        """Asks another actor that never answers in time: the timeout is this actor's own."""
        return str(await self.runtime.ref(address, name).ask("wait_gate", timeout=0.1))

    def not_an_endpoint(self) -> None:
        pass


class SmallCounter(Counter):
    mailbox_size = 8


@pytest.fixture
async def runtimes() -> AsyncIterator[tuple[Runtime, Runtime]]:
    async with open_runtime("ipc://") as server, open_runtime("tcp://127.0.0.1:0") as client:
        yield server, client


async def spawn_counter(server: Runtime, client: Runtime) -> tuple[Counter, ActorRef]:
    counter = Counter()
    ref = await server.spawn(counter, "counter")
    return counter, client.ref(ref.address, ref.name)


async def test_round_trip_with_args_kwargs_and_tensors(runtimes: tuple[Runtime, Runtime]) -> None:
    counter, ref = await spawn_counter(*runtimes)
    assert await ref.ask("add", 2, times=3) == 6
    out = await ref.ask("scale", torch.arange(4.0), 2.0)
    assert torch.equal(out, torch.arange(4.0) * 2)
    assert counter.events == ["start"]


async def test_local_calls_do_not_touch_the_network(runtimes: tuple[Runtime, Runtime]) -> None:
    server, _ = runtimes
    counter = Counter()
    ref = await server.spawn(counter, "local")
    tensor = torch.ones(3)
    out = await ref.ask("scale", tensor, 1.0)
    assert await ref.ask("add", 1) == 1
    assert server._receiver.statistics().messages == 0  # nothing went through the socket
    assert torch.equal(out, tensor)


async def test_remote_exception_carries_type_message_and_traceback(runtimes: tuple[Runtime, Runtime]) -> None:
    counter, ref = await spawn_counter(*runtimes)
    with pytest.raises(RemoteError) as info:
        await ref.ask("divide", 1.0, 0.0)
    error = info.value
    assert error.remote_type == "ZeroDivisionError"
    assert "float division by zero" in error.message
    assert "in divide" in error.remote_traceback and "return a / b" in error.remote_traceback
    assert "ZeroDivisionError" in str(error)
    assert counter.events[-1] == "failure divide ZeroDivisionError"
    assert await ref.ask("add", 1) == 1  # still serving


@pytest.mark.parametrize(
    "method,args,kwargs,error,match",
    [
        ("nope", [], {}, UnknownEndpoint, "has no endpoint 'nope'; its endpoints: add"),
        ("not_an_endpoint", [], {}, UnknownEndpoint, "not_an_endpoint"),
        ("_mailboxes", [], {}, UnknownEndpoint, "_mailboxes"),
        ("add", [], {}, BadArguments, "missing a required argument: 'amount'"),
        ("add", [1, 2], {}, BadArguments, "too many positional arguments"),
        ("add", [1], {"bogus": 1}, BadArguments, "unexpected keyword argument 'bogus'"),
    ],
)
async def test_bad_calls_get_clear_errors_and_the_actor_keeps_serving(
    runtimes: tuple[Runtime, Runtime], method: str, args: list[Any], kwargs: dict[str, Any],
    error: type[Exception], match: str,
) -> None:
    _, ref = await spawn_counter(*runtimes)
    with pytest.raises(error, match=match):
        await ref.ask(method, *args, **kwargs)
    assert await ref.ask("add", 5) == 5


async def test_unknown_actor(runtimes: tuple[Runtime, Runtime]) -> None:
    server, client = runtimes
    await spawn_counter(server, client)
    with pytest.raises(UnknownActor, match="no actor named 'ghost'") as info:
        await client.ref(server.address, "ghost").ask("add", 1)
    assert "counter" not in str(info.value)  # a caller does not learn which actors run there


async def test_unsendable_result_becomes_an_error(runtimes: tuple[Runtime, Runtime]) -> None:
    _, ref = await spawn_counter(*runtimes)
    with pytest.raises(RemoteError, match="cannot send an object of type object"):
        await ref.ask("unsendable")


async def test_messages_are_handled_one_at_a_time_in_order(runtimes: tuple[Runtime, Runtime]) -> None:
    server, client = runtimes
    counter, ref = await spawn_counter(server, client)
    async with open_runtime("ipc://") as other:
        ref2 = other.ref(ref.address, ref.name)
        # slow_add reads, yields, then writes: interleaving would lose updates.
        results = await asyncio.gather(*(r.ask("slow_add", 1) for _ in range(50) for r in (ref, ref2)))
    assert counter.value == 100
    assert sorted(results) == list(range(1, 101))


async def test_per_sender_order_under_concurrent_senders(runtimes: tuple[Runtime, Runtime]) -> None:
    server, client = runtimes
    ref = await server.spawn(ProbeActor(), "log")
    async with open_runtime("ipc://") as other:
        senders = {"a": client.ref(ref.address, "log"), "b": other.ref(ref.address, "log")}

        async def send_all(tag: str) -> None:
            for i in range(100):
                await senders[tag].tell("record", [tag, i])

        await asyncio.gather(send_all("a"), send_all("b"))
        # Order holds per sender, so a reply to each sender means its tells are in.
        await senders["b"].ask("ping")
        seen = await senders["a"].ask("recorded")
    for tag in "ab":
        assert [i for t, i in seen if t == tag] == list(range(100))


async def test_concurrent_endpoint_runs_while_a_call_is_in_progress(runtimes: tuple[Runtime, Runtime]) -> None:
    _, ref = await spawn_counter(*runtimes)
    waiting = asyncio.ensure_future(ref.ask("wait_gate"))
    await ref.ask("open_gate", timeout=5)  # would deadlock if it queued behind wait_gate
    assert await waiting == "opened"


_MARK: contextvars.ContextVar[str] = contextvars.ContextVar("test_mark", default="unset")


class Gated(Actor):
    """A counter whose ``hold`` waits for a gate and notes how it ended; its calls start where they are
    delivered (``taskless_start``), as every call does from Python 3.12 on."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.value = 0
        self.gate = asyncio.Event()

    async def on_stop(self) -> None:
        self.events.append("stop")

    @endpoint(taskless_start=True)
    async def hold(self) -> None:
        self.events.append("held")
        try:
            await self.gate.wait()
        finally:
            self.events.append("released" if self.gate.is_set() else "cancelled")

    @endpoint(taskless_start=True)
    async def add(self, amount: int) -> int:
        _MARK.set("set by the actor")
        self.value += amount
        return self.value

    @endpoint(concurrent=True, taskless_start=True)
    async def open_gate(self) -> None:
        self.gate.set()

    @endpoint(taskless_start=True)
    async def outer(self) -> None:
        self.events.append("outer starts")
        await self.ref.tell("inner")  # to itself, as it starts: must wait its turn
        self.events.append("outer ends")

    @endpoint(taskless_start=True)
    async def inner(self) -> None:
        self.events.append("inner")


class Guarded(Actor):
    """Endpoints as a user writes them: a timeout or a task group before their first wait."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[Any] | None] = []

    @endpoint
    async def timed(self) -> str:
        self.tasks.append(asyncio.current_task())
        async with asyncio.timeout(30):
            await asyncio.sleep(0)
        return "timed"

    @endpoint(concurrent=True)
    async def grouped(self) -> str:
        self.tasks.append(asyncio.current_task())
        async with asyncio.TaskGroup() as group:
            group.create_task(asyncio.sleep(0))
        return "grouped"


async def test_a_call_whose_first_step_needs_its_own_task_gets_one_from_near_and_far(
        runtimes: tuple[Runtime, Runtime]) -> None:
    # Before Python 3.12 every call started on the deliverer's stack: a remote call's first step ran
    # in no task ("Timeout should be used inside a task", "TaskGroup cannot determine the parent
    # task") and a local one's in its caller's, whose task a timeout would then have cancelled.
    server, client = runtimes
    actor = Guarded()
    here = await server.spawn(actor, "guarded")
    far = client.ref(here.address, here.name)
    for ref in (far, here):
        assert await ref.ask("timed") == "timed" and await ref.ask("grouped") == "grouped"
    caller = asyncio.current_task()
    assert all(task is not None and task is not caller for task in actor.tasks) and len(actor.tasks) == 4


@contextlib.asynccontextmanager
async def gated() -> AsyncIterator[tuple[Runtime, Gated, ActorRef]]:
    """A runtime with a :class:`Gated` actor whose mailbox waits for calls."""
    async with open_runtime("ipc://") as runtime:
        actor = Gated()
        ref = await runtime.spawn(actor, "gated")
        await asyncio.sleep(0)  # the mailbox's loop now waits for calls
        yield runtime, actor, ref


async def test_a_call_that_needs_no_wait_runs_as_it_is_delivered() -> None:
    async with gated() as (_, actor, ref):
        await ref.tell("add", 5)  # a local tell: delivered, and run, before it returns
        assert actor.value == 5
        assert await ref.ask("add", 1) == 6
        assert _MARK.get() == "unset"  # the call ran in a context of its own


async def test_a_call_started_at_delivery_keeps_the_calls_after_it_waiting_until_it_ends() -> None:
    async with gated() as (runtime, actor, ref):
        await ref.tell("hold")  # starts at once and waits for the gate
        assert actor.events == ["held"]
        added = [asyncio.ensure_future(ref.ask("add", 1)) for _ in range(3)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert actor.value == 0 and not any(a.done() for a in added)  # sequential: behind the one holding
        await ref.ask("open_gate")
        assert await asyncio.gather(*added) == [1, 2, 3]
        assert actor.events == ["held", "released"]


async def test_a_call_started_at_delivery_goes_on_in_a_task_given_a_coroutine(monkeypatch: pytest.MonkeyPatch) -> None:
    # Python 3.12's tasks take coroutines only (3.11's also took generators): a generator here
    # broke every call that waited after its start on a 3.12 GPU machine (TypeError).
    async with gated() as (runtime, actor, ref):
        given: list[Any] = []
        tasks: list[asyncio.Task[Any]] = []
        spawn = runtime.spawn_task
        monkeypatch.setattr(runtime, "spawn_task", lambda coro, **how: given.append(coro) or tasks.append(
            task := spawn(coro, **how)) or task)
        await ref.tell("hold")  # starts at once, waits for the gate: the rest runs in a task
        assert len(given) == 1 and isinstance(given[0], collections.abc.Coroutine)
        await ref.ask("open_gate")
        await tasks[0]
        assert actor.events == ["held", "released"]


async def test_a_call_an_actor_makes_to_itself_as_a_call_starts_runs_after_it() -> None:
    async with gated() as (runtime, actor, ref):
        await ref.tell("outer")
        await ref.ask("add", 0)  # after both
        assert actor.events == ["outer starts", "outer ends", "inner"]


async def test_of_the_requests_one_read_hands_on_only_the_first_starts_at_once() -> None:
    # A burst is read whole before its replies go out (answered as each was read, 64 calls in
    # flight lost an eighth of their rate); a request alone in its read starts at once.
    async with gated() as (runtime, actor, _):
        request = {"t": "req", "id": None, "to": "gated", "m": "add", "a": [1], "k": {}, "r": None}
        runtime._on_request(dict(request))  # the first the receiver's current read hands on
        assert actor.value == 1
        runtime._on_request(dict(request))  # a second of the same read: queued
        runtime._on_request(dict(request))
        assert actor.value == 1
        for _ in range(5):
            await asyncio.sleep(0)
        assert actor.value == 3


async def test_stopping_an_actor_ends_a_call_started_at_delivery_before_its_on_stop() -> None:
    async with gated() as (runtime, actor, ref):
        await ref.tell("hold")
        await runtime.stop_actor("gated")
        assert actor.events == ["held", "cancelled", "stop"]


async def test_ask_times_out_with_a_typed_error(runtimes: tuple[Runtime, Runtime]) -> None:
    _, ref = await spawn_counter(*runtimes)
    with pytest.raises(ActorTimeout, match="no reply from counter.wait_gate"):
        await ref.ask("wait_gate", timeout=0.1)
    await ref.ask("open_gate")


async def test_a_remote_timeout_is_reported_as_the_remotes_not_the_callers(
    runtimes: tuple[Runtime, Runtime]
) -> None:
    server, client = runtimes
    counter, ref = await spawn_counter(server, client)
    middle = client.ref((await server.spawn(Counter(), "middle")).address, "middle")
    started = asyncio.get_running_loop().time()
    with pytest.raises(ActorTimeout) as info:
        await middle.ask("ask_with_short_timeout", ref.address, ref.name, timeout=10)
    # The middle actor's 0.1 s wait expired; the caller's own 10 s did not, and it says so.
    assert asyncio.get_running_loop().time() - started < 5
    assert info.value.message.startswith("remote timeout: no reply from counter.wait_gate")
    assert "within 0.1s" in info.value.message
    await ref.ask("open_gate")


async def test_typed_endpoint_handles_call_the_method_they_name(runtimes: tuple[Runtime, Runtime]) -> None:
    counter, ref = await spawn_counter(*runtimes)
    add = ref.endpoint(Counter.add, timeout=5)
    assert await add.call(2, times=3) == 6
    assert await add.tell(1) >= 0
    assert await ref.endpoint(Counter.add).call(0) == 7
    with pytest.raises(TypeError, match="not an @endpoint"):
        ref.endpoint(Counter.not_an_endpoint)  # type: ignore[arg-type]
    with pytest.raises(BadArguments):
        await add.call("x", "y", "z")  # type: ignore[call-arg]


async def test_unreachable_peer_times_out(runtimes: tuple[Runtime, Runtime], tmp_path: Any) -> None:
    _, client = runtimes
    with pytest.raises(ActorTimeout):
        await client.ref(f"ipc://{tmp_path}/nobody", "x").ask("ping", timeout=0.2)


async def test_full_mailbox_refuses_instead_of_growing(runtimes: tuple[Runtime, Runtime]) -> None:
    server, client = runtimes
    counter = SmallCounter()
    ref = await server.spawn(counter, "small")
    blocked = [asyncio.ensure_future(ref.ask("wait_gate"))]
    await counter.entered.wait()  # one call running, the mailbox empty
    blocked += [asyncio.ensure_future(ref.ask("wait_gate")) for _ in range(SmallCounter.mailbox_size)]
    await asyncio.sleep(0)
    with pytest.raises(MailboxFull):
        await ref.ask("add", 1)
    counter.gate.set()
    assert await asyncio.gather(*blocked) == ["opened"] * len(blocked)


async def test_malformed_frames_are_dropped_and_the_runtime_keeps_serving(runtimes: tuple[Runtime, Runtime]) -> None:
    server, client = runtimes
    _, ref = await spawn_counter(server, client)
    raw = zmq.asyncio.Context.instance().socket(zmq.PUSH)
    try:
        raw.connect(server.address)
        for frames in ([b"\xc1"], [b"\x93\x01\x90\xc4\x01\xc1"], [b"\x93\x01\x90\xc4\x01\x01"], [b""]):
            await raw.send_multipart(frames)
        assert await ref.ask("add", 7, timeout=5) == 7
    finally:
        raw.close(linger=0)


async def test_stop_actor_runs_on_stop_and_fails_later_calls(runtimes: tuple[Runtime, Runtime]) -> None:
    server, client = runtimes
    counter, ref = await spawn_counter(server, client)
    await server.stop_actor("counter")
    assert counter.events == ["start", "stop"]
    with pytest.raises(UnknownActor):
        await ref.ask("add", 1)


class Cancelling(Actor):
    """Work that another endpoint cancels, as a job's close cancels the step in progress."""

    def __init__(self) -> None:
        self.work_task: asyncio.Task[Any] | None = None

    @endpoint(concurrent=True)
    async def work(self) -> None:
        self.work_task = asyncio.current_task()
        await asyncio.Event().wait()

    @endpoint(concurrent=True)
    async def cancel_work(self) -> None:
        assert self.work_task is not None
        self.work_task.cancel()


async def test_a_call_cancelled_where_it_runs_is_answered_at_once(runtimes: tuple[Runtime, Runtime]) -> None:
    """Found as a job closed while a driver's job.step was in flight: the step's task was cancelled
    on the head, no answer went back, and the driver waited for the step's timeout (minutes)."""
    server, client = runtimes
    actor = Cancelling()
    ref = client.ref((await server.spawn(actor, "w")).address, "w")
    pending = asyncio.ensure_future(ref.ask("work", timeout=None))  # only an answer ends it
    while actor.work_task is None:
        await asyncio.sleep(0.01)
    await ref.ask("cancel_work")
    with pytest.raises(ActorStopped, match=r"Cancelling.work on 'w' was cancelled before it answered"):
        await pending


async def test_stopping_an_actor_answers_the_call_in_progress_and_those_waiting(
        runtimes: tuple[Runtime, Runtime]) -> None:
    server, client = runtimes
    counter, ref = await spawn_counter(server, client)
    running = asyncio.ensure_future(ref.ask("wait_gate", timeout=None))
    await counter.entered.wait()
    waiting = [asyncio.ensure_future(ref.ask("add", 1, timeout=None)) for _ in range(3)]
    while server._mailboxes["counter"]._queue.qsize() < 3:  # every one is in the mailbox, behind the first
        await asyncio.sleep(0.01)
    await server.stop_actor("counter")
    with pytest.raises(ActorStopped, match="cancelled before it answered"):
        await running
    for call in waiting:
        with pytest.raises(ActorStopped, match=r"Counter.add on 'counter' was not run: the actor stopped first"):
            await call
    assert counter.value == 0


async def test_a_runtime_that_closes_leaves_the_calls_it_was_running_to_the_callers_liveness() -> None:
    """Unlike one actor stopping: a process whose node died closes its runtime, and an answer sent
    then ("cancelled before it answered") reached the head before the node's loss did, so the head
    failed a step it would have recovered (test_recovery's lost data-parallel member, in CI)."""
    async with open_runtime("ipc://") as client:
        server_cm = open_runtime("ipc://")
        server = await server_cm.__aenter__()
        counter = Counter()
        ref = client.ref((await server.spawn(counter, "c")).address, "c")
        assert await ref.ask("add", 0) == 0  # the server's way back to the client is open, as a stage's to its head
        running = asyncio.ensure_future(ref.ask("wait_gate", timeout=1.0))
        await counter.entered.wait()
        waiting = asyncio.ensure_future(ref.ask("add", 1, timeout=1.0))
        while server._mailboxes["c"]._queue.qsize() < 1:
            await asyncio.sleep(0.01)
        await server_cm.__aexit__(None, None, None)
        for call in (running, waiting):
            with pytest.raises(ActorTimeout):  # no answer at all: not ActorStopped
                await call
        assert counter.value == 0


async def test_failing_on_start_aborts_the_spawn() -> None:
    class Broken(Actor):
        async def on_start(self) -> None:
            raise RuntimeError("cannot start")

    async with open_runtime("ipc://") as runtime:
        with pytest.raises(RuntimeError, match="cannot start"):
            await runtime.spawn(Broken(), "broken")
        assert runtime.actor_names() == []


async def test_duplicate_name_is_refused() -> None:
    async with open_runtime("ipc://") as runtime:
        await runtime.spawn(Counter(), "c")
        with pytest.raises(ValueError, match="already runs"):
            await runtime.spawn(Counter(), "c")


async def test_endpoint_must_be_async() -> None:
    with pytest.raises(TypeError, match="must be an async def"):
        endpoint(lambda self: None)


async def test_close_stops_actors_fails_pending_calls_and_leaves_nothing_behind() -> None:
    threads_before = threading.active_count()
    tasks_before = asyncio.all_tasks()
    counter = Counter()
    async with open_runtime("ipc://") as server:
        async with open_runtime("ipc://") as client:
            ref = await server.spawn(counter, "c")
            pending = asyncio.ensure_future(client.ref(ref.address, "c").ask("wait_gate"))
            await asyncio.sleep(0.05)
        with pytest.raises(ActorStopped):
            await pending
        path = server.address.removeprefix("ipc://")
    assert counter.events == ["start", "stop"]
    assert asyncio.all_tasks() == tasks_before
    assert threading.active_count() == threads_before
    import os

    assert not os.path.exists(path)


class Exiting(Actor):
    """An actor running a job's code that exits or interrupts: on the loop, on a thread, at start."""

    def __init__(self, exit_at_start: bool = False) -> None:
        self.exit_at_start = exit_at_start

    async def on_start(self) -> None:
        if self.exit_at_start:
            sys.exit(2)

    @endpoint
    async def exit_here(self, code: int) -> None:
        sys.exit(code)

    @endpoint
    async def interrupt_on_a_thread(self) -> None:
        def interrupt() -> None:
            raise KeyboardInterrupt

        await asyncio.to_thread(contained, interrupt)


async def test_a_jobs_sys_exit_fails_the_call_and_the_runtime_keeps_serving(runtimes: tuple[Runtime, Runtime]) -> None:
    server, client = runtimes
    ref = client.ref(server.address, (await server.spawn(Exiting(), "exiting")).name)
    with pytest.raises(UserCodeExit, match=r"sys.exit\(7\) in Exiting.exit_here"):
        await ref.endpoint(Exiting.exit_here, timeout=10).call(7)
    with pytest.raises(UserCodeExit, match="KeyboardInterrupt in .*interrupt"):
        await ref.endpoint(Exiting.interrupt_on_a_thread, timeout=10).call()
    with pytest.raises(UserCodeExit, match=r"sys.exit\(2\) in Exiting.on_start"):
        await server.spawn(Exiting(exit_at_start=True), "exiting-at-start")
    _, counter = await spawn_counter(server, client)
    assert await counter.endpoint(Counter.add, timeout=10).call(3) == 3  # the runtime goes on


async def test_calls_to_an_address_marked_lost_fail_at_once_pending_and_later(runtimes: tuple[Runtime, Runtime]) -> None:
    # What the head does when a node says one of its actor processes ended (actors._processes).
    server, client = runtimes
    counter, ref = await spawn_counter(server, client)
    pending = asyncio.ensure_future(ref.ask("wait_gate"))
    await asyncio.wait_for(counter.entered.wait(), 30)
    client.mark_lost(server.address, ActorLost("counter on node n0: its process killed by SIGSEGV",
                                               details={"node": "n0"}))
    with pytest.raises(ActorLost, match="killed by SIGSEGV"):
        await asyncio.wait_for(pending, 30)
    for call in (ref.ask("add", 1), ref.tell("add", 1)):
        with pytest.raises(ActorLost, match="killed by SIGSEGV") as later:
            await call
        assert later.value.details == {"node": "n0"}
    assert client.lost(server.address) is not None and client.lost(client.address) is None
    local = server.ref(server.address, "counter")  # the server itself goes on
    await local.ask("open_gate")
    assert await local.ask("add", 1) == 1


async def test_calls_waiting_to_be_sent_to_a_peer_that_is_gone_fail_with_its_loss() -> None:
    """A hang seen on busy machines: a peer's process ended, and asks to it wait for room to send (more than the
    socket queues); the node's loss failed their futures but each ask went on waiting in its send,
    until its own timeout (none here, a step's ten minutes in a job). They end with the loss now."""
    async with open_runtime("tcp://127.0.0.1:0") as client:
        async with open_runtime("tcp://127.0.0.1:0") as server:
            _, ref = await spawn_counter(server, client)
            assert await ref.ask("add", 1, timeout=10) == 1
        calls = [asyncio.ensure_future(ref.ask("add", 1, timeout=None)) for _ in range(600)]  # past the HWM
        await asyncio.sleep(0.5)
        client.fail_calls_to(server.address, NodeLost("node n0 was lost", details={"node": "n0"}))
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
    assert all(isinstance(outcome, NodeLost) for outcome in outcomes)


class _CallerActor(Actor):
    @endpoint
    async def echo_with_caller(self, value: Any) -> tuple[str, Any]:
        return current_caller(), value


@pytest.mark.parametrize("bulk", ["encrypt", "authenticate", "curve"])
async def test_secure_runtimes_call_through_every_bulk_mode_and_name_the_caller(bulk: str) -> None:
    server_keys, client_keys = Keypair.generate(), Keypair.generate()
    ring = {server_keys.public: "node:n0", client_keys.public: "client:alice"}
    async with open_runtime("ipc://", keys=server_keys, ring=lambda: ring) as server, \
            open_runtime("ipc://", keys=client_keys, ring=lambda: ring, bulk=bulk) as client:  # type: ignore[arg-type]
        await server.spawn(_CallerActor(), "callee")
        tensor = torch.randn(300_000)  # past the size a frame is sealed straight into an aligned buffer
        caller, value = await client.ref(server.address, "callee").ask("echo_with_caller", tensor, timeout=30)
    assert caller == "client:alice" and torch.equal(value, tensor)


async def test_a_call_whose_reply_was_refused_on_the_way_fails_at_once_saying_so_and_the_next_one_works() -> None:
    """Between two secure runtimes (as on two hosts), a reply sealed and altered on the way is refused:
    the caller waited out its timeout for it. The caller's receiver says whose message was lost, and
    the calls waiting on that runtime's replies fail with MessageLost at once; the session goes on."""
    server_keys, client_keys = Keypair.generate(), Keypair.generate()
    ring = {server_keys.public: "node:n0", client_keys.public: "client:alice"}
    async with open_runtime("tcp://127.0.0.1:0", keys=server_keys, ring=lambda: ring) as server, \
            open_runtime("tcp://127.0.0.1:0", keys=client_keys, ring=lambda: ring) as client:
        await server.spawn(_CallerActor(), "callee")
        callee = client.ref(server.address, "callee")
        tensor = torch.randn(300_000)  # its reply is sealed, over the bulk socket
        assert (await callee.ask("echo_with_caller", tensor, timeout=30))[0] == "client:alice"
        link = server._senders._entries[client.address].sender._link  # type: ignore[union-attr]
        link.key = TamperedKey(link.key)
        with pytest.raises(MessageLost, match=r"\(node:n0\) may have been lost on the way.*fails its tag"):
            await callee.ask("echo_with_caller", tensor, timeout=60)
        link.key = link.key.key
        _, value = await callee.ask("echo_with_caller", tensor, timeout=30)
    assert torch.equal(value, tensor)


class _SlowHeadOnly(Actor):
    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()

    @endpoint(roles=("head",))
    async def work(self) -> str:
        self.started.set()
        await asyncio.sleep(0.5)
        return "the node's own answer"


async def test_only_the_runtime_a_call_went_to_answers_it_directly_or_through_another() -> None:
    """A client key answered the head's call to a node (call ids count from 1: easy to guess), or named
    the head's address for the reply to a request of its own, so the node's refusal failed the head's
    call. Only a reply from the key the call went to is taken; a reply goes only to the caller's own address."""
    head_keys, node_keys, client_keys = Keypair.generate(), Keypair.generate(), Keypair.generate()
    ring = {head_keys.public: "head:head", node_keys.public: "node:n0", client_keys.public: "client:mallory"}
    async with open_runtime("tcp://127.0.0.1:0", keys=head_keys, ring=lambda: ring) as head, \
            open_runtime("tcp://127.0.0.1:0", keys=node_keys, ring=lambda: ring) as node, \
            open_runtime("tcp://127.0.0.1:0", keys=client_keys, ring=lambda: ring) as client:
        slow = _SlowHeadOnly()
        await node.spawn(slow, "stage")
        for forge in ("reply", "reflected request"):
            slow.started.clear()
            call = asyncio.create_task(head.ref(node.address, "stage").endpoint(_SlowHeadOnly.work, timeout=30).call())
            await slow.started.wait()
            for call_id in range(1, 4):
                if forge == "reply":
                    await client._send(head.address, {"t": "rep", "id": call_id, "ok": True, "v": "forged"})
                else:
                    await client._send(node.address, {"t": "req", "id": call_id, "to": "stage", "m": "work",
                                                      "a": [], "k": {}, "r": head.address})
            assert await call == "the node's own answer", forge


def test_an_error_of_the_jobs_code_says_at_the_caller_which_callable_raised() -> None:
    from actors._errors import calling, error_from_wire, error_to_wire

    with pytest.raises(ZeroDivisionError) as raised:
        with calling("in the outer thing"), calling("in the loss tests:mine"):
            1 / 0
    assert raised.value.__notes__ == ["in the loss tests:mine", "in the outer thing"]
    error = error_from_wire(error_to_wire(raised.value))
    assert isinstance(error, RemoteError) and error.remote_type == "ZeroDivisionError"
    assert error.message == "division by zero (in the loss tests:mine; in the outer thing)"
    assert error.remote_traceback.rstrip().endswith("in the outer thing")  # Python prints notes there too
    # The runtime's own errors say all there is to say: never noted.
    with pytest.raises(ActorStopped) as stopped:
        with calling("in the model factory x:y"):
            raise ActorStopped("gone")
    assert not hasattr(stopped.value, "__notes__") and error_to_wire(stopped.value)["message"] == "gone"
    # An error without notes crosses as it did.
    assert error_to_wire(ValueError("plain"))["message"] == "plain"


def test_an_error_that_crossed_the_wire_says_which_type_the_remote_side_raised() -> None:
    from actors._errors import error_from_wire, error_to_wire, names_type

    error = error_from_wire(error_to_wire(_SpecError("too few layers")))
    assert error.remote_type.endswith("test_runtime._SpecError")  # qualified by the raising side's module
    assert error.raised(_SpecError) and error.raised(KeyError, _SpecError)
    assert not error.raised(ValueError)  # its name, not its bases: a type the caller may not import
    assert names_type("elsewhere.module._SpecError: the link closed while sending", KeyError, _SpecError)
    assert names_type("_SpecError", _SpecError)
    assert not names_type("elsewhere.Not_SpecError: x", _SpecError)
    assert not names_type("RuntimeError: _SpecError happened", _SpecError)  # the type, not the message


class _SpecError(ValueError):
    """A library's own ValueError (as torch's and this project's errors derive from Python's)."""


class _Unrelated(Exception):
    pass


@pytest.mark.parametrize(("raised", "builtin"), [
    (ValueError("bad value"), ValueError), (TypeError("bad type"), TypeError), (KeyError("k"), KeyError),
    (FileNotFoundError(2, "no such file"), FileNotFoundError), (_SpecError("a spec's own"), ValueError),
    (RuntimeError("torch said"), RuntimeError), (ZeroDivisionError("zero"), ZeroDivisionError),
])
def test_a_remote_builtin_error_is_caught_by_its_builtin_type_and_stays_a_remote_error(
    raised: Exception, builtin: type[Exception]
) -> None:
    """A scheduler's ValueError ("too few layers", "needs 3 nodes") reached the driver as a bare
    RemoteError, which ``except ValueError`` let through; now it is both."""
    from actors._errors import error_from_wire, error_to_wire

    try:
        raise raised
    except Exception as exc:  # noqa: BLE001  (the test raises it to give it a traceback)
        wire = error_to_wire(exc)
    error = error_from_wire(wire)
    assert isinstance(error, RemoteError) and isinstance(error, builtin)
    assert type(error).__name__ == f"Remote{builtin.__name__}"
    assert error.remote_type.endswith(type(raised).__name__) and error.remote_traceback
    assert str(error).startswith(f"{error.remote_type}: ")  # RemoteError's text, not the builtin's
    with pytest.raises(builtin):
        raise error
    # Relayed once more (a head passing on a stage's error), it keeps both.
    again = error_from_wire(error_to_wire(error))
    assert isinstance(again, RemoteError) and isinstance(again, builtin) and again.remote_type == error.remote_type


def test_only_pythons_own_exception_types_are_rebuilt_by_name() -> None:
    """The builtin a peer names is looked up in a table, never imported or resolved: a name outside it
    (one that would stop the caller, or a class of the peer's) gives a plain RemoteError."""
    from actors._errors import error_from_wire, error_to_wire

    assert "builtin" not in error_to_wire(_Unrelated("x"))
    plain = error_from_wire(error_to_wire(_Unrelated("x")))
    assert type(plain) is RemoteError
    for name in ("SystemExit", "KeyboardInterrupt", "GeneratorExit", "BaseException", "Exception",
                 "UnicodeDecodeError", "os.system", "", 7):
        forged = error_from_wire({"kind": "RemoteError", "type": "X", "message": "m", "builtin": name})
        assert type(forged) is RemoteError, name
    # A kind of the runtime's own keeps its class (BadArguments is a TypeError already).
    from actors._errors import BadArguments
    assert type(error_from_wire(error_to_wire(BadArguments("no")))) is BadArguments


def test_every_builtin_of_the_table_is_rebuilt_with_its_message_and_details() -> None:
    from actors._errors import BUILTIN_KINDS, error_from_wire, error_to_wire, remote_error_class

    for name, base in BUILTIN_KINDS.items():
        error = remote_error_class(name)("msg", remote_type=name, remote_traceback="tb", details={"a": 1})
        assert isinstance(error, base) and error.message == "msg" and error.details == {"a": 1}, name
        assert type(error_from_wire(error_to_wire(error))) is type(error), name


def test_the_wires_own_errors_are_rebuilt_as_what_the_docs_say_to_catch() -> None:
    """Found by review: job.state_dict() past the message limit raised a RemoteValueError that `except
    MessageTooLarge` (as the docs' errors table says) did not catch. The wire's errors are rebuilt by their
    type's name from a table of two; any other name a peer gives still makes no class of its own."""
    from actors._errors import error_from_wire, error_to_wire
    from transport.wire import MessageTooLarge, WireError

    rebuilt = error_from_wire(error_to_wire(MessageTooLarge("the reply is 9 MiB, past the limit")))
    assert isinstance(rebuilt, MessageTooLarge) and isinstance(rebuilt, WireError) and isinstance(rebuilt, ValueError)
    assert isinstance(rebuilt, RemoteError) and rebuilt.message == "the reply is 9 MiB, past the limit"
    assert isinstance(error_from_wire(error_to_wire(WireError("bad"))), WireError)
    forged = error_from_wire({"kind": "RemoteError", "type": "transport.wire.Other", "message": "m"})
    assert type(forged) is RemoteError


async def test_a_task_whose_caller_takes_its_outcome_is_not_logged_as_the_runtimes_failure(
        caplog: pytest.LogCaptureFixture) -> None:
    """A stage's failed step ran in a runtime task: its report carried the failure, and the runtime logged
    the same exception as an ERROR with its traceback. An ``awaited`` task's outcome is its caller's."""
    async def fails() -> None:
        raise ValueError("the step's own fault")

    async with open_runtime("ipc://") as runtime:
        with caplog.at_level(logging.WARNING, logger="actors._runtime"):
            taken = runtime.spawn_task(fails(), name="taken", awaited=True)
            await asyncio.wait({taken})
            assert isinstance(taken.exception(), ValueError)
            assert "task taken failed" not in caplog.text
            dropped = runtime.spawn_task(fails(), name="dropped")
            await asyncio.wait({dropped})
            assert "task dropped failed" in caplog.text  # no one takes it: the runtime says so
        waits = runtime.spawn_task(asyncio.sleep(60), name="waits", awaited=True)
    assert waits.cancelled()  # still the runtime's to cancel as it closes
