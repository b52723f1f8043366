"""Tests for actors/_nodes.py in one process: the head keeps NodeInfo records and tells EventSinks typed events."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from actors import (
    HEAD,
    ActorLost,
    BadArguments,
    Event,
    EventSink,
    HeadActor,
    NodeInfo,
    NodeJoined,
    NodeLeft,
    NodeSilent,
    NotAllowed,
    RemoteError,
    Runtime,
    open_runtime,
)

pytestmark = pytest.mark.timeout(30)

WORKER = NodeInfo(name="node0", address="tcp://127.0.0.1:1", device="cpu", pid=11, host="box", memory_bytes=1 << 30)


@pytest.fixture
async def head_and_client() -> AsyncIterator[tuple[HeadActor, Runtime, Runtime]]:
    async with open_runtime("ipc://") as server, open_runtime("tcp://127.0.0.1:0") as client:
        head = HeadActor(heartbeat_interval=0.05, heartbeat_timeout=0.2)
        await server.spawn(head, HEAD)
        yield head, server, client


async def subscribe(client: Runtime, head_address: str) -> asyncio.Queue[Event]:
    events: asyncio.Queue[Event] = asyncio.Queue()
    sink = await client.spawn(EventSink(events.put_nowait), "events")
    await client.ref(head_address, HEAD).endpoint(HeadActor.subscribe, timeout=5).call(sink.name)
    return events


async def test_a_node_registers_as_a_record_and_its_events_arrive_as_records(
    head_and_client: tuple[HeadActor, Runtime, Runtime]
) -> None:
    _, server, client = head_and_client
    head = client.ref(server.address, HEAD)
    events = await subscribe(client, server.address)
    settings = await head.endpoint(HeadActor.register, timeout=5).call(WORKER)
    assert (settings.interval, settings.timeout) == (0.05, 0.2)
    assert settings.liveness.startswith("ipc://")  # the socket the head watches this node's connection on
    [node] = await head.endpoint(HeadActor.nodes, timeout=5).call()
    assert isinstance(node, NodeInfo) and node.alive and (node.name, node.pid, node.host) == ("node0", 11, "box")
    joined = await asyncio.wait_for(events.get(), 5)
    assert isinstance(joined, NodeJoined) and joined.node == "node0" and joined.kind == "node_joined"
    assert joined.time > 0  # the head's clock, set when published
    # Silent past the timeout: lost, and the subscriber hears it as a NodeSilent.
    silent = await asyncio.wait_for(events.get(), 5)
    assert isinstance(silent, NodeSilent) and silent.node == "node0" and silent.silent_s >= 0.2  # (to the ms)
    assert [n.state for n in await head.endpoint(HeadActor.nodes, timeout=5).call()] == ["lost"]
    await head.endpoint(HeadActor.register, timeout=5).call(WORKER)  # it comes back
    await head.endpoint(HeadActor.deregister, timeout=5).call("node0")
    assert isinstance(await asyncio.wait_for(events.get(), 5), NodeJoined)
    left = await asyncio.wait_for(events.get(), 5)
    assert isinstance(left, NodeLeft) and left.node == "node0"


async def test_the_head_decides_a_nodes_state_and_identity(head_and_client: tuple[HeadActor, Runtime, Runtime]) -> None:
    _, server, client = head_and_client
    head = client.ref(server.address, HEAD)
    await head.endpoint(HeadActor.register, timeout=5).call(
        dataclasses.replace(WORKER, state="lost", identity="admin:me"))
    [node] = await head.endpoint(HeadActor.nodes, timeout=5).call()
    assert node.state == "alive" and node.identity == ""  # a runtime without keys: no identity


BAD_REGISTRATIONS = [
    ({"name": "node0", "address": "x"}, BadArguments, "info must be NodeInfo, not dict"),
    (dataclasses.replace(WORKER, pid="11"), RemoteError, "register needs a NodeInfo with"),  # type: ignore[arg-type]
    (dataclasses.replace(WORKER, pid=True), RemoteError, "register needs a NodeInfo with"),
    (dataclasses.replace(WORKER, host="h" * 300), RemoteError, "at most 256 characters"),
]


@pytest.mark.parametrize(("info", "error", "match"), BAD_REGISTRATIONS)
async def test_a_bad_registration_is_refused_and_the_head_keeps_serving(
    head_and_client: tuple[HeadActor, Runtime, Runtime], info: object, error: type[Exception], match: str
) -> None:
    _, server, client = head_and_client
    head = client.ref(server.address, HEAD)
    with pytest.raises(error, match=match):
        await head.endpoint(HeadActor.register, timeout=5).call(info)  # type: ignore[arg-type]
    assert await head.endpoint(HeadActor.nodes, timeout=5).call() == []


async def test_an_event_sink_takes_events_only() -> None:
    async with open_runtime("ipc://") as runtime:
        taken: list[Event] = []
        sink = await runtime.spawn(EventSink(taken.append), "events")
        await sink.endpoint(EventSink.on_event, timeout=5).call(NodeLeft(node="n"))
        with pytest.raises(BadArguments, match="event must be Event, not dict"):
            await sink.endpoint(EventSink.on_event, timeout=5).call({"type": "node_left"})  # type: ignore[arg-type]
        assert taken == [NodeLeft(node="n")]


async def test_a_worker_started_before_its_head_waits_for_the_address_file(tmp_path: Path) -> None:
    from actors._serve import _read_join_file

    path, stop = tmp_path / "head.address", asyncio.Event()
    waiting = asyncio.ensure_future(_read_join_file(str(path), 60, stop))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # no head yet
    path.write_text("tcp://127.0.0.1:5555\n")
    assert await waiting == "tcp://127.0.0.1:5555"
    with pytest.raises(TimeoutError, match="the head wrote no address to .* within 0.05s"):
        await _read_join_file(str(tmp_path / "never"), 0.05, stop)
    stop.set()
    assert await _read_join_file(str(tmp_path / "never"), 60, stop) == ""  # stopped while waiting


async def test_a_node_reports_the_actor_processes_it_hosts_and_the_head_fails_calls_to_an_ended_one() -> None:
    async with open_runtime("ipc://") as server, open_runtime("tcp://127.0.0.1:0") as client:
        await server.spawn(HeadActor(heartbeat_interval=5, heartbeat_timeout=60), HEAD)
        head = client.ref(server.address, HEAD)
        await head.endpoint(HeadActor.register, timeout=5).call(WORKER)
        stage = "tcp://127.0.0.1:2"
        await head.endpoint(HeadActor.hosting, timeout=5).call("node0", [stage])
        lost = head.endpoint(HeadActor.actor_lost, timeout=5)
        with pytest.raises(RemoteError, match="node node0 hosts no actor process at"):
            await lost.call("node0", "tcp://127.0.0.1:3", "job0.rank1", "exited with code 7")
        with pytest.raises(NotAllowed, match="no live node 'node1' registered with this key"):
            await lost.call("node1", stage, "job0.rank1", "exited with code 7")
        with pytest.raises(RemoteError, match="a list of at most 4096 addresses"):
            await head.endpoint(HeadActor.hosting, timeout=5).call("node0", ["x"] * 4097)
        assert server.lost(stage) is None
        await lost.call("node0", stage, "job0.rank1", "killed by SIGSEGV")
        gone = server.lost(stage)
        assert isinstance(gone, ActorLost) and gone.message == "job0.rank1 on node node0: its process killed by SIGSEGV"
        with pytest.raises(ActorLost):  # the head's own calls to it fail at once from now on
            await server.ref(stage, "job0.rank1").ask("anything", timeout=60)


async def test_a_node_key_cannot_take_over_keep_alive_remove_or_cut_off_another_nodes() -> None:
    """Found by review: node:n1 registered as n0 (the refusal told it the pid to give), kept n0 alive with
    heartbeats, deregistered it, and said it hosted n0's own address, then that it was lost: the head's
    calls to n0 failed. A node names only itself and addresses that carry its own key."""
    from dataclasses import replace

    from actors import NODE, NodeActor
    from actors._nodes import node_info
    from transport.security import Keypair

    head_keys, keys0, keys1 = Keypair.generate(), Keypair.generate(), Keypair.generate()
    ring = {head_keys.public: "head:head", keys0.public: "node:n0", keys1.public: "node:n1"}
    async with open_runtime("tcp://127.0.0.1:0", keys=head_keys, ring=lambda: ring) as server, \
            open_runtime("tcp://127.0.0.1:0", keys=keys0, ring=lambda: ring) as n0, \
            open_runtime("tcp://127.0.0.1:0", keys=keys1, ring=lambda: ring) as n1:
        await server.spawn(HeadActor(heartbeat_interval=5, heartbeat_timeout=60), HEAD)
        await n0.spawn(NodeActor(node_info("n0", n0.address, "cpu"), (), asyncio.Event()), NODE)
        as0, as1 = n0.ref(server.address, HEAD), n1.ref(server.address, HEAD)
        info0 = node_info("n0", n0.address, "cpu")
        await as0.endpoint(HeadActor.register, timeout=5).call(info0)
        await as1.endpoint(HeadActor.register, timeout=5).call(node_info("n1", n1.address, "cpu"))
        with pytest.raises(NotAllowed, match="already named 'n0', under another key") as taken:
            await as1.endpoint(HeadActor.register, timeout=5).call(replace(info0, address=n1.address))
        assert str(info0.pid) not in taken.value.message
        with pytest.raises(NotAllowed, match="does not carry this node's own key"):  # n0's address, as n2
            await as1.endpoint(HeadActor.register, timeout=5).call(replace(info0, name="n2"))
        for call in (as1.endpoint(HeadActor.heartbeat, timeout=5).call("n0"),
                     as1.endpoint(HeadActor.deregister, timeout=5).call("n0")):
            with pytest.raises(NotAllowed, match="no live node 'n0' registered with this key"):
                await call
        with pytest.raises(NotAllowed, match="hosts actors only in processes of its own"):
            await as1.endpoint(HeadActor.hosting, timeout=5).call("n1", [n0.address])
        nodes = {node.name: node for node in await server.ref(server.address, HEAD).endpoint(
            HeadActor.nodes, timeout=5).call()}
        assert (nodes["n0"].state, nodes["n0"].identity, nodes["n0"].address) == ("alive", "node:n0", n0.address)
        assert (await server.ref(n0.address, NODE).endpoint(NodeActor.describe, timeout=5).call()).name == "n0"
        assert await as0.endpoint(HeadActor.heartbeat, timeout=5).call("n0") is True
