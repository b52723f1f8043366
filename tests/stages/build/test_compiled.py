# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/build/test_compiled.py
"""Compiling a stage's layers (stages.build.compiled): names kept, fused and tensor-parallel layers eager, and a
pipeline of compiled stages trains as one eager process under every split of backward.

The pipelines here compile with ``aot_eager`` (torch.compile's graph capture and autograd split, run as aten ops:
no C++ compiler, no process); tests/schedulers/test_compile.py trains with inductor on nodes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from actors._registry import DEFAULT_ALLOW, EXAMPLE_FACTORIES
from schedulers.schedules import build_schedule
from stages.build.compiled import compile_kwargs, compile_stage, stays_eager
from stages.build.stage import build_stage
from stages.build.tensor_parallel import RowParallelLinear
from stages.compute import wgrad
from tests.stages.compute.test_tail import batches, reference
from tests.stages.stage_parts import InProcessPipeline, stage_config

pytestmark = pytest.mark.timeout(240)

AOT = {"backend": "aot_eager"}


@pytest.mark.parametrize(("setting", "expected"), [
    (False, None),
    (True, {}),
    ({}, {}),
    ({"backend": "inductor", "mode": None, "dynamic": False}, {"backend": "inductor", "dynamic": False}),
    ({"fullgraph": True, "options": {"max_autotune": True}}, {"fullgraph": True, "options": {"max_autotune": True}}),
])
def test_the_setting_is_torch_compiles_own_arguments(setting: Any, expected: dict[str, Any] | None) -> None:
    assert compile_kwargs(setting) == expected


def test_off_compiles_nothing_and_keeps_the_fast_path() -> None:
    built = build_stage(stage_config(0), DEFAULT_ALLOW + EXAMPLE_FACTORIES, torch.device("cpu"))
    assert all(getattr(layer, "_compiled_call_impl", None) is None for layer in built.held.values())
    assert built.model.inline_max_s > 0


def test_each_layer_compiles_in_place_keeping_its_names_and_the_fused_linears_stay_eager() -> None:
    eager = build_stage(stage_config(0), DEFAULT_ALLOW + EXAMPLE_FACTORIES, torch.device("cpu"))
    built = build_stage(stage_config(0, torch_compile=AOT), DEFAULT_ALLOW + EXAMPLE_FACTORIES, torch.device("cpu"))
    assert [name for name, _ in built.named_parameters] == [name for name, _ in eager.named_parameters]
    assert list(built.model.modules[0].state_dict()) == list(eager.model.modules[0].state_dict())
    assert all(layer._compiled_call_impl is not None for layer in built.held.values())
    linears = [m for layer in built.held.values() for m in layer.modules() if wgrad.takes_over(m)]
    assert linears and all(stays_eager(m, fused_linears=built.model.weight_grads) for m in linears)
    # A compiled layer may compile again (a new shape): never on the event loop's thread.
    assert built.model.inline_max_s == 0.0


def test_a_layer_that_stays_eager_is_not_compiled_itself() -> None:
    row = RowParallelLinear(4, 4, None, rank=0, world=1)
    chain = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.GELU()), row)
    fused = wgrad.WeightGradients()
    assert compile_stage({0: nn.Sequential(chain)}, AOT, fused_linears=fused) == 1
    assert stays_eager(row, fused_linears=None) and row._compiled_call_impl is None
    assert not stays_eager(chain[0][0], fused_linears=None)  # a plain linear compiles with its layer
    assert not stays_eager(chain[0][0], fused_linears=fused)  # ... and so does one the stage did not take over
    assert compile_stage({0: chain}, False, fused_linears=fused) == 0


@pytest.mark.parametrize(("schedule", "fields"), [
    ("1f1b", {}),
    ("zero_bubble", {}),                                                  # I, then W, fused
    ("zero_bubble", {"w_batching": True}),                                # every W batched in the tail
    ("zero_bubble", {"gradient_accumulation_fusion": False, "torch_compile": {**AOT, "fullgraph": True}}),
    # Found by review: with shapes compiled symbolically (dynamic, or a batch of another size) the backward
    # compiles lazily, after the patch that kept it from donating buffers, and the split backward's I failed.
    ("zero_bubble", {"gradient_accumulation_fusion": False, "torch_compile": {**AOT, "dynamic": True}}),
    ("1f1b", {"activation_checkpointing": True}),
])
async def test_compiled_stages_train_as_one_eager_process(schedule: str, fields: dict[str, Any]) -> None:
    steps = batches(2)
    expected_state, expected_losses = reference(steps)
    fields = {"torch_compile": AOT, **fields}
    pipeline = InProcessPipeline([stage_config(rank, schedule=schedule, **fields) for rank in range(2)], schedule)
    if fields.get("w_batching"):
        pipeline.programs = build_schedule(schedule, 2, 2, split=True, batch_w=True)
    try:
        for step, (x, y) in enumerate(steps):
            result = await pipeline.step(step, x, y)
            assert result.decision.apply
            assert result.loss == pytest.approx(expected_losses[step], rel=1.3e-6)
        state = pipeline.state()
    finally:
        pipeline.close()
    assert state.keys() == expected_state.keys()
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, msg=key)


def test_a_compiled_traced_stage_evaluates_in_evaluation_mode_and_trains_compiled_again() -> None:
    """Found by review: a compiled model cut at split_points kept the graph it compiled in training mode, which
    the switch to eval() rewrote but never reached: an evaluation dropped activations (two evaluations of one
    batch differed) and moved batch norm's running statistics. It now evaluates as eager does, statistics kept,
    and trains compiled again after."""
    from stages.build.traced import trace_stages
    from tests.stages.build.test_traced import _ModeDependent

    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    outs, kept = [], []
    for compiled in (False, True):
        torch.manual_seed(0)
        stages = trace_stages(_ModeDependent(), ["qkv"], x, "mode_dependent", dynamic=False)
        if compiled:
            assert compile_stage(dict(enumerate(stages)), {"backend": "aot_eager"}, fused_linears=None) == 2
        torch.manual_seed(3)
        stages[1](stages[0](x)).sum().backward()  # a training step's forward and backward
        before = {k: v.clone() for k, v in stages[1].state_dict().items() if "running" in k or "batches" in k}
        for stage in stages:
            stage.eval()
        with torch.no_grad():
            first, second = (stages[1](stages[0](x)) for _ in range(2))
        assert torch.equal(first, second)
        kept.append(all(torch.equal(stages[1].state_dict()[k], v) for k, v in before.items()))
        for stage in stages:
            stage.train()
        assert (stages[1].module._compiled_call_impl is not None) is compiled  # trains compiled again
        outs.append(first)
    assert kept == [True, True]
    torch.testing.assert_close(outs[1], outs[0])
