# .venv/bin/python -m pytest -q -p no:cacheprovider tests/schedulers/test_self_evaluations.py
"""A job's own evaluations (schedulers.self_evaluations), on a stand-in for the job: when they come, once
each, before a save due at the same step, what they record, and what a lost node does to one. The
evaluations themselves, against one process, are tests/schedulers/test_runs.py's, on nodes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from actors import NodeLost, StepFailed
from schedulers import evaluation, job_state
from schedulers.checkpoint_paths import CheckpointPath
from schedulers.events import CheckpointSaved, EarlyStopped, Evaluated
from schedulers.jobs import JobSpec
from schedulers.records import EvalResult
from schedulers.self_evaluations import BetweenSteps, SelfEvaluations
from schedulers.self_saves import SelfSaves

MODEL = "examples.models:residual_mlp"
VALIDATION = dict(model=MODEL, eval_data="examples.data:regression_batches", eval_batches=4)


@dataclass
class Job:
    """What SelfEvaluations reads of a job: its spec, id, applied steps, recovery budget, and its events."""

    spec: JobSpec
    id: str = "job0"
    applied: int = 0
    placer: Any = None
    restarts: int = 0
    loads: int = 0  # whole checkpoints loaded (JobCore.loaded)
    events: list[Any] = field(default_factory=list)

    def publish(self, event: Any) -> None:
        self.events.append(event)

    async def lost_member(self) -> str | None:  # every member is there (a lost one: tests/schedulers/test_recovery.py)
        return None

    @contextlib.asynccontextmanager
    async def operation(self) -> AsyncIterator[None]:  # job.save holds the job as JobCore's does
        yield


class Monitors:
    def __init__(self) -> None:
        self.recorded: list[tuple[float, int]] = []

    def record_evaluation(self, result: EvalResult, step: int) -> None:
        self.recorded.append((result.loss, step))


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, Any]]:
    """Every evaluation schedulers.evaluation.evaluate was asked for: (applied, data_step); its loss is the
    applied step count. A job whose ``fail`` attribute is set fails with that instead."""
    calls: list[tuple[int, Any]] = []

    async def evaluate(job: Job, path: Any, inputs: Any, targets: Any, *, outputs: bool = False,
                       data_step: int | None = None) -> EvalResult:
        if getattr(job, "fail", None) is not None:
            raise job.fail  # type: ignore[attr-defined]
        calls.append((job.applied, data_step))
        validation = evaluation.on_validation(job.spec, inputs, targets, data_step)
        return EvalResult(loss=float(job.applied), items=32.0, eval_time_s=0.5,
                          batches=job.spec.evaluation.eval_batches if validation else 1)

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    return calls


async def test_a_job_evaluates_after_every_nth_applied_step_once_and_records_each_evaluation(
        asked: list[Any]) -> None:
    job, monitors = Job(JobSpec.of(**VALIDATION, eval_every=3)), Monitors()
    evals = SelfEvaluations(job, None, monitors)  # type: ignore[arg-type]
    assert not evals.eval_point(0)  # none before the first step
    for applied in range(1, 8):
        job.applied = applied
        assert evals.eval_point(applied) == (applied % 3 == 0)
        await evals.evaluate_if_due()
    await evals.evaluate_if_due()  # the same point asked again (a step and a run): once
    result = await evals.evaluate(data_step=2)  # job.evaluate on the data factory's batch 2
    assert asked == [(3, None), (6, None), (7, 2)] and result.loss == 7.0
    assert monitors.recorded == [(3.0, 3), (6.0, 6), (7.0, 7)]
    assert [(e.step, e.loss, e.periodic, e.validation, e.batches) for e in job.events] == [
        (3, 3.0, True, True, 4), (6, 6.0, True, True, 4), (7, 7.0, False, False, 1)]
    assert evals.last is job.events[-1]  # what the job's description shows
    assert SelfEvaluations(Job(JobSpec.of(model=MODEL), applied=3), None, None).eval_point(3) is False  # type: ignore[arg-type]


async def test_after_loading_an_older_checkpoint_the_evaluation_and_save_points_come_again(
        asked: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # Steps 1-4 evaluate and save at 2 and 4; job.load of the step-2 version, then steps 3-4 again: the
    # points at 4 come again (they were skipped: already taken at that step count). A recovery's replay,
    # which loads nothing, still takes each point once.
    saves: list[int] = []

    async def save(job: Job, path: CheckpointPath, keep: int = 1, spare: str | None = None,
                   evaluations: dict[str, Any] | None = None) -> str:
        saves.append(job.applied)
        return f"/ckpt/v{len(saves):06d}"

    monkeypatch.setattr(job_state, "write_checkpoint", save)
    job = Job(JobSpec.of(**VALIDATION, eval_every=2, checkpoint_dir="run", checkpoint_every=2))
    between = BetweenSteps(SelfEvaluations(job, None, None),  # type: ignore[arg-type]
                           SelfSaves(job, CheckpointPath(directory="/ckpt", within=None)))  # type: ignore[arg-type]

    async def steps(applied: range) -> None:
        for job.applied in applied:
            await between.evaluate()
            await between.save()

    await steps(range(1, 5))
    job.applied, job.loads = 2, 1  # JobCore.loaded(2): job.load of the version saved at step 2
    await steps(range(3, 5))
    job.applied = 2  # JobCore.rolled_back(2): a recovery replays steps 3 and 4, loading no checkpoint
    await steps(range(3, 5))
    assert [applied for applied, _ in asked] == [2, 4, 4]
    assert saves == [2, 4, 4]


async def test_the_evaluation_due_comes_before_the_save_due_after_the_same_step(
        asked: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    async def save(job: Job, path: CheckpointPath, keep: int = 1, spare: str | None = None,
                   evaluations: dict[str, Any] | None = None) -> str:
        job.publish(("saving", job.applied))
        return "/ckpt/v000001"

    monkeypatch.setattr(job_state, "write_checkpoint", save)
    job = Job(JobSpec.of(**VALIDATION, eval_every=2, checkpoint_dir="run", checkpoint_every=4))
    between = BetweenSteps(SelfEvaluations(job, None, None),  # type: ignore[arg-type]
                           SelfSaves(job, CheckpointPath(directory="/ckpt", within=None)))  # type: ignore[arg-type]
    assert [between.due(n) for n in range(1, 6)] == [False, True, False, True, False]
    results = []
    for applied in range(1, 5):
        job.applied = applied
        results.append(await between.evaluate())
        await between.save()
    assert [None if r is None else r.loss for r in results] == [None, 2.0, None, 4.0]  # what joins the step's stats
    assert [type(e).__name__ if not isinstance(e, tuple) else e for e in job.events] == [
        "Evaluated", "Evaluated", ("saving", 4), "CheckpointSaved"]
    assert isinstance(job.events[1], Evaluated) and isinstance(job.events[3], CheckpointSaved)


async def test_keep_best_spares_the_version_saved_at_the_best_evaluation_from_every_rotation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Losses 3, 2, 2.5, 1, 4 at steps 1..5, a save after each: the best evaluation's version is the spare of
    every later save into the job's directory (``job.save``'s too), and the description's best checkpoint."""
    losses = {1: 3.0, 2: 2.0, 3: 2.5, 4: 1.0, 5: 4.0}
    spares: list[tuple[int, str | None]] = []
    standings: list[dict[str, Any] | None] = []

    async def evaluate(job: Job, path: Any, inputs: Any, targets: Any, *, outputs: bool = False,
                       data_step: int | None = None) -> EvalResult:
        return EvalResult(loss=losses[job.applied], items=8.0, eval_time_s=0.1)

    async def save(job: Job, path: CheckpointPath, keep: int = 1, spare: str | None = None,
                   evaluations: dict[str, Any] | None = None) -> str:
        spares.append((job.applied, spare))
        standings.append(evaluations)
        return f"{path.directory}/v{len(spares):06d}"

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    monkeypatch.setattr(job_state, "write_checkpoint", save)
    job = Job(JobSpec.of(**VALIDATION, eval_every=1, checkpoint_dir="run", checkpoint_every=1, keep_best=True))
    own = CheckpointPath(directory="/ckpt", within=None)
    evals, saves = SelfEvaluations(job, None, None), SelfSaves(job, own)  # type: ignore[arg-type]
    between = BetweenSteps(evals, saves)
    for applied in range(1, 6):
        job.applied = applied
        await between.evaluate()
        await between.save()
    assert spares == [(1, None), (2, "v000001"), (3, "v000002"), (4, "v000002"), (5, "v000004")]
    assert [(e.step, e.best) for e in job.events if isinstance(e, CheckpointSaved)] == [
        (1, True), (2, True), (3, False), (4, True), (5, False)]
    assert saves.best_version == "/ckpt/v000004" and evals.best is not None and evals.best.step == 4
    assert saves.save_args(own)[:2] == (1, "v000004")  # job.save into the job's directory spares it too
    assert saves.save_args(CheckpointPath(directory="/elsewhere", within=None)) == (1, None, None)
    # Each save records how the evaluations stood as it was written: the best, those since, the best's version.
    assert [(s["best"]["step"], s["stale"], s["spare"]) for s in standings if s is not None] == [
        (1, 0, None), (2, 0, "v000001"), (2, 1, "v000002"), (4, 0, "v000002"), (4, 1, "v000004")]


async def test_a_job_save_into_its_own_directory_at_the_best_evaluation_is_its_best_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The manifest of such a save records the best at its own step, which a resume takes as the best
    # version; the running job did not, and its next own save's rotation (keep 1) removed it.
    spares: list[str | None] = []

    async def evaluate(job: Job, path: Any, inputs: Any, targets: Any, *, outputs: bool = False,
                       data_step: int | None = None) -> EvalResult:
        return EvalResult(loss={1: 1.0, 2: 2.0}[job.applied], items=8.0, eval_time_s=0.1)

    async def save(job: Job, path: CheckpointPath, keep: int = 1, spare: str | None = None,
                   evaluations: dict[str, Any] | None = None) -> str:
        spares.append(spare)
        return f"{path.directory}/v{len(spares):06d}"

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    monkeypatch.setattr(job_state, "write_checkpoint", save)
    job = Job(JobSpec.of(**VALIDATION, eval_every=1, checkpoint_dir="run", checkpoint_every=2, keep_checkpoints=1,
                         keep_best=True))
    own = CheckpointPath(directory="/ckpt", within=None)
    evals, saves = SelfEvaluations(job, None, None), SelfSaves(job, own)  # type: ignore[arg-type]
    between = BetweenSteps(evals, saves)
    job.applied = 1
    await between.evaluate()  # the best so far
    assert await saves.save(CheckpointPath(directory="/elsewhere", within=None)) == "/elsewhere/v000001"
    assert saves.best_version is None  # not the job's directory: not in its rotation
    assert await saves.save(own) == "/ckpt/v000002"  # job.save into the job's own directory
    assert saves.best_version == "/ckpt/v000002"
    job.applied = 2
    await between.evaluate()  # worse
    await between.save()  # the job's own save: its rotation spares the best
    assert spares == [None, None, "v000002"] and saves.best_version == "/ckpt/v000002"


@pytest.mark.parametrize(("resumed", "best_version"), [("/ckpt/v000005", "/ckpt/v000004"),
                                                       ("/ckpt/v000004", "/ckpt/v000004")])
async def test_a_resumed_job_takes_up_its_best_evaluation_its_patience_and_its_best_version(
        monkeypatch: pytest.MonkeyPatch, resumed: str, best_version: str) -> None:
    """What a save recorded (the best after step 4, one evaluation since, v000004 its version) comes back
    with the checkpoint it was saved in: from step 5's, the spare; from step 4's, the version itself."""
    best = Evaluated(job="job0", step=4, loss=1.0, items=8.0, batches=4, eval_time_s=0.1, periodic=True,
                     validation=True)
    step = int(resumed[-1])
    standing = {"best": best.to_wire(), "stale": 5 - step, "spare": None if step == 4 else "v000004"}

    async def resume(job: Job, path: CheckpointPath) -> tuple[str, int, dict[str, Any]]:
        job.applied = step
        return resumed, step, {"id": "job0", "evaluations": standing}

    monkeypatch.setattr(job_state, "resume", resume)
    job = Job(JobSpec.of(**VALIDATION, eval_every=1, checkpoint_dir="run", checkpoint_every=1, keep_best=True,
                         resume_from_checkpoint=True, early_stopping_patience=3))
    own = CheckpointPath(directory="/ckpt", within=None)
    evals, saves = SelfEvaluations(job, None, None), SelfSaves(job, own)  # type: ignore[arg-type]
    BetweenSteps(evals, saves)
    assert await saves.resume() == (resumed, step)
    assert evals.best == best and evals.stale == 5 - step and saves.best_version == best_version
    # A record another hand spoiled is passed over: the job judges afresh.
    for key, wrong in (("stale", -1), ("spare", ".."), ("best", {"step": 4})):
        standing = {"best": best.to_wire(), "stale": 1, "spare": "v000004", key: wrong}
        again = SelfEvaluations(job, None, None)
        BetweenSteps(again, spoiled := SelfSaves(job, own))  # type: ignore[arg-type]
        assert await spoiled.resume() == (resumed, step)
        assert again.best is None and again.stale == 0 and spoiled.best_version is None


def test_keep_best_needs_every_save_at_an_evaluation_point() -> None:
    for wrong in ({}, {"eval_every": 2, "checkpoint_every": 3}, {"eval_every": 3}):
        options = {"checkpoint_dir": "run", "checkpoint_every": 4, **wrong}
        with pytest.raises(ValueError, match="keep_best .* needs checkpoint_every .* multiple of evaluation.eval_every"):
            JobSpec.of(**VALIDATION, keep_best=True, **options)
    assert JobSpec.of(**VALIDATION, keep_best=True, checkpoint_dir="run", eval_every=2,
                      checkpoint_every=4).checkpointing.keep_best
    with pytest.raises(TypeError, match="keep_best"):
        JobSpec.of(model=MODEL, keep_best="yes")


async def test_a_periodic_evaluation_that_loses_a_node_is_passed_over_only_where_the_job_recovers(
        asked: list[Any]) -> None:
    lost = NodeLost("node n1 was lost", details={"node": "n1"})
    recovering = Job(JobSpec.of(**VALIDATION, eval_every=1, max_restarts=1), applied=1, placer=object())
    recovering.fail = lost  # type: ignore[attr-defined]
    assert await SelfEvaluations(recovering, None, None).evaluate_if_due() is None  # type: ignore[arg-type]
    assert recovering.events == []  # passed over: the next step recovers
    stuck = Job(JobSpec.of(**VALIDATION, eval_every=1), applied=1)
    stuck.fail = lost  # type: ignore[attr-defined]
    with pytest.raises(NodeLost):
        await SelfEvaluations(stuck, None, None).evaluate_if_due()  # type: ignore[arg-type]
    failing = Job(JobSpec.of(**VALIDATION, eval_every=1, max_restarts=1), applied=1, placer=object())
    failing.fail = StepFailed("evaluation failed at stage 0")  # type: ignore[attr-defined]
    with pytest.raises(StepFailed):  # a failure of its own (the validation data's) ends a run as a step's would
        await SelfEvaluations(failing, None, None).evaluate_if_due()  # type: ignore[arg-type]


def test_the_evaluation_section_wants_its_data_for_eval_every_and_a_batch_at_least() -> None:
    from examples.data import regression_batches

    from torch.nn.functional import l1_loss

    spec = JobSpec.of(model=MODEL, eval_data=regression_batches, eval_data_kwargs={"seed": 9}, eval_every=5,
                      eval_metrics=l1_loss)
    assert spec.evaluation.eval_data == "examples.data:regression_batches"  # a factory by itself: its path
    assert spec.evaluation.eval_metrics == "torch.nn.functional:l1_loss"
    assert spec.evaluation.eval_batches == 1 and spec.evaluation.eval_data_kwargs == {"seed": 9}
    with pytest.raises(ValueError, match=r"evaluation.eval_every needs evaluation.eval_data"):
        JobSpec.of(model=MODEL, eval_every=5)
    with pytest.raises(ValueError, match=r"evaluation.eval_batches"):
        JobSpec.of(**VALIDATION | {"eval_batches": -1})
    with pytest.raises(TypeError, match=r"evaluation.eval_data_kwargs"):
        JobSpec.of(**VALIDATION, eval_data_kwargs=[1])


async def test_evaluations_that_stop_improving_stop_the_job_early_naming_the_best(
        asked: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``early_stopping_patience``: the job's own evaluations are judged by ``metric_for_best``; after that many in
    a row not better than the best by more than the threshold, it says so and asks its run to stop."""
    losses = iter([3.0, 2.0, 1.95, 2.5, 1.0, 1.2, 1.1])

    async def evaluate(job: Job, path: Any, inputs: Any, targets: Any, *, outputs: bool = False,
                       data_step: int | None = None) -> EvalResult:
        return EvalResult(loss=next(losses), items=8.0, metrics={"accuracy": 0.5})

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    job = Job(JobSpec.of(**VALIDATION, eval_every=1, early_stopping_patience=2, early_stopping_threshold=0.1,
                         eval_metrics="examples.models:token_accuracy"))
    evals, stops = SelfEvaluations(job, None, None), []  # type: ignore[arg-type]
    evals.on_early_stop = lambda: stops.append(job.applied)
    flags = []
    for applied in range(1, 8):
        job.applied = applied
        await evals.evaluate_if_due()
        flags.append(evals.stop_early)
    # 2.0 beats 3.0; 1.95 is within the threshold and 2.5 worse: the second such stops; 1.0 is a new best.
    assert flags == [False, False, False, True, False, False, True] and stops == [4, 7]
    early = [(e.step, e.metric, e.best, e.best_step, e.patience) for e in job.events if isinstance(e, EarlyStopped)]
    assert early == [(4, "loss", 2.0, 2, 2), (7, "loss", 1.0, 5, 2)]
    assert evals.best is not None and (evals.best.step, evals.best.loss) == (5, 1.0)


async def test_a_greater_metric_can_be_the_judge_and_an_unknown_one_fails_the_evaluation_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    accuracies = iter([0.5, 0.4, 0.6])

    async def evaluate(job: Job, path: Any, inputs: Any, targets: Any, *, outputs: bool = False,
                       data_step: int | None = None) -> EvalResult:
        return EvalResult(loss=1.0, items=8.0, metrics={"accuracy": next(accuracies, 0.5)})

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    rules = dict(VALIDATION, eval_every=1, eval_metrics="examples.models:token_accuracy")
    job = Job(JobSpec.of(**rules, metric_for_best="accuracy", greater_is_better=True, early_stopping_patience=3))
    evals = SelfEvaluations(job, None, None)  # type: ignore[arg-type]
    for applied in range(1, 4):
        job.applied = applied
        await evals.evaluate_if_due()
    assert evals.best is not None and evals.best.step == 3 and evals.stale == 0 and not evals.stop_early
    wrong = Job(JobSpec.of(**rules, metric_for_best="f1"), applied=1)
    with pytest.raises(ValueError, match=r"metric_for_best 'f1' is not among the evaluation's figures \(loss, "
                                         r"accuracy\)"):
        await SelfEvaluations(wrong, None, None).evaluate_if_due()  # type: ignore[arg-type]


def test_early_stopping_needs_the_jobs_own_evaluations_and_a_metric_it_is_given() -> None:
    with pytest.raises(ValueError, match="early_stopping_patience needs evaluation.eval_every"):
        JobSpec.of(**VALIDATION, early_stopping_patience=3)
    with pytest.raises(ValueError, match="metric_for_best='accuracy' needs evaluation.eval_metrics"):
        JobSpec.of(**VALIDATION, metric_for_best="accuracy")
    with pytest.raises(ValueError, match="early_stopping_threshold must be a finite number >= 0"):
        JobSpec.of(**VALIDATION, eval_every=1, early_stopping_threshold=-1)
    with pytest.raises(TypeError, match="greater_is_better"):
        JobSpec.of(**VALIDATION, greater_is_better="yes")
