"""Any ``nn.Module`` split at named split points, with torch's own pipelining front end.

``torch.distributed.pipelining.pipeline`` traces the model (``torch.export``) on one
example micro-batch and cuts the graph before each split point's module. Each stage
actor traces the same model from the same seed on the same example, so every stage
has the same graph; it keeps the submodules of its own stages.

What torch's front end leaves to us, done here:

* **Routing.** A traced stage may need values from any earlier stage, not just the one
  before it (GPT-2's attention mask from stage 0 at stage 2). actorpipe's boundaries
  join neighbours only, so each stage passes on, as one tuple, every value that a
  later stage still needs: its own outputs and what it received for later ones.
* **Tied parameters.** Tracing copies each stage's parameters, so a parameter the
  model shares between stages (tied embeddings) arrives as separate copies; they are
  made one tensor again per process, and :mod:`stages.build.tied` keeps the stages' copies
  equal.
* **Names.** A stage module's ``state_dict`` already uses the original model's keys;
  buffers the model keeps out of its ``state_dict`` (rotary ``inv_freq``) are kept out
  here too, so the gathered state loads into the original model with ``strict=True``.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import operator
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from stages.compute.activations import checkpointed

__all__ = ["TracedStage", "TracingError", "check_batch", "trace_stages"]

_PLACEHOLDER = -1  # "produced" by the model's inputs


class TracingError(ValueError):
    """The model could not be split at the given split points; the message says what to do."""


# Ops whose training behaviour the trace records as an argument: (op, the argument's index, its value in eval).
_MODE_ARGS: dict[Any, tuple[int, str, Any]] = {
    torch.ops.aten.dropout.default: (2, "train", False),
    torch.ops.aten.feature_dropout.default: (2, "train", False),
    torch.ops.aten.alpha_dropout.default: (2, "train", False),
    torch.ops.aten.feature_alpha_dropout.default: (2, "train", False),
    torch.ops.aten.native_dropout.default: (2, "train", False),
    torch.ops.aten.scaled_dot_product_attention.default: (4, "dropout_p", 0.0),
    torch.ops.aten.batch_norm.default: (5, "training", False),
}
_TRAINED_AS = "actorpipe_training_value"  # node.meta: the argument's value as traced (the training one)


def graph_training(module: nn.Module, mode: bool) -> int:
    """Sets the training flag the trace recorded in ``module``'s graphs (dropout's ``train``, attention's
    ``dropout_p``, batch norm's ``training`` and the 1 it adds to its count of batches) to the traced value
    (``mode`` True) or the evaluation one; returns how many graphs changed (each is recompiled)."""
    changed = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        touched = False
        for node in graph.nodes:
            found = _MODE_ARGS.get(node.target) if node.op == "call_function" else None
            if found is None and _counts_batches(node):
                found = (1, "other", 0)  # batch norm's count of batches, moved in training only
            if found is None:
                continue
            index, keyword, off = found
            in_args = len(node.args) > index
            current = node.args[index] if in_args else node.kwargs.get(keyword, _ABSENT)
            if current is _ABSENT:
                continue
            traced = node.meta.setdefault(_TRAINED_AS, current)
            wanted = traced if mode else off
            if current == wanted:
                continue
            if in_args:
                node.args = (*node.args[:index], wanted, *node.args[index + 1:])
            else:
                node.kwargs = {**node.kwargs, keyword: wanted}
            touched = True
        if touched:
            changed += 1
            if isinstance(sub, fx.GraphModule):
                sub.recompile()
    return changed


_ABSENT = object()


def _counts_batches(node: fx.Node) -> bool:
    """Whether ``node`` is batch norm's ``num_batches_tracked.add_(1)``, which the trace recorded as the
    training forward runs it."""
    target = node.args[0] if node.op == "call_function" and node.target is torch.ops.aten.add_.Tensor else None
    return (isinstance(target, fx.Node) and target.op == "get_attr"
            and str(target.target).rpartition(".")[2] == "num_batches_tracked")


class TracedStage(nn.Module):
    """One model stage of a traced model: its graph module, and which values it takes and passes on.

    The first stage is called as the model is (positional and keyword tensors); every
    later one with the tuple the stage before it returned. The last returns the
    model's output; the others a tuple of the values later stages need.
    """

    def __init__(self, module: fx.GraphModule, *, index: int, args: list[Any], received: list[str],
                 produced: list[tuple[str, int | None]], passed: list[str], output: Any,
                 signature: inspect.Signature | None, placeholders: dict[str, str]) -> None:
        super().__init__()
        self.module = module
        self.index = index
        self._compiled_for_training: Any = None  # a compiled module's compiled call, while it evaluates (see train)
        self._args = args  # per argument of the graph module: a value name, or ("const", value)
        self._received = received
        self._produced = produced  # value name, index into the module's output (None: the output itself)
        self._passed = passed
        self._output = output  # the last stage: the model output's structure in value names
        self._signature = signature
        self._placeholders = placeholders
        # Set by the stage for activation checkpointing: the graph module is one checkpoint.
        self.checkpoint_activations = False
        # The traced model's config as JSON (a transformers model's ``config``), for an export; or None.
        self.model_config: str | None = None
        # The first stage's: per placeholder (by value name), the dimensions its trace fixed, as (dim, size).
        self.fixed: dict[str, list[tuple[int, int]]] = {}
        # Traced for the example's shapes alone, as asked (the job's ``dynamic_shapes=False``).
        self.static = False
        if signature is not None:
            # Here, not at the top: sympy and torch's symbolic shapes cost a driver 0.4 s to import.
            from torch.fx.experimental.symbolic_shapes import is_concrete_int

            nodes = [n for n in module.graph.nodes if n.op == "placeholder"]
            for node, arg in zip(nodes, args):
                value = node.meta.get("val")
                if isinstance(arg, str) and isinstance(value, torch.Tensor):
                    dims = [(d, int(size)) for d, size in enumerate(value.shape) if is_concrete_int(size)]
                    if dims:
                        self.fixed[arg] = dims

    def train(self, mode: bool = True) -> TracedStage:
        """Training or evaluation mode, as ``nn.Module.train``; and, since the trace wrote the training
        flag of dropout, attention dropout and batch norm into the graph as constants (a module's own
        ``training`` no longer reaches them), those ops are switched too (:func:`graph_training`): an
        evaluation of a model cut at ``split_points`` drops nothing and normalizes with the running
        statistics, which it leaves as they are, as ``model.eval()`` does."""
        super().train(mode)
        graph_training(self.module, mode)
        # A compiled graph (torch_compile) keeps the graph it compiled, in training mode: the rewrite above never
        # reaches it (an evaluation ran with dropout on and moved batch norm's statistics). Evaluation runs the
        # graph module as it now is, eagerly; training takes its compiled graph back.
        module = self.module
        if not mode and module._compiled_call_impl is not None:
            self._compiled_for_training = module._compiled_call_impl
            module._compiled_call_impl = None
        elif mode and self._compiled_for_training is not None:
            module._compiled_call_impl, self._compiled_for_training = self._compiled_for_training, None
        return self

    def check_inputs(self, inputs: Any) -> None:
        """Refuses a micro-batch (as the first stage takes it) whose shape the trace cannot run: a
        dimension ``torch.export`` fixed (the model computes with its size) that differs.

        Raises:
            ValueError: names the input, the dimension, both sizes and what to do.
        """
        if not self.fixed:
            return
        call_args, call_kwargs = _as_call(inputs)
        env = self._bind(call_args, call_kwargs)
        for node, dims in self.fixed.items():
            value = env.get(node)
            if not isinstance(value, torch.Tensor):
                continue
            for dim, size in dims:
                if dim >= value.dim() or value.shape[dim] == size:
                    continue
                if self.static:
                    raise ValueError(
                        f"input {self._placeholders.get(node, node)!r} has shape {tuple(value.shape)}, but the job "
                        f"traced its model for the example's shapes alone (dynamic_shapes=False), which has {size} "
                        f"at dim {dim}: give micro-batches of the example's shapes (pad to them), or trace with "
                        "dynamic_shapes=True (the default) for any batch size and sequence length")
                raise ValueError(
                    f"input {self._placeholders.get(node, node)!r} has {value.shape[dim]} at dim {dim} (shape "
                    f"{tuple(value.shape)}), but tracing the model fixed that dimension at {size}: torch.export "
                    "could not keep it dynamic (the model computes with its size, e.g. a reshape to it). Give "
                    f"micro-batches whose dim {dim} is {size} (pad to it), or make the model take its sizes "
                    "from its inputs"
                    + (f"; export fixes every size of 1, so trace on example_inputs with more than one there"
                       if size == 1 else ""))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._signature is not None:
            env = self._bind(args, kwargs)
        else:
            (values,) = args
            if not isinstance(values, (tuple, list)) or len(values) != len(self._received):
                got = len(values) if isinstance(values, (tuple, list)) else type(values).__name__
                raise TypeError(f"traced stage {self.index} takes {len(self._received)} values, got {got}")
            env = dict(zip(self._received, values))
        module_args = [env[a] if isinstance(a, str) else a[1] for a in self._args]
        out = checkpointed(self.module, *module_args, modules=[self.module]) if self.checkpoint_activations else self.module(*module_args)
        for name, index in self._produced:
            env[name] = out if index is None else out[index]
        if self._output is not None:
            return _fill(self._output, env)
        return tuple(env[name] for name in self._passed)

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        assert self._signature is not None
        bound = self._signature.bind(*args, **kwargs).arguments
        extra: dict[str, Any] = {}
        for name, param in self._signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD and name in bound:
                extra = dict(bound[name])
        env = {}
        for node, name in self._placeholders.items():
            if name in bound:
                env[node] = bound[name]
            elif name in extra:
                env[node] = extra[name]
            else:
                raise TypeError(f"the model was traced with an input {name!r} that this batch does not give")
        return env


def check_batch(module: nn.Module, micro_batches: Sequence[Any]) -> None:
    """Refuses a step whose micro-batches the first stage's traced graph cannot run (see
    :meth:`TracedStage.check_inputs`), before any of its actions; a stage of no traced model passes.

    Raises:
        ValueError: what does not fit, and what to do.
    """
    first = next((m for m in module.modules() if isinstance(m, TracedStage) and m.index == 0), None)
    if first is not None:
        for micro_batch in micro_batches:
            first.check_inputs(micro_batch)


def _fill(structure: Any, env: Mapping[str, Any]) -> Any:
    if isinstance(structure, str):
        return env[structure]
    if isinstance(structure, tuple) and structure and structure[0] == "const":
        return structure[1]
    if isinstance(structure, list):
        return [_fill(s, env) for s in structure]
    return structure


def trace_stages(model: nn.Module, split_points: Sequence[str], example: Any, path: str, *,
                 dynamic: bool = True) -> list[TracedStage]:
    """``model`` cut before each module named in ``split_points``, traced on ``example`` (one
    micro-batch: a tensor, a tuple of positional tensors or a dict of keyword tensors).

    ``dynamic``: every dimension of the inputs stays symbolic where the model lets it (any batch
    size and sequence length runs); False traces for the example's shapes alone, as torch's
    pipelining front end does, in about half the time (the job's ``dynamic_shapes``), and
    :func:`check_batch` then refuses a micro-batch of any other shape.

    Raises:
        TracingError: an unknown split point, one the forward never reaches (or reaches
            twice), or a model ``torch.export`` cannot trace; the message names the
            module and what to do.
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    names = dict(model.named_modules())
    for point in split_points:
        if point not in names or point == "":
            near = difflib.get_close_matches(point, list(names), n=3)
            raise TracingError(f"split point {point!r} is not a module of {path}"
                               + (f"; did you mean {', '.join(map(repr, near))}?" if near else
                                  "; name modules as model.named_modules() does (e.g. 'transformer.h.2')"))
    if len(set(split_points)) != len(split_points):
        raise TracingError(f"split points repeat a module: {list(split_points)}")
    args, kwargs = _as_call(example)
    split_spec = {point: SplitPoint.BEGINNING for point in split_points}

    def for_the_examples_shapes() -> Any:
        try:
            with _split_points_restored(model, split_points):
                return pipeline(model, mb_args=args, mb_kwargs=kwargs, split_spec=split_spec)
        except Exception as exc:  # torch.export raises many kinds; all mean "not traceable as it is"
            raise TracingError(_untraceable(model, path, exc)) from exc

    if not dynamic:
        pipe = for_the_examples_shapes()
    else:
        try:
            with _dynamic_export(), _split_points_restored(model, split_points):  # any batch size and length
                pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs, split_spec=split_spec)
        except Exception:  # a model whose shapes cannot all vary: traced for the example's own
            pipe = for_the_examples_shapes()  # (its error chained to the dynamic trace's, which names more)
    if pipe.num_stages != len(split_points) + 1:
        raise TracingError(
            f"{path} split at {len(split_points)} points gave {pipe.num_stages} stages, not "
            f"{len(split_points) + 1}: each split point must be a module the forward calls exactly once, "
            "in the order given")
    modules = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    _refuse_called_across_stages(path, modules)
    _retie(model, modules)
    _keep_out_of_state(model, modules)
    stages = _route(pipe.split_gm.graph, modules, inspect.signature(model.forward))
    for stage in stages:
        stage.static = not dynamic
    return stages


_NO_FORWARD = object()  # a module without a forward of its own (the class's)


@contextlib.contextmanager
def _split_points_restored(model: nn.Module, split_points: Sequence[str]) -> Iterator[None]:
    """Inside: torch's pipelining front end may wrap each split point's ``forward`` (it does, in place,
    and leaves it wrapped); after, each is the module's own again. A model traced a second time (the
    fallback to the example's shapes after a dynamic trace failed, a notebook that traces twice) would
    otherwise wrap the wrapper, whose call then recursed until Python's limit."""
    modules = [model.get_submodule(point) for point in split_points]
    own = [vars(module).get("forward", _NO_FORWARD) for module in modules]
    try:
        yield
    finally:
        for module, forward in zip(modules, own):
            if forward is _NO_FORWARD:
                vars(module).pop("forward", None)
            else:
                vars(module)["forward"] = forward
            vars(module).pop("_orig_forward", None)


@contextlib.contextmanager
def _dynamic_export() -> Iterator[None]:
    """Inside: torch's pipelining front end exports the model with every dimension of every input
    tensor dynamic (``torch.export.Dim.AUTO``: export keeps a dimension symbolic unless the model
    fixes it), so that the stages' graphs run any batch size and sequence length rather than the
    example's alone (dynamic padding changes the length each step). The front end has no argument
    for it, so its export call is replaced for the duration."""
    from torch.distributed.pipelining import _IR

    original = _IR.Pipe._trace_with_export

    def export(module: nn.Module, example_args: tuple[Any, ...], example_kwargs: dict[str, Any] | None = None) -> Any:
        return torch.export.export(module, example_args, example_kwargs,
                                   dynamic_shapes=_auto_shapes(module, example_args, example_kwargs or {}))

    _IR.Pipe._trace_with_export = staticmethod(export)  # type: ignore[assignment]
    try:
        yield
    finally:
        _IR.Pipe._trace_with_export = original  # type: ignore[method-assign]


def _auto_shapes(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``dynamic_shapes`` for ``torch.export``: each tensor argument, by name, every dimension automatic."""
    def dims(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {d: torch.export.Dim.AUTO for d in range(value.dim())}
        if isinstance(value, (tuple, list)):
            return type(value)(dims(v) for v in value)
        if isinstance(value, Mapping):
            return {k: dims(v) for k, v in value.items()}
        return None

    names = [name for name, p in inspect.signature(module.forward).parameters.items()
             if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    shapes = {name: dims(value) for name, value in zip(names, args)}
    shapes.update({name: dims(value) for name, value in kwargs.items()})
    return shapes


def _as_call(example: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example, Mapping):
        return (), dict(example)
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    return (example,), {}


def _route(graph: fx.Graph, modules: list[nn.Module], signature: inspect.Signature) -> list[TracedStage]:
    """Each stage's wrapper: which values it takes, computes and passes on (see the module doc)."""
    producer: dict[str, int] = {}
    outputs: dict[int, list[tuple[str, int | None]]] = {}
    stage_args: list[list[Any]] = []
    placeholders: dict[str, str] = {}  # node name -> the forward's parameter it stands for
    final: Any = None
    stage_of_node: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            producer[node.name] = _PLACEHOLDER
            placeholders[node.name] = str(node.target)
        elif node.op == "call_module":
            index = len(stage_args)
            stage_of_node[node.name] = index
            if node.kwargs:
                raise TracingError("a traced stage takes keyword arguments; actorpipe passes values positionally")
            stage_args.append([a.name if isinstance(a, fx.Node) else ("const", a) for a in node.args])
            outputs[index] = []
            if all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
                for user in node.users:
                    producer[user.name] = index
                    outputs[index].append((user.name, int(user.args[1])))
            else:
                producer[node.name] = index
                outputs[index].append((node.name, None))
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0].name in stage_of_node:
            continue
        elif node.op == "output":
            final = _names(node.args[0])
        else:
            raise TracingError(f"the traced model computes {node.format_node()} between stages; move it into "
                               "a module or choose other split points")
    count = len(stage_args)
    uses: dict[str, int] = {}  # value -> the last stage that needs it (count: the model's output)
    for index, args in enumerate(stage_args):
        for a in args:
            if isinstance(a, str):
                uses[a] = max(uses.get(a, -1), index)
    for name in _leaf_names(final):
        uses[name] = count
    order = [n.name for n in graph.nodes if n.name in producer]
    # live[i]: what crosses the boundary after stage i (made at or before it, needed after it).
    live = [[n for n in order if producer[n] <= i < uses.get(n, -1)] for i in range(count)]
    if isinstance(final, list) and len(final) == 1:
        final = final[0]  # the model's one output (the logits), not a 1-tuple
    graphs = [m for m in modules if isinstance(m, fx.GraphModule)]
    if len(graphs) != len(modules):
        raise TracingError("torch's pipelining front end gave a stage that is not a graph module")
    return [TracedStage(graphs[index], index=index, args=stage_args[index],
                        received=live[index - 1] if index > 0 else [], produced=outputs[index],
                        passed=live[index] if index < count - 1 else [],
                        output=final if index == count - 1 else None,
                        signature=signature if index == 0 else None,
                        placeholders=placeholders if index == 0 else {})
            for index in range(count)]


def _names(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, (tuple, list)):
        return [_names(v) for v in value]
    return ("const", value)


def _leaf_names(structure: Any) -> list[str]:
    if isinstance(structure, str):
        return [structure]
    if isinstance(structure, list):
        return [n for s in structure for n in _leaf_names(s)]
    return []


def _refuse_called_across_stages(path: str, modules: list[nn.Module]) -> None:
    """Refuses a module the forward calls in two stages: torch's pipelining gives the later stage a copy of
    its parameters (``a@1.weight``), which nothing would keep equal to the first (the two stages trained
    two copies of one weight, silently, and the state had keys the model lacks)."""
    for index, module in enumerate(modules):
        copies = sorted({name.split("@")[0] for name, _ in module.named_parameters(remove_duplicate=False)
                         if "@" in name})
        if copies:
            raise TracingError(
                f"{path}: stage {index} calls {', '.join(repr(c) for c in copies)} again after an earlier stage "
                "called it, and each stage would train its own copy of its weights; choose split points that "
                "keep every call of a shared module in one stage")


def _retie(model: nn.Module, modules: list[nn.Module]) -> None:
    """Makes the stage modules' copies of each parameter the model shares one tensor again, and gives a
    stage that holds it under one of its names the others too (export keeps one: BERT's ``cls.predictions
    .bias`` is its decoder's), so that the stage's state has every key the model's has."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    for names in aliases.values():
        if len(names) < 2:
            continue
        shared: nn.Parameter | None = None
        for module in modules:
            missing: list[tuple[nn.Module, str]] = []
            holds = False
            for name in names:
                owner_name, _, attribute = name.rpartition(".")
                try:
                    owner = module.get_submodule(owner_name)
                except AttributeError:
                    continue
                found = owner._parameters.get(attribute)
                if found is None:
                    if attribute not in owner._modules and attribute not in owner._buffers:
                        missing.append((owner, attribute))
                    continue
                holds = True
                if shared is None:
                    shared = found
                elif found is not shared:
                    owner._parameters[attribute] = shared
            if holds and shared is not None:
                for owner, attribute in missing:
                    owner._parameters[attribute] = shared


def _keep_out_of_state(model: nn.Module, modules: list[nn.Module]) -> None:
    """Buffers the model keeps out of its state_dict stay out of the stages' too."""
    keys = set(model.state_dict())
    for module in modules:
        for name, _ in list(module.named_buffers(remove_duplicate=False)):
            if name not in keys:
                owner_name, _, attribute = name.rpartition(".")
                module.get_submodule(owner_name)._non_persistent_buffers_set.add(attribute)


def _untraceable(model: nn.Module, path: str, exc: BaseException) -> str:
    """What went wrong tracing ``model``, the module it happened in where that can be found, and what to do."""
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and len(chain) < 8:  # torch.export's own error is the cause of pipelining's
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    where = _failing_module(model, "\n".join(str(c) for c in chain))
    lines = [f"{type(c).__name__}: {str(c).strip().splitlines()[0] if str(c).strip() else ''}" for c in chain]
    return (f"could not trace {path}" + (f" in module {where}" if where else "") + f": {lines[-1][:300]}"
            + (f" ({lines[0][:200]})" if len(lines) > 1 else "") + "\n"
            "What to do: call the model so that it returns tensors (Hugging Face models: build them with "
            "use_cache=False, and take the logits); move Python-side branching on tensor values out of "
            "forward; or choose split points at modules the forward calls once each. A model that cannot be "
            "traced still trains split by hand: return an nn.Sequential of its blocks.")


def _failing_module(model: nn.Module, text: str) -> str | None:
    """The module whose forward the error's deepest ``File "...", line N, in forward`` points into."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', text)
    for file, line, function in reversed(frames):
        for name, module in model.named_modules():
            method = getattr(type(module), function, None)
            if method is None or not inspect.isfunction(method):
                continue
            try:
                source, start = inspect.getsourcelines(method)
                source_file = inspect.getsourcefile(method)
            except (OSError, TypeError):
                continue
            if source_file == file and start <= int(line) < start + len(source):
                return f"{name or '(the model)'} ({type(module).__name__}.{function})"
    return None

