"""The wire format: one msgpack header frame plus zero or more raw tensor frames.

A message is any tree of msgpack types (None, bool, int, float, str, bytes, lists,
tuples, dicts) with tensors anywhere in it. On the wire::

    frame 0   msgpack [version, tensor_table, body_bytes]
    frame 1…  the tensors' encoded frames, in table order

``body_bytes`` is the msgpack of the payload with each tensor replaced by an ext
value that holds its index in ``tensor_table``; each table row is
``[codec, dtype, shape, params, num_frames]``. A record (a class registered with
:func:`register_record`) travels as the list ``[ext(name), fields]``: an ext value
holding its registered name, then the map of its fields, which may hold tensors and
records in turn. The receiver rebuilds only registered classes, through their own
strict ``from_wire``. The receiver checks every row against
the codec's own idea of the frame sizes before it touches a frame, then rebuilds
each tensor over the received buffer (no copy for the ``none`` codec).

Nothing is ever unpickled, and nothing a message names is imported or called but
the ``from_wire`` of a class this process registered. Every malformed input raises
a :class:`WireError`.

What a message may cost the receiver is bounded before the cost is paid (a message
comes from whoever can reach the socket):

- at most :data:`MAX_FRAMES_PER_MESSAGE` frames and ``max_bytes`` bytes on the wire;
- the header is decoded with msgpack's length limits sized for a valid header
  (strings of at most 64 characters, at most 8 codec params, one row, shape and
  params per tensor frame), so a junk header costs at most its own length (one under
  4 KiB is read without counting its lists: it cannot cost more than its length; one
  with no tensors, most actor calls', has its few fixed bytes read by hand);
- each table row is checked against its codec before any tensor is built: the
  frames' exact sizes, the decoded size (elements times the declared dtype's
  size), which may not exceed what the codec ever expands to (decoded bytes per
  encoded byte, :data:`MAX_EXPANSION`; a lossy codec decodes to float32 at most, so
  float64 travels raw), and a total over all rows of at most ``max_bytes``;
- the body is decoded with msgpack's length limits (no array or map longer than
  :data:`MAX_ITEMS`), at most :data:`MAX_CONTAINERS` lists and maps in all, and
  nested at most :data:`MAX_DEPTH` deep (a body under 4 KiB is read in one pass with
  no Python call per list, and again with the record hook if a record tag is in it).

The sender checks the same frame, expansion, decoded-size and padding limits, so
its tensors never make ``decode_message`` refuse a message ``encode_message``
accepted (the body's limits are checked on receipt only). Errors quote untrusted
values only through :func:`excerpt`.
"""

from __future__ import annotations

import gc
import itertools
import math
import reprlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import torch

from transport._buffers import aligned_empty
from transport.codecs import CODEC_NAMES, FRAME_ALIGNMENT, Codec, CodecError, Encoded, get_codec
from transport.records import MAX_RECORD_NAME, RECORD_CLASSES, RECORD_NAMES, RecordType, record_types, register_record

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DTYPES",
    "MAX_CONTAINERS",
    "MAX_DEPTH",
    "MAX_EXPANSION",
    "MAX_FRAMES_PER_MESSAGE",
    "MAX_ITEMS",
    "Coded",
    "MessageTooLarge",
    "RAISE_THE_LIMIT",
    "RecordType",
    "WireError",
    "decode_message",
    "encode_message",
    "excerpt",
    "worth_logging",
    "keep_lossy_encoded",
    "record_types",
    "register_record",
]

WIRE_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
# Where the limit is set: the sender's error says it (a receiver only logs a short line).
RAISE_THE_LIMIT = (
    "raise the limit on every process that sends or takes it (python -m actors.node --max-message-bytes N "
    "on the head and every worker, LocalCluster(max_message_bytes=N), Cluster.connect(..., max_message_bytes=N)), "
    "or send less per message (job.save(DIR) writes a checkpoint without sending its tensors)")
_TENSOR_EXT = 1
_RECORD_EXT = 2
_MAX_NDIM = 32
_MAX_FRAMES_PER_TENSOR = 8

# The limits below are what a message may cost the receiver; each is far above what
# this project's messages need (the largest in the test suite: 54 frames, a body of
# 402 lists and maps, arrays of 400 items, nesting 6 deep, header strings of 13
# characters; state dicts travel as one flat map of tensors, a step's report as a
# list of spans, one small list per action).

MAX_FRAMES_PER_MESSAGE = 1 << 16
"""Frames in one message (a header and up to 8 per tensor): 32k int8 tensors, 64k raw."""
MAX_ITEMS = 1 << 20
"""Items in one msgpack array or map of a message body (8 MiB of pointers)."""
MAX_CONTAINERS = 1 << 14
"""Lists and maps in one message body. An empty list is one byte on the wire and about
60 in memory, and building one costs about 0.2 us: 5 MB of them took a second to
decode; refusing at this bound takes 2-4 ms, so a flood of them leaves the loop
free to answer pings within a few tens of ms."""
MAX_DEPTH = 64
"""Nesting of lists and maps in a message body (msgpack itself stops at 1024; code that
recurses over a payload, ``repr`` included, stops near 1000)."""
MAX_EXPANSION: dict[str, int] = {"none": 1, "fp16": 2, "bf16": 2, "int8": 4, "fp8": 4, "int4": 8}
"""Decoded bytes per encoded byte each codec may declare: its ratio when it decodes to
float32 (the scales make the block codecs' true ratio a little lower). A float64
declaration on a lossy codec would double it (int4: 16x), so those travel raw."""
_MAX_HEADER_STR = 64  # codec and dtype names, param names and values
_SHORT_HEADER = 4096  # bytes
_SHORT_BODY = 4096  # bytes
_MAX_PARAMS = 8
# The zero padding of the block codecs' last block, computed and thrown away by decode:
# at most the message's own element count or this many elements, whichever is more,
# so rows of one element with 2**20-element blocks cannot cost 4 MiB each.
_MAX_PADDING = 1 << 20

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
# What numpy views without a copy: a contiguous CPU tensor of these leaves as its own buffer.
_NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.int8, torch.uint8,
                           torch.int16, torch.int32, torch.int64, torch.bool})
_NONE = get_codec("none")
_MAX_NUMEL = 1 << 48  # the codecs' bound on an untrusted shape (transport.codecs)
_keep_encoded = False  # keep_lossy_encoded


def keep_lossy_encoded(keep: bool) -> None:
    """Whether :func:`decode_message` in this process hands a lossy codec's tensors on as
    :class:`~transport.codecs.Encoded` (their frames on the host, every size checked as always)
    instead of decoding them. A process that computes on a GPU sets it: the encoded bytes cross
    to the device and are decoded there (``stages.comm.device_io``), a quarter of float32's for
    int8, instead of the decoded values."""
    global _keep_encoded
    _keep_encoded = keep


class WireError(ValueError):
    """Bytes that do not form a valid message: the message is dropped, the receiver goes on."""


class MessageTooLarge(WireError):
    """A message over the configured size limit."""


@dataclass(frozen=True, slots=True)
class _RecordTag:
    """The ext value that opens a record: ``[tag, fields]`` becomes the record."""

    name: str


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
        payload: msgpack types, tensors and records (instances of classes given to
            :func:`register_record`), nested in lists, tuples, dicts and records.
            Wrap a tensor in :class:`Coded` to pick its codec, or pass an
            :class:`~transport.codecs.Encoded` to send one encoded already.
        codec: the codec for floating tensors not wrapped in :class:`Coded`;
            other tensors always travel raw, and so do float64 tensors under a
            lossy default (receivers refuse them: see :data:`MAX_EXPANSION`).
        max_bytes: the largest message, header and frames together, and the most
            bytes its tensors may take once decoded.

    Returns:
        ``[header, *tensor_frames]``; tensor frames are buffers over the encoded
        tensors (for ``none``, over the caller's tensor itself), so the caller must
        not modify a sent tensor in place until the send has completed.

    Raises:
        TypeError: an object msgpack cannot carry.
        transport.codecs.CodecError: a codec that does not exist or fit the tensor,
            or a lossy codec asked to carry float64 (cast to float32 or send it raw).
        MessageTooLarge: the encoded message exceeds ``max_bytes`` or
            :data:`MAX_FRAMES_PER_MESSAGE` frames, or its tensors ``max_bytes`` decoded.
    """
    encoder = getattr(_encoders, "encoder", None)
    if encoder is None or encoder.busy:  # busy: a record's fields encoded a message of their own
        encoder = _Encoder()
        if getattr(_encoders, "encoder", None) is None:
            _encoders.encoder = encoder
    return encoder.encode(payload, codec, max_bytes)


_encoders = threading.local()
_PACKER_KEEPS = 1 << 16  # bytes of buffer a thread's packer may keep between messages
_NO_TENSORS: list[Any] = []
_TENSOR_REFS = [msgpack.ExtType(_TENSOR_EXT, index.to_bytes(4, "little")) for index in range(256)]
_RECORD_TAGS: dict[str, msgpack.ExtType] = {}


class _Encoder:
    """One thread's msgpack packer (made once: a packer allocates its buffer) and the
    tensor table of the message it is encoding, set afresh for each message."""

    __slots__ = ("busy", "packer", "codec", "table", "frames", "decoded_nbytes", "numel_total",
                 "padding_total", "frame_nbytes")

    def __init__(self) -> None:
        self.busy = False
        self.packer = msgpack.Packer(default=self.extension, use_bin_type=True)
        self.table: list[list[Any]] = []
        self.frames: list[Any] = []

    def encode(self, payload: Any, codec: str, max_bytes: int) -> list[Any]:
        self.busy, self.codec, self.table, self.frames = True, codec, [], []
        self.decoded_nbytes = self.numel_total = self.padding_total = self.frame_nbytes = 0
        try:
            body = self.packer.pack(payload)
            table, frames = self.table, self.frames
            header = self.packer.pack([WIRE_VERSION, table, body])
            if len(header) > _PACKER_KEEPS:  # a packer keeps the buffer it grew: not one this large
                self.packer = msgpack.Packer(default=self.extension, use_bin_type=True)
        except BaseException:  # the packer may hold what it had packed, however large: start afresh
            self.packer = msgpack.Packer(default=self.extension, use_bin_type=True)
            raise
        finally:
            self.busy, self.table, self.frames = False, [], []  # hold no sender's tensor past the call
        total = len(header) + self.frame_nbytes
        if total > max_bytes or self.decoded_nbytes > max_bytes:
            raise MessageTooLarge(
                f"message is {total} bytes ({self.decoded_nbytes} bytes of tensors decoded), over the "
                f"limit of {max_bytes}; {RAISE_THE_LIMIT}"
            )
        if len(frames) >= MAX_FRAMES_PER_MESSAGE:
            raise MessageTooLarge(
                f"message has {len(frames) + 1} frames, over the limit of {MAX_FRAMES_PER_MESSAGE}; "
                "send the tensors in several messages"
            )
        if self.padding_total > max(self.numel_total, _MAX_PADDING):
            raise CodecError(_padding_problem(self.numel_total, self.padding_total))
        return [header, *frames]

    def extension(self, obj: Any) -> Any:
        """msgpack's ``default``: a record or a tensor, what msgpack cannot pack itself."""
        record = RECORD_NAMES.get(type(obj))
        if record is not None:
            tag = _RECORD_TAGS.get(record[0])
            if tag is None:
                tag = _RECORD_TAGS[record[0]] = msgpack.ExtType(_RECORD_EXT, record[0].encode())
            return [tag, record[1](obj)]
        if isinstance(obj, Encoded):  # encoded already (e.g. on a compute thread)
            return self._add(obj)
        if isinstance(obj, Coded):
            _check_sendable(obj.tensor)
            return self._add(get_codec(obj.codec).encode(obj.tensor.detach()))
        if not isinstance(obj, torch.Tensor):
            raise TypeError(
                f"cannot send an object of type {type(obj).__qualname__}: messages hold None, bool, "
                "int, float, str, bytes, lists, dicts, tensors and registered records (register_record)"
            )
        _check_sendable(obj)
        chosen = get_codec(self.codec)
        # e.g. integer tensors under a lossy default; float64 too (MAX_EXPANSION)
        if obj.dtype not in chosen.dtypes or (chosen.lossy and obj.dtype.itemsize > 4):
            chosen = _NONE
        if chosen is _NONE:
            buffer = _own_buffer(obj)
            if buffer is not None:  # the tensor's own bytes: no Encoded, no views (the common case)
                self.decoded_nbytes += buffer.nbytes
                self.frame_nbytes += buffer.nbytes
                self.numel_total += obj.numel()
                self.table.append(["none", _DTYPE_NAMES[obj.dtype], list(obj.shape), {}, 1])
                self.frames.append(buffer)
                return _tensor_ref(len(self.table) - 1)
        return self._add(chosen.encode(obj.detach()))

    def _add(self, encoded: Encoded) -> msgpack.ExtType:
        numel = math.prod(encoded.shape)
        problem = _expansion_problem(encoded.codec, encoded.dtype, numel, encoded.nbytes)
        if problem is not None:
            raise CodecError(f"cannot send {problem}; cast it to float32 first, or send it with codec 'none'")
        self.decoded_nbytes += numel * encoded.dtype.itemsize
        self.numel_total += numel
        self.padding_total += get_codec(encoded.codec).decoded_elements(encoded.shape, encoded.params) - numel
        self.table.append(_table_row(encoded))
        buffers = [_as_buffer(frame) for frame in encoded.frames]
        self.frames.extend(buffers)
        self.frame_nbytes += sum(buffer.nbytes for buffer in buffers)
        return _tensor_ref(len(self.table) - 1)


def _tensor_ref(index: int) -> msgpack.ExtType:
    if index < len(_TENSOR_REFS):
        return _TENSOR_REFS[index]
    return msgpack.ExtType(_TENSOR_EXT, index.to_bytes(4, "little"))


def decode_message(
    frames: Sequence[Any], *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, bad_records: list[WireError] | None = None
) -> Any:
    """Rebuilds a payload from frames received off the wire.

    Every size is checked before the memory it implies is committed (see the module
    docstring); tensors are only built once every table row has passed.

    Args:
        frames: ``zmq.Frame`` objects, bytes, bytearrays or memoryviews.
        max_bytes: the largest message accepted, header and frames together, and
            the most bytes its tensors may take once decoded.
        bad_records: where to report a record that cannot be rebuilt (a name no
            class is registered under, or fields its ``from_wire`` refuses) instead
            of raising; the record decodes as None. The rest of the message is sound
            then, so a receiver can answer its sender with a typed error.

    Returns:
        The payload, tensors rebuilt on the CPU, records rebuilt as their classes.
        A tensor sent with the ``none`` codec shares memory with its received frame; one
        sent with a lossy codec is an :class:`~transport.codecs.Encoded` where
        :func:`keep_lossy_encoded` asked for it.

    Raises:
        MessageTooLarge: over ``max_bytes`` on the wire or decoded, or over
            :data:`MAX_FRAMES_PER_MESSAGE` frames.
        WireError: for every other malformed input, with what was wrong.
    """
    if not frames:
        raise WireError("empty message: expected a header frame")
    if len(frames) > MAX_FRAMES_PER_MESSAGE:
        raise MessageTooLarge(f"message has {len(frames)} frames, over the limit of {MAX_FRAMES_PER_MESSAGE}")
    buffers = [_buffer_of(frame) for frame in frames]
    total = buffers[0].nbytes if len(buffers) == 1 else sum(buf.nbytes for buf in buffers)
    if total > max_bytes:
        raise MessageTooLarge(f"message is {total} bytes, over the limit of {max_bytes}")
    plain = _plain_body(buffers[0]) if len(buffers) == 1 else None
    if plain is not None:
        return _unpack_body(plain, _NO_TENSORS, bad_records)
    version, table, body = _unpack_header(buffers[0], num_tensor_frames=len(buffers) - 1)
    if version != WIRE_VERSION:
        raise WireError(f"wire version {excerpt(version)} is not supported (this side speaks {WIRE_VERSION})")
    tensors = _rebuild_tensors(table, buffers[1:], max_bytes=max_bytes)
    return _unpack_body(body, tensors, bad_records)


# The header of a message with no tensors (most actor calls and replies) is read by hand: its
# few fixed bytes, then the body's length. The bytes are the general form ([version, [], body]).
_PLAIN_HEADER = b"\x93" + msgpack.packb(WIRE_VERSION) + b"\x90"  # array of 3: the version, an empty table
_BIN_LENGTH_BYTES = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # msgpack bin 8, bin 16, bin 32


def _plain_body(buf: memoryview) -> memoryview | None:
    """The body of a one-frame message whose header is the version and an empty table, or None
    for any other header (the general path reads it, and names what is wrong with it)."""
    size = buf.nbytes
    start = len(_PLAIN_HEADER) + 1  # then the body's bin marker, its length, the body
    if size < start or buf[:start - 1] != _PLAIN_HEADER:
        return None
    width = _BIN_LENGTH_BYTES.get(buf[start - 1])
    if width is None or int.from_bytes(buf[start:start + width], "big") != size - start - width:
        return None
    return buf[start + width:]


def worth_logging(count: int) -> bool:
    """Whether the ``count``-th of a kind of refusal is logged: the 1st, 2nd, 4th, 8th..., so that a
    flood of bad input stays quiet while the count itself stays whole."""
    return count & (count - 1) == 0


def excerpt(value: object, limit: int = 80) -> str:
    """A short, escaped ``repr`` of an untrusted value, for log lines and error messages.

    At most ``limit`` characters, and its cost does not grow with the value: strings
    and bytes are cut before they are escaped, containers show their first items and
    levels only, tensors their dtype and shape.
    """
    try:
        text = _Excerpt(limit).repr(value)
    except Exception:  # e.g. an int too long to print; an excerpt must never fail
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


class _Excerpt(reprlib.Repr):
    """reprlib's bounded repr, made safe for every type a message can hold."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxlong = self.maxother = max(limit, 8)

    def _sliced(self, x: Any, level: int) -> str:
        head = x[: self.maxstring]  # cut first: escaping a 48 MiB value is the cost avoided
        return repr(head) if len(head) == len(x) else repr(head)[: self.maxstring] + self.fillvalue

    repr_str = repr_bytes = repr_bytearray = _sliced

    def repr_memoryview(self, x: memoryview, level: int) -> str:
        return f"<memoryview of {x.nbytes} bytes>"

    def repr_dict(self, x: dict[Any, Any], level: int) -> str:
        # reprlib sorts every key first: O(n log n) on an untrusted map.
        if not x:
            return "{}"
        if level <= 0:
            return "{" + self.fillvalue + "}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                  for k, v in itertools.islice(x.items(), self.maxdict)]
        if len(x) > self.maxdict:
            pieces.append(self.fillvalue)
        return "{" + ", ".join(pieces) + "}"

    def repr_Tensor(self, x: torch.Tensor, level: int) -> str:
        return f"tensor({_DTYPE_NAMES.get(x.dtype, str(x.dtype))}, {list(x.shape)})"

    def repr_instance(self, x: Any, level: int) -> str:
        if x is None or isinstance(x, (bool, float, complex)):
            return repr(x)
        return f"<{type(x).__name__}>"  # no repr of arbitrary objects: it could be anything


def _table_row(encoded: Encoded) -> list[Any]:
    return [
        encoded.codec,
        _DTYPE_NAMES[encoded.dtype],
        list(encoded.shape),
        dict(encoded.params),
        len(encoded.frames),
    ]


def _as_buffer(frame: torch.Tensor) -> memoryview:
    if frame.device.type != "cpu":
        # Codecs leave frames on the tensor's device. A stage actor moves its own to pinned
        # host memory, overlapped (stages.comm.device_io); any other sender pays a blocking copy.
        frame = frame.cpu()
    # numpy's view keeps the tensor alive for as long as ZeroMQ holds the buffer.
    return memoryview(frame.numpy())  # type: ignore[arg-type]  # ndarray exports the buffer protocol


def _check_sendable(tensor: torch.Tensor) -> None:
    """Raises TypeError for a tensor no codec can carry: one without data, or not dense."""
    if tensor.layout != torch.strided:
        raise TypeError(f"cannot send a {str(tensor.layout).removeprefix('torch.')} tensor: messages carry dense "
                        "tensors; send tensor.to_dense(), or its indices and values as tensors of their own")
    if tensor.is_meta:
        raise TypeError(f"cannot send a tensor on the meta device (shape {list(tensor.shape)}): it has no data; "
                        "materialize it first (torch.empty_like(tensor, device='cpu'), or load its weights)")


def _own_buffer(tensor: torch.Tensor) -> memoryview | None:
    """The bytes of a tensor the ``none`` codec sends as they are, or None where that codec's
    own path is needed (another device, a strided view, a dtype numpy cannot view, no elements)."""
    if not (tensor.is_cpu and tensor.dtype in _NUMPY_DTYPES and tensor.is_contiguous() and tensor.numel()):
        return None
    # numpy's view keeps the tensor alive for as long as ZeroMQ holds the buffer.
    array = (tensor.detach() if tensor.requires_grad else tensor).numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]  # ndarray exports the buffer protocol


def _buffer_of(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    try:
        view = memoryview(buf)
    except TypeError:
        raise WireError(f"frame of type {type(frame).__name__} is not a buffer") from None
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


_T = TypeVar("_T")


class _ContainerBudget:
    """A msgpack list_hook and object_hook that counts containers and refuses one too many."""

    __slots__ = ("limit", "used", "what")

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.used, self.what = limit, 0, what

    def __call__(self, container: _T) -> _T:
        self.used += 1
        if self.used > self.limit:
            raise WireError(f"{self.what} holds more than {self.limit} lists and maps")
        return container


def _unpack_header(buf: memoryview, *, num_tensor_frames: int) -> tuple[Any, list[Any], bytes]:
    # A valid header is [version, table, body] with a [codec, dtype, shape, params,
    # num_frames] row per tensor, and every tensor has a frame: so no array is longer
    # than a shape or the frame count, and it holds 2 + 3 * rows lists and maps (the
    # budget has room for a few rows more, which the row checks then name precisely).
    # A header of a few KiB costs at most its length whatever it holds: only a longer one is counted.
    count = _ContainerBudget(2 + 3 * (num_tensor_frames + 8), "header") if buf.nbytes > _SHORT_HEADER else None
    try:
        header = msgpack.unpackb(
            buf, raw=False, strict_map_key=False, timestamp=0, list_hook=count, object_hook=count,
            max_str_len=_MAX_HEADER_STR, max_bin_len=buf.nbytes, max_ext_len=0,
            max_array_len=max(_MAX_NDIM, num_tensor_frames), max_map_len=_MAX_PARAMS,
        )
    except WireError:
        raise
    except Exception as exc:
        raise WireError(f"malformed header: {type(exc).__name__}: {_clip(exc)}") from None
    if not (isinstance(header, list) and len(header) == 3):
        raise WireError("malformed header: expected [version, tensor_table, body]")
    version, table, body = header
    if not isinstance(table, list) or not isinstance(body, bytes):
        raise WireError("malformed header: tensor table must be a list and body bytes")
    return version, table, body


class _RecordBuilder(_ContainerBudget):
    """The body's list hook: counts containers against the budget, and turns each
    ``[record tag, fields]`` list into its registered record class.

    msgpack builds containers inside out, so a record's fields (nested records
    included) are rebuilt before the record itself. One hook does both, so a body
    of many small lists pays one Python call per list, as it did before records.
    """

    __slots__ = ("bad", "opened", "built")

    def __init__(self, bad: list[WireError] | None) -> None:
        super().__init__(MAX_CONTAINERS, "message body")
        self.bad = bad
        self.opened = self.built = 0

    def open(self, data: bytes) -> _RecordTag:
        try:
            name = data.decode()
        except UnicodeDecodeError:
            raise WireError(f"record name {excerpt(data)} is not UTF-8") from None
        self.opened += 1
        return _RecordTag(name)

    def list_hook(self, items: list[Any]) -> Any:
        self.used += 1
        if self.used > self.limit:
            raise WireError(f"{self.what} holds more than {self.limit} lists and maps")
        # A record's tag is decoded before the list that holds it ends: with none
        # pending, this list is no record.
        if self.opened == self.built or not items or type(items[0]) is not _RecordTag:
            return items
        return self._build(items[0].name, items)

    def _build(self, name: str, items: list[Any]) -> Any:
        self.built += 1
        if len(items) != 2 or not isinstance(items[1], dict):
            raise WireError(f"record {excerpt(name)} must be [name, fields map]")
        cls = RECORD_CLASSES.get(name)
        try:
            if cls is None:
                raise WireError(
                    f"unknown record type {excerpt(name)}: no class is registered under that name here "
                    "(the module that defines it is not imported, or the peers run different versions)"
                )
            try:
                return cls.from_wire(items[1])
            except Exception as exc:  # the class's own strict rules: typed here, whatever it raised
                raise WireError(f"record {name}: {type(exc).__name__}: {_clip(exc)}") from None
        except WireError as exc:
            if self.bad is None:
                raise
            self.bad.append(exc)
            return None

    def check_closed(self) -> None:
        if self.opened != self.built:
            raise WireError(f"{self.opened - self.built} record tag(s) outside a [name, fields] list")


class _HasRecord(Exception):
    """A record tag in a body read without the record hook: it is read again with it."""


def _unpack_body(body: bytes | memoryview, tensors: list[torch.Tensor | Encoded],
                 bad_records: list[WireError] | None) -> Any:
    """The payload of a message body, its tensor references replaced by ``tensors``.

    A short body is read first without the record hook, a Python call per list that only a
    body holding records needs (most hold none): the first record tag sends it round again
    with it. A long one is read with it at once, so what a second round costs stays small.
    """
    records = None if len(body) <= _SHORT_BODY else _RecordBuilder(bad_records)

    def ext_hook(code: int, data: bytes) -> torch.Tensor | Encoded | _RecordTag:
        if code == _RECORD_EXT:
            if records is None:
                raise _HasRecord
            return records.open(data)
        if code != _TENSOR_EXT or len(data) != 4:
            raise WireError(f"unknown msgpack extension type {code}")
        index = int.from_bytes(data, "little")
        if index >= len(tensors):
            raise WireError(f"tensor reference {index} but the table has {len(tensors)} rows")
        return tensors[index]

    if records is not None:
        return _unpack_body_once(body, ext_hook, records)
    try:
        return _unpack_body_once(body, ext_hook, None)
    except _HasRecord:
        records = _RecordBuilder(bad_records)
        return _unpack_body_once(body, ext_hook, records)


def _unpack_body_once(body: bytes | memoryview, ext_hook: Callable[[int, bytes], Any],
                      records: _RecordBuilder | None) -> Any:
    size = len(body)
    # Each list or map takes a byte at least, so a short body needs no counting, and no
    # body nests deeper than it has containers. The record builder counts as it builds.
    count: _ContainerBudget | None = None
    if size > MAX_DEPTH:
        count = records if records is not None else _ContainerBudget(MAX_CONTAINERS, "message body")
    # Thousands of new lists and maps trigger the cyclic GC, and a full collection walks
    # every object of the process (torch's included: ~100 ms). Nothing here makes a cycle.
    pause_gc = count is not None and gc.isenabled()
    if pause_gc:
        gc.disable()
    try:
        payload = msgpack.unpackb(
            body, ext_hook=ext_hook, raw=False, strict_map_key=False, timestamp=0,
            list_hook=records.list_hook if records is not None else count, object_hook=count,
            max_str_len=size, max_bin_len=size, max_ext_len=MAX_RECORD_NAME,  # a name or a tensor reference
            max_array_len=min(size, MAX_ITEMS), max_map_len=min(size // 2, MAX_ITEMS),
        )
    except (WireError, _HasRecord):
        raise
    except Exception as exc:  # msgpack raises many types for corrupt input
        raise WireError(f"malformed message body: {type(exc).__name__}: {_clip(exc)}") from None
    finally:
        if pause_gc:
            gc.enable()
    if records is not None:
        records.check_closed()
    if count is not None and count.used > MAX_DEPTH:
        _check_depth(payload)
    return payload


def _check_depth(payload: Any) -> None:
    """Raises WireError if lists and maps nest deeper than MAX_DEPTH in ``payload``.

    Level by level, each level's containers picked out of the one above in C
    (``compress`` over a membership test of each item's type): a body of many small
    lists (a stage's report holds one per action) costs no Python call per item.
    """
    containers = {list, dict, *RECORD_NAMES}
    is_container = containers.__contains__
    level = [payload] if type(payload) in containers else []
    for _ in range(MAX_DEPTH):
        deeper: list[Any] = []
        for container in level:
            kind = type(container)
            if kind is list:
                items: Any = container
            elif kind is dict:
                items = container.values()
            else:  # a record: its fields
                items = list(RECORD_NAMES[kind][1](container).values())
            deeper += itertools.compress(items, map(is_container, map(type, items)))
        if not deeper:
            return
        level = deeper
    raise WireError(f"message body nests lists and maps more than {MAX_DEPTH} deep")


def _rebuild_tensors(table: list[Any], frames: list[memoryview], *, max_bytes: int
                     ) -> list[torch.Tensor | Encoded]:
    # Every row is checked, and the totals, before the first tensor is built.
    checked: list[tuple[Codec, str, torch.dtype, tuple[int, ...], dict[str, Any], list[memoryview]]] = []
    position = decoded_total = numel_total = padding_total = 0
    for index, row in enumerate(table):
        codec_name, dtype, shape, params, num_frames = _check_row(index, row)
        numel = math.prod(shape)
        if (codec_name == "none" and num_frames == 1 and not params and 0 < numel <= _MAX_NUMEL
                and dtype in _NONE.dtypes and position < len(frames)):
            # What the none codec's frame_sizes checks, inline: the common row, a tensor's own bytes
            buf = frames[position]
            if buf.nbytes != numel * dtype.itemsize:
                raise WireError(f"tensor {index} frame 0: {buf.nbytes} bytes, but none "
                                f"{list(shape)} {_DTYPE_NAMES[dtype]} needs {numel * dtype.itemsize}")
            position += 1
            decoded_total += buf.nbytes
            if decoded_total > max_bytes:
                raise MessageTooLarge(
                    f"tensor {index}: the message's tensors would decode to more than the limit of {max_bytes} bytes"
                )
            numel_total += numel
            checked.append((_NONE, codec_name, dtype, shape, params, [buf]))
            continue
        codec = get_codec(codec_name)
        try:
            sizes = codec.frame_sizes(dtype, shape, params)
            computed = codec.decoded_elements(shape, params)
        except CodecError as exc:
            raise WireError(f"tensor {index}: {_clip(exc)}") from None
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
        problem = _expansion_problem(codec_name, dtype, numel, sum(sizes))
        if problem is not None:
            raise WireError(f"tensor {index}: refused {problem}")
        decoded_total += numel * dtype.itemsize
        if decoded_total > max_bytes:
            raise MessageTooLarge(
                f"tensor {index}: the message's tensors would decode to more than the limit of {max_bytes} bytes"
            )
        numel_total += numel
        padding_total += computed - numel
        checked.append((codec, codec_name, dtype, shape, params, mine))
    if position != len(frames):
        raise WireError(f"{len(frames) - position} extra frame(s) after the last tensor")
    if padding_total > max(numel_total, _MAX_PADDING):
        raise WireError(_padding_problem(numel_total, padding_total))
    tensors: list[torch.Tensor | Encoded] = []
    for index, (codec, codec_name, dtype, shape, params, mine) in enumerate(checked):
        if codec is _NONE:
            tensors.append(_raw_tensor(mine[0], dtype, shape))
            continue
        encoded = Encoded(codec=codec_name, dtype=dtype, shape=shape, params=params,
                          frames=tuple(_uint8_tensor(buf) for buf in mine))
        if _keep_encoded:
            tensors.append(encoded)
            continue
        try:
            tensors.append(codec.decode_checked(encoded))  # every size was checked above
        except Exception as exc:  # frame_sizes vetted the row; stay typed regardless
            raise WireError(f"tensor {index}: cannot decode: {type(exc).__name__}: {_clip(exc)}") from None
    return tensors


def _expansion_problem(codec_name: str, dtype: torch.dtype, numel: int, encoded_nbytes: int) -> str | None:
    """Why a tensor's decoded size is out of proportion to its frames, or None if it is not."""
    decoded_nbytes = numel * dtype.itemsize
    ratio = MAX_EXPANSION.get(codec_name, 1)
    if decoded_nbytes <= ratio * encoded_nbytes:
        return None
    return (
        f"a {_DTYPE_NAMES.get(dtype, dtype)} tensor of {numel} elements in {encoded_nbytes} bytes of "
        f"codec {codec_name}: it would expand {decoded_nbytes / max(1, encoded_nbytes):.1f}x, over that codec's "
        f"{ratio}x (lossy codecs carry float32, float16 and bfloat16)"
    )


def _padding_problem(numel: int, padding: int) -> str:
    return (
        f"the codecs' blocks pad {numel} elements with {padding} zeros to decode, more than "
        f"max({numel}, {_MAX_PADDING}); use blocks no larger than the tensors, or fewer tensors a message"
    )


def _check_row(index: int, row: Any) -> tuple[str, torch.dtype, tuple[int, ...], dict[str, Any], int]:
    if not (isinstance(row, list) and len(row) == 5):
        raise WireError(f"tensor {index}: malformed table row")
    codec_name, dtype_name, shape, params, num_frames = row
    if not isinstance(codec_name, str) or codec_name not in CODEC_NAMES:
        raise WireError(f"tensor {index}: unknown codec {excerpt(codec_name)}; known codecs: {', '.join(CODEC_NAMES)}")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise WireError(f"tensor {index}: unknown dtype {excerpt(dtype_name)}; known: {', '.join(DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_NDIM
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise WireError(f"tensor {index}: shape must be a list of at most {_MAX_NDIM} non-negative ints")
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise WireError(f"tensor {index}: codec params must be a map with string keys")
    if type(num_frames) is not int or not 0 <= num_frames <= _MAX_FRAMES_PER_TENSOR:
        raise WireError(f"tensor {index}: bad frame count {excerpt(num_frames)}")
    return codec_name, DTYPES[dtype_name], tuple(shape), params, num_frames


def _clip(exc: BaseException, limit: int = 200) -> str:
    """An exception's text cut to ``limit`` characters (its text may quote the input)."""
    text = str(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _raw_tensor(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor that travelled with the ``none`` codec, its frame checked to be its size: over the
    frame itself where that is writable and aligned, else over one aligned copy (see
    :data:`~transport.codecs.FRAME_ALIGNMENT`; libzmq hands large frames 8 bytes past a 16-byte
    boundary)."""
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    alignment = max(dtype.itemsize, FRAME_ALIGNMENT)
    tensor = None if buf.readonly else torch.frombuffer(buf, dtype=dtype)
    if tensor is None or tensor.data_ptr() % alignment:
        # One plain copy on this thread (malloc's blocks are 16-byte aligned; where they
        # are not, a buffer that is).
        tensor = torch.frombuffer(bytearray(buf), dtype=dtype)
        if tensor.data_ptr() % alignment:
            aligned = aligned_empty(buf.nbytes)
            aligned.copy_(tensor.view(torch.uint8))
            tensor = aligned.view(dtype)
    return tensor if len(shape) == 1 else tensor.view(shape)


def _uint8_tensor(buf: memoryview) -> torch.Tensor:
    if buf.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if buf.readonly:
        # torch.frombuffer wants a writable buffer; bytes objects (local and test
        # callers) pay one copy, frames received from ZeroMQ do not.
        buf = memoryview(bytearray(buf))
    return torch.frombuffer(buf, dtype=torch.uint8)
