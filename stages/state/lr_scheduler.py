"""A stage's learning-rate schedule: built from ``(path, kwargs)``, and its state kept and put back exactly.

Any ``torch.optim.lr_scheduler.LRScheduler`` class (or a factory that returns one,
called with the optimizer and the kwargs) drives the optimizer's parameter groups;
DeepSpeed's schedules live in :mod:`stages.state.lr`, which every node admits as its own
code, whatever its allow-list says (only the schedule classes defined there).

The state is plain data (JSON and msgpack carry it: numbers, strings, lists, maps):
the scheduler's ``state_dict`` and, per parameter group, the values a schedule
moves (``lr``; ``momentum`` or ``betas`` when it cycles momentum), since torch keeps
the current rate in the optimizer's groups, not in the scheduler.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from actors._errors import NotAllowed
from actors._registry import is_allowed, load_object

__all__ = ["BUILTIN_SCHEDULES", "build_scheduler", "check_state", "decode_state", "encode_state", "learning_rates",
           "load_schedule", "load_state", "scheduler_state"]

BUILTIN_SCHEDULES = "stages.state.lr"  # admitted on every node, for schedule classes only
_MAX_STATE_BYTES = 1 << 20  # a schedule's state is a few numbers per group; a bound for what comes from outside


def load_schedule(path: str, allow: Iterable[str]) -> Any:
    """The schedule class (or factory) ``path`` names, by the node's allow-list or as one of actorpipe's own.

    A path into :mod:`stages.state.lr` is looked up with that module alone admitted, and
    must name an ``LRScheduler`` class defined there; every other path follows the
    allow-list as any factory does (:func:`~actors._registry.load_object`).

    Raises:
        NotAllowed, ValueError, ImportError, AttributeError: as ``load_object``, or a
            name in ``stages.state.lr`` that is not a schedule.
    """
    allow = tuple(allow)
    if not isinstance(path, str) or path.partition(":")[0] != BUILTIN_SCHEDULES or is_allowed(BUILTIN_SCHEDULES,
                                                                                               allow):
        return load_object(path, allow)
    found = load_object(path, (BUILTIN_SCHEDULES,))
    if not (isinstance(found, type) and issubclass(found, LRScheduler)):
        raise NotAllowed(f"{path[:120]!r} is not a learning-rate schedule; {BUILTIN_SCHEDULES} offers "
                         "WarmupLR, WarmupDecayLR, WarmupCosineLR and OneCycle")
    return found


def build_scheduler(spec: list[Any] | tuple[Any, ...], optimizer: torch.optim.Optimizer,
                    allow: Iterable[str]) -> LRScheduler:
    """The schedule ``spec = [path, kwargs]`` names, driving ``optimizer``; checked before the first step.

    Raises:
        ValueError: kwargs the schedule refuses, a factory that returns something else,
            ``ReduceLROnPlateau`` (it steps on a metric), or state that is not plain
            data (it could not be checkpointed); each message names the schedule.
        NotAllowed: the path is outside the node's allow-list.
    """
    path, kwargs = spec[0], dict(spec[1] if len(spec) > 1 else {})
    factory = load_schedule(path, allow)
    if isinstance(factory, type) and issubclass(factory, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(f"lr_scheduler {path}: ReduceLROnPlateau steps on a validation metric, which a job "
                         "does not have; use a schedule that steps with the optimizer")
    try:
        scheduler = factory(optimizer, **kwargs)
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"lr_scheduler {path} with {sorted(kwargs)}: {type(exc).__name__}: {exc}") from None
    if not isinstance(scheduler, LRScheduler):
        raise ValueError(f"lr_scheduler {path} made a {type(scheduler).__name__}, not a "
                         "torch.optim.lr_scheduler.LRScheduler")
    try:
        encode_state(scheduler_state(scheduler))
    except ValueError as exc:
        raise ValueError(f"lr_scheduler {path} cannot be checkpointed: {exc}") from None
    return scheduler


def learning_rates(optimizer: torch.optim.Optimizer) -> list[float]:
    """Each parameter group's current learning rate."""
    return [float(group["lr"]) for group in optimizer.param_groups]


def _group_keys(scheduler: LRScheduler) -> tuple[str, ...]:
    return ("lr", "momentum", "betas") if getattr(scheduler, "cycle_momentum", False) else ("lr",)


def _plain(value: Any, where: str) -> Any:
    """``value`` as plain data (tuples become lists), or ValueError naming where it is not."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
    raise ValueError(f"{where} is a {type(value).__name__}, not plain data")


def scheduler_state(scheduler: LRScheduler) -> dict[str, Any]:
    """Everything that continues the schedule exactly: ``{"scheduler": ..., "groups": [...]}``, plain data.

    Raises:
        ValueError: the scheduler keeps something that is not plain data.
    """
    groups = [{key: _plain(group[key], f"param group {i} {key}") for key in _group_keys(scheduler) if key in group}
              for i, group in enumerate(scheduler.optimizer.param_groups)]
    return {"scheduler": _plain(scheduler.state_dict(), "state"), "groups": groups}


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return "number"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def _like(given: Any, live: Any) -> Any:
    """``given`` in the live value's container types (a tuple stays a tuple), recursively."""
    if isinstance(live, tuple) and isinstance(given, list):
        return tuple(_like(g, w) for g, w in zip(given, live)) if len(given) == len(live) else tuple(given)
    if isinstance(live, list) and isinstance(given, list) and len(given) == len(live):
        return [_like(g, w) for g, w in zip(given, live)]
    if isinstance(live, dict) and isinstance(given, dict):
        return {k: _like(v, live[k]) if k in live else v for k, v in given.items()}
    if isinstance(live, float) and isinstance(given, int) and not isinstance(given, bool):
        return float(given)
    return given


def check_state(scheduler: LRScheduler, state: Any) -> list[str]:
    """What keeps ``state`` (from a checkpoint or a snapshot) from fitting ``scheduler``; empty: it fits.

    Only keys the live scheduler has may be set, each with a value of the same kind, so
    that a state from elsewhere cannot reach the scheduler's optimizer or add attributes.
    """
    if not isinstance(state, dict) or set(state) != {"scheduler", "groups"}:
        return ["the learning-rate schedule's state is not a map of scheduler and groups"]
    saved, groups = state["scheduler"], state["groups"]
    live = scheduler.state_dict()
    problems: list[str] = []
    if not isinstance(saved, dict):
        return ["the learning-rate schedule's scheduler state is not a map"]
    for key, value in saved.items():
        if key not in live:
            problems.append(f"learning-rate schedule: {str(key)[:40]!r} is not part of {type(scheduler).__name__}'s "
                            "state (another schedule?)")
        elif value is not None and live[key] is not None and _kind(value) != _kind(live[key]):
            problems.append(f"learning-rate schedule: {key} is a {_kind(value)}, {type(scheduler).__name__} keeps "
                            f"a {_kind(live[key])}")
    param_groups = scheduler.optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(param_groups):
        problems.append(f"learning-rate schedule: state for {len(groups) if isinstance(groups, list) else '?'} "
                        f"parameter groups, the optimizer has {len(param_groups)} (no_weight_decay makes two: "
                        "resume with the setting the checkpoint was written with, or load its weights only)")
        return problems
    for i, (values, group) in enumerate(zip(groups, param_groups)):
        if not isinstance(values, dict):
            problems.append(f"learning-rate schedule: param group {i} is not a map")
            continue
        for key, value in values.items():
            if key not in _group_keys(scheduler) or key not in group:
                problems.append(f"learning-rate schedule: param group {i} has no {str(key)[:40]!r} to set")
            elif _kind(value) != _kind(group[key]) or (isinstance(value, float) and not math.isfinite(value)):
                problems.append(f"learning-rate schedule: param group {i} {key} = {str(value)[:40]}")
    return problems


def load_state(scheduler: LRScheduler, state: Mapping[str, Any]) -> None:
    """Puts a :func:`scheduler_state` back: the schedule's position and the groups' current values.

    Raises:
        ValueError: the state does not fit (see :func:`check_state`); nothing is changed then.
    """
    problems = check_state(scheduler, state)
    if problems:
        raise ValueError("; ".join(problems[:5]))
    live = scheduler.state_dict()
    scheduler.load_state_dict({key: _like(value, live[key]) for key, value in state["scheduler"].items()})
    for values, group in zip(state["groups"], scheduler.optimizer.param_groups):
        for key, value in values.items():
            if isinstance(group[key], torch.Tensor):
                group[key].fill_(value)
            else:
                group[key] = _like(value, group[key])


def encode_state(state: Mapping[str, Any]) -> torch.Tensor:
    """The state as a tensor of JSON bytes, for a snapshot (a flat map of tensors).

    Raises:
        ValueError: not plain data.
    """
    try:
        text = json.dumps(state, allow_nan=True)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def decode_state(tensor: torch.Tensor) -> Any:
    """What :func:`encode_state` made (checked by :func:`check_state` before use).

    Raises:
        ValueError: not a uint8 vector of JSON, or over a megabyte.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1 or \
            tensor.numel() > _MAX_STATE_BYTES:
        raise ValueError("a learning-rate schedule's state travels as a uint8 vector of JSON under 1 MiB")
    try:
        return json.loads(tensor.numpy().tobytes().decode())
    except ValueError as exc:
        raise ValueError(f"the learning-rate schedule's state is not JSON: {str(exc)[:80]}") from None
