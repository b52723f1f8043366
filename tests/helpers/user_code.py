"""Factories whose code ends the process or interrupts it, as a user's own might (tests of containment)."""

from __future__ import annotations

import sys
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
