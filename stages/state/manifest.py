"""What a checkpoint version's manifest says, and the error every checkpoint problem is.

The manifest (``DIR/vNNNNNN/manifest.json``) lists every tensor of the unpartitioned
model and every parameter's optimizer state: whole shape, dtype, tensor-parallel
split, and for each part its shard file, offset, size and crc32. It comes from disk,
so :meth:`Manifest.from_wire` checks every field. The directory and the bytes are
:mod:`stages.state.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DCP", "DCP_FILE", "FORMAT", "SAFETENSORS", "SAFETENSORS_FILE", "CheckpointError", "Manifest",
           "NoCheckpoint", "TensorEntry", "TensorPart", "layer_of", "merge_written", "open_inside"]

FORMAT = "actorpipe-checkpoint"
FORMAT_VERSION = 1
# A shard file: pP-tT.safetensors (.bin: raw bytes, written before shards were safetensors files);
# -dN: replica N's ZeRO-1 optimizer shard.
FILE = re.compile(r"p\d{1,6}-t\d{1,6}(-d\d{1,6})?\.(safetensors|bin)")
# Weights as Hugging Face and safetensors keep them (stages.state.safetensors_files): a manifest made
# from the files' own headers, which carry no checksums, and no optimizer state.
SAFETENSORS = "safetensors"
SAFETENSORS_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.safetensors")
# A torch.distributed.checkpoint directory (stages.state.dcp_files): weights alone, each tensor in one
# or more chunks, each chunk a torch.save blob in a .distcp file, read with weights_only=True.
DCP = "dcp"
DCP_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.distcp")
_FILES = {SAFETENSORS: SAFETENSORS_FILE, DCP: DCP_FILE}
_MAX_CHUNKS = 1 << 16  # a DCP tensor's chunks (a sharded save: one per rank that held a piece)
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}  # the dtypes stored, by name


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


class NoCheckpoint(CheckpointError):
    """A directory that holds no checkpoint at all (no ``LATEST``, no weights): what a job that resumes
    from its own directory (``checkpointing.resume_from_checkpoint``) takes as "start from the seed"."""



def open_inside(path: str, follow_links: bool = False) -> io.BufferedReader:
    """A checkpoint's or a weights directory's file opened to read, refused when it is a symbolic
    link: the directory was checked to lie where its reader may read
    (:func:`stages.state.checkpoint.check_within`), and a link in it could lead anywhere.
    ``follow_links``: the admin's load, which may read anywhere (the Hugging Face cache keeps a
    snapshot's files as links into its blobs).

    Raises:
        OSError: a link (its message says so), or what opening it raised.
    """
    try:
        return os.fdopen(os.open(path, os.O_RDONLY | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)), "rb")
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links and os.path.islink(path):
            raise OSError(errno.ELOOP, "a symbolic link, which a client's load does not follow (it could lead out of "
                          "the client's directory); give the files themselves (the Hugging Face cache keeps "
                          "links: snapshot_download(..., local_dir=DIR) copies them out), or load with the "
                          "admin's key", path) from None
        raise


def _expect(condition: bool, problem: str) -> None:
    if not condition:
        raise CheckpointError("the checkpoint's manifest is malformed", [problem])


def _int_list(value: Any, what: str) -> list[int]:
    _expect(isinstance(value, list) and all(type(v) is int and v >= 0 for v in value),
            f"{what}: expected a list of integers >= 0, got {str(value)[:60]}")
    return list(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorPart:
    """Where one tensor-parallel rank's part of a tensor lies, and its checksum; of a DCP checkpoint, one
    chunk of a tensor and where in the whole tensor it begins (``at``)."""

    file: str
    offset: int
    nbytes: int
    shape: list[int]
    crc32: int | None  # None: a safetensors or DCP file's tensor, which has none
    at: list[int] | None = None  # a DCP chunk's offsets in the whole tensor

    def to_wire(self) -> dict[str, Any]:
        return {"file": self.file, "offset": self.offset, "nbytes": self.nbytes, "shape": self.shape,
                "crc32": self.crc32, **({"at": self.at} if self.at is not None else {})}

    @classmethod
    def from_wire(cls, data: Any, what: str, source: str = FORMAT) -> TensorPart:
        keys = {"file", "offset", "nbytes", "shape", "crc32"} | ({"at"} if source == DCP else set())
        _expect(isinstance(data, dict) and set(data) == keys, f"{what}: a part needs exactly {', '.join(sorted(keys))}")
        pattern = _FILES.get(source, FILE)
        _expect(isinstance(data["file"], str) and pattern.fullmatch(data["file"]) is not None,
                f"{what}: file {str(data['file'])[:60]!r} is not a shard file name "
                "(pP-tT.safetensors, NAME.safetensors or NAME.distcp)")
        crc = data["crc32"]
        _expect(crc is not None or source != FORMAT, f"{what}: crc32 is missing")
        numbers = _int_list([data["offset"], data["nbytes"], 0 if crc is None else crc], f"{what} offset/nbytes/crc32")
        at = _int_list(data["at"], f"{what} at") if source == DCP else None
        shape = _int_list(data["shape"], what)
        _expect(at is None or len(at) == len(shape), f"{what}: a chunk's offsets and shape differ in rank")
        return cls(file=data["file"], offset=numbers[0], nbytes=numbers[1], shape=shape,
                   crc32=None if crc is None else numbers[2], at=at)


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
    def from_wire(cls, data: Any, what: str, source: str = FORMAT) -> TensorEntry:
        _expect(isinstance(data, dict) and set(data) == {"shape", "dtype", "shard", "parts"},
                f"{what}: an entry needs exactly shape, dtype, shard, parts")
        _expect(isinstance(data["dtype"], str) and data["dtype"] in DTYPES,
                f"{what}: unknown dtype {str(data['dtype'])[:30]!r}")
        shard = None if data["shard"] is None else _int_list(data["shard"], f"{what} shard")
        _expect(shard is None or (len(shard) == 3 and shard[1] >= 1 and shard[2] >= 1),
                f"{what}: shard must be [dim, world, num_fused]")
        _expect(isinstance(data["parts"], list) and (len(data["parts"]) == (shard[1] if shard else 1) or (
            source == DCP and shard is None and 0 < len(data["parts"]) <= _MAX_CHUNKS)),
                f"{what}: expected {shard[1] if shard else 1} part(s)")
        parts = [TensorPart.from_wire(p, what, source) for p in data["parts"]]
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
    source: str = FORMAT  # or SAFETENSORS: weights alone, read from the files' own headers
    links: bool = False  # SAFETENSORS: its files may be links, read through (an admin's load: open_inside)

    def to_wire(self) -> dict[str, Any]:
        return {"format": self.source, "version": FORMAT_VERSION, "step": self.step, "optimizer": self.optimizer,
                "files": self.files, "model": {k: e.to_wire() for k, e in self.model.items()},
                "optimizer_state": {k: {n: e.to_wire() for n, e in s.items()}
                                    for k, s in self.optimizer_state.items()},
                "job": self.job, "lr_scheduler": self.lr_scheduler, **({"links": True} if self.links else {})}

    @classmethod
    def from_wire(cls, data: Any) -> Manifest:
        """Checks every field of an untrusted manifest (it comes from disk).

        Raises:
            CheckpointError: another format or version, or any malformed field.
        """
        _expect(isinstance(data, dict) and data.get("format") in (FORMAT, SAFETENSORS, DCP), f"not an {FORMAT} manifest")
        source = data["format"]
        _expect(data.get("version") == FORMAT_VERSION,
                f"format version {str(data.get('version'))[:20]}; this actorpipe reads {FORMAT_VERSION}")
        pattern = _FILES.get(source, FILE)
        _expect(isinstance(data.get("files"), dict) and all(
            isinstance(k, str) and pattern.fullmatch(k) and type(v) is int and v >= 0 for k, v in data["files"].items()),
            "files: expected a map of shard file name to size")
        model, state = data.get("model"), data.get("optimizer_state")
        _expect(isinstance(model, dict) and isinstance(state, dict) and all(isinstance(s, dict) for s in state.values()),
                "model and optimizer_state must be maps")
        _expect(type(data.get("step")) is int and isinstance(data.get("optimizer"), str), "step and optimizer")
        schedule = data.get("lr_scheduler")  # absent from manifests written before schedules were kept
        _expect(schedule is None or (isinstance(schedule, dict) and set(schedule) == {"path", "state"}
                                     and isinstance(schedule["path"], str) and isinstance(schedule["state"], dict)),
                "lr_scheduler: expected null or a map of path and state")
        _expect(source == FORMAT or not (state or schedule), f"a {source} manifest holds weights only")
        return cls(
            step=data["step"], optimizer=data["optimizer"], files=dict(data["files"]),
            model={str(k): TensorEntry.from_wire(e, str(k)[:80], source) for k, e in model.items()},
            optimizer_state={str(k): {str(n): TensorEntry.from_wire(e, f"{str(k)[:80]} {str(n)[:20]}")
                                      for n, e in s.items()} for k, s in state.items()},
            job=data.get("job") if isinstance(data.get("job"), dict) else {}, lr_scheduler=schedule, source=source,
            links=source == SAFETENSORS and data.get("links") is True)

    def entries(self) -> Iterator[tuple[str, TensorEntry]]:
        """Every tensor with a label for messages: ``3.fc1.weight``, ``3.fc1.weight (optimizer exp_avg)``."""
        yield from self.model.items()
        for key, state in self.optimizer_state.items():
            for name, entry in state.items():
                yield f"{key} (optimizer {name})", entry

    def _readings(self, held: frozenset[str]) -> Iterator[tuple[str, dict[str, str]]]:
        """Each way to read the keys no stage holds: as they are (``""``), or with one base-model prefix added
        (``"+transformer."``) or taken off (``"-transformer."``); as ``(how, {key: its name})``."""
        unplaced = [k for k in self.model if k not in held]
        yield "", {k: k for k in unplaced}
        for prefix in sorted({k.partition(".")[0] for k in held if "." in k}):
            yield f"+{prefix}.", {k: f"{prefix}.{k}" for k in unplaced}
        for prefix in sorted({k.partition(".")[0] for k in unplaced if "." in k}):
            if all(k.startswith(prefix + ".") for k in unplaced):
                yield f"-{prefix}.", {k: k.partition(".")[2] for k in unplaced}

    def left_unplaced(self, held: frozenset[str]) -> set[str]:
        """The keys some reading of :meth:`under_base_prefix` leaves where no stage holds them: what a
        model may pass over (``passed_over`` there)."""
        return {k for _, renamed in self._readings(held) for k, v in renamed.items() if v not in held}

    def under_base_prefix(self, held: frozenset[str],
                          passed_over: frozenset[str] = frozenset()) -> tuple[Manifest, str]:
        """The weights under the names the model holds them by, where they differ by the one prefix that
        sets a Hugging Face model with a head apart from its base model (``base_model_prefix``), as
        ``from_pretrained`` reads them: a base model's files (``h.0.attn.c_attn.weight``, as the Hub
        holds ``gpt2``) into the model with a head (``transformer.h.0.attn.c_attn.weight``), or a
        model with a head's files into its base. Only the keys no stage holds are renamed, and only
        where one prefix places every one of them (but those in ``passed_over``, which are left out,
        as ``from_pretrained`` leaves out the keys a model names in ``_keys_to_ignore_on_load_unexpected``:
        the causal masks the Hub's ``gpt2`` keeps) and no renamed key collides with another.

        Returns:
            the manifest (``self`` where nothing changed) and how the keys moved (``""`` if not):
            ``"+transformer."`` or ``"-transformer."``.
        """
        if all(k in held for k in self.model):
            return self, ""
        found = [(how, renamed) for how, renamed in self._readings(held)
                 if all(v in held or k in passed_over for k, v in renamed.items())]
        if found and found[0][0] == "":  # nothing to rename: only keys to pass over
            found = found[:1]
        if len(found) != 1:
            return self, ""
        how, renamed = found[0]
        model = {renamed.get(k, k): e for k, e in self.model.items() if renamed.get(k, k) in held}
        if len(model) + sum(1 for k, v in renamed.items() if v not in held) != len(self.model):
            return self, ""  # a renamed key is also one the files hold as it is
        return dataclasses.replace(self, model=model), how

    def restrict(self, keys: frozenset[str], *, weights_only: bool) -> Manifest:
        """The part of the checkpoint the holder of ``keys`` (its state's, and its parameters') reads."""
        def mine(key: str) -> bool:
            return key in keys

        state = {} if weights_only else {k: s for k, s in self.optimizer_state.items() if mine(k)}
        return Manifest(step=self.step, optimizer=self.optimizer, files=self.files,
                        model={k: e for k, e in self.model.items() if mine(k)}, optimizer_state=state,
                        lr_scheduler=None if weights_only else self.lr_scheduler, source=self.source,
                        links=self.links)


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
