"""In-memory snapshots of a stage's parameters and optimizer state, to recover a lost stage.

A snapshot is a flat map of tensors (nothing else travels): ``model/3.fc1.weight`` for
each held layer's state, ``optim/I/NAME`` for the optimizer's per-parameter state (I
counts the optimizer's parameters in group order), ``optimpy/I/NAME`` for state
kept as a Python number, ``lr_scheduler/state`` for the learning-rate schedule's
position and the groups' current rates (JSON bytes, see :mod:`stages.state.lr_scheduler`),
and ``rng/cpu`` (``rng/cuda``) for the random state dropout draws from, so that a replay
draws the masks the first run drew.
It restores into a stage built from the same configuration: the one that took it,
rolled back, or its replacement on another node.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from stages.state import lr_scheduler as _lr_scheduler

__all__ = ["SnapshotShelf", "capture", "restore"]


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


_SCHEDULE = "lr_scheduler/state"
_RNG_CPU, _RNG_CUDA = "rng/cpu", "rng/cuda"


def _cuda_device(held: Mapping[int, nn.Module]) -> torch.device | None:
    device = next((p.device for layer in held.values() for p in layer.parameters()), None)
    return device if device is not None and device.type == "cuda" else None


def capture(held: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer,
            scheduler: LRScheduler | None = None) -> dict[str, torch.Tensor]:
    """A copy of the held layers' state, the optimizer's and the schedule's, detached from the live ones."""
    snapshot = {f"model/{i}.{key}": value.detach().clone()
                for i, layer in held.items() for key, value in layer.state_dict().items()}
    for index, param in enumerate(_parameters(optimizer)):
        for name, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                snapshot[f"optim/{index}/{name}"] = value.detach().clone()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                dtype = torch.int64 if isinstance(value, int) else torch.float64
                snapshot[f"optimpy/{index}/{name}"] = torch.tensor(value, dtype=dtype)
    if scheduler is not None:
        snapshot[_SCHEDULE] = _lr_scheduler.encode_state(_lr_scheduler.scheduler_state(scheduler))
    # Dropout's masks come from the process's generator: without it a replayed step drew other masks than the
    # step it replays (a replacement starts from the seed, the survivors from where they had got to).
    snapshot[_RNG_CPU] = torch.get_rng_state()
    if (device := _cuda_device(held)) is not None:
        snapshot[_RNG_CUDA] = torch.cuda.get_rng_state(device)
    return snapshot


def restore(held: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer,
            snapshot: Mapping[str, torch.Tensor], scheduler: LRScheduler | None = None) -> None:
    """Puts a :func:`capture` back: every held layer's state, the optimizer's and the schedule's, exactly.

    Raises:
        ValueError: the snapshot does not fit these layers (a key missing or unknown, a
            shape that differs) or this schedule; nothing is changed then.
    """
    model = {k.removeprefix("model/"): v for k, v in snapshot.items() if k.startswith("model/")}
    live = {f"{i}.{key}": value for i, layer in held.items() for key, value in layer.state_dict().items()}
    if set(model) != set(live):
        raise ValueError(f"the snapshot does not fit this stage: missing {sorted(set(live) - set(model))[:5]}, "
                         f"unknown {sorted(set(model) - set(live))[:5]}")
    wrong = [k for k, v in model.items() if v.shape != live[k].shape]
    if wrong:
        raise ValueError(f"the snapshot's shapes differ from this stage's for {wrong[:5]}")
    schedule: Any = None
    if scheduler is not None:
        if _SCHEDULE not in snapshot:
            raise ValueError("the snapshot holds no learning-rate schedule, and this stage has one")
        schedule = _lr_scheduler.decode_state(snapshot[_SCHEDULE])
        problems = _lr_scheduler.check_state(scheduler, schedule)
        if problems:
            raise ValueError(f"the snapshot's schedule does not fit this stage's: {'; '.join(problems[:3])}")
    params = _parameters(optimizer)
    with torch.no_grad():
        for key, value in model.items():
            live[key].copy_(value)
    optimizer.state.clear()
    for key, value in snapshot.items():
        kind, _, rest = key.partition("/")
        if kind not in ("optim", "optimpy"):
            continue
        index, _, name = rest.partition("/")
        param = params[int(index)]
        state = optimizer.state.setdefault(param, {})
        # A snapshot lives on the host; a scalar (Adam's step) stays there, as the optimizer keeps it.
        state[name] = (value.to(param.device, copy=True) if value.dim() else value.clone()) if kind == "optim" \
            else value.item()
    for param in params:
        param.grad = None
    if scheduler is not None:  # after the optimizer: the schedule sets its groups' rates
        _lr_scheduler.load_state(scheduler, schedule)
    if _RNG_CPU in snapshot:  # a snapshot taken before the random state was kept has none
        torch.set_rng_state(snapshot[_RNG_CPU])
    if _RNG_CUDA in snapshot and (device := _cuda_device(held)) is not None:
        torch.cuda.set_rng_state(snapshot[_RNG_CUDA], device)


class SnapshotShelf:
    """The newest snapshots by index, ``keep`` of them (older ones are dropped as new ones come)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._items: dict[int, dict[str, torch.Tensor]] = {}

    def put(self, index: int, snapshot: dict[str, torch.Tensor]) -> None:
        self._items[index] = snapshot
        for old in sorted(self._items)[:-self.keep]:
            del self._items[old]

    def get(self, index: int) -> dict[str, torch.Tensor]:
        try:
            return self._items[index]
        except KeyError:
            raise KeyError(f"no snapshot of step {index}; have {sorted(self._items)}") from None

    def indices(self) -> list[int]:
        return sorted(self._items)

    def __contains__(self, index: object) -> bool:
        return index in self._items
