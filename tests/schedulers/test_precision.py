"""Mixed precision, fp16 loss scaling and global-norm clipping across the pipeline (see docs/precision.md).

The reference for each is one process doing the same arithmetic: the same micro-batches
in order, under the same autocast, with each stage boundary cast to the compute dtype
(where the pipeline sends it in that dtype), the loss scaled and the gradients unscaled
and clipped as ``GradScaler.unscale_`` and ``clip_grad_norm_`` would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import pytest
import torch

from actors import Cluster
from schedulers.console.render import job_detail
from tests.helpers.models import overflowing
from tests.schedulers.test_training import WORKLOADS

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]

GPT = WORKLOADS["gpt"]
MICRO = 4
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def one_process(workload: dict[str, Any], cuts: list[int], *, precision: str = "fp32", scale: float = 1.0,
                clip: float = 0.0, batches: list[Any] | None = None, replicas: int = 1,
                schedule: Any = None) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """State, losses and global gradient norms of the same training in one process (the same
    micro-batches as ``replicas`` data-parallel replicas would take: in fp16 a micro-batch's
    size changes how its gradients round)."""
    torch.manual_seed(0)
    model = workload["build"](**workload["kwargs"])
    layers = list(model.children())
    path, kwargs = workload["optimizer"]
    optimizer = getattr(torch.optim, path.partition(":")[2])(model.parameters(), **kwargs)
    scheduler = schedule(optimizer) if schedule is not None else None
    dtype = DTYPES.get(precision)
    losses, norms = [], []
    for x, y in batches if batches is not None else workload["batches"]():
        optimizer.zero_grad()
        total = 0.0
        micro = [(xm, ym) for xr, yr in zip(x.chunk(replicas), y.chunk(replicas))
                 for xm, ym in zip(xr.chunk(MICRO), yr.chunk(MICRO))]
        for xm, ym in micro:
            h = xm
            for index, layer in enumerate(layers):
                if index in cuts and dtype is not None:
                    h = h.to(dtype)  # the pipeline sends its boundaries in the compute dtype
                with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
                    h = layer(h)
            with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
                loss = workload["loss_fn"](h, ym).float()
            total += float(loss.detach())
            (loss * scale / len(micro) if scale != 1.0 else loss / len(micro)).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        if scale != 1.0:
            for p in params:
                p.grad.mul_(1.0 / scale)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf"))))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(total / len(micro))
    return model.state_dict(), losses, norms


async def train(cluster: Cluster, workload: dict[str, Any], batches: list[Any] | None = None,
                **options: Any) -> tuple[dict[str, torch.Tensor], list[Any], list[list[int]]]:
    job = await cluster.train(model=workload["model"], model_kwargs=workload["kwargs"], loss=workload["loss"],
                              optimizer=workload["optimizer"], micro_batches=MICRO, **options)
    try:
        stats = [await job.step(x, y) for x, y in (batches if batches is not None else workload["batches"]())]
        return await job.state_dict(), stats, job.bounds
    finally:
        await job.close()


def cuts_of(bounds: list[list[int]]) -> list[int]:
    return [first for first, _ in bounds[1:]]


def assert_state_close(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float,
                       atol: float) -> None:
    assert list(state) == list(expected)
    for key in expected:
        torch.testing.assert_close(state[key], expected[key], rtol=rtol, atol=atol,
                                   msg=lambda detail, key=key: f"{key}: {detail}")


PRECISION_CASES = [(precision, schedule, "zmq", 1) for precision in ("bf16", "fp16")
                   for schedule in ("gpipe", "1f1b", "interleaved", "zero_bubble")] + [
    ("bf16", "1f1b", "dist", 1), ("fp16", "zero_bubble", "dist", 1), ("bf16", "1f1b", "zmq", 2)]


@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.parametrize(("precision", "schedule", "transport", "tensor"), PRECISION_CASES)
async def test_mixed_precision_equals_one_process_under_the_same_autocast(
    cluster: Cluster, precision: str, schedule: str, transport: str, tensor: int
) -> None:
    state, stats, bounds = await train(cluster, GPT, pipeline_stages=2, schedule=schedule, precision=precision,
                                       transport=transport, tensor_parallel=tensor)
    expected, losses, norms = one_process(GPT, cuts_of(bounds), precision=precision,
                                          scale=2.0 ** 16 if precision == "fp16" else 1.0)
    # The same operations in the same order on the same bits: what differs is only where a
    # sum's order may (the float32 norm, the loss mean), so float32-level tolerances hold.
    # Tensor parallelism splits each GEMM's sum in two and adds the halves after rounding
    # them to the compute dtype: differences of bf16's own size (2**-8 relative) in single
    # activations; after three SGD steps (lr 0.1, momentum 0.9) they reach about 2e-4 in a
    # parameter, so the tolerance there is bf16's, not float32's.
    rtol = 1e-5 if tensor == 1 else 1e-3
    assert [s.loss for s in stats] == pytest.approx(losses, rel=rtol)
    assert_state_close(state, expected, rtol=1e-5 if tensor == 1 else 1e-2, atol=1e-6 if tensor == 1 else 5e-4)
    assert [s.grad_norm for s in stats] == pytest.approx(norms, rel=1e-4 if tensor == 1 else 1e-2)
    assert all(not s.skipped for s in stats)
    assert [s.loss_scale for s in stats] == ([2.0 ** 16] * len(stats) if precision == "fp16" else [None] * len(stats))


@pytest.mark.asyncio(loop_scope="package")
async def test_the_boundaries_travel_in_the_compute_dtype(cluster: Cluster) -> None:
    batch = GPT["batches"]()[:1]
    _, full, _ = await train(cluster, GPT, batches=batch, pipeline_stages=2)
    _, half, _ = await train(cluster, GPT, batches=batch, pipeline_stages=2, precision="bf16")
    for edge, sent in full[0].bytes_per_edge.items():
        assert half[0].bytes_per_edge[edge] <= 0.5 * sent + 2048  # the tensors halve; message headers do not


@pytest.mark.asyncio(loop_scope="package")
async def test_an_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(cluster: Cluster) -> None:
    workload = {"model": "tests.helpers.models:overflowing", "kwargs": {}, "build": overflowing,
                "loss": "torch.nn.functional:mse_loss", "loss_fn": torch.nn.functional.mse_loss,
                "optimizer": ("torch.optim:SGD", {"lr": 0.1})}
    generator = torch.Generator().manual_seed(4)
    batches = [(torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator)) for _ in range(3)]
    batches[1][0][0, 0] = 1e4  # step 1: stage 0's first layer overflows; stage 1 sees nothing wrong
    job = await cluster.train(model=workload["model"], optimizer=workload["optimizer"], pipeline_stages=2,
                              micro_batches=2, precision="fp16", hysteresis=1, initial_scale_power=8)
    try:
        first = await job.step(*batches[0])
        before = await job.state_dict()
        skipped = await job.step(*batches[1])
        after = await job.state_dict()
        last = await job.step(*batches[2])
        description = await job.describe()
    finally:
        await job.close()
    detail = "\n".join(job_detail(dataclasses.replace(description, last_stats=last)))
    assert "loss scale 128 (1 steps skipped for overflow), precision fp16" in detail and "grad norm" in detail
    assert not first.skipped and skipped.skipped and not last.skipped
    assert any("0.weight" in what for what in skipped.nonfinite)
    assert all(torch.equal(before[k], after[k]) for k in before)  # no stage stepped, not even stage 1
    assert (first.loss_scale, skipped.loss_scale, last.loss_scale) == (256.0, 256.0, 128.0)
    assert (skipped.skipped_steps, last.skipped_steps) == (1, 1)


@pytest.mark.asyncio(loop_scope="package")
async def test_fp16_skips_the_same_steps_at_any_data_parallel_width(cluster: Cluster) -> None:
    """Found by review: a replica's loss is the mean over its own share, so at data_parallel=2 its fp16
    gradients were twice one process's and overflowed at half the scale, and which steps were skipped
    depended on the mesh. The order's scale is now divided by the replicas (a power of two: exactly undone).
    The same micro-batches (2 samples each: 8 at one replica, 4 at each of two) now skip the same steps at
    the same scales and train to the same parameters, up to the replicas' order of summing."""
    mlp = WORKLOADS["mlp"]
    generator = torch.Generator().manual_seed(4321)
    dim = mlp["kwargs"]["dim"]
    batches = [(torch.randn(16, 4, dim, generator=generator) * 3, torch.randn(16, 4, dim, generator=generator) * 3)
               for _ in range(6)]
    runs = {}
    for replicas in (1, 2):
        job = await cluster.train(model=mlp["model"], model_kwargs=mlp["kwargs"], loss=mlp["loss"],
                                  optimizer=mlp["optimizer"], pipeline_stages=2, data_parallel=replicas,
                                  micro_batches=8 // replicas, precision="fp16", initial_scale_power=20,
                                  loss_scale_window=2, hysteresis=1, gradient_clipping=0.5)
        try:
            runs[replicas] = [await job.step(x, y) for x, y in batches], await job.state_dict()
        finally:
            await job.close()
    (stats_one, one), (stats_two, two) = runs[1], runs[2]
    assert [s.skipped for s in stats_two] == [s.skipped for s in stats_one] and any(s.skipped for s in stats_one)
    assert [s.loss_scale for s in stats_two] == [s.loss_scale for s in stats_one]
    for key, value in one.items():
        torch.testing.assert_close(two[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.asyncio(loop_scope="package")
async def test_fp16_token_averaging_scales_as_sample_averaging_does(cluster: Cluster) -> None:
    """Found by review: with loss_averaging="tokens" a micro-batch's loss was a sum, divided by the count only
    after backward, so its fp16 gradients were the count times one process's: the first five steps overflowed
    and were skipped (and with min_loss_scale 8192 the job failed) where the same batches averaged by samples
    applied every step. The order's scale is now divided by a power of two near the count (exactly undone)."""
    runs = {}
    for averaging in ("samples", "tokens"):
        job = await cluster.train(model=GPT["model"], model_kwargs=GPT["kwargs"], loss=GPT["loss"],
                                  optimizer=GPT["optimizer"], pipeline_stages=2, micro_batches=2, precision="fp16",
                                  loss_averaging=averaging, min_loss_scale=8192)
        try:
            runs[averaging] = [await job.step(x, y) for x, y in GPT["batches"]()]
        finally:
            await job.close()
    for averaging, stats in runs.items():
        assert [s.skipped for s in stats] == [False] * len(stats), averaging
        assert [s.loss_scale for s in stats] == [2.0 ** 16] * len(stats), averaging
    # No padding: the same mean loss either way, up to fp16's rounding of the two ways to it.
    assert [s.loss for s in runs["tokens"]] == pytest.approx([s.loss for s in runs["samples"]], rel=1e-3)


@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
async def test_clipping_equals_clip_grad_norm_on_one_process(cluster: Cluster, precision: str) -> None:
    state, stats, bounds = await train(cluster, GPT, pipeline_stages=2, data_parallel=2, gradient_clipping=0.5,
                                       precision=precision)
    expected, losses, norms = one_process(GPT, cuts_of(bounds), clip=0.5, precision=precision,
                                          scale=2.0 ** 16 if precision == "fp16" else 1.0, replicas=2)
    assert min(norms) > 0.5  # the clip bites on every step
    assert [s.grad_norm for s in stats] == pytest.approx(norms, rel=1e-5)
    assert_state_close(state, expected, rtol=1e-5, atol=1e-6)
    assert [s.loss for s in stats] == pytest.approx(losses, rel=1e-5)


@pytest.mark.asyncio(loop_scope="package")
async def test_the_norm_is_reported_without_clipping_and_counts_tied_weights_once(cluster: Cluster) -> None:
    tied = {**GPT, "kwargs": {**GPT["kwargs"], "tie_embeddings": True}}
    _, stats, bounds = await train(cluster, tied, pipeline_stages=2)
    _, _, norms = one_process(tied, cuts_of(bounds))
    assert [s.grad_norm for s in stats] == pytest.approx(norms, rel=1e-5)
    assert all(s.grad_norm is not None and math.isfinite(s.grad_norm) for s in stats)


@pytest.mark.asyncio(loop_scope="package")
async def test_clipping_across_a_pipeline_tensor_data_mesh_equals_clip_grad_norm_(eight: Cluster) -> None:
    # (2, 2, 2): every kind of sharing at once
    state, stats, bounds = await train(eight, GPT, pipeline_stages=2, tensor_parallel=2, data_parallel=2,
                                       gradient_clipping=0.5)
    expected, _, norms = one_process(GPT, cuts_of(bounds), clip=0.5, replicas=2)
    assert [s.grad_norm for s in stats] == pytest.approx(norms, rel=1e-5)
    assert_state_close(state, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.asyncio(loop_scope="package")
async def test_every_option_together_equals_one_process(cluster: Cluster) -> None:
    """bf16, clipping, a DeepSpeed warmup, activation checkpointing and ZeRO-1 at once, on a
    pipeline of 2 x 2 data-parallel replicas: one process doing the same arithmetic."""
    from stages.state.lr import WarmupLR

    warmup = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 3, "warmup_type": "linear"}
    state, stats, bounds = await train(cluster, GPT, pipeline_stages=2, data_parallel=2, precision="bf16",
                                       gradient_clipping=0.5, lr_scheduler=("stages.state.lr:WarmupLR", warmup),
                                       activation_checkpointing=True, zero_stage=1)
    expected, losses, norms = one_process(GPT, cuts_of(bounds), precision="bf16", clip=0.5, replicas=2,
                                          schedule=lambda optimizer: WarmupLR(optimizer, **warmup))
    assert [s.loss for s in stats] == pytest.approx(losses, rel=1e-5)
    assert [s.grad_norm for s in stats] == pytest.approx(norms, rel=1e-4)
    assert_state_close(state, expected, rtol=1e-5, atol=1e-6)
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    rates = WarmupLR(probe, **warmup)
    expected_lr = []
    for _ in stats:
        probe.step()
        rates.step()
        expected_lr.append(rates.get_last_lr())
    assert [s.lr for s in stats] == expected_lr and expected_lr[0] != expected_lr[-1]
