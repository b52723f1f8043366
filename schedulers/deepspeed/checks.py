"""What the config translator reports, and the checks of single values it is built from.

Each check raises :class:`ConfigError` naming the key; :class:`Translation` collects them,
so that a translation goes on to the next key and reports every problem at once.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from schedulers.jobs import CODECS, PARTITION_METHODS

__all__ = ["AUTO", "ConfigError", "Problem", "Translation"]

AUTO = "auto"  # DeepSpeed's (and the Hugging Face integration's) "fill this in from elsewhere"

Check = Callable[[Mapping[str, Any], str, str], Any]


class Problem(NamedTuple):
    """One thing wrong in a config: its dotted key and what to do."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


class ConfigError(ValueError):
    """Config keys that are unknown, missing or wrong.

    Attributes:
        key: the dotted path of the (first) key that is wrong.
        problems: every problem found, each with its key; one for a single mistake.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.problems = [Problem(key, message)]

    @classmethod
    def of(cls, problems: Sequence[Problem], *, where: str = "the config") -> ConfigError:
        """One error carrying every problem (the message lists them, one a line)."""
        assert problems, "an error needs a problem"
        error = cls(problems[0].key, problems[0].message)
        if len(problems) > 1:
            error.problems = list(problems)
            error.args = (f"{len(problems)} problems in {where}:\n" + "\n".join(f"  {p}" for p in problems),)
        return error


class Translation:
    """A translation in progress: the JobSpec fields found so far (and the key each came
    from), the problems (each with its key) and the notices."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.origins: dict[str, str] = {}  # JobSpec field -> the config key that set it
        self.problems: list[Problem] = []
        self.notices: list[str] = []

    def set(self, field: str, value: Any, key: str) -> None:
        """Sets a JobSpec field from ``key``; two keys that set it differently are a problem."""
        if field in self.fields and self.fields[field] != value:
            self.problem(key, f"says {field}={show(value)}, but {self.origins[field]} says {show(self.fields[field])}; "
                              "give one of them")
            return
        self.fields[field] = value
        self.origins.setdefault(field, key)

    def problem(self, key: str, message: str) -> None:
        self.problems.append(Problem(key, message))

    def notice(self, key: str, message: str) -> None:
        """A line for the user: a key accepted that does something else here, or nothing."""
        self.notices.append(f"{key}: {message}")

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """A :class:`ConfigError` raised in the block is recorded, and the translation goes on."""
        try:
            yield
        except ConfigError as exc:
            self.problems.extend(exc.problems)


# -- keys ----------------------------------------------------------------------------------


def unknown_key(prefix: str, key: object, known: Iterable[str]) -> ConfigError:
    """The error for a key no table knows, with the nearest known one."""
    known = list(known)
    near = difflib.get_close_matches(str(key), known, n=1)
    hint = f"; did you mean {prefix}{near[0]}?" if near else f"; known keys: {', '.join(known)}"
    return ConfigError(f"{prefix}{key}", f"unknown key{hint}")


def check_keys(t: Translation, prefix: str, section: Mapping[str, Any], known: Iterable[str]) -> None:
    """Records an unknown-key problem for each key of ``section`` not in ``known``."""
    known = tuple(known)
    for key in section:
        if key not in known:
            t.problems.extend(unknown_key(prefix, key, known).problems)


# -- values --------------------------------------------------------------------------------


def show(value: Any) -> str:
    """A short, escaped excerpt of a value for a message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def path(section: Mapping[str, Any], key: str, prefix: str) -> str:
    value = section.get(key)
    if not isinstance(value, str) or value.count(":") != 1:
        raise ConfigError(prefix + key, f"expected an import path 'package.module:name', got {show(value)}")
    return value


def mapping(section: Mapping[str, Any], key: str, prefix: str) -> dict[str, Any]:
    value = section.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(prefix + key, f"expected an object of keyword arguments, got {show(value)}")
    return dict(value)


def integer(section: Mapping[str, Any], key: str, prefix: str, *, minimum: int | None = None,
            maximum: int | None = None) -> int:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(prefix + key, f"expected an integer, got {show(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(prefix + key, f"expected an integer >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(prefix + key, f"expected an integer <= {maximum}, got {value}")
    return value


def any_int(section: Mapping[str, Any], key: str, prefix: str) -> int:
    return integer(section, key, prefix)


def positive_int(section: Mapping[str, Any], key: str, prefix: str) -> int:
    return integer(section, key, prefix, minimum=1)


def non_negative_int(section: Mapping[str, Any], key: str, prefix: str) -> int:
    return integer(section, key, prefix, minimum=0)


def number(section: Mapping[str, Any], key: str, prefix: str, *, minimum: float = 0.0) -> float:
    """A finite number >= ``minimum`` (hjson reads ``1.0`` as the integer 1: both are numbers)."""
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < minimum:
        raise ConfigError(prefix + key, f"expected a number >= {minimum:g}, got {show(value)}")
    return float(value)


def seconds(section: Mapping[str, Any], key: str, prefix: str) -> float:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ConfigError(prefix + key, f"expected a number of seconds > 0, got {show(value)}")
    return float(value)


def boolean(section: Mapping[str, Any], key: str, prefix: str) -> bool:
    value = section.get(key)
    if not isinstance(value, bool):
        raise ConfigError(prefix + key, f"expected true or false, got {show(value)}")
    return value


def choice(choices: tuple[str, ...]) -> Check:
    """A check that the value is one of ``choices``."""
    def check(section: Mapping[str, Any], key: str, prefix: str) -> str:
        value = section.get(key)
        if value not in choices:
            raise ConfigError(prefix + key, f"expected one of {', '.join(choices)}, got {show(value)}")
        return str(value)
    return check


def partition_method(section: Mapping[str, Any], key: str, prefix: str) -> str:
    """One of the partition methods, or DeepSpeed's ``type:REGEX`` (layers whose class matches)."""
    value = section.get(key)
    if isinstance(value, str) and value.startswith("type:") and 5 < len(value) <= 205:
        try:
            re.compile(value[5:])
        except re.error as exc:
            raise ConfigError(prefix + key, f"{show(value)} is not a regular expression after type: ({exc})") from None
        return value
    return str(choice(PARTITION_METHODS)(section, key, prefix))


def names(section: Mapping[str, Any], key: str, prefix: str) -> list[str]:
    value = section.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(prefix + key, f"expected a list of module names, got {show(value)}")
    return list(value)


def codec(codecs: Mapping[str, Any], key: str, prefix: str) -> str | list[str]:
    value = codecs.get(key)
    listed = [value] if isinstance(value, str) else value
    if not isinstance(listed, list) or not listed or any(n not in CODECS for n in listed):
        raise ConfigError(prefix + key, (
            f"expected a codec name ({', '.join(CODECS)}) or a list of one per stage boundary, got {show(value)}"))
    return value if isinstance(value, str) else list(listed)
