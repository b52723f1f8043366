"""A stage's torch.distributed membership: its process groups and its point-to-point link.

The groups are joined on the stage's compute thread (a GPU link waits on its stream)
through a rendezvous actor, formed again when a lost replica is replaced
(:meth:`StageGroups.rejoin`), and left when the stage stops. Other parts read the
data-parallel group through :meth:`StageGroups.data_group`, never a copy of it: a
rejoin replaces it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from stages.comm.p2p import DistLink, open_link
from stages.comm.parallel import ProcessGroups, join_process_groups, leave_process_groups, pipeline_pairs
from stages.mesh import Mesh
from stages.records import StageConfig

__all__ = ["StageGroups"]

log = logging.getLogger(__name__)


class StageGroups:
    """The process groups one stage actor belongs to (none without ``config.dist``), and its link.

    Args:
        config: the stage's config; ``dist`` names the rendezvous and the backend.
        own_address: this node's address, which the rendezvous records.
        device: the stage's device (the link allocates its receive buffers there).
    """

    def __init__(self, config: StageConfig, own_address: str, device: torch.device) -> None:
        self.config = config
        self.mesh = config.mesh
        self.own_address = own_address
        self.device = device
        self.groups: ProcessGroups | None = None
        self.link: DistLink | None = None  # transport="dist" only

    @property
    def data_size(self) -> int:
        """Data-parallel replicas this stage averages with (1 without groups)."""
        return self.groups.data_size if self.groups is not None else 1

    def data_group(self) -> Any:
        """The data-parallel process group as it is now (a rejoin forms it again)."""
        assert self.groups is not None
        return self.groups.data

    def join(self, dist_config: dict[str, Any], store: dist.Store) -> ProcessGroups:
        """Joins the job's groups (blocks until every member has); opens the link with transport="dist".

        Call on the compute thread.
        """
        cfg = self.config
        self.groups = join_process_groups(dist_config, self.mesh, cfg.global_rank, cfg.job, store,
                                          own_address=self.own_address, pairs=self._pairs(), device=self.device)
        if cfg.communication.transport == "dist" and self.link is None:
            self.link = open_link(self.device, self.groups.pairs, cfg.global_rank)
        return self.groups

    def check_rejoin(self) -> None:
        """Raises ValueError unless this stage's groups can form again: a job with groups, not tensor-parallel
        (its layers hold their groups)."""
        if self.config.dist is None or self.mesh.tensor > 1:
            raise ValueError("only a data-parallel job's groups form again (tensor-parallel layers hold theirs)")

    def rejoin(self, dist_config: dict[str, Any], store: dist.Store,
               forget: Callable[[], None] | None = None) -> ProcessGroups:
        """Leaves the groups and joins them again through a new rendezvous (a lost member was replaced).

        Call on the compute thread. ``forget`` runs first, once the old groups are dropped: the
        overlapped reduction's collectives end with them. Then, on the event loop's thread,
        :meth:`rebind_link`.

        Raises:
            ValueError: see :meth:`check_rejoin`; nothing changed.
        """
        self.check_rejoin()
        self.groups = None
        if forget is not None:
            forget()
        leave_process_groups()
        groups = self.join(dist_config, store)
        self.config = dataclasses.replace(self.config, dist=dict(dist_config))
        return groups

    def rebind_link(self) -> None:
        """Points the link (if any) at the groups formed again; on the event loop's thread, which uses it."""
        if self.link is not None and self.groups is not None:
            self.link.rebind(self.groups.pairs)

    def _pairs(self) -> list[tuple[int, int]]:
        """The pipeline neighbours' two-rank groups every member builds: with transport="dist" only."""
        cfg = self.config
        return pipeline_pairs(self.mesh, cfg.num_stages, cfg.parallelism.placement) if cfg.communication.transport == "dist" else []

    def close(self) -> None:
        """Closes the link and drops the groups (after :func:`leave_process_groups` on the compute thread)."""
        if self.link is not None:
            self.link.close()
        self.link = None
        # A gloo group's threads and listening sockets live as long as its Python object.
        self.groups = None
