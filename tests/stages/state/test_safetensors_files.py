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
    with pytest.raises(CheckpointError, match="cannot be read as safetensors weights"):
        manifest(str(mine))
