# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/comm/test_delivery.py
"""Sending and taking in boundary values (stages.comm.delivery), in one process.

The Receiver must refuse every slot no program has and every malformed value before
anything is kept; the Sender must count what it sends per edge, encode with the
boundary's codec, and start a changed gradient boundary's error feedback afresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from actors._errors import NotAllowed
from stages.comm.boundary import Payload
from stages.comm.delivery import Receiver, Sender, StreamPeer, check_codecs
from stages.comm.device_io import DeviceIO
from stages.compute.executor import Inbox
from stages.program import Action, ActionKind
from transport.stream import StreamBroken, StreamServer
from transport.wire import keep_lossy_encoded
from tests.stages.stage_parts import MODEL_KWARGS, InProcessPipeline, stage_config

pytestmark = pytest.mark.timeout(60)


def receiver(rank: int = 1, num_ranks: int = 2) -> Receiver:
    def spawn(coro: Any, name: str) -> None:
        coro.close()
        raise AssertionError("nothing is spawned without a dist link")

    return Receiver(stage_config(rank, num_ranks), Inbox(64), spawn)


# (step, kind, stage, micro-batch) at current step 0 with 2 micro-batches: rank 1 of 2 holds the last stage.
@pytest.mark.parametrize(("slot", "ok"), [
    ((0, "F", 1, 0), True), ((0, "F", 1, 1), True),
    ((1, "F", 1, 7), True),  # the next step may bring up to 4x as many micro-batches
    ((1, "F", 1, 8), False), ((0, "F", 1, 2), False),  # the current step's count
    ((2, "F", 1, 0), False), ((-1, "F", 1, 0), False),  # neither the current step nor the next
    ((0, "B", 1, 0), False),  # no gradient comes to the last stage
    ((0, "F", 0, 0), False),  # a stage another rank holds
    ((0, "X", 1, 0), False), ((0, "F", 1, -1), False), ((True, "F", 1, 0), False), ((0, "F", "1", 0), False),
])
def test_receiver_takes_only_the_slots_its_programs_have(slot: tuple[Any, ...], ok: bool) -> None:
    incoming = receiver()
    if ok:
        incoming.check_slot(0, 2, *slot)
    else:
        with pytest.raises(NotAllowed, match="rank 1 \\(step 0, stages \\[1\\]\\) expects no"):
            incoming.check_slot(0, 2, *slot)


@pytest.mark.parametrize(("leaves", "spec", "reason"), [
    ([torch.ones(1)], {"x": [0]}, "not one of"),
    ([torch.ones(1), torch.ones(1)], 1, "describes 1"),
    ([torch.ones(1)], {"t": [[0]] * 40}, "not a one-entry map"),
    (torch.ones(1), 1, "a list of tensors"),
    ([torch.ones(1), "x"], 1, "a list of tensors, got a str at 1"),
])
async def test_receiver_refuses_a_malformed_value_and_keeps_nothing(leaves: Any, spec: Any, reason: str) -> None:
    incoming = receiver()
    with pytest.raises(NotAllowed, match=reason):
        incoming.deliver(0, 2, 0, "F", 1, 0, leaves, spec)
    incoming.deliver(0, 2, 0, "F", 1, 0, [torch.ones(1)], 1)  # the slot is still free


async def test_a_delivered_value_waits_in_the_inbox_and_comes_once() -> None:
    incoming = receiver()
    incoming.deliver(0, 2, 0, "F", 1, 1, [torch.full((2,), 3.0)], 1)
    value = await incoming.inbox.take((0, "F", 1, 1))
    assert torch.equal(value.leaves[0], torch.full((2,), 3.0)) and value.spec == 1
    incoming.deliver(0, 2, 0, "F", 1, 0, [torch.ones(1)], 1)
    with pytest.raises(ValueError, match="delivered twice"):
        incoming.deliver(0, 2, 0, "F", 1, 0, [torch.ones(1)], 1)


async def test_a_value_that_arrives_after_its_step_was_aborted_is_a_leftover_not_a_second_delivery() -> None:
    """Aborting a step cancels the program waiting on the inbox, and with it the slot it waited on;
    the neighbour's value still on the wire then arrived at a cancelled slot and was refused as
    "delivered twice", an ERROR with a traceback in the node's log each time a driver cancelled a step."""
    incoming = receiver()
    waiting = asyncio.ensure_future(incoming.inbox.take((0, "F", 1, 0)))
    await asyncio.sleep(0)  # the program waits on the slot
    waiting.cancel()  # abort_step cancels the program
    with pytest.raises(asyncio.CancelledError):
        await waiting
    incoming.deliver(0, 2, 0, "F", 1, 0, [torch.ones(1)], 1)  # the leftover: kept until the reset drops it
    incoming.inbox.drop_step(0)
    incoming.deliver(0, 2, 0, "F", 1, 0, [torch.ones(1)], 1)  # and the slot is free again after it
    assert torch.equal((await incoming.inbox.take((0, "F", 1, 0))).leaves[0], torch.ones(1))


@pytest.mark.parametrize(("activation", "gradient", "match"), [
    (["none"], ["none", "none"], "expected one codec per boundary \\(1\\)"),
    ([], ["none"], "expected one codec per boundary"),
    (["zip"], ["none"], "unknown codec 'zip'"),
])
def test_check_codecs(activation: list[str], gradient: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_codecs(stage_config(0), activation, gradient)
    check_codecs(stage_config(0), ["int8"], ["fp16"])


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    async def deliver(self, step: int, kind: str, stage: int, microbatch: int, leaves: list[torch.Tensor],
                      spec: Any) -> int:
        self.sent.append((step, kind, stage, microbatch, leaves, spec))
        return 100

    async def deliver_header(self, *args: Any) -> int:
        raise AssertionError("no dist link")


async def direct(fn: Any, *args: Any) -> Any:
    return fn(*args)


@pytest.fixture
def sender() -> Iterator[tuple[Sender, Recorder]]:
    from stages.comm.delivery import PeerEndpoints

    config = stage_config(1, activation_codec=["none"], gradient_codec=["int8"], error_feedback=True)
    out = Sender(config, direct, DeviceIO("cpu"))
    recorder = Recorder()
    out.peers[:] = [PeerEndpoints(deliver=recorder.deliver, deliver_header=recorder.deliver_header)] * 2
    yield out, recorder


async def test_sender_encodes_with_the_boundarys_codec_and_counts_each_edge(sender: tuple[Sender, Recorder]
                                                                             ) -> None:
    out, recorder = sender
    grad = torch.linspace(-1, 1, 64)
    value = Payload([grad, torch.arange(3)], {"l": [0, 0]})
    assert await out.send(4, Action(stage=1, kind=ActionKind.SEND_B, microbatch=1), value) == 100
    (step, kind, stage, microbatch, leaves, spec), = recorder.sent
    assert (step, kind, stage, microbatch, spec) == (4, "B", 0, 1, {"l": [0, 0]})
    assert not isinstance(leaves[0], torch.Tensor)  # int8-encoded
    assert torch.equal(leaves[1], torch.arange(3))  # integers travel exact
    stats = out.edge_stats["B 1->0"]
    assert stats["codec"] == "int8" and stats["bytes"] == 100 and stats["raw_bytes"] == value.nbytes
    assert 0 < stats["sq_err"] < stats["sq_norm"] == pytest.approx(float(grad.double().pow(2).sum()))
    # Error feedback kept this stream's residual; a changed codec starts it afresh, an unchanged one keeps it.
    feedback = out.feedback[0]
    out.set_codecs(["none"], ["int8"])
    assert out.feedback[0] is feedback
    out.set_codecs(["none"], ["fp16"])
    assert out.feedback[0] is not feedback and out.codecs == {"F": ["none"], "B": ["fp16"]}
    with pytest.raises(ValueError, match="unknown codec"):
        out.set_codecs(["none"], ["zip"])
    assert out.codecs == {"F": ["none"], "B": ["fp16"]}  # a refused change changes nothing


async def test_a_pipeline_of_parts_delivers_every_value_once() -> None:
    pipeline = InProcessPipeline([stage_config(rank, 2, micro_batches=4) for rank in range(2)])
    try:
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randn(8, MODEL_KWARGS["dim"], generator=gen) for _ in range(2))
        result = await pipeline.step(0, x, y)
        assert sorted(pipeline.ranks[1].received) == [(0, "F", 1, m) for m in range(4)]
        assert sorted(pipeline.ranks[0].received) == [(0, "B", 0, m) for m in range(4)]
        assert pipeline.ranks[0].sender.edge_stats["F 0->1"]["bytes"] == 8 * MODEL_KWARGS["dim"] * 4
        assert result.decision.apply
    finally:
        pipeline.close()


async def quantized_steps(keep_encoded: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Three steps of a 2-stage pipeline of parts whose boundaries send int8 (activations) and
    fp8 (gradients), the wire keeping lossy values encoded as a GPU's process does, or not."""
    keep_lossy_encoded(keep_encoded)
    pipeline = InProcessPipeline([stage_config(rank, 2, micro_batches=2, activation_codec=["int8"],
                                               gradient_codec=["fp8"]) for rank in range(2)])
    try:
        gen = torch.Generator().manual_seed(0)
        losses = []
        for step in range(3):
            x, y = (torch.randn(8, MODEL_KWARGS["dim"], generator=gen) for _ in range(2))
            losses.append((await pipeline.step(step, x, y)).loss)
        return losses, pipeline.state()
    finally:
        keep_lossy_encoded(False)
        pipeline.close()


async def test_lossy_values_kept_encoded_to_the_device_train_to_the_same_bits() -> None:
    # On a GPU the encoded bytes cross to the device and are decoded there (stages.worker.start):
    # the same frames through the same decode, so the same training, to the bit.
    kept_losses, kept_state = await quantized_steps(True)
    losses, state = await quantized_steps(False)
    assert kept_losses == losses
    assert kept_state.keys() == state.keys() and all(torch.equal(kept_state[k], state[k]) for k in state)


async def test_a_broken_stream_fails_one_send_and_the_next_opens_a_fresh_session(tmp_path: Any) -> None:
    taken: list[Any] = []
    server = StreamServer(taken.append)
    opened: list[int] = []

    async def open_stream(opening: bytes, rank: int) -> str:  # as the member's endpoint answers
        opened.append(rank)
        address = await server.start(f"ipc://{tmp_path}/sock")
        server.open(opening, f"node:a/{rank}")
        return address

    peer = StreamPeer(open_stream, 3, encrypt=True)
    await peer.deliver(0, "F", 1, 0, [torch.ones(2)], 0)
    while not taken:
        await asyncio.sleep(0.01)
    for connection in list(server._connections):  # the member refused what came, or restarted
        connection.close()
    with pytest.raises(StreamBroken):
        for _ in range(1000):  # the close reaches the sender after some sends at most
            await peer.vote(0, 3, {"x": 1})
            await asyncio.sleep(0.001)
    await peer.deliver(1, "F", 1, 0, [torch.full((2,), 2.0)], 0)
    while len(taken) < 2 or taken[-1][1] != 1:
        await asyncio.sleep(0.01)
    assert opened == [3, 3] and taken[0][0] == "value" and torch.equal(taken[-1][5][0], torch.full((2,), 2.0))
    peer.close()
    server.close()
