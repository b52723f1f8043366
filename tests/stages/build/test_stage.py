# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/build/test_stage.py
"""build_stage (stages.build.stage): one frozen result from a stage's config, in one process."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from actors._errors import NotAllowed
from actors._registry import DEFAULT_ALLOW, EXAMPLE_FACTORIES
from stages.build.data_source import BatchFunction
from stages.build.stage import BuiltStage, build_stage, read_data
from tests.stages.stage_parts import MODEL_KWARGS, stage_config

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")
DATA = {"data": "examples.data:regression_batches", "data_kwargs": {"batch_size": 8, "seq": 2, "dim": 8}}


def build(rank: int = 0, num_ranks: int = 2, **overrides: Any) -> BuiltStage:
    return build_stage(stage_config(rank, num_ranks, **overrides), DEFAULT_ALLOW + EXAMPLE_FACTORIES, CPU)


def test_a_built_stage_is_one_frozen_value_holding_its_layers_and_their_names() -> None:
    first, last = build(0), build(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.overlap = None  # type: ignore[misc]
    assert list(first.held) == [0, 1] and list(last.held) == [2, 3]
    assert list(first.model.modules) == [0] and list(last.model.modules) == [1]
    assert [name for name, _ in first.named_parameters][:2] == ["0.norm.weight", "0.norm.bias"]
    # Every stage starts from the weights one process would: the same seed, the same model.
    torch.manual_seed(0)
    from examples.models import residual_mlp
    whole = residual_mlp(**MODEL_KWARGS).state_dict()
    for built in (first, last):
        for name, param in built.named_parameters:
            assert torch.equal(param, whole[name]), name
    # Nothing shared, sharded or replicated: every parameter counts in the norm, nothing overlaps.
    assert len(first.norm_params) == len(first.named_parameters) == len(list(first.model.optimizer.param_groups[0]
                                                                             ["params"]))
    assert {id(p) for p in first.reduce_params} == {id(p) for _, p in first.named_parameters}
    assert first.overlap is None and first.specs == {} and first.aliases == {} and first.tied.groups == []
    assert (first.tensor_rank, first.data_rank, first.data) == (0, 0, None)


def test_the_data_factory_is_built_on_the_first_and_last_stage_only() -> None:
    built = [build(rank, 3, model_kwargs={**MODEL_KWARGS, "blocks": 3}, **DATA) for rank in range(3)]
    assert built[0].data is not None and built[1].data is None and built[2].data is not None


@pytest.mark.parametrize(("rank", "num_ranks", "reads"), [(0, 2, (True, False)), (1, 2, (False, True)),
                                                          (0, 1, (True, True)), (1, 3, (False, False))])
def test_read_data_splits_this_replicas_share_into_micro_batches(rank: int, num_ranks: int,
                                                                 reads: tuple[bool, bool]) -> None:
    config = stage_config(rank, num_ranks, model_kwargs={**MODEL_KWARGS, "blocks": 3}, **DATA)

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.arange(8.0) + step, -torch.arange(8.0)

    inputs, targets, weights = read_data(BatchFunction(data), config, 10, [1, 2], 2)  # replica 1 of 2, 2 micro-batches
    assert weights is None  # an even split
    assert (inputs is not None, targets is not None) == reads
    if inputs is not None:
        assert [t.tolist() for t in inputs] == [[14.0, 15.0], [16.0, 17.0]]
    if targets is not None:
        assert [t.tolist() for t in targets] == [[-4.0, -5.0], [-6.0, -7.0]]


def test_read_data_without_a_factory_says_so() -> None:
    with pytest.raises(ValueError, match="job test has no data factory"):
        read_data(None, stage_config(0), 0, [0, 1], 2)
    with pytest.raises(ValueError, match="job test has no eval_data"):  # an order to read validation data it lacks
        read_data(None, stage_config(0), 0, [0, 1], 2, "eval_data")


@pytest.mark.parametrize(("overrides", "match"), [
    ({"model": "os:system"}, "not on this node's allow-list"),
    ({"optimizer": ["subprocess:Popen", {}]}, "not on this node's allow-list"),
    ({"loss": "shutil:rmtree"}, "not on this node's allow-list"),
])
def test_a_factory_outside_the_allow_list_is_refused(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(NotAllowed, match=match):
        build(**overrides)


def test_a_traced_stage_on_another_device_makes_what_the_trace_made_on_the_cpu_there() -> None:
    """The trace records the device of the tensors it saw made (GPT-2's position ids: ``arange(...,
    device=cpu)``, ``to(..., device=cpu)``); a stage on a GPU moved its weights but still made those
    on the CPU and failed at its first forward. The meta device stands in for a GPU here."""
    pytest.importorskip("transformers")
    tokens = torch.randint(0, 64, (2, 8))
    config = stage_config(0, 2, model="examples.hf:gpt2", bounds=[[0, 1], [1, 2]], loss="examples.models:lm_loss",
                          model_kwargs={"dim": 32, "heads": 2, "vocab": 64, "positions": 16, "layers": 4},
                          split_points=["transformer.h.2"], example_inputs=tokens, dynamic_shapes=False)
    built = build_stage(config, DEFAULT_ALLOW + EXAMPLE_FACTORIES, torch.device("meta"))
    out = built.model.modules[0](tokens.to("meta"))
    assert [value.device.type for value in out] == ["meta"] * len(out) and out[0].shape == (2, 8, 32)


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.float32), ("fp16", torch.float32),
                                                  ("fp32", torch.bfloat16)])
def test_mixed_precision_keeps_float32_masters_of_a_model_built_in_bf16(precision: str, dtype: torch.dtype) -> None:
    """Found by review: a model built in bf16 trained its bf16 weights themselves under precision='bf16', and
    an SGD step at lr 1e-4 changed none of them. Mixed precision keeps float32 masters (autocast computes in
    the half dtype); precision='fp32' trains what it is given."""
    config = stage_config(0, 2, model="tests.helpers.models:bf16_mlp", model_kwargs={"dim": 8, "layers": 4},
                          precision=precision, bounds=[[0, 2], [2, 4]])
    built = build_stage(config, DEFAULT_ALLOW + EXAMPLE_FACTORIES + ("tests.helpers.models",), CPU)
    assert {p.dtype for _, p in built.named_parameters} == {dtype}
    assert all(p.dtype == dtype for group in built.model.optimizer.param_groups for p in group["params"])


def test_an_optimizer_that_steps_with_a_closure_is_refused_where_the_stage_builds_it() -> None:
    """Found by review: torch's L-BFGS (and a subclass of it) failed every step at STEP with "'NoneType' object
    is not callable", with or without ZeRO: its step re-evaluates the loss in a closure, which a pipeline step
    cannot give. The spec refuses torch's by name; a subclass, only known once imported, is refused here."""
    config = stage_config(0, 2, optimizer=("tests.helpers.models:LineSearch", {"lr": 0.1}))
    with pytest.raises(ValueError, match="closure.*use AdamW or SGD"):
        build_stage(config, DEFAULT_ALLOW + EXAMPLE_FACTORIES + ("tests.helpers.models",), CPU)


def test_a_validation_set_read_once_through_must_have_an_end() -> None:
    with pytest.raises(ValueError, match="eval_batches=0 reads the validation set once through.*batch function"):
        build(1, eval_data="examples.data:regression_batches", eval_batches=0)


@pytest.mark.parametrize(("loss", "checked"), [("torch.nn.functional:mse_loss", True),
                                               ("tests.helpers.models:per_sample_loss", False)])
def test_a_stage_checks_targets_for_torchs_broadcasting_losses_alone(loss: str, checked: bool) -> None:
    config = stage_config(1, 2, loss=loss)
    built = build_stage(config, DEFAULT_ALLOW + EXAMPLE_FACTORIES + ("tests.helpers.models",), CPU)
    assert built.model.checks_target_shape is checked
