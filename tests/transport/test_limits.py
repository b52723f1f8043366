"""Tests for what a hostile message may cost a receiver (transport/wire.py, transport/channel.py).

A security probe's findings as tests: decode amplification and declared sizes refused before
any allocation, msgpack bodies that are cheap on the wire but costly to build refused
fast, a message's size checked frame by frame as it arrives, and untrusted values
quoted only as short escaped excerpts.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from transport.channel import open_receiver, open_sender
from transport.codecs import CodecError, Fp8Codec, encode
from transport.wire import (
    MAX_CONTAINERS,
    MAX_DEPTH,
    MAX_EXPANSION,
    MAX_FRAMES_PER_MESSAGE,
    MAX_ITEMS,
    Coded,
    MessageTooLarge,
    WireError,
    decode_message,
    encode_message,
    excerpt,
)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
# The probe's bar: a hostile message is refused in under 50 ms of this process's CPU time
# (process time, not wall time: a busy machine preempting the test must not fail it,
# while decoding what the message declares would take seconds of CPU).
FAST_S = 0.05
MIB = 1 << 20


@contextlib.contextmanager
def cheap() -> Iterator[None]:
    """Asserts that the body took under :data:`FAST_S` of this process's CPU time, with the cyclic
    GC paused meanwhile: a collection that happened to start inside would walk every object of
    the process, torch's included, and charge the body for it."""
    paused = gc.isenabled()
    gc.disable()
    start = time.process_time()
    try:
        yield
    finally:
        spent = time.process_time() - start
        if paused:
            gc.enable()
    assert spent < FAST_S, f"{spent:.3f}s of CPU"


def header(table: list[object], body: object = None, *, version: object = 1, raw_body: bytes | None = None) -> bytes:
    return msgpack.packb([version, table, msgpack.packb(body) if raw_body is None else raw_body])


def ref(index: int) -> msgpack.ExtType:
    return msgpack.ExtType(1, index.to_bytes(4, "little"))


def row_frames(codec: str, dtype: str, numel: int, *, block: int = 256) -> tuple[list[object], list[int]]:
    """A table row declaring ``numel`` elements of ``dtype``, and the frame sizes the codec wants."""
    if codec == "none":
        return [codec, dtype, [numel], {}, 1], [numel * torch.empty(0, dtype=getattr(torch, dtype)).element_size()]
    if codec in ("fp16", "bf16"):
        return [codec, dtype, [numel], {}, 1], [2 * numel]
    values = (numel + 1) // 2 if codec == "int4" else numel
    return [codec, dtype, [numel], {"block": block}, 2], [values, 4 * math.ceil(numel / block)]


def crafted(codec: str, dtype: str, numel: int, *, block: int = 256) -> list[object]:
    row, sizes = row_frames(codec, dtype, numel, block=block)
    return [header([row], body=ref(0)), *(bytearray(n) for n in sizes)]


# -- 1. declared sizes, checked before memory is committed ---------------------------

DECLARED = {
    # The probe: an int4 message declaring float64 decodes to 16x its frames (25x RSS).
    "int4 declaring float64": (("int4", "float64", 4096), WireError, "expand"),
    "int8 declaring float64": (("int8", "float64", 4096), WireError, "expand"),
    "fp8 declaring float64": (("fp8", "float64", 4096), WireError, "expand"),
    "fp16 declaring float64": (("fp16", "float64", 4096), WireError, "expand"),
    "bf16 declaring float64": (("bf16", "float64", 4096), WireError, "expand"),
}


@pytest.mark.parametrize("args,error,match", DECLARED.values(), ids=DECLARED.keys())
def test_a_declared_size_out_of_proportion_to_its_frames_is_refused(
    args: tuple[str, str, int], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        decode_message(crafted(*args))


def test_tensors_that_would_decode_past_the_limit_are_refused() -> None:
    frames = crafted("int4", "float32", 1 << 16)  # 33 KiB of frames, 256 KiB decoded
    assert sum(memoryview(f).nbytes for f in frames) < 64 << 10
    with pytest.raises(MessageTooLarge, match="decode to more than the limit"):
        decode_message(frames, max_bytes=64 << 10)
    # Two rows within the limit each, over it together.
    row, sizes = row_frames("int8", "float32", 6000)
    two = [header([row, row], body=[ref(0), ref(1)]), *(bytearray(n) for n in sizes + sizes)]
    decode_message(two, max_bytes=64 << 10)
    with pytest.raises(MessageTooLarge):
        decode_message(two, max_bytes=40 << 10)


def test_block_padding_is_bounded_per_message() -> None:
    # 300 rows of 2 elements in 2**20-element blocks: 5 bytes of frames each, but the
    # block codecs' torch path would build 300 padded blocks (~9 MiB of temporaries each).
    row, sizes = row_frames("fp8", "float32", 2, block=1 << 20)
    frames = [header([row] * 300), *(bytearray(n) for _ in range(300) for n in sizes)]
    with cheap(), pytest.raises(WireError, match="pad"):
        decode_message(frames)
    decode_message(crafted("fp8", "float32", 2, block=1 << 20))  # one such row is fine
    tiny = Fp8Codec(block=1 << 20).encode(torch.ones(2))
    encode_message([tiny])
    with pytest.raises(CodecError, match="pad"):  # the sender refuses what the receiver would
        encode_message([tiny] * 300)


CODEC_DTYPES = [(codec, dtype) for codec in MAX_EXPANSION for dtype in (torch.float32, torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("numel", [0, 1, 255, 256, 257, 5000])
@pytest.mark.parametrize("codec,dtype", CODEC_DTYPES, ids=[f"{c}-{d}" for c, d in CODEC_DTYPES])
def test_every_codec_stays_within_its_expansion_bound(codec: str, dtype: torch.dtype, numel: int) -> None:
    encoded = encode(torch.randn(numel).to(dtype), codec)
    assert numel * dtype.itemsize <= MAX_EXPANSION[codec] * encoded.nbytes
    frames = [bytes(memoryview(f)) for f in encode_message({"x": Coded(torch.randn(numel).to(dtype), codec)})]
    assert decode_message(frames)["x"].dtype == dtype


def test_float64_travels_raw_under_a_lossy_default_and_is_refused_when_asked_for() -> None:
    x = torch.randn(1000, dtype=torch.float64)
    frames = encode_message({"x": x}, codec="int4")
    assert msgpack.unpackb(frames[0])[1][0][0] == "none"
    assert torch.equal(decode_message([bytes(memoryview(f)) for f in frames])["x"], x)
    with pytest.raises(CodecError, match="cast it to float32"):
        encode_message(Coded(x, "int4"))
    with pytest.raises(CodecError, match="cast it to float32"):
        encode_message(encode(x, "fp16"))


def test_the_sender_refuses_what_the_receiver_would() -> None:
    with pytest.raises(MessageTooLarge, match="decoded"):
        encode_message(Coded(torch.zeros(1 << 16), "int4"), max_bytes=64 << 10)


# The probe's numbers, in a fresh process: 16 MiB of int4 frames declaring float64
# would decode to 256 MiB (plus a float32 temporary); refused, RSS must not move.
AMPLIFICATION_PROBE = r"""
import json, math, resource
import msgpack, torch
from transport.wire import WireError, decode_message, encode_message, Coded

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def crafted(codec, dtype, numel, sizes):
    head = msgpack.packb([1, [[codec, dtype, [numel], {"block": 256} if len(sizes) == 2 else {}, len(sizes)]],
                          msgpack.packb(msgpack.ExtType(1, bytes(4)))])
    return [head, *(bytearray(b"\x11") * n for n in sizes)]  # touched: counted in the baseline

N = 32 << 20
cases = {
    "int4 declaring float64": (crafted("int4", "float64", N, [N // 2, 4 * N // 256]), None),
    "fp16 declaring float64": (crafted("fp16", "float64", N // 4, [N // 2]), None),
    "int4 decoding past max_bytes": (crafted("int4", "float32", N, [N // 2, 4 * N // 256]), 64 << 20),
}
for codec in ("int4", "int8", "fp8", "fp16", "none"):  # warm up kernels and allocator
    decode_message([bytes(memoryview(f)) for f in encode_message(Coded(torch.randn(4096), codec))])
baseline = peak_mib()
out = {}
for name, (frames, max_bytes) in cases.items():
    try:
        decode_message(frames, **({"max_bytes": max_bytes} if max_bytes else {}))
        out[name] = "decoded"
    except WireError as exc:
        out[name] = type(exc).__name__
    out[name + " MiB"] = peak_mib() - baseline
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_amplification_is_refused_before_any_allocation() -> None:
    done = subprocess.run([sys.executable, "-c", AMPLIFICATION_PROBE], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["int4 declaring float64"] == "WireError", out
    assert out["fp16 declaring float64"] == "WireError", out
    assert out["int4 decoding past max_bytes"] == "MessageTooLarge", out
    assert max(v for k, v in out.items() if k.endswith("MiB")) < 16, out  # peak RSS growth, MiB


# -- 2. msgpack decoded with limits ---------------------------------------------------

N = 5_000_000


def array(n: int, item: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + item * n


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x90"


HOSTILE_BODIES = {
    # The probe's flood message: 5 MB that builds 5 million lists.
    "5M empty lists": array(N, b"\x90"),
    "5M empty maps": array(N, b"\x80"),
    "5 lists of 1M empty lists": b"\x95" + array(1 << 20, b"\x90") * 5,
    "a map of 2M entries": b"\xdf" + (2 << 20).to_bytes(4, "big") + b"\x00\xc0" * (2 << 20),
    f"nested {MAX_DEPTH + 1} deep": nested(MAX_DEPTH + 1),
    "nested 1000 deep": nested(1000),
}


@pytest.mark.parametrize("body", HOSTILE_BODIES.values(), ids=HOSTILE_BODIES.keys())
def test_a_costly_body_is_refused_fast(body: bytes) -> None:
    frames = [header([], raw_body=body)]
    with cheap(), pytest.raises(WireError):
        decode_message(frames)


HOSTILE_HEADERS = {
    "5M empty lists": array(N, b"\x90"),
    "a table of nested empty lists": header([[[[]] * 32] * 32] * 32),
    "a 1M-entry params map": header([["int8", "float32", [2], {str(i): i for i in range(1 << 20)}, 2]]),
}


@pytest.mark.parametrize("head", HOSTILE_HEADERS.values(), ids=HOSTILE_HEADERS.keys())
def test_a_costly_header_is_refused_fast(head: bytes) -> None:
    with cheap(), pytest.raises(WireError, match="header"):
        decode_message([head, b"\0" * 8])


def deep(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth - 1):
        value = [value]
    return value


LEGAL_BODIES = {
    "lists and maps up to the container limit": [[i] for i in range(MAX_CONTAINERS - 1)],
    "an array of MAX_ITEMS items": list(range(MAX_ITEMS)),
    f"nesting {MAX_DEPTH} deep": deep(MAX_DEPTH),
    "a map of 100k keys": {f"layer{i}.weight": i for i in range(100_000)},
    "a program of 5000 actions": {"actions": [[f"{i % 4}F{i}", i, None] for i in range(5000)]},
}


@pytest.mark.parametrize("payload", LEGAL_BODIES.values(), ids=LEGAL_BODIES.keys())
def test_legitimate_bodies_at_the_limits_decode(payload: object) -> None:
    assert decode_message(encode_message(payload)) == payload


def test_too_many_frames_are_refused() -> None:
    frames = [header([])] + [b""] * MAX_FRAMES_PER_MESSAGE
    with pytest.raises(MessageTooLarge, match="frames"):
        decode_message(frames)


# -- 3. a message's size checked as its frames arrive ---------------------------------


@pytest.fixture
async def raw_push() -> AsyncIterator[zmq.asyncio.Socket]:
    socket = zmq.asyncio.Context.instance().socket(zmq.PUSH)
    yield socket
    socket.close(linger=0)


OVERSIZED = {
    "six frames of 512 KiB over a 1 MiB limit": [b"\0" * (512 << 10)] * 6,
    "one frame more than MAX_FRAMES_PER_MESSAGE": [b""] * (MAX_FRAMES_PER_MESSAGE + 1),
}


@pytest.mark.parametrize("frames", OVERSIZED.values(), ids=OVERSIZED.keys())
async def test_receive_refuses_a_message_over_the_limit_and_keeps_serving(
    raw_push: zmq.asyncio.Socket, frames: list[bytes]
) -> None:
    async with open_receiver("ipc://", max_message_bytes=MIB) as rx, open_sender(rx.address) as tx:
        raw_push.connect(rx.address)
        await raw_push.send_multipart(frames)
        with pytest.raises(MessageTooLarge, match="refused a message"):
            await rx.receive_frames()
        await tx.send({"ok": True})
        assert await rx.receive() == {"ok": True}
        assert rx.statistics().messages == 1  # the refused one was never delivered


@pytest.mark.parametrize("frames", OVERSIZED.values(), ids=OVERSIZED.keys())
async def test_pump_drops_a_message_over_the_limit_before_the_handler(
    raw_push: zmq.asyncio.Socket, frames: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="transport.channel")
    delivered: list[int] = []
    arrived = asyncio.Event()

    def on_frames(message: list[zmq.Frame]) -> None:
        delivered.append(len(message))
        arrived.set()

    async with open_receiver("ipc://", max_message_bytes=MIB) as rx:
        rx.pump(on_frames)
        raw_push.connect(rx.address)
        await raw_push.send_multipart(frames)
        await raw_push.send_multipart(encode_message({"ok": True}))  # same pipe: arrives after
        await asyncio.wait_for(arrived.wait(), 10)
    assert delivered == [1]
    (record,) = [r for r in caplog.records if "refused a message" in r.getMessage()]
    assert len(record.getMessage()) < 300


# -- 5. untrusted values only as short, escaped excerpts ------------------------------

HUGE = 48 << 20
HUGE_FIELDS = {
    # The probe: a 48 MiB codec name put 50 MB into the node's log.
    "codec name": lambda: [header([["x" * HUGE, "float32", [2], {}, 1]]), b"\0" * 8],
    "dtype name": lambda: [header([["none", "x" * HUGE, [2], {}, 1]]), b"\0" * 8],
    "version": lambda: [header([], version="x" * HUGE)],
    "param name": lambda: [header([["int8", "float32", [2], {"x" * HUGE: 1}, 2]]), b"\0" * 2, b"\0" * 4],
    "frame count": lambda: [header([["none", "float32", [2], {}, "x" * HUGE]]), b"\0" * 8],
}


@pytest.mark.parametrize("make", HUGE_FIELDS.values(), ids=HUGE_FIELDS.keys())
def test_errors_quote_a_huge_field_in_a_few_characters(make: object) -> None:
    frames = make()  # type: ignore[operator]
    with cheap(), pytest.raises(WireError) as info:
        decode_message(frames)
    assert len(str(info.value)) < 500


EXCERPTS = {
    "48 MiB str": ("x" * HUGE, "'xxxx"),
    "48 MiB bytes": (b"\0" * HUGE, "b'\\x00"),
    "escapes": ("\n\x1b[31mred\x00\u202e", "'\\n\\x1b[31mred\\x00\\u202e'"),
    "1M-item list": (list(range(1 << 20)), "[0, 1, 2, 3, 4, 5, ...]"),
    "1M-key dict": ({i: None for i in range(1 << 20)}, "{0: None, 1: None, 2: None, 3: None, ...}"),
    "nested 10000 deep": (deep(10_000), "[[[[...]]]]"),
    "tensor": (torch.zeros(3, 4), "tensor(float32, [3, 4])"),
    "int too long to print": (10**5000, "<int>"),
    "arbitrary object": (object(), "<object>"),
    "memoryview": (memoryview(b"abc"), "<memoryview of 3 bytes>"),
    "scalars": ([None, True, 1.5, -7], "[None, True, 1.5, -7]"),
}


@pytest.mark.parametrize("value,start", EXCERPTS.values(), ids=EXCERPTS.keys())
def test_excerpt_is_short_escaped_and_cheap(value: object, start: str) -> None:
    with cheap():
        text = excerpt(value)
    assert text.startswith(start) and len(text) <= 80 and text.isprintable()
    assert len(excerpt(value, 20)) <= 20
