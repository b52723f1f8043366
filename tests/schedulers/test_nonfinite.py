"""Bad numbers end to end: a NaN anywhere stops the step everywhere, bad batches are refused.

The package's shared LocalCluster (4 nodes, tests/schedulers/conftest.py) serves the module;
each case starts a small job, feeds it a poisoned or malformed batch and checks what the user
sees and that no parameter moved. The checks themselves are unit-tested in
tests/stages/compute/test_executor_checks.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from actors import NonFiniteError, RemoteError, StepFailed
from stages import StageActor
from examples.models import residual_mlp
from schedulers import Cluster, Job

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="package")]

MODEL_KWARGS = {"blocks": 2, "dim": 8, "hidden": 16}
SGD = ("torch.optim:SGD", {"lr": 0.1})


def batch(size: int = 8, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(size, MODEL_KWARGS["dim"], generator=gen), torch.randn(size, MODEL_KWARGS["dim"], generator=gen)


def poisoned(rows: slice = slice(0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = batch()
    inputs[rows, 0] = float("nan")
    return inputs, targets


async def start(cluster: Cluster, **kwargs: Any) -> Job:
    settings: dict[str, Any] = {"model": "examples.models:residual_mlp", "model_kwargs": MODEL_KWARGS,
                                "optimizer": SGD, "pipeline_stages": 2, "micro_batches": 2, "seed": 0, **kwargs}
    return await cluster.train(**settings)


def assert_same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), f"{key} changed"


async def test_raise_fails_the_step_with_a_typed_error_and_changes_nothing(cluster: Cluster) -> None:
    job = await start(cluster)
    try:
        before = await job.state_dict()
        with pytest.raises(NonFiniteError) as caught:
            await job.step(*poisoned())
        assert isinstance(caught.value, StepFailed)
        message = str(caught.value)
        assert "stage 1: loss of micro-batch 0 is nan" in message, message
        assert "gradient of" in message  # the stages' gradients are named too
        assert caught.value.stage == 1 and caught.value.action == "loss"
        assert any("stage 0: gradient of 0." in f for f in caught.value.nonfinite), caught.value.nonfinite
        assert_same(before, await job.state_dict())
        # The gradients were dropped: a clean step now trains as on a fresh job.
        stats = await job.step(*batch())
        assert not stats.skipped and torch.isfinite(torch.tensor(stats.loss))
    finally:
        await job.close()


def one_step_reference(inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = residual_mlp(**MODEL_KWARGS)
    optimizer = torch.optim.SGD(model.parameters(), **SGD[1])
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()
    return model.state_dict()


async def test_skip_drops_the_step_reports_it_and_trains_on(cluster: Cluster) -> None:
    job = await start(cluster, on_nonfinite="skip", optimizer=("torch.optim:SGD", {"lr": 0.1, "momentum": 0.9}))
    try:
        before = await job.state_dict()
        stats = await job.step(*poisoned())
        assert stats.skipped
        assert "stage 1: loss of micro-batch 0 is nan" in stats.nonfinite
        assert_same(before, await job.state_dict())
        clean = await job.step(*batch(seed=1))
        assert not clean.skipped and clean.nonfinite == []
        after = await job.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        # Momentum SGD's first step is plain SGD: the skipped step left no buffer behind.
        torch.testing.assert_close(after, one_step_reference(*batch(seed=1)))
        described = await job.describe()
        assert described.last_stats is not None and not described.last_stats.skipped
    finally:
        await job.close()


async def replica_states(cluster: Cluster, job: Job) -> list[dict[str, torch.Tensor]]:
    described = await job.describe()
    refs = [cluster.runtime.ref(address, name) for address, name in described.stages]
    return [await ref.endpoint(StageActor.state_dict, timeout=60).call() for ref in refs]


async def test_nan_on_one_replica_skips_every_replica(cluster: Cluster) -> None:
    job = await start(cluster, pipeline_stages=1, data_parallel=2, on_nonfinite="skip")
    try:
        before = await replica_states(cluster, job)
        stats = await job.step(*poisoned(slice(6, 8)))  # the last quarter: replica 1's second micro-batch
        assert stats.skipped
        assert any(f.startswith("stage 0 dp 1: loss") for f in stats.nonfinite), stats.nonfinite
        assert not any(f.startswith("stage 0 dp 0") for f in stats.nonfinite), stats.nonfinite
        after = await replica_states(cluster, job)
        for replica in range(2):
            assert_same(before[replica], after[replica])
        await job.step(*batch(seed=1))
        trained = await replica_states(cluster, job)
        assert_same(trained[0], trained[1])
        torch.testing.assert_close(trained[0], one_step_reference(*batch(seed=1)))
    finally:
        await job.close()


async def test_raise_names_the_replica_the_nan_came_from(cluster: Cluster) -> None:
    job = await start(cluster, pipeline_stages=1, data_parallel=2)
    try:
        before = await replica_states(cluster, job)
        with pytest.raises(NonFiniteError) as caught:
            await job.step(*poisoned(slice(4, 5)))  # replica 1's first micro-batch
        assert caught.value.details["data"] == 1 and caught.value.stage == 0
        # Averaging spreads the NaN to replica 0's gradients, but only replica 1's are blamed.
        assert all(f.startswith("stage 0 dp 1") for f in caught.value.nonfinite), caught.value.nonfinite
        after = await replica_states(cluster, job)
        for replica in range(2):
            assert_same(before[replica], after[replica])
    finally:
        await job.close()


async def test_an_empty_batch_is_refused_before_anything_runs(cluster: Cluster) -> None:
    job = await start(cluster)
    try:
        with pytest.raises(RemoteError, match="hold no samples") as caught:
            await job.step(torch.empty(0, MODEL_KWARGS["dim"]), torch.empty(0, MODEL_KWARGS["dim"]))
        assert caught.value.remote_type == "ValueError"
        assert (await job.describe()).last_stats is None
    finally:
        await job.close()


async def test_targets_the_loss_would_broadcast_are_refused(cluster: Cluster) -> None:
    job = await start(cluster)
    try:
        before = await job.state_dict()
        inputs, _ = batch()
        with pytest.raises(StepFailed, match=r"targets of shape \(4, 1\) do not match the model's output "
                                             r"of shape \(4, 8\)") as caught:
            await job.step(inputs, torch.randn(8, 1))
        assert caught.value.stage == 1
        assert_same(before, await job.state_dict())
    finally:
        await job.close()


async def test_a_loss_that_is_not_one_number_fails_the_step_naming_it(cluster: Cluster) -> None:
    job = await start(cluster, loss="tests.helpers.models:per_sample_loss")
    try:
        before = await job.state_dict()
        with pytest.raises(StepFailed, match=r"the loss function tests\.helpers\.models:per_sample_loss returned a "
                                             r"tensor of shape \(4,\)") as caught:
            await job.step(*batch())
        assert caught.value.stage == 1
        assert_same(before, await job.state_dict())
        with pytest.raises(StepFailed, match=r"^evaluation failed: stage 1 at 1F0: ValueError: the loss function "
                                             r"tests\.helpers\.models:per_sample_loss returned a tensor of shape"):
            await job.evaluate(*batch())
    finally:
        await job.close()
