"""What an actor a node spawned may know of that node (its own room: the node's agent and the
processes it hosts actors in both make one)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NodeContext"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeContext:
    """What an actor spawned on a node may know of it: its device and (live) allow-list."""

    name: str
    device: str
    allow_list: list[str]  # the node agent's own list: admissions show up here

    @property
    def allow(self) -> tuple[str, ...]:
        return tuple(self.allow_list)
