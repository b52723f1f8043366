"""Checkpoints that cannot lie: written by every stage in parallel, checksummed, fsynced, switched atomically.

A checkpoint directory ``DIR`` holds versions and a pointer to the complete one::

    DIR/LATEST                  "v000007": the newest complete version (replaced with os.replace, fsynced)
    DIR/v000007/manifest.json   every tensor: whole shape, dtype, tensor-parallel split, and each part's
                                file, offset, size and crc32
    DIR/v000007/p0-t0.safetensors
                                one stage actor's tensors (pipeline rank 0, tensor rank 0) as a safetensors
                                file: a JSON header, then the raw bytes back to back; no pickle, every byte
                                covered by a checksum in the manifest; weights under their keys, optimizer
                                state under ``KEY/NAME`` (``3.fc1.weight/exp_avg``)
    DIR/v000007/model.safetensors.index.json
                                Hugging Face's index of the weights: each whole tensor's file (a
                                tensor-parallel split one is under ``metadata.tensor_parallel``)
    DIR/.staging-job3-1f2e9a0c/ job3's save in progress, or one that was killed (job3's next save removes it)

Shards written before they were safetensors files (``p0-t0.bin``, raw bytes alone) still
load: the manifest says where each tensor lies either way. A load memory-maps each file
(copy on write), so a tensor's bytes are read from the page cache once, into the model.

A save makes a staging directory named by its job, lets every writer put its file
there (fsynced), writes the manifest, renames the staging directory to the next free
version number, and only then points ``LATEST`` at it; older versions go after the
pointer has moved. A kill at any instant therefore leaves ``LATEST`` naming a
complete version: the old one or the new one, never none and never a mix. The steps
are named by :func:`_reached`, which tests use to stop a writer at each of them.

Saves of several jobs to one directory do not undo each other: a save removes only
its own job's staging directories, a version number is claimed by the rename itself
(a directory rename never replaces a version), and the rename, the pointer and the
removal of older versions happen under an exclusive ``flock`` of ``DIR`` (on a
filesystem without one, such saves must not overlap in time).

A client's checkpoints stay in its own subtree of the operator's checkpoint root: the
head resolves the path as written, and :func:`check_within` makes every node refuse
one that a symbolic link leads out of it. No message here lists a directory's
contents or repeats a file's bytes: the directory may be someone else's.

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

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import math
import secrets
import shutil
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from stages.build.tensor_parallel import ShardSpec, gather_tensor
from stages.state import dcp_files, safetensors_files
from stages.state.manifest import (
    DCP,
    DTYPES,
    FILE,
    FORMAT,
    SAFETENSORS,
    CheckpointError,
    Manifest,
    NoCheckpoint,
    TensorEntry,
    TensorPart,
    layer_of,
    merge_written,
    open_inside,
)

__all__ = [
    "FORMAT", "CheckpointError", "Manifest", "NoCheckpoint", "TensorEntry", "TensorPart", "begin_version",
    "check_directory", "check_staging", "check_version", "check_within", "commit_version", "dtype_name",
    "fsync_directory", "is_version", "layer_of", "merge_written",
    "read_entry", "read_manifest", "write_tensors",
]

log = logging.getLogger(__name__)

LATEST = "LATEST"
MANIFEST = "manifest.json"
_STAGING_PREFIX = ".staging-"
_VERSION = re.compile(r"v(\d{6})")
_JOB = re.compile(r"[A-Za-z0-9_.]{1,64}")  # a job id, as its staging directories' names carry it
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


def fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tensors(
    path: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[int, dict[str, TensorPart]]:
    """Writes ``tensors`` into a new safetensors file at ``path`` and fsyncs it.

    The tensors go by falling element size (each then begins at a multiple of its own),
    under their names in ``tensors``; ``metadata`` goes into the header's ``__metadata__``.

    Returns:
        The file's size and each tensor's part (offset in the file, size, shape, crc32).

    Raises:
        CheckpointError: the file cannot be made (e.g. the directory is not on this node), or
            a dtype safetensors cannot name.
    """
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise CheckpointError(f"cannot write {path}", [f"{directory} does not exist on this node; {_SHARED_FS}"])
    host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    host = dict(sorted(host.items(), key=lambda kv: -kv[1].element_size()))  # stable: same sizes keep their order
    start = safetensors_files.header(host, metadata)
    parts: dict[str, TensorPart] = {}
    offset = len(start)
    try:
        with open(path, "xb") as f:
            f.write(start)
            for key, tensor in host.items():
                data = _raw(tensor)
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


def _mapped(path: str, expected: int, follow_links: bool = False) -> mmap.mmap | None:
    """``path`` memory-mapped copy-on-write (None when empty), once its size is the manifest's.

    Raises:
        CheckpointError: another size (a truncated or replaced file).
        OSError: it cannot be opened or mapped.
    """
    with open_inside(path, follow_links) as f:
        size = os.fstat(f.fileno()).st_size
        if size != expected:
            raise CheckpointError("bad checkpoint", [f"{path}: {size} bytes, the manifest says {expected} (truncated?)"])
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None


def _read_part(version: str, part: TensorPart, dtype: torch.dtype, files: Mapping[str, int], label: str,
               follow_links: bool = False) -> torch.Tensor:
    """One part's tensor, backed by the file's copy-on-write mapping when its offset is aligned for
    ``dtype`` (a copy otherwise: an old shard's back-to-back bytes need not be)."""
    path = os.path.join(version, part.file)
    where = f"{path}, {label}"
    numel = math.prod(part.shape)
    if numel * dtype.itemsize != part.nbytes or part.file not in files:
        raise CheckpointError("bad checkpoint", [f"{where}: the manifest's size or file does not fit the entry"])
    if part.offset + part.nbytes > files[part.file]:
        raise CheckpointError("bad checkpoint", [f"{where}: only {max(files[part.file] - part.offset, 0)} of "
                                                 f"{part.nbytes} bytes there"])
    try:
        mapped = _mapped(path, files[part.file], follow_links)
    except OSError as exc:
        raise CheckpointError("bad checkpoint", [f"{where}: {exc}"]) from exc
    if mapped is None or numel == 0:
        return torch.empty(part.shape, dtype=dtype)
    raw = memoryview(mapped)[part.offset:part.offset + part.nbytes]
    if part.offset % dtype.itemsize == 0:
        tensor = torch.frombuffer(mapped, dtype=dtype, count=numel, offset=part.offset).view(part.shape)
    else:
        tensor = torch.empty(part.shape, dtype=dtype)
        _raw(tensor)[:] = raw
    crc = zlib.crc32(raw) if part.crc32 is not None else None  # a model directory's safetensors have none
    raw.release()
    if crc != part.crc32:
        raise CheckpointError("bad checkpoint", [
            f"{where}: checksum mismatch (crc32 {crc:08x}, the manifest says {part.crc32:08x}): "
            "the file was changed or damaged after it was written"])
    return tensor


def read_entry(version: str, entry: TensorEntry, files: Mapping[str, int], label: str,
               source: str = FORMAT, follow_links: bool = False) -> torch.Tensor:
    """The whole tensor ``entry`` describes, every part's checksum verified (a DCP checkpoint's: its chunks
    put together, :func:`stages.state.dcp_files.read_chunks`).

    Raises:
        CheckpointError: a missing or short file, a checksum mismatch, parts that do not
            make the recorded shape; the message names the file and the key.
    """
    if source == DCP:
        return dcp_files.read_chunks(version, entry, files, label)
    dtype = DTYPES[entry.dtype]
    parts = [_read_part(version, part, dtype, files, label, follow_links) for part in entry.parts]
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


_NO_CHECKPOINT = (f"a checkpoint directory is one job.save wrote: {LATEST} and its versions (or a model directory's "
                  f"safetensors weights, or a torch.distributed.checkpoint's .metadata and files); {_SHARED_FS}; "
                  "model.pt, the unversioned format of earlier actorpipe, loads with "
                  "torch.load(path, weights_only=True) and job.load_state_dict")


def check_directory(path: Any) -> str:
    """``path`` if it is a usable checkpoint directory name: absolute and normalized.

    Paths come from clients, and every node resolves them on its own: a relative one
    would land in each node's working directory, so it is refused (the head resolves
    a client's path first: see ``schedulers.checkpoint_paths``).

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


def _inside(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip(os.sep) + os.sep)


def check_within(directory: Any, within: Any) -> str:
    """``directory`` if it lies inside ``within`` as written and on this node, symbolic links resolved.

    The head resolved a client's path as written; this is each node's own look at its
    own filesystem, so that a link inside a client's subtree cannot lead a save or a
    load out of it.

    Raises:
        CheckpointError: it lies outside ``within``; the message says where it must stay, never
            where a link leads.
    """
    directory, within = check_directory(directory), check_directory(within)
    if not (_inside(directory, within) and _inside(os.path.realpath(directory), os.path.realpath(within))):
        raise CheckpointError(f"{directory[:200]} is outside {within[:200]} (links resolved)",
                              ["a client's checkpoints stay in its own directory of the checkpoint root"])
    return directory


def _check_job(job: Any) -> str:
    if not isinstance(job, str) or _JOB.fullmatch(job) is None:
        raise CheckpointError(f"{str(job)[:80]!r} is not a job id (letters, digits, '_', '.')")
    return job


def _staging_prefix(job: str) -> str:
    """What job ``job``'s staging directories start with (``.staging-job3-``; a job id has no ``-``)."""
    return f"{_STAGING_PREFIX}{job}-"


def _versions(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if _VERSION.fullmatch(n))


def _refuse_foreign(directory: str, entries: list[str]) -> None:
    """A directory that already holds something other than checkpoints is not ours to fill or clean.

    The message does not name what it holds: the directory may be someone else's.
    """
    ours = [LATEST, f"{LATEST}.tmp"]
    foreign = [n for n in entries if n not in ours and not _VERSION.fullmatch(n) and not n.startswith(_STAGING_PREFIX)]
    if foreign and LATEST not in entries:
        log.debug("refused to save to %s: %d entries that are not a checkpoint's", directory, len(foreign))
        raise CheckpointError(f"{directory} is not an actorpipe checkpoint directory and is not empty",
                              ["save to a new or empty directory"])


def begin_version(directory: str, job: str, *, within: str | None = None) -> str:
    """Makes job ``job``'s staging directory for a save to ``directory``, after removing what a killed
    save of the same job left there (a job saves one at a time; other jobs' are left alone).

    Args:
        within: the subtree ``directory`` must stay in on this node (a client's), or None.

    Returns:
        Its path, ``DIR/.staging-JOB-XXXXXXXX``.

    Raises:
        CheckpointError: ``directory`` cannot be made, holds something else, or lies outside ``within``.
    """
    directory, job = check_directory(directory), _check_job(job)
    if within is not None:
        check_within(directory, within)
    try:
        os.makedirs(directory, exist_ok=True)
        entries = os.listdir(directory)
        _refuse_foreign(directory, entries)
        mine = _staging_prefix(job)
        for name in entries:
            if name.startswith(mine):
                shutil.rmtree(os.path.join(directory, name))
        staging = os.path.join(directory, f"{mine}{secrets.token_hex(4)}")
        os.mkdir(staging)
        fsync_directory(directory)
        fsync_directory(os.path.dirname(directory))
    except OSError as exc:
        raise CheckpointError(f"cannot write a checkpoint to {directory}", [str(exc)]) from exc
    _reached("staged")
    return staging


def check_staging(staging: Any, name: str = "p0-t0.safetensors", *, job: str | None = None) -> str:
    """The path of shard file ``name`` in ``staging``, both checked (they come over the wire).

    Args:
        job: the staging directory must be this job's (a stage writes only into its own job's).

    Raises:
        CheckpointError: not a (this job's) staging directory, or not a shard file name.
    """
    check_directory(staging)
    prefix = _STAGING_PREFIX if job is None else _staging_prefix(_check_job(job))
    if not os.path.basename(staging).startswith(prefix) or FILE.fullmatch(name) is None:
        whose = "a" if job is None else "this job's"
        raise CheckpointError(f"refused to write {name[:40]!r} into {staging[:200]!r}",
                              [f"not {whose} staging directory, or not a shard file name"])
    return os.path.join(staging, name)


def is_version(name: Any) -> bool:
    """Whether ``name`` is a version directory's own name (``v000007``), as a save makes them."""
    return isinstance(name, str) and _VERSION.fullmatch(name) is not None


def check_version(version: Any, source: str = FORMAT) -> str:
    """``version`` if it names a version directory (``/abs/DIR/v000007``), or with the ``safetensors``
    source a directory of safetensors weights; it comes over the wire.

    Raises:
        CheckpointError: it does not.
    """
    check_directory(version)
    if (source == SAFETENSORS and safetensors_files.present(version)) or (source == DCP and dcp_files.present(version)):
        return version
    if _VERSION.fullmatch(os.path.basename(version)) is None:
        raise CheckpointError(f"{version[:200]!r} is not a checkpoint version directory")
    return version


@contextlib.contextmanager
def _exclusive(directory: str) -> Iterator[None]:
    """Holds an exclusive ``flock`` of ``directory``; on a filesystem without one, goes on unlocked."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            log.debug("no flock of %s (%s): saves of several jobs to it must not overlap", directory, exc)
        yield
    finally:
        os.close(fd)  # and with it the lock


def _claim_version(directory: str, staging: str) -> str:
    """Renames ``staging`` to the next free version; returns the version's path.

    A directory rename replaces only an empty directory, and a version never is one:
    two saves cannot take the same number, and the second takes the next.
    """
    number = max((int(n[1:]) for n in _versions(directory)), default=0) + 1
    while True:
        version = os.path.join(directory, f"v{number:06d}")
        try:
            os.rename(staging, version)
            return version
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        number += 1


def _pointer(directory: str) -> str | None:
    """The version ``LATEST`` names, or None: no directory, no pointer, or one that names no version.

    Why is logged at debug level, on this node: a caller's message must not tell what a
    directory holds, nor repeat a file's bytes.
    """
    path = os.path.join(directory, LATEST)
    if not os.path.isfile(path):
        log.debug("no checkpoint at %s: %s", directory, "no such directory" if not os.path.isdir(directory)
                  else f"no {LATEST} file")
        return None
    try:
        with open(path, "rb") as f:
            name = f.read(64).decode("ascii", "replace").strip()
    except OSError as exc:
        log.debug("no checkpoint at %s: %s", directory, exc.strerror)
        return None
    if _VERSION.fullmatch(name) is None:
        log.debug("no checkpoint at %s: its %s does not name a version", directory, LATEST)
        return None
    return name


def commit_version(directory: str, staging: str, manifest: Manifest, job: str, keep: int = 1,
                   spare: str | None = None) -> str:
    """Completes job ``job``'s save: manifest, fsync, rename to the next version, the pointer; removes
    older versions, all but the newest ``keep`` (the new one among them; 0: none is removed) and
    ``spare`` (a version's name, e.g. ``v000004``: the one saved at the job's best evaluation, which the
    rotation passes over, as the Trainer keeps its best checkpoint under ``save_total_limit``).

    The rename, the pointer and the removal hold the directory's lock, so a concurrent
    save of another job never loses its version, and the pointer only moves forward.

    Returns:
        The new version's path.

    Raises:
        CheckpointError: not ``job``'s staging directory in ``directory``, a shard file missing or not the
            size its writer reported, or the filesystem refused.
        ValueError: ``spare`` does not name a version.
    """
    if spare is not None and not is_version(spare):
        raise ValueError(f"spare must name a version such as 'v000004', got {str(spare)[:40]!r}")
    directory = check_directory(directory)
    check_staging(staging, job=job)
    if os.path.dirname(staging) != directory:
        raise CheckpointError(f"{staging[:200]} is not in {directory[:200]}")
    for name, size in manifest.files.items():
        path = os.path.join(staging, name)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            raise CheckpointError(f"the save to {directory} is incomplete", [f"{path} is missing or not {size} bytes"])
    try:
        for name, content in ((safetensors_files.INDEX, _weights_index(manifest)), (MANIFEST, manifest.to_wire())):
            with open(os.path.join(staging, name), "x") as f:
                json.dump(content, f)
                f.flush()
                os.fsync(f.fileno())
        fsync_directory(staging)
        _reached("manifest_written")
        with _exclusive(directory):
            version = _claim_version(directory, staging)
            fsync_directory(directory)
            _reached("renamed")
            name = os.path.basename(version)
            _point(directory, name)
            # Newer ones (only without a lock: another save's) stay, the spare, and the newest keep - 1 older ones.
            older = [old for old in _versions(directory) if old < name and old != spare]
            for old in older[: max(0, len(older) - keep + 1)] if keep else ():
                shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
                _reached("old_removed")
    except OSError as exc:
        raise CheckpointError(f"cannot complete the save to {directory}", [str(exc)]) from exc
    return version


def _weights_index(manifest: Manifest) -> dict[str, Any]:
    """Hugging Face's index of a version's weights: each whole tensor's shard file; the parts of a
    tensor-parallel split one are listed by file under ``metadata.tensor_parallel`` (no loader of
    that index puts such a tensor together: load the checkpoint here, or export it)."""
    whole = {key: entry.parts[0].file for key, entry in manifest.model.items() if entry.shard is None}
    split = {key: [part.file for part in entry.parts] for key, entry in manifest.model.items() if entry.shard is not None}
    size = sum(part.nbytes for entry in manifest.model.values() for part in entry.parts)
    return safetensors_files.index(whole, size, {"format": FORMAT, "step": manifest.step,
                                                 **({"tensor_parallel": split} if split else {})})


def _point(directory: str, name: str) -> None:
    """Points ``LATEST`` at version ``name`` (an fsynced temporary, ``os.replace``, the directory fsynced),
    unless it names a newer one already."""
    current = _pointer(directory)
    if current is not None and current > name:
        return
    pointer = os.path.join(directory, f"{LATEST}.tmp")
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    _reached("pointer_written")
    os.replace(pointer, os.path.join(directory, LATEST))
    fsync_directory(directory)
    _reached("pointed")


def read_manifest(directory: str, *, within: str | None = None) -> tuple[str, Manifest]:
    """The version ``LATEST`` points at (or ``directory`` itself, a version), and its manifest.

    Args:
        within: the subtree ``directory`` must stay in on this node (a client's), or None.

    Raises:
        CheckpointError: outside ``within``; no checkpoint there (:class:`NoCheckpoint`, one message
            whatever the directory holds or lacks); a version that cannot be read or a malformed manifest.
    """
    directory = check_directory(directory)
    if within is not None:
        check_within(directory, within)
    name = _pointer(directory)
    if name is None and _VERSION.fullmatch(os.path.basename(directory)) and os.path.isfile(
            os.path.join(directory, MANIFEST)):  # a version itself, as job.save returns it
        directory, name = os.path.dirname(directory), os.path.basename(directory)
    if name is None and safetensors_files.present(directory):  # weights as Hugging Face keeps them
        return directory, safetensors_files.manifest(directory, follow_links=within is None)
    if name is None and dcp_files.present(directory):  # weights as torch.distributed.checkpoint keeps them
        return directory, dcp_files.manifest(directory)
    if name is None:
        raise NoCheckpoint(f"no actorpipe checkpoint at {directory}", [_NO_CHECKPOINT])
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
