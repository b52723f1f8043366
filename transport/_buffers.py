"""Fresh CPU buffers for what the transport receives, seals, decrypts and decodes."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["POOL_MAX_BYTES", "aligned_empty", "only_held_by"]

# From this size a buffer comes from numpy's allocator rather than torch's, and from the pool.
_NUMPY_FROM_BYTES = 1 << 20
# The most bytes of blocks the pool keeps, in use or free; larger buffers beyond it are
# allocated as they would be without the pool.
POOL_MAX_BYTES = 256 << 20


class _BlockPool:
    """Large blocks kept for reuse once nothing refers to them any more.

    A buffer a message was sealed into stays with ZeroMQ until it is sent; a received
    one becomes the caller's tensor. Either way nobody tells the transport when it is
    done with it, but every view, memoryview, tensor and storage made from a block holds
    a reference to the block's array (numpy and torch both keep the array that owns the
    memory alive), so a block whose only reference is the pool's own is free.

    Why keep them: a fresh 16 MiB buffer page-faults in again, zeroed by the kernel, on
    every message while the ones before it are still held (by ZeroMQ's queue, by the
    stage): AES-GCM into a fresh buffer took 3.8 ms against 1.6 into one used before,
    and 7-14 ms in a sender beside a receiver on a 2-core machine.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._by_size: dict[int, list[np.ndarray]] = {}
        self._bytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A block of at least ``nbytes`` + 64 bytes that nothing else refers to."""
        with self._lock:
            blocks = self._by_size.get(nbytes)
            if blocks is not None:
                index = _first_free(blocks)
                if index >= 0:
                    return blocks[index]
            block = np.empty(nbytes + 64, dtype=np.uint8)
            if self._bytes + block.nbytes > self.max_bytes:
                self._drop_free(self._bytes + block.nbytes - self.max_bytes)
            if self._bytes + block.nbytes <= self.max_bytes:
                self._by_size.setdefault(nbytes, []).append(block)
                self._bytes += block.nbytes
            return block

    def _drop_free(self, nbytes: int) -> None:
        """Lets go of free blocks of any size, oldest sizes first, until ``nbytes`` are let go or none is free."""
        for size in list(self._by_size):
            blocks = self._by_size[size]
            while nbytes > 0 and (index := _first_free(blocks)) >= 0:
                nbytes -= blocks[index].nbytes
                self._bytes -= blocks[index].nbytes
                del blocks[index]
            if not blocks:
                del self._by_size[size]
            if nbytes <= 0:
                return

    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes


def _references(items: Sequence[Any], index: int) -> int:
    return sys.getrefcount(items[index])


# What _references counts for an object only its list refers to (the list's reference and
# getrefcount's argument: 2 on CPython 3.11), measured the same way rather than assumed.
_ONLY_THE_CONTAINERS = _references([object()], 0)


def only_held_by(items: Sequence[Any], index: int) -> bool:
    """Whether ``items[index]`` has no reference but the one of ``items`` (a list or a deque)."""
    return _references(items, index) == _ONLY_THE_CONTAINERS


def _first_free(blocks: list[np.ndarray]) -> int:
    """The index of the first block only ``blocks`` refers to, or -1."""
    for index in range(len(blocks)):
        if only_held_by(blocks, index):
            return index
    return -1


_POOL = _BlockPool(POOL_MAX_BYTES)


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` at a 64-byte aligned address, not zeroed, that nothing else uses.

    Large ones come from numpy's allocator, through a pool of blocks reused once every
    tensor and view of them is gone (see :class:`_BlockPool`): torch's allocator left
    each to page-fault in again, zeroed, on every message (16 MiB received and freed in
    a loop: 82-655 faults and 0.69-1.46 ms a buffer, against none and 0.36 ms through
    malloc, which the pool also saves while earlier buffers are still held). Small ones
    are cheaper from torch (1.4 us against 3.3 us of Python).
    """
    if nbytes < _NUMPY_FROM_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    whole = torch.from_numpy(_POOL.take(nbytes))
    start = -whole.data_ptr() % 64
    return whole[start:start + nbytes]
