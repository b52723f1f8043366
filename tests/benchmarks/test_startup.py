"""benchmarks.startup runs and reports what it promises (its figures are the benchmark's, not asserted)."""

from __future__ import annotations

import pytest

from benchmarks.startup import measure

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_startup_benchmark_reports_both_ratios_and_where_a_jobs_creation_went() -> None:
    result = measure(rounds=1, num_jobs=1, nodes=2)  # 2 nodes: four fewer processes import torch than at 4
    assert result["cluster_ready_vs_parallel_imports"] > 0 and result["job_created_vs_torch_import"] > 0
    assert result["cluster_again_vs_exec"] > 0 and min(result["cluster_again_s"], result["cluster_exec_s"]) > 0
    assert list(result["creation_breakdown_s"]) == ["compile", "place", "partition", "rendezvous", "spawn",
                                                    "connect", "actor"]
    assert sum(result["creation_breakdown_s"].values()) <= result["job_created_s"]
