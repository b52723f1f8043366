"""The stage process's allocator setting: freed activation buffers are reused, not faulted in again."""

from __future__ import annotations

import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[3]

# One reference block's forward and backward on a micro-batch (docs/design.md), in a fresh
# process; prints the minor page faults of each of the 12 iterations after 6 warm-up ones.
PROBE = textwrap.dedent("""
    import resource, sys, torch
    from stages.compute.allocator import keep_freed_memory
    torch.set_num_threads(1)
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    block = torch.nn.Sequential(torch.nn.LayerNorm(512), torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512))
    x = torch.randn(8, 32, 512)
    faults = []
    for i in range(18):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block(x).square().mean().backward()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
    print(*faults[6:])
""")


def faults_per_iteration(mode: str) -> float:
    """The median of the per-iteration faults: a one-off growth of the heap (a 2 MiB
    region faulted in once, seen now and then with the setting on) is not a per-micro-batch cost."""
    done = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
    return statistics.median(float(n) for n in done.stdout.split())


def test_kept_memory_stops_the_page_faults_of_each_micro_batch() -> None:
    default, kept = faults_per_iteration("default"), faults_per_iteration("keep")
    # Without: hundreds to thousands a micro-batch (megabytes zero-filled); with: a few dozen strays.
    assert kept < 200, kept
    assert default > 5 * max(kept, 1.0), (default, kept)
