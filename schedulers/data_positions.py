"""Where a job's data stands at each step: how far into a dataset's stream a step's batch begins.

A dataset is read as one stream (:mod:`stages.build.data_source`), and a step reads the next
``data_parallel * micro_batches`` micro-batches of it (every replica's). While the layout stays,
step ``k``'s batch begins ``k * data_parallel * micro_batches`` micro-batches in, which the stages
work out themselves. A change of ``micro_batches`` on the running job, or a checkpoint loaded into
another layout, changes how many micro-batches a step takes from then on; worked out from the step
count, the stream jumped (samples skipped or trained twice). So the scheduler keeps, from each such
step on, where the stream stood there and how many micro-batches a step takes, and tells every step's
order its position (:attr:`stages.StepOrder.data_position`); checkpoints keep it.
"""

from __future__ import annotations

__all__ = ["DataPositions"]


class DataPositions:
    """A job's data positions, in global micro-batches (every replica's) read before a step's batch.

    Args:
        per_step: micro-batches a step takes: ``data_parallel * micro_batches``.
    """

    def __init__(self, per_step: int) -> None:
        self._starts: dict[int, tuple[int, int]] = {0: (0, per_step)}  # step -> (position there, per step from it)

    def at(self, step: int) -> int:
        """Where step ``step``'s batch begins (a step before every start: as the first start counts on)."""
        start = max((s for s in self._starts if s <= step), default=min(self._starts))
        position, per_step = self._starts[start]
        return max(0, position + (step - start) * per_step)

    def change(self, step: int, per_step: int) -> None:
        """From step ``step`` on, a step takes ``per_step`` micro-batches (``micro_batches`` was set)."""
        self._starts = {s: v for s, v in self._starts.items() if s < step} | {step: (self.at(step), per_step)}

    def restart(self, step: int, position: int, per_step: int) -> None:
        """A checkpoint of step ``step`` was loaded, its data at ``position``: from there on, ``per_step``."""
        self._starts = {step: (position, per_step)}
