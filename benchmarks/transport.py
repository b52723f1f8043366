# Run: python -m benchmarks.transport   (or: make bench)
"""One-way channel throughput against raw pyzmq, and codec speed, measured in one run.

Two processes: this one sends, a spawned one receives. For each tensor size the same
PUSH/PULL socket pair is driven four times — through actorpipe's channel (msgpack
header + zero-copy tensor frame, asyncio on uvloop, decoded back into a tensor),
through the same channel secured as a cluster's channels are by default (a session
opened over CURVE, every message sealed with AES-GCM: ``transport.sealed``), through
it with every message in CURVE itself (libsodium, the way before sealing), and through
raw blocking pyzmq sending the tensor's buffer with ``copy=False`` — and a fifth way,
the one stages send their values by default: a sealed stream each process's loop writes
and reads itself (``transport.stream``, encrypted; ``stream_vs_plain``) — alternating
trials so machine noise hits all alike, seven of each by default: on a 2-core machine one
trial of the same kind can run at 1.7 or 4.5 GB/s (raw pyzmq at 1 MiB, twelve trials in
a row; at 64 KiB 0.55 or 3.5), by where the scheduler puts the four busy threads, so a
median of three decided little. Each kind's spread (its slowest and fastest trial) is
printed beside its median. The channels get the tensor as raw pyzmq does,
to read while they send (``handed_over=True``: the sender never modifies it). The
receiver times each block from its first message to its last. Every process, the peers'
alike, sets glibc's malloc as a stage process does (``runtime.keep_freed_memory``, on by
default), so a received tensor's buffer is reused memory, not pages faulted in afresh
(``--default-malloc``: glibc's own settings, as the head or a driver runs; the JSON's
``malloc`` says which). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import zmq

from stages.compute.allocator import keep_freed_memory
from transport.channel import BulkMode, open_receiver, open_sender
from transport.codecs import CODEC_NAMES, get_codec
from transport.loop import run
from transport.sealed import SessionKey
from transport.security import Gate, Keypair
from transport.stream import StreamLink, StreamServer
from transport.wire import encode_message

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
_DEFAULT_MALLOC = "ACTORPIPE_BENCH_DEFAULT_MALLOC"
BYTES_PER_TRIAL = 512 << 20
KINDS = ("raw", "channel", "secure", "curve", "stream")


def _count(size: int) -> int:
    return max(32, BYTES_PER_TRIAL // size)


def _as_a_stage_process() -> None:
    """One thread, and glibc's malloc set as every stage process sets it (``runtime.keep_freed_memory``,
    on by default: freed blocks under 32 MiB stay for reuse), so the channel is measured as stages run
    it, both peers alike. With glibc's own settings a channel receiver of 1 MiB messages took 5,600-9,400
    page faults and four times the system time over 512 messages, at half the throughput (each decoded
    message's buffers handed back to the kernel and taken again); ``--default-malloc`` measures that
    way (a process that is not a stage: the head, a driver)."""
    torch.set_num_threads(1)
    if not os.environ.get(_DEFAULT_MALLOC):
        keep_freed_memory()


def _raw_receive(address: str, plan: list[tuple[int, int]], results: Any, ready: Any) -> None:
    _as_a_stage_process()
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 64)
    sock.bind(address)
    ready.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    for size, count in plan:
        sock.recv(copy=False)
        start = time.perf_counter()
        for _ in range(count - 1):
            frame = sock.recv(copy=False)
        results.put(((count - 1) * size, time.perf_counter() - start, len(frame)))
    sock.close(linger=0)


def _channel_receive(
    address: str, plan: list[tuple[int, int]], results: Any, ready: Any, curve: tuple[Keypair, bytes] | None = None
) -> None:
    _as_a_stage_process()
    context: zmq.Context[Any] = zmq.Context()
    gate = Gate(context, lambda: {curve[1]: "node:bench"}) if curve is not None else None

    async def main() -> None:
        async with open_receiver(address, hwm=64, context=context, curve=curve[0] if curve else None) as rx:
            ready.put(rx.address)
            for size, count in plan:
                await rx.receive()
                start = time.perf_counter()
                for _ in range(count - 1):
                    tensor = await rx.receive()
                results.put(((count - 1) * size, time.perf_counter() - start, tensor.numel() * 4))

    try:
        run(main())
    finally:
        if gate is not None:
            gate.stop()
        context.term()


def _stream_receive(folder: str, plan: list[tuple[int, int]], results: Any, ready: Any, opening: bytes) -> None:
    """The stage path: a sealed stream this process's loop reads (``transport.stream``)."""
    _as_a_stage_process()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        blocks = iter(plan)
        state: dict[str, Any] = {"block": next(blocks), "seen": 0, "start": 0.0}
        done = loop.create_future()

        def on_message(tensor: torch.Tensor) -> None:
            size, count = state["block"]
            state["seen"] += 1
            if state["seen"] == 1:
                state["start"] = time.perf_counter()
            elif state["seen"] == count:
                results.put(((count - 1) * size, time.perf_counter() - state["start"], tensor.numel() * 4))
                state["block"], state["seen"] = next(blocks, None), 0
                if state["block"] is None:
                    done.set_result(None)

        server = StreamServer(on_message)
        try:
            ready.put(await server.start("", exactly=f"ipc://{folder}/stream"))
            server.open(opening, "bench")
            await done
        finally:
            server.close()

    run(main())


async def _stream_send(address: str, plan: list[tuple[int, int]], key: SessionKey, results: Any) -> list[Any]:
    """Sends ``plan`` and returns the receiver's results: the loop must run until what the link
    queued has left (an ended loop drops it)."""
    link = await StreamLink.connect(address, key)
    try:
        for size, count in plan:
            tensor = torch.ones(size // 4)
            for _ in range(count):
                await link.send(encode_message(tensor))
        return [await asyncio.to_thread(results.get, timeout=120) for _ in plan]
    finally:
        link.close()


def _raw_send(address: str, plan: list[tuple[int, int]]) -> None:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.connect(address)
    for size, count in plan:
        buf = memoryview(torch.ones(size // 4).numpy())  # type: ignore[arg-type]
        for _ in range(count):
            sock.send(buf, copy=False)
    sock.close(linger=-1)


async def _channel_send(address: str, plan: list[tuple[int, int]], curve: Keypair | None = None,
                        bulk: BulkMode = "encrypt") -> None:
    async with open_sender(address, hwm=64, linger_ms=-1, curve=curve, bulk=bulk) as tx:
        for size, count in plan:
            tensor = torch.ones(size // 4)
            for _ in range(count):
                await tx.send(tensor, handed_over=True)  # never modified: raw pyzmq's copy=False


def measure_throughput(kind: str, plan: list[tuple[int, int]]) -> list[float]:
    """One trial: bytes/s per block of ``plan`` for ``kind`` ('channel', 'secure', 'curve', 'stream' or 'raw')."""
    ctx = mp.get_context("spawn")
    results, ready = ctx.Queue(), ctx.Queue()
    tempdir = tempfile.mkdtemp(prefix="actorpipe-bench-")
    server, client = Keypair.generate(), Keypair.generate()
    secure = kind in ("secure", "curve")
    key = SessionKey.new()
    if kind == "stream":
        target, args = _stream_receive, (tempdir, plan, results, ready, key.open_message())
    else:
        extra = ((server, client.public),) if secure else ()
        target = _raw_receive if kind == "raw" else _channel_receive
        args = (f"ipc://{tempdir}/sock", plan, results, ready, *extra)
    proc = ctx.Process(target=target, args=args)
    proc.start()
    try:
        address = ready.get(timeout=60)
        received = None
        if kind == "stream":
            received = run(_stream_send(address, plan, key, results))
        elif kind != "raw":
            run(_channel_send(address, plan, client if secure else None, "curve" if kind == "curve" else "encrypt"))
        else:
            _raw_send(address, plan)
        rates = []
        for i, (size, _) in enumerate(plan):
            nbytes, seconds, last = received[i] if received is not None else results.get(timeout=120)
            assert last == size, "receiver saw a wrong-sized message"
            rates.append(nbytes / seconds)
        return rates
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        shutil.rmtree(tempdir, ignore_errors=True)


def measure_memcpy(numel: int = 4 << 20, repeats: int = 5) -> float:
    """GB/s of a plain copy of ``numel`` float32 into a preallocated tensor: the peer every codec is measured against."""
    source, target = torch.randn(numel), torch.empty(numel)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return numel * 4 / statistics.median(times) / 1e9


def measure_codecs(numel: int = 4 << 20, repeats: int = 5) -> dict[str, tuple[float, float]]:
    """Encode+decode GB/s of float32 input and encoded/raw size ratio, per codec."""
    torch.manual_seed(0)
    tensor = torch.randn(numel)
    raw_bytes = numel * 4
    out: dict[str, tuple[float, float]] = {}
    for name in CODEC_NAMES:
        codec = get_codec(name)
        codec.decode(codec.encode(tensor))  # warm up allocator and kernels
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            encoded = codec.encode(tensor)
            codec.decode(encoded)
            times.append(time.perf_counter() - start)
        out[name] = (raw_bytes / statistics.median(times) / 1e9, encoded.nbytes / raw_bytes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=7, help="alternating trials per transport")
    parser.add_argument("--default-malloc", action="store_true",
                        help="glibc's own malloc settings, not a stage process's (runtime.keep_freed_memory)")
    args = parser.parse_args()
    if args.default_malloc:
        os.environ[_DEFAULT_MALLOC] = "1"  # the receivers, spawned, read it
    _as_a_stage_process()

    plan = [(size, _count(size)) for size in SIZES.values()]
    samples: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
    for _ in range(args.trials):
        for kind in KINDS:
            samples[kind].append(measure_throughput(kind, plan))
    medians = {kind: [statistics.median(t[i] for t in trials) / 1e9 for i in range(len(plan))]
               for kind, trials in samples.items()}

    print(f"one-way throughput, ipc, PUSH/PULL, median of {args.trials} trials (GB/s)")
    print(f"{'size':>8} {'raw pyzmq':>10} {'channel':>10} {'ratio':>7} {'secure':>8} {'vs plain':>9} "
          f"{'all CURVE':>10} {'vs plain':>9} {'stream':>8} {'vs plain':>9}")
    for i, label in enumerate(SIZES):
        spread = "  ".join(f"{kind} {min(t[i] for t in trials) / 1e9:.2f}-{max(t[i] for t in trials) / 1e9:.2f}"
                           for kind, trials in samples.items())
        print(f"{label:>8} trials' spread (GB/s): {spread}")
    for i, label in enumerate(SIZES):
        raw, chan = medians["raw"][i], medians["channel"][i]
        secure, curve, stream = medians["secure"][i], medians["curve"][i], medians["stream"][i]
        print(f"{label:>8} {raw:>10.2f} {chan:>10.2f} {chan / raw:>7.2f} {secure:>8.2f} {secure / chan:>9.2f} "
              f"{curve:>10.2f} {curve / chan:>9.2f} {stream:>8.2f} {stream / chan:>9.2f}")

    # The copy before and after the codecs: a ratio to it holds across machines where GB/s do not.
    memcpy = [measure_memcpy()]
    codecs = measure_codecs()
    memcpy.append(measure_memcpy())
    copy_gbps = statistics.mean(memcpy)
    print(f"\ncodec encode+decode, 16 MiB float32, 1 thread; a memory copy of the same bytes: {copy_gbps:.2f} GB/s")
    print(f"{'codec':>6} {'GB/s':>8} {'vs memcpy':>10} {'size ratio':>11}")
    for name, (gbps, ratio) in codecs.items():
        print(f"{name:>6} {gbps:>8.2f} {gbps / copy_gbps:>10.3f} {ratio:>11.4f}")

    summary: dict[str, Any] = {"malloc": "default" if args.default_malloc else "stage"}
    for i, label in enumerate(SIZES):
        summary[f"channel_GBps_{label}"] = round(medians["channel"][i], 3)
        summary[f"raw_GBps_{label}"] = round(medians["raw"][i], 3)
        summary[f"channel_vs_raw_{label}"] = round(medians["channel"][i] / medians["raw"][i], 3)
        summary[f"secure_GBps_{label}"] = round(medians["secure"][i], 3)
        summary[f"secure_vs_plain_{label}"] = round(medians["secure"][i] / medians["channel"][i], 3)
        summary[f"curve_GBps_{label}"] = round(medians["curve"][i], 3)
        summary[f"curve_vs_plain_{label}"] = round(medians["curve"][i] / medians["channel"][i], 3)
        summary[f"stream_GBps_{label}"] = round(medians["stream"][i], 3)
        summary[f"stream_vs_plain_{label}"] = round(medians["stream"][i] / medians["channel"][i], 3)
    summary["memcpy_GBps"] = round(copy_gbps, 3)
    for name, (gbps, ratio) in codecs.items():
        if name == "none":  # zero-copy: views, no work done, so no speed to set against a copy
            continue
        summary[f"{name}_GBps"] = round(gbps, 3)
        summary[f"{name}_vs_memcpy"] = round(gbps / copy_gbps, 3)
        summary[f"{name}_size_ratio"] = round(ratio, 4)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
