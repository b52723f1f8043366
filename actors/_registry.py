"""What a node may build: actor classes by registered name, factories by allowed import path.

Nothing that runs on a node arrives as code: an actor class is looked up in a
registry the node's own code filled, and a model, loss, data or optimizer factory is
imported by a ``package.module:attribute`` path that the node's allow-list admits.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from actors._actor import Actor
from actors._errors import NotAllowed

__all__ = ["DEFAULT_ALLOW", "actor_class", "load_object", "register_actor", "registered_actors"]

A = TypeVar("A", bound=type[Actor])

DEFAULT_ALLOW = ("torch.nn", "torch.optim", "examples")
_ACTOR_CLASSES: dict[str, type[Actor]] = {}
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def register_actor(name: str) -> Callable[[A], A]:
    """Class decorator: nodes may spawn this class when asked for ``name``."""

    def add(cls: A) -> A:
        if _ACTOR_CLASSES.get(name, cls) is not cls:
            raise ValueError(f"actor name {name!r} is already registered to {_ACTOR_CLASSES[name].__qualname__}")
        _ACTOR_CLASSES[name] = cls
        return cls

    return add


def registered_actors() -> list[str]:
    return sorted(_ACTOR_CLASSES)


def actor_class(name: str) -> type[Actor]:
    """The class registered as ``name``.

    Raises:
        NotAllowed: no class is registered under that name.
    """
    try:
        return _ACTOR_CLASSES[name]
    except KeyError:
        raise NotAllowed(
            f"no actor class registered as {name!r}; this node knows: {', '.join(registered_actors()) or 'none'}"
        ) from None


def is_allowed(module: str, allow: Iterable[str]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in allow)


def load_object(path: str, allow: Iterable[str]) -> Any:
    """Imports ``package.module:attribute`` if the allow-list admits its module.

    Raises:
        ValueError: ``path`` is not of the form ``package.module:attribute``.
        NotAllowed: the module is outside ``allow``; the message says how to admit it.
        ImportError, AttributeError: the module or attribute does not exist.
    """
    if not isinstance(path, str) or not _IMPORT_PATH.match(path):
        raise ValueError(f"{path!r} is not an import path of the form 'package.module:attribute'")
    module_name, _, attribute = path.partition(":")
    allow = tuple(allow)
    if not is_allowed(module_name, allow):
        raise NotAllowed(
            f"{path!r} is not on this node's allow-list ({', '.join(allow) or 'empty'}); start the "
            f"node with --allow {module_name} (LocalCluster(allow=[...]) does this for you)"
        )
    obj: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj
