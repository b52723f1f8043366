"""A killed driver's LocalCluster folder is removed by the next LocalCluster, and only such folders are."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from actors import LocalCluster
from actors.cluster import _write_owner, local_binds, remove_orphaned_tempdirs

pytestmark = [pytest.mark.timeout(120)]

DRIVER = """
import asyncio, sys
from actors import LocalCluster

async def main():
    local = LocalCluster(nodes=0)
    async with local:
        print(local._tempdir, local.processes["head"].pid, flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


def wait_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every temporary folder of this test (and of its driver) under ``tmp_path``, not the machine's /tmp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path


@pytest.mark.asyncio
@pytest.mark.multiprocess
async def test_the_next_local_cluster_removes_a_killed_drivers_folder(private_tmp: Path) -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert driver.stdout is not None
        folder, head_pid = driver.stdout.readline().decode().split()
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    head_gone = wait_gone(int(head_pid))  # the head dies with its driver (PR_SET_PDEATHSIG)
    if not head_gone:
        os.kill(int(head_pid), signal.SIGKILL)
    assert head_gone, "the killed driver's head outlived it"
    assert Path(folder).parent == private_tmp and Path(folder).is_dir()  # the kill left it behind
    # Beside it: a folder of a driver that still runs (this one), and one that names no owner.
    alive = tempfile.mkdtemp(prefix="actorpipe-cluster-")
    _write_owner(alive)
    unowned = tempfile.mkdtemp(prefix="actorpipe-cluster-")
    local = LocalCluster(nodes=0)
    async with local:
        assert local._tempdir is not None and Path(local._tempdir).parent == private_tmp
        assert not Path(folder).exists()
        assert Path(alive).is_dir() and Path(unowned).is_dir()
    # torchinductor_USER is torch's compile cache, which importing torch._dynamo makes in TMPDIR (the fork
    # server the nodes are forked from imports it once): torch's, not a cluster's, and shared by design.
    left = sorted(p.name for p in private_tmp.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == sorted([Path(alive).name, Path(unowned).name])


def test_a_reused_pid_does_not_keep_a_folder(private_tmp: Path) -> None:
    # The recorded pid is alive (it is this process) but started at another time: another process.
    stale = tempfile.mkdtemp(prefix="actorpipe-cluster-")
    (Path(stale) / "owner").write_text(f"{os.getpid()} 1")
    assert remove_orphaned_tempdirs() == [stale]
    assert not Path(stale).exists()


def test_a_local_cluster_listens_on_unix_sockets_in_its_folder_or_on_loopback_where_the_path_is_too_long() -> None:
    binds = local_binds("/tmp/actorpipe-cluster-abc", ["head", "driver", "node0"])
    assert binds == {name: f"ipc:///tmp/actorpipe-cluster-abc/{name}" for name in ("head", "driver", "node0")}
    # sun_path holds 103 bytes on macOS (107 on Linux), and a node's child binds at PATH.PID with a
    # stream socket at PATH.PID.stream: the longest path may take 103 - len(".4194304.stream") = 88 bytes.
    at_limit = "/" + "d" * (88 - len("/driver") - 1)
    assert local_binds(at_limit, ["driver"]) == {"driver": f"ipc://{at_limit}/driver"}
    over = at_limit + "d"
    assert local_binds(over, ["head", "driver"]) == {"head": "tcp://127.0.0.1:0", "driver": "tcp://127.0.0.1:0"}


@pytest.mark.asyncio
@pytest.mark.multiprocess
async def test_every_socket_of_a_local_cluster_lives_in_its_folder_and_goes_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The head, the nodes, a hosted actor's process, the driver and the head's liveness sockets bind
    Unix sockets in the cluster's folder (nothing beside it in the temporary folder), and the folder
    goes when the cluster stops, a SIGKILLed node's socket files with it."""
    short = tempfile.mkdtemp(prefix="ap", dir="/tmp")  # short enough for Unix socket paths
    monkeypatch.setattr(tempfile, "tempdir", short)
    monkeypatch.setenv("TMPDIR", short)
    try:
        local = LocalCluster(nodes=2)
        async with local as cluster:
            folder = local._tempdir
            assert folder is not None and os.path.dirname(folder) == short
            await cluster.spawn("node0", "probe", "echo")
            node1 = next(n for n in await cluster.nodes() if n.name == "node1")
            os.kill(node1.pid, signal.SIGKILL)  # leaves its socket files behind
            assert wait_gone(node1.pid)
            sockets = sorted(p.name for p in Path(folder).iterdir() if p.is_socket())
            assert os.listdir(short) == [os.path.basename(folder)]  # nothing outside the cluster's folder
            for expected in ("head", "head.bulk", "head.stream", "head.live0", "driver", "driver.stream", "node0",
                             "node0.bulk", "node0.stream", "node1"):
                assert expected in sockets, sockets
            hosted = [name for name in sockets if name.startswith("node0.") and name[len("node0."):].isdigit()]
            assert len(hosted) == 1 and {f"{hosted[0]}.bulk", f"{hosted[0]}.stream"} <= set(sockets)  # the echo actor's
        assert os.listdir(short) == []
    finally:
        shutil.rmtree(short, ignore_errors=True)
