"""DeepSpeed-style configs: batch-size arithmetic, DeepSpeed's keys as JobSpec fields, and every problem at once."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from schedulers.deepspeed.config import (
    MAX_CONFIG_BYTES,
    BatchSizes,
    ConfigError,
    TranslatedConfig,
    load_config,
    resolve_batch_sizes,
    translate_config,
)
from schedulers.jobs import CSVConfig, JobSpec, MixedPrecision, Monitoring, TensorBoardConfig, WandbConfig

pytestmark = pytest.mark.timeout(30)

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gpt_config.json"
DS_CONFIGS = Path(__file__).resolve().parent / "ds_configs"

MINIMAL: dict[str, Any] = {"train_batch_size": 8, "model": "examples.models:residual_mlp"}


def fields_of(spec: JobSpec, *names: str) -> tuple[Any, ...]:
    """The spec's fields by their flat names, whatever their sections."""
    return tuple(spec.get(name) for name in names)


def translate(config: dict[str, Any], **kwargs: Any) -> JobSpec:
    return translate_config(config, **kwargs).spec


def problems_of(config: dict[str, Any], **kwargs: Any) -> dict[str, str]:
    """Every problem translate_config reports, key -> message."""
    with pytest.raises(ConfigError) as info:
        translate_config(config, **kwargs)
    return {p.key: p.message for p in info.value.problems}


def notices_of(config: dict[str, Any], **kwargs: Any) -> dict[str, str]:
    notices = translate_config(config, **kwargs).notices
    return dict(line.split(": ", 1) for line in notices)  # type: ignore[misc]


# -- batch sizes --------------------------------------------------------------------------------


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


@pytest.mark.parametrize(("batch", "data_parallel", "expected", "resolved"), [
    # "auto" is filled from the other batch keys and the mesh, as the Hugging Face integration does
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2,
     (16, 4, 2), {"train_batch_size": "\"auto\" is 16 (train_batch_size 16 = micro 4 * accumulation 2 * "
                                      "data_parallel 2)"}),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4}, 1,
     (32, 8, 4), {"train_micro_batch_size_per_gpu": "\"auto\" is 8"}),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}, 2,
     (32, 4, 4), {"gradient_accumulation_steps": "\"auto\" is 4"}),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}, 1,
     (4, 4, 1), {"train_batch_size": "\"auto\" is 4", "gradient_accumulation_steps": "\"auto\" is 1"}),
])
def test_auto_batch_sizes_are_resolved_from_the_others_and_the_mesh(
    batch: dict[str, Any], data_parallel: int, expected: tuple[int, int, int], resolved: dict[str, str]
) -> None:
    config = {"model": "examples.models:residual_mlp", "data_parallel": data_parallel, **batch,
              "data": "examples.data:regression_batches"}
    result = translate_config(config)
    spec = result.spec
    assert (spec.training.data_kwargs["batch_size"], spec.parallelism.micro_batches) == (expected[0], expected[2])
    notices = dict(line.split(": ", 1) for line in result.notices)
    for key, text in resolved.items():
        assert notices[key].startswith(text)


def test_an_auto_batch_size_nothing_resolves_says_which_keys_would() -> None:
    found = problems_of({"model": "examples.models:residual_mlp", "train_batch_size": "auto",
                         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4})
    assert found == {"train_batch_size": (
        "\"auto\" cannot be resolved: give two of train_batch_size, train_micro_batch_size_per_gpu, "
        "gradient_accumulation_steps (in the job file, --job, or as arguments); \"auto\" is filled from them and "
        "data_parallel (1)")}


# -- the translation as a whole ------------------------------------------------------------------


def test_the_example_gpt_config_translates_to_a_valid_job() -> None:
    config = load_config(EXAMPLE)
    spec = config.spec
    assert isinstance(spec, JobSpec) and config.notices == ()
    assert spec.training.model == "examples.models:gpt" and spec.training.loss == "examples.models:lm_loss"
    assert spec.optimization.optimizer == ("torch.optim:AdamW", {"lr": 0.001, "weight_decay": 0.0})  # as FusedAdam
    assert spec.parallelism.pipeline_stages == 2 and spec.parallelism.schedule == "1f1b"
    assert spec.parallelism.micro_batches == 4  # gradient_accumulation_steps: the micro-batches of one step
    assert spec.training.data == "examples.data:char_batches"
    assert spec.training.data_kwargs["batch_size"] == 32  # train_batch_size, filled in for the factory
    assert spec.parallelism.partition_method == "parameters"
    # The validation split every 100 steps, its batches global batches too, with the next-character accuracy.
    assert spec.evaluation.eval_data_kwargs == {"context": 64, "split": "val", "seed": 0, "batch_size": 32}
    assert (spec.evaluation.eval_every, spec.evaluation.eval_metrics) == (100, "examples.models:token_accuracy")


def test_keys_the_file_leaves_out_take_the_specs_defaults() -> None:
    spec = translate(MINIMAL)
    defaults = JobSpec.of(model="examples.models:residual_mlp")
    assert spec.replace(micro_batches=defaults.parallelism.micro_batches) == defaults


def test_everything_a_config_can_say_reaches_train() -> None:
    config = {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "optimizer": {"type": "adam", "params": {"lr": 0.01, "betas": [0.9, 0.95], "torch_adam": True}},
        "training": {"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 8},
                     "loss": "torch.nn.functional:mse_loss",
                     "data": "examples.data:regression_batches", "data_kwargs": {"dim": 512}, "seed": 3},
        "parallelism": {"pipeline_stages": 2, "schedule": "interleaved", "partition_method": "uniform",
                        "virtual_stages": 2, "tensor_parallel": 1, "data_parallel": 2},
        "communication": {"activation_codec": "int8", "gradient_codec": ["int4", "fp16", "none"],
                          "reduce_codec": "int8", "error_feedback": True, "measure_codec_error": False,
                          "transport": "zmq", "overlap_reduce": False, "bucket_bytes": 1 << 20},
        "runtime": {"threads_per_stage": 2, "keep_freed_memory": False},
        "fault_tolerance": {"step_timeout_s": 30, "on_nonfinite": "skip"},
        "mixed_precision": {"precision": "bf16"},
        "evaluation": {"eval_data": "examples.data:regression_batches", "eval_data_kwargs": {"seed": 9},
                       "eval_every": 50, "eval_batches": 4},
        "w_batching": True,  # flat, beside the sections
    }
    spec = translate(config)
    p, c = spec.parallelism, spec.communication
    assert spec.optimization.optimizer == ("torch.optim:AdamW", {"lr": 0.01, "betas": [0.9, 0.95]})  # adam_w_mode
    assert (p.schedule, p.virtual_stages, p.partition_method, p.w_batching) == ("interleaved", 2, "uniform", True)
    assert (p.data_parallel, p.micro_batches, spec.training.data_kwargs["batch_size"]) == (2, 4, 16)
    assert c.gradient_codec == ["int4", "fp16", "none"] and c.reduce_codec == "int8"
    assert c.error_feedback and not c.measure_codec_error and not c.overlap_reduce and c.bucket_bytes == 1 << 20
    assert (spec.training.seed, spec.runtime.threads_per_stage, spec.fault_tolerance.step_timeout_s) == (3, 2, 30.0)
    assert (spec.runtime.keep_freed_memory, spec.fault_tolerance.on_nonfinite) == (False, "skip")
    assert spec.mixed_precision.precision == "bf16"
    # The validation data's batches are global batches too: train_batch_size is filled in for its factory.
    assert spec.evaluation.eval_data_kwargs == {"seed": 9, "batch_size": 16}
    assert (spec.evaluation.eval_every, spec.evaluation.eval_batches) == (50, 4)
    assert JobSpec.from_wire(spec.to_wire()) == spec


def test_a_job_file_in_the_specs_own_flat_names_trains_what_it_says(tmp_path: Path) -> None:
    """The case that trained one stage with the factory's default model: spec names in a job file are read."""
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 8, "gradient_accumulation_steps": 2}))
    (tmp_path / "job.json").write_text(json.dumps({
        "model": "examples.models:residual_mlp", "pipeline_stages": 2, "model_kwargs": {"blocks": 4, "dim": 8}}))
    result = load_config(tmp_path / "ds.json", job=tmp_path / "job.json")
    assert result.spec.parallelism.pipeline_stages == 2
    assert result.spec.training.model_kwargs == {"blocks": 4, "dim": 8}
    assert result.notices == ()
    # the same in sections, and as the call takes it
    sections = {"training": {"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 4, "dim": 8}},
                "parallelism": {"pipeline_stages": 2}}
    assert translate({"train_batch_size": 8, "gradient_accumulation_steps": 2}, job=sections) == result.spec
    assert result.spec == JobSpec.of(model="examples.models:residual_mlp", model_kwargs={"blocks": 4, "dim": 8},
                                     pipeline_stages=2, micro_batches=2)
    # the job's own saves, as torchtitan's [checkpoint] section: a section of the job file
    saving = {**sections, "checkpointing": {"checkpoint_dir": "runs/gpt", "checkpoint_every": 500}}
    assert translate({"train_batch_size": 8, "gradient_accumulation_steps": 2}, job=saving).checkpointing == \
        result.spec.checkpointing.__class__(checkpoint_dir="runs/gpt", checkpoint_every=500)


@pytest.mark.parametrize(("job", "key", "message"), [
    ({"pipline_stages": 2}, "pipline_stages", "unknown key; did you mean pipeline_stages?"),
    ({"mesh_shape": [2, 2]}, "mesh_shape", "unknown key; actorpipe's keys are the spec's sections and fields"),
    ({"parallelism": {"pipeline_stage": 2}}, "parallelism.pipeline_stage", "did you mean parallelism.pipeline_stages"),
    ({"parallelism": {"seed": 2}}, "parallelism.seed", "seed belongs in training"),
    ({"parallelism": 2}, "parallelism", "expected an object of Parallelism fields"),
    ({"pipeline": {"schedule": "gpipe"}}, "pipeline.schedule",
     "not a key of DeepSpeed's pipeline block; actorpipe's is parallelism.schedule"),
    ({"model": {"factory": "examples.models:gpt"}}, "training.model", "its keyword arguments go beside it"),
    ({"data": {"factory": "examples.data:char_batches"}}, "training.data", "go beside it, as data_kwargs"),
    ({"eval_data": {"factory": "examples.data:char_batches"}}, "evaluation.eval_data",
     "go beside it, as eval_data_kwargs"),
    ({"evaluation": {"eval_data": "examples.data:char_batches", "eval_data_kwargs": {"batch_size": 3}}},
     "evaluation.eval_data_kwargs.batch_size", "expected 8 (train_batch_size"),
    ({"codecs": {"activation": "int8"}}, "codecs", "not a key any more: its keys are now "
                                                   "communication.activation_codec"),
    ({"seed": 1, "training": {"seed": 2}}, "seed", "given twice, flat and as training.seed; give it once"),
])
def test_actorpipes_keys_are_strict_and_name_the_nearest(job: dict[str, Any], key: str, message: str) -> None:
    found = problems_of(MINIMAL, job=job)
    assert key in found and message in found[key], found


def test_the_job_files_former_blocks_are_refused_even_in_the_deepspeed_file_naming_what_replaced_them() -> None:
    found = problems_of({**MINIMAL, "mesh": {"data_parallel": 2}})
    assert found == {"mesh": "not a key any more: its keys are now parallelism.tensor_parallel and "
                             "parallelism.data_parallel (or flat at the top)"}


def test_an_unknown_key_in_the_deepspeed_file_is_a_notice_but_in_the_job_file_an_error() -> None:
    notices = notices_of({**MINIMAL, "cuda_visible_devices": "0"})
    assert "not a DeepSpeed or actorpipe key: ignored" in notices["cuda_visible_devices"]
    assert "cuda_visible_devices" in problems_of(MINIMAL, job={"cuda_visible_devices": "0"})
    assert "cuda_visible_devices" in problems_of(MINIMAL, cuda_visible_devices="0")


def test_a_name_both_deepspeed_and_the_spec_use_is_deepspeeds_block_as_an_object_and_the_field_otherwise() -> None:
    spec = translate({**MINIMAL, "optimizer": ["torch.optim:Adam", {"lr": 0.1}], "tensor_parallel": 1,
                      "activation_checkpointing": 2})
    assert (spec.optimization.optimizer, spec.runtime.activation_checkpointing) == (("torch.optim:Adam", {"lr": 0.1}), 2)
    spec = translate({**MINIMAL, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                      "tensor_parallel": {"autotp_size": 1}, "activation_checkpointing": {}})
    assert (spec.optimization.optimizer, spec.runtime.activation_checkpointing) == (("torch.optim:SGD", {"lr": 0.1}), True)


def test_everything_deepspeed_can_say_reaches_the_spec() -> None:
    config = {
        **MINIMAL, "pipeline": {"stages": 2, "partition": "type:Linear", "activation_checkpoint_interval": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 8, "loss_scale_window": 50,
                 "hysteresis": 3, "min_loss_scale": 0.5},
        "gradient_clipping": 0.5, "zero_optimization": {"stage": 1},
        "communication_data_type": "bf16", "tensor_parallel": {"autotp_size": 2},
    }
    spec = translate(config)
    assert spec.mixed_precision == MixedPrecision(precision="fp16", loss_scale=128.0, initial_scale_power=8,
                                                  loss_scale_window=50, hysteresis=3, min_loss_scale=0.5)
    assert fields_of(spec, "gradient_clipping", "zero_stage", "activation_checkpointing") == (0.5, 1, 2)
    assert spec.optimization.lr_scheduler == ("stages.state.lr:WarmupLR", {"warmup_num_steps": 10})
    assert fields_of(spec, "partition_method", "reduce_codec", "tensor_parallel") == ("type:Linear", "bf16", 2)


def test_bf16_skips_a_step_with_an_overflow_as_deepspeed_does() -> None:
    assert translate({**MINIMAL, "bf16": {"enabled": True}}).fault_tolerance.on_nonfinite == "skip"
    result = translate_config({**MINIMAL, "bfloat16": {"enabled": True, "check_grad_overflow": False}})
    assert (result.spec.mixed_precision.precision, result.spec.fault_tolerance.on_nonfinite) == ("bf16", "raise")
    assert "bfloat16: the old name of bf16: read as bf16" in result.notices


@pytest.mark.parametrize("autocast", [{"enabled": True, "dtype": "torch.bfloat16"}, {"enabled": True}])
def test_torch_autocast_is_the_precision(autocast: dict[str, Any]) -> None:
    assert translate({**MINIMAL, "torch_autocast": autocast}).mixed_precision.precision == "bf16"
    fp16 = translate({**MINIMAL, "torch_autocast": {"enabled": True, "dtype": "fp16"}})
    assert fp16.mixed_precision.precision == "fp16"


# -- hjson, two files, arguments ---------------------------------------------------------------------


def test_files_are_read_as_deepspeed_reads_them_hjson(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text("""
        // a comment, as DeepSpeed (hjson) allows
        {
          # another
          "train_batch_size": 8,
          /* and a block */
          model: "examples.models:residual_mlp",   // unquoted key
          "optimizer": {"type": "SGD", "params": {"lr": 0.1,},},
          "fp16": {"enabled": false,},
        }
    """)
    assert load_config(path).spec.optimization.optimizer == ("torch.optim:SGD", {"lr": 0.1})


@pytest.mark.parametrize(("text", "message"), [
    ('{"train_batch_size": 8,,}', "not valid JSON or hjson: .*line 1"),
    ('{"train_batch_size": 8, "train_batch_size": 16}', "the key 'train_batch_size' is given twice in one object"),
    ("[1, 2]", "must be an object of config keys, got list"),
    ("[" * 5000 + "]" * 5000, "nested too deeply|not valid JSON"),
])
def test_a_file_that_cannot_be_read_says_where(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_huge_file_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "huge.json"
    path.write_text(" " * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match="larger than"):
        load_config(path)


def test_two_files_make_the_same_job_as_one(tmp_path: Path) -> None:
    ds = {"train_batch_size": 16, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "fp16": {"enabled": True}}
    job = {"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 4},
           "parallelism": {"pipeline_stages": 2}, "data": "examples.data:regression_batches"}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    (tmp_path / "job.json").write_text(json.dumps(job))
    one = translate({**ds, **job})
    assert load_config(tmp_path / "ds.json", job=tmp_path / "job.json").spec == one
    assert load_config(tmp_path / "ds.json", job=os.fspath(tmp_path / "job.json")).spec == one
    assert load_config(tmp_path / "ds.json", job=job).spec == one
    assert load_config(tmp_path / "ds.json", **job).spec == one
    assert translate(ds, job=job) == one


def test_the_job_part_and_arguments_merge_over_the_file_with_a_notice() -> None:
    ds = {"train_batch_size": 16, "pipeline": {"stages": 4, "partition": "uniform"},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
    job = {"model": "examples.models:residual_mlp", "pipeline": {"stages": 2}, "optimizer": {"params": {"lr": 3e-4}}}
    result = translate_config(ds, job=job, model_kwargs={"blocks": 4}, training={"seed": 7})
    spec = result.spec
    assert fields_of(spec, "pipeline_stages", "partition_method", "seed") == (2, "uniform", 7)
    assert spec.optimization.optimizer == ("torch.optim:AdamW", {"lr": 3e-4, "weight_decay": 0.1})
    assert spec.training.model_kwargs == {"blocks": 4}
    assert "pipeline.stages: 2 from the job config replaces 4 from the config" in result.notices
    assert "optimizer.params.lr: 0.0003 from the job config replaces 0.001 from the config" in result.notices
    # an optimizer of another type replaces the whole block: its params belong to the type
    other = translate(ds, job={**job, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert other.optimization.optimizer == ("torch.optim:SGD", {"lr": 0.1})


def test_a_job_file_resolves_the_autos_of_a_hugging_face_style_config() -> None:
    result = load_config(DS_CONFIGS / "hf_trainer_zero1.json", job=DS_CONFIGS / "hf_trainer_job.json")
    spec = result.spec
    assert fields_of(spec, "micro_batches", "data_parallel") == (2, 2) and spec.training.data_kwargs["batch_size"] == 16
    assert spec.optimization.optimizer == ("torch.optim:AdamW", {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                    "weight_decay": 0.0})
    assert spec.optimization.lr_scheduler == ("stages.state.lr:WarmupDecayLR", {
        "warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 50, "total_num_steps": 1000})
    assert fields_of(spec, "precision", "gradient_clipping", "zero_stage") == ("fp16", 1.0, 1)
    notices = dict(line.split(": ", 1) for line in result.notices)
    assert notices["gradient_clipping"].startswith("\"auto\" is 1.0, the Hugging Face Trainer's default")
    assert notices["bf16.enabled"].startswith("\"auto\" is false")
    # without the job file, every "auto" nothing resolves is listed, with what would resolve it
    with pytest.raises(ConfigError) as info:
        load_config(DS_CONFIGS / "hf_trainer_zero1.json", model="examples.models:residual_mlp")
    assert [p.key for p in info.value.problems] == [
        "train_batch_size", "optimizer.params.lr", "scheduler.params.warmup_num_steps",
        "scheduler.params.total_num_steps"]
    assert "give the learning rate as optimizer.params.lr in the job file (--job)" in str(info.value)


@pytest.mark.parametrize("ds", ["gpt2_fp16_zero1.json", "pipeline_alexnet.json"])
def test_deepspeed_examples_style_configs_run_without_edits(ds: str) -> None:
    """fp16 + WarmupLR + clipping + ZeRO-1 (and DeepSpeed's own pipeline keys) translate as they are."""
    before = (DS_CONFIGS / ds).read_bytes()
    result = load_config(DS_CONFIGS / ds, job=DS_CONFIGS / "gpt2_job.json")
    assert (DS_CONFIGS / ds).read_bytes() == before
    spec = result.spec
    assert isinstance(spec, JobSpec) and fields_of(spec, "model", "pipeline_stages") == ("examples.models:gpt", 2)
    if ds == "gpt2_fp16_zero1.json":
        assert spec.optimization.optimizer == ("torch.optim:AdamW", {"lr": 1.5e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": 0.01})
        assert spec.optimization.lr_scheduler == ("stages.state.lr:WarmupLR", {"warmup_min_lr": 0,
                                                                            "warmup_max_lr": 1.5e-4,
                                                            "warmup_num_steps": 100, "warmup_type": "linear"})
        assert fields_of(spec, "precision", "loss_scale", "initial_scale_power", "loss_scale_window") == \
            ("fp16", 0.0, 12, 500)
        assert fields_of(spec, "gradient_clipping", "zero_stage", "activation_checkpointing") == (1.0, 1, True)
        assert (spec.parallelism.micro_batches, spec.training.data_kwargs["batch_size"]) == (8, 32)
        assert spec.monitoring == Monitoring(tensorboard=TensorBoardConfig(output_path="runs/", job_name="gpt2"))
    else:
        assert fields_of(spec, "partition_method", "activation_checkpointing", "micro_batches") == ("type:Linear", 1, 32)
        assert "cuda_visible_devices: not a DeepSpeed or actorpipe key: ignored" in "\n".join(result.notices)
    assert JobSpec.from_wire(spec.to_wire()) == spec


# -- optimizers and schedules ----------------------------------------------------------------------


@pytest.mark.parametrize(("optimizer", "expected"), [
    ({"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1}}, ("torch.optim:AdamW", {"lr": 1e-3, "weight_decay": 0.1})),
    ({"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, ("torch.optim:Adam", {"weight_decay": 0.1})),
    # DeepSpeed's fused (and CPU) Adam decays nothing unless asked; its torch_adam path is torch's AdamW, 0.01
    ({"type": "Adam", "params": {"torch_adam": True, "bias_correction": True}}, ("torch.optim:AdamW", {})),
    # the name decides, as in DeepSpeed
    ({"type": "AdamW", "params": {"adam_w_mode": False}}, ("torch.optim:AdamW", {"weight_decay": 0.0})),
    ({"type": "AdamW"}, ("torch.optim:AdamW", {"weight_decay": 0.0})),
    ({"type": "Adam", "params": {"adam_w_mode": False}}, ("torch.optim:Adam", {"weight_decay": 0.0})),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, ("torch.optim:SGD", {"lr": 0.1, "momentum": 0.9})),
    ({"type": "Adagrad", "params": {"lr": 0.01}}, ("torch.optim:Adagrad", {"lr": 0.01})),
    ({"type": "RMSprop", "params": {"alpha": 0.9}}, ("torch.optim:RMSprop", {"alpha": 0.9})),
    ({"type": "Adamax"}, ("torch.optim:Adamax", {})),
    ({"type": "MuAdam", "params": {"lr": 1e-3}}, ("mup:MuAdam", {"lr": 1e-3})),
    ({"type": "MuAdamW"}, ("mup:MuAdamW", {})),
    ({"type": "MuSGD", "params": {"lr": 0.1}}, ("mup:MuSGD", {"lr": 0.1})),
    ({"type": "torch.optim:ASGD", "params": {"lr": 0.1}}, ("torch.optim:ASGD", {"lr": 0.1})),
    ({"type": "mypkg.optim:Lamb", "params": {"lr": 0.1, "anything": 1}}, ("mypkg.optim:Lamb", {"lr": 0.1, "anything": 1})),
])
def test_optimizer_types_mean_what_they_mean_to_deepspeed(optimizer: dict[str, Any], expected: tuple[str, Any]) -> None:
    assert translate({**MINIMAL, "optimizer": optimizer}).optimization.optimizer == expected


@pytest.mark.parametrize(("optimizer", "expected"), [
    ({"type": "AdamW8bit", "params": {"lr": 1e-3}}, ("torch.optim:AdamW", "int8")),
    ({"type": "Adam8bit", "params": {"adam_w_mode": False}}, ("torch.optim:Adam", "int8")),
    ({"type": "AdamW4bit"}, ("torch.optim:AdamW", "int4")),
    ({"type": "Adam", "params": {"fp32_optimizer_states": False}}, ("torch.optim:AdamW", "bf16")),
    ({"type": "Adam", "params": {"fp32_optimizer_states": True}}, ("torch.optim:AdamW", "fp32")),
])
def test_low_bit_adam_types_and_deepspeeds_state_dtype_hold_the_moments_in_fewer_bits(
        optimizer: dict[str, Any], expected: tuple[str, str]) -> None:
    optimization = translate({**MINIMAL, "optimizer": optimizer}).optimization
    assert (optimization.optimizer[0], optimization.optimizer_states) == expected


def test_a_low_bit_type_and_a_contrary_optimizer_states_are_a_problem() -> None:
    with pytest.raises(ConfigError, match="optimizer_states"):
        translate({**MINIMAL, "optimizer": {"type": "AdamW8bit"}, "optimizer_states": "int4"})


@pytest.mark.parametrize(("kind", "why"), [
    ("Lamb", "torch has no LAMB optimizer"),
    ("OneBitAdam", "1-bit Adam compresses DeepSpeed's own gradient all-reduce"),
    ("OneBitLamb", "1-bit LAMB compresses"),
    ("ZeroOneAdam", "0/1 Adam compresses"),
    ("Lion", "torch has no Lion optimizer"),
    ("Muon", "MuonWithAuxAdam"),
    ("LBFGS", "closure"),
])
def test_deepspeed_optimizers_without_a_torch_equivalent_are_refused_with_why(kind: str, why: str) -> None:
    found = problems_of({**MINIMAL, "optimizer": {"type": kind, "params": {"lr": 1e-3}}})
    assert list(found) == ["optimizer.type"]
    assert found["optimizer.type"].startswith(f"{kind} is not available here: ") and why in found["optimizer.type"]
    assert "AdamW" in found["optimizer.type"]


@pytest.mark.parametrize(("params", "key", "message"), [
    ({"momentum": 0.9}, "optimizer.params.momentum", "not a parameter of torch.optim:AdamW; it takes lr, betas"),
    ({"weight_decy": 0.1}, "optimizer.params.weight_decy", "did you mean optimizer.params.weight_decay?"),
    ({"betas": [1.5, 0.9]}, "optimizer.params",
     "torch.optim:AdamW refuses {'betas': [1.5, 0.9], 'weight_decay': 0.0}: Invalid beta"),
    ({"lr": -1}, "optimizer.params", "Invalid learning rate"),
    ({"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm", "clip with the top-level \"gradient_clipping\""),
    ({"bias_correction": False}, "optimizer.params.bias_correction", "always correct the moments' bias"),
    ({"lr": "auto"}, "optimizer.params.lr", "give the learning rate as optimizer.params.lr"),
])
def test_optimizer_params_are_checked_against_the_class_before_submit(params: dict[str, Any], key: str,
                                                                      message: str) -> None:
    found = problems_of({**MINIMAL, "optimizer": {"type": "Adam", "params": params}})
    assert key in found and message in found[key]


def test_auto_optimizer_params_other_than_the_learning_rate_are_the_trainers_defaults() -> None:
    result = translate_config({**MINIMAL, "optimizer": {"type": "AdamW", "params": {
        "lr": 1e-3, "betas": "auto", "eps": "auto", "weight_decay": "auto"}}})
    assert result.spec.optimization.optimizer == ("torch.optim:AdamW", {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                           "weight_decay": 0.0})
    assert sum("the Hugging Face Trainer's default" in line for line in result.notices) == 3


@pytest.mark.parametrize(("scheduler", "expected"), [
    ({"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 100,
                                     "warmup_type": "log", "last_batch_iteration": -1}},
     ("stages.state.lr:WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 100,
                             "warmup_type": "log", "last_batch_iteration": -1})),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, "warmup_max_lr": 1e-3, "warmup_type": "linear"}},
     ("stages.state.lr:WarmupDecayLR", {"total_num_steps": 1000, "warmup_max_lr": 1e-3, "warmup_type": "linear"})),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 1000, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01,
                                           "warmup_num_steps": 10}},
     ("stages.state.lr:WarmupCosineLR", {"total_num_steps": 1000, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01,
                                   "warmup_num_steps": 10})),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 100,
                                     "cycle_second_step_size": None, "decay_lr_rate": 0.1, "cycle_momentum": False}},
     ("stages.state.lr:OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 100,
                             "cycle_second_step_size": None, "decay_lr_rate": 0.1, "cycle_momentum": False})),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
     ("stages.state.lr:WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05})),  # the optimizer's lr, as HF fills it
    # Found by review: rates per parameter group, which DeepSpeed's WarmupLR takes (and so do ours), were refused.
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_min_lr": [0.0, 0.0],
                                          "warmup_max_lr": [0.01, 0.02]}},
     ("stages.state.lr:WarmupDecayLR", {"total_num_steps": 10, "warmup_min_lr": [0.0, 0.0],
                                        "warmup_max_lr": [0.01, 0.02]})),
    ({"type": "StepLR", "params": {"step_size": 10, "gamma": 0.5}},
     ("torch.optim.lr_scheduler:StepLR", {"step_size": 10, "gamma": 0.5})),
    ({"type": "torch.optim.lr_scheduler:CosineAnnealingLR", "params": {"T_max": 100}},
     ("torch.optim.lr_scheduler:CosineAnnealingLR", {"T_max": 100})),
])
def test_scheduler_types_take_deepspeeds_params_unchanged(scheduler: dict[str, Any], expected: tuple[str, Any]) -> None:
    config = {**MINIMAL, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "scheduler": scheduler}
    assert translate(config).optimization.lr_scheduler == expected


@pytest.mark.parametrize(("scheduler", "key", "message"), [
    ({"type": "LRRangeTest"}, "scheduler.type", "LRRangeTest is not available here: a learning-rate range test"),
    ({"type": "ReduceLROnPlateau"}, "scheduler.type", "steps on a validation metric"),
    ({"type": "WarmupLr2"}, "scheduler.type", "unknown schedule 'WarmupLr2' (did you mean WarmupLR?)"),
    ({"type": "WarmupLR", "params": {"warmup_num_step": 10}}, "scheduler.params.warmup_num_step",
     "did you mean scheduler.params.warmup_num_steps?"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": -1}}, "scheduler.params.warmup_num_steps",
     "expected an integer >= 0 for DeepSpeed's WarmupLR, got -1"),
    ({"type": "WarmupDecayLR", "params": {}}, "scheduler.params.total_num_steps",
     "missing: DeepSpeed's WarmupDecayLR needs it"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}, "scheduler.params.cycle_max_lr", "missing"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}, "scheduler.params.total_num_steps",
     "give the number of optimizer steps the run will take as scheduler.params.total_num_steps in the job file"),
    ({"type": "CosineAnnealingLR"}, "scheduler.params", "torch.optim.lr_scheduler:CosineAnnealingLR refuses {}"),
    ({"type": "StepLR", "params": {"step": 3}}, "scheduler.params.step", "did you mean scheduler.params.step_size?"),
    # Found by review: passed here, then every stage refused it as the job started.
    ({"type": "WarmupLR", "params": {"last_batch_iteration": 4}}, "scheduler.params.last_batch_iteration",
     "4: a schedule here starts at -1 (the default), and a resumed job takes its schedule's position from the "
     "checkpoint"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, "x"]}}, "scheduler.params.warmup_max_lr",
     "expected a number >= 0, or a list of one per parameter group"),
])
def test_a_wrong_schedule_is_refused_naming_the_key(scheduler: dict[str, Any], key: str, message: str) -> None:
    found = problems_of({**MINIMAL, "scheduler": scheduler})
    assert key in found and message in found[key], found


def test_an_unknown_warmup_type_falls_back_to_log_as_in_deepspeed() -> None:
    result = translate_config({**MINIMAL, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})
    assert result.spec.optimization.lr_scheduler == ("stages.state.lr:WarmupLR", {"warmup_type": "log"})
    assert "DeepSpeed falls back to log" in "\n".join(result.notices)


# -- switched off, no effect, refused --------------------------------------------------------------


def test_blocks_present_but_switched_off_are_accepted_as_they_are() -> None:
    config = {
        **MINIMAL,
        "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16},
        "bf16": {"enabled": False},
        "amp": {"enabled": False, "opt_level": "O1"},
        "torch_autocast": {"enabled": False, "dtype": "torch.float16"},
        "zero_optimization": {"stage": 0, "overlap_comm": True, "reduce_bucket_size": 5e8},
        "gradient_clipping": 0,
        "progressive_layer_drop": {"enabled": False, "theta": 0.5},
        "tensorboard": {"enabled": False},
        "flops_profiler": {"enabled": False},
        "elasticity": {"enabled": False},
    }
    result = translate_config(config)
    assert result.notices == ()
    assert result.spec == translate(MINIMAL)


@pytest.mark.parametrize(("key", "value", "text"), [
    ("steps_per_print", 10, "no effect here: DeepSpeed's log interval"),
    ("wall_clock_breakdown", True, "no effect here: DeepSpeed's timers"),
    ("dump_state", False, "no effect here"),
    ("prescale_gradients", False, "no effect here"),
    ("comet", {"enabled": True, "project": "p"}, "no effect here: Comet is not written"),
    ("flops_profiler", {"enabled": True, "profile_step": 1}, "no effect here: DeepSpeed's FLOPs profiler"),
    ("comms_logger", {"enabled": True}, "no effect here: DeepSpeed's communication log"),
    ("zero_allow_untested_optimizer", True, "no effect here: ZeRO-1 shards any torch optimizer's state"),
    ("checkpoint", {"tag_validation": "Warn"}, "no effect here"),
    ("aio", {"block_size": 1048576}, "no effect here"),
])
def test_keys_that_tune_deepspeeds_machinery_are_accepted_with_a_notice(key: str, value: Any, text: str) -> None:
    assert notices_of({**MINIMAL, key: value})[key].startswith(text)


# -- monitors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("blocks", "expected"), [
    ({"tensorboard": {"enabled": True, "output_path": "output/ds_logs/", "job_name": "train_bert"}},
     Monitoring(tensorboard=TensorBoardConfig(output_path="output/ds_logs/", job_name="train_bert"))),
    ({"tensorboard": {"enabled": True}},  # DeepSpeed's defaults: output_path "", job_name DeepSpeedJobName
     Monitoring(tensorboard=TensorBoardConfig(output_path="", job_name="DeepSpeedJobName"))),
    ({"wandb": {"enabled": True, "team": "my_team", "group": "my_group", "project": "my_project"}},
     Monitoring(wandb=WandbConfig(project="my_project", group="my_group", team="my_team"))),
    ({"wandb": {"enabled": True}}, Monitoring(wandb=WandbConfig(project="deepspeed"))),
    ({"csv_monitor": {"enabled": True, "output_path": "logs", "job_name": "csv"}},
     Monitoring(csv_monitor=CSVConfig(output_path="logs", job_name="csv"))),
    ({"tensorboard": {"enabled": False, "output_path": "runs"}, "wandb": {"project": "p"}}, Monitoring()),
    ({"monitoring": {"tensorboard": {"output_path": "runs"}}},  # the spec's own form, in a job file
     Monitoring(tensorboard=TensorBoardConfig(output_path="runs"))),
])
def test_deepspeeds_monitor_blocks_become_the_jobs_monitors(blocks: dict[str, Any], expected: Monitoring) -> None:
    result = translate_config({**MINIMAL, **blocks})
    assert result.spec.monitoring == expected
    on = [key for key, block in blocks.items() if key != "monitoring" and block.get("enabled")]
    assert [line.split(":")[0] for line in result.notices] == on  # each says how it differs: names, axis, paths
    assert all("Train/Samples/train_loss" in line for line in result.notices)
    assert JobSpec.from_wire(result.spec.to_wire()) == result.spec


@pytest.mark.parametrize(("blocks", "key", "message"), [
    ({"tensorboard": {"enabled": True, "output": "runs"}}, "tensorboard.output",
     "unknown key; did you mean tensorboard.output_path?"),
    ({"wandb": {"enabled": True, "entity": "t"}}, "wandb.entity", "unknown key"),
    ({"csv_monitor": {"enabled": "yes"}}, "csv_monitor.enabled", "expected true or false"),
    ({"tensorboard": {"enabled": True, "job_name": "a/b"}}, "tensorboard", "tensorboard.job_name must be 1 to 128"),
    ({"wandb": {"enabled": True, "project": 7}}, "wandb", "wandb.project must be a string"),
    ({"monitoring": {"csv_monitor": {"path": "x"}}}, "monitoring.csv_monitor",
     "monitoring.csv_monitor has no key 'path'"),
])
def test_a_wrong_monitor_block_is_refused_naming_the_key(blocks: dict[str, Any], key: str, message: str) -> None:
    found = problems_of({**MINIMAL, **blocks})
    assert key in found and message in found[key], found


@pytest.mark.parametrize(("block", "key", "text"), [
    ({"zero_optimization": {"stage": 1, "overlap_comm": True}}, "zero_optimization.overlap_comm", "no effect here"),
    ({"zero_optimization": {"stage": 1, "contiguous_gradients": True}}, "zero_optimization.contiguous_gradients",
     "no effect here"),
    ({"zero_optimization": {"stage": 1, "reduce_scatter": True}}, "zero_optimization.reduce_scatter", "no effect"),
    ({"zero_optimization": {"stage": 1, "allgather_partitions": True}}, "zero_optimization.allgather_partitions",
     "no effect here"),
    ({"zero_optimization": {"stage": 1, "allgather_bucket_size": 5e8}}, "zero_optimization.allgather_bucket_size",
     "no effect here"),
    ({"zero_optimization": {"stage": 1, "cpu_offload": True}}, "zero_optimization.cpu_offload",
     "no effect here: optimizer state stays on each stage's device"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer", "no effect here: optimizer state stays on each stage's device"),
    ({"zero_optimization": True}, "zero_optimization", "the old true/false form: stage 1"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads",
     "master weights and gradients stay float32 here"),
    ({"fp16": {"enabled": True, "auto_cast": False}}, "fp16.auto_cast", "inputs are not cast ahead"),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, "fp16.consecutive_hysteresis", "not built here"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16.immediate_grad_update", "no effect here"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads",
     "stay float32 here"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype", "gradients accumulate in float32"),
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing",
     "here every stage checkpoints each layer"),
    ({"activation_checkpointing": {"cpu_checkpointing": True}}, "activation_checkpointing.cpu_checkpointing",
     "no effect here"),
    ({"pipeline": {"seed_layers": True}}, "pipeline.seed_layers",
     "a model returned whole is built by every stage from one"),
    ({"pipeline": {"partition": "best"}}, "pipeline.partition", "partitioned by parameters"),
    ({"pipeline": {"pipe_partitioned": True, "grad_partitioned": True}}, "pipeline.grad_partitioned", "no effect"),
    ({"tensor_parallel": {"autotp_size": 1, "tp_overlap_comm": True}}, "tensor_parallel.tp_overlap_comm", "no effect"),
    ({"cuda_visible_devices": 0}, "cuda_visible_devices", "not a DeepSpeed or actorpipe key: ignored"),
    ({"gradient_checkpointing": True}, "gradient_checkpointing",
     "ignored, as DeepSpeed ignores keys it does not know (Hugging Face's name for activation checkpointing"),
])
def test_deepspeed_sub_keys_are_honoured_or_say_what_happens_instead(block: dict[str, Any], key: str,
                                                                      text: str) -> None:
    assert text in notices_of({**MINIMAL, **block})[key]


def test_a_config_can_let_the_job_choose_its_schedule_within_a_stash_limit() -> None:
    spec = translate({**MINIMAL, "pipeline": {"stages": 2}, "schedule": "auto", "max_stash_bytes": 1 << 28})
    assert (spec.parallelism.schedule, spec.parallelism.max_stash_bytes) == ("auto", 1 << 28)
    assert "parallelism.max_stash_bytes" in problems_of({**MINIMAL, "parallelism": {"schedule": "auto",
                                                                                    "max_stash_bytes": 0}})


def test_activation_checkpointing_is_an_interval_or_every_layer() -> None:
    every = {n: translate({**MINIMAL, "pipeline": {"activation_checkpoint_interval": n}}) for n in (3, 0)}
    assert every[3].runtime.activation_checkpointing == 3
    assert every[0].runtime.activation_checkpointing is False
    assert translate({**MINIMAL, "activation_checkpointing": {}}).runtime.activation_checkpointing is True
    off = translate_config({**MINIMAL, "activation_checkpointing": {}, "pipeline": {"activation_checkpoint_interval": 0}})
    assert off.spec.runtime.activation_checkpointing is False
    assert "activation_checkpointing: checkpointing is off" in off.notices[0]


@pytest.mark.parametrize(("change", "key", "message"), [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled",
     "fp16.enabled is true too, and a job computes in one precision"),
    ({"zero_optimization": {"stage": 3}, "pipeline": {"stages": 4}}, "zero_optimization.stage",
     "ZeRO-3 is not built: a pipeline stage holds its parameters whole"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "expected an integer <= 3, got 4"),
    ({"zero_optimization": {"stgae": 1}}, "zero_optimization.stgae", "did you mean zero_optimization.stage?"),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled", "expected true or false"),
    ({"fp16": {"enabled": True, "initial_scale_power": 100}}, "fp16.initial_scale_power", "<= 64"),
    ({"fp16": {"enabled": True, "loss_scale_windows": 10}}, "fp16.loss_scale_windows",
     "did you mean fp16.loss_scale_window?"),
    ({"amp": {"enabled": True, "opt_level": "O2"}}, "amp", "NVIDIA Apex AMP is not used here"),
    ({"torch_autocast": {"enabled": True, "dtype": "int8"}}, "torch_autocast.dtype", "expected torch.bfloat16"),
    ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention", "not supported here: DeepSpeed's block-sparse"),
    ({"progressive_layer_drop": {"enabled": True}}, "progressive_layer_drop", "not supported here"),
    ({"elasticity": {"enabled": True}}, "elasticity", "not supported here: elastic training"),
    ({"gradient_clipping": -1}, "gradient_clipping", "expected a number >= 0"),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op", "replicas average their gradients"),
    ({"communication_data_type": "int8"}, "communication_data_type", "expected fp32, fp16 or bf16"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size", "sequence parallelism is not built here"),
    ({"tensor_parallel": {"autotp_size": 2}, "parallelism": {"tensor_parallel": 4}}, "tensor_parallel.autotp_size",
     "says tensor_parallel=2, but parallelism.tensor_parallel says 4"),
    ({"pipeline": {"partition": "parameters"}, "partition_method": "uniform"}, "pipeline.partition",
     "says partition_method='parameters', but parallelism.partition_method says 'uniform'"),
    ({"pipeline": {"activation_checkpoint_interval": -1}}, "pipeline.activation_checkpoint_interval", ">= 0"),
    ({"activation_checkpointing": {"partition_activation": True}}, "activation_checkpointing.partition_activation",
     "did you mean activation_checkpointing.partition_activations?"),
    ({"train_batch_sise": 8}, "train_batch_sise", "did you mean train_batch_size"),
    ({"optimiser": {"type": "SGD"}}, "optimiser", "unknown key; did you mean optimizer?"),
    ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation", "false is not available"),
    ({"optimizer": {"type": "torch.optim:Adamm"}}, "optimizer.type", "torch.optim has no class 'Adamm'"),
    ({"pipeline": {"stages": 2, "seed_layer": True}}, "pipeline.seed_layer", "did you mean pipeline.seed_layers"),
    ({"parallelism": {"shedule": "1f1b"}}, "parallelism.shedule", "did you mean parallelism.schedule"),
    ({"schedule": "2f2b"}, "parallelism.schedule", "expected one of gpipe, 1f1b"),
    ({"partition_method": "typo:Linear"}, "parallelism.partition_method", "parameters, uniform"),
    ({"parallelism": {"partition_method": "type:("}}, "parallelism.partition_method", "not a regular expression"),
    ({"split_points": "transformer.h.2"}, "parallelism.split_points", "a list of module names"),
    ({"pipeline": {"stages": 0}}, "pipeline.stages", "expected an integer >= 1, got 0"),
    ({"optimizer": {"type": "Lio"}}, "optimizer.type", "unknown optimizer 'Lio'"),
    ({"optimizer": {"type": "SGD", "param": {}}}, "optimizer.param", "did you mean optimizer.params"),
    ({"activation_codec": "int9"}, "communication.activation_codec", "expected a codec name"),
    ({"model": "examples.models"}, "training.model", "expected an import path"),
    ({"data": "examples.data:char_batches", "data_kwargs": {"batch_size": 4}},
     "training.data_kwargs.batch_size", "expected 8 (train_batch_size"),
    ({"step_timeout_s": -1}, "fault_tolerance.step_timeout_s", "> 0"),
    ({"communication": {"transport": "carrier-pigeon"}}, "communication.transport", "expected one of zmq, dist"),
    ({"seed": "0"}, "training.seed", "expected an integer"),
    ({"max_restarts": -1}, "fault_tolerance.max_restarts", "must be an int >= 0"),
    ({"pipeline": {"stages": 2}, "communication": {"gradient_codec": ["int8", "int8"]}},
     "communication.gradient_codec", "gradient_codec lists 2 codecs but the pipeline has 1 stage boundaries"),
])
def test_a_wrong_key_or_value_is_an_error_that_names_it(change: dict[str, Any], key: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        translate_config({**MINIMAL, **change})
    assert info.value.key == key
    assert message in str(info.value)


def test_everything_wrong_in_a_file_is_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text("""{
        "train_batch_size": 30, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
        "model": "examples.models:residual_mlp",
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
        "fp16": {"enabled": true}, "bf16": {"enabled": true},
        "zero_optimization": {"stage": 3, "overlap_comm": true},
        "pipeline": {"stages": 2},
    }""")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [p.key for p in info.value.problems] == [
        "bf16.enabled", "zero_optimization.stage", "train_batch_size", "optimizer.type"]
    text = str(info.value)
    assert text.startswith(f"4 problems in {path}:\n  bf16.enabled: fp16.enabled is true too")
    assert "\n  train_batch_size: expected 32" in text and "\n  optimizer.type: Lamb is not available" in text
    # docs/deepspeed.md shows this very report: it must be what the reader says (it once showed ZeRO-2
    # refused with pipeline stages after ZeRO-2 was built).
    docs = (EXAMPLE.parents[1] / "docs" / "deepspeed.md").read_text()
    shown = docs.split("4 problems in ds_config.json:\n", 1)[1].split("```", 1)[0]
    assert shown.splitlines() == text.splitlines()[1:]


@pytest.mark.parametrize(("dtype", "codec"), [("BF16", "bf16"), ("Fp16", "fp16"), ("FP32", "none")])
def test_communication_data_type_is_read_in_any_case_as_deepspeed_reads_it(dtype: str, codec: str) -> None:
    spec = translate_config({**MINIMAL, "communication_data_type": dtype}).spec
    assert fields_of(spec, "reduce_codec") == (codec,)


def test_deepspeeds_own_rates_come_with_a_one_cycle_whose_stair_counts_it_ignores() -> None:
    # DeepSpeed's OneCycle stores cycle_*_stair_count and never reads it; stages.state.lr's builds stairs.
    result = translate_config({**MINIMAL, "scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_stair_count": 2, "cycle_second_stair_count": 3}}})
    assert result.spec.optimization.lr_scheduler == ("stages.state.lr:OneCycle",
                                                      {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1})
    assert sum("stair_count: dropped, so that the rates are DeepSpeed's" in n for n in result.notices) == 2


def test_a_warmup_without_its_top_rate_says_where_it_warms_up_to() -> None:
    warmup = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    notices = translate_config({**MINIMAL, "scheduler": warmup}).notices
    assert any(n.startswith("scheduler.params.warmup_max_lr: not given: the rate warms up to the optimizer's lr")
               for n in notices)
    given = {"warmup_num_steps": 10, "warmup_max_lr": 0.01}
    assert not translate_config({**MINIMAL, "scheduler": {"type": "WarmupLR", "params": given}}).notices


def test_a_missing_model_is_named() -> None:
    with pytest.raises(ConfigError, match="model: missing"):
        translate_config({"train_batch_size": 8})


def test_deepspeeds_type_partition_and_split_points_reach_the_spec() -> None:
    spec = translate({**MINIMAL, "pipeline": {"stages": 2, "partition": "type:Linear"}})
    assert spec.parallelism.partition_method == "type:Linear"
    spec = translate({**MINIMAL, "model": "examples.hf:gpt2",
                      "data": "examples.data:char_batches", "data_kwargs": {"batch_size": 8},
                      "pipeline": {"stages": 2}, "split_points": ["transformer.h.2"]})
    assert isinstance(spec, JobSpec) and spec.parallelism.split_points == ["transformer.h.2"]


def test_the_result_is_a_translated_config_with_no_spec_fields_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(MINIMAL))
    config = load_config(path)
    assert isinstance(config, TranslatedConfig)
    assert config.spec.training.model == "examples.models:residual_mlp"
    with pytest.raises(AttributeError):
        config.model  # type: ignore[attr-defined]  # noqa: B018


def test_the_data_factory_is_checked_even_when_the_batch_sizes_are_wrong() -> None:
    found = problems_of({"model": "examples.models:residual_mlp", "train_batch_size": 30,
                         "train_micro_batch_size_per_gpu": 8, "data": "examples.data"})
    assert sorted(found) == ["train_batch_size", "training.data"]


def test_a_job_that_is_neither_a_path_nor_keys_is_a_type_error(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(MINIMAL))
    with pytest.raises(TypeError, match="job must be a file path or a mapping of config keys, got int"):
        load_config(path, job=3)  # type: ignore[arg-type]


# -- compile ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("block", "expected"), [
    ({"enabled": True}, True),  # DeepSpeed's first form: enabled, backend, kwargs
    ({"enabled": True, "backend": "aot_eager", "kwargs": {"mode": "max-autotune", "dynamic": False}},
     {"backend": "aot_eager", "mode": "max-autotune", "dynamic": False}),
    ({"deepcompile": True, "fullgraph": False}, {"fullgraph": False}),  # DeepCompile's block: torch.compile here
    ({"enabled": False, "backend": "inductor"}, False),
    ({"deepcompile": False}, False),
    ({"enabled": True, "disable": True}, False),
])
def test_deepspeeds_compile_block_is_the_stages_torch_compile(block: dict[str, Any], expected: Any) -> None:
    assert translate({**MINIMAL, "compile": block}).runtime.torch_compile == expected


def test_the_compile_blocks_other_keys_say_what_happens_instead() -> None:
    notices = notices_of({**MINIMAL, "compile": {"deepcompile": True, "offload_activation": True}})
    assert notices["compile.deepcompile"].startswith("DeepCompile's passes (ZeRO-3 prefetch, offloading) are not built")
    assert notices["compile.offload_activation"] == "no effect here: it tunes DeepCompile"
    assert notices_of({**MINIMAL, "compile": {"backend": "inductor"}})["compile"].startswith(
        "the block alone compiles nothing")


@pytest.mark.parametrize(("block", "key", "message"), [
    ({"enabled": True, "kwargs": {"fullgraf": True}}, "compile.kwargs.fullgraf", "not one of torch.compile's"),
    ({"enabled": True, "kwargs": 3}, "compile.kwargs", "expected an object of torch.compile's arguments"),
    ({"enabled": "yes"}, "compile.enabled", "expected true or false"),
    ("inductor", "compile", "expected an object such as"),
    ({"enabled": True, "backend": "tvmm"}, "compile", "runtime.torch_compile.backend: unknown backend 'tvmm'"),
])
def test_a_wrong_compile_block_is_refused_naming_the_key(block: Any, key: str, message: str) -> None:
    problems = problems_of({**MINIMAL, "compile": block})
    assert message in problems[key], problems
