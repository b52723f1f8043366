"""torch.distributed for a job's mesh: its backend, joining its groups, and data-parallel gradient averaging.

Every stage actor of a job joins one process group spanning the job's mesh, with the
job's rendezvous on the head (``stages.comm.rendezvous``), then builds every tensor- and data-parallel
subgroup, and with ``transport="dist"`` one two-rank group per direction between pipeline
neighbours, in the same order (as torch requires), and keeps its own.

The backend follows the devices (:func:`backend_for`): gloo when every stage actor is on a
CPU, ``cpu:gloo,cuda:nccl`` when every one is on a GPU (NCCL for CUDA tensors; gloo
for any CPU tensor a collective is handed), and a job that mixes the two is refused.
"""

from __future__ import annotations

import datetime
import fcntl
import functools
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from stages.comm.zero import GradientShards
from stages.mesh import Mesh
from stages.program import Placement, stage_to_rank
from transport.addresses import Address
from transport.codecs import Encoded, ErrorFeedback

__all__ = [
    "GLOO", "NCCL", "GroupJoinFailed", "ProcessGroups", "average_gradients", "backend_for", "bucket_layout", "join_process_groups",
    "leave_process_groups", "pipeline_pairs", "root_cause", "start_average",
]

log = logging.getLogger(__name__)



@functools.cache
def _user_interfaces() -> tuple[str | None, str | None]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` as this process was started, never as it
    overrode them: read at the first group's set-up, before anything here writes them (not at
    import, which may have been in the process a node was forked from: actors._forkserver)."""
    return os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")

GLOO = "gloo"
# torch dispatches each collective by its tensors' device: NCCL for CUDA tensors, and gloo for
# a CPU tensor, which a pure NCCL group would refuse ("no backend for device type cpu").
NCCL = "cpu:gloo,cuda:nccl"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


@dataclass(slots=True)
class ProcessGroups:
    """The groups one stage actor belongs to."""

    data: Any  # ProcessGroup of this stage's data-parallel replicas
    tensor: Any  # ProcessGroup of this stage's tensor-parallel shards
    data_size: int
    tensor_size: int
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)  # flat gradient buckets, by index
    # (sender, receiver) global ranks -> the two-rank group that carries that direction's
    # point-to-point tensors (transport="dist"); only the pairs this rank is in.
    pairs: dict[tuple[int, int], Any] = field(default_factory=dict)


def backend_for(nodes: Sequence[Mapping[str, Any]]) -> str:
    """The torch.distributed backend for a job whose stage actors run on ``nodes``, in rank order.

    Args:
        nodes: the head's node records (``device``, and ``host`` to tell machines apart).

    Returns:
        :data:`GLOO` when every node computes on a CPU, :data:`NCCL` when every one has a GPU.

    Raises:
        ValueError: some nodes are on CPUs and some on GPUs (a collective's members must
            agree on its backend, and gloo moves no CUDA tensor point to point); or two of
            the job's ranks would share one GPU, which NCCL refuses.
    """
    devices = [str(n.get("device", "cpu")) or "cpu" for n in nodes]
    kinds = {d.partition(":")[0] for d in devices}
    if kinds <= {"cpu"}:
        return GLOO
    if kinds != {"cuda"}:
        shown = ", ".join(f"rank {r}: {d}" for r, d in enumerate(devices))
        raise ValueError(
            f"this job's stage actors would run on {shown}; collectives and transport='dist' need every stage "
            "actor on a GPU (NCCL) or every one on a CPU (gloo): place the job on nodes of one kind "
            "(LocalCluster(devices=...) or --device), or, for a pipeline alone, use transport='zmq'")
    owner: dict[tuple[str, str], int] = {}
    for rank, (node, device) in enumerate(zip(nodes, devices)):
        where = (str(node.get("host", "")), device)
        if where in owner:
            raise ValueError(
                f"ranks {owner[where]} and {rank} of this job would both use {device} on "
                f"{where[0] or 'one machine'}; NCCL needs a GPU per rank: start one node per GPU "
                "(LocalCluster(devices='auto') or python -m actors.node --device cuda:K), or, for a pipeline "
                "alone, use transport='zmq'")
        owner[where] = rank
    return NCCL


def pipeline_pairs(mesh: Mesh, num_stages: int, placement: Placement = "loop") -> list[tuple[int, int]]:
    """Every (sender, receiver) pair of global ranks that pipeline tensors travel between, in a fixed order.

    Each pair gets a two-rank group of its own, one per direction: NCCL runs a
    communicator's operations one after another on one stream, so a rank sending its
    activation while its neighbour sends a gradient back on the same communicator
    would each wait for a receive queued behind the other's send. With a group per
    direction, a communicator only ever carries sends one way, matched in the order
    they were posted.

    Args:
        num_stages: the model's stages (more than ``mesh.pipeline`` with interleaving, where
            the last rank also sends to the first).
        placement: how those stages sit on the ranks (in a V, neighbours in the middle share a rank).
    """
    pairs: list[tuple[int, int]] = []
    for data in range(mesh.data):
        for tensor in range(mesh.tensor):
            ranks = mesh.pipeline_ranks(data, tensor)
            for stage in range(num_stages - 1):
                a, b = (ranks[stage_to_rank(s, mesh.pipeline, placement)] for s in (stage, stage + 1))
                for pair in ((a, b), (b, a)):
                    if a != b and pair not in pairs:
                        pairs.append(pair)
    return pairs

class GroupJoinFailed(RuntimeError):
    """A stage could not join its job's process groups.

    Its usual cause is another rank of the same job: one that joined, failed to build (a
    refused factory, a tensor-parallel split that would untie a parameter) and left the
    groups while this rank was still connecting to it. :func:`root_cause` reports that
    rank's failure rather than this one.
    """


def root_cause(failures: list[BaseException]) -> BaseException:
    """The failure to report when several ranks of one job failed to start: the first that is not
    a :class:`GroupJoinFailed` (a rank's own or one that came back over the wire), else the first."""
    joined = f"{GroupJoinFailed.__module__}.{GroupJoinFailed.__qualname__}"
    return next((f for f in failures if not isinstance(f, GroupJoinFailed)
                 and getattr(f, "remote_type", None) != joined), failures[0])


def join_process_groups(
    config: dict[str, Any], mesh: Mesh, rank: int, job: str, store: dist.Store, *, own_address: str = "",
    pairs: Sequence[tuple[int, int]] = (), device: torch.device | None = None,
) -> ProcessGroups:
    """Joins the job's process group and its subgroups; blocks until every member has.

    Args:
        config: ``{"rendezvous": [ADDRESS, ACTOR], "backend": GLOO | NCCL,
            "timeout_s": float, "loopback": bool}`` (see :func:`backend_for`); ``loopback``:
            every member is on this machine, so gloo (and NCCL's bootstrap) listen on the
            loopback interface only.
        store: the job's rendezvous (an :class:`stages.comm.rendezvous.ActorStore`).
        own_address: this node's runtime address: without ``loopback``, gloo listens on
            the network interface that holds its IP address (the one the cluster reaches
            this node at) rather than wherever the hostname resolves to. A
            ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME``) the node was started with always wins.
        pairs: :func:`pipeline_pairs` when stages send tensors over torch.distributed: a
            two-rank group is built for each, and this rank keeps those it is in.
        device: the stage's device; a CUDA one becomes this thread's current device
            first, as NCCL requires (its communicators bind to the current device).

    Raises:
        RuntimeError: this process already belongs to another job's process group.
        GroupJoinFailed: joining failed (a member that left, the store, a timeout); this process is
            left in no group.
    """
    if dist.is_initialized():
        raise RuntimeError("this node already runs a stage of another distributed job; give each job its own nodes")
    backend = str(config.get("backend", GLOO))
    interface = _loopback_interface() if config.get("loopback") else _interface_holding(own_address)
    user_gloo, user_nccl = _user_interfaces()
    for variable, user_set, used in (("GLOO_SOCKET_IFNAME", user_gloo, True),
                                     ("NCCL_SOCKET_IFNAME", user_nccl, "nccl" in backend)):
        if user_set is not None or not used:
            continue
        if interface is not None:
            os.environ[variable] = interface
        else:  # gloo binds the address the hostname resolves to; NCCL picks an interface itself
            os.environ.pop(variable, None)
    try:
        return _join(config, mesh, rank, job, store, pairs, device, backend)
    except Exception as exc:
        leave_process_groups()  # joined the default group and failed in a subgroup: this node serves the next job
        cause = "a rank that failed to build and left them is the usual cause"
        if not config.get("loopback") and any(host in str(exc) for host in ("[127.0.0.1]", "[::1]")):
            variable = "NCCL_SOCKET_IFNAME" if "nccl" in backend else "GLOO_SOCKET_IFNAME"
            cause = (f"{backend} reached for a loopback address, and the job's members are on several machines: "
                     f"{variable} (here {os.environ.get(variable, 'unset')}; a node's own setting wins) names the "
                     "network interface they reach each other on")
        raise GroupJoinFailed(f"rank {rank} of job {job} could not join its process groups ({cause}): {exc}") from exc


def _join(config: Mapping[str, Any], mesh: Mesh, rank: int, job: str, store: dist.Store,
          pairs: Sequence[tuple[int, int]], device: torch.device | None, backend: str) -> ProcessGroups:
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=float(config.get("timeout_s", 600)))
    dist.init_process_group(backend=backend, store=dist.PrefixStore(job, store),
                            rank=rank, world_size=mesh.size, timeout=timeout)
    mine: dict[str, Any] = {}
    for kind, groups in (("tensor", mesh.tensor_groups()), ("data", mesh.data_groups())):
        for ranks in groups:
            group = dist.new_group(ranks)  # every rank creates every group, in order
            if rank in ranks:
                mine[kind] = group
    own_pairs = {}
    for pair in pairs:
        group = dist.new_group(list(pair))  # likewise
        if rank in pair:
            own_pairs[pair] = group
    _connect_pairs(pairs, own_pairs, rank, device if device is not None else torch.device("cpu"))
    log.info("joined %s's process group (%s) as rank %d of %d", job, backend, rank, mesh.size)
    return ProcessGroups(data=mine["data"], tensor=mine["tensor"], data_size=mesh.data, tensor_size=mesh.tensor,
                         pairs=own_pairs)


def _connect_pairs(pairs: Sequence[tuple[int, int]], own: Mapping[tuple[int, int], Any], rank: int,
                   device: torch.device) -> None:
    """One byte over each of this rank's pair groups, in ``pairs``' order, now.

    NCCL creates a group's communicator at its first operation, and blocks until both
    ranks are creating it, talking through the rendezvous store: left to the first
    activation, that would block the event loop that posts transfers, which is the
    thread the store's calls need. Every rank takes its pairs in the same global order,
    so the earliest pair not yet connected always has both its ranks at it. The byte
    goes by ``batch_isend_irecv``, as every transfer after it: NCCL keys a batched
    transfer's communicator apart from a lone ``isend``'s, and it is that one that must exist.
    """
    for pair in pairs:
        if rank not in pair:
            continue
        sender, receiver = pair
        byte = torch.zeros(1, dtype=torch.uint8, device=device)
        op = dist.P2POp(dist.isend, byte, receiver, group=own[pair]) if rank == sender \
            else dist.P2POp(dist.irecv, byte, sender, group=own[pair])
        for work in dist.batch_isend_irecv([op]):
            work.wait()


def _loopback_interface() -> str | None:
    """The name of the loopback network interface ("lo" on Linux), if there is one."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n == "lo" or n.startswith("lo")), None)


def _interface_holding(address: str) -> str | None:
    """The network interface whose address is the host of ``tcp://HOST:PORT[|KEY]`` (IPv4, or IPv6 in
    brackets), if any."""
    where = Address.parse(address.partition("|")[0])
    if not where.is_tcp or not where.host:
        return None
    try:
        wanted = ipaddress.ip_address(where.bare_host)
    except ValueError:
        return None
    if wanted.is_unspecified:
        return None
    if wanted.version == 6:
        return _interface_holding_v6(wanted)
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
        if socket.inet_ntoa(answer[20:24]) == str(wanted):
            return name
    return None


def _interface_holding_v6(wanted: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """The interface that holds IPv6 address ``wanted``, from Linux's ``/proc/net/if_inet6`` (one line
    an address: its 32 hex digits, index, prefix, scope, flags, interface)."""
    try:
        with open("/proc/net/if_inet6") as table:
            lines = table.read().splitlines()
    except OSError:  # not Linux, or no IPv6
        return None
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and fields[0] == wanted.packed.hex():
            return fields[5]
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
    shards: GradientShards | None = None,
) -> int:
    """Averages gradients across the data-parallel group, a bucket per collective, after backward.

    The buckets are :func:`bucket_layout`'s, so that a model costs a handful of
    all-reduces rather than one per parameter; each is copied into a flat buffer,
    reduced, divided by the group's size and copied back. (``stages.comm.overlap`` reduces
    the same buckets during backward instead, with the gradients living in them.)

    Args:
        feedback: a lossy codec with error feedback (one residual per bucket): each
            replica then sends its bucket encoded, gathers every replica's encoding and
            averages the decoded buckets, as ZeRO++'s quantized gradients do; every
            replica decodes the same bytes, so all still step identically.

        shards: ZeRO's plan (exact reductions only): each bucket is reduce-scattered, and
            a replica keeps only the gradients of its own run; the others become None.

    Returns:
        The bytes this replica contributed to the wire (the flat buckets' bytes when raw).
    """
    sent = 0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # every replica must take part in every bucket
    layout = bucket_layout(params, bucket_bytes) if shards is None else shards.layout
    for index, members in enumerate(layout):
        grads = [g for g in (params[i].grad for i in members) if g is not None]
        ranges = shards.ranges[index] if shards is not None else None
        if ranges is None:
            sent += _reduce_bucket(grads, groups, feedback, index)
            continue
        flat = _flat_buffer(groups, index, sum(g.numel() for g in grads), grads[0])
        torch.cat([g.reshape(-1) for g in grads], out=flat)
        if feedback is not None and feedback.codec.lossy:
            sent += _scatter_encoded(flat, ranges, groups, feedback, index)
        else:
            start_reduce_scatter(flat, ranges, dist.get_rank(groups.data), groups.data, groups.data_size).wait()
            sent += flat.numel() * flat.element_size()
        _copy_out(flat, grads)
    if shards is not None:
        for p, kept in zip(params, shards.owned(dist.get_rank(groups.data), params)):
            if not kept:
                p.grad = None  # another replica's to step: its average is there, not here
    return sent


def start_reduce_scatter(flat: torch.Tensor, ranges: Sequence[tuple[int, int]], rank: int, group: Any,
                         world: int) -> Any:
    """Starts averaging ``flat`` over ``group`` into this member's range only: a sum reduce-scatter of
    the replicas' ``ranges`` (``ranges[rank]`` is this member's ``[start, end)``), then the division
    :func:`start_average` does, in place in ``flat``'s range. The rest of ``flat`` keeps this
    member's own values. Returns a future; ``wait()`` returns once both are done."""
    start, end = ranges[rank]
    mine = flat.new_empty(end - start)
    parts = [flat[a:b] for a, b in ranges]
    return _Placed(dist.reduce_scatter(mine, parts, group=group, async_op=True), flat[start:end], mine, world)


def _scatter_encoded(flat: torch.Tensor, ranges: Sequence[tuple[int, int]], groups: ProcessGroups,
                     feedback: ErrorFeedback, index: int) -> int:
    """A reduce-scatter of ``flat`` with a lossy codec, as ZeRO++'s quantized gradients: each replica
    encodes each other replica's range (with error feedback, a residual per bucket and range)
    and sends it there alone; each sums the decoded ranges it got with its own, unencoded,
    and divides. Returns the bytes this replica sent: about (replicas - 1) / replicas of the
    encoded bucket, where the lossy all-reduce gathers every replica's whole bucket."""
    me, world = dist.get_rank(groups.data), groups.data_size
    peers = dist.get_process_group_ranks(groups.data)
    start, end = ranges[me]
    codec = feedback.codec
    ops, incoming, sent = [], [], 0
    for r, (a, b) in enumerate(ranges):
        if r == me:
            continue
        if b > a:  # my contribution to replica r's range
            encoded = feedback.encode(flat[a:b], stream=(index, r))
            sent += encoded.nbytes
            ops += [dist.P2POp(dist.isend, frame.contiguous(), peers[r], groups.data) for frame in encoded.frames]
        if end > start:  # replica r's contribution to mine
            sizes = codec.frame_sizes(flat.dtype, (end - start,), _codec_params(codec))
            frames = tuple(torch.empty(n, dtype=torch.uint8, device=flat.device) for n in sizes)
            incoming.append(frames)
            ops += [dist.P2POp(dist.irecv, frame, peers[r], groups.data) for frame in frames]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    if end > start:
        mine = flat[start:end]
        total = mine.to(torch.float32)
        for frames in incoming:
            encoded = Encoded(codec=codec.name, dtype=flat.dtype, shape=(end - start,),
                              params=_codec_params(codec), frames=frames)
            total = total + codec.decode(encoded).reshape(-1).to(device=flat.device, dtype=torch.float32)
        mine.copy_(total / world)
    return sent


def _codec_params(codec: Any) -> dict[str, int | float | str]:
    """The params a codec encodes with (its block size, for the block codecs)."""
    return {"block": codec.block} if hasattr(codec, "block") else {}


class _Placed:
    """A reduce-scatter in flight; :meth:`wait` then puts this member's average in place. (gloo's
    reduce-scatter of uneven parts has no future to chain the division to.)"""

    def __init__(self, work: Any, target: torch.Tensor, mine: torch.Tensor, world: int) -> None:
        self._work, self._target, self._mine, self._world = work, target, mine, world

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._target.copy_(self._mine).div_(self._world)


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
            # A codec may hand its frames back on the CPU (the wire's side): the sum stays on the device.
            flat += feedback.codec.decode(replace(encoded, frames=frames)).reshape(-1).to(flat.device)
        sent = encoded.nbytes
    flat /= groups.data_size
    _copy_out(flat, grads)
    return sent


def _copy_out(flat: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
