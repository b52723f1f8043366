"""The actor runtime: actors, refs, request/reply, nodes and clusters.

Public names are re-exported here from private modules, lazily (PEP 562), so that a
leaf such as ``actors.program`` imports without pulling in torch and ZeroMQ.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Actor": "actors._actor",
    "endpoint": "actors._actor",
    "ActorError": "actors._errors",
    "ActorStopped": "actors._errors",
    "ActorTimeout": "actors._errors",
    "BadArguments": "actors._errors",
    "MailboxFull": "actors._errors",
    "NotAllowed": "actors._errors",
    "RemoteError": "actors._errors",
    "UnknownActor": "actors._errors",
    "UnknownEndpoint": "actors._errors",
    "ActorRef": "actors._ref",
    "load_object": "actors._registry",
    "register_actor": "actors._registry",
    "Runtime": "actors._runtime",
    "open_runtime": "actors._runtime",
    "StepFailed": "actors._errors",
    "Job": "actors.job",
    "StepStats": "actors.job",
    "Cluster": "actors.cluster",
    "LocalCluster": "actors.cluster",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from actors._actor import Actor, endpoint
    from actors._errors import (
        ActorError,
        ActorStopped,
        ActorTimeout,
        BadArguments,
        MailboxFull,
        NotAllowed,
        RemoteError,
        StepFailed,
        UnknownActor,
        UnknownEndpoint,
    )
    from actors.job import Job, StepStats
    from actors._ref import ActorRef
    from actors._registry import load_object, register_actor
    from actors._runtime import Runtime, open_runtime
    from actors.cluster import Cluster, LocalCluster
