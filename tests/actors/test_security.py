"""A cluster admits only its own keys, and each key may do only what its role may (docs/security.md, as tests)."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import AsyncIterator

import msgpack
import pytest
import pytest_asyncio
import torch
import zmq

from actors import (
    HEAD,
    NODE,
    ActorTimeout,
    Cluster,
    ClusterKeys,
    Event,
    EventSink,
    HeadActor,
    LocalCluster,
    NodeActor,
    NodeDescription,
    NodeSilent,
    NotAllowed,
    RemoteError,
    TooManySubscribers,
    UnknownActor,
    open_runtime,
)
from stages import RendezvousActor, StageActor, StepOrder
from schedulers.events import JobClosed, JobEvent, StepFinished
from schedulers.job_actor import JobActor
from transport.security import Keypair

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.asyncio(loop_scope="module")]

MODEL = {"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 2, "dim": 8}, "pipeline_stages": 2,
         "micro_batches": 2}
_LOCAL: list[LocalCluster] = []


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster() -> AsyncIterator[Cluster]:
    local = LocalCluster(nodes=2)
    async with local as cluster:
        assert local.keys is not None
        local.keys.add("client", "alice")
        local.keys.add("client", "bob")
        _LOCAL[:] = [local]
        yield cluster


def keys() -> ClusterKeys:
    assert _LOCAL[0].keys is not None
    return _LOCAL[0].keys


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 2, 8), torch.randn(4, 2, 8)


async def test_the_key_directory_is_private(cluster: Cluster) -> None:
    directory = keys().directory
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, name


@pytest.mark.parametrize("who", ["plaintext", "unknown key"])
async def test_a_peer_without_the_clusters_key_gets_no_answer(cluster: Cluster, who: str) -> None:
    head = cluster.head.address
    if who == "plaintext":
        opened = open_runtime("tcp://127.0.0.1:0")
    else:
        stranger = Keypair.generate()
        opened = open_runtime("tcp://127.0.0.1:0", keys=stranger, ring=lambda: {stranger.public: "client:me"})
    async with opened as runtime:
        with pytest.raises(ActorTimeout):  # refused at the handshake: not one byte reaches the head's decoder
            await runtime.ref(head, HEAD).endpoint(HeadActor.nodes, timeout=1.0).call()
    assert len(await cluster.nodes()) == 2  # the head goes on serving its members


async def test_a_client_cannot_act_on_another_clients_job(cluster: Cluster) -> None:
    async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice, \
            Cluster.connect(cluster.head.address, keys=keys().directory, identity="bob") as bob:
        job = await alice.train(**MODEL)
        try:
            await job.step(*batch())
            assert [d.job for d in await alice.jobs()] == [job.id]
            assert job.id not in [d.job for d in await bob.jobs()]  # not even listed
            with pytest.raises(NotAllowed, match=f"{job.id} belongs to client:alice"):
                await bob.job(job.id)
            # Bob calls alice's job actor through his own connection: what a forged call does.
            forged = bob.runtime.ref(*job.ref.to_wire())
            for attempt in (forged.endpoint(JobActor.state_dict).call(), forged.endpoint(JobActor.close).call(),
                            forged.endpoint(JobActor.load_state_dict).call({}),
                            forged.endpoint(JobActor.set).call("micro_batches", 4),
                            forged.endpoint(JobActor.step).call(*batch()), forged.endpoint(JobActor.run).call(1),
                            forged.ask("describe", timeout=10), forged.ask("stop", timeout=10)):  # by name too
                with pytest.raises(NotAllowed, match=f"{job.id} belongs to client:alice; only its owner or the admin"):
                    await attempt
            assert (await job.describe()).steps == 1  # alice's job goes on, unchanged
            assert [d.job for d in await cluster.jobs()] == [job.id]  # the admin key sees (and may do) all
        finally:
            await job.close()


async def feed(cluster: Cluster, name: str = "feed") -> asyncio.Queue[Event]:
    """Subscribes a new EventSink of ``cluster``'s runtime to the head's and the scheduler's events."""
    events: asyncio.Queue[Event] = asyncio.Queue()
    await cluster.subscribe(await cluster.runtime.spawn(EventSink(events.put_nowait), name))
    return events


async def heard_until(events: asyncio.Queue[Event], last: type[JobEvent], job: str) -> list[Event]:
    """Every event up to ``last`` of ``job`` (the scheduler tells each subscriber in publishing order)."""
    heard: list[Event] = []
    while True:
        heard.append(event := await asyncio.wait_for(events.get(), 60))
        if isinstance(event, last) and event.job == job:
            return heard


async def test_a_clients_subscription_hears_only_its_own_jobs_and_only_where_it_subscribed(cluster: Cluster) -> None:
    async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice, \
            Cluster.connect(cluster.head.address, keys=keys().directory, identity="bob") as bob:
        alices, bobs, admins = await feed(alice), await feed(bob), await feed(cluster)
        # Alice asks the scheduler to send to a sink of bob's runtime: a request whose reply address is his.
        stolen: asyncio.Queue[Event] = asyncio.Queue()
        await bob.runtime.spawn(EventSink(stolen.put_nowait), "forged")
        await alice.runtime._send(cluster.head.address, {"t": "req", "id": 1 << 40, "to": "scheduler",
                                                          "m": "subscribe", "a": ["forged"], "k": {},
                                                          "r": bob.runtime.address})
        job = await alice.train(**MODEL)
        try:
            await job.step(*batch())
            theirs = await bob.train(**MODEL)  # while alice's job runs: neither hears the other's
            await theirs.close()
        finally:
            await job.close()
        # Alice's job closed last: each feed heard all it would of both jobs by its last event.
        heard = {"alice": await heard_until(alices, JobClosed, job.id),
                 "bob": await heard_until(bobs, JobClosed, theirs.id),
                 "admin": await heard_until(admins, JobClosed, job.id)}
    jobs = {who: {e.job for e in events if isinstance(e, JobEvent)} for who, events in heard.items()}
    assert jobs == {"alice": {job.id}, "bob": {theirs.id}, "admin": {job.id, theirs.id}}
    [step] = [e for e in heard["alice"] if isinstance(e, StepFinished)]
    assert step.loss == step.loss and not [e for e in heard["bob"] if isinstance(e, StepFinished)]
    assert stolen.empty()  # the forged subscription was refused: nothing of alice's reached bob's runtime


async def test_a_key_holds_a_bounded_number_of_subscriptions_and_closing_frees_them(cluster: Cluster) -> None:
    async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice:
        for i in range(16):
            await feed(alice, f"feed{i}")
        with pytest.raises(TooManySubscribers, match="'client:alice' already holds 16 subscriptions to the head"):
            await feed(alice, "one too many")
        # Bob's key has its own count; and a sink of another runtime is refused before anything is sent.
        async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="bob") as bob:
            await feed(bob)
            with pytest.raises(ValueError, match="an EventSink of this connection's runtime"):
                await bob.subscribe(alice.runtime.ref(alice.runtime.address, "feed0"))
    async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as again:
        for i in range(16):  # the closed connection gave its subscriptions back
            await feed(again, f"feed{i}")


async def test_a_node_describes_itself_and_checks_imports_for_a_client_without_its_internals(cluster: Cluster) -> None:
    job = await cluster.train(**MODEL)  # the admin's: its stage actors run on both nodes
    try:
        node = next(n for n in await cluster.nodes() if n.name == "node0")
        head_agent = cluster.runtime.ref(cluster.head.address, NODE)
        async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice:
            assert {n.pid for n in await alice.nodes()} == {0} and node.pid  # the membership list, without pids
            for agent, name in ((cluster.node_ref(node), "node0"), (head_agent, "head")):
                mine = await alice.runtime.ref(agent.address, NODE).endpoint(NodeActor.describe, timeout=10).call()
                assert isinstance(mine, NodeDescription) and mine.name == name and mine.num_actors >= 2
                assert (mine.pid, mine.host, mine.address, mine.actors, mine.allow, mine.working_directory) == \
                    (None,) * 6
                assert job.id not in str(mine.to_wire())  # no other job's actor names
                full = await agent.endpoint(NodeActor.describe, timeout=10).call()  # the admin's view: everything
                assert full.actors is not None and any(a.startswith(job.id) for a in full.actors)
                assert full.allow and full.working_directory and full.num_actors == len(full.actors)
                assert full.pid == node.pid if name == "node0" else full.pid

            check = alice.runtime.ref(node.address, NODE).endpoint(NodeActor.check_import, timeout=10)
            admin_check = cluster.node_ref(node).endpoint(NodeActor.check_import, timeout=10)
            assert await check.call("torch.nn:Linear") == "torch.nn.modules.linear.Linear"
            for path, reason in (("os:system", "is not on this node's allow-list; start the node with --allow os"),
                                 ("torch.nn.functional:conv2d", "defined outside this node's allow-list and only")):
                with pytest.raises(NotAllowed, match=reason) as refused:
                    await check.call(path)
                assert "torch.optim" not in refused.value.message  # the allow-list's entries stay on the node
                with pytest.raises(NotAllowed, match=r"allow-list \(torch\.nn, torch\.optim"):
                    await admin_check.call(path)
            with pytest.raises(RemoteError) as missing:
                await check.call("examples.not_there:model")
            assert missing.value.remote_type == "ModuleNotFoundError" and "No module named" in missing.value.message
            assert "runs in" not in missing.value.message and "PYTHONPATH=" not in missing.value.message
            assert not missing.value.remote_traceback  # a traceback would show the node's files
            with pytest.raises(RemoteError, match="this process runs in .* with PYTHONPATH="):
                await admin_check.call("examples.not_there:model")
    finally:
        await job.close()


async def test_clients_cannot_register_nodes_spawn_actors_or_shut_nodes_down(cluster: Cluster) -> None:
    node = next(n for n in await cluster.nodes() if n.name == "node0")
    async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice:
        head = alice.runtime.ref(cluster.head.address, HEAD)
        with pytest.raises(NotAllowed, match="may not call HeadActor.register"):
            await head.endpoint(HeadActor.register, timeout=10).call({"name": 7, "address": 8})
        agent = alice.runtime.ref(node.address, NODE)
        with pytest.raises(NotAllowed, match="may not call NodeActor.spawn"):
            await agent.endpoint(NodeActor.spawn, timeout=10).call("probe", "mine", {})
        with pytest.raises(NotAllowed, match="may not call NodeActor.shutdown"):
            await agent.endpoint(NodeActor.shutdown, timeout=10).call()
    assert {n.name for n in await cluster.nodes() if n.alive} == {"node0", "node1"}


async def test_forged_deliveries_are_refused_and_counted(cluster: Cluster) -> None:
    job = await cluster.train(**MODEL)
    try:
        await job.step(*batch())
        (info,) = [d for d in await cluster.jobs() if d.job == job.id]
        last = cluster.runtime.ref(*info.stages[1])
        poison = torch.full((2, 2, 8), float("nan"))
        # A client key may not deliver at all.
        async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice:
            deliver = alice.runtime.ref(last.address, last.name).endpoint(StageActor.deliver, timeout=10)
            with pytest.raises(NotAllowed, match="may not call StageActor.deliver"):
                await deliver.call(1, "F", 1, 0, [poison], 0)
        # A member's key that is none of this job's nodes' may not either.
        outsider = keys().add("node", "outsider")
        async with open_runtime("tcp://127.0.0.1:0", keys=outsider, ring=keys().ring) as member:
            deliver = member.ref(last.address, last.name).endpoint(StageActor.deliver, timeout=10)
            with pytest.raises(NotAllowed, match="holds no key of job"):
                await deliver.call(1, "F", 1, 0, [poison], 0)
        # The job's own nodes' keys may, but only for the current or next step and a slot the programs have.
        async with open_runtime("tcp://127.0.0.1:0", keys=keys().identity("node0"), ring=keys().ring) as member:
            deliver = member.ref(last.address, last.name).endpoint(StageActor.deliver, timeout=10)
            for forged in ((1000, "F", 1, 0), (1, "F", 0, 0), (1, "B", 1, 0), (1, "F", 1, 99), (1, "X", 1, 0)):
                with pytest.raises(NotAllowed, match="expects no"):
                    await deliver.call(*forged, [poison], 0)
            # A slot the next step has, but not a well-formed value: refused before it is kept.
            for leaves, spec, reason in (([poison], {"x": [0]}, "not one of"), ([poison, poison], 1, "describes 1"),
                                         ([poison], {"t": [[0]] * 40}, "not a one-entry map"),
                                         (poison, 1, "a list of tensors")):
                with pytest.raises(NotAllowed, match=reason):
                    await deliver.call(1, "F", 1, 0, leaves, spec)
        stats = await job.step(*batch())  # nothing forged got in: the step is clean
        assert stats.loss == stats.loss  # not NaN
    finally:
        await job.close()


async def test_only_the_head_turns_w_batching_on_for_a_step_and_a_bad_value_changes_nothing(cluster: Cluster) -> None:
    job = await cluster.train(**MODEL)
    try:
        await job.step(*batch())
        (info,) = [d for d in await cluster.jobs() if d.job == job.id]
        stage = cluster.runtime.ref(*info.stages[0])
        # run_step(order): a client's key and the job's own node's key are refused before any argument is read.
        call = (StepOrder(step=5, program=[], w_batching=True).to_wire(),)
        async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice:
            with pytest.raises(NotAllowed, match="may not call StageActor.run_step"):
                await alice.runtime.ref(stage.address, stage.name).endpoint(StageActor.run_step, timeout=10).call(*call)
        async with open_runtime("tcp://127.0.0.1:0", keys=keys().identity("node0"), ring=keys().ring) as member:
            with pytest.raises(NotAllowed, match="may not call StageActor.run_step"):
                await member.ref(stage.address, stage.name).endpoint(StageActor.run_step, timeout=10).call(*call)
        # The head's key may call it; a value that is not a bool is refused before the stage moves to that step.
        async with open_runtime("tcp://127.0.0.1:0", keys=keys().identity("head"), ring=keys().ring) as head:
            run_step = head.ref(stage.address, stage.name).endpoint(StageActor.run_step, timeout=10)
            with pytest.raises(RemoteError, match="ValueError: w_batching must be a bool, got 'yes'"):
                await run_step.call({**call[0], "w_batching": "yes"})
        stats = await job.step(*batch())  # the refused call left the stage where it was
        assert stats.loss == stats.loss
    finally:
        await job.close()


async def test_snapshots_and_tied_gradients_come_only_from_the_jobs_own_stages(cluster: Cluster) -> None:
    job = await cluster.train(**MODEL)
    try:
        await job.step(*batch())
        (info,) = [d for d in await cluster.jobs() if d.job == job.id]
        stage = cluster.runtime.ref(*info.stages[1])
        snapshot = {"model/2.weight": torch.zeros(2)}
        async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice:
            theirs = alice.runtime.ref(stage.address, stage.name)
            with pytest.raises(NotAllowed, match="may not call StageActor.keep_snapshot"):
                await theirs.endpoint(StageActor.keep_snapshot, timeout=10).call(0, 1, snapshot)
            with pytest.raises(NotAllowed, match="may not call StageActor.deliver_tied"):
                await theirs.endpoint(StageActor.deliver_tied, timeout=10).call(1, "0.weight", 0, torch.zeros(2))
        outsider = keys().add("node", "snapshot_outsider")
        async with open_runtime("tcp://127.0.0.1:0", keys=outsider, ring=keys().ring) as member:
            theirs = member.ref(stage.address, stage.name)
            with pytest.raises(NotAllowed, match="holds no key of job"):
                await theirs.endpoint(StageActor.keep_snapshot, timeout=10).call(0, 1, snapshot)
            with pytest.raises(NotAllowed, match="holds no key of job"):
                await theirs.endpoint(StageActor.deliver_tied, timeout=10).call(1, "0.weight", 0, torch.zeros(2))
        async with open_runtime("tcp://127.0.0.1:0", keys=keys().identity("node0"), ring=keys().ring) as member:
            # The job's own node, but a gradient for a group this untied model does not have.
            theirs = member.ref(stage.address, stage.name)
            with pytest.raises(NotAllowed, match="expects no tied gradient"):
                await theirs.endpoint(StageActor.deliver_tied, timeout=10).call(1, "0.weight", 0, torch.zeros(2))
        stats = await job.step(*batch())  # nothing refused got in: the job still trains
        assert stats.loss == stats.loss
    finally:
        await job.close()


async def test_a_jobs_rendezvous_serves_only_its_own_nodes_and_goes_with_the_job(cluster: Cluster) -> None:
    job = await cluster.train(**{**MODEL, "pipeline_stages": 1, "data_parallel": 2})
    store = f"{job.id}.rendezvous"
    try:
        await job.step(*batch())  # the two replicas formed their gloo group through it
        head = cluster.head.address
        async with Cluster.connect(head, keys=keys().directory, identity="alice") as alice:
            get = alice.runtime.ref(head, store).endpoint(RendezvousActor.get, timeout=10)
            with pytest.raises(NotAllowed, match="may not call RendezvousActor.get"):
                await get.call("x")
        intruder = keys().add("node", "intruder")
        async with open_runtime("tcp://127.0.0.1:0", keys=intruder, ring=keys().ring) as member:
            for attempt in (member.ref(head, store).endpoint(RendezvousActor.num_keys, timeout=10).call(),
                            member.ref(head, store).endpoint(RendezvousActor.set, timeout=10).call("k", b"v")):
                with pytest.raises(NotAllowed, match="only its members use its rendezvous"):
                    await attempt
        async with open_runtime("tcp://127.0.0.1:0", keys=keys().identity("node0"), ring=keys().ring) as member:
            assert await member.ref(head, store).endpoint(RendezvousActor.num_keys, timeout=10).call() > 0
    finally:
        await job.close()
    async with open_runtime("tcp://127.0.0.1:0", keys=keys().identity("node0"), ring=keys().ring) as member:
        with pytest.raises(UnknownActor):
            await member.ref(cluster.head.address, store).endpoint(RendezvousActor.num_keys, timeout=10).call()


async def test_a_members_flood_leaves_the_head_answering_and_no_node_lost(cluster: Cluster) -> None:
    """The probe's flood (30 msgpack lists of 5 million empty lists), from a key the cluster admits."""
    from transport.security import configure_client, split_address

    flood = [msgpack.packb([1, [], b"\xdd" + (5_000_000).to_bytes(4, "big") + b"\x90" * 5_000_000])]
    endpoint, head_key = split_address(cluster.head.address)
    assert head_key is not None
    member = keys().identity("node0")
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    try:
        configure_client(push, member, head_key)
        push.connect(endpoint)
        events = cluster.events()
        lost: list[dict[str, object]] = []

        async def watch() -> None:
            async for event in events:
                if isinstance(event, NodeSilent):
                    lost.append(event)

        watcher = asyncio.ensure_future(watch())
        await asyncio.sleep(0.2)  # the subscription is in place
        worst = 0.0
        for _ in range(30):
            await asyncio.to_thread(push.send_multipart, flood)
            started = time.perf_counter()
            assert len(await cluster.nodes()) == 2
            worst = max(worst, time.perf_counter() - started)
        await asyncio.sleep(2.5)  # longer than the heartbeat timeout (2 s): a starved head would mark nodes lost
        watcher.cancel()
        assert worst < 0.5, f"the head took {worst:.3f}s to answer under the flood"
        assert not lost and {n.state for n in await cluster.nodes()} == {"alive"}
    finally:
        push.close(linger=0)
        context.term()
