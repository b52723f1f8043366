"""Checkpoints through a running cluster: exact resumption, all-or-nothing loads, other layouts, bad files.

The package's shared LocalCluster (4 nodes, tests/schedulers/conftest.py) serves the
module, except the tests of the message limit: they share one of 2 nodes whose limit
is 64 KiB. The format and the kill windows of a save are tested without a cluster in
tests/stages/state/test_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from actors import Cluster, LocalCluster, RemoteError
from schedulers.client import CheckpointError, Job
from schedulers.job_actor import JobActor

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.asyncio(loop_scope="package")]

MLP = {"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 4, "dim": 16, "hidden": 32}}
LINEARS = "tests.helpers.checkpoint_models:linears"


def batches(count: int, dim: int = 16, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, dim, generator=gen), torch.randn(8, 4, dim, generator=gen)) for _ in range(count)]


async def train(job: Job, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    return [(await job.step(x, y)).loss for x, y in data]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("optimizer", [("torch.optim:Adam", {"lr": 0.01}), ("torch.optim:AdamW", {"lr": 0.01})],
                         ids=["adam", "adamw"])
async def test_training_after_save_and_load_equals_training_without_the_interruption(
    cluster: Cluster, tmp_path: Path, optimizer: tuple[str, dict[str, Any]]
) -> None:
    first, then = batches(2, seed=1), batches(2, seed=2)
    directory = tmp_path / "ckpt"
    async with await cluster.train(**MLP, optimizer=optimizer, pipeline_stages=2, micro_batches=2) as job:
        await train(job, first)
        version = await job.save(directory)
        losses_a = await train(job, then)
        state_a = await job.state_dict()
    assert version == str(directory / "v000001")
    assert sorted(os.listdir(directory)) == ["LATEST", "v000001"]
    assert sorted(os.listdir(version)) == ["manifest.json", "model.safetensors.index.json", "p0-t0.safetensors",
                                           "p1-t0.safetensors"]
    manifest = json.loads((Path(version) / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["optimizer"] == optimizer[0]
    assert sorted(manifest["optimizer_state"]["3.fc1.weight"]) == ["exp_avg", "exp_avg_sq", "step"]
    assert set(manifest["optimizer_state"]) == set(manifest["model"])  # every parameter has moments

    # A fresh job from another seed: the load must bring weights, moments and step count.
    async with await cluster.train(**MLP, optimizer=optimizer, pipeline_stages=2, micro_batches=2, seed=9) as job:
        assert await job.load(directory) == 2
        assert (await job.describe()).steps == 2
        losses_b = await train(job, then)
        state_b = await job.state_dict()
    assert losses_a == losses_b
    assert_same(state_a, state_b)


async def test_a_new_save_replaces_the_old_one_and_clears_its_jobs_killed_saves_leftovers(
    cluster: Cluster, tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    async with await cluster.train(**MLP, pipeline_stages=2, micro_batches=2) as job:
        await job.save(directory)
        (directory / f".staging-{job.id}-deadbeef").mkdir()  # as a killed save of this job leaves it
        (directory / f".staging-{job.id}-deadbeef" / "p0-t0.safetensors").write_bytes(b"half")
        (directory / ".staging-job999-0000cafe").mkdir()  # another job's save in progress: not this one's to remove
        await train(job, batches(1))
        assert await job.save(directory) == str(directory / "v000002")
        assert sorted(os.listdir(directory)) == [".staging-job999-0000cafe", "LATEST", "v000002"]
        (directory / ".staging-job999-0000cafe").rmdir()
        assert (directory / "LATEST").read_text() == "v000002\n"
        trained = await job.state_dict()
        await train(job, batches(1, seed=3))
        await job.save(directory / "other")
        await job.load(directory)
        assert_same(await job.state_dict(), trained)


async def test_a_flipped_byte_anywhere_is_named_by_file_and_key_and_nothing_loads(
    cluster: Cluster, tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    async with await cluster.train(**MLP, optimizer=("torch.optim:Adam", {"lr": 0.01}), pipeline_stages=2,
                                   micro_batches=2) as job:
        await train(job, batches(1))
        version = Path(await job.save(directory))
        manifest = json.loads((version / "manifest.json").read_text())
        parts = [(label, part) for label, part in _parts(manifest)]
        size = (version / "p1-t0.safetensors").stat().st_size
        await train(job, batches(1, seed=4))
        before = await job.state_dict()
        start = min(part["offset"] for _, part in parts if part["file"] == "p1-t0.safetensors")  # after the header
        for offset in (start, (start + size) // 2, size - 1):  # the first, a middle and the last byte of data
            label = next(label for label, part in parts if part["file"] == "p1-t0.safetensors"
                         and part["offset"] <= offset < part["offset"] + part["nbytes"])
            _flip(version / "p1-t0.safetensors", offset)
            with pytest.raises(CheckpointError, match="checksum mismatch") as info:
                await job.load(directory)
            _flip(version / "p1-t0.safetensors", offset)  # back as it was
            assert f"p1-t0.safetensors, {label}: checksum mismatch" in str(info.value)
            assert len(info.value.problems) == 1
            assert_same(await job.state_dict(), before)
        await job.load(directory)  # undamaged again: it loads
        assert not all(torch.equal(v, before[k]) for k, v in (await job.state_dict()).items())


def _parts(manifest: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    found = [(key, part) for key, entry in manifest["model"].items() for part in entry["parts"]]
    for key, state in manifest["optimizer_state"].items():
        for name, entry in state.items():
            found += [(f"{key} (optimizer {name})", part) for part in entry["parts"]]
    return found


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


MISMATCHES = [
    # (the loading model's dims, dtype, the problems the load must list)
    ([8, 8, 8, 8, 4], "float32", [r"3\.bias: shape \[8\] in the checkpoint, \[4\] in this model",
                                  r"3\.weight: shape \[8, 8\] in the checkpoint, \[4, 8\] in this model"]),
    ([8, 8, 8, 8, 8, 8], "float32", [r"4\.bias: missing from the checkpoint", r"4\.weight: missing"]),
    ([8, 8, 8, 8], "float32", [r"3\.bias: in the checkpoint but no stage holds it",
                               r"3\.weight: in the checkpoint but no stage holds it"]),
    ([8, 8, 8, 8, 8], "float64", [r"0\.weight: dtype float32 in the checkpoint, float64 in this model"]),
]


@pytest.mark.parametrize("dims, dtype, problems", MISMATCHES, ids=["shape", "missing", "extra", "dtype"])
async def test_a_load_that_does_not_fit_lists_every_problem_and_changes_nothing(
    cluster: Cluster, tmp_path: Path, dims: list[int], dtype: str, problems: list[str]
) -> None:
    directory = tmp_path / "ckpt"
    async with await cluster.train(model=LINEARS, model_kwargs={"dims": [8, 8, 8, 8, 8]}, pipeline_stages=2,
                                   micro_batches=2, optimizer=("torch.optim:Adam", {"lr": 0.01})) as job:
        await train(job, batches(1, dim=8))
        await job.save(directory)
    async with await cluster.train(model=LINEARS, model_kwargs={"dims": dims, "dtype": dtype}, pipeline_stages=2,
                                   micro_batches=2, optimizer=("torch.optim:Adam", {"lr": 0.01}), seed=3) as job:
        before = await job.state_dict()
        with pytest.raises(CheckpointError, match="nothing changed") as info:
            await job.load(directory)
        for problem in problems:
            assert any(re.search(problem, p) for p in info.value.problems), (problem, info.value.problems)
        assert_same(await job.state_dict(), before)
        assert (await job.describe()).steps == 0


async def test_one_wrong_shape_in_the_file_leaves_every_stage_unchanged(cluster: Cluster, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    async with await cluster.train(**MLP, pipeline_stages=2, micro_batches=2) as job:
        version = Path(await job.save(directory))
        manifest_path = version / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        manifest["model"]["3.fc2.bias"]["shape"] = [17]  # one tensor of the last stage
        manifest_path.write_text(json.dumps(manifest))
        await train(job, batches(1))
        before = await job.state_dict()
        with pytest.raises(CheckpointError) as info:
            await job.load(directory)
        assert info.value.problems == ["3.fc2.bias: shape [17] in the checkpoint, [16] in this model"]
        assert_same(await job.state_dict(), before)  # stage 0 had nothing wrong and applied nothing either


LAYOUTS = [
    pytest.param({"pipeline_stages": 1}, id="pipeline-2-to-1"),
    pytest.param({"pipeline_stages": 1, "tensor_parallel": 2}, id="pipeline-2-to-tensor-2"),
    pytest.param({"pipeline_stages": 1, "data_parallel": 2}, id="pipeline-2-to-data-2"),
    pytest.param({"pipeline_stages": 2, "schedule": "gpipe"}, id="another-schedule"),
]


async def resume_in_another_layout(
    cluster: Cluster, directory: Path, optimizer: tuple[str, dict[str, Any]], saving: dict[str, Any],
    loading: dict[str, Any],
) -> Path:
    """Saves after 2 steps in one layout, loads into another, and checks the next step matches; the version."""
    then = batches(1, seed=8)
    async with await cluster.train(**MLP, optimizer=optimizer, micro_batches=2, **saving) as job:
        await train(job, batches(2))
        version = Path(await job.save(directory))
        saved = await job.state_dict()
        losses_a = await train(job, then)
        state_a = await job.state_dict()
    async with await cluster.train(**MLP, optimizer=optimizer, micro_batches=2, seed=4, **loading) as job:
        await job.load(directory)
        assert_same(await job.state_dict(), saved)
        losses_b = await train(job, then)  # the moments came along: the next step matches
        state_b = await job.state_dict()
    assert losses_b == pytest.approx(losses_a, rel=1e-5)
    for key, value in state_a.items():
        torch.testing.assert_close(state_b[key], value, rtol=1e-5, atol=1e-6)
    return version


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_a_checkpoint_loads_into_another_layout(cluster: Cluster, tmp_path: Path, layout: dict[str, Any]) -> None:
    await resume_in_another_layout(cluster, tmp_path / "ckpt", ("torch.optim:Adam", {"lr": 0.01}),
                                   {"pipeline_stages": 2}, layout)


async def test_a_tensor_parallel_checkpoint_loads_into_a_pipeline(cluster: Cluster, tmp_path: Path) -> None:
    version = await resume_in_another_layout(cluster, tmp_path / "ckpt", ("torch.optim:AdamW", {"lr": 0.01}),
                                             {"tensor_parallel": 2}, {"pipeline_stages": 2})
    assert sorted(os.listdir(version)) == ["manifest.json", "model.safetensors.index.json", "p0-t0.safetensors",
                                           "p0-t1.safetensors"]
    manifest = json.loads((version / "manifest.json").read_text())
    fc1 = manifest["model"]["0.fc1.weight"]
    assert fc1["shape"] == [32, 16] and fc1["shard"] == [0, 2, 1] and [p["file"] for p in fc1["parts"]] == \
        ["p0-t0.safetensors", "p0-t1.safetensors"]
    assert manifest["optimizer_state"]["0.fc1.weight"]["exp_avg"]["shard"] == [0, 2, 1]
    assert manifest["model"]["0.norm.weight"]["shard"] is None  # replicated: written once, by tensor rank 0
    index = json.loads((version / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["0.norm.weight"] == "p0-t0.safetensors" and "0.fc1.weight" not in index["weight_map"]
    assert index["metadata"]["tensor_parallel"]["0.fc1.weight"] == ["p0-t0.safetensors", "p0-t1.safetensors"]


async def test_weights_only_keeps_the_optimizer_and_allows_another_one(cluster: Cluster, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    async with await cluster.train(**MLP, optimizer=("torch.optim:Adam", {"lr": 0.01}), pipeline_stages=2,
                                   micro_batches=2) as job:
        await train(job, batches(1))
        await job.save(directory)
        saved = await job.state_dict()
    async with await cluster.train(**MLP, pipeline_stages=2, micro_batches=2, seed=2) as job:  # SGD
        with pytest.raises(CheckpointError, match="holds torch.optim:Adam state but this job uses torch.optim:SGD"):
            await job.load(directory)
        await train(job, batches(1))
        assert await job.load(directory, weights_only=True) == 1
        assert_same(await job.state_dict(), saved)
        assert (await job.describe()).steps == 1  # its own count


async def test_directories_that_are_not_checkpoints_are_refused_clearly(cluster: Cluster, tmp_path: Path) -> None:
    async with await cluster.train(**MLP, pipeline_stages=2, micro_batches=2) as job:
        (tmp_path / "empty").mkdir()
        old = tmp_path / "old"
        old.mkdir()
        (old / "model.pt").write_bytes(b"an unversioned checkpoint")
        messages = set()
        for name in ("nothing", "empty", "old"):  # one message, which tells none of them apart
            with pytest.raises(CheckpointError, match=f"no actorpipe checkpoint at {tmp_path}/{name}") as info:
                await job.load(tmp_path / name)
            assert "model.pt, the unversioned format of earlier actorpipe, loads with torch.load" in str(info.value)
            messages.add(str(info.value).replace(name, "DIR"))
        assert len(messages) == 1
        with pytest.raises(CheckpointError, match="is not an actorpipe checkpoint directory") as info:
            await job.save(old)  # it holds something else: not ours to fill
        assert "save to a new or empty directory" in str(info.value)
        assert sorted(os.listdir(old)) == ["model.pt"]
        # The admin's relative path comes with the driver's working directory; without it, it is refused.
        save = job.ref.endpoint(JobActor.save)
        with pytest.raises(RemoteError, match="must be absolute"):
            await save.call("relative/ckpt")
        with pytest.raises(RemoteError, match="must be absolute and normalized"):
            await save.call(f"{tmp_path}/a/../../escape")
        (tmp_path / "a-file").write_text("not a directory")
        with pytest.raises(CheckpointError, match=r"on node node\d: cannot write a checkpoint to") as info:
            await job.save(tmp_path / "a-file" / "ckpt")  # no node can make a directory there
        assert "Not a directory" in str(info.value)


def _checksums(version: Path) -> dict[str, int]:
    manifest = json.loads((version / "manifest.json").read_text())
    return {label: part["crc32"] for label, part in _parts(manifest)}


# A message limit small enough that a model over it is a few KiB of compute, not gigabytes: the
# same property as a 2 GiB model under the default 1 GiB limit, at a thousandth of the bytes.
LIMIT = 64 << 10


@pytest_asyncio.fixture(loop_scope="package", scope="module")
async def limited() -> AsyncIterator[tuple[LocalCluster, Cluster]]:
    """Two nodes whose every process (head, nodes, this driver) takes messages of at most ``LIMIT`` bytes."""
    local = LocalCluster(nodes=2, max_message_bytes=LIMIT)
    async with local as cluster:
        yield local, cluster


async def test_a_model_over_the_message_limit_checkpoints_and_loads_without_one_big_message(
    limited: tuple[LocalCluster, Cluster], tmp_path: Path
) -> None:
    """8 linears of 64 x 64 float32 (16 KiB each), 2 stages of 64 KiB: no stage's share fits one 64 KiB message."""
    local, cluster = limited
    assert local.max_message_bytes == LIMIT
    dims = [64] * 9
    async with await cluster.train(model=LINEARS, model_kwargs={"dims": dims, "bias": False}, pipeline_stages=2,
                                   micro_batches=1, optimizer=("torch.optim:SGD", {"lr": 0.1})) as job:
        with pytest.raises(RemoteError, match=r"--max-message-bytes N on the head and every worker.*job\.save"):
            await job.state_dict()  # one stage's share does not fit in one message
        first = Path(await job.save(tmp_path / "a"))
        index = json.loads((first / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == 2 * LIMIT and set(index["weight_map"].values()) == {
            "p0-t0.safetensors", "p1-t0.safetensors"}
        gen = torch.Generator().manual_seed(0)
        await job.step(torch.randn(2, 64, generator=gen), torch.randn(2, 64, generator=gen))
        second = Path(await job.save(tmp_path / "b"))
        assert await job.load(tmp_path / "a") == 0
        third = Path(await job.save(tmp_path / "c"))  # what the stages hold after the load
    assert len(_checksums(first)) == 8
    assert _checksums(third) == _checksums(first)
    assert all(_checksums(second)[k] != crc for k, crc in _checksums(first).items())  # the step changed every layer


async def test_the_message_limit_reaches_every_process_and_save_does_not_need_it(
    limited: tuple[LocalCluster, Cluster], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="max_message_bytes must be an int >= 1"):
        LocalCluster(nodes=1, max_message_bytes=0)
    _, small = limited
    mlp = {**MLP, "model_kwargs": {"blocks": 4, "dim": 64, "hidden": 256}}  # about 270 KB per stage
    async with await small.train(**mlp, pipeline_stages=2, micro_batches=1) as job:
        # The stage's own runtime refuses its 270 KB answer: the nodes took the limit.
        with pytest.raises(RemoteError, match=r"over the limit of 65536; raise the limit .*--max-message-bytes"):
            await job.state_dict()
        await job.save(tmp_path / "ckpt")
        assert await job.load(tmp_path / "ckpt") == 0


def _write_safetensors(directory: Path, state: dict[str, torch.Tensor], shards: int) -> None:
    """``state`` as Hugging Face keeps a model: one ``model.safetensors``, or shards and their index."""
    from safetensors.torch import save_file

    directory.mkdir()
    if shards == 1:
        save_file(state, str(directory / "model.safetensors"))
        return
    keys = list(state)
    weight_map = {}
    for n in range(shards):
        name = f"model-{n + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[n::shards]}
        save_file(part, str(directory / name))
        weight_map.update(dict.fromkeys(part, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 2])
async def test_safetensors_weights_load_each_stage_its_own_tensors(cluster: Cluster, tmp_path: Path,
                                                                   shards: int) -> None:
    """A directory of safetensors files (one ``model.safetensors``, or shards and their index) loads as
    weights: every stage reads its own tensors from the files; the optimizer and step count stay."""
    torch.manual_seed(7)
    from examples.models import residual_mlp
    weights = {k: v.clone() for k, v in residual_mlp(**MLP["model_kwargs"]).state_dict().items()}
    _write_safetensors(tmp_path / "hf", weights, shards)
    async with await cluster.train(**MLP, optimizer=("torch.optim:Adam", {"lr": 0.01}), pipeline_stages=2,
                                   tensor_parallel=2, micro_batches=2) as job:
        await train(job, batches(1))
        assert await job.load(tmp_path / "hf") == 0
        assert_same(await job.state_dict(), weights)
        assert (await job.describe()).steps == 1  # weights alone: the job's own count and optimizer stay
        await train(job, batches(1))
    bad = dict(weights)
    bad["1.fc1.weight"] = torch.zeros(3, 3)
    _write_safetensors(tmp_path / "wrong", bad, shards)
    async with await cluster.train(**MLP, pipeline_stages=2, micro_batches=2) as job:
        before = await job.state_dict()
        with pytest.raises(CheckpointError, match="1 problem") as info:
            await job.load(tmp_path / "wrong")
        assert "1.fc1.weight" in str(info.value)
        assert_same(await job.state_dict(), before)  # nothing changed anywhere
