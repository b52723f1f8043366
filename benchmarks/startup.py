# Run: python -m benchmarks.startup            (add --rounds 1 for a quicker look)
"""Start-up: how long a cluster takes to be ready, and a job to be created, against their floors.

Peers, measured in the same run on this machine:

- ``torch_import_s``: one ``python -c "import torch"``, the least of ``--rounds``;
- ``parallel_imports_s``: five of them at once (a head and four nodes import torch together),
  the least of ``--rounds``: the floor of a 4-node cluster's start on this machine;
- ``cluster_ready_s``: ``LocalCluster(nodes=4)`` from its start to every node registered,
  the first cluster of a fresh driver process (whose fork server imports torch and the
  runtime once, see ``actors/_forkserver.py``), the least of ``--rounds`` such drivers;
- ``cluster_again_s``: a later ``LocalCluster(nodes=4)`` of the same driver (forked from its
  warm fork server), and ``cluster_exec_s``: one started with ``fork_nodes=False`` (each
  process ``python -m actors.node``, importing on its own), each the least of ``--rounds``;
- ``job_created_s``: ``cluster.train`` of 4 stages of an 8-block MLP (slices that build in
  milliseconds), the median of ``--jobs`` jobs on one cluster, each closed before the next,
  with the head's breakdown of it (``JobInfo.creation_s``: compile, place, partition,
  rendezvous, spawn, connect, actor) and ``first_step_s``.

``cluster_ready_vs_parallel_imports`` is the first cluster's time over its floor (target <=
1.2), ``cluster_again_vs_exec`` a later cluster's over one whose processes import on their
own, and ``job_created_vs_torch_import`` the job's creation over one ``import torch`` (target
<= 0.4). ``--nodes N`` measures an N-node cluster (N + 1 imports at once its floor, N stages
its job) in place of four. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from examples import positive_int as count
from schedulers import LocalCluster
from transport.loop import run

JOB = {"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 8, "dim": 64, "hidden": 128},
       "micro_batches": 4}  # on as many stages as the cluster has nodes


def imports(count: int) -> float:
    """Seconds for ``count`` processes importing torch at once, from the first start to the last exit."""
    started = time.perf_counter()
    processes = [subprocess.Popen([sys.executable, "-c", "import torch"]) for _ in range(count)]
    for process in processes:
        process.wait()
    return time.perf_counter() - started


async def cluster_ready(nodes: int, fork_nodes: bool = True) -> float:
    started = time.perf_counter()
    async with LocalCluster(nodes=nodes, fork_nodes=fork_nodes):
        return time.perf_counter() - started


# A fresh driver's first cluster, timed from LocalCluster's start (the driver's own imports are done).
FIRST_CLUSTER = """
import sys
from benchmarks.startup import cluster_ready
from transport.loop import run
print(run(cluster_ready(int(sys.argv[1]))))
"""


def first_cluster_ready(nodes: int) -> float:
    """Seconds to a fresh driver's first ``LocalCluster(nodes=nodes)``: its fork server's imports included."""
    done = subprocess.run([sys.executable, "-c", FIRST_CLUSTER, str(nodes)], capture_output=True, text=True,
                          check=True)
    return float(done.stdout.split()[-1])


async def jobs(count: int, nodes: int) -> list[dict[str, Any]]:
    out = []
    async with LocalCluster(nodes=nodes) as cluster:
        for _ in range(count):
            started = time.perf_counter()
            job = await cluster.train(**JOB, pipeline_stages=nodes)
            created = time.perf_counter() - started
            try:
                started = time.perf_counter()
                await job.step(torch.randn(16, 64), torch.randn(16, 64))
                first = time.perf_counter() - started
            finally:
                await job.close()
            out.append({"job_created_s": created, "first_step_s": first, "creation_s": job.creation_s})
    return out


def measure(rounds: int, num_jobs: int, nodes: int = 4) -> dict[str, Any]:
    torch_import = min(imports(1) for _ in range(rounds))
    parallel = min(imports(nodes + 1) for _ in range(rounds))
    ready = min(first_cluster_ready(nodes) for _ in range(rounds))
    run(cluster_ready(nodes))  # this driver's fork server is warm from here on
    again = min(run(cluster_ready(nodes)) for _ in range(rounds))
    spawned = min(run(cluster_ready(nodes, fork_nodes=False)) for _ in range(rounds))
    made = run(jobs(num_jobs, nodes))
    made.sort(key=lambda j: j["job_created_s"])
    median = made[len(made) // 2]
    created = statistics.median(j["job_created_s"] for j in made)
    return {
        "torch_import_s": round(torch_import, 3),
        "parallel_imports_s": round(parallel, 3),
        "cluster_ready_s": round(ready, 3),
        "cluster_again_s": round(again, 3),
        "cluster_exec_s": round(spawned, 3),
        "job_created_s": round(created, 3),
        "first_step_s": round(statistics.median(j["first_step_s"] for j in made), 3),
        "creation_breakdown_s": median["creation_s"],
        "cluster_ready_vs_parallel_imports": round(ready / parallel, 3),
        "cluster_again_vs_exec": round(again / spawned, 3),
        "job_created_vs_torch_import": round(created / torch_import, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=count, default=3, help="imports and fresh clusters timed (the least counts)")
    parser.add_argument("--jobs", type=count, default=5, help="jobs created on one cluster (the median counts)")
    parser.add_argument("--nodes", type=count, default=4, help="the cluster's nodes, and its job's stages")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = measure(args.rounds, args.jobs, args.nodes)
    for key, value in result.items():
        print(f"{key:>36}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
