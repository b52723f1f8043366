"""Starting from a launcher's variables (actors.launchers): torchrun for real, Slurm's and Kubernetes'
variables exactly as ``srun`` and an Indexed Job set them."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from actors.keys import ClusterKeys
from actors.launchers import (
    HeadStartError,
    LaunchRole,
    _await_head,
    first_host,
    from_environment,
    own_host,
    serve_unless_rank_zero,
)
from tests.helpers import pythonpath


def test_an_ipv6_head_is_named_in_brackets_and_a_node_is_reached_where_its_route_to_the_head_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``MASTER_ADDR=fd00::5`` made ``tcp://fd00::5:29501``, which libzmq cannot read; and a node told the
    head was on another host advertised its host name resolved, which Debian and Ubuntu map to
    ``127.0.1.1`` (and this machine to ``127.0.0.1``): no other host could reach it."""
    role = from_environment({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "fd00::5", "MASTER_PORT": "29500"})
    assert role is not None and role.head_address == "tcp://[fd00::5]:29501" and not role.loopback
    ipv6_loopback = from_environment({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "::1"})
    assert ipv6_loopback is not None and ipv6_loopback.loopback and own_host("::1") == "[::1]"
    assert own_host("127.0.0.1") == "127.0.0.1" and own_host("localhost") == "127.0.0.1"
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    # 192.0.2.1 (TEST-NET-1) goes by the default route: its source address is this host's own.
    host = own_host("192.0.2.1", 29501)
    assert not ipaddress.ip_address(host).is_loopback
    with socket.socket() as probe:
        probe.bind((host, 0))  # an address of this machine
    monkeypatch.setenv("ACTORPIPE_HOST", "fd00::9")
    assert own_host("192.0.2.1") == "[fd00::9]"


def test_a_head_whose_name_is_loopback_on_its_own_machine_listens_on_every_address(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--master-addr $(hostname)`` where /etc/hosts maps the name to 127.0.1.1: the head listened on loopback,
    and ranks on other machines (which resolve the name to its network address) waited for it in silence.
    It now listens on every address (tests/actors/test_remote.py trains so across two hosts)."""
    from actors.node import _from_launcher, parse_args

    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: real("127.0.1.1" if host == "trainhost" else host,
                                                                          *a, **k))
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "trainhost", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    _from_launcher(args := parse_args(["--insecure"]))
    assert args.head and args.bind == "tcp://0.0.0.0:29501" and args.allow_remote
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # a network address: the head listens there
    _from_launcher(args := parse_args(["--insecure"]))
    assert not ipaddress.ip_address(args.bind.split("//")[1].rsplit(":", 1)[0]).is_loopback
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # a launch on this machine alone stays on loopback
    _from_launcher(args := parse_args(["--insecure"]))
    assert args.bind == "tcp://127.0.0.1:29501" and not args.allow_remote


def test_torchrun_and_kubeflow_name_the_rank_and_the_head_one_port_above_their_store() -> None:
    env = {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}
    assert from_environment(env) == LaunchRole("torchrun", 2, 4, "10.0.0.5", 29501)
    assert from_environment({**env, "ACTORPIPE_PORT": "7000"}) == LaunchRole("torchrun", 2, 4, "10.0.0.5", 7000)
    pet = {"PET_NODE_RANK": "0", "PET_NNODES": "2", "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"}
    role = from_environment(pet)
    assert role == LaunchRole("torchrun", 0, 2, "job-master-0", 23457) and role.is_head and not role.loopback


def test_slurm_names_the_first_host_of_the_job_and_a_port_of_the_job() -> None:
    # As srun sets them for task 3 of 8 on two nodes.
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}
    assert from_environment(env) == LaunchRole("slurm", 3, 8, "gpu07", 20000 + 123456 % 20000)
    assert first_host("gpu[03-05,9],cpu1") == "gpu03" and first_host("login1,login2") == "login1"
    # A name goes on after its brackets (it was cut there: node01, a host that does not exist).
    assert first_host("node[01-02]-ib,login1") == "node01-ib" and first_host("rack[1-2]-blade[3-4]") == "rack1-blade3"
    assert first_host(" gpu-a[001-003],gpu-b[1,5-6] ") == "gpu-a001" and first_host("node[7]") == "node7"
    for bad in ("", "[1-2]", "node[01-02", "node01-02]"):
        with pytest.raises(ValueError, match="not a Slurm node list"):
            first_host(bad)
    with pytest.raises(ValueError, match="no SLURM_JOB_NODELIST"):
        from_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})



def test_slurm_names_the_first_host_of_the_step_where_task_zero_runs() -> None:
    # srun -N2 --relative=1 inside an allocation of n[1-3]: task 0 runs on n2, the step's first host (the head
    # was looked for on n1, where nothing listens, and every worker waited out its head timeout).
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_STEP_NODELIST": "n[2-3]",
           "SLURM_NODELIST": "n[1-3]", "SLURM_JOB_ID": "4242"}
    assert from_environment(env) == LaunchRole("slurm", 1, 2, "n2", 24242)


def test_a_kubernetes_indexed_job_needs_the_heads_stable_name() -> None:
    env = {"JOB_COMPLETION_INDEX": "1", "ACTORPIPE_WORLD_SIZE": "3", "ACTORPIPE_HEAD_HOST": "train-0.train"}
    assert from_environment(env) == LaunchRole("kubernetes", 1, 3, "train-0.train", 29400)
    with pytest.raises(ValueError, match="ACTORPIPE_HEAD_HOST"):
        from_environment({"JOB_COMPLETION_INDEX": "0"})
    with pytest.raises(ValueError, match="JOB_COMPLETION_INDEX=5 is outside a world of ACTORPIPE_WORLD_SIZE=3"):
        from_environment({**env, "JOB_COMPLETION_INDEX": "5"})
    assert from_environment({}) is None
    # A JobSet of two replicated Jobs numbers each Job's pods from 0: two heads, before it was refused.
    assert from_environment({**env, "JOB_INDEX": "0"}) == LaunchRole("kubernetes", 1, 3, "train-0.train", 29400)
    with pytest.raises(ValueError, match=r"JOB_INDEX='1': a JobSet of several replicated Jobs .*\(replicas: 1\)"):
        from_environment({**env, "JOB_INDEX": "1"})


@pytest.mark.multiprocess
def test_a_node_with_no_role_and_no_launcher_says_what_to_do() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID", "JOB_COMPLETION_INDEX")}
    result = subprocess.run([sys.executable, "-m", "actors.node"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "give --head, --join ADDRESS" in result.stderr and "torchrun" in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_rank_zero_fails_at_once_by_name_when_its_heads_port_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A head that cannot bind exits (code 2: a node that cannot start, one line saying why); rank 0 says
    so and why, rather than every rank timing out on connect."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                            "ACTORPIPE_PORT": str(port)}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(HeadStartError, match=rf"exited with code 2 before it listened; port {port} is in use"):
            serve_unless_rank_zero(["--insecure", "--log-level", "ERROR"])


@pytest.mark.multiprocess
def test_a_head_that_neither_listens_nor_exits_fails_rank_zero_within_the_start_timeout(tmp_path: Path) -> None:
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(HeadStartError, match=r"did not listen within 0.3s"):
            _await_head(stuck, str(tmp_path / "never"), LaunchRole("torchrun", 0, 2, "127.0.0.1", 1), 0.3)
        assert stuck.poll() is None  # the caller stops it (serve_unless_rank_zero does)
    finally:
        stuck.kill()
        stuck.wait()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_torchrun_cluster_of_three_trains_a_job_for_a_driver_that_names_no_address(tmp_path: Path) -> None:
    """``torchrun --nnodes 1 --nproc-per-node 3 -m actors.node``: rank 0 is the head, ranks 1 and 2
    join it; a driver with the same variables and keys connects without an address and trains."""
    from schedulers import Cluster

    keys = ClusterKeys.create(tmp_path / "keys")
    store, port = _free_port(), _free_port()  # the head's own: MASTER_PORT + 1 may be another test's
    env = {**os.environ, "ACTORPIPE_KEYS": str(keys.directory), "PYTHONPATH": pythonpath(os.getcwd()),
           "ACTORPIPE_PORT": str(port)}
    launcher = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nnodes", "1", "--nproc-per-node", "3",
         "--master-addr", "127.0.0.1", "--master-port", str(store), "-m", "actors.node", "--allow", "examples.models",
         "--checkpoint-root", str(tmp_path / "checkpoints"), "--log-level", "WARNING"],
        env=env, start_new_session=True, cwd=os.getcwd())
    driver_env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store),
                  "ACTORPIPE_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in driver_env}
    os.environ.update(driver_env)
    try:
        deadline = time.monotonic() + 120
        while True:  # the head listens once rank 0 has imported everything
            try:
                cluster = await Cluster.connect(keys=keys.directory, identity="admin", timeout=5)
                break
            except Exception:
                assert launcher.poll() is None, "torchrun ended"
                assert time.monotonic() < deadline, "the head never answered"
                await asyncio.sleep(0.5)
        try:
            while len([n for n in await cluster.nodes() if n.alive and n.name != "head"]) < 2:
                assert time.monotonic() < deadline, "the workers never joined"
                await asyncio.sleep(0.2)
            assert sorted(n.name for n in await cluster.nodes() if n.name != "head") == ["rank1", "rank2"]
            job = await cluster.train(model="examples.models:residual_mlp",
                                      model_kwargs={"blocks": 4, "dim": 8, "hidden": 16}, pipeline_stages=2,
                                      micro_batches=2)
            try:
                stats = await job.step(torch.randn(4, 8), torch.randn(4, 8))
                assert stats.loss == stats.loss
            finally:
                await job.close()
        finally:
            await cluster.close()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.killpg(launcher.pid, signal.SIGTERM)
        try:
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("master", ["127.0.0.1", "::1"])
def test_one_script_on_every_torchrun_rank_drives_on_rank_zero_and_serves_elsewhere(tmp_path: Path,
                                                                                     master: str) -> None:
    """examples/launched.py under ``torchrun --nproc-per-node 3``: rank 0 trains on the head it started,
    ranks 1 and 2 serve as nodes and exit once the head is gone; torchrun ends with every rank's 0.
    Over IPv6 as well (``MASTER_ADDR=::1``): every address in brackets, every socket let onto IPv6."""
    keys = ClusterKeys.create(tmp_path / "keys")
    env = {**os.environ, "ACTORPIPE_KEYS": str(keys.directory), "PYTHONPATH": pythonpath(os.getcwd()),
           "ACTORPIPE_PORT": str(_free_port())}  # the head's own: MASTER_PORT + 1 may be another test's
    launcher = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nnodes", "1", "--nproc-per-node", "3",
         "--master-addr", master, "--master-port", str(_free_port()), "examples/launched.py"],
        env=env, cwd=os.getcwd(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = launcher.communicate(timeout=240)
    finally:  # every rank and the head, whatever happened: nothing outlives the test
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
    assert launcher.returncode == 0, stderr[-3000:]
    steps = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" loss ")[0] for line in steps] == [f"step {k}" for k in range(5)], stdout[-2000:]
    # Ranks 1 and 2 stopped because the head's connection closed, not after --head-timeout of silence.
    assert stderr.count("a launched node stops with its head") == 2, stderr[-3000:]
    assert "head unreachable" not in stderr


@pytest.mark.parametrize(("env", "message"), [
    # Found by review: torchrun's rank and world without MASTER_ADDR were no launcher at all (each rank ran the
    # script alone), and an empty one made a head that listened beyond loopback and workers told "it needs a host".
    ({"RANK": "1", "WORLD_SIZE": "3"}, "torchrun's RANK and WORLD_SIZE are set but MASTER_ADDR is not"),
    ({"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": " "}, "MASTER_ADDR is empty"),
    ({"PET_NODE_RANK": "0", "PET_NNODES": "2"}, "PET_MASTER_ADDR is not"),
    # Each bad variable by its name, not "the launcher's rank".
    ({"RANK": "x", "WORLD_SIZE": "3", "MASTER_ADDR": "h"}, "RANK is not a whole number: 'x'"),
    ({"RANK": "0", "WORLD_SIZE": "", "MASTER_ADDR": "h"}, "WORLD_SIZE is not a whole number: ''"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "-1"},
     r"the head's port 0 \(from MASTER_PORT\+1\) is not a TCP port"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "ACTORPIPE_PORT": "abc"}, "ACTORPIPE_PORT is not a whole"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "ACTORPIPE_PORT": "70000"},
     r"port 70000 \(from ACTORPIPE_PORT\) is not a TCP port"),
    # int() takes "12_3" as 123.
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "12_3"},
     "SLURM_JOB_ID is not a whole number: '12_3'"),
])
def test_launcher_variables_that_cannot_work_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_environment(env)


def test_a_head_on_another_loopback_address_listens_where_the_others_look() -> None:
    """Found by review: MASTER_ADDR=127.0.1.1 (what `hostname -i` gives on Debian) made the head listen at
    127.0.0.1 while every rank looked for it at 127.0.1.1, which that socket refuses: nothing connected."""
    role = from_environment({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.1.1"})
    assert role is not None and role.loopback and role.head_address == "tcp://127.0.1.1:29501"
    assert own_host("127.0.1.1") == "127.0.1.1"
