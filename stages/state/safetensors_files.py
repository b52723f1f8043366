"""Weights as people have them: a model directory's ``model.safetensors``, or the shards a
``model.safetensors.index.json`` lists (Hugging Face's layout), read as a checkpoint.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and ``data_offsets`` in the data that follows) and the tensors' raw bytes,
row-major and little-endian, as this project's own shard files hold them. So a directory
of them becomes a :class:`~stages.state.manifest.Manifest` of the ``safetensors`` source,
made from the headers alone (a few kilobytes: no tensor is read), and a load goes the way
of a checkpoint's: the head places each key on the stage that holds it, and every stage
reads only its own tensors' bytes from the files (a seek and a read each), checks them
and applies them only when every stage found nothing wrong. No process ever holds the
whole model. The files carry no checksums (a part's ``crc32`` is None), and no optimizer
state: such a load takes the weights alone.

The headers come from someone else's file, so everything in them is checked: a header of
at most :data:`MAX_HEADER_BYTES`, known dtypes, offsets inside the file that match the
shape, and file names without a directory in them.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any

import torch

from stages.state.manifest import (
    DTYPES,
    SAFETENSORS,
    SAFETENSORS_FILE,
    CheckpointError,
    Manifest,
    TensorEntry,
    TensorPart,
    open_inside,
)

__all__ = ["INDEX", "MAX_HEADER_BYTES", "SINGLE", "TAGS", "header", "index", "manifest", "present"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit
_MAX_INDEX_BYTES = 64 << 20
# safetensors' dtype names -> the manifest's (torch's, without "torch.").
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "C64": "complex64",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
TAGS = {name: tag for tag, name in _DTYPES.items()}  # the manifest's dtype names -> safetensors' own


def header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The start of a safetensors file that holds ``tensors`` back to back in their order: the
    header's length and the header, padded with spaces so the data begins 8-byte aligned.

    ``__metadata__`` says ``"format": "pt"`` (what Hugging Face's loaders ask of a file), and
    ``metadata`` besides. Callers order tensors by falling element size, so that every tensor
    begins at a multiple of its own (a memory-mapped load then needs no copy to align it).

    Raises:
        CheckpointError: a dtype safetensors has no name for (complex128).
    """
    described: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, tensor in tensors.items():
        tag = TAGS.get(str(tensor.dtype).removeprefix("torch."))
        if tag is None:
            raise CheckpointError(f"cannot write {name} as safetensors", [f"safetensors has no {tensor.dtype}"])
        nbytes = tensor.numel() * tensor.element_size()
        described[name] = {"dtype": tag, "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(described, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def index(weight_map: Mapping[str, str], total_size: int, metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A ``model.safetensors.index.json`` as Hugging Face writes it: each tensor's file, and the weights' bytes."""
    return {"metadata": {"total_size": total_size, **(metadata or {})}, "weight_map": dict(weight_map)}


def present(directory: str) -> bool:
    """Whether ``directory`` holds weights in safetensors files (an index, or one ``model.safetensors``)."""
    return os.path.isfile(os.path.join(directory, INDEX)) or os.path.isfile(os.path.join(directory, SINGLE))


def _bad(path: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{path} cannot be read as safetensors weights", [problem])


def _files(directory: str, follow_links: bool) -> list[str]:
    """The safetensors files of ``directory``: the index's, in order of first mention, or the one file."""
    index = os.path.join(directory, INDEX)
    if not os.path.isfile(index):
        return [SINGLE]
    try:
        with open_inside(index, follow_links) as f:
            text = f.read(_MAX_INDEX_BYTES + 1)
        data = json.loads(text) if len(text) <= _MAX_INDEX_BYTES else None
    except (OSError, ValueError) as exc:
        raise _bad(index, str(exc)[:200]) from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise _bad(index, "expected a JSON object with a non-empty weight_map of tensor name to file")
    for key, name in weight_map.items():  # checked before dict.fromkeys: a list there was "unhashable type"
        if not isinstance(name, str) or SAFETENSORS_FILE.fullmatch(name) is None:
            raise _bad(index, f"{str(key)[:80]}: {str(name)[:80]!r} is not a safetensors file name in this directory")
    return list(dict.fromkeys(weight_map.values()))


def _header(path: str, follow_links: bool) -> tuple[dict[str, Any], int, int]:
    """A file's header, where its data begins, and its size."""
    try:
        with open_inside(path, follow_links) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) != 8:
                raise _bad(path, "shorter than a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise _bad(path, f"a header of {length} bytes (at most {MAX_HEADER_BYTES}, inside the file)")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise _bad(path, str(exc)) from exc
    except ValueError as exc:
        raise _bad(path, f"the header is not JSON: {str(exc)[:120]}") from exc
    if not isinstance(header, dict):
        raise _bad(path, "the header is not a JSON object")
    return header, 8 + length, size


def _entry(path: str, name: str, info: Any, start: int, size: int) -> TensorEntry:
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or info["dtype"] not in _DTYPES:
        raise _bad(path, f"{name[:80]}: an unknown dtype {str(info.get('dtype') if isinstance(info, dict) else info)[:20]!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise _bad(path, f"{name[:80]}: shape and data_offsets must be lists of integers >= 0")
    dtype = _DTYPES[info["dtype"]]
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    begin, end = offsets
    if end - begin != nbytes or start + end > size:
        raise _bad(path, f"{name[:80]}: data_offsets {offsets} do not hold a {dtype} tensor of shape {shape} "
                         "inside the file")
    part = TensorPart(file=os.path.basename(path), offset=start + begin, nbytes=nbytes, shape=list(shape), crc32=None)
    return TensorEntry(shape=list(shape), dtype=dtype, shard=None, parts=[part])


def manifest(directory: str, *, follow_links: bool = False) -> Manifest:
    """The weights in ``directory``'s safetensors files, as a manifest of the ``safetensors`` source;
    ``follow_links``: files that are symbolic links are read through (an admin's load; see
    :func:`~stages.state.manifest.open_inside`), here and where the stages read them.

    Raises:
        CheckpointError: no such files, or a file or index that is not what it claims (named).
    """
    model: dict[str, TensorEntry] = {}
    sizes: dict[str, int] = {}
    for name in _files(directory, follow_links):
        path = os.path.join(directory, name)
        header, start, size = _header(path, follow_links)
        sizes[name] = size
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if key in model:
                raise _bad(path, f"{key[:80]} is in two files")
            model[key] = _entry(path, key, info, start, size)
    return Manifest(step=0, optimizer="", files=sizes, model=model, optimizer_state={},
                    job={"source": SAFETENSORS}, source=SAFETENSORS, links=follow_links)
