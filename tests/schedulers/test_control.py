"""Settings a running job may change: checked at once, applied at the barrier."""

from __future__ import annotations

from typing import Any

import pytest

from schedulers.job_core import compile_programs
from schedulers.settings import plan_setting
from schedulers.jobs import JobSpec

pytestmark = pytest.mark.timeout(30)


def spec(**changes: Any) -> JobSpec:
    base = {"model": "examples.models:residual_mlp", "pipeline_stages": 2, "micro_batches": 4,
            "data": "examples.data:regression_batches", "data_kwargs": {"batch_size": 8}}
    return JobSpec.from_kwargs({**base, **changes})


@pytest.mark.parametrize(("key", "value", "field", "expected"), [
    ("schedule", "gpipe", "schedule", "gpipe"),
    ("schedule", "zero_bubble", "schedule", "zero_bubble"),
    ("schedule", "auto", "schedule", "auto"),
    ("micro_batches", "8", "micro_batches", 8),
    ("micro_batches", 2, "micro_batches", 2),
    ("activation_codec", "int8", "activation_codec", "int8"),
    ("gradient_codec", "int4", "gradient_codec", "int4"),
])
def test_settings_that_fit_give_the_new_spec(key: str, value: Any, field: str, expected: Any) -> None:
    new = plan_setting(spec(), key, value)
    assert new.get(field) == expected
    assert compile_programs(new)  # and it compiles


def test_any_micro_batch_count_fits_the_data() -> None:
    """Found by review: the factory's batch_size was read as the global batch, so a DataLoader's (one
    micro-batch's) refused micro_batches=4 at batch_size 2, and a batch function's refused any count that did
    not divide it, though a step cuts such a batch as tensor_split does."""
    assert plan_setting(spec(), "micro_batches", "3").get("micro_batches") == 3
    loader = spec(data="examples.data:token_sequences", data_kwargs={"batch_size": 2})
    assert plan_setting(loader, "micro_batches", "4").get("micro_batches") == 4


@pytest.mark.parametrize(("base", "key", "value", "message"), [
    ({}, "seed", "1", "cannot set 'seed' on a running job; settable: micro_batches, schedule"),
    ({}, "micro_batchs", "4", "cannot set 'micro_batchs' on a running job \\(did you mean 'micro_batches'\\?\\); settable"),
    ({}, "micro_batches", "three", "micro_batches must be an integer >= 1, got 'three'"),
    ({}, "micro_batches", "0", "micro_batches must be an integer >= 1"),
    ({}, "schedule", "2f2b", "unknown schedule '2f2b'"),
    ({}, "schedule", "interleaved", "re-partitions the model"),
    ({"schedule": "interleaved"}, "schedule", "1f1b", "re-partitions the model"),
    ({"schedule": "interleaved"}, "schedule", "auto", "re-partitions the model \\(auto runs one stage per rank\\)"),
    ({"schedule": "zbv"}, "schedule", "interleaved", "between interleaved, V-shaped \\(zbv, dualpipev\\) and"),
    ({}, "schedule", "dualpipev", "re-partitions the model"),
    ({"schedule": "interleaved", "data_kwargs": {"batch_size": 12}}, "micro_batches", "3", "multiple"),
    ({}, "activation_codec", "int9", "unknown codec 'int9'"),
    ({}, "lr", "fast", "lr must be a number > 0, got 'fast'"),
    ({}, "lr", "-0.1", "lr must be a finite number > 0, got '-0.1'"),
    ({}, "lr", "inf", "lr must be a finite number > 0"),
    ({}, "lr", True, "lr must be a finite number > 0"),
    ({"lr_scheduler": ("torch.optim.lr_scheduler:StepLR", {"step_size": 2})}, "lr", "0.1",
     r"this job's learning rate follows its lr_scheduler \(torch.optim.lr_scheduler:StepLR\); set lr on a job "
     "without one"),
])
def test_settings_that_do_not_fit_are_refused_with_why(base: dict[str, Any], key: str, value: str,
                                                        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        # As Settings.set does: planned at once, then compiled (off the head's loop there).
        compile_programs(plan_setting(spec(**base), key, value))


def test_the_two_v_shaped_schedules_switch_on_a_running_job() -> None:
    # ZB-V and DualPipeV cut and place the model alike (two stages per rank, in a V).
    new = plan_setting(spec(schedule="zbv", micro_batches=4), "schedule", "dualpipev")
    assert new.parallelism.schedule == "dualpipev" and new.parallelism.placement == "v"
    assert compile_programs(new)


def test_a_fixed_schedule_drops_autos_stash_limit_and_auto_compiles_its_probe() -> None:
    auto = spec(schedule="auto", max_stash_bytes=1 << 20)
    fixed = plan_setting(auto, "schedule", "1f1b")
    assert (fixed.parallelism.schedule, fixed.parallelism.max_stash_bytes) == ("1f1b", None)
    assert plan_setting(auto, "micro_batches", "8").parallelism.max_stash_bytes == 1 << 20
    assert compile_programs(auto) == compile_programs(spec(schedule="zero_bubble"))  # what it measures with
    assert compile_programs(auto, "gpipe") == compile_programs(spec(schedule="gpipe"))  # what it chose


def test_codec_lists_are_one_codec_per_boundary() -> None:
    new = plan_setting(spec(pipeline_stages=3), "gradient_codec", "int8,none")
    assert new.edge_codecs("gradient_codec") == ["int8", "none"]


def test_a_learning_rate_keeps_the_optimizers_other_arguments() -> None:
    base = spec(optimizer=("torch.optim:SGD", {"lr": 0.1, "momentum": 0.9}))
    assert plan_setting(base, "lr", "0.02").optimization.optimizer == ("torch.optim:SGD", {"lr": 0.02, "momentum": 0.9})
    assert plan_setting(spec(optimizer=("torch.optim:AdamW", {})), "lr", 1e-4).optimization.optimizer == (
        "torch.optim:AdamW", {"lr": 1e-4})
    assert base.optimization.optimizer[1]["lr"] == 0.1  # the job's own spec is left alone until the barrier


def test_each_step_takes_the_learning_rate_set_last_at_or_before_it() -> None:
    from schedulers.job_core import JobCore

    job = JobCore.__new__(JobCore)  # only what learning_rate reads
    job.learning_rates = {}
    assert job.learning_rate(5) is None  # never set: the optimizer's own
    job.learning_rates = {0: 0.1, 3: 0.02, 7: 0.5}
    assert [job.learning_rate(p) for p in (0, 2, 3, 6, 7, 100)] == [0.1, 0.1, 0.02, 0.02, 0.5, 0.5]


class CodecStage:
    """A stage actor's ref as Settings calls it: set_codecs refused ``refusals`` times, then taken."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.codecs: list[Any] = []

    def endpoint(self, method: Any, timeout: float | None = None) -> "CodecStage":
        return self

    async def call(self, activation: Any, gradient: Any) -> None:
        from actors import ActorError

        if self.refusals:
            self.refusals -= 1
            raise ActorError("set_codecs timed out")
        self.codecs.append((activation, gradient))


async def test_codecs_the_stages_refuse_leave_the_other_settings_to_apply() -> None:
    # The codecs' refusal returned before anything else applied: an lr and a micro-batch count set
    # alongside were dropped, silently, and a stage that took the new codecs kept them.
    from schedulers.job_core import JobCore
    from schedulers.limits import Limits
    from schedulers.settings import Settings

    events: list[Any] = []
    stages = [CodecStage(refusals=0), CodecStage(refusals=1)]

    async def nobody() -> set[str]:
        return set()

    async def members(repairs: bool) -> None:
        pass

    job = JobCore(runtime=None, job_id="job0", spec=spec(optimizer=("torch.optim:SGD", {"lr": 0.1})),
                  stages=stages, nodes=["a", "b"], bounds=[[0, 2], [2, 4]], publish=events.append,
                  alive_nodes=nobody, check_members=members)  # type: ignore[arg-type]
    settings = Settings(job, Limits())
    for key, value in (("lr", "0.02"), ("micro_batches", "8"), ("activation_codec", "int8")):
        await settings.set(key, value)
    async with job.operation(stepping=True):
        await settings.apply_pending()
    assert [type(e).__name__ for e in events][-2:] == ["SettingRejected", "SettingsApplied"]
    assert events[-1].changes == {"lr": 0.02, "micro_batches": 8}
    assert job.spec.optimization.optimizer[1]["lr"] == 0.02 and job.spec.parallelism.micro_batches == 8
    assert job.spec.get("activation_codec") == "none" and job.learning_rate(job.applied) == 0.02
    assert stages[0].codecs[-1] == stages[1].codecs[-1] == (["none"], ["none"])  # the one that took int8 went back


async def test_a_new_learning_rate_leaves_an_auto_jobs_plan_and_a_new_micro_batch_count_moves_its_data_on() -> None:
    """Found by review: set lr on an auto job threw its plan away and probed again (zero-bubble and W-batched
    probe steps), though a rate moves no cost. A micro-batch count does, and the data reads on from where it
    stood (schedulers.data_positions) rather than from the step count in the new layout."""
    from schedulers.job_core import JobCore
    from schedulers.limits import Limits
    from schedulers.settings import Settings

    async def nobody() -> set[str]:
        return set()

    async def members(repairs: bool) -> None:
        pass

    job = JobCore(runtime=None, job_id="job0", spec=spec(schedule="auto"), stages=[], nodes=["a", "b"],
                  bounds=[[0, 2], [2, 4]], publish=lambda event: None, alive_nodes=nobody,
                  check_members=members)  # type: ignore[arg-type]
    job.auto.probe_steps_left = 0  # planned
    job.applied = 3
    settings = Settings(job, Limits())
    await settings.set("lr", "0.02")
    async with job.operation(stepping=True):
        await settings.apply_pending()
    assert job.auto.probe_steps_left == 0 and job.spec.optimization.optimizer[1]["lr"] == 0.02
    await settings.set("micro_batches", "8")
    async with job.operation(stepping=True):
        await settings.apply_pending()
    assert job.auto.probe_steps_left > 0
    assert [job.data.at(step) for step in (2, 3, 4)] == [8, 12, 20]  # 1 replica: 4 micro-batches a step, then 8
