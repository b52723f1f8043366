"""``job.export``: a model directory that ``from_pretrained`` and ``load_state_dict(strict=True)`` load,
written stage by stage under the model's own names, each tied tensor once, with the model's config."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from actors import Cluster
from examples import hf
from examples.models import residual_mlp
from stages import CheckpointError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

SEQ, VOCAB = 8, 64
GPT2 = {"dim": 32, "heads": 2, "vocab": VOCAB, "positions": 16, "layers": 4}
MLP = {"blocks": 4, "dim": 16, "hidden": 32}


def lm_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (8, SEQ), generator=generator),
            torch.randint(0, VOCAB, (8, SEQ), generator=generator))


def read_directory(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export's safetensors files, with safetensors' own reader."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            part = load_file(str(directory / name))
            assert not state.keys() & part.keys(), "a tensor in two files"
            state.update(part)
    return state


@pytest.mark.asyncio(loop_scope="package")
async def test_an_exported_gpt2_loads_with_from_pretrained_and_gives_the_jobs_logits(
    cluster: Cluster, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    async with await cluster.train(model="examples.hf:gpt2", model_kwargs=GPT2, loss="examples.models:lm_loss",
                                   pipeline_stages=2, micro_batches=2, split_points=["transformer.h.2"],
                                   example_inputs=lm_batch(0)[0][:4], optimizer=("torch.optim:SGD", {"lr": 0.1}),
                                   dynamic_shapes=False) as job:  # its batches have one shape
        await job.step(*lm_batch(1))  # trained: the weights are no longer the factory's
        directory = Path(await job.export(tmp_path / "gpt2"))
        inputs, targets = lm_batch(2)
        evaluated = await job.evaluate(inputs, targets, outputs=True)
        trained = await job.state_dict()
    assert sorted(os.listdir(directory)) == ["config.json", "model-00001-of-00002.safetensors",
                                             "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    # The tied head once, under the embedding's name (what save_pretrained keeps), in the first stage's file.
    assert "lm_head.weight" not in index["weight_map"]
    assert index["weight_map"]["transformer.wte.weight"] == "model-00001-of-00002.safetensors"
    assert index["weight_map"]["transformer.h.3.mlp.c_fc.weight"] == "model-00002-of-00002.safetensors"
    assert set(index["weight_map"]) == set(read_directory(directory))
    assert json.loads((directory / "config.json").read_text())["n_layer"] == 4
    model = transformers.GPT2LMHeadModel.from_pretrained(str(directory)).eval()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied again by transformers
    for key, value in trained.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)
    with torch.no_grad():
        logits = model(inputs).logits
    torch.testing.assert_close(logits, evaluated.outputs, rtol=1e-5, atol=1e-5)  # the last stage returns the logits


@pytest.mark.asyncio(loop_scope="package")
async def test_a_tensor_parallel_pipeline_exports_whole_tensors_that_a_strict_load_takes(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with await cluster.train(model="examples.models:residual_mlp", model_kwargs=MLP, pipeline_stages=2,
                                   tensor_parallel=2, micro_batches=2) as job:
        generator = torch.Generator().manual_seed(3)
        await job.step(torch.randn(4, 3, 16, generator=generator), torch.randn(4, 3, 16, generator=generator))
        directory = Path(await job.export(tmp_path / "mlp"))
        trained = await job.state_dict()
    assert sorted(os.listdir(directory)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                             "model.safetensors.index.json"]  # the slices' staging is gone
    model: nn.Module = residual_mlp(**MLP)
    model.load_state_dict(read_directory(directory), strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, trained[key]), key
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in trained.values())


@pytest.mark.asyncio(loop_scope="package")
async def test_one_stage_exports_one_file_and_a_directory_that_holds_something_is_refused(
    cluster: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    async with await cluster.train(model="examples.models:residual_mlp", model_kwargs=MLP, pipeline_stages=1,
                                   micro_batches=1) as job:
        with pytest.raises(CheckpointError, match="is not empty"):
            await job.export(tmp_path / "taken")
        assert (tmp_path / "taken" / "notes.txt").read_text() == "mine" and len(os.listdir(tmp_path / "taken")) == 1
        directory = Path(await job.export(tmp_path / "one"))
        trained = await job.state_dict()
    assert os.listdir(directory) == ["model.safetensors"]
    assert read_directory(directory).keys() == trained.keys()


# -- torch.distributed.checkpoint -----------------------------------------------------------------


def dcp_save_sharded(state: dict[str, torch.Tensor], directory: Path) -> None:
    """A DCP checkpoint as a sharded save leaves one: each tensor of two dims or more in two chunks
    along dim 0 (as FSDP's), written by DCP's own writer with the chunks' offsets in its metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType, TensorWriteData
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import TensorProperties

    class Chunked(DefaultSavePlanner):
        """Saves every 2-d tensor as two chunks of rows (a rank's shards, as FSDP's)."""

        def create_local_plan(self):  # type: ignore[no-untyped-def]
            plan = super().create_local_plan()
            items = []
            for item in plan.items:
                tensor = self.state_dict[item.index.fqn]
                if item.type != WriteItemType.TENSOR or tensor.dim() < 2 or tensor.shape[0] < 2:
                    items.append(item)
                    continue
                half = tensor.shape[0] // 2
                for start, rows in ((0, half), (half, tensor.shape[0] - half)):
                    offsets = torch.Size([start] + [0] * (tensor.dim() - 1))
                    sizes = torch.Size([rows, *tensor.shape[1:]])
                    items.append(WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, sizes),
                                                                       properties=TensorProperties.create_from_tensor(tensor),
                                                                       size=tensor.size())))
            return dataclasses.replace(plan, items=items)

        def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
            tensor = self.state_dict[write_item.index.fqn]
            if write_item.type == WriteItemType.SHARD:
                chunk = write_item.tensor_data.chunk
                return tensor.narrow(0, chunk.offsets[0], chunk.sizes[0]).contiguous()
            return super().resolve_data(write_item)

    metadata = dcp.save(state, checkpoint_id=str(directory), planner=Chunked(), no_dist=True)
    chunked = [m for m in metadata.state_dict_metadata.values()
               if isinstance(m, TensorStorageMetadata) and len(m.chunks) == 2]
    assert chunked, "the save was not sharded"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP called in one process on purpose
@pytest.mark.asyncio(loop_scope="package")
async def test_a_dcp_export_loads_with_dcp_and_a_sharded_dcp_checkpoint_loads_into_any_layout(
    cluster: Cluster, tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(11)
    pretrained = residual_mlp(**MLP)
    dcp_save_sharded(dict(pretrained.state_dict()), tmp_path / "sharded")
    async with await cluster.train(model="examples.models:residual_mlp", model_kwargs=MLP, pipeline_stages=2,
                                   tensor_parallel=2, micro_batches=2) as job:
        assert await job.load(tmp_path / "sharded") == 0  # weights alone: the job's step stays
        loaded = await job.state_dict()
        generator = torch.Generator().manual_seed(3)
        await job.step(torch.randn(4, 3, 16, generator=generator), torch.randn(4, 3, 16, generator=generator))
        directory = Path(await job.export(tmp_path / "dcp", format="dcp"))
        trained = await job.state_dict()
    for key, value in pretrained.state_dict().items():
        assert torch.equal(loaded[key], value), key
    assert sorted(os.listdir(directory)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    model = residual_mlp(**MLP)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(directory), no_dist=True)  # torch's own reader, in one process
    for key, value in state.items():
        assert torch.equal(value, trained[key]), key

