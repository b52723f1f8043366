# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/test_records.py
"""The records between the scheduler and the stages (stages.records): StepOrder, checked when made."""

from __future__ import annotations

from typing import Any

import pytest
import zmq

from stages.records import RecordError, StageReport, StepOrder
from transport.records import RECORD_NAMES
from transport.wire import decode_message, encode_message

pytestmark = pytest.mark.timeout(30)


def test_a_step_order_round_trips_the_wire() -> None:
    order = StepOrder(step=3, program=["0F0", "0B0"], data_step=2, data_shard=[1, 2], micro_batches=4,
                      snapshot=2, loss_scale=1024, w_batching=True)
    assert StepOrder.from_wire(order.to_wire()) == order
    assert StepOrder.from_wire({"step": 0, "program": []}) == StepOrder(step=0, program=[])


@pytest.mark.parametrize(("change", "match"), [
    ({"step": -1}, "step must be an int >= 0"),
    ({"step": True}, "step must be an int >= 0"),
    ({"program": "0F0"}, "program must be a list of actions as text"),
    ({"program": [1]}, "program must be a list of actions as text"),
    ({"w_batching": "yes"}, "w_batching must be a bool, got 'yes'"),
    ({"whole": 1}, "whole must be a bool, got 1"),
    ({"eval_data": "yes"}, "eval_data must be a bool, got 'yes'"),
    ({"micro_batches": 0}, "micro_batches must be an int >= 1, got 0"),
    ({"micro_batches": 2.0}, "micro_batches must be an int >= 1"),
    ({"snapshot": -1}, "snapshot must be an int >= 0"),
    ({"data_step": False}, "data_step must be an int >= 0"),
    ({"loss_scale": 0}, "loss_scale must be a finite number > 0, got 0"),
    ({"loss_scale": True}, "loss_scale must be a finite number > 0"),
    ({"loss_scale": "8"}, "loss_scale must be a finite number > 0"),
    ({"loss_scale": float("inf")}, "loss_scale must be a finite number > 0"),
    ({"lr": -0.1}, "lr must be a finite number > 0, got -0.1"),
    ({"lr": float("nan")}, "lr must be a finite number > 0"),
    ({"lr": "0.1"}, "lr must be a finite number > 0"),
    ({"data_shard": [2, 2]}, "data_shard must be \\[replica, replicas\\]"),
    ({"data_shard": [0]}, "data_shard must be \\[replica, replicas\\]"),
])
def test_a_bad_step_order_is_refused_when_it_is_made(change: dict[str, Any], match: str) -> None:
    wire = {"step": 1, "program": [], **change}
    with pytest.raises(ValueError, match=match):
        StepOrder.from_wire(wire)


def test_a_step_order_with_an_unknown_or_missing_key_is_refused() -> None:
    with pytest.raises(RecordError, match="unknown key\\(s\\) inputz"):
        StepOrder.from_wire({"step": 1, "program": [], "inputz": []})
    with pytest.raises(RecordError, match="missing key\\(s\\) program"):
        StepOrder.from_wire({"step": 1})


def test_a_stage_report_travels_with_its_spans_flat_and_comes_back_as_it_left() -> None:
    spans = [[f"1F{i}", 0.01 * i, 0.01 * i + 0.005] for i in range(300)]
    report = StageReport(status="done", losses=[0.5, 0.25], items=[2.0, 2.0], spans=spans, started_at=12.5)
    on_the_wire = RECORD_NAMES[StageReport][1](report)["spans"]  # what the encoder writes: one flat list
    assert on_the_wire == [item for span in spans for item in span]
    frames = encode_message({"v": report})
    back = decode_message([zmq.Frame(bytes(f)) for f in frames])["v"]
    assert back == report and back.spans == spans
    assert StageReport.from_wire(report.to_wire()) == report  # a nested map (JSON, logs) is taken too
    assert StageReport.from_wire({"status": "done", "spans": []}).spans == []


def test_flat_spans_that_are_not_whole_triples_are_refused() -> None:
    with pytest.raises(RecordError, match="whole \\[action, start, end\\] triples, not 4 items"):
        StageReport.from_wire({"status": "done", "spans": ["1F0", 0.0, 0.1, "1B0"]})
