"""What the layers above plug into the runtime, found by entry point, so ``actors/`` names none of them.

The installed distribution declares them (``pyproject.toml``, group ``actorpipe``):

- ``head``: a module the head node imports at start-up to register the actors it
  hosts (the scheduler actor); ``python -m actors.node --plugin MODULE`` overrides it.
- ``worker``: a module a worker node imports at start-up (it registers the actors the
  node hosts) whose ``start(device)`` prepares the process for its device.
- ``devices``: a module whose ``visible_gpu_count()`` counts this process's GPUs.
- ``cluster``: the :class:`~actors.Cluster` subclass a driver's connection is built
  as (it adds the job API: ``train``, ``jobs``, ``job``).
- ``jobs``: the module that holds the job API's public names (``Job``, ``StepStats``).

Without an installed plugin the runtime still works as a generic actor system.
"""

from __future__ import annotations

import functools
import importlib
import logging
from importlib.metadata import entry_points
from typing import Any

__all__ = ["GROUP", "head_modules", "load_plugin"]

log = logging.getLogger(__name__)

GROUP = "actorpipe"


@functools.cache
def _entries() -> dict[str, str]:
    return {entry.name: entry.value for entry in entry_points(group=GROUP)}


def head_modules() -> tuple[str, ...]:
    """The modules the head imports at start-up (the installed ``head`` plugin), or none."""
    value = _entries().get("head")
    return (value,) if value else ()


def load_plugin(name: str) -> Any:
    """The object the installed plugin ``name`` names (``module:attribute`` or a module), or None."""
    value = _entries().get(name)
    if not value:
        return None
    module, _, attr = value.partition(":")
    obj: Any = importlib.import_module(module)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj
