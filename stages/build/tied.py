"""Parameters tied across pipeline stages (shared embeddings and the like).

One process holds a tied parameter once and autograd sums both uses' gradients into
it. Split across stages, each stage holding one of the layers that share it builds
its own copy; left alone the copies would each follow their own gradient and come
apart. The stages that hold a group therefore add their gradients (in rank order, so
every copy gets the same bits) before any optimizer step, as DeepSpeed's tied-layer
groups and Megatron's embedding group do: the copies start equal (same seed) and
stay equal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["TiedGroup", "TiedSync", "summed", "tied_for_rank", "tied_groups"]


@dataclass(frozen=True, slots=True)
class TiedGroup:
    """One shared tensor as this rank sees it."""

    names: tuple[str, ...]  # every name the model gives it ("0.weight", "5.out.weight"), in layer order
    ranks: tuple[int, ...]  # the pipeline ranks holding one of those layers, ascending
    param: nn.Parameter  # this rank's copy

    @property
    def name(self) -> str:
        return self.names[0]


def tied_groups(layers: Sequence[nn.Module]) -> list[list[str]]:
    """The names (``"LAYER.param"``) of each parameter more than one layer holds, one list a tensor."""
    seen: dict[int, list[str]] = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters(remove_duplicate=False):
            names = seen.setdefault(id(param), [])
            key = f"{index}.{name}"
            if key not in names:
                names.append(key)
    return [names for names in seen.values() if len({n.partition(".")[0] for n in names}) > 1]


def tied_for_rank(layers: Sequence[nn.Module], rank_of_layer: Callable[[int], int], rank: int,
                  held: Mapping[int, nn.Module]) -> list[TiedGroup]:
    """The groups ``rank`` must sum with other ranks: those whose layers sit on more than one rank."""
    groups = []
    for names in tied_groups(layers):
        ranks = tuple(sorted({rank_of_layer(int(n.partition(".")[0])) for n in names}))
        mine = [n for n in names if int(n.partition(".")[0]) in held]
        if len(ranks) < 2 or not mine:
            continue
        layer, _, attribute = mine[0].partition(".")
        param = held[int(layer)].get_parameter(attribute)
        groups.append(TiedGroup(names=tuple(names), ranks=ranks, param=param))
    return groups


def summed(parts: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """The sum of each rank's gradient, always added in rank order (the same bits on every rank)."""
    ranks = sorted(parts)
    total = parts[ranks[0]].clone()
    for rank in ranks[1:]:
        total += parts[rank]
    return total


Send = Callable[[int, int, str, torch.Tensor], Awaitable[None]]  # (to rank, step, group name, gradient)


@dataclass(slots=True)
class TiedSync:
    """One stage's side of the sums: what it sends, and the other ranks' gradients as they come."""

    rank: int
    groups: list[TiedGroup]
    _inbox: dict[tuple[int, str, int], asyncio.Future[torch.Tensor]] = field(default_factory=dict)

    async def sum(self, step: int, send: Send) -> None:
        """Sends this rank's gradient of every group to the other holders and sets the sum as ``.grad``."""
        for group in self.groups:
            grad = group.param.grad
            mine = (grad if grad is not None else torch.zeros_like(group.param)).detach().cpu()
            others = [r for r in group.ranks if r != self.rank]
            await asyncio.gather(*(send(r, step, group.name, mine) for r in others))
            parts = {self.rank: mine}
            for r in others:
                parts[r] = await self._part(step, group.name, r)
            total = summed(parts).to(group.param.device)
            if group.param.grad is None:
                group.param.grad = total
            else:
                group.param.grad.copy_(total)
        self._inbox = {k: v for k, v in self._inbox.items() if k[0] > step}

    def receive(self, step: int, current: int, name: object, rank: object, grad: object) -> None:
        """Another rank's gradient of group ``name`` for step ``step`` (this stage is at ``current``).

        Raises:
            ValueError: not one this rank expects: another step, group, rank or shape, or twice.
        """
        group = next((g for g in self.groups if g.name == name), None)
        if group is None or step != current or rank not in group.ranks or rank == self.rank \
                or not isinstance(grad, torch.Tensor) or grad.shape != group.param.shape \
                or grad.dtype != group.param.dtype:
            raise ValueError(f"rank {self.rank} (step {current}) expects no tied gradient {str(name)[:60]!r} of "
                             f"step {str(step)[:12]} from rank {str(rank)[:12]}")
        assert isinstance(rank, int) and isinstance(name, str)
        future = self._part(step, name, rank)
        if future.done():
            raise ValueError(f"tied gradient {name!r} of step {step} from rank {rank} came twice")
        future.set_result(grad)

    def _part(self, step: int, name: str, rank: int) -> asyncio.Future[torch.Tensor]:
        return self._inbox.setdefault((step, name, rank), asyncio.get_running_loop().create_future())
