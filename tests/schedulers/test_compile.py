# .venv/bin/python -m pytest -q -p no:cacheprovider tests/schedulers/test_compile.py
"""runtime.torch_compile on nodes: stages compiled with inductor train as one eager process, within compile's
rounding, under zero-bubble's split backward (fused and W-batched, or plain autograd whole-graph), and a checkpoint
saved from a compiled job loads back into it.

Each stage process compiles its layers at the first step (seconds on two cores): the jobs are small and few, one
block a stage (a stage of several compiled layers is tests/stages/build/test_compiled.py's, in one process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from actors import Cluster
from examples.models import residual_mlp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600), pytest.mark.asyncio(loop_scope="package")]

MODEL_KWARGS = {"blocks": 2, "dim": 16, "hidden": 32}
OPTIMIZER = ("torch.optim:SGD", {"lr": 0.05})  # Adam would blow compile's rounding up


def batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    return [(torch.randn(8, 4, 16, generator=gen), torch.randn(8, 4, 16, generator=gen)) for _ in range(steps)]


def eager_reference(steps: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, eager, the whole global batch per step."""
    torch.manual_seed(0)
    model = residual_mlp(**MODEL_KWARGS)
    optimizer = torch.optim.SGD(model.parameters(), **OPTIMIZER[1])
    losses = []
    for x, y in steps:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model.state_dict(), losses


@pytest.mark.parametrize("options", [
    pytest.param({"w_batching": True, "torch_compile": True, "fusion_min_weight_elements": 0}, id="fused-wbatching"),
    pytest.param({"gradient_accumulation_fusion": False, "torch_compile": {"backend": "inductor", "fullgraph": True}},
                 id="plain-autograd-fullgraph"),
])
async def test_compiled_stages_train_as_one_eager_process_and_load_their_checkpoint(
    cluster: Cluster, tmp_path: Path, options: dict[str, Any]
) -> None:
    steps = batches()
    expected_state, expected_losses = eager_reference(steps)
    async with await cluster.train(model="examples.models:residual_mlp", model_kwargs=MODEL_KWARGS,
                                   optimizer=OPTIMIZER, pipeline_stages=2, schedule="zero_bubble", micro_batches=2,
                                   seed=0, **options) as job:
        losses = [(await job.step(x, y)).loss for x, y in steps]
        state = await job.state_dict()
        version = await job.save(tmp_path / "ckpt")
        await job.step(*steps[0])  # moves the weights away from the checkpoint
        await job.load(version)
        loaded = await job.state_dict()
    assert list(state) == list(expected_state)
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda m: f"{key}: {m}")
        assert torch.equal(loaded[key], state[key]), key
    assert losses == pytest.approx(expected_losses, rel=1e-5)
