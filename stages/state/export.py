"""A trained model as people load it: a directory of safetensors weights under the model's own names.

``job.export(DIR)`` writes what ``from_pretrained`` and ``load_state_dict(strict=True)``
read::

    DIR/model.safetensors                     one pipeline stage: every weight
    DIR/model-00001-of-00004.safetensors      or one file per pipeline stage, written by that stage
    DIR/model.safetensors.index.json          and Hugging Face's index of them (several files)
    DIR/config.json                           the model's config, when it has one (a transformers model)

Every pipeline stage writes its own file, at once, from its own memory, so no process
ever holds more than its stage: with tensor parallelism the ranks first write their
slices into a staging directory, and each stage's first rank reads its tensors back
whole. A tensor tied across stages (an embedding and a language-model head) is written
once, under the name the model gives it first (the embedding's: what ``save_pretrained``
keeps); a tensor one stage holds under two names likewise.

With ``format="dcp"`` the directory is a ``torch.distributed.checkpoint`` one instead
(:mod:`stages.state.dcp_files`): every stage saves its tensors with DCP's own writer,
and the coordinator merges their metadata into one ``.metadata``, written last.

The staging directory lies inside ``DIR``; the files move out of it by ``os.rename``
when every stage is done, the weights first and the index and config last, so an
export that was stopped halfway holds no index (nor, on one stage, no
``model.safetensors``) for a loader to trust.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from stages.state import checkpoint, dcp_files, safetensors_files
from stages.state.manifest import CheckpointError

__all__ = ["CONFIG", "FORMATS", "begin_export", "commit_export", "file_name", "unique_tensors", "write_export"]

CONFIG = "config.json"
FORMATS = ("safetensors", "dcp")
_FILE = {"safetensors": re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors"), "dcp": re.compile(r"dcp-\d{5}")}


def file_name(stage: int, stages: int, format: str = "safetensors") -> str:
    """Stage ``stage``'s file: ``model.safetensors`` alone, or Hugging Face's ``model-00001-of-00004.safetensors``;
    in DCP's format, the directory its writer fills (``dcp-00000``)."""
    if format == "dcp":
        return f"dcp-{stage:05d}"
    return safetensors_files.SINGLE if stages == 1 else f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def unique_tensors(state: Mapping[str, torch.Tensor], primary: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """``state`` with each tied tensor once: a name whose tied group is first named otherwise goes
    (``primary``: a name -> its group's first name), and so does a second name of one tensor."""
    kept: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in state.items():
        if primary.get(name, name) != name:
            continue
        same = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape))
        if tensor.numel() and same in seen:
            continue
        seen.add(same)
        kept[name] = tensor
    return kept


def begin_export(directory: str, job: str, *, within: str | None = None) -> str:
    """Makes ``directory`` (new, or empty) and job ``job``'s staging directory in it; returns the staging's path.

    Raises:
        CheckpointError: ``directory`` holds something, lies outside ``within``, or cannot be made.
    """
    directory = checkpoint.check_directory(directory)
    if within is not None:
        checkpoint.check_within(directory, within)
    if os.path.isdir(directory) and any(not n.startswith(".staging-") for n in os.listdir(directory)):
        raise CheckpointError(f"{directory} is not empty", ["export to a new or empty directory"])
    return checkpoint.begin_version(directory, job, within=within)


def write_export(staging: str, file: str, tensors: Mapping[str, torch.Tensor],
                 format: str = "safetensors") -> dict[str, Any]:
    """Writes one stage's file of the export into ``staging`` (fsynced); returns ``{"file", "bytes",
    "tensors": {name: bytes}}`` for the index (in DCP's format, also ``"saved"``: what
    :func:`stages.state.dcp_files.save_stage` returns).

    Raises:
        CheckpointError: not an export file name, or the file cannot be written.
    """
    if format not in _FILE or _FILE[format].fullmatch(file) is None:
        raise CheckpointError(f"{file[:60]!r} is not an export's file name in the {str(format)[:20]!r} format")
    checkpoint.check_staging(staging)
    if format == "dcp":
        saved = dcp_files.save_stage(os.path.join(staging, file), tensors)
        return {"file": file, "tensors": {name: t.numel() * t.element_size() for name, t in tensors.items()},
                "saved": saved}
    size, parts = checkpoint.write_tensors(os.path.join(staging, file), tensors)
    return {"file": file, "bytes": size, "tensors": {name: part.nbytes for name, part in parts.items()}}


def _commit_dcp(directory: str, staging: str, written: Sequence[Mapping[str, Any]]) -> None:
    """Moves every stage's ``.distcp`` files into ``directory`` (``__S_K.distcp``: stage S's K-th), then
    writes the merged ``.metadata``."""
    files: dict[tuple[int, str], str] = {}
    for s, answer in enumerate(written):
        names = sorted({chunk["file"] for meta in answer["saved"]["tensors"].values() for chunk in meta["chunks"]})
        for k, name in enumerate(names):
            files[(s, name)] = f"__{s}_{k}.distcp"
            os.rename(os.path.join(staging, answer["file"], name), os.path.join(directory, files[(s, name)]))
    dcp_files.merge(directory, [answer["saved"] for answer in written], files)


def commit_export(directory: str, staging: str, written: Sequence[Mapping[str, Any]], config: str | None,
                  format: str = "safetensors") -> str:
    """Moves every stage's file out of ``staging`` into ``directory``, then writes the index (several
    files) and ``config.json`` (the model's, when ``config`` is its JSON); removes ``staging``.
    In DCP's format: the stages' ``.distcp`` files, then the merged ``.metadata``.

    Raises:
        CheckpointError: a name given twice, a file missing, or the filesystem refused.
    """
    directory = checkpoint.check_directory(directory)
    checkpoint.check_staging(staging)
    weight_map: dict[str, str] = {}
    for answer in written:
        for name in answer["tensors"]:
            if name in weight_map:
                raise CheckpointError(f"the export to {directory} is not one model",
                                      [f"{name} is in {weight_map[name]} and {answer['file']}"])
            weight_map[name] = answer["file"]
    try:
        if format == "dcp":
            _commit_dcp(directory, staging, written)
            written, config = [], None
        for answer in written:
            os.rename(os.path.join(staging, answer["file"]), os.path.join(directory, answer["file"]))
        last: list[tuple[str, str]] = []
        if len(written) > 1:
            size = sum(nbytes for answer in written for nbytes in answer["tensors"].values())
            last.append((safetensors_files.INDEX, json.dumps(safetensors_files.index(weight_map, size), indent=2)))
        if config is not None:
            last.append((CONFIG, config))
        for name, text in last:
            path = os.path.join(staging, name)
            with open(path, "x") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.rename(path, os.path.join(directory, name))
        shutil.rmtree(staging)
        checkpoint.fsync_directory(directory)
    except OSError as exc:
        raise CheckpointError(f"cannot complete the export to {directory}", [str(exc)]) from exc
    return directory
