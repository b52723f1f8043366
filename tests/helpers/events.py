"""A test's subscription to a cluster's events, and reading a job's events off it."""

from __future__ import annotations

import asyncio

from actors import Cluster, Event, EventSink
from schedulers.events import JobEvent


async def feed(cluster: Cluster, name: str) -> asyncio.Queue[Event]:
    """Subscribes a new EventSink, named ``name`` in ``cluster``'s runtime, to the head's and the scheduler's events."""
    events: asyncio.Queue[Event] = asyncio.Queue()
    await cluster.subscribe(await cluster.runtime.spawn(EventSink(events.put_nowait), name))
    return events


async def heard_until(events: asyncio.Queue[Event], last: type[JobEvent], job: str) -> list[Event]:
    """Every event of ``job`` up to its next ``last``, that one last (the scheduler tells a subscriber in
    publishing order)."""
    heard: list[Event] = []
    while True:
        event = await asyncio.wait_for(events.get(), 60)
        if isinstance(event, JobEvent) and event.job == job:
            heard.append(event)
            if isinstance(event, last):
                return heard
