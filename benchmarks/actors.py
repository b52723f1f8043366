# Run: python -m benchmarks.actors
"""Actor request/reply round trip between two node processes, against raw pyzmq.

Three measurements in one run, on this machine's loopback:
- actorpipe: a probe actor in node0 asks a probe actor in node1 (``ping``), one call
  at a time, then with 64 calls in flight, secure (the default: CURVE admits the keys
  and opens a session per pair of runtimes, and the calls between the nodes travel on
  the sealed streams the event loops drive, every message sealed with AES-GCM,
  ``transport.sealed``, ``transport.stream``) and again with ``--insecure`` (plaintext,
  and the calls on ZeroMQ: a runtime without keys opens no streams). The two defaults
  differ in transport as well as in security: ``curve_vs_insecure_rtt`` is the secure
  default over the insecure one, what turning security off changes, not CURVE's cost
  on one socket;
- raw: two processes ping-pong a 64-byte message over a pair of PUSH/PULL sockets
  with ``zmq.asyncio`` on the same event loop (uvloop), over Unix sockets (``ipc://``,
  in a temporary folder): raw ZeroMQ, the peer issue 30's ``rtt_ratio_vs_raw_zmq`` names
  (the secure calls no longer use ZeroMQ between nodes; ``benchmarks.hop`` sets the
  transports themselves side by side).
The calls are made in rounds (``--rounds``), and each round also times as many raw round
trips, the order alternating from round to round, so that a change in the machine's load
during the run weighs on both sides of each ratio alike (measured one after the other, a
quiet machine's ratio swung from 1.13 to 1.99 between runs). Each cluster's ratio is
against the raw round trips of its own rounds. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import shutil
import statistics
import tempfile
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


def _raw_echo(outbox: str, folder: str, ready: Any) -> None:
    """Echoes every message back until an empty one."""
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(f"ipc://{folder}/echo")
        push.connect(outbox)
        ready.put(pull.getsockopt_string(zmq.LAST_ENDPOINT))
        while message := await pull.recv():
            await push.send(message)
        pull.close(linger=0)
        push.close(linger=1000)
        ctx.term()

    run(main())


class RawPeer:
    """Raw pyzmq's side of the comparison: a process that echoes, and this loop's sockets to it.

    It lives for the whole run, so that its blocks of round trips can alternate with the
    actors' in the same minute: the machine's load then weighs on both alike.
    """

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.folder = tempfile.mkdtemp(prefix="actorpipe-raw-")
        self.pull.bind(f"ipc://{self.folder}/driver")
        self.proc: Any = None

    async def start(self) -> None:
        mp_ctx = mp.get_context("spawn")
        ready = mp_ctx.Queue()
        self.proc = mp_ctx.Process(target=_raw_echo,
                                   args=(self.pull.getsockopt_string(zmq.LAST_ENDPOINT), self.folder, ready))
        self.proc.start()
        self.push.connect(await asyncio.to_thread(ready.get, True, 60))

    async def round_trips(self, count: int) -> list[float]:
        """``count`` round trips of a 64-byte message (seconds each)."""
        rtts = []
        for _ in range(count):
            start = time.perf_counter()
            await self.push.send(PAYLOAD)
            await self.pull.recv()
            rtts.append(time.perf_counter() - start)
        return rtts

    async def aclose(self) -> None:
        if self.proc is not None:
            await self.push.send(b"")
            await asyncio.to_thread(self.proc.join, 30)
            if self.proc.is_alive():
                self.proc.kill()
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclasses.dataclass(slots=True)
class Rounds:
    """One cluster's figures, gathered in rounds that alternate with raw pyzmq's."""

    rtts: list[float] = dataclasses.field(default_factory=list)
    raw_rtts: list[float] = dataclasses.field(default_factory=list)
    req_per_s: list[float] = dataclasses.field(default_factory=list)  # one per round, 64 in flight


async def measure_actors(raw: RawPeer, count: int, rounds: int, *, insecure: bool = False) -> Rounds:
    """Round trips between actors in two nodes, and requests/s with 64 in flight (CURVE unless
    ``insecure``), in ``rounds`` rounds, each also timing as many raw round trips (the order
    alternating from round to round)."""
    out = Rounds()
    per_round = max(1, count // rounds)
    async with LocalCluster(nodes=2, insecure=insecure) as cluster:
        pinger = await cluster.spawn("node0", "probe", "pinger")
        target = await cluster.spawn("node1", "probe", "target")
        ping_peer = pinger.endpoint(ProbeActor.ping_peer, timeout=600)
        await ping_peer.call(target.address, target.name, 200)  # warm up
        await raw.round_trips(200)
        for index in range(rounds):
            for side in ("raw", "actors") if index % 2 == 0 else ("actors", "raw"):
                if side == "raw":
                    out.raw_rtts += await raw.round_trips(per_round)
                    continue
                single = await ping_peer.call(target.address, target.name, per_round)
                out.rtts += single["rtts_s"]
                many = await ping_peer.call(target.address, target.name, per_round * 4, 64)
                out.req_per_s.append(per_round * 4 / many["elapsed_s"])
    return out


async def measure(count: int, rounds: int) -> tuple[Rounds, Rounds]:
    """The secure cluster's rounds, then the insecure one's, against one raw peer."""
    raw = RawPeer()
    try:
        await raw.start()
        return (await measure_actors(raw, count, rounds),
                await measure_actors(raw, count, rounds, insecure=True))
    finally:
        await raw.aclose()


def summarize(secure: Rounds, plain: Rounds) -> dict[str, Any]:
    """The last line's figures: medians of every round's samples (requests/s: of the rounds' rates)."""
    raw_rtts = secure.raw_rtts + plain.raw_rtts
    rtt, raw_rtt = statistics.median(secure.rtts) * 1e6, statistics.median(secure.raw_rtts) * 1e6
    plain_rtt, plain_raw_rtt = statistics.median(plain.rtts) * 1e6, statistics.median(plain.raw_rtts) * 1e6
    req_per_s, plain_req_per_s = statistics.median(secure.req_per_s), statistics.median(plain.req_per_s)
    return {
        "rtt_us": round(rtt, 1),
        "rtt_p99_us": round(_percentile(secure.rtts, 0.99) * 1e6, 1),
        "raw_rtt_us": round(statistics.median(raw_rtts) * 1e6, 1),
        "raw_rtt_p99_us": round(_percentile(raw_rtts, 0.99) * 1e6, 1),
        # Each against the raw round trips timed in its own rounds.
        "rtt_ratio_vs_raw_zmq": round(rtt / raw_rtt, 3),
        "inflight64_req_per_s": round(req_per_s, 1),
        "insecure_rtt_us": round(plain_rtt, 1),
        "insecure_rtt_ratio_vs_raw_zmq": round(plain_rtt / plain_raw_rtt, 3),
        "insecure_inflight64_req_per_s": round(plain_req_per_s, 1),
        "curve_vs_insecure_rtt": round(rtt / plain_rtt, 3),
        "curve_vs_insecure_inflight64": round(req_per_s / plain_req_per_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=5000, help="round trips per measurement")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds the round trips are split into, alternating with raw pyzmq's")
    args = parser.parse_args()
    if args.count < 1 or not 1 <= args.rounds <= args.count:
        parser.error("--count must be >= 1 and --rounds between 1 and --count")

    secure, plain = run(measure(args.count, args.rounds))
    rows: dict[str, Any] = {
        "raw pyzmq async": secure.raw_rtts + plain.raw_rtts,
        "actorpipe actor": secure.rtts,
        "... --insecure": plain.rtts,
    }
    print(f"request/reply round trip, 2 processes, loopback, {args.count} calls in {args.rounds} rounds "
          "(microseconds)")
    print(f"{'path':>18} {'median':>8} {'p99':>8}")
    for name, rtts in rows.items():
        print(f"{name:>18} {statistics.median(rtts) * 1e6:>8.1f} {_percentile(rtts, 0.99) * 1e6:>8.1f}")
    summary = summarize(secure, plain)
    print(f"actorpipe, 64 calls in flight: {summary['inflight64_req_per_s']:,.0f} requests/s (CURVE), "
          f"{summary['insecure_inflight64_req_per_s']:,.0f} (--insecure)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
