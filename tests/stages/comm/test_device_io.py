"""Tests for stages/comm/device_io.py and stages/comm/pinned.py: the pinned pool, the no-op CPU streams, and the CUDA
path's ordering, run on the CPU with a fake backend that records every stream call and copy.

Run: .venv/bin/python -m pytest -q tests/stages/comm/test_device_io.py
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from stages.comm.pinned import PinnedPool
from stages.comm.device_io import DeviceIO, DeviceStreams, backend_for, copy_to_cpu
from transport.codecs import Encoded, decode, get_codec

pytestmark = pytest.mark.timeout(60)


# -- a fake CUDA: streams and events that log what happens, in order -------------------------------------


class FakeEvent:
    def __init__(self, log: list[tuple[Any, ...]], number: int) -> None:
        self.log, self.name, self.done = log, f"e{number}", False

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))
        self.done = True


class FakeStream:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", self.name, event.name))


class FakeCuda:
    """Stages like CUDA (every CPU tensor counts as the device's), and logs each call."""

    staged = True
    pinned = False

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.events: list[FakeEvent] = []
        self.current = "compute"

    def current_stream(self) -> FakeStream:
        return FakeStream(self.log, "compute")

    def new_stream(self) -> FakeStream:
        return FakeStream(self.log, "copy")

    def new_event(self) -> FakeEvent:
        self.events.append(FakeEvent(self.log, len(self.events)))
        return self.events[-1]

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream.name
        try:
            yield
        finally:
            self.current = before

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", stream.name))

    def finish(self) -> None:
        """Every event completes (the device caught up)."""
        for event in self.events:
            event.done = True


class LogCopies(TorchFunctionMode):
    """Logs each ``copy_`` with the stream it was launched on and whether it may overlap the host."""

    def __init__(self, backend: FakeCuda) -> None:
        super().__init__()
        self.backend = backend

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            blocking = "non_blocking" if kwargs.get("non_blocking", args[2] if len(args) > 2 else False) else "blocking"
            self.backend.log.append(("copy", self.backend.current, blocking))
        return func(*args, **kwargs)


def fake_io(**kwargs: Any) -> tuple[DeviceIO, FakeCuda]:
    backend = FakeCuda()
    return DeviceIO("cpu", backend=backend, **kwargs), backend


def steps(log: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [entry for entry in log if entry[0] != "synchronize"]


# -- the pool ------------------------------------------------------------------------------------------


def test_the_pool_reuses_a_released_buffer_and_allocates_none_after_warm_up() -> None:
    pool = PinnedPool(1 << 20, pinned=False)
    for _ in range(10):  # ten micro-batches of the same two sizes
        first, second = pool.acquire(3000), pool.acquire(70_000)
        assert (first.numel(), second.numel()) == (3000, 70_000)
        pool.release(first)
        pool.release(second)
        del first, second
    assert pool.allocations == 2 and pool.reuses == 18 and pool.overflows == 0
    assert pool.bytes_held == 4096 + 131072  # power-of-two size classes


def test_a_buffer_something_still_references_is_not_reused() -> None:
    pool = PinnedPool(1 << 20, pinned=False)
    buffer = pool.acquire(1000)
    frame = memoryview(buffer.view(torch.int32).reshape(10, 25).numpy())  # type: ignore[arg-type]  # as ZeroMQ holds a frame
    pool.release(buffer)
    del buffer
    other = pool.acquire(1000)
    assert pool.allocations == 2 and pool.num_leased == 2
    del frame
    gc.collect()
    pool.release(other)
    del other
    pool.acquire(1000)
    assert pool.allocations == 2 and pool.reuses == 1


def test_a_buffer_is_not_reused_before_its_copy_event_completes() -> None:
    pool = PinnedPool(1 << 20, pinned=False)
    event = FakeEvent([], 0)
    pool.release(pool.acquire(100), after=event)
    pool.acquire(100)
    assert pool.allocations == 2
    event.done = True
    pool.acquire(100)
    assert pool.allocations == 2 and pool.reuses == 1


def test_an_unreleased_buffer_stays_leased_even_once_dropped() -> None:
    pool = PinnedPool(1 << 20, pinned=False)
    pool.acquire(100)
    pool.acquire(100)
    assert pool.allocations == 2 and pool.num_leased == 2


def test_the_pool_stays_within_its_bound_and_serves_what_does_not_fit_unpooled() -> None:
    pool = PinnedPool(16384, pinned=False)
    held = [pool.acquire(4096) for _ in range(4)]
    assert pool.bytes_held == 16384
    extra = pool.acquire(4096)  # no room: an ordinary buffer, not counted
    assert pool.overflows == 1 and pool.bytes_held == 16384 and extra.numel() == 4096
    pool.release(extra)
    for buffer in held:
        pool.release(buffer)
    del held, buffer
    big = pool.acquire(10_000)  # free buffers of another size make room
    assert big.numel() == 10_000 and pool.bytes_held == 16384 and pool.allocations == 5
    assert pool.acquire(1 << 20).numel() == 1 << 20 and pool.overflows == 2  # over the whole bound
    assert pool.trim() == 0 and pool.acquire(0).numel() == 0


def test_the_pool_refuses_a_negative_size() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        PinnedPool().acquire(-1)


# -- the CPU: nothing moves, nothing waits -------------------------------------------------------------


def test_on_the_cpu_streams_are_no_ops_and_events_are_complete() -> None:
    streams = DeviceStreams("cpu")
    event = streams.record()
    streams.wait(event, streams.copy)
    assert event.query()
    with streams.copying():
        pass
    assert not backend_for("cpu").staged and backend_for("cuda:0").staged


async def test_on_the_cpu_every_path_hands_the_same_tensors_back() -> None:
    io = DeviceIO("cpu")
    x, y = torch.randn(4, 5), torch.arange(6)
    encoded = get_codec("int8").encode(x)
    host = io.to_host([x, encoded, y])
    await io.wait(host.event)
    assert host.values[0] is x and host.values[1] is encoded and host.values[2] is y
    assert io.to_device([x, y])[0] is x
    back = io.copy_to_cpu([x])[0]
    assert back.data_ptr() == x.data_ptr()  # as x.detach().cpu(): the same memory
    assert io.copy_to_device([x])[0] is x
    assert copy_to_cpu([x])[0].data_ptr() == x.data_ptr()
    assert io.pool.allocations == 0


# -- the CUDA path's logic, with the fake -----------------------------------------------------------------


async def test_to_host_copies_after_the_producing_kernels_on_the_copy_stream() -> None:
    io, cuda = fake_io()
    x = torch.randn(8, 16)
    y = torch.randn(4, 8).t()  # not contiguous
    encoded = get_codec("int8").encode(x)
    with LogCopies(cuda):
        host = io.to_host([x, encoded, y])
    assert steps(cuda.log) == [
        ("record", "e0", "compute"),  # after the kernels that made x, y and the frames
        ("wait", "copy", "e0"),  # the copy stream waits; the compute stream does not
        ("copy", "copy", "non_blocking"), ("record_stream", "copy"),  # x
        ("copy", "copy", "non_blocking"), ("record_stream", "copy"),  # the values frame
        ("copy", "copy", "non_blocking"), ("record_stream", "copy"),  # the scales frame
        ("copy", "copy", "non_blocking"), ("record_stream", "copy"),  # y, made contiguous on the copy stream first
        ("record", "e1", "copy"),
    ]
    assert host.event is cuda.events[1] and not host.event.query()
    cuda.log.clear()
    await io.wait(host.event)  # on the waiting thread, not the loop
    assert cuda.log == [("synchronize", "e1")]
    torch.testing.assert_close(host.values[0], x, rtol=0, atol=0)
    assert host.values[0].data_ptr() != x.data_ptr()
    torch.testing.assert_close(decode(host.values[1]), decode(encoded), rtol=0, atol=0)
    torch.testing.assert_close(host.values[2], y, rtol=0, atol=0)
    io.close()


def test_to_host_allocates_nothing_per_micro_batch_after_warm_up() -> None:
    io, cuda = fake_io()
    for _ in range(8):
        host = io.to_host([torch.randn(32, 64), get_codec("int8").encode(torch.randn(32, 64))])
        cuda.finish()  # the copy ran; ZeroMQ sent the frames and let them go
        del host
    assert io.pool.allocations == 3 and io.pool.reuses == 21


def test_to_device_stages_in_pinned_memory_and_orders_the_compute_stream_after_the_copy() -> None:
    io, cuda = fake_io()
    x, ids = torch.randn(3, 7), torch.arange(5)
    with LogCopies(cuda):
        out = io.to_device([x, ids])
    assert steps(cuda.log) == [
        ("copy", "compute", "blocking"), ("copy", "compute", "blocking"),  # into the pinned staging buffers
        ("copy", "copy", "non_blocking"), ("record_stream", "compute"),  # host->device, on the copy stream
        ("copy", "copy", "non_blocking"), ("record_stream", "compute"),
        ("record", "e0", "copy"),
        ("wait", "compute", "e0"),  # the consumer's kernels come after the copies; the host never waits
    ]
    assert out[0].data_ptr() != x.data_ptr()
    torch.testing.assert_close(out[0], x, rtol=0, atol=0)
    assert torch.equal(out[1], ids) and out[1].dtype == torch.int64
    assert io.pool.num_leased == 2  # the staging buffers wait for the copy's event
    cuda.finish()
    io.to_device([x, ids])
    assert io.pool.allocations == 2


def test_an_encoded_value_crosses_as_its_frames_and_is_decoded_on_the_device_after_its_copy() -> None:
    io, cuda = fake_io()
    x, ids = torch.randn(64, 300), torch.arange(5)
    kept = [get_codec("int8").encode(x), get_codec("bf16").encode(x)]  # as the wire keeps them on a GPU
    staged: list[int] = []
    acquire = io.pool.acquire
    io.pool.acquire = lambda nbytes: staged.append(nbytes) or acquire(nbytes)  # type: ignore[method-assign]
    with LogCopies(cuda):
        out = io.to_device([kept[0], ids, kept[1]])
    assert staged == [f.nbytes for f in kept[0].frames] + [ids.nbytes] + [f.nbytes for f in kept[1].frames]
    assert sum(staged) < x.nbytes * 0.8  # a quarter and a half of float32's, not two float32 copies
    assert steps(cuda.log)[-1] == ("wait", "compute", "e0")  # decoded on the compute stream, after the copy
    for got, encoded in zip((out[0], out[2]), kept):
        assert got.dtype == torch.float32 and torch.equal(got, decode(encoded))
    assert torch.equal(out[1], ids)
    plain = DeviceIO("cpu")  # on a CPU: the same values, decoded where they are
    assert all(torch.equal(a, b) for a, b in zip(plain.to_device([kept[0], ids, kept[1]]), out))


def test_a_round_trip_keeps_every_dtype_and_shape_bit_for_bit() -> None:
    io, cuda = fake_io()
    values = [torch.randn(2, 3, dtype=torch.float64), torch.randn(5).to(torch.bfloat16), torch.tensor(True),
              torch.empty(0, 4), torch.tensor(3.5), torch.randint(0, 255, (7,), dtype=torch.uint8)]
    host = io.to_host(values)
    back = io.to_device(host.values)
    for got, want in zip(back, values):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("chunk_bytes", [64, 1000, 1 << 20])
def test_bulk_copies_move_tensors_in_chunks_with_one_sync_each(chunk_bytes: int) -> None:
    io, cuda = fake_io(chunk_bytes=chunk_bytes)
    tensors = [torch.randn(100), torch.randn(10, 10).t(), torch.arange(30), torch.randn(0)]
    with LogCopies(cuda):
        out = io.copy_to_cpu(tensors)
    for got, want in zip(out, tensors):
        assert torch.equal(got, want) and (got.data_ptr() != want.data_ptr() or not want.numel())
    total = sum(t.numel() * t.element_size() for t in tensors)
    chunks = -(-total // chunk_bytes)
    assert sum(entry[0] == "synchronize" for entry in cuda.log) == chunks
    assert cuda.log[:2] == [("record", "e0", "compute"), ("wait", "copy", "e0")]
    assert all(entry[1:] == ("copy", "non_blocking") for entry in cuda.log if entry[0] == "copy"
               and entry[1] == "copy")
    assert io.pool.bytes_held <= 2 * io.pool.size_class(chunk_bytes)  # two chunks in flight at most

    cuda.log.clear()
    back = io.copy_to_device(out)
    for got, want in zip(back, tensors):
        assert torch.equal(got, want)
    assert cuda.log[-1] == ("wait", "compute", cuda.events[-1].name)  # the compute stream waits for the last
    assert sum(entry[0] == "synchronize" for entry in cuda.log) == max(0, chunks - 2)


def test_the_int8_codecs_device_dequantize_is_bit_equal_to_the_cpu_kernel() -> None:
    from transport.codecs import _dequantize_int8, _dequantize_int8_arithmetic

    values = torch.randint(-127, 128, (64, 256), dtype=torch.int8)
    scale = torch.rand(64) * torch.logspace(-30, 30, 64)
    for zero_point in (0, 8):
        assert torch.equal(_dequantize_int8_arithmetic(values, scale, zero_point),
                           _dequantize_int8(values, scale, zero_point))


def test_decode_refuses_frames_on_two_devices() -> None:
    encoded = get_codec("int8").encode(torch.randn(300))
    mixed = Encoded(codec="int8", dtype=encoded.dtype, shape=encoded.shape, params=encoded.params,
                    frames=(encoded.frames[0], encoded.frames[1].to("meta")))
    with pytest.raises(ValueError, match="one device"):
        decode(mixed)


async def test_wait_for_a_slow_copy_leaves_the_loop_free() -> None:
    io, _ = fake_io()
    released = asyncio.Event()

    class SlowEvent:
        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            asyncio.run_coroutine_threadsafe(released.wait(), loop).result(5)

    loop = asyncio.get_running_loop()
    waiting = asyncio.create_task(io.wait(SlowEvent()))
    await asyncio.sleep(0)
    assert not waiting.done()
    released.set()  # the loop ran this: it was not blocked
    await asyncio.wait_for(waiting, 5)
    io.close()
