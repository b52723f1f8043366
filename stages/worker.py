"""What a worker node loads at start-up: the actor classes it hosts, pinned to its device.

The runtime finds this module by entry point (``worker`` in the ``actorpipe`` group),
so that :mod:`actors` never names the stage package.
"""

from __future__ import annotations

import stages.actor  # noqa: F401  (registers the stage actor)
import stages.build.describe  # noqa: F401  (registers the model inspector)
from actors.devices import cuda_index
from stages.devices import pin_device
from transport.wire import keep_lossy_encoded

__all__ = ["preload", "start"]


def preload() -> None:
    """Imports what a stage would import on its first optimizer and its first step: the node's
    zygote (``actors._processes``) runs this once, so that each stage's process starts with it.
    ``torch.optim.Optimizer`` imports ``torch._dynamo`` the first time one is built (1.5 s of CPU
    here, in every stage's process without this)."""
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401



def start(device: str) -> None:
    """Prepares this process to compute on ``device``: from here on, work on the calling thread
    without an explicit index lands on the node's GPU (the stage's compute thread pins itself
    the same way).

    On a GPU, lossy values off the wire stay encoded until they reach the device
    (:func:`transport.wire.keep_lossy_encoded`).

    Raises:
        ValueError: ``device`` is not ``cpu`` or a GPU this process sees.
    """
    pin_device(device)
    keep_lossy_encoded(cuda_index(device) is not None)
