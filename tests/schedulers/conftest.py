"""The scheduler tests' shared fixtures: LocalClusters for the modules whose jobs need no fresh one."""
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

    The nodes preload ``transformers.modeling_utils``: the Hugging Face jobs of test_real_models and
    others then start each stage a second sooner (a node imports it once, for every stage it forks).
    """
    async with LocalCluster(nodes=4, preload=["transformers.modeling_utils"]) as cluster:
        yield cluster


@pytest_asyncio.fixture(loop_scope="package", scope="package")
async def eight() -> AsyncIterator[Cluster]:
    """Eight CPU nodes, for the jobs on a (pipeline, tensor, data) = (2, 2, 2) mesh that
    test_training and test_precision each run: nine processes that import torch cost
    several seconds a start on a small machine. Each job is closed when its test ends,
    whatever the test found. Idle, the nine use about 2% of one core.
    """
    async with LocalCluster(nodes=8) as cluster:
        yield cluster
