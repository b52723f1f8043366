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

This module is the format and the filesystem; :mod:`stages.state.stage_checkpoint` is what
one stage writes and loads, and the scheduler's controller runs the two phases.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from stages.build.tensor_parallel import ShardSpec, gather_tensor

__all__ = [
    "FORMAT", "CheckpointError", "Manifest", "TensorEntry", "TensorPart", "begin_version", "check_directory",
    "check_staging", "check_version", "commit_version", "dtype_name", "layer_of", "merge_written", "read_entry",
    "read_manifest", "write_tensors",
]

FORMAT = "actorpipe-checkpoint"
FORMAT_VERSION = 1
LATEST = "LATEST"
MANIFEST = "manifest.json"
_STAGING_PREFIX = ".staging-"
_VERSION = re.compile(r"v(\d{6})")
_FILE = re.compile(r"p\d{1,6}-t\d{1,6}(-d\d{1,6})?\.bin")  # -dN: replica N's ZeRO-1 optimizer shard
_MAX_PATH = 4096
_MAX_MANIFEST_BYTES = 256 << 20
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
_SHARED_FS = ("on several machines the checkpoint directory must be on a filesystem every node mounts "
              "at the same path")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded as asked; ``problems`` lists each thing wrong.

    A load that raises it has applied nothing anywhere.
    """

    def __init__(self, summary: str, problems: list[str] | None = None) -> None:
        self.summary = summary
        self.problems = list(problems or [])
        shown = self.problems[:50]
        more = len(self.problems) - len(shown)
        lines = [summary, *(f"  - {p}" for p in shown), *([f"  - ... and {more} more"] if more > 0 else [])]
        super().__init__("\n".join(lines))

    @classmethod
    def from_message(cls, message: str) -> CheckpointError:
        """Rebuilds one from its message (as it arrives from another process)."""
        summary, *rest = message.split("\n")
        return cls(summary, [line.removeprefix("  - ") for line in rest if line.startswith("  - ")])


def _reached(point: str) -> None:
    """A named step of a save (``staged``, ``tensor_written``, ``manifest_written``, ``renamed``,
    ``pointer_written``, ``pointed``, ``old_removed``); tests replace this to stop the process there."""


# --- what the manifest says --------------------------------------------------------------------


def _expect(condition: bool, problem: str) -> None:
    if not condition:
        raise CheckpointError("the checkpoint's manifest is malformed", [problem])


def _int_list(value: Any, what: str) -> list[int]:
    _expect(isinstance(value, list) and all(type(v) is int and v >= 0 for v in value),
            f"{what}: expected a list of integers >= 0, got {str(value)[:60]}")
    return list(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorPart:
    """Where one tensor-parallel rank's part of a tensor lies, and its checksum."""

    file: str
    offset: int
    nbytes: int
    shape: list[int]
    crc32: int

    def to_wire(self) -> dict[str, Any]:
        return {"file": self.file, "offset": self.offset, "nbytes": self.nbytes, "shape": self.shape,
                "crc32": self.crc32}

    @classmethod
    def from_wire(cls, data: Any, what: str) -> TensorPart:
        _expect(isinstance(data, dict) and set(data) == {"file", "offset", "nbytes", "shape", "crc32"},
                f"{what}: a part needs exactly file, offset, nbytes, shape, crc32")
        _expect(isinstance(data["file"], str) and _FILE.fullmatch(data["file"]) is not None,
                f"{what}: file {str(data['file'])[:60]!r} is not a shard file name (pP-tT.bin)")
        numbers = _int_list([data["offset"], data["nbytes"], data["crc32"]], f"{what} offset/nbytes/crc32")
        return cls(file=data["file"], offset=numbers[0], nbytes=numbers[1], shape=_int_list(data["shape"], what),
                   crc32=numbers[2])


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    """One tensor of the unpartitioned model: its whole shape, dtype, split and parts (by tensor rank)."""

    shape: list[int]
    dtype: str
    shard: list[int] | None  # [dim, world, num_fused] when split over tensor-parallel ranks
    parts: list[TensorPart]

    def to_wire(self) -> dict[str, Any]:
        return {"shape": self.shape, "dtype": self.dtype, "shard": self.shard,
                "parts": [p.to_wire() for p in self.parts]}

    @classmethod
    def from_wire(cls, data: Any, what: str) -> TensorEntry:
        _expect(isinstance(data, dict) and set(data) == {"shape", "dtype", "shard", "parts"},
                f"{what}: an entry needs exactly shape, dtype, shard, parts")
        _expect(data["dtype"] in _DTYPES, f"{what}: unknown dtype {str(data['dtype'])[:30]!r}")
        shard = None if data["shard"] is None else _int_list(data["shard"], f"{what} shard")
        _expect(shard is None or (len(shard) == 3 and shard[1] >= 1 and shard[2] >= 1),
                f"{what}: shard must be [dim, world, num_fused]")
        _expect(isinstance(data["parts"], list) and len(data["parts"]) == (shard[1] if shard else 1),
                f"{what}: expected {shard[1] if shard else 1} part(s)")
        parts = [TensorPart.from_wire(p, what) for p in data["parts"]]
        return cls(shape=_int_list(data["shape"], what), dtype=data["dtype"], shard=shard, parts=parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """What a checkpoint version holds; also the plan a stage gets on load (the entries it needs).

    ``optimizer_state`` maps a parameter's key to its optimizer state (``exp_avg``,
    ``step``…) as entries split like the parameter; ``optimizer`` is the optimizer's
    import path; ``step`` is the job's next step at the save; ``lr_scheduler`` is the
    learning-rate schedule's ``{"path", "state"}`` (plain data, the same on every
    stage), or None: no schedule, or a manifest written before schedules were kept.
    """

    step: int
    optimizer: str
    files: dict[str, int]  # file -> size in bytes
    model: dict[str, TensorEntry]
    optimizer_state: dict[str, dict[str, TensorEntry]]
    job: dict[str, Any] = field(default_factory=dict)  # who wrote it, for people: job id, spec, layout
    lr_scheduler: dict[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": FORMAT_VERSION, "step": self.step, "optimizer": self.optimizer,
                "files": self.files, "model": {k: e.to_wire() for k, e in self.model.items()},
                "optimizer_state": {k: {n: e.to_wire() for n, e in s.items()}
                                    for k, s in self.optimizer_state.items()},
                "job": self.job, "lr_scheduler": self.lr_scheduler}

    @classmethod
    def from_wire(cls, data: Any) -> Manifest:
        """Checks every field of an untrusted manifest (it comes from disk).

        Raises:
            CheckpointError: another format or version, or any malformed field.
        """
        _expect(isinstance(data, dict) and data.get("format") == FORMAT, f"not an {FORMAT} manifest")
        _expect(data.get("version") == FORMAT_VERSION,
                f"format version {str(data.get('version'))[:20]}; this actorpipe reads {FORMAT_VERSION}")
        _expect(isinstance(data.get("files"), dict) and all(
            isinstance(k, str) and _FILE.fullmatch(k) and type(v) is int and v >= 0 for k, v in data["files"].items()),
            "files: expected a map of shard file name to size")
        model, state = data.get("model"), data.get("optimizer_state")
        _expect(isinstance(model, dict) and isinstance(state, dict) and all(isinstance(s, dict) for s in state.values()),
                "model and optimizer_state must be maps")
        _expect(type(data.get("step")) is int and isinstance(data.get("optimizer"), str), "step and optimizer")
        schedule = data.get("lr_scheduler")  # absent from manifests written before schedules were kept
        _expect(schedule is None or (isinstance(schedule, dict) and set(schedule) == {"path", "state"}
                                     and isinstance(schedule["path"], str) and isinstance(schedule["state"], dict)),
                "lr_scheduler: expected null or a map of path and state")
        return cls(
            step=data["step"], optimizer=data["optimizer"], files=dict(data["files"]),
            model={str(k): TensorEntry.from_wire(e, str(k)[:80]) for k, e in model.items()},
            optimizer_state={str(k): {str(n): TensorEntry.from_wire(e, f"{str(k)[:80]} {str(n)[:20]}")
                                      for n, e in s.items()} for k, s in state.items()},
            job=data.get("job") if isinstance(data.get("job"), dict) else {}, lr_scheduler=schedule)

    def entries(self) -> Iterator[tuple[str, TensorEntry]]:
        """Every tensor with a label for messages: ``3.fc1.weight``, ``3.fc1.weight (optimizer exp_avg)``."""
        yield from self.model.items()
        for key, state in self.optimizer_state.items():
            for name, entry in state.items():
                yield f"{key} (optimizer {name})", entry

    def restrict(self, keys: frozenset[str], *, weights_only: bool) -> Manifest:
        """The part of the checkpoint the holder of ``keys`` (its state's, and its parameters') reads."""
        def mine(key: str) -> bool:
            return key in keys

        state = {} if weights_only else {k: s for k, s in self.optimizer_state.items() if mine(k)}
        return Manifest(step=self.step, optimizer=self.optimizer, files=self.files,
                        model={k: e for k, e in self.model.items() if mine(k)}, optimizer_state=state,
                        lr_scheduler=None if weights_only else self.lr_scheduler)


def layer_of(key: str) -> int | None:
    """The layer index a key starts with (``3.fc1.weight`` -> 3), or None."""
    head = key.partition(".")[0]
    return int(head) if head.isdigit() and len(head) < 10 else None


def merge_written(
    written: list[dict[str, Any]]
) -> tuple[dict[str, int], dict[str, TensorEntry], dict[str, dict[str, TensorEntry]]]:
    """The manifest's files, model and optimizer state, from every writer's answer.

    A writer reports ``{"file", "bytes", "tensors": [...]}``, one item per tensor it
    wrote: ``{"key", "state" (None, or the optimizer state's name), "shape" (whole),
    "dtype", "shard", "rank" (its tensor-parallel rank), "part"}``; the parts of a split
    tensor are put in tensor-rank order.
    """
    files: dict[str, int] = {}
    found: dict[tuple[str, str | None], dict[str, Any]] = {}
    for answer in written:
        files[answer["file"]] = answer["bytes"]
        for info in answer["tensors"]:
            entry = found.setdefault((info["key"], info["state"]), {**info, "parts": {}})
            assert entry["shape"] == info["shape"] and entry["shard"] == info["shard"], info["key"]
            entry["parts"][info["rank"]] = TensorPart(**info["part"])
    model: dict[str, TensorEntry] = {}
    state: dict[str, dict[str, TensorEntry]] = {}
    for (key, name), info in found.items():
        tensor = TensorEntry(shape=info["shape"], dtype=info["dtype"], shard=info["shard"],
                             parts=[info["parts"][r] for r in sorted(info["parts"])])
        if name is None:
            model[key] = tensor
        else:
            state.setdefault(key, {})[name] = tensor
    return files, model, state


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
    dtype = _DTYPES[entry.dtype]
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
    if name not in _DTYPES:
        raise CheckpointError(f"cannot checkpoint a {name} tensor", [f"supported: {', '.join(_DTYPES)}"])
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
    if not os.path.basename(staging).startswith(_STAGING_PREFIX) or _FILE.fullmatch(name) is None:
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
