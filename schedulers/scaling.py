"""fp16 loss scaling and global-norm clipping: what the scheduler decides between the reduction and the step.

The stages report each step's gradients as a share of the squared global norm
(:class:`~stages.records.ReduceReport.grad_sq`) and whether any is not finite; from
those the scheduler decides, for every stage at once, whether the step applies, by how
much the gradients are unscaled and clipped, and the next loss scale. One decision for
all: an overflow on any stage or replica skips the step on every one of them.

The dynamic scale follows DeepSpeed's ``DynamicLossScaler``: it starts at
``2**initial_scale_power``; an overflow costs one unit of ``hysteresis``, and when none
is left the scale halves (never below ``min_loss_scale``); after ``loss_scale_window``
steps without an overflow it doubles and the hysteresis is restored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LossScaler", "clip_coefficient"]


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor ``clip_grad_norm_`` multiplies gradients by: ``max_norm / (norm + 1e-6)``, at most 1."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


@dataclass(slots=True)
class LossScaler:
    """A job's fp16 loss scale: static (``window`` 0) or dynamic."""

    scale: float
    dynamic: bool = True
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    hysteresis_left: int = 2
    steps: int = 0  # optimizer-step decisions so far (applied or skipped)
    last_overflow: int = -1
    skipped: int = 0  # steps skipped for an overflow so far

    @classmethod
    def for_spec(cls, loss_scale: float, initial_scale_power: int, window: int, hysteresis: int,
                 min_scale: float) -> LossScaler:
        if loss_scale > 0:
            return cls(scale=float(loss_scale), dynamic=False, window=window, hysteresis=hysteresis,
                       min_scale=min_scale, hysteresis_left=hysteresis)
        return cls(scale=float(2 ** initial_scale_power), window=window, hysteresis=hysteresis,
                   min_scale=min_scale, hysteresis_left=hysteresis)

    @property
    def at_minimum(self) -> bool:
        return not self.dynamic or self.scale <= self.min_scale

    def update(self, overflow: bool) -> None:
        """Records one step's outcome and moves the scale for the next."""
        if overflow:
            self.skipped += 1
            if self.dynamic:
                if self.hysteresis == 1 or self.hysteresis_left == 1:
                    self.scale = max(self.scale / 2, self.min_scale)
                else:
                    self.hysteresis_left -= 1
            self.last_overflow = self.steps
        elif self.dynamic and (self.steps - self.last_overflow) % self.window == 0:
            self.hysteresis_left = self.hysteresis
            self.scale *= 2
        self.steps += 1

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "steps": self.steps,
                "last_overflow": self.last_overflow, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.steps = int(state["steps"])
        self.last_overflow = int(state["last_overflow"])
        self.skipped = int(state["skipped"])
