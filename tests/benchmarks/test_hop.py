"""benchmarks.hop runs and reports what it promises (its figures are the benchmark's, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.hop import measure
from transport.loop import run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_each_kind_gets_one_median_per_trial_and_the_echoes_end() -> None:
    medians = run(measure(trials=2, count=20))
    assert {kind: len(values) for kind, values in medians.items()} == {"zmq": 2, "unix": 2, "stream": 2}
    assert all(value > 0 for values in medians.values() for value in values)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_tiny_run_prints_every_key_last() -> None:
    command = [sys.executable, "-m", "benchmarks.hop", "--trials", "1", "--round-trips", "20"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["zmq_rtt_us"] > 0 and summary["unix_rtt_us"] > 0 and summary["stream_rtt_us"] > 0
    assert summary["zmq_vs_unix_rtt"] == pytest.approx(summary["zmq_rtt_us"] / summary["unix_rtt_us"], rel=0.01)
    assert summary["stream_vs_zmq_rtt"] == pytest.approx(summary["stream_rtt_us"] / summary["zmq_rtt_us"], rel=0.01)
