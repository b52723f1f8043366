"""benchmarks.transport's codec measurement, small: every codec is timed beside a memory copy of the same bytes."""

from __future__ import annotations

import pytest

import benchmarks.transport as bench
from benchmarks.transport import measure_codecs, measure_memcpy, measure_throughput
from transport.codecs import CODEC_NAMES


def test_every_codec_is_measured_with_its_size_ratio_and_a_memory_copy_beside_it() -> None:
    copy = measure_memcpy(numel=1 << 14, repeats=2)
    codecs = measure_codecs(numel=1 << 14, repeats=2)
    assert copy > 0 and set(codecs) == set(CODEC_NAMES)
    assert all(gbps > 0 for gbps, _ in codecs.values())
    assert codecs["none"][1] == 1.0 and abs(codecs["int8"][1] - (1 + 4 / 256) / 4) < 1e-6


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["secure", "curve"])
def test_a_secure_channel_is_measured_end_to_end(kind: str) -> None:
    rates = measure_throughput(kind, [(64 << 10, 4), (1 << 20, 4)])  # a spawned receiver, a session, two sizes
    assert len(rates) == 2 and all(rate > 0 for rate in rates)


def test_each_process_sets_malloc_as_a_stage_does_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """The channel is measured as stages run it (runtime.keep_freed_memory), both peers alike;
    --default-malloc (the environment the spawned receivers read) leaves glibc's settings."""
    calls: list[bool] = []
    monkeypatch.setattr(bench, "keep_freed_memory", lambda: calls.append(True) or True)
    monkeypatch.delenv(bench._DEFAULT_MALLOC, raising=False)
    bench._as_a_stage_process()
    monkeypatch.setenv(bench._DEFAULT_MALLOC, "1")
    bench._as_a_stage_process()
    assert calls == [True]
