# .venv/bin/python -m pytest -q -p no:cacheprovider tests/schedulers/test_dist_backend.py
"""The scheduler picks a job's torch.distributed backend from the devices of the nodes it placed
the job on, and refuses a job NCCL and gloo cannot serve before anything starts.

``open_rendezvous`` runs on a stand-in runtime that records what it would spawn: the
nodes are fake records, as on a machine with GPUs.
"""

from __future__ import annotations

from typing import Any

import pytest

from actors import NodeInfo
from stages.comm.parallel import GLOO, NCCL
from schedulers.jobs import JobSpec
from schedulers.scheduler import open_rendezvous

pytestmark = [pytest.mark.timeout(30), pytest.mark.asyncio]


class Runtime:
    address = "tcp://127.0.0.1:5555"

    def __init__(self) -> None:
        self.spawned: list[str] = []

    async def spawn(self, actor: Any, name: str) -> None:
        self.spawned.append(name)


def placed(*devices: str) -> list[NodeInfo]:
    return [NodeInfo(name=f"node{i}", address=f"tcp://127.0.0.1:{6000 + i}", device=d, host="box", pid=i,
                     memory_bytes=0, identity=f"node:node{i}") for i, d in enumerate(devices)]


async def rendezvous(spec: JobSpec, nodes: list[NodeInfo]) -> tuple[Runtime, dict[str, Any] | None]:
    runtime = Runtime()
    _, config = await open_rendezvous(runtime, "job0", spec, nodes)  # type: ignore[arg-type]
    return runtime, config


@pytest.mark.parametrize(("layout", "devices", "backend"), [
    ({"pipeline_stages": 2, "transport": "dist"}, ("cpu", "cpu"), GLOO),
    ({"pipeline_stages": 2, "transport": "dist"}, ("cuda:0", "cuda:1"), NCCL),
    ({"data_parallel": 2}, ("cuda:1", "cuda:0"), NCCL),
    ({"tensor_parallel": 2}, ("cpu", "cpu"), GLOO),
])
async def test_the_stages_dist_config_names_the_backend_of_their_devices(
    layout: dict[str, Any], devices: tuple[str, ...], backend: str
) -> None:
    runtime, config = await rendezvous(JobSpec.of(model="examples.models:residual_mlp", **layout), placed(*devices))
    assert config is not None and config["backend"] == backend
    assert runtime.spawned == ["job0.rendezvous"]


@pytest.mark.parametrize(("layout", "devices", "says"), [
    ({"pipeline_stages": 2, "transport": "dist"}, ("cpu", "cuda:0"), "every stage actor on a GPU"),
    ({"data_parallel": 2}, ("cuda:0", "cuda:0"), "NCCL needs a GPU per rank"),
])
async def test_a_job_nccl_cannot_serve_is_refused_before_its_rendezvous_starts(
    layout: dict[str, Any], devices: tuple[str, ...], says: str
) -> None:
    spec = JobSpec.of(model="examples.models:residual_mlp", **layout)
    runtime = Runtime()
    with pytest.raises(ValueError, match=says):
        await open_rendezvous(runtime, "job0", spec, placed(*devices))  # type: ignore[arg-type]
    assert runtime.spawned == []


async def test_a_pipeline_over_zeromq_needs_no_backend_and_may_share_a_gpu() -> None:
    runtime, config = await rendezvous(JobSpec.of(model="examples.models:residual_mlp", pipeline_stages=2),
                                       placed("cuda:0", "cuda:0"))
    assert config is None and runtime.spawned == []
