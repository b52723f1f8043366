"""Hang forensics: what each stage waits for, which send never happened, and the marked grid."""

from __future__ import annotations

import pytest

from schedulers.hang import StageProgress, diagnose
from schedulers.schedules import build_schedule

pytestmark = pytest.mark.timeout(30)


def programs(name: str = "1f1b", ranks: int = 2, microbatches: int = 4) -> dict[int, list[str]]:
    return {rank: [str(a) for a in p] for rank, p in build_schedule(name, ranks, microbatches).items()}


def at(rank: int, current: str | None, program: list[str] | None = None, done: int | None = None) -> StageProgress:
    """A stage at ``current`` (index from its program when ``done`` is not given)."""
    if done is None:
        assert program is not None and current is not None
        done = program.index(current)
    return StageProgress(rank=rank, current=current, done=done)


def test_a_receive_whose_send_was_never_reached_names_both_and_where_the_sender_is() -> None:
    p = programs()
    report = diagnose(p, {0: at(0, "0F3", p[0]), 1: at(1, "1RECV_F3", p[1])})
    assert report.lines[0] == "stage 1 waits at 1RECV_F3: stage 0 never reached 0SEND_F3 (stuck at 0F3)"
    assert report.lines[1] == f"stage 0 is computing 0F3 ({p[0].index('0F3')} of 16 actions done)"
    assert ">0F3<" in report.grid and ">1RECV_F3<" in report.grid
    assert report.marks == [(0, p[0].index("0F3")), (1, p[1].index("1RECV_F3"))]
    assert not report.settled
    assert str(report).endswith(report.grid)


@pytest.mark.parametrize(("rank0", "rank1", "expected"), [
    # Backward: stage 0 waits for stage 1's input gradient.
    ("0RECV_B1", "1F1", "stage 0 waits at 0RECV_B1: stage 1 never reached 1SEND_B1 (stuck at 1F1)"),
    # The sender is past its send: the value was lost on the way.
    ("0RECV_B0", "1RECV_F2", "stage 0 waits at 0RECV_B0: stage 1 sent it (1SEND_B0 done) but it has not arrived"),
    ("0RECV_B0", "1SEND_B0", "stage 0 waits at 0RECV_B0: stage 1 is sending it now (1SEND_B0)"),
])
def test_each_kind_of_unmatched_receive_is_explained(rank0: str, rank1: str, expected: str) -> None:
    p = programs()
    report = diagnose(p, {0: at(0, rank0, p[0]), 1: at(1, rank1, p[1])})
    assert expected in report.lines


def test_a_sender_at_the_barrier_or_silent_is_said_so() -> None:
    p = programs("gpipe", 2, 2)
    barrier = p[0].index("0BARRIER")
    report = diagnose(p, {0: at(0, None, done=barrier), 1: at(1, "1RECV_F1", p[1])})
    assert "stage 0 reached the barrier (8 of 8 actions done)" in report.lines
    report = diagnose(p, {0: "job0.rank0 did not answer (timed out)", 1: at(1, "1RECV_F0", p[1])})
    assert report.lines[0] == ("stage 1 waits at 1RECV_F0: stage 0 (job0.rank0 did not answer (timed out)) "
                               "should send it at 0SEND_F0")
    assert "stage 0: job0.rank0 did not answer (timed out)" in report.lines


def test_a_stage_that_has_not_started_the_step_is_not_taken_for_one_that_sent() -> None:
    p = programs()
    stale = StageProgress(rank=0, current=None, done=p[0].index("0BARRIER"), stale=True)
    report = diagnose(p, {0: stale, 1: at(1, "1RECV_F0", p[1])})
    assert report.lines[0] == "stage 1 waits at 1RECV_F0: stage 0 never reached 0SEND_F0 (not started this step)"
    assert "stage 0 has not started this step" in report.lines


def test_every_stage_at_its_barrier_is_settled_and_idle_between_steps() -> None:
    p = programs()
    done = {r: at(r, None, done=p[r].index(f"{r}BARRIER")) for r in p}
    assert diagnose(p, done).settled
    idle = diagnose(p, done, running=False)
    assert idle.lines[0].startswith("stage 0 is idle (its last step reached the barrier")
    assert ">0BARRIER<" in idle.grid


def test_interleaved_waits_look_up_the_virtual_stages_rank() -> None:
    p = {rank: [str(a) for a in prog] for rank, prog in build_schedule("interleaved", 2, 4, 2).items()}
    # Model stage 2 lives on rank 0 and waits for stage 1 (rank 1).
    report = diagnose(p, {0: at(0, "2RECV_F0", p[0]), 1: at(1, "1F0", p[1])})
    assert report.lines[0] == "stage 0 waits at 2RECV_F0: stage 1 never reached 1SEND_F0 (stuck at 1F0)"


def test_during_a_run_the_report_is_of_the_step_being_collected_not_the_one_sent_ahead() -> None:
    """Found by review: a run sends step N+1's orders while its stages finish step N, and the report took the
    newest step sent for the one in progress, so every stage still on N was 'has not started this step' and the
    grid lost its marks (a step timeout's report too). It is now of the step whose answers are awaited; a stage
    already on the next one finished it, at its barrier."""
    import asyncio

    from schedulers.job_views import JobViews
    from stages.mesh import Mesh
    from stages.records import ProgressReport

    p = programs()

    class Ref:
        def __init__(self, report: ProgressReport) -> None:
            self.report, self.name = report, f"rank{report.rank}"

        def endpoint(self, method: object, timeout: float) -> Ref:
            return self

        async def call(self) -> ProgressReport:
            return self.report

    class Job:
        mesh, programs, next_step, collecting = Mesh(pipeline=2), p, 8, 7
        lock = asyncio.Lock()
        stages: list[Ref] = []

    async def report(*answers: ProgressReport) -> tuple[str, list[str], list[int], list[int]]:
        Job.stages = [Ref(answer) for answer in answers]
        async with Job.lock:
            return await JobViews(Job()).hang_report()  # type: ignore[arg-type]

    # Both stages on step 7, step 8 sent ahead.
    text, lines, silent, busy = asyncio.run(report(ProgressReport(rank=0, step=7, current="0F3",
                                                                  done=p[0].index("0F3")),
                                             ProgressReport(rank=1, step=7, current="1RECV_F3",
                                                            done=p[1].index("1RECV_F3"))))
    assert silent == [] and busy == [0] and "has not started" not in text  # stage 0 computes; 1 waits
    assert lines[0] == "stage 1 waits at 1RECV_F3: stage 0 never reached 0SEND_F3 (stuck at 0F3)"
    assert ">0F3<" in text and ">1RECV_F3<" in text
    # Stage 1 in step 7's tail, stage 0 already on step 8: step 7 is done on both.
    text, lines, _, busy = asyncio.run(report(ProgressReport(rank=0, step=8, current="0F0", done=0),
                                        ProgressReport(rank=1, step=7, current=None, done=p[1].index("1BARRIER"))))
    assert lines == ["stage 0 reached the barrier (16 of 16 actions done)",
                     "stage 1 reached the barrier (16 of 16 actions done)"]
    assert ">0BARRIER<" in text and ">1BARRIER<" in text and busy == []  # stage 0 computes the next step


def test_a_trace_of_a_job_that_lost_a_node_says_so_at_once() -> None:
    """Found by review: 'trace JOB' after a node was lost waited 5 s per stage and said 'remote timeout: no reply
    from job0.rank0.clock'; it is a NodeLost naming the node now, before any stage is asked."""
    import asyncio

    from actors import NodeLost
    from schedulers.job_views import JobViews

    class Job:
        id, last_reports, last_stats, stages = "job0", [object()], object(), [object()]

        async def lost_member(self) -> str | None:
            return "node1"

    with pytest.raises(NodeLost, match="node node1 of job0 was lost"):
        asyncio.run(JobViews(Job()).trace())  # type: ignore[arg-type]
