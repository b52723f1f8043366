"""Tests for actors/_subscribers.py in one process: subscriptions are bound to the caller, bounded and filtered.

Four runtimes with keys of one key directory talk over real CURVE sockets: a
publisher (the head's key) and the clients alice and bob and the admin. A forged
request is sent as raw wire messages, with a reply address that is not the sender's.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from actors import (
    Actor,
    ClusterKeys,
    Event,
    EventSink,
    NodeJoined,
    NodeLeft,
    Runtime,
    Subscribers,
    TooManySubscribers,
    endpoint,
    open_runtime,
)

pytestmark = pytest.mark.timeout(30)

PUBLISHER = "publisher"


class Publisher(Actor):
    """Stands for the head or the scheduler: its subscribe endpoints, over a :class:`Subscribers`."""

    def __init__(self, subscribers: Subscribers) -> None:
        self.subscribers = subscribers

    @endpoint(roles=("client",))
    async def subscribe(self, actor: str) -> None:
        self.subscribers.add(self.runtime, actor)

    @endpoint(roles=("client",))
    async def unsubscribe(self, actor: str) -> bool:
        return self.subscribers.remove(self.runtime, actor)

    @endpoint(roles=("client",))
    async def count(self) -> int:
        return len(self.subscribers)


@dataclass
class Member:
    runtime: Runtime
    events: asyncio.Queue[Event]

    async def subscribe(self, address: str, name: str = "events") -> None:
        await self.runtime.spawn(EventSink(self.events.put_nowait), name)
        await self.runtime.ref(address, PUBLISHER).endpoint(Publisher.subscribe, timeout=5).call(name)

    async def heard(self, marker: Event) -> list[Event]:
        """Every event heard up to ``marker`` (published last: each subscriber hears in publishing order)."""
        heard = []
        while dataclasses.replace(event := await asyncio.wait_for(self.events.get(), 5), time=0.0) != marker:
            heard.append(event)
        return heard


@dataclass
class Site:
    keys: ClusterKeys
    head: Runtime
    publisher: Publisher
    members: dict[str, Member]

    def publish(self, event: Event, owner: str | None = None) -> int:
        return self.publisher.subscribers.publish(self.head, event, owner=owner)

    async def count(self, who: str = "alice") -> int:
        """How many subscribers the publisher holds, after every message ``who`` sent before this was handled."""
        ref = self.members[who].runtime.ref(self.head.address, PUBLISHER)
        return await ref.endpoint(Publisher.count, timeout=5).call()


async def open_site(tmp_path: Path, subscribers: Subscribers) -> AsyncIterator[Site]:
    keys = ClusterKeys.create(tmp_path / "keys")
    for name in ("alice", "bob"):
        keys.add("client", name)
    async with open_runtime("tcp://127.0.0.1:0", keys=keys.identity("head"), ring=keys.ring) as head, \
            open_runtime("tcp://127.0.0.1:0", keys=keys.identity("alice"), ring=keys.ring) as alice, \
            open_runtime("tcp://127.0.0.1:0", keys=keys.identity("bob"), ring=keys.ring) as bob, \
            open_runtime("tcp://127.0.0.1:0", keys=keys.identity("admin"), ring=keys.ring) as admin:
        publisher = Publisher(subscribers)
        await head.spawn(publisher, PUBLISHER)
        members = {name: Member(runtime, asyncio.Queue()) for name, runtime in
                   (("alice", alice), ("bob", bob), ("admin", admin))}
        yield Site(keys, head, publisher, members)


@pytest.fixture
async def site(tmp_path: Path) -> AsyncIterator[Site]:
    async for opened in open_site(tmp_path, Subscribers("publisher")):
        yield opened


async def test_a_client_hears_only_events_of_what_its_key_owns_and_the_admin_hears_all(site: Site) -> None:
    for member in site.members.values():
        await member.subscribe(site.head.address)
    alices, bobs, everyones = NodeLeft(node="alice's"), NodeLeft(node="bob's"), NodeJoined(node="for all")
    assert site.publish(alices, owner="client:alice") == 2  # alice and the admin
    assert site.publish(bobs, owner="client:bob") == 2
    assert site.publish(everyones) == 3
    marker = NodeJoined(node="marker")
    site.publish(marker)
    heard = {name: [e.node for e in await member.heard(marker)]  # type: ignore[attr-defined]
             for name, member in site.members.items()}
    assert heard == {"alice": ["alice's", "for all"], "bob": ["bob's", "for all"],
                     "admin": ["alice's", "bob's", "for all"]}


async def test_a_subscriber_is_reached_only_at_the_address_of_the_key_that_subscribed(site: Site) -> None:
    alice, bob = site.members["alice"].runtime, site.members["bob"].runtime
    await bob.spawn(EventSink(site.members["bob"].events.put_nowait), "events")
    host, port = alice.address.partition("|")[0].rsplit(":", 1)
    bobs_key = bob.address.partition("|")[2]
    forged_reply_addresses = [
        bob.address,  # another client's runtime: alice would have the head send bob her events
        site.head.address,  # the head itself
        f"{host}:{port}|{bobs_key}",  # alice's endpoint, someone else's key
        alice.address.partition("|")[0],  # alice's endpoint, no key to prove
        f"tcp://localhost:{port}|{alice.address.partition('|')[2]}",  # a name the head would have to look up
        "tcp://203.0.113.9:5555",  # anywhere
    ]
    for call_id, reply_to in enumerate(forged_reply_addresses, start=1):
        await alice._send(site.head.address, {"t": "req", "id": call_id, "to": PUBLISHER, "m": "subscribe",
                                              "a": ["events"], "k": {}, "r": reply_to})
    await alice._send(site.head.address, {"t": "req", "id": None, "to": PUBLISHER, "m": "subscribe",
                                          "a": ["events"], "k": {}, "r": None})  # a tell: no address at all
    assert await site.count() == 0  # every one refused: the publisher will send events to none of them
    # Through its own runtime, the same call subscribes alice, at her own address.
    await site.members["alice"].subscribe(site.head.address)
    [subscriber] = list(site.publisher.subscribers)
    assert (subscriber.caller, subscriber.address, subscriber.actor) == ("client:alice", alice.address, "events")


@pytest.fixture
async def small_site(tmp_path: Path) -> AsyncIterator[Site]:
    async for opened in open_site(tmp_path, Subscribers("publisher", max_per_caller=2, max_total=3)):
        yield opened


async def test_subscriptions_are_bounded_per_key_and_in_all_with_a_typed_error(small_site: Site) -> None:
    site = small_site
    alice, bob, admin = site.members["alice"], site.members["bob"], site.members["admin"]
    await alice.subscribe(site.head.address, "a")
    await alice.subscribe(site.head.address, "b")
    again = alice.runtime.ref(site.head.address, PUBLISHER).endpoint(Publisher.subscribe, timeout=5)
    await again.call("a")  # the same sink again: no new subscription
    with pytest.raises(TooManySubscribers, match="'client:alice' already holds 2 subscriptions to the publisher"):
        await alice.subscribe(site.head.address, "c")
    await bob.subscribe(site.head.address, "x")
    with pytest.raises(TooManySubscribers, match="the publisher holds 3 subscriptions, the most it takes"):
        await admin.subscribe(site.head.address, "y")
    # Bob cannot end alice's subscription (his call names his own runtime's sink); alice can.
    bobs = bob.runtime.ref(site.head.address, PUBLISHER).endpoint(Publisher.unsubscribe, timeout=5)
    assert await bobs.call("a") is False
    alices = alice.runtime.ref(site.head.address, PUBLISHER).endpoint(Publisher.unsubscribe, timeout=5)
    assert await alices.call("a") is True
    await again.call("c")  # (its sink was spawned by the refused attempt)
    assert await site.count() == 3


def test_the_bounds_must_make_sense() -> None:
    with pytest.raises(ValueError, match="need 1 <= max_per_caller"):
        Subscribers("p", max_per_caller=0)
    with pytest.raises(ValueError, match="need 1 <= max_per_caller"):
        Subscribers("p", max_per_caller=8, max_total=4)
