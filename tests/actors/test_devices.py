"""Each node's device (``actors.devices``, ``stages.devices``), against fake GPU counts: the rules, every refusal, and pinning."""

from __future__ import annotations

import argparse
import asyncio
import threading
from typing import Any

import pytest
import torch

from actors import LocalCluster, devices, plugins
from actors._nodes import NodeContext
from actors.devices import check_device, cuda_index, device_argument, node_devices, visible_gpu_count
from stages import devices as stage_devices
from stages.devices import pin_device

pytestmark = pytest.mark.timeout(60)

C = [f"cuda:{i}" for i in range(4)]

# (devices, nodes, spares, visible GPUs) -> each node's device, nodes first then spares.
PLACEMENTS: list[tuple[Any, int | None, int, int, list[str]]] = [
    ("auto", None, 0, 0, ["cpu", "cpu"]),  # no GPU: the CPU default of 2 nodes
    ("auto", 3, 0, 0, ["cpu"] * 3),  # nodes= keeps its meaning on CPU
    ("auto", None, 1, 0, ["cpu"] * 3),
    ("auto", None, 0, 1, ["cuda:0"]),  # one node per visible GPU
    ("auto", None, 0, 2, C[:2]),
    ("auto", None, 0, 4, C),
    ("auto", 2, 0, 4, C[:2]),  # the first K GPUs
    ("auto", 2, 1, 4, C[:3]),  # a spare takes the next free GPU
    ("auto", None, 1, 2, ["cuda:0", "cuda:1", "cuda:0"]),  # every GPU has a node: the spare shares the first
    ("auto", 4, 0, 1, ["cuda:0"] * 4),  # more nodes than GPUs: in turn (LocalCluster warns)
    ("auto", 3, 0, 2, ["cuda:0", "cuda:1", "cuda:0"]),
    ("auto", 0, 0, 2, []),
    ("cpu", None, 0, 4, ["cpu", "cpu"]),  # GPUs there, but not asked for
    ("cpu", 3, 1, 2, ["cpu"] * 4),
    ("cpu", 0, 0, 0, []),
    (["cpu"], None, 0, 0, ["cpu"]),
    (["cuda:1", "cuda:0"], None, 0, 2, ["cuda:1", "cuda:0"]),  # one node per entry, in the list's order
    (["cuda:0", "cuda:0"], None, 0, 1, ["cuda:0", "cuda:0"]),  # a GPU named twice: shared on purpose
    (["cuda:0", "cuda:0"], 2, 0, 1, ["cuda:0", "cuda:0"]),  # nodes= that agrees
    (["cuda:3", "cpu"], None, 3, 4, ["cuda:3", "cpu", "cuda:3", "cpu", "cuda:3"]),  # spares cycle the list
    ((torch.device("cuda:1"), "cpu"), None, 0, 2, ["cuda:1", "cpu"]),  # torch.device entries, any sequence
]


@pytest.mark.parametrize(("spec", "nodes", "spares", "gpus", "expected"), PLACEMENTS)
def test_node_devices(spec: Any, nodes: int | None, spares: int, gpus: int, expected: list[str]) -> None:
    assert node_devices(spec, nodes, spares, gpus) == expected


# (devices, nodes, spares, visible GPUs) -> what the ValueError says.
REFUSALS: list[tuple[Any, Any, Any, int, str]] = [
    (["cuda:0"], None, 0, 0, r"device 'cuda:0' does not exist: this process sees no GPU; use devices='auto'"),
    (["cuda:2"], None, 0, 2, r"'cuda:2' does not exist: this process sees 2 GPUs \(cuda:0\.\.cuda:1\)"),
    (["cuda:1"], None, 0, 1, r"sees 1 GPU \(cuda:0\.\.cuda:0\)"),
    (["cpu", "cuda:4"], None, 0, 4, r"'cuda:4' does not exist"),
    (["gpu0"], None, 0, 2, r"unknown device 'gpu0': a node's device is 'cpu' or 'cuda:K'"),
    (["cuda"], None, 0, 2, r"unknown device 'cuda'.*name the GPU, e\.g\. 'cuda:0'"),
    (["cuda:-1"], None, 0, 2, r"unknown device 'cuda:-1'"),
    (["cuda:01"], None, 0, 2, r"unknown device 'cuda:01'"),
    (["CPU"], None, 0, 0, r"unknown device 'CPU'"),
    (["mps"], None, 0, 0, r"unknown device 'mps'"),
    ([0], None, 0, 1, r"unknown device '0'"),
    ([], None, 0, 2, r"devices=\[\] names no device"),
    (["cuda:0", "cuda:1"], 3, 0, 2, r"nodes=3 disagrees with devices, which names 2 \(cuda:0, cuda:1\)"),
    (["cpu"], 0, 0, 0, r"nodes=0 disagrees with devices, which names 1"),
    ("gpu", None, 0, 2, r"devices='gpu' is not understood: give 'auto'"),
    ("cuda:0", None, 0, 1, r"devices='cuda:0' is not understood.*or a list of"),  # a list, not a word
    ("auto", -1, 0, 0, r"nodes must be an int >= 0, got -1"),
    ("cpu", 2.0, 0, 0, r"nodes must be an int >= 0, got 2\.0"),
    ("cpu", True, 0, 0, r"nodes must be an int >= 0, got True"),
    ("auto", 2, -1, 2, r"spares must be an int >= 0, got -1"),
]


@pytest.mark.parametrize(("spec", "nodes", "spares", "gpus", "message"), REFUSALS)
def test_node_devices_refuses_with_what_is_accepted(spec: Any, nodes: Any, spares: Any, gpus: int,
                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        node_devices(spec, nodes, spares, gpus)


def test_no_gpu_seen_for_want_of_the_installed_counter_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # Run from a checkout on PYTHONPATH (as on a GPU machine here), nothing counted the one GPU there was.
    monkeypatch.setattr(plugins, "_entries", lambda: {})
    with pytest.raises(ValueError, match=r"sees no GPU \(nothing here counts GPUs: .*'devices' entry point"):
        node_devices(["cuda:0"], None, 0, visible_gpu_count())
    with pytest.raises(ValueError, match=r"sees 1 GPU \(cuda:0\.\.cuda:0\); use"):  # a count: nothing to add
        node_devices(["cuda:1"], None, 0, 1)


def test_cuda_index_and_check_device() -> None:
    assert cuda_index("cpu") is None
    assert cuda_index("cuda:0") == 0 and cuda_index("cuda:13") == 13
    assert check_device("cuda:3", 4) == "cuda:3" and check_device("cpu", 0) == "cpu"
    with pytest.raises(ValueError, match="sees 4 GPUs"):
        check_device("cuda:4", 4)


def test_the_node_command_line_checks_its_device_before_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    from actors.node import parse_args

    assert parse_args(["--join", "tcp://127.0.0.1:1"]).device == "cpu"
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 0)
    with pytest.raises(argparse.ArgumentTypeError, match="'cuda:0' does not exist: this process sees no GPU"):
        device_argument("cuda:0")
    with pytest.raises(SystemExit):
        parse_args(["--join", "tcp://127.0.0.1:1", "--device", "cuda:0"])
    with pytest.raises(SystemExit):
        parse_args(["--join", "tcp://127.0.0.1:1", "--device", "gpu"])
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 2)
    assert parse_args(["--join", "tcp://127.0.0.1:1", "--device", "cuda:1"]).device == "cuda:1"


def test_the_node_command_line_says_what_is_wrong_with_a_device(capsys: pytest.CaptureFixture[str]) -> None:
    from actors.node import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--join", "tcp://127.0.0.1:1", "--device", "cuda"])
    assert info.value.code == 2
    assert "argument --device: unknown device 'cuda'" in capsys.readouterr().err


def test_pin_device_sets_the_calling_threads_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(stage_devices, "visible_gpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append((threading.current_thread().name, index)))
    pin_device("cpu")
    assert calls == []  # nothing to pin on CPU
    pin_device("cuda:1")
    assert calls == [(threading.current_thread().name, 1)]
    with pytest.raises(ValueError, match="'cuda:2' does not exist"):
        pin_device("cuda:2")
    assert len(calls) == 1


def test_a_worker_on_a_gpu_keeps_lossy_values_encoded_until_they_reach_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from stages import worker
    from transport import wire

    monkeypatch.setattr(stage_devices, "visible_gpu_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(wire, "_keep_encoded", False)
    worker.start("cuda:0")
    assert wire._keep_encoded is True
    worker.start("cpu")
    assert wire._keep_encoded is False


def test_pin_device_refuses_a_gpu_this_machine_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage_devices, "visible_gpu_count", lambda: 0)
    with pytest.raises(ValueError, match="'cuda:0' does not exist: this process sees no GPU"):
        pin_device("cuda:0")


def test_the_stage_compute_thread_pins_the_nodes_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's current device is per host thread: the stage's compute thread must pin itself too."""
    import stages.actor as stage

    pinned: list[tuple[str, str]] = []
    monkeypatch.setattr(stage, "pin_device", lambda device: pinned.append((threading.current_thread().name, device)))
    made: list[Any] = []

    class Recording(stage.ThreadPoolExecutor):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(stage, "ThreadPoolExecutor", Recording)

    class Built(Exception):
        pass

    def build(*args: Any) -> None:
        raise Built

    actor = stage.StageActor.__new__(stage.StageActor)
    # Only what on_start reads: the rank before it builds, the job to name in a failed build.
    actor.config = type("Config", (), {"pipeline_rank": 1, "job": "job0"})()
    actor.runtime = None  # type: ignore[assignment]  # not spawned: the fake build never reaches it
    actor.node_context = NodeContext(name="node1", device="cuda:1", allow_list=[])
    monkeypatch.setattr(stage, "join_and_build", build)
    with pytest.raises(Built) as failed:
        asyncio.run(actor.on_start())
    assert failed.value.__notes__ == ["building stage 1 of job job0 on node node1 (a worker)"]
    assert [device for _, device in pinned] == ["cuda:1"]
    assert pinned[0][0].startswith("stage1-compute")  # on the compute thread, not the event loop's
    made[0].shutdown(wait=True)


def test_local_cluster_resolves_devices_before_starting_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 0)
    with pytest.raises(ValueError, match="'cuda:0' does not exist: this process sees no GPU"):
        LocalCluster(devices=["cuda:0"])
    with pytest.raises(ValueError, match="nodes=3 disagrees with devices"):
        LocalCluster(nodes=3, devices=["cpu", "cpu"])
    assert LocalCluster().devices == {"node0": "cpu", "node1": "cpu"}
    assert LocalCluster(nodes=1, spares=1, devices="cpu").devices == {"node0": "cpu", "spare0": "cpu"}


def test_local_cluster_starts_one_node_per_gpu_each_on_its_device(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    import actors.cluster

    monkeypatch.setattr(actors.cluster, "visible_gpu_count", lambda: 2)
    local = LocalCluster(spares=1, insecure=True)
    assert local.devices == {"node0": "cuda:0", "node1": "cuda:1", "spare0": "cuda:0"}
    assert local.num_nodes == 2 and local.num_spares == 1
    args = local._worker_args("node1", ["--insecure"], "/tmp/head.address")
    assert args[args.index("--device") + 1] == "cuda:1" and args[args.index("--name") + 1] == "node1"
    assert not caplog.records
    LocalCluster(nodes=3)  # more nodes than GPUs: they share, and the driver hears it
    assert "LocalCluster(nodes=3) on 2 GPU(s): nodes share GPUs in turn (cuda:0, cuda:1, cuda:0)" in caplog.text



@pytest.mark.parametrize(("env", "gpus", "device"), [
    ({"LOCAL_RANK": "3", "RANK": "11", "WORLD_SIZE": "16", "MASTER_ADDR": "h"}, 8, "cuda:3"),  # torchrun, 8 a host
    ({"SLURM_LOCALID": "1", "SLURM_PROCID": "5"}, 4, "cuda:1"),  # srun, one task per GPU
    ({"LOCAL_RANK": "9"}, 8, "cuda:1"),  # more ranks on the host than GPUs it sees: they share in turn
    ({"JOB_COMPLETION_INDEX": "2"}, 1, "cuda:0"),  # a Kubernetes pod: alone with its GPUs
    ({"LOCAL_RANK": "3"}, 0, "cpu"),  # no GPU visible
])
def test_device_auto_takes_this_ranks_gpu_on_its_machine(env: dict[str, str], gpus: int, device: str) -> None:
    """Noticed in review: nothing read LOCAL_RANK, so under torchrun --nproc-per-node 8 every node given
    --device cuda:0 computed on GPU 0. --device auto takes the rank's own (resolved as the node starts)."""
    from actors.launchers import local_rank
    from actors.devices import rank_device

    assert device_argument("auto") == "auto"
    assert rank_device(local_rank(env), gpus) == device


def test_a_local_rank_that_is_not_one_is_named() -> None:
    from actors.launchers import local_rank

    with pytest.raises(ValueError, match="LOCAL_RANK is not a whole number: 'x'"):
        local_rank({"LOCAL_RANK": "x"})
    with pytest.raises(ValueError, match="SLURM_LOCALID must be >= 0, got -1"):
        local_rank({"SLURM_LOCALID": "-1"})


def test_the_node_resolves_device_auto_as_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from actors import node

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(node, "visible_gpu_count", lambda: 2)
    args = node.parse_args(["--join", "tcp://127.0.0.1:1", "--device", "auto"])
    node._resolve_device(args)
    assert args.device == "cuda:1"
    monkeypatch.setattr(node, "visible_gpu_count", lambda: 0)
    args = node.parse_args(["--join", "tcp://127.0.0.1:1", "--device", "auto"])
    node._resolve_device(args)
    assert args.device == "cpu"
