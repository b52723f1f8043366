"""The scheduler tests' shared fixture: one LocalCluster for the modules whose jobs need no fresh one."""
from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from actors import Cluster, LocalCluster


@pytest_asyncio.fixture(loop_scope="package", scope="package")
async def cluster() -> AsyncIterator[Cluster]:
    """Four CPU nodes, started once for every module here that asks for ``cluster``.

    A start costs seconds (five processes import torch), and these modules' jobs are
    independent: each starts its own and closes it. A module whose tests kill, stop or
    count a cluster's processes starts its own cluster instead. Tests that use this one
    run on the package's event loop, the one its connection lives on:
    ``pytest.mark.asyncio(loop_scope="package")``.
    """
    async with LocalCluster(nodes=4) as cluster:
        yield cluster
