"""Nothing of a cluster listens beyond loopback unless asked: checked with each process's own sockets."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest
import torch

from benchmarks.overhead import process_tree
from schedulers import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

_LISTEN = "0A"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_address: str, family: int) -> str:
    raw = bytes.fromhex(hex_address)
    if family == socket.AF_INET:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # /proc/net/tcp6 prints the address as four host-order 32-bit words.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """Every TCP socket the process ``pid`` listens on, as (address, port)."""
    inodes = _socket_inodes(pid)
    found = []
    # The process's own view: the network namespace it lives in.
    for path, family in ((f"/proc/{pid}/net/tcp", socket.AF_INET), (f"/proc/{pid}/net/tcp6", socket.AF_INET6)):
        if not os.path.exists(path):
            continue
        with open(path) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == _LISTEN and inode in inodes:
                    host, port = local.split(":")
                    found.append((_address(host, family), int(port, 16)))
    return found


def with_children(pid: int) -> list[int]:
    """``pid`` and every process under it (a node's hosted actor processes, where its stages run)."""
    return process_tree(pid) or [pid]


def test_listening_addresses_sees_a_wildcard_listener() -> None:
    wildcard = socket.socket()
    try:
        wildcard.bind(("0.0.0.0", 0))
        wildcard.listen(1)
        assert ("0.0.0.0", wildcard.getsockname()[1]) in listening_addresses(os.getpid())
    finally:
        wildcard.close()


@pytest.mark.parametrize("transport", ["dist"])
@pytest.mark.multiprocess
async def test_a_job_with_a_rendezvous_and_collectives_listens_only_on_loopback(transport: str) -> None:
    local = LocalCluster(nodes=2)
    async with local as cluster:
        head_before = [a for p in with_children(local.processes["head"].pid) for a in listening_addresses(p)]
        job = await cluster.train(model="examples.models:residual_mlp", model_kwargs={"blocks": 2, "dim": 8},
                                  data_parallel=2, micro_batches=2, transport=transport)
        try:
            await job.step(torch.randn(8, 2, 8), torch.randn(8, 2, 8))
            pids = {name: proc.pid for name, proc in local.processes.items()}
            # Each process with its children: a stage runs in a process its node hosts.
            seen = {name: [a for p in with_children(pid) for a in listening_addresses(p)] for name, pid in pids.items()}
            assert seen["node0"] and seen["node1"], seen  # gloo's listeners in the workers' stages at least
            # The rendezvous is an actor on the head's own channel: the head opens no listener for it.
            assert seen["head"] == head_before
            for name, addresses in seen.items():
                outside = [a for a in addresses if not ipaddress.ip_address(a[0]).is_loopback]
                assert not outside, f"{name} listens beyond loopback: {outside}"
        finally:
            await job.close()
