"""ZeRO-1 (stages/comm/zero.py): the partition, and two gloo replicas stepping their shards exactly.

Run: .venv/bin/python -m pytest tests/stages/comm/test_zero.py -q
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stages.state import snapshots
from stages.comm import zero
from stages.comm.zero import ShardedOptimizer, _buckets, check_snapshot, partition, state_bytes
from examples.models import residual_mlp

WORLD = 2
STEPS = 3
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


@pytest.mark.parametrize(("numels", "shards", "owners"), [
    ([], 2, []),
    ([5], 2, [0]),  # a shard may own nothing
    ([4, 4, 4, 4], 2, [0, 1, 0, 1]),
    ([1, 100, 10, 10, 90], 2, [1, 0, 1, 0, 1]),  # largest first, each to the lightest shard so far
    ([3, 3, 3], 1, [0, 0, 0]),
    ([9, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2, [0] + [1] * 9),  # whole parameters: 9 against 9
    ([10, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2, [0] + [1] * 9),
])
def test_partition_balances_element_counts_deterministically(numels: list[int], shards: int,
                                                              owners: list[int]) -> None:
    assert partition(numels, shards) == owners


def test_large_parameters_go_alone_and_small_ones_share_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zero, "IN_PLACE_BYTES", 400)
    params = [torch.zeros(n) for n in (10, 100, 20, 60, 30, 5)]  # float32: 40, 400, 80, 240, 120, 20 bytes
    params.insert(3, torch.zeros(7, dtype=torch.float64))
    sizes = [[p.numel() for p in bucket] for bucket in _buckets(params, bucket_bytes=160)]
    assert sizes == [[10, 20], [100], [7], [60], [30, 5]]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return residual_mlp(blocks=2, dim=16, hidden=32)


def _gradients(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``STEPS`` steps on fixed gradients; the learning rate halves after the first (a schedule's doing)."""
    for step in range(STEPS):
        _gradients(model, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for group in optimizer.param_groups:
            group["lr"] *= 0.5


def _worker(rank: int, directory: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(directory, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        group = dist.new_group(list(range(WORLD)))
        results: dict[str, Any] = {}
        zero.IN_PLACE_BYTES = 2048  # the 32 x 16 weights go in place; the rest in buckets of 1 KiB
        for name, (cls, kwargs) in OPTIMIZERS.items():
            model = _model()
            optimizer = ShardedOptimizer(model.parameters(), cls, kwargs, shard=rank, ranks=list(range(WORLD)),
                                         group=lambda: group, bucket_bytes=1024)
            _train(model, optimizer)
            results[name] = {"state": model.state_dict(), "state_bytes": state_bytes(optimizer),
                             "owned": [optimizer.owns(p) for p in model.parameters()]}
        torch.save(results, os.path.join(directory, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("zero"))
    context = mp.start_processes(_worker, args=(directory,), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 90.0
    try:
        while not context.join(timeout=1.0):  # raises with the child's traceback if one failed
            if time.monotonic() > deadline:
                raise TimeoutError("ZeRO workers still running after 90 s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
    return [torch.load(os.path.join(directory, f"rank{r}.pt"), weights_only=True) for r in range(WORLD)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.multiprocess
def test_replicas_stepping_their_shards_equal_one_unsharded_optimizer(two_replicas: list[dict[str, Any]],
                                                                      name: str) -> None:
    model = _model()
    cls, kwargs = OPTIMIZERS[name]
    optimizer = cls(model.parameters(), **kwargs)
    _train(model, optimizer)
    for replica in two_replicas:
        for key, value in model.state_dict().items():
            assert torch.equal(replica[name]["state"][key], value), f"{name} {key}"
    # Each parameter is owned once, and the state is split about evenly.
    owned = [replica[name]["owned"] for replica in two_replicas]
    assert all(a != b for a, b in zip(*owned))
    whole = state_bytes(optimizer)
    shards = [replica[name]["state_bytes"] for replica in two_replicas]
    assert sum(shards) == whole
    assert max(shards) <= 0.55 * whole


def _sharded(shard: int) -> tuple[torch.nn.Module, ShardedOptimizer]:
    model = _model()

    def no_group() -> Any:
        raise AssertionError("no collective expected")

    return model, ShardedOptimizer(model.parameters(), torch.optim.Adam, {"lr": 0.01}, shard=shard, ranks=[0, 1],
                                   group=no_group, bucket_bytes=1 << 20)


def test_the_outer_groups_hold_every_parameter_and_the_state_is_the_shards() -> None:
    model, optimizer = _sharded(0)
    params = list(model.parameters())
    assert optimizer.param_groups[0]["params"] == params
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)  # the optimizer's own defaults, for schedules
    assert optimizer.state is optimizer.inner.state
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.inner.step()
    assert {id(p) for p in optimizer.state} == {id(p) for p in params if optimizer.owns(p)}
    optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)  # every parameter's, not only the shard's
    with pytest.raises(NotImplementedError, match="when it is built"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})


def test_a_whole_state_dict_loads_into_a_shard_and_keeps_only_its_own() -> None:
    model = _model()
    whole = torch.optim.Adam(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    whole.step()
    saved = whole.state_dict()
    _, optimizer = _sharded(1)
    optimizer.load_state_dict(saved)
    assert optimizer.state is optimizer.inner.state
    params = optimizer.param_groups[0]["params"]
    assert {id(p) for p in optimizer.state} == {id(p) for p in params if optimizer.owns(p)}
    assert all(torch.equal(optimizer.state[p]["exp_avg"], whole.state[q]["exp_avg"])
               for p, q in zip(params, model.parameters()) if optimizer.owns(p))


def test_a_snapshot_of_another_replicas_shard_is_refused() -> None:
    held: dict[int, torch.nn.Module] = {}
    snaps = []
    for shard in (0, 1):
        model, optimizer = _sharded(shard)
        held[shard] = model
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.inner.step()
        snaps.append((optimizer, snapshots.capture(dict(enumerate(model)), optimizer)))
    (first, own), (_, other) = snaps
    check_snapshot(first, own)
    with pytest.raises(ValueError, match="another data-parallel replica's"):
        check_snapshot(first, other)
    check_snapshot(torch.optim.SGD(held[0].parameters(), lr=0.1), other)  # unsharded: anything goes


def test_gradient_shards_cut_each_bucket_into_contiguous_runs_by_replica() -> None:
    params = [torch.zeros(n) for n in (10, 30, 20, 40, 100)]  # float32: 40, 120, 80, 160, 400 bytes
    tied = params[2]
    shards = zero.plan_gradient_shards(params, bucket_bytes=400, replicas=2, replicated={id(tied)})
    assert shards.layout == [[0, 1], [2], [3], [4]]  # the tied parameter in a bucket of its own
    assert shards.ranges[1] is None  # all-reduced: every replica keeps the tied gradient whole
    # Bucket 0: 10 + 30 elements; the second's middle (25) is past half (20): runs [0, 10) and [10, 40),
    # the larger to replica 0 (both hold nothing yet: the lowest index).
    assert shards.ranges[0] == [(10, 40), (0, 10)]
    # Each run to the replica with the fewest elements so far: the tied 20 to replica 1 (10 against 30),
    # the 40 to replica 0 (30 against 30: the lowest), the 100 to replica 1 (70 against 30).
    assert shards.ranges[2] == [(0, 40), (0, 0)] and shards.ranges[3] == [(0, 0), (0, 100)]
    assert [shards.owners[id(p)] for p in params] == [1, 0, 1, 0, 1]
    assert shards.owned(0, params) == [False, True, True, True, False]
    assert shards.owned(1, params) == [True, False, True, False, True]


def test_gradient_shards_keep_the_replicas_even_when_large_parameters_come_in_buckets_of_their_own() -> None:
    # A large parameter alone in a bucket, then two small ones in the next, four times over (layers whose
    # weights exceed the bucket, their biases between). Before, run k of bucket b went to replica
    # (k + b) % 2: every large one landed on replica 1, which stepped 404 elements against 4.
    params: list[torch.Tensor] = []
    for _ in range(4):
        params += [torch.zeros(100), torch.zeros(1), torch.zeros(1)]
    shards = zero.plan_gradient_shards(params, bucket_bytes=8, replicas=2)
    stepped = [sum(p.numel() for p in params if shards.owners[id(p)] == r) for r in range(2)]
    assert stepped == [204, 204]
