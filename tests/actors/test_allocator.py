"""The stage process's allocator setting: freed activation buffers are reused, not faulted in again."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One reference block's forward and backward on a micro-batch (DESIGN.md), in a fresh
# process; prints the minor page faults of the last 6 of 12 iterations, per iteration.
PROBE = textwrap.dedent("""
    import resource, sys, torch
    from actors._allocator import keep_freed_memory
    torch.set_num_threads(1)
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    block = torch.nn.Sequential(torch.nn.LayerNorm(512), torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512))
    x = torch.randn(8, 32, 512)
    for i in range(12):
        if i == 6:
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block(x).square().mean().backward()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / 6)
""")


def faults_per_iteration(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
    return float(done.stdout.split()[-1])


def test_kept_memory_stops_the_page_faults_of_each_micro_batch() -> None:
    default, kept = faults_per_iteration("default"), faults_per_iteration("keep")
    # Without: hundreds to thousands a micro-batch (megabytes zero-filled); with: a few dozen strays.
    assert kept < 200, kept
    assert default > 5 * max(kept, 1.0), (default, kept)
