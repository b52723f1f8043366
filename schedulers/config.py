"""Jobs without Python: a DeepSpeed-style ``ds_config.json`` translated into a :class:`~schedulers.jobs.JobSpec`.

The batch keys mean what they mean in DeepSpeed, and are checked the way DeepSpeed
checks them: ``train_batch_size == train_micro_batch_size_per_gpu *
gradient_accumulation_steps * data_parallel``, and any two of the three determine
the third. In a pipeline the accumulation steps are the micro-batches of one
optimizer step, so ``gradient_accumulation_steps`` becomes ``micro_batches``.
actorpipe's own fields name the model, loss and data factories by import path, the
mesh and the wire codecs::

    {
      "train_batch_size": 32,
      "gradient_accumulation_steps": 4,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
      "pipeline": {"stages": 2, "schedule": "1f1b", "partition_method": "parameters"},
      "model": {"factory": "examples.models:gpt", "kwargs": {"dim": 128, "layers": 4}},
      "loss": "examples.models:lm_loss",
      "data": {"factory": "examples.data:char_batches", "kwargs": {"context": 64}},
      "mesh": {"tensor_parallel": 1, "data_parallel": 1},
      "codecs": {"activation": "none", "gradient": "none", "reduce": "none"},
      "transport": "zmq",
      "seed": 0
    }

Everything here is pure: no files but the one :func:`load_config` reads, no imports
of the factories. A key the file leaves out takes the spec's own default. A key this module does not know is an error that names it (with
the nearest known key), and so is a batch size that does not add up (with the value
that would).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from schedulers.jobs import CODECS, PARTITION_METHODS, SCHEDULE_NAMES, TRANSPORTS, JobSpec

__all__ = ["OPTIMIZERS", "BatchSizes", "ConfigError", "load_config", "resolve_batch_sizes", "translate_config"]

# DeepSpeed's optimizer "type" names (case-insensitive) and the torch class each becomes.
OPTIMIZERS = {
    "adam": "torch.optim:Adam",
    "adamw": "torch.optim:AdamW",
    "sgd": "torch.optim:SGD",
    "adagrad": "torch.optim:Adagrad",
    "adamax": "torch.optim:Adamax",
    "adadelta": "torch.optim:Adadelta",
    "rmsprop": "torch.optim:RMSprop",
    "nadam": "torch.optim:NAdam",
    "radam": "torch.optim:RAdam",
}

# DeepSpeed keys that mean something actorpipe does not do (yet): refused with why,
# rather than silently ignored, since the run would not be the one the file describes.
_UNSUPPORTED = {
    "fp16": "mixed precision is not supported; the stages compute in float32",
    "bf16": "mixed precision is not supported; the stages compute in float32",
    "amp": "mixed precision is not supported; the stages compute in float32",
    "zero_optimization": "ZeRO sharding is not supported; use the pipeline and tensor_parallel to split the model",
    "gradient_clipping": "gradient clipping is not supported yet",
    "scheduler": "learning-rate schedulers are not supported yet",
    "activation_checkpointing": "activation checkpointing is not supported yet",
}

_TOP_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
    "pipeline", "model", "loss", "data", "mesh", "codecs", "transport", "seed", "threads_per_stage",
    "step_timeout_s",
    # DeepSpeed's logging switches: harmless, accepted and ignored.
    "steps_per_print", "wall_clock_breakdown",
)
_SECTIONS: dict[str, tuple[str, ...]] = {
    "optimizer": ("type", "params"),
    "pipeline": ("stages", "schedule", "partition_method", "virtual_stages", "split_points"),
    "model": ("factory", "kwargs"),
    "data": ("factory", "kwargs", "batch_size_arg"),
    "mesh": ("tensor_parallel", "data_parallel"),
    "codecs": ("activation", "gradient", "reduce", "error_feedback", "measure_error"),
}
# DeepSpeed-only optimizer parameters with no torch equivalent.
_DEEPSPEED_ONLY_PARAMS = ("torch_adam", "adam_w_mode")


class ConfigError(ValueError):
    """A config key that is unknown, missing or wrong; ``key`` is its dotted path."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class BatchSizes(NamedTuple):
    """The three batch sizes, consistent: ``train_batch_size == micro * accumulation * data_parallel``."""

    train_batch_size: int
    micro_batch_size: int
    accumulation_steps: int


def load_config(path: str | os.PathLike[str]) -> JobSpec:
    """Reads a JSON config and translates it (see :func:`translate_config`).

    Raises:
        ConfigError: the file is not JSON, or the config is wrong (the message names the key).
        OSError: the file cannot be read.
    """
    with open(path) as f:
        text = f.read()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(os.fspath(path), f"not valid JSON: {exc}") from None
    return translate_config(config)


def translate_config(config: Mapping[str, Any]) -> JobSpec:
    """A DeepSpeed-style config as the job's spec (what ``cluster.train`` takes).

    Raises:
        ConfigError: an unknown or unsupported key, a missing ``model``, a value of
            the wrong type, or batch sizes that do not add up.
    """
    if not isinstance(config, Mapping):
        raise ConfigError("config", f"must be a JSON object, got {type(config).__name__}")
    _check_keys("", config, _TOP_KEYS)
    sections = {name: _section(config, name) for name in _SECTIONS}
    if "model" not in config:
        raise ConfigError("model", "missing; name the model factory, e.g. \"model\": \"examples.models:gpt\"")
    pipeline, mesh, codecs = sections["pipeline"], sections["mesh"], sections["codecs"]
    data_parallel = _positive_int(mesh, "data_parallel", "mesh.") if "data_parallel" in mesh else 1
    sizes = resolve_batch_sizes(
        train_batch_size=_optional_positive_int(config, "train_batch_size"),
        micro_batch_size=_optional_positive_int(config, "train_micro_batch_size_per_gpu"),
        accumulation_steps=_optional_positive_int(config, "gradient_accumulation_steps"),
        data_parallel=data_parallel,
    )
    kwargs: dict[str, Any] = {
        "model": _path(sections["model"], "factory", "model."),
        "model_kwargs": _mapping(sections["model"], "kwargs", "model."),
        "data_parallel": data_parallel,
        "micro_batches": sizes.accumulation_steps,
    }
    if "optimizer" in config:
        kwargs["optimizer"] = _optimizer(sections["optimizer"])
    # Each key the file gives, checked here so the error names it; the rest keep the spec's defaults.
    optional: list[tuple[str, Mapping[str, Any], str, str, Any]] = [
        ("pipeline_stages", pipeline, "stages", "pipeline.", _positive_int),
        ("tensor_parallel", mesh, "tensor_parallel", "mesh.", _positive_int),
        ("schedule", pipeline, "schedule", "pipeline.", _choice(SCHEDULE_NAMES)),
        ("partition_method", pipeline, "partition_method", "pipeline.", _partition_method),
        ("split_points", pipeline, "split_points", "pipeline.", _names),
        ("virtual_stages", pipeline, "virtual_stages", "pipeline.", _positive_int),
        ("activation_codec", codecs, "activation", "codecs.", _codec),
        ("gradient_codec", codecs, "gradient", "codecs.", _codec),
        ("reduce_codec", codecs, "reduce", "codecs.", _choice(CODECS)),
        ("error_feedback", codecs, "error_feedback", "codecs.", _bool),
        ("measure_codec_error", codecs, "measure_error", "codecs.", _bool),
        ("seed", config, "seed", "", _int),
        ("loss", config, "loss", "", _path),
        ("transport", config, "transport", "", _choice(TRANSPORTS)),
        ("threads_per_stage", config, "threads_per_stage", "", _positive_int),
        ("step_timeout_s", config, "step_timeout_s", "", _seconds),
    ]
    for name, section, key, prefix, check in optional:
        if key in section:
            kwargs[name] = check(section, key, prefix)
    if "data" in config:
        kwargs["data"], kwargs["data_kwargs"] = _data(sections["data"], sizes.train_batch_size)
    try:
        return JobSpec.from_kwargs(kwargs)  # what no single key shows, e.g. a codec list of the wrong length
    except (TypeError, ValueError) as exc:
        raise ConfigError("config", str(exc)) from None


def resolve_batch_sizes(
    *,
    train_batch_size: int | None,
    micro_batch_size: int | None,
    accumulation_steps: int | None,
    data_parallel: int = 1,
) -> BatchSizes:
    """Completes and checks DeepSpeed's three batch sizes, any two of which fix the third.

    One given alone: ``train_batch_size`` means one accumulation step, so does
    ``train_micro_batch_size_per_gpu``; ``gradient_accumulation_steps`` alone is not enough.

    Raises:
        ConfigError: the sizes disagree, or do not divide; the message names the key
            and the value that would fit.
    """
    total, micro, accum, dp = train_batch_size, micro_batch_size, accumulation_steps, data_parallel
    if total is not None and micro is not None and accum is not None:
        if total != micro * accum * dp:
            raise ConfigError("train_batch_size", (
                f"expected {micro * accum * dp} = train_micro_batch_size_per_gpu ({micro}) * "
                f"gradient_accumulation_steps ({accum}) * data_parallel ({dp}), got {total}"))
        return BatchSizes(total, micro, accum)
    if total is not None and micro is not None:
        accum = _divide(total, micro * dp, "train_batch_size",
                        f"train_micro_batch_size_per_gpu ({micro}) * data_parallel ({dp})")
    elif total is not None and accum is not None:
        micro = _divide(total, accum * dp, "train_batch_size",
                        f"gradient_accumulation_steps ({accum}) * data_parallel ({dp})")
    elif micro is not None:
        accum = accum or 1
        total = micro * accum * dp
    elif total is not None:
        accum = 1
        micro = _divide(total, dp, "train_batch_size", f"data_parallel ({dp})")
    else:
        raise ConfigError("train_batch_size", (
            "missing; give train_batch_size or train_micro_batch_size_per_gpu "
            "(with gradient_accumulation_steps if you accumulate)"))
    return BatchSizes(total, micro, accum)


def _divide(total: int, by: int, key: str, what: str) -> int:
    if total % by:
        lower, upper = total // by * by, (total // by + 1) * by
        nearest = f"{lower} or {upper}" if lower else str(upper)
        raise ConfigError(key, f"expected a multiple of {what} = {by} (e.g. {nearest}), got {total}")
    return total // by


# -- pieces ------------------------------------------------------------------------


def _check_keys(prefix: str, section: Mapping[str, Any], known: tuple[str, ...]) -> None:
    for key in section:
        if key in known:
            continue
        where = f"{prefix}{key}"
        if not prefix and key in _UNSUPPORTED:
            raise ConfigError(where, f"not supported by actorpipe: {_UNSUPPORTED[key]}")
        near = difflib.get_close_matches(str(key), known, n=1)
        hint = f"; did you mean {prefix}{near[0]}?" if near else f"; known keys: {', '.join(known)}"
        raise ConfigError(where, f"unknown key{hint}")


def _section(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A sub-object, with its keys checked; a bare string stands for ``{"factory": ...}``."""
    value = config.get(name, {})
    if isinstance(value, str) and name in ("model", "data"):
        value = {"factory": value}
    if not isinstance(value, Mapping):
        raise ConfigError(name, f"expected an object with keys {', '.join(_SECTIONS[name])}, got {value!r}")
    _check_keys(f"{name}.", value, _SECTIONS[name])
    return dict(value)


def _path(section: Mapping[str, Any], key: str, prefix: str) -> str:
    value = section.get(key)
    if not isinstance(value, str) or value.count(":") != 1:
        raise ConfigError(prefix + key, f"expected an import path 'package.module:name', got {value!r:.60}")
    return value


def _mapping(section: Mapping[str, Any], key: str, prefix: str) -> dict[str, Any]:
    value = section.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(prefix + key, f"expected an object of keyword arguments, got {value!r}")
    return dict(value)


def _int(section: Mapping[str, Any], key: str, prefix: str) -> int:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(prefix + key, f"expected an integer, got {value!r:.60}")
    return value


def _positive_int(section: Mapping[str, Any], key: str, prefix: str) -> int:
    value = _int(section, key, prefix)
    if value < 1:
        raise ConfigError(prefix + key, f"expected an integer >= 1, got {value}")
    return value


def _optional_positive_int(section: Mapping[str, Any], key: str) -> int | None:
    return None if section.get(key) is None else _positive_int(section, key, "")


def _seconds(section: Mapping[str, Any], key: str, prefix: str) -> float:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ConfigError(prefix + key, f"expected a number of seconds > 0, got {value!r:.60}")
    return float(value)


def _bool(section: Mapping[str, Any], key: str, prefix: str) -> bool:
    value = section.get(key)
    if not isinstance(value, bool):
        raise ConfigError(prefix + key, f"expected true or false, got {value!r:.60}")
    return value


def _choice(choices: tuple[str, ...]) -> Any:
    """A check that the value is one of ``choices``."""
    def check(section: Mapping[str, Any], key: str, prefix: str) -> str:
        value = section.get(key)
        if value not in choices:
            raise ConfigError(prefix + key, f"expected one of {', '.join(choices)}, got {value!r:.60}")
        return str(value)
    return check


def _partition_method(section: Mapping[str, Any], key: str, prefix: str) -> str:
    """One of the partition methods, or DeepSpeed's ``type:REGEX`` (layers whose class matches)."""
    value = section.get(key)
    if isinstance(value, str) and value.startswith("type:") and 5 < len(value) <= 205:
        try:
            re.compile(value[5:])
        except re.error as exc:
            raise ConfigError(prefix + key, f"{value!r:.60} is not a regular expression after type: ({exc})") from None
        return value
    return str(_choice(PARTITION_METHODS)(section, key, prefix))


def _names(section: Mapping[str, Any], key: str, prefix: str) -> list[str]:
    value = section.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(prefix + key, f"expected a list of module names, got {value!r:.60}")
    return list(value)


def _codec(codecs: Mapping[str, Any], key: str, prefix: str = "codecs.") -> str | list[str]:
    value = codecs.get(key)
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or any(n not in CODECS for n in names):
        raise ConfigError(f"{prefix}{key}", (
            f"expected a codec name ({', '.join(CODECS)}) or a list of one per stage boundary, got {value!r:.60}"))
    return value if isinstance(value, str) else list(names)


def _optimizer(section: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    kind = section.get("type")
    params = _mapping(section, "params", "optimizer.")
    if not isinstance(kind, str):
        raise ConfigError("optimizer.type", f"expected a name such as Adam, AdamW or SGD, got {kind!r}")
    if params.pop("adam_w_mode", False) and kind.lower() == "adam":
        kind = "AdamW"  # DeepSpeed's Adam with adam_w_mode is decoupled weight decay: AdamW
    for key in _DEEPSPEED_ONLY_PARAMS:
        params.pop(key, None)
    if ":" in kind:
        return kind, params  # a full import path, e.g. "torch.optim:ASGD"
    path = OPTIMIZERS.get(kind.lower())
    if path is None:
        names = ", ".join(p.rpartition(":")[2] for p in OPTIMIZERS.values())
        raise ConfigError("optimizer.type", f"unknown optimizer {kind!r}; expected one of {names} "
                          "or an import path 'package.module:Class'")
    return path, params


def _data(section: Mapping[str, Any], train_batch_size: int) -> tuple[str, dict[str, Any]]:
    """The data factory and its kwargs, with the global batch size passed as ``batch_size_arg``."""
    factory = _path(section, "factory", "data.")
    kwargs = _mapping(section, "kwargs", "data.")
    arg = section.get("batch_size_arg", "batch_size")
    if arg is None:
        return factory, kwargs
    if not isinstance(arg, str):
        raise ConfigError("data.batch_size_arg", f"expected a keyword name or null, got {arg!r}")
    given = kwargs.setdefault(arg, train_batch_size)
    if given != train_batch_size:
        raise ConfigError(f"data.kwargs.{arg}", (
            f"expected {train_batch_size} (train_batch_size: one global batch per step), got {given!r}; "
            "leave it out and it is filled in"))
    return factory, kwargs
