"""A module an allow-list admits that re-exports what it must not hand out (tests/actors/test_registry.py).

``load_object`` must refuse every name here that is not defined in this module, and
every route through it to ``os.system``; it must accept the factories defined here.
"""

from __future__ import annotations

import functools
import os
import os.path
from os import system
from typing import Any

from torch import nn

run = system  # a built-in from posix, under a harmless name
evaluate = eval  # builtins, re-exported
lookup = getattr
join = os.path.join  # a Python function defined in posixpath
shell = functools.partial(os.system, "true")  # an instance: no module of its own to vouch for it
Linear = nn.Linear  # a class from torch.nn: fine where torch.nn is admitted, refused where it is not


def linear_stack(layers: int = 2, dim: int = 4) -> nn.Sequential:
    """A factory defined here: admitted."""
    return nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])


class Builders:
    """Factories as ``Class.method``, and a class attribute that smuggles a re-export."""

    run = staticmethod(os.system)
    shell = os.system

    @classmethod
    def stack(cls, layers: int = 2) -> nn.Sequential:
        return linear_stack(layers)

    @staticmethod
    def single(dim: int = 4) -> nn.Linear:
        return nn.Linear(dim, dim)

    class Nested:
        @classmethod
        def stack(cls, layers: int = 3) -> nn.Sequential:
            return linear_stack(layers)

    @property
    def built(self) -> Any:  # a descriptor, not a factory
        return linear_stack()


instance = Builders()  # an instance, not a factory
