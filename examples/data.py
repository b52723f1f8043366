"""Data factories the examples name by import path (``"examples.data:char_batches"``).

A factory takes keyword arguments and returns ``batch(step) -> (inputs, targets)``,
deterministic in ``step``: every process that calls ``batch(7)`` gets the same tensors,
so the first pipeline stage can read the inputs and the last stage the targets without
either sending them to the other. Or it returns what people already train from, a
``DataLoader`` (:func:`token_sequences`: sequences of many lengths, padded per
micro-batch), which each replica reads its shard of.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Callable, Sequence

import torch
from torch.utils.data import DataLoader

__all__ = ["Batch", "char_corpus", "char_batches", "regression_batches", "encode", "decode", "pad_collate",
           "regression_samples", "token_sequences", "VOCAB_SIZE"]

Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]

VOCAB_SIZE = 128  # the character vocabulary: ASCII byte values

# Directories under the standard library that hold tests or third-party code: test
# sources are mostly repetitive fixtures, and site-packages differs between machines.
_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def _seed_for(seed: int, step: int) -> int:
    """One 63-bit seed per (seed, step) pair, so each step gets its own random stream."""
    # splitmix64's finaliser: nearby (seed, step) pairs get unrelated generator seeds.
    mask = 2**64 - 1
    x = (seed * 0x9E3779B97F4A7C15 + step) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) >> 1


def encode(text: str) -> torch.Tensor:
    """``text`` as int64 byte ids; characters outside ASCII become ``'?'``."""
    data = text.encode("ascii", errors="replace")
    if not data:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def decode(ids: torch.Tensor) -> str:
    """Int ids back to text (ids outside ASCII become ``'?'``)."""
    return bytes(i if 0 <= i < VOCAB_SIZE else ord("?") for i in ids.flatten().tolist()).decode("ascii")


def _stdlib_sources(root: str) -> list[str]:
    """Every ``.py`` file under ``root`` outside test and package directories, in sorted path order."""
    paths: list[str] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        paths.extend(os.path.join(directory, f) for f in files if f.endswith(".py"))
    return sorted(paths, key=lambda p: os.path.relpath(p, root))


@functools.lru_cache(maxsize=4)
def char_corpus(max_bytes: int = 2_000_000) -> str:
    """Real text available offline: the standard library's Python sources, ASCII only.

    Reading 2 MB takes about 20 ms, so nothing is cached on disk; the result is kept
    in memory per process.

    Args:
        max_bytes: length cap of the returned text, in characters (= bytes, as it is ASCII).

    Returns:
        The concatenated sources, non-ASCII characters replaced by ``'?'``.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    root = sysconfig.get_paths()["stdlib"]
    parts: list[str] = []
    total = 0
    for path in _stdlib_sources(root):
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        text = text.encode("ascii", errors="replace").decode("ascii")
        parts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    corpus = "".join(parts)[:max_bytes]
    if not corpus:
        raise RuntimeError(f"no Python sources found under {root}; pass a corpus another way")
    return corpus


@functools.lru_cache(maxsize=4)
def _char_ids(max_bytes: int, split: str) -> torch.Tensor:
    ids = encode(char_corpus(max_bytes))
    cut = int(0.9 * len(ids))
    return ids[:cut] if split == "train" else ids[cut:]


def char_batches(
    batch_size: int = 16,
    context: int = 128,
    max_bytes: int = 2_000_000,
    split: str = "train",
    seed: int = 0,
) -> Batch:
    """Random character windows of the corpus for next-character prediction.

    Args:
        batch_size: windows per batch.
        context: characters per window.
        max_bytes: corpus size (see ``char_corpus``).
        split: ``"train"`` (first 90% of the corpus) or ``"val"`` (last 10%).
        seed: with the step, seeds the window positions.

    Returns:
        ``batch(step)`` giving inputs ``[batch_size, context]`` int64 and the targets,
        the same windows shifted one character on.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if batch_size < 1 or context < 1:
        raise ValueError(f"batch_size and context must be >= 1, got {batch_size} and {context}")
    ids = _char_ids(max_bytes, split)
    num_starts = len(ids) - context  # a window needs context + 1 characters: inputs and one more target
    if num_starts < 1:
        raise ValueError(f"the {split} split has {len(ids)} characters, too few for context {context}; raise max_bytes")
    offsets = torch.arange(context + 1)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(_seed_for(seed, step))
        starts = torch.randint(num_starts, (batch_size,), generator=generator)
        windows = ids[starts[:, None] + offsets]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    return batch


def regression_batches(
    batch_size: int = 64,
    seq: int = 32,
    dim: int = 512,
    seed: int = 0,
    learnable: bool = False,
    nan_at: Sequence[int] = (),
) -> Batch:
    """Reference-workload data: random float32 inputs ``[batch_size, seq, dim]`` and targets.

    Args:
        batch_size, seq, dim: the shape of inputs and targets.
        seed: with the step, seeds each batch.
        learnable: targets are a fixed random linear map of the inputs plus small noise
            (so a loss can go down) instead of independent random tensors.
        nan_at: steps whose batch carries a NaN in its first input (a corrupt record: what a
            job's ``on_nonfinite`` does with one).

    Returns:
        ``batch(step)`` giving ``(inputs, targets)``.
    """
    poisoned = {int(step) for step in nan_at}
    weight = None
    if learnable:
        # Its own stream (a negative "step"), so the map never coincides with a batch.
        mixer = torch.Generator().manual_seed(_seed_for(seed, -1))
        weight = torch.randn(dim, dim, generator=mixer) / dim**0.5

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(_seed_for(seed, step))
        inputs = torch.randn(batch_size, seq, dim, generator=generator)
        if weight is None:
            targets = torch.randn(batch_size, seq, dim, generator=generator)
        else:
            targets = inputs @ weight + 0.01 * torch.randn(batch_size, seq, dim, generator=generator)
        if step in poisoned:
            inputs.view(-1)[0] = float("nan")
        return inputs, targets

    return batch


def regression_samples(count: int = 100, seq: int = 32, dim: int = 512, batch_size: int = 8,
                       seed: int = 0) -> DataLoader:
    """A DataLoader over a fixed set of ``count`` random ``(inputs, targets)`` samples of ``[seq, dim]``,
    ``batch_size`` a micro-batch: :func:`regression_batches`' kind of data as a finite set (validation
    data whose size need not divide a global batch, read once through with ``eval_batches=0``)."""
    gen = torch.Generator().manual_seed(seed)
    inputs, targets = torch.randn(count, seq, dim, generator=gen), torch.randn(count, seq, dim, generator=gen)
    return DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=batch_size)


def pad_collate(batch: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int = 0,
                ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic padding: ``(ids, targets)`` pairs of any lengths as ``[B, longest]`` inputs (``pad_id``
    on the right) and targets (``ignore_index`` there, so no loss counts the padding)."""
    longest = max(len(ids) for ids, _ in batch)
    inputs = torch.full((len(batch), longest), pad_id, dtype=torch.int64)
    targets = torch.full((len(batch), longest), ignore_index, dtype=torch.int64)
    for row, (ids, target) in enumerate(batch):
        inputs[row, :len(ids)] = ids
        targets[row, :len(target)] = target
    return inputs, targets


def token_sequences(count: int = 64, min_len: int = 2, max_len: int = 16, vocab_size: int = VOCAB_SIZE,
                    batch_size: int = 4, shuffle: bool = True, seed: int = 0, num_workers: int = 0) -> DataLoader:
    """A DataLoader of ``count`` random token sequences of ``min_len`` to ``max_len`` tokens (the targets
    are the next tokens), ``batch_size`` a micro-batch, each padded to its own longest by :func:`pad_collate`:
    a fine-tuning set's shape, where every micro-batch has its own length; ``num_workers`` worker
    processes load it."""
    gen = torch.Generator().manual_seed(seed)
    sequences = []
    for _ in range(count):
        length = int(torch.randint(min_len, max_len + 1, (), generator=gen))
        tokens = torch.randint(0, vocab_size, (length + 1,), generator=gen)
        sequences.append((tokens[:-1], tokens[1:]))
    return DataLoader(sequences, batch_size=batch_size, shuffle=shuffle, collate_fn=pad_collate, num_workers=num_workers)
