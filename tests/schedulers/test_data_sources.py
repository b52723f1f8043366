"""A DataLoader as a job's data source, end to end against one process.

Sequences of many lengths, padded per micro-batch by the loader's collate_fn, read by each
replica's first and last stage as DistributedSampler shards them: every micro-batch of a
step has its own length, and with ``loss_averaging="tokens"`` the step equals one process's
token mean over all of them. A checkpoint keeps the data's position (the step), so a job
loaded from it reads on exactly where the saved one did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from actors import Cluster
from examples import hf
from examples.data import token_sequences
from examples.models import gpt, lm_loss
from stages.build.data_source import DatasetReader

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.asyncio(loop_scope="package")]

GPT = {"vocab_size": 32, "dim": 16, "layers": 2, "heads": 2, "context": 8}
DATA = {"count": 24, "min_len": 2, "max_len": 8, "vocab_size": 32, "batch_size": 2, "shuffle": True, "seed": 3}
SGD = ("torch.optim:SGD", {"lr": 0.1, "momentum": 0.9})
REPLICAS, MICRO = 2, 2


def _train(**overrides: object) -> dict[str, object]:
    return dict(model="examples.models:gpt", model_kwargs=GPT, loss="examples.models:lm_loss", optimizer=SGD,
                pipeline_stages=2, data_parallel=REPLICAS, schedule="1f1b", micro_batches=MICRO, seed=0,
                data="examples.data:token_sequences", data_kwargs=DATA, loss_averaging="tokens") | overrides


LLAMA = {"layers": 2, "dim": 32, "heads": 2, "kv_heads": 1, "vocab": 32, "positions": 16}
MODELS = {
    "gpt": (lambda: gpt(**GPT), {"model": "examples.models:gpt", "model_kwargs": GPT}, lambda out: out),
    # Traced at split_points on the loader's first micro-batch, every dimension dynamic.
    "llama": (lambda: hf.llama(**LLAMA), {"model": "examples.hf:llama", "model_kwargs": LLAMA,
                                          "split_points": ["model.layers.1"]}, lambda out: out.logits),
}


def train_one_process(model: torch.nn.Module, logits: Any, steps: list[list[tuple[Any, Any]]]) -> list[float]:
    """Trains ``model`` as the job does (SGD, a token mean over each step's micro-batches); each step's loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for pairs in steps:
        total = sum(lm_loss(logits(model(x)), y, reduction="sum") for x, y in pairs)
        loss = total / sum(int((y != -100).sum()) for _, y in pairs)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


async def assert_trains_as(cluster: Cluster, trained: torch.nn.Module, losses: list[float], **overrides: Any) -> None:
    """A job of ``_train(**overrides)`` reads its data for ``len(losses)`` steps and ends equal to ``trained``."""
    job = await cluster.train(**_train(**overrides))
    try:
        stats = [await job.step() for _ in losses]
        state = await job.state_dict()
    finally:
        await job.close()
    assert [s.loss for s in stats] == pytest.approx(losses, rel=1e-5)
    # Found by review: samples was the factory's batch_size (a DataLoader's: one micro-batch's), 4x too few here.
    spec = _train(**overrides)
    assert {s.samples for s in stats} == {spec["data_parallel"] * spec["micro_batches"] * DATA["batch_size"]}
    for key, value in trained.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("name", list(MODELS))
async def test_a_data_loader_of_many_lengths_trains_as_one_process(cluster: Cluster, name: str) -> None:
    build, options, logits = MODELS[name]
    steps = 4  # 4 steps x 2 replicas x 2 micro-batches x 2 samples = 32 > 24: into the second epoch
    reader = DatasetReader(token_sequences(**DATA), None, seed=0)
    try:
        reads = [[reader.read(step, r, REPLICAS, MICRO) for r in range(REPLICAS)] for step in range(steps)]
    finally:
        reader.close()
    lengths = {x.shape[1] for step in reads for inputs, _, _ in step for x in inputs}
    assert len(lengths) > 2  # the micro-batches do have lengths of their own
    torch.manual_seed(0)
    model = build()
    losses = train_one_process(model, logits, [[(x, y) for inputs, targets, _ in step for x, y in zip(inputs, targets)]
                                               for step in reads])
    await assert_trains_as(cluster, model, losses, **options)


async def test_a_loaders_worker_processes_feed_each_stage_what_its_thread_would(cluster: Cluster) -> None:
    # num_workers=2: each of the four stages (two replicas' first and last) loads in two processes of its own.
    reader = DatasetReader(token_sequences(**DATA), None, seed=0)  # no workers: on the reader's thread
    try:
        reads = [[reader.read(step, r, REPLICAS, MICRO) for r in range(REPLICAS)] for step in range(4)]
    finally:
        reader.close()
    torch.manual_seed(0)
    model = gpt(**GPT)
    losses = train_one_process(model, lambda out: out, [[(x, y) for inputs, targets, _ in step
                                                         for x, y in zip(inputs, targets)] for step in reads])
    await assert_trains_as(cluster, model, losses, data_kwargs={**DATA, "num_workers": 2})


@pytest.mark.parametrize(("schedule", "stages", "micro"), [("1f1b", 3, MICRO), ("dualpipev", 2, 4)])
async def test_a_stage_between_the_first_and_the_last_reads_no_data(cluster: Cluster, schedule: str, stages: int,
                                                                     micro: int) -> None:
    # A rank that holds neither the model's first stage nor its last (the middle of three, or both
    # ranks' inner stages in a V) has no data to read: its values come from its neighbours.
    reader = DatasetReader(token_sequences(**DATA), None, seed=0)
    try:
        reads = [reader.read(step, 0, 1, micro) for step in range(2)]
    finally:
        reader.close()
    torch.manual_seed(0)
    model = gpt(**GPT)
    losses = train_one_process(model, lambda out: out, [list(zip(inputs, targets)) for inputs, targets, _ in reads])
    await assert_trains_as(cluster, model, losses, pipeline_stages=stages, data_parallel=1, schedule=schedule,
                           micro_batches=micro)


async def test_a_checkpoint_resumes_the_data_where_it_stood(cluster: Cluster, tmp_path: Path) -> None:
    job = await cluster.train(**_train())
    try:
        for _ in range(2):
            await job.step()
        await job.save(str(tmp_path / "ckpt"))
        expected = [(await job.step()).loss for _ in range(2)]
    finally:
        await job.close()
    resumed = await cluster.train(**_train())
    try:
        assert await resumed.load(str(tmp_path / "ckpt")) == 2
        losses = [(await resumed.step()).loss for _ in range(2)]
    finally:
        await resumed.close()
    assert losses == expected


@pytest.mark.parametrize("layout", ["more_micro_batches", "one_replica"])
async def test_a_checkpoint_loaded_into_another_layout_reads_on_where_the_saved_job_stood(
        cluster: Cluster, tmp_path: Path, layout: str) -> None:
    """Found by review: the stream's position was worked out from the step count and the loading job's own
    layout, so a job saved after 2 steps of 2 replicas x 2 micro-batches (16 global micro-batches... of which
    8 read) and loaded with 4 micro-batches began at 16, skipping 8 micro-batches of the epoch; with one
    replica, at 4, reading 4 again. The checkpoint keeps the position; the loaded job's first step reads the
    8th global micro-batch on, as one process given that stream would (the loss of its first step, taken
    before the optimizer's state, which one process here does not have, moves anything)."""
    job = await cluster.train(**_train())
    try:
        for _ in range(2):
            await job.step()
        await job.save(str(tmp_path / "ckpt"))
        saved = await job.state_dict()
    finally:
        await job.close()
    replicas, micro = (REPLICAS, 4) if layout == "more_micro_batches" else (1, MICRO)
    resumed = await cluster.train(**_train(data_parallel=replicas, micro_batches=micro))
    try:
        assert await resumed.load(str(tmp_path / "ckpt")) == 2
        first = (await resumed.step()).loss
        described = await resumed.describe()
    finally:
        await resumed.close()
    reader = DatasetReader(token_sequences(**DATA), None, seed=0)
    try:
        step = [pair for r in range(replicas) for pair in zip(*reader.read(0, r, replicas, micro, 8)[:2])]
    finally:
        reader.close()
    model = gpt(**GPT)
    model.load_state_dict(saved)
    assert first == pytest.approx(train_one_process(model, lambda out: out, [step])[0], rel=1e-5)
    assert described.steps == 3
