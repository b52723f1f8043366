"""benchmarks.hop runs and reports what it promises (its figures are the benchmark's, not asserted)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import pytest

from benchmarks import hop
from transport.loop import run


def test_each_kind_gets_one_median_per_trial_the_kinds_taking_turns_to_go_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []

    def trial(kind: str, seconds: float) -> Callable[[str, int], Awaitable[list[float]]]:
        async def measured(folder: str, count: int) -> list[float]:
            order.append(kind)
            return [seconds] * count
        return measured

    monkeypatch.setattr(hop, "TRIALS", {"zmq": trial("zmq", 1.0), "unix": trial("unix", 2.0),
                                        "stream": trial("stream", 3.0)})
    medians = run(hop.measure(trials=3, count=5))
    assert medians == {"zmq": [1.0] * 3, "unix": [2.0] * 3, "stream": [3.0] * 3}
    assert order == ["zmq", "unix", "stream", "unix", "stream", "zmq", "stream", "zmq", "unix"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_tiny_run_of_every_kind_prints_every_key_last_and_the_echoes_end(capsys: pytest.CaptureFixture[str]) -> None:
    hop.main(["--trials", "1", "--round-trips", "20"])  # each trial spawns its echo and joins it
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0].strip() for line in lines[1:4]] == ["zmq", "unix", "stream"]
    summary = json.loads(lines[-1])
    assert summary["zmq_rtt_us"] > 0 and summary["unix_rtt_us"] > 0 and summary["stream_rtt_us"] > 0
    assert summary["zmq_vs_unix_rtt"] == pytest.approx(summary["zmq_rtt_us"] / summary["unix_rtt_us"], rel=0.01)
    assert summary["stream_vs_zmq_rtt"] == pytest.approx(summary["stream_rtt_us"] / summary["zmq_rtt_us"], rel=0.01)
    assert (summary["trials"], summary["round_trips"]) == (1, 20)
