"""Traces of measured steps: clock alignment, tracks, spans, transfer flows, and the PNG timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stages.program import Action
from schedulers.schedules import SCHEDULES, build_schedule
from schedulers.simulate import simulate
from schedulers.trace import StageRecord, estimate_offset, match_transfers, plot_trace, to_chrome_trace

pytestmark = pytest.mark.timeout(60)


def test_offset_comes_from_the_round_trip_with_the_least_delay() -> None:
    # The stage's clock is 5 s ahead; replies are delayed by queueing except in one probe.
    samples = [(100.0, 105.9, 101.0), (200.0, 205.02, 200.04), (300.0, 305.5, 300.2)]
    offset, rtt = estimate_offset(samples)
    assert offset == pytest.approx(5.0) and rtt == pytest.approx(0.04)
    with pytest.raises(ValueError, match="at least one"):
        estimate_offset([])


def _records_from_simulation(schedule_name: str, num_ranks: int, num_microbatches: int,
                             offsets: list[float]) -> list[StageRecord]:
    """What stages would report for a simulated step, each on a clock ``offsets[rank]`` ahead of the head's."""
    schedule = build_schedule(schedule_name, num_ranks, num_microbatches)
    result = simulate(schedule)
    records = []
    for rank in range(num_ranks):
        spans = [[str(e.action), e.start, max(e.end, e.start + 1e-3)] for e in result.events
                 if e.rank == rank and e.action.kind.value not in ("BARRIER", "REDUCE", "STEP")]
        records.append(StageRecord(member=rank, name=f"stage {rank}", pipeline_rank=rank, replica=(0, 0),
                                   started_at=1000.0 + offsets[rank], offset_s=offsets[rank], spans=spans))
    return records


# Links between ranks, both ways: 2 with one stage per rank, 4 in a V (stages 2 and 3 share rank 2).
LINKS = {"zbv": 4, "dualpipev": 4}


@pytest.mark.parametrize("schedule_name", [s for s in SCHEDULES if s != "interleaved"])
def test_trace_has_a_track_per_stage_every_span_and_a_flow_per_transfer(schedule_name: str) -> None:
    micro_batches = 6 if schedule_name == "dualpipev" else 4
    records = _records_from_simulation(schedule_name, 3, micro_batches, offsets=[0.0, 7.5, -2.0])
    placement = "v" if schedule_name in LINKS else "loop"
    trace = to_chrome_trace(records, num_ranks=3, title="t", metadata={"job": "job0"}, placement=placement)
    events = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert tracks == {0: "stage 0", 1: "stage 1", 2: "stage 2"}
    spans = [e for e in events if e["ph"] == "X"]
    assert sorted(e["name"] for e in spans) == sorted(str(s[0]) for r in records for s in r.spans)
    for e in spans:  # every span says which micro-batch it is
        assert e["args"]["microbatch"] == Action.parse(e["name"]).microbatch
    sends = sum(1 for r in records for s in r.spans if "SEND" in str(s[0]))
    starts = [e for e in events if e["ph"] == "s"]
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == len(finishes) == sends == 2 * LINKS.get(schedule_name, 2) * micro_batches
    by_name = {(e["tid"], e["name"]): e for e in spans}
    for start in starts:
        send_name, recv_name = start["name"].split(" -> ")
        finish = finishes[start["id"]]
        send, recv = by_name[start["tid"], send_name], by_name[finish["tid"], recv_name]
        assert Action.parse(send_name).microbatch == Action.parse(recv_name).microbatch
        assert send["ts"] <= start["ts"] <= send["ts"] + send["dur"]  # bound to the send's slice
        assert recv["ts"] <= finish["ts"] <= recv["ts"] + recv["dur"]  # and to the receive's
        assert start["ts"] <= finish["ts"] + 1.0  # aligned clocks: nothing arrives before it left
    assert trace["otherData"]["job"] == "job0"
    assert trace["otherData"]["clock_offsets_s"] == {"stage 0": 0.0, "stage 1": 7.5, "stage 2": -2.0}


def test_clock_offsets_put_every_stage_on_the_head_clock() -> None:
    # Both stages started at the same head time; stage 1's clock runs 30 s ahead.
    records = [
        StageRecord(member=0, name="s0", pipeline_rank=0, started_at=50.0, offset_s=0.0,
                    spans=[["0F0", 0.0, 1.0], ["0SEND_F0", 1.0, 1.1]]),
        StageRecord(member=1, name="s1", pipeline_rank=1, started_at=80.0, offset_s=30.0,
                    spans=[["1RECV_F0", 0.0, 1.2], ["1F0", 1.2, 2.0]]),
    ]
    events = to_chrome_trace(records, num_ranks=2)["traceEvents"]
    ts = {e["name"]: e["ts"] for e in events if e["ph"] == "X"}
    assert ts == {"0F0": 0.0, "0SEND_F0": pytest.approx(1.0e6), "1RECV_F0": 0.0, "1F0": pytest.approx(1.2e6)}
    (flow,) = match_transfers(records, 2)
    assert flow == (0, 1, 1, 0)


def test_transfers_stay_within_their_replica_and_follow_interleaved_placement() -> None:
    # Two data-parallel replicas, interleaved 2 ranks x 2 virtual stages: stage 2 lives on rank 0.
    def record(member: int, rank: int, data: int, spans: list[list[Any]]) -> StageRecord:
        return StageRecord(member=member, name=f"m{member}", pipeline_rank=rank, replica=(data, 0),
                           started_at=0.0, spans=spans)

    records = [
        record(0, 0, 0, [["0SEND_F0", 0.0, 0.1], ["2RECV_F0", 0.5, 0.6]]),
        record(1, 1, 0, [["1RECV_F0", 0.1, 0.2], ["1SEND_F0", 0.3, 0.4]]),
        record(2, 0, 1, [["0SEND_F0", 0.0, 0.1]]),
        record(3, 1, 1, [["1RECV_F0", 0.1, 0.2]]),
    ]
    assert sorted(match_transfers(records, 2)) == [(0, 0, 1, 0), (1, 1, 0, 1), (2, 0, 3, 0)]


def test_plot_draws_a_png_with_a_row_per_stage(tmp_path: Path) -> None:
    from PIL import Image

    records = _records_from_simulation("zero_bubble", 4, 8, offsets=[0.0, 0.1, 0.2, 0.3])
    trace = to_chrome_trace(records, num_ranks=4, title="zb step 0")
    path = tmp_path / "timeline.png"
    plot_trace(trace, path)
    with Image.open(path) as image:
        assert image.format == "PNG"
        width, height = image.size
    assert width == 1000 and 200 <= height <= 600
    colours = Image.open(path).convert("RGB").getcolors(1 << 20) or []
    assert len(colours) > 8  # bars of several kinds, not a blank canvas


def test_the_steps_tail_shows_after_the_actions_as_its_own_spans(tmp_path: Path) -> None:
    """A stage's tail (the reduction, the wait for every stage's vote, the optimizer step) comes as spans named
    by the program's tail actions: category ``tail`` in the trace, a purple bar in the picture."""
    from PIL import Image

    tail = [["0REDUCE", 0.30, 0.32], ["0BARRIER", 0.32, 0.36], ["0STEP", 0.36, 0.40]]
    record = StageRecord(member=0, name="stage 0", pipeline_rank=0, started_at=5.0,
                         spans=[["0F0", 0.0, 0.1], ["0B0", 0.1, 0.3], *tail])
    trace = to_chrome_trace([record], num_ranks=1)
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert [(e["name"], e["cat"], e["args"]["kind"]) for e in spans[2:]] == [
        ("0REDUCE", "tail", "REDUCE"), ("0BARRIER", "tail", "BARRIER"), ("0STEP", "tail", "STEP")]
    assert spans[3]["ts"] == pytest.approx(0.32e6) and spans[3]["dur"] == pytest.approx(0.04e6)
    path = tmp_path / "tail.png"
    plot_trace(trace, path)
    colours = {rgb for _, rgb in Image.open(path).convert("RGB").getcolors(1 << 20) or []}
    assert (0x94, 0x67, 0xBD) in colours  # tab:purple
