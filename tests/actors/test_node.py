"""Multi-process tests: node processes, LocalCluster, heartbeats and clean-up."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from transport.security import split_address

from stages.build.describe import ModelInspector
from actors import (
    NODE,
    Cluster,
    ClusterKeys,
    LocalCluster,
    NodeActor,
    NodeSilent,
    NotAllowed,
    RemoteError,
    UnknownEndpoint,
    open_runtime,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(120),
              pytest.mark.asyncio(loop_scope="module")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


_KEYS: list[ClusterKeys] = []  # the module cluster's keys, for the tests that attach more members


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster() -> AsyncIterator[Cluster]:
    local = LocalCluster(nodes=2, allow=["tests"])
    async with local as cluster:
        assert local.keys is not None
        _KEYS[:] = [local.keys]
        yield cluster


async def test_nodes_register_with_their_details(cluster: Cluster) -> None:
    nodes = {n.name: n for n in await cluster.nodes()}
    assert set(nodes) == {"node0", "node1"}
    for node in nodes.values():
        assert node.state == "alive" and node.device == "cpu"
        assert node.pid != os.getpid() and alive(node.pid)
        assert node.memory_bytes > 0 and node.host
        # A Unix socket in the local cluster's folder (actors.cluster.local_binds), its bulk socket beside it.
        assert node.address.startswith("ipc:///") and f"/{node.name}|" in node.address
        assert node.address.endswith(f"/{node.name}.bulk")
        assert node.last_heartbeat_age_s < 2.0


async def test_round_trip_across_processes(cluster: Cluster) -> None:
    ref = await cluster.spawn("node0", "probe", "echo", label="first")
    assert await ref.ask("echo", {"nested": [1, "two", None]}) == {"nested": [1, "two", None]}
    who = await ref.ask("whoami")
    node0 = next(n for n in await cluster.nodes() if n.name == "node0")
    # In a process of its own (actors._processes), which the node names to the operator.
    hosted = (await cluster.node_ref(node0).ask("describe")).processes
    assert who == {"pid": hosted["echo"], "label": "first", "name": "echo"} and who["pid"] != node0.pid


async def test_remote_error_carries_the_remote_traceback(cluster: Cluster) -> None:
    ref = await cluster.spawn("node1", "probe", "failing")
    with pytest.raises(RemoteError) as info:
        await ref.ask("fail", "it broke")
    assert info.value.remote_type == "RuntimeError" and info.value.message == "it broke"
    assert "actors/probe.py" in info.value.remote_traceback and "raise RuntimeError" in info.value.remote_traceback
    with pytest.raises(UnknownEndpoint):
        await ref.ask("no_such_method")
    assert await ref.ask("echo", 1) == 1


async def test_only_registered_actor_classes_are_spawned(cluster: Cluster) -> None:
    with pytest.raises(NotAllowed, match="no actor class registered as 'os.system'"):
        await cluster.spawn("node0", "os.system", "evil")


async def test_factories_outside_the_allow_list_are_refused(cluster: Cluster) -> None:
    node = cluster.node_ref(next(n for n in await cluster.nodes() if n.name == "node0"))
    assert await node.ask("check_import", "torch.nn:Linear") == "torch.nn.modules.linear.Linear"
    assert (await node.ask("check_import", "tests.actors.test_node:alive")).endswith("alive")
    with pytest.raises(NotAllowed, match="start the node with --allow os"):
        await node.ask("check_import", "os:system")
    with pytest.raises(RemoteError, match="not an import path"):
        await node.ask("check_import", "import os; os.system('x')")


async def test_the_allow_list_bypass_is_refused_by_a_node_and_names_it(cluster: Cluster, tmp_path: Path) -> None:
    node = cluster.node_ref(next(n for n in await cluster.nodes() if n.name == "node0"))
    marker = tmp_path / "marker.txt"
    with pytest.raises(NotAllowed, match="node node0 refused it: .* may not pass through modules"):
        await node.ask("check_import", "torch.nn:functional.torch.os.system")
    inspector = await cluster.spawn("node0", "model_inspector", "inspector")
    describe = inspector.endpoint(ModelInspector.describe_model, timeout=30)
    with pytest.raises(NotAllowed, match="node node0 refused the model: .* may not pass through modules"):
        await describe.call("torch.nn:functional.torch.os.system", {"command": f"touch {marker}"})
    with pytest.raises(NotAllowed, match="node node0 refused the model: .*start the node with --allow os"):
        await describe.call("os:system", {"command": f"touch {marker}"})
    assert not marker.exists()


async def test_a_node_describes_a_model_by_its_layers_parameter_counts(cluster: Cluster) -> None:
    inspector = await cluster.spawn("node1", "model_inspector", "inspector")
    describe = inspector.endpoint(ModelInspector.describe_model, timeout=30)
    assert await describe.call("tests.helpers.models:linear_stack", {"layers": 3, "dim": 4}) == [20, 20, 20]
    # Built on the meta device: a model far larger than the node's memory costs nothing.
    huge = await describe.call("tests.helpers.models:linear_stack", {"layers": 2, "dim": 1 << 20})
    assert huge == [(1 << 40) + (1 << 20)] * 2
    with pytest.raises(RemoteError, match="unexpected keyword argument 'nope'"):
        await describe.call("tests.helpers.models:linear_stack", {"nope": 1})


async def test_the_head_never_imports_user_code(cluster: Cluster) -> None:
    head_agent = cluster.runtime.ref(cluster.head.address, NODE)
    with pytest.raises(NotAllowed, match="is the head, which never imports user code"):
        await head_agent.endpoint(NodeActor.spawn, timeout=30).call("model_inspector", "inspector", {})
    with pytest.raises(NotAllowed, match="is the head"):
        await head_agent.ask("check_import", "torch.nn:Linear")


async def test_per_sender_order_under_concurrent_senders_across_processes(cluster: Cluster) -> None:
    ref = await cluster.spawn("node1", "probe", "ordered")
    keys = _KEYS[0]
    async with open_runtime("tcp://127.0.0.1:0", keys=keys.identity("admin"), ring=keys.ring) as other:
        refs = {"driver": ref, "other": other.ref(ref.address, ref.name)}

        async def send(tag: str) -> None:
            for i in range(200):
                await refs[tag].tell("record", [tag, i])

        await asyncio.gather(send("driver"), send("other"))
        # Order holds per sender, so a reply to each sender means its tells are in.
        await refs["other"].ask("ping", timeout=10)
        seen = await ref.ask("recorded", timeout=10)
    assert len(seen) == 400
    for tag in refs:
        assert [i for t, i in seen if t == tag] == list(range(200))


async def test_malformed_frames_to_a_node_leave_it_serving(cluster: Cluster) -> None:
    ref = await cluster.spawn("node0", "probe", "sturdy")
    raw = zmq.asyncio.Context.instance().socket(zmq.PUSH)
    try:
        raw.connect(split_address(ref.address)[0])  # plaintext: refused at the handshake, as garbage would be
        for frames in ([b"\xc1\xc1"], [b"\x93\x01\x91\x95\xa4none\xa5int99\x90\x80\x01", b"x"],
                       [b"\x93\x02\x90\xc4\x00"], [b"\x93\x01\x90\xc4\x01\x01"], [os.urandom(64), os.urandom(9)]):
            await raw.send_multipart(frames)
        assert await ref.ask("echo", "still here", timeout=10) == "still here"
    finally:
        raw.close(linger=0)


async def test_connect_attaches_a_second_driver(cluster: Cluster) -> None:
    async with Cluster.connect(cluster.head.address, keys=_KEYS[0].directory) as second:
        assert {n.name for n in await second.nodes()} == {"node0", "node1"}


async def test_killed_node_is_reported_lost_within_the_timeout() -> None:
    lc = LocalCluster(nodes=2, heartbeat_timeout=2.0)
    async with lc as cluster:
        events = cluster.events()
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0.2)  # the subscription is in place
        killed_at = time.monotonic()
        os.kill(lc.processes["node1"].pid, signal.SIGKILL)
        event = await asyncio.wait_for(first, 10)
        elapsed = time.monotonic() - killed_at
        assert isinstance(event, NodeSilent) and event.node == "node1"
        assert elapsed <= 3.0, f"lost after {elapsed:.2f}s"
        states = {n.name: n.state for n in await cluster.nodes()}
        assert states == {"node0": "alive", "node1": "lost"}
        await events.aclose()
        first.cancel()


async def test_local_cluster_leaves_no_process_behind_when_the_body_raises() -> None:
    lc = LocalCluster(nodes=2)
    with pytest.raises(KeyError):
        async with lc:
            pids = lc.pids
            assert len(pids) == 3 and all(alive(p) for p in pids)
            raise KeyError("driver bug")
    assert not any(alive(p) for p in pids)


async def test_local_cluster_leaves_no_process_behind_when_cancelled() -> None:
    lc = LocalCluster(nodes=1)
    started = asyncio.Event()

    async def body() -> None:
        async with lc:
            started.set()
            await asyncio.sleep(3600)

    task = asyncio.ensure_future(body())
    await asyncio.wait_for(started.wait(), 60)
    pids = lc.pids
    task.cancel()  # what Ctrl-C does to the driver's main task
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not any(alive(p) for p in pids)
