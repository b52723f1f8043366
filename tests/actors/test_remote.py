"""Two "hosts" (network namespaces joined by a veth pair, as root): a remote worker with its key joins, a stranger does not."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors import ClusterKeys
from benchmarks import _netns

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.skipif(_netns.unavailable_reason() is not None, reason=str(_netns.unavailable_reason()))]

# Runs inside namespace B, on the other "host": one driver with the cluster's client
# key (it must see the remote worker join), one stranger with a key of its own and one
# with none (neither may get an answer from the head).
PROBE = textwrap.dedent("""
    import asyncio, sys
    from actors import HEAD, ActorTimeout, HeadActor, open_runtime
    from schedulers import Cluster
    from transport.security import Keypair

    async def main(address, keys, bind):
        async with Cluster.connect(address, keys=keys, bind=bind, allow_remote=True, timeout=30) as driver:
            nodes = await driver.wait_for_nodes(1, timeout=60)
            print("member sees", sorted(n.name for n in nodes), flush=True)
        stranger = Keypair.generate()
        for label, security in (("stranger", {"keys": stranger, "ring": lambda: {stranger.public: "client:me"}}),
                                ("plaintext", {})):
            async with open_runtime(bind, allow_remote=True, **security) as runtime:
                try:
                    await runtime.ref(address, HEAD).endpoint(HeadActor.nodes, timeout=3).call()
                    print(label, "ANSWERED", flush=True)
                except ActorTimeout:
                    print(label, "refused", flush=True)

    asyncio.run(main(*sys.argv[1:]))
""")


def start_head(link: _netns.Link, keys: ClusterKeys, address_file: Path,
               processes: list[subprocess.Popen[bytes]], bind: str = "") -> str:
    """Starts a head in namespace A, listening on its veth address (or ``bind``); returns its address."""
    processes.append(_netns.start_process(link.ns_a, [
        sys.executable, "-m", "actors.node", "--head", "--bind", bind or f"tcp://{link.addr_a}:0", "--allow-remote",
        "--address-file", str(address_file), "--keys", keys.directory, "--log-level", "WARNING"]))
    deadline = time.monotonic() + 60
    while not address_file.exists():
        assert processes[0].poll() is None and time.monotonic() < deadline, "the head did not start"
        time.sleep(0.05)
    return address_file.read_text().strip()


@contextlib.contextmanager
def two_hosts(tmp_path: Path, tag: str, subnet: str, *nodes: str
              ) -> Iterator[tuple[_netns.Link, ClusterKeys, Path, list[subprocess.Popen[bytes]]]]:
    """A link between two namespaces, the cluster's keys (with a node key for each of ``nodes``), where
    the head writes its address, and the processes started meanwhile, each stopped at the end."""
    link = _netns.make_link(f"{tag}{os.getpid() % 100000}", subnet=subnet)
    keys = ClusterKeys.create(tmp_path / "keys")
    for name in nodes:
        keys.add("node", name)
    processes: list[subprocess.Popen[bytes]] = []
    with _netns.open_link(link):
        try:
            yield link, keys, tmp_path / "head.address", processes
        finally:
            _netns.stop_processes(processes)


def test_a_remote_worker_joins_with_its_key_and_a_remote_stranger_is_refused(tmp_path: Path) -> None:
    link = _netns.make_link(f"k{os.getpid() % 100000}", subnet="10.213.9")
    keys = ClusterKeys.create(tmp_path / "keys")
    keys.add("node", "remote")
    address_file = tmp_path / "head.address"
    processes: list[subprocess.Popen[bytes]] = []
    with _netns.open_link(link):
        try:
            address = start_head(link, keys, address_file, processes)
            assert address.startswith(f"tcp://{link.addr_a}:") and "|" in address
            processes.append(_netns.start_process(link.ns_b, [
                sys.executable, "-m", "actors.node", "--join", address, "--name", "remote", "--bind",
                f"tcp://{link.addr_b}:0", "--allow-remote", "--keys", keys.directory, "--identity", "remote",
                "--log-level", "WARNING"]))
            probe = subprocess.run(_netns.netns_exec(link.ns_b, [
                sys.executable, "-c", PROBE, address, keys.directory, f"tcp://{link.addr_b}:0"]),
                cwd=_netns.REPO_ROOT, capture_output=True, text=True, timeout=120)
            assert probe.returncode == 0, probe.stderr[-3000:]
            assert probe.stdout.splitlines() == ["member sees ['remote']", "stranger refused", "plaintext refused"]
        finally:
            _netns.stop_processes(processes)


# Runs inside namespace B: the driver trains a job whose two data-parallel replicas sit
# on different "hosts", so their gloo group meets through the head's rendezvous actor.
TRAIN = textwrap.dedent("""
    import asyncio, math, sys
    import torch
    from schedulers import Cluster

    async def main(address, keys, bind):
        async with Cluster.connect(address, keys=keys, bind=bind, allow_remote=True, timeout=30) as driver:
            await driver.wait_for_nodes(2, timeout=60)
            job = await driver.train(model="examples.models:residual_mlp", model_kwargs={"blocks": 2, "dim": 8},
                                     data_parallel=2, micro_batches=2, step_timeout_s=60)
            try:
                torch.manual_seed(0)
                for _ in range(2):
                    stats = await job.step(torch.randn(8, 2, 8), torch.randn(8, 2, 8))
                    print("loss finite", math.isfinite(stats.loss), flush=True)
            finally:
                await job.close()

    asyncio.run(main(*sys.argv[1:]))
""")


def test_data_parallel_replicas_on_two_hosts_meet_through_the_heads_channel(tmp_path: Path) -> None:
    from tests.schedulers.test_listeners import listening_addresses

    link = _netns.make_link(f"r{os.getpid() % 100000}", subnet="10.213.10")
    keys = ClusterKeys.create(tmp_path / "keys")
    for name in ("near", "far"):
        keys.add("node", name)
    address_file = tmp_path / "head.address"
    processes: list[subprocess.Popen[bytes]] = []
    with _netns.open_link(link):
        try:
            address = start_head(link, keys, address_file, processes)
            head_listens = listening_addresses(processes[0].pid)
            for name, ns, host in (("near", link.ns_a, link.addr_a), ("far", link.ns_b, link.addr_b)):
                processes.append(_netns.start_process(ns, [
                    sys.executable, "-m", "actors.node", "--join", address, "--name", name, "--bind",
                    f"tcp://{host}:0", "--allow-remote", "--keys", keys.directory, "--identity", name,
                    "--allow", "examples.models", "--log-level", "WARNING"]))
            run = subprocess.run(_netns.netns_exec(link.ns_b, [
                sys.executable, "-c", TRAIN, address, keys.directory, f"tcp://{link.addr_b}:0"]),
                cwd=_netns.REPO_ROOT, capture_output=True, text=True, timeout=150)
            assert run.returncode == 0, run.stderr[-3000:]
            assert run.stdout.splitlines() == ["loss finite True"] * 2
            # No store of its own: the head listens on its runtime's two ports (CURVE, and the bulk socket
            # of sealed messages: transport.sealed), as before the job, and on one liveness socket per
            # worker (actors._liveness), nothing else.
            runtime_ports = {int(part.rpartition(":")[2]) for part in address.split("|")[::2]}
            assert len(runtime_ports) == 2 and {port for _, port in head_listens} == runtime_ports
            after = listening_addresses(processes[0].pid)
            assert runtime_ports <= {port for _, port in after} and len(after) == 2 + 2, after
        finally:
            _netns.stop_processes(processes)


# Runs inside namespace B: a driver that trains one step on the worker there.
ONE_STEP = textwrap.dedent("""
    import asyncio, math, sys
    import torch
    from schedulers import Cluster

    async def main(address, keys, bind):
        async with Cluster.connect(address, keys=keys, bind=bind, allow_remote=True, timeout=30) as driver:
            await driver.wait_for_nodes(1, timeout=60)
            job = await driver.train(model="examples.models:residual_mlp", model_kwargs={"blocks": 2, "dim": 8},
                                     step_timeout_s=60)
            try:
                stats = await job.step(torch.randn(4, 8), torch.randn(4, 8))
                print("loss finite", math.isfinite(stats.loss), flush=True)
            finally:
                await job.close()

    asyncio.run(main(*sys.argv[1:]))
""")


def test_a_head_and_a_worker_bound_to_every_address_are_reached_at_their_own(tmp_path: Path) -> None:
    """``--bind tcp://0.0.0.0:0`` (as in a container) made a node name itself ``tcp://0.0.0.0:PORT``: a head
    so bound told workers on other hosts to answer it at 0.0.0.0, their own machine. It now names
    itself by its address on its default route, and listens on every address still."""
    with two_hosts(tmp_path, "w", "10.213.11", "far") as (link, keys, address_file, processes):
        for ns, gateway in ((link.ns_a, link.addr_b), (link.ns_b, link.addr_a)):  # each host's default route
            subprocess.run(["ip", "-n", ns, "route", "add", "default", "via", gateway], check=True, timeout=30)
        address = start_head(link, keys, address_file, processes, bind="tcp://0.0.0.0:0")
        assert address.startswith(f"tcp://{link.addr_a}:") and f"|tcp://{link.addr_a}:" in address, address
        processes.append(_netns.start_process(link.ns_b, [
            sys.executable, "-m", "actors.node", "--join", address, "--name", "far", "--bind", "tcp://*:0",
            "--allow-remote", "--keys", keys.directory, "--identity", "far", "--allow", "examples.models",
            "--log-level", "WARNING"]))
        run = subprocess.run(_netns.netns_exec(link.ns_b, [
            sys.executable, "-c", ONE_STEP, address, keys.directory, "tcp://0.0.0.0:0"]),
            cwd=_netns.REPO_ROOT, capture_output=True, text=True, timeout=150)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.splitlines() == ["loss finite True"]

# Runs inside namespace B: a driver that names no bind (loopback, the default).
LOOPBACK_DRIVER = textwrap.dedent("""
    import asyncio, sys, time
    from schedulers import Cluster

    async def main(address, keys):
        started = time.monotonic()
        try:
            await Cluster.connect(address, keys=keys, timeout=20)
        except ValueError as exc:
            print(type(exc).__name__, round(time.monotonic() - started) < 10, exc, flush=True)

    asyncio.run(main(*sys.argv[1:]))
""")


def test_a_process_the_head_cannot_answer_says_so(tmp_path: Path) -> None:
    """A driver or a worker on another host that left --bind at its default (loopback) sent its calls, and the
    head's answers went to loopback on the head's own host: the driver waited out its timeout for a
    HeadUnreachable that blamed the keys, the worker its --head-timeout. Both now fail at once, naming the fix;
    a worker bound where the head has no route says that the answers may not reach it."""
    with two_hosts(tmp_path, "l", "10.213.12", "far") as (link, keys, address_file, processes):
        address = start_head(link, keys, address_file, processes)
        driver = subprocess.run(_netns.netns_exec(link.ns_b, [sys.executable, "-c", LOOPBACK_DRIVER, address,
                                                              keys.directory]),
                                cwd=_netns.REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert driver.returncode == 0, driver.stderr[-3000:]
        assert driver.stdout.startswith(f"ValueError True the head at tcp://{link.addr_a}:"), driver.stdout
        assert (f"listens at tcp://127.0.0.1:" in driver.stdout and "bind='tcp://ADDRESS:0'" in driver.stdout
                and f"toward it is {link.addr_b})" in driver.stdout), driver.stdout
        worker = subprocess.run(_netns.netns_exec(link.ns_b, [
            sys.executable, "-m", "actors.node", "--join", address, "--name", "far", "--keys", keys.directory,
            "--identity", "far", "--head-timeout", "60", "--log-level", "WARNING"]),
            cwd=_netns.REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert worker.returncode == 2, worker.stderr[-3000:]
        assert worker.stderr.strip().splitlines()[-1].startswith(f"error: the head at tcp://{link.addr_a}:")
        assert "--bind tcp://ADDRESS:0" in worker.stderr and "--allow-remote" in worker.stderr
        # Bound beyond loopback, but on a network the head has no route to: it waits out --head-timeout,
        # and says that the head's answers may not reach it (it blamed the keys alone).
        subprocess.run(["ip", "-n", link.ns_b, "addr", "add", "10.99.0.2/24", "dev", link.dev_b], check=True,
                       timeout=30)  # a second network on the same link, which the head's host has no route to
        worker = subprocess.run(_netns.netns_exec(link.ns_b, [
            sys.executable, "-m", "actors.node", "--join", address, "--name", "far", "--keys", keys.directory,
            "--identity", "far", "--bind", "tcp://10.99.0.2:0", "--allow-remote", "--head-timeout", "3",
            "--log-level", "WARNING"]), cwd=_netns.REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert worker.returncode == 1, worker.stderr[-3000:]  # HeadUnreachable, as for a head that is silent
        assert "its answers cannot reach this process at tcp://10.99.0.2:" in worker.stderr, worker.stderr[-3000:]


def test_data_parallel_replicas_on_two_hosts_train_over_ipv6(tmp_path: Path) -> None:
    """The two-host data-parallel job of the test above on a link with IPv6 addresses alone: the head, the
    nodes and the driver in brackets, the replicas' gloo group on the interface that holds the node's
    address (it found none for an IPv6 address, and gloo listened where the host name resolves:
    loopback, and timed out connecting)."""
    with two_hosts(tmp_path, "6", "10.213.13", "near", "far") as (link, keys, address_file, processes):
        hosts = {link.ns_a: "fd13::1", link.ns_b: "fd13::2"}
        for (ns, address), dev in zip(hosts.items(), (link.dev_a, link.dev_b)):  # IPv6 alone on the link
            subprocess.run(["ip", "-n", ns, "-4", "addr", "flush", "dev", dev], check=True, timeout=30)
            subprocess.run(["ip", "-n", ns, "addr", "add", f"{address}/64", "dev", dev, "nodad"], check=True,
                           timeout=30)
        address = start_head(link, keys, address_file, processes, bind="tcp://[fd13::1]:0")
        assert address.startswith("tcp://[fd13::1]:"), address
        for name, ns in (("near", link.ns_a), ("far", link.ns_b)):
            processes.append(_netns.start_process(ns, [
                sys.executable, "-m", "actors.node", "--join", address, "--name", name, "--bind",
                f"tcp://[{hosts[ns]}]:0", "--allow-remote", "--keys", keys.directory, "--identity", name,
                "--allow", "examples.models", "--log-level", "WARNING"]))
        run = subprocess.run(_netns.netns_exec(link.ns_b, [
            sys.executable, "-c", TRAIN, address, keys.directory, "tcp://[fd13::2]:0"]),
            cwd=_netns.REPO_ROOT, capture_output=True, text=True, timeout=150)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.splitlines() == ["loss finite True"] * 2


# Runs inside namespace B: a driver that creates a two-host data-parallel job and says how that ended.
CREATE = textwrap.dedent("""
    import asyncio, sys
    from schedulers import Cluster

    async def main(address, keys, bind):
        async with Cluster.connect(address, keys=keys, bind=bind, allow_remote=True, timeout=30) as driver:
            await driver.wait_for_nodes(2, timeout=60)
            try:
                await asyncio.wait_for(driver.train(model="examples.models:residual_mlp",
                                                    model_kwargs={"blocks": 2, "dim": 8}, data_parallel=2,
                                                    micro_batches=2), 120)
                print("created", flush=True)
            except Exception as exc:
                print(type(exc).__name__, exc, flush=True)

    asyncio.run(main(*sys.argv[1:]))
""")


def test_a_process_group_that_cannot_connect_fails_the_job_at_once_and_says_why(tmp_path: Path) -> None:
    """Both nodes' gloo on loopback (GLOO_SOCKET_IFNAME=lo, as a node's own setting): one rank failed to
    connect in seconds, and the creation waited 300 s for the other, which waited for it, then said
    only that a spawn timed out. The rank still building is now stopped once one fails, and the
    error names the interface setting."""
    with two_hosts(tmp_path, "j", "10.213.15", "near", "far") as (link, keys, address_file, processes):
        address = start_head(link, keys, address_file, processes)
        for name, ns, host in (("near", link.ns_a, link.addr_a), ("far", link.ns_b, link.addr_b)):
            processes.append(_netns.start_process(ns, [
                "env", "GLOO_SOCKET_IFNAME=lo", sys.executable, "-m", "actors.node", "--join", address, "--name",
                name, "--bind", f"tcp://{host}:0", "--allow-remote", "--keys", keys.directory, "--identity", name,
                "--allow", "examples.models", "--log-level", "ERROR"]))
        run = subprocess.run(_netns.netns_exec(link.ns_b, [
            sys.executable, "-c", CREATE, address, keys.directory, f"tcp://{link.addr_b}:0"]),
            cwd=_netns.REPO_ROOT, capture_output=True, text=True, timeout=200)
        assert run.returncode == 0, run.stderr[-3000:]
        # A RuntimeError on the node: a RemoteError that is also a RuntimeError at the caller.
        assert run.stdout.startswith("RemoteRuntimeError stages.comm.parallel.GroupJoinFailed: rank "), \
            run.stdout[-3000:]
        assert "gloo reached for a loopback address, and the job's members are on several machines: " \
               "GLOO_SOCKET_IFNAME (here lo; a node's own setting wins)" in run.stdout, run.stdout[-3000:]


# Runs inside namespace A beside the head: a driver with the launcher's variables (no address), one step.
LAUNCHED_DRIVER = textwrap.dedent("""
    import asyncio, math
    import torch
    from schedulers import Cluster

    async def main():
        async with Cluster.connect(identity="admin", timeout=30) as driver:
            await driver.wait_for_nodes(1, timeout=60)
            async with await driver.train(model="examples.models:residual_mlp", model_kwargs={"blocks": 2, "dim": 8},
                                          step_timeout_s=60) as job:
                stats = await job.step(torch.randn(4, 8), torch.randn(4, 8))
                print("loss finite", math.isfinite(stats.loss), flush=True)

    asyncio.run(main())
""")


def test_a_launched_head_whose_name_is_loopback_at_home_is_reached_from_another_host(tmp_path: Path) -> None:
    """torchrun's MASTER_ADDR as a host name that the head's own /etc/hosts maps to 127.0.1.1 (Debian's
    way) and the other host resolves to the head's network address: the head listened on loopback and
    the remote rank waited for it in silence. It now listens on every address."""
    with two_hosts(tmp_path, "n", "10.213.16") as (link, keys, address_file, processes):
        hosts = {link.ns_a: "127.0.1.1", link.ns_b: link.addr_a}  # each host's view of the name "trainhost"
        try:
            for ns, address in hosts.items():  # ip netns exec mounts /etc/netns/NS/hosts over /etc/hosts
                os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
                Path(f"/etc/netns/{ns}/hosts").write_text(f"127.0.0.1 localhost\n{address} trainhost\n")
            subprocess.run(["ip", "-n", link.ns_a, "route", "add", "default", "via", link.addr_b], check=True,
                           timeout=30)
            launcher = ["env", "WORLD_SIZE=2", "MASTER_ADDR=trainhost", "MASTER_PORT=29500",
                        f"ACTORPIPE_KEYS={keys.directory}"]
            processes.append(_netns.start_process(link.ns_a, [
                *launcher, "RANK=0", sys.executable, "-m", "actors.node", "--log-level", "WARNING"]))
            processes.append(_netns.start_process(link.ns_b, [
                *launcher, "RANK=1", sys.executable, "-m", "actors.node", "--allow", "examples.models",
                "--head-timeout", "60", "--log-level", "WARNING"]))
            run = subprocess.run(_netns.netns_exec(link.ns_a, [*launcher, "RANK=0", sys.executable, "-c",
                                                               LAUNCHED_DRIVER]),
                                 cwd=_netns.REPO_ROOT, capture_output=True, text=True, timeout=150)
            assert run.returncode == 0, run.stderr[-3000:]
            assert run.stdout.splitlines() == ["loss finite True"]
        finally:
            for ns in hosts:
                shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
