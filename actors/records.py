"""Typed records that cross the wire: frozen dataclasses with a strict ``from_wire``.

A record is a frozen, slotted, keyword-only dataclass. It travels as a msgpack map
(``record.to_wire()``) and comes back with ``Record.from_wire(data)``, which refuses
a key it does not know and a required key that is missing: nothing is dropped
silently, so the two sides cannot drift apart unnoticed. This module is a leaf (no
torch, no ZeroMQ), so every layer can import it cheaply.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, ClassVar, Protocol, TypeVar

__all__ = ["RecordError", "WireRecord"]

R = TypeVar("R", bound="WireRecord")


class RecordError(ValueError):
    """A record from the wire with an unknown or missing key, or not a map at all."""


class _FromWire(Protocol):
    @classmethod
    def from_wire(cls, data: Any) -> Any: ...


class WireRecord:
    """Mixin for dataclass records: ``to_wire`` and a strict ``from_wire``.

    A field that holds another record, a list of them, or ``None`` is named in
    ``nested``, with the class that rebuilds it; every other field holds plain data.
    """

    __slots__ = ()
    nested: ClassVar[dict[str, type[_FromWire]]] = {}

    def to_wire(self) -> dict[str, Any]:
        """The record as a plain map."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        for name in self.nested:
            value = data[name]
            if isinstance(value, list):
                data[name] = [item.to_wire() for item in value]
            elif value is not None:
                data[name] = value.to_wire()
        return data

    @classmethod
    def from_wire(cls: type[R], data: Any) -> R:
        """Rebuilds a record sent by :meth:`to_wire`.

        Raises:
            RecordError: not a map, a key the record does not have, or a required key missing.
        """
        if not isinstance(data, dict):
            raise RecordError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(str(k)[:40] for k in data if k not in known)
        if unknown:
            raise RecordError(f"{cls.__name__}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
        missing = [name for name, f in known.items()
                   if name not in data and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise RecordError(f"{cls.__name__}: missing key(s) {', '.join(missing)}")
        data = dict(data)
        for name, record in cls.nested.items():
            value = data.get(name)
            if isinstance(value, list):
                data[name] = [record.from_wire(item) for item in value]
            elif value is not None:
                data[name] = record.from_wire(value)
        return cls(**data)
