"""DeepSpeed's keys besides the optimizer and schedule, as JobSpec fields, notices or refusals.

Precision (``fp16``, ``bf16``, ``torch_autocast``, ``amp``), ``gradient_clipping``,
``zero_optimization``, ``activation_checkpointing``, DeepSpeed's pipeline keys, its
communication keys and its monitors (``tensorboard``, ``wandb``, ``csv_monitor``) map
onto the job's options. Keys that only tune DeepSpeed's own
machinery are accepted with one notice each; features that would change what is
trained and are not built here are refused with why. A block that is present but
switched off (``"enabled": false``, ZeRO stage 0, clipping 0) is accepted as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stages.monitor_configs import CSVConfig, TensorBoardConfig, WandbConfig, monitor_config
from schedulers.deepspeed.checks import (
    AUTO,
    ConfigError,
    Translation,
    boolean,
    check_keys,
    integer,
    number,
    partition_method,
    show,
)

__all__ = ["DEEPSPEED_KEYS", "MONITORS", "NO_EFFECT", "PIPELINE_KEYS", "REFUSED", "translate_deepspeed_keys"]

_FP16_KEYS = ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads")
_BF16_KEYS = ("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
              "bf16_optimizer_states")
_AUTOCAST_KEYS = ("enabled", "dtype", "lower_precision_safe_modules")
_DTYPES = {"torch.bfloat16": "bf16", "bf16": "bf16", "bfloat16": "bf16",
           "torch.float16": "fp16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
           "torch.float32": "fp32", "fp32": "fp32", "float32": "fp32", "float": "fp32"}
_REDUCE_CODECS = {"fp32": "none", "fp16": "fp16", "bf16": "bf16"}

# DeepSpeedZeroConfig's fields and their stage3_ aliases (deepspeed/runtime/zero/config.py).
_ZERO_KEYS = (
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint",
    "offload_param", "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
    "param_persistence_threshold", "stage3_param_persistence_threshold", "model_persistence_threshold",
    "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters", "max_reuse_distance",
    "stage3_max_reuse_distance", "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold", "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size", "mics_hierarchical_params_gather",
    "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
    "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
)
_ZERO_NOTES = {
    "offload_optimizer": "no effect here: optimizer state stays on each stage's device",
    "offload_param": "no effect here: parameters stay on each stage's device",
    "cpu_offload": "no effect here: optimizer state stays on each stage's device",
    "cpu_offload_param": "no effect here: parameters stay on each stage's device",
}
_ZERO_NOTE = "no effect here: it tunes DeepSpeed's ZeRO buckets, streams or partitioning"

_CHECKPOINTING_NOTES = {
    "partition_activations": "no effect here: a stage keeps its boundary inputs whole on its own device",
    "cpu_checkpointing": "no effect here: the kept inputs stay on the stage's device",
    "contiguous_memory_optimization": "no effect here: torch's allocator holds the kept inputs",
    "number_checkpoints": "no effect here: the checkpoints are the layers (or every "
                          "activation_checkpoint_interval of them)",
    "synchronize_checkpoint_boundary": "no effect here: DeepSpeed's device synchronization around checkpoints",
    "profile": "no effect here: DeepSpeed's checkpoint timers; the console's `trace` times every action",
}

# DeepSpeed's own pipeline keys (deepspeed/runtime/config.py, get_pipeline_config), besides "stages".
PIPELINE_KEYS = ("partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned",
                 "grad_partitioned", "use_reentrant")

# DeepSpeed's monitor blocks (deepspeed/monitor/config.py) -> the spec's record, its keys and DeepSpeed's defaults.
# Each becomes the field of the same name in the spec's monitoring section.
MONITORS: dict[str, tuple[type[Any], tuple[str, ...], dict[str, str]]] = {
    "tensorboard": (TensorBoardConfig, ("enabled", "output_path", "job_name"), {"job_name": "DeepSpeedJobName"}),
    "wandb": (WandbConfig, ("enabled", "group", "team", "project"), {"project": "deepspeed"}),
    "csv_monitor": (CSVConfig, ("enabled", "output_path", "job_name"), {"job_name": "DeepSpeedJobName"}),
}
_MONITOR_NOTICE = ("written by the head, by step: Train/loss, Train/lr, ... (DeepSpeed's Train/Samples/train_loss, "
                   "... by samples); {where} is resolved as a checkpoint directory is (a client's stays in its "
                   "subtree of the checkpoint root)")
_CHECKPOINT_ENGINE = "no effect here: DeepSpeed's checkpoint writer; job.save writes checksummed checkpoints atomically"
# Top-level keys that only tune DeepSpeed's own machinery: accepted, one notice each.
NO_EFFECT = {
    "steps_per_print": "no effect here: DeepSpeed's log interval; every step's StepStats (and the console's feed) "
                       "report loss and time",
    "wall_clock_breakdown": "no effect here: DeepSpeed's timers; StepStats.busy_s and the console's `trace` give "
                            "the breakdown",
    "memory_breakdown": "no effect here: DeepSpeed's memory log; StepStats.peak_rss_bytes and peak_stash report memory",
    "dump_state": "no effect here: DeepSpeed prints its engine's state at start",
    "prescale_gradients": "no effect here: the data-parallel reduction averages float32 gradients (the same mean)",
    "gradient_predivide_factor": "no effect here: the data-parallel reduction averages float32 gradients "
                                 "(the same mean)",
    "disable_allgather": "no effect here: a switch of DeepSpeed's ZeRO all-gather",
    "sparse_gradients": "no effect here: embedding gradients are reduced dense",
    "zero_allow_untested_optimizer": "no effect here: ZeRO-1 shards any torch optimizer's state",
    "zero_force_ds_cpu_optimizer": "no effect here: there is no CPU-offloaded optimizer",
    "comet": "no effect here: Comet is not written; the tensorboard, wandb (offline) and csv_monitor blocks are",
    "flops_profiler": "no effect here: DeepSpeed's FLOPs profiler; the console's `trace` times every action",
    "comms_logger": "no effect here: DeepSpeed's communication log; StepStats.bytes_per_edge counts the traffic",
    "aio": "no effect here: DeepSpeed's NVMe offload I/O",
    "checkpoint": _CHECKPOINT_ENGINE, "nebula": _CHECKPOINT_ENGINE, "datastates": _CHECKPOINT_ENGINE,
    "timers": "no effect here: DeepSpeed's timers",
    "dataloader_drop_last": "no effect here: DeepSpeed's data loader; the data factory makes each step's batch",
    "log_level": "no effect here: DeepSpeed's log level",
    "graph_harvesting": "no effect here: DeepSpeed's CUDA graph capture",
    "vocabulary_size": "no effect here: DeepSpeed only checks its alignment",
    "autotuning": "no effect here: DeepSpeed's autotuner",
    "use_data_before_expert_parallelism": "no effect here: a mixture-of-experts placement",
    "seq_parallel_communication_data_type": "no effect here: there is no sequence parallelism",
}

# DeepSpeed features that change what is trained and are not built here: refused when
# switched on. key -> (on when the block has no "enabled", why).
REFUSED = {
    "sparse_attention": (True, "DeepSpeed's block-sparse attention kernels replace the model's attention; not built "
                               "here"),
    "progressive_layer_drop": (False, "progressive layer dropping skips layers while training; not built here"),
    "curriculum_learning": (False, "curriculum learning changes each step's sequence length; here the data factory "
                                   "makes each batch"),
    "data_efficiency": (False, "DeepSpeed's data sampling and token routing; here the data factory makes each batch"),
    "compression_training": (True, "DeepSpeed's compression (quantization, pruning) of the model; not built here"),
    "eigenvalue": (False, "DeepSpeed's eigenvalue estimation (for MoQ); not built here"),
    "quantize_training": (False, "MoQ quantized training; not built here"),
    "weight_quantization": (True, "weight quantization of the model; not built here"),
    "hybrid_engine": (False, "DeepSpeed-Chat's train-and-generate engine; not built here"),
    "elasticity": (False, "elastic training changes the batch sizes with the number of GPUs; here the mesh and batch "
                          "sizes are fixed (max_restarts replaces a lost node instead)"),
    "expert_parallel": (True, "mixture-of-experts parallelism; not built here"),
    "amp": (False, "NVIDIA Apex AMP is not used here; ask for mixed precision with \"fp16\": {\"enabled\": true} "
                   "(float16 with loss scaling) or \"bf16\": {\"enabled\": true}"),
}

# Every top-level key this module reads.
DEEPSPEED_KEYS = (
    "fp16", "bf16", "bfloat16", "torch_autocast", "data_types", "gradient_clipping", "zero_optimization",
    "activation_checkpointing", "communication_data_type", "gradient_allreduce_op", "tensor_parallel",
    "sequence_parallel_size", "managed_gradient_accumulation", "compile", *MONITORS, *NO_EFFECT, *REFUSED,
)


def translate_deepspeed_keys(t: Translation, config: Mapping[str, Any], pipeline: Mapping[str, Any]) -> None:
    """Maps DeepSpeed's keys in ``config`` (and its keys in ``pipeline``) onto ``t``.

    Run after the mesh and pipeline stages are in ``t.fields``: ZeRO's check needs them.
    """
    for step in (_precision, _clipping, _zero):
        with t.collecting():
            step(t, config)
    with t.collecting():
        _checkpointing(t, config, pipeline)
    with t.collecting():
        _pipeline(t, pipeline)
    for step in (_communication, _compile, _monitors, _machinery):
        with t.collecting():
            step(t, config)


# -- precision -------------------------------------------------------------------------------


def _precision(t: Translation, config: Mapping[str, Any]) -> None:
    bf16_key = "bf16"
    if "bfloat16" in config:
        if "bf16" in config:
            t.problem("bfloat16", "the old name of bf16, and bf16 is given too; keep bf16")
        else:
            bf16_key = "bfloat16"
            t.notice("bfloat16", "the old name of bf16: read as bf16")
    fp16 = _switched_block(t, config, "fp16", _FP16_KEYS)
    bf16 = _switched_block(t, config, bf16_key, _BF16_KEYS)
    if fp16 is not None and bf16 is not None:
        t.problem(f"{bf16_key}.enabled", "fp16.enabled is true too, and a job computes in one precision (DeepSpeed "
                                         "refuses both as well); enable one of them")
        return
    if fp16 is not None:
        t.set("precision", "fp16", "fp16.enabled")
        _fp16(t, fp16)
    if bf16 is not None:
        t.set("precision", "bf16", f"{bf16_key}.enabled")
        _bf16(t, bf16, bf16_key)
    autocast = _switched_block(t, config, "torch_autocast", _AUTOCAST_KEYS)
    if autocast is not None:
        _torch_autocast(t, autocast)
    _data_types(t, config)


def _switched_block(t: Translation, config: Mapping[str, Any], key: str,
                    known: tuple[str, ...]) -> dict[str, Any] | None:
    """The block if it is switched on, else None; ``"enabled": "auto"`` is false, the Trainer's default."""
    if key not in config:
        return None
    value = config[key]
    if not isinstance(value, Mapping):
        t.problem(key, f"expected an object such as {{\"enabled\": true}}, got {show(value)}")
        return None
    check_keys(t, f"{key}.", value, known)
    on = value.get("enabled", False)
    if on == AUTO:
        t.notice(f"{key}.enabled", "\"auto\" is false, the Hugging Face Trainer's default; set true in the job file "
                                   "to train in this precision")
        return None
    if not isinstance(on, bool):
        t.problem(f"{key}.enabled", f"expected true or false, got {show(on)}")
        return None
    return dict(value) if on else None


def _fp16(t: Translation, block: Mapping[str, Any]) -> None:
    scaling = (
        ("loss_scale", lambda: number(block, "loss_scale", "fp16.")),
        ("initial_scale_power", lambda: integer(block, "initial_scale_power", "fp16.", minimum=0, maximum=64)),
        ("loss_scale_window", lambda: integer(block, "loss_scale_window", "fp16.", minimum=1)),
        ("hysteresis", lambda: integer(block, "hysteresis", "fp16.", minimum=1)),
        ("min_loss_scale", lambda: number(block, "min_loss_scale", "fp16.", minimum=1e-30)),
    )
    for key, check in scaling:
        if key in block:
            with t.collecting():
                t.set(key, check(), f"fp16.{key}")
    if block.get("consecutive_hysteresis") is True:
        t.notice("fp16.consecutive_hysteresis", "not built here: the hysteresis is refilled only when the scale "
                                                "doubles, as with DeepSpeed's default (false)")
    if block.get("auto_cast") is False:
        t.notice("fp16.auto_cast", "inputs are not cast ahead, and the weights stay float32: each op under autocast "
                                   "casts its own inputs to float16 where autocast runs it in float16")
    if block.get("fp16_master_weights_and_grads") is True:
        t.notice("fp16.fp16_master_weights_and_grads", "master weights and gradients stay float32 here")


def _bf16(t: Translation, block: Mapping[str, Any], key: str) -> None:
    overflow = block.get("check_grad_overflow", True)
    if not isinstance(overflow, bool):
        t.problem(f"{key}.check_grad_overflow", f"expected true or false, got {show(overflow)}")
    elif overflow:
        t.set("on_nonfinite", "skip", f"{key}.check_grad_overflow")  # DeepSpeed skips the step, everywhere
    else:
        t.notice(f"{key}.check_grad_overflow", "a NaN or Inf gradient still stops the step here: it fails with "
                                               "NonFiniteError instead of being applied")
    if block.get("immediate_grad_update") is True:
        t.notice(f"{key}.immediate_grad_update", "no effect here: gradients accumulate in float32 and are applied "
                                                 "at the optimizer step (the result is the same)")
    for flag in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        if block.get(flag) is True:
            t.notice(f"{key}.{flag}", "master weights, gradients and optimizer state stay float32 here")


def _torch_autocast(t: Translation, block: Mapping[str, Any]) -> None:
    dtype = block.get("dtype")
    if dtype is None:
        t.notice("torch_autocast.dtype", "not given: torch's autocast default depends on the device (float16 on "
                                         "CUDA, bfloat16 on CPU); here bf16, give dtype to choose")
        dtype = "bf16"
    precision = _DTYPES.get(dtype) if isinstance(dtype, str) else None
    if precision is None or precision == "fp32":
        t.problem("torch_autocast.dtype", f"expected torch.bfloat16 or torch.float16, got {show(dtype)}")
        return
    t.set("precision", precision, "torch_autocast.enabled")
    if "lower_precision_safe_modules" in block:
        t.notice("torch_autocast.lower_precision_safe_modules", "autocast chooses each op's dtype in every module here")


def _data_types(t: Translation, config: Mapping[str, Any]) -> None:
    if "data_types" not in config:
        return
    value = config["data_types"]
    if not isinstance(value, Mapping):
        raise ConfigError("data_types", f"expected an object, got {show(value)}")
    for key, dtype in value.items():
        if key == "grad_accum_dtype" and _DTYPES.get(dtype) == "fp32":
            continue
        what = "gradients accumulate in float32 here" if key == "grad_accum_dtype" else "no effect here"
        t.notice(f"data_types.{key}", what)


# -- clipping, ZeRO, checkpointing -------------------------------------------------------------


def _clipping(t: Translation, config: Mapping[str, Any]) -> None:
    if "gradient_clipping" not in config:
        return
    if config["gradient_clipping"] == AUTO:
        t.notice("gradient_clipping", "\"auto\" is 1.0, the Hugging Face Trainer's default max_grad_norm; give a "
                                      "number in the job file to choose another (0 is off)")
        t.set("gradient_clipping", 1.0, "gradient_clipping")
        return
    t.set("gradient_clipping", number(config, "gradient_clipping", ""), "gradient_clipping")


def _zero(t: Translation, config: Mapping[str, Any]) -> None:
    if "zero_optimization" not in config:
        return
    value = config["zero_optimization"]
    if isinstance(value, bool):
        stage, block = int(value), {}
        t.notice("zero_optimization", f"the old true/false form: stage {stage}")
    elif isinstance(value, Mapping):
        block = dict(value)
        check_keys(t, "zero_optimization.", block, _ZERO_KEYS)
        stage = integer(block, "stage", "zero_optimization.", minimum=0, maximum=3) if "stage" in block else 0
    else:
        raise ConfigError("zero_optimization", f"expected an object such as {{\"stage\": 1}}, got {show(value)}")
    if stage == 3:
        raise ConfigError("zero_optimization.stage", (
            "ZeRO-3 is not built: a pipeline stage holds its parameters whole (layer specs build only its own); "
            "use stage 2, which shards gradients and optimizer state across replicas, with pipeline stages too "
            "(DeepSpeed refuses 2 with a pipeline)"))
    t.set("zero_stage", stage, "zero_optimization.stage")
    if stage == 0:
        return  # switched off: nothing in the block tunes anything
    for key in block:
        if key in _ZERO_KEYS and key != "stage":
            t.notice(f"zero_optimization.{key}", _ZERO_NOTES.get(key, _ZERO_NOTE))


def _checkpointing(t: Translation, config: Mapping[str, Any], pipeline: Mapping[str, Any]) -> None:
    block = config.get("activation_checkpointing")
    if block is not None:
        if not isinstance(block, Mapping):
            raise ConfigError("activation_checkpointing", f"expected an object, got {show(block)}")
        check_keys(t, "activation_checkpointing.", block, tuple(_CHECKPOINTING_NOTES))
    if "activation_checkpoint_interval" in pipeline:
        interval = integer(pipeline, "activation_checkpoint_interval", "pipeline.", minimum=0)
        if interval:
            t.set("activation_checkpointing", interval, "pipeline.activation_checkpoint_interval")
        elif block is not None:
            t.notice("activation_checkpointing", "checkpointing is off: pipeline.activation_checkpoint_interval is 0")
    elif block is not None:
        t.set("activation_checkpointing", True, "activation_checkpointing")
        t.notice("activation_checkpointing", (
            "DeepSpeed's block configures the checkpoints a model's code makes; here every stage checkpoints each "
            "layer (pipeline.activation_checkpoint_interval: N checkpoints every N layers)"))
    for key in block or {}:
        if key in _CHECKPOINTING_NOTES:
            t.notice(f"activation_checkpointing.{key}", _CHECKPOINTING_NOTES[key])


# -- pipeline, communication, machinery ----------------------------------------------------------


def _pipeline(t: Translation, pipeline: Mapping[str, Any]) -> None:
    if "partition" in pipeline:
        with t.collecting():
            if pipeline["partition"] == "best":
                t.notice("pipeline.partition", "\"best\" is DeepSpeed's config default, which its PipelineModule "
                                               "does not read: partitioned by parameters, the PipelineModule's default")
                t.set("partition_method", "parameters", "pipeline.partition")
            else:
                t.set("partition_method", partition_method(pipeline, "partition", "pipeline."), "pipeline.partition")
    if "seed_layers" in pipeline:
        with t.collecting():
            boolean(pipeline, "seed_layers", "pipeline.")
            t.notice("pipeline.seed_layers", "a model returned whole is built by every stage from one seed, each "
                                             "keeping its slice, so each layer starts as in one process; layer specs "
                                             "are built each under a seed of its own (docs/models.md), either way")
    for key, why in (("pipe_partitioned", "activations between stages are sent whole by each tensor-parallel rank"),
                     ("grad_partitioned", "gradients between stages are sent whole by each tensor-parallel rank"),
                     ("use_reentrant", "how DeepSpeed's checkpointing calls torch.utils.checkpoint")):
        if key in pipeline:
            with t.collecting():
                boolean(pipeline, key, "pipeline.")
                t.notice(f"pipeline.{key}", f"no effect here: {why}")


def _communication(t: Translation, config: Mapping[str, Any]) -> None:
    dtype = config.get("communication_data_type")
    if dtype is not None:
        codec = _REDUCE_CODECS.get(_DTYPES.get(dtype.lower(), "")) if isinstance(dtype, str) else None  # as DeepSpeed
        if codec is None:
            t.problem("communication_data_type", f"expected fp32, fp16 or bf16, got {show(dtype)}")
        else:
            t.set("reduce_codec", codec, "communication_data_type")
    op = config.get("gradient_allreduce_op", "mean")
    if op != "mean":
        t.problem("gradient_allreduce_op", (f"{show(op)} is not available: replicas average their gradients, so that "
                                            "training equals one process on the whole batch; leave it out or say mean"))
    if "tensor_parallel" in config:
        block = config["tensor_parallel"]
        if not isinstance(block, Mapping):
            t.problem("tensor_parallel", f"expected an object such as {{\"autotp_size\": 2}}, got {show(block)}")
        else:
            for key in block:
                if key == "autotp_size":
                    with t.collecting():
                        t.set("tensor_parallel", integer(block, key, "tensor_parallel.", minimum=1),
                              "tensor_parallel.autotp_size")
                else:
                    t.notice(f"tensor_parallel.{key}", "no effect here: it tunes DeepSpeed's AutoTP")
    if "sequence_parallel_size" in config:
        size = integer(config, "sequence_parallel_size", "", minimum=1)
        if size > 1:
            t.problem("sequence_parallel_size", "sequence parallelism is not built here; leave it out or say 1")
    if "managed_gradient_accumulation" in config and not boolean(config, "managed_gradient_accumulation", ""):
        t.problem("managed_gradient_accumulation", (
            "false is not available: every optimizer step here accumulates gradient_accumulation_steps "
            "micro-batches (what true means); leave it out"))


def _monitors(t: Translation, config: Mapping[str, Any]) -> None:
    """DeepSpeed's ``tensorboard``, ``wandb`` and ``csv_monitor`` blocks, when enabled, as the spec's monitors
    (DeepSpeed's defaults where a key is left out: ``job_name`` DeepSpeedJobName, ``project`` deepspeed)."""
    for key, (cls, known, defaults) in MONITORS.items():
        block = _switched_block(t, config, key, known) if isinstance(config.get(key), Mapping) else None
        if block is None:
            continue
        given = {k: v for k, v in block.items() if k in known and k != "enabled"}  # an unknown one is a problem
        try:
            value = monitor_config(key, {**defaults, **given}, cls)
        except (TypeError, ValueError) as exc:
            t.problem(key, str(exc))
            continue
        t.set(key, value, f"{key}.enabled")
        t.notice(key, _MONITOR_NOTICE.format(where="its run directory, offline (wandb sync uploads it)," if
                                             key == "wandb" else "output_path/job_name"))


# torch.compile's arguments in DeepSpeed's compile block: flat (its second form) or in "kwargs" (its first).
_COMPILE_ARGUMENTS = ("mode", "dynamic", "fullgraph", "options")


def _compile(t: Translation, config: Mapping[str, Any]) -> None:
    """DeepSpeed's ``compile`` block: ``runtime.torch_compile``, each stage compiling its layers.

    On with ``"enabled": true`` (DeepSpeed's first form) or ``"deepcompile": true``; ``backend``
    and torch.compile's arguments (in ``kwargs``, or flat) carry over. DeepCompile's own passes and
    switches get a notice each.
    """
    if "compile" not in config:
        return
    block = config["compile"]
    if not isinstance(block, Mapping):
        t.problem("compile", f"expected an object such as {{\"enabled\": true, \"backend\": \"inductor\"}}, got "
                             f"{show(block)}")
        return
    for switch in ("enabled", "deepcompile", "disable"):
        if switch in block:
            boolean(block, switch, "compile.")
    arguments: dict[str, Any] = {}
    if "backend" in block:
        arguments["backend"] = block["backend"]
    kwargs = block.get("kwargs", {})
    if not isinstance(kwargs, Mapping):
        t.problem("compile.kwargs", f"expected an object of torch.compile's arguments, got {show(kwargs)}")
        return
    for key, value in [*kwargs.items(), *((k, block[k]) for k in _COMPILE_ARGUMENTS if k in block)]:
        if key not in _COMPILE_ARGUMENTS:
            t.problem(f"compile.kwargs.{key}", "not one of torch.compile's arguments a stage takes "
                                               f"({', '.join(_COMPILE_ARGUMENTS)})")
        else:
            arguments[key] = value
    on = (block.get("enabled") is True or block.get("deepcompile") is True) and block.get("disable") is not True
    if not on:
        if arguments:
            t.notice("compile", "the block alone compiles nothing, as in DeepSpeed (where the script's engine.compile() "
                                "does): add \"enabled\": true, or set runtime.torch_compile in the job file")
        return
    t.set("torch_compile", arguments or True, "compile")
    if block.get("deepcompile") is True:
        t.notice("compile.deepcompile", "DeepCompile's passes (ZeRO-3 prefetch, offloading) are not built here; each "
                                        "stage compiles its layers with torch.compile (runtime.torch_compile)")
    for key in block:
        if key not in ("enabled", "deepcompile", "disable", "backend", "kwargs", *_COMPILE_ARGUMENTS):
            t.notice(f"compile.{key}", "no effect here: it tunes DeepCompile")


def _machinery(t: Translation, config: Mapping[str, Any]) -> None:
    for key, value in config.items():
        switched_off = isinstance(value, Mapping) and value.get("enabled") is False
        if key in NO_EFFECT and not switched_off:
            t.notice(key, NO_EFFECT[key])
        elif key in REFUSED:
            on_by_default, why = REFUSED[key]
            on = value.get("enabled", on_by_default) if isinstance(value, Mapping) else bool(value)
            if on and on != AUTO:  # "auto": the Trainer's default, off
                t.problem(key, f"not supported here: {why}")
