"""A model given as layer specs: each stage builds only the layers it holds.

A factory that returns an ``nn.Sequential`` is called whole on every stage, which then
keeps its slice: a model of N bytes needs N bytes in every stage's process to start.
A factory that returns a list of :class:`LayerSpec` instead (DeepSpeed's
``PipelineModule(layers=[LayerSpec(...)])`` is the same idea) names each layer's class
and arguments without building it. A stage builds its own layers for real and every
other layer on the meta device (its shape, no memory), so a stage holds its slice from
the start, and a model no single process could hold trains across stages.

Initialization is defined per layer, so it does not depend on the layout: layer ``i``
is built right after ``torch.manual_seed(layer_seed(seed, i))``, on whichever stage
holds it. :func:`layered_model` builds the same weights in one process, to start a
reference run (or an evaluation) from exactly the weights a job starts from.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["LayerSpec", "build_specs", "is_layer_specs", "layer_seed", "layered_model"]


class LayerSpec:
    """One layer of a model, by its class (or any callable returning an ``nn.Module``) and arguments.

    ``LayerSpec(nn.Linear, 2048, 2048, bias=False)`` builds ``nn.Linear(2048, 2048, bias=False)``
    where it is needed, and nowhere else. The arguments travel nowhere: the factory that
    returns the specs runs on each stage's node.
    """

    __slots__ = ("builder", "args", "kwargs")

    def __init__(self, builder: Callable[..., nn.Module], /, *args: Any, **kwargs: Any) -> None:
        if not callable(builder):
            raise TypeError(f"LayerSpec takes a module class or a function that builds one, got {builder!r:.80}")
        self.builder = builder
        self.args = args
        self.kwargs = kwargs

    def build(self) -> nn.Module:
        """The layer, on torch's current default device.

        Raises:
            TypeError: the builder returned something that is not an ``nn.Module``.
        """
        layer = self.builder(*self.args, **self.kwargs)
        if not isinstance(layer, nn.Module):
            raise TypeError(f"LayerSpec({self.name}) built a {type(layer).__name__}, not an nn.Module")
        return layer

    @property
    def name(self) -> str:
        return getattr(self.builder, "__qualname__", type(self.builder).__name__)

    def __repr__(self) -> str:
        return f"LayerSpec({self.name}, ...)"


def is_layer_specs(built: Any) -> bool:
    """Whether a factory's result is a model given as layer specs (a non-empty list or tuple of them)."""
    return isinstance(built, (list, tuple)) and bool(built) and all(isinstance(s, LayerSpec) for s in built)


def layer_seed(seed: int, index: int) -> int:
    """The seed layer ``index`` of a job seeded ``seed`` is built under: the first 63 bits of
    SHA-256 of ``"seed:index"``, so that neighbouring seeds and layers share no stream."""
    digest = hashlib.sha256(f"{int(seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def build_specs(specs: Sequence[LayerSpec], seed: int, held: Collection[int] | None = None) -> list[nn.Module]:
    """Every layer of ``specs``: those in ``held`` (all, for None) built for real under their
    :func:`layer_seed`, the rest on the meta device (their shapes, no memory, no random numbers).

    The caller's random state is left as it was.
    """
    layers = []
    with torch.random.fork_rng(devices=[]):
        for index, spec in enumerate(specs):
            if held is None or index in held:
                torch.manual_seed(layer_seed(seed, index))
                layers.append(spec.build())
            else:
                with torch.device("meta"):
                    layers.append(spec.build())
    return layers


def layered_model(specs: Sequence[LayerSpec], seed: int) -> nn.Sequential:
    """The whole model in one process, with exactly the weights a job seeded ``seed`` starts from."""
    if not is_layer_specs(specs):
        raise TypeError("layered_model takes a non-empty list of LayerSpec")
    return nn.Sequential(*build_specs(specs, seed))
