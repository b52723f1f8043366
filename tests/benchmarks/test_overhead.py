"""Tests for benchmarks/overhead.py: its fit and growth figures, and a tiny run end to end.

Run: .venv/bin/python -m pytest -q tests/benchmarks/test_overhead.py
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.overhead import ConfigResult, cpu_s, fit_line, growth, process_tree, summarize

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def config(num_stages: int, micro_batches: int, actions: int, step_ms: float) -> ConfigResult:
    return ConfigResult(num_stages=num_stages, micro_batches=micro_batches, actions_per_rank=[actions - 1, actions],
                        actorpipe_step_s=[step_ms / 1e3], torch_step_s=[2 * step_ms / 1e3],
                        run_step_s=[(step_ms - 0.5) / 1e3], compute_actions_fraction=0.1, compute_s=0.001)


@pytest.mark.parametrize(("xs", "ys", "line"), [
    ([1, 2, 3], [5, 7, 9], (3.0, 2.0)),
    ([10, 20], [100, 100], (100.0, 0.0)),
    ([4, 4], [1, 2], None),  # one distinct x: no line
])
def test_fit_line(xs: list[float], ys: list[float], line: tuple[float, float] | None) -> None:
    fitted = fit_line(xs, ys)
    assert fitted == (None if line is None else pytest.approx(line))


def test_growth_is_flat_when_every_action_costs_the_same() -> None:
    # 100 us per action plus a fixed 1 ms a step.
    results = [config(2, m, 4 * m + 3, 1.0 + 0.1 * (4 * m + 3)) for m in (8, 64)]
    figures = growth(results, "actorpipe")
    assert figures["fit_us_per_action_2stages"] == pytest.approx(100.0)
    assert figures["fit_fixed_us_2stages"] == pytest.approx(1000.0)
    assert figures["per_action_growth_micro_batches_2stages"] < 1.0  # the fixed cost spreads over more actions
    assert growth(results, "torch")["torch_fit_us_per_action_2stages"] == pytest.approx(200.0)
    run = growth(results, "run")  # the same actions, 0.5 ms less a step: the fixed part alone is smaller
    assert run["run_fit_us_per_action_2stages"] == pytest.approx(100.0)
    assert run["run_fit_fixed_us_2stages"] == pytest.approx(500.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.multiprocess
def test_a_tiny_run_prints_the_overhead_per_action_last() -> None:
    command = [sys.executable, "-m", "benchmarks.overhead", "--stages", "2", "--micro-batches", "8",
               "--steps", "2", "--warmup", "1", "--rounds", "1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["overhead_us_per_action"] > 0 and summary["vs_torch_overhead"] > 0
    assert summary["run_vs_torch_overhead"] > 0 and summary["run_step_ms_2stages_8mb"] > 0  # job.run, timed too
    assert summary["actions_per_rank_2stages_8mb"] == [35, 43]  # 1F1B, 8 micro-batches, split backward
    assert summary["overhead_us_per_action_2stages_8mb"] == summary["overhead_us_per_action"]
    assert summary["skipped"] == []
    if sys.platform == "linux":  # the CPU both peers spent, read from /proc
        assert summary["cpu_ms_per_step_2stages_8mb"] > 0 and summary["torch_cpu_ms_per_step_2stages_8mb"] > 0
        assert summary["vs_torch_cpu"] > 0


@pytest.mark.parametrize(("num_stages", "num_cores", "cpu_us"), [(8, 2, 2000.0), (2, 2, 2000.0), (8, 16, 8000.0)])
def test_cpu_time_per_action_counts_the_cores_the_stages_share(num_stages: int, num_cores: int,
                                                               cpu_us: float) -> None:
    # 80 actions in all, 80 ms a step: on 2 cores that is 2 ms of core time per action.
    r = ConfigResult(num_stages=num_stages, micro_batches=8, actions_per_rank=[80 // num_stages] * num_stages,
                     actorpipe_step_s=[0.08], torch_step_s=[0.08], run_step_s=[0.08], compute_actions_fraction=0.0,
                     compute_s=0.0,
                     num_cores=num_cores)
    assert r.cpu_us_per_action(r.actorpipe_ms) == pytest.approx(cpu_us)


def test_the_cpu_fit_takes_each_peers_measured_cpu_and_is_left_out_where_it_was_not_measured() -> None:
    # 30 us of CPU per action plus 2 ms a step (actorpipe), 50 us per action and nothing fixed (torch).
    results = [config(2, m, 4 * m + 3, 10.0) for m in (8, 64)]
    for r in results:
        r.cpu_ms_per_step.update(actorpipe=2.0 + 0.03 * r.actions_per_stage, torch=0.05 * r.actions_per_stage)
    ours, torch_figures = growth(results, "actorpipe"), growth(results, "torch")
    assert ours["cpu_fit_fixed_ms_2stages"] == pytest.approx(2.0)
    assert ours["cpu_fit_ms_per_action_2stages"] == pytest.approx(0.03)
    assert torch_figures["torch_cpu_fit_fixed_ms_2stages"] == pytest.approx(0.0, abs=1e-9)
    assert "run_cpu_fit_fixed_ms_2stages" not in growth(results, "run")  # a run's CPU is not measured
    summary = summarize(results)
    assert summary["cpu_ms_per_step_2stages_8mb"] == pytest.approx(2.0 + 0.03 * 35)
    assert summary["vs_torch_cpu"] == pytest.approx(statistics.median(
        (2.0 + 0.03 * r.actions_per_stage) / (0.05 * r.actions_per_stage) for r in results), abs=1e-3)
    results[0].cpu_ms_per_step.clear()  # not measured (no /proc): no fit, and no keys for it
    assert "cpu_fit_fixed_ms_2stages" not in growth(results, "actorpipe")
    assert "cpu_ms_per_step_2stages_8mb" not in summarize(results)


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads Linux's /proc")
def test_the_cpu_of_a_child_process_is_counted_and_an_idle_one_adds_nothing() -> None:
    # The child waits for a line, burns 0.3 s of CPU, says so and waits for the next line.
    burn = ("import time\ninput()\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
            "print('burnt', flush=True)\ninput()")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.pid in (process_tree() or [])
        before = cpu_s([child.pid])  # its start-up only
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "burnt\n"
        burnt = cpu_s([child.pid]) - before
        assert 0.3 <= burnt < 0.3 + 1.0  # at least what it burnt; the rest is its own bookkeeping
        time.sleep(0.1)
        assert cpu_s([child.pid]) - before - burnt < 0.05  # waiting on a pipe costs (next to) nothing
    finally:
        child.communicate("", timeout=30)
    assert cpu_s([child.pid]) == 0.0  # a process that ended counts 0
