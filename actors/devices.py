"""Which device each node of a ``LocalCluster`` computes on.

``node_devices`` is pure (the visible GPU count is an argument), so every rule below is
tested against fake counts on a machine without a GPU; counting GPUs and pinning a
process to one are the compute plugin's (:mod:`stages.devices`), since the runtime
imports no torch.

The rules, for ``LocalCluster(nodes=..., spares=..., devices=...)``:

- ``"cpu"``: ``nodes`` CPU nodes (2 when not given), as before GPUs existed.
- ``"auto"`` (the default): one node per visible GPU, ``cuda:0`` ... ``cuda:N-1``; with
  ``nodes=K`` the first K GPUs, and with more nodes than GPUs the nodes take the GPUs
  in turn (``cuda:0, cuda:1, cuda:0, ...``) so that code written as
  ``LocalCluster(nodes=4)`` still runs on a one-GPU machine; the scheduler then warns
  about each job whose stage actors share a GPU. Without a GPU: ``nodes`` CPU nodes.
- a list: one node per entry, each ``"cpu"`` or ``"cuda:K"`` with K below the visible
  count. Naming a GPU twice is allowed and is how sharing is asked for deliberately
  (e.g. a 2-stage job on a one-GPU machine: ``["cuda:0", "cuda:0"]``). A ``nodes=``
  given as well must equal the list's length.
- spares take devices after the nodes', continuing the same turn: ``"auto"`` with 4
  GPUs, ``nodes=2, spares=1`` puts ``spare0`` on ``cuda:2``; a list is cycled from its
  start (``spare0`` on the first entry's device), so a spare can stand in for a node.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Literal

__all__ = ["DEFAULT_CPU_NODES", "DeviceSpec", "check_device", "cuda_index", "device_argument", "node_devices",
           "visible_gpu_count"]

DeviceSpec = Literal["auto", "cpu"] | Sequence[str]

DEFAULT_CPU_NODES = 2  # LocalCluster's node count on CPU when ``nodes`` is not given

_CUDA = re.compile(r"cuda:(0|[1-9][0-9]{0,3})")
_ACCEPTED = "'cpu' or 'cuda:K' (K a visible GPU's index)"


def cuda_index(device: str) -> int | None:
    """K for ``"cuda:K"``; None for ``"cpu"``.

    Raises:
        ValueError: anything else (the message says what is accepted).
    """
    if device == "cpu":
        return None
    match = _CUDA.fullmatch(device)
    if match is None:
        hint = "; name the GPU, e.g. 'cuda:0'" if device == "cuda" else ""
        raise ValueError(f"unknown device {device!r:.40}: a node's device is {_ACCEPTED}{hint}")
    return int(match.group(1))


def check_device(device: str, num_gpus: int) -> str:
    """``device`` if a node can compute on it where ``num_gpus`` GPUs are visible.

    Raises:
        ValueError: not ``cpu`` or ``cuda:K``, or no GPU K here (the message says which exist).
    """
    index = cuda_index(device)
    if index is not None and index >= num_gpus:
        seen = f"{num_gpus} GPU{'s' if num_gpus != 1 else ''} (cuda:0..cuda:{num_gpus - 1})" if num_gpus else "no GPU"
        if not num_gpus and _gpu_counter() is None:
            seen += (" (nothing here counts GPUs: the installed actorpipe distribution's 'devices' entry point is "
                     "missing, as when the code runs from a checkout on PYTHONPATH; pip install the project)")
        raise ValueError(f"device {device!r} does not exist: this process sees {seen}; use devices='auto' "
                         "for one node per visible GPU, 'cpu', or check CUDA_VISIBLE_DEVICES and the driver")
    return device


def rank_device(local_rank: int | None, num_gpus: int) -> str:
    """``--device auto``: the GPU of this rank on its machine (``cuda:LOCAL_RANK`` of a launcher that starts
    one process per GPU, modulo the GPUs this process sees; cuda:0 for a process alone on its machine, as a
    Kubernetes pod is), or the CPU where no GPU is visible."""
    if not num_gpus:
        return "cpu"
    return f"cuda:{(local_rank or 0) % num_gpus}"


def node_devices(devices: DeviceSpec, nodes: int | None, spares: int, num_gpus: int) -> list[str]:
    """Each node's device, nodes first then spares, by the rules in this module's docstring.

    Args:
        devices: ``"auto"``, ``"cpu"`` or one device per node.
        nodes: the node count asked for; None: as ``devices`` implies.
        spares: how many spare nodes follow.
        num_gpus: how many GPUs this process sees (``visible_gpu_count()``).

    Raises:
        ValueError: an unknown ``devices`` word or entry, a GPU that is not visible, an
            empty list, or a ``nodes`` that disagrees with the list.
    """
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 0):
        raise ValueError(f"nodes must be an int >= 0, got {nodes!r:.40}")
    if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
        raise ValueError(f"spares must be an int >= 0, got {spares!r:.40}")
    if isinstance(devices, str):
        if devices == "cpu" or (devices == "auto" and num_gpus == 0):
            count = DEFAULT_CPU_NODES if nodes is None else nodes
            return ["cpu"] * (count + spares)
        if devices != "auto":
            raise ValueError(f"devices={devices!r:.40} is not understood: give 'auto' (one node per visible GPU, "
                             f"or CPU nodes without one), 'cpu', or a list of {_ACCEPTED}")
        count = num_gpus if nodes is None else nodes
        return [f"cuda:{i % num_gpus}" for i in range(count + spares)]
    listed = [d if isinstance(d, str) else str(d) for d in devices]  # a torch.device reads as its name
    if not listed:
        raise ValueError("devices=[] names no device: give one entry per node, 'auto' or 'cpu'")
    for device in listed:
        check_device(device, num_gpus)
    if nodes is not None and nodes != len(listed):
        raise ValueError(f"nodes={nodes} disagrees with devices, which names {len(listed)} "
                         f"({', '.join(listed)}): one node per entry; drop nodes= or make them agree")
    return listed + [listed[i % len(listed)] for i in range(spares)]


def device_argument(text: str) -> str:
    """``--device`` of ``python -m actors.node``: a GPU this machine lacks fails at parse time, before
    anything starts, with the GPUs it has; ``auto`` is resolved once the node knows its rank
    (:func:`rank_device`).

    Raises:
        argparse.ArgumentTypeError: as :func:`check_device`'s ValueError.
    """
    import argparse

    if text == "auto":
        return text
    try:
        return check_device(text, visible_gpu_count() if text != "cpu" else 0)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _gpu_counter() -> Callable[[], int] | None:
    """The installed compute plugin's ``visible_gpu_count``, or None where no plugin is installed."""
    from actors.plugins import load_plugin

    return getattr(load_plugin("devices"), "visible_gpu_count", None)


def visible_gpu_count() -> int:
    """How many CUDA devices this process sees (0 without CUDA), as the installed compute plugin counts them.

    The runtime imports no torch: the plugin (``devices`` in the ``actorpipe`` entry
    points; :mod:`stages.devices`) answers. Without one, no GPU is known.
    """
    count = _gpu_counter()
    return int(count()) if count is not None else 0
