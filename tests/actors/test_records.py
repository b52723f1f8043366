"""Tests for actors/records.py: records are strict on the way in and travel between runtimes as themselves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch

from actors import Actor, BadArguments, BadRecord, RecordError, Runtime, WireRecord, endpoint, open_runtime
from transport import records as registry

pytestmark = pytest.mark.timeout(30)


@dataclass(frozen=True, slots=True, kw_only=True)
class Part(WireRecord):
    name: str
    size: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Order(WireRecord):
    wire_name: ClassVar[str] = "test.Order"
    nested: ClassVar[dict[str, type[WireRecord]]] = {"parts": Part, "main": Part}

    id: int
    parts: list[Part] = field(default_factory=list)
    main: Part | None = None
    weights: torch.Tensor | None = None


def test_a_record_registers_under_its_wire_name_or_its_class_name() -> None:
    assert registry.record_types()["test.Order"] is Order
    assert registry.record_types()["Part"] is Part


def test_to_wire_and_from_wire_round_trip_nested_records() -> None:
    order = Order(id=1, parts=[Part(name="a", size=2)], main=Part(name="b"))
    data = order.to_wire()
    assert data == {"id": 1, "parts": [{"name": "a", "size": 2}], "main": {"name": "b", "size": 0}, "weights": None}
    assert Order.from_wire(data) == order


def test_from_wire_passes_a_record_of_its_class_through() -> None:
    order = Order(id=1)
    assert Order.from_wire(order) is order
    # A map of records, as the wire rebuilds one: nested records are taken as they are.
    assert Order.from_wire({"id": 1, "parts": [Part(name="a")]}) == Order(id=1, parts=[Part(name="a")])


BAD = {
    "not a map": ([1], "expected a map"),
    "unknown key": ({"id": 1, "colour": "red"}, r"unknown key\(s\) colour"),
    "missing key": ({"parts": []}, r"missing key\(s\) id"),
    "another record": (Part(name="a"), "expected a Order or a map, got a Part"),
    "another record nested": ({"id": 1, "main": Order(id=2)}, "expected a Part or a map, got a Order"),
}


@pytest.mark.parametrize("data,match", BAD.values(), ids=BAD.keys())
def test_from_wire_is_strict(data: object, match: str) -> None:
    with pytest.raises(RecordError, match=match):
        Order.from_wire(data)


class Shop(Actor):
    def __init__(self) -> None:
        self.orders: list[Order] = []

    @endpoint
    async def place(self, order: Order) -> Order:
        self.orders.append(order)
        return Order(id=order.id + 1, parts=[*order.parts, Part(name="receipt")], weights=order.weights)

    @endpoint
    async def last(self) -> Order:
        return self.orders[-1]

    @endpoint
    async def count(self) -> int:
        return len(self.orders)


@pytest.fixture
async def runtimes() -> AsyncIterator[tuple[Runtime, Runtime]]:
    async with open_runtime("ipc://") as server, open_runtime("tcp://127.0.0.1:0") as client:
        yield server, client


async def test_records_cross_the_wire_as_records_with_their_tensors(runtimes: tuple[Runtime, Runtime]) -> None:
    server, client = runtimes
    shop = Shop()
    ref = client.ref(server.address, (await server.spawn(shop, "shop")).name)
    weights = torch.arange(6.0)
    answer = await ref.endpoint(Shop.place, timeout=10).call(
        Order(id=1, parts=[Part(name="a", size=3)], main=Part(name="m"), weights=weights))
    assert isinstance(answer, Order) and answer.id == 2
    assert answer.parts == [Part(name="a", size=3), Part(name="receipt")]
    assert isinstance(shop.orders[0].main, Part) and torch.equal(shop.orders[0].weights, weights)  # type: ignore[arg-type]
    assert answer.weights is not None and torch.equal(answer.weights, weights)


async def test_a_record_the_receiver_refuses_is_a_typed_error_and_it_keeps_serving(
    runtimes: tuple[Runtime, Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, client = runtimes
    shop = Shop()
    ref = client.ref(server.address, (await server.spawn(shop, "shop")).name)
    # As a newer sender would: a field this side does not know.
    monkeypatch.setitem(registry.RECORD_NAMES, Part,
                        ("Part", lambda self: {"name": self.name, "size": self.size, "colour": "red"}))
    with pytest.raises(BadRecord, match=r"record Part: RecordError: Part: unknown key\(s\) colour"):
        await ref.endpoint(Shop.place, timeout=10).call(Order(id=1, parts=[Part(name="a")]))
    monkeypatch.undo()
    assert await ref.endpoint(Shop.count, timeout=10).call() == 0  # the call did not run
    assert (await ref.endpoint(Shop.place, timeout=10).call(Order(id=1))).id == 2


async def test_an_unregistered_record_name_is_a_typed_error_both_ways(
    runtimes: tuple[Runtime, Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, client = runtimes
    shop = Shop()
    ref = client.ref(server.address, (await server.spawn(shop, "shop")).name)
    await ref.endpoint(Shop.place, timeout=10).call(Order(id=1))
    # Sent under a name no class holds here: refused in a call, and in a reply.
    monkeypatch.setitem(registry.RECORD_NAMES, Order, ("test.Gone", Order.wire_fields))
    with pytest.raises(BadRecord, match="unknown record type 'test.Gone'"):
        await ref.endpoint(Shop.place, timeout=10).call(Order(id=5))
    with pytest.raises(BadRecord, match="the reply's 1 record"):
        await ref.endpoint(Shop.last, timeout=10).call()
    monkeypatch.undo()
    assert (await ref.endpoint(Shop.last, timeout=10).call()) == Order(id=1)


async def test_an_endpoint_refuses_what_is_not_the_record_its_signature_names(runtimes: tuple[Runtime, Runtime]) -> None:
    server, client = runtimes
    shop = Shop()
    ref = client.ref(server.address, (await server.spawn(shop, "shop")).name)
    for wrong in ({"id": 1}, Part(name="a"), None):
        with pytest.raises(BadArguments, match="order must be Order, not"):
            await ref.ask("place", wrong, timeout=10)  # by name: the type checker would refuse it
    assert shop.orders == []
