"""Busy is not dead: a saturated machine or a paused worker costs time, never a node; a killed one is
known at once, and every operation in flight then fails with NodeLost.

Each test starts a cluster of its own (they stop, kill and starve its processes). No
assertion is on a duration: a pause shorter than the silence timeout must cost the step
its length and nothing else; a kill must end the step with NodeLost long before the
step's own timeout (ten minutes here) could.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from actors import NodeLost
from schedulers import LocalCluster

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]

MLP = {"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 8, "dim": 16, "hidden": 32},
       "optimizer": ("torch.optim:SGD", {"lr": 0.01}), "micro_batches": 4, "step_timeout_s": 600}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 16), torch.randn(8, 16)


async def test_an_eight_node_job_trains_on_while_both_cores_are_saturated() -> None:
    """Two CPU burners for 10 s (2.5 times the liveness timeout a silent node is dropped after, 4 s
    here) beside an 8-stage job (nine node processes and eight stage processes on two cores): every
    step runs, and the head loses no node."""
    async with LocalCluster(nodes=8, heartbeat_timeout=4.0) as cluster:
        job = await cluster.train(**MLP, pipeline_stages=8)
        burners = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 10\n"
                                     "while time.time() < end: pass"]) for _ in range(2)]
        try:
            steps = 0
            while any(b.poll() is None for b in burners):
                stats = await job.step(*batch())
                assert stats.loss == stats.loss
                steps += 1
            assert steps > 0
            assert all(node.alive for node in await cluster.nodes())
            assert (await job.describe()).steps == steps
        finally:
            for burner in burners:
                burner.kill()
                burner.wait()
            await job.close()


async def test_a_worker_paused_mid_step_costs_the_step_that_time_and_nothing_else() -> None:
    """SIGSTOP a worker (its node and its stage's process, as a long collection pause or a host
    hiccup would) for three seconds in the middle of a step, shorter than the silence timeout:
    the step finishes, the node stays a member, and the next step runs."""
    local = LocalCluster(nodes=2)
    async with local as cluster:
        job = await cluster.train(**{**MLP, "model_kwargs": {"blocks": 8, "dim": 256, "hidden": 1024}},
                                  pipeline_stages=2)
        try:
            await job.step(*batch_of(256))
            step = asyncio.ensure_future(job.step(*batch_of(256)))
            await asyncio.sleep(0.2)
            victim = local.processes[job.nodes[1]].pid
            os.killpg(victim, signal.SIGSTOP)
            await asyncio.sleep(3)
            os.killpg(victim, signal.SIGCONT)
            stats = await step
            assert stats.loss == stats.loss
            assert all(node.alive for node in await cluster.nodes())
            after = await job.step(*batch_of(256))
            assert after.loss == after.loss
        finally:
            await job.close()


def batch_of(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(64, dim), torch.randn(64, dim)


async def test_a_step_begun_right_after_a_kill_fails_with_node_lost_not_at_its_timeout() -> None:
    """A hang seen on busy machines: a node SIGKILLed between two steps, the next step begun half a second
    later, used to wait out its whole step_timeout_s (65 s measured, 10 minutes by default)."""
    local = LocalCluster(nodes=2)
    async with local as cluster:
        job = await cluster.train(**MLP, pipeline_stages=2)
        try:
            await job.step(*batch())
            os.kill(local.processes[job.nodes[1]].pid, signal.SIGKILL)
            await asyncio.sleep(0.5)
            started = time.monotonic()
            with pytest.raises(NodeLost) as lost:
                await asyncio.wait_for(job.step(*batch()), 120)  # far below the step's own 600 s
            assert lost.value.node == job.nodes[1]
            assert time.monotonic() - started < 120
            for call in (job.step(*batch()), job.state_dict()):  # and every operation after it, at once
                with pytest.raises(NodeLost):
                    await asyncio.wait_for(call, 60)
        finally:
            await asyncio.wait_for(job.close(), 60)
