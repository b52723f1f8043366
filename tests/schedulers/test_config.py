"""DeepSpeed-style configs: batch-size arithmetic, key checking, and the translation to a JobSpec."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from schedulers.config import BatchSizes, ConfigError, load_config, resolve_batch_sizes, translate_config
from schedulers.jobs import JobSpec

pytestmark = pytest.mark.timeout(30)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt_config.json"

MINIMAL: dict[str, Any] = {"train_batch_size": 8, "model": "examples.models:residual_mlp"}


@pytest.mark.parametrize(("given", "expected"), [
    # (train_batch_size, micro, accumulation, data_parallel) -> (train, micro, accumulation)
    ((32, 8, 4, 1), (32, 8, 4)),
    ((32, 8, None, 1), (32, 8, 4)),
    ((32, None, 4, 1), (32, 8, 4)),
    ((None, 8, 4, 1), (32, 8, 4)),
    ((32, None, None, 1), (32, 32, 1)),
    ((None, 8, None, 1), (8, 8, 1)),
    ((64, 8, None, 2), (64, 8, 4)),
    ((64, None, 4, 2), (64, 8, 4)),
    ((None, 8, 4, 2), (64, 8, 4)),
    ((64, None, None, 2), (64, 32, 1)),
])
def test_any_two_batch_sizes_determine_the_third(given: tuple[Any, ...], expected: tuple[int, int, int]) -> None:
    total, micro, accum, dp = given
    sizes = resolve_batch_sizes(train_batch_size=total, micro_batch_size=micro, accumulation_steps=accum,
                                data_parallel=dp)
    assert sizes == BatchSizes(*expected)


@pytest.mark.parametrize(("given", "key", "message"), [
    ((30, 8, 4, 1), "train_batch_size", "expected 32 = train_micro_batch_size_per_gpu (8) * "
                                        "gradient_accumulation_steps (4) * data_parallel (1), got 30"),
    ((32, 8, 4, 2), "train_batch_size", "expected 64"),
    ((30, 8, None, 1), "train_batch_size", "expected a multiple of train_micro_batch_size_per_gpu (8) * "
                                           "data_parallel (1) = 8 (e.g. 24 or 32), got 30"),
    ((30, None, 4, 1), "train_batch_size", "= 4 (e.g. 28 or 32), got 30"),
    ((9, None, None, 2), "train_batch_size", "data_parallel (2) = 2"),
    ((None, None, 4, 1), "train_batch_size", "missing"),
    ((None, None, None, 1), "train_batch_size", "missing"),
])
def test_inconsistent_batch_sizes_name_the_key_and_the_expected_value(
    given: tuple[Any, ...], key: str, message: str
) -> None:
    total, micro, accum, dp = given
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(train_batch_size=total, micro_batch_size=micro, accumulation_steps=accum,
                            data_parallel=dp)
    assert info.value.key == key
    assert message in str(info.value)


def test_the_example_gpt_config_translates_to_a_valid_job() -> None:
    spec = load_config(EXAMPLE)
    assert isinstance(spec, JobSpec)
    assert spec.model == "examples.models:gpt" and spec.loss == "examples.models:lm_loss"
    assert spec.optimizer == ("torch.optim:AdamW", {"lr": 0.001})
    assert spec.pipeline_stages == 2 and spec.schedule == "1f1b"
    assert spec.micro_batches == 4  # gradient_accumulation_steps: the micro-batches of one step
    assert spec.data == "examples.data:char_batches"
    assert spec.data_kwargs["batch_size"] == 32  # train_batch_size, filled in for the factory
    assert spec.partition_method == "parameters"


def test_keys_the_file_leaves_out_take_the_specs_defaults() -> None:
    spec = translate_config(MINIMAL)
    defaults = JobSpec(model="examples.models:residual_mlp")
    assert spec.replace(micro_batches=defaults.micro_batches) == defaults


def test_everything_a_config_can_say_reaches_train() -> None:
    config = {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "optimizer": {"type": "adam", "params": {"lr": 0.01, "betas": [0.9, 0.95], "torch_adam": True}},
        "pipeline": {"stages": 2, "schedule": "interleaved", "partition_method": "uniform", "virtual_stages": 2},
        "model": {"factory": "examples.models:residual_mlp", "kwargs": {"blocks": 8}},
        "loss": "torch.nn.functional:mse_loss",
        "data": {"factory": "examples.data:regression_batches", "kwargs": {"dim": 512}},
        "mesh": {"tensor_parallel": 1, "data_parallel": 2},
        "codecs": {"activation": "int8", "gradient": ["int4", "fp16", "none"], "reduce": "int8",
                   "error_feedback": True, "measure_error": False},
        "transport": "zmq", "seed": 3, "threads_per_stage": 2, "step_timeout_s": 30,
        "steps_per_print": 10, "wall_clock_breakdown": False,
    }
    spec = translate_config(config)
    kwargs = spec.to_wire()
    assert spec.optimizer == ("torch.optim:Adam", {"lr": 0.01, "betas": [0.9, 0.95]})
    assert (kwargs["schedule"], kwargs["virtual_stages"], kwargs["partition_method"]) == ("interleaved", 2, "uniform")
    assert (kwargs["data_parallel"], kwargs["micro_batches"], kwargs["data_kwargs"]["batch_size"]) == (2, 4, 16)
    assert kwargs["gradient_codec"] == ["int4", "fp16", "none"] and kwargs["reduce_codec"] == "int8"
    assert kwargs["error_feedback"] and not kwargs["measure_codec_error"]
    assert (kwargs["seed"], kwargs["threads_per_stage"], kwargs["step_timeout_s"]) == (3, 2, 30.0)
    assert JobSpec.from_wire(kwargs) == spec


@pytest.mark.parametrize(("optimizer", "expected"), [
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, ("torch.optim:SGD", {"lr": 0.1, "momentum": 0.9})),
    ({"type": "AdamW"}, ("torch.optim:AdamW", {})),
    ({"type": "Adam", "params": {"adam_w_mode": True, "lr": 1e-3}}, ("torch.optim:AdamW", {"lr": 1e-3})),
    ({"type": "torch.optim:ASGD", "params": {"lr": 0.1}}, ("torch.optim:ASGD", {"lr": 0.1})),
])
def test_optimizer_types_become_torch_optimizers(optimizer: dict[str, Any], expected: tuple[str, Any]) -> None:
    assert translate_config({**MINIMAL, "optimizer": optimizer}).optimizer == expected


@pytest.mark.parametrize(("change", "key", "message"), [
    ({"train_batch_sise": 8}, "train_batch_sise", "did you mean train_batch_size"),
    ({"pipeline": {"stages": 2, "shedule": "1f1b"}}, "pipeline.shedule", "did you mean pipeline.schedule"),
    ({"pipeline": {"schedule": "2f2b"}}, "pipeline.schedule", "expected one of gpipe, 1f1b"),
    ({"pipeline": {"partition_method": "typo:Linear"}}, "pipeline.partition_method", "parameters, uniform"),
    ({"pipeline": {"partition_method": "type:("}}, "pipeline.partition_method", "not a regular expression"),
    ({"pipeline": {"split_points": "transformer.h.2"}}, "pipeline.split_points", "a list of module names"),
    ({"pipeline": {"stages": 0}}, "pipeline.stages", "expected an integer >= 1, got 0"),
    ({"optimizer": {"type": "Lion"}}, "optimizer.type", "unknown optimizer 'Lion'"),
    ({"optimizer": {"type": "SGD", "param": {}}}, "optimizer.param", "did you mean optimizer.params"),
    ({"fp16": {"enabled": True}}, "fp16", "not supported by actorpipe: mixed precision"),
    ({"zero_optimization": {"stage": 1}}, "zero_optimization", "ZeRO"),
    ({"codecs": {"activation": "int9"}}, "codecs.activation", "expected a codec name"),
    ({"model": {"kwargs": {}}}, "model.factory", "expected an import path"),
    ({"data": {"factory": "examples.data:char_batches", "kwargs": {"batch_size": 4}}},
     "data.kwargs.batch_size", "expected 8 (train_batch_size"),
    ({"step_timeout_s": -1}, "step_timeout_s", "> 0"),
    ({"transport": "carrier-pigeon"}, "transport", "expected one of zmq, dist"),
    ({"seed": "0"}, "seed", "expected an integer"),
])
def test_a_wrong_key_or_value_is_an_error_that_names_it(change: dict[str, Any], key: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        translate_config({**MINIMAL, **change})
    assert info.value.key == key
    assert message in str(info.value)


def test_deepspeeds_type_partition_and_split_points_reach_the_spec() -> None:
    spec = translate_config({**MINIMAL, "pipeline": {"stages": 2, "partition_method": "type:Linear"}})
    assert spec.partition_method == "type:Linear"
    spec = translate_config({**MINIMAL, "model": {"factory": "examples.hf:gpt2"},
                             "data": {"factory": "examples.data:char_batches", "kwargs": {"batch_size": 8}},
                             "pipeline": {"stages": 2, "split_points": ["transformer.h.2"]}})
    assert isinstance(spec, JobSpec) and spec.split_points == ["transformer.h.2"]


def test_a_missing_model_is_named() -> None:
    with pytest.raises(ConfigError, match="model: missing"):
        translate_config({"train_batch_size": 8})


def test_a_codec_list_of_the_wrong_length_is_refused_with_why() -> None:
    with pytest.raises(ConfigError, match="gradient_codec lists 2 codecs but the pipeline has 1 stage boundaries"):
        translate_config({**MINIMAL, "pipeline": {"stages": 2}, "codecs": {"gradient": ["int8", "int8"]}})


def test_a_file_that_is_not_json_says_where(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"train_batch_size": 8,,}')
    with pytest.raises(ConfigError, match="not valid JSON: .*line 1"):
        load_config(path)
    path.write_text(json.dumps(MINIMAL))
    assert load_config(os.fspath(path)).model == "examples.models:residual_mlp"
