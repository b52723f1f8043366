"""Where a job's data stands at each step (schedulers.data_positions), and a dataset read on from there."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from schedulers.data_positions import DataPositions
from stages.build.data_source import DatasetReader

pytestmark = pytest.mark.timeout(30)


def test_a_change_of_micro_batches_goes_on_from_where_the_stream_stood_and_a_rollback_finds_the_old_rate() -> None:
    positions = DataPositions(4)  # 2 replicas x 2 micro-batches
    assert [positions.at(step) for step in range(4)] == [0, 4, 8, 12]
    positions.change(3, 8)  # set micro_batches 4 before step 3
    assert [positions.at(step) for step in range(6)] == [0, 4, 8, 12, 20, 28]
    positions.change(5, 2)
    assert [positions.at(step) for step in (2, 4, 5, 6)] == [8, 20, 28, 30]  # a replay of step 2 reads as before
    positions.restart(10, 33, 4)  # a checkpoint of step 10 loaded, its stream at 33
    assert [positions.at(step) for step in (10, 11)] == [33, 37]


def test_a_layout_changed_mid_epoch_reads_every_sample_of_the_epoch_once() -> None:
    """Found by review: after a change of micro_batches or of replicas the position came from the step count in
    the new layout, and samples of the epoch were skipped or read twice. Read from the positions the scheduler
    keeps, 2 steps at 2 replicas x 2 micro-batches, then 2 at 1 replica x 3, take 4 x 2 + 2 x 3 = 14 of the
    16 samples of an epoch, each once, and the stream goes on in order."""
    loader = DataLoader(TensorDataset(torch.arange(16).float().unsqueeze(1), torch.arange(16)), batch_size=1,
                        shuffle=True)
    reader = DatasetReader(loader, None, seed=2)
    positions = DataPositions(4)
    try:
        taken = [int(x) for step in range(2) for r in range(2)
                 for x in torch.cat(reader.read(step, r, 2, 2, positions.at(step))[0]).flatten()]
        positions.change(2, 3)
        taken += [int(x) for step in range(2, 4)
                  for x in torch.cat(reader.read(step, 0, 1, 3, positions.at(step))[0]).flatten()]
    finally:
        reader.close()
    assert len(taken) == len(set(taken)) == 14
    order = torch.randperm(16, generator=torch.Generator().manual_seed(2)).tolist()
    assert sorted(taken) == sorted(order[:14])
