"""Counting this process's GPUs and pinning a thread to one: the only calls into CUDA for placement.

The rules of which node gets which device are torch-free (:mod:`actors.devices`).
"""

from __future__ import annotations

import torch

from actors.devices import check_device, cuda_index

__all__ = ["pin_device", "visible_gpu_count"]


def visible_gpu_count() -> int:
    """How many CUDA devices this process sees (0 without CUDA); honours ``CUDA_VISIBLE_DEVICES``."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pin_device(device: str) -> None:
    """Makes ``device`` the current CUDA device of the calling thread; nothing for ``cpu``.

    CUDA's current device belongs to a host thread, not the process: a node calls this
    at start and again on each thread that computes (the stage's compute thread), so
    that a kernel, a stream or an NCCL communicator made without an explicit index lands
    on the node's GPU and not on ``cuda:0``.

    Raises:
        ValueError: not a device name, or this process sees no such GPU.
    """
    index = cuda_index(device)
    if index is None:
        return
    check_device(device, visible_gpu_count())
    torch.cuda.set_device(index)
