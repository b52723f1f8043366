"""The job contract: JobSpec checks every argument at the call, derives each stage's config, and is the docs' table."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from actors import ActorRef, RecordError
from stages import Mesh, StageConfig
from schedulers import Cluster, JobDescription, JobSpec, StepStats
from schedulers.jobs import (
    CODECS,
    FIELDS,
    SCHEDULE_NAMES,
    SECTIONS,
    TRANSPORTS,
    Checkpointing,
    FaultTolerance,
    MixedPrecision,
    Parallelism,
    Training,
    argument_table,
    field_docs,
    stage_config,
)
from schedulers.schedules import SCHEDULES
from transport.codecs import CODEC_NAMES

pytestmark = pytest.mark.timeout(30)

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "jobspec.md"
MODEL = "examples.models:residual_mlp"


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"pipeline_stages": True}, TypeError, "^parallelism.pipeline_stages must be an int, got bool True"),
    ({"pipeline_stages": 0}, ValueError, "^parallelism.pipeline_stages must be an int >= 1, got 0"),
    ({"micro_batches": 2.0}, TypeError, "micro_batches must be an int, got float"),
    ({"schedule": "interleaved", "virtual_stages": 0}, ValueError, "virtual_stages must be an int >= 2, got 0"),
    ({"schedule": "interleaved", "virtual_stages": -1}, ValueError, "virtual_stages must be an int >= 2"),
    ({"schedule": "interleaved", "virtual_stages": "2"}, TypeError, "virtual_stages must be an int, got str"),
    ({"virtual_stages": 2}, ValueError, "virtual_stages=2 applies only to schedule='interleaved'"),
    ({"schedule": "2f2b"}, ValueError, "schedule: unknown schedule '2f2b'"),
    ({"schedule": "1F1B"}, ValueError, "did you mean '1f1b'"),
    ({"schedule": None}, TypeError, "schedule must be one of gpipe, 1f1b"),
    ({"gradient_codec": 5}, TypeError, "gradient_codec must be a codec name or a list of them, got 5"),
    ({"gradient_codec": ["int8", 5]}, TypeError, "gradient_codec must be one of none"),
    ({"activation_codec": "int9"}, ValueError, "activation_codec: unknown codec 'int9'"),
    ({"pipeline_stages": 3, "activation_codec": ["int8"]}, ValueError, "lists 1 codecs but the pipeline has 2"),
    ({"reduce_codec": "zip"}, ValueError, "reduce_codec: unknown codec 'zip'"),
    ({"step_timeout_s": float("nan")}, ValueError, "step_timeout_s must be a finite number of seconds > 0, got nan"),
    ({"step_timeout_s": math.inf}, ValueError, "finite"),
    ({"step_timeout_s": 0}, ValueError, "step_timeout_s must be a finite number of seconds > 0, got 0"),
    ({"step_timeout_s": "10"}, TypeError, "step_timeout_s must be a number of seconds, got str '10'"),
    ({"seed": "x"}, TypeError, "seed must be an int, got str 'x'"),
    ({"seed": -1}, ValueError, "seed must be an int in"),
    ({"threads_per_stage": -1}, ValueError, "threads_per_stage must be an int >= 1, got -1"),
    ({"optimizer": 42}, TypeError, "optimizer must be 'package.module:Class' or \\(path, kwargs\\), got 42"),
    ({"optimizer": ("torch.optim:SGD", [0.1])}, TypeError, "optimizer kwargs must be a dict"),
    ({"optimizer": "SGD"}, ValueError, "optimizer: 'SGD' is not an import path"),
    # Found by review: L-BFGS failed every step at STEP ("'NoneType' object is not callable").
    ({"optimizer": ("torch.optim:LBFGS", {"lr": 1})}, ValueError, "optimizer: torch.optim:LBFGS re-evaluates the loss"),
    ({"optimizer": torch.optim.LBFGS}, ValueError, "optimizer: torch.optim.lbfgs:LBFGS re-evaluates the loss"),
    ({"model": 7}, TypeError, "model must be an import path"),
    ({"model": "examples.models"}, ValueError, "model: 'examples.models' is not an import path"),
    ({"model_kwargs": [1]}, TypeError, "model_kwargs must be a dict"),
    ({"data_kwargs": {1: 2}}, TypeError, "data_kwargs must be a dict of keyword arguments \\(str keys\\)"),
    ({"error_feedback": "yes"}, TypeError, "error_feedback must be True or False, got str 'yes'"),
    ({"transport": "tcp"}, ValueError, "transport: unknown value 'tcp'; choose one of zmq, dist"),
    ({"partition_method": "layers"}, ValueError, "partition_method: unknown value 'layers'"),
    ({"bucket_bytes": 0}, ValueError, "bucket_bytes must be an int >= 1"),
    # In the spec's own names (the schedule generators said num_microbatches and num_stages).
    ({"pipeline_stages": 2, "schedule": "interleaved", "micro_batches": 3}, ValueError,
     r"parallelism.micro_batches=3: .* 2 pipeline stages .* use a multiple of 2 \(2 or 4\)"),
    ({"pipeline_stages": 3, "schedule": "dualpipev", "micro_batches": 5}, ValueError,
     r"parallelism.micro_batches=5: DualPipeV needs .* 6 for 3 pipeline stages"),
    ({"schedule": "auto", "max_stash_bytes": 0}, ValueError, "max_stash_bytes must be an int >= 1, got 0"),
    ({"schedule": "auto", "max_stash_bytes": 1.5e9}, TypeError, "max_stash_bytes must be an int, got float"),
    ({"schedule": "auto", "max_stash_bytes": True}, TypeError, "max_stash_bytes must be an int, got bool"),
    ({"max_stash_bytes": 1 << 30}, ValueError, "max_stash_bytes limits what schedule='auto' may choose, and this "
                                               "job runs '1f1b'"),
    ({"schedule": "auto", "virtual_stages": 2}, ValueError, "virtual_stages=2 applies only to "
                                                            "schedule='interleaved', not 'auto'"),
    ({"schedule": "Auto"}, ValueError, "did you mean 'auto'"),
    ({"learning_rate": 0.1}, TypeError, "train\\(\\) got an unknown argument 'learning_rate'"),
    ({"micro_batch": 4}, TypeError, "unknown argument 'micro_batch'; did you mean micro_batches\\?"),
    ({"seed": -1}, ValueError, "^training.seed must be an int in"),
    ({"step_timeout_s": 0}, ValueError, "^fault_tolerance.step_timeout_s must be"),
    ({"loss_scale": -1.0}, ValueError, "^mixed_precision.loss_scale must be a finite number >= 0"),
    ({"zero_stage": 4}, ValueError, "^optimization.zero_stage must be an int in \\[0, 3\\]"),
    ({"bucket_bytes": 0}, ValueError, "^communication.bucket_bytes must be an int >= 1"),
    ({"activation_checkpointing": 0}, ValueError, "^runtime.activation_checkpointing must be an int >= 1"),
    ({"stash_codec": "int9"}, ValueError,
     "^runtime.stash_codec: unknown codec 'int9' \\(did you mean 'int8'\\?\\); choose one of none, fp16, bf16"),
    ({"stash_codec": None}, TypeError, "^runtime.stash_codec must be one of none, fp16, bf16, int8, fp8, int4; got"),
    ({"pipeline_stages": 3, "activation_codec": ["int8"]}, ValueError, "^communication.activation_codec lists 1"),
    ({"torch_compile": "inductor"}, TypeError, "^runtime.torch_compile must be True, False or a dict of torch.compile"),
    ({"torch_compile": {"backend": "indcutor"}}, ValueError,
     "^runtime.torch_compile.backend: unknown backend 'indcutor' \\(did you mean 'inductor'\\?\\)"),
    ({"torch_compile": {"fulgraph": True}}, TypeError,
     "^runtime.torch_compile: unknown torch.compile argument 'fulgraph'; did you mean 'fullgraph'\\?"),
    ({"torch_compile": {"mode": "fast"}}, ValueError, "^runtime.torch_compile.mode: unknown mode 'fast'"),
    ({"torch_compile": {"dynamic": 1}}, TypeError, "^runtime.torch_compile.dynamic must be True or False"),
    ({"torch_compile": {"mode": "max-autotune", "options": {"max_autotune": True}}}, ValueError,
     "^runtime.torch_compile: give mode or options, not both"),
    ({"torch_compile": {"options": {"max_autotune": [1]}}}, TypeError, "^runtime.torch_compile.options must be"),
    ({"torch_compile": {"fullgraph": True}}, ValueError,
     "^runtime.torch_compile fullgraph=True needs gradient_accumulation_fusion=False: the fused nn.Linear"),
    ({"torch_compile": {"fullgraph": True}, "gradient_accumulation_fusion": False, "tensor_parallel": 2}, ValueError,
     "^runtime.torch_compile fullgraph=True needs tensor_parallel=1: tensor-parallel layers all-reduce"),
    ({"w_batching": True, "gradient_accumulation_fusion": False}, ValueError,
     "^parallelism.w_batching .* needs gradient_accumulation_fusion=True"),
    ({"dynamic_shapes": False}, ValueError,
     "^parallelism.dynamic_shapes=False fixes the shapes a model with split_points is traced for; this job has no"),
    ({"dynamic_shapes": "no"}, TypeError, "^parallelism.dynamic_shapes must be True or False, got str 'no'"),
    ({"parallelism": {"pipeline_stages": 0}}, ValueError, "^parallelism.pipeline_stages must be an int >= 1"),
    ({"parallelism": {"pipline_stages": 2}}, TypeError,
     "unknown argument 'parallelism.pipline_stages'; did you mean parallelism.pipeline_stages\\?"),
    ({"parallelism": {"seed": 2}}, TypeError, "unknown argument 'parallelism.seed'; seed belongs in training"),
    ({"parallelism": 2}, TypeError, "parallelism must be a Parallelism or a dict of its fields, got int 2"),
    ({"parallelism": {"micro_batches": 2}, "micro_batches": 4}, TypeError,
     "got micro_batches both flat and in parallelism=\\{...\\}; give it once"),
    ({"trainin": {}}, TypeError, "unknown argument 'trainin'; did you mean training\\?"),
])
def test_every_argument_is_checked_for_type_and_range_with_its_name(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        JobSpec.from_kwargs({"model": MODEL, **kwargs})


def test_auto_takes_a_stash_limit_or_none_and_travels() -> None:
    spec = JobSpec.of(model=MODEL, pipeline_stages=2, micro_batches=3, schedule="auto", max_stash_bytes=64 << 20)
    p = spec.parallelism
    assert (p.schedule, p.max_stash_bytes, p.num_virtual_stages) == ("auto", 64 << 20, 1)
    assert JobSpec.from_wire(spec.to_wire()) == spec
    assert JobSpec.of(model=MODEL, schedule="auto").parallelism.max_stash_bytes is None  # no limit


def test_a_spec_without_a_model_says_how_to_name_one() -> None:
    with pytest.raises(TypeError, match="train\\(\\) needs model='package.module:factory'"):
        JobSpec.from_kwargs({"pipeline_stages": 2})


@pytest.mark.parametrize(("old", "new"), [("num_microbatches", "micro_batches"), ("threads", "threads_per_stage")])
def test_an_old_spelling_is_an_error_that_names_the_new_one(old: str, new: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match=f"unknown argument '{old}'; did you mean {new}\\?"):
            JobSpec.from_kwargs({"model": MODEL, old: 4})


def test_flat_keywords_route_to_their_sections_and_sections_come_whole_or_as_dicts() -> None:
    flat = JobSpec.of(model=MODEL, pipeline_stages=2, micro_batches=4, precision="bf16",
                      step_timeout_s=30.0)
    whole = JobSpec(training=Training(model=MODEL), parallelism=Parallelism(pipeline_stages=2, micro_batches=4),
                    mixed_precision=MixedPrecision(precision="bf16"), fault_tolerance=FaultTolerance(step_timeout_s=30.0))
    dicts = JobSpec.of(training={"model": MODEL}, parallelism={"pipeline_stages": 2, "micro_batches": 4},
                       mixed_precision={"precision": "bf16"},
                       step_timeout_s=30.0)
    assert flat == whole == dicts
    assert (flat.parallelism.micro_batches, flat.mixed_precision.precision, flat.get("step_timeout_s")) == (4, "bf16", 30.0)
    # a flat field replaces the same field of a section given whole
    assert JobSpec.of(model=MODEL, parallelism=Parallelism(pipeline_stages=2), micro_batches=2).parallelism == \
        Parallelism(pipeline_stages=2, micro_batches=2)
    assert set(FIELDS) == {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    assert len(FIELDS) == 70
    with pytest.raises(TypeError, match="training must be a Training, got dict"):
        JobSpec(training={"model": MODEL})  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="'micro_batch' is not a JobSpec field; did you mean micro_batches"):
        flat.get("micro_batch")


def plain_factory() -> None:
    """A module-level function: a node imports it by tests.schedulers.test_jobs:plain_factory."""


class PlainModel:
    """A module-level class, by tests.schedulers.test_jobs:PlainModel."""


def test_a_factory_is_its_path_or_the_function_or_class_itself() -> None:
    spec = JobSpec.of(model=plain_factory, loss=torch.nn.functional.mse_loss, data=PlainModel,
                      optimizer=(torch.optim.SGD, {"lr": 0.1}), lr_scheduler=torch.optim.lr_scheduler.StepLR)
    assert spec.training.model == "tests.schedulers.test_jobs:plain_factory"
    assert spec.training.loss == "torch.nn.functional:mse_loss"
    assert spec.training.data == "tests.schedulers.test_jobs:PlainModel"
    assert spec.optimization.optimizer == ("torch.optim.sgd:SGD", {"lr": 0.1})
    assert spec.optimization.lr_scheduler == ("torch.optim.lr_scheduler:StepLR", {})
    assert JobSpec.from_wire(spec.to_wire()) == spec  # paths on the wire, as the nodes import them
    assert JobSpec.of(model=MODEL, optimizer=torch.optim.Adam).optimization.optimizer == ("torch.optim.adam:Adam", {})


def _nested() -> Any:
    def inner() -> None:
        pass
    return inner


def _in_main() -> Any:
    def factory() -> None:
        pass
    factory.__module__, factory.__qualname__ = "__main__", "factory"
    return factory


@pytest.mark.parametrize(("factory", "error", "message"), [
    (lambda: None, ValueError, "training.model: a node imports a factory by its path, .* a lambda has no name"),
    (_nested(), ValueError, "training.model: .* it is defined inside a function: move it to a module's top level"),
    (_in_main(), ValueError, "training.model: .* it is defined in __main__"),
    (functools.partial(plain_factory), TypeError, "training.model must be an import path .* or the function or class "
                                                  "itself, got partial"),
    (7, TypeError, "training.model must be an import path"),
    (_nested, ValueError, "names '_nested', and nodes import public names only"),
])
def test_a_factory_no_node_could_import_by_its_path_is_refused_with_why(
    factory: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        JobSpec.of(model=factory)


def test_an_object_whose_path_imports_something_else_is_refused() -> None:
    def impostor() -> None:
        pass
    impostor.__qualname__ = "plain_factory"
    impostor.__module__ = __name__
    with pytest.raises(ValueError, match="tests.schedulers.test_jobs:plain_factory does not import it back"):
        JobSpec.of(model=MODEL, loss=impostor)


def test_the_literal_choices_are_the_ones_the_lower_layers_implement() -> None:
    assert set(SCHEDULE_NAMES) == set(SCHEDULES) | {"auto"}  # auto picks one of them (schedulers.planning)
    assert set(CODECS) == set(CODEC_NAMES)
    assert TRANSPORTS == ("zmq", "dist", "stream")


def test_a_spec_travels_and_comes_back_equal_and_refuses_what_it_does_not_know() -> None:
    spec = JobSpec.of(model=MODEL, pipeline_stages=2, micro_batches=4, gradient_codec=["int8"],
                      optimizer=("torch.optim:Adam", {"lr": 1e-3}))
    wire = spec.to_wire()
    assert list(wire) == list(SECTIONS) and wire["parallelism"]["micro_batches"] == 4
    assert wire["optimization"]["optimizer"] == ["torch.optim:Adam", {"lr": 1e-3}]
    assert JobSpec.from_wire(wire) == spec
    with pytest.raises(TypeError, match="unknown argument 'extra'"):
        JobSpec.from_wire({**wire, "extra": 1})
    with pytest.raises(TypeError, match="unknown argument 'parallelism.extra'"):
        JobSpec.from_wire({**wire, "parallelism": {**wire["parallelism"], "extra": 1}})
    with pytest.raises(TypeError, match="a job spec must be a mapping"):
        JobSpec.from_wire(["model", MODEL])


def test_a_schedule_module_is_admitted_with_the_factories_but_actorpipes_own_needs_no_admission() -> None:
    own = JobSpec.of(model=MODEL, lr_scheduler=("stages.state.lr:WarmupLR", {"warmup_num_steps": 10}))
    assert own.factory_modules == ["examples.models", "torch.nn.functional", "torch.optim"]
    theirs = JobSpec.of(model=MODEL, lr_scheduler=("mypkg.schedules:warmup", {}))
    assert "mypkg.schedules" in theirs.factory_modules
    assert JobSpec.from_wire(own.to_wire()) == own


def test_replace_checks_the_new_value() -> None:
    spec = JobSpec.of(model=MODEL, pipeline_stages=2, micro_batches=4)
    assert spec.replace(micro_batches=8).parallelism == Parallelism(pipeline_stages=2, micro_batches=8)
    assert spec.replace(parallelism={"micro_batches": 2}).parallelism == Parallelism(pipeline_stages=2, micro_batches=2)
    assert spec.replace(parallelism=Parallelism(micro_batches=2)).parallelism == Parallelism(micro_batches=2)
    assert spec.replace(seed=3).training == Training(model=MODEL, seed=3)
    with pytest.raises(ValueError, match="parallelism.micro_batches must be an int >= 1"):
        spec.replace(micro_batches=0)
    with pytest.raises(TypeError, match="replace\\(\\) got an unknown argument 'micro_batch'"):
        spec.replace(micro_batch=2)


def test_the_checkpointing_section_needs_its_directory_for_what_it_does_and_checks_each_field() -> None:
    with pytest.raises(ValueError, match="checkpointing.checkpoint_every needs checkpointing.checkpoint_dir"):
        JobSpec.of(model=MODEL, checkpoint_every=100)
    with pytest.raises(ValueError, match="checkpoint_every and checkpointing.resume_from_checkpoint need "
                                         "checkpointing.checkpoint_dir"):
        JobSpec.of(model=MODEL, checkpoint_every=100, resume_from_checkpoint=True)
    with pytest.raises(ValueError, match="checkpointing.checkpoint_every must be an int >= 0, got -1"):
        JobSpec.of(model=MODEL, checkpoint_dir="runs", checkpoint_every=-1)
    with pytest.raises(TypeError, match="checkpointing.resume_from_checkpoint must be True or False"):
        JobSpec.of(model=MODEL, checkpoint_dir="runs", resume_from_checkpoint="yes")
    for bad in (5, "x" * 1025, "a\0b"):
        with pytest.raises(TypeError, match="checkpointing.checkpoint_dir must be a directory path"):
            JobSpec.of(model=MODEL, checkpoint_dir=bad)
    with pytest.raises(ValueError, match="checkpointing.checkpoint_dir must name a directory"):
        JobSpec.of(model=MODEL, checkpoint_dir="")
    spec = JobSpec.of(model=MODEL, checkpointing={"checkpoint_dir": "runs/a", "checkpoint_every": 100})
    assert spec.checkpointing == Checkpointing(checkpoint_dir="runs/a", checkpoint_every=100)
    assert JobSpec.from_wire(spec.to_wire()) == spec
    assert JobSpec.of(model=MODEL).checkpointing == Checkpointing()  # off: only job.save saves


@pytest.mark.parametrize(("spec", "rank", "expected"), [
    (JobSpec.of(model=MODEL, pipeline_stages=2, micro_batches=4), 1,
     {"pipeline_rank": 1, "pipeline_stages": 2, "micro_batches": 4, "stages": [1], "global_rank": 1}),
    (JobSpec.of(model=MODEL, pipeline_stages=2, tensor_parallel=2, data_parallel=2, micro_batches=2), 5,
     {"pipeline_rank": 0, "pipeline_stages": 2, "mesh": Mesh(pipeline=2, tensor=2, data=2), "global_rank": 5}),
    (JobSpec.of(model=MODEL, pipeline_stages=2, schedule="interleaved", micro_batches=4, activation_codec="int8",
             threads_per_stage=None), 0,
     {"activation_codec": ["int8"] * 3, "gradient_codec": ["none"] * 3, "stages": [0, 2]}),
])
def test_each_stage_config_is_derived_from_the_spec(spec: JobSpec, rank: int, expected: dict[str, Any]) -> None:
    bounds = [[i, i + 1] for i in range(spec.num_model_stages)]
    config = stage_config(spec, job="job0", global_rank=rank, bounds=bounds, dist=None)
    assert {k: getattr(config, k) for k in expected} == expected
    assert StageConfig.from_wire(config.to_wire()) == config
    # A stage reads the spec's own sections; the head's (fault tolerance, checkpointing, monitoring) stay behind.
    head_only = ("fault_tolerance", "checkpointing", "monitoring")
    sections = {name: getattr(spec, name) for name in SECTIONS if name not in head_only}
    assert {name: getattr(config, name) for name in sections} == sections
    assert not set(head_only) & set(config.to_wire())


def test_the_reference_table_is_the_specs_fields() -> None:
    assert set(field_docs()) == set(FIELDS), "every field has a docstring under it"
    assert set(field_docs(JobSpec)) == set(SECTIONS), "every section has a docstring under it"
    text = REFERENCE.read_text()
    table = argument_table()
    assert table in text, ("docs/jobspec.md's argument table differs from the spec; replace the whole "
                           "table there with the output of `python -m schedulers.jobs`")
    assert "\n\n" not in table, "one contiguous block"
    sections = re.findall(r"^\| \*\*`(\w+)`\*\* \|", table, flags=re.M)
    assert sections == list(SECTIONS)
    rows = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert rows == list(FIELDS)


class _CountingRuntime:
    """Stands in for a runtime: counts every message a call would send."""

    address = "tcp://127.0.0.1:1"

    def __init__(self) -> None:
        self.sent: list[str] = []

    def ref(self, address: str, name: str) -> ActorRef:
        return ActorRef(self, address, name)  # type: ignore[arg-type]

    async def ask(self, ref: ActorRef, method: str, *args: Any, **kwargs: Any) -> Any:
        self.sent.append(method)
        raise AssertionError(f"{method} was sent")

    tell = ask


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"model": MODEL, "pipline_stages": 2}, TypeError),
    ({"model": MODEL, "schedule": "1f1f"}, ValueError),
    ({"model": MODEL, "step_timeout_s": "10"}, TypeError),
])
async def test_a_bad_train_argument_raises_at_the_call_without_contacting_the_head(
    kwargs: dict[str, Any], error: type[Exception]
) -> None:
    runtime = _CountingRuntime()
    cluster = Cluster(runtime, runtime.ref("tcp://127.0.0.1:1", "head"), contextlib.AsyncExitStack())  # type: ignore[arg-type]
    with pytest.raises(error):
        await cluster.train(**kwargs)
    with pytest.raises(TypeError, match="a JobSpec or keyword arguments, not both"):
        await cluster.train(JobSpec.of(model=MODEL), seed=1)
    with pytest.raises(ValueError, match="a lambda has no name"):
        await cluster.train(model=lambda: None)
    assert runtime.sent == []


async def test_an_export_format_it_does_not_write_is_refused_at_the_call_without_contacting_the_head() -> None:
    """Found by review: job.export(format="bin") went to the head and came back as a remote error with its
    traceback; every argument is checked at the call, before anything is sent."""
    from schedulers.client import Job
    from schedulers.records import JobInfo

    runtime = _CountingRuntime()
    head = runtime.ref("tcp://127.0.0.1:1", "head")
    cluster = Cluster(runtime, head, contextlib.AsyncExitStack())  # type: ignore[arg-type]
    job = Job(cluster, JobInfo(job="job0", bounds=[[0, 4]], nodes=["n0"], actor=["tcp://127.0.0.1:1", "job0"]),
              JobSpec.of(model=MODEL))
    for bad in ("bin", None, ["dcp"]):
        with pytest.raises(ValueError, match="export writes safetensors or dcp, not"):
            await job.export("/tmp/out", format=bad)  # type: ignore[arg-type]
    assert runtime.sent == []


def test_step_stats_carry_samples_per_s_and_refuse_unknown_keys() -> None:
    stats = StepStats(step=0, loss=1.0, step_time_s=0.5, bubble_fraction=0.1, bytes_sent=10, samples=8,
                      samples_per_s=16.0)
    assert StepStats.from_wire(stats.to_wire()) == stats
    with pytest.raises(RecordError, match="StepStats: unknown key\\(s\\) sample_rate"):
        StepStats.from_wire({**stats.to_wire(), "sample_rate": 1})
    with pytest.raises(RecordError, match="StepStats: missing key\\(s\\) loss"):
        StepStats.from_wire({k: v for k, v in stats.to_wire().items() if k != "loss"})


def test_a_job_description_rebuilds_its_nested_records() -> None:
    spec = JobSpec.of(model=MODEL, pipeline_stages=2, micro_batches=2)
    stats = StepStats(step=3, loss=1.0, step_time_s=0.5, bubble_fraction=0.1, bytes_sent=10)
    info = JobDescription(job="job0", spec=spec, bounds=[[0, 1], [1, 2]], nodes=["a", "b"], mesh=[2, 1, 1],
                          stages=[["tcp://x:1", "job0.rank0"], ["tcp://x:2", "job0.rank1"]], steps=4,
                          programs=[["0F0"], ["1F0"]], stepping=False, traced=True, last_stats=stats)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = JobDescription.from_wire(info.to_wire())
    assert again == info and isinstance(again.spec, JobSpec) and isinstance(again.last_stats, StepStats)
