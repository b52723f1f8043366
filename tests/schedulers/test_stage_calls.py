"""A step's failure named by what caused it (schedulers.stage_calls), with the stages' answers made here."""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from actors import NodeLost, StepFailed
from actors._errors import error_to_wire
from schedulers import stage_calls
from schedulers.stage_calls import StageCalls
from stages import StageReport
from stages.comm.p2p import PeerClosed
from stages.mesh import Mesh
from transport.stream import StreamBroken


class TwoStageJob:
    """What StageCalls reads of a job: its timeout, its mesh, its nodes and which of them live."""

    def __init__(self, alive: Sequence[str] = ("node0", "node1")) -> None:
        self.spec = SimpleNamespace(fault_tolerance=SimpleNamespace(step_timeout_s=60.0))
        self.mesh = Mesh(pipeline=2)
        self.nodes = ["node0", "node1"]
        self.alive = set(alive)

    async def alive_nodes(self) -> set[str]:
        return set(self.alive)


def calls_for(job: TwoStageJob) -> StageCalls:
    calls = StageCalls(job, views=None)  # type: ignore[arg-type]  # the views serve a timeout's report only

    async def abort(step: int, tasks: Mapping[int, asyncio.Future[Any]], silent: Sequence[int] = (),
                    busy: Sequence[int] = ()) -> None:
        pass  # no stage actors here to tell

    calls.abort = abort  # type: ignore[method-assign]
    return calls


# What a stage's send raises when its neighbour's process died: on a sealed stream, and over gloo
# (transport="dist"; gloo's own words as torch 2.13 raises them, inside PeerClosed).
CLOSED_LINKS = {
    "stream": StreamBroken("the stream link to ipc:///tmp/x/stream closed while sending: the receiver closed"),
    "dist": PeerClosed("the other rank's connection closed (its process ended?): [third_party/gloo/gloo/transport/"
                       "tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:64204"),
}


def broken_send(transport: str = "stream") -> StageReport:
    """Stage 0's report when its send to stage 1 found the link closed (stage 1's node died)."""
    return StageReport(status="failed", action="0SEND_F3", error=error_to_wire(CLOSED_LINKS[transport]))


@pytest.mark.parametrize("transport", sorted(CLOSED_LINKS))
async def test_a_broken_link_to_a_neighbour_fails_the_step_as_the_lost_node_that_broke_it(transport: str) -> None:
    # Stage 0's failed send reaches the head first; the news that stage 1's node is lost comes after
    # it. The step must fail with NodeLost, naming stage 1: that is what a job with max_restarts
    # recovers from, and what happened. (It failed with stage 0's broken link before.)
    loop = asyncio.get_running_loop()
    stage0, stage1 = loop.create_future(), loop.create_future()
    stage0.set_result(broken_send(transport))
    loop.call_later(0.05, stage1.set_exception, NodeLost("node node1 was lost", details={"node": "node1"}))
    with pytest.raises(NodeLost) as info:
        await calls_for(TwoStageJob()).reports(3, {0: stage0, 1: stage1})
    assert info.value.details["stage"] == 1 and info.value.details["node"] == "node1"


async def test_a_broken_link_with_every_node_alive_stays_the_stages_own_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage_calls, "LOSS_GRACE_S", 0.2)
    loop = asyncio.get_running_loop()
    stage0, stage1 = loop.create_future(), loop.create_future()  # stage 1 never answers
    stage0.set_result(broken_send())
    with pytest.raises(StepFailed) as info:
        await calls_for(TwoStageJob()).reports(3, {0: stage0, 1: stage1})
    assert not isinstance(info.value, NodeLost)
    assert info.value.details["stage"] == 0 and info.value.details["cause"].startswith("transport.stream.StreamBroken:")


async def test_a_broken_link_whose_node_the_detector_already_dropped_is_that_node_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # No call has failed with NodeLost yet, but the head no longer counts node1 among the living.
    monkeypatch.setattr(stage_calls, "LOSS_GRACE_S", 0.2)
    loop = asyncio.get_running_loop()
    stage0, stage1 = loop.create_future(), loop.create_future()
    stage0.set_result(broken_send())
    with pytest.raises(NodeLost) as info:
        await calls_for(TwoStageJob(alive=["node0"])).reports(3, {0: stage0, 1: stage1})
    assert info.value.details["node"] == "node1"


async def test_an_abort_waits_for_no_stage_that_computed_one_action_for_the_whole_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a stage whose compute thread ran one action past step_timeout_s took the abort, and the
    head then waited up to 5 s for its call, which ends only with the action: the timed-out step's error came
    5 s late. A stage the hang report found computing (``busy``) is told, and not waited for."""
    aborted: list[int] = []

    class Ref:
        def __init__(self, rank: int) -> None:
            self.rank, self.name = rank, f"rank{rank}"

        def endpoint(self, method: Any, timeout: float | None = None) -> Ref:
            return self

        async def call(self, step: int) -> None:
            aborted.append(self.rank)

        tell = call

    job = TwoStageJob()
    job.stages = [Ref(0), Ref(1)]  # type: ignore[attr-defined]
    waited: list[list[Any]] = []

    async def wait(futures: Any, timeout: float | None = None) -> Any:
        waited.append(list(futures))
        return set(), set(futures)

    monkeypatch.setattr(stage_calls.asyncio, "wait", wait)
    loop = asyncio.get_running_loop()
    tasks = {0: loop.create_future(), 1: loop.create_future()}  # neither call ends: stage 0 computes on
    await StageCalls(job, views=None).abort(7, tasks, busy=[0])  # type: ignore[arg-type]
    assert sorted(aborted) == [0, 1] and waited == [[tasks[1]]]
    await StageCalls(job, views=None).abort(7, tasks, busy=[0, 1])  # type: ignore[arg-type]
    assert waited == [[tasks[1]]]  # no wait at all
