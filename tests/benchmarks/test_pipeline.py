"""Tests for benchmarks/pipeline.py: picking the fastest schedule, and a tiny run end to end.

Run: .venv/bin/python -m pytest -q tests/benchmarks/test_pipeline.py
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks._torch_pipelining import DIM, NUM_BLOCKS, REFERENCE, Workload, reference_batch
from benchmarks.pipeline import (
    ACTORPIPE_SCHEDULES, ActorpipePeer, PeerResult, fastest, last_line, reference_data, split_steps, workload_of,
)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def result(name: str, schedule: str, step_s: float) -> PeerResult:
    return PeerResult(name=name, num_stages=2, schedule=schedule, step_times_s=[step_s], peak_rss_bytes=[0])


def test_fastest_picks_the_quickest_default_schedule_and_ignores_variants() -> None:
    results = [result("actorpipe_1f1b_2stages", "1f1b", 1.0),
               result("actorpipe_zero_bubble_2stages", "zero_bubble", 0.9),
               result("actorpipe_1f1b_2stages_dist", "1f1b", 0.5),  # a transport variant, not a schedule
               result("torch_interleaved_2stages", "interleaved", 0.8),
               result("actorpipe_gpipe_4stages", "gpipe", 0.1)]
    best = fastest(results, "actorpipe", ACTORPIPE_SCHEDULES, 2)
    assert best is not None and best.name == "actorpipe_zero_bubble_2stages"
    assert fastest(results, "actorpipe", ACTORPIPE_SCHEDULES, 8) is None
    # W batching is a setting of a schedule: counted where asked for.
    results.append(result("actorpipe_1f1b_2stages_wbatch", "1f1b", 0.85))
    assert fastest(results, "actorpipe", ACTORPIPE_SCHEDULES, 2).name == "actorpipe_zero_bubble_2stages"  # type: ignore[union-attr]
    best = fastest(results, "actorpipe", ACTORPIPE_SCHEDULES, 2, ("", "_wbatch"))
    assert best is not None and best.name == "actorpipe_1f1b_2stages_wbatch"


@pytest.mark.parametrize(("steps", "rounds", "blocks"), [(10, 5, [2, 2, 2, 2, 2]), (7, 3, [3, 2, 2]), (2, 5, [1, 1])])
def test_split_steps(steps: int, rounds: int, blocks: list[int]) -> None:
    assert split_steps(steps, rounds) == blocks


def test_last_line_is_the_exception_of_a_traceback() -> None:
    text = "peer rank 1 failed:\nTraceback (most recent call last):\n  File \"x\"\nValueError: needs 2 stages\n\n"
    assert last_line(text) == "ValueError: needs 2 stages"


def test_blocks_and_dim_pick_a_smaller_model_of_the_reference_kind() -> None:
    assert workload_of(argparse.Namespace(blocks=NUM_BLOCKS, dim=DIM)) is REFERENCE
    small = workload_of(argparse.Namespace(blocks=4, dim=32))
    assert small.model == REFERENCE.model and small.model_kwargs == {"blocks": 4, "dim": 32}
    assert small.batch_shape == (*REFERENCE.batch_shape[:-1], 32)


def test_the_stages_read_the_batch_the_driver_would_send() -> None:
    workload = Workload(model_kwargs={"blocks": 2, "dim": 16}, batch_shape=(8, 4, 16))
    inputs, targets = reference_data(list(workload.batch_shape))(3)
    sent = reference_batch(workload)
    assert torch.equal(inputs, sent[0]) and torch.equal(targets, sent[1])
    on_stages = ActorpipePeer(num_stages=2, schedule="1f1b", workload=workload, data_on_stages=True)
    assert on_stages._data() == {"data": "benchmarks.pipeline:reference_data", "data_kwargs": {"batch_shape": [8, 4, 16]}}
    assert ActorpipePeer(num_stages=2, schedule="1f1b", workload=workload)._data() == {}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.multiprocess
def test_a_tiny_run_prints_the_best_schedules_ratio_last() -> None:
    # Two steps of each peer at 2 stages: torch's 1F1B and ZB-V against actorpipe's (interleaved 1F1B runs
    # through the same plumbing, and costs the suite seconds),
    # on a model of the reference's kind small enough that the peers' start-up is the cost. The
    # compiled peers on aot_eager: the same plumbing as inductor's, without its code generation.
    command = [sys.executable, "-m", "benchmarks.pipeline", "--stages", "2", "--steps", "1", "--warmup", "1",
               "--rounds", "1", "--skip-variants", "--torch-schedules", "1f1b", "zbv",
               "--actorpipe-schedules", "1f1b", "zbv", "--blocks", "4", "--dim", "32",
               "--compile-backend", "aot_eager"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["workload"] == {"blocks": 4, "dim": 32}
    assert summary["vs_torch_best_2stages"] > 0
    assert summary["actorpipe_best_2stages"] in ("1f1b", "zbv")
    assert summary["torch_best_2stages"] in ("1f1b", "zbv")
    assert summary["vs_torch_1f1b_2stages"] > 0 and summary["vs_torch_interleaved_2stages"] is None
    # ZB-V on both sides (two stages per rank in a V), trained to the one process's parameters.
    assert summary["vs_torch_zbv_2stages"] > 0
    assert summary["actorpipe_zbv_2stages_max_rel_diff"] < 1e-4
    assert summary["vs_torch_best_4stages"] is None  # not asked for
    assert summary["torch_not_run"] == {}
    assert summary["torch_zbv_2stages_max_rel_diff"] < 1e-4
    assert "every torch schedule asked for ran on CPU/gloo" in done.stdout
    # The compiled 1F1B peers (each block through torch.compile), each against its eager peer.
    compiled = summary["compiled_vs_eager_2stages"]
    assert set(compiled) == {"actorpipe", "torch"} and all(ratio > 0 for ratio in compiled.values()), compiled


def test_the_compute_only_ceiling_is_set_against_eager_layouts_alone() -> None:
    """Found by review: the fastest actorpipe peer at 2 stages could be the torch.compile'd one, set against an
    eager compute-only ceiling it can beat, which no pipeline can."""
    from benchmarks.pipeline import COMPUTE_ONLY, summarize

    results = [result("actorpipe_1f1b_2stages", "1f1b", 1.0), result("actorpipe_1f1b_2stages_compiled", "1f1b", 0.5),
               result(f"{COMPUTE_ONLY}_2stages", "1f1b", 0.9)]
    summary = summarize(results, [2])
    assert summary["best_actorpipe_layout_2stages"] == "actorpipe_1f1b_2stages"
    assert summary["vs_compute_only_2stages"] == pytest.approx(0.9, abs=1e-3)
