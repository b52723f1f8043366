"""The sections of a :class:`~schedulers.jobs.JobSpec`, one frozen dataclass per concern.

Each section checks its own fields when it is made, and names a field in an error as
``section.field``; what must fit across sections (codecs per stage boundary, ZeRO with
pipeline stages, the schedule's own limits, ...) is checked by the spec. The sections
live here, below the scheduler, because a stage actor is built from them: its
:class:`~stages.records.StageConfig` carries the sections it needs as they are (they
are wire records, checked again when they arrive), so a new setting touches its
section, its one consumer and a test. Every field name is unique across the
sections, so a flat keyword routes to one (:data:`FIELDS`). The docstring under each
field is its documentation: the argument table is generated from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, get_args

from actors.records import WireRecord
from stages.spec_checks import (
    check_bool,
    check_choice,
    check_int,
    check_kwargs,
    check_number,
    check_optimizer_steps,
    check_partition_method,
    check_path,
    check_seconds,
    check_torch_compile,
    factory_path,
    path_and_kwargs,
    show,
)
from stages.mesh import Mesh
from stages.program import Placement
from stages.monitor_configs import CSVConfig, TensorBoardConfig, WandbConfig, monitor_config
from stages.state.weight_decay import check_rule as check_decay_rule
from stages.state.state_precision import STATE_PRECISIONS, StatePrecision, adam_arguments

__all__ = [
    "AUTO_PROBE",
    "CODECS",
    "COMPILE_BACKENDS",
    "COMPILE_MODES",
    "FIELDS",
    "LOSS_AVERAGING",
    "NONFINITE_ACTIONS",
    "PARTITION_METHODS",
    "PRECISIONS",
    "SCHEDULE_NAMES",
    "SECTIONS",
    "TRANSPORTS",
    "V_SCHEDULES",
    "Checkpointing",
    "CodecName",
    "Communication",
    "CompileBackend",
    "CompileMode",
    "Evaluation",
    "FaultTolerance",
    "LossAveraging",
    "MixedPrecision",
    "Monitoring",
    "NonFiniteAction",
    "Optimization",
    "Parallelism",
    "PartitionMethod",
    "Precision",
    "Runtime",
    "ScheduleName",
    "Training",
    "TransportName",
]

ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev", "auto"]
TransportName = Literal["zmq", "dist", "stream"]
PartitionMethod = Literal["parameters", "uniform", "profile"]
CodecName = Literal["none", "fp16", "bf16", "int8", "fp8", "int4"]
NonFiniteAction = Literal["raise", "skip"]
LossAveraging = Literal["samples", "tokens"]
Precision = Literal["fp32", "bf16", "fp16"]
# torch.compile's backends for training that come with torch (torch._dynamo.list_backends()), and its modes.
CompileBackend = Literal["inductor", "aot_eager", "eager", "cudagraphs"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
COMPILE_BACKENDS: tuple[str, ...] = get_args(CompileBackend)
COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)
PRECISIONS: tuple[str, ...] = get_args(Precision)

SCHEDULE_NAMES: tuple[str, ...] = get_args(ScheduleName)
# The schedules that hold two model stages on every rank in a V (stages.program.Placement "v").
V_SCHEDULES: tuple[str, ...] = ("zbv", "dualpipev")
TRANSPORTS: tuple[str, ...] = get_args(TransportName)
PARTITION_METHODS: tuple[str, ...] = get_args(PartitionMethod)
CODECS: tuple[str, ...] = get_args(CodecName)
NONFINITE_ACTIONS: tuple[str, ...] = get_args(NonFiniteAction)
LOSS_AVERAGING: tuple[str, ...] = get_args(LossAveraging)
# What a job with schedule="auto" runs while it measures its stages (schedulers.planning):
# ZB-H1 splits every backward into I and W, so one step times F, I and W on every stage,
# and its peak stash (p micro-batches a stage) is no more than 1F1B's largest.
AUTO_PROBE = "zero_bubble"

_SEED_RANGE = (0, 2**63 - 1)


class _Section(WireRecord):
    """What every section shares: its name in the spec, and a check's name for a field.

    A section is a wire record (it travels inside a stage's config) under the name
    ``JobSpec.<section>``.
    """

    __slots__ = ()
    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        cls.wire_name = f"JobSpec.{cls.__dict__.get('name', cls.__name__)}"
        super().__init_subclass__(**kwargs)

    @classmethod
    def key(cls, name: str) -> str:
        """``section.field``, as errors and the job file spell it."""
        return f"{cls.name}.{name}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Training(_Section):
    """What is trained, on what: the model, its loss, its data and the seed it starts from."""

    name: ClassVar[str] = "training"

    model: str
    """factory by import path (`package.module:callable`) or the function or class itself, returning an `nn.Sequential` (or a list of layers), or any `nn.Module` with `split_points`; each stage builds it from `seed` and keeps its slice"""
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    """keyword arguments of the model factory"""
    loss: str = "torch.nn.functional:mse_loss"
    """`output, target -> scalar`, mean-reduced, by import path or itself (with `loss_averaging="tokens"` it is called with `reduction="sum"`)"""
    loss_averaging: LossAveraging = "samples"
    """how a step's loss averages over micro-batches and replicas. `samples` (the default): each micro-batch's mean loss weighted by its share of the global batch's samples, which is one process's mean over the whole batch however it is split (an uneven last batch too). `tokens`: the sum of every per-token loss over the count of target elements other than `ignore_index` in the whole global batch, across micro-batches and replicas (Hugging Face's `num_items_in_batch`): the loss is called with `reduction="sum"` and the stages agree on the count before they step"""
    ignore_index: int = -100
    """with `loss_averaging="tokens"`: the target value that is not counted (padding, the prompt)"""
    data: str | None = None
    """a data factory by import path or itself: `factory(**data_kwargs)` returns `batch(step) -> (inputs, targets)` (the global batch), or a `torch.utils.data.DataLoader`, a map-style or iterable dataset (a Hugging Face `datasets` one too), which each replica's first and last stage read as `DistributedSampler` does, one micro-batch at a time; then `job.step()` takes no batch"""
    data_kwargs: dict[str, Any] = field(default_factory=dict)
    """keyword arguments of the data factory"""
    micro_batch_size: int | None = None
    """samples per micro-batch when `data` makes a dataset (a DataLoader's own `batch_size` wins): each replica reads `micro_batches` of them a step"""
    seed: int = 0
    """seed every stage builds the model from, so each slice holds the weights one process would start from"""
    meta_init: bool = False
    """build the model with its parameters on the meta device (a model cut at `split_points` is traced there too), and make real only the stage's own: each module resets its parameters (`reset_parameters()`, or a Hugging Face model's `_init_weights`) under a seed of its name, the same weights in any layout, which `stages.meta_initialized` builds in one process; for a model larger than one process, whose weights usually come from `job.load` (safetensors, checkpoints)"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", factory_path(self.key("model"), self.model))
        check_bool(self.key("meta_init"), self.meta_init)
        check_kwargs(self.key("model_kwargs"), self.model_kwargs)
        object.__setattr__(self, "loss", factory_path(self.key("loss"), self.loss))
        if self.data is not None:
            object.__setattr__(self, "data", factory_path(self.key("data"), self.data))
        check_kwargs(self.key("data_kwargs"), self.data_kwargs)
        if self.micro_batch_size is not None:
            check_int(self.key("micro_batch_size"), self.micro_batch_size, minimum=1)
        check_int(self.key("seed"), self.seed, minimum=_SEED_RANGE[0], maximum=_SEED_RANGE[1])
        check_choice(self.key("loss_averaging"), self.loss_averaging, LOSS_AVERAGING)
        check_int(self.key("ignore_index"), self.ignore_index, minimum=-(2**63), maximum=2**63 - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallelism(_Section):
    """The mesh (pipeline x tensor x data), the pipeline's schedule and where the model is cut."""

    name: ClassVar[str] = "parallelism"

    pipeline_stages: int = 1
    """pipeline ranks; the mesh has `pipeline_stages * tensor_parallel * data_parallel` stage actors, one per node"""
    tensor_parallel: int = 1
    """Megatron tensor-parallel degree (see "Data and tensor parallelism")"""
    data_parallel: int = 1
    """data-parallel replicas, each on its own shard of the global batch"""
    micro_batches: int = 1
    """the global batch (each replica's share) is split into this many; gradients accumulate across them"""
    schedule: ScheduleName = "1f1b"
    """`gpipe`, `1f1b` (PipeDream-Flush), `interleaved` (Megatron's virtual stages), `zero_bubble` (ZB-H1), `zbv` (ZB-V) and `dualpipev` (DeepSeek's DualPipeV; both hold two model stages per rank in a V: rank 0 the first and the last), or `auto`: the first steps run `zero_bubble` and time every stage's F, B, I, W and the link (two steps, three with fused weight gradients: one more times W batching, unless `max_stash_bytes` is set, which a W-batched step could exceed); the timed simulator then ranks the schedules this partition runs (GPipe, 1F1B, zero-bubble) and the job runs the fastest that fits `max_stash_bytes` (`job.plan()` shows them all, interleaved, ZB-V and DualPipeV included as re-partitions to consider; `StepStats.schedule` names the one each step ran)"""
    virtual_stages: int | None = None
    """model stages per rank with `interleaved` (>= 2; default 2); only for that schedule"""
    max_stash_bytes: int | None = None
    """with `schedule="auto"`: the most bytes of activations one stage actor may hold for backward (as `StepStats.peak_stash_bytes` counts them); auto runs the fastest schedule predicted to fit, and when none does the step that plans fails with nothing applied. `None`: no limit"""
    w_batching: bool = False
    """W batching: every weight-gradient GEMM waits for the end of the step and runs as one GEMM per weight over all micro-batches (a larger K, as one process's whole batch); needs `gradient_accumulation_fusion`. Costs memory: each `nn.Linear`'s inputs and output gradients stay held for every micro-batch until then. With `schedule='auto'` the plan turns it on or off"""
    partition_method: PartitionMethod | str = "parameters"
    """`parameters` (balance the counts of parameters that train, exactly; frozen ones weigh nothing, as in DeepSpeed), `uniform` (balance layer counts), `profile` (balance each layer's measured forward and backward time on a sample micro-batch from `data` or `example_inputs`; `split_points` override every method) or `type:REGEX` (balance the layers whose class name matches, case-insensitive, as DeepSpeed's `type:transformer`)"""
    split_points: list[str] | None = None
    """split any `nn.Module`: the names (as `named_modules()` gives them) of the modules each new stage begins at, `pipeline_stages * virtual stages - 1` of them; the model is traced with torch's pipelining front end on one micro-batch (`example_inputs`, else the data factory's first), and `state_dict`/checkpoints keep its own names"""
    example_inputs: Any = None
    """one micro-batch (a tensor, a tuple of positional tensors or a dict of keyword tensors, shaped as `job.step` will split the batch) to trace a model with `split_points` on, or for `partition_method="profile"` to time layers on; not needed with `data`"""
    dynamic_shapes: bool = True
    """with `split_points`: trace with every dimension of the inputs dynamic where the model lets it, so that any batch size and sequence length runs (dynamic padding, a loader's short last batch); `False` traces for the example micro-batch's shapes alone, as torch's `pipeline()` does, in about half the time per stage, and a step of other shapes is refused before it runs"""

    def __post_init__(self) -> None:
        for name in ("pipeline_stages", "tensor_parallel", "data_parallel", "micro_batches"):
            check_int(self.key(name), getattr(self, name), minimum=1)
        check_choice(self.key("schedule"), self.schedule, SCHEDULE_NAMES, "schedule")
        self._check_micro_batches()
        if self.virtual_stages is not None:
            check_int(self.key("virtual_stages"), self.virtual_stages, minimum=2)
            if self.schedule != "interleaved":
                raise ValueError(f"{self.key('virtual_stages')}={self.virtual_stages} applies only to "
                                 f"schedule='interleaved', not {self.schedule!r}; leave it out or use the "
                                 "interleaved schedule")
        if self.max_stash_bytes is not None:
            check_int(self.key("max_stash_bytes"), self.max_stash_bytes, minimum=1)
            if self.schedule != "auto":
                raise ValueError(f"{self.key('max_stash_bytes')} limits what schedule='auto' may choose, and "
                                 f"this job runs {self.schedule!r}; use schedule='auto' or leave max_stash_bytes out")
        check_bool(self.key("w_batching"), self.w_batching)
        check_bool(self.key("dynamic_shapes"), self.dynamic_shapes)
        if not self.dynamic_shapes and self.split_points is None:
            raise ValueError(f"{self.key('dynamic_shapes')}=False fixes the shapes a model with split_points is "
                             "traced for; this job has no split_points: leave it out")
        check_partition_method(self.key("partition_method"), self.partition_method, PARTITION_METHODS)
        self._check_split_points()

    def _check_micro_batches(self) -> None:
        """What a schedule asks of the micro-batch count, in the spec's own names (the schedule
        generators, which say num_microbatches and num_stages, would refuse it later)."""
        stages, micro = self.pipeline_stages, self.micro_batches
        if self.schedule == "interleaved" and micro % stages:
            below = micro - micro % stages
            options = " or ".join(str(n) for n in (below, below + stages) if n > 0)
            raise ValueError(f"{self.key('micro_batches')}={micro}: the interleaved schedule sends micro-batches "
                             f"round its {stages} pipeline stages in groups of {stages}; use a multiple of "
                             f"{stages} ({options})")
        if self.schedule == "dualpipev" and micro < 2 * stages:
            raise ValueError(f"{self.key('micro_batches')}={micro}: DualPipeV needs at least as many micro-batches "
                             f"as model stages, {2 * stages} for {stages} pipeline stages (two each)")

    def _check_split_points(self) -> None:
        points = self.split_points
        if points is None:
            if self.example_inputs is not None and self.partition_method != "profile":
                raise ValueError(f"{self.key('example_inputs')} is the micro-batch a model with split_points is "
                                 "traced on (or partition_method='profile' times layers on); give one of those, or "
                                 "leave it out")
            return
        if isinstance(points, tuple):
            points = list(points)
            object.__setattr__(self, "split_points", points)
        if not isinstance(points, list) or not all(isinstance(p, str) and 0 < len(p) <= 300 for p in points):
            raise TypeError(f"{self.key('split_points')} must be a list of module names, got {show(points)}")
        if len(points) != self.num_model_stages - 1:
            raise ValueError(f"{self.key('split_points')} names {len(points)} modules; {self.num_model_stages} "
                             f"model stages ({self.pipeline_stages} pipeline stages x {self.num_virtual_stages} "
                             f"virtual) begin at {self.num_model_stages - 1} of them")
        if self.tensor_parallel > 1:
            raise ValueError(f"{self.key('tensor_parallel')} splits the layers of an nn.Sequential; a model split "
                             "at split_points trains with tensor_parallel=1")

    @property
    def num_virtual_stages(self) -> int:
        """Model stages per pipeline rank: ``virtual_stages`` (default 2) with ``interleaved``, else 1."""
        if self.schedule == "interleaved":
            return self.virtual_stages or 2
        return 2 if self.schedule in V_SCHEDULES else 1

    @property
    def placement(self) -> Placement:
        """How the model stages sit on the ranks: ``v`` for ZB-V and DualPipeV, else round-robin."""
        return "v" if self.schedule in V_SCHEDULES else "loop"

    @property
    def num_model_stages(self) -> int:
        return self.pipeline_stages * self.num_virtual_stages

    @property
    def mesh(self) -> Mesh:
        return Mesh(pipeline=self.pipeline_stages, tensor=self.tensor_parallel, data=self.data_parallel)


@dataclass(frozen=True, slots=True, kw_only=True)
class Optimization(_Section):
    """The optimizer, its learning-rate schedule, gradient clipping and ZeRO."""

    name: ClassVar[str] = "optimization"

    optimizer: tuple[str, dict[str, Any]] = ("torch.optim:SGD", {"lr": 0.01})
    """`(path, kwargs)`, e.g. `("torch.optim:Adam", {"lr": 1e-3})` or `(torch.optim.Adam, {...})`, or a bare path or class"""
    lr_scheduler: tuple[str, dict[str, Any]] | None = None
    """`(path, kwargs)` of a learning-rate schedule stepped once per applied optimizer step on every stage (a skipped step does not advance it): any `torch.optim.lr_scheduler` class, or DeepSpeed's (`stages.state.lr:WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle`); `StepStats.lr` reports the rate, checkpoints and recovery continue it"""
    gradient_clipping: float = 0.0
    """clip the global gradient norm (every stage, tensor shard and replica, as `clip_grad_norm_` on one process) to this; 0 is off. `StepStats.grad_norm` reports the norm either way"""
    zero_stage: int = 0
    """ZeRO across data-parallel replicas: each bucket of gradients is reduce-scattered into one run of whole parameters per replica (half the bytes of an all-reduce), each replica steps and keeps optimizer state for its runs only, then the owners broadcast the parameters. 1: gradient buffers stay whole; 2: between steps a replica keeps only its runs' gradients. A lossy `reduce_codec` encodes each replica's range of the reduce-scatter (as ZeRO++); 0 is off, 3 is not built; with `data_parallel=1` nothing changes"""
    optimizer_states: StatePrecision = "fp32"
    """how Adam's two moments are held: `fp32` (torch's own optimizer, exact); `bf16`, `int8` or `int4` keep them in 2, 1 or 1/2 byte per parameter, block-wise with stochastic rounding (`stages.state.quantized_adam`), for `torch.optim:Adam` or `AdamW`; checkpoints store them as float32, readable at any precision"""
    no_weight_decay: str | tuple[str, ...] = ()
    """parameters the optimizer's `weight_decay` leaves alone, in a second parameter group with `weight_decay=0`: `"biases_and_norms"` (every parameter of fewer than two dimensions: biases and normalization layers' weights, as Megatron-LM and Hugging Face's Trainer leave them), or names as `model.named_parameters()` gives them, `*` a wildcard (`["*.bias", "*.ln_f.*"]`); `stages.parameter_groups` makes the same groups in one process. Empty (the default): one group, every parameter as the optimizer's own arguments say"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer", path_and_kwargs(self.key("optimizer"), self.optimizer))
        check_optimizer_steps(self.key("optimizer"), self.optimizer[0])
        object.__setattr__(self, "no_weight_decay", check_decay_rule(self.key("no_weight_decay"), self.no_weight_decay))
        if self.lr_scheduler is not None:
            object.__setattr__(self, "lr_scheduler", path_and_kwargs(self.key("lr_scheduler"), self.lr_scheduler))
        check_number(self.key("gradient_clipping"), self.gradient_clipping)
        check_int(self.key("zero_stage"), self.zero_stage, minimum=0, maximum=3)
        check_choice(self.key("optimizer_states"), self.optimizer_states, STATE_PRECISIONS)
        if self.optimizer_states != "fp32":
            try:
                adam_arguments(self.optimizer[0], self.optimizer[1], self.optimizer_states)
            except ValueError as e:
                raise ValueError(f"{self.key('optimizer_states')}: {e}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class MixedPrecision(_Section):
    """The compute dtype and fp16's loss scaling (DeepSpeed's ``fp16`` / ``bf16`` blocks)."""

    name: ClassVar[str] = "mixed_precision"

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

    def __post_init__(self) -> None:
        check_choice(self.key("precision"), self.precision, PRECISIONS)
        check_number(self.key("loss_scale"), self.loss_scale)
        check_number(self.key("min_loss_scale"), self.min_loss_scale)
        check_int(self.key("initial_scale_power"), self.initial_scale_power, minimum=0, maximum=64)
        check_int(self.key("loss_scale_window"), self.loss_scale_window, minimum=1)
        check_int(self.key("hysteresis"), self.hysteresis, minimum=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Communication(_Section):
    """What crosses the wire and how: stage boundaries' codecs, the transport, the data-parallel reduction."""

    name: ClassVar[str] = "communication"

    activation_codec: CodecName | list[CodecName] = "none"
    """wire codec for forward activations: one name for every stage boundary, or a list with one per boundary; `none` is exact"""
    gradient_codec: CodecName | list[CodecName] = "none"
    """wire codec for backward input-gradients, as `activation_codec`"""
    error_feedback: bool = False
    """keep each gradient boundary's quantization residual per micro-batch slot and add it to that slot's next gradient"""
    measure_codec_error: bool = True
    """decode what was sent and report its error (costs one decode per lossy send)"""
    transport: TransportName = "stream"
    """stage-to-stage tensors as sealed messages on a Unix or TCP stream that each stage's event loop reads and writes itself (`stream`: no ZeroMQ I/O thread on the path), as actor messages over ZeroMQ (`zmq`), or by `torch.distributed` point-to-point (`dist`)"""
    reduce_codec: CodecName = "none"
    """codec for the data-parallel gradient reduction; `none` is an exact all-reduce"""
    bucket_bytes: int = 25 << 20
    """size of the flat buckets the data-parallel reduction averages gradients in"""
    overlap_reduce: bool = True
    """start each bucket's data-parallel all-reduce during the last micro-batch's backward, as soon as its gradients are final (they live in the buckets: no copies), as DDP does; off, the buckets are copied and reduced after the barrier (the same bits, later), as they always are with a lossy `reduce_codec`"""

    def __post_init__(self) -> None:
        for name in ("activation_codec", "gradient_codec"):
            value = getattr(self, name)
            if isinstance(value, tuple):
                value = list(value)
                object.__setattr__(self, name, value)
            if isinstance(value, list):
                for codec in value:
                    check_choice(self.key(name), codec, CODECS, "codec")
            elif isinstance(value, str):
                check_choice(self.key(name), value, CODECS, "codec")
            else:
                raise TypeError(f"{self.key(name)} must be a codec name or a list of them, got {show(value)}")
        for name in ("error_feedback", "measure_codec_error", "overlap_reduce"):
            check_bool(self.key(name), getattr(self, name))
        check_choice(self.key("transport"), self.transport, TRANSPORTS)
        check_choice(self.key("reduce_codec"), self.reduce_codec, CODECS, "codec")
        check_int(self.key("bucket_bytes"), self.bucket_bytes, minimum=1)

    def edge_codecs(self, name: Literal["activation_codec", "gradient_codec"], edges: int) -> list[str]:
        """``activation_codec`` or ``gradient_codec`` as one codec per stage boundary (``edges`` of them).

        Raises:
            ValueError: a list whose length is not the number of boundaries.
        """
        value = getattr(self, name)
        codecs = [value] * edges if isinstance(value, str) else list(value)
        if len(codecs) != edges:
            raise ValueError(
                f"{self.key(name)} lists {len(codecs)} codecs but the pipeline has {edges} stage boundaries "
                f"({edges + 1} model stages); give one per boundary or a single name"
            )
        return codecs


@dataclass(frozen=True, slots=True, kw_only=True)
class Runtime(_Section):
    """How each stage process computes and holds memory; none of these changes a result but a lossy `stash_codec` (and `torch_compile`, by compile's rounding)."""

    name: ClassVar[str] = "runtime"

    threads_per_stage: int | None = 1
    """torch intra-op threads in each stage process (`None`: torch's default)"""
    gradient_accumulation_fusion: bool = True
    """as in Megatron: exact `nn.Linear` weight gradients accumulate into `.grad` with one GEMM, and a backward whose input gradient leaves the rank runs as `I` (sent at once) then `W`; off: plain autograd"""
    fusion_min_weight_elements: int = 65536
    """with `gradient_accumulation_fusion`, the fewest weight elements an `nn.Linear` needs to be fused (and its weight gradient deferred to `W`); a smaller one keeps plain autograd and has its weight gradient computed in `I`, because for it the fused layer's Python autograd Function costs more than the memory pass it saves (on CPU 1.5-2x a plain linear's forward and backward below 65536 elements; see docs/benchmarks.md). `0`: every `nn.Linear`"""
    activation_checkpointing: bool | int = False
    """recompute activations in backward instead of keeping them: `True` checkpoints every layer (each keeps only its input), `N` each run of N layers of a stage (DeepSpeed's `activation_checkpoint_interval`; a traced stage is one run); exact, for about one more forward per micro-batch"""
    stash_codec: CodecName = "none"
    """hold what autograd saves for backward encoded with this wire codec (`bf16`: 2 bytes a value; `int8`, `fp8`: about 1, block-scaled; `int4`: about 1/2), decoded when backward needs it, and let go of the stage's own boundary inputs and outputs, which backward needs only as places in the graph (`peak_stash_bytes` shows the saving). Lossy: each saved value is off by at most the codec's error (int8: its block's absmax / 254). Floating-point tensors of 1024 elements or more; never parameters, buffers or the batch. Composes with `activation_checkpointing`: each segment's input is held encoded. `none`: as they are, exact"""
    keep_freed_memory: bool = True
    """stage processes set glibc's malloc to keep freed buffers instead of page-faulting them in again every micro-batch"""
    torch_compile: bool | dict[str, Any] = False
    """compile each layer a stage holds with `torch.compile`, in place, after it is built and placed (a traced stage: its graph as one): `True`, or a dict of torch.compile's own arguments, `{"backend": "inductor", "mode": ..., "dynamic": ..., "fullgraph": ..., "options": {...}}` (backend `inductor`, `aot_eager`, `eager`, `cudagraphs`). Layers that record their own weight gradients (the fused `nn.Linear` of `gradient_accumulation_fusion`) or talk to other ranks (tensor-parallel ones) stay eager, graph breaks between compiled regions, so split backwards (`I`/`W`), W batching and activation checkpointing work as before; `fullgraph=True` therefore needs `gradient_accumulation_fusion=False` and `tensor_parallel=1`. The first step pays the compile; results equal eager's within compile's own rounding. `False`: eager"""

    def __post_init__(self) -> None:
        if self.threads_per_stage is not None:
            check_int(self.key("threads_per_stage"), self.threads_per_stage, minimum=1)
        for name in ("gradient_accumulation_fusion", "keep_freed_memory"):
            check_bool(self.key(name), getattr(self, name))
        check_int(self.key("fusion_min_weight_elements"), self.fusion_min_weight_elements, minimum=0)
        if not isinstance(self.activation_checkpointing, bool):
            check_int(self.key("activation_checkpointing"), self.activation_checkpointing, minimum=1)
        check_choice(self.key("stash_codec"), self.stash_codec, CODECS, "codec")
        check_torch_compile(self.key("torch_compile"), self.torch_compile, COMPILE_BACKENDS, COMPILE_MODES)
        if isinstance(self.torch_compile, dict) and self.torch_compile.get("fullgraph") and \
                self.gradient_accumulation_fusion:
            raise ValueError(f"{self.key('torch_compile')} fullgraph=True needs gradient_accumulation_fusion=False: "
                             "the fused nn.Linear weight gradients are an autograd Function that hands its GEMMs to "
                             "the stage (for the split backward's W), which torch.compile cannot trace, so each "
                             "linear is a graph break; set gradient_accumulation_fusion=False or leave fullgraph out")


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultTolerance(_Section):
    """What a slow step, a lost node or a non-finite value does to the job."""

    name: ClassVar[str] = "fault_tolerance"

    step_timeout_s: float = 600.0
    """a step that takes longer fails with the stuck actions named"""
    max_restarts: int = 0
    """recoveries the job may make: a lost stage is respawned on a spare node and every stage rolls back to the newest snapshot, then the lost steps replay (pipeline- and data-parallel jobs over `zmq`); 0: a lost node fails the job with `NodeLost`"""
    snapshot_every: int = 1
    """with `max_restarts`, every stage keeps a copy of its parameters and optimizer state each this many steps, and sends one to the next pipeline rank"""
    on_nonfinite: NonFiniteAction = "raise"
    """a NaN or Inf in a loss or gradient, on any stage or replica, stops the step before any parameter changes: `raise` fails it with `NonFiniteError`, `skip` drops it everywhere and reports `StepStats.skipped`"""

    def __post_init__(self) -> None:
        check_seconds(self.key("step_timeout_s"), self.step_timeout_s)
        check_int(self.key("max_restarts"), self.max_restarts, minimum=0)
        check_int(self.key("snapshot_every"), self.snapshot_every, minimum=1)
        check_choice(self.key("on_nonfinite"), self.on_nonfinite, NONFINITE_ACTIONS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluation(_Section):
    """The job's validation data, and how often the job evaluates itself on it."""

    name: ClassVar[str] = "evaluation"

    eval_data: str | None = None
    """the validation data: a factory by import path or itself, made and read as `data` is (`eval_factory(**eval_data_kwargs)` gives `batch(k) -> (inputs, targets)`, or a DataLoader or dataset read one micro-batch of `micro_batch_size` at a time); its batches 0 to `eval_batches - 1` are the validation set, the same ones at every evaluation, so that evaluations compare (the Trainer's `eval_dataset`, Megatron's validation split). `job.evaluate()` without a batch evaluates on it"""
    eval_data_kwargs: dict[str, Any] = field(default_factory=dict)
    """keyword arguments of the validation data factory"""
    eval_every: int = 0
    """evaluate on `eval_data` after every this many applied optimizer steps, in a run and one step at a time alike, between two steps (Megatron's `--eval-interval`, the Trainer's `eval_steps`); the loss (and `eval_metrics`) joins that step's `StepStats.eval_loss`, goes to the monitors as `Eval/loss` and out as an `Evaluated` event. 0: only when `job.evaluate` is called"""
    eval_batches: int = 1
    """batches of `eval_data` each evaluation averages over (Megatron's `--eval-iters`), each split as a step's global batch is, over the job's micro-batches and replicas; a dataset is read on as one stream, so batches past its end take its first samples again. 0: one pass over a dataset with a length (a map-style dataset or a DataLoader over one), every sample once, as the Trainer evaluates its `eval_dataset`: the last batch is short, cut as evenly as it goes"""
    eval_metrics: str | None = None
    """a metrics function by import path or itself (the Trainer's `compute_metrics`): `metrics(outputs, targets)` on the last stage, with each micro-batch's outputs and targets as the loss takes them, returns a number (named after the function) or a dict of named numbers, each a mean over the micro-batch (an accuracy, a mean error); every evaluation averages them over its micro-batches weighted by their samples (or counted tokens), as one process would over the whole batch, into `EvalResult.metrics`, the `Evaluated` event and the monitors (`Eval/NAME`)"""

    metric_for_best: str = "loss"
    """what the job's own evaluations are judged by: `loss`, or a name `eval_metrics` returns (the Trainer's `metric_for_best_model`); the best so far is in `job.describe().best_eval`"""
    greater_is_better: bool = False
    """whether a larger `metric_for_best` is better (an accuracy) rather than a smaller one (a loss, an error)"""
    early_stopping_patience: int = 0
    """stop a run (`job.run`) once this many of the job's own evaluations in a row did not improve on the best by more than `early_stopping_threshold` (the Trainer's `EarlyStoppingCallback`): the run ends after that step, says so (`EarlyStopped`, `RunInfo.stopped_early`), and a driven step's `StepStats.stop_early` is set. 0: never"""
    early_stopping_threshold: float = 0.0
    """by how much `metric_for_best` must beat the best so far to count as an improvement"""

    def __post_init__(self) -> None:
        if self.eval_data is not None:
            object.__setattr__(self, "eval_data", factory_path(self.key("eval_data"), self.eval_data))
        check_kwargs(self.key("eval_data_kwargs"), self.eval_data_kwargs)
        check_int(self.key("eval_every"), self.eval_every, minimum=0)
        check_int(self.key("eval_batches"), self.eval_batches, minimum=0)
        if self.eval_metrics is not None:
            object.__setattr__(self, "eval_metrics", factory_path(self.key("eval_metrics"), self.eval_metrics))
        if self.eval_every and self.eval_data is None:
            raise ValueError(f"{self.key('eval_every')} needs {self.key('eval_data')}: the validation data to "
                             "evaluate on")
        if not isinstance(self.metric_for_best, str) or not self.metric_for_best:
            raise TypeError(f"{self.key('metric_for_best')} must be 'loss' or a name eval_metrics returns, got "
                            f"{show(self.metric_for_best)}")
        if self.metric_for_best != "loss" and self.eval_metrics is None:
            raise ValueError(f"{self.key('metric_for_best')}={self.metric_for_best!r} needs {self.key('eval_metrics')}"
                             ": the function that returns it")
        check_bool(self.key("greater_is_better"), self.greater_is_better)
        check_int(self.key("early_stopping_patience"), self.early_stopping_patience, minimum=0)
        check_number(self.key("early_stopping_threshold"), self.early_stopping_threshold)
        if self.early_stopping_patience and not self.eval_every:
            raise ValueError(f"{self.key('early_stopping_patience')} needs {self.key('eval_every')}: early stopping "
                             "counts the job's own evaluations")


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpointing(_Section):
    """Where the job saves by itself, how often, and whether it goes on from its last save."""

    name: ClassVar[str] = "checkpointing"

    checkpoint_dir: str | None = None
    """where the job saves by itself (`checkpoint_every`) and what it resumes from (`resume_from_checkpoint`), resolved as `job.save`'s directory is: a client's stays in its subtree of the checkpoint root, an admin's relative path is taken from the driver's working directory"""
    checkpoint_every: int = 0
    """save a checkpoint into `checkpoint_dir` after every this many applied optimizer steps, in a run and one step at a time alike, between two steps (as Megatron's `--save-interval` and torchtitan's `checkpoint.interval`). 0: only `job.save` saves"""
    keep_checkpoints: int = 1
    """how many of the newest versions a save into `checkpoint_dir` keeps there, its own and `job.save`'s (torchtitan's `keep_latest_k`, the Trainer's `save_total_limit`); the older ones go once `LATEST` names the new one. 0: every version stays. A save into any other directory keeps only its newest"""
    keep_best: bool = False
    """keep the version saved at the job's best evaluation so far (by `evaluation.metric_for_best`) out of the rotation of `keep_checkpoints`, as the Trainer keeps its best checkpoint under `save_total_limit` (`load_best_model_at_end`); `job.describe().best_checkpoint` names it, for `job.load`. Needs `checkpoint_every` a multiple of `evaluation.eval_every`, so that every save has the evaluation of its own step"""
    resume_from_checkpoint: bool = False
    """as the job starts, load the newest checkpoint in `checkpoint_dir` if there is one (all or nothing, as `job.load`: weights, optimizer state, LR schedule, step count, and with it the data factory's position), so that a job started again after a crash goes on from its last save; none there: it starts from its seed"""

    def __post_init__(self) -> None:
        if self.checkpoint_dir is not None:
            check_path(self.key("checkpoint_dir"), self.checkpoint_dir)
            if not self.checkpoint_dir:
                raise ValueError(f"{self.key('checkpoint_dir')} must name a directory (None: no directory)")
        check_int(self.key("checkpoint_every"), self.checkpoint_every, minimum=0)
        check_int(self.key("keep_checkpoints"), self.keep_checkpoints, minimum=0)
        check_bool(self.key("resume_from_checkpoint"), self.resume_from_checkpoint)
        check_bool(self.key("keep_best"), self.keep_best)
        wanted = [self.key(name) for name in ("checkpoint_every", "resume_from_checkpoint") if getattr(self, name)]
        if wanted and self.checkpoint_dir is None:
            verb = "needs" if len(wanted) == 1 else "need"
            raise ValueError(f"{' and '.join(wanted)} {verb} {self.key('checkpoint_dir')}: the directory to save "
                             "into and resume from")


@dataclass(frozen=True, slots=True, kw_only=True)
class Monitoring(_Section):
    """Where the head writes each step's scalars and each evaluation's loss: TensorBoard, W&B (offline), CSV."""

    name: ClassVar[str] = "monitoring"

    tensorboard: TensorBoardConfig | None = None
    """TensorBoard event files in `output_path/job_name/` (DeepSpeed's `tensorboard` block): `{}` for the defaults, or `{"output_path": "runs", "job_name": "gpt"}`; `output_path` is resolved as a checkpoint directory is (a client's stays in its subtree of the checkpoint root), `job_name` defaults to the job's id. Needs `tensorboard` on the head (`pip install actorpipe[monitor]`)"""
    wandb: WandbConfig | None = None
    """a Weights & Biases run, offline, in `output_path/wandb/` (DeepSpeed's `wandb` block): `{"project": ..., "group": ..., "team": ...}` (team: W&B's entity); `wandb sync` uploads it. Needs `wandb` on the head"""
    csv_monitor: CSVConfig | None = None
    """one CSV file of `step,value` rows per scalar in `output_path/job_name/` (DeepSpeed's `csv_monitor` block), e.g. `Train_loss.csv`; paths as for `tensorboard`"""

    def __post_init__(self) -> None:
        for name, cls in (("tensorboard", TensorBoardConfig), ("wandb", WandbConfig), ("csv_monitor", CSVConfig)):
            object.__setattr__(self, name, monitor_config(self.key(name), getattr(self, name), cls))

    @property
    def enabled(self) -> bool:
        """Whether any monitor is on."""
        return any(getattr(self, f.name) is not None for f in fields(self))


_SECTION_CLASSES: tuple[type[Any], ...] = (Training, Parallelism, Optimization, MixedPrecision, Communication,
                                           Runtime, FaultTolerance, Evaluation, Checkpointing, Monitoring)
SECTIONS: dict[str, type[Any]] = {cls.name: cls for cls in _SECTION_CLASSES}
"""Each section of a :class:`JobSpec` by its name, in the spec's order."""
FIELDS: dict[str, str] = {f.name: cls.name for cls in _SECTION_CLASSES for f in fields(cls)}
"""Each field's section, by the field's name (unique across sections)."""
assert len(FIELDS) == sum(len(fields(cls)) for cls in _SECTION_CLASSES), "a field name is in two sections"
assert not set(FIELDS) & set(SECTIONS), "a field has a section's name"
