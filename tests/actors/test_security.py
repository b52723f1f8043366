"""A cluster admits only its own keys, and each key may do only what its role may (docs/security.md, as tests)."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import pytest
import pytest_asyncio
import torch
import zmq

from actors import (
    HEAD,
    NODE,
    ActorTimeout,
    BadArguments,
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
from schedulers.client import CheckpointError
from schedulers.events import JobClosed, JobEvent, StepFinished
from schedulers.job_actor import JobActor
from transport.sealed import SessionKey
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


def checkpoint_root() -> str:
    """The head's checkpoint root: the cluster's own (in its temporary directory), since none was given."""
    assert _LOCAL[0].checkpoint_root is not None
    return _LOCAL[0].checkpoint_root


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


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


async def test_a_driver_without_the_clusters_key_is_told_what_to_check(cluster: Cluster, tmp_path: Path) -> None:
    """Both waited ten seconds and said only "no reply from head.nodes"; the keyless one now fails at once."""
    from actors._reach import HeadUnreachable, SecurityMismatch

    other = ClusterKeys.create(str(tmp_path / "other"))
    with pytest.raises(HeadUnreachable, match="something listens there but did not answer: a head whose ring does "
                                              "not hold this process's key refuses its handshake"):
        await Cluster.connect(cluster.head.address, keys=other.directory, identity="admin", timeout=1.0)
    with pytest.raises(SecurityMismatch, match="is secure \\(its address carries its public key\\), and this process "
                                               "has no keys: connect with keys="):
        await Cluster.connect(cluster.head.address, insecure=True)


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
                            forged.endpoint(JobActor.evaluate).call(*batch(), True),
                            forged.endpoint(JobActor.save).call("run"), forged.endpoint(JobActor.load).call("run"),
                            forged.endpoint(JobActor.export).call("model"), forged.endpoint(JobActor.wait).call(),
                            forged.endpoint(JobActor.cancel_step).call(),  # would cancel alice's steps
                            forged.ask("describe", timeout=10), forged.ask("stop", timeout=10)):  # by name too
                with pytest.raises(NotAllowed, match=f"{job.id} belongs to client:alice; only its owner or the admin"):
                    await attempt
            assert (await job.describe()).steps == 1  # alice's job goes on, unchanged
            assert [d.job for d in await cluster.jobs()] == [job.id]  # the admin key sees (and may do) all
        finally:
            await job.close()


# -- checkpoints are the job's own: a client keeps them under ROOT/NAME --------------------------


async def test_a_client_saves_under_its_own_subtree_and_another_client_cannot_load_or_save_there(
    cluster: Cluster
) -> None:
    root = checkpoint_root()
    async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice, \
            Cluster.connect(cluster.head.address, keys=keys().directory, identity="bob") as bob:
        hers, his = await alice.train(**MODEL), await bob.train(**MODEL, seed=1)
        try:
            await hers.step(*batch())
            assert await hers.save("run") == f"{root}/alice/run/v000001"  # relative: under her subtree
            await hers.step(*batch())
            assert await hers.save("run") == f"{root}/alice/run/v000002"
            saved, own = await hers.state_dict(), await his.state_dict()
            for path in (f"{root}/alice/run", "../alice/run", f"{root}/bob/../alice/run", f"{root}/alice"):
                for attempt in (his.load(path), his.load(path, weights_only=True), his.save(path), his.export(path)):
                    with pytest.raises(NotAllowed, match=f"is outside {root}/bob, where the checkpoints of "
                                                         "client:bob are kept") as info:
                        await attempt
                    assert "v00000" not in str(info.value) and "LATEST" not in str(info.value), path
            assert_same(await his.state_dict(), own)  # none of her weights
            assert sorted(os.listdir(f"{root}/alice/run")) == ["LATEST", "v000002"]  # nothing of hers deleted
            # His own "run" is another directory, and her next load is her own save.
            assert await his.save("run") == f"{root}/bob/run/v000001"
            await hers.step(*batch())
            assert await hers.load("run") == 2
            assert_same(await hers.state_dict(), saved)
            # A job's own checkpoint_dir is taken as a save's is: his cannot name hers (refused before any
            # work), and his relative one lies in his subtree, where resuming finds nothing of hers.
            for path in (f"{root}/alice/run", "../alice/run"):
                with pytest.raises(NotAllowed, match=f"is outside {root}/bob"):
                    await bob.train(**MODEL, checkpoint_dir=path, resume_from_checkpoint=True)
            resumed = await bob.train(**MODEL, checkpoint_dir="fresh", resume_from_checkpoint=True, checkpoint_every=1)
            try:
                assert (resumed.resumed_from, resumed.resumed_step) == (None, 0)
                await resumed.step(*batch())
                assert sorted(os.listdir(f"{root}/bob/fresh")) == ["LATEST", "v000001"]
            finally:
                await resumed.close()
        finally:
            await hers.close()
            await his.close()


async def test_the_admin_key_saves_and_loads_anywhere(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = checkpoint_root()
    monkeypatch.chdir(tmp_path)
    async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice:
        hers = await alice.train(**MODEL)
        try:
            await hers.save("for-the-admin")
            job = await cluster.train(**MODEL, seed=3)  # the LocalCluster's driver holds the admin key
            try:
                assert await job.save(tmp_path / "mine") == f"{tmp_path}/mine/v000001"  # outside the root
                assert await job.save("relative") == f"{tmp_path}/relative/v000001"  # from the driver's directory
                assert await job.load(f"{root}/alice/for-the-admin") == 0  # inside a client's subtree
                assert_same(await job.state_dict(), await hers.state_dict())
                assert await job.save(f"{root}/alice/from-the-admin") == f"{root}/alice/from-the-admin/v000001"
            finally:
                await job.close()
            assert await hers.load("from-the-admin") == 0
        finally:
            await hers.close()


async def test_checkpoint_errors_name_no_file_and_repeat_no_bytes(cluster: Cluster) -> None:
    """What the operator (or anyone with a shell) put in a client's subtree is not told back to the client."""
    root = checkpoint_root()
    notes = Path(root, "bob", "notes")
    notes.mkdir(parents=True)
    for name in ("id_ed25519", "notes.txt", "payroll.csv"):
        (notes / name).write_text("private")
    Path(root, "bob", "pointer").mkdir()
    Path(root, "bob", "pointer", "LATEST").write_text("hunter2 is the password\n")
    Path(root, "bob", "empty").mkdir()
    async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="bob") as bob:
        job = await bob.train(**MODEL)
        try:
            with pytest.raises(CheckpointError, match=f"{root}/bob/notes is not an actorpipe checkpoint directory") \
                    as info:
                await job.save("notes")
            messages = [str(info.value)]
            for name in ("notes", "pointer", "empty", "missing"):
                with pytest.raises(CheckpointError, match=f"no actorpipe checkpoint at {root}/bob/{name}\n") as info:
                    await job.load(name)
                messages.append(str(info.value).replace(name, "DIR"))
            assert len(set(messages[1:])) == 1  # what a directory holds or lacks is not told apart
            for message in messages:
                assert not any(word in message for word in ("id_ed25519", "notes.txt", "payroll", "hunter2")), message
            assert sorted(os.listdir(notes)) == ["id_ed25519", "notes.txt", "payroll.csv"]
        finally:
            await job.close()


async def test_a_jobs_save_leaves_another_jobs_staging_directory_alone(cluster: Cluster) -> None:
    root = checkpoint_root()
    async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice:
        first, second = await alice.train(**MODEL), await alice.train(**MODEL)
        try:
            await first.save("shared")
            # The first job's next save, in progress: its staging directory, half written.
            staging = Path(root, "alice", "shared", f".staging-{first.id}-0000beef")
            staging.mkdir()
            (staging / "p0-t0.safetensors").write_bytes(b"half")
            assert await second.save("shared") == f"{root}/alice/shared/v000002"
            assert (staging / "p0-t0.safetensors").read_bytes() == b"half"  # the other job's save goes on
            assert await first.save("shared") == f"{root}/alice/shared/v000003"  # and clears its own leftover
            assert sorted(os.listdir(Path(root, "alice", "shared"))) == ["LATEST", "v000003"]
        finally:
            await first.close()
            await second.close()


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
                await check.call("examples.models.not_there:model")
            assert missing.value.remote_type == "ModuleNotFoundError" and "No module named" in missing.value.message
            assert "runs in" not in missing.value.message and "PYTHONPATH=" not in missing.value.message
            assert not missing.value.remote_traceback  # a traceback would show the node's files
            with pytest.raises(RemoteError, match="this process runs in .* with PYTHONPATH="):
                await admin_check.call("examples.models.not_there:model")
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


async def test_only_a_node_itself_reports_the_actor_processes_it_hosts_and_their_end(cluster: Cluster) -> None:
    # The head fails every call to an address a node says its actor process at ended: a client, or
    # another node's key, could otherwise cut a job off from its stages.
    job = await cluster.train(**MODEL)
    try:
        await job.step(*batch())
        host = next(n for n in await cluster.nodes() if n.name == job.nodes[1])
        assert f"{job.id}.rank1" in (await cluster.node_ref(host).ask("describe")).processes
        async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice:
            head = alice.runtime.ref(cluster.head.address, HEAD)
            with pytest.raises(NotAllowed, match="may not call HeadActor.actor_lost"):
                await head.endpoint(HeadActor.actor_lost, timeout=10).call(job.nodes[1], "x", "y", "z")
            with pytest.raises(NotAllowed, match="may not call HeadActor.hosting"):
                await head.endpoint(HeadActor.hosting, timeout=10).call(job.nodes[1], [])
            agent = alice.runtime.ref(host.address, NODE)
            with pytest.raises(NotAllowed, match="may not call NodeActor.stop_actor"):
                await agent.endpoint(NodeActor.stop_actor, timeout=10).call(f"{job.id}.rank1")
        other = job.nodes[0]
        async with Cluster.connect(cluster.head.address, keys=keys().directory, identity=other) as node:
            head = node.runtime.ref(cluster.head.address, HEAD)
            with pytest.raises(NotAllowed, match=f"no live node '{job.nodes[1]}' registered with this key"):
                await head.endpoint(HeadActor.hosting, timeout=10).call(job.nodes[1], [])
            with pytest.raises(NotAllowed, match=f"no live node '{job.nodes[1]}' registered with this key"):
                await head.endpoint(HeadActor.actor_lost, timeout=10).call(job.nodes[1], "x", "y", "z")
        assert (await job.step(*batch())).loss > 0  # nothing was cut off
    finally:
        await job.close()


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
            # Nor may a client write files through a stage: an export is the head's to order.
            with pytest.raises(NotAllowed, match="may not call StageActor.export_begin"):
                await alice.runtime.ref(stage.address, stage.name).endpoint(StageActor.export_begin, timeout=10).call(
                    "/tmp/anywhere")
            # Nor ask which keys of a file the model passes over: the head asks, as it loads one.
            with pytest.raises(NotAllowed, match="may not call StageActor.passed_over"):
                await alice.runtime.ref(stage.address, stage.name).endpoint(StageActor.passed_over, timeout=10).call(
                    ["h.0.attn.bias"])
        async with open_runtime("tcp://127.0.0.1:0", keys=keys().identity("node0"), ring=keys().ring) as member:
            with pytest.raises(NotAllowed, match="may not call StageActor.run_step"):
                await member.ref(stage.address, stage.name).endpoint(StageActor.run_step, timeout=10).call(*call)
        # The head's key may call it; a value that is not a bool is refused before the stage moves to that step.
        async with open_runtime("tcp://127.0.0.1:0", keys=keys().identity("head"), ring=keys().ring) as head:
            run_step = head.ref(stage.address, stage.name).endpoint(StageActor.run_step, timeout=10)
            with pytest.raises(RemoteError, match="ValueError: w_batching must be a bool, got 'yes'"):
                await run_step.call({**call[0], "w_batching": "yes"})
            passed_over = head.ref(stage.address, stage.name).endpoint(StageActor.passed_over, timeout=10)
            with pytest.raises(RemoteError, match="TypeError: keys must be a list of str"):
                await passed_over.call("h.0.attn.bias")
            assert await passed_over.call(["h.0.attn.bias"]) == []  # a model without patterns passes nothing over
        stats = await job.step(*batch())  # the refused call left the stage where it was
        assert stats.loss == stats.loss
    finally:
        await job.close()


async def test_only_the_head_moves_a_stages_step_and_a_bad_step_changes_nothing(cluster: Cluster) -> None:
    job = await cluster.train(**MODEL)
    try:
        await job.step(*batch())
        (info,) = [d for d in await cluster.jobs() if d.job == job.id]
        stage = cluster.runtime.ref(*info.stages[1])
        # connect(..., step) moves a stage's step fence forward (a recovery's): a stranger could skip it ahead.
        args = ([list(s) for s in info.stages], None, None, 10**9)
        async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice:
            with pytest.raises(NotAllowed, match="may not call StageActor.connect"):
                await alice.runtime.ref(stage.address, stage.name).endpoint(StageActor.connect, timeout=10).call(*args)
        async with open_runtime("tcp://127.0.0.1:0", keys=keys().identity("node0"), ring=keys().ring) as member:
            with pytest.raises(NotAllowed, match="may not call StageActor.connect"):
                await member.ref(stage.address, stage.name).endpoint(StageActor.connect, timeout=10).call(*args)
        async with open_runtime("tcp://127.0.0.1:0", keys=keys().identity("head"), ring=keys().ring) as head:
            with pytest.raises(RemoteError, match="step must be an int, got str"):
                await head.ref(stage.address, stage.name).endpoint(StageActor.connect, timeout=10).call(
                    *args[:3], "12")
        assert (await job.step(*batch())).loss > 0  # the refused calls left the stage where it was
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


async def test_a_stream_opens_only_for_the_jobs_own_stages_and_a_bad_opening_is_refused(cluster: Cluster) -> None:
    job = await cluster.train(**MODEL)
    try:
        await job.step(*batch())
        (info,) = [d for d in await cluster.jobs() if d.job == job.id]
        stage = cluster.runtime.ref(*info.stages[1])
        opening = SessionKey.new().open_message()
        async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice:
            with pytest.raises(NotAllowed, match="may not call StageActor.open_stream"):
                await alice.runtime.ref(stage.address, stage.name).endpoint(
                    StageActor.open_stream, timeout=10).call(opening, 0)
        outsider = keys().add("node", "stream_outsider")
        async with open_runtime("tcp://127.0.0.1:0", keys=outsider, ring=keys().ring) as member:
            with pytest.raises(NotAllowed, match="holds no key of job"):
                await member.ref(stage.address, stage.name).endpoint(StageActor.open_stream, timeout=10).call(opening, 0)
        async with open_runtime("tcp://127.0.0.1:0", keys=keys().identity("node0"), ring=keys().ring) as member:
            open_stream = member.ref(stage.address, stage.name).endpoint(StageActor.open_stream, timeout=10)
            # A job node's key, but no opening: refused by its size before anything is kept.
            for bad in (b"x" * (4 << 20), opening[:-1], b""):
                with pytest.raises(RemoteError, match="SealRefused: a session opening has"):
                    await open_stream.call(bad, 0)
            with pytest.raises(NotAllowed, match="takes no stream"):
                await open_stream.call(opening, "0")
        stats = await job.step(*batch())  # the stages' own sessions were untouched: the job still trains
        assert stats.loss == stats.loss
    finally:
        await job.close()


async def test_votes_and_tallies_come_only_from_the_jobs_own_stages(cluster: Cluster) -> None:
    job = await cluster.train(**MODEL)
    try:
        await job.step(*batch())
        (info,) = [d for d in await cluster.jobs() if d.job == job.id]
        stage = cluster.runtime.ref(*info.stages[1])
        vote = {"nonfinite_loss": True, "nonfinite_gradient": False, "grad_sq": 1.0}
        async with Cluster.connect(cluster.head.address, keys=keys().directory, identity="alice") as alice:
            theirs = alice.runtime.ref(stage.address, stage.name)
            with pytest.raises(NotAllowed, match="may not call StageActor.vote"):
                await theirs.endpoint(StageActor.vote, timeout=10).call(1, 0, vote)
            with pytest.raises(NotAllowed, match="may not call StageActor.tally"):
                await theirs.endpoint(StageActor.tally, timeout=10).call(1, [vote, vote])
        outsider = keys().add("node", "vote_outsider")
        async with open_runtime("tcp://127.0.0.1:0", keys=outsider, ring=keys().ring) as member:
            theirs = member.ref(stage.address, stage.name)
            with pytest.raises(NotAllowed, match="holds no key of job"):
                await theirs.endpoint(StageActor.vote, timeout=10).call(1, 0, vote)
            with pytest.raises(NotAllowed, match="holds no key of job"):
                await theirs.endpoint(StageActor.tally, timeout=10).call(1, [vote] * 1000)
        stats = await job.step(*batch())  # no vote got in: the step's losses are finite, so it applies
        assert stats.loss == stats.loss and not stats.skipped_steps
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


async def test_a_jobs_wait_answers_no_stranger_and_refuses_an_argument(cluster: Cluster) -> None:
    job = await cluster.train(**MODEL)
    try:
        stranger = Keypair.generate()
        async with open_runtime("tcp://127.0.0.1:0", keys=stranger, ring=lambda: {stranger.public: "client:me"}) as rt:
            with pytest.raises(ActorTimeout):  # refused at the handshake, as every endpoint
                await rt.ref(*job.ref.to_wire()).endpoint(JobActor.wait, timeout=1.0).call()
        with pytest.raises(BadArguments, match="too many positional"):  # wait takes nothing: refused before it runs
            await job.ref.ask("wait", "x" * 1_000_000, timeout=30)
        assert await job.wait() is None  # the job goes on serving its owner (it never ran)
        await job.step(*batch())
        assert (await job.describe()).steps == 1
    finally:
        await job.close()
