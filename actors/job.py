"""The driver's handle on a training job: ``job = await cluster.train(...)``."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from actors._ref import ActorRef

if TYPE_CHECKING:
    from actors.cluster import Cluster

__all__ = ["Job", "StepStats"]

_CHECKPOINT_FILE = "model.pt"
_META_FILE = "job.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class StepStats:
    """What one optimizer step did.

    Attributes:
        step: the step's index within the job (from 0).
        loss: the global batch's mean loss, as one process would compute it.
        step_time_s: wall time from sending the programs to the optimizer step done.
        bubble_fraction: the share of stage time spent idle, from the stages' own timings.
        bytes_sent: bytes that crossed between stages (activations and gradients).
        bytes_per_edge: the same per edge and direction, e.g. ``{"F 0->1": n, "B 1->0": n}``.
        peak_stash: per rank, the most micro-batch activations held at once.
        peak_rss_bytes: per rank, the stage process's peak resident memory.
        busy_s: per rank, seconds spent computing.
        codec_stats: per edge and direction (``"F 0->1"``, ``"B 1->0"``): the codec,
            ``bytes`` on the wire, ``raw_bytes`` (the tensors' own size), their
            ``ratio``, and ``rel_error``, the norm of (decoded - sent) over the norm
            of what was sent (0 for ``none``).
        reduce_bytes: bytes all replicas put on the wire for the data-parallel
            gradient reduction (encoded bytes with a lossy ``reduce_codec``).
    """

    step: int
    loss: float
    step_time_s: float
    bubble_fraction: float
    bytes_sent: int
    bytes_per_edge: dict[str, int] = field(default_factory=dict)
    peak_stash: list[int] = field(default_factory=list)
    peak_rss_bytes: list[int] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    codec_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    reduce_bytes: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepStats:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class Job:
    """A job running on a cluster; every method is a call to the head's scheduler actor."""

    def __init__(self, cluster: Cluster, scheduler: ActorRef, info: dict[str, Any], spec: dict[str, Any]) -> None:
        self.cluster = cluster
        self.id: str = info["job"]
        self.bounds: list[list[int]] = info["bounds"]
        self.nodes: list[str] = info["nodes"]
        self.spec = spec
        self._scheduler = scheduler

    async def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> StepStats:
        """One optimizer step on a global batch, split into the job's micro-batches.

        Without arguments the stages read the batch from the job's data factory.

        Raises:
            StepFailed: a stage failed, a node was lost or the step timed out; the
                step was not applied anywhere.
            RemoteError: a batch that does not split into the job's micro-batches.
        """
        timeout = float(self.spec.get("step_timeout_s", 600.0)) + 60.0
        return StepStats.from_dict(await self._scheduler.ask("step", self.id, inputs, targets, timeout=timeout))

    async def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state, with the unpartitioned model's keys."""
        state: dict[str, torch.Tensor] = await self._scheduler.ask("state_dict", self.id, timeout=600)
        return state

    async def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads a whole-model state (as :meth:`state_dict` returns) into the stages."""
        await self._scheduler.ask("load_state_dict", self.id, {k: v.detach().cpu() for k, v in state.items()},
                                  timeout=600)

    async def save(self, directory: str | os.PathLike[str]) -> None:
        """Writes the model's state to ``directory`` atomically: it appears whole or not at all."""
        state = await self.state_dict()
        target = os.fspath(directory)
        parent = os.path.dirname(os.path.abspath(target))
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".checkpoint-", dir=parent)
        try:
            torch.save(state, os.path.join(staging, _CHECKPOINT_FILE))
            with open(os.path.join(staging, _META_FILE), "w") as f:
                json.dump({"job": self.id, "spec": self.spec, "bounds": self.bounds}, f, indent=1, default=str)
            if os.path.exists(target):
                old = tempfile.mkdtemp(prefix=".old-checkpoint-", dir=parent)
                os.replace(target, os.path.join(old, "x"))
                os.replace(staging, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    async def load(self, directory: str | os.PathLike[str]) -> None:
        """Loads a checkpoint written by :meth:`save` (tensors only; nothing is unpickled)."""
        state = torch.load(os.path.join(os.fspath(directory), _CHECKPOINT_FILE), weights_only=True)
        await self.load_state_dict(state)

    async def trace(self, path: str | os.PathLike[str]) -> None:
        """Writes the last step's measured timeline as Chrome/Perfetto trace JSON (on the head's clock)."""
        trace = await self._scheduler.ask("trace", self.id, timeout=60)
        with open(path, "w") as f:
            json.dump(trace, f)

    async def close(self) -> None:
        """Stops the job's stage actors."""
        await self._scheduler.ask("close_job", self.id, timeout=60)

    async def __aenter__(self) -> Job:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
