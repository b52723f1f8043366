"""benchmarks.memory's DeepSpeed peer: its launcher, against a stand-in rank (DeepSpeed is no dependency).

Run: .venv/bin/python -m pytest -q tests/benchmarks/test_memory.py
"""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks import _memory_states

FAKE = "tests.benchmarks.fake_deepspeed_rank"


@pytest.mark.multiprocess
def test_the_launcher_gathers_every_rank_s_peak_by_stage() -> None:
    peaks = _memory_states._deepspeed_peaks(4, 24, 7, "sgd", module=FAKE)
    assert peaks == [1000 * 4 * 7, 1000 * 3 * 7, 1000 * 2 * 7, 1000 * 1 * 7]  # stage 0 is the last rank


@pytest.mark.multiprocess
def test_a_rank_that_fails_is_named_with_its_output() -> None:
    with pytest.raises(RuntimeError, match=r"rank 2 exited with 3: Traceback: gloo could not connect"):
        _memory_states._deepspeed_peaks(4, 24, 7, "adam", module=FAKE)


def test_without_deepspeed_the_summary_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    assert _memory_states.deepspeed_peer(8, 24, 2048) == {"deepspeed": "not installed"}
