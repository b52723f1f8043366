# Run: python -m benchmarks.precision            (add --steps 3 for a quick look)
"""What mixed precision changes on the reference workload: bytes between stages, step time, loss.

The reference workload (docs/design.md: 8 residual MLP blocks, 512 wide, a [64, 32, 512]
batch in 8 micro-batches, SGD) over 2 pipeline stages with 1F1B, in one
``LocalCluster``, as two jobs whose steps alternate in rotated order (noise hits each
alike): ``fp32`` and ``bf16``. Reported per precision:
the bytes that crossed between the stages per step, the median step time and the last
loss; ``bf16_bytes_ratio`` is bf16's wire bytes over fp32's (the boundary tensors
halve: target <= 0.5), ``bf16_step_ratio`` its median step time over fp32's (on a CPU
without bf16 matrix units autocast costs casts and gains nothing; the point here is the
wire). fp16 is left out: CPUs have no fast fp16 GEMMs (PyTorch 2.13 falls back to a
reference kernel, about 40x slower than fp32 here), so it is a GPU setting; its wire
bytes equal bf16's. The ratios count message headers too, so they sit a hair above the
tensors' exact 0.5. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from examples import positive_int as count
from schedulers import Job, LocalCluster
from transport.loop import run

WORKLOAD = {"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 8, "dim": 512},
            "data": "examples.data:regression_batches", "data_kwargs": {"batch_size": 64, "seq": 32, "dim": 512},
            "loss": "torch.nn.functional:mse_loss", "optimizer": ("torch.optim:SGD", {"lr": 0.01}),
            "pipeline_stages": 2, "schedule": "1f1b", "micro_batches": 8, "seed": 0}
PRECISIONS = ("fp32", "bf16")


async def measure(steps: int, warmup: int) -> dict[str, Any]:
    async with LocalCluster(nodes=4) as cluster:
        jobs: dict[str, Job] = {p: await cluster.train(**WORKLOAD, precision=p) for p in PRECISIONS}
        try:
            samples: dict[str, list[Any]] = {p: [] for p in PRECISIONS}
            for i in range(warmup + steps):
                for precision in PRECISIONS[i % 2:] + PRECISIONS[:i % 2]:
                    stats = await jobs[precision].step()
                    if i >= warmup:
                        samples[precision].append(stats)
        finally:
            for job in jobs.values():
                await job.close()
    result: dict[str, Any] = {}
    for precision, taken in samples.items():
        result[precision] = {"bytes_per_step": taken[-1].bytes_sent,
                             "step_s": round(statistics.median(s.step_time_s for s in taken), 4),
                             "loss": round(taken[-1].loss, 5)}
    result["bf16_bytes_ratio"] = round(result["bf16"]["bytes_per_step"] / result["fp32"]["bytes_per_step"], 4)
    result["bf16_step_ratio"] = round(result["bf16"]["step_s"] / result["fp32"]["step_s"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=count, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    result = run(measure(args.steps, args.warmup))
    for key, value in result.items():
        print(f"{key:>18}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
