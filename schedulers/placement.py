"""Which nodes a job's stage actors go to: one per node, free nodes first, one per GPU where possible.

Pure (node records in, node records out), so that every rule is tested with made-up
node lists and no process. A node is what the head lists (:class:`~actors.NodeInfo`:
``name``, ``device``, ``host``, …). Two nodes share a GPU when they name the same
``cuda:K`` on the same host.

The rules, in order of preference for each pick: a node whose GPU holds no stage
actor yet, of this job or another (a CPU node counts as such: CPU nodes never
"share a GPU"); then a node no other job uses; then by name. So a GPU sits idle
only when every alternative is already on a distinct GPU or a CPU, and a job shares
a GPU only when every GPU of the cluster already holds a stage actor. That case is
reported in :attr:`Placement.notices` (the scheduler logs them and the driver
warns with :class:`PlacementWarning`), except where it cannot work: two ranks of one
job on one GPU when the job needs an NCCL communicator, which NCCL refuses
("Duplicate GPU detected"); that is a ValueError that says what to do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from actors import NodeInfo

__all__ = ["Placement", "PlacementWarning", "choose_nodes", "gpu_of"]

_REMEDY = ("start one node per GPU (LocalCluster(devices='auto'), or python -m actors.node --device cuda:K on each "
           "GPU), or run fewer stage actors at once")


class PlacementWarning(UserWarning):
    """A job's stage actors share a GPU (with each other or another job's) because every GPU is
    taken, or mix CPU and GPU nodes.

    Either way a step is slower than with a GPU each: sharers contend for the GPU's
    memory and compute, and a CPU stage sets the pace of a GPU pipeline.
    Sharing on purpose (``LocalCluster(devices=["cuda:0", "cuda:0"])`` on a one-GPU
    machine) can silence it: ``warnings.simplefilter("ignore", PlacementWarning)``.
    """


class Placement(NamedTuple):
    """The chosen nodes, by global rank, and what the driver should hear about them."""

    nodes: list[NodeInfo]
    notices: list[str]


def gpu_of(node: NodeInfo) -> tuple[str, str] | None:
    """``(host, "cuda:K")`` for a GPU node, None for a CPU one."""
    return (node.host, node.device) if node.device.startswith("cuda") else None


def choose_nodes(
    alive: Sequence[NodeInfo], busy: Mapping[str, str], count: int, *, exclusive_gpus: bool = False,
) -> Placement:
    """``count`` of the ``alive`` nodes for a job's stage actors, by the rules in the module docstring.

    Args:
        alive: the nodes that may host a stage actor (their ``state`` is not checked).
        busy: node name -> a job that already has a stage actor there.
        count: how many stage actors the job has (one per node).
        exclusive_gpus: the job needs a communicator among its ranks (NCCL): two of its
            ranks on one GPU is refused, not warned about.

    Raises:
        ValueError: fewer nodes than ``count``; or ``exclusive_gpus`` and fewer distinct
            GPUs than the job's GPU ranks.
    """
    if len(alive) < count:
        raise ValueError(f"this job needs {count} nodes (one stage actor each) but the cluster has {len(alive)} "
                         "alive; start more nodes or shrink the mesh")
    others: dict[tuple[str, str], str] = {}  # a GPU -> a job that already computes on it
    for node in alive:
        gpu = gpu_of(node)
        if gpu is not None and node.name in busy:
            others.setdefault(gpu, busy[node.name])
    remaining = sorted(alive, key=lambda n: n.name)
    chosen: list[NodeInfo] = []
    notices: list[str] = []
    for _ in range(count):
        pick = min(remaining, key=lambda n: (_taken(n, others, chosen), n.name in busy, n.name))
        remaining.remove(pick)
        if _taken(pick, others, chosen):
            notices.append(_shared(pick, others, chosen, exclusive_gpus))
        chosen.append(pick)
    if len({gpu_of(n) is None for n in chosen}) > 1:
        notices.append(f"the job's stage actors mix CPU and GPU nodes ({', '.join(_where(n) for n in chosen)}): "
                       "the CPU stages set the pace; start GPU nodes only, or place the job on CPU nodes")
    return Placement(chosen, notices)


def _taken(node: NodeInfo, others: Mapping[tuple[str, str], str], chosen: Sequence[NodeInfo]) -> bool:
    """Whether ``node`` is on a GPU that another job, or a node already chosen, computes on."""
    gpu = gpu_of(node)
    return gpu is not None and (gpu in others or any(gpu_of(n) == gpu for n in chosen))


def _shared(node: NodeInfo, others: Mapping[tuple[str, str], str], chosen: Sequence[NodeInfo],
            exclusive: bool) -> str:
    """The notice for ``node``, whose GPU is taken; raises where NCCL would refuse the sharing."""
    gpu = gpu_of(node)
    assert gpu is not None, "only a GPU node is taken"
    mates = [n.name for n in chosen if gpu_of(n) == gpu]
    if mates and exclusive:
        raise ValueError(f"this job needs a GPU per rank for its NCCL communicator, but node {node.name} would "
                         f"share {_where(node)} with its {', '.join(mates)} (every other GPU is taken), which NCCL "
                         f"refuses; {_REMEDY}, or use transport='zmq' with tensor_parallel=1 and data_parallel=1")
    who = [f"this job's {', '.join(mates)}"] if mates else []
    if gpu in others:
        who.append(f"a stage actor of {others[gpu]}")
    return (f"node {node.name} shares {_where(node)} with {' and '.join(who)}: every GPU of the cluster already "
            f"holds a stage actor, so they contend for its memory and compute; {_REMEDY}")


def _where(node: NodeInfo) -> str:
    return f"{node.device} on {node.host}" if node.host else node.device
