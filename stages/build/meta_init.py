"""A model cut at ``split_points`` built on the meta device: each stage makes only its own parameters.

Without it, every stage calls the model's factory for real and traces the whole model
before keeping its stage: a model of N bytes needs N bytes in every stage process. With
``meta_init=True`` the factory runs with every parameter made on the meta device (a
shape, no memory: as ``accelerate``'s ``init_empty_weights`` does; buffers are made as
usual, they are what a forward computes with besides the weights and are small),
torch's pipelining front end traces the model on a meta copy of the example micro-batch
(and of its buffers), and a stage makes real only the parameters its own model stages
hold, and takes back the buffers they hold.

**Initialization**, defined for any layout: each module that owns parameters resets them
with its own ``reset_parameters()`` right after ``torch.manual_seed(module_seed(seed,
name))`` (``name`` as ``named_modules()`` gives it), so a parameter gets the same values
on whichever stage holds it; a parameter two modules share (tied embeddings) takes its
first owner's. :func:`meta_initialized` builds those same weights in one process: the
reference a job equals, to the last bit. A module that owns parameters and has no
``reset_parameters`` cannot be initialized so: the build fails and names it (such a model
trains from weights a ``job.load`` brings, or without ``meta_init``). The weights differ
from what the factory itself would draw from ``torch.manual_seed(seed)``: meta_init is
for models whose weights are loaded (a Hugging Face model's safetensors, a checkpoint),
or trained from this initialization.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["MetaInitError", "buffers_on_meta", "materialize", "meta_initialized", "meta_values", "module_seed",
           "on_meta", "parameters_on_meta", "restore_buffers", "retarget"]


class MetaInitError(ValueError):
    """A model that ``meta_init`` cannot initialize; the message names the module and what to do."""


def module_seed(seed: int, name: str) -> int:
    """The seed module ``name`` resets its parameters under, in a job seeded ``seed``: the first 63
    bits of SHA-256 of ``"seed:name"``."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside: every parameter a module registers is moved to the meta device as it is registered.

    A parameter is made where its module makes it and moved at once, so the most a build
    holds is one parameter; whatever initializes it afterwards runs on the meta device
    (no memory, no random numbers drawn). Patches ``nn.Module.register_parameter`` for the
    duration: build nothing else in another thread meanwhile.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def on_meta(value: Any) -> Any:
    """``value`` (a tensor, or tuples, lists and dicts of them) with every tensor an empty one on the meta device."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, dict):
        return {k: on_meta(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(on_meta(v) for v in value)
    return value


def meta_values(model: nn.Module, seed: int, wanted: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """Real values for ``model``'s parameters named in ``wanted`` (all, for None), by name, as every
    layout initializes them (see the module doc); ``model``'s own parameters stay where they are.

    Raises:
        MetaInitError: a module that owns a wanted parameter has no ``reset_parameters``.
    """
    owner: dict[int, tuple[str, str]] = {}  # id(param) -> its first owner: (module name, attribute)
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attribute, param in module._parameters.items():
            if param is not None:
                owner.setdefault(id(param), (module_name, attribute))
    needed = {name: owner[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
              if wanted is None or name in wanted}
    by_module: dict[str, set[str]] = {}
    for module_name, attribute in needed.values():
        by_module.setdefault(module_name, set()).add(attribute)
    made: dict[tuple[str, str], torch.Tensor] = {}
    state = torch.random.get_rng_state()
    try:
        for module_name, attributes in by_module.items():
            module = model.get_submodule(module_name)
            made.update(_reset(module, module_name, attributes, _initializer(model, module, module_name, attributes),
                               seed))
    finally:
        torch.random.set_rng_state(state)
    return {name: made[where] for name, where in needed.items()}


def _initializer(model: nn.Module, module: nn.Module, module_name: str,
                 attributes: Collection[str]) -> Callable[[], Any]:
    """What initializes ``module``'s own parameters: its ``reset_parameters()``, else (a Hugging Face
    model) the model's ``_init_weights(module)``, the one ``from_pretrained`` and ``post_init`` use."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    hugging_face = getattr(model, "_init_weights", None)
    if callable(hugging_face):
        return lambda: hugging_face(module)
    raise MetaInitError(
        f"meta_init: module {module_name or '(the model)'} ({type(module).__name__}) owns parameters "
        f"{sorted(attributes)} and has no reset_parameters() to initialize them with; give it one, or train "
        "without meta_init")


def _reset(module: nn.Module, module_name: str, attributes: Collection[str], reset: Callable[[], Any],
           seed: int) -> dict[tuple[str, str], torch.Tensor]:
    """Runs ``reset`` on real parameters made for ``module``; returns the wanted ones. They start as
    NaN, so that one the initializer left alone is found. The module's own (meta) parameters are put
    back afterwards.

    Raises:
        MetaInitError: the initializer left a wanted parameter unset.
    """
    kept = dict(module._parameters)
    for attribute, param in kept.items():
        if param is not None:
            fresh = torch.full(param.shape, float("nan"), dtype=param.dtype) if param.is_floating_point() \
                else torch.zeros(param.shape, dtype=param.dtype)
            module._parameters[attribute] = nn.Parameter(fresh, requires_grad=param.requires_grad)
    try:
        torch.manual_seed(module_seed(seed, module_name))
        with torch.no_grad():
            reset()
        made = {(module_name, a): module._parameters[a].detach() for a in attributes}  # type: ignore[union-attr]
    finally:
        module._parameters.update(kept)
    unset = sorted(a for (_, a), value in made.items() if value.is_floating_point() and bool(value.isnan().any()))
    if unset:
        raise MetaInitError(f"meta_init: initializing module {module_name or '(the model)'} "
                            f"({type(module).__name__}) left {unset} unset; give it a reset_parameters() that sets "
                            "them, or train without meta_init")
    return made


def meta_initialized(factory: Callable[..., nn.Module], kwargs: dict[str, Any], seed: int) -> nn.Module:
    """The model ``factory(**kwargs)`` with the weights a ``meta_init`` job starts from, in one process.

    The factory is called after ``torch.manual_seed(seed)``, as each stage calls it, so what it draws
    for real (a random buffer: only parameters go to the meta device) is the stages' too; the
    caller's random state is left as it was."""
    with torch.random.fork_rng(), parameters_on_meta():
        torch.manual_seed(seed)
        model = factory(**kwargs)
    if isinstance(model, (list, tuple, nn.Sequential)):  # layers by position, as a stage takes them (a
        model = nn.Sequential(*model)                      # Sequential's named children too: seeds, keys)
    materialize(model, meta_values(model, seed))
    return model


def materialize(module: nn.Module, values: dict[str, torch.Tensor], also: Collection[nn.Module] = ()) -> None:
    """Replaces ``module``'s meta parameters named in ``values`` by them; a parameter shared under
    several names, in ``module`` or in the modules ``also`` (another stage's, in this process),
    stays one tensor everywhere."""
    made: dict[int, nn.Parameter] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.device.type == "meta" and name in values and id(param) not in made:
            made[id(param)] = nn.Parameter(values[name].clone(), requires_grad=param.requires_grad)
    # Every name of a parameter made real takes it, in a layer another stage holds too: a tie stays a tie.
    for holder in (module, *also):
        for name, param in list(holder.named_parameters(remove_duplicate=False)):
            if id(param) in made:
                owner_name, _, attribute = name.rpartition(".")
                holder.get_submodule(owner_name)._parameters[attribute] = made[id(param)]


@contextlib.contextmanager
def buffers_on_meta(model: nn.Module) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Inside: every buffer of ``model`` is a meta copy, so a trace on the meta device does not meet a
    real one (a causal mask the forward multiplies by, BatchNorm's running statistics); yields each
    copy's real buffer (``id(copy) -> (copy, real)``), which :func:`restore_buffers` puts back into
    the traced stages. On leaving, the model holds its own again."""
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    for module in model.modules():
        for attribute, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type != "meta":
                swapped.append((module, attribute, buffer))
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, attribute, buffer in swapped:  # a buffer shared under several names: one copy, still shared
        copy = copies.setdefault(id(buffer), (buffer.to("meta"), buffer))[0]
        module._buffers[attribute] = copy
    try:
        yield {id(copy): (copy, real) for copy, real in copies.values()}
    finally:
        for module, attribute, buffer in swapped:
            module._buffers[attribute] = buffer


def restore_buffers(module: nn.Module, real: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Puts the real buffers :func:`buffers_on_meta` yielded back wherever a stage traced on the meta
    device holds their copies (as buffers, or as the plain attributes a trace makes of a buffer
    that several modules share).

    Raises:
        MetaInitError: a buffer of the stage that is no copy of the model's (a constant the trace
            made on the meta device), named.
    """
    for name, sub in module.named_modules(remove_duplicate=False):
        for attribute, value in [*sub._buffers.items(), *vars(sub).items()]:
            if isinstance(value, torch.Tensor) and value.device.type == "meta" and id(value) in real:
                made = real[id(value)][1]
                if attribute in sub._buffers:
                    sub._buffers[attribute] = made
                else:
                    setattr(sub, attribute, made)
            elif attribute in sub._buffers and isinstance(value, torch.Tensor) and value.device.type == "meta":
                raise MetaInitError(f"{name + '.' if name else ''}{attribute}: the trace on the meta device made "
                                    "this tensor and it has no value; register it as a buffer of its module, "
                                    "or train without meta_init")


def retarget(module: nn.Module, device: torch.device, source: torch.device = torch.device("meta")) -> int:
    """Points the ops a trace on the ``source`` device recorded as making or moving tensors there
    (``arange(..., device=meta)``, ``to(..., device=cpu)``) at ``device``, in every graph of ``module``
    (a trace on the meta device, or a stage traced on the CPU that computes on a GPU); returns how
    many graphs it changed."""
    meta = torch.device(source)
    changed = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        touched = False
        for node in graph.nodes:
            if _on(node.kwargs.get("device"), meta):
                node.kwargs = {**node.kwargs, "device": device}
                touched = True
            if any(_on(arg, meta) for arg in node.args):
                node.args = tuple(device if _on(a, meta) else a for a in node.args)
                touched = True
        if touched:
            changed += 1
            if isinstance(sub, torch.fx.GraphModule):
                sub.recompile()
    return changed


def _on(value: Any, device: torch.device) -> bool:
    """Whether ``value`` (a graph node's argument) names ``device`` (a device, or its name)."""
    if isinstance(value, str):
        try:
            value = torch.device(value)
        except RuntimeError:
            return False
    return isinstance(value, torch.device) and value == device
