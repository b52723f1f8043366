"""Tests for transport/wire.py: round trips, zero-copy decode, and typed errors for bad bytes."""

from __future__ import annotations

import functools
import os
import tracemalloc
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.codecs import CodecError, Encoded, decode, encode
from transport.records import record_types, register_record
from transport.wire import (
    DTYPES,
    MAX_DEPTH,
    Coded,
    MessageTooLarge,
    WireError,
    decode_message,
    encode_message,
    keep_lossy_encoded,
)

# CI runs a fixed (derandomized) set of 4,000 and every other run a fresh 1,000: over the days, the
# dev runs reach more inputs than a larger fixed set would, and CI keeps to its ten minutes.
FUZZ_EXAMPLES = 4_000 if os.environ.get("CI") else 1_000


def as_bytes(frames: list[object]) -> list[bytes]:
    """What a peer would receive: plain bytes, no memory shared with the sender."""
    return [bytes(memoryview(f)) for f in frames]  # type: ignore[arg-type]


def roundtrip(payload: object, **kwargs: object) -> object:
    return decode_message(as_bytes(encode_message(payload, **kwargs)))  # type: ignore[arg-type]


def test_nested_payload_roundtrips() -> None:
    a = torch.randn(3, 4)
    b = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    payload = {
        "name": "step",
        "n": 3,
        "ratio": 0.5,
        "flag": True,
        "none": None,
        "raw": b"\x00\x01",
        "nested": [a, {"deep": [b, 7]}],
        1: "int keys survive",
    }
    out = roundtrip(payload)
    assert isinstance(out, dict)
    assert out["name"] == "step" and out["n"] == 3 and out["flag"] is True and out[1] == "int keys survive"
    assert out["raw"] == b"\x00\x01" and out["none"] is None
    torch.testing.assert_close(out["nested"][0], a, rtol=0, atol=0)
    torch.testing.assert_close(out["nested"][1]["deep"][0], b, rtol=0, atol=0)
    assert out["nested"][1]["deep"][1] == 7


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 0, 3), (3, 4, 5)])
def test_every_dtype_and_shape_roundtrips_exactly(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = (torch.randn(shape) * 10).to(dtype)
    out = roundtrip([tensor])[0]  # type: ignore[index]
    assert out.dtype == dtype and out.shape == tensor.shape
    # Bit-for-bit, so NaNs and signed zeros count too.
    assert torch.equal(out.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_non_contiguous_tensor_roundtrips() -> None:
    tensor = torch.randn(6, 8).t()[::2]
    assert not tensor.is_contiguous()
    torch.testing.assert_close(roundtrip(tensor), tensor, rtol=0, atol=0)


def test_raw_decode_shares_memory_with_the_frame() -> None:
    frames = [bytearray(memoryview(f)) for f in encode_message({"t": torch.zeros(4)})]
    out = decode_message(frames)
    frames[1][0:4] = bytearray(torch.tensor([5.0]).numpy().tobytes())
    assert out["t"][0].item() == 5.0  # the tensor is a view of the received buffer


@pytest.mark.parametrize(("dtype", "requires_grad"),
                         [(dtype, False) for dtype in DTYPES.values()]
                         + [(dtype, True) for dtype in DTYPES.values() if dtype.is_floating_point],
                         ids=[*DTYPES, *(f"{name}-requires_grad" for name, dtype in DTYPES.items()
                                         if dtype.is_floating_point)])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5)])
def test_a_tensor_leaves_as_the_none_codec_would_send_it(
    dtype: torch.dtype, requires_grad: bool, shape: tuple[int, ...]
) -> None:
    """A contiguous CPU tensor's own bytes skip the codec's objects: the wire must not tell."""
    tensor = (torch.randn(shape) * 10).to(dtype).requires_grad_(requires_grad)
    direct = as_bytes(encode_message([tensor, 3]))
    through_codec = as_bytes(encode_message([encode(tensor.detach(), "none"), 3]))
    assert direct == through_codec


def test_a_raw_frame_off_its_alignment_decodes_from_an_aligned_copy() -> None:
    """libzmq hands a large frame 8 bytes past a 16-byte boundary: the tensor is built over a
    copy at an aligned address (kernels pick their path by alignment), never over the frame."""
    tensor = torch.randn(1000)
    header, frame = as_bytes(encode_message(tensor))
    backing = bytearray(len(frame) + 32)
    start = 8 - torch.frombuffer(backing, dtype=torch.uint8).data_ptr() % 16 + 16
    backing[start:start + len(frame)] = frame
    view = memoryview(backing)[start:start + len(frame)]
    assert torch.frombuffer(view, dtype=torch.uint8).data_ptr() % 16 == 8
    out = decode_message([header, view])
    assert out.data_ptr() % 16 == 0 and torch.equal(out, tensor)
    backing[start:start + 4] = bytes(4)
    assert torch.equal(out, tensor)  # a copy: the frame's memory is not the tensor's


@pytest.mark.parametrize("make", [
    lambda: torch.sparse_coo_tensor([[0]], [1.0], (3,)),
    lambda: torch.ones(2, 2).to_sparse_csr(),
    lambda: torch.ones(3, device="meta"),
], ids=["sparse_coo", "sparse_csr", "meta"])
@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_tensor_without_dense_data_is_refused_with_what_to_send_instead(make: Any, codec: str) -> None:
    """Before: torch's own RuntimeError or NotImplementedError from deep inside a codec."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes that sparse support is in beta
        tensor = make()
    for payload in ({"t": tensor}, {"t": Coded(tensor, codec)}):
        with pytest.raises(TypeError, match="to_dense|materialize"):
            encode_message(payload, codec=codec)


def test_raw_encode_does_not_copy_the_tensor() -> None:
    tensor = torch.randn(1024)
    frames = encode_message(tensor)
    view = memoryview(frames[1])
    assert view.nbytes == tensor.numel() * 4
    tensor[0] = 42.0
    assert torch.frombuffer(bytearray(view[:4]), dtype=torch.float32).item() == 42.0


def test_default_codec_applies_to_floating_tensors_only() -> None:
    floats, ints = torch.randn(4096), torch.arange(10)
    frames = encode_message([floats, ints], codec="int8")
    out = decode_message(as_bytes(frames))
    assert out[0].dtype == torch.float32 and not torch.equal(out[0], floats)
    assert (out[0] - floats).abs().max() <= floats.abs().max() / 127  # int8's bound, with slack
    assert torch.equal(out[1], ints)
    assert sum(memoryview(f).nbytes for f in frames[1:]) < floats.numel() * 4 * 0.3 + 80


def test_coded_marks_one_tensor() -> None:
    x, y = torch.randn(512), torch.randn(512)
    out = roundtrip({"x": Coded(x, "bf16"), "y": y})
    assert out["x"].dtype == torch.float32 and torch.equal(out["y"], y)  # type: ignore[index]
    torch.testing.assert_close(out["x"], x, rtol=2**-8, atol=0)  # type: ignore[index]


def test_pre_encoded_tensor_travels_as_is() -> None:
    x = torch.randn(1000)
    encoded = encode(x, "int8")
    out = roundtrip({"x": encoded})
    assert torch.equal(out["x"], decode(encoded))  # type: ignore[index]


@pytest.fixture
def lossy_kept_encoded() -> Any:
    keep_lossy_encoded(True)
    yield
    keep_lossy_encoded(False)


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8", "bf16", "fp16"])
def test_a_process_that_keeps_lossy_values_encoded_gets_the_frames_and_the_same_values(
        lossy_kept_encoded: None, codec: str) -> None:
    # A GPU's process (stages.worker.start): the frames cross to the device, not float32.
    x, ids = torch.randn(40, 33), torch.arange(7)
    frames = as_bytes(encode_message({"x": Coded(x, codec), "ids": ids}))
    out = decode_message(frames)
    kept = out["x"]
    assert isinstance(kept, Encoded) and kept.codec == codec and kept.shape == (40, 33)
    assert kept.nbytes == sum(len(f) for f in frames[1:]) - ids.numel() * 8  # the wire's bytes, no more
    assert torch.equal(out["ids"], ids)
    keep_lossy_encoded(False)
    assert torch.equal(decode(kept), decode_message(frames)["x"])  # decoded later: the same bits


def test_a_kept_value_is_checked_as_a_decoded_one_is(lossy_kept_encoded: None) -> None:
    frames = as_bytes(encode_message(Coded(torch.randn(300), "int8")))
    with pytest.raises(WireError, match="frame 0: 299 bytes"):
        decode_message([frames[0], frames[1][:-1], *frames[2:]])


def test_requires_grad_tensor_is_sent_detached() -> None:
    x = torch.randn(3, requires_grad=True)
    out = roundtrip(x * 2)
    assert not out.requires_grad  # type: ignore[union-attr]


def test_unsendable_object_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="cannot send an object of type object"):
        encode_message({"bad": object()})


def test_unknown_codec_on_send_is_a_codec_error() -> None:
    with pytest.raises(CodecError):
        encode_message(Coded(torch.randn(3), "zip"))


def test_message_over_the_limit_is_refused_on_both_sides() -> None:
    tensor = torch.zeros(1000)
    with pytest.raises(MessageTooLarge, match="over the limit of 1000"):
        encode_message(tensor, max_bytes=1000)
    frames = as_bytes(encode_message(tensor))
    with pytest.raises(MessageTooLarge):
        decode_message(frames, max_bytes=1000)


def _header(table: list[object], body: object = None, version: int = 1) -> bytes:
    return msgpack.packb([version, table, msgpack.packb(body)])


def _ref(index: int) -> msgpack.ExtType:
    return msgpack.ExtType(1, index.to_bytes(4, "little"))


GOOD_ROW = ["none", "float32", [2], {}, 1]
BAD_MESSAGES = {
    "no frames": ([], "empty message"),
    "not msgpack": ([b"\xc1\xc1\xc1"], "malformed header"),
    "truncated msgpack": ([b"\x93\x01"], "malformed header"),
    "header not a list": ([msgpack.packb({"a": 1})], "expected"),
    "wrong version": ([_header([], version=99)], "wire version 99"),
    "unknown dtype": ([_header([["none", "complex128", [2], {}, 1]]), b"\0" * 32], "unknown dtype"),
    "unknown codec": ([_header([["zip", "float32", [2], {}, 1]]), b"\0" * 8], "zip"),
    "negative dim": ([_header([["none", "float32", [-2], {}, 1]]), b"\0" * 8], "shape"),
    "float dim": ([_header([["none", "float32", [2.0], {}, 1]]), b"\0" * 8], "shape"),
    "shape disagrees with frame": ([_header([GOOD_ROW]), b"\0" * 12], "needs 8"),
    "huge shape": ([_header([["none", "float32", [2**40, 2**40], {}, 1]]), b"\0" * 8], "elements"),
    "missing frame": ([_header([GOOD_ROW, GOOD_ROW]), b"\0" * 8], "missing frames"),
    "extra frame": ([_header([GOOD_ROW]), b"\0" * 8, b"\0" * 8], "extra frame"),
    "bad frame count": ([_header([["none", "float32", [2], {}, 3]]), b"\0" * 8], "frames"),
    "bad codec params": ([_header([["int8", "float32", [2], {"block": -1}, 2]]), b"", b""], "tensor 0"),
    "dangling tensor ref": ([_header([], body=[_ref(3)])], "tensor reference 3"),
    "unknown ext type": ([_header([], body=msgpack.ExtType(9, b"x"))], "extension type 9"),
    "body not msgpack": ([msgpack.packb([1, [], b"\xc1"])], "malformed message body"),
    "row not a list": ([_header(["row"]), b""], "malformed table row"),
}


@pytest.mark.parametrize("frames,match", BAD_MESSAGES.values(), ids=BAD_MESSAGES.keys())
def test_malformed_input_raises_wire_error(frames: list[bytes], match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode_message(frames)


PLAIN_PAYLOADS = {
    "empty map": {},
    "a call": {"t": "req", "id": 7, "to": "echo", "m": "echo", "a": [1, 2.5, None], "k": {"x": b"y"}, "r": "ipc://x"},
    "bin 16 body": {"blob": b"\xff" * 300},
    "a long nested body (counted)": [[[[["leaf" * 20]]]]],
    "over the one-pass size": ["é" * 20_000, list(range(3000))],
}


@pytest.mark.parametrize("payload", PLAIN_PAYLOADS.values(), ids=PLAIN_PAYLOADS.keys())
def test_a_message_of_plain_values_is_the_general_form_read_in_one_pass(payload: object) -> None:
    frames = encode_message(payload)
    assert frames == [msgpack.packb([1, [], msgpack.packb(payload, use_bin_type=True)], use_bin_type=True)]
    assert decode_message(as_bytes(frames)) == payload
    assert decode_message([bytearray(frames[0])]) == payload


def test_plain_messages_encode_on_many_threads_at_once() -> None:
    payloads = [{"n": n, "s": "x" * (n % 50), "big": b"z" * (20_000 if n % 7 == 0 else 1)} for n in range(400)]
    with ThreadPoolExecutor(4) as pool:
        decoded = list(pool.map(lambda p: decode_message(as_bytes(encode_message(p))), payloads))
    assert decoded == payloads


def test_the_encoder_holds_no_frame_once_the_message_is_gone() -> None:
    frames = encode_message({"x": torch.ones(1000), "p": Point(x=1, weights=torch.zeros(3))})
    assert decode_message(as_bytes(frames))["x"].sum().item() == 1000
    gone = [weakref.ref(frame) for frame in frames[1:]]  # views of the sender's tensors
    del frames
    assert [ref() for ref in gone] == [None, None]


def test_a_large_message_leaves_its_thread_no_large_buffer() -> None:
    # Run on a thread of its own: what that thread's encoder keeps is all it allocated.
    def encode_and_measure() -> tuple[int, int]:
        tracemalloc.start()
        try:
            frames = encode_message({"blob": b"x" * (48 << 20)})
            size = len(frames[0])
            del frames
            return size, tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()

    with ThreadPoolExecutor(1) as pool:
        size, kept = pool.submit(encode_and_measure).result()
    assert size > 48 << 20
    assert kept < 4 << 20, kept


def test_a_message_that_cannot_be_encoded_leaves_the_next_one_whole() -> None:
    with pytest.raises(TypeError, match="cannot send an object of type object"):
        encode_message([torch.ones(3), "x" * 100_000, object()])
    frames = encode_message([torch.zeros(2), "y"])
    assert len(frames) == 2
    out = decode_message(as_bytes(frames))
    assert torch.equal(out[0], torch.zeros(2)) and out[1] == "y"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sealed:
    """A record whose fields are a message of their own, encoded while the outer one is."""

    inner: object

    def wire_fields(self) -> dict[str, object]:
        return {"frames": [bytes(memoryview(f)) for f in encode_message([self.inner, torch.arange(3)])]}


register_record(Sealed, "test.Sealed", fields=Sealed.wire_fields)


def test_a_message_encoded_while_another_is_encoding_leaves_both_whole() -> None:
    frames = encode_message([torch.full((2,), 7.0), Sealed(inner={"k": torch.ones(4)})])
    header = msgpack.unpackb(frames[0])
    assert len(header[1]) == 1 and len(frames) == 2  # the outer message's one tensor; the inner one's are bytes
    body = msgpack.unpackb(header[2], ext_hook=lambda code, data: code)
    inner = decode_message(body[1][1]["frames"])
    assert torch.equal(inner[0]["k"], torch.ones(4)) and torch.equal(inner[1], torch.arange(3))


@functools.cache
def _valid_frames() -> tuple[bytes, ...]:
    payload = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": [1, "x", torch.ones(3, dtype=torch.int8)],
               "r": Point(x=1, label="a", weights=[Point(x=2, weights=torch.zeros(2))])}
    return tuple(as_bytes(encode_message(payload)) + as_bytes(encode_message(Coded(torch.randn(300), "int4")))[1:])


def _mutate(frames: list[bytes], data: st.DataObject) -> list[bytes]:
    frames = list(frames)
    action = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop", "duplicate", "swap"]))
    index = data.draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[index])
    if action == "flip" and frame:
        pos = data.draw(st.integers(0, len(frame) - 1))
        frame[pos] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        frame = frame[: data.draw(st.integers(0, len(frame)))]
    elif action == "extend":
        frame += data.draw(st.binary(min_size=1, max_size=16))
    elif action == "drop":
        del frames[index]
        return frames
    elif action == "duplicate":
        frames.insert(index, frames[index])
        return frames
    elif action == "swap" and len(frames) > 1:
        other = data.draw(st.integers(0, len(frames) - 1))
        frames[index], frames[other] = frames[other], frames[index]
        return frames
    frames[index] = bytes(frame)
    return frames


@settings(max_examples=FUZZ_EXAMPLES)
@given(st.data())
def test_fuzz_mutated_messages_raise_only_wire_error(data: st.DataObject) -> None:
    frames = list(_valid_frames())
    for _ in range(data.draw(st.integers(1, 3))):
        frames = _mutate(frames, data) or [b""]
    try:
        decode_message(frames)
    except WireError:
        pass


@settings(max_examples=FUZZ_EXAMPLES // 4)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_fuzz_random_frames_raise_only_wire_error(frames: list[bytes]) -> None:
    try:
        decode_message(frames)
    except WireError:
        pass


tensors = st.builds(
    lambda shape, dtype: (torch.randn(shape) * 100).to(dtype),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.float16, torch.int64, torch.bool, torch.uint8]),
)
payloads = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8) | tensors,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@settings(max_examples=300)
@given(payloads)
def test_any_payload_roundtrips(payload: object) -> None:
    assert _same(roundtrip(payload), payload)


# -- records -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Point:
    """A record as the wire sees one (actors.records.WireRecord is the real kind): strict on the way in."""

    x: int
    label: str = ""
    weights: object = None  # a tensor, a Point, a list of Points: whatever the test puts there

    def wire_fields(self) -> dict[str, object]:
        return {"x": self.x, "label": self.label, "weights": self.weights}

    @classmethod
    def from_wire(cls, data: object) -> Point:
        assert isinstance(data, dict)
        if set(data) - {"x", "label", "weights"}:
            raise ValueError(f"unknown key(s) {sorted(set(data) - {'x', 'label', 'weights'})}")
        if "x" not in data:
            raise ValueError("missing key x")
        return cls(**data)


register_record(Point, "test.Point")


def _record(name: str, fields: object) -> list[object]:
    """A record as a sender would put it in a message body: [ext(name), fields]."""
    return [msgpack.ExtType(2, name.encode()), fields]


def test_a_record_travels_as_its_class() -> None:
    out = roundtrip({"p": Point(x=3, label="a")})
    assert out == {"p": Point(x=3, label="a")}


def test_nested_records_and_lists_of_records_travel() -> None:
    inner = [Point(x=1), Point(x=2, label="b")]
    out = roundtrip([Point(x=0, weights=Point(x=9, weights=inner)), inner])
    assert out == [Point(x=0, weights=Point(x=9, weights=inner)), inner]


def test_tensors_in_a_record_travel_as_raw_frames() -> None:
    weights = torch.arange(1000, dtype=torch.float32)
    frames = encode_message(Point(x=1, weights=weights))
    assert len(frames) == 2  # the header and the tensor's own frame: not packed into the body
    assert len(frames[0]) < 200
    out = decode_message(as_bytes(frames))
    assert isinstance(out, Point) and torch.equal(out.weights, weights)  # type: ignore[arg-type]


def test_an_unregistered_class_is_refused_at_the_sender() -> None:
    @dataclass(frozen=True)
    class Unregistered:
        x: int

    with pytest.raises(TypeError, match="registered records"):
        encode_message(Unregistered(x=1))


def test_a_name_cannot_be_taken_twice() -> None:
    @dataclass(frozen=True)
    class Other(Point):
        pass

    with pytest.raises(ValueError, match="taken by"):
        register_record(Other, "test.Point")
    assert record_types()["test.Point"] is Point
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        register_record(Other, "x" * 65)


BAD_RECORDS = {
    "unregistered name": (_record("test.Nothing", {"x": 1}), "unknown record type 'test.Nothing'"),
    "unknown key": (_record("test.Point", {"x": 1, "y": 2}), r"record test.Point: ValueError: unknown key\(s\) \['y'\]"),
    "missing key": (_record("test.Point", {"label": "a"}), "missing key x"),
    "bad nested record": (_record("test.Point", {"x": 1, "weights": _record("test.Point", {})}), "missing key x"),
}


@pytest.mark.parametrize("body,match", BAD_RECORDS.values(), ids=BAD_RECORDS.keys())
def test_a_record_that_does_not_rebuild_is_a_wire_error(body: object, match: str) -> None:
    frames = [_header([], body=body)]
    with pytest.raises(WireError, match=match) as excinfo:
        decode_message(frames)
    # Reported instead, the rest of the message decodes (the bad record as None): a
    # receiver can answer who sent it.
    bad: list[WireError] = []
    decoded = decode_message([_header([], body={"id": 7, "a": [body]})], bad_records=bad)
    assert decoded["id"] == 7 and decoded["a"] in ([None], [Point(x=1)])
    assert len(bad) == 1 and isinstance(bad[0], WireError) and bad[0].args == excinfo.value.args


MALFORMED_RECORDS = {
    "tag alone": (msgpack.ExtType(2, b"test.Point"), "outside a"),
    "tag second": ([1, msgpack.ExtType(2, b"test.Point")], "outside a"),
    "tag as a map value": ({"a": msgpack.ExtType(2, b"test.Point")}, "outside a"),
    "fields not a map": (_record("test.Point", [1]), r"must be \[name, fields map\]"),
    "three items": ([msgpack.ExtType(2, b"test.Point"), {"x": 1}, 3], r"must be \[name, fields map\]"),
    "name not utf-8": ([msgpack.ExtType(2, b"\xff\xfe"), {}], "not UTF-8"),
    "name too long": ([msgpack.ExtType(2, b"n" * 65), {}], "malformed message body"),
}


@pytest.mark.parametrize("body,match", MALFORMED_RECORDS.values(), ids=MALFORMED_RECORDS.keys())
def test_a_malformed_record_is_a_wire_error_even_when_reported(body: object, match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode_message([_header([], body=body)], bad_records=[])


def test_nothing_from_the_wire_is_called_but_a_registered_from_wire() -> None:
    # A name that looks like an import path names no class: nothing is imported or called.
    with pytest.raises(WireError, match="unknown record type"):
        decode_message([_header([], body=_record("os:system", {"command": "true"}))])


def test_records_count_toward_the_depth_limit() -> None:
    deep: object = Point(x=0)
    for _ in range(MAX_DEPTH):
        deep = Point(x=0, weights=[deep])
    with pytest.raises(WireError, match="nests"):
        roundtrip(deep)
    shallow: object = Point(x=0)
    for _ in range(MAX_DEPTH // 3):
        shallow = Point(x=0, weights=[shallow])
    assert roundtrip(shallow) == shallow


points = st.recursive(
    st.builds(Point, x=st.integers(-(2**31), 2**31), label=st.text(max_size=6)),
    lambda children: st.builds(Point, x=st.integers(0, 9), weights=children | st.lists(children, max_size=3)),
    max_leaves=6,
)


@settings(max_examples=200)
@given(points)
def test_any_record_tree_roundtrips(point: Point) -> None:
    assert roundtrip(point) == point
