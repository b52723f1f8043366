# Run: python -m benchmarks.partition            (add --steps 4 for a quick look)
"""How well each partition method balances a model whose parameters and compute disagree.

The model (``tests.helpers.models:skewed_cnn``) is four convolutions that cost the
compute and one linear that holds most of the parameters, over 2 pipeline stages, in
one ``LocalCluster``. Peers, measured in the same run with the steps of each method
alternating: ``parameters`` (balance parameter counts), ``uniform`` (layer counts)
and ``profile`` (each layer's measured forward and backward). Reported per method:
the bounds, the median busy seconds of each stage, their max/min (``imbalance``) and
the median step time; ``profile_vs_parameters`` is the step-time ratio (below 1:
profile is faster). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

from examples import positive_int as count
from schedulers import Job, LocalCluster
from transport.loop import run

MODEL = {"model": "tests.helpers.models:skewed_cnn", "model_kwargs": {"channels": 48, "size": 32},
         "data": "tests.helpers.models:image_batches", "data_kwargs": {"batch_size": 64, "size": 32},
         "pipeline_stages": 2, "micro_batches": 8}
METHODS = ("parameters", "uniform", "profile")


async def measure(steps: int, warmup: int) -> dict[str, Any]:
    async with LocalCluster(nodes=6) as cluster:
        jobs: dict[str, Job] = {m: await cluster.train(**MODEL, partition_method=m) for m in METHODS}
        try:
            samples: dict[str, list[Any]] = {m: [] for m in METHODS}
            for i in range(warmup + steps):
                for method in METHODS[i % 3:] + METHODS[:i % 3]:  # rotated: noise hits each alike
                    stats = await jobs[method].step()
                    if i >= warmup:
                        samples[method].append(stats)
            result: dict[str, Any] = {}
            for method, taken in samples.items():
                busy = [statistics.median(s.busy_s[r] for s in taken) for r in range(2)]
                result[method] = {"bounds": jobs[method].bounds, "busy_s": [round(b, 4) for b in busy],
                                  "imbalance": round(max(busy) / min(busy), 3),
                                  "step_s": round(statistics.median(s.step_time_s for s in taken), 4)}
            result["profile_vs_parameters"] = round(result["profile"]["step_s"] / result["parameters"]["step_s"], 3)
            return result
        finally:
            for job in jobs.values():
                await job.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=count, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    result = run(measure(args.steps, args.warmup))
    for key, value in result.items():
        print(f"{key:>22}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
