"""DeepSpeed's learning-rate schedules, as ``torch.optim.lr_scheduler.LRScheduler`` classes.

``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` and ``OneCycle`` take DeepSpeed's
parameter names (a ``ds_config.json``'s ``scheduler.params`` as they are) and follow
the formulas of ``deepspeed/runtime/lr_schedules.py``, step for step: after ``k``
optimizer steps the learning rate is the one DeepSpeed's scheduler gives after ``k``
calls of its ``step()``. DeepSpeed counts ``last_batch_iteration`` from -1 (the value
at construction); torch counts ``last_epoch`` from 0 (its constructor takes the first
step), so every formula here reads ``iteration = last_epoch - 1``.

Being torch schedulers, they checkpoint with ``state_dict`` and mix with torch's own
(``SequentialLR``, ``ChainedScheduler``). A job names one as
``lr_scheduler=("stages.state.lr:WarmupLR", {...})``; every node loads this module whatever
its allow-list, as it is actorpipe's own code (see :mod:`stages.state.lr_scheduler`), so
nothing else may be defined here: only schedule classes, and private helpers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

log = logging.getLogger(__name__)

_WARMUP_TYPES = ("log", "linear")


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r:.40}")
    return float(value)


def _per_group(optimizer: Optimizer, value: Any, name: str) -> list[float]:
    """A number for every parameter group, or a list with one per group (as DeepSpeed takes them)."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name}: expected one value per parameter group ({len(optimizer.param_groups)}), "
                             f"got {len(value)}")
        return [_number(v, name) for v in value]
    return [_number(value, name)] * len(optimizer.param_groups)


def _warmup_steps(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"warmup_num_steps must be an integer >= 0, got {value!r:.40}")
    return max(2, value)  # DeepSpeed's floor (0, the Hugging Face integration's "no warm-up", too): log(1) is 0


def _warmup_type(value: Any) -> str:
    # DeepSpeed falls back to "log" on an unknown type with a warning; a typo is refused here instead.
    if value not in _WARMUP_TYPES:
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {value!r:.40}")
    return str(value)


def _start(last_batch_iteration: Any) -> None:
    if last_batch_iteration != -1:
        raise ValueError(f"last_batch_iteration={last_batch_iteration!r:.40}: a schedule starts at -1 here; "
                         "to resume one, load a checkpoint (it holds the schedule's state)")


def _warmup_fraction(iteration: int, num_steps: int, kind: str) -> float:
    """How far warmup has come at ``iteration`` (0 to 1), on DeepSpeed's log or linear curve."""
    if kind == "log":  # the reciprocal first, as DeepSpeed computes it: the same bits
        return (1.0 / math.log(num_steps)) * math.log(iteration + 1)
    return iteration / num_steps


# What a schedule's state holds of its position (torch's LRScheduler's own counters): all a load restores.
_POSITION = frozenset({"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial"})


class _ResumesPosition(LRScheduler):
    """A schedule that takes only its position from a saved state, as DeepSpeed's take only
    ``last_batch_iteration``: its settings are the ones it was made with, so a job resumed with a
    longer ``total_num_steps`` (or another peak) follows the new schedule from where the old one stood.
    Torch's ``load_state_dict`` restored every attribute, and the saved settings won over the new ones."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict({key: value for key, value in state_dict.items() if key in _POSITION})


class WarmupLR(_ResumesPosition):
    """Rises from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` steps, then stays there.

    Args:
        optimizer: the optimizer whose parameter groups it drives.
        warmup_min_lr: the first learning rate (a number, or one per parameter group).
        warmup_max_lr: the learning rate after warmup; None (as in DeepSpeed) takes each
            group's own ``lr``.
        warmup_num_steps: steps to warm up over (at least 2, as DeepSpeed makes it).
        warmup_type: ``"log"``: ``min + (max - min) * log(i + 1) / log(n)``;
            ``"linear"``: ``min + (max - min) * i / n``, at DeepSpeed iteration ``i``.
        last_batch_iteration: DeepSpeed's resume argument; only -1 (resume through a checkpoint).

    Raises:
        ValueError: a bad value, named.
    """

    def __init__(self, optimizer: Optimizer, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        _start(last_batch_iteration)
        self.warmup_num_steps = _warmup_steps(warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer)

    def get_lr(self) -> list[float | Tensor]:
        iteration = self.last_epoch - 1
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then a linear decay to 0 at ``total_num_steps``.

    After warmup the rate is ``min + (max - min) * max(0, (total - i) / max(1, total - n))``
    at DeepSpeed iteration ``i``. Unlike :class:`WarmupLR`, ``warmup_max_lr`` defaults
    to 0.001, as in DeepSpeed.

    Raises:
        ValueError: a bad value, named.
    """

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r:.40}")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            log.warning("WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d", total_num_steps,
                        self.warmup_num_steps)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_ResumesPosition):
    """Warms up to the optimizer's own ``lr``, then follows a cosine down to ``cos_min_ratio`` of it.

    Every rate is a ratio of each group's ``lr``: at DeepSpeed iteration ``i`` below
    ``n = warmup_num_steps`` the ratio is ``warmup_min_ratio + f * (1 - warmup_min_ratio)``
    (``f`` on the log or linear curve), afterwards
    ``cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2`` with
    ``p = min(1, (i - n + 1) / max(1, total_num_steps - n))``. As in DeepSpeed, the rate
    before the first step is 0.

    Raises:
        ValueError: a bad value, named.
    """

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        _start(last_batch_iteration)
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r:.40}")
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = _warmup_steps(warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_min_ratio = _number(warmup_min_ratio, "warmup_min_ratio")
        self.cos_min_ratio = _number(cos_min_ratio, "cos_min_ratio")
        if total_num_steps < self.warmup_num_steps:
            log.warning("WarmupCosineLR: total_num_steps %d is less than warmup_num_steps %d", total_num_steps,
                        self.warmup_num_steps)
        super().__init__(optimizer)

    def get_lr(self) -> list[float | Tensor]:
        iteration = self.last_epoch - 1
        if iteration < 0:
            return [0.0 for _ in self.base_lrs]
        ratio = self._ratio(iteration)
        return [float(base) * ratio for base in self.base_lrs]

    def _ratio(self, iteration: int) -> float:
        n = self.warmup_num_steps
        if iteration < n:
            rise = _warmup_fraction(iteration, n, self.warmup_type)
            return self.warmup_min_ratio + rise * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (iteration - n + 1) / max(1, self.total_num_steps - n))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)


class OneCycle(_ResumesPosition):
    """DeepSpeed's 1Cycle: one cycle up from ``cycle_min_lr`` to ``cycle_max_lr`` and back, then decay.

    The cycle rises over ``cycle_first_step_size`` steps and falls over
    ``cycle_second_step_size`` (default: the same); a stair count > 0 moves the rate in
    that many flat stairs per half instead of every step. After the cycle the rate is
    ``cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size)`` at ``d`` steps past it
    (``cycle_min_lr`` itself when either is 0).

    ``cycle_momentum`` does what DeepSpeed's does: with an optimizer that has ``betas``
    (Adam, AdamW…) it sets ``betas`` to ``(momentum, 0.99)``, the momentum moving
    inversely to the rate between ``cycle_max_mom`` and ``cycle_min_mom`` and starting
    at ``cycle_min_mom`` (note that DeepSpeed's fixed 0.99 replaces the optimizer's own
    second beta); after the cycle it is ``cycle_max_mom * (1 + decay_mom_rate * d /
    decay_step_size)``. With an optimizer without ``betas`` (SGD) DeepSpeed turns it
    off with a warning, and so does this.

    Raises:
        ValueError: a bad value, named.
    """

    def __init__(self, optimizer: Optimizer, cycle_min_lr: float | Sequence[float],
                 cycle_max_lr: float | Sequence[float], decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom: float | Sequence[float] = 0.8, cycle_max_mom: float | Sequence[float] = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        _start(last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if not first > 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size!r:.40}")
        if not second >= 0:
            raise ValueError(f"cycle_second_step_size must be >= 0, got {cycle_second_step_size!r:.40}")
        for name, count in (("cycle_first_stair_count", cycle_first_stair_count),
                            ("cycle_second_stair_count", cycle_second_stair_count)):
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {count!r:.40}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = float(decay_step_size)
        self.decay_lr_rate = float(decay_lr_rate)
        self.decay_mom_rate = float(decay_mom_rate)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in optimizer.defaults:
            log.warning("OneCycle: cycle_momentum is off: %s has no betas (as in DeepSpeed)",
                        type(optimizer).__name__)
            self.cycle_momentum = False
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        super().__init__(optimizer)

    def _scale(self, iteration: int) -> float:
        """Where in the cycle DeepSpeed iteration ``iteration`` is, from 0 (min lr) to 1 (max lr)."""
        batch = iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # from the integer position, as DeepSpeed does, not from the rounded scale
            in_cycle = batch % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decayed(self, iteration: int) -> float | None:
        """``d / decay_step_size`` past the cycle, or None while the cycle runs."""
        if iteration < self.total_size:
            return None
        return (iteration - self.total_size + 1) / self.decay_step_size if self.decay_step_size else 0.0

    def get_lr(self) -> list[float | Tensor]:
        iteration = self.last_epoch - 1
        interval = self._decayed(iteration)
        if interval is None:
            scale = self._scale(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        return [low / (1 + self.decay_lr_rate * interval) for low in self.min_lrs]

    def _momenta(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_moms)  # DeepSpeed's constructor sets the minimum, whatever the formula says
        interval = self._decayed(iteration)
        if interval is None:
            scale = self._scale(iteration)
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return list(self.max_moms)
        return [high * (1 + self.decay_mom_rate * interval) for high in self.max_moms]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group, momentum in zip(self.optimizer.param_groups, self._momenta(self.last_epoch - 1)):
                group["betas"] = (momentum, 0.99)
