"""Weights in a ``torch.distributed.checkpoint`` (DCP) directory: read as a checkpoint, and written.

A DCP directory holds ``.metadata`` (a pickled ``Metadata``: every tensor's dtype,
shape and chunks, and where each chunk lies) and ``.distcp`` files whose chunks are
``torch.save`` blobs. A load reads the metadata with an unpickler that admits DCP's own
metadata classes and nothing else (no other class, no function call: a file that asks
for one is refused, so a crafted ``.metadata`` cannot run code on a node), makes a
:class:`~stages.state.manifest.Manifest` of the ``dcp`` source from it, and every stage
reads only its own tensors' chunks, each with ``torch.load(weights_only=True)``, and
puts a tensor saved in chunks (by FSDP, or any sharded save) back together. Like
safetensors weights, such a load takes the weights alone.

A write (``job.export(DIR, format="dcp")``) has every pipeline stage save its own
tensors with DCP's own writer into the export's staging directory, and the
coordinator merges their metadata into one ``.metadata`` (written last), so that
``torch.distributed.checkpoint.load`` reads the directory in any process or world size.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from stages.state.manifest import DCP, DCP_FILE, DTYPES, CheckpointError, Manifest, TensorEntry, TensorPart, open_inside

__all__ = ["METADATA", "manifest", "merge", "present", "read_chunks", "save_stage"]

METADATA = ".metadata"
_MAX_METADATA_BYTES = 256 << 20
_DCP = "torch.distributed.checkpoint.metadata"
# What DCP's metadata pickles, and nothing more: its own record classes, torch.Size, dtypes, a layout by name,
# and the path it was saved to.
_ALLOWED = {
    (_DCP, name) for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                              "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")} | {
    ("torch", name) for name in DTYPES}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise CheckpointError("a .metadata that is not DCP's", [f"it asks for {module[:80]}.{name[:80]}, "
                                                                    "which DCP metadata never holds"])
        return super().find_class(module, name)


def present(directory: str) -> bool:
    """Whether ``directory`` holds a DCP checkpoint (its ``.metadata``)."""
    return os.path.isfile(os.path.join(directory, METADATA))


def _read_metadata(directory: str) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(directory, METADATA)
    try:
        with open_inside(path) as f:
            data = f.read(_MAX_METADATA_BYTES + 1)
        if len(data) > _MAX_METADATA_BYTES:
            raise CheckpointError(f"{path} is over {_MAX_METADATA_BYTES} bytes")
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed pickle raises anything; it is named, not trusted
        raise CheckpointError(f"{path} cannot be read as DCP metadata", [f"{type(exc).__name__}: {str(exc)[:200]}"]) \
            from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path} cannot be read as DCP metadata", ["it holds no Metadata"])
    return metadata


def _sizes(directory: str, files: set[str]) -> dict[str, int]:
    sizes = {}
    for name in sorted(files):
        try:
            with open_inside(os.path.join(directory, name)) as f:
                sizes[name] = os.fstat(f.fileno()).st_size
        except OSError as exc:
            raise CheckpointError(f"{os.path.join(directory, name)} cannot be read", [str(exc)]) from exc
    return sizes


def manifest(directory: str) -> Manifest:
    """The tensors of the DCP checkpoint in ``directory``, as a manifest of the ``dcp`` source (entries
    that are not tensors, such as a saved step count, are left out).

    Raises:
        CheckpointError: metadata that is not DCP's, a dtype or file name this cannot take, a
            chunk with transforms (compression), or a file that cannot be read.
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    metadata = _read_metadata(directory)
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    model: dict[str, TensorEntry] = {}
    files: set[str] = set()
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        label = f"{directory}: {str(fqn)[:120]}"
        dtype = str(meta.properties.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise CheckpointError(f"{label} cannot be loaded", [f"a {dtype} tensor"])
        parts = []
        for chunk in meta.chunks:
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
            if info is None or getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{label} cannot be loaded", ["a chunk without a place, or saved with "
                                                                     "transforms (compression) this does not read"])
            if not isinstance(info.relative_path, str) or DCP_FILE.fullmatch(info.relative_path) is None:
                raise CheckpointError(f"{label} cannot be loaded",
                                      [f"{str(info.relative_path)[:80]!r} is not a .distcp file in the directory"])
            files.add(info.relative_path)
            parts.append(TensorPart(file=info.relative_path, offset=int(info.offset), nbytes=int(info.length),
                                    shape=[int(d) for d in chunk.sizes], crc32=None, at=[int(d) for d in chunk.offsets]))
        if not parts:
            raise CheckpointError(f"{label} cannot be loaded", ["a tensor without chunks"])
        model[str(fqn)] = TensorEntry(shape=[int(d) for d in meta.size], dtype=dtype, shard=None, parts=parts)
    return Manifest(step=0, optimizer="", files=_sizes(directory, files), model=model, optimizer_state={},
                    job={"source": DCP}, source=DCP)


def read_chunks(directory: str, entry: TensorEntry, files: Mapping[str, int], label: str) -> torch.Tensor:
    """The whole tensor ``entry`` describes, from its chunks (each ``torch.load(weights_only=True)``),
    which must cover it exactly.

    Raises:
        CheckpointError: a missing or short file, a chunk that is not the tensor the metadata says, or
            chunks that leave part of the tensor uncovered.
    """
    dtype = DTYPES[entry.dtype]
    whole = torch.empty(entry.shape, dtype=dtype)
    covered = torch.zeros(entry.shape, dtype=torch.bool) if len(entry.parts) > 1 else None
    for part in entry.parts:
        where = f"{os.path.join(directory, part.file)}, {label}"
        if part.file not in files or part.at is None or len(part.at) != len(entry.shape) or any(
                a + n > d for a, n, d in zip(part.at, part.shape, entry.shape)):
            raise CheckpointError("bad checkpoint", [f"{where}: a chunk outside the tensor, or in no listed file"])
        try:
            with open_inside(os.path.join(directory, part.file)) as f:
                if os.fstat(f.fileno()).st_size != files[part.file]:
                    raise CheckpointError("bad checkpoint", [f"{where}: the file changed since its metadata was read"])
                f.seek(part.offset)
                blob = f.read(part.nbytes)
            chunk = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch.load of a damaged blob raises anything
            raise CheckpointError("bad checkpoint", [f"{where}: {type(exc).__name__}: {str(exc)[:160]}"]) from exc
        if not isinstance(chunk, torch.Tensor) or list(chunk.shape) != part.shape or chunk.dtype != dtype:
            raise CheckpointError("bad checkpoint", [f"{where}: the chunk is not the {entry.dtype} tensor of shape "
                                                     f"{part.shape} the metadata says"])
        place = tuple(slice(a, a + n) for a, n in zip(part.at, part.shape))
        whole[place] = chunk
        if covered is not None:
            covered[place] = True
    if covered is not None and not bool(covered.all()):
        raise CheckpointError("bad checkpoint", [f"{label}: its chunks leave part of it uncovered"])
    return whole


def save_stage(directory: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Saves one stage's tensors with DCP's own writer into ``directory`` (made here); returns their
    metadata as plain data for :func:`merge`: ``{"version", "tensors": {fqn: {"dtype", "size",
    "chunks": [{"offsets", "sizes", "file", "offset", "length"}]}}}``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        metadata = dcp.save(dict(tensors), storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    described: dict[str, Any] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        assert isinstance(meta, TensorStorageMetadata), fqn
        chunks = []
        for chunk in meta.chunks:
            info = metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
            chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), "file": info.relative_path,
                           "offset": info.offset, "length": info.length})
        described[fqn] = {"dtype": str(meta.properties.dtype).removeprefix("torch."), "size": list(meta.size),
                          "chunks": chunks}
    return {"version": metadata.version, "tensors": described}


def merge(directory: str, stages: Sequence[Mapping[str, Any]], files: Mapping[tuple[int, str], str]) -> None:
    """Writes ``directory``'s ``.metadata`` (fsynced) for the stages' saves, whose files now lie in
    ``directory`` under ``files[(stage, the name DCP gave it)]``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for s, saved in enumerate(stages):
        for fqn, meta in saved["tensors"].items():
            chunks = []
            for chunk in meta["chunks"]:
                offsets = torch.Size(chunk["offsets"])
                chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(chunk["sizes"])))
                storage[MetadataIndex(fqn, offsets)] = _StorageInfo(files[(s, chunk["file"])], chunk["offset"],
                                                                    chunk["length"])
            state[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=DTYPES[meta["dtype"]]),
                                               size=torch.Size(meta["size"]), chunks=chunks)
    metadata = Metadata(state_dict_metadata=state, planner_data={fqn: (fqn,) for fqn in state},
                        storage_data=storage, version=stages[0]["version"] if stages else None)
    path = os.path.join(directory, METADATA)
    with open(path + ".tmp", "xb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(path + ".tmp", path)
