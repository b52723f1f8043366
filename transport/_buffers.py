"""Fresh CPU buffers for what the transport receives, decrypts and decodes."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["aligned_empty"]

# From this size a buffer comes from numpy's allocator rather than torch's.
_NUMPY_FROM_BYTES = 1 << 20


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A new uint8 tensor of ``nbytes`` at a 64-byte aligned address, not zeroed.

    Large ones come through numpy (plain ``malloc``): glibc then reuses the memory a
    previous message freed, where torch's allocator left it to page-fault in again, zeroed,
    on every message (16 MiB received and freed in a loop: 0 faults and 0.36 ms a buffer
    against 82-655 faults and 0.69-1.46 ms). Small ones are cheaper from torch (1.4 us
    against 3.3 us of Python).
    """
    if nbytes < _NUMPY_FROM_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    whole = torch.from_numpy(np.empty(nbytes + 64, dtype=np.uint8))
    start = -whole.data_ptr() % 64
    return whole[start:start + nbytes]
