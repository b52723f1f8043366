"""Tests for benchmarks/gpu.py: without CUDA it says so and exits 0; its CPU dry run compares for real.

Run: .venv/bin/python -m pytest -q tests/benchmarks/test_gpu.py
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import distance

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]


def run_module(*args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=170)
    return done, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the real checks would run")
@pytest.mark.multiprocess
def test_without_cuda_it_says_so_in_the_last_line_and_exits_0() -> None:
    done, summary = run_module()
    assert done.returncode == 0, done.stderr[-2000:]
    assert summary["cuda"] is False and "is_available" in str(summary["reason"])


@pytest.mark.multiprocess
def test_the_cpu_dry_run_trains_two_stages_over_zeromq_as_one_process() -> None:
    done, summary = run_module("--device", "cpu", "--steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary["ok"] is True and summary["dry_run"] is True
    for case in ("zmq_fp32", "zmq_bf16"):
        result = summary[case]
        assert isinstance(result, dict) and result["ok"] is True and 0 <= result["tolerance_used"] <= 1, result
    assert isinstance(summary["int8_gbps"], float) and summary["int8_gbps"] > 0


def test_distance_fails_a_state_one_step_off() -> None:
    expected = {"w": torch.tensor([1.0, -2.0, 0.0]), "b": torch.zeros(2)}
    same = distance(dict(expected), expected, 1e-5, 1e-6)
    assert same == {"tolerance_used": 0.0, "max_rel_diff": 0.0, "max_abs_diff": 0.0}
    off = distance({"w": torch.tensor([1.0, -2.0001, 0.0]), "b": torch.zeros(2)}, expected, 1e-5, 1e-6)
    assert off["tolerance_used"] > 1 and off["max_rel_diff"] == pytest.approx(5e-5, rel=1e-2)
    with pytest.raises(ValueError, match="keys"):
        distance({"w": expected["w"]}, expected, 1e-5, 1e-6)
