"""W batching (see docs/parallelism.md): the weight-gradient GEMMs of a step's micro-batches run as one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from actors import Cluster
from stages.compute import wgrad as _wgrad
from stages.program import ActionKind
from schedulers.schedules import build_schedule
from tests.schedulers.test_training import WORKLOADS, train_reference

GPT = WORKLOADS["gpt"]


def test_batched_weight_gradients_equal_the_sum_of_the_per_micro_batch_ones() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    grads = _wgrad.WeightGradients()
    _wgrad.install(nn.Sequential(layer), grads)
    pendings = []
    for _ in range(4):
        with grads.deferring() as pending:
            layer(torch.randn(3, 5, 16)).pow(2).sum().backward()
        pendings.append(list(pending))
    expected_w = sum(g.reshape(-1, 8).t().mm(x.reshape(-1, 16)) for p in pendings for _, _, g, x in p)
    expected_b = sum(g.reshape(-1, 8).sum(0) for p in pendings for _, _, g, _ in p)
    _wgrad.apply_batched(pendings)
    assert all(not p for p in pendings)  # taken
    assert layer.weight.grad is not None and layer.bias.grad is not None
    torch.testing.assert_close(layer.weight.grad, expected_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad, expected_b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zero_bubble"])
def test_every_backward_becomes_i_and_every_w_waits_for_the_tail(schedule: str) -> None:
    programs = build_schedule(schedule, 2, 4, 2 if schedule == "interleaved" else None, split=True, batch_w=True)
    for program in programs.values():
        kinds = [a.kind for a in program if a.kind in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)]
        assert ActionKind.B not in kinds
        first_w = kinds.index(ActionKind.W)
        assert set(kinds[first_w:]) == {ActionKind.W} and kinds.count(ActionKind.W) == kinds.count(ActionKind.I)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="package")
# fusion_min_weight_elements: 0 fuses every linear of this small GPT; 1000 only its MLPs' (1024) and the
# head (2048), so a stage runs fused and plain-autograd linears side by side, and its W has only the former.
@pytest.mark.parametrize(("schedule", "stages", "fuse_from"),
                         [("1f1b", 2, 0), ("zero_bubble", 2, 1000), ("gpipe", 4, 0), ("interleaved", 2, 1000)])
@pytest.mark.multiprocess
async def test_w_batching_trains_as_one_process_and_holds_every_micro_batch_until_the_tail(
    cluster: Cluster, schedule: str, stages: int, fuse_from: int
) -> None:
    expected, losses = train_reference(GPT)
    job = await cluster.train(model=GPT["model"], model_kwargs=GPT["kwargs"], loss=GPT["loss"],
                              optimizer=GPT["optimizer"], pipeline_stages=stages, schedule=schedule, micro_batches=4,
                              w_batching=True, fusion_min_weight_elements=fuse_from)
    try:
        stats = [await job.step(x, y) for x, y in GPT["batches"]()]
        state = await job.state_dict()
    finally:
        await job.close()
    assert [s.loss for s in stats] == pytest.approx(losses, rel=1e-5)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
    held = 2 * 4 if schedule == "interleaved" else 4  # every micro-batch of every held stage waits for W
    assert all(peak == held for peak in stats[-1].peak_stash)


def test_w_batching_needs_fused_weight_gradients() -> None:
    from schedulers.jobs import JobSpec

    with pytest.raises(ValueError, match="needs gradient_accumulation_fusion"):
        JobSpec.of(model=GPT["model"], w_batching=True, gradient_accumulation_fusion=False)
