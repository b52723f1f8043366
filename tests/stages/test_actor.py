# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/test_actor.py
"""The stage actor's layer of endpoints (stages.actor), two stages in one runtime in this process.

No node processes: the actors run in one runtime without keys, called through typed
endpoints as the scheduler calls them. A step goes run_step -> reduce_step ->
finish_step; a bad order is refused before the stage moves to its step; a delivery
for a slot no program has is refused and counted; stopping drops every part.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from actors._errors import NotAllowed, RemoteError
from actors._ref import ActorRef
from actors._runtime import Runtime, open_runtime
from schedulers.schedules import build_schedule
from stages.actor import StageActor
from stages.records import FinishReport, ReduceReport, StageReport, StepOrder
from tests.stages.stage_parts import MODEL_KWARGS, stage_config

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def stages() -> AsyncIterator[tuple[Runtime, list[StageActor], list[ActorRef]]]:
    async with open_runtime() as runtime:
        actors = [StageActor(**stage_config(rank).to_wire()) for rank in range(2)]
        refs = [await runtime.spawn(actor, f"stage{rank}") for rank, actor in enumerate(actors)]
        for ref in refs:
            await ref.endpoint(StageActor.connect, timeout=10).call([r.to_wire() for r in refs])
        yield runtime, actors, refs


def orders(step: int) -> list[StepOrder]:
    gen = torch.Generator().manual_seed(step)
    x, y = (torch.randn(8, MODEL_KWARGS["dim"], generator=gen) for _ in range(2))
    programs = build_schedule("1f1b", 2, 2)
    return [StepOrder(step=step, program=[str(a) for a in programs[0]], inputs=list(x.chunk(2))),
            StepOrder(step=step, program=[str(a) for a in programs[1]], targets=list(y.chunk(2)))]


async def run(refs: list[ActorRef], step: int, **finish: Any) -> tuple[list[StageReport], list[FinishReport]]:
    reports = [StageReport.from_wire(r) for r in await asyncio.gather(*(
        ref.endpoint(StageActor.run_step, timeout=30).call(order.to_wire()) for ref, order in zip(refs, orders(step))))]
    reduced = [ReduceReport.from_wire(r) for r in await asyncio.gather(*(
        ref.endpoint(StageActor.reduce_step, timeout=30).call(step) for ref in refs))]
    assert all(not r.nonfinite for r in reduced)
    finished = [FinishReport.from_wire(r) for r in await asyncio.gather(*(
        ref.endpoint(StageActor.finish_step, timeout=30).call(step, **finish) for ref in refs))]
    return reports, finished


async def test_a_step_runs_through_the_endpoints(stages: tuple[Runtime, list[StageActor], list[ActorRef]]) -> None:
    _, actors, refs = stages
    # In one runtime the state crosses no wire: on the CPU it is the parameters themselves.
    before = {k: v.clone() for k, v in (await refs[0].endpoint(StageActor.state_dict, timeout=10).call()).items()}
    reports, finished = await run(refs, 0)
    assert [r.status for r in reports] == ["done", "done"]
    assert reports[0].losses == [] and len(reports[1].losses) == 2
    assert "F 0->1" in reports[0].bytes_sent  # in one runtime a delivery crosses no wire: 0 bytes
    assert reports[0].codec_stats["F 0->1"]["raw_bytes"] == 8 * MODEL_KWARGS["dim"] * 4
    assert [f.lr for f in finished] == [[0.05], [0.05]]
    after = await refs[0].endpoint(StageActor.state_dict, timeout=10).call()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    progress = await refs[1].endpoint(StageActor.progress, timeout=10).call()
    assert progress["step"] == 0 and progress["done"] > 0


@pytest.mark.parametrize(("change", "match"), [
    ({"w_batching": "yes"}, "ValueError: w_batching must be a bool, got 'yes'"),
    ({"micro_batches": 0}, "ValueError: micro_batches must be an int >= 1"),
    ({"inputz": []}, "RecordError: StepOrder: unknown key\\(s\\) inputz"),
])
async def test_a_bad_order_is_refused_before_the_stage_moves_to_its_step(
        stages: tuple[Runtime, list[StageActor], list[ActorRef]], change: dict[str, Any], match: str) -> None:
    _, actors, refs = stages
    with pytest.raises(RemoteError, match=match):
        await refs[0].endpoint(StageActor.run_step, timeout=10).call({**orders(5)[0].to_wire(), **change})
    assert actors[0]._step == -1
    reports, _ = await run(refs, 0)  # nothing of it stayed behind
    assert [r.status for r in reports] == ["done", "done"]


async def test_a_delivery_for_no_slot_is_refused_and_counted(
        stages: tuple[Runtime, list[StageActor], list[ActorRef]]) -> None:
    _, actors, refs = stages
    deliver = refs[1].endpoint(StageActor.deliver, timeout=10)
    refused = actors[1].refused_calls
    with pytest.raises(NotAllowed, match="expects no 'B' for stage 1"):
        await deliver.call(0, "B", 1, 0, [torch.zeros(1)], 1)
    with pytest.raises(NotAllowed, match="a list of tensors"):
        await deliver.call(0, "F", 1, 0, "x", 1)  # type: ignore[arg-type]
    assert actors[1].refused_calls == refused + 2
    reports, _ = await run(refs, 0)
    assert [r.status for r in reports] == ["done", "done"]


async def test_stopping_drops_every_part(stages: tuple[Runtime, list[StageActor], list[ActorRef]]) -> None:
    runtime, actors, refs = stages
    await run(refs, 0)
    assert actors[0].parts is not None
    await runtime.stop_actor(refs[0].name)
    assert actors[0].parts is None
