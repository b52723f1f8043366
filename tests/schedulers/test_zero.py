"""ZeRO-1 with the pipeline: sharded optimizer state trains exactly as unsharded (see docs/parallelism.md).

The package's shared LocalCluster of 4 nodes (tests/schedulers/conftest.py) serves the
module; every job is 2 pipeline stages x 2 data-parallel replicas. "Exact" means the same bits as the same job with
``zero_stage=0`` (the gradients are the same, and each parameter's update is the one
optimizer step the unsharded job computes), and float32-close to one process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from actors import Cluster, LocalCluster
from schedulers.client import Job
from tests.schedulers.test_training import OPTIMIZERS, WORKLOADS, train_reference

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.asyncio(loop_scope="package")]

MLP = WORKLOADS["mlp"]
MESH = {"pipeline_stages": 2, "data_parallel": 2, "micro_batches": 4, "seed": 0}


async def start(cluster: Cluster, workload: dict[str, Any], **options: Any) -> Job:
    return await cluster.train(model=workload["model"], model_kwargs=workload["kwargs"], loss=workload["loss"],
                               **{"optimizer": workload["optimizer"], **MESH, **options})


async def train(job: Job, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
    return [await job.step(x, y) for x, y in data]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def assert_halved(by_rank: list[int]) -> None:
    """Each stage's (or tensor shard's) two replicas, global ranks s and 2 + s, hold about half its optimizer
    state each."""
    for stage in (0, 1):
        replicas = [by_rank[stage], by_rank[2 + stage]]
        assert 0 < max(replicas) <= 0.55 * sum(replicas), replicas


def assert_close(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float) -> None:
    assert list(state) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=rtol, atol=rtol / 10, msg=lambda m: f"{key}: {m}")


TENSOR_PARALLEL = {"pipeline_stages": 1, "tensor_parallel": 2}  # (P,T,D) = (1,2,2): ranks pair up as with (2,1,2)


@pytest.mark.parametrize(("schedule", "optimizer", "mesh"), [
    ("1f1b", "adam", {}), ("1f1b", "sgd_momentum", {}), ("gpipe", "adam", {}), ("gpipe", "sgd_momentum", {}),
    pytest.param("1f1b", "adam", TENSOR_PARALLEL, id="1f1b-adam-tp2"),
])
async def test_zero1_trains_to_the_bits_of_unsharded_training(cluster: Cluster, schedule: str, optimizer: str,
                                                              mesh: dict[str, int]) -> None:
    workload = {**MLP, "optimizer": OPTIMIZERS[optimizer]}
    runs = {}
    for stage in (0, 1):
        async with await start(cluster, workload, schedule=schedule, zero_stage=stage, **mesh) as job:
            stats = await train(job, workload["batches"]())
            runs[stage] = (stats, await job.state_dict())
    (plain, plain_state), (sharded, sharded_state) = runs[0], runs[1]
    assert_same(sharded_state, plain_state)
    assert [s.loss for s in sharded] == [s.loss for s in plain]
    expected_state, expected_losses = train_reference(workload)
    assert_close(sharded_state, expected_state, rtol=1e-6)
    assert [s.loss for s in sharded] == pytest.approx(expected_losses, rel=1e-6)
    # The optimizer state held when the last step began: each replica half of it.
    whole, halves = plain[-1].optimizer_state_bytes, sharded[-1].optimizer_state_bytes
    assert plain[0].optimizer_state_bytes == [0, 0, 0, 0]  # torch makes it at the first step
    assert whole[0] == whole[2] > 0 and whole[1] == whole[3] > 0  # by global rank: (dp, pp or tp) = 00 01 10 11
    assert [halves[0] + halves[2], halves[1] + halves[3]] == whole[:2]
    assert_halved(halves)


async def test_tied_embeddings_stay_tied_and_exact_with_zero1(cluster: Cluster) -> None:
    workload = {**WORKLOADS["gpt"], "kwargs": {**WORKLOADS["gpt"]["kwargs"], "tie_embeddings": True}}
    states = {}
    for stage in (0, 1):
        async with await start(cluster, workload, schedule="1f1b", zero_stage=stage) as job:
            stats = await train(job, workload["batches"]())
            states[stage] = await job.state_dict()
    head = workload["kwargs"]["layers"] + 1
    pair = ["0.token.weight", f"{head}.out.weight"]
    assert stats[-1].tied == [pair]
    assert torch.equal(states[1][pair[0]], states[1][pair[1]])  # both copies took the same update
    assert_same(states[1], states[0])
    expected_state, _ = train_reference(workload)
    assert_close(states[1], expected_state, rtol=1e-6)


async def test_no_weight_decay_groups_train_as_one_process_sharded_or_not(cluster: Cluster) -> None:
    kwargs = {**WORKLOADS["gpt"]["kwargs"], "tie_embeddings": True}
    workload = {**WORKLOADS["gpt"], "kwargs": kwargs,
                "optimizer": ("torch.optim:SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.2})}
    head = kwargs["layers"] + 1
    # Biases and norms, and the tied projection named as the head names it (stage 1's name for it;
    # stage 0 and one process know it as the token embedding).
    rule = ["biases_and_norms", f"{head}.out.*"]
    runs = {}
    for stage in (0, 1):
        async with await start(cluster, workload, schedule="1f1b", zero_stage=stage, no_weight_decay=rule) as job:
            stats = await train(job, workload["batches"]())
            runs[stage] = (stats, await job.state_dict())
    (plain, plain_state), (sharded, sharded_state) = runs[0], runs[1]
    assert_same(sharded_state, plain_state)
    assert [s.loss for s in sharded] == [s.loss for s in plain]
    expected_state, expected_losses = train_reference(workload, rule)
    assert_close(sharded_state, expected_state, rtol=1e-6)
    assert [s.loss for s in sharded] == pytest.approx(expected_losses, rel=1e-6)
    assert plain[-1].lr == [0.1, 0.1]  # two groups on every stage
    # The rule changed what trained: decaying every parameter ends elsewhere.
    everything, _ = train_reference(workload)
    assert not torch.allclose(everything["0.token.weight"], expected_state["0.token.weight"], rtol=1e-4)
    assert not torch.allclose(everything["1.norm1.weight"], expected_state["1.norm1.weight"], rtol=1e-4)
    # An optimizer without weight decay has nothing to leave parameters out of: refused when the stages build.
    with pytest.raises(ValueError, match="no_weight_decay: torch.optim:Rprop takes no weight_decay"):
        await start(cluster, {**MLP, "optimizer": ("torch.optim:Rprop", {"lr": 0.01})}, no_weight_decay=rule)


@pytest.mark.parametrize("zero_stage", [0, 2])
async def test_frozen_parameters_stay_as_they_are_across_replicas_as_in_one_process(cluster: Cluster,
                                                                                     zero_stage: int) -> None:
    """Found by review: with data_parallel > 1 every held parameter took part in the reduction, so a
    frozen one got a zero gradient where one process has None, and AdamW's weight decay moved it."""
    from tests.helpers.models import partly_frozen_mlp
    workload = {**MLP, "model": "tests.helpers.models:partly_frozen_mlp", "build": partly_frozen_mlp,
                "optimizer": ("torch.optim:AdamW", {"lr": 0.01, "weight_decay": 0.1})}
    async with await start(cluster, workload, zero_stage=zero_stage) as job:
        stats = await train(job, workload["batches"]())
        state = await job.state_dict()
    torch.manual_seed(0)
    initial = partly_frozen_mlp(**workload["kwargs"]).state_dict()
    assert all(torch.equal(state[key], initial[key]) for key in initial if key.startswith("0."))
    expected_state, expected_losses = train_reference(workload)
    assert_close(state, expected_state, rtol=1e-5)
    assert [s.loss for s in stats] == pytest.approx(expected_losses, rel=1e-5)


async def test_a_skipped_step_changes_nothing_on_any_replica(cluster: Cluster) -> None:
    data = MLP["batches"]()
    poisoned = data[1][0].clone()
    poisoned[0, 0, 0] = float("nan")  # in replica 0's half of the batch only
    runs = {}
    for stage in (0, 1):
        async with await start(cluster, MLP, zero_stage=stage, on_nonfinite="skip") as job:
            await job.step(*data[0])
            before = await job.state_dict()
            skipped = await job.step(poisoned, data[1][1])
            assert skipped.skipped and skipped.nonfinite
            assert_same(await job.state_dict(), before)
            await train(job, data[1:])  # the moments were left alone too: the same bits as unsharded
            runs[stage] = await job.state_dict()
    assert_same(runs[1], runs[0])


@pytest.mark.parametrize(("saving", "loading"), [
    pytest.param(1, {"zero_stage": 1}, id="zero1"),
    pytest.param(1, {"zero_stage": 0}, id="zero1-to-zero0"),
    pytest.param(1, {"zero_stage": 1, "data_parallel": 1}, id="zero1-dp1"),
    # ZeRO-2's replicas hold their shards' moments as ZeRO-1's do: its checkpoints held replica 0's alone.
    pytest.param(2, {"zero_stage": 2}, id="zero2"),
    pytest.param(2, {"zero_stage": 0}, id="zero2-to-zero0"),
])
async def test_a_sharded_checkpoint_resumes_exactly_in_any_layout(cluster: Cluster, tmp_path: Path, saving: int,
                                                                  loading: dict[str, Any]) -> None:
    first, then = MLP["batches"](), MLP["batches"]()[:2]
    directory = tmp_path / "ckpt"
    async with await start(cluster, MLP, zero_stage=saving) as job:
        await train(job, first)
        version = Path(await job.save(directory))
        await train(job, then)
        state_a = await job.state_dict()
    # Replica 0 writes the weights; each replica its shard's moments: every parameter's once.
    assert sorted(os.listdir(version)) == ["manifest.json", "model.safetensors.index.json", "p0-t0-d1.safetensors",
                                           "p0-t0.safetensors", "p1-t0-d1.safetensors", "p1-t0.safetensors"]
    manifest = json.loads((version / "manifest.json").read_text())
    assert set(manifest["optimizer_state"]) == set(manifest["model"])
    files = {part["file"] for states in manifest["optimizer_state"].values() for entry in states.values()
             for part in entry["parts"]}
    assert files == {"p0-t0.safetensors", "p0-t0-d1.safetensors", "p1-t0.safetensors", "p1-t0-d1.safetensors"}

    async with await start(cluster, MLP, **{**loading, "seed": 9}) as job:
        assert await job.load(directory) == len(first)
        await train(job, then)
        state_b = await job.state_dict()
    if loading.get("data_parallel", 2) == 2:
        assert_same(state_b, state_a)  # the same replicas' gradients: the same bits, sharded or not
    else:
        assert_close(state_b, state_a, rtol=1e-5)  # one replica sums the batch in another order


async def test_an_unsharded_checkpoint_loads_into_zero1(cluster: Cluster, tmp_path: Path) -> None:
    first, then = MLP["batches"](), MLP["batches"]()[:2]
    directory = tmp_path / "ckpt"
    async with await start(cluster, MLP, zero_stage=0) as job:
        await train(job, first)
        await job.save(directory)
        await train(job, then)
        state_a = await job.state_dict()
    async with await start(cluster, MLP, zero_stage=1, seed=9) as job:
        await job.load(directory)
        stats = await train(job, then)
        state_b = await job.state_dict()
    assert_same(state_b, state_a)
    assert_halved(stats[0].optimizer_state_bytes)  # each replica took only its shard's moments


async def test_a_tensor_parallel_zero1_checkpoint_loads_into_a_pipeline(cluster: Cluster, tmp_path: Path) -> None:
    first, then = MLP["batches"](), MLP["batches"]()[:2]
    directory = tmp_path / "ckpt"
    async with await start(cluster, MLP, zero_stage=1, **TENSOR_PARALLEL) as job:
        await train(job, first)
        version = Path(await job.save(directory))
        await train(job, then)
        state_a = await job.state_dict()
    assert sorted(os.listdir(version)) == ["manifest.json", "model.safetensors.index.json", "p0-t0-d1.safetensors",
                                           "p0-t0.safetensors", "p0-t1-d1.safetensors", "p0-t1.safetensors"]
    manifest = json.loads((version / "manifest.json").read_text())
    assert set(manifest["optimizer_state"]) == set(manifest["model"])
    async with await start(cluster, MLP, zero_stage=1, seed=9) as job:
        await job.load(directory)
        await train(job, then)
        state_b = await job.state_dict()
    assert_close(state_b, state_a, rtol=1e-5)  # tensor-parallel sums run in another order


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
async def test_zero1_with_mixed_precision_and_clipping_keeps_the_bits(cluster: Cluster, precision: str) -> None:
    # fp16 starts at DeepSpeed's scale of 2**16: steps that overflow are skipped on every replica.
    options = {"precision": precision, "gradient_clipping": 0.5}
    runs = {}
    for stage in (0, 1):
        async with await start(cluster, MLP, zero_stage=stage, **options) as job:
            stats = await train(job, MLP["batches"]())
            runs[stage] = (stats, await job.state_dict())
    (plain, plain_state), (sharded, sharded_state) = runs[0], runs[1]
    assert_same(sharded_state, plain_state)
    assert [(s.loss, s.grad_norm, s.loss_scale, s.skipped) for s in sharded] == \
        [(s.loss, s.grad_norm, s.loss_scale, s.skipped) for s in plain]


async def test_int8_moments_shard_to_the_same_bits_and_resume_exactly_from_a_checkpoint(cluster: Cluster,
                                                                                        tmp_path: Path) -> None:
    """Adam's moments in 8 bits (stages/state/quantized_adam.py): each parameter's rounding noise is seeded
    by its name, so the sharded job rounds as the unsharded one; a checkpoint holds the moments as
    float32 and loads back to the same codes, so a resumed job continues to the same bits."""
    workload = {**MLP, "optimizer": ("torch.optim:AdamW", {"lr": 0.01, "weight_decay": 0.01})}
    first, then = MLP["batches"](), MLP["batches"]()[:2]
    runs = {}
    for stage in (0, 1):
        async with await start(cluster, workload, zero_stage=stage, optimizer_states="int8") as job:
            await train(job, first)
            if stage == 1:
                await job.save(tmp_path / "ckpt")
            stats = await train(job, then)
            runs[stage] = (stats, await job.state_dict())
    assert_same(runs[1][1], runs[0][1])
    assert [s.loss for s in runs[1][0]] == [s.loss for s in runs[0][0]]
    assert_halved(runs[1][0][-1].optimizer_state_bytes)
    async with await start(cluster, workload, zero_stage=0, optimizer_states="fp32") as job:
        await train(job, first)
        fp32 = await train(job, then)
        fp32_bytes = fp32[-1].optimizer_state_bytes
    # A quarter of float32's moments, and a little for the block maxima and step counts.
    assert all(0.25 * f < q <= 0.3 * f for q, f in zip(runs[0][0][-1].optimizer_state_bytes, fp32_bytes))
    assert [s.loss for s in runs[0][0]] == pytest.approx([s.loss for s in fp32], rel=0.05)

    async with await start(cluster, workload, zero_stage=0, optimizer_states="int8", seed=9) as job:
        assert await job.load(tmp_path / "ckpt") == len(first)
        await train(job, then)
        assert_same(await job.state_dict(), runs[0][1])


@pytest.mark.parametrize("overlap_reduce", [True, False])
async def test_zero2_with_pipeline_stages_trains_to_the_bits_of_unsharded_training(cluster: Cluster,
                                                                                  overlap_reduce: bool) -> None:
    """ZeRO-2, which DeepSpeed refuses with a pipeline: each bucket is reduce-scattered, each replica
    keeps and steps its runs only, and between steps holds only their gradients."""
    runs = {}
    for stage in (0, 1, 2):
        async with await start(cluster, MLP, schedule="1f1b", zero_stage=stage, overlap_reduce=overlap_reduce) as job:
            stats = await train(job, MLP["batches"]())
            runs[stage] = (stats, await job.state_dict())
    for stage in (1, 2):
        assert_same(runs[stage][1], runs[0][1])
        assert [s.loss for s in runs[stage][0]] == [s.loss for s in runs[0][0]]
        assert_halved(runs[stage][0][-1].optimizer_state_bytes)
    last = {stage: runs[stage][0][-1] for stage in runs}
    assert last[0].parameter_bytes == last[2].parameter_bytes
    assert all(g >= p for g, p in zip(last[0].gradient_bytes, last[0].parameter_bytes))  # whole gradients
    if overlap_reduce:  # ZeRO-1 keeps its buckets whole between steps; ZeRO-2 gives them back
        assert last[1].gradient_bytes == last[0].gradient_bytes
    assert_halved(last[2].gradient_bytes)
    assert all(0 < g < 0.6 * p for g, p in zip(last[2].gradient_bytes, last[2].parameter_bytes))


async def test_zero2_keeps_tied_weights_whole_and_clips_as_one_process(cluster: Cluster) -> None:
    workload = {**WORKLOADS["gpt"], "kwargs": {**WORKLOADS["gpt"]["kwargs"], "tie_embeddings": True}}
    states, stats = {}, {}
    for stage in (0, 2):
        async with await start(cluster, workload, schedule="1f1b", zero_stage=stage) as job:
            stats[stage] = await train(job, workload["batches"]())
            states[stage] = await job.state_dict()
    head = workload["kwargs"]["layers"] + 1
    pair = ["0.token.weight", f"{head}.out.weight"]
    assert torch.equal(states[2][pair[0]], states[2][pair[1]])  # tied buckets are all-reduced, the pair summed
    assert_same(states[2], states[0])
    # The tied pair, kept whole by both replicas, counts once in the global norm (its owner's square).
    assert [s.grad_norm for s in stats[2]] == [s.grad_norm for s in stats[0]]
    async with await start(cluster, MLP, zero_stage=2, gradient_clipping=0.05) as job:
        clipped = await train(job, MLP["batches"]())
        clipped_state = await job.state_dict()
    async with await start(cluster, MLP, zero_stage=0, gradient_clipping=0.05) as job:
        plain = await train(job, MLP["batches"]())
        assert_same(clipped_state, await job.state_dict())
    # Each parameter's square from the replica that keeps it, added in order: one process's norm, to the bit.
    assert [s.grad_norm for s in clipped] == [s.grad_norm for s in plain]
    assert all(s.grad_norm > 0.05 for s in plain)  # every step clipped


async def test_zero2_with_a_lossy_reduce_codec_sends_each_replica_only_its_encoded_range(cluster: Cluster) -> None:
    """As ZeRO++'s quantized gradients: each replica encodes the others' ranges and sends each its own,
    about half the bytes of the lossy all-reduce's gather at two replicas; the error is the codec's."""
    runs = {}
    for stage, codec in ((0, "none"), (0, "int8"), (2, "int8")):
        async with await start(cluster, MLP, zero_stage=stage, reduce_codec=codec) as job:
            stats = await train(job, MLP["batches"]())
            runs[(stage, codec)] = (stats, await job.state_dict())
    exact_losses = [s.loss for s in runs[(0, "none")][0]]
    for key in ((0, "int8"), (2, "int8")):
        assert [s.loss for s in runs[key][0]] == pytest.approx(exact_losses, rel=0.02)
    gathered, scattered = runs[(0, "int8")][0][-1].reduce_bytes, runs[(2, "int8")][0][-1].reduce_bytes
    assert 0 < scattered <= 0.55 * gathered
    assert_halved(runs[(2, "int8")][0][-1].optimizer_state_bytes)
