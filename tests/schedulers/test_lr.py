"""Learning-rate schedules end to end (see docs/precision.md): every stage steps the job's schedule once per
applied step, StepStats reports the rate, checkpoints resume it, and a skipped step does not advance it.

The package's shared LocalCluster of 4 nodes (tests/schedulers/conftest.py) serves the module;
each case compares with one process training the same model (float32, SGD with momentum) under
the same schedule.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

from actors import Cluster, LocalCluster, RemoteError
from stages import CheckpointError
from examples.models import residual_mlp
from schedulers.deepspeed.config import load_config
from schedulers.console.render import job_detail

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.asyncio(loop_scope="package")]

MODEL_KWARGS = {"blocks": 4, "dim": 8, "hidden": 16}
SGD = ("torch.optim:SGD", {"lr": 0.1, "momentum": 0.9})
WARMUP = ("stages.state.lr:WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 5})
WARMUP_LINEAR = ("stages.state.lr:WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 5,
                                        "warmup_type": "linear"})
STEP_LR = ("torch.optim.lr_scheduler:StepLR", {"step_size": 2, "gamma": 0.5})
STEPS = 6


def batches(count: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 2, MODEL_KWARGS["dim"], generator=gen), torch.randn(8, 2, MODEL_KWARGS["dim"], generator=gen))
            for _ in range(count)]


def reference(schedule: tuple[str, dict[str, Any]], data: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """One process: the same model, optimizer and schedule; the state and each step's rates after it."""
    torch.manual_seed(0)
    model = residual_mlp(**MODEL_KWARGS)
    opt = torch.optim.SGD(model.parameters(), **SGD[1])
    module, _, name = schedule[0].partition(":")
    scheduler = getattr(importlib.import_module(module), name)(opt, **schedule[1])
    rates = []
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        scheduler.step()
        rates.append(scheduler.get_last_lr())
    return model.state_dict(), rates


async def start(cluster: Cluster, schedule: tuple[str, dict[str, Any]], **kwargs: Any) -> Any:
    settings: dict[str, Any] = {"model": "examples.models:residual_mlp", "model_kwargs": MODEL_KWARGS,
                                "optimizer": SGD, "lr_scheduler": schedule, "pipeline_stages": 2, "micro_batches": 2,
                                "seed": 0, **kwargs}
    return await cluster.train(**settings)


def assert_close_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize(("schedule", "data_parallel", "zero_stage"), [
    pytest.param(WARMUP, 1, 0, id="WarmupLR-pp2"),
    pytest.param(STEP_LR, 1, 0, id="StepLR-pp2"),
    pytest.param(WARMUP_LINEAR, 2, 0, id="WarmupLR-pp2-dp2"),
    pytest.param(STEP_LR, 2, 1, id="StepLR-pp2-dp2-zero1"),  # the sharded optimizer takes the outer groups' rate
])
async def test_a_schedule_on_every_stage_equals_one_process(cluster: Cluster, schedule: tuple[str, dict[str, Any]],
                                                            data_parallel: int, zero_stage: int) -> None:
    data = batches()
    want_state, want_rates = reference(schedule, data)
    job = await start(cluster, schedule, data_parallel=data_parallel, zero_stage=zero_stage)
    try:
        stats = [await job.step(x, y) for x, y in data]
        state = await job.state_dict()
        detail = job_detail(dataclasses.replace(await job.describe(), last_stats=stats[-1]))
    finally:
        await job.close()
    assert [s.lr for s in stats] == want_rates
    assert len({tuple(r) for r in want_rates}) > 2  # the schedule moved
    assert f"lr {stats[-1].lr[0]:.4g}," in detail[1], detail[1]
    assert_close_state(state, want_state)


async def test_a_checkpoint_mid_warmup_resumes_the_schedule_exactly(cluster: Cluster, tmp_path: Path) -> None:
    data = batches()
    want_state, want_rates = reference(WARMUP, data)
    first = await start(cluster, WARMUP)
    try:
        rates = [(await first.step(x, y)).lr for x, y in data[:3]]
        await first.save(tmp_path / "ckpt")
    finally:
        await first.close()
    resumed = await start(cluster, WARMUP)
    try:
        assert await resumed.load(tmp_path / "ckpt") == 3
        rates += [(await resumed.step(x, y)).lr for x, y in data[3:]]
        state = await resumed.state_dict()
    finally:
        await resumed.close()
    assert rates == want_rates
    assert_close_state(state, want_state)
    # weights_only takes the parameters and leaves the new job's schedule where it is: at its start.
    fresh = await start(cluster, WARMUP)
    try:
        await fresh.load(tmp_path / "ckpt", weights_only=True)
        assert (await fresh.step(*data[0])).lr == want_rates[0]
    finally:
        await fresh.close()
    other = await start(cluster, STEP_LR)
    try:
        with pytest.raises(CheckpointError, match="goes on with the learning-rate schedule stages.state.lr:WarmupLR but "
                                                  "this job uses torch.optim.lr_scheduler:StepLR"):
            await other.load(tmp_path / "ckpt")
    finally:
        await other.close()


async def test_a_skipped_step_does_not_advance_the_schedule(cluster: Cluster) -> None:
    data = batches(3)
    want_state, want_rates = reference(WARMUP_LINEAR, data)
    poisoned = (data[1][0].clone(), data[1][1])
    poisoned[0][0, 0, 0] = float("nan")
    job = await start(cluster, WARMUP_LINEAR, on_nonfinite="skip")
    try:
        stats = [await job.step(*batch) for batch in (data[0], poisoned, *data[1:])]
        state = await job.state_dict()
    finally:
        await job.close()
    assert [s.skipped for s in stats] == [False, True, False, False]
    assert [s.lr for s in stats] == [want_rates[0], want_rates[0], *want_rates[1:]]
    assert_close_state(state, want_state)


async def test_an_fp16_overflow_does_not_advance_the_schedule(cluster: Cluster) -> None:
    generator = torch.Generator().manual_seed(4)
    data = [(torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator)) for _ in range(3)]
    data[1][0][0, 0] = 1e4  # tests.helpers.models:overflowing: stage 0's first layer overflows at step 1
    job = await cluster.train(model="tests.helpers.models:overflowing", optimizer=("torch.optim:SGD", {"lr": 0.1}),
                              lr_scheduler=("torch.optim.lr_scheduler:StepLR", {"step_size": 1, "gamma": 0.5}),
                              pipeline_stages=2, micro_batches=2, precision="fp16", hysteresis=1)
    try:
        stats = [await job.step(*batch) for batch in data]
    finally:
        await job.close()
    assert [s.skipped for s in stats] == [False, True, False]
    assert [s.lr for s in stats] == [[0.05], [0.05], [0.025]]


async def test_a_deepspeed_config_with_warmup_runs_its_schedule_as_deepspeed_would(cluster: Cluster) -> None:
    """DeepSpeedExamples-style: fp16, WarmupLR (linear, 100 steps to 1.5e-4), clipping and ZeRO-1, unedited."""
    configs = Path(__file__).parent / "deepspeed" / "ds_configs"
    # its tensorboard block off: it would write runs/gpt2 under this directory (test_monitors runs it)
    spec = load_config(configs / "gpt2_fp16_zero1.json", job=configs / "gpt2_job.json",
                       tensorboard={"enabled": False}).spec
    job = await cluster.train(spec)
    try:
        stats = [await job.step() for _ in range(3)]
    finally:
        await job.close()
    applied = 0
    for s in stats:  # DeepSpeed's rate after k applied steps: min + (max - min) * (k - 1) / n (an overflow skips one)
        applied += not s.skipped
        assert s.lr == [0 + (1.5e-4 - 0) * (max(applied - 1, 0) / 100)]
    assert applied >= 2


@pytest.mark.parametrize(("schedule", "match"), [
    (("stages.state.lr:WarmupLR", {"warmup_steps": 10}), "lr_scheduler stages.state.lr:WarmupLR .*unexpected keyword"),
    (("stages.state.lr:WarmupDecayLR", {"warmup_num_steps": 10}), "lr_scheduler stages.state.lr:WarmupDecayLR .*total_num_steps"),
    (("torch.optim.lr_scheduler:ReduceLROnPlateau", {}), "ReduceLROnPlateau steps on a validation metric"),
])
async def test_a_bad_schedule_fails_at_job_start_naming_it(cluster: Cluster, schedule: tuple[str, dict[str, Any]],
                                                           match: str) -> None:
    with pytest.raises(RemoteError, match=match):
        await start(cluster, schedule)
    assert await cluster.jobs() == []
