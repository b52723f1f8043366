"""The wire format: one msgpack header frame plus zero or more raw tensor frames.

A message is any tree of msgpack types (None, bool, int, float, str, bytes, lists,
tuples, dicts) with tensors anywhere in it. On the wire::

    frame 0   msgpack [version, tensor_table, body_bytes]
    frame 1…  the tensors' encoded frames, in table order

``body_bytes`` is the msgpack of the payload with each tensor replaced by an ext
value that holds its index in ``tensor_table``; each table row is
``[codec, dtype, shape, params, num_frames]``. The receiver checks every row against
the codec's own idea of the frame sizes before it touches a frame, then rebuilds
each tensor over the received buffer (no copy for the ``none`` codec).

Nothing is ever unpickled. Every malformed input raises a :class:`WireError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from transport.codecs import CodecError, Encoded, get_codec

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DTYPES",
    "Coded",
    "MessageTooLarge",
    "WireError",
    "decode_message",
    "encode_message",
]

WIRE_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_TENSOR_EXT = 1
_MAX_NDIM = 32
_MAX_FRAMES_PER_TENSOR = 8

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class WireError(ValueError):
    """Bytes that do not form a valid message: the message is dropped, the receiver goes on."""


class MessageTooLarge(WireError):
    """A message over the configured size limit."""


@dataclass(frozen=True, slots=True)
class Coded:
    """A tensor marked to travel with a given codec instead of the message default.

    (Not a tuple: msgpack would pack a tuple as a list before asking us.)
    """

    tensor: torch.Tensor
    codec: str


def encode_message(
    payload: Any, *, codec: str = "none", max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> list[Any]:
    """Encodes ``payload`` into frames ready for ``send_multipart(copy=False)``.

    Args:
        payload: msgpack types and tensors, nested in lists, tuples and dicts.
            Wrap a tensor in :class:`Coded` to pick its codec, or pass an
            :class:`~transport.codecs.Encoded` to send one encoded already.
        codec: the codec for floating tensors not wrapped in :class:`Coded`;
            other tensors always travel raw.
        max_bytes: the largest message, header and frames together.

    Returns:
        ``[header, *tensor_frames]``; tensor frames are buffers over the encoded
        tensors (for ``none``, over the caller's tensor itself), so the caller must
        not modify a sent tensor in place until the send has completed.

    Raises:
        TypeError: an object msgpack cannot carry.
        transport.codecs.CodecError: a codec that does not exist or fit the tensor.
        MessageTooLarge: the encoded message exceeds ``max_bytes``.
    """
    table: list[list[Any]] = []
    frames: list[Any] = []

    def add_tensor(obj: Any) -> msgpack.ExtType:
        if isinstance(obj, Encoded):  # encoded already (e.g. on a compute thread)
            encoded = obj
        elif isinstance(obj, Coded):
            encoded = get_codec(obj.codec).encode(obj.tensor.detach())
        elif isinstance(obj, torch.Tensor):
            chosen = get_codec(codec)
            if obj.dtype not in chosen.dtypes:  # e.g. integer tensors under a lossy default
                chosen = get_codec("none")
            encoded = chosen.encode(obj.detach())
        else:
            raise TypeError(
                f"cannot send an object of type {type(obj).__qualname__}: messages hold "
                "None, bool, int, float, str, bytes, lists, dicts and tensors"
            )
        table.append(_table_row(encoded))
        frames.extend(_as_buffer(frame) for frame in encoded.frames)
        return msgpack.ExtType(_TENSOR_EXT, (len(table) - 1).to_bytes(4, "little"))

    body = msgpack.packb(payload, default=add_tensor, use_bin_type=True)
    header = msgpack.packb([WIRE_VERSION, table, body], use_bin_type=True)
    total = len(header) + sum(memoryview(f).nbytes for f in frames)
    if total > max_bytes:
        raise MessageTooLarge(
            f"message is {total} bytes, over the limit of {max_bytes}; raise "
            "max_message_bytes on both ends or send the tensor in parts"
        )
    return [header, *frames]


def decode_message(frames: Sequence[Any], *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Any:
    """Rebuilds a payload from frames received off the wire.

    Args:
        frames: ``zmq.Frame`` objects, bytes, bytearrays or memoryviews.
        max_bytes: the largest message accepted, header and frames together.

    Returns:
        The payload, tensors rebuilt on the CPU. A tensor sent with the ``none``
        codec shares memory with its received frame.

    Raises:
        WireError: for every malformed input, with what was wrong.
    """
    if not frames:
        raise WireError("empty message: expected a header frame")
    buffers = [_buffer_of(frame) for frame in frames]
    total = sum(buf.nbytes for buf in buffers)
    if total > max_bytes:
        raise MessageTooLarge(f"message is {total} bytes, over the limit of {max_bytes}")
    version, table, body = _unpack_header(buffers[0])
    if version != WIRE_VERSION:
        raise WireError(f"wire version {version!r} is not supported (this side speaks {WIRE_VERSION})")
    tensors = _rebuild_tensors(table, buffers[1:])

    def ext_hook(code: int, data: bytes) -> torch.Tensor:
        if code != _TENSOR_EXT or len(data) != 4:
            raise WireError(f"unknown msgpack extension type {code}")
        index = int.from_bytes(data, "little")
        if index >= len(tensors):
            raise WireError(f"tensor reference {index} but the table has {len(tensors)} rows")
        return tensors[index]

    try:
        return msgpack.unpackb(body, ext_hook=ext_hook, raw=False, strict_map_key=False, timestamp=0)
    except WireError:
        raise
    except Exception as exc:  # msgpack raises many types for corrupt input
        raise WireError(f"malformed message body: {type(exc).__name__}: {exc}") from None


def _table_row(encoded: Encoded) -> list[Any]:
    return [
        encoded.codec,
        _DTYPE_NAMES[encoded.dtype],
        list(encoded.shape),
        dict(encoded.params),
        len(encoded.frames),
    ]


def _as_buffer(frame: torch.Tensor) -> memoryview:
    # numpy's view keeps the tensor alive for as long as ZeroMQ holds the buffer.
    return memoryview(frame.numpy())  # type: ignore[arg-type]  # ndarray exports the buffer protocol


def _buffer_of(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    try:
        view = memoryview(buf)
    except TypeError:
        raise WireError(f"frame of type {type(frame).__name__} is not a buffer") from None
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _unpack_header(buf: memoryview) -> tuple[Any, list[Any], bytes]:
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=False, timestamp=0)
    except Exception as exc:
        raise WireError(f"malformed header: {type(exc).__name__}: {exc}") from None
    if not (isinstance(header, list) and len(header) == 3):
        raise WireError("malformed header: expected [version, tensor_table, body]")
    version, table, body = header
    if not isinstance(table, list) or not isinstance(body, bytes):
        raise WireError("malformed header: tensor table must be a list and body bytes")
    return version, table, body


def _rebuild_tensors(table: list[Any], frames: list[memoryview]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    position = 0
    for index, row in enumerate(table):
        codec_name, dtype, shape, params, num_frames = _check_row(index, row)
        try:
            codec = get_codec(codec_name)
            sizes = codec.frame_sizes(dtype, shape, params)
        except CodecError as exc:
            raise WireError(f"tensor {index}: {exc}") from None
        if num_frames != len(sizes):
            raise WireError(f"tensor {index}: codec {codec_name} needs {len(sizes)} frames, header says {num_frames}")
        mine = frames[position : position + num_frames]
        if len(mine) != num_frames:
            raise WireError(f"tensor {index}: missing frames ({len(mine)} of {num_frames} present)")
        for k, (buf, size) in enumerate(zip(mine, sizes)):
            if buf.nbytes != size:
                raise WireError(
                    f"tensor {index} frame {k}: {buf.nbytes} bytes, but {codec_name} "
                    f"{list(shape)} {_DTYPE_NAMES[dtype]} needs {size}"
                )
        position += num_frames
        encoded = Encoded(
            codec=codec_name,
            dtype=dtype,
            shape=shape,
            params=params,
            frames=tuple(_uint8_tensor(buf) for buf in mine),
        )
        try:
            tensors.append(codec.decode(encoded))
        except Exception as exc:  # frame_sizes vetted the row; stay typed regardless
            raise WireError(f"tensor {index}: cannot decode: {type(exc).__name__}: {exc}") from None
    if position != len(frames):
        raise WireError(f"{len(frames) - position} extra frame(s) after the last tensor")
    return tensors


def _check_row(index: int, row: Any) -> tuple[str, torch.dtype, tuple[int, ...], dict[str, Any], int]:
    if not (isinstance(row, list) and len(row) == 5):
        raise WireError(f"tensor {index}: malformed table row")
    codec_name, dtype_name, shape, params, num_frames = row
    if not isinstance(codec_name, str):
        raise WireError(f"tensor {index}: codec name must be a string")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise WireError(f"tensor {index}: unknown dtype {dtype_name!r}; known: {', '.join(DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_NDIM
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise WireError(f"tensor {index}: shape must be a list of at most {_MAX_NDIM} non-negative ints")
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise WireError(f"tensor {index}: codec params must be a map with string keys")
    if type(num_frames) is not int or not 0 <= num_frames <= _MAX_FRAMES_PER_TENSOR:
        raise WireError(f"tensor {index}: bad frame count {num_frames!r}")
    return codec_name, DTYPES[dtype_name], tuple(shape), params, num_frames


def _uint8_tensor(buf: memoryview) -> torch.Tensor:
    if buf.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if buf.readonly:
        # torch.frombuffer wants a writable buffer; bytes objects (local and test
        # callers) pay one copy, frames received from ZeroMQ do not.
        buf = memoryview(bytearray(buf))
    return torch.frombuffer(buf, dtype=torch.uint8)
