"""A training job's specification: what ``cluster.train(...)`` takes, checked at the call.

:class:`JobSpec` is the one source of truth for a job's settings. ``cluster.train``
builds one (from a ``JobSpec`` or from keyword arguments) before anything is sent;
the DeepSpeed-style config translator returns one; the scheduler derives each stage
actor's :class:`~actors.StageConfig` from it with :func:`stage_config`; the argument
table of docs/jobspec.md is generated from the docstrings under its fields
(``python -m schedulers.jobs`` prints it, and a test keeps the page equal to it).

Run: python -m schedulers.jobs      # docs/jobspec.md's table of train() arguments
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from stages import BUILTIN_SCHEDULES, Mesh, split_batch, StageConfig
from schedulers.schedules import build_schedule

__all__ = [
    "AUTO_PROBE",
    "CODECS",
    "NONFINITE_ACTIONS",
    "PARTITION_METHODS",
    "SCHEDULE_NAMES",
    "TRANSPORTS",
    "CodecName",
    "JobSpec",
    "NonFiniteAction",
    "PartitionMethod",
    "ScheduleName",
    "TransportName",
    "argument_table",
    "stage_config",
]

ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zero_bubble", "auto"]
TransportName = Literal["zmq", "dist"]
PartitionMethod = Literal["parameters", "uniform", "profile"]
CodecName = Literal["none", "fp16", "bf16", "int8", "fp8", "int4"]
NonFiniteAction = Literal["raise", "skip"]
Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

SCHEDULE_NAMES: tuple[str, ...] = get_args(ScheduleName)
TRANSPORTS: tuple[str, ...] = get_args(TransportName)
PARTITION_METHODS: tuple[str, ...] = get_args(PartitionMethod)
CODECS: tuple[str, ...] = get_args(CodecName)
NONFINITE_ACTIONS: tuple[str, ...] = get_args(NonFiniteAction)
# What a job with schedule="auto" runs while it measures its stages (schedulers.planning):
# ZB-H1 splits every backward into I and W, so one step times F, I and W on every stage,
# and its peak stash (p micro-batches a stage) is no more than 1F1B's largest.
AUTO_PROBE = "zero_bubble"

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_SEED_RANGE = (0, 2**63 - 1)
# Public spellings that were renamed: old name -> new name (accepted with a DeprecationWarning).
_RENAMED = {"num_microbatches": "micro_batches", "threads": "threads_per_stage"}


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """Everything a training job is built from; every field is checked when the spec is made.

    Raises (on construction):
        TypeError: a field of the wrong type; the message names the field.
        ValueError: a value out of range or that does not fit the others; the message
            names the field and what would work.
    """

    model: str
    """factory by import path (`package.module:callable`), returning an `nn.Sequential` (or a list of layers), or any `nn.Module` with `split_points`; each stage builds it from `seed` and keeps its slice"""
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    """keyword arguments of the model factory"""
    loss: str = "torch.nn.functional:mse_loss"
    """`output, target -> scalar`, mean-reduced, by import path"""
    optimizer: tuple[str, dict[str, Any]] = ("torch.optim:SGD", {"lr": 0.01})
    """`(path, kwargs)`, e.g. `("torch.optim:Adam", {"lr": 1e-3})`, or a bare path"""
    pipeline_stages: int = 1
    """pipeline ranks; the mesh has `pipeline_stages * tensor_parallel * data_parallel` stage actors, one per node"""
    tensor_parallel: int = 1
    """Megatron tensor-parallel degree (see "Data and tensor parallelism")"""
    data_parallel: int = 1
    """data-parallel replicas, each on its own shard of the global batch"""
    schedule: ScheduleName = "1f1b"
    """`gpipe`, `1f1b` (PipeDream-Flush), `interleaved` (Megatron's virtual stages), `zero_bubble` (ZB-H1), or `auto`: the first two steps run `zero_bubble` and time every stage's F, B, I, W and the link; the timed simulator then ranks the schedules this partition runs (GPipe, 1F1B, zero-bubble) and the job runs the fastest that fits `max_stash_bytes` (`job.plan()` shows them all, interleaved included as a re-partition to consider; `StepStats.schedule` names the one each step ran)"""
    micro_batches: int = 1
    """the global batch (each replica's share) is split into this many; gradients accumulate across them"""
    virtual_stages: int | None = None
    """model stages per rank with `interleaved` (>= 2; default 2); only for that schedule"""
    max_stash_bytes: int | None = None
    """with `schedule="auto"`: the most bytes of activations one stage actor may hold for backward (as `StepStats.peak_stash_bytes` counts them); auto runs the fastest schedule predicted to fit, and when none does the step that plans fails with nothing applied. `None`: no limit"""
    split_points: list[str] | None = None
    """split any `nn.Module`: the names (as `named_modules()` gives them) of the modules each new stage begins at, `pipeline_stages * virtual stages - 1` of them; the model is traced with torch's pipelining front end on one micro-batch (`example_inputs`, else the data factory's first), and `state_dict`/checkpoints keep its own names"""
    example_inputs: Any = None
    """one micro-batch (a tensor, a tuple of positional tensors or a dict of keyword tensors, shaped as `job.step` will split the batch) to trace a model with `split_points` on, or for `partition_method="profile"` to time layers on; not needed with `data`"""
    partition_method: PartitionMethod | str = "parameters"
    """`parameters` (balance parameter counts, exactly), `uniform` (balance layer counts), `profile` (balance each layer's measured forward and backward time on a sample micro-batch from `data` or `example_inputs`; `split_points` override every method) or `type:REGEX` (balance the layers whose class name matches, case-insensitive, as DeepSpeed's `type:transformer`)"""
    activation_codec: CodecName | list[CodecName] = "none"
    """wire codec for forward activations: one name for every stage boundary, or a list with one per boundary; `none` is exact"""
    gradient_codec: CodecName | list[CodecName] = "none"
    """wire codec for backward input-gradients, as `activation_codec`"""
    error_feedback: bool = False
    """keep each gradient boundary's quantization residual per micro-batch slot and add it to that slot's next gradient"""
    measure_codec_error: bool = True
    """decode what was sent and report its error (costs one decode per lossy send)"""
    reduce_codec: CodecName = "none"
    """codec for the data-parallel gradient reduction; `none` is an exact all-reduce"""
    bucket_bytes: int = 25 << 20
    """size of the flat buckets the data-parallel reduction averages gradients in"""
    overlap_reduce: bool = True
    """start each bucket's data-parallel all-reduce during the last micro-batch's backward, as soon as its gradients are final (they live in the buckets: no copies), as DDP does; off, the buckets are copied and reduced after the barrier (the same bits, later), as they always are with a lossy `reduce_codec`"""
    transport: TransportName = "zmq"
    """stage-to-stage tensors as actor messages over ZeroMQ (`zmq`) or by `torch.distributed` point-to-point (`dist`)"""
    seed: int = 0
    """seed every stage builds the model from, so each slice holds the weights one process would start from"""
    data: str | None = None
    """a data factory by import path: `factory(**data_kwargs)` returns `batch(step) -> (inputs, targets)`; then `job.step()` takes no batch"""
    data_kwargs: dict[str, Any] = field(default_factory=dict)
    """keyword arguments of the data factory"""
    threads_per_stage: int | None = 1
    """torch intra-op threads in each stage process (`None`: torch's default)"""
    gradient_accumulation_fusion: bool = True
    """as in Megatron: exact `nn.Linear` weight gradients accumulate into `.grad` with one GEMM, and a backward whose input gradient leaves the rank runs as `I` (sent at once) then `W`; off: plain autograd"""
    w_batching: bool = False
    """W batching: every weight-gradient GEMM waits for the end of the step and runs as one GEMM per weight over all micro-batches (a larger K, as one process's whole batch); needs `gradient_accumulation_fusion`. Costs memory: each `nn.Linear`'s inputs and output gradients stay held for every micro-batch until then. With `schedule='auto'` the plan turns it on or off"""
    keep_freed_memory: bool = True
    """stage processes set glibc's malloc to keep freed buffers instead of page-faulting them in again every micro-batch"""
    step_timeout_s: float = 600.0
    """a step that takes longer fails with the stuck actions named"""
    max_restarts: int = 0
    """recoveries the job may make: a lost stage is respawned on a spare node and every stage rolls back to the newest snapshot, then the lost steps replay (pipeline- and data-parallel jobs over `zmq`); 0: a lost node fails the job with `NodeLost`"""
    snapshot_every: int = 1
    """with `max_restarts`, every stage keeps a copy of its parameters and optimizer state each this many steps, and sends one to the next pipeline rank"""
    on_nonfinite: NonFiniteAction = "raise"
    """a NaN or Inf in a loss or gradient, on any stage or replica, stops the step before any parameter changes: `raise` fails it with `NonFiniteError`, `skip` drops it everywhere and reports `StepStats.skipped`"""
    precision: Precision = "fp32"
    """`fp32`; `bf16` or `fp16`: compute under autocast with float32 master weights and optimizer state, stage boundaries in the compute dtype; `fp16` scales the loss (dynamic unless `loss_scale`)"""
    loss_scale: float = 0.0
    """with `fp16`: a static loss scale; 0 scales dynamically (DeepSpeed's `loss_scale`)"""
    initial_scale_power: int = 16
    """with dynamic fp16 loss scaling: the first scale is `2**initial_scale_power`"""
    loss_scale_window: int = 1000
    """with dynamic fp16 loss scaling: steps without an overflow before the scale doubles"""
    hysteresis: int = 2
    """with dynamic fp16 loss scaling: overflows tolerated before the scale halves"""
    min_loss_scale: float = 1.0
    """with dynamic fp16 loss scaling: the scale never drops below this"""
    gradient_clipping: float = 0.0
    """clip the global gradient norm (every stage, tensor shard and replica, as `clip_grad_norm_` on one process) to this; 0 is off. `StepStats.grad_norm` reports the norm either way"""
    lr_scheduler: tuple[str, dict[str, Any]] | None = None
    """`(path, kwargs)` of a learning-rate schedule stepped once per applied optimizer step on every stage (a skipped step does not advance it): any `torch.optim.lr_scheduler` class, or DeepSpeed's (`stages.state.lr:WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle`); `StepStats.lr` reports the rate, checkpoints and recovery continue it"""
    activation_checkpointing: bool | int = False
    """recompute activations in backward instead of keeping them: `True` checkpoints every layer (each keeps only its input), `N` each run of N layers of a stage (DeepSpeed's `activation_checkpoint_interval`; a traced stage is one run); exact, for about one more forward per micro-batch"""
    zero_stage: int = 0
    """ZeRO: 1 shards optimizer state across data-parallel replicas (each steps its shard, then the parameters are broadcast; with `data_parallel=1` nothing changes); 0 is off; 2 and 3 are refused with pipeline stages"""

    def __post_init__(self) -> None:
        _check_path("model", self.model)
        _check_kwargs("model_kwargs", self.model_kwargs)
        _check_path("loss", self.loss)
        object.__setattr__(self, "optimizer", _optimizer(self.optimizer))
        for name in ("pipeline_stages", "tensor_parallel", "data_parallel", "micro_batches"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_choice("schedule", self.schedule, SCHEDULE_NAMES, "schedule")
        if self.virtual_stages is not None:
            _check_int("virtual_stages", self.virtual_stages, minimum=2)
            if self.schedule != "interleaved":
                raise ValueError(f"virtual_stages={self.virtual_stages} applies only to schedule='interleaved', "
                                 f"not {self.schedule!r}; leave it out or use the interleaved schedule")
        if self.max_stash_bytes is not None:
            _check_int("max_stash_bytes", self.max_stash_bytes, minimum=1)
            if self.schedule != "auto":
                raise ValueError(f"max_stash_bytes limits what schedule='auto' may choose, and this job runs "
                                 f"{self.schedule!r}; use schedule='auto' or leave max_stash_bytes out")
        _check_partition_method(self.partition_method)
        self._check_split_points()
        if self.partition_method == "profile" and self.data is None and self.example_inputs is None:
            raise ValueError("partition_method='profile' times each layer on a sample micro-batch from the job's "
                             "data factory: give data='pkg.mod:factory' or example_inputs=<one micro-batch> "
                             "(or partition by parameters)")
        for name in ("error_feedback", "measure_codec_error", "overlap_reduce", "gradient_accumulation_fusion",
                     "keep_freed_memory", "w_batching"):
            _check_bool(name, getattr(self, name))
        edges: tuple[Literal["activation_codec", "gradient_codec"], ...] = ("activation_codec", "gradient_codec")
        for name in edges:
            value = getattr(self, name)
            if isinstance(value, tuple):
                value = list(value)
                object.__setattr__(self, name, value)
            self.edge_codecs(name)
        _check_choice("reduce_codec", self.reduce_codec, CODECS, "codec")
        _check_int("bucket_bytes", self.bucket_bytes, minimum=1)
        _check_choice("transport", self.transport, TRANSPORTS)
        _check_int("seed", self.seed, minimum=_SEED_RANGE[0], maximum=_SEED_RANGE[1])
        if self.data is not None:
            _check_path("data", self.data)
        _check_kwargs("data_kwargs", self.data_kwargs)
        if self.threads_per_stage is not None:
            _check_int("threads_per_stage", self.threads_per_stage, minimum=1)
        _check_seconds("step_timeout_s", self.step_timeout_s)
        _check_int("max_restarts", self.max_restarts, minimum=0)
        _check_int("snapshot_every", self.snapshot_every, minimum=1)
        if self.max_restarts and (self.tensor_parallel > 1 or self.transport != "zmq"):
            raise ValueError("max_restarts recovers pipeline- and data-parallel jobs over transport='zmq'; "
                             "tensor-parallel layers and transport='dist' hold process groups that recovery does "
                             "not form again yet: leave max_restarts at 0")
        _check_choice("on_nonfinite", self.on_nonfinite, NONFINITE_ACTIONS)
        if self.w_batching and not self.gradient_accumulation_fusion:
            raise ValueError("w_batching runs the fused weight-gradient GEMMs together; it needs "
                             "gradient_accumulation_fusion=True")
        self._check_training_options()
        # The schedule's own limits (e.g. interleaved needs micro_batches to be a multiple of the stages).
        build_schedule(AUTO_PROBE if self.schedule == "auto" else self.schedule, self.pipeline_stages,
                       self.micro_batches, self.num_virtual_stages if self.schedule == "interleaved" else None)

    def _check_training_options(self) -> None:
        """Precision, loss scaling, clipping, LR schedule, activation checkpointing and ZeRO (see docs/precision.md)."""
        _check_choice("precision", self.precision, PRECISIONS)
        for name in ("loss_scale", "min_loss_scale", "gradient_clipping"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {_show(value)}")
        _check_int("initial_scale_power", self.initial_scale_power, minimum=0, maximum=64)
        _check_int("loss_scale_window", self.loss_scale_window, minimum=1)
        _check_int("hysteresis", self.hysteresis, minimum=1)
        if self.lr_scheduler is not None:
            object.__setattr__(self, "lr_scheduler", _path_and_kwargs("lr_scheduler", self.lr_scheduler))
        value = self.activation_checkpointing
        if not isinstance(value, bool):
            _check_int("activation_checkpointing", value, minimum=1)
        _check_int("zero_stage", self.zero_stage, minimum=0, maximum=3)
        if self.zero_stage >= 2 and self.pipeline_stages > 1:
            raise ValueError(f"zero_stage={self.zero_stage} with pipeline_stages={self.pipeline_stages}: ZeRO-2 and "
                             "ZeRO-3 partition gradients, and pipeline parallelism accumulates each micro-batch's "
                             "gradients locally before the reduction (DeepSpeed refuses the same); use zero_stage=1")
        if self.zero_stage >= 2:
            raise ValueError(f"zero_stage={self.zero_stage} is not built yet; zero_stage=1 shards the optimizer state")

    def _check_split_points(self) -> None:
        points = self.split_points
        if self.example_inputs is not None:
            try:
                split_batch(self.example_inputs, 1, "example_inputs")
            except (TypeError, ValueError) as exc:
                raise TypeError(f"example_inputs: {exc}") from None
        if points is None:
            if self.example_inputs is not None and self.partition_method != "profile":
                raise ValueError("example_inputs is the micro-batch a model with split_points is traced on (or "
                                 "partition_method='profile' times layers on); give one of those, or leave it out")
            return
        if isinstance(points, tuple):
            points = list(points)
            object.__setattr__(self, "split_points", points)
        if not isinstance(points, list) or not all(isinstance(p, str) and 0 < len(p) <= 300 for p in points):
            raise TypeError(f"split_points must be a list of module names, got {_show(points)}")
        if len(points) != self.num_model_stages - 1:
            raise ValueError(f"split_points names {len(points)} modules; {self.num_model_stages} model stages "
                             f"({self.pipeline_stages} pipeline stages x {self.num_model_stages // self.pipeline_stages} "
                             f"virtual) begin at {self.num_model_stages - 1} of them")
        if self.tensor_parallel > 1:
            raise ValueError("tensor_parallel splits the layers of an nn.Sequential; a model split at split_points "
                             "trains with tensor_parallel=1")
        if self.example_inputs is None and self.data is None:
            raise ValueError("a model with split_points is traced on one micro-batch before training: give "
                             "example_inputs=<one micro-batch, as job.step splits the batch> or data='pkg.mod:factory'")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> JobSpec:
        """A spec from ``cluster.train``'s keyword arguments.

        Old spellings (``num_microbatches``, ``threads``) still work, with a DeprecationWarning.

        Raises:
            TypeError: an unknown argument (the message suggests the nearest known one),
                a missing ``model``, or a value of the wrong type.
            ValueError: a value that cannot work.
        """
        args = dict(kwargs)
        for old, new in _RENAMED.items():
            if old in args:
                if new in args:
                    raise TypeError(f"train() got both {old}= and {new}=; {old} is the old name of {new}")
                warnings.warn(f"train({old}=...) is deprecated; call it {new}", DeprecationWarning, stacklevel=3)
                args[new] = args.pop(old)
        known = [f.name for f in fields(cls)]
        for name in args:
            if name not in known:
                near = difflib.get_close_matches(str(name), known, n=1)
                hint = f"; did you mean {near[0]}?" if near else f"; known arguments: {', '.join(known)}"
                raise TypeError(f"train() got an unknown argument {name!r}{hint}")
        if "model" not in args:
            raise TypeError("train() needs model='package.module:factory'")
        return cls(**args)

    def replace(self, **changes: Any) -> JobSpec:
        """A copy with ``changes`` applied, checked like a new spec."""
        return dataclasses.replace(self, **changes)

    def edge_codecs(self, name: Literal["activation_codec", "gradient_codec"]) -> list[str]:
        """``activation_codec`` or ``gradient_codec`` as one codec per stage boundary.

        Raises:
            ValueError: an unknown codec, or a list whose length is not the number of boundaries.
        """
        value = getattr(self, name)
        edges = self.num_model_stages - 1
        if isinstance(value, str):
            _check_choice(name, value, CODECS, "codec")
            codecs = [value] * edges
        elif isinstance(value, list):
            codecs = list(value)
        else:
            raise TypeError(f"{name} must be a codec name or a list of them, got {_show(value)}")
        for codec in codecs:
            _check_choice(name, codec, CODECS, "codec")
        if len(codecs) != edges:
            raise ValueError(
                f"{name} lists {len(codecs)} codecs but the pipeline has {edges} stage boundaries "
                f"({self.num_model_stages} model stages); give one per boundary or a single name"
            )
        return codecs

    @property
    def num_virtual_stages(self) -> int:
        if self.schedule == "interleaved":
            return self.virtual_stages or 2
        return 1

    @property
    def num_model_stages(self) -> int:
        return self.pipeline_stages * self.num_virtual_stages

    @property
    def mesh(self) -> Mesh:
        return Mesh(pipeline=self.pipeline_stages, tensor=self.tensor_parallel, data=self.data_parallel)

    @property
    def factory_modules(self) -> list[str]:
        """The modules of the import paths this spec names (model, loss, optimizer, data, schedule).

        actorpipe's own schedules (``stages.state.lr``) are left out: every node admits them already.
        """
        paths = [self.model, self.loss, self.optimizer[0], self.data,
                 self.lr_scheduler[0] if self.lr_scheduler is not None else None]
        return sorted({p.partition(":")[0] for p in paths if p is not None} - {BUILTIN_SCHEDULES})

    def to_wire(self) -> dict[str, Any]:
        """Plain data for msgpack (``JobSpec.from_wire`` takes it back)."""
        data = dataclasses.asdict(self)
        data["optimizer"] = [self.optimizer[0], dict(self.optimizer[1])]
        return data

    @classmethod
    def from_wire(cls, data: Any) -> JobSpec:
        """The spec :meth:`to_wire` sent; checked like any other.

        Raises:
            TypeError, ValueError: not a spec, or one with unknown keys or bad values.
        """
        if not isinstance(data, dict):
            raise TypeError(f"a job spec must be a mapping, got {_show(data)}")
        return cls.from_kwargs(data)


def stage_config(
    spec: JobSpec,
    *,
    job: str,
    global_rank: int,
    bounds: Sequence[Sequence[int]],
    dist: Mapping[str, Any] | None,
) -> StageConfig:
    """The configuration of the stage actor at ``global_rank`` of ``spec``'s mesh: the one derivation."""
    mesh = spec.mesh
    return StageConfig(
        job=job, pipeline_rank=mesh.coords(global_rank).pipeline, pipeline_stages=spec.pipeline_stages,
        mesh=[mesh.pipeline, mesh.tensor, mesh.data], global_rank=global_rank,
        bounds=[list(b) for b in bounds], dist=dict(dist) if dist is not None else None,
        model=spec.model, model_kwargs=dict(spec.model_kwargs), loss=spec.loss,
        optimizer=[spec.optimizer[0], dict(spec.optimizer[1])], micro_batches=spec.micro_batches, seed=spec.seed,
        activation_codec=spec.edge_codecs("activation_codec"), gradient_codec=spec.edge_codecs("gradient_codec"),
        error_feedback=spec.error_feedback, measure_codec_error=spec.measure_codec_error,
        reduce_codec=spec.reduce_codec, bucket_bytes=spec.bucket_bytes, overlap_reduce=spec.overlap_reduce,
        transport=spec.transport,
        data=spec.data, data_kwargs=dict(spec.data_kwargs), threads_per_stage=spec.threads_per_stage,
        gradient_accumulation_fusion=spec.gradient_accumulation_fusion, keep_freed_memory=spec.keep_freed_memory,
        split_points=list(spec.split_points) if spec.split_points is not None else None,
        example_inputs=spec.example_inputs,
        precision=spec.precision, loss_scale=float(spec.loss_scale), initial_scale_power=spec.initial_scale_power,
        loss_scale_window=spec.loss_scale_window, hysteresis=spec.hysteresis,
        min_loss_scale=float(spec.min_loss_scale), gradient_clipping=float(spec.gradient_clipping),
        lr_scheduler=[spec.lr_scheduler[0], dict(spec.lr_scheduler[1])] if spec.lr_scheduler is not None else None,
        activation_checkpointing=spec.activation_checkpointing, zero_stage=spec.zero_stage,
        w_batching=spec.w_batching,
    )


# -- the reference table (docs/jobspec.md) --------------------------------------------


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal under it in this module's source)."""
    tree = ast.parse(inspect.getsource(JobSpec))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = after.value.value
    return docs


def argument_table() -> str:
    """docs/jobspec.md's markdown table of ``train()`` arguments, from the fields and their docstrings."""
    docs = field_docs()
    rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
    for f in fields(JobSpec):
        if f.default is not dataclasses.MISSING:
            default = f"`{f.default!r}`"
        elif f.default_factory is not dataclasses.MISSING:
            default = f"`{f.default_factory()!r}`"
        else:
            default = "required"
        rows.append(f"| `{f.name}` | {default} | {docs[f.name]} |")
    return "\n".join(rows)


# -- checks -------------------------------------------------------------------------------


def _show(value: Any) -> str:
    """A short, escaped excerpt of a value for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_int(name: str, value: Any, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {_show(value)}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {bound}, got {value}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {_show(value)}")


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {_show(value)}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")


def _check_partition_method(value: Any) -> None:
    if isinstance(value, str) and value.startswith("type:"):
        pattern = value.removeprefix("type:")
        if not pattern or len(pattern) > 200:
            raise ValueError(f"partition_method {_show(value)}: give a class-name pattern of 1 to 200 characters "
                             "after 'type:', e.g. 'type:block'")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"partition_method {_show(value)}: not a regular expression ({exc})") from None
        return
    _check_choice("partition_method", value, PARTITION_METHODS + ("type:REGEX",))


def _check_choice(name: str, value: Any, choices: tuple[str, ...], what: str | None = None) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {', '.join(choices)}; got {type(value).__name__} {_show(value)}")
    if value not in choices:
        near = [c for c in choices if c.lower() == value.lower()] or difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"{name}: unknown {what or 'value'} {_show(value)}{hint}; choose one of {', '.join(choices)}")


def _check_path(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be an import path 'package.module:callable', got "
                        f"{type(value).__name__} {_show(value)}")
    if not _IMPORT_PATH.match(value):
        raise ValueError(f"{name}: {_show(value)} is not an import path of the form 'package.module:callable'")


def _check_kwargs(name: str, value: Any) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"{name} must be a dict of keyword arguments (str keys), got {_show(value)}")


def _path_and_kwargs(name: str, value: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(value, str):
        path, kwargs = value, {}
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        path, kwargs = value
    else:
        raise TypeError(f"{name} must be 'package.module:Class' or (path, kwargs), got {_show(value)}")
    _check_path(name, path)
    _check_kwargs(f"{name} kwargs", kwargs)
    return str(path), dict(kwargs)


def _optimizer(value: Any) -> tuple[str, dict[str, Any]]:
    return _path_and_kwargs("optimizer", value)


if __name__ == "__main__":
    print(argument_table())
