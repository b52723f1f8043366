"""A run's steps sent ahead: each step's orders go out while the step before it finishes.

A run (``job.run``) takes its steps from the job's data factory on the head; where nothing
in a step's orders depends on how the step before it ends (see
``StepPath.may_step_ahead``), it sends them before that step's answers are in, so each
stage goes from one step's tail straight into the next. These tests hold the run to one
process trained step by step: with a state read coming in between, and with a step
skipped for a NaN (the step sent after it is refused by every stage and sent again).
"""

from __future__ import annotations

import asyncio
import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from actors import Cluster
from examples.data import regression_batches
from examples.models import residual_mlp
from schedulers.client import Job
from schedulers.events import CheckpointSaved, EarlyStopped, Evaluated, RunFinished, StepFinished
from schedulers.records import RunInfo
from stages import CheckpointError
from tests.helpers.events import feed, heard_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.asyncio(loop_scope="package")]

MODEL = {"blocks": 4, "dim": 8, "hidden": 16}
DATA = {"batch_size": 8, "seq": 2, "dim": 8, "seed": 5}
VALIDATION = DATA | {"seed": 99}  # the validation data: other batches of the same kind
SGD = ("torch.optim:SGD", {"lr": 0.1, "momentum": 0.9})


def _train(**overrides: Any) -> dict[str, Any]:
    return dict(model="examples.models:residual_mlp", model_kwargs=MODEL, optimizer=SGD, pipeline_stages=2,
                data_parallel=2, micro_batches=2, seed=0, data="examples.data:regression_batches",
                data_kwargs=DATA) | overrides


def one_process(positions: list[int | None], **data: Any) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """The model's state before any step and after each, trained on ``positions``' batches (None: a
    step skipped, its state unchanged); each step's loss."""
    torch.manual_seed(0)
    model = residual_mlp(**MODEL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    read = regression_batches(**(DATA | data))
    states, losses = [copy.deepcopy(model.state_dict())], []
    for position in positions:
        if position is not None:
            x, y = read(position)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        states.append(copy.deepcopy(model.state_dict()))
    return states, losses


async def ended(job: Job) -> RunInfo:
    """The job's run, once it has ended (as ``describe`` says it then)."""
    run = await job.wait()
    assert run is not None and not run.active
    described = (await job.describe()).run
    assert described is not None and (described.done, described.target, described.active, described.error) == (
        run.done, run.target, run.active, run.error)
    return run


def equal(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(state[k], v, rtol=1e-5, atol=1e-6) for k, v in expected.items())


async def test_a_run_sends_each_step_ahead_lets_a_state_read_in_between_and_trains_as_one_process(
        cluster: Cluster) -> None:
    steps = 5
    states, losses = one_process(list(range(steps)))
    job = await cluster.train(**_train())
    try:
        await job.run(steps)
        between = await job.state_dict()  # waits for the job: the run lets it in between two steps
        run = await ended(job)
        state, later = await job.state_dict(), await job.describe()
    finally:
        await job.close()
    assert run.error is None and run.done == steps
    # Every step but the first went out ahead, save at most one after which the state read came in.
    assert steps - 2 <= run.ahead <= steps - 1
    assert any(equal(between, expected) for expected in states)
    assert equal(state, states[-1])
    assert later.last_stats is not None and later.last_stats.loss == pytest.approx(losses[-1], rel=1e-5)
    assert later.run is not None and 0 < later.run.elapsed_s == run.elapsed_s  # timed from start to end


async def test_wait_returns_a_runs_end_however_it_ends_and_none_before_any_run(cluster: Cluster) -> None:
    job = await cluster.train(**_train(data_parallel=1))
    try:
        assert await job.wait() is None  # never ran
        target = 1_000_000
        started = await job.run(target)
        waiting = asyncio.ensure_future(job.wait())
        await asyncio.sleep(0)
        assert started.active and not waiting.done()
        await job.stop()
        stopped = await waiting
        again = await job.wait()  # none going on: the last run's at once
        finished = await job.run(2)
        assert finished.active
        done = await job.wait()
    finally:
        await job.close()
    assert not stopped.active and stopped.error is None and stopped.target == target and stopped.done < target
    assert again == stopped
    assert not done.active and (done.done, done.target, done.error) == (2, 2, None)


async def test_steps_while_a_run_is_paused_step_the_job_one_at_a_time_and_the_run_still_takes_its_own(
        cluster: Cluster) -> None:
    steps, between = 30, 2  # the pause all but surely lands inside the run; the checks hold wherever it lands
    states, losses = one_process(list(range(steps + between)))
    events = await feed(cluster, "paused-run-events")
    job = await cluster.train(**_train())
    try:
        await job.run(steps)
        await job.pause()  # after the steps in flight
        stepped = [await job.step() for _ in range(between)]  # a debugger's single steps, from the data factory
        paused = (await job.describe()).run
        await job.resume()
        run = await ended(job)
        state = await job.state_dict()
        heard = await heard_until(events, RunFinished, job.id)
    finally:
        await job.close()
    # Each step's event: the run's own say how far the run is, counting its own steps alone; the
    # driver's say nothing of the run (they counted as the run's before).
    progress = {e.step: e.run for e in heard if isinstance(e, StepFinished)}
    assert len(progress) == steps + between
    assert [progress[s.step] for s in stepped] == [None] * between
    assert [(p.done, p.target) for p in progress.values() if p is not None] == [(k, steps) for k in range(1, steps + 1)]
    assert paused is not None and paused.done <= steps
    # The data position is the step count: each step read the batch after the one before, whoever sent it.
    assert [s.step for s in stepped] == [paused.done + k for k in range(between)]
    assert [s.loss for s in stepped] == pytest.approx(losses[paused.done:paused.done + between], rel=1e-5)
    assert run.error is None and run.done == steps
    assert equal(state, states[-1])


async def test_a_learning_rate_set_on_the_running_job_takes_effect_at_its_next_step_as_one_process(
        cluster: Cluster) -> None:
    torch.manual_seed(0)
    model = residual_mlp(**MODEL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    read = regression_batches(**DATA)
    for position in range(8):  # two steps at 0.1, then 0.02: two by job.step, four by a run sent ahead
        if position == 2:
            opt.param_groups[0]["lr"] = 0.02
        x, y = read(position)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    job = await cluster.train(**_train())
    try:
        await job.step()
        await job.step()
        change = await job.set("lr", "0.02")
        assert (change.key, change.value) == ("lr", 0.02)
        stepped = [await job.step() for _ in range(2)]
        await job.run(4)
        run = await ended(job)
        state, described = await job.state_dict(), await job.describe()
    finally:
        await job.close()
    assert [s.lr for s in stepped] == [[0.02], [0.02]] and run.error is None and run.done == 4
    assert equal(state, model.state_dict())
    assert described.spec.optimization.optimizer == ("torch.optim:SGD", {"lr": 0.02, "momentum": 0.9})


async def test_a_driver_that_gives_up_on_its_step_during_a_run_cancels_its_step_not_the_run(
        cluster: Cluster) -> None:
    # The driver's step waits for the run's step in progress (each forward stalls 0.2 s); it gives up,
    # and its cancel_step reached whichever step held the job: the run's, which ended the run.
    job = await cluster.train(**_train(model="tests.helpers.models:stalling", model_kwargs={"seconds": 0.2},
                                       data_parallel=1))

    async def done() -> int:
        run = (await job.describe()).run
        assert run is not None and run.active, run
        return run.done

    try:
        await job.run(100_000)
        while await done() < 1:
            await asyncio.sleep(0.1)
        step = asyncio.ensure_future(job.step())
        await asyncio.sleep(0.05)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        before = await done()
        while await done() < before + 2:  # the run goes on (it ended at once)
            await asyncio.sleep(0.1)
        await job.stop()
        run = await ended(job)
    finally:
        await job.close()
    assert run.error is None and before + 2 <= run.done < 100_000


async def test_micro_batches_set_back_to_the_jobs_first_count_reach_the_stages(cluster: Cluster) -> None:
    # 2 -> 4 -> 2: an order carried the count only where it differed from the one the stages were built
    # with, and a stage keeps the count it was told last, so the last two steps read and averaged their
    # batches as 4 micro-batches while running a program of 2 (their losses and the weights drifted).
    states, losses = one_process([0, 1, 2, 3])
    job = await cluster.train(**_train(data_parallel=1))
    try:
        stats = [await job.step()]
        await job.set("micro_batches", 4)
        stats.append(await job.step())
        await job.set("micro_batches", 2)
        stats += [await job.step(), await job.step()]
        state = await job.state_dict()
    finally:
        await job.close()
    assert [s.micro_batches for s in stats] == [2, 4, 2, 2]
    assert [s.loss for s in stats] == pytest.approx(losses, rel=1e-5)
    assert equal(state, states[-1])


async def test_a_step_skipped_for_a_nan_drops_the_step_sent_after_it_and_sends_it_again(cluster: Cluster) -> None:
    # Step 1's batch holds a NaN: every stage drops it, so every stage refuses step 2, sent ahead of
    # it; the run drops that one and sends it again, reading the data position it would have read.
    states, _ = one_process([0, None, 2, 3], nan_at=[1])
    job = await cluster.train(**_train(data_kwargs=DATA | {"nan_at": [1]}, on_nonfinite="skip"))
    try:
        await job.run(4)
        run = await ended(job)
        state, description = await job.state_dict(), await job.describe()
    finally:
        await job.close()
    assert run.error is None and run.done == 4
    assert run.ahead == 2  # steps 1 and 3; step 2 went again once step 1 was in
    assert description.steps == 4
    assert equal(state, states[-1])


async def test_an_fp16_run_sends_steps_ahead_and_trains_as_its_steps_one_by_one(cluster: Cluster) -> None:
    # A dynamic loss scale started far too high: the first steps overflow and are skipped while it
    # comes down, then it doubles after two clean steps (and overflows again). A step sent ahead runs
    # with the scale an applied step leaves; one sent after an overflow is sent again.
    fp16 = dict(precision="fp16", initial_scale_power=24, hysteresis=1, loss_scale_window=2)
    steps = 11
    reference = await cluster.train(**_train(**fp16))
    try:
        stats = [await reference.step() for _ in range(steps)]
        want = await reference.state_dict()
    finally:
        await reference.close()
    skipped = [s.skipped for s in stats]
    assert skipped[0] and not all(skipped)
    assert stats[-1].loss_scale == 2 * stats[-2].loss_scale  # the last step runs at a scale just doubled
    job = await cluster.train(**_train(**fp16))
    try:
        await job.run(steps)
        run = await ended(job)
        state, description = await job.state_dict(), await job.describe()
    finally:
        await job.close()
    assert run.error is None and run.done == steps
    assert run.ahead == steps - 1 - sum(skipped[:-1])  # all but the first and those sent after an overflow
    assert all(torch.equal(state[k], want[k]) for k in want)
    last = description.last_stats
    assert last is not None and (last.loss_scale, last.skipped_steps, last.grad_norm) == (
        stats[-1].loss_scale, stats[-1].skipped_steps, stats[-1].grad_norm)


async def test_a_job_saves_itself_every_n_steps_and_one_started_again_goes_on_from_its_last_save(
        cluster: Cluster, tmp_path: Path) -> None:
    """``checkpointing``: a run of 5 steps with ``checkpoint_every=2`` saves after steps 2 and 4, between two
    steps (none is sent ahead across a save) and says so, keeping the newest ``keep_checkpoints``; a job
    started again on that directory with ``resume_from_checkpoint`` goes on from step 4 (weights,
    optimizer state, step count and the data factory's position) and trains on as one process, saving
    after step 6 when stepped one at a time. On a directory with no checkpoint yet, such a job starts
    from its seed; on one whose checkpoint does not load, it does not start."""
    states, _ = one_process(list(range(7)))
    events = await feed(cluster, "checkpoint-events")
    directory = str(tmp_path / "auto")
    fresh = await cluster.train(**_train(checkpoint_dir=directory, resume_from_checkpoint=True))
    try:
        assert (fresh.resumed_from, fresh.resumed_step) == (None, 0)
        assert equal(await fresh.state_dict(), states[0])
    finally:
        await fresh.close()
    job = await cluster.train(**_train(checkpoint_dir=directory, checkpoint_every=2, keep_checkpoints=2))
    try:
        await job.run(5)
        run = await ended(job)
        heard = await heard_until(events, RunFinished, job.id)
    finally:
        await job.close()
    assert run.error is None and run.done == 5
    saved = [event for event in heard if isinstance(event, CheckpointSaved)]
    assert [event.step for event in saved] == [2, 4]
    assert run.ahead <= 2  # steps 3 and 5 come after a save; only 2 and 4 can go out ahead
    assert sorted(os.listdir(directory)) == ["LATEST", "v000001", "v000002"]  # keep_checkpoints=2
    again = await cluster.train(**_train(checkpoint_dir=directory, checkpoint_every=2, keep_checkpoints=2,
                                         resume_from_checkpoint=True))
    try:
        assert (again.resumed_from, again.resumed_step) == (saved[-1].version, 4)
        assert equal(await again.state_dict(), states[4])
        await again.step()
        await again.step()
        six = (await heard_until(events, CheckpointSaved, again.id))[-1]
        assert equal(await again.state_dict(), states[6])
    finally:
        await again.close()
    assert isinstance(six, CheckpointSaved) and six.step == 6 and six.version != saved[-1].version
    assert sorted(os.listdir(directory)) == ["LATEST", "v000002", "v000003"]
    # A checkpoint that is there but does not load fails the start, saying why, and leaves no job.
    shard = Path(six.version) / "p0-t0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        await cluster.train(**_train(checkpoint_dir=directory, resume_from_checkpoint=True))
    assert not [d.job for d in await cluster.jobs() if d.spec.checkpointing.checkpoint_dir == directory]


def validation_loss(state: dict[str, torch.Tensor], batches: int, loss: Any = F.mse_loss) -> float:
    """One process's ``loss`` at ``state`` over the validation data's first ``batches`` batches (as one batch of
    them all)."""
    model = residual_mlp(**MODEL)
    model.load_state_dict(state)
    read = regression_batches(**VALIDATION)
    with torch.no_grad():
        return sum(loss(model(x), y).item() for x, y in map(read, range(batches))) / batches


async def test_a_job_evaluates_itself_every_n_steps_before_it_saves_in_a_run_and_step_by_step(
        cluster: Cluster, tmp_path: Path) -> None:
    """``evaluation``: with ``eval_every=2`` a run of 4 steps evaluates on the validation data after steps 2
    and 4 (each the loss of one process at those weights over ``eval_batches`` batches, read per replica),
    the one after step 4 before the save due then, with no step sent ahead across either; stepped one at a time it
    evaluates after step 6 too; ``job.evaluate()`` without a batch evaluates on the validation data; and
    none of it changes training, which ends where one process does."""
    states, _ = one_process(list(range(6)))
    events = await feed(cluster, "evaluation-events")
    job = await cluster.train(**_train(eval_data="examples.data:regression_batches", eval_data_kwargs=VALIDATION,
                                       eval_every=2, eval_batches=3, checkpoint_dir=str(tmp_path), checkpoint_every=4,
                                       eval_metrics="torch.nn.functional:l1_loss"))
    try:
        await job.run(4)
        run = await ended(job)
        heard = await heard_until(events, RunFinished, job.id)
        asked = await job.evaluate()
        described = (await job.describe()).last_eval
        later = await heard_until(events, Evaluated, job.id)
        five = await job.step()
        six = await job.step()
        later += await heard_until(events, Evaluated, job.id)
        state = await job.state_dict()
    finally:
        await job.close()
    assert run.error is None and run.done == 4 and run.ahead <= 2  # steps 3 and 1 cannot go out ahead
    evaluated = [e for e in heard + later if isinstance(e, Evaluated)]
    assert [(e.step, e.periodic, e.validation, e.batches) for e in evaluated] == [
        (2, True, True, 3), (4, True, True, 3), (4, False, True, 3), (6, True, True, 3)]
    for event in evaluated:
        assert event.loss == pytest.approx(validation_loss(states[event.step], 3), rel=1e-5), event
        # eval_metrics: the mean absolute error, over every micro-batch of both replicas as over the whole set
        assert event.metrics == pytest.approx({"l1_loss": validation_loss(states[event.step], 3, F.l1_loss)}, rel=1e-5)
    assert asked.loss == evaluated[2].loss and asked.items == 3 * DATA["batch_size"]
    assert described == evaluated[2]  # the job's description shows its last evaluation
    # The evaluation's loss joins its step's statistics and event; the save comes after both.
    kinds = [type(e).__name__ for e in heard if isinstance(e, (Evaluated, CheckpointSaved, StepFinished))]
    assert kinds == ["StepFinished", "Evaluated", "StepFinished"] * 2 + ["CheckpointSaved"]
    finished = [e for e in heard if isinstance(e, StepFinished)]
    assert [e.eval_loss for e in finished] == [None, evaluated[0].loss, None, evaluated[1].loss]
    assert [e.eval_metrics for e in finished] == [{}, evaluated[0].metrics, {}, evaluated[1].metrics]
    assert five.eval_loss is None and six.eval_loss == evaluated[3].loss
    assert equal(state, states[6])


async def test_eval_batches_0_evaluates_every_sample_of_the_validation_set_once(cluster: Cluster) -> None:
    """Found and left by review, built now: a validation set whose size does not divide the global batch was
    read on as a stream, so its first samples counted twice. With ``eval_batches=0`` the job reads it once
    through: 11 samples at 2 replicas x 2 micro-batches x 2 are 2 batches, the second cut 1, 1, 1 and a
    stand-in that counts nothing; the loss is one process's over the 11 samples and the outputs are the
    model's for them, in order. Training is left alone."""
    from examples.data import regression_samples

    shape = {"count": 11, "seq": 2, "dim": 8, "batch_size": 2}
    states, _ = one_process([0])
    job = await cluster.train(**_train(eval_data="examples.data:regression_samples", eval_data_kwargs=shape,
                                       eval_batches=0, eval_metrics="torch.nn.functional:l1_loss"))
    try:
        await job.step()
        result = await job.evaluate(outputs=True)
        again = await job.evaluate()
        state = await job.state_dict()
    finally:
        await job.close()
    assert equal(state, states[1])
    model = residual_mlp(**MODEL)
    model.load_state_dict(states[1])
    inputs, targets = regression_samples(**shape).dataset.tensors
    with torch.no_grad():
        outputs = model(inputs)
    assert result.items == 11 and result.batches == 2
    assert result.loss == pytest.approx(F.mse_loss(outputs, targets).item(), rel=1e-5)
    assert result.metrics == pytest.approx({"l1_loss": F.l1_loss(outputs, targets).item()}, rel=1e-5)
    torch.testing.assert_close(result.outputs, outputs, rtol=1e-5, atol=1e-6)
    assert again.loss == result.loss


async def test_keep_best_keeps_the_best_evaluations_version_beside_the_newest_and_it_loads(
        cluster: Cluster, tmp_path: Path) -> None:
    """``keep_best`` with ``keep_checkpoints=1``, an evaluation and a save after each of 4 steps, judged on the
    loss with greater_is_better (so that the best is not the newest): the directory keeps the newest version
    and the one saved at the best evaluation, which the description names and which loads as it was saved."""
    states, _ = one_process(list(range(4)))
    losses = {step: validation_loss(states[step], 2) for step in range(1, 5)}
    best = max(losses, key=losses.__getitem__)
    assert best < 4  # else the newest and the best would be one version
    job = await cluster.train(**_train(eval_data="examples.data:regression_batches", eval_data_kwargs=VALIDATION,
                                       eval_every=1, eval_batches=2, greater_is_better=True,
                                       checkpoint_dir=str(tmp_path), checkpoint_every=1, keep_checkpoints=1,
                                       keep_best=True))
    try:
        await job.run(4)
        assert (await ended(job)).error is None
        described = await job.describe()
        assert described.best_eval is not None and described.best_eval.step == best
        assert described.best_checkpoint == str(tmp_path / f"v{best:06d}")
        assert sorted(n for n in os.listdir(tmp_path) if n.startswith("v")) == [f"v{best:06d}", "v000004"]
        assert await job.load(described.best_checkpoint) == best
        state = await job.state_dict()
    finally:
        await job.close()
    for key, value in states[best].items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


async def test_a_resumed_job_counts_its_patience_on_and_keeps_sparing_its_best_version(
        cluster: Cluster, tmp_path: Path) -> None:
    """With a learning rate of 0 every evaluation equals the first: a job that saved after steps 1 and 2 (one
    evaluation without improvement since the best) and is started again with ``resume_from_checkpoint`` takes
    up its best (step 1's, its version spared) and its patience of 3 from there: its run stops after step 4,
    as one uninterrupted run would, and the directory keeps step 1's version beside the newest."""
    options = _train(optimizer=("torch.optim:SGD", {"lr": 0.0}), eval_every=1, eval_data_kwargs=VALIDATION,
                     eval_data="examples.data:regression_batches", early_stopping_patience=3,
                     checkpoint_dir=str(tmp_path), checkpoint_every=1, keep_checkpoints=1, keep_best=True)
    async with await cluster.train(**options) as first:
        await first.run(2)
        assert (await ended(first)).done == 2
    job = await cluster.train(**options, resume_from_checkpoint=True)
    try:
        assert job.resumed_step == 2
        described = await job.describe()
        assert described.best_eval is not None and described.best_eval.step == 1
        assert described.best_checkpoint == str(tmp_path / "v000001")
        await job.run(20)
        run = await ended(job)
        described = await job.describe()
    finally:
        await job.close()
    assert (run.done, run.stopped_early, run.error) == (2, True, None)  # steps 3 and 4: stale 2, then 3
    assert described.best_checkpoint == str(tmp_path / "v000001")
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("v")) == ["v000001", "v000004"]


async def test_a_run_whose_evaluations_stop_improving_stops_early_and_says_which_was_best(cluster: Cluster) -> None:
    """``early_stopping_patience=1`` with a learning rate of 0: the validation loss after step 2 equals the one
    after step 1, not an improvement, so a run of 20 ends after step 2 (no step went out ahead across an
    evaluation), told as stopped early with step 1's evaluation the best."""
    events = await feed(cluster, "early-stopping-events")
    job = await cluster.train(**_train(optimizer=("torch.optim:SGD", {"lr": 0.0}), eval_every=1,
                                       eval_data="examples.data:regression_batches", eval_data_kwargs=VALIDATION,
                                       early_stopping_patience=1))
    try:
        await job.run(20)
        run = await ended(job)
        heard = await heard_until(events, RunFinished, job.id)
        described = await job.describe()
    finally:
        await job.close()
    assert (run.done, run.stopped_early, run.error, run.ahead) == (2, True, None, 0)
    [early] = [e for e in heard if isinstance(e, EarlyStopped)]
    assert (early.step, early.metric, early.best_step, early.patience) == (2, "loss", 1, 1)
    assert described.best_eval is not None and described.best_eval.step == 1 and described.best_eval.loss == early.best
    assert described.last_stats is not None and described.last_stats.stop_early
