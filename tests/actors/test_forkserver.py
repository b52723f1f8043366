"""The fork server a LocalCluster forks its head and nodes from (actors._forkserver)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors import LocalCluster
from actors._forkserver import ForkedProcess, ForkServer, fork_server
from tests.helpers import pythonpath

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

ROOT = str(Path(__file__).resolve().parents[2])
PROGRAM = "tests.helpers.forked_main"


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie has exited all the same
    except FileNotFoundError:
        return True


def wait_for(path: Path, process: ForkedProcess) -> dict[str, object]:
    while not path.exists():
        assert process.poll() is None, f"the program exited with {process.returncode} before writing {path}"
        time.sleep(0.02)
    return json.loads(path.read_text())


@pytest.fixture
def server() -> Iterator[ForkServer]:
    server = ForkServer()
    try:
        yield server
    finally:
        server.close()


def test_a_forked_program_runs_where_and_as_the_driver_says(server: ForkServer, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capfd: pytest.CaptureFixture[str]) -> None:
    # Changed after the server started: the child takes the driver's now, as a new process would.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "FORKED_TEST_VALUE": "set late", "PYTHONPATH": pythonpath(ROOT), "TMPDIR": str(tmp_path / "tmp")}
    out = tmp_path / "out.json"
    process = server.start([str(out), "exit", "7"], env, module=PROGRAM)
    assert process.wait(timeout=120) == 7 and process.returncode == 7
    said = json.loads(out.read_text())
    assert said["cwd"] == str(tmp_path) and said["value"] == "set late"
    assert said["tmp"] == str(tmp_path / "tmp")  # not the server's, which its imports cached
    assert said["argv"] == [str(out), "exit", "7"]
    assert said["pid"] == process.pid and said["sid"] == process.pid  # a session of its own
    assert said["stdin"] == ""  # /dev/null, as LocalCluster's nodes had
    assert "forked_main says exit" in capfd.readouterr().err  # the driver's stderr, as it is now


def test_kill_ends_a_forked_process_and_wait_says_how(server: ForkServer, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    process = server.start([str(out), "sleep"], {**os.environ, "PYTHONPATH": pythonpath(ROOT)}, module=PROGRAM)
    wait_for(out, process)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.1)
    process.kill()
    assert process.wait(timeout=120) == -signal.SIGKILL and process.poll() == -signal.SIGKILL
    assert gone(process.pid)
    process.kill()  # a second kill of a reaped process signals nothing (its pid may be another's now)


def test_a_program_that_fails_to_import_exits_1_and_says_why(server: ForkServer,
                                                             capfd: pytest.CaptureFixture[str]) -> None:
    process = server.start([], dict(os.environ), module="tests.helpers.no_such_program")
    assert process.wait(timeout=120) == 1
    assert "No module named 'tests.helpers.no_such_program'" in capfd.readouterr().err


def test_the_forked_processes_end_with_the_driver_however_it_ends(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        from actors._forkserver import fork_server
        process = fork_server().start([{str(out)!r}, "sleep"], {{**os.environ, "PYTHONPATH": {ROOT!r}}},
                                      module={PROGRAM!r})
        print(process.pid, flush=True)
        time.sleep(3600)
    """)], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert driver.stdout is not None
        pid = int(driver.stdout.readline())
        while not out.exists():
            assert driver.poll() is None
            time.sleep(0.02)
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 120  # the server sees its channel close, and ends its children
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid)


async def test_clusters_after_the_first_fork_from_the_same_server() -> None:
    async with LocalCluster(nodes=1) as cluster:
        first = fork_server()
        assert [n.alive for n in await cluster.nodes()] == [True]
    async with LocalCluster(nodes=1) as cluster:
        assert fork_server() is first and first.alive
        assert [n.alive for n in await cluster.nodes()] == [True]


async def test_a_cluster_can_start_each_node_as_its_own_command() -> None:
    local = LocalCluster(nodes=1, fork_nodes=False)
    async with local as cluster:
        assert all(isinstance(p, subprocess.Popen) for p in local.processes.values())
        assert [n.name for n in await cluster.nodes() if n.alive] == ["node0"]
    forked = LocalCluster(nodes=1)
    async with forked as cluster:
        assert all(isinstance(p, ForkedProcess) for p in forked.processes.values())
        assert all(os.getpgid(p.pid) == p.pid for p in forked.processes.values())  # each in its own session
        pids = forked.pids
    assert all(gone(pid) for pid in pids)
