"""Tensor codecs: turn a tensor into small metadata plus raw byte frames, and back.

Run its tests with: `.venv/bin/python -m pytest -q tests/transport/test_codecs.py`

Codecs: `none` (the tensor's own bytes, zero-copy both ways), `fp16` and `bf16`
(casts), and the block-wise lossy codecs `int8`, `fp8` (e4m3) and `int4`, which split
the flattened tensor into blocks of `block` elements (default 256, the last block
zero-padded in the computation only) and store one float32 scale per block.
`ErrorFeedback` wraps a lossy codec and carries each stream's quantization residual
into the stream's next tensor.

Frames are native-endian raw bytes; every platform torch ships for is little-endian,
and the int4 packing relies on it. Encoding runs on the tensor's device and leaves the
frames there: a CUDA activation is quantized on the GPU, so only the small frames cross
to the host (``stages.comm.device_io`` copies them, overlapped with compute; the wire copies
any device frame it is handed). Decoding runs on the frames' device: the wire's are
always on the CPU.

On CPU, int8 and int4 run C kernels (`transport/_native/`, compiled on first use;
3x and 6x faster at 16 MiB). They write the same bytes as the torch path, which other
devices and machines without a C compiler use, except in blocks holding NaN, which
decode to NaN either way.
"""
from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from transport import _native
from transport._buffers import aligned_empty

__all__ = [
    "CODEC_NAMES", "Codec", "CodecError", "Encoded", "ErrorFeedback", "aligned", "aligned_copy", "decode", "encode",
    "get_codec",
]

# torch 2.13 warns once per process, as a UserWarning raised from C++, that quantized
# tensor creation is deprecated. We use quantized tensors only as a vectorised
# round-and-saturate kernel (fbgemm) and never hand them out, so the warning is noise
# to our users; a per-call catch_warnings() would cost more than a small encode.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other quantized",
    category=UserWarning,
)

_FLOAT_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
_RAW_DTYPES = _FLOAT_DTYPES | {
    torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, torch.complex128,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.uint16, torch.uint32, torch.uint64,
}
_MAX_BLOCK = 1 << 20
# No real tensor has more elements; bounding untrusted shapes keeps torch's size
# arithmetic (and ours) far from int64 overflow.
_MAX_NUMEL = 1 << 48
_MAX_NDIM = 64
_TINY = torch.finfo(torch.float32).tiny
_FLOAT32_MAX = torch.finfo(torch.float32).max


class CodecError(ValueError):
    """An unknown codec, an unsupported dtype, or params or frames that do not fit."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Encoded:
    """A tensor as a codec left it: what to rebuild it from, and the raw frames.

    Attributes:
        codec: The codec's name.
        dtype: The original tensor's dtype.
        shape: The original tensor's shape.
        params: Small msgpack-able codec parameters, e.g. `{"block": 256}`.
        frames: Each a 1-D contiguous torch.uint8 tensor, on the device the tensor was
            encoded on (the CPU for everything that came off the wire).
    """

    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: dict[str, int | float | str]
    frames: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        """Total bytes of the frames."""
        return sum(frame.numel() * frame.element_size() for frame in self.frames)


def _checked_numel(shape: object) -> int:
    """Return the element count of an untrusted shape, or raise CodecError."""
    if not isinstance(shape, (tuple, list)) or len(shape) > _MAX_NDIM:
        raise CodecError(f"shape must be a tuple of at most {_MAX_NDIM} ints, got {shape!r}")
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= _MAX_NUMEL:
            raise CodecError(f"shape dimensions must be ints in 0..2**48, got {shape!r}")
    numel = math.prod(shape)
    if numel > _MAX_NUMEL:
        raise CodecError(f"shape {shape!r} has more than 2**48 elements")
    return numel


def _as_frame(tensor: torch.Tensor) -> torch.Tensor:
    """Return `tensor`'s bytes as a 1-D contiguous uint8 tensor on its device (no copy if possible).

    Not moved to the CPU here: a per-frame ``.cpu()`` would block the compute stream
    on every message, and the caller knows better when and how to move it (pinned,
    on a side stream: see ``stages.comm.device_io``).
    """
    return tensor.contiguous().reshape(-1).view(torch.uint8)


# Receive buffers start wherever libzmq put them (often 8 bytes past a 16-byte boundary
# for small messages). CPU kernels pick their path by alignment, and an 8-aligned input
# can round differently from the same values at a 16-aligned address: a tensor that
# crossed the wire would then not compute bit for bit as in one process.
FRAME_ALIGNMENT = 16


def _frame_as(frame: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View a uint8 frame as `dtype`, copying only when its address is not 16-byte aligned."""
    # torch refuses a view at a misaligned storage offset, and see FRAME_ALIGNMENT.
    return aligned(frame, dtype.itemsize).view(dtype)


def aligned(tensor: torch.Tensor, itemsize: int | None = None) -> torch.Tensor:
    """``tensor``, or a copy of it (:func:`aligned_copy`) where it starts off
    :data:`FRAME_ALIGNMENT` or its elements' size (``itemsize``: the size of what it will be viewed as)."""
    if not tensor.data_ptr() % max(itemsize or tensor.element_size(), FRAME_ALIGNMENT):
        return tensor
    return aligned_copy(tensor.contiguous().view(torch.uint8).reshape(-1)).view(tensor.dtype).view(tensor.shape)


def aligned_copy(frame: torch.Tensor) -> torch.Tensor:
    """A copy of a uint8 frame at a 64-byte aligned address.

    On the CPU the bytes go through numpy, one plain copy on this thread: torch's
    ``clone`` splits a copy over its intra-op threads, and handing a 64 KiB receive to
    another thread on a busy machine measured 10x slower than copying it here.
    """
    if frame.device.type != "cpu":
        return frame.clone()
    copy = aligned_empty(frame.numel())
    copy.numpy()[:] = frame.numpy()
    return copy


class Codec(ABC):
    """Encodes tensors into frames and decodes them back to the original dtype and shape."""

    name: ClassVar[str]
    lossy: ClassVar[bool]
    dtypes: ClassVar[frozenset[torch.dtype]]

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> Encoded:
        """Encode `tensor` (any device, contiguous or not).

        Raises:
            CodecError: The codec does not support the tensor's dtype.
        """

    def frame_sizes(
        self, dtype: torch.dtype, shape: tuple[int, ...], params: Mapping[str, object]
    ) -> tuple[int, ...]:
        """Return the byte length each frame must have.

        Safe on untrusted input: it checks every param decode relies on and allocates
        nothing proportional to the shape.

        Raises:
            CodecError: Bad params or shape, or an unsupported dtype.
        """
        self._check_dtype(dtype)
        return self._frame_sizes(dtype, _checked_numel(shape), params)

    @abstractmethod
    def _frame_sizes(
        self, dtype: torch.dtype, numel: int, params: Mapping[str, object]
    ) -> tuple[int, ...]:
        """`frame_sizes` for a checked dtype and element count."""

    def decoded_elements(self, shape: tuple[int, ...], params: Mapping[str, object]) -> int:
        """Return how many elements `decode` computes: the shape's, plus any padding.

        Safe on untrusted input that `frame_sizes` accepted; allocates nothing.

        Raises:
            CodecError: Bad params or shape.
        """
        return _checked_numel(shape)

    def decode(self, encoded: Encoded) -> torch.Tensor:
        """Rebuild a tensor of `encoded.dtype` and `encoded.shape` on the frames' device.

        Raises:
            CodecError: The frames do not match the codec, dtype, shape and params, or
                lie on different devices.
        """
        if encoded.codec != self.name:
            raise CodecError(f"codec {self.name!r} cannot decode frames of {encoded.codec!r}")
        sizes = self.frame_sizes(encoded.dtype, encoded.shape, encoded.params)
        actual = tuple(encoded.frames)
        if len(actual) != len(sizes):
            raise CodecError(f"{self.name}: expected {len(sizes)} frames, got {len(actual)}")
        device = actual[0].device if actual and isinstance(actual[0], torch.Tensor) else None
        for index, (frame, size) in enumerate(zip(actual, sizes)):
            if not (isinstance(frame, torch.Tensor) and frame.dtype == torch.uint8
                    and frame.dim() == 1 and frame.is_contiguous()):
                raise CodecError(f"{self.name}: frame {index} is not a 1-D contiguous uint8 tensor")
            if frame.device != device:
                raise CodecError(f"{self.name}: frame {index} is on {frame.device}, frame 0 on {device}; "
                                 "move the frames to one device first")
            if frame.numel() != size:
                raise CodecError(f"{self.name}: frame {index}: {frame.numel()} bytes, not {size}")
        return self._decode(encoded)

    def decode_checked(self, encoded: Encoded) -> torch.Tensor:
        """`decode` for frames its caller made and checked against `frame_sizes` itself: 1-D
        contiguous uint8 tensors on one device, this codec's, each of its size (the wire
        does, for every tensor of a message, before it builds the first). No check again."""
        return self._decode(encoded)

    @abstractmethod
    def _decode(self, encoded: Encoded) -> torch.Tensor:
        """Decode frames that `decode` has already checked against `frame_sizes`."""

    def _check_dtype(self, dtype: object) -> torch.dtype:
        if not isinstance(dtype, torch.dtype) or dtype not in self.dtypes:
            hint = " (use codec 'none' for this dtype)" if self.lossy else ""
            raise CodecError(f"codec {self.name!r} does not support dtype {dtype}{hint}")
        return dtype


class NoneCodec(Codec):
    """The tensor's own bytes: bit-exact, and zero-copy for contiguous CPU tensors.

    The frame of a contiguous CPU tensor shares its memory, so writing to the tensor
    after `encode` changes the frame; the decoded tensor is a view of the frame.
    """

    name = "none"
    lossy = False
    dtypes = _RAW_DTYPES

    def encode(self, tensor: torch.Tensor) -> Encoded:
        dtype = self._check_dtype(tensor.dtype)
        return Encoded(codec=self.name, dtype=dtype, shape=tuple(tensor.shape), params={},
                       frames=(_as_frame(tensor.detach()),))

    def _frame_sizes(
        self, dtype: torch.dtype, numel: int, params: Mapping[str, object]
    ) -> tuple[int, ...]:
        _check_no_params(self.name, params)
        return (numel * dtype.itemsize,)

    def _decode(self, encoded: Encoded) -> torch.Tensor:
        return _frame_as(encoded.frames[0], encoded.dtype).reshape(encoded.shape)


def _check_no_params(name: str, params: Mapping[str, object]) -> None:
    if not isinstance(params, Mapping) or params:
        raise CodecError(f"codec {name!r} takes no params, got {params!r}")


class _CastCodec(Codec):
    """A floating tensor cast to a 16-bit float type on the wire."""

    lossy = True
    dtypes = _FLOAT_DTYPES
    wire_dtype: ClassVar[torch.dtype]

    def encode(self, tensor: torch.Tensor) -> Encoded:
        dtype = self._check_dtype(tensor.dtype)
        wire = tensor.detach()
        if dtype != self.wire_dtype:  # never touch the caller's tensor in place
            wire = self._saturate(wire.to(self.wire_dtype, memory_format=torch.contiguous_format))
        return Encoded(codec=self.name, dtype=dtype, shape=tuple(tensor.shape), params={},
                       frames=(_as_frame(wire),))

    def _saturate(self, wire: torch.Tensor) -> torch.Tensor:
        """Fix up a freshly cast tensor in place (values that overflowed the cast)."""
        return wire

    def _frame_sizes(
        self, dtype: torch.dtype, numel: int, params: Mapping[str, object]
    ) -> tuple[int, ...]:
        _check_no_params(self.name, params)
        return (numel * 2,)

    def _decode(self, encoded: Encoded) -> torch.Tensor:
        wire = _frame_as(encoded.frames[0], self.wire_dtype).reshape(encoded.shape)
        return wire.to(encoded.dtype)


class Fp16Codec(_CastCodec):
    """float16 on the wire; relative error <= 2**-11 in float16's normal range.

    Values of a wider dtype beyond ±65504, ±inf included, saturate to ±65504 instead
    of becoming inf; NaN stays NaN. float16 tensors pass through bit-exact.
    """

    name = "fp16"
    wire_dtype = torch.float16

    def _saturate(self, wire: torch.Tensor) -> torch.Tensor:
        # Clamping the half-size result is cheaper than clamping the input; the cast
        # has already turned overflowing values into ±inf, which clamp maps to ±max.
        return wire.clamp_(-65504.0, 65504.0)


class Bf16Codec(_CastCodec):
    """bfloat16 on the wire: float32's exponent range, relative error <= 2**-8.

    Not clamped (a clamp would double the cost): float32 values within 0.2% of float32's
    maximum, and float64 values beyond bfloat16's range, become ±inf.
    """

    name = "bf16"
    wire_dtype = torch.bfloat16


class _BlockCodec(Codec):
    """Block-wise symmetric quantization: one float32 scale, absmax / qmax, per block.

    Frames: (values, float32 scales). The values frame holds exactly the tensor's
    element count (int4: half of it, rounded up); the zero padding of the last block
    exists only during the computation (the torch path copies the input when numel %
    block != 0). Inputs are quantized in float32. NaN or inf in a block makes that
    block's decoded values garbage (NaN or inf mostly), never an exception. Codecs with
    `native_kernel` run the C kernels of transport/_native on CPU when they load.
    """

    lossy = True
    dtypes = _FLOAT_DTYPES
    qmax: ClassVar[float]
    even_block: ClassVar[bool] = False
    # The C kernels in transport/_native that match the torch path ("int8", "int4", "fp8").
    native_kernel: ClassVar[str | None] = None

    def __init__(self, *, block: int = 256) -> None:
        """Use blocks of `block` elements (1..2**20; int4: even).

        Raises:
            CodecError: A block size out of range.
        """
        self.block = self._check_block({"block": block})

    def _check_block(self, params: Mapping[str, object]) -> int:
        if not isinstance(params, Mapping) or set(params) != {"block"}:
            raise CodecError(f"codec {self.name!r} takes exactly the param 'block', got {params!r}")
        block = params["block"]
        if type(block) is not int or not 1 <= block <= _MAX_BLOCK:
            raise CodecError(f"{self.name}: block must be an int in 1..2**20, got {block!r}")
        if self.even_block and block % 2:
            raise CodecError(f"{self.name}: block must be even, got {block}")
        return block

    def _frame_sizes(
        self, dtype: torch.dtype, numel: int, params: Mapping[str, object]
    ) -> tuple[int, ...]:
        return (self._values_nbytes(numel), 4 * -(-numel // self._check_block(params)))

    def _values_nbytes(self, numel: int) -> int:
        return numel

    def decoded_elements(self, shape: tuple[int, ...], params: Mapping[str, object]) -> int:
        # The torch path decodes whole blocks: the last one's zero padding included.
        block = self._check_block(params)
        return -(-_checked_numel(shape) // block) * block

    def encode(self, tensor: torch.Tensor) -> Encoded:
        dtype = self._check_dtype(tensor.dtype)
        flat = tensor.detach().to(torch.float32, memory_format=torch.contiguous_format).reshape(-1)
        kernels = self._kernels(flat.device.type)
        if kernels is not None:
            assert self.native_kernel is not None
            values, scale = kernels.encode(flat, kind=self.native_kernel, block=self.block,
                                           floor=_TINY, ceil=self._scale_ceiling())
        else:
            values, scale = self._encode_torch(flat)
        return Encoded(codec=self.name, dtype=dtype, shape=tuple(tensor.shape),
                       params={"block": self.block}, frames=(_as_frame(values), _as_frame(scale)))

    def _kernels(self, device_type: str) -> _native.BlockQuantKernels | None:
        """The C kernels when this codec has them and the device is the CPU, else None."""
        if self.native_kernel is None or device_type != "cpu":
            return None
        return _native.blockquant()

    def _scale_ceiling(self) -> float:
        # Keeps qmax * scale from rounding up to inf near float32's maximum.
        return _FLOAT32_MAX / self.qmax * (1 - 2**-20)

    def _encode_torch(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the values (1-D) and float32 scales of a flat float32 tensor."""
        numel = flat.numel()
        padded = -(-numel // self.block) * self.block
        if padded != numel:
            flat = torch.nn.functional.pad(flat, (0, padded - numel))
        blocks = flat.view(-1, self.block)
        # max(amax, -amin): two vectorised reductions, twice as fast as abs().amax(),
        # which writes a full-size temporary.
        absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())
        # The floor (smallest normal float32) keeps all-zero and subnormal blocks away
        # from 0/0 and keeps 1/scale finite, while |x| / scale stays <= qmax.
        scale = (absmax / self.qmax).clamp_(_TINY, self._scale_ceiling())
        scaled = blocks * scale.reciprocal().unsqueeze(1)
        return self._encode_values(scaled)[: self._values_nbytes(numel)], scale

    def _decode(self, encoded: Encoded) -> torch.Tensor:
        block = self._check_block(encoded.params)
        scale = _frame_as(encoded.frames[1], torch.float32)
        numel = math.prod(encoded.shape)
        kernels = self._kernels(scale.device.type)
        if kernels is not None:
            assert self.native_kernel is not None
            flat = kernels.decode(encoded.frames[0], scale, kind=self.native_kernel, numel=numel,
                                  block=block)
        else:
            flat = self._decode_torch(encoded.frames[0], scale, block)[:numel]
        return flat.reshape(encoded.shape).to(encoded.dtype)

    def _decode_torch(self, frame: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
        """Return the flat float32 values of every block, the padding included."""
        padded = self._values_nbytes(scale.numel() * block)
        if frame.numel() != padded:
            frame = torch.nn.functional.pad(frame, (0, padded - frame.numel()))
        return self._decode_values(frame, scale, block).view(-1)

    @abstractmethod
    def _encode_values(self, scaled: torch.Tensor) -> torch.Tensor:
        """Turn `scaled` ([blocks, block] float32, |x| <= qmax) into a 1-D value tensor."""

    @abstractmethod
    def _decode_values(self, frame: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
        """Turn a values frame padded to whole blocks into float32 [blocks, block]."""


def _round_to_int8_elementwise(scaled: torch.Tensor, qmax: int) -> torch.Tensor:
    """Return round-half-even(scaled) clamped to ±qmax as flat int8."""
    return scaled.round().clamp_(-qmax, qmax).to(torch.int8).reshape(-1)


def _round_to_int8(scaled: torch.Tensor, qmax: int) -> torch.Tensor:
    """`_round_to_int8_elementwise`, fast on CPU, where it saturates to [-128, 127] instead.

    Equal to the elementwise version wherever |scaled| <= qmax.
    """
    if scaled.device.type != "cpu":
        return _round_to_int8_elementwise(scaled, qmax)
    # On CPU, fbgemm's per-tensor quantize (scale 1) rounds and saturates in one
    # vectorised pass, ~5x faster than round/clamp/cast. quantize_per_channel would
    # apply the block scales itself but is a scalar loop (~1 GB/s) in torch 2.13.
    # NaN becomes 127. No zero point: torch 2.13's fbgemm adds it before rounding and
    # 2.11's after, which moves values within a float32 ulp of a tie.
    quantized = torch.quantize_per_tensor(scaled, 1.0, 0, torch.qint8)
    # int_repr() would copy, slowly; alias the quantized storage as int8 instead.
    # (quantized.view(torch.int8) looks equivalent but returns a tensor that segfaults.)
    return torch.empty(0, dtype=torch.int8).set_(
        quantized.untyped_storage(), 0, (quantized.numel(),), (1,)
    )


def _dequantize_int8(values: torch.Tensor, scale: torch.Tensor, zero_point: int) -> torch.Tensor:
    """Return (values - zero_point) * scale per block ([blocks, block] int8) as float32."""
    if values.device.type != "cpu":
        return _dequantize_int8_arithmetic(values, scale, zero_point)
    # The per-channel dequantize kernel is vectorised and measured 2x faster than
    # values.to(float32) * scale; float32 -> float64 -> float32 scales are exact.
    zero_points = torch.full((scale.numel(),), zero_point, dtype=torch.int64)
    quantized = torch._make_per_channel_quantized_tensor(values, scale.double(), zero_points, 0)
    return quantized.dequantize()


def _dequantize_int8_arithmetic(values: torch.Tensor, scale: torch.Tensor, zero_point: int) -> torch.Tensor:
    """`_dequantize_int8` as plain torch ops, for devices without quantized kernels (CUDA).

    Bit-equal to the CPU kernel: ``values - zero_point`` is a small integer, exact in
    float32, and its product with a float32 scale is rounded once either way.
    """
    return (values.to(torch.float32) - zero_point).mul_(scale.unsqueeze(1))


class Int8Codec(_BlockCodec):
    """int8 values round(x / scale) in [-127, 127], scale = block absmax / 127.

    Per-element error <= scale / 2 (rounding is half to even). Size: 1 + 4 / block
    bytes per element, 0.254x of float32 with the default block of 256.
    """

    name = "int8"
    qmax = 127.0
    native_kernel = "int8"

    def _encode_values(self, scaled: torch.Tensor) -> torch.Tensor:
        return _round_to_int8(scaled, 127)

    def _decode_values(self, frame: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
        return _dequantize_int8(frame.view(torch.int8).view(-1, block), scale, 0)


class Fp8Codec(_BlockCodec):
    """float8 e4m3 values of x / scale, scale = block absmax / 448 (e4m3's maximum).

    Error <= 2**-4 of the value for scaled values >= 2**-6 (e4m3 normals), else
    <= 2**-10 * scale. Size as int8.
    """

    name = "fp8"
    qmax = 448.0
    native_kernel = "fp8"

    def _encode_values(self, scaled: torch.Tensor) -> torch.Tensor:
        # Saturated here, not by the cast: torch's cast of a value past 448 (an infinity in a
        # block) gave NaN (0x7f) in torch 2.11 and saturates in 2.13, as the C kernel does.
        return scaled.clamp_(-self.qmax, self.qmax).to(torch.float8_e4m3fn).reshape(-1).view(torch.uint8)

    def _decode_values(self, frame: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
        # torch's e4m3 -> float cast is scalar on CPU (~0.6 GB/s). Shifting the e4m3
        # bits left by 7 gives the float16 whose value is exactly 2**-8 times the e4m3
        # value, subnormals included; float16 -> float32 is vectorised. The 2**8 goes
        # into the scale. e4m3 NaN bytes, which only a corrupt frame holds, decode finite.
        wide = frame.view(torch.int8).to(torch.int16)  # sign-extended
        half = ((wide << 7) & ~0x4000).view(torch.float16)  # clear the sign's copy in bit 14
        return half.to(torch.float32).view(-1, block).mul_((scale * 256.0).unsqueeze(1))


class Int4Codec(_BlockCodec):
    """int4 values round(x / scale) in [-7, 7], scale = block absmax / 7, two per byte.

    Each nibble holds value + 8 (1..15; 0 would decode as -8), the even element in the
    low nibble; an odd element count pads one nibble. Per-element error <= scale / 2 =
    absmax / 14. `block` must be even. Size: 0.5 + 4 / block bytes per element, 0.129x
    of float32 with the default block.
    """

    name = "int4"
    qmax = 7.0
    even_block = True
    native_kernel = "int4"

    def _values_nbytes(self, numel: int) -> int:
        return (numel + 1) // 2

    def _encode_values(self, scaled: torch.Tensor) -> torch.Tensor:
        # The clamp keeps ±inf at ±7 (fbgemm saturates to int8's range). Offset values
        # 1..15 leave each byte's high nibble clear, so for an element pair read as one
        # little-endian int16 w, the packed byte is the low byte of w | (w >> 4).
        # Measured 4x faster than masking strided halves.
        pairs = _round_to_int8(scaled, 7).clamp_(-7, 7).add_(8).view(torch.int16)
        return (pairs >> 4).bitwise_or_(pairs).to(torch.uint8)

    def _decode_values(self, frame: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
        nibbles = torch.stack((frame & 0x0F, frame >> 4), dim=1).view(torch.int8)
        return _dequantize_int8(nibbles.view(-1, block), scale, 8)


_CODECS: dict[str, Codec] = {
    codec.name: codec
    for codec in (NoneCodec(), Fp16Codec(), Bf16Codec(), Int8Codec(), Fp8Codec(), Int4Codec())
}
CODEC_NAMES: tuple[str, ...] = tuple(_CODECS)


def get_codec(name: str) -> Codec:
    """Return the codec called `name`, with default params.

    Raises:
        CodecError: No codec has that name.
    """
    codec = _CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(CODEC_NAMES)}")
    return codec


def encode(tensor: torch.Tensor, codec: str = "none") -> Encoded:
    """Encode `tensor` with the named codec (default params).

    Raises:
        CodecError: Unknown codec, or one that does not support the tensor's dtype.
    """
    return get_codec(codec).encode(tensor)


def decode(encoded: Encoded) -> torch.Tensor:
    """Check `encoded` against its codec's `frame_sizes`, then decode it on the frames' device.

    Raises:
        CodecError: Unknown codec, or params, shape, dtype or frames that do not fit.
    """
    return get_codec(encoded.codec).decode(encoded)


class ErrorFeedback:
    """Error feedback for a lossy codec (as in 1-bit SGD / EF-SGD).

    Per stream, the residual `input - decode(encode(input))` is kept and added to the
    next tensor of that stream, so quantization errors cancel over steps instead of
    accumulating. A residual whose shape, dtype or device differs from the new tensor's
    is discarded. Non-finite residual entries are zeroed, so one overflowed step does not
    poison the stream. With a lossless codec it only encodes. Not safe for concurrent
    use of one stream from several threads.
    """

    def __init__(self, codec: Codec | str) -> None:
        """Wrap `codec` (a Codec or a codec name).

        Raises:
            CodecError: Unknown codec name.
        """
        self.codec = get_codec(codec) if isinstance(codec, str) else codec
        # Per stream: the residual (float32, or float64 for float64 tensors) and the
        # dtype of the tensor it came from.
        self._residuals: dict[Hashable, tuple[torch.Tensor, torch.dtype]] = {}

    def encode(self, tensor: torch.Tensor, stream: Hashable) -> Encoded:
        """Encode `tensor` plus the stream's residual, and keep the new residual.

        Raises:
            CodecError: The codec does not support the tensor's dtype.
        """
        if not self.codec.lossy:
            return self.codec.encode(tensor)
        tensor = tensor.detach()
        work_dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        corrected = tensor.to(work_dtype)
        residual, dtype = self._residuals.get(stream, (None, None))
        if (
            residual is not None and dtype == tensor.dtype
            and residual.shape == tensor.shape and residual.device == tensor.device
        ):
            corrected = corrected + residual
        encoded = self.codec.encode(corrected.to(tensor.dtype))
        decoded = self.codec.decode(encoded).to(device=tensor.device, dtype=work_dtype)
        residual = torch.nan_to_num_(corrected - decoded, 0.0, 0.0, 0.0)
        self._residuals[stream] = (residual, tensor.dtype)
        return encoded

    def reset(self, stream: Hashable | None = None) -> None:
        """Forget the residual of `stream`, or of every stream when it is None."""
        if stream is None:
            self._residuals.clear()
        else:
            self._residuals.pop(stream, None)
