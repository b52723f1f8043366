"""The checks of single values a :class:`~schedulers.jobs.JobSpec` is built from.

Each raises ``TypeError`` (the wrong type) or ``ValueError`` (a value that cannot work)
with a message that starts with the field's name as the spec spells it
(``parallelism.micro_batches``) and says what would work.
"""

from __future__ import annotations

import difflib
import math
import re
import sys
from collections.abc import Iterable
from typing import Any

__all__ = [
    "MAX_PATH",
    "check_bool",
    "check_choice",
    "check_int",
    "check_kwargs",
    "check_number",
    "check_optimizer_steps",
    "check_partition_method",
    "check_path",
    "check_seconds",
    "check_torch_compile",
    "closure_refusal",
    "factory_path",
    "nearest",
    "path_and_kwargs",
    "show",
]

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def show(value: Any) -> str:
    """A short, escaped excerpt of a value for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def nearest(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` most likely meant: the closest spelling, else one it begins."""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return close[0]
    starts = [k for k in known if name and (k.startswith(name) or k.endswith(name))]
    return starts[0] if starts else None


def check_int(name: str, value: Any, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {show(value)}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {bound}, got {value}")


def check_number(name: str, value: Any) -> None:
    """A finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {show(value)}")


MAX_PATH = 1024  # the longest directory path a spec takes


def check_path(name: str, value: Any) -> None:
    """A directory path as a spec takes it (where the head resolves it later): a string, bounded, no NUL."""
    if not isinstance(value, str) or len(value) > MAX_PATH or "\0" in value:
        raise TypeError(f"{name} must be a directory path (a string of at most {MAX_PATH} characters), "
                        f"got {show(value)}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {show(value)}")


def check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {show(value)}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")


def check_choice(name: str, value: Any, choices: tuple[str, ...], what: str | None = None) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {', '.join(choices)}; got {type(value).__name__} {show(value)}")
    if value not in choices:
        near = [c for c in choices if c.lower() == value.lower()] or difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"{name}: unknown {what or 'value'} {show(value)}{hint}; choose one of {', '.join(choices)}")


def check_partition_method(name: str, value: Any, methods: tuple[str, ...]) -> None:
    if isinstance(value, str) and value.startswith("type:"):
        pattern = value.removeprefix("type:")
        if not pattern or len(pattern) > 200:
            raise ValueError(f"{name} {show(value)}: give a class-name pattern of 1 to 200 characters "
                             "after 'type:', e.g. 'type:block'")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{name} {show(value)}: not a regular expression ({exc})") from None
        return
    check_choice(name, value, methods + ("type:REGEX",))


def check_torch_compile(name: str, value: Any, backends: tuple[str, ...], modes: tuple[str, ...]) -> None:
    """``False``, ``True`` or a dict of torch.compile's own arguments (``backend``, ``mode``, ``dynamic``,
    ``fullgraph``, ``options``), each of its kind.

    Raises:
        TypeError: not a bool or a dict, an unknown argument (naming the nearest), or one of the wrong type.
        ValueError: an unknown backend or mode, or both ``mode`` and ``options`` (torch.compile takes one).
    """
    if isinstance(value, bool):
        return
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be True, False or a dict of torch.compile's arguments "
                        f"({{\"backend\": \"inductor\", \"mode\": ..., \"dynamic\": ..., \"fullgraph\": ..., "
                        f"\"options\": {{...}}}}), got {type(value).__name__} {show(value)}")
    known = ("backend", "mode", "dynamic", "fullgraph", "options")
    for key in value:
        if key not in known:
            near = nearest(str(key), known)
            hint = f"; did you mean {near!r}?" if near else ""
            raise TypeError(f"{name}: unknown torch.compile argument {show(key)}{hint} (known: {', '.join(known)})")
    if "backend" in value:
        check_choice(f"{name}.backend", value["backend"], backends, "backend")
    if value.get("mode") is not None:
        check_choice(f"{name}.mode", value["mode"], modes, "mode")
    if value.get("dynamic") is not None:
        check_bool(f"{name}.dynamic", value["dynamic"])
    if "fullgraph" in value:
        check_bool(f"{name}.fullgraph", value["fullgraph"])
    options = value.get("options")
    if options is not None:
        if not isinstance(options, dict) or not all(isinstance(k, str) for k in options) or not all(
                isinstance(v, (str, int, float, bool)) for v in options.values()):
            raise TypeError(f"{name}.options must be a dict of the backend's options with str keys and str, int, "
                            f"float or bool values (e.g. {{\"max_autotune\": true}}), got {show(options)}")
        if value.get("mode") is not None:
            raise ValueError(f"{name}: give mode or options, not both (torch.compile takes one of them; a mode is a "
                             "set of options)")


def closure_refusal(path: str) -> str:
    """Why the optimizer at ``path`` (torch's L-BFGS, or a subclass of it) cannot train a job."""
    return (f"{path} re-evaluates the loss in a closure at every step (L-BFGS's line search), which a "
            "pipeline step cannot do: each micro-batch's forward and backward ran once, on other stages; "
            "use AdamW or SGD")


def check_optimizer_steps(name: str, path: str) -> None:
    """Refuses torch's L-BFGS by its path (a subclass of it is refused where the stage builds it)."""
    module, _, cls = path.partition(":")
    if cls == "LBFGS" and (module == "torch.optim" or module.startswith("torch.optim.")):
        raise ValueError(f"{name}: {closure_refusal(path)}")


def check_kwargs(name: str, value: Any) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"{name} must be a dict of keyword arguments (str keys), got {show(value)}")


def factory_path(name: str, value: Any) -> str:
    """An import path ``package.module:callable``, given as one or as the callable itself.

    A node builds the factory by importing that path, so an object is taken only when
    the path derived from its ``__module__`` and ``__qualname__`` imports it back.

    Raises:
        TypeError: neither a path nor a function or class.
        ValueError: a malformed path, or an object no node could import by its path (a
            lambda, a function defined inside another, one defined in ``__main__``, one
            whose path names a private module or name).
    """
    if isinstance(value, str):
        if not _IMPORT_PATH.match(value):
            raise ValueError(f"{name}: {show(value)} is not an import path of the form 'package.module:callable'")
        return value
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not callable(value) or not isinstance(module, str) or not isinstance(qualname, str):
        raise TypeError(f"{name} must be an import path 'package.module:callable' or the function or class "
                        f"itself, got {type(value).__name__} {show(value)}")
    why = ("a lambda has no name to import it by: define it with def at a module's top level" if "<lambda>" in qualname
           else "it is defined inside a function: move it to a module's top level" if "<locals>" in qualname
           else "it is defined in __main__, which is not the nodes' __main__: move it to a module the nodes import"
           if module == "__main__" else None)
    private = next((p for p in re.split(r"[.]", f"{module}.{qualname}") if p.startswith("_")), None)
    if why is None and private is not None:
        why = (f"its path {module}:{qualname} names {private!r}, and nodes import public names only: give the "
               "public path it is exported under as a string ('package.module:name')")
    if why is None:
        found: Any = sys.modules.get(module)
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if found is not value:
            why = f"{module}:{qualname} does not import it back (give its path as a string)"
    if why is not None:
        raise ValueError(f"{name}: a node imports a factory by its path, and {show(value)} has none: {why}")
    return f"{module}:{qualname}"


def path_and_kwargs(name: str, value: Any) -> tuple[str, dict[str, Any]]:
    """``(path, kwargs)`` from a path, a class, or a pair of either and a dict."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise TypeError(f"{name} must be 'package.module:Class' or (path, kwargs), got {show(value)}")
        path, kwargs = value
    elif isinstance(value, str) or callable(value):
        path, kwargs = value, {}
    else:
        raise TypeError(f"{name} must be 'package.module:Class' or (path, kwargs), got {show(value)}")
    path = factory_path(name, path)
    check_kwargs(f"{name} kwargs", kwargs)
    return path, dict(kwargs)
