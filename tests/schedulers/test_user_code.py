"""A client is not the operator: a job's code, its settings and its sizes stay inside that job.

Two client keys (alice, bob) share one LocalCluster. Each case is something one
client's job did to the cluster before (docs/security.md): its code exiting the node
process, a partition pattern holding a node's interpreter, a spec that froze the
head's loop while its schedule compiled. After each, the nodes are alive and bob's
job steps on.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from actors import ActorTimeout, Cluster, LimitExceeded, LocalCluster, RemoteError, StepFailed, UserCodeExit
from schedulers import JobSpec
from schedulers.scheduler import SchedulerActor
from tests.helpers.clients import TwoClients

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.asyncio(loop_scope="module")]

MODEL = {"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 2, "dim": 8}, "micro_batches": 2}
USER = "tests.helpers.user_code"
LIMITS = {"micro_batches": 64, "jobs_per_client": 2, "threads_per_stage": 8, "step_timeout_s": 3600,
          "max_restarts": 10, "parameters": 20_000}
CLIENTS = TwoClients()
connect = CLIENTS.connect


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster() -> AsyncIterator[Cluster]:
    async with CLIENTS.start(nodes=2, allow=[USER], limits=LIMITS) as cluster:
        yield cluster


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 2, 8), torch.randn(4, 2, 8)


async def assert_the_cluster_serves(cluster: Cluster, bob: Cluster) -> None:
    """Every node is alive and one process each (none exited), and bob's new job steps."""
    assert {n.name for n in await cluster.nodes() if n.alive} == {"node0", "node1"}
    assert all(proc.poll() is None for proc in CLIENTS.local.processes.values())
    job = await bob.train(**MODEL, pipeline_stages=2)
    try:
        assert (await job.step(*batch())).loss > 0
    finally:
        await job.close()


@pytest.mark.parametrize(("factory", "code"), [
    # Found by review: each named a wrapper of the project's ('in partial', 'in join_and_build'), not the
    # function of the job's that exited; now the function and its line.
    ({"data": f"{USER}:exiting_data"}, "sys.exit(4) in exiting_data (user_code.py:"),  # called as each stage builds
    ({"model": f"{USER}:exiting_model"}, "sys.exit(3) in exiting_model (user_code.py:"),  # built by the partitioner
    ({"model": f"{USER}:interrupting_model"}, "KeyboardInterrupt in interrupting_model (user_code.py:"),
])
async def test_a_jobs_code_that_exits_fails_that_job_only(cluster: Cluster, factory: dict[str, Any],
                                                          code: str) -> None:
    async with connect(cluster, "alice") as alice, connect(cluster, "bob") as bob:
        with pytest.raises(UserCodeExit, match=re.escape(code)):
            await alice.train(**{**MODEL, **factory}, pipeline_stages=2)
        await assert_the_cluster_serves(cluster, bob)


async def test_a_loss_that_exits_fails_the_step_and_the_job_goes_on(cluster: Cluster) -> None:
    async with connect(cluster, "alice") as alice, connect(cluster, "bob") as bob:
        job = await alice.train(**MODEL, pipeline_stages=2, loss=f"{USER}:exiting_loss")
        try:
            with pytest.raises(StepFailed, match=r"sys.exit\(5\)"):
                await job.step(*batch())
        finally:
            await job.close()
        await assert_the_cluster_serves(cluster, bob)


async def test_one_jobs_slow_build_does_not_hold_up_another_clients_job(cluster: Cluster, tmp_path: Path) -> None:
    # Alice's data factory takes until the test opens its gate; the nodes' agents used to build
    # one stage at a time, so bob's job waited for hers (6.1 s behind a 7 s factory).
    started, gate = tmp_path / "started", tmp_path / "gate"
    async with connect(cluster, "alice") as alice, connect(cluster, "bob") as bob:
        slow = asyncio.ensure_future(alice.train(**MODEL, pipeline_stages=2, data=f"{USER}:gated_data",
                                                 data_kwargs={"started": str(started), "gate": str(gate)}))
        try:
            while not started.exists():
                assert not slow.done(), slow.exception()
                await asyncio.sleep(0.02)
            await asyncio.wait_for(assert_the_cluster_serves(cluster, bob), 120)  # while alice's builds
            assert not slow.done()
        finally:
            gate.touch()
            job = await slow
            await job.close()


async def test_a_backtracking_partition_pattern_cannot_hang_a_node(cluster: Cluster) -> None:
    # re.search held the worker's interpreter on this for ever: no heartbeat, the node marked lost.
    async with connect(cluster, "alice") as alice, connect(cluster, "bob") as bob:
        with pytest.raises(RemoteError, match="matches 0 of the model's"):
            await alice.train(**MODEL, pipeline_stages=2, partition_method=r"type:(\w|\w|\w|\w)*!")
        await assert_the_cluster_serves(cluster, bob)


@pytest.mark.parametrize(("change", "limit"), [
    ({"micro_batches": 150_000}, "micro_batches"),  # its schedule froze the head's loop for 14 s
    ({"threads_per_stage": 10**6}, "threads_per_stage"),
    ({"step_timeout_s": 1e300}, "step_timeout_s"),
    ({"max_restarts": 10**9}, "max_restarts"),
])
async def test_a_spec_past_the_operators_limits_is_refused_before_any_work(cluster: Cluster, change: dict[str, Any],
                                                                            limit: str) -> None:
    async with connect(cluster, "alice") as alice, connect(cluster, "bob") as bob:
        # Sent as a raw spec, past the driver's own checks (JobSpec() compiles nothing).
        spec = JobSpec.of(**MODEL, pipeline_stages=2).replace(**change)
        with pytest.raises(LimitExceeded, match=f"past this cluster's limit {limit}=") as caught:
            await alice.call(SchedulerActor.create_job, timeout=60).call(spec)
        assert caught.value.limit == limit
        await assert_the_cluster_serves(cluster, bob)


@pytest.mark.parametrize("cut", [
    {},  # a Sequential, counted layer by layer on the meta device
    {"split_points": ["1"], "example_inputs": torch.zeros(2, 2, 64)},  # any module, counted whole before it is traced
])
async def test_a_model_past_the_parameters_limit_is_refused_before_any_stage_builds_it(cluster: Cluster,
                                                                                     cut: dict[str, Any]) -> None:
    async with connect(cluster, "alice") as alice, connect(cluster, "bob") as bob:
        big = {**MODEL, "model_kwargs": {"blocks": 2, "dim": 64}, "pipeline_stages": 2, **cut}  # 66,432 parameters
        with pytest.raises(LimitExceeded, match="past this cluster's limit parameters=") as caught:
            await alice.train(**big)
        assert caught.value.limit == "parameters" and caught.value.value == 66_432
        await assert_the_cluster_serves(cluster, bob)


async def test_jobs_per_client_and_settings_are_bounded(cluster: Cluster) -> None:
    async with connect(cluster, "alice") as alice, connect(cluster, "bob") as bob:
        jobs = [await alice.train(**MODEL) for _ in range(2)]
        try:
            with pytest.raises(LimitExceeded, match="limit jobs_per_client=2"):
                await alice.train(**MODEL)
            with pytest.raises(LimitExceeded, match="limit micro_batches=64"):
                await jobs[0].set("micro_batches", 150_000)
            assert (await jobs[0].describe()).spec.parallelism.micro_batches == 2  # nothing changed
            await jobs[0].set("micro_batches", 4)  # within the limit: compiled off the loop, applied next step
            assert (await jobs[0].step(*batch())).loss > 0
            await assert_the_cluster_serves(cluster, bob)  # bob's jobs are his own count
        finally:
            for job in jobs:
                await job.close()


async def test_only_the_client_that_started_a_creation_can_abandon_it(cluster: Cluster, tmp_path: Path) -> None:
    """abandon_job ends a creation or the job it made: bob's word on alice's ticket, a stranger's, and a
    ticket that is no string or too long change nothing."""
    from actors import open_runtime
    from transport.security import Keypair

    started, gate = tmp_path / "started", tmp_path / "gate"
    spec = JobSpec.from_kwargs({**MODEL, "pipeline_stages": 2, "data": f"{USER}:gated_data",
                                "data_kwargs": {"started": str(started), "gate": str(gate)}})
    async with connect(cluster, "alice") as alice, connect(cluster, "bob") as bob:
        creating = asyncio.ensure_future(alice.call(SchedulerActor.create_job, timeout=600).call(spec, None, "t-alice"))
        try:
            while not started.exists():
                assert not creating.done(), creating.exception()
                await asyncio.sleep(0.02)
            abandon = bob.call(SchedulerActor.abandon_job, timeout=30)
            await abandon.call("t-alice")  # not bob's: nothing happens
            for bad, kind in ((["t-alice"] * 100_000, "TypeError"), ("t" * 1_000_000, "ValueError")):
                with pytest.raises(RemoteError) as refused:
                    await abandon.call(bad)
                assert refused.value.remote_type == kind
            stranger = Keypair.generate()
            async with open_runtime("tcp://127.0.0.1:0", keys=stranger,
                                    ring=lambda: {stranger.public: "client:me"}) as runtime:
                with pytest.raises(ActorTimeout):  # refused at the handshake, as every endpoint
                    await runtime.ref(*cluster.scheduler.to_wire()).endpoint(
                        SchedulerActor.abandon_job, timeout=1.0).call("t-alice")
            assert not creating.done()
        finally:
            gate.touch()
        info = await creating  # alice's creation went on to its end
        await bob.call(SchedulerActor.abandon_job, timeout=30).call("t-alice")  # made now; still not bob's
        assert info.job in {j.job for j in await alice.jobs()}
        job = await alice.job(info.job)
        await job.close()
