"""torch.distributed for a job's mesh: joining its groups, and data-parallel gradient averaging.

Every stage actor of a job joins one process group spanning the job's mesh, with the
job's rendezvous on the head (``actors.rendezvous``), then builds every tensor- and data-parallel
subgroup in the same order (as torch requires) and keeps its own.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from actors.mesh import Mesh
from transport.codecs import ErrorFeedback

__all__ = [
    "ProcessGroups", "average_gradients", "bucket_layout", "join_process_groups", "leave_process_groups",
    "start_average",
]

log = logging.getLogger(__name__)

_USER_GLOO_IFNAME = os.environ.get("GLOO_SOCKET_IFNAME")  # as the node was started: never overridden
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


@dataclass(slots=True)
class ProcessGroups:
    """The groups one stage actor belongs to."""

    data: Any  # ProcessGroup of this stage's data-parallel replicas
    tensor: Any  # ProcessGroup of this stage's tensor-parallel shards
    data_size: int
    tensor_size: int
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)  # flat gradient buckets, by index


def join_process_groups(
    config: dict[str, Any], mesh: Mesh, rank: int, job: str, store: dist.Store, *, own_address: str = ""
) -> ProcessGroups:
    """Joins the job's process group and its subgroups; blocks until every member has.

    Args:
        config: ``{"rendezvous": [ADDRESS, ACTOR], "backend": "gloo" | "nccl",
            "timeout_s": float, "loopback": bool}``; ``loopback``: every member is on this
            machine, so gloo listens on the loopback interface only.
        store: the job's rendezvous (an :class:`actors.rendezvous.ActorStore`).
        own_address: this node's runtime address: without ``loopback``, gloo listens on
            the network interface that holds its IP address (the one the cluster reaches
            this node at) rather than wherever the hostname resolves to. A
            ``GLOO_SOCKET_IFNAME`` the node was started with always wins.

    Raises:
        RuntimeError: this process already belongs to another job's process group.
    """
    if dist.is_initialized():
        raise RuntimeError("this node already runs a stage of another distributed job; give each job its own nodes")
    if _USER_GLOO_IFNAME is None:
        interface = _loopback_interface() if config.get("loopback") else _interface_holding(own_address)
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
        else:  # gloo binds the address the hostname resolves to
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
    timeout = datetime.timedelta(seconds=float(config.get("timeout_s", 600)))
    dist.init_process_group(backend=config.get("backend", "gloo"), store=dist.PrefixStore(job, store),
                            rank=rank, world_size=mesh.size, timeout=timeout)
    mine = {}
    for kind, groups in (("tensor", mesh.tensor_groups()), ("data", mesh.data_groups())):
        for ranks in groups:
            group = dist.new_group(ranks)  # every rank creates every group, in order
            if rank in ranks:
                mine[kind] = group
    log.info("joined %s's process group as rank %d of %d", job, rank, mesh.size)
    return ProcessGroups(data=mine["data"], tensor=mine["tensor"], data_size=mesh.data, tensor_size=mesh.tensor)


def _loopback_interface() -> str | None:
    """The name of the loopback network interface ("lo" on Linux), if there is one."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n == "lo" or n.startswith("lo")), None)


def _interface_holding(address: str) -> str | None:
    """The network interface whose IPv4 address is the host of ``tcp://HOST:PORT[|KEY]``, if any."""
    scheme, _, rest = address.partition("|")[0].partition("://")
    host = rest.rpartition(":")[0]
    if scheme != "tcp" or not host:
        return None
    try:
        wanted = ipaddress.ip_address(host)
    except ValueError:
        return None
    if wanted.version != 4 or wanted.is_unspecified:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
        if socket.inet_ntoa(answer[20:24]) == str(wanted):
            return name
    return None


def leave_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def bucket_layout(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Which parameters (by index) share each flat gradient bucket.

    Parameters are packed in order into buckets of at most ``bucket_bytes``, one dtype
    a bucket; one parameter larger than that gets a bucket of its own. Every replica
    computes the same layout from the same parameters, so the buckets' collectives pair up.
    """
    buckets: list[list[int]] = []
    size = 0
    for index, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if buckets and (size + nbytes > bucket_bytes or p.dtype != params[buckets[-1][0]].dtype):
            buckets.append([])
            size = 0
        if not buckets:
            buckets.append([])
        buckets[-1].append(index)
        size += nbytes
    return buckets


def average_gradients(
    params: Sequence[torch.Tensor],
    groups: ProcessGroups,
    bucket_bytes: int,
    feedback: ErrorFeedback | None = None,
) -> int:
    """Averages gradients across the data-parallel group, a bucket per collective, after backward.

    The buckets are :func:`bucket_layout`'s, so that a model costs a handful of
    all-reduces rather than one per parameter; each is copied into a flat buffer,
    reduced, divided by the group's size and copied back. (``actors._overlap`` reduces
    the same buckets during backward instead, with the gradients living in them.)

    Args:
        feedback: a lossy codec with error feedback (one residual per bucket): each
            replica then sends its bucket encoded, gathers every replica's encoding and
            averages the decoded buckets, as ZeRO++'s quantized gradients do; every
            replica decodes the same bytes, so all still step identically.

    Returns:
        The bytes this replica contributed to the wire (the flat buckets' bytes when raw).
    """
    sent = 0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # every replica must take part in every bucket
    for index, members in enumerate(bucket_layout(params, bucket_bytes)):
        grads = [params[i].grad for i in members]
        sent += _reduce_bucket([g for g in grads if g is not None], groups, feedback, index)
    return sent


def start_average(flat: torch.Tensor, group: Any, world: int) -> Any:
    """Starts averaging ``flat`` in place over ``group`` of ``world`` members: a sum all-reduce, then,
    as soon as it completes (on the collective's thread), the division :func:`average_gradients`
    does. Returns a future; ``wait()`` returns once both are done."""
    def divide(done: Any) -> torch.Tensor:
        done.value()  # the all-reduce's error, if it failed, is the average's
        return flat.div_(world)

    return dist.all_reduce(flat, group=group, async_op=True).get_future().then(divide)


def _flat_buffer(groups: ProcessGroups, index: int, numel: int, like: torch.Tensor) -> torch.Tensor:
    """The bucket's flat buffer, kept across steps: a fresh tens-of-MB tensor each step
    costs page faults that take longer than the copy into it."""
    buffer = groups.buffers.get(index)
    if buffer is None or buffer.numel() != numel or buffer.dtype != like.dtype or buffer.device != like.device:
        buffer = groups.buffers[index] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer


def _reduce_bucket(grads: list[torch.Tensor], groups: ProcessGroups, feedback: ErrorFeedback | None,
                   index: int) -> int:
    flat = _flat_buffer(groups, index, sum(g.numel() for g in grads), grads[0])
    torch.cat([g.reshape(-1) for g in grads], out=flat)
    if feedback is None or not feedback.codec.lossy:
        dist.all_reduce(flat, group=groups.data)
        sent = flat.numel() * flat.element_size()
    else:
        encoded = feedback.encode(flat, stream=index)
        replicas = [[torch.empty_like(frame) for _ in range(groups.data_size)] for frame in encoded.frames]
        for gathered, frame in zip(replicas, encoded.frames):
            dist.all_gather(gathered, frame.contiguous(), group=groups.data)
        flat.zero_()
        for r in range(groups.data_size):
            frames = tuple(gathered[r] for gathered in replicas)
            flat += feedback.codec.decode(replace(encoded, frames=frames)).reshape(-1)
        sent = encoded.nbytes
    flat /= groups.data_size
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
    return sent
