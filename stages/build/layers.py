"""Building a job's model on a stage node: the whole model from its factory and seed, cut into layers.

Every stage builds the same model from the same seed and keeps its slice; the head
never builds it, but asks a worker for per-layer sizes (:func:`layer_parameter_counts`).
"""

from __future__ import annotations

import contextlib
import logging
import regex
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from stages.build import tied
from stages.compute.activations import run_layers, run_segments
from actors._errors import calling
from actors._registry import load_object
from stages.build.data_source import first_inputs
from stages.records import StageConfig
from stages.build.layer_specs import build_specs, is_layer_specs, layer_seed
from stages.build.meta_init import (
    buffers_on_meta, materialize, meta_values, on_meta, parameters_on_meta, restore_buffers, retarget)
from stages.build.traced import TracedStage, trace_stages

__all__ = ["TRACED_ON", "Chain", "build_layers", "layer_parameter_counts", "layer_times", "model_layers"]

log = logging.getLogger(__name__)


class Chain(nn.Sequential):
    """A stage's run of consecutive layers: the first takes the stage's arguments as given
    (the model's own, on the first stage), each later one the value before it returns.

    Args:
        checkpoint_every: when above 0, each run of this many layers is one activation
            checkpoint (see :mod:`stages.compute.activations`): backward recomputes it from its input.
    """

    def __init__(self, *layers: nn.Module, checkpoint_every: int = 0) -> None:
        super().__init__(*layers)
        self.checkpoint_every = checkpoint_every

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        layers = list(self)
        if not layers:
            if len(args) != 1 or kwargs:
                raise TypeError("an empty stage passes on exactly one value")
            return args[0]
        if self.checkpoint_every:
            return run_segments(layers, self.checkpoint_every, *args, **kwargs)
        return run_layers(layers, *args, **kwargs)


def build_layers(
    config: StageConfig, allow: Sequence[str], shard: Callable[[nn.Sequential], nn.Sequential] | None = None
) -> Layers:
    """Builds the model from its factory with the job's seed and returns its layers.

    A factory that returns the model (an ``nn.Sequential``) is called whole on every
    stage, from the same seed, so the slices each keeps hold exactly the weights one
    process would start from. A factory that returns layer specs
    (:mod:`stages.build.layer_specs`) has only the stage's own layers built for real,
    each under its own seed, and the rest on the meta device. ``shard`` then cuts a
    tensor-parallel rank's share out of the layers (it knows them by position).
    """
    factory = load_object(config.training.model, allow)
    torch.manual_seed(config.training.seed)
    meta = config.training.meta_init
    with parameters_on_meta() if meta else contextlib.nullcontext(), calling(model_factory(config.training.model)):
        built = factory(**config.training.model_kwargs)
    layers = Layers(_layers(built, config, allow, shard, meta))
    # What a Hugging Face model's from_pretrained passes over in its files (the causal masks the Hub's gpt2 keeps).
    passed = getattr(built, "_keys_to_ignore_on_load_unexpected", None)
    if isinstance(passed, (list, tuple, set, frozenset)):  # a set in transformers 5, a list before
        layers.passed_over = tuple(sorted(p for p in passed if isinstance(p, str)))
    return layers


class Layers(list[nn.Module]):
    """A model's layers (:func:`build_layers`), and the patterns of the keys its ``from_pretrained`` passes over
    in a file (Hugging Face's ``_keys_to_ignore_on_load_unexpected``; regular expressions it searches for)."""

    passed_over: tuple[str, ...] = ()


def _layers(built: Any, config: StageConfig, allow: Sequence[str],
            shard: Callable[[nn.Sequential], nn.Sequential] | None, meta: bool) -> list[nn.Module]:
    held = {i for s in config.stages for i in range(*config.bounds[s])}
    if config.parallelism.split_points is not None:
        return list(_traced_layers(built, config, allow))
    if is_layer_specs(built):  # only the held layers are built for real, each under its own seed
        model = nn.Sequential(*build_specs(built, config.training.seed, held))
    else:
        model = nn.Sequential(*model_layers(built, config.training.model))
        if meta:  # only the held layers' parameters made real (see stages.build.meta_init)
            wanted = [f"{i}.{name}" for i in held for name, _ in model[i].named_parameters(remove_duplicate=False)]
            materialize(model, meta_values(model, config.training.seed, wanted))
    if shard is not None:
        before = tied.tied_groups(list(model.children()))
        model = shard(model)
        lost = [names for names in before if names not in tied.tied_groups(list(model.children()))]
        if lost:
            raise ValueError(f"tensor parallelism would untie {' = '.join(lost[0])} (it splits one copy and not "
                             "the other); train this model with tensor_parallel=1, or untie it")
    layers = list(model.children())
    if config.bounds[-1][1] != len(layers):
        raise ValueError(
            f"the partition covers {config.bounds[-1][1]} layers but {config.training.model} built {len(layers)}"
        )
    return layers


# Where a model cut at split_points is traced (one traced on the meta device is pointed back here): a stage
# on another device points what the trace recorded at its own (stages.build.stage).
TRACED_ON = torch.device("cpu")


def _traced_layers(built: Any, config: StageConfig, allow: Sequence[str]) -> list[TracedStage]:
    """The model stages of any nn.Module, traced on the job's example micro-batch (see :mod:`stages.build.traced`)."""
    if not isinstance(built, nn.Module):
        raise TypeError(f"{config.training.model} built a {type(built).__name__}; split_points split an nn.Module")
    assert config.parallelism.split_points is not None
    example = config.parallelism.example_inputs
    if example is None:
        if config.training.data is None:
            raise ValueError("a model with split_points needs example_inputs or a data factory to trace on")
        with calling(data_factory(config.training.data)):
            made = load_object(config.training.data, allow)(**config.training.data_kwargs)
        example = first_inputs(made, config.training.micro_batch_size, config.training.seed, config.mesh.data,
                               config.micro_batches)
    meta = config.training.meta_init
    buffers: contextlib.AbstractContextManager[dict[int, tuple[torch.Tensor, torch.Tensor]]] = (
        buffers_on_meta(built) if meta else contextlib.nullcontext({}))
    with buffers as real_buffers:
        stages = trace_stages(built, config.parallelism.split_points, on_meta(example) if meta else example,
                              config.training.model, dynamic=config.parallelism.dynamic_shapes)
    if len(stages) != config.bounds[-1][1]:
        raise ValueError(f"the job has {config.bounds[-1][1]} model stages but {len(stages)} came of the split")
    described = getattr(getattr(built, "config", None), "to_json_string", None)  # a transformers model's config
    try:
        text = described() if callable(described) else None
    except (TypeError, ValueError) as exc:  # a config that does not say itself in JSON: exports go without one
        log.info("%s's config is not JSON (%s); an export writes no config.json", config.training.model, exc)
        text = None
    for stage in stages:
        stage.model_config = text if isinstance(text, str) else None
    if meta:  # traced on the meta device: the held stages' parameters made real, their ops pointed back
        for s in config.stages:
            names = [name for name, _ in stages[s].module.named_parameters(remove_duplicate=False)]
            materialize(stages[s].module, meta_values(built, config.training.seed, names),
                        also=[stage.module for stage in stages])
            restore_buffers(stages[s].module, real_buffers)
            retarget(stages[s], TRACED_ON)
    return stages


def layer_parameter_counts(model: str, model_kwargs: dict[str, Any], allow: Sequence[str],
                           type_pattern: str | None = None, *, whole: bool = False,
                           trainable: bool = False) -> list[int]:
    """The parameter count of each layer the factory ``model`` builds, for partitioning; with
    ``type_pattern``, 1 for each layer whose class name matches it (case-insensitive), else 0;
    ``trainable``: only the parameters that require gradients (a frozen embedding counts nothing),
    as DeepSpeed's ``partition_method="parameters"`` counts them.

    The model is built on the meta device, so its parameters take no memory; torch's
    device context is per thread, so stages computing in other threads are unaffected.
    Layers are taken as :func:`build_layers` takes them; ``whole``: one count, of the whole
    model, of any ``nn.Module`` (a model cut at ``split_points`` is no list of layers).

    Raises:
        NotAllowed: the node's allow-list refuses ``model``.
    """
    factory = load_object(model, allow)
    with torch.device("meta"), calling(model_factory(model)):
        built = factory(**model_kwargs)

    def count(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)

    if whole and isinstance(built, nn.Module):
        return [count(built)]
    layers = model_layers(built, model)
    if whole:
        return [sum(count(layer) for layer in layers)]
    if type_pattern is not None:
        return match_layer_types(type_pattern, [type(layer).__name__ for layer in layers])
    return [count(layer) for layer in layers]


def model_factory(path: Any) -> str:
    """Where an error from calling the model factory ``path`` came from (see :func:`actors._errors.calling`)."""
    return f"in the model factory {path}"


def data_factory(path: Any) -> str:
    """Where an error from calling the data factory ``path`` came from."""
    return f"in the data factory {path}"


# What matching partition_method="type:REGEX" against every layer may cost, in all.
MATCH_BUDGET_S = 1.0


def match_layer_types(pattern: str, names: Sequence[str], *, budget_s: float = MATCH_BUDGET_S) -> list[int]:
    """1 for each class name ``pattern`` matches (case-insensitive ``search``), else 0.

    The match runs under a time budget (the ``regex`` module's timeout): a pattern that
    backtracks catastrophically (``(\\w|\\w)*!``) fails here with an error instead of
    holding the interpreter, and with it the node's heartbeat and every other job.

    Raises:
        ValueError: not a pattern of at most 200 characters, or it ran out of time.
    """
    if not isinstance(pattern, str) or not 0 < len(pattern) <= 200:
        raise ValueError("type_pattern is a regular expression of 1 to 200 characters")
    try:
        compiled = regex.compile(pattern, regex.IGNORECASE)
    except regex.error as exc:
        raise ValueError(f"type:{pattern[:60]!r} is not a regular expression ({exc})") from None
    deadline = time.monotonic() + budget_s
    try:
        return [1 if compiled.search(name, timeout=max(deadline - time.monotonic(), 1e-3)) else 0 for name in names]
    except TimeoutError:
        raise ValueError(f"partition_method 'type:{pattern[:60]}' took more than {budget_s:g}s to match the "
                         f"model's {len(names)} layer class names (a pattern with nested repetition backtracks "
                         "without end); name the repeated block's class, e.g. 'type:block'") from None


def model_layers(built: Any, path: str) -> list[nn.Module]:
    """The layers a factory's model is split at: an ``nn.Sequential``'s children, a list's items,
    or layer specs built on the meta device.

    Raises:
        TypeError: any other object (e.g. a Hugging Face model), with what to return instead.
    """
    if isinstance(built, nn.Sequential):
        return list(built.children())
    if is_layer_specs(built):  # every layer on the meta device: shapes and classes, no memory
        return build_specs(built, 0, held=())
    if isinstance(built, (list, tuple, nn.ModuleList)) and built and all(isinstance(m, nn.Module) for m in built):
        return list(built)
    raise TypeError(
        f"{path} built a {type(built).__name__}, not an nn.Sequential, a list of layers or of LayerSpec: actorpipe "
        "splits a model between its top-level layers, in order. Return nn.Sequential(...) of them (or [LayerSpec(cls, "
        "*args), ...], to build each layer only on the stage that holds it), with whatever the "
        "model's forward does between them (a flatten before a classifier, a slice) as layers of their own; "
        "or split it as it is: give split_points=[...], the names of the modules each stage after the first "
        "begins at (e.g. ['transformer.h.6'] for two stages of a Hugging Face GPT-2)")


def layer_times(model: str, model_kwargs: dict[str, Any], allow: Sequence[str], data: str | None,
                data_kwargs: dict[str, Any], micro_batches: int, seed: int, repeats: int = 5,
                example: Any = None, micro_batch_size: int | None = None) -> list[int]:
    """Microseconds each layer takes, forward and backward, on the first micro-batch of data step 0
    (or on ``example``, one micro-batch, for a job without a data factory).

    For ``partition_method="profile"``: the model is built as a stage builds it, the
    sample comes from the job's own data factory, and each layer runs on the previous
    layer's output, once to warm up and then ``repeats`` times; the fastest run counts
    (noise on a shared machine only ever adds time). The time is the CPU time of the thread
    that runs the layer, with torch's intra-op work kept on that thread meanwhile (one
    thread): on a busy machine the wall clock also counts the time other processes had the
    cores, and the whole process's CPU time the node's other threads (its event loop,
    libzmq's I/O threads, torch's idle workers spinning) - either fell on some layers and
    not others and moved the split. A layer that waits without computing costs nothing here.
    """
    layers = _one_real_at_a_time(load_object(model, allow), model_kwargs, model, seed)
    if data is not None:
        with calling(data_factory(data)):
            made = load_object(data, allow)(**data_kwargs)
        x = first_inputs(made, micro_batch_size, seed, 1, micro_batches)
    else:
        x = example
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"partition_method='profile' times layers on a tensor micro-batch, got {type(x).__name__}; "
                        "partition by parameters, or give split_points")
    times = []
    with _torch_on_this_thread():
        for index, layer in layers:
            # As in training: no gradient flows into the data, only into every later layer's input.
            sample = x.detach().requires_grad_(index > 0 and x.is_floating_point())
            runs = []
            for _ in range(repeats + 1):
                started = time.thread_time()
                out = layer(sample)
                if out.requires_grad:
                    out.backward(torch.ones_like(out))
                runs.append(time.thread_time() - started)
            layer.zero_grad(set_to_none=True)
            times.append(max(1, round(min(runs[1:]) * 1e6)))
            with torch.no_grad():
                x = layer(x)
    return times


@contextlib.contextmanager
def _torch_on_this_thread() -> Iterator[None]:
    """Torch's intra-op work on the calling thread (one thread) meanwhile, so that the thread's CPU
    time is all of a layer's; CPU autograd runs its backward on the calling thread already."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _one_real_at_a_time(factory: Callable[..., Any], kwargs: dict[str, Any], path: str,
                        seed: int) -> Iterator[tuple[int, nn.Module]]:
    """The model's layers, each real only while the caller has it: the model is built with its
    parameters on the meta device (layer specs: not at all), and each layer in turn gets real ones
    (layer specs: its own seed's; otherwise random normal, enough to time it) and gives them back
    to the meta device once the next is asked for. So profiling a model needs one layer's memory,
    not the model's."""
    torch.manual_seed(seed)
    with parameters_on_meta(), calling(model_factory(path)):
        built = factory(**kwargs)
    if is_layer_specs(built):
        for index, spec in enumerate(built):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(layer_seed(seed, index))
                layer = spec.build()
            yield index, layer
        return
    layers = model_layers(built, path)
    model = nn.Sequential(*layers)
    for index, layer in enumerate(layers):
        values = {f"{index}.{name}": torch.empty(p.shape, dtype=p.dtype).normal_(0.0, 0.02) if p.is_floating_point()
                  else torch.zeros(p.shape, dtype=p.dtype)
                  for name, p in layer.named_parameters(remove_duplicate=False) if p.is_meta}
        materialize(model, values)
        yield index, layer
        layer.to("meta")
