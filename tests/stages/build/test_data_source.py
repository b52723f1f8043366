"""Data sources (stages.build.data_source) in one process: datasets and DataLoaders read per replica."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset, default_collate

from stages.build.data_source import BatchFunction, DatasetReader, data_source, first_inputs, split_pair


def _dataset(n: int = 10) -> TensorDataset:
    return TensorDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n) * 10)


def _ids(read: tuple[list[Any], list[Any], Any]) -> list[list[int]]:
    return [mb.flatten().long().tolist() for mb in read[0]]


@pytest.mark.parametrize("shuffle", [False, True])
def test_each_replica_reads_what_distributed_sampler_gives_it_epoch_after_epoch(shuffle: bool) -> None:
    """10 samples, 3 replicas, 2 micro-batches of 2: each replica's stream is DistributedSampler's
    indices for epoch 0, then epoch 1's (set_epoch), without a gap between them."""
    dataset = _dataset(10)
    loader = DataLoader(dataset, batch_size=2, shuffle=shuffle)
    for replica in range(3):
        reader = data_source(loader, None, seed=7)
        assert isinstance(reader, DatasetReader)
        try:
            streamed = [i for step in range(4) for mb in _ids(reader.read(step, replica, 3, 2)) for i in mb]
        finally:
            reader.close()
        expected = []
        for epoch in range(4):
            sampler = DistributedSampler(dataset, num_replicas=3, rank=replica, shuffle=shuffle, seed=7)
            sampler.set_epoch(epoch)
            expected += list(sampler)
        assert streamed == expected[:16]


def test_a_step_reads_the_same_micro_batches_again_in_any_order() -> None:
    """The position is the step: reading step 3, then 1, then 3 again gives the same batches (a rollback,
    a resume from a checkpoint), and a dict with labels splits as Hugging Face's batches do."""
    items = [{"input_ids": torch.tensor([i, i + 1]), "labels": torch.tensor([i + 1, i + 2])} for i in range(9)]
    reader = DatasetReader(items, micro_batch_size=2, seed=0)
    try:
        third = reader.read(3, 0, 1, 2)
        first = reader.read(1, 0, 1, 2)
        again = reader.read(3, 0, 1, 2)
    finally:
        reader.close()
    # Step 3 reads samples 12..15 of the stream: the second epoch's 3..6.
    assert [mb["input_ids"][:, 0].tolist() for mb in third[0]] == [[3, 4], [5, 6]]
    assert [mb["input_ids"][:, 0].tolist() for mb in first[0]] == [[4, 5], [6, 7]]
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(third[0], again[0]))
    assert all(torch.equal(t, mb["input_ids"] + 1) for t, mb in zip(first[1], first[0]))


class _Counting(IterableDataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.n):
            yield torch.tensor([float(i)]), torch.tensor(i)


def test_an_iterable_dataset_is_dealt_round_robin_and_goes_back_when_asked() -> None:
    reader = data_source(_Counting(7), 2, seed=0)
    assert isinstance(reader, DatasetReader)
    try:
        # Replica 1 of 2: items 1, 3, 5, and the epoch's last round padded with its first item, as
        # DistributedSampler pads a shard: every replica takes four items an epoch.
        one = _ids(reader.read(0, 1, 2, 2))
        two = _ids(reader.read(1, 1, 2, 2))
        back = _ids(reader.read(0, 1, 2, 2))
    finally:
        reader.close()
    assert one == [[1, 3], [5, 0]] and two == one and back == one


def test_the_replicas_of_an_iterable_dataset_stay_in_step_epoch_after_epoch() -> None:
    """Found by review: replica 0 took 3 items of a 5-item epoch and replica 1 took 2, so their epochs drifted
    apart (from step 1 the global batches were not one process's) and some items came up 1.5 times as often."""
    readers = [data_source(_Counting(5), 1, seed=0) for _ in range(2)]
    try:
        taken = [[_ids(reader.read(step, replica, 2, 1))[0][0] for step in range(9)]
                 for replica, reader in enumerate(readers)]
    finally:
        for reader in readers:
            reader.close()
    assert taken == [[0, 2, 4] * 3, [1, 3, 0] * 3]  # three items a replica an epoch, every epoch alike


class _CountingWithLength(_Counting):
    """An iterable dataset that says its length (torch allows it; WebDataset's with_length gives one)."""

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("as_loader", [False, True], ids=["dataset", "loader"])
def test_an_iterable_dataset_with_a_length_is_still_iterated(as_loader: bool) -> None:
    # torch's Dataset base gives it a __getitem__ that raises: with __len__ too it was read by index and
    # failed ("Subclasses of Dataset should implement __getitem__"; as a loader, "_InfiniteConstantSampler
    # has no len()"), where torch's own DataLoader iterates it.
    made = DataLoader(_CountingWithLength(7), batch_size=2) if as_loader else _CountingWithLength(7)
    reader = data_source(made, None if as_loader else 2, seed=0)
    assert isinstance(reader, DatasetReader) and not reader.indexed
    try:
        assert _ids(reader.read(0, 1, 2, 2)) == [[1, 3], [5, 0]]  # as the one without a length
    finally:
        reader.close()


def test_a_collate_fn_pads_each_micro_batch_to_its_own_length() -> None:
    lengths = [3, 5, 2, 6]
    sequences = [(torch.arange(n), torch.arange(n) + 1) for n in lengths]

    def pad(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(len(x) for x, _ in batch)
        return (torch.stack([torch.nn.functional.pad(x, (0, longest - len(x))) for x, _ in batch]),
                torch.stack([torch.nn.functional.pad(y, (0, longest - len(y)), value=-100) for _, y in batch]))

    reader = data_source(DataLoader(sequences, batch_size=2, collate_fn=pad), None, seed=0)
    try:
        inputs, targets, weights = reader.read(0, 0, 1, 2)
    finally:
        reader.close()
    assert [tuple(x.shape) for x in inputs] == [(2, 5), (2, 6)] and weights is None
    assert int((targets[0] == -100).sum()) == 2


def test_a_batch_function_shards_the_global_batch_as_before() -> None:
    source = data_source(lambda step: (torch.arange(8).float() + step, torch.zeros(8)), None, seed=0)
    assert isinstance(source, BatchFunction)
    inputs, _, weights = source.read(1, 1, 2, 2)
    assert [x.tolist() for x in inputs] == [[5.0, 6.0], [7.0, 8.0]] and weights is None
    assert torch.equal(first_inputs(lambda step: (torch.arange(8), torch.arange(8)), None, 0, 2, 2), torch.arange(2))


def test_what_a_source_cannot_be_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="needs micro_batch_size"):
        DatasetReader(_dataset(), None, seed=0)
    with pytest.raises(ValueError, match="batch_sampler of its own"):
        DatasetReader(DataLoader(_dataset(), batch_sampler=[[0, 1]]), None, seed=0)
    with pytest.raises(ValueError, match="empty"):
        DatasetReader([], 2, seed=0)
    with pytest.raises(TypeError, match="expected batch"):
        data_source(42, None, seed=0)
    with pytest.raises(TypeError, match=r"\(inputs, targets\) or a dict with 'labels'"):
        split_pair({"input_ids": torch.zeros(2)})


def test_a_hugging_face_dataset_is_a_source() -> None:
    import datasets  # a dev dependency (pyproject.toml)

    table = datasets.Dataset.from_dict({"input_ids": [[i, i + 1] for i in range(6)],
                                        "labels": [[i + 1, i + 2] for i in range(6)]}).with_format("torch")
    reader = data_source(table, 3, seed=0)
    try:
        inputs, targets, _ = reader.read(0, 1, 2, 1)  # replica 1 of 2: rows 1, 3, 5
    finally:
        reader.close()
    assert inputs[0]["input_ids"][:, 0].tolist() == [1, 3, 5] and torch.equal(targets[0], inputs[0]["input_ids"] + 1)


def test_a_shuffled_epoch_is_ordered_once_not_once_a_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """The permutation of a million samples was made again for every sample read: 3.1 s a step of
    8 x 32 samples, where it is now made once an epoch (16 ms)."""
    made: list[int] = []
    randperm = torch.randperm

    def counted(n: int, **kwargs: Any) -> torch.Tensor:
        made.append(n)
        return randperm(n, **kwargs)

    monkeypatch.setattr(torch, "randperm", counted)
    reader = DatasetReader(DataLoader(_dataset(10), batch_size=2, shuffle=True), None, seed=0)
    try:
        reader._read(0, 0, 1, 2)  # samples 0-3 of epoch 0
        assert made == [10]
        reader._read(4, 0, 1, 2)  # global micro-batch 4 on: samples 8-11, the rest of epoch 0 and epoch 1's first two
        assert made == [10, 10]
    finally:
        reader.close()


def test_a_loaders_own_sampler_draws_each_epoch_the_same_on_every_replica_and_read() -> None:
    """A WeightedRandomSampler or a SubsetRandomSampler was read as no sampler at all (every sample in
    order); each replica now takes its share of what the sampler draws for the epoch, seeded by the job."""
    dataset = _dataset(10)
    only_odd = torch.tensor([0.0, 1.0] * 5)
    weighted = DataLoader(dataset, batch_size=2, sampler=torch.utils.data.WeightedRandomSampler(only_odd, 12))
    subset = DataLoader(dataset, batch_size=2, sampler=torch.utils.data.SubsetRandomSampler([2, 5, 7]))

    def stream(loader: DataLoader[Any], replica: int, replicas: int, steps: int, seed: int = 3) -> list[int]:
        reader = DatasetReader(loader, None, seed=seed)
        try:
            return [i for step in range(steps) for mb in _ids(reader.read(step, replica, replicas, 2)) for i in mb]
        finally:
            reader.close()

    drawn = stream(weighted, 0, 1, 6)  # two epochs of 12 draws
    assert len(drawn) == 24 and all(i % 2 == 1 for i in drawn), drawn
    assert drawn == stream(weighted, 0, 1, 6) and drawn != stream(weighted, 0, 1, 6, seed=4)
    assert drawn[:12] != drawn[12:]  # each epoch draws anew
    # Two replicas share each epoch's draws: replica r takes every second one from the r-th.
    halves = [stream(weighted, r, 2, 3) for r in range(2)]
    assert [halves[r][k] for k in range(6) for r in range(2)] == drawn[:12]
    picked = stream(subset, 0, 1, 3)  # 12 samples: four epochs of the subset, each a permutation of it
    assert all(sorted(picked[e * 3:(e + 1) * 3]) == [2, 5, 7] for e in range(4)), picked
    assert subset.sampler.generator is None  # a copy of the user's sampler draws: it is never changed


def test_a_sampler_longer_or_shorter_than_it_says_is_refused() -> None:
    class Lying(torch.utils.data.Sampler[int]):
        def __iter__(self) -> Iterator[int]:
            return iter([0, 1, 2])

        def __len__(self) -> int:
            return 5

    reader = DatasetReader(DataLoader(_dataset(10), batch_size=2, sampler=Lying()), None, seed=0)
    try:
        with pytest.raises(ValueError, match=r"the DataLoader's sampler drew 3 indices for epoch 0, and says len\(\) == 5"):
            reader.read(0, 0, 1, 2)
    finally:
        reader.close()


class _Sharded(IterableDataset):  # type: ignore[type-arg]
    """Items 0..n-1, each with the pid that read it; a worker takes every num_workers-th item from its id on."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        ids = range(self.n) if info is None else range(info.id, self.n, info.num_workers)
        for i in ids:
            yield torch.tensor([float(i)]), torch.tensor(os.getpid())


@pytest.mark.multiprocess
def test_an_iterable_datasets_items_come_from_the_loaders_worker_processes() -> None:
    """num_workers was ignored for an iterable dataset (every item read on the reader's thread). Its items
    now come from the workers, one from each in turn as torch's DataLoader takes them: a dataset that
    shards itself per worker is read in its own order, across epochs and after going back."""
    import multiprocessing

    def read(reader: DatasetReader, replica: int) -> tuple[list[list[list[int]]], set[int]]:
        reads = [reader.read(step, replica, 2, 2) for step in (0, 1, 2, 0, 1)]  # on (into epoch 2), back, on
        return [_ids(r) for r in reads], {int(p) for r in reads for t in r[1] for p in t}

    for replica in range(2):
        threaded = DatasetReader(DataLoader(_Sharded(7), batch_size=2), None, seed=0)
        pooled = DatasetReader(DataLoader(_Sharded(7), batch_size=2, num_workers=2), None, seed=0)
        try:
            (ids, here), (pooled_ids, there) = read(threaded, replica), read(pooled, replica)
            assert pooled_ids == ids and ids[0][0] == [replica, replica + 2]
            assert here == {os.getpid()} and there and os.getpid() not in there  # each epoch's two workers read
        finally:
            threaded.close()
            pooled.close()
        pooled._thread.shutdown(wait=True)
        assert not multiprocessing.active_children()  # each epoch's workers ended, the last with the reader


@pytest.mark.multiprocess
@pytest.mark.parametrize("sampling", ["shuffle", "weighted"])
def test_a_loaders_worker_processes_load_the_same_micro_batches_and_end_with_the_reader(sampling: str) -> None:
    """num_workers was ignored (every sample loaded on the reader's one thread); the workers now load the
    stream, micro-batch for micro-batch what the thread loads, across epochs and after going back."""
    import multiprocessing

    dataset = _dataset(10)

    def loader(workers: int) -> DataLoader[Any]:
        if sampling == "shuffle":
            return DataLoader(dataset, batch_size=2, shuffle=True, num_workers=workers)
        weights = torch.arange(10, dtype=torch.float) + 1
        return DataLoader(dataset, batch_size=2, sampler=torch.utils.data.WeightedRandomSampler(weights, 7),
                          num_workers=workers)

    def read(reader: DatasetReader, replica: int, steps: list[int]) -> list[list[list[int]]]:
        return [_ids(reader.read(step, replica, 2, 3)) for step in steps]

    steps = [0, 1, 2, 3, 1, 2, 5]  # on, back (a rollback), on, and a jump
    for replica in range(2):
        threaded = DatasetReader(loader(0), None, seed=5)
        pooled = DatasetReader(loader(2), None, seed=5)
        try:
            assert pooled._workers is not None and threaded._workers is None
            assert read(pooled, replica, steps) == read(threaded, replica, steps)
            assert multiprocessing.active_children()  # the loader's workers
        finally:
            threaded.close()
            pooled.close()
        pooled._thread.shutdown(wait=True)
        assert not multiprocessing.active_children()


@pytest.mark.parametrize("shuffle", [False, True])
def test_one_pass_reads_every_sample_once_its_last_batch_short_and_stand_ins_weighing_nothing(shuffle: bool) -> None:
    """Found and left by review, built now: a validation set of 11 samples read in batches of 2 replicas x 2
    micro-batches x 2 took 16 samples, 5 of them twice. With eval_batches=0 it is read once through: 2 batches,
    the second of 3 samples cut over 4 micro-batches, the empty one a stand-in (the batch's first sample) of
    weight 0; every sample once, in the epoch's order, and the same at every pass."""
    loader = DataLoader(_dataset(11), batch_size=2, shuffle=shuffle)
    reader = data_source(loader, None, seed=3)
    assert isinstance(reader, DatasetReader)
    try:
        assert reader.pass_batches(2, 2) == 2 and reader.pass_batches(1, 1) == 6
        reads = [reader.read_once(batch, replica, 2, 2) for batch in range(2) for replica in range(2)]
        again = reader.read_once(1, 1, 2, 2)
        with pytest.raises(ValueError, match="past the end of one pass"):
            reader.read_once(2, 0, 2, 2)
    finally:
        reader.close()
    taken = [i for read in reads for mb, w in zip(_ids(read), read[2]) if w for i in mb]
    order = list(range(11)) if not shuffle else torch.randperm(11, generator=torch.Generator().manual_seed(3)).tolist()
    assert taken == order
    assert [read[2] for read in reads] == [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]
    assert [len(mb) for read in reads[2:] for mb in _ids(read)] == [1, 1, 1, 1]
    assert _ids(reads[3])[1] == [order[8]]  # the stand-in: the last batch's first sample
    assert _ids(again) == _ids(reads[3]) and all(torch.equal(a, b) for a, b in zip(again[1], reads[3][1]))


def test_a_source_without_an_end_cannot_be_read_once_through() -> None:
    from stages.build.stage import whole_pass_source

    with pytest.raises(ValueError, match="eval_batches=0.*batch function, which has no end"):
        whole_pass_source(BatchFunction(lambda step: (torch.zeros(2, 1), torch.zeros(2, 1))))
    reader = DatasetReader(_Counting(4), micro_batch_size=2, seed=0)
    try:
        with pytest.raises(ValueError, match="eval_batches=0.*this one is iterable"):
            whole_pass_source(reader)
    finally:
        reader.close()


class _Drawing(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A dataset that draws as it reads (a random window, nanoGPT's way), from torch's, Python's and numpy's
    generators."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        import random

        import numpy

        start = int(torch.randint(0, 1000, ())) + random.randrange(1000) + int(numpy.random.randint(1000))
        return torch.tensor([float(index), float(start)]), torch.tensor(start)

    def __len__(self) -> int:
        return 12


def _masking_collate(samples: list[Any]) -> Any:
    """A collator that draws too (as Hugging Face's masked language modelling collator masks at random)."""
    inputs, targets = default_collate(samples)
    return inputs, targets + torch.randint(0, 2, targets.shape) * 10_000


def _drawn(reader: DatasetReader, replica: int, steps: list[int], disturb: int) -> list[list[list[float]]]:
    taken = []
    for step in steps:
        torch.manual_seed(disturb + step)  # each process's generators stand elsewhere (dropout, reading ahead)
        _ = torch.rand(disturb + step)
        inputs, targets, _ = reader.read(step, replica, 2, 2)
        taken.append([mb[:, 1].tolist() + t.tolist() for mb, t in zip(inputs, targets)])
    return taken


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.multiprocess)])
def test_a_dataset_that_draws_as_it_reads_gives_every_stage_and_every_read_again_the_same_samples(
        workers: int) -> None:
    """Found by review: a dataset drawing a random window in __getitem__ (or a collator masking at random) drew
    from each stage process's own generators, which dropout and reading ahead had used differently, so a
    replica's first stage read other windows than its last, and the job trained on inputs with another
    sample's targets without a word (12 of 20 items differed). With worker processes, a read out of order (an
    evaluation between steps, a load, a rollback) made the workers start their draws again. Each micro-batch
    is now read and collated under generators seeded by its place in the stream, and they are put back."""
    import random

    def reader() -> DatasetReader:
        return DatasetReader(DataLoader(_Drawing(), batch_size=2, collate_fn=_masking_collate, num_workers=workers),
                             None, seed=4)

    first, last, again = reader(), reader(), reader()
    try:
        steps = [0, 1, 2, 3]
        on_first = _drawn(first, 1, steps, disturb=1)
        assert _drawn(last, 1, steps, disturb=7) == on_first
        assert _drawn(again, 1, [0, 2, 2, 1, 2, 3], disturb=3) == [on_first[s] for s in [0, 2, 2, 1, 2, 3]]
        state, python = torch.get_rng_state(), random.getstate()
        first.read(4, 0, 2, 2)
        assert torch.equal(torch.get_rng_state(), state) and random.getstate() == python  # put back
    finally:
        for each in (first, last, again):
            each.close()
    assert len({value for mb in on_first for row in mb for value in row}) > 16  # they did draw
