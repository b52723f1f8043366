"""Tests for transport/codecs.py.

Run: .venv/bin/python -m pytest -q tests/transport/test_codecs.py
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from contextlib import AbstractContextManager
from typing import Any
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays
from torch.overrides import TorchFunctionMode

from transport import _native, codecs
from transport.codecs import (
    CODEC_NAMES, CodecError, Encoded, ErrorFeedback, aligned_empty, decode, encode, get_codec,
)

pytestmark = [
    pytest.mark.timeout(60),
    # pytest resets warning filters after collection, dropping the module's own filter
    # for torch's once-per-process warning; test_quantize_deprecation_warning_is_silenced
    # checks that filter in a fresh process instead.
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor, torch.quantize_per_channel"),
]

LOSSY = ("fp16", "bf16", "int8", "fp8", "int4")
BLOCK_CODECS = ("int8", "fp8", "int4")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
RAW_DTYPES = FLOAT_DTYPES + (
    torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, torch.complex128, torch.int8,
    torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.uint16, torch.uint32,
    torch.uint64,
)
SHAPES = [(), (0,), (0, 5), (1,), (7,), (3, 5), (2, 3, 4), (513,), (4, 256)]
QMAX = {"int8": 127, "int4": 7, "fp8": 448}
TINY = 2.0**-126  # smallest normal float32: the floor of every block scale


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)  # every unseeded torch.randn below is reproducible


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block absmax, flattened, in float64."""
    flat = x.detach().reshape(-1).double().abs()
    num_blocks = -(-flat.numel() // block)
    padded = torch.nn.functional.pad(flat, (0, num_blocks * block - flat.numel()))
    return padded.view(num_blocks, block).amax(1).repeat_interleave(block)[: flat.numel()]


def error_bound(codec: str, x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Per-element bound on |decode(encode(x)) - x| for float32 or float64 input."""
    ax = x.detach().reshape(-1).double().abs()
    if codec == "fp16":  # 10 mantissa bits: half an ulp is 2**-11 relative; subnormal ulp 2**-24
        return ax * 2**-11 + 2**-25
    if codec == "bf16":  # 7 mantissa bits: 2**-8 relative; subnormal ulp 2**-133
        return ax * 2**-8 + 2**-134
    absmax = block_absmax(x, block)
    scale = (absmax / QMAX[codec]).clamp_min(TINY)
    # x * (1 / scale) and q * scale are float32 products: a few float32 ulps of absmax.
    slop = absmax * 2**-20
    if codec == "fp8":
        # e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 of the scaled value when it is
        # normal (>= 2**-6); below that the spacing is 2**-9, so at most 2**-10 * scale.
        return ax * 2**-4 + scale * 2**-10 + slop
    # round(x / scale) is off by at most 1/2: absmax / 254 for int8, absmax / 14 for int4.
    return scale / 2 + slop


def check_frames(encoded: Encoded) -> None:
    for frame in encoded.frames:
        assert frame.dtype == torch.uint8 and frame.dim() == 1
        assert frame.is_contiguous() and frame.device.type == "cpu"
    sizes = get_codec(encoded.codec).frame_sizes(encoded.dtype, encoded.shape, encoded.params)
    assert sizes == tuple(frame.numel() for frame in encoded.frames)
    assert encoded.nbytes == sum(sizes)


def make_codec(name: str, block: int) -> codecs.Codec:
    codec = get_codec(name)
    return type(codec)(block=block) if name in BLOCK_CODECS else codec  # type: ignore[call-arg]


# --- round trips ---------------------------------------------------------------------


ROUNDTRIP_CASES = [("none", d, s) for d in RAW_DTYPES for s in SHAPES] + [
    (c, d, s) for c in LOSSY for d in FLOAT_DTYPES for s in SHAPES
]


@pytest.mark.parametrize("codec,dtype,shape", ROUNDTRIP_CASES)
def test_roundtrip_keeps_shape_and_dtype(
    codec: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    x = random_tensor(shape, dtype)
    encoded = encode(x, codec)
    check_frames(encoded)
    assert (encoded.codec, encoded.dtype, encoded.shape) == (codec, dtype, shape)
    y = decode(encoded)
    assert y.dtype == dtype and y.shape == x.shape and y.device.type == "cpu"
    if codec == "none":
        assert torch.equal(y.reshape(-1).view(torch.uint8), x.reshape(-1).view(torch.uint8))
    elif x.numel():
        # Decoding rounds once more into a 16-bit input dtype.
        u_out = {torch.float16: 2**-11, torch.bfloat16: 2**-8}.get(dtype, 0.0)
        bound = error_bound(codec, x.float()) * (1 + u_out) + x.double().abs().reshape(-1) * u_out
        assert ((y.double() - x.double()).reshape(-1).abs() <= bound + 2**-24).all()


NON_CONTIGUOUS = {
    "transposed": lambda: torch.randn(40, 30).t(),
    "step_slice": lambda: torch.randn(50, 60)[::3, 1::2],
    "expanded": lambda: torch.randn(7, 1).expand(7, 300),
    "permuted_3d": lambda: torch.randn(4, 5, 6).permute(2, 0, 1),
}


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("layout", NON_CONTIGUOUS)
def test_non_contiguous_encodes_like_its_contiguous_copy(codec: str, layout: str) -> None:
    x = NON_CONTIGUOUS[layout]()
    assert not x.is_contiguous()
    y = decode(encode(x, codec))
    assert y.shape == x.shape
    assert torch.equal(y, decode(encode(x.contiguous(), codec)))


def test_none_is_zero_copy_both_ways() -> None:
    x = torch.randn(64, 8)
    encoded = encode(x)
    assert encoded.frames[0].data_ptr() == x.data_ptr()
    y = decode(encoded)
    assert y.data_ptr() == encoded.frames[0].data_ptr()
    assert torch.equal(y, x)


def test_none_is_bit_exact_for_nan_payloads_and_negative_zero() -> None:
    x = torch.tensor([0x7FC00001, 0xFFFFFFFF, 0x80000000, 0x7F800000], dtype=torch.int64)
    x = x.to(torch.int32).view(torch.float32)
    assert torch.equal(decode(encode(x)).view(torch.int32), x.view(torch.int32))


def test_frame_at_misaligned_offset_is_copied_then_decoded() -> None:
    # A receive buffer may hold a frame at any offset; a dtype view needs alignment.
    x = torch.randn(10)
    for codec in ("none", "int8"):
        encoded = encode(x, codec)
        pad = torch.zeros(1, dtype=torch.uint8)
        frames = tuple(torch.cat([pad, f])[1:] for f in encoded.frames)
        assert all(f.storage_offset() == 1 for f in frames)
        y = decode(replace(encoded, frames=frames))
        assert torch.equal(y, decode(encoded))


@pytest.mark.parametrize("numel", [1000, (1 << 20) + 8])  # below and past the size numpy allocates from
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex128])
def test_a_misaligned_frame_of_any_size_is_copied_to_a_64_byte_boundary(numel: int, dtype: torch.dtype) -> None:
    x = torch.randn(numel, dtype=dtype)
    encoded = encode(x, "none")
    shifted = torch.cat([torch.zeros(8, dtype=torch.uint8), encoded.frames[0]])[8:]  # 8 bytes off, as libzmq's
    assert shifted.data_ptr() % 16 == 8
    y = decode(replace(encoded, frames=(shifted,)))
    assert y.data_ptr() % 64 == 0 and y.is_contiguous() and torch.equal(y, x)
    for nbytes in (0, 1, 100, 1 << 20, (1 << 20) + 3):
        buffer = aligned_empty(nbytes)
        assert buffer.numel() == nbytes and buffer.dtype == torch.uint8 and buffer.data_ptr() % 64 == 0


def test_codec_names() -> None:
    assert CODEC_NAMES == ("none", "fp16", "bf16", "int8", "fp8", "int4")
    assert all(get_codec(name).name == name for name in CODEC_NAMES)
    assert [get_codec(name).lossy for name in CODEC_NAMES] == [False] + [True] * 5


# --- error bounds and sizes ----------------------------------------------------------


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_error_within_derived_bound_on_normal_data(codec: str, dtype: torch.dtype) -> None:
    x = random_tensor((16 * 256 + 37,), dtype, seed=1) * 3  # a partial last block too
    err = (decode(encode(x, codec)).double() - x.double()).abs()
    bound = error_bound(codec, x)
    assert (err <= bound).all(), (err - bound).max()
    assert err.max() > bound.max() / 64  # the bound is not vacuous either


@pytest.mark.parametrize(
    "codec,block", [(c, b) for c in BLOCK_CODECS for b in (2, 64, 1000)] + [("int8", 1), ("fp8", 1)]
)
def test_custom_block_round_trips_through_module_decode(codec: str, block: int) -> None:
    x = torch.randn(3, 333)
    encoded = make_codec(codec, block).encode(x)
    assert encoded.params == {"block": block}
    check_frames(encoded)
    y = decode(encoded)  # the default codec instance decodes with the frames' block
    assert ((y - x).abs().reshape(-1) <= error_bound(codec, x, block)).all()


# (codec, numel) -> frame byte counts with the default block of 256.
SIZES = [
    ("none", 1000, (4000,)), ("fp16", 1000, (2000,)), ("bf16", 1000, (2000,)),
    ("int8", 1000, (1000, 16)), ("fp8", 1000, (1000, 16)), ("int4", 1000, (500, 16)),
    ("int4", 1001, (501, 16)), ("int8", 256, (256, 4)), ("int4", 1, (1, 4)), ("int8", 0, (0, 0)),
]


@pytest.mark.parametrize("codec,numel,sizes", SIZES)
def test_encoded_sizes_are_pinned(codec: str, numel: int, sizes: tuple[int, ...]) -> None:
    encoded = encode(torch.randn(numel), codec)
    assert tuple(f.numel() for f in encoded.frames) == sizes
    assert get_codec(codec).frame_sizes(torch.float32, (numel,), encoded.params) == sizes


@pytest.mark.parametrize(
    "codec,ratio,limit",
    [
        ("int8", (1 + 4 / 256) / 4, 0.27),
        ("fp8", (1 + 4 / 256) / 4, 0.27),
        ("int4", (0.5 + 4 / 256) / 4, 0.15),
    ],
)
def test_size_ratio_at_one_million_elements(codec: str, ratio: float, limit: float) -> None:
    x = torch.randn(1 << 20)
    actual = encode(x, codec).nbytes / (x.numel() * 4)
    assert actual == ratio and actual <= limit


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("shape", [(300,), (2, 256), (1,)])
def test_all_zero_input_decodes_to_exact_zero(codec: str, shape: tuple[int, ...]) -> None:
    encoded = encode(torch.zeros(shape), codec)
    assert all(torch.isfinite(f.view(torch.float32)).all() for f in encoded.frames[1:])
    assert torch.equal(decode(encoded), torch.zeros(shape))


@pytest.mark.parametrize("codec", BLOCK_CODECS)
@pytest.mark.parametrize("value", [1e-40, -3e-39, torch.finfo(torch.float32).max])
def test_extreme_blocks_stay_finite_and_bounded(codec: str, value: float) -> None:
    x = torch.cat([torch.full((256,), value), torch.randn(256)])
    y = decode(encode(x, codec))
    assert torch.isfinite(y).all()
    assert ((y.double() - x.double()).abs() <= error_bound(codec, x)).all()


@pytest.mark.parametrize("codec", LOSSY)
def test_nan_and_inf_do_not_raise_or_leak_into_other_blocks(codec: str) -> None:
    x = torch.randn(4 * 256)
    x[3], x[300], x[600] = float("nan"), float("inf"), -float("inf")
    y = decode(encode(x, codec))
    assert y.shape == x.shape
    clean = slice(768, 1024)  # the fourth block holds only finite values
    assert ((y[clean] - x[clean]).abs().double() <= error_bound(codec, x)[clean]).all()


def test_fp16_saturates_instead_of_overflowing_and_leaves_fp16_input_alone() -> None:
    x = torch.tensor([1e5, -1e9, float("inf"), float("nan"), 1.0])
    assert torch.equal(decode(encode(x, "fp16"))[:3], torch.tensor([65504.0, -65504.0, 65504.0]))
    assert decode(encode(x, "fp16"))[3].isnan()
    h = torch.tensor([float("inf"), 2.0], dtype=torch.float16)
    assert torch.equal(decode(encode(h, "fp16")), h.clone())
    assert h[0].isinf()  # the caller's tensor is not clamped in place


@pytest.mark.parametrize("qmax", (127, 7))
def test_fast_rounding_matches_elementwise_reference(qmax: int) -> None:
    # The torch path on CPU rounds with fbgemm's quantize; other devices use the
    # elementwise version. Both round half to even, exactly: with no zero point in
    # fbgemm, values within an ulp of a tie round the same in every torch version.
    scaled = torch.randn(256, 256) * qmax / 3
    scaled[0, :7] = torch.tensor([0.5, 1.5, -0.5, -2.5, qmax, -qmax, -2.500000238418579])
    scaled = scaled.clamp(-qmax, qmax).reshape(-1)
    fast = codecs._round_to_int8(scaled.clone(), qmax)
    assert fast[:7].tolist() == [0, 2, 0, -2, qmax, -qmax, -3]
    assert torch.equal(fast, codecs._round_to_int8_elementwise(scaled.clone(), qmax))


def test_int4_rounds_before_adding_its_offset() -> None:
    # absmax 7 gives a scale of 1; -2.5 - 1 ulp + 8 would round to 5.5, then to 6 (-2).
    x = torch.tensor([7.0, -2.500000238418579, 2.5, -3.5])
    expected = torch.tensor([7.0, -3.0, 2.0, -4.0])
    assert torch.equal(decode(encode(x, "int4")), expected)
    with torch_path():
        assert torch.equal(decode(encode(x, "int4")), expected)


# --- validation ----------------------------------------------------------------------


BAD_PARAMS = [
    {"block": 0}, {"block": -256}, {"block": 2**21}, {"block": 2.0}, {"block": "256"},
    {"block": True}, {"block": None}, {}, {"block": 256, "extra": 1}, {"blocks": 256},
]


@pytest.mark.parametrize("codec", BLOCK_CODECS)
@pytest.mark.parametrize("params", BAD_PARAMS, ids=repr)
def test_frame_sizes_rejects_bad_params(codec: str, params: dict[str, object]) -> None:
    with pytest.raises(CodecError):
        get_codec(codec).frame_sizes(torch.float32, (10,), params)


@pytest.mark.parametrize(
    "codec,dtype,shape,params",
    [
        ("int4", torch.float32, (10,), {"block": 255}),
        ("none", torch.float32, (10,), {"block": 256}),
        ("fp16", torch.float32, (10,), {"x": 1}),
        ("int8", torch.int32, (10,), {"block": 256}),
        ("fp16", torch.int64, (10,), {}),
        ("none", "float32", (10,), {}),
        ("none", torch.qint8, (10,), {}),
        ("int8", torch.float32, (-1,), {"block": 256}),
        ("int8", torch.float32, (2.0,), {"block": 256}),
        ("int8", torch.float32, (True,), {"block": 256}),
        ("int8", torch.float32, "10", {"block": 256}),
        ("none", torch.float32, (2**30, 2**30), {}),
        ("none", torch.float32, (1,) * 65, {}),
    ],
)
def test_frame_sizes_rejects_bad_dtype_shape_or_params(
    codec: str, dtype: object, shape: object, params: dict[str, object]
) -> None:
    with pytest.raises(CodecError):
        get_codec(codec).frame_sizes(dtype, shape, params)  # type: ignore[arg-type]


def test_frame_sizes_allocates_nothing_for_huge_shapes() -> None:
    # 2**48 elements would be a petabyte; frame_sizes must only do arithmetic.
    sizes = get_codec("int4").frame_sizes(torch.float32, (2**24, 2**24), {"block": 256})
    assert sizes == (2**47, 4 * 2**40)


def good_int8() -> Encoded:
    return encode(torch.randn(300), "int8")


def replace(encoded: Encoded, **changes: object) -> Encoded:
    fields = dict(codec=encoded.codec, dtype=encoded.dtype, shape=encoded.shape,
                  params=encoded.params, frames=encoded.frames)
    fields.update(changes)
    return Encoded(**fields)  # type: ignore[arg-type]


BAD_ENCODED = {
    "unknown_codec": lambda e: replace(e, codec="zstd"),
    "too_few_frames": lambda e: replace(e, frames=e.frames[:1]),
    "too_many_frames": lambda e: replace(e, frames=e.frames + e.frames[:1]),
    "short_frame": lambda e: replace(e, frames=(e.frames[0][:-1], e.frames[1])),
    "int8_frame": lambda e: replace(e, frames=(e.frames[0].view(torch.int8), e.frames[1])),
    "2d_frame": lambda e: replace(e, frames=(e.frames[0].view(1, -1), e.frames[1])),
    "strided_frame": lambda e: replace(e, frames=(e.frames[0].repeat(2)[::2], e.frames[1])),
    "not_a_tensor": lambda e: replace(e, frames=(bytes(300), e.frames[1])),
    "wrong_shape": lambda e: replace(e, shape=(301,)),
    "wrong_block": lambda e: replace(e, params={"block": 128}),
    "int_dtype": lambda e: replace(e, dtype=torch.int32),
    "frames_on_two_devices": lambda e: replace(e, frames=(e.frames[0], e.frames[1].to("meta"))),
}


@pytest.mark.parametrize("case", BAD_ENCODED)
def test_decode_rejects_frames_that_do_not_fit(case: str) -> None:
    with pytest.raises(CodecError):
        decode(BAD_ENCODED[case](good_int8()))


def test_codec_decode_rejects_another_codecs_frames() -> None:
    with pytest.raises(CodecError, match="int8"):
        get_codec("fp8").decode(good_int8())


@pytest.mark.parametrize("name", ["zstd", "", "INT8", 8])
def test_unknown_codec_name_lists_known_ones(name: object) -> None:
    with pytest.raises(CodecError, match="known codecs: none, fp16, bf16, int8, fp8, int4"):
        get_codec(name)  # type: ignore[arg-type]
    with pytest.raises(CodecError):
        encode(torch.ones(3), name)  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool, torch.complex64])
def test_lossy_codec_on_non_float_tensor_points_to_none(codec: str, dtype: torch.dtype) -> None:
    with pytest.raises(CodecError, match="'none'"):
        encode(torch.ones(4, dtype=dtype), codec)


@pytest.mark.parametrize("block", [0, -2, 2**21, 3.0, True])
def test_codec_constructor_rejects_bad_block(block: object) -> None:
    with pytest.raises(CodecError):
        codecs.Int8Codec(block=block)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="even"):
        codecs.Int4Codec(block=255)


def test_requires_grad_tensor_encodes_without_autograd() -> None:
    x = torch.randn(10, requires_grad=True)
    for codec in CODEC_NAMES:
        assert not decode(encode(x * 2, codec)).requires_grad


@pytest.mark.multiprocess
def test_quantize_deprecation_warning_is_silenced() -> None:
    # torch warns once per process, so check in a fresh one with warnings as errors.
    code = "import torch, transport.codecs as c; c.decode(c.encode(torch.randn(300), 'int4'))"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=root,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- error feedback ------------------------------------------------------------------


def cumulative_error(feedback: ErrorFeedback | None, x: torch.Tensor, steps: int) -> float:
    decoded_sum = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(steps):
        encoded = feedback.encode(x, "s") if feedback else encode(x, "int4")
        decoded_sum += decode(encoded).double()
    return float((decoded_sum - steps * x.double()).abs().max())


def test_error_feedback_tracks_the_cumulative_sum() -> None:
    # Without feedback the same rounding error repeats every step and grows linearly.
    # With it, sum(decoded) = sum(inputs) - last residual (the residuals telescope), and
    # a residual is one rounding error of a corrected input: about absmax / 14.
    x = torch.randn(1024, generator=torch.Generator().manual_seed(3)) * 0.01
    plain = cumulative_error(None, x, 50)
    with_feedback = cumulative_error(ErrorFeedback("int4"), x, 50)
    quantum = float(block_absmax(x, 256).max()) / 7
    assert with_feedback <= quantum
    assert plain >= 10 * with_feedback


def test_error_feedback_streams_are_isolated_and_reset() -> None:
    a, b = torch.randn(512) * 0.1, torch.randn(512) * 0.1
    shared, alone = ErrorFeedback("int8"), ErrorFeedback(get_codec("int8"))
    for _ in range(3):
        shared.encode(b, "b")
        assert torch.equal(decode(shared.encode(a, "a")), decode(alone.encode(a, "a")))
    shared.reset("a")
    assert torch.equal(decode(shared.encode(a, "a")), decode(encode(a, "int8")))
    assert not torch.equal(decode(shared.encode(b, "b")), decode(encode(b, "int8")))
    shared.reset()
    assert torch.equal(decode(shared.encode(b, "b")), decode(encode(b, "int8")))


@pytest.mark.parametrize(
    "second",
    [torch.randn(2, 256) * 0.1, (torch.randn(256) * 0.1).double(), torch.randn(256).bfloat16()],
)
def test_error_feedback_discards_a_residual_that_does_not_fit(second: torch.Tensor) -> None:
    feedback = ErrorFeedback("int4")
    feedback.encode(torch.randn(256) * 0.1, "s")
    encoded = feedback.encode(second, "s")
    assert encoded.dtype == second.dtype
    assert torch.equal(decode(encoded), decode(encode(second, "int4")))


def test_error_feedback_recovers_from_non_finite_input() -> None:
    feedback = ErrorFeedback("int8")
    x = torch.randn(256)
    feedback.encode(torch.full((256,), float("nan")), "s")
    y = decode(feedback.encode(x, "s"))
    assert ((y - x).abs().double() <= error_bound("int8", x)).all()


def test_error_feedback_keeps_the_residual_when_encode_fails() -> None:
    feedback, alone = ErrorFeedback("int4"), ErrorFeedback("int4")
    x = torch.randn(256) * 0.1
    feedback.encode(x, "s")
    alone.encode(x, "s")
    with pytest.raises(CodecError):
        feedback.encode(torch.ones(256, dtype=torch.int32), "s")
    assert torch.equal(decode(feedback.encode(x, "s")), decode(alone.encode(x, "s")))


def test_error_feedback_with_lossless_codec_just_encodes() -> None:
    feedback = ErrorFeedback("none")
    x = torch.arange(10)
    assert torch.equal(decode(feedback.encode(x, 0)), x)
    with pytest.raises(CodecError):
        ErrorFeedback("int8").encode(x, 0)
    with pytest.raises(CodecError):
        ErrorFeedback("gzip")


# --- C kernels (transport/_native) ----------------------------------------------------


NATIVE_CODECS = ("int8", "int4", "fp8")
NATIVE_BLOCKS = {"int8": (1, 7, 256), "int4": (2, 6, 256), "fp8": (1, 7, 256)}
HAS_COMPILER = bool(os.environ.get("CC")) or any(shutil.which(c) for c in ("cc", "gcc", "clang"))
requires_native = pytest.mark.skipif(
    _native.blockquant() is None, reason="no C kernels: int8, int4 and fp8 run their torch path"
)


def torch_path() -> AbstractContextManager[object]:
    """A context in which the codecs find no C kernels and take their torch path."""
    return mock.patch.object(_native, "blockquant", lambda: None)


class CastSpy(TorchFunctionMode):
    """Keeps every tensor cast to float8_e4m3fn."""

    def __init__(self) -> None:
        super().__init__()
        self.cast: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to and torch.float8_e4m3fn in (*args[1:], *kwargs.values()):
            self.cast.append(args[0].detach().clone())
        return func(*args, **kwargs)


def test_fp8s_torch_path_saturates_before_the_cast_whatever_torchs_cast_does() -> None:
    # torch 2.11's cast turned an infinity (or anything past 448) into NaN where 2.13's and
    # the C kernel saturate: on a GPU machine with torch 2.11 the two paths' frames differed.
    x = with_specials(4 * 256 + 3)
    with torch_path(), CastSpy() as spy:
        encoded = get_codec("fp8").encode(x)
    (given,) = spy.cast
    assert bool(((given.abs() <= 448) | given.isnan()).all())
    infinite_only = slice(256, 768)  # blocks 1 and 2 hold an infinity and no NaN (a NaN's block is NaN)
    values = encoded.frames[0][infinite_only]
    assert bool(((values & 0x7F) != 0x7F).all())  # an infinity saturates: no NaN byte in its block
    assert sorted(values[x[infinite_only].isinf()].tolist()) == [0x7E, 0xFE]  # +448 and -448


def assert_same_encoding(native: Encoded, reference: Encoded) -> None:
    """Frames equal byte for byte, except the values of blocks whose scale is NaN.

    Such blocks decode to NaN whatever their values, and torch's NaN payloads and
    NaN rounding vary with shapes and CPUs, so only NaN-ness is compared there.
    """
    (values, scales), (ref_values, ref_scales) = native.frames, reference.frames
    nan = scales.view(torch.float32).isnan()
    assert torch.equal(nan, ref_scales.view(torch.float32).isnan())
    assert torch.equal(scales.view(torch.int32)[~nan], ref_scales.view(torch.int32)[~nan])
    block = int(native.params["block"])
    bytes_per_block = block // 2 if native.codec == "int4" else block
    keep = (~nan).repeat_interleave(bytes_per_block)[: values.numel()]
    assert torch.equal(values[keep], ref_values[keep])


def assert_same_decoding(encoded: Encoded) -> None:
    """Both native decodes, cached and streaming stores, equal the torch path's."""
    with torch_path():
        reference = decode(encoded)
    for stream_min_bytes in (0, 1 << 62):
        with mock.patch.object(_native, "STREAM_MIN_BYTES", stream_min_bytes):
            native = decode(encoded)
        torch.testing.assert_close(native, reference, rtol=0, atol=0, equal_nan=True)


def with_specials(n: int) -> torch.Tensor:
    x = torch.randn(n)
    x[3], x[300], x[600], x[900] = float("nan"), float("inf"), -float("inf"), float("nan")
    x[901] = float("inf")
    return x


def near_ties(qmax: int) -> torch.Tensor:
    """A block whose scaled values x * (1 / scale) all land within an ulp of a tie.

    The absmax 3 * qmax makes 1 / scale float32(1/3), so (k + 0.5) * 3 scales to
    k + 0.5 rounded; rounding the exact product instead (a fused multiply-add, or an
    offset added before rounding) moves about half of them to the other integer.
    """
    return torch.tensor([3.0 * qmax] + [3 * (k + 0.5) for k in range(-qmax, qmax)])


def e4m3_values() -> torch.Tensor:
    """Every finite float8 e4m3 value, in byte order (448 among them: a block's scale is then 1)."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return every[every.isfinite()]


def e4m3_ties() -> torch.Tensor:
    """448, then the midpoint of every two neighbouring e4m3 values (each a tie to round to even),
    subnormals included, and the floats just above and below them."""
    ordered = e4m3_values().unique()
    mid = (ordered[1:] + ordered[:-1]) / 2
    return torch.cat([torch.tensor([448.0]), mid, torch.nextafter(mid, torch.tensor(1e9)),
                      torch.nextafter(mid, torch.tensor(-1e9)), torch.tensor([460.0])])


def e4m3_every_exponent() -> torch.Tensor:
    """Floats of random bits below 448, so of every float32 exponent there (float32 subnormals
    too), with random signs: where e4m3's rounding step changes with the exponent."""
    generator = torch.Generator().manual_seed(8)
    bits = torch.randint(0, 0x43E00000, (1 << 14,), generator=generator, dtype=torch.int32)
    signs = torch.randint(0, 2, (1 << 14,), generator=generator).float() * 2 - 1
    return torch.cat([torch.tensor([448.0]), bits.view(torch.float32) * signs])


NATIVE_INPUTS = {
    "empty": lambda: torch.empty(0),
    "one": lambda: torch.tensor([0.3]),
    "partial_block": lambda: torch.randn(3 * 256 + 37) * 5,
    "odd_2d": lambda: torch.randn(3, 333),
    "non_contiguous": lambda: torch.randn(50, 60)[::3, 1::2],
    "expanded": lambda: torch.randn(7, 1).expand(7, 300),
    # absmax 127 (int8) and 7 (int4) give a scale of exactly 1: every .5 is a tie.
    "int8_ties": lambda: torch.arange(-254, 255).float() / 2,
    "int4_ties": lambda: (torch.arange(-14, 15).float() / 2).repeat(20),
    "int8_near_ties": lambda: near_ties(127),
    "int4_near_ties": lambda: near_ties(7).repeat(17),
    "fp8_every_value": e4m3_values,
    "fp8_ties": e4m3_ties,
    "fp8_every_exponent": e4m3_every_exponent,
    "tiny_and_huge": lambda: torch.tensor([1e-40, -3e-39, 0.0, -0.0] * 64 + [3.4e38, -1.0] * 128),
    "zeros": lambda: torch.zeros(600),
    "nan_and_inf": lambda: with_specials(4 * 256 + 3),
    "float64": lambda: (torch.randn(1000) * 1e3).double(),
    "float16": lambda: torch.randn(1000).half(),
    "bfloat16": lambda: torch.randn(1000).bfloat16(),
}


def test_native_kernels_load_where_a_compiler_exists() -> None:
    if not HAS_COMPILER or os.environ.get("ACTORPIPE_NATIVE") == "0":
        pytest.skip("no C compiler, or the kernels are turned off")
    kernels = _native.blockquant()
    assert kernels is not None and kernels.path.exists()


@requires_native
@pytest.mark.parametrize(
    "codec,block", [(c, b) for c in NATIVE_CODECS for b in NATIVE_BLOCKS[c]]
)
@pytest.mark.parametrize("case", NATIVE_INPUTS)
def test_native_frames_match_the_torch_path(codec: str, block: int, case: str) -> None:
    x = NATIVE_INPUTS[case]()
    codec_ = make_codec(codec, block)
    native = codec_.encode(x)
    with torch_path():
        reference = codec_.encode(x)
    check_frames(native)
    assert (native.dtype, native.shape, native.params) == (x.dtype, x.shape, {"block": block})
    assert_same_encoding(native, reference)
    assert_same_decoding(native)


@requires_native
@pytest.mark.parametrize("codec", NATIVE_CODECS)
def test_native_frames_match_the_torch_path_at_benchmark_size(codec: str) -> None:
    x = torch.randn(1 << 22)
    native = encode(x, codec)
    with torch_path():
        reference = encode(x, codec)
    assert all(torch.equal(a, b) for a, b in zip(native.frames, reference.frames))
    assert_same_decoding(native)


@requires_native
def test_native_fp8_encodes_every_e4m3_value_as_itself_and_decodes_every_byte_as_the_torch_path() -> None:
    values = e4m3_values()  # absmax 448: the scale is exactly 1
    encoded = encode(values, "fp8")
    assert torch.equal(encoded.frames[0].view(torch.float8_e4m3fn).float(), values)
    every_byte = Encoded(codec="fp8", dtype=torch.float32, shape=(256,), params={"block": 256},
                         frames=(torch.arange(256, dtype=torch.int32).to(torch.uint8),
                                 torch.tensor([0.5]).view(torch.uint8)))
    assert_same_decoding(every_byte)  # the NaN bytes too, which a corrupt frame alone holds


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"])
def test_loader_falls_back_with_a_warning_when_the_build_fails(
    cc: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("ACTORPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ACTORPIPE_NATIVE", raising=False)
    with caplog.at_level(logging.WARNING, logger=_native.__name__):
        assert _native._load() is None
    assert len(caplog.records) == 1 and "torch path" in caplog.records[0].getMessage()
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("*.tmp"))


def test_loader_is_off_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACTORPIPE_NATIVE", "0")
    assert _native._load() is None


@requires_native
def test_loader_compiles_once_then_reuses_the_cached_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ACTORPIPE_CACHE_DIR", str(tmp_path))
    first = _native._load()
    assert first is not None and first.path.parent == tmp_path

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    second = _native._load()
    assert second is not None and second.path == first.path


@pytest.mark.slow
@requires_native
@pytest.mark.multiprocess
def test_concurrent_processes_build_one_library(tmp_path: Path) -> None:
    code = "from transport import _native; print(_native.blockquant().path)"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "ACTORPIPE_CACHE_DIR": str(tmp_path)}
    processes = [
        subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    outputs = [process.communicate(timeout=50) for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs
    assert len({stdout for stdout, _ in outputs}) == 1
    assert [path.suffix for path in tmp_path.iterdir() if path.suffix != ".lock"] == [".so"]


# --- properties ----------------------------------------------------------------------


FLOAT32_ARRAYS = arrays(
    np.float32,
    array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=24),
    elements=st.floats(-6e4, 6e4, width=32),  # inside fp16's range, subnormals included
)


@settings(max_examples=200)
@given(
    data=FLOAT32_ARRAYS,
    codec=st.sampled_from(LOSSY),
    block=st.sampled_from([2, 4, 256, 1000]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_property_roundtrip_within_bound(
    data: np.ndarray, codec: str, block: int, dtype: torch.dtype
) -> None:
    x = torch.from_numpy(data).to(dtype)
    encoded = make_codec(codec, block).encode(x)
    check_frames(encoded)
    y = decode(encoded)
    assert y.shape == x.shape and y.dtype == dtype
    err = (y.double() - x.double()).abs().reshape(-1)
    assert (err <= error_bound(codec, x, block)).all()


@settings(max_examples=200)
@given(
    codec=st.sampled_from(CODEC_NAMES),
    dtype=st.sampled_from(RAW_DTYPES + ("float32", None)),
    shape=st.one_of(st.lists(st.integers(-3, 2**50), max_size=4), st.text(max_size=3)),
    params=st.dictionaries(
        st.sampled_from(["block", "x"]),
        st.one_of(
            st.integers(-10, 2**22), st.floats(), st.text(max_size=3), st.none(), st.booleans()
        ),
        max_size=2,
    ),
)
def test_property_frame_sizes_raises_only_codec_error(
    codec: str, dtype: object, shape: object, params: dict[str, object]
) -> None:
    try:
        sizes = get_codec(codec).frame_sizes(dtype, shape, params)  # type: ignore[arg-type]
    except CodecError:
        return
    assert all(type(size) is int and size >= 0 for size in sizes)


@settings(max_examples=200)
@given(
    codec=st.sampled_from(CODEC_NAMES),
    dtype=st.sampled_from(FLOAT_DTYPES),
    shape=st.lists(st.integers(0, 9), max_size=3).map(tuple),
    block=st.sampled_from([2, 6, 256]),
    data=st.data(),
)
def test_property_any_bytes_of_the_right_size_decode_without_raising(
    codec: str, dtype: torch.dtype, shape: tuple[int, ...], block: int, data: st.DataObject
) -> None:
    params: dict[str, int | float | str] = {"block": block} if codec in BLOCK_CODECS else {}
    sizes = get_codec(codec).frame_sizes(dtype, shape, params)
    frames = tuple(
        torch.frombuffer(bytearray(data.draw(st.binary(min_size=n, max_size=n))) or bytearray(1),
                         dtype=torch.uint8)[:n]
        for n in sizes
    )
    y = decode(Encoded(codec=codec, dtype=dtype, shape=shape, params=params, frames=frames))
    assert y.shape == shape and y.dtype == dtype


ANY_FLOAT32 = arrays(
    np.float32,
    array_shapes(min_dims=1, max_dims=2, min_side=0, max_side=40),
    elements=st.floats(width=32),  # NaN, inf, subnormals and huge values included
)


@requires_native
@settings(max_examples=200)
@given(data=ANY_FLOAT32, codec=st.sampled_from(NATIVE_CODECS), block=st.sampled_from([2, 6, 256]))
def test_property_native_frames_match_the_torch_path(
    data: np.ndarray, codec: str, block: int
) -> None:
    x = torch.from_numpy(data)
    codec_ = make_codec(codec, block)
    native = codec_.encode(x)
    with torch_path():
        reference = codec_.encode(x)
    assert_same_encoding(native, reference)
    assert_same_decoding(native)


@requires_native
@settings(max_examples=200)
@given(
    codec=st.sampled_from(NATIVE_CODECS),
    numel=st.integers(0, 600),
    block=st.sampled_from([2, 6, 256]),
    data=st.data(),
)
def test_property_native_decodes_any_bytes_like_the_torch_path(
    codec: str, numel: int, block: int, data: st.DataObject
) -> None:
    params: dict[str, int | float | str] = {"block": block}
    sizes = get_codec(codec).frame_sizes(torch.float32, (numel,), params)
    frames = tuple(
        torch.frombuffer(bytearray(data.draw(st.binary(min_size=n, max_size=n))) or bytearray(1),
                         dtype=torch.uint8)[:n]
        for n in sizes
    )
    assert_same_decoding(
        Encoded(codec=codec, dtype=torch.float32, shape=(numel,), params=params, frames=frames)
    )
