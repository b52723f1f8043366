# Run: python -m benchmarks.microbatch        (about a minute; the machine should be quiet)
"""Where the compute-only ceiling of ``benchmarks.pipeline`` comes from, on the reference workload.

The compute-only peer (each of 2 processes computes its half of the model over the 8
micro-batches, both cores at once, no transfers, no bubble) reaches about 1.6x one
process, not 2x. Two things make up the difference, measured here one at a time:

- ``microbatch_penalty``: the whole model's forward and backward over the batch as 8
  micro-batches, over the same as one batch of 64 (one process, one thread).
  W batching takes back at most ``w_batching_share_of_penalty`` of it: the weight-gradient
  GEMMs of every ``nn.Linear`` as one GEMM over all rows (``w_batched_ms``) instead of one
  per micro-batch (``w_per_microbatch_ms``); the forward's and the input gradient's GEMMs
  stay per micro-batch, as a pipeline needs them.
- ``two_core_contention``: one half of the model's 8 micro-batches, timed while the other
  half runs in a second process on the other core, over the same timed alone. The cores
  share the last-level cache and the memory bus.

``ceiling_vs_single_process`` = 2 / (penalty x contention) is what a pipeline without
bubble and transfers could reach on these cores; the pipeline peers land below it. One
JSON line last.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks._torch_pipelining import NUM_MICROBATCHES, build_model, reference_batch

REPEATS = 5


def median_time(fn: Callable[[], None], repeats: int = REPEATS) -> float:
    fn()  # warm-up: allocator, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_backward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, chunks: int) -> Callable[[], None]:
    def run() -> None:
        for x, y in zip(inputs.chunk(chunks), targets.chunk(chunks)):
            torch.nn.functional.mse_loss(model(x), y).backward()
        model.zero_grad(set_to_none=True)
    return run


def weight_gradients(model: nn.Module, rows: int, chunks: int) -> Callable[[], None]:
    """Every linear's weight-gradient GEMM over ``rows`` rows, in ``chunks`` GEMMs."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    operands = [(torch.randn(rows, m.in_features), torch.randn(rows, m.out_features),
                 torch.zeros(m.out_features, m.in_features)) for m in linears]

    def run() -> None:
        for x, g, grad in operands:
            for xs, gs in zip(x.chunk(chunks), g.chunk(chunks)):
                grad.addmm_(gs.t(), xs)
    return run


def half(model: nn.Sequential, which: int) -> nn.Sequential:
    mid = len(model) // 2
    return nn.Sequential(*(list(model)[:mid] if which == 0 else list(model)[mid:]))


def _half_worker(which: int, start: Any, results: Any) -> None:
    torch.set_num_threads(1)
    inputs, targets = reference_batch()
    model = half(build_model(), which)
    run = forward_backward(model, inputs, targets, NUM_MICROBATCHES)
    run()
    start.wait()
    results.put((which, median_time(run)))


def concurrent_halves() -> dict[int, float]:
    """Each half's step time while both run at once, one process (and core) each."""
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(2), ctx.Queue()
    workers = [ctx.Process(target=_half_worker, args=(w, start, results)) for w in (0, 1)]
    for worker in workers:
        worker.start()
    times = dict(results.get(timeout=600) for _ in workers)
    for worker in workers:
        worker.join()
    return times


def measure() -> dict[str, Any]:
    torch.set_num_threads(1)
    inputs, targets = reference_batch()
    model = build_model()
    rows = inputs.numel() // inputs.shape[-1]
    split = median_time(forward_backward(model, inputs, targets, NUM_MICROBATCHES))
    whole = median_time(forward_backward(model, inputs, targets, 1))
    w_split = median_time(weight_gradients(model, rows, NUM_MICROBATCHES))
    w_whole = median_time(weight_gradients(model, rows, 1))
    alone = {w: median_time(forward_backward(half(model, w), inputs, targets, NUM_MICROBATCHES)) for w in (0, 1)}
    together = concurrent_halves()
    contention = statistics.fmean(together[w] / alone[w] for w in (0, 1))
    penalty = split / whole
    return {
        "step_8_microbatches_ms": round(split * 1e3, 1),
        "step_one_batch_ms": round(whole * 1e3, 1),
        "microbatch_penalty": round(penalty, 3),
        "w_per_microbatch_ms": round(w_split * 1e3, 1),
        "w_batched_ms": round(w_whole * 1e3, 1),
        "w_batching_share_of_penalty": round((w_split - w_whole) / (split - whole), 3) if split > whole else None,
        "half_alone_ms": [round(alone[w] * 1e3, 1) for w in (0, 1)],
        "half_with_the_other_running_ms": [round(together[w] * 1e3, 1) for w in (0, 1)],
        "two_core_contention": round(contention, 3),
        "ceiling_vs_single_process": round(2 / (penalty * contention), 3),
    }


def main() -> None:
    summary = measure()
    for key, value in summary.items():
        print(f"{key:<32} {value}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
