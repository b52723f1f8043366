"""A stage's data reads (stages.build.reads): on a thread unless known short.

A source that records the thread of each read stands for the job's data factory: the
first read, one after a rollback and one after a slow read go to a thread (the loop
keeps answering); a read that follows a short one runs on the loop's thread; a stage
that holds neither the first nor the last model stage reads nothing.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from stages.build.reads import DataReads
from stages.compute.inline import INLINE_MAX_S
from tests.stages.stage_parts import stage_config

pytestmark = pytest.mark.timeout(60)


class Source:
    """A data source whose batch for a step is the step's number; it records where each read ran. Its
    clock moves only in a slow read, so what counts as short does not depend on the machine's load."""

    def __init__(self, slow_at: set[int] | None = None) -> None:
        self.slow_at = slow_at or set()
        self.threads: list[tuple[int, bool]] = []  # (step, on the loop's thread)
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def read(self, step: int, replica: int, replicas: int, micro_batches: int, position: int | None = None) -> Any:
        self.threads.append((step, threading.current_thread() is threading.main_thread()))
        if step in self.slow_at:
            self.now += 10 * INLINE_MAX_S
        batch = [torch.full((1,), float(step))] * micro_batches
        return batch, batch, None


async def test_a_read_runs_on_the_loop_only_after_a_short_read_of_the_step_before() -> None:
    source = Source(slow_at={3})
    reads = DataReads(source, stage_config(0), clock=source.clock)  # type: ignore[arg-type]
    steps = [0, 1, 2, 3, 4, 5, 2, 3]
    for step in steps:
        inputs, _, _ = await reads.read(step, [0, 1], 2)
        assert [float(x) for x in inputs] == [float(step)] * 2
    # The first read, the one after a slow read (4) and a rollback (the second 2) go to a thread.
    assert source.threads == list(zip(steps, [False, True, True, True, False, True, False, True]))
    assert (reads.inline, reads.threaded) == (5, 3)


async def test_a_stage_between_the_first_and_the_last_reads_nothing() -> None:
    source = Source()
    reads = DataReads(source, stage_config(1, 3), clock=source.clock)  # type: ignore[arg-type]
    assert await reads.read(0, [0, 1], 2) == (None, None, None)
    assert source.threads == []
