# Run: .venv/bin/python -m benchmarks.zero          (add --steps 2 --dim 128 for a quick look)
"""ZeRO-1's optimizer state per replica against unsharded training, on the reference workload.

Peers, measured in one run: the reference workload (docs/design.md: 8 residual MLP blocks
of width 512, a [64, 32, 512] batch, micro-batches of 8, MSE) trained with Adam on
2 pipeline stages x 2 data-parallel replicas, 1F1B, once with ``zero_stage=0`` and
once with ``zero_stage=1``, each on a fresh ``LocalCluster`` of 4 nodes. A stage's
optimizer state is what ``StepStats.optimizer_state_bytes`` reports for the last step
(the state held when it began: Adam's moments and step counts); a replica's is the
sum over its stages. ``zero1_optimizer_state_ratio`` is the largest replica's state
with ZeRO-1 over the same replica's without (ideal: 1 / data_parallel = 0.5; whole
parameters are the unit of partition, so a little above). ``exact`` says whether the
two runs' trained parameters are the same bits. Step times and peak RSS are quoted for
information only: the two peers run one after the other on a shared machine. The
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from schedulers import LocalCluster
from transport.loop import run

MESH = {"pipeline_stages": 2, "data_parallel": 2}
OPTIMIZER = ("torch.optim:Adam", {"lr": 1e-3})
BATCH, SEQ, MICROBATCH_SIZE = 64, 32, 8


async def train(zero_stage: int, args: argparse.Namespace) -> dict[str, Any]:
    """One peer: a fresh 4-node cluster, ``args.steps`` steps; what it measured and its trained state."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(BATCH, SEQ, args.dim, generator=generator)
    targets = torch.randn(BATCH, SEQ, args.dim, generator=generator)
    micro_batches = BATCH // (MESH["data_parallel"] * MICROBATCH_SIZE)
    async with LocalCluster(nodes=MESH["pipeline_stages"] * MESH["data_parallel"]) as cluster:
        async with await cluster.train(
                model="examples.models:residual_mlp", model_kwargs={"blocks": args.blocks, "dim": args.dim},
                loss="torch.nn.functional:mse_loss", optimizer=OPTIMIZER, schedule="1f1b",
                micro_batches=micro_batches, seed=0, zero_stage=zero_stage, **MESH) as job:
            times, stats = [], None
            for _ in range(args.steps):
                started = time.perf_counter()
                stats = await job.step(inputs, targets)
                times.append(time.perf_counter() - started)
            state = await job.state_dict()
    assert stats is not None
    return {"optimizer_state_bytes": list(stats.optimizer_state_bytes), "peak_rss_bytes": list(stats.peak_rss_bytes),
            "step_times_s": times[1:] or times, "state": state}


def per_replica(by_rank: list[int]) -> list[int]:
    """Stage actors' bytes (by global rank, data-parallel outermost) summed per replica."""
    stages = MESH["pipeline_stages"]
    return [sum(by_rank[d * stages:(d + 1) * stages]) for d in range(MESH["data_parallel"])]


def summarize(plain: dict[str, Any], sharded: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    whole, shard = per_replica(plain["optimizer_state_bytes"]), per_replica(sharded["optimizer_state_bytes"])
    exact = all(torch.equal(sharded["state"][k], v) for k, v in plain["state"].items())
    num_params = sum(v.numel() for v in plain["state"].values())
    median = {name: statistics.median(peer["step_times_s"]) for name, peer in (("zero0", plain), ("zero1", sharded))}
    return {
        "zero1_optimizer_state_ratio": round(max(s / w for s, w in zip(shard, whole)), 4),
        "zero1_optimizer_state_ratio_worst_stage": round(max(
            s / w for s, w in zip(sharded["optimizer_state_bytes"], plain["optimizer_state_bytes"])), 4),
        "optimizer_state_bytes_per_replica": {"zero0": whole, "zero1": shard},
        "optimizer_state_bytes_per_stage": {"zero0": plain["optimizer_state_bytes"],
                                            "zero1": sharded["optimizer_state_bytes"]},
        "exact": exact,
        "zero1_step_time_ratio": round(median["zero1"] / median["zero0"], 3),
        "median_step_s": {k: round(v, 4) for k, v in median.items()},
        "peak_rss_bytes": {"zero0": plain["peak_rss_bytes"], "zero1": sharded["peak_rss_bytes"]},
        "mesh": [MESH["pipeline_stages"], 1, MESH["data_parallel"]], "optimizer": OPTIMIZER[0],
        "blocks": args.blocks, "dim": args.dim, "parameters": num_params, "steps": args.steps,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=3, help="steps per peer (the last one's state is measured)")
    parser.add_argument("--blocks", type=int, default=8, help="residual MLP blocks (reference: 8)")
    parser.add_argument("--dim", type=int, default=512, help="model width (reference: 512)")
    args = parser.parse_args()
    if args.steps < 2 or args.blocks < MESH["pipeline_stages"] or args.dim < 1:
        parser.error("--steps >= 2 (the optimizer state exists from the first step on), --blocks >= 2, --dim >= 1")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    plain = run(train(0, args))
    sharded = run(train(1, args))
    summary = summarize(plain, sharded, args)
    mib = 1 << 20
    print(f"optimizer state per replica, MiB: zero_stage=0 {[round(b / mib, 1) for b in summary['optimizer_state_bytes_per_replica']['zero0']]}"
          f", zero_stage=1 {[round(b / mib, 1) for b in summary['optimizer_state_bytes_per_replica']['zero1']]}")
    print(f"zero1_optimizer_state_ratio {summary['zero1_optimizer_state_ratio']} (target <= 0.55), "
          f"same parameters: {summary['exact']}, step time ratio {summary['zero1_step_time_ratio']}")
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary))
    sys.exit(0 if summary["exact"] else 1)


if __name__ == "__main__":
    main()
