"""One process per stage actor: a job's code that ends, crashes or hangs its process stays in its job.

Two client keys (alice, bob) share one LocalCluster of two nodes; both their jobs
place a stage on each node. Before, every job's stages ran in the node's process:
``os._exit`` or a segfault in alice's loss ended the node (bob's job failed with
``NodeLost``), a loss that held the interpreter stopped the node's heartbeats, and
``torch.set_num_threads``, seeds or the allocator settings one stage made were every
stage's on that node. Now each stage has a process of its own (``actors._processes``),
and its node reports how it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import torch

from actors import NODE, ActorLost, Cluster, LocalCluster, NodeActor, StageLost, StepFailed
from actors.cluster import Cluster as BaseCluster
from tests.helpers.clients import TwoClients
from tests.helpers.user_code import node_marker

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.asyncio(loop_scope="module")]

MODEL = {"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 2, "dim": 8}, "micro_batches": 2,
         "pipeline_stages": 2, "step_timeout_s": 120}
USER = "tests.helpers.user_code"
CLIENTS = TwoClients()
connect = CLIENTS.connect


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster() -> AsyncIterator[Cluster]:
    async with CLIENTS.start(nodes=2, allow=[USER]) as cluster:
        yield cluster


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 2, 8), torch.randn(4, 2, 8)


async def hosted(cluster: BaseCluster) -> dict[str, dict[str, int]]:
    """Each node's hosted actors and their pids, as the operator sees them."""
    found = {}
    for node in await cluster.nodes():
        agent = cluster.runtime.ref(node.address, NODE)
        description = await agent.endpoint(NodeActor.describe, timeout=10).call()
        assert description.processes is not None
        found[node.name] = description.processes
    return found


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def assert_the_cluster_serves(cluster: Cluster, bob: Cluster) -> None:
    """Every node is alive and its process runs, and bob's new job steps."""
    assert {n.name for n in await cluster.nodes() if n.alive} == {"node0", "node1"}
    assert all(proc.poll() is None for proc in CLIENTS.local.processes.values())
    job = await bob.train(**MODEL)
    try:
        assert (await job.step(*batch())).loss > 0
    finally:
        await job.close()


async def test_each_jobs_stage_runs_in_a_process_of_its_own(cluster: Cluster) -> None:
    async with connect(cluster, "alice") as alice, connect(cluster, "bob") as bob:
        jobs = [await alice.train(**MODEL, threads_per_stage=2), await bob.train(**MODEL)]
        try:
            for job in jobs:
                await job.step(*batch())
            processes = await hosted(cluster)
            node_pids = {name: proc.pid for name, proc in CLIENTS.local.processes.items()}
            for node, actors in processes.items():
                # A stage of each job on each node, each in its own process: threads_per_stage=2 (or
                # any process-wide setting a job's code makes) is that job's alone.
                assert sorted(actors) == sorted(f"{job.id}.rank{job.nodes.index(node)}" for job in jobs)
                pids = set(actors.values())
                assert len(pids) == 2 and node_pids[node] not in pids and not pids & set(node_pids.values())
            stage_pids = [pid for actors in processes.values() for pid in actors.values()]
        finally:
            for job in jobs:
                await job.close()
        assert await hosted(cluster) == {"node0": {}, "node1": {}}
        assert all(gone(pid) for pid in stage_pids)  # closing a job ends its stages' processes


@pytest.mark.parametrize(("loss", "how"), [
    ("ending_loss", "exited with code 7"),  # os._exit: nothing to catch
    ("segfaulting_loss", "killed by SIGSEGV"),
])
async def test_a_stage_whose_process_ends_fails_its_job_only(cluster: Cluster, loss: str, how: str) -> None:
    # Before: the node's process ended with it, and bob's job with NodeLost.
    async with connect(cluster, "alice") as alice, connect(cluster, "bob") as bob:
        job = await alice.train(**MODEL, loss=f"{USER}:{loss}")
        try:
            with pytest.raises(StageLost, match=how) as failed:
                await job.step(*batch())
            assert failed.value.stage == 1 and failed.value.node == job.nodes[1]
            with pytest.raises(StageLost, match=f"{job.id} cannot go on: .*{how}"):  # at once, every later call
                await job.step(*batch())
            await assert_the_cluster_serves(cluster, bob)
        finally:
            await job.close()
        assert await hosted(cluster) == {"node0": {}, "node1": {}}


async def test_with_restarts_a_stage_whose_process_ended_is_built_again_on_its_node(cluster: Cluster) -> None:
    nodes = [proc.pid for name, proc in CLIENTS.local.processes.items() if name != "head"]
    markers = [node_marker(kind, pid) for kind in ("armed", "fired") for pid in nodes]
    (x, y), (x2, y2) = batch(), batch()
    async with connect(cluster, "alice") as alice:
        job = await alice.train(**MODEL, loss=f"{USER}:ending_once_loss", max_restarts=1)
        reference = await alice.train(**MODEL, loss="torch.nn.functional:mse_loss")
        try:
            assert (await job.step(x, y)).loss == (await reference.step(x, y)).loss
            for marker in markers[:len(nodes)]:
                open(marker, "w").close()
            # The last stage's process ends in its loss; it is built again on its node from the snapshot
            # its neighbour kept, and the step runs again.
            stats = await job.step(x2, y2)
            assert stats.recovery is not None and stats.recovery.moved == {job.nodes[1]: job.nodes[1]}
            # From the snapshot of the step before (replaying none), or, where the neighbour had not yet
            # received that one when the process ended (a loaded machine), the one before it and a replay.
            assert (stats.recovery.from_step, stats.recovery.replayed) in ((1, 0), (0, 1)), stats.recovery
            assert stats.loss == (await reference.step(x2, y2)).loss
            got, expected = await job.state_dict(), await reference.state_dict()
            assert all(torch.equal(got[key], value) for key, value in expected.items())
        finally:
            await job.close()
            await reference.close()
            for marker in markers:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(marker)


async def test_a_stage_that_holds_the_interpreter_does_not_stop_its_node(cluster: Cluster) -> None:
    # Before: the node stopped heartbeating, was marked lost, and took bob's job with it.
    async with connect(cluster, "alice") as alice, connect(cluster, "bob") as bob:
        job = await alice.train(**{**MODEL, "step_timeout_s": 3}, loss=f"{USER}:spinning_loss")
        spinning = (await hosted(cluster))[job.nodes[1]][f"{job.id}.rank1"]
        try:
            with pytest.raises(StepFailed, match="timed out") as failed:
                await job.step(*batch())
            # The report names the stage that did not answer, and the head told it to abort without
            # waiting for the reply (which held the error back by 5 s).
            assert failed.value.details["silent"] == [1], failed.value.details
            assert "did not answer" in str(failed.value)
            await assert_the_cluster_serves(cluster, bob)  # alice's stage still spins meanwhile
            assert not gone(spinning)
        finally:
            await job.close()  # its node kills the process that does not stop when told
        assert gone(spinning)
        assert await hosted(cluster) == {"node0": {}, "node1": {}}


@pytest.mark.parametrize(("factory", "how"), [
    ({"model": f"{USER}:crashing_model"}, "exited with code 9"),  # in the worker that inspects the model
    ({"data": f"{USER}:crashing_data"}, "exited with code 8 while the actor started"),  # as each stage builds
])
async def test_a_factory_that_ends_its_process_fails_job_creation_only(cluster: Cluster, factory: dict[str, Any],
                                                                       how: str) -> None:
    async with connect(cluster, "alice") as alice, connect(cluster, "bob") as bob:
        with pytest.raises(ActorLost, match=how):
            await alice.train(**{**MODEL, **factory})
        await assert_the_cluster_serves(cluster, bob)
        assert await hosted(cluster) == {"node0": {}, "node1": {}}


async def test_a_killed_node_takes_its_stage_processes_with_it() -> None:
    local = LocalCluster(nodes=2)
    async with local as cluster:
        job = await cluster.train(**MODEL)
        await job.step(*batch())
        stages = (await hosted(cluster))["node1"]
        assert stages
        os.kill(local.processes["node1"].pid, signal.SIGKILL)
        deadline = time.monotonic() + 60  # the kernel's parent-death signal, through the zygote
        while not all(gone(pid) for pid in stages.values()):
            assert time.monotonic() < deadline, f"stage processes outlived their node: {stages}"
            await asyncio.sleep(0.05)
        await job.close()
