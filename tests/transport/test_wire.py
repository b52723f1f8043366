"""Tests for transport/wire.py: round trips, zero-copy decode, and typed errors for bad bytes."""

from __future__ import annotations

import functools
import os

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.codecs import CodecError, decode, encode
from transport.wire import (
    DTYPES,
    Coded,
    MessageTooLarge,
    WireError,
    decode_message,
    encode_message,
)

FUZZ_EXAMPLES = 10_000 if os.environ.get("CI") else 1_000


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


@functools.cache
def _valid_frames() -> tuple[bytes, ...]:
    payload = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": [1, "x", torch.ones(3, dtype=torch.int8)]}
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
