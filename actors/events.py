"""Events the head tells its subscribers (``on_event(event)``): typed records, one class per kind.

Every event is an :class:`Event`: a :class:`~actors.records.WireRecord` with the
head's ``time`` (set when it is published) and a ``kind`` that names it in logs and
consoles. The head's own are about membership; the scheduler adds its job events
(``schedulers.events``). A subscriber matches on the class (``isinstance`` or
``match``); code that only shows events can use ``kind``. This module is a leaf (no
torch, no ZeroMQ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from actors.records import WireRecord

__all__ = ["Event", "NodeJoined", "NodeLeft", "NodeSilent"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Event(WireRecord):
    """Base of every event: ``time`` is the publisher's clock (``time.time()``) when it was published."""

    kind: ClassVar[str] = "event"
    time: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeJoined(Event):
    """Node ``node`` registered with the head (or registered again)."""

    kind: ClassVar[str] = "node_joined"
    node: str


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLeft(Event):
    """Node ``node`` said it was stopping."""

    kind: ClassVar[str] = "node_left"
    node: str


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSilent(Event):
    """The head lost node ``node``: no heartbeat for ``silent_s`` seconds (its calls fail with NodeLost)."""

    kind: ClassVar[str] = "node_lost"
    node: str
    silent_s: float
