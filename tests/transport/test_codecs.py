"""Tests for transport/codecs.py.

Run: .venv/bin/python -m pytest -q tests/transport/test_codecs.py
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from transport import codecs
from transport.codecs import (
    CODEC_NAMES, CodecError, Encoded, ErrorFeedback, decode, encode, get_codec,
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


@pytest.mark.parametrize("codec", ("int8", "int4"))
def test_fast_rounding_matches_elementwise_reference(codec: str) -> None:
    # The CPU path goes through fbgemm's quantize; other devices use the elementwise
    # version. Both round half to even. fbgemm adds the zero point (int4: 8) before
    # rounding, so a value within a float32 ulp of a tie may round the other way.
    qmax, zero_point = QMAX[codec], {"int8": 0, "int4": 8}[codec]
    scaled = torch.randn(256, 256) * qmax / 3
    scaled[0, :6] = torch.tensor([0.5, 1.5, -0.5, -2.5, qmax, -qmax])
    scaled[0, 6] = -2.500000238418579  # one float32 ulp past a tie: -3 exactly, -2 in fbgemm
    scaled = scaled.clamp(-qmax, qmax).reshape(-1)
    fast = codecs._round_to_int8(scaled.clone(), qmax, zero_point)
    reference = codecs._round_to_int8_elementwise(scaled.clone(), qmax, zero_point)
    assert fast[:6].tolist() == [v + zero_point for v in (0, 2, 0, -2, qmax, -qmax)]
    differs = fast != reference
    assert ((fast.int() - reference.int()).abs() <= 1).all()
    assert ((scaled[differs].abs() % 1 - 0.5).abs() < 1e-6).all()
    assert differs.sum() <= (1 if zero_point else 0)


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
