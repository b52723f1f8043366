"""A stage's reads of its data factory: on the loop's thread when they are known short.

A step that reads its batch from the job's data factory (``StepOrder.data_step``) used
to read it on a thread at every step: a dataset's first read, or one after a rollback,
can take a while, and the stage's loop keeps answering meanwhile. The hop to a thread
and back cost 0.3-0.7 ms a step of a small model on two busy cores, more than most
reads. So a read runs on the loop's thread when the step follows the last one read and
that read took at most :data:`~stages.compute.inline.INLINE_MAX_S` (as a short action
runs inline: :mod:`stages.compute.inline`); the first read, one after a rollback and
one after a read that took longer go to a thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from stages.build.data_source import BatchFunction, DatasetReader
from stages.comm.boundary import batch_size
from stages.build.stage import read_data
from stages.compute.inline import INLINE_MAX_S
from stages.records import StageConfig

__all__ = ["DataReads"]

Read = tuple[list[Any] | None, list[Any] | None, list[float] | None]


class DataReads:
    """One stage's data reads (see the module docstring).

    Args:
        data: the stage's data source (None: the job has none; a read fails as
            :func:`~stages.build.stage.read_data` says).
        config: the stage's config.
        clock: seconds, for timing each read.
        what: which of the job's data ``data`` is, as an error names it.
        once: each read is a batch of one pass over the dataset (the validation set with
            ``evaluation.eval_batches=0``); :attr:`pass_batches` is then the pass's length.
    """

    def __init__(self, data: BatchFunction | DatasetReader | None, config: StageConfig,
                 clock: Callable[[], float] = time.perf_counter, what: str = "data factory",
                 once: bool = False) -> None:
        self.data = data
        self.config = config
        self.what = what
        self.clock = clock
        self.once = once
        self.pass_batches: int | None = None  # with once, as the last read found it (the replicas may change)
        self.samples = 0  # on a last stage: the samples the last read's micro-batches held (its replica's share)
        self.inline = self.threaded = 0  # reads on the loop's thread, and on a thread
        self._next: int | None = None  # the step that follows the last one read
        self._last_s = float("inf")

    async def read(self, step: int, shard: Sequence[int], micro_batches: int, position: int | None = None) -> Read:
        """Step ``step``'s batch for replica ``shard`` (``[replica, replicas]``) in ``micro_batches`` parts
        (``position``: where a dataset's begins, :meth:`~stages.build.data_source.DatasetReader.read`).

        Raises:
            ValueError: as :func:`~stages.build.stage.read_data`.
        """
        if step == self._next and self._last_s <= INLINE_MAX_S:
            self.inline += 1
            found, seconds = self._timed(step, shard, micro_batches, position)
        else:
            self.threaded += 1
            found, seconds = await asyncio.to_thread(self._timed, step, shard, micro_batches, position)
        self._last_s, self._next = seconds, step + 1
        return found

    def _timed(self, step: int, shard: Sequence[int], micro_batches: int,
               position: int | None = None) -> tuple[Read, float]:
        """A read and its own time (not a thread hop's, wherever it ran)."""
        started = self.clock()
        found = read_data(self.data, self.config, step, shard, micro_batches, self.what, self.once, position)
        self.samples = sum(batch_size(t) or 0 for t in found[1] or ())
        if self.once and isinstance(self.data, DatasetReader):
            self.pass_batches = self.data.pass_batches(shard[1], micro_batches)
        return found, self.clock() - started
