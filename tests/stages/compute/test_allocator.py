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
# process; prints the minor page faults of each of the 24 iterations after 6 warm-up ones.
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
    for i in range(30):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block(x).square().mean().backward()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
    print(*faults[6:])
""")


def faults_per_iteration(mode: str) -> float:
    """The mean of the per-iteration faults. Without the setting glibc's own heuristics (its
    mmap threshold rises after a free, its heap is trimmed when the top is free) fault in the
    freed buffers in some iterations and not in others: 0 in up to half of them, so a median
    of 0 came up under load (the mean: 775-1,570 in six runs). With it, a one-off growth of the
    heap (a 2 MiB region, 512 faults once) spreads over the 24 iterations (means 0-43)."""
    done = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
    return statistics.mean(float(n) for n in done.stdout.split())


def test_kept_memory_stops_the_page_faults_of_each_micro_batch() -> None:
    default, kept = faults_per_iteration("default"), faults_per_iteration("keep")
    # Without: hundreds to thousands a micro-batch (megabytes zero-filled); with: a few dozen strays.
    assert kept < 200, kept
    assert default > 5 * max(kept, 1.0), (default, kept)
