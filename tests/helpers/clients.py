"""A LocalCluster shared by two client keys, alice and bob: for tests of what one client may do to another."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from actors import Cluster, LocalCluster


class TwoClients:
    """Starts the cluster (:meth:`start`, a module fixture's body) and connects alice or bob to it."""

    def __init__(self) -> None:
        self._local: LocalCluster | None = None

    @property
    def local(self) -> LocalCluster:
        assert self._local is not None, "the cluster has not started"
        return self._local

    @contextlib.asynccontextmanager
    async def start(self, **kwargs: Any) -> AsyncIterator[Cluster]:
        """A ``LocalCluster(**kwargs)`` whose keys admit the client keys ``alice`` and ``bob``."""
        local = LocalCluster(**kwargs)
        async with local as cluster:
            assert local.keys is not None
            local.keys.add("client", "alice")
            local.keys.add("client", "bob")
            self._local = local
            yield cluster

    def connect(self, cluster: Cluster, who: str) -> Any:
        """A connection (``async with``) to ``cluster`` holding ``who``'s key."""
        keys = self.local.keys
        assert keys is not None
        return Cluster.connect(cluster.head.address, keys=keys.directory, identity=who)
