# Run: python -m examples.transport_demo
"""A first look at actorpipe: a local cluster, actors in two node processes, tensors between them.

Starts a head and two worker nodes on this machine, places a probe actor on each,
measures a round trip between them, and sends a 512 KiB activation-sized tensor (8 x 32 x 512)
through every codec, printing what each costs on the wire and what it loses.
"""

from __future__ import annotations

import statistics
import time

import torch

from actors import LocalCluster
from actors.probe import ProbeActor
from transport.codecs import CODEC_NAMES, decode, encode
from transport.loop import run
from transport.wire import Coded


async def main() -> None:
    torch.manual_seed(0)
    async with LocalCluster(nodes=2) as cluster:
        for node in await cluster.nodes():
            print(f"node {node.name}: pid {node.pid} at {node.address} ({node.device})")
        a = await cluster.spawn("node0", "probe", "a")
        b = await cluster.spawn("node1", "probe", "b")
        result = await a.endpoint(ProbeActor.ping_peer, timeout=60).call(b.address, b.name, 500)
        print(f"actor round trip node0 -> node1: median {statistics.median(result['rtts_s']) * 1e6:.0f} us")

        activation = torch.randn(8, 32, 512) * 3  # one reference micro-batch: 512 KiB
        print(f"\n{'codec':>6} {'bytes':>9} {'ratio':>6} {'rel. error':>11} {'echo ms':>8}")
        echo = b.endpoint(ProbeActor.echo, timeout=30)
        for name in CODEC_NAMES:
            await echo.call(Coded(activation, name))  # first call warms kernels up
            start = time.perf_counter()
            back = await echo.call(Coded(activation, name))
            elapsed = time.perf_counter() - start
            nbytes = encode(activation, name).nbytes
            error = (back - activation).norm() / activation.norm()
            assert decode(encode(activation, name)).shape == activation.shape
            print(f"{name:>6} {nbytes:>9} {nbytes / (activation.numel() * 4):>6.3f} {error:>11.2e} {elapsed * 1e3:>8.1f}")
    print("\ncluster stopped; no process left behind")


if __name__ == "__main__":
    run(main())
