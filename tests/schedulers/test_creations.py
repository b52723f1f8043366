"""Job creations a caller gave up on (schedulers.creations), in one process."""

from __future__ import annotations

import asyncio

import pytest

from actors import ActorStopped
from schedulers.creations import Creations


async def test_a_creation_under_way_is_cancelled_by_its_caller_only() -> None:
    creations = Creations()
    entered = asyncio.Event()

    async def create() -> None:
        with creations.running("t1", "client:alice"):
            entered.set()
            await asyncio.sleep(60)

    task = asyncio.ensure_future(create())
    await entered.wait()
    assert creations.abandon("t1", "client:bob") is None  # another key's word counts for nothing
    await asyncio.sleep(0)
    assert not task.done()
    assert creations.abandon("t1", "client:alice") is None
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_job_already_made_is_named_once_to_its_caller_for_closing() -> None:
    creations = Creations()
    creations.made("t2", "client:alice", "job7")
    assert creations.abandon("t2", "client:bob") is None
    assert creations.abandon("t2", "client:alice") == "job7"
    assert creations.abandon("t2", "client:alice") is None  # closed once


async def test_a_word_that_overtook_its_creation_stops_it_when_it_comes() -> None:
    creations = Creations()
    assert creations.abandon("t3", "client:alice") is None
    with pytest.raises(ActorStopped, match="abandoned this job's creation before it began"):
        with creations.running("t3", "client:alice"):
            pass
    with creations.running("", "client:alice"):  # no ticket: nothing to abandon it by
        pass


def test_tickets_are_remembered_a_bounded_while() -> None:
    creations = Creations()
    for n in range(Creations.KEEP + 10):
        creations.made(f"t{n}", "client:alice", f"job{n}")
        creations.abandon(f"early{n}", "client:alice")
    assert creations.abandon("t0", "client:alice") is None  # forgotten, oldest first
    assert creations.abandon(f"t{Creations.KEEP + 9}", "client:alice") == f"job{Creations.KEEP + 9}"
    assert len(creations._abandoned) <= Creations.KEEP
