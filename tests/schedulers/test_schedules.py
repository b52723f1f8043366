"""Tests for schedulers/schedules.py: generators, lowering passes, the registry and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.program import COMM_KINDS, Action, ActionKind
from schedulers.dataflow import Schedule
from schedulers.grid import format_grid, parse_grid
from schedulers.schedules import (
    SCHEDULES,
    add_send_recv,
    add_step_tail,
    build_schedule,
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    main,
    one_f_one_b,
    split_backward,
    zero_bubble_h1,
    zero_bubble_v,
)
from schedulers.simulate import simulate
from schedulers.validate import validate

ROOT = Path(__file__).resolve().parents[2]

# Expected schedules, written the way the grid prints them.
EXPECTED: dict[tuple[Callable[[int, int], Schedule], int, int], str] = {
    (gpipe, 2, 4): """
        0: 0F0 0F1 0F2 0F3 -   -   0B0 0B1 0B2 0B3
        1: -   1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3
    """,
    (one_f_one_b, 2, 4): """
        0: 0F0 0F1 -   0B0 0F2 0B1 0F3 0B2 -   0B3
        1: -   1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
    """,
    (one_f_one_b, 3, 2): """
        0: 0F0 0F1 -   -   -   0B0 -   0B1
        1: -   1F0 1F1 -   1B0 -   1B1
        2: -   -   2F0 2B0 2F1 2B1
    """,
    (zero_bubble_h1, 2, 4): """
        0: 0F0 0F1 -   0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3
        1: -   1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3
    """,
    (interleaved_1f1b, 2, 4): """
        0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 -   2B2 -   2B3 0B2 0B3
        1: -   1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
    """,
    (interleaved_1f1b, 1, 2): "0: 0F0 1F0 1B0 0F1 0B0 1F1 1B1 0B1",
    # In a V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2.
    (zero_bubble_v, 2, 4): """
        0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3
        1: -   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3
    """,
    (dualpipe_v, 2, 4): """
        0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3
        1: -   1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3
    """,
}


@pytest.mark.parametrize(("generator", "num_stages", "num_microbatches"), list(EXPECTED))
def test_small_schedules_match_their_text(
    generator: Callable[[int, int], Schedule], num_stages: int, num_microbatches: int
) -> None:
    text = EXPECTED[generator, num_stages, num_microbatches]
    schedule = generator(num_stages, num_microbatches)
    assert schedule == parse_grid(text)
    assert format_grid(schedule) == "\n".join(line.strip() for line in text.strip().splitlines())


def test_registry_names_every_generator() -> None:
    assert SCHEDULES == {
        "gpipe": gpipe,
        "1f1b": one_f_one_b,
        "interleaved": interleaved_1f1b,
        "zero_bubble": zero_bubble_h1,
        "zbv": zero_bubble_v,
        "dualpipev": dualpipe_v,
    }


def _torch_order(cls_name: str, num_ranks: int, num_microbatches: int) -> Schedule:
    """torch's own order for one of its V-shaped schedules, in our actions (overlapped pairs in turn)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    kinds = {"F": ActionKind.F, "I": ActionKind.I, "W": ActionKind.W, "B": ActionKind.B}
    cls = getattr(torch_schedules, cls_name)
    # The rank-order method reads only these three (no stages, no process group needed).
    shell = type("Shell", (), {"pp_group_size": num_ranks, "_n_microbatches": num_microbatches,
                               "num_stages": 2 * num_ranks})()
    order: Schedule = {}
    for rank in range(num_ranks):
        ops = [op for op in cls._calculate_single_rank_operations(shell, rank) if op is not None]
        flat = [sub for op in ops for sub in (op.sub_actions or (op,))]
        order[rank] = [Action(stage=a.stage_index, kind=kinds[a.computation_type.value],
                              microbatch=a.microbatch_index) for a in flat]
    return order


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 5])
def test_the_v_schedules_run_torch_s_order(num_ranks: int) -> None:
    # The same programs as torch 2.13's ScheduleZBVZeroBubble and ScheduleDualPipeV, which a
    # user moving from torch's pipelining gets, and every one of them validates.
    for m in range(1, 4 * num_ranks + 2):
        assert zero_bubble_v(num_ranks, m) == _torch_order("ScheduleZBVZeroBubble", num_ranks, m), m
        validate(zero_bubble_v(num_ranks, m))
        if m >= 2 * num_ranks:
            assert dualpipe_v(num_ranks, m) == _torch_order("ScheduleDualPipeV", num_ranks, m), m
            validate(dualpipe_v(num_ranks, m))


def test_a_v_schedule_turns_round_on_the_last_rank_without_a_transfer() -> None:
    lowered = build_schedule("zbv", 3, 6)
    layout = validate(lowered)
    assert layout.placement == "v" and layout.num_stages == 6
    assert [layout.rank_of(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    sends = {str(a) for program in lowered.values() for a in program if a.kind in COMM_KINDS}
    assert "2SEND_F0" not in sends and "3RECV_F0" not in sends  # stage 2 -> 3 stays on rank 2
    assert "1SEND_F0" in sends and "4SEND_F0" in sends
    # Rank 0 reads the inputs and computes the loss: nothing goes round from the last stage to the first.
    assert not any(a.stage == 5 and a.kind is ActionKind.SEND_F for a in lowered[0])


def test_interleaving_by_one_is_1f1b() -> None:
    assert interleaved_1f1b(4, 6, num_virtual_stages=1) == one_f_one_b(4, 6)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gpipe(0, 4), "num_stages >= 1, got 0"),
        (lambda: one_f_one_b(4, 0), "num_microbatches >= 1, got 0"),
        (lambda: zero_bubble_h1(-1, 4), "num_stages >= 1"),
        (lambda: interleaved_1f1b(4, 6), r"multiple of num_stages \(4\); got 6, try 4 or 8"),
        (lambda: interleaved_1f1b(4, 2), r"multiple of num_stages \(4\); got 2, try 4 or 8"),
        (lambda: interleaved_1f1b(4, 8, num_virtual_stages=0), "num_virtual_stages >= 1"),
        (lambda: build_schedule("interleaved", 4, 8, num_virtual_stages=0), "num_virtual_stages >= 1, got 0"),
        (lambda: build_schedule("pipedream", 4, 8), "unknown schedule 'pipedream'; choose one of"),
        (lambda: build_schedule("1f1b", 4, 8, num_virtual_stages=2), "use 'interleaved'"),
        (lambda: dualpipe_v(3, 5), r"at least as many micro-batches as model stages \(6 for 3 ranks\), got 5"),
        (lambda: build_schedule("zbv", 4, 8, num_virtual_stages=3), "two model stages per rank, in a V"),
    ],
)
def test_impossible_arguments_say_what_would_work(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def _sizes(draw: st.DrawFn, name: str) -> tuple[int, int, int | None]:
    num_stages = draw(st.integers(1, 6))
    if name == "interleaved":
        virtual = draw(st.integers(1, 3))
        return num_stages, num_stages * draw(st.integers(1, 3)), virtual
    if name == "dualpipev":
        return num_stages, draw(st.integers(2 * num_stages, 2 * num_stages + 6)), None
    return num_stages, draw(st.integers(1, 12)), None


@st.composite
def generated(draw: st.DrawFn) -> tuple[str, int, int, int | None]:
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    return (name, *_sizes(draw, name))


@settings(max_examples=200)
@given(generated())
def test_every_generated_schedule_validates(case: tuple[str, int, int, int | None]) -> None:
    name, num_stages, num_microbatches, virtual = case
    lowered = build_schedule(name, num_stages, num_microbatches, virtual)
    layout = validate(lowered)
    assert layout.num_ranks == num_stages and layout.num_microbatches == num_microbatches
    assert layout.num_stages == num_stages * (virtual or (2 if name in ("zbv", "dualpipev") else 1))
    extra = {"num_virtual_stages": virtual} if virtual else {}
    validate(SCHEDULES[name](num_stages, num_microbatches, **extra))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_lowering_puts_receives_before_and_sends_after_compute(name: str) -> None:
    lowered = build_schedule(name, 4, 8)
    for rank, program in lowered.items():
        assert [str(a) for a in program[-3:]] == [f"{rank}BARRIER", f"{rank}REDUCE", f"{rank}STEP"]
        for i, a in enumerate(program):
            if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                consumer = program[i + 1]
                assert consumer.stage == a.stage and consumer.microbatch == a.microbatch
                is_forward = a.kind is ActionKind.RECV_F
                needs_it = {ActionKind.F} if is_forward else {ActionKind.B, ActionKind.I}
                assert consumer.kind in needs_it
            if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                producer = program[i - 1]
                assert producer.stage == a.stage and producer.microbatch == a.microbatch


def test_lowering_counts() -> None:
    # 4 stages, 8 micro-batches: 3 links, each carries 8 activations and 8 gradients.
    lowered = add_send_recv(one_f_one_b(4, 8))
    kinds = [a.kind for p in lowered.values() for a in p]
    for kind in COMM_KINDS:
        assert kinds.count(kind) == 3 * 8


@pytest.mark.parametrize(("num_stages", "num_virtual_stages"), [(1, 1), (1, 2), (1, 3)])
def test_stages_sharing_a_rank_hand_over_locally(num_stages: int, num_virtual_stages: int) -> None:
    compute = interleaved_1f1b(num_stages, 3, num_virtual_stages)
    assert add_send_recv(compute) == compute


def test_split_backward_sends_after_input_grad() -> None:
    lowered = add_send_recv(zero_bubble_h1(2, 1))
    assert lowered == parse_grid(
        """
        0: 0F0 0SEND_F0 0RECV_B0 0I0 0W0
        1: 1RECV_F0 1F0 1I0 1SEND_B0 1W0
        """
    )


def test_split_backward_keeps_1f1b_order_and_sends_before_the_weight_gemms() -> None:
    # Stage 0 sends no input gradient and keeps its B; stage 1's B becomes I, W with
    # the send between them.
    assert split_backward(one_f_one_b(2, 2)) == parse_grid(
        """
        0: 0F0 0F1 0B0 0B1
        1: 1F0 1I0 1W0 1F1 1I1 1W1
        """
    )
    lowered = build_schedule("1f1b", 2, 2, split=True)
    assert lowered[1][:5] == parse_grid("1RECV_F0 1F0 1I0 1SEND_B0 1W0")[0]
    validate(lowered)  # raises on a broken dependency


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_split_backward_shortens_the_simulated_step(name: str) -> None:
    plain, split = (simulate(build_schedule(name, 4, 8, split=s)) for s in (False, True))
    assert split.makespan < plain.makespan
    assert split.peak_stash == plain.peak_stash


def test_split_backward_leaves_rank_local_boundaries_and_zero_bubble_alone() -> None:
    local = interleaved_1f1b(1, 3, 2)  # both model stages on one rank
    assert split_backward(local) == local
    zb = zero_bubble_h1(4, 8)
    assert split_backward(zb) == zb


def test_step_tail_is_appended_per_rank() -> None:
    assert add_step_tail({0: [Action.parse("0F0")], 1: []}) == parse_grid(
        "0: 0F0 0BARRIER 0REDUCE 0STEP\n1: 1BARRIER 1REDUCE 1STEP"
    )


def test_main_prints_grid_makespan_and_bubble(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.json"
    argv = ["--schedule", "interleaved", "--stages", "2", "--micro-batches", "4"]
    assert main([*argv, "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "0: 0F0 0F1 2F0" in out
    assert "makespan: 27" in out and "bubble_fraction: 0.1111" in out.splitlines()
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}


def test_main_rejects_impossible_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--schedule", "interleaved", "--stages", "4", "--micro-batches", "6"])
    assert info.value.code == 2
    assert "try 4 or 8" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # it ended in a traceback (found by review)
        main(["--width", "0"])
    assert info.value.code == 2 and "argument --width: must be >= 1, got 0" in capsys.readouterr().err


def test_main_splits_backward_on_request(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--schedule", "1f1b", "--stages", "2", "--micro-batches", "8", "--split-backward"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "makespan: 26" in out and "bubble_fraction: 0.0769" in out


def test_the_old_micro_batches_flag_is_an_error_that_names_the_new_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--schedule", "1f1b", "--stages", "2"]
    assert main([*argv, "--micro-batches", "8"]) == 0
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--microbatches", "8"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --microbatches 8; did you mean --micro-batches?" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_command_line_prints_the_1f1b_bubble() -> None:
    command = [sys.executable, "-m", "schedulers.schedules"]
    command += ["--schedule", "1f1b", "--stages", "4", "--micro-batches", "8"]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert "bubble_fraction: 0.2727" in done.stdout.splitlines()
    assert done.stderr == ""
