"""Where a stage's batches come from: a data factory's batch function, or the dataset a user already has.

``training.data`` names a factory; what ``factory(**data_kwargs)`` returns decides how a
first or last stage reads a step's micro-batches:

- a function ``batch(step) -> (inputs, targets)``: the global batch of step ``step``, which
  each replica shards (:class:`BatchFunction`, as before);
- a ``torch.utils.data.DataLoader``, a map-style dataset (``__getitem__`` and ``__len__``,
  a Hugging Face ``datasets.Dataset`` too) or an iterable one: :class:`DatasetReader`
  reads it as ``DistributedSampler`` would, each replica its own shard, one micro-batch of
  ``micro_batch_size`` samples (a DataLoader's own ``batch_size``) at a time, collated by
  the loader's ``collate_fn`` (so dynamic padding gives each micro-batch its own length).

A dataset is read as one endless stream: epoch after epoch, each shuffled with
``seed + epoch`` when the DataLoader shuffles, dealt to the replicas as
``DistributedSampler`` deals an epoch. A step's batch is the stream's next
``replicas * micro_batches`` micro-batches, from where the scheduler says it stands
(``StepOrder.data_position``: :mod:`schedulers.data_positions`; by default step ``k``'s
begins ``k * micro_batches * replicas`` in), so a checkpoint resumes the data where it
stood, in any layout, and a recovery that rolls back to a snapshot reads the same
batches again. A micro-batch of a
map-style dataset is read and collated under random number generators seeded by its
place in the stream (:class:`_SeededReads`), so a dataset or collator that draws (a random
window, masked tokens) gives a replica's first and last stage the same samples, and a
read again the same. With a DataLoader's ``num_workers``, a map-style dataset's samples
are loaded and collated so in its worker processes, in the same order, and the next
step's micro-batches are read ahead on a thread of the reader's own; without, each is
read when asked. An iterable dataset's items then come from the worker
processes as torch's DataLoader yields them: each worker iterates its own copy, and the
loader takes one item from each in turn. A dataset that shards itself per worker
(``torch.utils.data.get_worker_info``; Hugging Face's and WebDataset's iterable datasets
do) is so read once, and one that takes every ``num_workers``-th item from the worker's id
on is read in its own order, as on the thread; one that does not shard is read once per
worker, as torch's DataLoader reads it.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import random
import sys
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, SequentialSampler, default_collate

from stages.compute.averaging import shard_batch

__all__ = ["BatchFunction", "DatasetReader", "data_source", "first_inputs"]

Read = tuple[list[Any], list[Any], list[float] | None]  # every micro-batch's inputs and targets, and weights


class BatchFunction:
    """A data factory's ``batch(step) -> (inputs, targets)``: the global batch, sharded per replica."""

    def __init__(self, batch: Callable[[int], Any]) -> None:
        self.batch = batch

    def read(self, step: int, replica: int, replicas: int, micro_batches: int, position: int | None = None) -> Read:
        """This replica's micro-batches of step ``step``, and their loss weights (None: an even split);
        ``position`` is a dataset's (the batch is the step's whatever came before)."""
        inputs, targets = self.batch(step)
        input_shards, target_shards, weights = shard_batch(inputs, targets, replicas, micro_batches)
        return input_shards[replica], target_shards[replica], weights[replica] if weights is not None else None

    def close(self) -> None:
        """Nothing to let go of."""


class DatasetReader:
    """A dataset (or a DataLoader's) read per replica as an endless stream of micro-batches.

    Args:
        source: a DataLoader, a map-style dataset or an iterable one.
        micro_batch_size: samples per micro-batch (a DataLoader's own ``batch_size`` wins).
        seed: the shuffle's seed (epoch ``e`` shuffles with ``seed + e``).
        workers: a DataLoader with ``num_workers`` loads a map-style dataset's samples, or an
            iterable dataset's items, in that many worker processes (its ``prefetch_factor``,
            ``worker_init_fn``, ``timeout`` and ``multiprocessing_context`` too); False: on the
            reader's thread.

    Raises:
        ValueError: no micro-batch size, a DataLoader with a batch sampler of its own, or an
            empty dataset.
    """

    def __init__(self, source: Any, micro_batch_size: int | None, seed: int, *, workers: bool = True) -> None:
        self.collate: Callable[[list[Any]], Any] = default_collate
        dataset, sampler = source, None
        if isinstance(source, DataLoader):
            if source.batch_size is None:
                raise ValueError("a DataLoader with a batch_sampler of its own cannot be sharded per replica; give it "
                                 "batch_size (and shuffle, or a sampler) instead")
            dataset, micro_batch_size, sampler = source.dataset, source.batch_size, source.sampler
            self.collate = source.collate_fn
        if micro_batch_size is None:
            raise ValueError("a dataset as the data source needs micro_batch_size (samples per micro-batch), "
                             "or a DataLoader with its batch_size")
        self.dataset = dataset
        self.size = micro_batch_size
        self.seed = seed
        self.indexed = _map_style(dataset)
        # How an epoch orders the indices: in order, shuffled (a plain shuffle=True), or as the loader's own
        # sampler draws them (a WeightedRandomSampler, a SubsetRandomSampler, one of the user's).
        self._sampler: Any = None  # a Sampler, with its len()
        self.shuffle = False
        if self.indexed and sampler is not None and not isinstance(sampler, SequentialSampler):
            if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(dataset):
                self.shuffle = True
            else:
                self._sampler = sampler
        self._length = len(self._sampler) if self._sampler is not None else len(dataset) if self.indexed else 0
        if self.indexed and self._length == 0:
            raise ValueError("the dataset is empty" if not len(dataset) else "the DataLoader's sampler draws no index")
        self._orders: dict[int, torch.Tensor] = {}  # the epochs' orders in use (a step may cross into the next)
        # A loader with worker processes: a map-style dataset's samples are loaded and collated there, in
        # the stream's order, by a DataLoader over this replica's positions (see _from_workers); an
        # iterable dataset's items are iterated there (see _epoch).
        self._workers: dict[str, Any] | None = None
        if workers and isinstance(source, DataLoader) and source.num_workers > 0:
            self._workers = {"num_workers": source.num_workers, "prefetch_factor": source.prefetch_factor,
                             "worker_init_fn": source.worker_init_fn, "timeout": source.timeout,
                             "multiprocessing_context": source.multiprocessing_context}
        self._feed: tuple[tuple[int, int, int], Iterator[Any]] | None = None  # (replica, replicas, next position)
        self._stream: tuple[int, int, Generator[Any, None, None]] | None = None  # iterable: (replicas, position, iterator)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data")
        self._ahead: tuple[tuple[int, int, int, int], Future[Read]] | None = None

    def read(self, step: int, replica: int, replicas: int, micro_batches: int, position: int | None = None) -> Read:
        """This replica's micro-batches of step ``step``: the batch that begins ``position`` global
        micro-batches (every replica's) into the stream, by default ``step * micro_batches * replicas``
        (the layout was never changed; after a change the scheduler says where the data stands). With
        worker processes (prefetched when it is the one after the last) the next step's is then read ahead.

        Without them the read is here and now: it seeds the process's generators for its while
        (:class:`_SeededReads`), and read ahead it would do so while the stage computes, whose dropout
        would then draw from the read's seed and be put back with it."""
        at = step * micro_batches * replicas if position is None else position
        if self._workers is None:
            return self._read(at, replica, replicas, micro_batches)
        key = (at, replica, replicas, micro_batches)
        ahead, self._ahead = self._ahead, None
        future = ahead[1] if ahead is not None and ahead[0] == key else self._thread.submit(self._read, *key)
        result = future.result()
        following = (at + micro_batches * replicas, replica, replicas, micro_batches)
        self._ahead = (following, self._thread.submit(self._read, *following))
        return result

    def close(self) -> None:
        """Stops reading ahead; the loader's worker processes, if any, end once a read in progress has."""
        if self._ahead is not None:
            self._ahead[1].cancel()
        self._thread.submit(self._end_feed)  # on the thread that reads from it
        self._thread.shutdown(wait=False)

    def _read(self, at: int, replica: int, replicas: int, micro_batches: int) -> Read:
        """The micro-batches of replica ``replica`` of the batch beginning ``at`` global micro-batches in: as
        ``DistributedSampler`` deals an epoch, the replica takes every ``replicas``-th sample of the stream
        from the batch's first sample (``at * size``) on, from its ``replica``-th."""
        base = at * self.size  # the batch's first sample in the stream (every replica's)
        if self._workers is not None and self.indexed:
            batches = self._from_workers(base, micro_batches, replica, replicas)
        elif self.indexed:
            reads = _SeededReads(self.dataset, self.collate, self.seed)
            batches = [reads.__getitems__([(g, self.index(g, replicas)) for g in range(
                           base + m * self.size * replicas + replica, base + (m + 1) * self.size * replicas, replicas)])
                       for m in range(micro_batches)]
        else:  # what the iterator draws here (not in worker processes): the same on every stage
            first = base // replicas  # this replica's items before the batch (a whole round, unless replicas changed)
            with _seeded(self.seed, replicas, base + replica) if self._workers is None else contextlib.nullcontext():
                samples = self._iterated(first, micro_batches * self.size, replica, replicas)
                batches = [self.collate(samples[m * self.size:(m + 1) * self.size]) for m in range(micro_batches)]
        pairs = [split_pair(batch) for batch in batches]
        return [p[0] for p in pairs], [p[1] for p in pairs], None

    def pass_batches(self, replicas: int, micro_batches: int) -> int:
        """How many global batches one pass over the dataset takes (:meth:`read_once`), the last one short.

        Raises:
            ValueError: an iterable dataset, which has no length to read once through.
        """
        if not self.indexed:
            raise ValueError("evaluation.eval_batches=0 reads the validation set once through, which needs a "
                             "dataset with a length (a map-style dataset, or a DataLoader over one); this one is "
                             "iterable: give eval_batches the number of batches to average over")
        return -(-self._length // (replicas * micro_batches * self.size))

    def read_once(self, batch: int, replica: int, replicas: int, micro_batches: int) -> Read:
        """Batch ``batch`` of one pass over the dataset (its first epoch's order), this replica's share: every
        sample once in the pass, as the Trainer's evaluation reads its ``eval_dataset``. The batch's samples
        are cut into the replicas' micro-batches in order, as evenly as they go; where there are fewer samples
        than micro-batches (the last batch), a micro-batch with none holds the batch's first sample again,
        with weight 0 (the weights: 1 for a micro-batch of the pass, 0 for such a stand-in)."""
        size = replicas * micro_batches * self.size
        positions = range(batch * size, min(self._length, (batch + 1) * size))
        order = self._order(0)
        indices = [p if order is None else int(order[p]) for p in positions]
        if not indices:
            raise ValueError(f"batch {batch} is past the end of one pass over the dataset "
                             f"({self.pass_batches(replicas, micro_batches)} batches)")
        parts = replicas * micro_batches
        cuts = [-(-c * len(indices) // parts) for c in range(parts + 1)]  # the empty ones (if any) last
        batches, weights = [], []
        reads = _SeededReads(self.dataset, self.collate, self.seed)
        for c in range(replica * micro_batches, (replica + 1) * micro_batches):
            start, end = (cuts[c], cuts[c + 1]) if cuts[c] < cuts[c + 1] else (0, 1)  # else a stand-in
            batches.append(reads.__getitems__([(-1 - batch * size - p, indices[p]) for p in range(start, end)]))
            weights.append(1.0 if cuts[c] < cuts[c + 1] else 0.0)
        pairs = [split_pair(b) for b in batches]
        return [p[0] for p in pairs], [p[1] for p in pairs], weights

    def index(self, position: int, replicas: int) -> int:
        """The dataset index at ``position`` of the stream (a map-style dataset's; every replica's samples,
        replica ``position % replicas`` taking this one): each epoch padded, as ``DistributedSampler`` pads
        it, to a multiple of ``replicas`` with its first samples."""
        n = self._length
        epoch, within = divmod(position, -(-n // replicas) * replicas)
        order = self._order(epoch)
        at = within % n
        return at if order is None else int(order[at])

    def _from_workers(self, base: int, micro_batches: int, replica: int, replicas: int) -> list[Any]:
        """This replica's micro-batches of the batch from stream sample ``base`` on, loaded and collated by the
        loader's worker processes: one DataLoader over this replica's positions, kept while the steps read
        on, made again only to go elsewhere (a rollback, a load). Its workers are seeded from the job's seed."""
        if self._feed is None or self._feed[0] != (replica, replicas, base):
            self._end_feed()
            assert self._workers is not None
            loader: DataLoader[Any] = DataLoader(
                _SeededReads(self.dataset, self.collate, self.seed), batch_size=self.size, collate_fn=_as_yielded,
                sampler=_Positions(self, base + replica, replicas), generator=torch.Generator().manual_seed(self.seed),
                **self._workers)
            self._feed = ((replica, replicas, base), iter(loader))
        batches = [next(self._feed[1]) for _ in range(micro_batches)]
        self._feed = ((replica, replicas, base + micro_batches * self.size * replicas), self._feed[1])
        return batches

    def _end_feed(self) -> None:
        """Lets the loaders' iterators go, and with them their worker processes."""
        feed, self._feed = self._feed, None
        if feed is not None:
            _shut_down(feed[1])
        stream, self._stream = self._stream, None
        if stream is not None:
            stream[2].close()  # its epoch's loader shuts down (the generator's finally)

    def _order(self, epoch: int) -> torch.Tensor | None:
        """Epoch ``epoch``'s indices (None: in order), made once an epoch: made for every sample, a
        shuffle of a million samples cost three seconds a step."""
        if not self.shuffle and self._sampler is None:
            return None
        order = self._orders.get(epoch)
        if order is None:
            order = self._shuffled(epoch) if self.shuffle else self._drawn(epoch)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}  # a step reads on from it
            self._orders[epoch] = order
        return order

    def _shuffled(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self._length, generator=torch.Generator().manual_seed(self.seed + epoch))

    def _drawn(self, epoch: int) -> torch.Tensor:
        """The loader's sampler's indices for ``epoch``: drawn with a generator seeded ``seed + epoch``
        where the sampler takes one (torch's do), so every replica, every step read again (a rollback,
        a load) and every stage draws the same; a sampler with ``set_epoch`` is told the epoch first.

        A copy of the sampler draws them: the user's own is never changed. It was lent the generator
        and given its own back, and a reader closed while its read-ahead still drew could leave the
        lent one in place for the next reader of the same loader to take as the user's."""
        assert self._sampler is not None
        sampler = copy.copy(self._sampler)
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        if hasattr(sampler, "generator"):
            sampler.generator = torch.Generator().manual_seed(self.seed + epoch)  # type: ignore[attr-defined]
        order = torch.tensor([int(i) for i in sampler], dtype=torch.int64)
        if len(order) != self._length:
            raise ValueError(f"the DataLoader's sampler drew {len(order)} indices for epoch {epoch}, and says "
                             f"len() == {self._length}: a sampler's epoch must be as long as it says")
        return order

    def _iterated(self, first: int, count: int, replica: int, replicas: int) -> list[Any]:
        """An iterable dataset's: this replica takes every ``replicas``-th item from its ``replica``-th,
        epoch after epoch; one iterator kept, started again only to go back (a rollback or a load)."""
        stream = self._stream
        if stream is None or stream[0] != replicas or stream[1] > first:
            stream = (replicas, 0, self._items(replica, replicas))
        _, position, items = stream
        for _ in range(first - position):
            next(items)
        taken = [next(items) for _ in range(count)]
        self._stream = (replicas, first + count, items)
        return taken

    def _items(self, replica: int, replicas: int) -> Generator[Any, None, None]:
        # The workers' seeds: drawn from one generator per stream, so a stream started again (a
        # rollback, a load) seeds each epoch's workers as it did the first time.
        generator = torch.Generator().manual_seed(self.seed)
        for epoch in itertools.count():
            if hasattr(self.dataset, "set_epoch"):  # a Hugging Face IterableDataset's shuffle follows the epoch
                self.dataset.set_epoch(epoch)
            count, first = 0, []  # the epoch's first items: what pads its last round (below)
            items = self._epoch(generator)
            try:
                for index, item in enumerate(items):
                    count = index + 1
                    if index < replicas:
                        first.append(item)
                    if index % replicas == replica:
                        yield item
            finally:  # the stream ended or was let go: the epoch's worker processes end with it
                _shut_down(items)
            if not count:
                raise ValueError("the iterable dataset yielded nothing")
            # Every replica takes as many items an epoch, as DistributedSampler pads its shards: the last
            # round's missing places take the epoch's first items again. Without it a replica with one item
            # fewer began its next epoch a step ahead of the others, and their epochs drifted apart.
            for extra in range(count, count + (-count) % replicas):
                if extra % replicas == replica:
                    yield first[(extra - count) % len(first)]

    def _epoch(self, generator: torch.Generator) -> Iterator[Any]:
        """One pass over an iterable dataset: here, or in the loader's worker processes, one item from
        each in turn (the items as the dataset yields them: the micro-batches are collated here)."""
        if self._workers is None:
            return iter(self.dataset)
        return iter(DataLoader(self.dataset, batch_size=None, collate_fn=_as_yielded, generator=generator,
                               **self._workers))


def _as_yielded(item: Any) -> Any:
    """A worker's item as the dataset yielded it (a module's function: a spawned worker unpickles it)."""
    return item


def _shut_down(iterator: Iterator[Any]) -> None:
    """Ends a DataLoader iterator's worker processes now (any other iterator: nothing to end)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


class _Positions(Sampler[tuple[int, int]]):
    """A replica's stream as the keys of :class:`_SeededReads` (``position, dataset index``), every
    ``replicas``-th position from ``first`` on, endlessly: what a loader's worker processes load (see
    :meth:`DatasetReader._from_workers`)."""

    def __init__(self, reader: DatasetReader, first: int, replicas: int) -> None:
        self.reader, self.first, self.replicas = reader, first, replicas

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for position in itertools.count(self.first, self.replicas):
            yield position, self.reader.index(position, self.replicas)


class _SeededReads(torch.utils.data.Dataset[Any]):
    """A dataset's micro-batches, each read and collated under random number generators seeded from the job's
    seed and the micro-batch's place in its replica's stream (its first key).

    A dataset that draws as it reads (a random crop or window in ``__getitem__``, a collator that masks
    tokens at random, as Hugging Face's for masked language modelling does) drew from each process's own
    generators, which the stages had used differently (dropout, reading ahead), so a replica's first stage
    and its last read different samples for one micro-batch: the inputs of one and the targets of another,
    and nothing said so. Seeded by place, every stage, a read again (a rollback, a load, an evaluation in
    between) and a loader's worker process draw the same; torch's, Python's and numpy's generators are put
    back as they were after each. A module's class: a spawned worker unpickles it."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any], seed: int) -> None:
        self.dataset, self.collate, self.seed = dataset, collate, seed

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> Any:
        """The micro-batch of ``keys`` (each ``position, index``: its first sample's place in the stream seeds
        it), collated."""
        with _seeded(self.seed, keys[0][0]):
            return self.collate([self.dataset[index] for _, index in keys])

    def __getitem__(self, key: tuple[int, int]) -> Any:
        """A micro-batch of one sample (a loader reads a batch through :meth:`__getitems__`)."""
        return self.__getitems__([key])

    def __len__(self) -> int:
        return len(self.dataset)


@contextlib.contextmanager
def _seeded(seed: int, *place: int) -> Iterator[None]:
    """Torch's CPU generator, Python's and (where imported) numpy's global one seeded from ``seed`` and
    ``place``, and put back as they were afterwards."""
    mixed = seed % 2**32
    for part in place:
        mixed = (mixed * 1_000_003 + part) % 2**61
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    kept = numpy.random.get_state() if numpy is not None else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(mixed)
        random.seed(mixed)
        if numpy is not None:
            numpy.random.seed(mixed % 2**32)
        try:
            yield
        finally:
            random.setstate(python)
            if numpy is not None:
                numpy.random.set_state(kept)


def split_pair(batch: Any) -> tuple[Any, Any]:
    """A collated micro-batch as ``(inputs, targets)``: a pair as it is, or a dict with ``labels``
    (Hugging Face's) as the other keys and the labels.

    Raises:
        TypeError: anything else (say which is which with a collate_fn).
    """
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping) and "labels" in batch:
        return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
    raise TypeError(f"a dataset's batch must be (inputs, targets) or a dict with 'labels'; got "
                    f"{type(batch).__name__}{' with keys ' + str(sorted(batch)) if isinstance(batch, Mapping) else ''}")


def _map_style(dataset: Any) -> bool:
    """Whether ``dataset`` is read by index: ``__getitem__`` and ``__len__``, and no ``IterableDataset`` (torch's
    ``Dataset`` base gives every dataset a ``__getitem__`` that raises, and an iterable one may have a length,
    as WebDataset's ``with_length`` gives it)."""
    return not isinstance(dataset, torch.utils.data.IterableDataset) and hasattr(dataset, "__getitem__") \
        and hasattr(dataset, "__len__")


def data_source(made: Any, micro_batch_size: int | None, seed: int, *,
                workers: bool = True) -> BatchFunction | DatasetReader:
    """What the data factory made, as a source a stage reads micro-batches from (see the module docstring);
    ``workers``: a DataLoader's worker processes load a map-style dataset's samples (its ``num_workers``).

    Raises:
        TypeError: neither a batch function nor a dataset or DataLoader.
    """
    if isinstance(made, (DataLoader, torch.utils.data.IterableDataset)) or _map_style(made):
        return DatasetReader(made, micro_batch_size, seed, workers=workers)
    if callable(made):
        return BatchFunction(made)
    if hasattr(made, "__iter__"):
        return DatasetReader(made, micro_batch_size, seed)
    raise TypeError(f"the data factory made a {type(made).__name__}: expected batch(step) -> (inputs, targets), "
                    "a DataLoader, or a dataset")


def first_inputs(made: Any, micro_batch_size: int | None, seed: int, replicas: int, micro_batches: int) -> Any:
    """The first micro-batch's inputs of step 0, replica 0 (what a traced or profiled model is shown)."""
    source = data_source(made, micro_batch_size, seed, workers=False)  # one micro-batch: no worker processes
    try:
        return source.read(0, 0, replicas, micro_batches)[0][0]
    finally:
        source.close()
