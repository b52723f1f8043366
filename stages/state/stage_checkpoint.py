"""What one stage actor writes into a checkpoint, and how it checks and then applies its part on load.

A stage's tensors are its held layers' state (parameters and buffers) and its
optimizer's state per parameter, under the unpartitioned model's keys; its
learning-rate schedule's state is plain data that goes into the manifest. A
tensor-parallel rank writes its own slices of split tensors; replicated ones are
written by tensor rank 0 alone. Loading is two calls: :func:`prepare_load` reads,
verifies and reshapes everything into memory and reports every problem without
touching the model; :func:`apply_load` then only copies. Both run on the stage's
compute thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from stages.state import lr_scheduler as _lr_scheduler
from stages.comm.device_io import DeviceIO, copy_to_cpu
from stages.state.quantized_adam import checkpoint_state, encode_loaded
from stages.state.checkpoint import CheckpointError, Manifest, TensorEntry, check_staging, dtype_name, read_entry, write_tensors
from stages.state.manifest import DTYPES, FORMAT
from stages.build.tensor_parallel import ShardSpec, shard_tensor

__all__ = ["PreparedLoad", "apply_load", "prepare_load", "whole_shape", "write_stage"]


Key = Callable[[int, str], str]  # (held layer, its own name) -> the name in the whole model


def layer_key(layer: int, name: str) -> str:
    """A Sequential's naming: ``3.fc1.weight``."""
    return f"{layer}.{name}"


def _named_parameters(held: Mapping[int, nn.Module], key: Key) -> dict[str, nn.Parameter]:
    return {key(i, name): p for i, layer in held.items() for name, p in layer.named_parameters()}


def whole_shape(local: torch.Size | list[int], spec: ShardSpec | None) -> list[int]:
    """The unpartitioned shape of a tensor-parallel slice (each rank holds 1/world along ``dim``)."""
    shape = list(local)
    if spec is not None:
        shape[spec.dim] *= spec.world
    return shape


def _state_spec(value: torch.Tensor, param: nn.Parameter, spec: ShardSpec | None) -> ShardSpec | None:
    """An optimizer state tensor is split like its parameter when it has the parameter's shape (``exp_avg``)."""
    return spec if spec is not None and value.shape == param.shape else None


def write_stage(
    staging: str, file: str, held: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer,
    specs: Mapping[str, ShardSpec], tp_rank: int, key: Key = layer_key, *, model: bool = True,
    optimizer_state: bool = True, scheduler: LRScheduler | None = None, io: DeviceIO | None = None,
) -> dict[str, Any]:
    """Writes this stage's tensors to ``staging/file``; returns what the manifest needs of them
    (and, under ``lr_scheduler``, the schedule's state or None).

    Args:
        model: write the held layers' state too; without it, the optimizer state alone
            (a data-parallel replica other than 0 with ZeRO-1: its shard's).
        optimizer_state: write the optimizer's state (and the schedule's); without it, the weights alone.
        io: the stage's device copies: from a GPU, every tensor moves to the CPU once, in
            pinned chunks, before anything is written.

    Raises:
        CheckpointError: the directory is not visible here, or the optimizer keeps state
            that is not a tensor.
    """
    path = check_staging(staging, file)
    items: list[tuple[str, str | None, torch.Tensor, ShardSpec | None]] = [
        (key(i, name), None, value, specs.get(key(i, name)))
        for i, layer in held.items() for name, value in layer.state_dict().items() if model]
    for whole, param in _named_parameters(held, key).items() if optimizer_state else ():
        for name, value in checkpoint_state(optimizer, param).items():
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"cannot checkpoint the optimizer state {name!r} of {whole}",
                                      [f"it is a {type(value).__name__}; only tensors are stored"])
            items.append((whole, name, value, _state_spec(value, param, specs.get(whole))))
    mine = [item for item in items if item[3] is not None or tp_rank == 0]  # replicated: rank 0 writes
    host = copy_to_cpu([value for _, _, value, _ in mine], io)
    names = [key if name is None else f"{key}/{name}" for key, name, _, _ in mine]  # exp_avg: 3.fc1.weight/exp_avg
    size, parts = write_tensors(path, dict(zip(names, host)))
    tensors = [{"key": key, "state": name, "shape": whole_shape(value.shape, spec), "dtype": dtype_name(value.dtype),
                "shard": list(spec) if spec is not None else None, "rank": tp_rank,
                "part": parts[stored].to_wire()}
               for stored, (key, name, value, spec) in zip(names, mine)]
    schedule = _lr_scheduler.scheduler_state(scheduler) if scheduler is not None and optimizer_state else None
    return {"file": file, "bytes": size, "tensors": tensors, "lr_scheduler": schedule}


@dataclass(slots=True)
class PreparedLoad:
    """A stage's verified part of a checkpoint, ready to copy: per layer, per parameter's optimizer state,
    and the learning-rate schedule's state (None: leave the schedule as it is)."""

    model: dict[int, dict[str, torch.Tensor]]
    optimizer_state: dict[str, dict[str, torch.Tensor]]
    lr_scheduler: dict[str, Any] | None = None


def _local(
    version: str, plan: Manifest, label: str, entry: TensorEntry, shape: list[int], dtype: str | None,
    spec: ShardSpec | None, tp_rank: int, problems: list[str],
) -> torch.Tensor | None:
    """This rank's slice of one checked entry, or None after adding what is wrong to ``problems``.

    Weights as another tool keeps them (safetensors, DCP) in another floating dtype than the model's are
    cast to the model's, as ``from_pretrained(..., dtype=...)`` casts them (a bf16 Llama into a float32
    model); this project's own checkpoints hold what the job held, and another dtype there is refused."""
    wrong = []
    cast = None
    if dtype is not None and entry.dtype != dtype:
        if plan.source != FORMAT and DTYPES[entry.dtype].is_floating_point and DTYPES[dtype].is_floating_point:
            cast = DTYPES[dtype]
        else:
            wrong.append(f"{label}: dtype {entry.dtype} in the checkpoint, {dtype} in this model")
    if entry.shape != shape:
        wrong.append(f"{label}: shape {entry.shape} in the checkpoint, {shape} in this model")
    if wrong:  # not read at all: its bytes would not fit
        problems.extend(wrong)
        return None
    try:
        whole = read_entry(version, entry, plan.files, label, plan.source, plan.links)
    except CheckpointError as exc:
        problems.extend(exc.problems or [str(exc)])
        return None
    if cast is not None:
        whole = whole.to(cast)
    return shard_tensor(whole, tp_rank, spec) if spec is not None else whole


def prepare_load(
    version: str, plan: Manifest, held: Mapping[int, nn.Module], specs: Mapping[str, ShardSpec], tp_rank: int,
    key: Key = layer_key, *, owns: Callable[[torch.Tensor], bool] | None = None, scheduler: LRScheduler | None = None,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> tuple[PreparedLoad, list[str]]:
    """Reads and checks this stage's part of a checkpoint; changes nothing.

    Every key of the held layers must be in ``plan`` and every key of ``plan`` in them,
    with the model's whole shape and dtype and a matching checksum; optimizer state
    must belong to a held parameter and have its shape, or be a scalar; a schedule's
    state must fit ``scheduler`` (a plan without one leaves the schedule as it is).

    Args:
        owns: with ZeRO-1, whether this replica keeps a parameter's optimizer state;
            the state of the others is not read (their owners read and check it).
        aliases: a tied tensor's name -> its other names: a key the plan lacks is read
            under one of those (Hugging Face's files keep a tied head under its embedding's
            name alone), and such an entry is no stranger to this model.

    Returns:
        The prepared tensors, and every problem found (empty: it may be applied).
    """
    problems: list[str] = []
    own = {key(i, k): v for i, layer in held.items() for k, v in layer.state_dict().items()}
    where = {key(i, k): (i, k) for i, layer in held.items() for k in layer.state_dict()}
    entries = dict(plan.model)
    for name in sorted(own.keys() - entries.keys()):
        found = next((other for other in (aliases or {}).get(name, ()) if other in plan.model), None)
        if found is not None:
            entries[name] = plan.model[found]
    known = own.keys() | {other for name in own for other in (aliases or {}).get(name, ())}
    plan = dataclasses.replace(plan, model={k: e for k, e in entries.items() if k in own or k not in known})
    problems += [f"{k}: missing from the checkpoint" for k in sorted(own.keys() - plan.model.keys())]
    problems += [f"{k}: in the checkpoint but not in this model" for k in sorted(plan.model.keys() - own.keys())]
    model: dict[int, dict[str, torch.Tensor]] = {}
    for name in sorted(own.keys() & plan.model.keys()):
        spec = specs.get(name)
        local = _local(version, plan, name, plan.model[name], whole_shape(own[name].shape, spec),
                       dtype_name(own[name].dtype), spec, tp_rank, problems)
        if local is not None:
            layer, own_name = where[name]
            model.setdefault(layer, {})[own_name] = local
    params = _named_parameters(held, key)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, saved in plan.optimizer_state.items():
        param = params.get(name)
        if param is None:
            problems.append(f"{name}: optimizer state for a parameter this model does not have")
            continue
        if owns is not None and not owns(param):
            continue
        whole = whole_shape(param.shape, specs.get(name))
        for state_name, entry in saved.items():
            label = f"{name} (optimizer {state_name})"
            if entry.shape not in (whole, []):
                problems.append(f"{label}: shape {entry.shape} fits neither the parameter's {whole} nor a scalar")
                continue
            spec = specs.get(name) if entry.shape == whole else None  # exp_avg is split like its parameter
            local = _local(version, plan, label, entry, entry.shape, None, spec, tp_rank, problems)
            if local is not None:
                state.setdefault(name, {})[state_name] = local
    schedule = plan.lr_scheduler["state"] if plan.lr_scheduler is not None and scheduler is not None else None
    if schedule is not None:
        assert scheduler is not None
        problems += _lr_scheduler.check_state(scheduler, schedule)
    return PreparedLoad(model=model, optimizer_state=state, lr_scheduler=schedule), problems


def _to_device(prepared: PreparedLoad, io: DeviceIO, *, weights_only: bool) -> PreparedLoad:
    """``prepared`` with its tensors on ``io``'s device (optimizer scalars, such as Adam's step, stay on the CPU)."""
    slots: list[tuple[dict[str, torch.Tensor], str]] = [(mine, name) for mine in prepared.model.values() for name in mine]
    if not weights_only:
        slots += [(saved, name) for saved in prepared.optimizer_state.values() for name, v in saved.items() if v.dim()]
    model = {i: dict(mine) for i, mine in prepared.model.items()}
    state = {k: dict(saved) for k, saved in prepared.optimizer_state.items()}
    copies = {id(prepared.model[i]): model[i] for i in prepared.model}
    copies.update({id(prepared.optimizer_state[k]): state[k] for k in prepared.optimizer_state})
    for (mine, name), moved in zip(slots, io.copy_to_device([mine[name] for mine, name in slots])):
        copies[id(mine)][name] = moved
    return PreparedLoad(model=model, optimizer_state=state, lr_scheduler=prepared.lr_scheduler)


def apply_load(
    prepared: PreparedLoad, held: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer, *, weights_only: bool,
    key: Key = layer_key, scheduler: LRScheduler | None = None, io: DeviceIO | None = None,
) -> None:
    """Copies a prepared, checked load into the layers (and, unless ``weights_only``, the optimizer and
    the schedule).

    Args:
        io: the stage's device copies: on a GPU, every tensor crosses to the device once, in
            pinned chunks, before it is copied into place.
    """
    if io is not None and io.staged:
        prepared = _to_device(prepared, io, weights_only=weights_only)
    for i, mine in prepared.model.items():
        held[i].load_state_dict(mine, strict=True)
    if weights_only:
        return
    params = _named_parameters(held, key)
    optimizer.state.clear()  # a parameter the checkpoint has no state for starts afresh, as it did then
    for name, saved in prepared.optimizer_state.items():
        param = params[name]
        optimizer.state[param] = {name: value.to(param.device) if value.dim() else value
                                  for name, value in saved.items()}
    encode_loaded(optimizer)  # quantized moments: stored as float32, held in their own precision
    if scheduler is not None and prepared.lr_scheduler is not None:  # it sets the groups' current rates
        _lr_scheduler.load_state(scheduler, prepared.lr_scheduler)
