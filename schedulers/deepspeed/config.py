"""Jobs without Python: a DeepSpeed ``ds_config.json``, as it is, translated into a :class:`~schedulers.jobs.JobSpec`.

A config has two parts. DeepSpeed's keys mean what they mean to DeepSpeed: the batch
sizes (checked as DeepSpeed checks them: ``train_batch_size ==
train_micro_batch_size_per_gpu * gradient_accumulation_steps * data_parallel``, any two
give the third; in a pipeline the accumulation steps are the micro-batches of one
optimizer step), ``optimizer``, ``scheduler``, ``fp16`` / ``bf16``,
``gradient_clipping``, ``zero_optimization``, ``activation_checkpointing`` and
``pipeline``. actorpipe's own keys are the spec's own: its sections and fields, with
the names ``cluster.train`` takes (``python -m schedulers.jobs`` lists them). A
section holds its fields (``"parallelism": {"pipeline_stages": 2}``); a field may also
stand at the top, flat (``"pipeline_stages": 2``), as a keyword does in the call. Both
parts may be in one file, or the DeepSpeed file stays as it is and actorpipe's part
comes from a second file or from arguments::

    config = load_config("ds_config.json", job="job.json")     # or job={...}, or model=..., data_parallel=...
    for line in config.notices:                                # keys accepted that do something else here
        print(line)
    job = await cluster.train(config.spec)

with ``job.json`` such as::

    {
      "training": {
        "model": "examples.models:gpt", "model_kwargs": {"dim": 128, "layers": 4},
        "loss": "examples.models:lm_loss",
        "data": "examples.data:char_batches", "data_kwargs": {"context": 64}
      },
      "parallelism": {"pipeline_stages": 2, "schedule": "1f1b"},
      "communication": {"activation_codec": "none"}
    }

actorpipe's keys are strict: an unknown one is a problem that names the nearest. Only
DeepSpeed's stay lenient, as DeepSpeed is: an unknown top-level key of the DeepSpeed
file (e.g. ``"cuda_visible_devices"`` in DeepSpeedExamples' files) is ignored with a
notice, unless it is a near miss of a known one. In the job file and the arguments,
which are actorpipe's, every top-level key must be known. Where a name is both
DeepSpeed's and a field (``optimizer``, ``tensor_parallel``,
``activation_checkpointing``), an object is DeepSpeed's block and anything else the
field (``"optimizer": ["torch.optim:Adam", {"lr": 0.001}]``).

Files are read as DeepSpeed reads them (hjson: comments and trailing commas are
fine). The parts merge key by key, later over earlier (file, then job, then
arguments), a flat field as the field of its section; a value that replaces another
is reported in a notice, one that replaces ``"auto"`` is what ``"auto"`` is for.
``"auto"`` is resolved as the Hugging Face integration does where this config holds
the answer (the batch sizes from each other and the mesh); an ``"auto"`` nothing
resolves is a problem that says what would. ``train_batch_size`` is passed to the data
factory as ``data_kwargs["batch_size"]`` (``"batch_size_arg"`` names another keyword,
``null`` none).

Every problem in the config is reported at once: one :class:`ConfigError` lists
each, with its key and what to do. Keys that only tune DeepSpeed's own machinery are
accepted, with a notice each. Reading and translating are pure: no files but the ones
named, no imports of the factories (a class in ``torch.optim`` is built once on a dummy
parameter to check its arguments).
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import hjson

from schedulers.deepspeed.checks import AUTO, ConfigError, Problem, Translation, check_keys, positive_int, show
from schedulers.deepspeed.keys import DEEPSPEED_KEYS, PIPELINE_KEYS, translate_deepspeed_keys
from schedulers.deepspeed.optimizer import OPTIMIZERS, translate_optimizer, translate_scheduler
from schedulers.deepspeed.spec_keys import FORMER, SHARED, sectioned, translate_spec_keys
from schedulers.jobs import FIELDS, SECTIONS, JobSpec

__all__ = [
    "MAX_CONFIG_BYTES",
    "OPTIMIZERS",
    "BatchSizes",
    "ConfigError",
    "Problem",
    "TranslatedConfig",
    "load_config",
    "read_config_file",
    "resolve_batch_sizes",
    "translate_config",
]

MAX_CONFIG_BYTES = 1 << 20  # a ds_config is a few KiB; a larger file is refused before it is parsed

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# DeepSpeed's blocks this module reads itself, with their keys (keys.py reads the others).
_BLOCKS: dict[str, tuple[str, ...]] = {
    "optimizer": ("type", "params", "legacy_fusion"),
    "scheduler": ("type", "params"),
    "pipeline": ("stages", *PIPELINE_KEYS),
}
_KNOWN = (*_BATCH_KEYS, "batch_size_arg", *_BLOCKS, *DEEPSPEED_KEYS, *SECTIONS, *FIELDS)
class BatchSizes(NamedTuple):
    """The three batch sizes, consistent: ``train_batch_size == micro * accumulation * data_parallel``."""

    train_batch_size: int
    micro_batch_size: int
    accumulation_steps: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TranslatedConfig:
    """A config translated: the job's spec, and what the user should read about it."""

    spec: JobSpec
    """what ``cluster.train`` takes"""
    notices: tuple[str, ...] = ()
    """one line per key accepted that has no effect here, or does something else (``"key: what happens"``)"""


def load_config(
    path: str | os.PathLike[str],
    /,
    *,
    job: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    **overrides: Any,
) -> TranslatedConfig:
    """Reads a DeepSpeed-style config (JSON or hjson) and translates it (see :func:`translate_config`).

    Args:
        path: the config: DeepSpeed's ``ds_config.json`` as it is, or one file with
            actorpipe's keys as well.
        job: actorpipe's part (the spec's sections or fields: model, loss, data,
            pipeline_stages, ...), or any key to add or replace: a file path, or the
            keys themselves. Its top-level keys are strict: an unknown one is a problem.
        overrides: top-level keys, over both files (e.g. ``data_parallel=2`` or
            ``parallelism={"data_parallel": 2}``); strict, as the job part.

    Raises:
        ConfigError: a file is not JSON/hjson, or anything in the config is wrong; its
            ``problems`` list every one, each with its key.
        OSError: a file cannot be read.
        TypeError: ``job`` is neither a path nor a mapping.
    """
    if job is not None and not isinstance(job, (str, os.PathLike, Mapping)):
        raise TypeError(f"job must be a file path or a mapping of config keys, got {type(job).__name__}")
    t = Translation()
    sources: list[tuple[str, Any]] = []
    files = [path] + ([job] if isinstance(job, (str, os.PathLike)) else [])
    for file in files:
        with t.collecting():
            sources.append((os.fspath(file), read_config_file(file)))
    names = [os.fspath(f) for f in files]
    if isinstance(job, Mapping):
        sources.append(("the job config", job))
        names.append("the job config")
    if overrides:
        sources.append(("arguments", overrides))
    where = " with ".join(names) + (" and arguments" if overrides else "")
    if t.problems:
        raise ConfigError.of(t.problems, where=where)
    return _translate(t, sources, where)


def translate_config(
    config: Mapping[str, Any], /, *, job: Mapping[str, Any] | None = None, **overrides: Any
) -> TranslatedConfig:
    """A DeepSpeed-style config as the job's spec (what ``cluster.train`` takes), with notices.

    Args:
        config: DeepSpeed's keys, actorpipe's, or both.
        job: more keys, merged over ``config`` (actorpipe's part of a two-file config).
        overrides: top-level keys, merged over both.

    Raises:
        ConfigError: every unknown, unsupported, missing or wrong key (``problems``
            lists each with its dotted key), or batch sizes that do not add up.
    """
    sources: list[tuple[str, Any]] = [("the config", config)]
    if job is not None:
        sources.append(("the job config", job))
    if overrides:
        sources.append(("arguments", overrides))
    return _translate(Translation(), sources, "the config")


def read_config_file(path: str | os.PathLike[str]) -> Any:
    """A config file's contents, read as DeepSpeed reads them (hjson: comments, trailing commas).

    Raises:
        ConfigError: larger than :data:`MAX_CONFIG_BYTES`, not UTF-8, not JSON/hjson, or
            a key given twice in one object (DeepSpeed refuses that too).
        OSError: the file cannot be read.
    """
    name = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(name, f"larger than {MAX_CONFIG_BYTES} bytes; a config is a few KiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(name, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        return hjson.loads(text, object_pairs_hook=_without_duplicates)
    except _DuplicateKey as exc:
        raise ConfigError(name, f"the key {show(exc.key)} is given twice in one object; keep one") from None
    except hjson.HjsonDecodeError as exc:
        raise ConfigError(name, f"not valid JSON or hjson: {exc}") from None
    except RecursionError:
        raise ConfigError(name, "nested too deeply to be a config") from None
    except (OverflowError, ValueError) as exc:  # hjson's own number conversions: 1e999 as an int
        raise ConfigError(name, f"not valid JSON or hjson: a number it cannot hold ({exc})") from None


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


# -- translation ----------------------------------------------------------------------------


def _translate(t: Translation, sources: list[tuple[str, Any]], where: str) -> TranslatedConfig:
    config, strict = _merge(t, sources)
    _check_top_keys(t, config, strict)
    blocks = {name: _block(t, config, name) for name in _BLOCKS}
    translate_spec_keys(t, config)
    with t.collecting():
        _pipeline_stages(t, blocks["pipeline"])
    translate_deepspeed_keys(t, config, blocks["pipeline"])
    mesh_ok = not any(p.key.endswith("data_parallel") for p in t.problems)
    sizes = _batch_sizes(t, config, t.fields.get("data_parallel", 1)) if mesh_ok else None
    if _deepspeeds(config, "optimizer"):
        translate_optimizer(t, blocks["optimizer"])
        if "legacy_fusion" in blocks["optimizer"]:
            t.notice("optimizer.legacy_fusion", "no effect here: DeepSpeed's fused fp16 optimizer switch")
    if "scheduler" in config:
        params = blocks["optimizer"].get("params")
        translate_scheduler(t, blocks["scheduler"], lr=params.get("lr") if isinstance(params, Mapping) else None)
    for factory in ("data", "eval_data"):
        if factory in t.fields and sizes is not None:
            with t.collecting():
                _pass_batch_size(t, config, sizes.train_batch_size, f"{factory}_kwargs")
    if t.problems:
        raise ConfigError.of(t.problems, where=where)
    return TranslatedConfig(spec=_spec(t), notices=tuple(t.notices))


def _deepspeeds(config: Mapping[str, Any], key: str) -> bool:
    """Whether ``config[key]`` is DeepSpeed's block (an object), where the name is a spec field too."""
    return isinstance(config.get(key), Mapping)


def _merge(t: Translation, sources: list[tuple[str, Any]]) -> tuple[dict[str, Any], set[str]]:
    """The sources merged key by key, later over earlier; a replaced value gets a notice.

    Returns the merged config, and the top-level keys that came from actorpipe's own
    sources (every one after the first, the DeepSpeed file): those must all be known.
    """
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    strict: set[str] = set()
    for index, (source, layer) in enumerate(sources):
        if not isinstance(layer, Mapping):
            raise ConfigError(source, f"must be an object of config keys, got {type(layer).__name__}")
        layer = sectioned(t, layer)
        if index:
            strict.update(layer)
        _merge_into(t, merged, layer, "", source, origins)
    return merged, strict


def _merge_into(t: Translation, target: dict[str, Any], layer: Mapping[str, Any], prefix: str, source: str,
                origins: dict[str, str]) -> None:
    for key, value in layer.items():
        dotted = f"{prefix}{key}"
        old = target.get(key)
        # an optimizer or schedule of another type replaces the whole block: its params belong to the type
        new_type = prefix == "" and key in ("optimizer", "scheduler") and isinstance(value, Mapping) \
            and isinstance(old, Mapping) and "type" in value and value["type"] != old.get("type")
        if isinstance(old, Mapping) and isinstance(value, Mapping) and not new_type:
            target[key] = dict(old)
            _merge_into(t, target[key], value, f"{dotted}.", source, origins)
            continue
        if key in target and old != value and old != AUTO:
            t.notice(dotted, f"{show(value)} from {source} replaces {show(old)} from {_origin(origins, dotted)}")
        target[key] = copy.deepcopy(value)
        origins[dotted] = source


def _origin(origins: dict[str, str], dotted: str) -> str:
    """The source that gave ``dotted`` (or the block it came in)."""
    while dotted not in origins and "." in dotted:
        dotted = dotted.rpartition(".")[0]
    return origins.get(dotted, "an earlier source")


# Other tools' names that land in a ds_config, each with what it is called here (a nearest name would mislead).
OTHER_TOOLS = {
    "gradient_checkpointing": "Hugging Face's name for activation checkpointing: DeepSpeed's activation_checkpointing "
                              "block, or the job's activation_checkpointing",
}


def _check_top_keys(t: Translation, config: Mapping[str, Any], strict: set[str]) -> None:
    for key in config:
        if key in _KNOWN:
            continue
        name = str(key) if len(str(key)) <= 80 else str(key)[:77] + "..."
        if key in FORMER:
            t.problem(name, f"not a key any more: {FORMER[key]}")
            continue
        typo = difflib.get_close_matches(str(key), _KNOWN, n=1, cutoff=0.8)
        if key in strict or typo:
            near = typo or difflib.get_close_matches(str(key), _KNOWN, n=1, cutoff=0.7)
            t.problem(name, f"unknown key; did you mean {near[0]}?" if near else
                      "unknown key; actorpipe's keys are the spec's sections and fields (python -m schedulers.jobs "
                      "lists them), beside DeepSpeed's")
            continue
        # e.g. "cuda_visible_devices" in DeepSpeedExamples' files: DeepSpeed reads only the keys it knows
        near = difflib.get_close_matches(str(key), _KNOWN, n=1)
        hint = f" ({OTHER_TOOLS[key]})" if key in OTHER_TOOLS else f" (did you mean {near[0]}?)" if near else ""
        t.notice(name, f"not a DeepSpeed or actorpipe key: ignored, as DeepSpeed ignores keys it does not know{hint}")


def _block(t: Translation, config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """One of DeepSpeed's blocks, with its keys checked (``{}`` when absent, or the spec's field of that name)."""
    value = config.get(name, {})
    if name in SHARED and not isinstance(value, Mapping):
        return {}  # e.g. "optimizer": ["torch.optim:Adam", {...}]: the spec's field (spec_keys)
    if not isinstance(value, Mapping):
        t.problem(name, f"expected an object with keys {', '.join(_BLOCKS[name][:5])}, got {show(value)}")
        return {}
    for key in value:
        if key in FIELDS:  # a spec field in DeepSpeed's block: say where it goes
            t.problem(f"{name}.{key}", f"not a key of DeepSpeed's {name} block; actorpipe's is "
                                       f"{FIELDS[key]}.{key} (or {key} at the top)")
        elif key not in _BLOCKS[name]:
            check_keys(t, f"{name}.", {key: None}, _BLOCKS[name])
    return dict(value)


def _batch_sizes(t: Translation, config: Mapping[str, Any], data_parallel: int) -> BatchSizes | None:
    """DeepSpeed's three batch sizes, ``"auto"`` resolved from the others and ``data_parallel``."""
    given: dict[str, int | None] = dict.fromkeys(_BATCH_KEYS)
    autos = [key for key in _BATCH_KEYS if config.get(key) == AUTO]
    problems = len(t.problems)
    for key in _BATCH_KEYS:
        if key not in autos and config.get(key) is not None:
            with t.collecting():
                given[key] = positive_int(config, key, "")
    if len(t.problems) > problems:
        return None
    try:
        sizes = resolve_batch_sizes(train_batch_size=given["train_batch_size"],
                                    micro_batch_size=given["train_micro_batch_size_per_gpu"],
                                    accumulation_steps=given["gradient_accumulation_steps"],
                                    data_parallel=data_parallel)
    except ConfigError as exc:
        if not autos or not exc.problems[0].message.startswith("missing"):
            t.problems.extend(exc.problems)
            return None
        t.problem(autos[0], (
            f"\"auto\" cannot be resolved: give two of {', '.join(_BATCH_KEYS)} (in the job file, --job, or as "
            f"arguments); \"auto\" is filled from them and data_parallel ({data_parallel})"))
        return None
    equation = (f"train_batch_size {sizes.train_batch_size} = micro {sizes.micro_batch_size} * accumulation "
                f"{sizes.accumulation_steps} * data_parallel {data_parallel}")
    for key, value in zip(_BATCH_KEYS, sizes):
        if key in autos:
            t.notice(key, f"\"auto\" is {value} ({equation})")
    t.set("micro_batches", sizes.accumulation_steps, "gradient_accumulation_steps")
    return sizes


def _spec(t: Translation) -> JobSpec:
    """The JobSpec; what no single key shows (e.g. a codec list of the wrong length) names the key that set it."""
    try:
        return JobSpec.from_kwargs(t.fields)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        found = [(m.start(), key) for field, key in t.origins.items()
                 if (m := re.search(rf"\b{field}\b", message)) is not None]
        raise ConfigError(min(found)[1] if found else "config", message) from None


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


def _pipeline_stages(t: Translation, pipeline: Mapping[str, Any]) -> None:
    """DeepSpeed's ``pipeline.stages``: the pipeline stages, or ``"auto"`` (its PipelineModule's)."""
    if "stages" not in pipeline:
        return
    if pipeline["stages"] == AUTO:
        if "pipeline_stages" not in t.fields:
            t.notice("pipeline.stages", "\"auto\" (DeepSpeed: the PipelineModule's stages) and nothing else gives "
                                        "them: 1 stage; give pipeline_stages in the job file to split the model")
        return
    t.set("pipeline_stages", positive_int(pipeline, "stages", "pipeline."), "pipeline.stages")


def _pass_batch_size(t: Translation, config: Mapping[str, Any], train_batch_size: int, field: str) -> None:
    """``train_batch_size`` as a data factory's ``batch_size`` (or the keyword ``batch_size_arg`` names), in
    its keyword arguments ``field`` (``data_kwargs``, or the validation data's ``eval_data_kwargs``)."""
    arg = config.get("batch_size_arg", "batch_size")
    if arg is None:
        return
    if not isinstance(arg, str):
        raise ConfigError("batch_size_arg", f"expected a keyword name or null, got {show(arg)}")
    kwargs = dict(t.fields.get(field, {}))
    given = kwargs.setdefault(arg, train_batch_size)
    where = f"{FIELDS[field]}.{field}"
    if given != train_batch_size:
        raise ConfigError(f"{t.origins.get(field, where)}.{arg}", (
            f"expected {train_batch_size} (train_batch_size: one global batch per step), got {show(given)}; "
            "leave it out and it is filled in"))
    t.fields[field] = kwargs
    t.origins.setdefault(field, where)
