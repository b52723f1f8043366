# Run: torchrun --nproc-per-node 3 examples/launched.py        (or: srun python examples/launched.py)
"""One training script for every rank of a launcher (torchrun, srun, a Kubernetes Indexed Job).

The launcher starts this script on every rank. Its first call makes rank 0 the driver,
with the cluster's head started beside it, and every other rank a worker node that serves
until the head is gone. Rank 0 then connects with the launcher's variables alone, trains,
and exits; the head stops with it and the workers exit by themselves. The keys come from
``ACTORPIPE_KEYS`` (``python -m actors.keys init DIR`` once; on many machines a shared
folder or a Secret, see docs/machines.md); without a launcher it trains on a LocalCluster.
"""

from __future__ import annotations

import asyncio

import torch

from actors.launchers import serve_unless_rank_zero

# Every rank: the node options (the factories this job names, how long a worker waits for the head).
role = serve_unless_rank_zero(["--allow", "examples.models", "--head-timeout", "60", "--log-level", "WARNING"])


async def train(cluster: object) -> None:
    job = await cluster.train(model="examples.models:residual_mlp",  # type: ignore[attr-defined]
                              model_kwargs={"blocks": 4, "dim": 8, "hidden": 16}, pipeline_stages=2,
                              micro_batches=2, optimizer=("torch.optim:SGD", {"lr": 0.05}))
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    for step in range(5):
        print(f"step {step} loss {(await job.step(x, y)).loss:.4f}", flush=True)
    await job.close()


async def main() -> None:
    from schedulers import Cluster, LocalCluster

    if role is None:
        async with LocalCluster(nodes=2) as local:
            await train(local)
        return
    async with Cluster.connect(identity="admin", timeout=60) as cluster:  # the head rank 0 just started
        while len([n for n in await cluster.nodes() if n.alive]) < role.world_size - 1:  # every other rank
            await asyncio.sleep(0.2)
        await train(cluster)


asyncio.run(main())
