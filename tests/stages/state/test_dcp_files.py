"""Reading torch.distributed.checkpoint directories safely: metadata that asks for anything but DCP's own
record classes is refused before anything runs, and chunks must be the tensors the metadata says."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from stages.state import checkpoint as ck
from stages.state import dcp_files
from stages.state.manifest import DCP, CheckpointError


def test_metadata_that_asks_for_a_function_is_refused_and_never_runs(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    # pickle protocol 0: call os.system("touch ran") while loading.
    (tmp_path / ".metadata").write_bytes(f"cos\nsystem\n(S'touch {ran}'\ntR.".encode())
    with pytest.raises(CheckpointError, match=r"not DCP's[\s\S]*asks for os\.system"):
        ck.read_manifest(str(tmp_path))
    assert not ran.exists()


def test_metadata_that_is_not_a_pickle_or_not_metadata_is_named(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(CheckpointError, match="cannot be read as DCP metadata"):
        dcp_files.manifest(str(tmp_path))
    (tmp_path / ".metadata").write_bytes(b"\x80\x04K\x07.")  # the integer 7
    with pytest.raises(CheckpointError, match="holds no Metadata"):
        dcp_files.manifest(str(tmp_path))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP called in one process on purpose
def test_a_dcp_save_reads_back_exactly_and_a_damaged_chunk_is_named(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.LayerNorm(4)).to(torch.bfloat16)
    state = {**model.state_dict(), "step": torch.tensor(3)}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    version, manifest = ck.read_manifest(str(tmp_path))
    assert manifest.source == DCP and set(manifest.model) == set(state)
    again = ck.Manifest.from_wire(manifest.to_wire())  # as the head sends it to a stage
    for key, value in state.items():
        assert torch.equal(ck.read_entry(version, again.model[key], again.files, key, DCP), value), key
    [name] = again.files
    path = tmp_path / name
    part = again.model["0.weight"].parts[0]
    data = bytearray(path.read_bytes())
    data[part.offset:part.offset + 64] = b"\0" * 64  # the blob's zip header
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp, 0\.weight"):
        ck.read_entry(version, again.model["0.weight"], again.files, "0.weight", DCP)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP called in one process on purpose
def test_chunks_that_leave_part_of_a_tensor_uncovered_are_refused(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(4, 2)}, checkpoint_id=str(tmp_path), no_dist=True)
    _, manifest = ck.read_manifest(str(tmp_path))
    entry = manifest.model["w"]
    part = entry.parts[0]
    # The metadata claims a 6 x 2 tensor whose one chunk of 4 rows is all there is.
    claimed = ck.TensorEntry(shape=[6, 2], dtype=entry.dtype, shard=None, parts=[part, part])
    with pytest.raises(CheckpointError, match="leave part of it uncovered"):
        ck.read_entry(str(tmp_path), claimed, manifest.files, "w", DCP)
    assert os.listdir(tmp_path)
