"""Builds one stage actor's share of a job: from its config to one frozen :class:`BuiltStage`.

Everything a stage computes with comes out of :func:`build_stage` at once — its modules,
optimizer and learning-rate schedule (as a :class:`~stages.compute.executor.StageModel`),
the names its tensors have in the whole model, its tensor-parallel shard specs, its tied
parameters, what the data-parallel reduction averages and what the global norm counts —
so that the actor holds one typed value, not a dozen attributes set on the way.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from actors._errors import calling
from actors._registry import load_object
from stages.build import tied
from stages.build.compiled import compile_stage
from stages.build.layers import TRACED_ON, Chain, Layers, build_layers, data_factory
from stages.build.meta_init import retarget
from stages.build.tensor_parallel import ShardSpec, shard_for_tensor_parallel, tp_shard_specs
from stages.build.traced import TracedStage
from stages.comm import overlap as _overlap
from stages.comm import zero
from stages.build.data_source import BatchFunction, DatasetReader, data_source
from stages.compute.averaging import check_summable
from stages.comm.groups import StageGroups
from stages.comm.parallel import start_average, start_reduce_scatter
from stages.compute import wgrad as _wgrad
from stages.compute.activations import checkpoint_interval
from stages.compute.allocator import keep_freed_memory
from stages.compute.executor import StageModel
from stages.compute.passes import broadcasting_loss
from stages.compute.inline import INLINE_MAX_S
from stages.mesh import Coords
from stages.records import StageConfig
from stages.spec_checks import closure_refusal
from stages.state import chunked_adam, quantized_adam, weight_decay
from stages.state.lr_scheduler import build_scheduler
from stages.state.stage_checkpoint import layer_key

__all__ = ["BuiltStage", "Key", "build_stage", "original_key", "read_data", "tied_names"]

log = logging.getLogger(__name__)

Key = Callable[[int, str], str]  # (layer, the layer's own tensor name) -> the name in the whole model


def original_key(layer: int, name: str) -> str:
    """A traced model's key: its stage modules keep the original model's names."""
    return name


@dataclass(frozen=True, slots=True, kw_only=True)
class BuiltStage:
    """What one stage actor computes with, as :func:`build_stage` made it."""

    model: StageModel
    """The held model stages' modules, loss, optimizer (ZeRO-1: sharded) and learning-rate schedule."""
    held: Mapping[int, nn.Module]
    """The held layers, by global layer index (a traced model: one per model stage)."""
    key: Key
    """A held layer's tensor's name in the whole model: ``"LAYER.name"``, or the name alone when traced."""
    named_parameters: Sequence[tuple[str, torch.Tensor]]
    """Every held parameter under its whole-model name (a shared one under each of its names)."""
    aliases: Mapping[str, list[str]]
    """A tied tensor's name -> its other names in the model (a state dict may give it under any)."""
    tied_primary: Mapping[str, str]
    """A tied tensor's name -> the name the model gives it first (an export keeps that one)."""
    specs: Mapping[str, list[int]]
    """How tensor-parallel parameters are split: key -> ``[dim, world, num_fused]``."""
    tied: tied.TiedSync
    """The parameters this rank shares with other pipeline ranks, whose gradients it sums with them."""
    reduce_params: Sequence[torch.Tensor]
    """What the data-parallel reduction averages, each once, in bucket (backward) order."""
    norm_params: Sequence[torch.Tensor]
    """Whose gradients this stage counts in the global norm (a tensor-replicated parameter on tensor
    rank 0 only, a tied one on the lowest pipeline rank holding it)."""
    overlap: _overlap.OverlappedReduction | None
    """The data-parallel reduction that starts during backward, where it serves."""
    gradient_shards: zero.GradientShards | None
    """ZeRO's reduce-scatter plan: whose run of each bucket this replica keeps and steps (None: all-reduce)."""
    data: BatchFunction | DatasetReader | None
    """The data factory's source, on a first or last stage of a job that has one; else None."""
    eval_data: BatchFunction | DatasetReader | None
    """The validation data's source (``evaluation.eval_data``), likewise."""
    tensor_rank: int
    """This stage's rank among its tensor-parallel shards."""
    data_rank: int
    """This stage's rank among its data-parallel replicas."""
    passed_over: tuple[str, ...] = ()
    """Patterns of the keys in another tool's files the model's ``from_pretrained`` passes over
    (:class:`~stages.build.layers.Layers`)."""

    def shard_spec_map(self) -> dict[str, ShardSpec]:
        """:attr:`specs` as :class:`~stages.build.tensor_parallel.ShardSpec` s."""
        return {key: ShardSpec(*spec) for key, spec in self.specs.items()}

    def tied_names(self, names: Sequence[str]) -> list[str]:
        """A tied group's names (``"LAYER.name"``) as the whole model gives them."""
        return tied_names(names, self.key)


def _data_source(cfg: StageConfig, path: str | None, kwargs: dict[str, Any],
                 allow: Sequence[str]) -> BatchFunction | DatasetReader | None:
    """The source a data factory ``path`` makes (:mod:`stages.build.data_source`), on a first or last
    stage; None on the others, or without one."""
    if path is None or not (0 in cfg.stages or cfg.num_stages - 1 in cfg.stages):
        return None
    with calling(data_factory(path)):
        made = load_object(path, allow)(**kwargs)
    return data_source(made, cfg.training.micro_batch_size, cfg.training.seed)


def _metrics_fn(cfg: StageConfig, allow: Sequence[str]) -> Callable[[Any, Any], Any] | None:
    """The job's metrics function (``evaluation.eval_metrics``), on a last stage; None elsewhere, or without one."""
    path = cfg.evaluation.eval_metrics
    if path is None or cfg.num_stages - 1 not in cfg.stages:
        return None
    return load_object(path, allow)  # type: ignore[no-any-return]


def whole_pass_source(source: BatchFunction | DatasetReader) -> None:
    """Checks that ``source`` can be read once through (``evaluation.eval_batches=0``): a dataset with a length.

    Raises:
        ValueError: a batch function (it has no end) or an iterable dataset (no length).
    """
    if isinstance(source, BatchFunction):
        raise ValueError("evaluation.eval_batches=0 reads the validation set once through, which needs a dataset "
                         "with a length (a map-style dataset, or a DataLoader over one); eval_data made a batch "
                         "function, which has no end: give eval_batches the number of batches to average over")
    source.pass_batches(1, 1)


def read_data(data: BatchFunction | DatasetReader | None, config: StageConfig, data_step: int, shard: Sequence[int],
              num_microbatches: int, what: str = "data factory", once: bool = False, position: int | None = None,
              ) -> tuple[list[Any] | None, list[Any] | None, list[float] | None]:
    """Step ``data_step``'s micro-batches of inputs (on a first stage) and targets (on a last), read from the
    data source ``data`` (:mod:`stages.build.data_source`): this replica's share (``shard``: ``[replica,
    replicas]``), and (on a last stage) their loss weights (None: an even split; see
    :mod:`stages.compute.averaging`).

    A stage actor that holds neither (the middle of three, or both inner stages of a V) reads
    nothing: its values come from its neighbours.

    ``position``: where a dataset's batch begins (:meth:`DatasetReader.read`). ``once``: batch ``data_step`` of
    one pass over a dataset (:meth:`DatasetReader.read_once`), the
    validation set's when ``evaluation.eval_batches`` is 0; its weights mark the stand-ins (0).

    Raises:
        ValueError: the job has no data factory (``what``: which one), or a batch of fewer samples than its parts.
    """
    first, last = 0 in config.stages, config.num_stages - 1 in config.stages
    if not (first or last):
        return None, None, None
    if data is None:
        raise ValueError(f"job {config.job} has no {what}")
    index, count = shard
    if once:
        assert isinstance(data, DatasetReader), "checked as the stage was built (whole_pass_source)"
        inputs, targets, weights = data.read_once(data_step, index, count, num_microbatches)
    else:
        inputs, targets, weights = data.read(data_step, index, count, num_microbatches, position)
    return inputs if first else None, targets if last else None, weights if last else None


def tied_names(names: Sequence[str], key: Key) -> list[str]:
    """A tied group's names (``"LAYER.name"``) as the whole model gives them (a traced model's own names)."""
    shown = []
    for name in names:
        layer, _, rest = name.partition(".")
        shown.append(key(int(layer), rest))
    return list(dict.fromkeys(shown))


def build_stage(config: StageConfig, allow: Sequence[str], device: torch.device,
                groups: StageGroups | None = None, *, reduce_exact: bool = True) -> BuiltStage:
    """Builds the layers, optimizer, schedule and the parts around them for the model stages ``config`` holds.

    Call on the stage's compute thread (it takes seconds; tensor-parallel layers bind
    their group there).

    Args:
        allow: the node's allow-list for the factories the config names.
        groups: the joined process groups (``config.dist``), whose tensor group shards
            the layers and whose data group the overlapped reduction averages over.
        reduce_exact: the data-parallel reduction is an exact all-reduce (no lossy
            ``reduce_codec``): only then may it start during backward.

    Raises:
        NotAllowed: a factory outside ``allow``.
        ValueError: a factory's arguments or result the stage cannot use.
    """
    cfg = config
    if cfg.runtime.threads_per_stage:
        torch.set_num_threads(cfg.runtime.threads_per_stage)
    if cfg.runtime.keep_freed_memory:
        keep_freed_memory()
    mesh = cfg.mesh
    me = mesh.coords(cfg.global_rank)
    shard = None
    if groups is not None and groups.groups is not None and mesh.tensor > 1:
        shard = functools.partial(shard_for_tensor_parallel, rank=me.tensor, world=mesh.tensor,
                                  group=groups.groups.tensor)
    modules, layers, key = _build_modules(cfg, allow, device, shard)
    held = {i: layers[i] for s in cfg.stages for i in range(*cfg.bounds[s])}
    named = [(key(i, name), p) for i, layer in held.items() for name, p in layer.named_parameters()]
    layer_rank = {i: cfg.rank_of(s) for s, (first, end) in enumerate(cfg.bounds)
                  for i in range(first, end)}
    sync = tied.TiedSync(cfg.pipeline_rank, tied.tied_for_rank(layers, layer_rank.__getitem__, cfg.pipeline_rank,
                                                               held))
    aliases: dict[str, list[str]] = {}
    primary: dict[str, str] = {}
    for names in tied.tied_groups(layers):
        shown = tied_names(names, key)
        for name in shown:
            aliases[name] = [other for other in shown if other != name]
            primary[name] = shown[0]
    specs = {key(i, k): list(spec) for i, layer in held.items() for k, spec in tp_shard_specs(layer).items()}
    weight_grads = None
    if cfg.runtime.gradient_accumulation_fusion:
        weight_grads = _wgrad.WeightGradients()
        for module in modules.values():
            _wgrad.install(module, weight_grads, min_weight_elements=cfg.runtime.fusion_min_weight_elements)
    # After the fused linears are installed: compile leaves them (and tensor-parallel layers) eager.
    compiled = compile_stage(modules, cfg.runtime.torch_compile, fused_linears=weight_grads)
    # A parameter two held layers share is one tensor: the optimizer takes it once.
    params = list({id(p): p for module in modules.values() for p in module.parameters()}.values())
    # A tied parameter's name is the least of its names: every rank holding it names it alike.
    param_names: dict[int, str] = {}
    for name, p in named:
        param_names[id(p)] = min(param_names.get(id(p), name), name, *aliases.get(name, []))
    reduce_params = _overlap.backward_order(modules)
    shards = None
    if cfg.optimization.zero_stage in (1, 2) and mesh.data > 1:
        # ZeRO: each bucket reduce-scattered into per-replica runs, which are what each replica steps.
        tied_ids = {id(g.param) for g in sync.groups}
        shards = zero.plan_gradient_shards(reduce_params, cfg.communication.bucket_bytes, mesh.data, tied_ids)
    # Each parameter under every name the model knows it by (a tied one's copies elsewhere too).
    known: list[tuple[str, torch.Tensor]] = []
    for p in params:
        first = param_names.get(id(p), "")
        known += [(name, p) for name in (first, *aliases.get(first, []))]
    with calling(f"in the optimizer {cfg.optimization.optimizer[0]}"
                 + (f" with {cfg.optimization.optimizer[1]!s:.200}" if len(cfg.optimization.optimizer) > 1 else "")):
        optimizer = _build_optimizer(cfg, allow, weight_decay.parameter_groups(known, cfg.optimization.no_weight_decay),
                                     groups, param_names, shards)
    scheduler = build_scheduler(cfg.optimization.lr_scheduler, optimizer, allow) if cfg.optimization.lr_scheduler is not None else None
    data = _data_source(cfg, cfg.training.data, cfg.training.data_kwargs, allow)
    eval_data = _data_source(cfg, cfg.evaluation.eval_data, cfg.evaluation.eval_data_kwargs, allow)
    if eval_data is not None and cfg.evaluation.eval_batches == 0:
        whole_pass_source(eval_data)
    log.info("stage %s/%d of job %s: model stages %s, %d parameters", cfg.pipeline_rank, cfg.pipeline_stages,
             cfg.job, cfg.stages, sum(p.numel() for p in params))
    overlap = None
    if groups is not None and groups.data_size > 1 and cfg.communication.overlap_reduce and reduce_exact:
        overlap = _build_overlap(cfg, modules, named, reduce_params, weight_grads, groups, shards, me.data)
    # Each parameter's share of the global norm: replicated tensor-parallel ones on tensor
    # rank 0, tied ones on the lowest pipeline rank holding them.
    tied_elsewhere = {id(g.param) for g in sync.groups if g.ranks[0] != cfg.pipeline_rank}
    norm_params = list({id(p): p for name, p in named
                        if id(p) not in tied_elsewhere and (name in specs or me.tensor == 0)}.values())
    loss_fn = load_object(cfg.training.loss, allow)
    tokens = cfg.training.loss_averaging == "tokens"
    if tokens and cfg.num_stages - 1 in cfg.stages:
        check_summable(loss_fn, cfg.training.loss)
    model = StageModel(modules=modules, num_stages=cfg.num_stages, loss_fn=loss_fn,
                       optimizer=optimizer, device=device, weight_grads=weight_grads, w_batching=cfg.parallelism.w_batching,
                       compute_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.mixed_precision.precision),
                       lr_scheduler=scheduler, stash_codec=cfg.runtime.stash_codec,
                       token_ignore_index=cfg.training.ignore_index if tokens else None,
                       metrics_fn=_metrics_fn(cfg, allow), checks_target_shape=broadcasting_loss(loss_fn),
                       # Tensor-parallel layers wait for their peers inside an action, and a compiled layer
                       # may compile again (a new shape, evaluation's no_grad): on the thread, never the loop's.
                       inline_max_s=0.0 if mesh.tensor > 1 or compiled else INLINE_MAX_S)
    return BuiltStage(model=model, held=held, key=key, named_parameters=named, aliases=aliases, tied_primary=primary,
                      specs=specs,
                      tied=sync, reduce_params=reduce_params, norm_params=norm_params, overlap=overlap,
                      gradient_shards=shards, data=data, eval_data=eval_data,
                      tensor_rank=me.tensor, data_rank=me.data, passed_over=layers.passed_over)


def _build_modules(cfg: StageConfig, allow: Sequence[str], device: torch.device,
                   shard: Callable[[nn.Sequential], nn.Sequential] | None
                   ) -> tuple[dict[int, nn.Module], Layers, Key]:
    """The held model stages' modules on ``device``, every layer of the model, and how held tensors are named."""
    built = build_layers(cfg, allow, shard)
    if cfg.mixed_precision.precision in ("bf16", "fp16"):
        _float32_masters(built, cfg)
    every = checkpoint_interval(cfg.runtime.activation_checkpointing)  # layers per activation checkpoint; 0: off
    modules: dict[int, nn.Module] = {}
    if cfg.parallelism.split_points is None:
        for s in cfg.stages:
            first, end = cfg.bounds[s]
            modules[s] = Chain(*built[first:end], checkpoint_every=every).to(device)
        return modules, built, layer_key
    # A traced model: one stage module per model stage; its graph module holds the
    # parameters under the original model's names.
    traced = [stage for stage in built if isinstance(stage, TracedStage)]
    for s in cfg.stages:
        modules[s] = traced[s].to(device)
        if device != TRACED_ON:  # the ops the trace recorded as making tensors on the CPU make them on the GPU
            retarget(modules[s], device, source=TRACED_ON)
        traced[s].checkpoint_activations = bool(every)  # the whole stage is one segment
    layers = Layers(stage.module for stage in traced)
    layers.passed_over = built.passed_over
    return modules, layers, original_key


def _float32_masters(layers: Sequence[nn.Module], cfg: StageConfig) -> None:
    """Mixed precision keeps float32 master weights, whatever dtype the factory built them in (a model loaded
    with ``torch_dtype=torch.bfloat16``): its half-precision parameters become float32, as DeepSpeed's bf16
    and fp16 modes keep float32 masters of them; autocast computes in the half dtype all the same. Left
    in 16 bits, a small update rounds away (an lr of 1e-4 changed no weight at all)."""
    low = {torch.bfloat16, torch.float16}
    for layer in layers:
        halves = [name for name, p in layer.named_parameters() if p.dtype in low]
        if halves:
            log.info("%s: precision=%s keeps float32 master weights; %d parameter(s) built in %s (%s...) become "
                     "float32", cfg.job, cfg.mixed_precision.precision, len(halves),
                     str(layer.get_parameter(halves[0]).dtype).removeprefix("torch."), halves[0])
            for p in layer.parameters():
                if p.dtype in low:
                    p.data = p.data.float()


def _build_optimizer(cfg: StageConfig, allow: Sequence[str], param_groups: list[dict[str, Any]],
                     groups: StageGroups | None, names: Mapping[int, str],
                     shards: zero.GradientShards | None) -> torch.optim.Optimizer:
    """The stage's optimizer over ``param_groups`` (:func:`~stages.state.weight_decay.parameter_groups`)."""
    params = [p for group in param_groups for p in group["params"]]
    optimizer_cls = load_object(cfg.optimization.optimizer[0], allow)
    if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.LBFGS):
        raise ValueError(closure_refusal(cfg.optimization.optimizer[0]))
    optimizer_kwargs = dict(cfg.optimization.optimizer[1] if len(cfg.optimization.optimizer) > 1 else {})
    if cfg.optimization.optimizer_states != "fp32":  # Adam's moments in fewer bits
        optimizer_cls, optimizer_kwargs = quantized_adam.replacing(
            cfg.optimization.optimizer[0], optimizer_kwargs, cfg.optimization.optimizer_states, names)
    elif params:  # torch's Adam on CPU, its temporaries a slice of a parameter at a time (the same bits)
        optimizer_cls = chunked_adam.chunked(optimizer_cls, optimizer_kwargs, params[0].device)
    mesh = cfg.mesh
    if cfg.optimization.zero_stage in (1, 2) and mesh.data > 1:  # with one replica there is nothing to shard
        assert groups is not None, "ZeRO-1 across replicas needs the job's process groups"
        me = mesh.coords(cfg.global_rank)
        optimizer: torch.optim.Optimizer = zero.ShardedOptimizer(
            param_groups, optimizer_cls, optimizer_kwargs, shard=me.data, group=groups.data_group,
            ranks=[mesh.rank(Coords(d, me.pipeline, me.tensor)) for d in range(mesh.data)],
            bucket_bytes=cfg.communication.bucket_bytes, owners=shards.owners if shards is not None else None)
    else:
        optimizer = optimizer_cls(param_groups, **optimizer_kwargs)
    if cfg.optimization.no_weight_decay and "weight_decay" not in optimizer.defaults:
        raise ValueError(f"optimization.no_weight_decay: {cfg.optimization.optimizer[0]} takes no weight_decay, "
                         "so there is no decay to leave parameters out of")
    return optimizer


def _build_overlap(cfg: StageConfig, modules: dict[int, nn.Module], named: Sequence[tuple[str, torch.Tensor]],
                   reduce_params: list[torch.Tensor], weight_grads: _wgrad.WeightGradients | None,
                   groups: StageGroups, shards: zero.GradientShards | None, replica: int) -> _overlap.OverlappedReduction:
    """The data-parallel reduction that starts during backward (with replicas, ``overlap_reduce`` on
    and an exact all-reduce: a lossy ``reduce_codec`` encodes each bucket with error feedback after
    the barrier instead, in :func:`~stages.comm.parallel.average_gradients`)."""
    names: dict[int, list[str]] = {}
    for name, p in named:
        names.setdefault(id(p), []).append(name)
    world = groups.data_size

    def reduce(flat: torch.Tensor) -> Any:
        return start_average(flat, groups.data_group(), world)  # the group as it is now: a rejoin replaces it

    def scatter(flat: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> Any:
        return start_reduce_scatter(flat, ranges, replica, groups.data_group(), world)

    return _overlap.OverlappedReduction(reduce_params, modules, names, bucket_bytes=cfg.communication.bucket_bytes,
                                        reduce=reduce, weight_grads=weight_grads, w_batching=cfg.parallelism.w_batching,
                                        shards=shards, scatter=scatter, replica=replica,
                                        release=cfg.optimization.zero_stage == 2)
