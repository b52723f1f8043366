# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/test_actor.py
"""The stage actor's layer of endpoints (stages.actor), two stages in one runtime in this process.

No node processes: the actors run in one runtime without keys, called through typed
endpoints as the scheduler calls them. A step goes run_step -> reduce_step ->
finish_step, or runs its tail inside run_step (one answer per step, the stages voting on
the decision); a bad order is refused before the stage moves to its step; a delivery
for a slot no program has is refused and counted; stopping drops every part.
"""

from __future__ import annotations

import asyncio
import logging
import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from actors._errors import NotAllowed, RemoteError
from actors._ref import ActorRef
from actors._runtime import Runtime, open_runtime
from schedulers.schedules import build_schedule
from stages.actor import StageActor
from stages.comm.delivery import StreamPeer
from stages.compute.tail import decide_step
from stages.records import FinishReport, ReduceReport, StageReport, StepOrder
from tests.helpers.tampered import TamperedKey
from tests.stages.stage_parts import MODEL_KWARGS, stage_config
from transport.sealed import SessionKey
from transport.security import Keypair

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def stages() -> AsyncIterator[tuple[Runtime, list[StageActor], list[ActorRef]]]:
    async with open_runtime() as runtime:  # values as actor messages; `streamed` below: on streams
        actors = [StageActor(**stage_config(rank, transport="zmq").to_wire()) for rank in range(2)]
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
    assert progress.step == 0 and progress.done > 0


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


async def test_a_replacement_told_the_jobs_step_keeps_the_next_steps_early_values(
        stages: tuple[Runtime, list[StageActor], list[ActorRef]]) -> None:
    # A recovery's replacement starts at step -1; the job's steps are numbered on (a retried step gets a
    # new number). Its neighbour's first activation of step 12 may come before its own order for step 12.
    runtime, _, refs = stages
    replacement = StageActor(**stage_config(1).to_wire())
    ref = await runtime.spawn(replacement, "replacement")
    peers = [refs[0].to_wire(), ref.to_wire()]
    deliver = ref.endpoint(StageActor.deliver, timeout=10)
    await ref.endpoint(StageActor.connect, timeout=10).call(peers)
    with pytest.raises(NotAllowed, match="expects no 'F' for stage 1, micro-batch 0 of step 12"):
        await deliver.call(12, "F", 1, 0, [torch.zeros(4, MODEL_KWARGS["dim"])], 0)  # the step would wait for it
    await ref.endpoint(StageActor.connect, timeout=10).call(peers, None, None, 11)  # as a recovery connects it
    await deliver.call(12, "F", 1, 0, [torch.zeros(4, MODEL_KWARGS["dim"])], 0)  # kept for its step
    assert replacement._step == 11
    await ref.endpoint(StageActor.connect, timeout=10).call(peers, None, None, 3)  # never back
    assert replacement._step == 11


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


async def _open_pair(runtime: Runtime, prefix: str) -> list[ActorRef]:
    """Two stage actors that know each other as pipeline peers and as the job's members (the tail's votes)."""
    refs = [await runtime.spawn(StageActor(**stage_config(rank).to_wire()), f"{prefix}{rank}") for rank in range(2)]
    wire = [r.to_wire() for r in refs]
    for ref in refs:
        await ref.endpoint(StageActor.connect, timeout=10).call(wire, None, wire)
    return refs


async def assert_same_state(pair: list[ActorRef], other: list[ActorRef]) -> None:
    """Each stage of ``pair`` holds the same state as ``other``'s, bit for bit."""
    for a, b in zip(pair, other):
        mine = await a.endpoint(StageActor.state_dict, timeout=10).call()
        theirs = await b.endpoint(StageActor.state_dict, timeout=10).call()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)


async def test_a_step_whose_stages_run_its_tail_equals_one_driven_by_calls() -> None:
    """One answer per step: reduce, the vote, clipping and the optimizer step all happen in run_step,
    and the result equals the scheduler's reduce_step/finish_step path to the last bit."""
    async with open_runtime() as runtime:
        inline, driven = await _open_pair(runtime, "inline"), await _open_pair(runtime, "driven")
        for step in range(3):
            answers = [StageReport.from_wire(r) for r in await asyncio.gather(*(
                ref.endpoint(StageActor.run_step, timeout=30).call(
                    dataclasses.replace(order, finish=True, max_norm=0.05).to_wire())
                for ref, order in zip(inline, orders(step))))]
            assert [a.status for a in answers] == ["done", "done"]
            assert all(a.reduced is not None and a.finished is not None for a in answers)
            reports = [StageReport.from_wire(r) for r in await asyncio.gather(*(
                ref.endpoint(StageActor.run_step, timeout=30).call(order.to_wire())
                for ref, order in zip(driven, orders(step))))]
            reduced = [ReduceReport.from_wire(r) for r in await asyncio.gather(*(
                ref.endpoint(StageActor.reduce_step, timeout=30).call(step) for ref in driven))]
            decision = decide_step(nonfinite_loss=False, nonfinite_gradient=False,
                                   grad_sq=sum(r.grad_sq for r in reduced), max_norm=0.05)
            assert decision.clip < 1.0  # clipping took part
            await asyncio.gather(*(ref.endpoint(StageActor.finish_step, timeout=30).call(
                step, True, decision.unscale, decision.clip) for ref in driven))
            assert [a.losses for a in answers] == [r.losses for r in reports]
            assert [a.reduced.grad_sq for a in answers if a.reduced] == [r.grad_sq for r in reduced]
        await assert_same_state(inline, driven)


async def test_a_stage_waiting_for_votes_is_aborted_and_forgets_the_step() -> None:
    async with open_runtime() as runtime:
        refs = await _open_pair(runtime, "stage")
        first, second = orders(0)
        # Rank 1 runs its program but not the tail, so rank 0 waits for a vote that never comes.
        waiting = asyncio.ensure_future(refs[0].endpoint(StageActor.run_step, timeout=30).call(
            dataclasses.replace(first, finish=True).to_wire()))
        assert StageReport.from_wire(await refs[1].endpoint(StageActor.run_step, timeout=30).call(
            second.to_wire())).status == "done"
        await asyncio.sleep(0)
        assert not waiting.done()
        await refs[0].endpoint(StageActor.abort_step, timeout=10).call(0)
        assert StageReport.from_wire(await waiting).status == "aborted"
        await refs[1].endpoint(StageActor.abort_step, timeout=10).call(0)
        answers = [StageReport.from_wire(r) for r in await asyncio.gather(*(  # the next step is whole
            ref.endpoint(StageActor.run_step, timeout=30).call(dataclasses.replace(order, finish=True).to_wire())
            for ref, order in zip(refs, orders(1))))]
        assert [a.status for a in answers] == ["done", "done"]


@pytest.mark.parametrize(("step", "rank", "vote", "match"), [
    (7, 0, {"nonfinite_loss": False, "nonfinite_gradient": False, "grad_sq": 1.0}, "only this step's or the next's"),
    (0, 5, {"nonfinite_loss": False, "nonfinite_gradient": False, "grad_sq": 1.0}, "outside a mesh of 2"),
    (0, 0, {"nonfinite_loss": "no", "nonfinite_gradient": False, "grad_sq": 1.0}, "not a vote"),
    (0, 0, {"grad_sq": 1.0}, "not a vote"),
])
async def test_a_vote_outside_the_step_or_the_mesh_is_refused_and_counted(
        stages: tuple[Runtime, list[StageActor], list[ActorRef]], step: int, rank: int, vote: dict[str, Any],
        match: str) -> None:
    _, actors, refs = stages
    refused = actors[1].refused_calls
    with pytest.raises(NotAllowed, match=match):
        await refs[1].endpoint(StageActor.vote, timeout=10).call(step, rank, vote)
    assert actors[1].refused_calls == refused + 1


VOTE = {"nonfinite_loss": False, "nonfinite_gradient": False, "grad_sq": 1.0}


@pytest.mark.parametrize(("votes", "match"), [
    ([VOTE, VOTE], "rank 1 of a mesh of 2 takes votes, not a tally"),  # two members send votes to each other
    ("votes", "a list of at most 2 votes"),
    ([VOTE, VOTE, VOTE], "a list of at most 2 votes"),
    ([VOTE, {"grad_sq": 1.0}], "not a tally"),
])
async def test_a_tally_a_stage_does_not_take_is_refused_and_counted(
        stages: tuple[Runtime, list[StageActor], list[ActorRef]], votes: Any, match: str) -> None:
    _, actors, refs = stages
    refused = actors[1].refused_calls
    with pytest.raises(NotAllowed, match=match):
        await refs[1].endpoint(StageActor.tally, timeout=10).call(0, votes)
    assert actors[1].refused_calls == refused + 1


async def test_a_second_vote_of_one_member_is_refused(stages: tuple[Runtime, list[StageActor], list[ActorRef]]) -> None:
    _, _, refs = stages
    vote = refs[1].endpoint(StageActor.vote, timeout=10)
    ballot = {"nonfinite_loss": False, "nonfinite_gradient": False, "grad_sq": 1.0}
    await vote.call(0, 0, ballot)
    with pytest.raises(NotAllowed, match="rank 0 voted twice on step 0"):
        await vote.call(0, 0, ballot)


async def test_an_abort_between_the_program_and_the_tail_fences_the_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """abort_step arriving after the program ended but before the tail began must not leave the
    stage waiting for votes that never come (its mailbox would hold every later step behind it)."""
    import stages.actor as stage_module

    real_end_step = stage_module.end_step
    async with open_runtime() as runtime:
        refs = await _open_pair(runtime, "stage")
        first_stage = runtime._mailboxes[refs[0].name].actor  # type: ignore[attr-defined]

        async def end_then_abort(parts: Any, step: int, task: Any) -> StageReport:
            report = await real_end_step(parts, step, task)
            if parts is first_stage.parts:  # only stage 0's, and only in the gap
                await refs[0].endpoint(StageActor.abort_step, timeout=10).call(step)
            return report

        monkeypatch.setattr(stage_module, "end_step", end_then_abort)
        first, second = orders(0)
        answers = [StageReport.from_wire(r) for r in await asyncio.gather(
            refs[0].endpoint(StageActor.run_step, timeout=30).call(dataclasses.replace(first, finish=True).to_wire()),
            refs[1].endpoint(StageActor.run_step, timeout=30).call(second.to_wire()))]
        assert answers[0].status == "aborted"
        monkeypatch.setattr(stage_module, "end_step", real_end_step)
        await refs[1].endpoint(StageActor.abort_step, timeout=10).call(0)
        answers = [StageReport.from_wire(r) for r in await asyncio.gather(*(  # the next step is whole
            ref.endpoint(StageActor.run_step, timeout=30).call(dataclasses.replace(order, finish=True).to_wire())
            for ref, order in zip(refs, orders(1))))]
        assert [a.status for a in answers] == ["done", "done"]


async def test_a_step_aborted_before_it_began_never_runs(stages: tuple[Runtime, list[StageActor], list[ActorRef]]
                                                         ) -> None:
    _, _, refs = stages
    await refs[0].endpoint(StageActor.abort_step, timeout=10).call(0)
    report = StageReport.from_wire(await refs[0].endpoint(StageActor.run_step, timeout=30).call(
        orders(0)[0].to_wire()))
    assert report.status == "aborted"


async def _finish_steps(refs: list[ActorRef], steps: list[int], **change: Any) -> list[list[StageReport]]:
    """Every order of ``steps`` sent at once, each after the first with ``after`` the one before it (as a
    run sends its next step while this one finishes); each step's answers by rank."""
    calls = [[asyncio.ensure_future(ref.endpoint(StageActor.run_step, timeout=30).call(dataclasses.replace(
        order, finish=True, after=steps[i - 1] if i else None, **change).to_wire()))
        for ref, order in zip(refs, orders(step))] for i, step in enumerate(steps)]
    return [[StageReport.from_wire(await call) for call in step_calls] for step_calls in calls]


async def test_a_step_sent_ahead_runs_once_the_one_before_is_applied_and_trains_as_one_by_one() -> None:
    # The head sends step k+1's order while step k runs: each stage's mailbox holds it and starts it
    # the moment step k's tail is done, so the round trip to the head leaves the critical path.
    async with open_runtime() as runtime:
        ahead, one_by_one = await _open_pair(runtime, "ahead"), await _open_pair(runtime, "single")
        answers = await _finish_steps(ahead, [0, 1, 2])
        assert [[a.status for a in step] for step in answers] == [["done", "done"]] * 3
        for step in range(3):
            single = await _finish_steps(one_by_one, [step])
            assert [a.losses for a in single[0]] == [a.losses for a in answers[step]]
        await assert_same_state(ahead, one_by_one)


async def test_a_step_sent_ahead_of_one_not_applied_runs_nothing_anywhere() -> None:
    # A step that failed, was aborted or dropped its gradients (a NaN) leaves the one sent after it
    # refused by every stage: no stage can then apply it while the head drops it (its vote never comes).
    async with open_runtime() as runtime:
        refs = await _open_pair(runtime, "stage")
        before = [{k: v.clone() for k, v in (await ref.endpoint(StageActor.state_dict, timeout=10).call()).items()}
                  for ref in refs]
        first, second = orders(0)
        poisoned = first.inputs[:1] + [torch.full_like(first.inputs[1], float("nan"))]
        calls = [asyncio.ensure_future(ref.endpoint(StageActor.run_step, timeout=30).call(order.to_wire()))
                 for ref, order in zip(refs, (dataclasses.replace(first, finish=True, inputs=poisoned),
                                               dataclasses.replace(second, finish=True)))]
        ahead = [asyncio.ensure_future(ref.endpoint(StageActor.run_step, timeout=30).call(
            dataclasses.replace(order, finish=True, after=0).to_wire())) for ref, order in zip(refs, orders(1))]
        dropped = [StageReport.from_wire(await call) for call in calls]
        assert [r.status for r in dropped] == ["done", "done"]  # the tail ran and dropped the step
        assert [StageReport.from_wire(await call).status for call in ahead] == ["aborted", "aborted"]
        for ref, state in zip(refs, before):
            now = await ref.endpoint(StageActor.state_dict, timeout=10).call()
            assert all(torch.equal(now[k], state[k]) for k in state)  # neither step changed anything
        answers = await _finish_steps(refs, [2, 3])  # the stages go on: the next steps run whole
        assert [[a.status for a in step] for step in answers] == [["done", "done"]] * 2
        with pytest.raises(RemoteError, match="after must be an int >= 0"):
            await refs[0].endpoint(StageActor.run_step, timeout=10).call({**orders(4)[0].to_wire(), "after": "3"})


@pytest.fixture
async def streamed() -> AsyncIterator[tuple[Runtime, list[StageActor], list[ActorRef]]]:
    async with open_runtime() as runtime:
        actors = [StageActor(**stage_config(rank, transport="stream").to_wire()) for rank in range(2)]
        refs = [await runtime.spawn(actor, f"stage{rank}") for rank, actor in enumerate(actors)]
        for ref in refs:
            await ref.endpoint(StageActor.connect, timeout=10).call([r.to_wire() for r in refs])
        yield runtime, actors, refs


async def test_values_on_streams_train_as_actor_messages_do(
        stages: tuple[Runtime, list[StageActor], list[ActorRef]],
        streamed: tuple[Runtime, list[StageActor], list[ActorRef]]) -> None:
    _, actors, refs = streamed
    for step in range(3):
        plain, _ = await run(stages[2], step)
        reports, _ = await run(refs, step)
        assert [r.losses for r in reports] == [r.losses for r in plain]
    # Even in one runtime a streamed value crosses a socket: its bytes are counted, and each
    # stage keeps one session per neighbour it sends to.
    assert reports[0].bytes_sent["F 0->1"] > 8 * MODEL_KWARGS["dim"] * 4 > 0
    assert reports[1].bytes_sent["B 1->0"] > 0
    assert all(a._streams is not None and len(a._streams.server._sessions) == 1 for a in actors)
    state = await refs[0].endpoint(StageActor.state_dict, timeout=10).call()
    expected = await stages[2][0].endpoint(StageActor.state_dict, timeout=10).call()
    assert all(torch.equal(state[k], expected[k]) for k in expected)


async def test_connected_again_a_stage_opens_fresh_sessions_and_stopping_closes_them(
        streamed: tuple[Runtime, list[StageActor], list[ActorRef]]) -> None:
    runtime, actors, refs = streamed
    await run(refs, 0)
    key = (refs[1].address, refs[1].name)
    first = actors[0]._streams.links[key]._link  # type: ignore[union-attr]
    assert first is not None
    for ref in refs:  # as a recovery connects the stages again
        await ref.endpoint(StageActor.connect, timeout=10).call([r.to_wire() for r in refs], None, None, 0)
    reports, _ = await run(refs, 1)
    assert [r.status for r in reports] == ["done", "done"]
    assert actors[0]._streams.links[key]._link is not first  # type: ignore[union-attr]
    assert len(actors[1]._streams.server._sessions) == 1  # type: ignore[union-attr]  # the old one went
    address = actors[1]._streams.server.address  # type: ignore[union-attr]
    assert address is not None and address.startswith("ipc://")
    await runtime.stop_actor(refs[1].name)
    assert not os.path.exists(address.partition("://")[2])


async def test_a_streamed_value_for_no_slot_or_a_bad_vote_is_refused_and_counted(
        streamed: tuple[Runtime, list[StageActor], list[ActorRef]]) -> None:
    _, actors, refs = streamed
    refused = actors[1].refused_calls
    intruder = StreamPeer(refs[1].endpoint(StageActor.open_stream, timeout=10).call, 0, encrypt=True)
    await intruder.deliver(0, "B", 1, 0, [torch.zeros(1)], 1)
    await intruder.deliver(0, "F", 1, 0, "x", 1)  # type: ignore[arg-type]
    await intruder.vote(0, 7, {"nonfinite": []})  # a rank outside the mesh, and not a vote
    await intruder.send(["call", "stop"])  # neither a value nor a vote
    while actors[1].refused_calls < refused + 4:
        await asyncio.sleep(0.01)
    intruder.close()
    reports, _ = await run(refs, 0)
    assert [r.status for r in reports] == ["done", "done"]


async def test_a_value_its_stream_lost_fails_the_receivers_step_at_once_and_names_the_sender(
        streamed: tuple[Runtime, list[StageActor], list[ActorRef]]) -> None:
    """A value refused on the way (here: its seal broken in transit) never comes, and the stage that
    waits for it waited out the step's timeout (ten minutes by default). Its stream server says whose
    session lost a message, and the step fails at the wait, naming the stream."""
    _, actors, refs = streamed
    await run(refs, 0)  # the links are open and proven
    link = actors[0]._streams.links[(refs[1].address, refs[1].name)]._link  # type: ignore[union-attr]
    assert link is not None
    link.key = TamperedKey(link.key)  # type: ignore[assignment]
    sender = asyncio.ensure_future(refs[0].endpoint(StageActor.run_step, timeout=30).call(orders(1)[0].to_wire()))
    report = StageReport.from_wire(await refs[1].endpoint(StageActor.run_step, timeout=30).call(orders(1)[1].to_wire()))
    assert report.status == "failed" and report.action is not None and "RECV_F" in report.action
    assert report.error is not None and "StreamBroken" in str(report.error)
    assert "may have lost a value or vote of step 1:" in str(report.error) and "refused" in str(report.error)
    # The sender fails at its next send (the link was closed), or waits for gradients that will not
    # come until the scheduler aborts it, as here.
    await refs[0].endpoint(StageActor.abort_step, timeout=10).call(1)
    assert StageReport.from_wire(await sender).status in ("failed", "aborted")


async def test_a_value_lost_over_zeromq_fails_the_receivers_step_at_once_and_names_the_node() -> None:
    """Values as actor messages (``transport="zmq"``) between two secure runtimes, as between two hosts:
    one refused on the way (its seal broken in transit) never came, and the stage that waited for it
    waited out the step's timeout (ten minutes by default). The receiver's inbox says whose session
    lost a message; the stage whose job that node is in fails the step at the wait, naming it. The
    same loss from a key that is none of the job's nodes' fails nothing."""
    keys = [Keypair.generate() for _ in range(2)]
    ring = {keys[0].public: "node:n0", keys[1].public: "node:n1"}
    kwargs = {"blocks": 2, "dim": 1024, "hidden": 16}  # a micro-batch's value of 16 KiB: sealed, over the bulk socket
    async with open_runtime("tcp://127.0.0.1:0", keys=keys[0], ring=lambda: ring) as first, \
            open_runtime("tcp://127.0.0.1:0", keys=keys[1], ring=lambda: ring) as second:
        runtimes = (first, second)
        actors = [StageActor(**stage_config(rank, transport="zmq", model_kwargs=kwargs).to_wire()) for rank in range(2)]
        names = [await runtime.spawn(actor, f"stage{rank}")
                 for rank, (runtime, actor) in enumerate(zip(runtimes, actors))]
        refs = [runtime.ref(runtime.address, ref.name) for runtime, ref in zip(runtimes, names)]  # each called at home
        for ref in refs:
            await ref.endpoint(StageActor.connect, timeout=10).call([r.to_wire() for r in names],
                                                                   ["node:n0", "node:n1"])
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randn(8, 1024, generator=gen) for _ in range(2))
        programs = build_schedule("1f1b", 2, 2)

        def order(rank: int, step: int) -> dict[str, Any]:
            data = {"inputs": list(x.chunk(2))} if rank == 0 else {"targets": list(y.chunk(2))}
            return StepOrder(step=step, program=[str(a) for a in programs[rank]], **data).to_wire()

        reports = await asyncio.gather(*(ref.endpoint(StageActor.run_step, timeout=30).call(order(rank, 0))
                                         for rank, ref in enumerate(refs)))
        assert [StageReport.from_wire(r).status for r in reports] == ["done", "done"]
        await asyncio.gather(*(ref.endpoint(StageActor.abort_step, timeout=10).call(0) for ref in refs))
        actors[1].on_messages_lost("node:stranger", "not this job's")  # not the job's node: nothing fails
        link = first._senders._entries[second.address].sender._link  # type: ignore[union-attr]
        assert link is not None
        link.key = TamperedKey(link.key)  # the session's seals lose a bit of their tag on the way
        sender = asyncio.ensure_future(refs[0].endpoint(StageActor.run_step, timeout=30).call(order(0, 1)))
        report = StageReport.from_wire(await refs[1].endpoint(StageActor.run_step, timeout=30).call(order(1, 1)))
        assert report.status == "failed" and report.action is not None and "RECV_F" in report.action
        assert report.error is not None and "MessageLost" in str(report.error)
        assert "the ZeroMQ session from node:n0 may have lost a value or vote of step 1:" in str(report.error)
        assert "fails its tag" in str(report.error)
        await refs[0].endpoint(StageActor.abort_step, timeout=10).call(1)
        assert StageReport.from_wire(await sender).status in ("failed", "aborted")


async def test_a_loss_between_steps_or_during_one_that_ends_well_fails_the_next_step(
        streamed: tuple[Runtime, list[StageActor], list[ActorRef]], caplog: pytest.LogCaptureFixture) -> None:
    """What a stream lost was of the step running when it was lost, unless that step then got every
    message it needed: then, as between steps, of the next one. Only that step fails."""
    _, actors, refs = streamed
    caplog.set_level(logging.WARNING)

    async def step_on_both(step: int) -> list[StageReport]:
        calls = [asyncio.ensure_future(ref.endpoint(StageActor.run_step, timeout=30).call(order.to_wire()))
                 for ref, order in zip(refs, orders(step))]
        receiver = StageReport.from_wire(await calls[1])
        if receiver.status != "done":  # the sender waits for gradients that will not come: abort it
            for ref in refs:
                await ref.endpoint(StageActor.abort_step, timeout=10).call(step)
        return [StageReport.from_wire(await calls[0]), receiver]

    await run(refs, 0)
    actors[1]._stream_lost("node:x/0", "a test's loss")  # between steps 0 and 1
    reports = await step_on_both(1)
    assert reports[1].status == "failed" and "of step 1: a test's loss" in str(reports[1].error)
    # A failed step is reported, and logged once, on one line: the runtime logged its task's failure
    # too, as an ERROR with an 80-line traceback, for a fault the step's report already carries.
    assert [r.levelname for r in caplog.records if r.name == "stages.compute.executor"] == ["WARNING"], caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    own = actors[1]._run_step

    async def losing_at_the_end(order: StepOrder) -> StageReport:
        report = await own(order)
        actors[1]._stream_lost("node:x/0", "lost late")  # step 2 had every value: step 3's was lost
        return report

    actors[1]._run_step = losing_at_the_end  # type: ignore[method-assign]
    assert [r.status for r in await step_on_both(2)] == ["done", "done"]
    actors[1]._run_step = own  # type: ignore[method-assign]
    for ref in refs:  # step 2's tail, driven by calls
        await ref.endpoint(StageActor.reduce_step, timeout=30).call(2)
        await ref.endpoint(StageActor.finish_step, timeout=30).call(2)
    reports = await step_on_both(3)
    assert reports[1].status == "failed" and "of step 3: lost late" in str(reports[1].error)
    reports = await step_on_both(4)  # a new step: nothing of it was lost
    assert [r.status for r in reports] == ["done", "done"]


async def test_a_tail_the_stages_run_votes_on_the_streams() -> None:
    async with open_runtime() as runtime:
        actors = [StageActor(**stage_config(rank, transport="stream").to_wire()) for rank in range(2)]
        refs = [await runtime.spawn(actor, f"stage{rank}") for rank, actor in enumerate(actors)]
        streamed: list[str] = []
        for actor in actors:
            def seen(message: Any, take: Any = actor._take_streamed) -> None:
                streamed.append(message[0])
                take(message)
            actor._take_streamed = seen  # type: ignore[method-assign]
        peers = [r.to_wire() for r in refs]
        for ref in refs:
            await ref.endpoint(StageActor.connect, timeout=10).call(peers, None, peers)
        for step in range(2):
            orders_ = [dataclasses.replace(order, finish=True) for order in orders(step)]
            reports = [StageReport.from_wire(r) for r in await asyncio.gather(*(
                ref.endpoint(StageActor.run_step, timeout=30).call(order.to_wire()) for ref, order in zip(refs, orders_)))]
            assert [r.status for r in reports] == ["done", "done"] and all(r.finished is not None for r in reports)
        assert streamed.count("vote") == 4 and streamed.count("value") == 8  # 2 steps x (2 votes, 2 x 2 values)
        # One link per stage actor it sends to, carrying values and votes alike (none to itself).
        assert all([p._link is not None for p in a._streams.links.values()].count(True) == 1  # type: ignore[union-attr]
                   for a in actors)
        assert all(len(a._streams.server._sessions) == 1 for a in actors)  # type: ignore[union-attr]


async def test_a_stage_without_streams_opens_none(stages: tuple[Runtime, list[StageActor], list[ActorRef]]) -> None:
    _, actors, refs = stages
    with pytest.raises(NotAllowed, match="takes no stream"):
        await refs[1].endpoint(StageActor.open_stream, timeout=10).call(SessionKey.new().open_message(), 0)
    assert actors[1]._streams is None
