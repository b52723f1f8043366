"""Pipeline training end to end: every schedule equals single-process training.

The package's shared LocalCluster of 4 nodes (tests/schedulers/conftest.py) serves the
module, and its 8-node one the (2, 2, 2) mesh; each case starts a job on it, trains 3
steps on fixed global batches, and compares parameters and losses with one process
training the same model from the same seed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from actors import Cluster
from examples.data import char_batches
from examples.models import gpt, lm_loss, residual_mlp, residual_mlp_layers
from stages import layered_model, meta_initialized, parameter_groups
from stages.state.weight_decay import check_rule
from schedulers.schedules import build_schedule
from schedulers.simulate import simulate

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.asyncio(loop_scope="package")]

MODEL_KWARGS = {"blocks": 8, "dim": 16, "hidden": 32}
OPTIMIZERS = {
    "sgd_momentum": ("torch.optim:SGD", {"lr": 0.05, "momentum": 0.9}),
    "adam": ("torch.optim:Adam", {"lr": 0.01}),
}
BATCH, SEQ, STEPS = 16, 4, 3


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    return [
        (torch.randn(BATCH, SEQ, MODEL_KWARGS["dim"], generator=gen),
         torch.randn(BATCH, SEQ, MODEL_KWARGS["dim"], generator=gen))
        for _ in range(STEPS)
    ]


def train_single_process(optimizer: tuple[str, dict[str, Any]]) -> tuple[dict[str, torch.Tensor], list[float]]:
    return train_reference({**WORKLOADS["mlp"], "optimizer": optimizer})


# Every schedule with both stage counts, both micro-batch counts and both optimizers, and
# every (stages, micro-batches) pair across the schedules. The whole product of these runs in
# one process against the same executor (tests/stages/compute/test_executor.py); here it
# would only repeat it over node processes.
ZMQ_SHAPES = [(2, 4, "sgd_momentum"), (4, 8, "adam")]
ZMQ_SHAPES_CROSSED = [(2, 8, "adam"), (4, 4, "sgd_momentum")]
CASES = [
    pytest.param(schedule, stages, micro, opt, "zmq", True, id=f"{schedule}-{stages}stages-{micro}mb-{opt}")
    for schedule, shapes in [("gpipe", ZMQ_SHAPES), ("1f1b", ZMQ_SHAPES_CROSSED), ("interleaved", ZMQ_SHAPES),
                             ("zero_bubble", ZMQ_SHAPES_CROSSED), ("zbv", [(2, 4, "sgd_momentum")]),
                             ("dualpipev", [(4, 8, "adam")])]
    for stages, micro, opt in shapes
] + [
    # The same executor over torch.distributed point-to-point instead of actor messages.
    pytest.param(schedule, stages, 8, "adam", "dist", True, id=f"{schedule}-{stages}stages-8mb-adam-dist")
    # Interleaved at 4 ranks: the last rank sends on to the first, over a pair group of its own.
    # In a V (zbv) rank 3 turns each micro-batch round in memory, and rank 0 holds the first and the last stage.
    for schedule, stages in [("1f1b", 2), ("gpipe", 4), ("interleaved", 2), ("interleaved", 4), ("zero_bubble", 4),
                             ("zbv", 4)]
] + [
    # The same executor over the sealed streams each stage's loop reads and writes itself.
    pytest.param(schedule, stages, 8, "adam", "stream", True, id=f"{schedule}-{stages}stages-8mb-adam-stream")
    for schedule, stages in [("1f1b", 2), ("interleaved", 4), ("zbv", 4)]
] + [
    # Plain autograd for every weight gradient: B unsplit, and zero-bubble's W walks the graph again.
    pytest.param(schedule, stages, 8, "adam", "zmq", False, id=f"{schedule}-{stages}stages-8mb-adam-nofusion")
    for schedule, stages in [("1f1b", 4), ("zero_bubble", 2), ("zero_bubble", 4)]
]


@pytest.mark.parametrize("schedule,stages,micro_batches,optimizer,transport,fusion", CASES)
async def test_pipeline_training_equals_one_process(
    cluster: Cluster, schedule: str, stages: int, micro_batches: int, optimizer: str, transport: str, fusion: bool
) -> None:
    expected_state, expected_losses = train_single_process(OPTIMIZERS[optimizer])
    job = await cluster.train(
        model="examples.models:residual_mlp", model_kwargs=MODEL_KWARGS,
        loss="torch.nn.functional:mse_loss", optimizer=OPTIMIZERS[optimizer],
        pipeline_stages=stages, schedule=schedule, micro_batches=micro_batches, seed=0, transport=transport,
        gradient_accumulation_fusion=fusion,
    )
    # Each stage frees a micro-batch's stash at its backward (or, split, once W has run):
    # the measured peaks are the ones the schedule implies.
    program = build_schedule(schedule, stages, micro_batches, split=fusion)
    expected_stash = list(simulate(program).peak_stash)
    try:
        losses = []
        for x, y in batches():
            stats = await job.step(x, y)
            losses.append(stats.loss)
            assert stats.peak_stash == expected_stash
            assert stats.bytes_sent > 0 and 0.0 <= stats.bubble_fraction < 1.0 and stats.step_time_s > 0
        state = await job.state_dict()
    finally:
        await job.close()
    assert list(state) == list(expected_state)  # same keys, same order as the unpartitioned model
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    assert losses == pytest.approx(expected_losses, rel=1e-5)


GPT_KWARGS = {"vocab_size": 128, "dim": 16, "layers": 4, "heads": 2, "context": 8}


def gpt_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    read = char_batches(batch_size=BATCH, context=GPT_KWARGS["context"], max_bytes=20_000, seed=3)
    return [read(step) for step in range(STEPS)]


# The GPT trains with SGD: its key bias gets a mathematically zero gradient (softmax
# ignores a constant shift), and Adam would blow the last bits of that zero up into
# full-size steps, making any two summation orders disagree.
WORKLOADS: dict[str, dict[str, Any]] = {
    "mlp": {"model": "examples.models:residual_mlp", "kwargs": MODEL_KWARGS, "build": residual_mlp,
            "loss": "torch.nn.functional:mse_loss", "loss_fn": torch.nn.functional.mse_loss, "batches": batches,
            "optimizer": ("torch.optim:Adam", {"lr": 0.01})},
    # Layer specs: each stage builds only its blocks, each under its own seed; one process builds all.
    "mlp_layers": {"model": "examples.models:residual_mlp_layers", "kwargs": MODEL_KWARGS,
                   "build": lambda **kwargs: layered_model(residual_mlp_layers(**kwargs), seed=0),
                   "loss": "torch.nn.functional:mse_loss", "loss_fn": torch.nn.functional.mse_loss,
                   "batches": batches, "optimizer": ("torch.optim:Adam", {"lr": 0.01})},
    "gpt": {"model": "examples.models:gpt", "kwargs": GPT_KWARGS, "build": gpt,
            "loss": "examples.models:lm_loss", "loss_fn": lm_loss, "batches": gpt_batches,
            "optimizer": ("torch.optim:SGD", {"lr": 0.1, "momentum": 0.9})},
    # meta_init: parameters made on the meta device, each stage makes real only its own, each module
    # reset under a seed of its name. One process builds all (tied weights: tests/schedulers/test_real_models.py).
    "gpt_meta": {"model": "examples.models:gpt", "kwargs": GPT_KWARGS,
                 "build": lambda **kwargs: meta_initialized(gpt, kwargs, seed=0), "options": {"meta_init": True},
                 "loss": "examples.models:lm_loss", "loss_fn": lm_loss, "batches": gpt_batches,
                 "optimizer": ("torch.optim:SGD", {"lr": 0.1, "momentum": 0.9})},
}


def train_reference(workload: dict[str, Any], no_weight_decay: Any = ()) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process on the workload's batches; ``no_weight_decay``: its optimizer over the job's groups."""
    torch.manual_seed(0)
    model = workload["build"](**workload["kwargs"])
    path, kwargs = workload["optimizer"]
    params = parameter_groups(model.named_parameters(remove_duplicate=False),
                              check_rule("no_weight_decay", no_weight_decay)) if no_weight_decay else model.parameters()
    opt = getattr(torch.optim, path.partition(":")[2])(params, **kwargs)
    losses = []
    for x, y in workload["batches"]():
        loss = workload["loss_fn"](model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


MESHES = [
    pytest.param("mlp", 2, 1, 2, "1f1b", "zmq", id="mlp-pp2-dp2-1f1b"),
    pytest.param("mlp", 1, 1, 2, "gpipe", "zmq", id="mlp-pp1-dp2"),
    pytest.param("mlp", 2, 1, 2, "zero_bubble", "zmq", id="mlp-pp2-dp2-zero_bubble"),
    pytest.param("mlp", 2, 2, 1, "1f1b", "zmq", id="mlp-pp2-tp2"),
    pytest.param("mlp", 1, 2, 2, "1f1b", "zmq", id="mlp-tp2-dp2"),
    pytest.param("mlp_layers", 2, 1, 2, "1f1b", "zmq", id="mlp_layers-pp2-dp2"),
    pytest.param("mlp_layers", 2, 2, 1, "interleaved", "zmq", id="mlp_layers-pp2-tp2-interleaved"),
    pytest.param("gpt", 2, 1, 1, "1f1b", "zmq", id="gpt-pp2"),
    pytest.param("gpt", 2, 1, 2, "1f1b", "zmq", id="gpt-pp2-dp2"),
    pytest.param("gpt", 2, 2, 1, "1f1b", "zmq", id="gpt-pp2-tp2"),
    pytest.param("gpt", 1, 2, 2, "gpipe", "zmq", id="gpt-tp2-dp2"),
    pytest.param("gpt_meta", 2, 2, 1, "1f1b", "zmq", id="gpt_meta-pp2-tp2"),
    pytest.param("gpt_meta", 4, 1, 1, "1f1b", "zmq", id="gpt_meta-pp4"),
    # Pipeline tensors by point-to-point: each replica (or shard) has its own pair groups.
    pytest.param("mlp", 2, 1, 2, "1f1b", "dist", id="mlp-pp2-dp2-dist"),
    pytest.param("mlp", 2, 2, 1, "1f1b", "dist", id="mlp-pp2-tp2-dist"),
    # Pipeline tensors on streams: each replica's (or shard's) stages open their own sessions.
    pytest.param("mlp", 2, 1, 2, "1f1b", "stream", id="mlp-pp2-dp2-stream"),
    pytest.param("gpt", 2, 2, 1, "1f1b", "stream", id="gpt-pp2-tp2-stream"),
]


@pytest.mark.parametrize("name,pipeline,tensor,data,schedule,transport", MESHES)
async def test_mesh_training_equals_one_process(
    cluster: Cluster, name: str, pipeline: int, tensor: int, data: int, schedule: str, transport: str
) -> None:
    workload = WORKLOADS[name]
    expected_state, expected_losses = train_reference(workload)
    job = await cluster.train(
        model=workload["model"], model_kwargs=workload["kwargs"], loss=workload["loss"],
        optimizer=workload["optimizer"], pipeline_stages=pipeline, tensor_parallel=tensor,
        data_parallel=data, schedule=schedule, micro_batches=4, seed=0, transport=transport,
        **workload.get("options", {}),
    )
    try:
        losses = [(await job.step(x, y)).loss for x, y in workload["batches"]()]
        state = await job.state_dict()
    finally:
        await job.close()
    assert list(state) == list(expected_state)
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    assert losses == pytest.approx(expected_losses, rel=1e-5)


async def test_full_mesh_of_eight_equals_one_process(eight: Cluster) -> None:
    """(P,T,D) = (2,2,2): eight node processes, oversubscribed on a small machine but exact."""
    for workload in WORKLOADS.values():
        expected_state, expected_losses = train_reference(workload)
        async with await eight.train(
            model=workload["model"], model_kwargs=workload["kwargs"], loss=workload["loss"],
            optimizer=workload["optimizer"], pipeline_stages=2, tensor_parallel=2, data_parallel=2,
            schedule="1f1b", micro_batches=4, seed=0, **workload.get("options", {}),
        ) as job:
            losses = [(await job.step(x, y)).loss for x, y in workload["batches"]()]
            state = await job.state_dict()
            await job.load_state_dict(expected_state)  # sharded back out to every member
            reloaded = await job.state_dict()
        for key, value in expected_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
            assert torch.equal(reloaded[key], value), key
        assert losses == pytest.approx(expected_losses, rel=1e-5)
