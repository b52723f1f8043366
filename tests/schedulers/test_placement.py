"""Placement (``schedulers.placement``) against fake node lists, the scheduler's use of it, and one real cluster."""

from __future__ import annotations

import dataclasses
import types
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from actors import NodeInfo
from schedulers import JobSpec, LocalCluster, PlacementWarning
from schedulers.placement import choose_nodes, gpu_of
from schedulers.scheduler import SchedulerActor

pytestmark = pytest.mark.timeout(120)


def node(name: str, device: str, host: str = "h", pid: int = 0) -> NodeInfo:
    return NodeInfo(name=name, address=f"tcp://{host}:1", device=device, pid=pid, host=host, memory_bytes=0)


def nodes(*devices: str, host: str = "h") -> list[NodeInfo]:
    """Alive nodes ``n0``, ``n1``, ... on ``devices`` (``"h2/cuda:0"`` puts one on another host)."""
    out = []
    for i, device in enumerate(devices):
        where, _, name = device.rpartition("/")
        out.append(node(f"n{i}", name, where or host, pid=i))
    return out


def lose(cluster: list[NodeInfo], index: int) -> None:
    cluster[index] = dataclasses.replace(cluster[index], state="lost")


def names(chosen: Sequence[NodeInfo]) -> list[str]:
    return [n.name for n in chosen]


# (node devices, busy node -> job, stage actors) -> chosen nodes by rank, how many notices.
CHOICES: list[tuple[tuple[str, ...], dict[str, str], int, list[str], int]] = [
    (("cpu", "cpu", "cpu"), {}, 2, ["n0", "n1"], 0),  # CPU: by name, as before GPUs
    (("cpu", "cpu", "cpu"), {"n0": "job0"}, 2, ["n1", "n2"], 0),  # free nodes first
    (("cpu", "cpu"), {"n0": "job0", "n1": "job0"}, 2, ["n0", "n1"], 0),  # shared CPU nodes: no notice, as before
    (("cuda:0", "cuda:1"), {}, 2, ["n0", "n1"], 0),  # one per GPU
    (("cuda:0", "cuda:0", "cuda:1"), {}, 2, ["n0", "n2"], 0),  # n1 would share n0's GPU while cuda:1 sits idle
    (("cuda:0", "cuda:0", "cuda:1", "cuda:1"), {}, 2, ["n0", "n2"], 0),
    (("cuda:0", "cuda:0", "cuda:1", "cuda:1"), {}, 4, ["n0", "n2", "n1", "n3"], 2),  # every GPU taken: share
    (("cuda:0", "cuda:1", "cuda:0", "cuda:1"), {"n0": "job0"}, 2, ["n1", "n2"], 1),  # job0 holds cuda:0
    (("cuda:0", "cuda:1", "cuda:2"), {"n0": "job0"}, 2, ["n1", "n2"], 0),
    (("cuda:0", "cuda:1", "cuda:2", "cuda:3"), {"n0": "job0", "n1": "job0"}, 2, ["n2", "n3"], 0),
    (("cuda:0", "cuda:1"), {"n0": "job0", "n1": "job0"}, 2, ["n0", "n1"], 2),  # a second job on a full cluster
    (("cuda:0", "cuda:0"), {}, 2, ["n0", "n1"], 1),  # sharing on purpose (devices=["cuda:0", "cuda:0"])
    (("a/cuda:0", "a/cuda:0", "b/cuda:0"), {}, 2, ["n0", "n2"], 0),  # cuda:0 on another host is another GPU
    (("a/cuda:0", "b/cuda:0"), {"n0": "job0"}, 1, ["n1"], 0),
    (("cuda:0", "cuda:0", "cpu"), {}, 2, ["n0", "n2"], 1),  # a CPU node before a shared GPU: a mix notice
    (("cpu", "cuda:0"), {}, 2, ["n0", "n1"], 1),  # mixed: the CPU stage sets the pace
    (("cuda:0",), {}, 1, ["n0"], 0),
]


@pytest.mark.parametrize(("devices", "busy", "count", "expected", "num_notices"), CHOICES)
def test_choose_nodes(devices: tuple[str, ...], busy: dict[str, str], count: int, expected: list[str],
                      num_notices: int) -> None:
    placement = choose_nodes(nodes(*devices), busy, count)
    assert names(placement.nodes) == expected
    assert len(placement.notices) == num_notices, placement.notices


def test_a_gpu_is_shared_only_when_every_gpu_is_taken() -> None:
    """Whatever the busy set, no chosen pair shares a GPU while an alive node's GPU holds no stage actor."""
    import itertools

    cluster = nodes("cuda:0", "cuda:0", "cuda:1", "cuda:2", "cuda:2", "cuda:3")
    for num_busy in range(len(cluster) + 1):
        for busy_names in itertools.combinations([n.name for n in cluster], num_busy):
            busy = {name: "job0" for name in busy_names}
            for count in range(1, len(cluster) + 1):
                chosen = choose_nodes(cluster, busy, count).nodes
                used = [gpu_of(n) for n in chosen]
                holders = {gpu_of(n) for n in cluster if n.name in busy}
                idle = {gpu_of(n) for n in cluster} - holders - set(used)
                if len(set(used)) < len(used) or set(used) & holders:
                    assert not idle, (busy, count, names(chosen))


def test_the_notices_say_which_gpu_who_holds_it_and_what_to_do() -> None:
    (notice,) = choose_nodes(nodes("cuda:0", "cuda:0"), {}, 2).notices
    assert notice.startswith("node n1 shares cuda:0 on h with this job's n0: every GPU of the cluster already "
                             "holds a stage actor")
    assert "LocalCluster(devices='auto'), or python -m actors.node --device cuda:K" in notice
    first, second = choose_nodes(nodes("cuda:0", "cuda:1"), {"n0": "job3", "n1": "job3"}, 2).notices
    assert first.startswith("node n0 shares cuda:0 on h with a stage actor of job3")
    assert second.startswith("node n1 shares cuda:1 on h with a stage actor of job3")
    _, both = choose_nodes(nodes("cuda:0", "cuda:0"), {"n1": "job1"}, 2).notices
    assert both.startswith("node n1 shares cuda:0 on h with this job's n0 and a stage actor of job1")
    (mixed,) = choose_nodes(nodes("cpu", "cuda:0"), {}, 2).notices
    assert mixed.startswith("the job's stage actors mix CPU and GPU nodes (cpu on h, cuda:0 on h)")


def test_an_nccl_job_refuses_two_ranks_on_one_gpu() -> None:
    with pytest.raises(ValueError, match=r"node n1 would share cuda:0 on h with its n0 .* which NCCL refuses; "
                                         r"start one node per GPU .* or use transport='zmq'"):
        choose_nodes(nodes("cuda:0", "cuda:0"), {}, 2, exclusive_gpus=True)
    # Avoidable: the second rank goes to the other GPU, and sharing with another job is only a notice.
    assert names(choose_nodes(nodes("cuda:0", "cuda:0", "cuda:1"), {}, 2, exclusive_gpus=True).nodes) == ["n0", "n2"]
    placement = choose_nodes(nodes("cuda:0", "cuda:1"), {"n0": "job0"}, 2, exclusive_gpus=True)
    assert names(placement.nodes) == ["n1", "n0"] and len(placement.notices) == 1
    assert choose_nodes(nodes("cpu", "cpu"), {}, 2, exclusive_gpus=True).notices == []  # gloo on CPU shares fine


def test_too_few_nodes() -> None:
    with pytest.raises(ValueError, match="needs 3 nodes .* has 2 alive"):
        choose_nodes(nodes("cpu", "cpu"), {}, 3)


def test_gpu_of() -> None:
    assert gpu_of(node("a", "cuda:1", "x")) == ("x", "cuda:1")
    assert gpu_of(node("a", "cpu", "x")) is None


class _FakeScheduler(SchedulerActor):
    """The scheduler with the head's node list replaced by a fake one, and jobs as (id, nodes)."""

    def __init__(self, node_list: list[NodeInfo], jobs: dict[str, list[str]]) -> None:
        super().__init__()
        self.node_list = node_list
        self._jobs = {job: types.SimpleNamespace(id=job, nodes=names) for job, names in jobs.items()}  # type: ignore

    async def _nodes(self) -> list[NodeInfo]:
        return self.node_list


def spec(**kwargs: Any) -> JobSpec:
    return JobSpec.of(model="examples.models:residual_mlp", **kwargs)


@pytest.mark.asyncio
async def test_the_scheduler_places_by_gpu_and_skips_lost_nodes() -> None:
    cluster = nodes("cuda:0", "cuda:0", "cuda:1", "cuda:1", "cuda:2")
    lose(cluster, 2)  # n2 is gone: its GPU still has n3
    scheduler = _FakeScheduler(cluster, {"job0": ["n4"]})
    placement = await scheduler._place(spec(pipeline_stages=2))
    assert names(placement.nodes) == ["n0", "n3"] and placement.notices == []
    placement = await scheduler._place(spec(pipeline_stages=3))
    assert names(placement.nodes) == ["n0", "n3", "n1"] and len(placement.notices) == 1
    with pytest.raises(ValueError, match=r"needs 5 nodes \(5 pipeline x 1 tensor x 1 data, one stage actor each\)"):
        await scheduler._place(spec(pipeline_stages=5))


@pytest.mark.asyncio
async def test_the_scheduler_refuses_an_nccl_job_that_would_share_a_gpu() -> None:
    scheduler = _FakeScheduler(nodes("cuda:0", "cuda:0"), {})
    with pytest.raises(ValueError, match="NCCL refuses"):
        await scheduler._place(spec(pipeline_stages=2, transport="dist"))
    with pytest.raises(ValueError, match="NCCL refuses"):
        await scheduler._place(spec(pipeline_stages=1, data_parallel=2))
    assert len((await scheduler._place(spec(pipeline_stages=2))).notices) == 1  # over ZeroMQ: shared, with a notice


@pytest.mark.asyncio
async def test_a_spare_on_a_gpu_no_busy_node_uses_comes_first() -> None:
    cluster = nodes("cuda:0", "cuda:1", "cuda:0", "cuda:1")  # n0, n1 run job0; n2, n3 are spares
    lose(cluster, 1)
    scheduler = _FakeScheduler(cluster, {"job0": ["n0", "n1"]})
    assert await scheduler._free_nodes(1, {"n0", "n1"}) == [("n3", "")]  # n1's GPU is free again; n2 shares n0's
    assert await scheduler._free_nodes(2, {"n0", "n1"}) == [("n3", ""), ("n2", "")]


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.multiprocess
async def test_a_cpu_cluster_reports_each_stages_device() -> None:
    async with LocalCluster(devices="cpu", nodes=2) as cluster:
        assert [n.device for n in await cluster.nodes()] == ["cpu", "cpu"]
        with warnings.catch_warnings():
            warnings.simplefilter("error", PlacementWarning)  # nothing to warn about on CPU
            job = await cluster.train(model="examples.models:residual_mlp",
                                      model_kwargs={"blocks": 2, "dim": 8, "hidden": 16},
                                      pipeline_stages=2, micro_batches=2)
        assert job.notices == []
        gen = torch.Generator().manual_seed(0)
        stats = await job.step(torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen))
        assert stats.devices == ["cpu", "cpu"]
        await job.close()


def test_records_from_before_devices_still_decode() -> None:
    from stages import StageReport
    from schedulers.records import JobInfo, StepStats

    old = StepStats(step=0, loss=1.0, step_time_s=0.1, bubble_fraction=0.0, bytes_sent=0).to_wire()
    del old["devices"]
    assert StepStats.from_wire(old).devices == []
    report = StageReport(status="done").to_wire()
    del report["device"]
    assert StageReport.from_wire(report).device == ""
    info = JobInfo(job="job0", bounds=[[0, 1]], nodes=["node0"], actor=["tcp://a", "job0.control"]).to_wire()
    del info["notices"]
    assert JobInfo.from_wire(info).notices == []
