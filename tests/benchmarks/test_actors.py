"""benchmarks.actors runs and reports what it promises (its figures are the benchmark's, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.actors import Rounds, main, summarize

ROOT = Path(__file__).resolve().parents[2]


def test_each_clusters_ratio_is_against_the_raw_round_trips_of_its_own_rounds() -> None:
    secure = Rounds(rtts=[3.0, 3.0, 3.0], raw_rtts=[1.0, 1.0, 1.0], req_per_s=[10.0, 30.0, 20.0])
    plain = Rounds(rtts=[4.0, 4.0], raw_rtts=[2.0, 2.0], req_per_s=[40.0, 40.0])
    summary = summarize(secure, plain)
    assert summary["rtt_ratio_vs_raw_zmq"] == 3.0  # not against the pooled raw median (1.5 or 2.0)
    assert summary["insecure_rtt_ratio_vs_raw_zmq"] == 2.0
    assert summary["inflight64_req_per_s"] == 20.0  # the median round
    assert summary["curve_vs_insecure_rtt"] == 0.75 and summary["curve_vs_insecure_inflight64"] == 0.5


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_tiny_run_alternates_rounds_and_prints_every_key_last() -> None:
    command = [sys.executable, "-m", "benchmarks.actors", "--count", "40", "--rounds", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("rtt_ratio_vs_raw_zmq", "inflight64_req_per_s", "insecure_rtt_ratio_vs_raw_zmq",
                "curve_vs_insecure_rtt", "curve_vs_insecure_inflight64"):
        assert summary[key] > 0, key
    assert "40 calls in 2 rounds" in done.stdout


def test_rounds_beyond_the_calls_are_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["benchmarks.actors", "--count", "2", "--rounds", "3"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2 and "--rounds between 1 and --count" in capsys.readouterr().err
