"""In-memory snapshots of a stage's parameters and optimizer state, to recover a lost stage.

A snapshot is a flat map of tensors (nothing else travels): ``model/3.fc1.weight`` for
each held layer's state, ``optim/I/NAME`` for the optimizer's per-parameter state (I
counts the optimizer's parameters in group order), and ``optimpy/I/NAME`` for state
kept as a Python number. It restores into a stage built from the same configuration:
the one that took it, rolled back, or its replacement on another node.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["SnapshotShelf", "capture", "restore"]


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def capture(held: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """A copy of the held layers' state and the optimizer's, detached from the live tensors."""
    snapshot = {f"model/{i}.{key}": value.detach().clone()
                for i, layer in held.items() for key, value in layer.state_dict().items()}
    for index, param in enumerate(_parameters(optimizer)):
        for name, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                snapshot[f"optim/{index}/{name}"] = value.detach().clone()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                dtype = torch.int64 if isinstance(value, int) else torch.float64
                snapshot[f"optimpy/{index}/{name}"] = torch.tensor(value, dtype=dtype)
    return snapshot


def restore(held: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer,
            snapshot: Mapping[str, torch.Tensor]) -> None:
    """Puts a :func:`capture` back: every held layer's state and the optimizer's, exactly.

    Raises:
        ValueError: the snapshot does not fit these layers (a key missing or unknown, a
            shape that differs); nothing is changed then.
    """
    model = {k.removeprefix("model/"): v for k, v in snapshot.items() if k.startswith("model/")}
    live = {f"{i}.{key}": value for i, layer in held.items() for key, value in layer.state_dict().items()}
    if set(model) != set(live):
        raise ValueError(f"the snapshot does not fit this stage: missing {sorted(set(live) - set(model))[:5]}, "
                         f"unknown {sorted(set(model) - set(live))[:5]}")
    wrong = [k for k, v in model.items() if v.shape != live[k].shape]
    if wrong:
        raise ValueError(f"the snapshot's shapes differ from this stage's for {wrong[:5]}")
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
        state = optimizer.state.setdefault(params[int(index)], {})
        state[name] = value.clone() if kind == "optim" else value.item()
    for param in params:
        param.grad = None


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
