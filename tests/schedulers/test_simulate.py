"""Tests for schedulers/simulate.py: the papers' bubble and stash figures, link timing, traces."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedulers.dataflow import Schedule
from schedulers.grid import parse_grid
from schedulers.schedules import (
    SCHEDULES,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
)
from schedulers.simulate import Costs, simulate, to_ascii, to_chrome_trace
from schedulers.validate import DeadlockError, ScheduleError

# (stages p, micro-batches m), including a single stage and fewer micro-batches than stages.
SIZES = [(1, 1), (1, 4), (2, 1), (2, 4), (3, 2), (4, 4), (4, 8), (4, 16), (5, 7), (8, 8), (8, 32)]
ZERO_BUBBLE = Costs(forward=1, input_grad=1, weight_grad=1)  # the paper's F = B = W case


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_gpipe_and_1f1b_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1(
    generator: Callable[[int, int], Schedule], p: int, m: int
) -> None:
    result = simulate(generator(p, m))
    assert result.makespan == 3 * (m + p - 1)  # F=1, B=2: the slowest path, exactly
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    for stats in result.ranks:
        assert stats.busy == 3 * m and stats.busy + stats.idle == result.makespan


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_gpipe_stashes_every_microbatch(p: int, m: int) -> None:
    assert simulate(gpipe(p, m)).peak_stash == (m,) * p


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_1f1b_stashes_at_most_p_minus_s_on_stage_s(p: int, m: int) -> None:
    assert simulate(one_f_one_b(p, m)).peak_stash == tuple(min(m, p - s) for s in range(p))


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_interleaving_shrinks_the_bubble_by_the_virtual_stages(p: int, m: int, v: int) -> None:
    # Megatron: the bubble time falls from (p-1)(F+B) to (p-1)(F+B)/v, with each of a
    # rank's v chunks costing 1/v of its work; costs here are per chunk, so the
    # fraction is (p-1) / (v*m + p-1).
    result = simulate(interleaved_1f1b(p, m, v))
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert result.bubble_fraction < simulate(one_f_one_b(p, m)).bubble_fraction


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (4, 4), (4, 8), (5, 7), (8, 8), (8, 32)])
def test_zero_bubble_h1_has_a_third_of_1f1bs_bubble(p: int, m: int) -> None:
    # The paper (F = B = W, here F = I = W = 1): 1F1B idles (p-1)(F+B+W) per stage,
    # ZB-H1 (p-1)(F+B-W), a third; and every stage stashes at most 1F1B's peak, p.
    result = simulate(zero_bubble_h1(p, m), ZERO_BUBBLE)
    baseline = simulate(one_f_one_b(p, m), ZERO_BUBBLE)  # B = 2 = I + W
    idle = result.makespan - 3 * m
    assert idle == p - 1 and baseline.makespan - 3 * m == 3 * (p - 1)
    assert result.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert max(result.peak_stash) <= max(baseline.peak_stash) == min(m, p)


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zero_bubble_never_loses_to_1f1b(p: int, m: int) -> None:
    assert simulate(zero_bubble_h1(p, m)).makespan <= simulate(one_f_one_b(p, m)).makespan


def test_links_delay_each_transfer_and_serialise_on_one_link() -> None:
    # 1 + 0.5 (link) + 1 + 2 + 0.5 (link) + 2.
    assert simulate(gpipe(2, 1), Costs(latency_s=0.5)).makespan == 7
    # 100 bytes at ratio 0.5 over 10 B/s: 5 s on the wire, so the second activation
    # waits for the first to clear the link: arrivals at 6 and 11.
    slow = Costs(activation_bytes=100, codec_ratio=0.5, bandwidth=10)
    result = simulate(gpipe(2, 2), slow)
    arrivals = [(t[0], t[1], t[3]) for t in result.transfers if t[0] == 0]
    assert arrivals == [(0, 1, 6), (0, 1, 11)]
    # Rank 1: F1 11-12, B0 12-14, B1 14-16; gradients arrive at 19 and 24; 0B1 24-26.
    assert result.makespan == 26


def test_gradients_cross_at_their_own_codec_ratio() -> None:
    # The activation at ratio 0.5 (5 s on the wire), its gradient at 0.1 (1 s): 1 + 5 + 1 + 2 + 1 + 2.
    costs = Costs(activation_bytes=100, codec_ratio=0.5, gradient_codec_ratio=0.1, bandwidth=10)
    result = simulate(gpipe(2, 1), costs)
    assert [(t[0], t[2], t[3]) for t in result.transfers] == [(0, 1, 6), (1, 9, 10)]
    assert result.makespan == 12
    # Without one, a gradient takes the activation's ratio.
    assert simulate(gpipe(2, 1), Costs(activation_bytes=100, codec_ratio=0.5, bandwidth=10)).makespan == 16


@settings(max_examples=60)
@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    p=st.integers(1, 4),
    k=st.integers(1, 3),
    costs=st.builds(
        Costs,
        forward=st.floats(0.1, 3),
        backward=st.floats(0.1, 3),
        input_grad=st.floats(0.1, 3),
        weight_grad=st.floats(0.1, 3),
        latency_s=st.floats(0, 2),
        bandwidth=st.floats(1, 100),
        activation_bytes=st.floats(0, 100),
        codec_ratio=st.floats(0.1, 1),
    ),
)
def test_lowered_and_compute_only_forms_time_the_same(
    name: str, p: int, k: int, costs: Costs
) -> None:
    m = p * k * (2 if name == "dualpipev" else 1)  # DualPipeV needs as many micro-batches as model stages
    compute = SCHEDULES[name](p, m)
    lowered = build_schedule(name, p, m)
    assert simulate(lowered, costs).makespan == pytest.approx(simulate(compute, costs).makespan)


def test_per_stage_costs() -> None:
    # Stage 1 is twice as slow: 1 + 2 + 4 + 2.
    assert simulate(gpipe(2, 1), Costs(forward=[1, 2], backward=(2, 4))).makespan == 9
    with pytest.raises(ValueError, match="2 per-stage values, but the schedule has stage 2"):
        simulate(gpipe(3, 1), Costs(forward=[1, 2]))


@pytest.mark.parametrize(
    "kwargs",
    [{"forward": -1}, {"backward": []}, {"latency_s": -1}, {"bandwidth": 0}, {"codec_ratio": 0},
     {"gradient_codec_ratio": 0}],
)
def test_costs_reject_impossible_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Costs(**kwargs)  # type: ignore[arg-type]


def test_deadlock_is_an_error_naming_the_blocked_actions() -> None:
    schedule = parse_grid("0: 0F0 0B0 0F1 0B1\n1: 1F1 1F0 1B0 1B1")
    with pytest.raises(DeadlockError, match="rank 1 blocked at 1F1 waiting for 0F1"):
        simulate(schedule)
    with pytest.raises(ScheduleError):
        simulate(parse_grid("0: 0F0"))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_chrome_trace_has_one_track_per_rank(name: str) -> None:
    result = simulate(build_schedule(name, 4, 8), Costs(latency_s=0.1))
    trace = json.loads(json.dumps(to_chrome_trace(result)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert {e["tid"] for e in spans} == {e["tid"] for e in names} == {0, 1, 2, 3}
    assert len(spans) == sum(1 for _ in result.events)
    assert any(e["name"] == "1F3" and e["dur"] == 1e6 for e in spans)
    flows = [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    # Between model stages on different ranks; in a V, stages 3 and 4 share rank 3.
    num_links = {"interleaved": 2 * 4 - 1, "zbv": 2 * 4 - 2, "dualpipev": 2 * 4 - 2}.get(name, 4 - 1)
    assert len(flows) == 2 * len(result.transfers) == 2 * (2 * num_links * 8)


def test_chrome_trace_is_written_like_a_measured_step() -> None:
    # One writer for both: categories and args as schedulers.trace writes them,
    # flows from each send to the receive that took its value.
    result = simulate(build_schedule("1f1b", 2, 2))
    events = to_chrome_trace(result)["traceEvents"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert spans["0F1"]["cat"] == "forward" and spans["0F1"]["args"]["kind"] == "F"
    assert spans["1SEND_B0"]["cat"] == "send" and spans["0RECV_B0"]["cat"] == "recv"
    assert spans["0STEP"]["cat"] == "tail"
    flows = sorted(e["name"] for e in events if e["ph"] == "s")
    assert flows == ["0SEND_F0 -> 1RECV_F0", "0SEND_F1 -> 1RECV_F1",
                     "1SEND_B0 -> 0RECV_B0", "1SEND_B1 -> 0RECV_B1"]
    other = to_chrome_trace(result)["otherData"]
    assert other["clock"] == "simulated" and other["makespan"] == result.makespan


def test_ascii_chart() -> None:
    result = simulate(one_f_one_b(2, 2))
    chart = to_ascii(result, width=9)
    # makespan 9: rank 0 runs F F . . B B . B B (0B0 waits for 1B0).
    assert chart.splitlines()[1:] == ["0 |FF..BB.BB| bubble 0.333", "1 |.FBBFBB..| bubble 0.333"]
    with pytest.raises(ValueError):
        to_ascii(result, width=0)
