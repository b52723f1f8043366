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
