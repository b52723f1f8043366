"""The transport's large buffers: reused once nothing refers to them, never while something does."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from transport import _buffers
from transport._buffers import aligned_empty

SIZE = 2 << 20  # above the size from which buffers come from the pool


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> _buffers._BlockPool:
    """A pool of this test's own, so blocks other tests left in the process's pool play no part."""
    fresh = _buffers._BlockPool(_buffers.POOL_MAX_BYTES)
    monkeypatch.setattr(_buffers, "_POOL", fresh)
    return fresh


def test_a_buffer_is_used_again_once_every_tensor_of_it_is_gone(pool: _buffers._BlockPool) -> None:
    first = aligned_empty(SIZE)
    address = first.data_ptr()
    assert address % 64 == 0 and first.numel() == SIZE
    del first
    again = aligned_empty(SIZE)
    assert again.data_ptr() == address
    assert pool.held_bytes() == SIZE + 64


# Whatever the transport or a caller makes of a buffer must keep it from being handed out again.
HOLDERS: dict[str, Callable[[torch.Tensor], Any]] = {
    "tensor slice": lambda t: t[:],
    "view as float32": lambda t: t.view(torch.float32),
    "storage only": lambda t: t.untyped_storage(),
    "numpy array": lambda t: t.numpy(),
    "slice of a numpy slice": lambda t: t.numpy()[8:][8:],
    "memoryview": lambda t: memoryview(t.numpy()),
    "slice of a memoryview": lambda t: memoryview(t.numpy())[64:],
    "tensor from a memoryview": lambda t: torch.frombuffer(memoryview(t.numpy())[64:], dtype=torch.uint8),
    "zmq frame": lambda t: zmq.Frame(memoryview(t.numpy()), copy=False),
}


def _first_bytes(held: Any, offset: int) -> bytes:
    """The first 64 bytes of the buffer ``held`` was made from, read through ``held``."""
    if isinstance(held, torch.UntypedStorage):
        return bytes(torch.empty(0, dtype=torch.uint8).set_(held, offset, (64,)).tolist())
    if isinstance(held, torch.Tensor):
        return bytes(held.view(torch.uint8)[:64].tolist())
    return bytes(memoryview(held.buffer if isinstance(held, zmq.Frame) else held).cast("B")[:64])


def _taken_again(address: int) -> bool:
    """Whether the pool hands out the block at ``address`` again within a few seconds (a zmq frame's
    buffer is let go by pyzmq's garbage thread, a moment after the frame is)."""
    for _ in range(500):
        if aligned_empty(SIZE).data_ptr() == address:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("make", HOLDERS.values(), ids=HOLDERS.keys())
def test_a_buffer_is_not_handed_out_while_anything_made_from_it_lives(pool: _buffers._BlockPool,
                                                                     make: Callable[[torch.Tensor], Any]) -> None:
    first = aligned_empty(SIZE)
    first.fill_(7)
    held = make(first[64:])
    address, offset = first.data_ptr(), first.storage_offset() + 64
    del first
    second = aligned_empty(SIZE)
    second.fill_(9)
    assert second.data_ptr() != address
    assert _first_bytes(held, offset) == b"\x07" * 64  # what the holder reads is still its own
    del held, second
    assert _taken_again(address)  # once it is gone, the block is free again


def test_blocks_of_other_sizes_that_are_free_make_room_and_the_pool_stays_under_its_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    small = _buffers._BlockPool(3 * (SIZE + 64))
    monkeypatch.setattr(_buffers, "_POOL", small)
    kept = [aligned_empty(SIZE) for _ in range(2)]
    del kept[1]
    larger = aligned_empty(2 * SIZE)  # over the limit with three blocks: the free one goes
    assert small.held_bytes() == (SIZE + 64) + (2 * SIZE + 64)
    beyond = aligned_empty(2 * SIZE)  # nothing free to let go: allocated as without a pool
    assert small.held_bytes() <= small.max_bytes and beyond.data_ptr() != larger.data_ptr()
    del beyond
    assert small.held_bytes() == (SIZE + 64) + (2 * SIZE + 64)
    assert len(kept) == 1


def test_buffers_used_again_do_not_fault_their_pages_in_again(pool: _buffers._BlockPool) -> None:
    """The cost the pool removes: a buffer freed to malloc while others are held comes back as
    fresh pages (glibc hands memory above its trim threshold back to the kernel), each one a page
    fault and a zeroing (15-30 ms for 16 MiB in this project's 2-core VM)."""
    def burst() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        held = [aligned_empty(16 << 20) for _ in range(6)]  # ZeroMQ's queue, or a stage's stash
        for buffer in held:
            buffer.numpy()[::4096] = 1  # touch every page
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    burst()
    pages = 6 * (16 << 20) // 4096
    assert burst() < pages // 10


def test_small_buffers_do_not_come_from_the_pool(pool: _buffers._BlockPool) -> None:
    small = aligned_empty(4096)
    assert small.numel() == 4096 and pool.held_bytes() == 0
    assert isinstance(np.asarray(small.numpy()), np.ndarray)
