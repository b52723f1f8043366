# Run: python -m benchmarks.actors
"""Actor request/reply round trip between two node processes, against raw pyzmq.

Three measurements in one run, on this machine's loopback:
- actorpipe: a probe actor in node0 asks a probe actor in node1 (``ping``), one call
  at a time, then with 64 calls in flight, secure (the default: CURVE admits the keys
  and opens a session per pair of runtimes, and every message is sealed with AES-GCM,
  ``transport.sealed``) and again with ``--insecure`` (plaintext), so the cost of
  security shows as its own ratio (``curve_vs_insecure_rtt``);
- raw: two processes ping-pong a 64-byte message over a pair of PUSH/PULL sockets
  with ``zmq.asyncio`` on the same event loop (uvloop) and the same transport (tcp
  on 127.0.0.1) as a LocalCluster: the socket type actorpipe uses.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import zmq
import zmq.asyncio

from actors.probe import ProbeActor
from schedulers import LocalCluster
from transport.loop import run

PAYLOAD = b"x" * 64


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _raw_echo(outbox: str, count: int, ready: Any) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind("tcp://127.0.0.1:*")
        push.connect(outbox)
        ready.put(pull.getsockopt_string(zmq.LAST_ENDPOINT))
        for _ in range(count):
            await push.send(await pull.recv())
        pull.close(linger=0)
        push.close(linger=1000)
        ctx.term()

    run(main())


def measure_raw(count: int) -> list[float]:
    """Round trips (seconds) of a 64-byte async ping-pong between two processes over tcp loopback."""

    async def main() -> list[float]:
        ctx = zmq.asyncio.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        pull.bind("tcp://127.0.0.1:*")
        mp_ctx = mp.get_context("spawn")
        ready = mp_ctx.Queue()
        proc = mp_ctx.Process(target=_raw_echo, args=(pull.getsockopt_string(zmq.LAST_ENDPOINT), count, ready))
        proc.start()
        try:
            push.connect(await asyncio.to_thread(ready.get, True, 60))
            rtts = []
            for _ in range(count):
                start = time.perf_counter()
                await push.send(PAYLOAD)
                await pull.recv()
                rtts.append(time.perf_counter() - start)
            return rtts
        finally:
            push.close(linger=0)
            pull.close(linger=0)
            ctx.term()
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()

    return run(main())


async def measure_actors(count: int, in_flight_count: int, *, insecure: bool = False) -> tuple[list[float], float]:
    """Round trips between actors in two nodes, and requests/s with 64 in flight (CURVE unless ``insecure``)."""
    async with LocalCluster(nodes=2, insecure=insecure) as cluster:
        pinger = await cluster.spawn("node0", "probe", "pinger")
        target = await cluster.spawn("node1", "probe", "target")
        ping_peer = pinger.endpoint(ProbeActor.ping_peer, timeout=600)
        await ping_peer.call(target.address, target.name, 200)  # warm up
        single = await ping_peer.call(target.address, target.name, count)
        many = await ping_peer.call(target.address, target.name, in_flight_count, 64)
        return single["rtts_s"], in_flight_count / many["elapsed_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=5000, help="round trips per measurement")
    args = parser.parse_args()

    raw = measure_raw(args.count + 200)[200:]
    actor_rtts, req_per_s = run(measure_actors(args.count, args.count * 4))
    plain_rtts, plain_req_per_s = run(measure_actors(args.count, args.count * 4, insecure=True))
    rows: dict[str, Any] = {
        "raw pyzmq async": raw,
        "actorpipe actor": actor_rtts,
        "... --insecure": plain_rtts,
    }
    print(f"request/reply round trip, 2 processes, loopback, {args.count} calls (microseconds)")
    print(f"{'path':>18} {'median':>8} {'p99':>8}")
    for name, rtts in rows.items():
        print(f"{name:>18} {statistics.median(rtts) * 1e6:>8.1f} {_percentile(rtts, 0.99) * 1e6:>8.1f}")
    print(f"actorpipe, 64 calls in flight: {req_per_s:,.0f} requests/s (CURVE), {plain_req_per_s:,.0f} (--insecure)")
    rtt, raw_rtt = statistics.median(actor_rtts) * 1e6, statistics.median(raw) * 1e6
    plain_rtt = statistics.median(plain_rtts) * 1e6
    print(json.dumps({
        "rtt_us": round(rtt, 1),
        "rtt_p99_us": round(_percentile(actor_rtts, 0.99) * 1e6, 1),
        "raw_rtt_us": round(raw_rtt, 1),
        "raw_rtt_p99_us": round(_percentile(raw, 0.99) * 1e6, 1),
        "rtt_ratio_vs_raw_zmq": round(rtt / raw_rtt, 3),
        "inflight64_req_per_s": round(req_per_s, 1),
        "insecure_rtt_us": round(plain_rtt, 1),
        "insecure_inflight64_req_per_s": round(plain_req_per_s, 1),
        "curve_vs_insecure_rtt": round(rtt / plain_rtt, 3),
        "curve_vs_insecure_inflight64": round(req_per_s / plain_req_per_s, 3),
    }))


if __name__ == "__main__":
    main()
