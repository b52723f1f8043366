"""What the controller's helper modules (recovery, state and checkpoints) see of a job.

:class:`~schedulers.control.JobController` is the one implementation; the helpers are
typed against this protocol so that they need not import the controller's module.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from actors import ActorRef, Event, Host
from stages import Mesh
from schedulers.jobs import JobSpec
from schedulers.scaling import LossScaler

__all__ = ["JobCore", "Placer"]


class JobCore(Protocol):
    """A job's members, its position in training, and its hold on them (see ``JobController``)."""

    runtime: Host
    id: str
    spec: JobSpec
    mesh: Mesh
    stages: list[ActorRef]  # by global rank
    nodes: list[str]  # by global rank
    bounds: list[list[int]]
    rendezvous: str | None
    fenced: dict[int, int]
    broken: str | None
    next_step: int
    applied: int
    steps_done: int
    scaler: LossScaler | None
    history: dict[int, tuple[Any, Any]]
    restarts: int
    last_checkpoint: tuple[str, int] | None
    driver_batches: bool
    snapshot_due: bool
    placer: Placer | None
    identities: list[str]
    retired: list[tuple[str, ActorRef]]
    _publish: Callable[[Event], None]
    _alive_nodes: Callable[[], Awaitable[set[str]]]

    def _operation(self, *, stepping: bool = False, repairs: bool = False) -> AbstractAsyncContextManager[None]:
        ...


@dataclass(frozen=True, slots=True)
class Placer:
    """What a recovery asks of the scheduler: free nodes, a stage spawned, a fresh rendezvous."""

    # ``count`` alive nodes no job uses, none of ``taken``: (name, key identity) each.
    free_nodes: Callable[[int, set[str]], Awaitable[list[tuple[str, str]]]]
    # Rank R's stage actor of the job, built on node N with this dist config.
    spawn: Callable[[JobCore, int, str, dict[str, Any] | None], Awaitable[ActorRef]]
    # A new rendezvous for the job's (new) members: (its name, the stages' dist config); the old one stops.
    renew_rendezvous: Callable[[JobCore], Awaitable[tuple[str, dict[str, Any]]]]
