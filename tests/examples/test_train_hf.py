"""examples/train_hf.py: a transformers GPT-2 trains over 2 stages unchanged and its state loads back."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the test setup installs it (the [hf] extra)
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_hugging_face_gpt2_trains_over_two_stages_and_loads_back_strictly() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "examples.train_hf", "--steps", "12", "--batch-size", "8", "--context", "16",
         "--dim", "32", "--layers", "2", "--micro-batches", "2", "--lr", "1e-2", "--eval-every", "5"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tied"] == [["transformer.wte.weight", "lm_head.weight"]]
    assert math.isfinite(report["val_loss"]) and report["final_loss"] < report["first_loss"]
    # The job's own evaluation (eval mode, dropout off, on its stages) is the gathered model's, on the same batches.
    assert report["job_val_loss"] == pytest.approx(report["val_loss"], rel=1e-5)
    assert [line.split()[1] for line in result.stdout.splitlines() if "validation" in line] == ["4", "9"]
    assert report["first_loss"] == pytest.approx(math.log(128), abs=0.3)  # a fresh model guesses about uniformly
