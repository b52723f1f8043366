"""schedule="auto" (schedulers/planning.py): costs measured from a step, candidates simulated, the choice.

The pure tests feed the planner stage reports made from a simulated step, so the
costs it should find are known exactly. The cluster tests (slow) run auto jobs: the
choice trains exactly like the same job on the chosen schedule, ``job.plan()`` lists
the candidates with their predictions, a limit nothing fits fails the planning step
with nothing applied, and the console's ``set JOB schedule auto`` hands a running job
to the planner.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import pytest
import torch
from rich.console import Console

from actors import RemoteError
from stages import Mesh, StageReport
from schedulers import Cluster, JobSpec
from schedulers.console.commands import execute
from schedulers.console.session import Session
from schedulers.jobs import AUTO_PROBE
from schedulers.planning import (
    PROBE_STEPS,
    AutoSchedule,
    NoScheduleFits,
    advise,
    choose,
    measure_costs,
    probe_steps,
    rank_candidates,
)
from schedulers.records import Candidate, MeasuredCosts
from schedulers.schedules import build_schedule
from schedulers.simulate import Costs, simulate

pytestmark = pytest.mark.timeout(600)

MODEL, KWARGS = "examples.models:residual_mlp", {"blocks": 4, "dim": 16, "hidden": 32}
UNIT = 1 << 20  # stash bytes a micro-batch holds on a rank, in these tests


def costs(*, stash: list[float] | None = None, overhead_s: float = 0.0, **per_rank: list[float]) -> MeasuredCosts:
    """Uniform costs on four ranks (F = I = W = 1, B = 2), with ``per_rank`` overrides."""
    base: dict[str, Any] = {"forward": [1.0] * 4, "backward": [2.0] * 4, "input_grad": [1.0] * 4,
                            "weight_grad": [1.0] * 4, "stash_bytes": stash or [UNIT] * 4}
    return MeasuredCosts(**{**base, **per_rank}, overhead_s=overhead_s)


def by_label(candidates: list[Candidate]) -> dict[str, Candidate]:
    return {c.label: c for c in candidates}


# -- the choice, with given costs ----------------------------------------------------------


def test_the_fastest_candidate_wins_and_interleaving_is_only_advised() -> None:
    ranked = rank_candidates(costs(overhead_s=0.5), num_microbatches=8)
    found = by_label(ranked)
    # ZB-H1 at 4 stages x 8 micro-batches, F = I = W = 1: makespan 27 against 1F1B's and GPipe's 30 (33
    # with whole backwards; split, a stage sends its input gradient after I), plus the overhead.
    assert [c.predicted_step_s for c in ranked] == sorted(c.predicted_step_s for c in ranked)
    assert found["zero_bubble"].predicted_step_s == 27.5 and found["1f1b"].predicted_step_s == 30.5
    assert [c.label for c in ranked if c.chosen] == ["zero_bubble"]
    assert found["zero_bubble"].stash == [4, 4, 4, 4] and found["zero_bubble"].stash_bytes == [4 * UNIT] * 4
    assert found["gpipe"].stash == [8, 8, 8, 8]
    # Interleaving re-partitions the model: predicted (here it would be faster), never chosen.
    interleaved = [c for c in ranked if c.schedule == "interleaved"]
    assert [c.virtual_stages for c in interleaved] == [4, 3, 2]
    assert not any(c.runnable or c.chosen for c in interleaved)
    assert interleaved[0].predicted_step_s < found["zero_bubble"].predicted_step_s


def test_the_v_shaped_schedules_are_weighed_and_run_where_the_job_is_cut_for_them() -> None:
    ranked = rank_candidates(costs(), num_microbatches=8)
    found = by_label(ranked)
    # ZB-V and DualPipeV (two stages per rank in a V, each half its rank's cost): predicted from the same
    # costs, and at F = I = W the V's bubble is smaller than ZB-H1's; advised only on this partition.
    zbv, dualpipev = found["zbv x2"], found["dualpipev x2"]
    assert zbv.predicted_step_s < found["zero_bubble"].predicted_step_s
    assert dualpipev.predicted_step_s < found["zero_bubble"].predicted_step_s
    assert not (zbv.runnable or dualpipev.runnable or zbv.chosen)
    # A job cut in a V runs them, not the interleaved candidate with as many stages per rank.
    cut = by_label(rank_candidates(costs(), num_microbatches=8, virtual_stages=2, placement="v"))
    assert cut["zbv x2"].runnable and cut["dualpipev x2"].runnable and not cut["interleaved x2"].runnable
    assert [c.label for c in cut.values() if c.chosen] in (["zbv x2"], ["dualpipev x2"])
    assert cut["zbv x2"].stash_bytes == [int(n * UNIT / 2) for n in cut["zbv x2"].stash]


def test_a_stash_limit_that_excludes_the_fastest_picks_the_next() -> None:
    # The last rank's activations are three times larger: ZB-H1 holds 4 of them there, 1F1B one.
    heavy = costs(stash=[UNIT, UNIT, UNIT, 3 * UNIT])
    assert by_label(rank_candidates(heavy, num_microbatches=8))["zero_bubble"].chosen
    ranked = rank_candidates(heavy, num_microbatches=8, max_stash_bytes=4 * UNIT)
    found = by_label(ranked)
    assert found["zero_bubble"].stash_bytes == [4 * UNIT, 4 * UNIT, 4 * UNIT, 12 * UNIT]
    assert not found["zero_bubble"].fits and not found["gpipe"].fits
    assert found["1f1b"].fits and found["1f1b"].chosen  # 4, 3, 2 and 1 micro-batches: 4 MiB at most
    assert [c.label for c in ranked if c.chosen] == ["1f1b"]


def test_a_limit_nothing_fits_is_an_error_that_says_what_would() -> None:
    with pytest.raises(NoScheduleFits, match=f"no schedule fits max_stash_bytes={4 * UNIT - 1}: the least any "
                                             f"would hold on one stage actor is {4 * UNIT} bytes \\(zero_bubble, 4 "
                                             f"micro-batches of activations\\); raise max_stash_bytes to at least "
                                             f"{4 * UNIT}"):
        rank_candidates(costs(), num_microbatches=8, max_stash_bytes=4 * UNIT - 1)
    assert issubclass(NoScheduleFits, ValueError)


def test_ties_go_to_the_smaller_stash_then_the_candidates_order() -> None:
    # Two stages, the first twice as slow: every schedule waits on it alike.
    slow_first = MeasuredCosts(forward=[2.0, 1.0], backward=[4.0, 2.0], input_grad=[2.0, 1.0],
                               weight_grad=[2.0, 1.0], stash_bytes=[UNIT, UNIT])
    found = by_label(rank_candidates(slow_first, num_microbatches=4))
    assert found["1f1b"].predicted_step_s == found["zero_bubble"].predicted_step_s
    assert found["1f1b"].chosen  # 2 and 1 micro-batches held, against 2 and 2


def test_choose_takes_the_first_runnable_candidate_that_fits() -> None:
    def candidate(name: str, runnable: bool = True, fits: bool = True) -> Candidate:
        return Candidate(schedule=name, predicted_step_s=1.0, bubble_fraction=0.0, stash=[1], stash_bytes=[1],
                         runnable=runnable, fits=fits)

    assert choose([candidate("a", runnable=False), candidate("b", fits=False), candidate("c")]).schedule == "c"
    with pytest.raises(NoScheduleFits, match="no candidate schedule runs on this job's partition"):
        choose([candidate("a", runnable=False)])


def test_micro_batches_interleaving_cannot_take_leave_it_out() -> None:
    ranked = rank_candidates(costs(), num_microbatches=6)  # not a multiple of the 4 stages, under 8 model stages
    assert {c.schedule for c in ranked} == {"gpipe", "1f1b", "zero_bubble", "zbv"}  # ZB-V takes any count


# -- costs, measured from a step ------------------------------------------------------------


def simulated_reports(name: str, truth: Costs, *, num_stages: int = 2, num_microbatches: int = 4,
                      stash: float = UNIT, tail_s: float = 0.25, batch_w: bool = False
                      ) -> tuple[list[StageReport], float]:
    """Stage reports of a step that ran exactly as the simulator times ``name`` under ``truth``."""
    program = build_schedule(name, num_stages, num_microbatches, split=True, batch_w=batch_w)
    result = simulate(program, truth)
    reports = []
    for rank, stats in enumerate(result.ranks):
        spans = [[str(e.action), e.start, e.end] for e in result.events
                 if e.rank == rank and e.action.microbatch is not None]
        codec_stats = {}
        for kind, edge in (("SEND_F", f"F {rank}->{rank + 1}"), ("SEND_B", f"B {rank}->{rank - 1}")):
            sends = sum(1 for span in spans if kind in span[0])
            if sends:
                raw = sends * truth.activation_bytes
                codec_stats[edge] = {"codec": "x", "bytes": int(raw / 2), "raw_bytes": int(raw), "sq_err": 0.0,
                                     "sq_norm": 0.0}
        reports.append(StageReport(status="done", spans=spans, elapsed_s=max(s[2] for s in spans),
                                   busy_s=stats.busy, peak_stash=stats.peak_stash,
                                   peak_stash_bytes=int(stats.peak_stash * stash), codec_stats=codec_stats))
    return reports, result.makespan + tail_s


TRUTH = Costs(forward=(0.30, 0.20), input_grad=(0.20, 0.25), weight_grad=(0.10, 0.15), backward=(0.30, 0.40),
              activation_bytes=1000.0, bandwidth=1e4, codec_ratio=0.5)


def test_a_probe_step_gives_back_the_costs_it_ran_with() -> None:
    reports, step_time = simulated_reports(AUTO_PROBE, TRUTH)
    found = measure_costs(reports, Mesh(pipeline=2), step_time_s=step_time, step=7)
    assert found.forward == pytest.approx([0.30, 0.20])
    assert found.input_grad == pytest.approx([0.20, 0.25]) and found.weight_grad == pytest.approx([0.10, 0.15])
    assert found.backward == pytest.approx([0.30, 0.40])  # zero-bubble splits every B: I + W
    assert found.stash_bytes == pytest.approx([UNIT, UNIT])
    assert (found.transfer_bytes, found.forward_ratio, found.backward_ratio) == (1000.0, 0.5, 0.5)
    assert found.bandwidth == pytest.approx(1e4)  # 500 bytes on the wire in 0.05 s each way
    assert found.overhead_s == pytest.approx(0.25) and found.step == 7
    # And the plan predicts that very step: its makespan plus what ran outside the programs.
    ranked = rank_candidates(found, num_microbatches=4)
    assert by_label(ranked)[AUTO_PROBE].predicted_step_s == pytest.approx(step_time)


def test_a_backward_that_ran_whole_is_split_as_the_measured_ones_are() -> None:
    # 1F1B splits only the backward whose gradient leaves the rank: stage 0 ran B, stage 1 I and W.
    reports, _ = simulated_reports("1f1b", TRUTH)
    found = measure_costs(reports, Mesh(pipeline=2))
    assert found.backward == pytest.approx([0.30, 0.40])
    share = 0.25 / 0.40  # stage 1's I / (I + W)
    assert found.input_grad == pytest.approx([0.30 * share, 0.25])
    assert found.weight_grad == pytest.approx([0.30 * (1 - share), 0.15])
    assert found.overhead_s == 0.0  # no step time given


def test_a_batched_run_of_ws_counts_as_its_share_per_micro_batch() -> None:
    # W batching defers every W to the tail, where the executor runs the whole run in the last one.
    reports, _ = simulated_reports(AUTO_PROBE, TRUTH, batch_w=True)
    batched = []
    for report in reports:
        spans = [list(span) for span in report.spans]
        ws = [span for span in spans if "W" in span[0]]
        total = sum(end - start for _, start, end in ws)
        for span in ws[:-1]:
            span[2] = span[1]
        ws[-1][1] = ws[-1][2] - total
        batched.append(dataclasses.replace(report, spans=spans))
    found = measure_costs(batched, Mesh(pipeline=2))
    assert found.weight_grad == pytest.approx([0.10, 0.15]) and found.input_grad == pytest.approx([0.20, 0.25])
    ranked = by_label(rank_candidates(found, num_microbatches=4, batch_w=True))
    assert ranked["1f1b +wbatch"].stash == [4, 4]  # every W waits for the tail: each stage holds every micro-batch


def test_a_report_missing_is_refused() -> None:
    reports, _ = simulated_reports(AUTO_PROBE, TRUTH)
    with pytest.raises(ValueError, match="a finished step's report from each of the 2 stage actors"):
        measure_costs(reports[:1], Mesh(pipeline=2))


def test_with_a_measured_batched_w_every_schedule_is_a_candidate_with_and_without_w_batching() -> None:
    cheap = costs(weight_grad_batched=[0.25] * 4)  # a batched W costs a quarter of one micro-batch's
    ranked = rank_candidates(cheap, num_microbatches=8)
    labels = {c.label for c in ranked if c.runnable}
    assert labels == {"1f1b", "1f1b +wbatch", "zero_bubble", "zero_bubble +wbatch", "gpipe", "gpipe +wbatch"}
    best = next(c for c in ranked if c.chosen)
    assert best.w_batching and best is next(c for c in ranked if c.runnable)  # cheaper Ws: batching wins
    plain = by_label(ranked)[best.label.removesuffix(" +wbatch")]
    assert max(best.stash_bytes) > max(plain.stash_bytes)  # it holds every micro-batch until the tail
    assert best.predicted_step_s < plain.predicted_step_s
    # Memory decides when batching does not fit.
    limited = rank_candidates(cheap, num_microbatches=8, max_stash_bytes=max(plain.stash_bytes))
    assert not next(c for c in limited if c.chosen).w_batching
    # A batched W that costs as much as the plain ones gains nothing and holds more: never chosen.
    assert not next(c for c in rank_candidates(costs(weight_grad_batched=[1.0] * 4), num_microbatches=8)
                    if c.chosen).w_batching
    # Without fused weight gradients there is no W batching to choose.
    assert not any(c.w_batching for c in rank_candidates(cheap, num_microbatches=8, split=False))


def test_auto_probes_w_batching_between_the_warm_up_and_the_timed_step() -> None:
    spec = JobSpec.of(model=MODEL, pipeline_stages=2, micro_batches=4, schedule="auto")
    auto = AutoSchedule(spec)
    assert probe_steps(spec) == PROBE_STEPS + 1 == 3
    assert probe_steps(spec.replace(gradient_accumulation_fusion=False)) == PROBE_STEPS
    ran = []
    for _ in range(2):
        ran.append(auto.running_w_batching(spec))
        reports, _ = simulated_reports(AUTO_PROBE, TRUTH)
        auto.probed(reports, Mesh(pipeline=2))
        auto.warmed_up()
    assert ran == [True, True] and auto.timed and not auto.running_w_batching(spec)
    assert auto.weight_grad_batched == pytest.approx([0.10, 0.15])  # TRUTH.weight_grad
    reports, _ = simulated_reports(AUTO_PROBE, TRUTH)
    ranked = auto.rank(spec, reports, Mesh(pipeline=2), step=2)
    assert any(c.w_batching for c in ranked) and auto.costs is not None
    assert auto.costs.weight_grad_batched == auto.weight_grad_batched
    auto.adopt(ranked, overhead_s=0.0)
    assert auto.running_w_batching(spec) == auto.chosen.w_batching  # type: ignore[union-attr]


def test_under_a_stash_limit_auto_probes_no_w_batching_which_would_hold_every_micro_batch() -> None:
    """Found by review: with max_stash_bytes the probe steps still batched their Ws, holding all 8 micro-batches
    (three times the limit) before any plan existed, on a schedule the plan then marked as not fitting."""
    spec = JobSpec.of(model=MODEL, pipeline_stages=2, micro_batches=8, schedule="auto", max_stash_bytes=1 << 40)
    auto = AutoSchedule(spec)
    assert probe_steps(spec) == PROBE_STEPS
    ran = []
    while not auto.timed:
        ran.append(auto.running_w_batching(spec))
        auto.warmed_up()
    assert ran == [False] * (PROBE_STEPS - 1) and not auto.running_w_batching(spec)
    reports, _ = simulated_reports(AUTO_PROBE, TRUTH)
    assert not any(c.w_batching for c in auto.rank(spec, reports, Mesh(pipeline=2), step=PROBE_STEPS - 1))


def test_auto_measures_on_the_probe_schedule_then_runs_its_choice() -> None:
    spec = JobSpec.of(model=MODEL, pipeline_stages=2, micro_batches=4, schedule="auto",
                      gradient_accumulation_fusion=False)
    auto = AutoSchedule(spec)
    assert auto.running(spec) == AUTO_PROBE and auto.measuring and probe_steps(spec) == 2
    assert auto.plan("job0", spec).state == "measuring"
    assert auto.warmed_up() and auto.timed
    reports, step_time = simulated_reports(AUTO_PROBE, TRUTH)
    ranked = auto.rank(spec, reports, Mesh(pipeline=2), step=1)
    auto.adopt(ranked, overhead_s=0.25)
    chosen = auto.chosen
    assert chosen is not None and not auto.measuring and auto.running(spec) == chosen.schedule
    assert auto.prediction(AUTO_PROBE if chosen.schedule != AUTO_PROBE else "gpipe", 1.0) == (None, None)
    predicted, error = auto.prediction(chosen.schedule, 2 * chosen.predicted_step_s)
    assert predicted == chosen.predicted_step_s and error == pytest.approx(1.0)
    plan = auto.plan("job0", spec)
    assert (plan.state, plan.chosen, plan.prediction_error) == ("planned", chosen.label, pytest.approx(1.0))
    assert plan.costs is not None and plan.costs.overhead_s == 0.25
    auto.reset(spec.replace(micro_batches=8))  # a setting changed: measure again
    assert auto.measuring and auto.chosen is None


def test_a_fixed_schedule_gets_advice_from_its_last_step() -> None:
    spec = JobSpec.of(model=MODEL, pipeline_stages=2, micro_batches=4, schedule="gpipe")
    reports, step_time = simulated_reports("gpipe", TRUTH)
    plan = advise("job3", spec, reports, Mesh(pipeline=2), offsets=None, step_time_s=step_time, step=3)
    assert (plan.state, plan.running, plan.costs and plan.costs.step) == ("advice", "gpipe", 3)
    assert by_label(plan.candidates)["gpipe"].predicted_step_s == pytest.approx(step_time)
    assert sum(c.chosen for c in plan.candidates) == 1 and plan.chosen in by_label(plan.candidates)


# -- on a cluster ----------------------------------------------------------------------------


def batches(num_steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, 16, generator=generator), torch.randn(8, 4, 16, generator=generator))
            for _ in range(num_steps)]


async def train(cluster: Cluster, steps: list[tuple[torch.Tensor, torch.Tensor]], **options: Any) -> tuple[
        list[Any], dict[str, torch.Tensor], Any]:
    job = await cluster.train(model=MODEL, model_kwargs=KWARGS, pipeline_stages=2, micro_batches=4, seed=0,
                              optimizer=("torch.optim:Adam", {"lr": 1e-3}), **options)
    try:
        stats = [await job.step(x, y) for x, y in steps]
        return stats, await job.state_dict(), await job.plan()
    finally:
        await job.close()


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.parametrize("options", [{"gradient_accumulation_fusion": False}, {"fusion_min_weight_elements": 0}],
                         ids=["plain", "fused"])
@pytest.mark.multiprocess
async def test_an_auto_job_trains_exactly_as_the_schedule_it_chose(cluster: Cluster, options: dict[str, Any]) -> None:
    spec = JobSpec.of(model=MODEL, schedule="auto", **options)
    probes = probe_steps(spec)
    steps = batches(probes + 2)
    stats, state, plan = await train(cluster, steps, schedule="auto", **options)
    assert plan.state == "planned" and plan.schedule == "auto"
    chosen = [c for c in plan.candidates if c.chosen]
    assert len(chosen) == 1 and chosen[0].label == plan.chosen and chosen[0].schedule == plan.running
    assert chosen[0] == next(c for c in plan.candidates if c.runnable and c.fits)  # the fastest it may run
    plain = {"gpipe", "1f1b", "zero_bubble"}
    fused = spec.runtime.gradient_accumulation_fusion  # then each with W batching too (measured by a probe step)
    assert {c.label for c in plan.candidates if c.runnable} == plain | ({f"{n} +wbatch" for n in plain} if fused
                                                                        else set())
    assert plan.costs is not None and (plan.costs.weight_grad_batched is not None) == fused
    for c in plan.candidates:
        assert c.predicted_step_s > 0 and len(c.stash) == len(c.stash_bytes) == 2 and min(c.stash_bytes) > 0
    assert [s.schedule for s in stats] == [AUTO_PROBE] * probes + [plan.running] * 2
    assert [s.predicted_step_s for s in stats] == [None] * probes + [chosen[0].predicted_step_s] * 2
    last = stats[-1]
    assert last.prediction_error == pytest.approx((last.step_time_s - last.predicted_step_s) / last.predicted_step_s)
    assert plan.last_step_s == last.step_time_s
    # The same job on the chosen schedule throughout: the same losses and parameters. The
    # probe step with W batching sums each weight gradient's micro-batches in one GEMM:
    # equal to float32 rounding, not bit for bit.
    fixed_stats, fixed_state, advice = await train(cluster, steps, schedule=plan.running,
                                                   w_batching=chosen[0].w_batching, **options)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if fused else {"rtol": 0, "atol": 0}
    torch.testing.assert_close([s.loss for s in stats], [s.loss for s in fixed_stats], **tolerance)
    assert list(state) == list(fixed_state)
    for key, value in fixed_state.items():
        torch.testing.assert_close(state[key], value, **tolerance, msg=lambda m: f"{key}: {m}")
    assert advice.state == "advice" and advice.running == plan.running and advice.candidates


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.multiprocess
async def test_a_stash_limit_nothing_fits_fails_the_planning_step_with_nothing_applied(cluster: Cluster) -> None:
    x, y = batches(1)[0]
    job = await cluster.train(model=MODEL, model_kwargs=KWARGS, pipeline_stages=2, micro_batches=4, seed=0,
                              schedule="auto", max_stash_bytes=1)
    try:
        assert (await job.plan()).state == "measuring"
        probes = probe_steps(JobSpec.of(model=MODEL, schedule="auto", max_stash_bytes=1))
        for _ in range(probes - 1):
            await job.step(x, y)  # the probe steps before the timed one are ordinary steps
        before = await job.state_dict()
        with pytest.raises(RemoteError, match="no schedule fits max_stash_bytes=1: the least any would hold"):
            await job.step(x, y)
        after = await job.state_dict()
        assert (await job.describe()).steps == probes - 1
    finally:
        await job.close()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.multiprocess
async def test_set_schedule_auto_from_the_console_plans_a_running_job(cluster: Cluster) -> None:
    out = io.StringIO()
    session = Session(cluster, Console(file=out, width=200), interactive=False)
    x, y = batches(1)[0]
    job = await cluster.train(model=MODEL, model_kwargs=KWARGS, pipeline_stages=2, micro_batches=4, seed=0)
    try:
        assert (await job.plan()).state == "no_steps"
        await job.step(x, y)
        assert await job.plan() == await job.plan()  # until the next step, the same advice
        await execute(session, ["schedule", job.id])  # a fixed schedule: what auto would run
        assert f"{job.id}: schedule 1f1b; from step 0's costs, auto would run" in out.getvalue()
        await execute(session, ["set", job.id, "schedule", "auto"])
        assert f"{job.id}: schedule=auto set" in out.getvalue()
        probes = probe_steps(JobSpec.of(model=MODEL, schedule="auto"))
        stats = [await job.step(x, y) for _ in range(probes + 1)]
        await execute(session, ["schedule", job.id])
        await execute(session, ["status", job.id])
        plan = await job.plan()
    finally:
        await job.close()
    plan_text = out.getvalue()
    running = stats[-1].schedule
    assert plan.chosen is not None and plan.chosen.split()[0] == running  # "zero_bubble" or "zero_bubble +wbatch"
    assert [s.schedule for s in stats[:probes]] == [AUTO_PROBE] * probes
    assert f"{job.id}: schedule auto runs {plan.chosen}, planned from step {probes}" in plan_text
    assert f"* {plan.chosen}" in plan_text
    assert f"{job.id}: auto ({running}), 2 stages" in plan_text  # the grid is what runs
    assert "against the prediction" in plan_text and "(predicted " in plan_text



@pytest.mark.parametrize(("stages", "schedule", "virtual"), [(1, "zbv", 2), (1, "dualpipev", 2), (1, "interleaved", 2),
                                                            (2, "interleaved", 5)])
def test_a_fixed_schedule_is_always_a_candidate_of_its_own_advice(stages: int, schedule: str, virtual: int) -> None:
    # job.plan() of such a job failed with NoScheduleFits: no candidate ran its partition (one rank
    # skipped every schedule of several chunks; interleaved stops at x4), where the job runs one.
    costs = MeasuredCosts(forward=[1.0] * stages, backward=[2.0] * stages, input_grad=[1.0] * stages,
                          weight_grad=[1.0] * stages, stash_bytes=[1 << 20] * stages)
    placement = "v" if schedule in ("zbv", "dualpipev") else "loop"
    with pytest.raises(NoScheduleFits):
        rank_candidates(costs, num_microbatches=4, virtual_stages=virtual, placement=placement)
    ranked = rank_candidates(costs, num_microbatches=4, virtual_stages=virtual, placement=placement,
                             own=(schedule, virtual))
    chosen = [c for c in ranked if c.chosen]
    assert [(c.schedule, c.virtual_stages, c.runnable) for c in chosen] == [(schedule, virtual, True)]
