"""actorpipe's own keys in a config: the spec's sections and fields, strict.

A job file (or the actorpipe part of one config file) names what DeepSpeed takes from
the training script with the spec's own vocabulary: a section holds its fields
(``"parallelism": {"pipeline_stages": 2}``) and a field may stand flat at the top
(``"pipeline_stages": 2``), as a keyword does in ``cluster.train``. :func:`sectioned`
moves flat fields into their sections, so that both spellings merge key by key;
:func:`translate_spec_keys` checks each field so that a problem names its key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from stages.spec_checks import nearest
from schedulers.deepspeed.checks import (
    Check,
    Translation,
    any_int,
    boolean,
    choice,
    codec,
    mapping,
    names,
    non_negative_int,
    partition_method,
    path,
    positive_int,
    seconds,
    show,
)
from stages.state.state_precision import STATE_PRECISIONS
from schedulers.jobs import CODECS, FIELDS, NONFINITE_ACTIONS, PRECISIONS, SCHEDULE_NAMES, SECTIONS, TRANSPORTS

__all__ = ["FORMER", "SHARED", "sectioned", "translate_spec_keys"]

# Names that are both a DeepSpeed block and a spec field: an object is DeepSpeed's (a monitor's spec form
# goes in its section: "monitoring": {"tensorboard": {...}}).
SHARED = ("optimizer", "tensor_parallel", "activation_checkpointing", "tensorboard", "wandb", "csv_monitor")


# The job file's blocks before it used the spec's names: refused wherever they appear, naming what replaced them.
FORMER = {
    "mesh": "its keys are now parallelism.tensor_parallel and parallelism.data_parallel (or flat at the top)",
    "codecs": "its keys are now communication.activation_codec, gradient_codec, reduce_codec, error_feedback and "
              "measure_codec_error (or flat at the top)",
}


def _optional(check: Check) -> Check:
    """``check``, or null (the field's ``None``)."""
    def checked(section: Mapping[str, Any], key: str, prefix: str) -> Any:
        return None if section.get(key) is None else check(section, key, prefix)
    return checked


# The fields checked one by one, so that each problem is reported with its key; the
# spec checks the others (and what must fit across fields) when it is built.
_FIELD_CHECKS: dict[str, Check] = {
    "model": path, "model_kwargs": mapping, "loss": path, "data": _optional(path), "data_kwargs": mapping,
    "eval_data": _optional(path), "eval_data_kwargs": mapping, "eval_metrics": _optional(path),
    "seed": any_int,
    **dict.fromkeys(("pipeline_stages", "tensor_parallel", "data_parallel", "micro_batches", "bucket_bytes",
                     "snapshot_every"), positive_int),
    **dict.fromkeys(("virtual_stages", "max_stash_bytes", "threads_per_stage"), _optional(positive_int)),
    "schedule": choice(SCHEDULE_NAMES), "partition_method": partition_method, "split_points": _optional(names),
    "activation_codec": codec, "gradient_codec": codec, "reduce_codec": choice(CODECS),
    "transport": choice(TRANSPORTS), "precision": choice(PRECISIONS), "on_nonfinite": choice(NONFINITE_ACTIONS),
    "optimizer_states": choice(STATE_PRECISIONS), "stash_codec": choice(CODECS),
    **dict.fromkeys(("error_feedback", "measure_codec_error", "overlap_reduce", "w_batching",
                     "gradient_accumulation_fusion", "keep_freed_memory"), boolean),
    "step_timeout_s": seconds,
    "fusion_min_weight_elements": non_negative_int,
}


def sectioned(t: Translation, layer: Mapping[str, Any]) -> dict[str, Any]:
    """``layer`` with each flat field moved into its section, so that both spellings merge key by key.

    A field given both ways in one layer is a problem: neither is later than the other.
    """
    result: dict[str, Any] = {}
    for key, value in layer.items():
        if key not in FIELDS or key == "gradient_clipping" or (key in SHARED and isinstance(value, Mapping)):
            result[key] = value  # not a field, or DeepSpeed's own key of that name (keys.py reads it)
    for key, value in layer.items():
        if key not in result:
            section = result.setdefault(FIELDS[key], {})
            if isinstance(section, Mapping) and key in section:
                t.problem(key, f"given twice, flat and as {FIELDS[key]}.{key}; give it once")
            elif isinstance(section, Mapping):  # else the section is wrong, and reported as such
                result[FIELDS[key]] = {**section, key: value}
    return result


def translate_spec_keys(t: Translation, config: Mapping[str, Any]) -> None:
    """The spec's sections (flat fields were moved into them): each field checked so that a problem names it."""
    for name, cls in SECTIONS.items():
        if name not in config:
            continue
        section = config[name]
        if not isinstance(section, Mapping):
            t.problem(name, f"expected an object of {cls.__name__} fields ({', '.join(f.name for f in fields(cls))}), "
                            f"got {show(section)}")
            continue
        for key in section:
            dotted = f"{name}.{key}"
            if key in FIELDS and FIELDS[key] != name:
                t.problem(dotted, f"{key} belongs in {FIELDS[key]} (or at the top, flat)")
            elif key not in FIELDS:
                known = [f.name for f in fields(cls)]
                near = nearest(str(key), known)
                t.problem(dotted, f"unknown key; did you mean {name}.{near}?" if near else
                          f"unknown key; known keys: {', '.join(known)}")
            elif key in ("model", "data", "eval_data") and isinstance(section[key], Mapping):
                t.problem(dotted, "expected an import path 'package.module:name'; its keyword arguments go beside "
                                  f"it, as {key}_kwargs")
            else:
                check = _FIELD_CHECKS.get(key)
                with t.collecting():
                    t.set(key, check(section, key, f"{name}.") if check else section[key], dotted)
    if "model" not in t.fields and not any(p.key.endswith("model") for p in t.problems):
        t.problem("model", "missing; name the model factory, e.g. \"model\": \"examples.models:gpt\" (in the job "
                           "file when the DeepSpeed config stays as it is)")
