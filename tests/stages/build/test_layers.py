"""Tests for stages/build/layers.py's partition pattern: DeepSpeed's type:REGEX, at a bounded cost."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from stages.build.layers import match_layer_types

NAMES = ["Embedding", "TransformerBlock", "TransformerBlock", "LayerNorm", "Linear"]


@pytest.mark.parametrize(("pattern", "expected"), [
    ("transformerblock", [0, 1, 1, 0, 0]),  # case-insensitive, as DeepSpeed's
    ("block|norm", [0, 1, 1, 1, 0]),
    ("^lin", [0, 0, 0, 0, 1]),
    (r"(\w|\w|\w|\w)*!", [0, 0, 0, 0, 0]),  # held re.search for ever; regex's matcher is linear here
])
def test_a_pattern_marks_the_layers_whose_class_it_matches(pattern: str, expected: list[int]) -> None:
    assert match_layer_types(pattern, NAMES) == expected


def test_a_pattern_that_backtracks_without_end_runs_out_of_time_with_an_error() -> None:
    with pytest.raises(ValueError, match=r"took more than 0.2s to match .* name the repeated block's class"):
        match_layer_types(r"(.*?a){20}!", ["ab" * 25] * 3, budget_s=0.2)


@pytest.mark.parametrize("pattern", ["", "x" * 201, "(unclosed"])
def test_a_pattern_that_is_not_one_is_refused(pattern: str) -> None:
    with pytest.raises(ValueError):
        match_layer_types(pattern, NAMES)


class _Counting(nn.Module):
    """A layer that notes, when it runs, how many of the model's parameters are real (not meta)."""

    model: list[nn.Module] = []
    seen: list[int] = []

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        _Counting.model.append(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Counting.seen.append(sum(p.numel() for m in _Counting.model for p in m.parameters() if not p.is_meta))
        return self.linear(x)


def counting_stack(layers: int = 4, dim: int = 8) -> nn.Sequential:
    _Counting.model.clear()
    return nn.Sequential(*(_Counting(dim) for _ in range(layers)))


def test_profiling_makes_one_layer_real_at_a_time() -> None:
    """partition_method="profile" times each layer with only that layer's parameters real: a model
    too large for one process can be profiled in one."""
    from stages.build.layers import layer_times

    _Counting.seen.clear()
    times = layer_times("tests.stages.build.test_layers:counting_stack", {"layers": 4, "dim": 8},
                        ["tests.stages.build"], None, {}, 1, 0, repeats=1, example=torch.randn(2, 8))
    assert len(times) == 4 and all(t >= 1 for t in times)
    assert _Counting.seen and set(_Counting.seen) == {8 * 8 + 8}  # one layer's, whichever runs


class _Waits(nn.Module):
    """Takes 30 ms of the wall clock and almost none of the CPU: as a layer seems when another
    process has the core while it computes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return x * 1.0


class _Computes(nn.Module):
    """Matrix products: CPU time, a few milliseconds of it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = torch.ones(96, 96)
        for _ in range(40):
            m = m @ m * 1e-2
        return x + m.sum() * 0


def waits_then_computes() -> nn.Sequential:
    return nn.Sequential(_Waits(), _Computes())


def test_profiling_counts_the_cpu_a_layer_spends_not_the_wall_clock_a_busy_machine_stretches() -> None:
    from stages.build.layers import layer_times

    waits, computes = layer_times("tests.stages.build.test_layers:waits_then_computes", {},
                                  ["tests.stages.build"], None, {}, 1, 0, repeats=2, example=torch.randn(2, 8))
    assert waits < computes  # by the wall clock the sleeping layer would be the slow one (30 ms)


def test_profiling_bills_a_layer_its_own_threads_cpu_not_what_the_processes_other_threads_spend() -> None:
    """A node's other threads (its event loop, libzmq's I/O, torch's idle workers) spend CPU while a
    layer is timed; counted, it lands on whichever layer runs then: here the one that sleeps."""
    from stages.build.layers import layer_times

    stop = threading.Event()

    def burn() -> None:
        m = torch.ones(128, 128)
        while not stop.is_set():
            m = m @ m * 1e-2  # releases the GIL: CPU time of this process, not of the profiling thread

    threads = torch.get_num_threads()
    burner = threading.Thread(target=burn, daemon=True)
    burner.start()
    try:
        waits, computes = layer_times("tests.stages.build.test_layers:waits_then_computes", {},
                                      ["tests.stages.build"], None, {}, 1, 0, repeats=2, example=torch.randn(2, 8))
    finally:
        stop.set()
        burner.join()
    assert waits < computes
    assert torch.get_num_threads() == threads  # the profile's one thread was put back
