# Run: python -m benchmarks.hop
"""One hop's latency: a ZeroMQ socket against a Unix socket the event loop drives itself.

Two processes bounce a 64-byte message back and forth (``--round-trips`` times per
trial), both on uvloop, as a LocalCluster's nodes run:

- ``zmq``: a pair of ``zmq.asyncio`` PAIR sockets over ``ipc://``, the transport every
  actor message and every stage-to-stage tensor takes today. A send hands the message
  to libzmq's I/O thread, which writes it; on the other side that process's I/O thread
  reads it and wakes the loop.
- ``unix``: a Unix stream socket that each loop writes and reads itself
  (``loop.sock_sendall`` / ``loop.sock_recv``): one wake-up a hop, the receiver's, as
  gloo's pair (written from the calling thread) has.
- ``stream``: what stages send their values on (``transport.stream``): the message
  encoded as a wire message, sealed with AES-GCM, written by the loop to a Unix socket
  and read, opened and decoded by the other loop; each direction its own session.

The trials alternate (``--trials`` of each), so the machine's load weighs on both
alike; the medians of each trial's median round trip are compared. ``zmq_vs_unix_rtt``
is how many times longer ZeroMQ's round trip takes: the floor under every hop made over
ZeroMQ, which no Python above libzmq can lower; ``stream_vs_zmq_rtt`` is what the stages'
sealed stream takes against ZeroMQ (below 1: faster). The last line printed is one JSON
object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import zmq
import zmq.asyncio

from examples import positive_int as count
from transport.loop import run
from transport.sealed import SessionKey
from transport.stream import StreamLink, StreamServer
from transport.wire import encode_message

MESSAGE = b"x" * 64


def _zmq_echo(address: str, count: int) -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        sock = context.socket(zmq.PAIR)
        sock.connect(address)
        for _ in range(count):
            await sock.send(await sock.recv())
        sock.close(linger=1000)
        context.term()

    run(main())


def _unix_echo(path: str, count: int) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            sock.setblocking(False)
            for _ in range(count):
                await loop.sock_sendall(sock, await _read_exactly(loop, sock, len(MESSAGE)))

    run(main())


def _stream_echo(address: str, opening_back: bytes, opening_here: bytes, folder: str, count: int) -> None:
    async def main() -> None:
        received: asyncio.Queue[Any] = asyncio.Queue()
        server = StreamServer(received.put_nowait)
        here = await server.start(f"ipc://{folder}/echo")
        server.open(opening_here, "bouncer")
        back = await StreamLink.connect(address, SessionKey.from_open_message(opening_back))
        await back.send(encode_message([here]))  # where the bouncer's messages go
        for _ in range(count):
            await back.send(encode_message(await received.get()))
        await received.get()  # the bouncer's last word: it has every answer
        back.close()
        server.close()

    run(main())


async def _read_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = await loop.sock_recv(sock, size - len(data))
        if not chunk:
            raise ConnectionError("the echo process closed its socket")
        data += chunk
    return data


@contextlib.contextmanager
def _echo(target: Callable[..., None], *args: Any) -> Iterator[None]:
    """The echo process, spawned, and gone after the block (killed if it has not ended by then)."""
    process = mp.get_context("spawn").Process(target=target, args=args)
    process.start()
    try:
        yield
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join()


async def _bounce(send: Callable[[], Awaitable[Any]], receive: Callable[[], Awaitable[Any]],
                  count: int) -> list[float]:
    """Each of ``count`` round trips' seconds."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        await send()
        await receive()
        times.append(time.perf_counter() - start)
    return times


async def _zmq_trial(folder: str, count: int) -> list[float]:
    address = f"ipc://{folder}/zmq"
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.PAIR)
    sock.bind(address)
    try:
        with _echo(_zmq_echo, address, count):
            return await _bounce(lambda: sock.send(MESSAGE), sock.recv, count)
    finally:
        sock.close(linger=0)
        context.term()


async def _unix_trial(folder: str, count: int) -> list[float]:
    loop = asyncio.get_running_loop()
    path = f"{folder}/unix"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        listener.setblocking(False)
        with _echo(_unix_echo, path, count):
            conn, _ = await asyncio.wait_for(loop.sock_accept(listener), timeout=60)
            with conn:
                conn.setblocking(False)
                return await _bounce(lambda: loop.sock_sendall(conn, MESSAGE),
                                     lambda: _read_exactly(loop, conn, len(MESSAGE)), count)


async def _stream_trial(folder: str, count: int) -> list[float]:
    received: asyncio.Queue[Any] = asyncio.Queue()
    server = StreamServer(received.put_nowait)
    address = await server.start(f"ipc://{folder}/bouncer")
    back, there = SessionKey.new(), SessionKey.new()  # the echo's session here, and this side's there
    server.open(back.open_message(), "echo")
    try:
        with _echo(_stream_echo, address, back.open_message(), there.open_message(), folder, count):
            [echo_address] = await asyncio.wait_for(received.get(), timeout=60)
            link = await StreamLink.connect(echo_address, there)
            try:
                times = await _bounce(lambda: link.send(encode_message([MESSAGE])), received.get, count)
                await link.send(encode_message(["done"]))
                return times
            finally:
                link.close()
    finally:
        server.close()


TRIALS: dict[str, Callable[[str, int], Awaitable[list[float]]]] = {
    "zmq": _zmq_trial, "unix": _unix_trial, "stream": _stream_trial}


async def measure(trials: int, count: int) -> dict[str, list[float]]:
    """Each kind's median round trip (seconds) per trial, the kinds taking turns to go first."""
    medians: dict[str, list[float]] = {kind: [] for kind in TRIALS}
    kinds = list(TRIALS)
    for index in range(trials):
        for kind in kinds[index % len(kinds):] + kinds[:index % len(kinds)]:
            folder = tempfile.mkdtemp(prefix="actorpipe-hop-")
            try:
                medians[kind].append(statistics.median(await TRIALS[kind](folder, count)))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=count, default=5, help="alternating trials of each kind")
    parser.add_argument("--round-trips", type=count, default=4000, help="round trips per trial")
    args = parser.parse_args(argv)
    medians = run(measure(args.trials, args.round_trips))
    zmq_us = statistics.median(medians["zmq"]) * 1e6
    unix_us = statistics.median(medians["unix"]) * 1e6
    stream_us = statistics.median(medians["stream"]) * 1e6
    print("round trip of 64 bytes between two processes, uvloop on both ends (us; median of trial medians)")
    for kind, values in medians.items():
        print(f"{kind:>6}: {statistics.median(values) * 1e6:7.1f}  (trials {min(values) * 1e6:.1f}-{max(values) * 1e6:.1f})")
    summary: dict[str, Any] = {"zmq_rtt_us": round(zmq_us, 1), "unix_rtt_us": round(unix_us, 1),
                               "stream_rtt_us": round(stream_us, 1), "zmq_vs_unix_rtt": round(zmq_us / unix_us, 3),
                               "stream_vs_zmq_rtt": round(stream_us / zmq_us, 3), "trials": args.trials,
                               "round_trips": args.round_trips}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
