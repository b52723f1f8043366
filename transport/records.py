"""The record classes the wire format can carry, by the name each travels under.

A registry only: :mod:`transport.wire` encodes an instance of a registered class as
its name and its fields, and rebuilds one through the class's own ``from_wire``. It
is a stdlib-only leaf, so a record module (``actors.records``) registers its classes
without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["MAX_RECORD_NAME", "RecordType", "Rebuilds", "record_types", "register_record"]

MAX_RECORD_NAME = 64
"""Bytes in a record's wire name."""


class RecordType(Protocol):
    """What the wire needs of a record class (``actors.records.WireRecord`` is one)."""

    def wire_fields(self) -> dict[str, Any]:
        """The record's fields, by name; nested records stay records (the wire encodes them)."""
        ...

    @classmethod
    def from_wire(cls, data: Any) -> Any:
        """Rebuilds the record from its fields map, refusing a map that does not fit."""
        ...


class Rebuilds(Protocol):
    """The least a class needs to travel: a ``from_wire`` that rebuilds it from a map, strictly."""

    @classmethod
    def from_wire(cls, data: Any) -> Any: ...


Fields = Callable[[Any], dict[str, Any]]

RECORD_CLASSES: dict[str, type[Rebuilds]] = {}  # wire name -> class
RECORD_NAMES: dict[type, tuple[str, Fields]] = {}  # class -> (wire name, what gives an instance's fields)


def register_record(cls: type[Rebuilds], name: str, *, fields: Fields | None = None) -> None:
    """Lets instances of ``cls`` travel in messages, under ``name``.

    A receiver rebuilds a record only if it registered a class under the record's
    name, which it does by importing the module that defines it.

    Args:
        fields: gives an instance's fields as a map that ``cls.from_wire`` takes back
            (default: its ``wire_fields`` method, as a :class:`RecordType` has).

    Raises:
        ValueError: ``name`` is empty, too long, or another class holds it. (A class
            of the same module and qualified name replaces the earlier one: a slotted
            dataclass is a second class object, and a reloaded module a third.)
    """
    if not name or len(name.encode()) > MAX_RECORD_NAME:
        raise ValueError(f"a record's wire name has 1 to {MAX_RECORD_NAME} bytes, not {name!r}")
    held = RECORD_CLASSES.get(name)
    if held is not None and held is not cls:
        if (held.__module__, held.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(
                f"wire name {name!r} of {cls.__module__}.{cls.__qualname__} is taken by "
                f"{held.__module__}.{held.__qualname__}; give one of them another wire_name"
            )
        del RECORD_NAMES[held]
    RECORD_CLASSES[name] = cls
    RECORD_NAMES[cls] = (name, fields if fields is not None else cls.wire_fields)  # type: ignore[attr-defined]


def record_types() -> dict[str, type[Rebuilds]]:
    """The record classes this process can rebuild, by wire name (a copy)."""
    return dict(RECORD_CLASSES)
