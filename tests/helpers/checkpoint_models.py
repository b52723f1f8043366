"""Model factories for the checkpoint tests: stacks of linears whose shapes and dtypes a test picks."""

from __future__ import annotations

import torch
from torch import nn


def linears(dims: list[int], bias: bool = True, dtype: str = "float32") -> nn.Sequential:
    """``Linear(dims[0] -> dims[1]), Linear(dims[1] -> dims[2]), ...``: one layer per step of ``dims``.

    Changing one width changes the shapes of exactly the layers next to it, so a test can
    make a checkpoint that differs from a model in one known place.
    """
    layers = [nn.Linear(a, b, bias=bias, dtype=getattr(torch, dtype)) for a, b in zip(dims, dims[1:])]
    return nn.Sequential(*layers)
