"""Tied parameters stay tied across pipeline stages, and training equals one process (see docs/parallelism.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from actors import Cluster, RemoteError
from stages.build.tied import tied_groups
from examples.models import gpt
from schedulers.console.render import job_detail
from tests.schedulers.test_training import GPT_KWARGS, WORKLOADS, train_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TIED = {**WORKLOADS["gpt"], "kwargs": {**GPT_KWARGS, "tie_embeddings": True}}
HEAD = GPT_KWARGS["layers"] + 1  # the head's layer index: embedding, blocks, head
PAIR = ["0.token.weight", f"{HEAD}.out.weight"]


def test_a_shared_parameter_is_found_under_every_name() -> None:
    layers = list(gpt(**TIED["kwargs"]).children())
    assert tied_groups(layers) == [PAIR]
    assert tied_groups(list(gpt(**GPT_KWARGS).children())) == []


@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.parametrize(("schedule", "pipeline", "data", "tensor"), [
    ("1f1b", 2, 1, 1), ("gpipe", 2, 1, 1), ("1f1b", 4, 1, 1), ("gpipe", 4, 1, 1), ("interleaved", 2, 1, 1),
    ("zbv", 2, 1, 1),  # in a V, the embedding and the head both sit on rank 0
    ("1f1b", 2, 2, 1),
])
@pytest.mark.multiprocess
async def test_tied_embeddings_split_across_stages_train_as_one_process(
    cluster: Cluster, schedule: str, pipeline: int, data: int, tensor: int
) -> None:
    expected_state, expected_losses = train_reference(TIED)
    job = await cluster.train(model=TIED["model"], model_kwargs=TIED["kwargs"], loss=TIED["loss"],
                              optimizer=TIED["optimizer"], pipeline_stages=pipeline, data_parallel=data, tensor_parallel=tensor,
                              schedule=schedule, micro_batches=4, seed=0)
    try:
        stats: list[Any] = [await job.step(x, y) for x, y in TIED["batches"]()]
        state = await job.state_dict()
        description = await job.describe()
    finally:
        await job.close()
    if schedule == "zbv":  # one rank holds both: one parameter in one process, nothing to sum across ranks
        assert stats[-1].tied == []
    else:
        assert stats[-1].tied == [PAIR]  # the step says which parameters it kept tied, and so does the console
        assert f"tied across stages: {' = '.join(PAIR)}" in "\n".join(
            job_detail(dataclasses.replace(description, last_stats=stats[-1])))
    # Both copies (first and last stage) took the same summed gradient: the same bits.
    assert torch.equal(state[PAIR[0]], state[PAIR[1]])
    assert list(state) == list(expected_state)
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    assert [s.loss for s in stats] == pytest.approx(expected_losses, rel=1e-5)


@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.multiprocess
async def test_tensor_parallelism_that_would_untie_a_parameter_is_refused_by_name(cluster: Cluster) -> None:
    with pytest.raises(RemoteError, match=f"tensor parallelism would untie {' = '.join(PAIR)}"):
        await cluster.train(model=TIED["model"], model_kwargs=TIED["kwargs"], loss=TIED["loss"],
                            optimizer=TIED["optimizer"], pipeline_stages=2, tensor_parallel=2, micro_batches=4)
    assert await cluster.jobs() == []


@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.multiprocess
async def test_a_refused_tensor_parallel_job_leaves_its_nodes_to_the_next_distributed_job(cluster: Cluster) -> None:
    # The refusal comes after the stages joined their process groups, on all four nodes.
    with pytest.raises(RemoteError, match="tensor parallelism would untie"):
        await cluster.train(model=TIED["model"], model_kwargs=TIED["kwargs"], loss=TIED["loss"],
                            optimizer=TIED["optimizer"], pipeline_stages=2, tensor_parallel=2, micro_batches=4)
    job = await cluster.train(model=TIED["model"], model_kwargs=TIED["kwargs"], loss=TIED["loss"],
                              optimizer=TIED["optimizer"], pipeline_stages=2, data_parallel=2, micro_batches=4)
    try:
        x, y = TIED["batches"]()[0]
        assert (await job.step(x, y)).loss > 0
    finally:
        await job.close()
