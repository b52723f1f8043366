# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/comm/test_parallel.py
"""A job's torch.distributed set-up (stages.comm.parallel), without processes.

The backend follows the nodes' devices; the pipeline's two-rank groups are a pure
function of the mesh; and every rank builds every group in the same order, keeping
its own, then connects its pairs in one global order (torch.distributed is replaced by
a recorder, so each rank of a mesh can be joined in turn in this process).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stages.comm import parallel
from stages.mesh import Mesh
from actors._errors import error_from_wire, error_to_wire
from stages.comm.parallel import (GLOO, NCCL, GroupJoinFailed, backend_for, join_process_groups, pipeline_pairs,
                                  root_cause)

pytestmark = pytest.mark.timeout(60)


def nodes(*devices: str, host: str = "gpu-box") -> list[dict[str, Any]]:
    return [{"name": f"node{i}", "device": d, "host": host, "state": "alive"} for i, d in enumerate(devices)]


# -- backend_for ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("job_nodes", "expected"), [
    (nodes("cpu", "cpu", "cpu"), GLOO),
    (nodes("cpu"), GLOO),
    ([{"name": "old"}, {"name": "older", "device": ""}], GLOO),  # a record without a device is a CPU node's
    (nodes("cuda:0", "cuda:1"), NCCL),
    (nodes("cuda:3", "cuda:0", "cuda:2", "cuda:1"), NCCL),
    (nodes("cuda:0", host="a") + nodes("cuda:0", host="b"), NCCL),  # two machines' first GPUs
])
def test_the_backend_follows_the_nodes_devices(job_nodes: list[dict[str, Any]], expected: str) -> None:
    assert backend_for(job_nodes) == expected


def test_gpu_jobs_run_cuda_tensors_on_nccl_and_cpu_tensors_on_gloo() -> None:
    assert NCCL == "cpu:gloo,cuda:nccl"  # the device-mapped form torch.distributed.init_process_group takes
    assert dist.Backend(NCCL) == NCCL


@pytest.mark.parametrize(("job_nodes", "says"), [
    (nodes("cpu", "cuda:0"), ["rank 0: cpu", "rank 1: cuda:0", "every stage actor on a GPU", "transport='zmq'"]),
    (nodes("cuda:0", "cpu", "cuda:1"), ["rank 1: cpu", "LocalCluster(devices=...)"]),
    (nodes("mps", "mps"), ["rank 0: mps", "(NCCL)", "(gloo)"]),
    (nodes("cuda:0", "cuda:1", "cuda:0"), ["ranks 0 and 2", "cuda:0 on gpu-box", "one node per GPU",
                                            "devices='auto'", "--device cuda:K"]),
    (nodes("cuda", "cuda"), ["ranks 0 and 1", "would both use cuda"]),
])
def test_a_job_that_mixes_devices_or_shares_a_gpu_is_refused_with_what_to_do(
    job_nodes: list[dict[str, Any]], says: list[str]
) -> None:
    with pytest.raises(ValueError) as refused:
        backend_for(job_nodes)
    for words in says:
        assert words in str(refused.value)


# -- pipeline_pairs -----------------------------------------------------------------------------


@pytest.mark.parametrize(("mesh", "num_stages", "expected"), [
    (Mesh(pipeline=1, data=2), 1, []),
    (Mesh(pipeline=2), 2, [(0, 1), (1, 0)]),
    (Mesh(pipeline=3), 3, [(0, 1), (1, 0), (1, 2), (2, 1)]),
    # Interleaved: 2 virtual stages per rank; stage 2 (rank 2) sends on to stage 3 (rank 0).
    (Mesh(pipeline=3), 6, [(0, 1), (1, 0), (1, 2), (2, 1), (2, 0), (0, 2)]),
    (Mesh(pipeline=2), 4, [(0, 1), (1, 0)]),  # the wrap-around pair is the same pair
    # rank = (d * pipeline + p) * tensor + t: each replica and shard is a pipeline of its own.
    (Mesh(pipeline=2, data=2), 2, [(0, 1), (1, 0), (2, 3), (3, 2)]),
    (Mesh(pipeline=2, tensor=2), 2, [(0, 2), (2, 0), (1, 3), (3, 1)]),
])
def test_pipeline_pairs_are_every_direction_between_neighbouring_ranks(
    mesh: Mesh, num_stages: int, expected: list[tuple[int, int]]
) -> None:
    assert pipeline_pairs(mesh, num_stages) == expected


# -- join_process_groups, with torch.distributed recorded -----------------------------------------


class Recorder:
    """Stands in for torch.distributed while one rank joins: records what it builds and sends."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.init: dict[str, Any] = {}
        self.groups: list[list[int]] = []  # every new_group call, in order
        self.batches: list[list[tuple[str, int, Any, torch.device]]] = []  # (op, peer, group, device) per batch

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # joining sets them: put them back after
            monkeypatch.setenv(variable, "unset by the test")
            monkeypatch.delenv(variable)
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: self.init.update(kwargs))
        monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: (prefix, store))
        monkeypatch.setattr(dist, "new_group", self.new_group)
        monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0: (op, tensor, peer, group, tag))
        monkeypatch.setattr(dist, "batch_isend_irecv", self.batch)

    def new_group(self, ranks: list[int]) -> Any:
        self.groups.append(list(ranks))
        return ("group", len(self.groups) - 1) if self.rank in ranks else "not a member"

    def batch(self, ops: list[Any]) -> list[Any]:
        self.batches.append([(op.__name__, peer, group, tensor.device) for op, tensor, peer, group, _ in ops])
        return [Done() for _ in ops]


class Done:
    def wait(self) -> bool:
        return True


@pytest.mark.parametrize(("mesh", "num_stages"), [
    (Mesh(pipeline=2), 2), (Mesh(pipeline=3, data=2), 6), (Mesh(pipeline=2, tensor=2, data=2), 2)])
def test_every_rank_builds_every_group_in_one_order_and_connects_its_own_pairs(
    monkeypatch: pytest.MonkeyPatch, mesh: Mesh, num_stages: int
) -> None:
    pairs = pipeline_pairs(mesh, num_stages)
    config = {"rendezvous": ["tcp://127.0.0.1:1", "r"], "backend": GLOO, "loopback": True}
    orders = []
    for rank in range(mesh.size):
        recorder = Recorder(rank)
        recorder.install(monkeypatch)
        groups = join_process_groups(config, mesh, rank, "job0", store=None, pairs=pairs)  # type: ignore[arg-type]
        orders.append(recorder.groups)
        assert recorder.init["backend"] == GLOO and recorder.init["rank"] == rank
        assert recorder.init["world_size"] == mesh.size
        # The pairs come last, after the tensor and data groups, as one group each.
        assert recorder.groups[-len(pairs):] == [list(p) for p in pairs]
        mine = [p for p in pairs if rank in p]
        assert list(groups.pairs) == mine
        first_pair = len(recorder.groups) - len(pairs)
        assert groups.pairs == {p: ("group", first_pair + pairs.index(p)) for p in mine}
        # One byte over each of its pairs, in the global order, each in its direction.
        assert recorder.batches == [[("isend" if rank == p[0] else "irecv", p[1] if rank == p[0] else p[0],
                                      groups.pairs[p], torch.device("cpu"))] for p in mine]
    assert all(order == orders[0] for order in orders)


def test_a_gpu_stage_joins_nccl_on_its_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder(1)
    recorder.install(monkeypatch)
    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    user_gloo, _ = parallel._user_interfaces()
    monkeypatch.setattr(parallel, "_user_interfaces", lambda: (user_gloo, None))
    device = torch.device("meta")  # stands for the GPU: the warm-up byte must be allocated there
    config = {"rendezvous": ["tcp://127.0.0.1:1", "r"], "backend": NCCL, "loopback": True}
    groups = join_process_groups(config, Mesh(pipeline=2), 1, "job0", store=None,  # type: ignore[arg-type]
                                 pairs=[(0, 1), (1, 0)], device=device)
    assert current == []  # only a CUDA device becomes the current one
    assert recorder.init["backend"] == NCCL
    assert [b[0][3] for b in recorder.batches] == [device, device]
    assert [b[0][0] for b in recorder.batches] == ["irecv", "isend"]
    assert set(groups.pairs) == {(0, 1), (1, 0)}
    assert os.environ.get("NCCL_SOCKET_IFNAME") == parallel._loopback_interface()  # NCCL bootstraps on loopback

    gpu = torch.device("cuda", 1)
    recorder = Recorder(1)
    recorder.install(monkeypatch)
    join_process_groups(config, Mesh(pipeline=2), 1, "job0", store=None, pairs=[], device=gpu)  # type: ignore[arg-type]
    assert current == [gpu]


def test_a_rank_that_fails_to_join_is_named_leaves_the_default_group_and_the_node_joins_the_next_job(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A real one-rank gloo group: the default group forms, then a subgroup's connection fails, as
    # when another rank joined, failed to build and left while this one was still connecting.
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # joining sets them: put them back after
        monkeypatch.setenv(variable, "unset by the test")
        monkeypatch.delenv(variable)
    config = {"rendezvous": ["tcp://127.0.0.1:1", "r"], "backend": GLOO, "loopback": True}
    new_group = dist.new_group

    def closed_by_peer(ranks: list[int]) -> Any:
        raise RuntimeError("Gloo connectFullMesh failed: Connection closed by peer")

    monkeypatch.setattr(dist, "new_group", closed_by_peer)
    with pytest.raises(GroupJoinFailed, match="rank 0 of job job0 could not join its process groups .*closed by peer"):
        join_process_groups(config, Mesh(pipeline=1), 0, "job0", store=dist.HashStore())
    assert not dist.is_initialized()  # left: before, the node refused every later job as "already runs a stage"
    monkeypatch.setattr(dist, "new_group", new_group)
    try:
        groups = join_process_groups(config, Mesh(pipeline=1), 0, "job1", store=dist.HashStore())
        assert dist.get_world_size(groups.data) == 1
    finally:
        parallel.leave_process_groups()


def test_the_failure_reported_for_a_job_is_a_rank_that_failed_to_build_not_one_its_leaving_broke() -> None:
    # The head reported the first failing rank's error in rank order: a refused job sometimes named
    # gloo ("Connection closed by peer") instead of its cause (CI, the tied-parameter refusal).
    def over_the_wire(exc: BaseException) -> BaseException:
        return error_from_wire(error_to_wire(exc))

    joined = over_the_wire(GroupJoinFailed("rank 0 could not join"))
    refused = over_the_wire(ValueError("tensor parallelism would untie a = b"))
    assert root_cause([joined, refused]) is refused
    assert root_cause([refused, joined]) is refused
    assert root_cause([joined]) is joined  # no other cause known: the join failure itself
    local = GroupJoinFailed("rank 2 could not join")
    assert root_cause([local, joined, RuntimeError("lost")]).args == ("lost",)
