"""Quantized activations and gradients between stages: bytes, fidelity and training quality."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import torch

from actors import Cluster, LocalCluster, RemoteError
from examples.data import regression_batches

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.asyncio(loop_scope="module")]

DIM = 128
MODEL = {"blocks": 4, "dim": DIM, "hidden": 2 * DIM}
DATA = {"batch_size": 16, "seq": 8, "dim": DIM, "seed": 5, "learnable": True}
STEPS = 25


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster() -> AsyncIterator[Cluster]:
    async with LocalCluster(nodes=2) as cluster:
        yield cluster


async def train(cluster: Cluster, steps: int = STEPS, **codecs: Any) -> tuple[list[float], Any]:
    job = await cluster.train(
        model="examples.models:residual_mlp", model_kwargs=MODEL, optimizer=("torch.optim:Adam", {"lr": 3e-3}),
        pipeline_stages=2, micro_batches=4, schedule="1f1b", data="examples.data:regression_batches",
        data_kwargs=DATA, **codecs,
    )
    try:
        losses, stats = [], None
        for _ in range(steps):
            stats = await job.step()
            losses.append(stats.loss)
        return losses, stats
    finally:
        await job.close()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def baseline(cluster: Cluster) -> tuple[list[float], Any]:
    return await train(cluster)


async def test_unquantized_edges_send_raw_bytes_exactly(baseline: tuple[list[float], Any]) -> None:
    losses, stats = baseline
    assert losses[-1] < 0.5 * losses[0]  # the task is learnable: quality comparisons mean something
    assert set(stats.codec_stats) == {"F 0->1", "B 1->0"}
    for edge in stats.codec_stats.values():
        assert edge["codec"] == "none" and edge["rel_error"] == 0.0
        assert 1.0 <= edge["ratio"] < 1.01  # raw tensor bytes plus a small header


@pytest.mark.parametrize("codec,max_ratio,max_error", [("int8", 0.27, 0.02), ("int4", 0.15, 0.2),
                                                       ("fp16", 0.51, 1e-3), ("bf16", 0.51, 1e-2)])
async def test_codec_bytes_and_error_on_the_wire(cluster: Cluster, codec: str, max_ratio: float,
                                                 max_error: float) -> None:
    # int8: block absmax/254 per element on Gaussian-like data gives ~0.5-1% relative error.
    _, stats = await train(cluster, steps=2, activation_codec=codec, gradient_codec=codec)
    for name, edge in stats.codec_stats.items():
        assert edge["codec"] == codec
        assert edge["ratio"] <= max_ratio, f"{name}: {edge}"
        assert 0.0 < edge["rel_error"] <= max_error, f"{name}: {edge}"


async def test_int8_training_ends_within_two_percent_of_unquantized(
    cluster: Cluster, baseline: tuple[list[float], Any]
) -> None:
    losses, _ = await train(cluster, activation_codec="int8", gradient_codec="int8")
    reference = baseline[0][-1]
    assert abs(losses[-1] - reference) / reference <= 0.02, (losses[-1], reference)


async def test_error_feedback_brings_int4_gradients_closer_to_unquantized(cluster: Cluster) -> None:
    # The residual is kept per boundary and micro-batch slot, so it corrects the
    # gradient of the same samples when a slot sees the same data again: here the
    # same global batch every step (full-batch training), where int4's rounding
    # bias would otherwise pile up step after step.
    x, y = regression_batches(batch_size=16, seq=8, dim=DIM, seed=5, learnable=True)(0)

    async def final_loss(**codecs: Any) -> float:
        job = await cluster.train(model="tests.helpers.models:linear_stack", model_kwargs={"layers": 4, "dim": DIM},
                                  optimizer=("torch.optim:SGD", {"lr": 0.2}), pipeline_stages=2, micro_batches=4,
                                  schedule="1f1b", **codecs)
        try:
            for _ in range(30):
                stats = await job.step(x, y)
            return stats.loss
        finally:
            await job.close()

    reference = await final_loss()
    plain = await final_loss(gradient_codec="int4")
    feedback = await final_loss(gradient_codec="int4", error_feedback=True)
    assert plain != reference  # int4 does change training here
    assert abs(feedback - reference) < abs(plain - reference), (feedback, plain, reference)


async def test_codecs_can_differ_per_boundary(cluster: Cluster) -> None:
    # Interleaved on 2 ranks with 2 virtual stages: model stages 0..3, three boundaries.
    job = await cluster.train(
        model="examples.models:residual_mlp", model_kwargs=MODEL, pipeline_stages=2, micro_batches=4,
        schedule="interleaved", data="examples.data:regression_batches", data_kwargs=DATA,
        activation_codec=["int8", "none", "bf16"], gradient_codec=["fp16", "int4", "none"],
    )
    try:
        stats = await job.step()
    finally:
        await job.close()
    codecs = {edge: s["codec"] for edge, s in stats.codec_stats.items()}
    assert codecs == {"F 0->1": "int8", "F 1->2": "none", "F 2->3": "bf16",
                      "B 1->0": "fp16", "B 2->1": "int4", "B 3->2": "none"}


@pytest.mark.parametrize(
    "codecs,match",
    [
        ({"activation_codec": "zip"}, "unknown codec 'zip'"),
        ({"gradient_codec": ["int8", "int8"]}, "lists 2 codecs but the pipeline has 1 stage boundaries"),
    ],
)
async def test_bad_codec_arguments_are_refused(cluster: Cluster, codecs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):  # at the call, before anything is sent
        await cluster.train(model="examples.models:residual_mlp", model_kwargs=MODEL, pipeline_stages=2, **codecs)


async def test_quantized_data_parallel_reduction_keeps_replicas_identical(cluster: Cluster) -> None:
    async def run(codec: str) -> tuple[float, int, list[dict[str, Any]]]:
        job = await cluster.train(
            model="examples.models:residual_mlp", model_kwargs=MODEL, optimizer=("torch.optim:Adam", {"lr": 3e-3}),
            pipeline_stages=1, data_parallel=2, micro_batches=2, data="examples.data:regression_batches",
            data_kwargs=DATA, reduce_codec=codec,
        )
        try:
            for _ in range(STEPS):
                stats = await job.step()
            (info,) = [j for j in await cluster.jobs() if j.job == job.id]
            replicas = [await cluster.runtime.ref(*ref).ask("state_dict") for ref in info.stages]
            return stats.loss, stats.reduce_bytes, replicas
        finally:
            await job.close()

    raw_loss, raw_bytes, _ = await run("none")
    loss, nbytes, replicas = await run("int8")
    assert nbytes <= 0.27 * raw_bytes
    assert abs(loss - raw_loss) / raw_loss <= 0.02, (loss, raw_loss)
    for key in replicas[0]:  # every replica decoded the same bytes, so all stepped alike
        assert torch.equal(replicas[0][key], replicas[1][key]), key
