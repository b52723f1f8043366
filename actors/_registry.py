"""What a node may build: actor classes by registered name, factories by allowed import path.

Nothing that runs on a node arrives as code: an actor class is looked up in a
registry the node's own code filled, and a model, loss, data or optimizer factory is
looked up by a ``package.module:attribute`` path that must name a function or class
*defined in* a module the node's allow-list admits (:func:`load_object` has the rules).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import types
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from actors._actor import Actor
from actors._errors import NotAllowed
from transport.wire import excerpt

__all__ = ["DEFAULT_ALLOW", "EXAMPLE_FACTORIES", "actor_class", "load_object", "register_actor", "registered_actors"]

A = TypeVar("A", bound=type[Actor])

# What every node admits: torch's layers, losses and optimizers. The operator names the rest
# (``--allow``); nothing else is admitted by default, not even the project's own scripts.
DEFAULT_ALLOW = ("torch.nn", "torch.optim")
# The examples' factory modules (models, data, Hugging Face models): a LocalCluster admits them
# for the demo, and so does a stage actor in the driver's own process. Never the example
# scripts (train_gpt, train_hf, ...), whose functions parse command lines, plot, write files
# and start clusters: those are not factories.
EXAMPLE_FACTORIES = ("examples.models", "examples.data", "examples.hf")
_ACTOR_CLASSES: dict[str, type[Actor]] = {}
# exec, eval, getattr, __import__, open: no factory lives there, whatever the allow-list says.
_NEVER_ALLOWED = frozenset({"builtins"})
# What a factory may be: a class, a function (Python or C), or a method bound to a class.
_FACTORY_TYPES = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def register_actor(name: str) -> Callable[[A], A]:
    """Class decorator: nodes may spawn this class when asked for ``name``."""

    def add(cls: A) -> A:
        if _ACTOR_CLASSES.get(name, cls) is not cls:
            raise ValueError(f"actor name {name!r} is already registered to {_ACTOR_CLASSES[name].__qualname__}")
        _ACTOR_CLASSES[name] = cls
        return cls

    return add


def registered_actors() -> list[str]:
    return sorted(_ACTOR_CLASSES)


def actor_class(name: str) -> type[Actor]:
    """The class registered as ``name``.

    Raises:
        NotAllowed: no class is registered under that name.
    """
    try:
        return _ACTOR_CLASSES[name]
    except KeyError:
        raise NotAllowed(
            f"no actor class registered as {name!r}; this node knows: {', '.join(registered_actors()) or 'none'}"
        ) from None


def is_allowed(module: str, allow: Iterable[str]) -> bool:
    """Whether ``module`` is one of the ``allow`` prefixes or inside one (``builtins`` never is)."""
    if module in _NEVER_ALLOWED:
        return False
    return any(module == prefix or module.startswith(prefix + ".") for prefix in allow)


def load_object(path: str, allow: Iterable[str], *, reveal: bool = True) -> Any:
    """Looks up the factory ``package.module:name`` (or ``package.module:Class.name``), never evaluating it.

    What a path may name, each rule checked before the next step is taken:

    1. Its form is ``module:attribute``, dotted names on each side, and no part of
       either starts with ``_`` (so no ``__globals__``, ``__builtins__``,
       ``__import__``, ``__init__``, and no private names).
    2. Its module is under an ``allow`` prefix; ``builtins`` (``exec``, ``eval``,
       ``getattr``, ``open``…) never is. Only then is the module imported.
    3. Every attribute before the last is a class whose ``__module__`` is admitted:
       ``Class.classmethod`` and nested classes work, but the walk never passes
       through a module object (``torch.nn:functional.torch.os.system`` stops at
       ``functional``) nor through a class imported from an unadmitted module.
    4. The object named is a class, a function (Python or built-in) or a method
       reached through such a class, never a module or an instance (a
       ``functools.partial``, a callable object), and its own ``__module__`` (the
       module that defines it, not the one it is reached through) is admitted: an
       object a module re-exports from elsewhere (``os.system`` imported into an
       allowed module, a ``torch`` built-in re-exported by ``torch.nn.functional``)
       is refused, as is one that does not say where it is defined.

    Re-exports inside the allowed prefixes are fine: ``torch.optim:SGD`` is defined in
    ``torch.optim.sgd``.

    Args:
        reveal: whether the messages may list the allow-list and name this process's
            folder and ``PYTHONPATH`` (what an operator fixes a node with); False for
            an answer to a client, which hears only which rule refused the path.

    Raises:
        ValueError: ``path`` is not of the form ``package.module:attribute``.
        NotAllowed: any rule above is broken; the message says which and what to do.
        ImportError, AttributeError: the module or attribute does not exist.
    """
    if not isinstance(path, str) or not _IMPORT_PATH.match(path):
        raise ValueError(f"{_excerpt(path)} is not an import path of the form 'package.module:attribute'")
    module_name, _, attribute = path.partition(":")
    allow = tuple(allow)
    private = next((part for part in re.split(r"[.:]", path) if part.startswith("_")), None)
    if private is not None:
        raise NotAllowed(
            f"{_excerpt(path)} names {private!r}, a private or special name (it starts with '_'); "
            "a factory is named by public names only: define a public function in an allowed module"
        )
    if module_name in _NEVER_ALLOWED:
        raise NotAllowed(f"{_excerpt(path)} names a built-in; {module_name} (exec, eval, getattr, open…) "
                         "never holds factories: define a function in an allowed module")
    if not is_allowed(module_name, allow):
        raise NotAllowed(
            f"{_excerpt(path)} is not on {_allow_list(allow, reveal)}; start the "
            f"node with --allow {module_name} (LocalCluster(allow=[...]) does this for you)"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        where = (f"this process runs in {os.getcwd()} with PYTHONPATH={os.environ.get('PYTHONPATH') or '(unset)'}: "
                 if reveal else "")
        raise ModuleNotFoundError(
            f"{_excerpt(path)}: {exc}; {where}start it where {module_name} imports (the folder that "
            f"holds it) or add that folder to PYTHONPATH", name=exc.name) from None
    *through, last = attribute.split(".")
    for depth, part in enumerate(through):
        obj = _attribute(obj, part)
        _check_intermediate(path, ".".join(through[:depth + 1]), obj, allow, reveal)
    obj = _attribute(obj, last)
    _check_factory(path, obj, allow, reveal)
    return obj


def _allow_list(allow: tuple[str, ...], reveal: bool) -> str:
    """"this node's allow-list", with its entries when they may be shown."""
    return f"this node's allow-list ({', '.join(allow) or 'empty'})" if reveal else "this node's allow-list"


def _excerpt(value: object) -> str:
    """A short, escaped excerpt of an untrusted value, for messages: cut before it is escaped, so a
    value of a gigabyte costs what one of a hundred bytes does (a whole ``repr`` of it took four times
    its size)."""
    return excerpt(value, 120)


def _attribute(owner: Any, name: str) -> Any:
    """``owner.name`` as an import would see it, without running a class's descriptors.

    A module's attributes are read as usual (its PEP 562 ``__getattr__`` is the
    admitted module's own code). A class's are read statically, so no property or
    metaclass hook runs; a ``staticmethod`` yields its function and a ``classmethod``
    is bound to the class, as ``getattr`` would.
    """
    try:
        value = getattr(owner, name) if not isinstance(owner, type) else inspect.getattr_static(owner, name)
    except AttributeError:
        public = [known for known in dir(owner) if not known.startswith("_")]
        # The shortest name that begins with it (mse -> mse_loss, cross -> cross_entropy), else the
        # nearest by spelling (Adamm -> Adam).
        near = sorted((known for known in public if name and known.startswith(name)), key=len)[:1] or \
            difflib.get_close_matches(name, public, n=1)
        label = getattr(owner, "__name__", type(owner).__name__)
        what = f"module {label!r}" if isinstance(owner, types.ModuleType) else repr(label)
        raise AttributeError(f"{what} has no attribute {name!r}" + (f"; did you mean {near[0]!r}?" if near else ""),
                             name=name, obj=owner) from None
    if not isinstance(owner, type):
        return value
    if isinstance(value, staticmethod):
        return value.__func__
    if isinstance(value, classmethod):
        return value.__get__(None, owner)
    return value


def _check_intermediate(path: str, reached: str, obj: Any, allow: tuple[str, ...], reveal: bool) -> None:
    module = path.partition(":")[0]
    if isinstance(obj, types.ModuleType):
        raise NotAllowed(
            f"{_excerpt(path)} reaches module {obj.__name__} through an attribute ({reached}); a factory path "
            f"may not pass through modules: name the factory in its own module, as '{obj.__name__}:name', "
            "if the allow-list admits it"
        )
    if not isinstance(obj, type):
        raise NotAllowed(
            f"{_excerpt(path)}: {reached} is a {type(obj).__name__}, not a class; only classes may stand "
            f"between the module and the factory ('{module}:Class.classmethod')"
        )
    defined_in = obj.__module__
    if not is_allowed(defined_in, allow):
        raise NotAllowed(
            f"{_excerpt(path)}: class {reached} is defined in {defined_in}, which {_allow_list(allow, reveal)} "
            f"does not admit; {module} only re-exports it"
        )


def _check_factory(path: str, obj: Any, allow: tuple[str, ...], reveal: bool) -> None:
    if isinstance(obj, types.ModuleType):
        raise NotAllowed(
            f"{_excerpt(path)} names module {obj.__name__}, not a factory; name a function or class in it, "
            f"as '{obj.__name__}:name'"
        )
    if not isinstance(obj, _FACTORY_TYPES):
        raise NotAllowed(
            f"{_excerpt(path)} names a {type(obj).__name__} object, not a function or class; a factory must "
            "be a function or class defined in an allowed module: define a function there that builds this "
            "object and name that"
        )
    defined_in = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", "?"))
    if not isinstance(defined_in, str):
        raise NotAllowed(
            f"{_excerpt(path)} names {name}, which does not say what module defines it (no __module__), so "
            "the allow-list cannot vouch for it: define a function in an allowed module that calls it and "
            "name that"
        )
    if defined_in in _NEVER_ALLOWED:
        raise NotAllowed(f"{_excerpt(path)} is the built-in {name} re-exported; {defined_in} (exec, eval, "
                         "getattr, open…) never holds factories: define a function in an allowed module")
    if not is_allowed(defined_in, allow):
        raise NotAllowed(
            f"{_excerpt(path)} is {defined_in}.{name}, defined outside {_allow_list(allow, reveal)} "
            f"and only re-exported by {path.partition(':')[0]}; name it where "
            f"it is defined and start the node with --allow {defined_in} if you trust that module, or define "
            "a function in an allowed module that calls it"
        )
