"""What each training monitor of a job's ``monitoring`` section is told: DeepSpeed's monitor blocks, typed.

One frozen record per tool, with DeepSpeed's names and meanings (its
``deepspeed/monitor/config.py``): :class:`TensorBoardConfig` and :class:`CSVConfig`
write under ``output_path/job_name/``, :class:`WandbConfig` names the W&B ``project``,
``group`` and ``team`` (W&B's entity). A spec takes each as the record or as a mapping
of its fields (a job file's form); :func:`monitor_config` turns either into the record
and names the field in every error. The head's job actor writes them
(:mod:`schedulers.monitors`); no stage reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from stages.spec_checks import check_path, nearest, show

__all__ = ["CSVConfig", "MonitorConfig", "TensorBoardConfig", "WandbConfig", "monitor_config"]

_MAX_NAME = 128  # W&B's limit on a project's name; more than enough for a directory's


def _check_name(name: str, value: Any, forbidden: str, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string{' or None' if optional else ''}, got {type(value).__name__} "
                        f"{show(value)}")
    bad = sorted({c for c in value if c in forbidden or not c.isprintable()})
    if not value or len(value) > _MAX_NAME or bad or value in (".", ".."):
        raise ValueError(f"{name} must be 1 to {_MAX_NAME} printable characters without "
                         f"{' '.join(repr(c) for c in forbidden)}, and not '.' or '..'; got {show(value)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorBoardConfig:
    """TensorBoard event files of a job's scalars (DeepSpeed's ``tensorboard`` block)."""

    output_path: str = ""
    """the directory the job's directory goes in, resolved as a checkpoint directory is: a client's under its own
    subtree of the head's checkpoint root; the admin's relative to the driver's working directory"""
    job_name: str | None = None
    """the job's directory inside ``output_path`` (one name, no ``/``); None: the job's id (``job0``)"""

    def check(self, name: str) -> None:
        check_path(f"{name}.output_path", self.output_path)
        _check_name(f"{name}.job_name", self.job_name, "/\\", optional=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class CSVConfig:
    """One CSV file per scalar (DeepSpeed's ``csv_monitor`` block): ``step,<name>`` rows."""

    output_path: str = ""
    """as TensorBoard's: where the job's directory goes"""
    job_name: str | None = None
    """the job's directory inside ``output_path``; None: the job's id"""

    def check(self, name: str) -> None:
        check_path(f"{name}.output_path", self.output_path)
        _check_name(f"{name}.job_name", self.job_name, "/\\", optional=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class WandbConfig:
    """A Weights & Biases run, offline (DeepSpeed's ``wandb`` block): ``wandb sync`` uploads it later."""

    project: str = "actorpipe"
    """the W&B project"""
    group: str | None = None
    """the W&B group the run joins"""
    team: str | None = None
    """the W&B team (W&B's ``entity``)"""
    output_path: str = ""
    """where W&B's ``wandb/offline-run-*`` directory goes (its ``dir``), resolved as TensorBoard's"""

    def check(self, name: str) -> None:
        _check_name(f"{name}.project", self.project, "/\\#?%:", optional=False)
        _check_name(f"{name}.group", self.group, "", optional=True)
        _check_name(f"{name}.team", self.team, "/\\#?%:", optional=True)
        check_path(f"{name}.output_path", self.output_path)


MonitorConfig = TensorBoardConfig | CSVConfig | WandbConfig
M = TypeVar("M", TensorBoardConfig, CSVConfig, WandbConfig)


def monitor_config(name: str, value: Any, cls: type[M]) -> M | None:
    """``value`` as a ``cls``: the record itself, a mapping of its fields, or None (off).

    Raises:
        TypeError: another type, an unknown key (the message names the nearest) or a field
            of the wrong type; each names the field as ``name.key``.
        ValueError: a name that cannot be used.
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        known = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key not in known:
                near = nearest(str(key), known)
                hint = f"; did you mean {name}.{near}?" if near else f"; its keys: {', '.join(known)}"
                raise TypeError(f"{name} has no key {show(key)}{hint}")
        value = cls(**value)
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__}, a dict of its fields ({{}} for the defaults) or None, "
                        f"got {type(value).__name__} {show(value)}")
    value.check(name)
    return value
