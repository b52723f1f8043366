"""Weights in safetensors files read as a checkpoint's manifest (stages/state/safetensors_files.py).

Run: .venv/bin/python -m pytest tests/stages/state/test_safetensors_files.py -q
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stages.state.checkpoint import read_entry, read_manifest
from stages.state.manifest import SAFETENSORS, CheckpointError, Manifest
from stages.state.safetensors_files import manifest

STATE = {"embed.weight": torch.randn(10, 4), "head.bias": torch.arange(3, dtype=torch.bfloat16),
         "steps": torch.tensor([7], dtype=torch.int64), "mask": torch.tensor([True, False])}


def test_a_files_header_becomes_entries_that_read_back_the_tensors(tmp_path: Path) -> None:
    save_file(STATE, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    version, found = read_manifest(str(tmp_path))  # no LATEST: the safetensors files are the weights
    assert version == str(tmp_path) and found.source == SAFETENSORS and found.optimizer_state == {}
    for key, value in STATE.items():
        entry = found.model[key]
        assert (entry.shape, entry.dtype, entry.parts[0].crc32) == (list(value.shape), str(value.dtype)[6:], None)
        assert torch.equal(read_entry(version, entry, found.files, key), value)
    again = Manifest.from_wire(found.to_wire())  # the head and the stages pass it on as it is
    assert again == found


def test_an_index_names_the_shards_that_hold_each_tensor(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    found = manifest(str(tmp_path))
    assert sorted(found.files) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert torch.equal(read_entry(str(tmp_path), found.model["b"], found.files, "b"), torch.zeros(3))


@pytest.mark.parametrize(("header", "problem"), [
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, "do not hold a float32 tensor of shape [4]"),
    ({"x": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 2]}}, "an unknown dtype 'Q4'"),
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16000]}}, "inside the file"),
    ({"x": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}, "must be lists of integers"),
    ([1, 2], "the header is not a JSON object"),
])
def test_a_header_that_does_not_fit_its_file_is_refused_by_name(tmp_path: Path, header: object, problem: str) -> None:
    text = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + bytes(16))
    with pytest.raises(CheckpointError, match="cannot be read as safetensors weights") as info:
        manifest(str(tmp_path))
    assert problem in str(info.value)


def test_an_index_may_not_lead_out_of_its_directory(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="is not a safetensors file name in this directory"):
        manifest(str(tmp_path))
    wire = {"format": SAFETENSORS, "version": 1, "step": 0, "optimizer": "", "files": {"../x.safetensors": 1},
            "model": {}, "optimizer_state": {}}
    with pytest.raises(CheckpointError, match="files: expected a map of shard file name"):
        Manifest.from_wire(wire)


def test_a_weights_file_that_is_a_link_is_refused(tmp_path: Path) -> None:
    """The directory is checked to lie where its reader may read; a link in it could lead anywhere."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    save_file({"a": torch.ones(2)}, str(elsewhere / "secret.safetensors"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.safetensors").symlink_to(elsewhere / "secret.safetensors")
    with pytest.raises(CheckpointError, match="a symbolic link, which a client's load does not follow"):
        manifest(str(mine))


def test_the_admins_load_reads_a_hugging_face_cache_snapshot_through_its_links(tmp_path: Path) -> None:
    """Found by review: the Hugging Face cache keeps a snapshot's files as links into its blobs
    (models--me--mlp/snapshots/REV/model.safetensors -> ../../blobs/SHA), and every load of one was refused with
    'Too many levels of symbolic links', the admin's too, who may read anywhere. The admin's manifest and reads
    go through the links (a client's are still refused, above); the plan says so to every stage."""
    from stages.state.checkpoint import read_entry, read_manifest

    repo = tmp_path / "models--me--mlp"
    (repo / "blobs").mkdir(parents=True)
    save_file({"a": torch.arange(3.0)}, str(repo / "blobs" / "0123abcd"))
    snapshot = repo / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to("../../blobs/0123abcd")
    version, found = read_manifest(str(snapshot))  # the admin: within None
    assert found.links and Manifest.from_wire(found.to_wire()).links
    assert torch.equal(read_entry(version, found.model["a"], found.files, "a", found.source, found.links),
                       torch.arange(3.0))
    with pytest.raises(CheckpointError, match="a symbolic link, which a client's load does not follow"):
        read_entry(version, found.model["a"], found.files, "a", found.source)
    with pytest.raises(CheckpointError, match="a symbolic link, which a client's load does not follow"):
        read_manifest(str(snapshot), within=str(tmp_path))


@pytest.mark.parametrize(("header", "problem"), [
    ({"x": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}}, "x: an unknown dtype \"['F32']\""),
])
def test_a_header_of_the_wrong_kinds_is_refused_by_name_not_by_a_type_error(tmp_path: Path, header: object,
                                                                          problem: str) -> None:
    """Found by review: a list as a dtype, or as an index's file, failed the load with "unhashable type:
    'list'", naming neither the file nor the key."""
    text = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + bytes(16))
    with pytest.raises(CheckpointError, match="cannot be read as safetensors weights") as info:
        manifest(str(tmp_path))
    assert problem in str(info.value)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": ["model.safetensors"]}}))
    with pytest.raises(CheckpointError) as listed:
        manifest(str(tmp_path))
    assert "a: \"['model.safetensors']\" is not a safetensors file name in this directory" in str(listed.value)
