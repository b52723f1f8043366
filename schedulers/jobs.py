"""A training job's specification, in sections: what ``cluster.train(...)`` takes, checked at the call.

:class:`JobSpec` is the one source of truth for a job's settings. It holds one frozen
section per concern, as torchtitan's config does: :class:`Training` (model, loss, data),
:class:`Parallelism` (the mesh and the pipeline schedule), :class:`Optimization`,
:class:`MixedPrecision`, :class:`Communication` (codecs, transport, the data-parallel
reduction), :class:`Runtime` (exact compute and memory knobs), :class:`FaultTolerance`,
:class:`Evaluation` (validation data, and evaluating on it every N steps),
:class:`Checkpointing` (saves the job makes by itself, and resuming from them)
and :class:`Monitoring` (what the head writes for TensorBoard, W&B
and CSV). Every field name is unique across sections, so a flat keyword
(``cluster.train(model=..., micro_batches=8)``) routes to its section; a section may be
given whole (``parallelism=Parallelism(pipeline_stages=2)``, or a dict).

``cluster.train`` builds a spec before anything is sent; the DeepSpeed-style config
reader returns one; the scheduler derives each stage actor's
:class:`~stages.StageConfig` from it with :func:`stage_config`; the argument table of
docs/jobspec.md is generated from the docstrings under the fields
(``python -m schedulers.jobs`` prints it, and a test keeps the page equal to it).

Run: python -m schedulers.jobs      # docs/jobspec.md's table of train() arguments, by section
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from schedulers.schedules import build_schedule
from stages import BUILTIN_SCHEDULES, Mesh, StageConfig, split_batch
from stages.monitor_configs import CSVConfig, TensorBoardConfig, WandbConfig
from stages.spec_checks import nearest, show
from stages.sections import (
    AUTO_PROBE,
    CODECS,
    FIELDS,
    NONFINITE_ACTIONS,
    PARTITION_METHODS,
    PRECISIONS,
    SCHEDULE_NAMES,
    SECTIONS,
    TRANSPORTS,
    Checkpointing,
    CodecName,
    Communication,
    Evaluation,
    FaultTolerance,
    MixedPrecision,
    Monitoring,
    NonFiniteAction,
    Optimization,
    Parallelism,
    PartitionMethod,
    Precision,
    Runtime,
    ScheduleName,
    Training,
    TransportName,
)

__all__ = [
    "AUTO_PROBE",
    "CODECS",
    "FIELDS",
    "NONFINITE_ACTIONS",
    "PARTITION_METHODS",
    "PRECISIONS",
    "SCHEDULE_NAMES",
    "SECTIONS",
    "TRANSPORTS",
    "CSVConfig",
    "Checkpointing",
    "CodecName",
    "Communication",
    "Evaluation",
    "FaultTolerance",
    "JobSpec",
    "MixedPrecision",
    "Monitoring",
    "NonFiniteAction",
    "Optimization",
    "Parallelism",
    "PartitionMethod",
    "Precision",
    "Runtime",
    "ScheduleName",
    "TensorBoardConfig",
    "Training",
    "TransportName",
    "WandbConfig",
    "argument_table",
    "field_docs",
    "stage_config",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """Everything a training job is built from, in sections; every field is checked when the spec is made.

    Build one from flat keywords and/or sections with :meth:`of` (what ``cluster.train``
    takes), or from the sections themselves::

        JobSpec.of(model="examples.models:gpt", pipeline_stages=2, micro_batches=8)
        JobSpec(training=Training(model="examples.models:gpt"), parallelism=Parallelism(pipeline_stages=2))

    Raises (on construction):
        TypeError: a field of the wrong type; the message names it as ``section.field``.
        ValueError: a value out of range or that does not fit the others; the message
            names the field and what would work.
    """

    training: Training
    """the model, its loss and its data"""
    parallelism: Parallelism = field(default_factory=Parallelism)
    """the mesh, the pipeline's schedule and where the model is cut"""
    optimization: Optimization = field(default_factory=Optimization)
    """the optimizer, its learning-rate schedule, clipping and ZeRO"""
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    """the compute dtype and fp16's loss scaling"""
    communication: Communication = field(default_factory=Communication)
    """codecs, transport and the data-parallel reduction"""
    runtime: Runtime = field(default_factory=Runtime)
    """threads, memory and exact compute knobs of each stage process"""
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    """timeouts, recovery and non-finite values"""
    evaluation: Evaluation = field(default_factory=Evaluation)
    """validation data, and evaluating on it every N steps"""
    checkpointing: Checkpointing = field(default_factory=Checkpointing)
    """checkpoints the job saves by itself, and resuming from the last one"""
    monitoring: Monitoring = field(default_factory=Monitoring)
    """TensorBoard, W&B and CSV monitors, written by the head"""

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__} {show(value)}; "
                                "JobSpec.of(...) also takes a dict or flat keywords")
        self._check_across_sections()

    def _check_across_sections(self) -> None:
        """What one section alone cannot check: the settings that must fit each other."""
        p, t, c = self.parallelism, self.training, self.communication
        if p.example_inputs is not None:  # a batch (torch): checked here, so that the sections stay torch-free
            try:
                split_batch(p.example_inputs, 1, "parallelism.example_inputs")
            except (TypeError, ValueError) as exc:
                raise TypeError(f"parallelism.example_inputs: {exc}") from None
        if p.partition_method == "profile" and t.data is None and p.example_inputs is None:
            raise ValueError("parallelism.partition_method='profile' times each layer on a sample micro-batch from "
                             "the job's data factory: give data='pkg.mod:factory' or example_inputs=<one "
                             "micro-batch> (or partition by parameters)")
        if p.split_points is not None and p.example_inputs is None and t.data is None:
            raise ValueError("parallelism.split_points: a model with split_points is traced on one micro-batch "
                             "before training: give example_inputs=<one micro-batch, as job.step splits the batch> "
                             "or data='pkg.mod:factory'")
        self.edge_codecs("activation_codec")
        self.edge_codecs("gradient_codec")
        if self.fault_tolerance.max_restarts and (p.tensor_parallel > 1 or c.transport == "dist"):
            raise ValueError("fault_tolerance.max_restarts recovers pipeline- and data-parallel jobs over "
                             "transport='stream' or 'zmq'; tensor-parallel layers and transport='dist' hold process groups that "
                             "recovery does not form again yet: leave max_restarts at 0")
        compiled = self.runtime.torch_compile
        if isinstance(compiled, dict) and compiled.get("fullgraph") and p.tensor_parallel > 1:
            raise ValueError("runtime.torch_compile fullgraph=True needs tensor_parallel=1: tensor-parallel layers "
                             "all-reduce inside their forward and backward and stay eager, which is a graph break; "
                             "leave fullgraph out (everything between them is compiled) or use tensor_parallel=1")
        if p.w_batching and not self.runtime.gradient_accumulation_fusion:
            raise ValueError("parallelism.w_batching runs the fused weight-gradient GEMMs together; it needs "
                             "gradient_accumulation_fusion=True")
        saves, evals = self.checkpointing, self.evaluation
        if saves.keep_best and not (saves.checkpoint_every and evals.eval_every
                                    and saves.checkpoint_every % evals.eval_every == 0):
            raise ValueError(f"checkpointing.keep_best keeps the version saved at the best evaluation: it needs "
                             f"checkpoint_every (now {saves.checkpoint_every}) a multiple of evaluation.eval_every "
                             f"(now {evals.eval_every}), both above 0, so that every save has its own step's "
                             "evaluation")
        zero = self.optimization.zero_stage
        if zero >= 3:
            raise ValueError(f"optimization.zero_stage={zero} is not built: a pipeline stage holds its parameters "
                             "whole; zero_stage=2 shards gradients and optimizer state, 1 the optimizer state")


    def check_schedule(self) -> None:
        """Compiles the spec's schedule once, for its own limits (e.g. interleaved needs ``micro_batches``
        to be a multiple of the stages): at the driver's call (:meth:`from_kwargs`). The head compiles a
        spec off its loop after checking the operator's limits (:mod:`schedulers.limits`), never as the
        spec comes off the wire: that takes time in proportion to stages x micro-batches.

        Raises:
            ValueError: the schedule cannot take these sizes.
        """
        p = self.parallelism
        build_schedule(AUTO_PROBE if p.schedule == "auto" else p.schedule, p.pipeline_stages, p.micro_batches,
                       p.num_virtual_stages if p.schedule != "auto" else None)

    @classmethod
    def of(cls, **kwargs: Any) -> JobSpec:
        """A spec from flat field names and/or sections, as ``cluster.train`` takes them (see :meth:`from_kwargs`)."""
        return cls.from_kwargs(kwargs)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> JobSpec:
        """A spec from ``cluster.train``'s keyword arguments.

        Each key is a field (``micro_batches``, routed to its section) or a section
        (``parallelism=Parallelism(...)`` or a dict of its fields); a field given flat
        replaces the same field of a section given whole.

        Raises:
            TypeError: an unknown argument (the message names the nearest known one), a
                field given twice, a missing ``model``, or a value of the wrong type.
            ValueError: a value that cannot work.
        """
        spec = _assemble({}, kwargs, "train()")
        spec.check_schedule()
        return spec

    def replace(self, **changes: Any) -> JobSpec:
        """A copy with ``changes`` applied, checked like a new spec.

        A change is a field by its flat name, a section given whole (it replaces that
        section) or a dict of a section's fields (they replace those fields).
        """
        return _assemble({name: getattr(self, name) for name in SECTIONS}, changes, "replace()")

    def get(self, name: str) -> Any:
        """A field by its flat name (``spec.get("micro_batches")``), as ``job.set`` names it.

        Raises:
            KeyError: not a field (the message names the nearest).
        """
        if name not in FIELDS:
            near = nearest(name, FIELDS)
            raise KeyError(f"{name!r} is not a JobSpec field" + (f"; did you mean {near}?" if near else ""))
        return getattr(getattr(self, FIELDS[name]), name)

    def edge_codecs(self, name: Literal["activation_codec", "gradient_codec"]) -> list[str]:
        """``activation_codec`` or ``gradient_codec`` as one codec per stage boundary.

        Raises:
            ValueError: a list whose length is not the number of boundaries.
        """
        return self.communication.edge_codecs(name, self.num_model_stages - 1)

    @property
    def num_virtual_stages(self) -> int:
        return self.parallelism.num_virtual_stages

    @property
    def num_model_stages(self) -> int:
        return self.parallelism.num_model_stages

    @property
    def mesh(self) -> Mesh:
        return self.parallelism.mesh

    @property
    def factory_modules(self) -> list[str]:
        """The modules of the import paths this spec names (model, loss, optimizer, data, schedule).

        actorpipe's own schedules (``stages.state.lr``) are left out: every node admits them already.
        """
        t, o = self.training, self.optimization
        paths = [t.model, t.loss, o.optimizer[0], t.data, o.lr_scheduler[0] if o.lr_scheduler is not None else None]
        return sorted({p.partition(":")[0] for p in paths if p is not None} - {BUILTIN_SCHEDULES})

    def to_wire(self) -> dict[str, Any]:
        """Plain data for msgpack, one map per section (``JobSpec.from_wire`` takes it back)."""
        data = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}  # copies: the spec stays frozen
        o = self.optimization
        data["optimization"]["optimizer"] = [o.optimizer[0], dict(o.optimizer[1])]
        if o.lr_scheduler is not None:
            data["optimization"]["lr_scheduler"] = [o.lr_scheduler[0], dict(o.lr_scheduler[1])]
        return data

    @classmethod
    def from_wire(cls, data: Any) -> JobSpec:
        """The spec :meth:`to_wire` sent; checked like any other, except for its schedule, which the
        head compiles after its limits and off its loop (:meth:`check_schedule`), never as it decodes.

        Raises:
            TypeError, ValueError: not a spec, or one with unknown keys or bad values.
        """
        if not isinstance(data, dict):
            raise TypeError(f"a job spec must be a mapping, got {show(data)}")
        return _assemble({}, data, "JobSpec.from_wire()")


def _assemble(base: dict[str, Any], changes: Mapping[str, Any], call: str) -> JobSpec:
    """A spec from ``base`` (section instances by name) with ``changes`` (sections, then flat fields) applied."""
    given: dict[str, dict[str, Any]] = {}  # section -> fields given in a section (whole or as a dict)
    flat: dict[str, dict[str, Any]] = {}  # section -> fields given by their flat names
    for key, value in changes.items():
        if key in SECTIONS:
            given[key] = _section_fields(key, value, call)
        elif key in FIELDS:
            flat.setdefault(FIELDS[key], {})[key] = value
        else:
            near = nearest(str(key), [*FIELDS, *SECTIONS])
            hint = f"; did you mean {near}?" if near else f"; known arguments: {', '.join(FIELDS)}"
            raise TypeError(f"{call} got an unknown argument {show(key)}{hint}")
    for section, values in flat.items():
        twice = sorted(set(values) & set(given.get(section, {})))
        if twice and changes.get(section) is not None and isinstance(changes[section], Mapping):
            raise TypeError(f"{call} got {twice[0]} both flat and in {section}={{...}}; give it once")
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        if name not in given and name not in flat:
            if name in base:
                sections[name] = base[name]
            continue
        whole = isinstance(changes.get(name), cls)  # a section given whole replaces; a dict updates the base's
        values = {**(_section_fields(name, base[name], call) if name in base and not whole else {}),
                  **given.get(name, {}), **flat.get(name, {})}
        if name == "training" and "model" not in values:
            raise TypeError(f"{call} needs model='package.module:factory' (or the factory itself)")
        sections[name] = cls(**values)
    if "training" not in sections:
        raise TypeError(f"{call} needs model='package.module:factory' (or the factory itself)")
    return JobSpec(**sections)


def _section_fields(name: str, value: Any, call: str) -> dict[str, Any]:
    """A section's fields, from the section itself or a mapping of its field names (checked strictly)."""
    cls = SECTIONS[name]
    if isinstance(value, cls):
        return {f.name: getattr(value, f.name) for f in fields(cls)}
    if not isinstance(value, Mapping):
        raise TypeError(f"{call}: {name} must be a {cls.__name__} or a dict of its fields, got "
                        f"{type(value).__name__} {show(value)}")
    known = [f.name for f in fields(cls)]
    for key in value:
        if key not in known:
            elsewhere = f"; {key} belongs in {FIELDS[key]}" if key in FIELDS else ""
            near = nearest(str(key), known)
            hint = elsewhere or (f"; did you mean {name}.{near}?" if near else f"; its fields: {', '.join(known)}")
            raise TypeError(f"{call} got an unknown argument {show(f'{name}.{key}')}{hint}")
    return dict(value)


def stage_config(
    spec: JobSpec,
    *,
    job: str,
    global_rank: int,
    bounds: Sequence[Sequence[int]],
    dist: Mapping[str, Any] | None,
) -> StageConfig:
    """The configuration of the stage actor at ``global_rank`` of ``spec``'s mesh: the sections a stage reads."""
    return StageConfig(job=job, global_rank=global_rank, bounds=[list(b) for b in bounds],
                       dist=dict(dist) if dist is not None else None, training=spec.training,
                       parallelism=spec.parallelism, optimization=spec.optimization,
                       mixed_precision=spec.mixed_precision, communication=spec.communication, runtime=spec.runtime,
                       evaluation=spec.evaluation)


# -- the reference table (docs/jobspec.md) --------------------------------------------


def field_docs(cls: type[Any] | None = None) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the source): of ``cls``, or of every section."""
    if cls is None:
        return {name: doc for section in SECTIONS.values() for name, doc in field_docs(section).items()}
    body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = after.value.value
    return docs


def argument_table() -> str:
    """docs/jobspec.md's markdown table of ``train()`` arguments, by section, from the fields and their docstrings.

    One contiguous block: a bold row names each section (its name in a job file and in
    ``JobSpec``) before that section's fields.
    """
    rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
    for name, cls in SECTIONS.items():
        summary = (cls.__doc__ or "").strip().splitlines()[0]
        rows.append(f"| **`{name}`** | | **{summary}** |")
        docs = field_docs(cls)
        for f in fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f"`{f.default!r}`"
            elif f.default_factory is not dataclasses.MISSING:
                default = f"`{f.default_factory()!r}`"
            else:
                default = "required"
            rows.append(f"| `{f.name}` | {default} | {docs[f.name]} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(argument_table())
