"""Reused host buffers for copies between a device and the host (see :mod:`stages.comm.device_io`).

Run its tests with: `.venv/bin/python -m pytest -q tests/stages/comm/test_device_io.py`
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DEFAULT_POOL_BYTES", "PinnedPool"]

DEFAULT_POOL_BYTES = 256 << 20


def _use_count(tensor: torch.Tensor) -> int:
    """How many tensors (zmq frames' numpy views included) reference ``tensor``'s memory, plus one.

    Without torch's private counter, a large number: buffers are then never reused
    (the pool hands out unpooled ones once it is full), which is slower but still correct.
    """
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return 1 << 30
    return int(counter(tensor.untyped_storage()._cdata))


@dataclass(slots=True)
class _Lease:
    block: torch.Tensor
    baseline: int  # _use_count with the pool's own reference alone
    released: bool = False
    after: Any = None  # the event the last copy from or into it records


class PinnedPool:
    """Reused host buffers for copies between a device and the host, pinned where CUDA can pin.

    Buffers come in power-of-two size classes (at least ``min_block`` bytes). A buffer
    given back with :meth:`release` is reused only once nothing else references its
    memory (ZeroMQ may still be sending from it: a zero-copy frame holds a view until
    libzmq is done with it) and the copy event it was given back with has completed.
    That is the cheapest correct choice for the send path: no copy of the frames, and no
    message tracker to thread through every layer of the actor runtime.

    The pool holds at most ``max_bytes``: when a new buffer would not fit, free buffers
    of other sizes are dropped first, and failing that the caller gets an ordinary
    unpooled buffer (counted in ``overflows``) that the garbage collector frees.

    Counters: ``allocations`` (buffers the pool made), ``reuses`` (requests served by a
    buffer made before), ``overflows``, ``bytes_held`` (the size of every buffer the pool
    owns, free or leased). After warm-up a steady stream of same-sized requests raises
    only ``reuses``.

    Args:
        max_bytes: the most bytes the pool owns at once.
        pinned: page-lock the buffers; by default where CUDA is available (pinning
            needs a CUDA driver).
        min_block: the smallest size class.

    Thread-safe: the event loop and the compute thread share a stage's pool.
    """

    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES, *, pinned: bool | None = None, min_block: int = 4096
                 ) -> None:
        if max_bytes < 0 or min_block < 1:
            raise ValueError(f"max_bytes must be >= 0 and min_block >= 1, got {max_bytes} and {min_block}")
        self.max_bytes = max_bytes
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self.min_block = min_block
        self.allocations = 0
        self.reuses = 0
        self.overflows = 0
        self.bytes_held = 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._leased: dict[int, _Lease] = {}  # by data_ptr
        self._lock = threading.Lock()

    def size_class(self, nbytes: int) -> int:
        """The size of the buffer that serves ``nbytes``."""
        return max(self.min_block, 1 << max(0, nbytes - 1).bit_length())

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of exactly ``nbytes`` (a view of a pooled one); give it back with :meth:`release`.

        Raises:
            ValueError: ``nbytes`` < 0.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        size = self.size_class(nbytes)
        with self._lock:
            block = self._take(size)
            if block is None:
                self._reclaim()
                block = self._take(size)
            if block is None:
                block = self._grow(size)
            if block is None:
                self.overflows += 1
                return torch.empty(nbytes, dtype=torch.uint8)
            self._leased[block.data_ptr()] = _Lease(block, _use_count(block))
        return block[:nbytes]

    def release(self, buffer: torch.Tensor, after: Any = None) -> None:
        """Gives back a buffer from :meth:`acquire`: reusable once nothing references its memory any more and
        ``after`` (an event, or None) has completed. An unpooled buffer is left to the garbage collector."""
        with self._lock:
            lease = self._leased.get(buffer.data_ptr()) if buffer.numel() else None
            if lease is not None:
                lease.released = True
                lease.after = after

    def trim(self) -> int:
        """Drops every free buffer; returns the bytes given up."""
        with self._lock:
            self._reclaim()
            dropped = sum(block.numel() for blocks in self._free.values() for block in blocks)
            self._free.clear()
            self.bytes_held -= dropped
            return dropped

    @property
    def num_leased(self) -> int:
        """Buffers handed out and not yet reusable."""
        with self._lock:
            return len(self._leased)

    def _take(self, size: int) -> torch.Tensor | None:
        blocks = self._free.get(size)
        if not blocks:
            return None
        self.reuses += 1
        return blocks.pop()

    def _reclaim(self) -> None:
        for ptr, lease in list(self._leased.items()):
            if lease.released and (lease.after is None or lease.after.query()) \
                    and _use_count(lease.block) <= lease.baseline:
                del self._leased[ptr]
                self._free.setdefault(lease.block.numel(), []).append(lease.block)

    def _grow(self, size: int) -> torch.Tensor | None:
        if size > self.max_bytes:
            return None
        for other in sorted(self._free, reverse=True):  # the largest free buffers make room first
            while self.bytes_held + size > self.max_bytes and self._free[other]:
                self.bytes_held -= self._free[other].pop().numel()
        if self.bytes_held + size > self.max_bytes:
            return None
        self.allocations += 1
        self.bytes_held += size
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
