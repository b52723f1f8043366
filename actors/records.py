"""Typed records that cross the wire: frozen dataclasses with a strict ``from_wire``.

A record is a frozen, slotted, keyword-only dataclass that subclasses
:class:`WireRecord`. Defining one registers it with the wire format under its
``wire_name`` (the class name unless it sets one), so a record travels in a message
as itself: an endpoint takes and returns records, and the receiver rebuilds the same
class through ``from_wire``, which refuses a key it does not know and a required key
that is missing. Nothing is dropped silently, so the two sides cannot drift apart
unnoticed; a record the receiver cannot rebuild reaches the caller as
:class:`~actors.BadRecord`. The receiver must have imported the module that defines
a record to rebuild it (a driver imports ``schedulers.records``, a node the stage's).

``to_wire()`` still gives the record as a plain map (nested records as maps too), for
JSON, logs and tables. This module is torch-free, so every layer can import it cheaply.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, ClassVar, Protocol, TypeVar

from transport.records import register_record

__all__ = ["RecordError", "WireRecord"]

R = TypeVar("R", bound="WireRecord")


class RecordError(ValueError):
    """A record from the wire with an unknown or missing key, or not a map at all."""


class _FromWire(Protocol):
    @classmethod
    def from_wire(cls, data: Any) -> Any: ...


class WireRecord:
    """Mixin for dataclass records: travels as itself, with ``to_wire`` and a strict ``from_wire``.

    A field that holds another record, a list of them, or ``None`` is named in
    ``nested``, with the class that rebuilds it; every other field holds plain data
    (or tensors, which travel as raw frames).
    """

    __slots__ = ()
    nested: ClassVar[dict[str, type[_FromWire]]] = {}
    wire_name: ClassVar[str]
    """The name the record travels under; the class name unless the class sets one."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "wire_name" not in cls.__dict__:
            cls.wire_name = cls.__name__
        register_record(cls, cls.wire_name)

    def wire_fields(self) -> dict[str, Any]:
        """The fields by name, nested records as records (the wire format encodes each)."""
        return {name: getattr(self, name) for name in _field_table(type(self))[0]}

    def to_wire(self) -> dict[str, Any]:
        """The record as a plain map, nested records as maps: for JSON, logs and tables."""
        data = self.wire_fields()
        for name in self.nested:
            value = data[name]
            if isinstance(value, list):
                data[name] = [item.to_wire() for item in value]
            elif value is not None:
                data[name] = value.to_wire()
        return data

    @classmethod
    def from_wire(cls: type[R], data: Any) -> R:
        """Rebuilds a record from its fields map (as :meth:`to_wire` gives it), or passes one through.

        A record of this class is returned as it is, so code that still converts by
        hand keeps working once records travel as records.

        Raises:
            RecordError: not a map, a key the record does not have, or a required key
                missing; or a record of another class.
        """
        if isinstance(data, cls):
            return data
        if isinstance(data, WireRecord):
            raise RecordError(f"{cls.__name__}: expected a {cls.__name__} or a map, got a {type(data).__name__}")
        if not isinstance(data, dict):
            raise RecordError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
        names, known, required = _field_table(cls)
        unknown = sorted(str(k)[:40] for k in data if k not in known)
        if unknown:
            raise RecordError(f"{cls.__name__}: unknown key(s) {', '.join(unknown)}; known: {', '.join(names)}")
        missing = [name for name in required if name not in data]
        if missing:
            raise RecordError(f"{cls.__name__}: missing key(s) {', '.join(missing)}")
        data = dict(data)
        for name, record in cls.nested.items():
            value = data.get(name)
            if isinstance(value, list):
                data[name] = [item if isinstance(item, record) else record.from_wire(item) for item in value]
            elif value is not None and not isinstance(value, record):
                data[name] = record.from_wire(value)
        return cls(**data)


# Record class -> its field names in order, as a set, and those without a default.
# ``dataclasses.fields`` builds its tuple on every call, and every record that crosses
# the wire asks once each way.
_FIELD_TABLES: dict[type, tuple[tuple[str, ...], frozenset[str], tuple[str, ...]]] = {}


def _field_table(cls: type) -> tuple[tuple[str, ...], frozenset[str], tuple[str, ...]]:
    table = _FIELD_TABLES.get(cls)
    if table is None:
        every = fields(cls)
        names = tuple(f.name for f in every)
        table = _FIELD_TABLES[cls] = (
            names, frozenset(names),
            tuple(f.name for f in every if f.default is MISSING and f.default_factory is MISSING))
    return table
