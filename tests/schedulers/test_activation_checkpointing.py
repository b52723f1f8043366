# .venv/bin/python -m pytest -q -p no:cacheprovider tests/schedulers/test_activation_checkpointing.py
"""Activation checkpointing end to end (see docs/precision.md): bit for bit what the same job
trains without it, for every schedule, both transports, fused weight gradients on and
off, dropout, boundary trees and traced models; and each stage holds fewer bytes.

Each case runs the same job twice on one LocalCluster, checkpointing off and on, and
compares the two with ``torch.equal``: the recompute is the same ops on the same values
(with the forward's RNG state), so not a bit may differ.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from actors import Cluster, LocalCluster
from schedulers.records import StepStats
from tests.schedulers.test_real_models import lm_batches, masked_batches
from tests.schedulers.test_training import GPT_KWARGS, gpt_batches

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.asyncio(loop_scope="package")]

MLP_KWARGS = {"blocks": 8, "dim": 16, "hidden": 64}
BATCH, SEQ, STEPS = 16, 4, 2


def mlp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    return [(torch.randn(BATCH, SEQ, MLP_KWARGS["dim"], generator=gen),
             torch.randn(BATCH, SEQ, MLP_KWARGS["dim"], generator=gen)) for _ in range(STEPS)]


MLP: dict[str, Any] = {"model": "examples.models:residual_mlp", "model_kwargs": MLP_KWARGS,
                       "loss": "torch.nn.functional:mse_loss", "optimizer": ("torch.optim:Adam", {"lr": 0.01})}


async def train(cluster: Cluster, batches: list[tuple[Any, torch.Tensor]], **spec: Any
                ) -> tuple[dict[str, torch.Tensor], list[StepStats]]:
    job = await cluster.train(seed=0, **spec)
    try:
        stats = [await job.step(x, y) for x, y in batches]
        return await job.state_dict(), stats
    finally:
        await job.close()


async def assert_same_training_and_less_held(cluster: Cluster, batches: list[tuple[Any, torch.Tensor]],
                                             setting: bool | int, **spec: Any) -> list[StepStats]:
    """Trains ``spec`` without and with ``activation_checkpointing=setting``; returns the latter's stats."""
    expected, plain = await train(cluster, batches, activation_checkpointing=False, **spec)
    state, stats = await train(cluster, batches, activation_checkpointing=setting, **spec)
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    assert [s.loss for s in stats] == [s.loss for s in plain]
    for ours, theirs in zip(stats, plain):
        assert ours.peak_stash == theirs.peak_stash  # as many micro-batches held, each by fewer bytes
        assert all(0 < held < without for held, without in zip(ours.peak_stash_bytes, theirs.peak_stash_bytes)), \
            (ours.peak_stash_bytes, theirs.peak_stash_bytes)
    return stats


CASES = [
    # schedule, stages, activation_checkpointing, transport, gradient_accumulation_fusion
    ("gpipe", 4, True, "zmq", True),
    ("1f1b", 4, True, "zmq", True),
    ("1f1b", 4, 2, "zmq", True),
    ("interleaved", 2, True, "zmq", True),  # 4 model stages of 2 blocks, 2 per rank
    ("interleaved", 2, 2, "zmq", True),
    ("zero_bubble", 4, True, "zmq", True),  # I defers the linears' weight GEMMs to W
    ("zero_bubble", 2, 2, "zmq", False),  # I is autograd.grad on the inputs, W walks the graph again
    ("1f1b", 4, True, "zmq", False),
    ("1f1b", 4, True, "dist", True),
    ("zero_bubble", 2, 2, "dist", True),
]


@pytest.mark.parametrize(("schedule", "stages", "setting", "transport", "fusion"), CASES,
                         ids=[f"{s}-{n}stages-{'every' if c is True else f'interval{c}'}-{t}"
                              f"{'' if f else '-nofusion'}" for s, n, c, t, f in CASES])
async def test_checkpointing_trains_exactly_as_without_and_holds_less(
    cluster: Cluster, schedule: str, stages: int, setting: bool | int, transport: str, fusion: bool
) -> None:
    await assert_same_training_and_less_held(
        cluster, mlp_batches(), setting, **MLP, pipeline_stages=stages, schedule=schedule, micro_batches=4,
        transport=transport, gradient_accumulation_fusion=fusion)


async def test_dropout_draws_the_same_masks_in_the_recompute(cluster: Cluster) -> None:
    await assert_same_training_and_less_held(
        cluster, gpt_batches()[:STEPS], True, model="examples.models:gpt",
        model_kwargs={**GPT_KWARGS, "dropout": 0.2}, loss="examples.models:lm_loss",
        optimizer=("torch.optim:SGD", {"lr": 0.1}), pipeline_stages=2, schedule="1f1b", micro_batches=4)


async def test_boundary_trees_with_integer_masks_and_constants_are_checkpointed(cluster: Cluster) -> None:
    await assert_same_training_and_less_held(
        cluster, masked_batches(STEPS), 2, model="tests.helpers.models:masked_blocks",
        optimizer=("torch.optim:SGD", {"lr": 0.1}), pipeline_stages=2, schedule="zero_bubble", micro_batches=2)


async def test_a_traced_stage_is_one_checkpoint(cluster: Cluster) -> None:
    pytest.importorskip("transformers")
    batches = lm_batches(STEPS)
    kwargs = {"dim": 32, "heads": 2, "vocab": 64, "positions": 16, "layers": 4, "dropout": 0.1}
    await assert_same_training_and_less_held(
        cluster, batches, True, model="examples.hf:gpt2", model_kwargs=kwargs, loss="examples.models:lm_loss",
        optimizer=("torch.optim:SGD", {"lr": 0.1}), pipeline_stages=2, schedule="1f1b", micro_batches=4,
        split_points=["transformer.h.2"], example_inputs=batches[0][0][:2], dynamic_shapes=False)  # one shape



async def test_tensor_parallel_stages_recompute_their_collectives_in_step(cluster: Cluster) -> None:
    # The recompute runs the forward's all-reduces again, inside the backward, on every shard in the same order.
    await assert_same_training_and_less_held(
        cluster, mlp_batches(), True, **MLP, pipeline_stages=2, tensor_parallel=2, schedule="1f1b", micro_batches=4)


@pytest.mark.parametrize(("precision", "schedule"), [("bf16", "1f1b"), ("fp16", "zero_bubble")])
async def test_under_mixed_precision_the_recompute_runs_under_the_same_autocast(
    cluster: Cluster, precision: str, schedule: str
) -> None:
    await assert_same_training_and_less_held(
        cluster, mlp_batches(), True, **MLP, pipeline_stages=4, schedule=schedule, micro_batches=4,
        precision=precision)


async def test_with_zero1_and_clipping(cluster: Cluster) -> None:
    await assert_same_training_and_less_held(
        cluster, mlp_batches(), 2, **MLP, pipeline_stages=2, data_parallel=2, schedule="1f1b", micro_batches=4,
        zero_stage=1, gradient_clipping=0.5)
