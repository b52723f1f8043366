# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/comm/test_p2p.py
"""Stage-to-stage transfers over torch.distributed (stages.comm.p2p), in one process.

torch.distributed is replaced by a fake network (:class:`Net`) that, like NCCL, ignores
tags and pairs each route's sends with its receives in the order they were posted: a
value whose header overtakes another's must still land in the right receive. The
waiting strategies are checked with fake works and streams: gloo's blocks a thread,
NCCL's orders the compute stream and never blocks the host. Two-stage jobs over real
gloo (tests/schedulers/test_training.py's ``dist`` cases) run the same code end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stages.comm.p2p import (DistLink, InOrder, LinkBroken, PeerClosed, StreamWaiter, ThreadWaiter,
                              naming_a_closed_peer, open_link, transfer_tag)
from transport.codecs import Encoded, get_codec

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio]

GROUPS = {(0, 1): "group 0->1", (1, 0): "group 1->0", (1, 2): "group 1->2", (2, 1): "group 2->1"}


@dataclass
class Op:
    op: Any
    tensor: torch.Tensor
    peer: int
    group: Any = None
    tag: int = 0


@dataclass
class Work:
    """A transfer: done when the network has moved its bytes."""

    waited_by: list[str] = field(default_factory=list)
    done: bool = False

    def wait(self) -> bool:
        self.waited_by.append(threading.current_thread().name)
        return True


class Net:
    """Pairs each group's sends and receives in posting order, ignoring tags, as NCCL does."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[Op]]] = []  # (posting rank, its ops), every batch
        self._sends: dict[Any, list[torch.Tensor]] = {}
        self._receives: dict[Any, list[torch.Tensor]] = {}
        self.rank = 0  # whose link is posting (set by the test around each call)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(dist, "P2POp", Op)
        monkeypatch.setattr(dist, "batch_isend_irecv", self.batch)

    def batch(self, ops: list[Op]) -> list[Work]:
        self.batches.append((self.rank, ops))
        for op in ops:
            queue = self._sends if op.op is dist.isend else self._receives
            queue.setdefault(op.group, []).append(op.tensor)
        for group in set(self._sends) | set(self._receives):
            sends, receives = self._sends.get(group, []), self._receives.get(group, [])
            while sends and receives:
                receive, send = receives.pop(0), sends.pop(0)
                receive.copy_(send[:receive.numel()]) if receive.numel() <= send.numel() else receive.zero_()
        return [Work() for _ in ops]


def link(rank: int, *, ordered: bool = True, device: str = "cpu") -> DistLink:
    return DistLink(device=torch.device(device), pairs={p: g for p, g in GROUPS.items() if rank in p},
                    waiter=ThreadWaiter(), ordered=ordered, rank=rank)


def encoded(value: torch.Tensor, codec: str = "none") -> Encoded:
    return get_codec(codec).encode(value)


# -- sending --------------------------------------------------------------------------------------


async def test_a_value_goes_in_one_batch_to_its_pairs_group_with_a_tag_per_frame(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    net = Net()
    net.install(monkeypatch)
    sender = link(1)
    value = [encoded(torch.randn(4, 300), "int8"), encoded(torch.arange(6))]  # 2 frames + 1 frame
    header = sender.send(value, 2, step=5, kind="F", stage=2, microbatch=3)
    [(_, ops)] = net.batches
    assert [op.op for op in ops] == [dist.isend] * 3
    assert {op.peer for op in ops} == {2} and {op.group for op in ops} == {"group 1->2"}
    assert [op.tag for op in ops] == [transfer_tag(5, "F", 2, 3, frame) for frame in range(3)]
    assert [op.tensor.numel() for op in ops] == [f.numel() for e in value for f in e.frames]
    assert header["seq"] == 0
    assert [leaf["codec"] for leaf in header["leaves"]] == ["int8", "none"]
    assert [leaf["sizes"] for leaf in header["leaves"]] == [[f.numel() for f in e.frames] for e in value]
    # Each destination numbers its own values; gradients go back on the other direction's group.
    assert sender.send([encoded(torch.ones(2))], 2, 5, "F", 2, 4)["seq"] == 1
    assert sender.send([encoded(torch.ones(2))], 0, 5, "B", 0, 3)["seq"] == 0
    assert net.batches[-1][1][0].group == "group 1->0"
    sender.close()


async def test_frames_are_sent_from_and_received_into_the_stages_device(monkeypatch: pytest.MonkeyPatch) -> None:
    net = Net()
    net.install(monkeypatch)
    stopped = RuntimeError("stop before decoding: meta tensors hold no bytes")

    def record(ops: list[Op]) -> list[Work]:
        net.batches.append((0, ops))
        if ops[0].op is dist.irecv:
            raise stopped
        return [Work() for _ in ops]

    monkeypatch.setattr(dist, "batch_isend_irecv", record)
    meta = link(1, device="meta")  # stands for a GPU: a CPU frame must be moved there, buffers made there
    header = meta.send([encoded(torch.randn(3, 5), "int8")], 2, 0, "F", 2, 0)
    assert {op.tensor.device.type for op in net.batches[0][1]} == {"meta"}
    with pytest.raises(RuntimeError) as raised:
        await meta.receive(header, 0, 0, "F", 1, 0)
    assert raised.value is stopped
    receives = net.batches[1][1]
    assert [op.op for op in receives] == [dist.irecv, dist.irecv]
    assert {op.tensor.device.type for op in receives} == {"meta"} and {op.peer for op in receives} == {0}
    assert {op.group for op in receives} == {"group 0->1"}
    assert [op.tensor.numel() for op in receives] == header["leaves"][0]["sizes"]
    meta.close()


# -- receiving in order ---------------------------------------------------------------------------


@pytest.mark.parametrize("ordered", [True, False])
async def test_headers_that_overtake_each_other_still_land_in_their_own_receives(
    monkeypatch: pytest.MonkeyPatch, ordered: bool
) -> None:
    """On NCCL (ordered) every value arrives whole; posting in header order (gloo's way,
    relying on tags this network ignores) pairs them wrong: the test can fail."""
    net = Net()
    net.install(monkeypatch)
    sender, receiver = link(0), link(1, ordered=ordered)
    values = [torch.full((2, 3), float(m)) for m in range(3)] + [torch.arange(5.0)]
    headers = []
    for m, value in enumerate(values):
        net.rank = 0
        headers.append(sender.send([encoded(value)], 1, 0, "F", 1, m))
    net.rank = 1
    # The headers arrive last first; each is received by a task of its own, as stage actors do.
    tasks = [asyncio.create_task(receiver.receive(h, 0, 0, "F", 1, m)) for m, h in reversed(list(enumerate(headers)))]
    got = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    received = [leaves[0] for leaves in reversed(got)]
    same = [torch.equal(r, v) if r.shape == v.shape else False for r, v in zip(received, values)]
    assert all(same) == ordered
    for each in (sender, receiver):
        each.close()


async def test_a_refused_header_breaks_its_route_on_nccl_instead_of_pairing_later_values_wrong(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    net = Net()
    net.install(monkeypatch)
    sender, receiver = link(0), link(1)
    first = sender.send([encoded(torch.ones(4))], 1, 0, "F", 1, 0)
    second = sender.send([encoded(torch.ones(4))], 1, 0, "F", 1, 1)
    first["leaves"][0]["sizes"] = [3]  # does not fit float32 [4]
    with pytest.raises(ValueError, match="do not fit"):
        await receiver.receive(first, 0, 0, "F", 1, 0)
    with pytest.raises(LinkBroken, match="link from rank 0 lost a value.*out of step"):
        await receiver.receive(second, 0, 0, "F", 1, 1)
    for each in (sender, receiver):
        each.close()


async def test_in_order_lets_values_go_in_their_number_order() -> None:
    gate = InOrder()
    posted: list[int] = []

    async def post(seq: int) -> None:
        await gate.turn(seq)
        posted.append(seq)
        gate.advance(seq)

    await asyncio.wait_for(asyncio.gather(post(2), post(1), post(0), post(3)), 5)
    assert posted == [0, 1, 2, 3]
    with pytest.raises(LinkBroken, match="numbered 2 came where 4"):  # posted already
        await gate.turn(2)
    for bad in (-1, "0", True, 1 << 16):  # not the number of a value still to come
        with pytest.raises(LinkBroken):
            await InOrder().turn(bad)


async def test_a_cancelled_receive_breaks_its_route_and_wakes_the_values_after_it() -> None:
    gate = InOrder()
    early = asyncio.create_task(gate.turn(1))
    later = asyncio.create_task(gate.turn(2))
    await asyncio.sleep(0)
    early.cancel()
    with pytest.raises(LinkBroken, match="receive of value 1 was cancelled"):
        await asyncio.wait_for(later, 5)
    with pytest.raises(LinkBroken):
        await gate.turn(0)


# -- waiting --------------------------------------------------------------------------------------


class FakeStream:
    """Records which works were waited while it was current (torch.cuda.stream stands in)."""

    def __init__(self) -> None:
        self.current = False
        self.entered = 0

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        assert stream is self
        self.current, self.entered = True, self.entered + 1
        try:
            yield
        finally:
            self.current = False


@dataclass
class StreamWork:
    stream: FakeStream
    on_stream: list[bool] = field(default_factory=list)

    def wait(self) -> None:
        self.on_stream.append(self.stream.current)
        assert threading.current_thread() is threading.main_thread(), "the host must not hand it to a thread"


async def test_nccl_waits_order_the_compute_stream_and_never_block_the_host() -> None:
    stream = FakeStream()
    waiter = StreamWaiter(stream, use=stream.use)
    works = [StreamWork(stream), StreamWork(stream)]
    await waiter.wait(works)
    assert [w.on_stream for w in works] == [[True], [True]]
    with waiter.posting():  # operations are posted, and buffers allocated, with the compute stream current
        assert stream.current
    assert not stream.current


async def test_the_nccl_path_posts_receives_and_decodes_with_the_compute_stream_current(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    net = Net()
    net.install(monkeypatch)
    stream = FakeStream()
    posted_on: list[bool] = []

    def batch(ops: list[Op]) -> list[Any]:
        posted_on.append(stream.current)
        net.batch(ops)
        return [StreamWork(stream) for _ in ops]

    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    sender = link(0)
    receiver = DistLink(device=torch.device("cpu"), pairs={(0, 1): "group 0->1"},
                        waiter=StreamWaiter(stream, use=stream.use), ordered=True, rank=1)
    header = sender.send([encoded(torch.arange(8.0), "bf16")], 1, 0, "F", 1, 0)
    [value] = await receiver.receive(header, 0, 0, "F", 1, 0)
    torch.testing.assert_close(value, torch.arange(8.0))
    assert posted_on == [False, True]  # the sender above waits gloo's way; the receiver posts on the stream
    assert stream.entered == 3  # post, wait, decode
    await receiver.flush()
    receiver.close()
    sender.close()


async def test_gloo_waits_block_a_communication_thread_not_the_loop() -> None:
    waiter = ThreadWaiter()
    works = [Work(), Work()]
    await waiter.wait(works)
    assert all(w.waited_by and w.waited_by[0].startswith("stage-p2p") for w in works)
    waiter.close()


class FailedWork:
    """A transfer whose wait raises ``error``, as gloo's does."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def wait(self) -> bool:
        raise self.error


GLOO_CLOSED = ("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:64204. "
               "This is typically caused by a remote worker crashing.")


async def test_a_gloo_connection_the_other_rank_closed_is_named_peer_closed() -> None:
    # gloo says so only in a RuntimeError's text; the head waits for the lost node behind a PeerClosed.
    waiter = ThreadWaiter()
    with pytest.raises(PeerClosed, match="other rank's connection closed.*Connection closed by peer") as info:
        await waiter.wait([Work(), FailedWork(RuntimeError(GLOO_CLOSED))])
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="^no route to rank 3$") as other:  # any other failure is its own
        await waiter.wait([FailedWork(RuntimeError("no route to rank 3"))])
    assert not isinstance(other.value, PeerClosed)
    waiter.close()


# Rank 1 of a gloo pair: takes one value, then its process ends.
_GLOO_RANK_1 = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    group = dist.ProcessGroupGloo(dist.FileStore(sys.argv[1], 2), 1, 2)
    group.recv([torch.zeros(4)], 0, 0).wait()
""")


@pytest.mark.multiprocess
async def test_a_send_to_a_gloo_rank_whose_process_ended_raises_peer_closed(tmp_path: Any) -> None:
    store = str(tmp_path / "store")
    child = subprocess.Popen([sys.executable, "-c", _GLOO_RANK_1, store])
    waiter = ThreadWaiter()
    try:
        group = await asyncio.to_thread(dist.ProcessGroupGloo, dist.FileStore(store, 2), 0, 2)
        await waiter.wait([group.send([torch.ones(4)], 1, 0)])
        assert await asyncio.to_thread(child.wait, 60) == 0
        with pytest.raises(PeerClosed, match="Connection closed by peer"):
            with naming_a_closed_peer():  # gloo raises when posting to a rank already gone, or while waiting
                await waiter.wait([group.send([torch.ones(1 << 20)], 1, 0)])
    finally:
        waiter.close()
        child.kill()
        child.wait()


async def test_flush_waits_for_every_send_once(monkeypatch: pytest.MonkeyPatch) -> None:
    net = Net()
    net.install(monkeypatch)
    works: list[Work] = []

    def batch(ops: list[Op]) -> list[Work]:
        works.extend(net.batch(ops))
        return works[-len(ops):]

    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    sender = link(0)
    sender.send([encoded(torch.ones(3), "int8")], 1, 0, "F", 1, 0)
    sender.send([encoded(torch.ones(3))], 1, 0, "F", 1, 1)
    await sender.flush()
    await sender.flush()
    assert [len(w.waited_by) for w in works] == [1, 1, 1]
    sender.close()


async def test_a_cpu_stage_gets_gloo_waits_and_tag_matching() -> None:
    cpu = open_link(torch.device("cpu"), {(0, 1): "g"}, 0)
    assert isinstance(cpu._waiter, ThreadWaiter) and not cpu._ordered
    cpu.close()


async def test_a_receive_that_fails_to_post_breaks_its_route_on_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    net = Net()
    net.install(monkeypatch)
    sender, receiver = link(0), link(1)
    headers = [sender.send([encoded(torch.ones(4))], 1, 0, "F", 1, m) for m in range(2)]

    def out_of_memory(ops: list[Op]) -> list[Work]:
        raise torch.OutOfMemoryError("no room for the receive buffers")

    monkeypatch.setattr(dist, "batch_isend_irecv", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        await receiver.receive(headers[0], 0, 0, "F", 1, 0)
    net.install(monkeypatch)
    with pytest.raises(LinkBroken, match="posting the receive of value 0 from rank 0 failed"):
        await receiver.receive(headers[1], 0, 0, "F", 1, 1)
    for each in (sender, receiver):
        each.close()
