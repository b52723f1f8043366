"""Checkpoints that cannot lie: written by every stage in parallel, checksummed, fsynced, switched atomically.

A checkpoint directory ``DIR`` holds versions and a pointer to the complete one::

    DIR/LATEST                  "v000007": the newest complete version (replaced with os.replace, fsynced)
    DIR/v000007/manifest.json   every tensor: whole shape, dtype, tensor-parallel split, and each part's
                                file, offset, size and crc32
    DIR/v000007/p0-t0.bin       the raw bytes of one stage actor's tensors (pipeline rank 0, tensor rank 0),
                                back to back: no pickle, every byte covered by a checksum
    DIR/.staging-v000008-1f2e/  a save in progress, or one that was killed (the next save removes it)

A save makes a staging directory, lets every writer put its file there (fsynced),
writes the manifest, renames the staging directory to its version, and only then
points ``LATEST`` at it; old versions go after the pointer has moved. A kill at any
instant therefore leaves ``LATEST`` naming a complete version: the old one or the new
one, never none and never a mix. The steps are named by :func:`_reached`, which tests
use to stop a writer at each of them.

Keys are the unpartitioned model's (``3.fc1.weight``), and optimizer state is kept per
parameter under the same key, so a checkpoint loads into any layout: another stage
count, schedule, tensor- or data-parallel degree. Every node reads and writes ``DIR``
itself, so on several machines it must be on a filesystem every node mounts at the
same path.

This module is the filesystem: the directory, its versions and the shards' bytes;
:mod:`stages.state.manifest` is what a manifest says (and :class:`CheckpointError`),
:mod:`stages.state.stage_checkpoint` what one stage writes and loads, and the
scheduler's controller runs the two phases.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from stages.build.tensor_parallel import ShardSpec, gather_tensor
from stages.state.manifest import (
    DTYPES,
    FILE,
    FORMAT,
    CheckpointError,
    Manifest,
    TensorEntry,
    TensorPart,
    layer_of,
    merge_written,
)

__all__ = [
    "FORMAT", "CheckpointError", "Manifest", "TensorEntry", "TensorPart", "begin_version", "check_directory",
    "check_staging", "check_version", "commit_version", "dtype_name", "layer_of", "merge_written", "read_entry",
    "read_manifest", "write_tensors",
]

LATEST = "LATEST"
MANIFEST = "manifest.json"
_STAGING_PREFIX = ".staging-"
_VERSION = re.compile(r"v(\d{6})")
_MAX_PATH = 4096
_MAX_MANIFEST_BYTES = 256 << 20
_SHARED_FS = ("on several machines the checkpoint directory must be on a filesystem every node mounts "
              "at the same path")


def _reached(point: str) -> None:
    """A named step of a save (``staged``, ``tensor_written``, ``manifest_written``, ``renamed``,
    ``pointer_written``, ``pointed``, ``old_removed``); tests replace this to stop the process there."""


# --- bytes on disk ---------------------------------------------------------------------------


def _raw(tensor: torch.Tensor) -> Any:
    """The tensor's bytes as a writable buffer (any dtype: bf16 too, through a uint8 view)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tensors(path: str, tensors: Mapping[str, torch.Tensor]) -> tuple[int, dict[str, TensorPart]]:
    """Writes ``tensors`` back to back into a new file at ``path`` and fsyncs it.

    Returns:
        The file's size and each tensor's part (offset, size, shape, crc32).

    Raises:
        CheckpointError: the file cannot be made (e.g. the directory is not on this node).
    """
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise CheckpointError(f"cannot write {path}", [f"{directory} does not exist on this node; {_SHARED_FS}"])
    parts: dict[str, TensorPart] = {}
    offset = 0
    try:
        with open(path, "xb") as f:
            for key, tensor in tensors.items():
                data = _raw(tensor.detach().to("cpu").contiguous())
                f.write(data)
                parts[key] = TensorPart(file=os.path.basename(path), offset=offset, nbytes=data.nbytes,
                                        shape=list(tensor.shape), crc32=zlib.crc32(data))
                offset += data.nbytes
                _reached("tensor_written")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise CheckpointError(f"cannot write {path}", [str(exc)]) from exc
    return offset, parts


def _read_part(version: str, part: TensorPart, dtype: torch.dtype, files: Mapping[str, int], label: str) -> torch.Tensor:
    path = os.path.join(version, part.file)
    where = f"{path}, {label}"
    tensor = torch.empty(part.shape, dtype=dtype)
    raw = _raw(tensor)
    if raw.nbytes != part.nbytes or part.file not in files:
        raise CheckpointError("bad checkpoint", [f"{where}: the manifest's size or file does not fit the entry"])
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != files[part.file]:
                raise CheckpointError("bad checkpoint",
                                      [f"{path}: {size} bytes, the manifest says {files[part.file]} (truncated?)"])
            f.seek(part.offset)
            got = f.readinto(raw)
    except OSError as exc:
        raise CheckpointError("bad checkpoint", [f"{where}: {exc}"]) from exc
    if got != part.nbytes:
        raise CheckpointError("bad checkpoint", [f"{where}: only {got} of {part.nbytes} bytes there"])
    crc = zlib.crc32(raw)
    if crc != part.crc32:
        raise CheckpointError("bad checkpoint", [
            f"{where}: checksum mismatch (crc32 {crc:08x}, the manifest says {part.crc32:08x}): "
            "the file was changed or damaged after it was written"])
    return tensor


def read_entry(version: str, entry: TensorEntry, files: Mapping[str, int], label: str) -> torch.Tensor:
    """The whole tensor ``entry`` describes, every part's checksum verified.

    Raises:
        CheckpointError: a missing or short file, a checksum mismatch, parts that do not
            make the recorded shape; the message names the file and the key.
    """
    dtype = DTYPES[entry.dtype]
    parts = [_read_part(version, part, dtype, files, label) for part in entry.parts]
    whole = gather_tensor(parts, ShardSpec(*entry.shard)) if entry.shard is not None else parts[0]
    if list(whole.shape) != entry.shape:
        raise CheckpointError("bad checkpoint", [f"{label}: parts make {list(whole.shape)}, not {entry.shape}"])
    return whole


def dtype_name(dtype: torch.dtype) -> str:
    """How the manifest names ``dtype`` (``float32``).

    Raises:
        CheckpointError: a dtype checkpoints do not store.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise CheckpointError(f"cannot checkpoint a {name} tensor", [f"supported: {', '.join(DTYPES)}"])
    return name


# --- the directory: versions and the pointer ------------------------------------------------------


def check_directory(path: Any) -> str:
    """``path`` if it is a usable checkpoint directory name: absolute and normalized.

    Paths come from clients, and every node resolves them on its own: a relative one
    would land in each node's working directory, so it is refused (``Job.save``
    resolves it against the driver's working directory first).

    Raises:
        CheckpointError: not a string, too long, relative, or not normalized (``..``).
    """
    if not isinstance(path, str) or not path or len(path) > _MAX_PATH or "\0" in path:
        raise CheckpointError(f"a checkpoint directory must be a path of at most {_MAX_PATH} characters",
                              [f"got {str(path)[:80]!r}"])
    if not os.path.isabs(path) or os.path.normpath(path) != path:
        raise CheckpointError(f"a checkpoint directory must be absolute and normalized: {path[:200]!r}",
                              [f"e.g. {os.path.normpath(os.path.join('/', path))[:200]!r}"])
    return path


def _versions(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if _VERSION.fullmatch(n))


def _refuse_foreign(directory: str, entries: list[str]) -> None:
    """A directory that already holds something other than checkpoints is not ours to fill or clean."""
    ours = [LATEST, f"{LATEST}.tmp"]
    foreign = [n for n in entries if n not in ours and not _VERSION.fullmatch(n) and not n.startswith(_STAGING_PREFIX)]
    if foreign and LATEST not in entries:
        raise CheckpointError(
            f"{directory} is not an actorpipe checkpoint directory (no {LATEST}) and is not empty",
            [f"it holds {', '.join(sorted(foreign)[:5])}; save to a new or empty directory"])


def begin_version(directory: str) -> str:
    """Makes the staging directory of the next version (after removing a killed save's leftovers).

    Returns:
        Its path, ``DIR/.staging-vNNNNNN-XXXXXXXX``.

    Raises:
        CheckpointError: ``directory`` cannot be made, or holds something else.
    """
    directory = check_directory(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        entries = os.listdir(directory)
        _refuse_foreign(directory, entries)
        for name in entries:
            if name.startswith(_STAGING_PREFIX):
                shutil.rmtree(os.path.join(directory, name))
        numbers = [int(n[1:]) for n in _versions(directory)]
        staging = os.path.join(directory, f"{_STAGING_PREFIX}v{max(numbers, default=0) + 1:06d}-{secrets.token_hex(4)}")
        os.mkdir(staging)
        _fsync_directory(directory)
        _fsync_directory(os.path.dirname(directory))
    except OSError as exc:
        raise CheckpointError(f"cannot write a checkpoint to {directory}", [str(exc)]) from exc
    _reached("staged")
    return staging


def check_staging(staging: Any, name: str = "p0-t0.bin") -> str:
    """The path of shard file ``name`` in ``staging``, both checked (they come over the wire).

    Raises:
        CheckpointError: not a staging directory, or not a shard file name.
    """
    check_directory(staging)
    if not os.path.basename(staging).startswith(_STAGING_PREFIX) or FILE.fullmatch(name) is None:
        raise CheckpointError(f"refused to write {name[:40]!r} into {staging[:200]!r}",
                              ["not a staging directory or not a shard file name"])
    return os.path.join(staging, name)


def check_version(version: Any) -> str:
    """``version`` if it names a version directory (``/abs/DIR/v000007``); it comes over the wire.

    Raises:
        CheckpointError: it does not.
    """
    check_directory(version)
    if _VERSION.fullmatch(os.path.basename(version)) is None:
        raise CheckpointError(f"{version[:200]!r} is not a checkpoint version directory")
    return version


def commit_version(directory: str, staging: str, manifest: Manifest) -> str:
    """Completes a save: manifest, fsync, rename to the version, then the pointer; removes old versions.

    Returns:
        The new version's path.

    Raises:
        CheckpointError: a shard file is missing or not the size its writer reported.
    """
    directory = check_directory(directory)
    check_staging(staging)
    if os.path.dirname(staging) != directory:
        raise CheckpointError(f"{staging[:200]} is not in {directory[:200]}")
    for name, size in manifest.files.items():
        path = os.path.join(staging, name)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            raise CheckpointError(f"the save to {directory} is incomplete", [f"{path} is missing or not {size} bytes"])
    with open(os.path.join(staging, MANIFEST), "x") as f:
        json.dump(manifest.to_wire(), f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_directory(staging)
    _reached("manifest_written")
    name = os.path.basename(staging).removeprefix(_STAGING_PREFIX).split("-")[0]
    version = os.path.join(directory, name)
    os.rename(staging, version)
    _fsync_directory(directory)
    _reached("renamed")
    pointer = os.path.join(directory, f"{LATEST}.tmp")
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    _reached("pointer_written")
    os.replace(pointer, os.path.join(directory, LATEST))
    _fsync_directory(directory)
    _reached("pointed")
    for old in _versions(directory):
        if old != name:
            shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
            _reached("old_removed")
    return version


def read_manifest(directory: str) -> tuple[str, Manifest]:
    """The version ``LATEST`` points at, and its manifest.

    Raises:
        CheckpointError: no such directory, not a checkpoint (e.g. one written before
            checkpoints were versioned), or a malformed pointer or manifest.
    """
    directory = check_directory(directory)
    if not os.path.isdir(directory):
        raise CheckpointError(f"no checkpoint at {directory}: no such directory on this node", [_SHARED_FS])
    pointer = os.path.join(directory, LATEST)
    if not os.path.isfile(pointer):
        problem = (f"{MANIFEST} and {LATEST} are missing; model.pt is the unversioned format of earlier "
                   "actorpipe: load it with torch.load(path, weights_only=True) and job.load_state_dict"
                   if os.path.exists(os.path.join(directory, "model.pt")) else f"it has no {LATEST} file")
        raise CheckpointError(f"{directory} is not an actorpipe checkpoint", [problem])
    with open(pointer, "rb") as f:
        name = f.read(64).decode("ascii", "replace").strip()
    if _VERSION.fullmatch(name) is None:
        raise CheckpointError(f"{pointer} does not name a version", [f"it says {name[:20]!r}"])
    version = os.path.join(directory, name)
    path = os.path.join(version, MANIFEST)
    try:
        with open(path, "rb") as f:
            text = f.read(_MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"{LATEST} names {name}, which cannot be read", [str(exc)]) from exc
    if len(text) > _MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path} is over {_MAX_MANIFEST_BYTES} bytes")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{path} is not JSON", [str(exc)[:200]]) from exc
    return version, Manifest.from_wire(data)
