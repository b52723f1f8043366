# .venv/bin/python -m pytest -q -p no:cacheprovider tests/schedulers/test_overlap.py
"""The data-parallel reduction overlapped with backward trains to the bits of the reduction after the barrier.

The package's shared LocalCluster of 4 nodes (tests/schedulers/conftest.py) serves the module;
every job is 2 pipeline stages x 2 data-parallel replicas, trained twice on the same batches:
``overlap_reduce=True`` (each bucket's all-reduce starts during the last micro-batch's backward,
gradients viewed into their buckets) and ``overlap_reduce=False`` (the buckets copied and
reduced after the barrier). Parameters and losses must be the same bits. (stages.comm.overlap
itself is tested in memory by tests/stages/comm/test_overlap.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from actors import Cluster, LocalCluster
from tests.schedulers.test_training import GPT_KWARGS, OPTIMIZERS, WORKLOADS

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.asyncio(loop_scope="package")]

MLP, GPT = WORKLOADS["mlp"], WORKLOADS["gpt"]
TIED_GPT = {**GPT, "kwargs": {**GPT_KWARGS, "tie_embeddings": True}}
# Small buckets (about a block each), so that each stage starts several while its backward runs.
MESH = {"pipeline_stages": 2, "data_parallel": 2, "micro_batches": 4, "seed": 0, "bucket_bytes": 4 << 10}


async def train(cluster: Cluster, workload: dict[str, Any], **options: Any) -> tuple[dict[str, torch.Tensor],
                                                                                     list[Any]]:
    async with await cluster.train(model=workload["model"], model_kwargs=workload["kwargs"], loss=workload["loss"],
                                   **{"optimizer": workload["optimizer"], **MESH, **options}) as job:
        stats = [await job.step(x, y) for x, y in workload["batches"]()]
        return await job.state_dict(), stats


async def assert_overlap_changes_no_bit(cluster: Cluster, workload: dict[str, Any], **options: Any) -> list[Any]:
    """Trains with and without the overlap; returns the overlapped run's stats."""
    state, stats = await train(cluster, workload, overlap_reduce=True, **options)
    after, after_stats = await train(cluster, workload, overlap_reduce=False, **options)
    assert list(state) == list(after)
    for key, value in after.items():
        assert torch.equal(state[key], value), key
    assert [s.loss for s in stats] == [s.loss for s in after_stats]
    for overlapped, barrier in zip(stats, after_stats):
        assert overlapped.reduce_bytes == barrier.reduce_bytes > 0
        assert len(overlapped.reduce_wait_s) == len(barrier.reduce_wait_s) == 4
        assert overlapped.grad_norm == barrier.grad_norm
    return stats


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero_bubble", "interleaved"])
async def test_every_schedule_reduces_to_the_same_bits(cluster: Cluster, schedule: str, fusion: bool) -> None:
    # fusion_min_weight_elements=0: MLP's small linears fused too, as a large model's are.
    await assert_overlap_changes_no_bit(cluster, MLP, schedule=schedule, gradient_accumulation_fusion=fusion,
                                        fusion_min_weight_elements=0)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
async def test_w_batching_reduces_to_the_same_bits(cluster: Cluster, schedule: str) -> None:
    await assert_overlap_changes_no_bit(cluster, MLP, schedule=schedule, w_batching=True, fusion_min_weight_elements=0)


async def test_tied_embeddings_sum_after_the_overlapped_reduction(cluster: Cluster) -> None:
    stats = await assert_overlap_changes_no_bit(cluster, TIED_GPT, schedule="1f1b")
    assert stats[-1].tied


async def test_zero1_steps_its_shard_on_the_overlapped_average(cluster: Cluster) -> None:
    await assert_overlap_changes_no_bit(cluster, {**MLP, "optimizer": OPTIMIZERS["adam"]}, schedule="1f1b",
                                        zero_stage=1)


async def test_fp16_unscales_and_clips_the_overlapped_average(cluster: Cluster) -> None:
    stats = await assert_overlap_changes_no_bit(cluster, GPT, schedule="1f1b", precision="fp16",
                                                gradient_clipping=0.5)
    assert all(s.loss_scale for s in stats) and all(s.grad_norm is not None for s in stats)
