# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/compute/test_tail.py
"""The step's tail (stages.compute.tail): the decisions as pure functions, and StepTail in one process.

A two-rank pipeline assembled from the stage's parts (tests/stages/stage_parts.py) must
train exactly as one process does — with global-norm clipping too — and a step whose
loss is not finite must change nothing on any rank.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from examples.models import residual_mlp
from schedulers.scaling import clip_coefficient as scheduler_clip_coefficient
from stages.compute import tail as tail_module
from stages.compute.inline import WARMUP_RUNS, InlinePolicy
from stages.compute.tail import (
    StepDecision, check_factor, checked_norm, clip_coefficient, decide_step, norm64, rescale_gradients,
    squared_norm,
)
from stages.compute.executor import nonfinite_gradients
from tests.stages.stage_parts import MODEL_KWARGS, InProcessPipeline, stage_config

pytestmark = pytest.mark.timeout(60)

INF, NAN = float("inf"), float("nan")


# -- the decisions --------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "expected"), [
    # Nothing wrong: apply, unscaled by the loss scale, the norm unscaled.
    ({"grad_sq": 4.0}, StepDecision(apply=True, unscale=1.0, clip=1.0, grad_norm=2.0, overflow=False)),
    ({"grad_sq": 64.0, "loss_scale": 4.0, "fp16": True},
     StepDecision(apply=True, unscale=4.0, clip=1.0, grad_norm=2.0, overflow=False)),
    # Clipping: max_norm / (norm + 1e-6) when the norm is larger; never more than 1.
    ({"grad_sq": 16.0, "max_norm": 1.0},
     StepDecision(apply=True, unscale=1.0, clip=1.0 / (4.0 + 1e-6), grad_norm=4.0, overflow=False)),
    ({"grad_sq": 0.25, "max_norm": 1.0}, StepDecision(apply=True, unscale=1.0, clip=1.0, grad_norm=0.5,
                                                      overflow=False)),
    # A non-finite value anywhere drops the step; without fp16 it is never an overflow.
    ({"grad_sq": INF, "nonfinite_gradient": True, "max_norm": 1.0},
     StepDecision(apply=False, unscale=1.0, clip=1.0, grad_norm=INF, overflow=False)),
    ({"grad_sq": 1.0, "nonfinite_loss": True}, StepDecision(apply=False, unscale=1.0, clip=1.0, grad_norm=1.0,
                                                             overflow=False)),
    # fp16: a gradient that overflowed while every loss is finite is an overflow ...
    ({"grad_sq": INF, "nonfinite_gradient": True, "fp16": True, "loss_scale": 1024.0},
     StepDecision(apply=False, unscale=1024.0, clip=1.0, grad_norm=INF, overflow=True)),
    # ... but not at the lowest dynamic scale, nor with a non-finite loss.
    ({"grad_sq": INF, "nonfinite_gradient": True, "fp16": True, "scale_at_floor": True},
     StepDecision(apply=False, unscale=1.0, clip=1.0, grad_norm=INF, overflow=False)),
    ({"grad_sq": INF, "nonfinite_gradient": True, "nonfinite_loss": True, "fp16": True},
     StepDecision(apply=False, unscale=1.0, clip=1.0, grad_norm=INF, overflow=False)),
])
def test_decide_step(kwargs: dict[str, Any], expected: StepDecision) -> None:
    assert decide_step(**{"nonfinite_loss": False, "nonfinite_gradient": False, **kwargs}) == expected


@pytest.mark.parametrize("norm", [0.0, 0.5, 1.0, 1.0 + 1e-7, 3.0, 1e30, INF, NAN])
@pytest.mark.parametrize("max_norm", [0.0, -1.0, 1.0, 2.5])
def test_clip_coefficient_is_the_schedulers(norm: float, max_norm: float) -> None:
    assert clip_coefficient(norm, max_norm) == scheduler_clip_coefficient(norm, max_norm)


@pytest.mark.parametrize(("value", "ok"), [(1, True), (0.5, True), (1e-30, True), (0, False), (-1.0, False),
                                           (INF, False), (NAN, False), (True, False), ("1", False), (None, False)])
def test_check_factor(value: Any, ok: bool) -> None:
    if ok:
        assert check_factor("clip", value) == float(value)
    else:
        with pytest.raises(ValueError, match="clip must be a finite number > 0"):
            check_factor("clip", value)


def test_squared_norm_and_rescale_follow_torch() -> None:
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5)),
              torch.nn.Parameter(torch.randn(2))]
    for p in params[:2]:
        p.grad = torch.randn_like(p)
    expected = float(torch.cat([p.grad.double().flatten() for p in params[:2]]).norm() ** 2)  # type: ignore[union-attr]
    assert squared_norm(params) == pytest.approx(expected, rel=1e-12)
    assert squared_norm(params[2:]) == 0.0
    grads = [p.grad.clone() for p in params[:2]]  # type: ignore[union-attr]
    rescale_gradients(params, 4.0, 0.5)
    for p, grad in zip(params, grads):
        torch.testing.assert_close(p.grad, grad / 4.0 * 0.5, rtol=0, atol=0)
    params[0].grad[0, 0] = INF  # type: ignore[index]
    assert squared_norm(params) == INF


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_check_and_the_norm_in_one_pass_are_the_two_passes_to_the_bit(dtype: torch.dtype) -> None:
    # A stage without a reduction or a tied sum reads each gradient once for both (see checked_norm).
    generator = torch.Generator().manual_seed(0)
    for trial in range(50):
        params = [torch.nn.Parameter(torch.zeros(int(n), dtype=dtype))
                  for n in torch.randint(0, 200, (6,), generator=generator)]
        for i, p in enumerate(params[:-1]):  # the last has no gradient
            scale = 10.0 ** int(torch.randint(-20, 20, (1,), generator=generator))
            p.grad = (torch.randn(p.shape, generator=generator) * scale).to(dtype)
        named = [(f"p{i}", p) for i, p in enumerate(params)] + [("alias", params[0])]
        norm_params = params[1:]  # the first's share of the norm is another rank's (tied, say)
        if trial % 3 == 1:
            params[2].grad[0:1] = NAN  # type: ignore[index]
        if trial % 3 == 2 and params[3].numel():
            params[3].grad[-1:] = -INF  # type: ignore[index]
        found, total = checked_norm(named, norm_params)
        assert found == nonfinite_gradients(named)
        expected = squared_norm(norm_params)
        assert total == expected or (math.isnan(total) and math.isnan(expected)), (trial, total, expected)
    assert checked_norm([], []) == ([], 0.0)
    huge = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    huge.grad = torch.full((2,), 1e300, dtype=torch.float64)  # finite, but its norm overflows
    assert checked_norm([("huge", huge)], [huge]) == ([], INF) and squared_norm([huge]) == INF


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_gradients_float64_norm_is_vector_norms_and_the_same_wherever_it_starts(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(3001, generator=generator).to(dtype)
    assert torch.equal(norm64(grad), torch.linalg.vector_norm(grad, dtype=torch.float64))
    assert float(norm64(grad[:0])) == 0.0
    monkeypatch.setattr(tail_module, "NORM_CHUNK", 256)  # longer than a chunk: the chunks' norms combined
    whole = float(norm64(grad))
    assert whole == pytest.approx(float(torch.linalg.vector_norm(grad, dtype=torch.float64)), rel=1e-12)
    storage = torch.empty(3001 + 3, dtype=dtype)
    for offset in (1, 2, 3):  # the same values 2, 4, 6 ... bytes past where the allocator put them
        shifted = storage[offset:offset + 3001]
        shifted.copy_(grad)
        assert float(norm64(shifted)) == whole


def test_a_gradients_float64_norm_takes_no_fresh_memory_of_its_size() -> None:
    """vector_norm(dtype=float64) copies a float32 gradient into new float64 memory first: on a
    stage of 8.4M parameters those pages' faults made the tail's norm 4 to 31 ms a step."""
    from torch.profiler import ProfilerActivity, profile

    param = torch.nn.Parameter(torch.zeros(1000, 100))
    param.grad = torch.randn(1000, 100)
    squared_norm([param])  # the thread's buffer, once
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        squared_norm([param])
        checked_norm([("w", param)], [param])
    assert max(event.cpu_memory_usage for event in prof.events()) < param.numel()  # bytes: not 8 a value


# -- StepTail in a pipeline of parts ---------------------------------------------------------


@pytest.fixture
def pipeline() -> Iterator[InProcessPipeline]:
    pipe = InProcessPipeline([stage_config(rank) for rank in range(2)])
    yield pipe
    pipe.close()


def batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    dim = MODEL_KWARGS["dim"]
    return [(torch.randn(8, dim, generator=gen), torch.randn(8, dim, generator=gen)) for _ in range(steps)]


def reference(steps: list[tuple[torch.Tensor, torch.Tensor]], max_norm: float = 0.0
              ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, plain autograd, the whole batch per step (micro-batch losses averaged as the stages do)."""
    torch.manual_seed(0)
    model = residual_mlp(**MODEL_KWARGS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in steps:
        optimizer.zero_grad()
        loss = sum(F.mse_loss(model(xm), ym) for xm, ym in zip(x.chunk(2), y.chunk(2))) / 2
        loss.backward()  # type: ignore[union-attr]
        if max_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        losses.append(float(loss.detach()))  # type: ignore[union-attr]
    return copy.deepcopy(model.state_dict()), losses


@pytest.mark.parametrize("max_norm", [0.0, 0.05])
async def test_a_pipeline_of_parts_trains_as_one_process(pipeline: InProcessPipeline, max_norm: float) -> None:
    steps = batches()
    expected_state, expected_losses = reference(steps, max_norm)
    for step, (x, y) in enumerate(steps):
        result = await pipeline.step(step, x, y, max_norm=max_norm)
        assert result.decision.apply
        assert result.loss == pytest.approx(expected_losses[step], rel=1e-6)
        if max_norm:
            assert result.decision.clip < 1.0  # the clip took part
        assert [len(r.lr) for r in result.finished] == [1, 1]
    state = pipeline.state()
    assert state.keys() == expected_state.keys()
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


class RecordingPolicy(InlinePolicy):
    """A policy whose bounds no run reaches, so every kind runs inline after its warm-up (no timing
    decides what this asserts); notes each run's kind and where it ran."""

    def __init__(self) -> None:
        super().__init__(max_s=3600.0, demote_s=3600.0)
        self.runs: list[tuple[Any, bool]] = []

    def record(self, key: Any, seconds: float, *, inline: bool) -> None:
        self.runs.append((key, inline))
        super().record(key, seconds, inline=inline)


async def test_the_tails_own_work_runs_inline_once_known_short_and_trains_the_same(
        pipeline: InProcessPipeline) -> None:
    # Each trip to the compute thread and back cost 0.1-0.3 ms of a step of a small model; the
    # tail's check and norm (one pass: nothing reduces these gradients between them), rescale,
    # memory count and (unsharded) optimizer step are this stage's own tensors alone, so they take
    # the fast path the actions take.
    policies = [RecordingPolicy() for _ in pipeline.ranks]
    for rank, policy in zip(pipeline.ranks, policies):
        rank.executor.inline_policy = policy
    steps = batches(5)
    expected_state, expected_losses = reference(steps, max_norm=0.05)
    for step, (x, y) in enumerate(steps):
        result = await pipeline.step(step, x, y, max_norm=0.05)
        assert result.decision.clip < 1.0  # so the rescale ran
        assert result.loss == pytest.approx(expected_losses[step], rel=1e-6)
    for policy in policies:
        tail = [(key[1], inline) for key, inline in policy.runs if isinstance(key, tuple) and key[0] == "tail"]
        assert not any(k in ("check", "norm") for k, _ in tail)
        for kind in ("check_norm", "rescale", "gradient_bytes", "step"):
            where = [inline for k, inline in tail if k == kind]
            assert where == [False] * WARMUP_RUNS + [True] * (len(steps) - WARMUP_RUNS), (kind, where)
    state = pipeline.state()
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


async def test_a_non_finite_loss_drops_the_step_on_every_rank(pipeline: InProcessPipeline) -> None:
    (x, y), = batches(1)
    await pipeline.step(0, x, y)
    before = {k: v.clone() for k, v in pipeline.state().items()}
    dropped = []
    pipeline.ranks[1].tail.on_drop = lambda: dropped.append(1)
    y = y.clone()
    y[0, 0] = NAN
    result = await pipeline.step(1, x, y)
    assert math.isnan(result.loss) and not result.decision.apply
    assert dropped == [1]
    for key, value in pipeline.state().items():
        assert torch.equal(value, before[key]), key
    for rank in pipeline.ranks:  # the step's gradients are gone: the next step starts clean
        assert all(p.grad is None for p in rank.executor.model.optimizer.param_groups[0]["params"])
    result = await pipeline.step(2, x, batches(1)[0][1])
    assert result.decision.apply and math.isfinite(result.loss)


async def test_finish_refuses_a_bad_factor_before_anything_changes(pipeline: InProcessPipeline) -> None:
    (x, y), = batches(1)
    for r, rank in enumerate(pipeline.ranks):
        rank.step = 0
        await rank.executor.begin(pipeline.program(r))
    await asyncio.gather(*(rank.executor.run(0, pipeline.program(r), x.chunk(2) if r == 0 else None,
                                             y.chunk(2) if r == 1 else None)
                           for r, rank in enumerate(pipeline.ranks)))
    reports = await asyncio.gather(*(rank.tail.reduce(0, pipeline.program(r)) for r, rank in enumerate(pipeline.ranks)))
    assert all(not report.nonfinite and report.grad_sq > 0 for report in reports)
    before = {k: v.clone() for k, v in pipeline.state().items()}
    with pytest.raises(ValueError, match="clip must be a finite number > 0, got nan"):
        await pipeline.ranks[0].tail.finish(pipeline.program(0), apply=True, clip=NAN)
    assert all(torch.equal(v, before[k]) for k, v in pipeline.state().items())
    await pipeline.ranks[0].tail.finish(pipeline.program(0), apply=True)
    assert not all(torch.equal(v, before[k]) for k, v in pipeline.state().items())


def test_many_gradients_norms_in_one_call_are_each_norm64s_to_the_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(16, generator=generator), torch.randn(4, 4, generator=generator).t(),  # not contiguous
             torch.randn(1000, generator=generator).to(torch.bfloat16), torch.randn(7, generator=generator) * 1e-30,
             torch.randn(5, generator=generator) * 1e20, torch.randn(9, dtype=torch.float64, generator=generator),
             torch.randn(0), torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")]),
             torch.randn(3001, generator=generator)]
    monkeypatch.setattr(tail_module, "FOREACH_NORM_MAX", 1024)  # the last is longer: norm64's own path
    calls: list[int] = []
    foreach_norm = torch._foreach_norm

    def counted(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(tensors))
        return foreach_norm(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counted)
    together = tail_module.norms64(grads)
    assert calls == [7]  # the short contiguous float32/bfloat16 ones in one call; the rest apart
    for grad, norm in zip(grads, together):
        one = norm64(grad)
        assert norm.dtype == torch.float64 and norm.shape == ()
        assert torch.equal(norm, one) or (norm.isnan() and one.isnan()), (grad.shape, norm, one)
    assert tail_module.norms64([]) == []
