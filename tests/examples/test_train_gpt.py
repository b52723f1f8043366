"""Tests for examples/train_gpt.py.

Run: .venv/bin/python -m pytest -q tests/examples/test_train_gpt.py
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.train_gpt import parse_args, train

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--steps", "3", "--batch-size", "8", "--context", "16", "--dim", "32", "--layers", "2", "--heads", "2",
        "--micro-batches", "4", "--eval-batches", "1", "--sample-tokens", "20"]


@pytest.mark.multiprocess
def test_single_process_run_prints_a_sample_and_writes_the_loss_curve(tmp_path: Path) -> None:
    out = tmp_path / "gpt"
    result = subprocess.run(
        [sys.executable, "-m", "examples.train_gpt", "--single-process", *TINY, "--steps", "5", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "step    0  loss 4.8" in result.stdout  # a fresh model guesses about uniformly: ln 128 = 4.85
    assert "validation loss" in result.stdout
    assert "--- sample ---\ndef " in result.stdout
    png = (out / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG")


def test_parse_args_rejects_a_batch_that_does_not_split_into_micro_batches(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--batch-size", "10", "--micro-batches", "4"])
    assert "divisible" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,says", [("--micro-batches", "0", "0 is below 1"), ("--stages", "two", "not a whole"),
                                             ("--heads", "-1", "-1 is below 1")])
def test_parse_args_refuses_a_count_below_one_as_a_usage_error(capsys: pytest.CaptureFixture[str], flag: str,
                                                              value: str, says: str) -> None:
    """``--micro-batches 0`` ended in a ZeroDivisionError traceback."""
    with pytest.raises(SystemExit) as exited:
        parse_args([flag, value])
    assert exited.value.code == 2 and f"argument {flag}: " in (err := capsys.readouterr().err) and says in err


async def test_single_process_training_lowers_the_loss() -> None:
    history = await train(parse_args(["--single-process", *TINY, "--steps", "8", "--lr", "3e-3"]))
    losses = history["losses"]
    assert len(losses) == 8 and len(history["step_times_s"]) == 8
    assert losses[-1] < losses[0] - 0.3


@pytest.mark.slow
@pytest.mark.multiprocess
async def test_pipelined_training_matches_the_single_process_run() -> None:
    # The design's exactness rule, through the example's own code: 2 stages, 1F1B and
    # micro-batches give one process's losses and parameters (float32 tolerance), and the
    # job's own evaluations (--eval-every) one process's validation losses at the same steps.
    single = await train(parse_args(["--single-process", *TINY, "--eval-every", "2", "--eval-batches", "2"]))
    pipelined = await train(parse_args([*TINY, "--eval-every", "2", "--eval-batches", "2"]))
    assert pipelined["losses"] == pytest.approx(single["losses"], rel=1e-5)
    steps = len(single["losses"])
    assert [at for at, *_ in pipelined["evaluated"]] == [at for at, *_ in single["evaluated"]] == list(
        range(2, steps + 1, 2)) and steps >= 2
    # each (steps, loss, accuracy): the accuracy is the job's eval_metrics (a near tie of two logits may flip a character)
    for (_, loss, accuracy), (_, expected_loss, expected_accuracy) in zip(pipelined["evaluated"], single["evaluated"]):
        assert loss == pytest.approx(expected_loss, rel=1e-5) and accuracy == pytest.approx(expected_accuracy, abs=0.01)
    assert pipelined["state"].keys() == single["state"].keys()
    for key, value in single["state"].items():
        torch.testing.assert_close(pipelined["state"][key], value, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
async def test_a_run_stopped_after_its_save_goes_on_from_it_as_the_single_process_run(tmp_path: Path) -> None:
    """--checkpoint-every and --resume: the job saves itself after step 2 of a run of 3 (the run then
    "stops"), and the same command with --resume and 5 steps trains steps 3 and 4 only, each as one
    process trains it (the data position came back with the checkpoint)."""
    single = await train(parse_args(["--single-process", *TINY, "--steps", "5"]))
    flags = [*TINY, "--out", str(tmp_path), "--checkpoint-every", "2"]
    first = await train(parse_args([*flags, "--steps", "3"]))
    again = await train(parse_args([*flags, "--steps", "5", "--resume"]))
    assert len(first["losses"]) == 3 and again["first_step"] == 2 and len(again["losses"]) == 3
    assert again["losses"] == pytest.approx(single["losses"][2:], rel=1e-5)
    for key, value in single["state"].items():
        torch.testing.assert_close(again["state"][key], value, rtol=1e-4, atol=1e-5)
    with pytest.raises(SystemExit):
        parse_args(["--single-process", "--resume"])


@pytest.mark.multiprocess
def test_settings_the_cluster_refuses_end_in_one_error_line_as_a_bad_flag_does() -> None:
    """More stages than the model has layers passed the flags' checks, and the head's refusal ended
    the script in a 49-line traceback; now it says ``error: ...`` on one line, exit code 2."""
    result = subprocess.run([sys.executable, "-m", "examples.train_gpt", *TINY, "--stages", "5"],
                            cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: examples.models:gpt has 4 layers, too few for 5 model stages (parallelism.pipeline_stages=5): "
        "every stage needs a layer; use at most 4 pipeline stages")
