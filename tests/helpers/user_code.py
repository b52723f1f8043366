"""Factories whose code ends the process or interrupts it, as a user's own might (tests of containment)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
from torch import nn


def exiting_model(**kwargs: Any) -> nn.Sequential:
    sys.exit(3)


def interrupting_model(**kwargs: Any) -> nn.Sequential:
    raise KeyboardInterrupt


def exiting_data(**kwargs: Any) -> Any:
    sys.exit(4)


def exiting_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    sys.exit(5)


def gated_data(started: str, gate: str) -> Any:
    """A data factory that takes as long as the test says: it marks ``started``, then waits for ``gate``."""
    open(started, "w").close()
    deadline = time.monotonic() + 120  # a test that never opens the gate still ends
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        return torch.randn(4, 2, 8, generator=generator), torch.randn(4, 2, 8, generator=generator)

    return batch


def crashing_model(code: int = 9, **kwargs: Any) -> nn.Sequential:
    """A model factory that ends its process at once, as native code gone wrong would (no exception)."""
    os._exit(code)


def crashing_data(code: int = 8, **kwargs: Any) -> Any:
    os._exit(code)


def ending_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss that ends its process mid-step (``os._exit``: nothing to catch)."""
    os._exit(7)


def segfaulting_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss that reads address 0: SIGSEGV, as a crash in an extension would."""
    import ctypes

    ctypes.string_at(0)
    raise AssertionError("unreachable")


def spinning_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss that never returns and never lets go of the interpreter: ``re``'s matcher holds the
    GIL through an exponential backtrack (about 2**60 steps here)."""
    import re

    re.match(r"(a*)*b", "a" * 60)
    raise AssertionError("unreachable")


def node_marker(kind: str, node_pid: int) -> str:
    """A file named for a node (by its pid, which is its stages' process group)."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"actorpipe-test-{kind}-{node_pid}")


def ending_once_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error; once the test arms this node (``node_marker("armed", pid)``), the next
    call ends its process (``os._exit``), one time only."""
    armed, fired = node_marker("armed", os.getpgid(0)), node_marker("fired", os.getpgid(0))
    if os.path.exists(armed) and not os.path.exists(fired):
        open(fired, "w").close()
        os._exit(7)
    return torch.nn.functional.mse_loss(output, target)




def nth_build_fails(marker: str, fail_at: int, block_at: int = 0, **kwargs: Any) -> nn.Sequential:
    """A model factory that raises in the ``fail_at``-th process to call it and holds the ``block_at``-th
    until ``marker + ".gate"`` exists (two minutes at most), as a rank that waits for a peer does
    (the calls are counted with files beside ``marker``: the head's inspection of the model is the
    first); every call builds ``examples.models.residual_mlp(**kwargs)`` otherwise."""
    from examples.models import residual_mlp

    call = 1
    while True:
        try:
            os.close(os.open(f"{marker}.{call}", os.O_CREAT | os.O_EXCL))
            break
        except FileExistsError:
            call += 1
    if call == fail_at:
        raise RuntimeError("this stage's model could not be built")
    deadline = time.monotonic() + 120
    while call == block_at and not os.path.exists(f"{marker}.gate") and time.monotonic() < deadline:
        time.sleep(0.05)
    return residual_mlp(**kwargs)
