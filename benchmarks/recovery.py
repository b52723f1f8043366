# Run: python -m benchmarks.recovery            (add --steps 6 for a quick look)
"""What recovering a lost pipeline stage costs, on the reference workload (docs/design.md) at 2 stages.

Peers, in one run on one ``LocalCluster`` (4 nodes and a spare, each job on 2 of its own):
- ``plain``: the job without ``max_restarts``: no snapshots;
- ``snapshots``: the same job with ``max_restarts=1`` (each stage copies its
  parameters and optimizer state every step and sends a copy to its neighbour).
The two jobs' steps alternate in rounds, so the machine's noise hits both alike;
``snapshot_overhead`` is the median step time with snapshots over the median without,
minus one. Then one stage node of the snapshot job is SIGKILLed in the middle of a
step: ``recovery_s`` is the time from the kill to that step completing (the head
noticing the loss, the respawn on the spare, the restore, the step again), and
``detect_s`` the part of it until the head listed the node as lost (its liveness
connection closed: ``actors._liveness``; before it, the 2 s heartbeat timeout). The parameters
afterwards are compared with the plain job's, which trained on the same batches.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time
from typing import Any

import torch

from examples import positive_int as count
from schedulers import Job, LocalCluster
from transport.loop import run

WORKLOAD = {"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 8, "dim": 512},
            "pipeline_stages": 2, "micro_batches": 8, "optimizer": ("torch.optim:SGD", {"lr": 0.01}),
            "data": "examples.data:regression_batches", "data_kwargs": {"batch_size": 64, "seq": 32, "dim": 512}}


async def timed_step(job: Job) -> float:
    started = time.perf_counter()
    await job.step()
    return time.perf_counter() - started


async def measure(steps: int, warmup: int, heartbeat_timeout: float) -> dict[str, Any]:
    local = LocalCluster(nodes=4, spares=1, heartbeat_timeout=heartbeat_timeout)
    async with local as cluster:
        plain = await cluster.train(**WORKLOAD)
        snap = await cluster.train(**WORKLOAD, max_restarts=1)
        try:
            times: dict[str, list[float]] = {"plain": [], "snapshots": []}
            for i in range(warmup + steps):
                order = [("plain", plain), ("snapshots", snap)][:: 1 if i % 2 else -1]
                for name, job in order:
                    seconds = await timed_step(job)
                    if i >= warmup:
                        times[name].append(seconds)
            medians = {name: statistics.median(values) for name, values in times.items()}
            victim = snap.nodes[1]
            step = asyncio.ensure_future(snap.step())
            await asyncio.sleep(medians["snapshots"] / 2)
            killed = time.perf_counter()
            os.kill(local.processes[victim].pid, signal.SIGKILL)
            detected = asyncio.ensure_future(_lost_after(cluster, victim, killed))
            stats = await step
            recovery_s = time.perf_counter() - killed
            detect_s = await detected
            assert stats.recovery is not None, "the step did not recover"
            await plain.step()  # the same data step as the recovered one
            same = await _same_parameters(plain, snap)
            return {
                "steps": steps,
                "plain_step_s": round(medians["plain"], 4),
                "snapshot_step_s": round(medians["snapshots"], 4),
                "snapshot_overhead": round(medians["snapshots"] / medians["plain"] - 1, 4),
                "recovery_s": round(recovery_s, 3),
                "detect_s": round(detect_s, 3),
                "restore_s": stats.recovery.seconds,
                "moved": stats.recovery.moved,
                "parameters_equal_after_recovery": same,
            }
        finally:
            for job in (plain, snap):
                await job.close()


async def _lost_after(cluster: Any, node: str, since: float) -> float:
    """Seconds from ``since`` until the head lists ``node`` as lost."""
    while not any(n.name == node and n.state == "lost" for n in await cluster.nodes()):
        await asyncio.sleep(0.01)
    return time.perf_counter() - since


async def _same_parameters(a: Job, b: Job) -> bool:
    left, right = await a.state_dict(), await b.state_dict()
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=count, default=20, help="timed steps of each job")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0,
                        help="the head's silence timeout (a killed node is known by its connection closing)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = run(measure(args.steps, args.warmup, args.heartbeat_timeout))
    for key, value in result.items():
        print(f"{key:>32}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
