"""What one job, and one client, may ask of the cluster: limits the operator sets on the head.

A spec is checked here at the head before any work is done for it (no node is asked, no
schedule compiled), and so is every setting a running job changes. The limits are the
operator's: ``python -m actors.node --head --limit micro_batches=4096 --limit
jobs_per_client=2`` (repeatable), or ``LocalCluster(limits={...})``. A request past one
fails with :class:`~actors.LimitExceeded`, which names the limit, the value asked and
the most allowed. The admin key and a cluster without keys are held to the same limits:
they protect the head, whoever asks.

Compiling a job's schedule takes time in proportion to its actions (stages x
micro-batches): :func:`off_loop` runs it on a thread under ``compile_timeout_s``, so the
head's loop keeps answering heartbeats and other clients meanwhile.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from actors import LimitExceeded, WireRecord
from schedulers.jobs import JobSpec

__all__ = ["Limits", "check_client", "check_spec", "off_loop", "parse_limits"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits(WireRecord):
    """The operator's limits; ``None`` lifts one (no limit)."""

    micro_batches: int | None = 4096
    """micro-batches a step of one job is split into"""
    scheduled_actions: int | None = 1 << 17
    """actions a step's schedule holds in all (pipeline stages x virtual stages x micro-batches x 3): what
    compiling it costs"""
    threads_per_stage: int | None = 256
    """torch threads a stage process may ask for"""
    step_timeout_s: float | None = 7 * 24 * 3600.0
    """the longest step timeout a job may set"""
    max_restarts: int | None = 1000
    """recoveries a job may ask for"""
    parameters: int | None = None
    """parameters a job's model may hold, as a worker counts them on the meta device (None: any)"""
    jobs_per_client: int | None = 16
    """jobs one client key may have open at once"""
    nodes_per_client: int | None = None
    """nodes one client's open jobs may hold together (None: every node)"""
    compile_timeout_s: float = 60.0
    """the longest a job's schedule may take to compile (off the head's loop)"""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name != "compile_timeout_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"limit {f.name} must be a positive number (or none), got {value!r:.40}")

    def exceeded(self, name: str, value: Any, allowed: Any, what: str) -> LimitExceeded:
        """The error for ``what`` (``value``) past the limit ``name`` (``allowed``)."""
        return LimitExceeded(
            f"{what} is {value}, past this cluster's limit {name}={allowed}; ask for less, or have the operator "
            f"raise it (python -m actors.node --head --limit {name}=N)",
            details={"limit": name, "value": value, "allowed": allowed})


def parse_limits(items: Iterable[str] | Mapping[str, Any]) -> Limits:
    """Limits from ``NAME=VALUE`` items (``--limit``, repeatable; ``none`` lifts one) or a map.

    Raises:
        ValueError: an unknown name (the known ones listed) or a value that is not a positive number.
    """
    known = {f.name: f for f in fields(Limits)}
    pairs = items.items() if isinstance(items, Mapping) else (_split(item) for item in items)
    changes: dict[str, Any] = {}
    for name, value in pairs:
        if name not in known:
            raise ValueError(f"unknown limit {name!r}; limits: {', '.join(known)}")
        if isinstance(value, str):
            value = None if value.lower() == "none" else _number(name, value)
        changes[name] = value
    return replace(Limits(), **changes)


def _split(item: str) -> tuple[str, str]:
    name, eq, value = item.partition("=")
    if not eq:
        raise ValueError(f"--limit takes NAME=VALUE, got {item!r:.60}")
    return name.strip(), value.strip()


def _number(name: str, text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"limit {name}: {text!r:.40} is not a number") from None


def check_spec(spec: JobSpec, limits: Limits) -> None:
    """Refuses a spec past the operator's limits, before any work is done for it.

    Raises:
        LimitExceeded: names the first limit passed.
    """
    p = spec.parallelism
    if limits.micro_batches is not None and p.micro_batches > limits.micro_batches:
        raise limits.exceeded("micro_batches", p.micro_batches, limits.micro_batches, "micro_batches")
    actions = p.num_model_stages * p.micro_batches * 3  # F, B (or I and W) and the transfers, per stage
    if limits.scheduled_actions is not None and actions > limits.scheduled_actions:
        raise limits.exceeded("scheduled_actions", actions, limits.scheduled_actions,
                              f"the schedule of {p.num_model_stages} model stages x {p.micro_batches} micro-batches")
    threads = spec.runtime.threads_per_stage
    if limits.threads_per_stage is not None and threads is not None and threads > limits.threads_per_stage:
        raise limits.exceeded("threads_per_stage", threads, limits.threads_per_stage, "threads_per_stage")
    ft = spec.fault_tolerance
    if limits.step_timeout_s is not None and ft.step_timeout_s > limits.step_timeout_s:
        raise limits.exceeded("step_timeout_s", ft.step_timeout_s, limits.step_timeout_s, "step_timeout_s")
    if limits.max_restarts is not None and ft.max_restarts > limits.max_restarts:
        raise limits.exceeded("max_restarts", ft.max_restarts, limits.max_restarts, "max_restarts")


def check_client(limits: Limits, caller: str, held: list[list[str]], nodes: int) -> None:
    """Refuses one more job of ``nodes`` nodes for client ``caller``, who holds ``held`` (each open
    job's nodes) already.

    Raises:
        LimitExceeded: past ``jobs_per_client`` or ``nodes_per_client``.
    """
    if limits.jobs_per_client is not None and len(held) + 1 > limits.jobs_per_client:
        raise limits.exceeded("jobs_per_client", len(held) + 1, limits.jobs_per_client,
                              f"the open jobs of {caller}, with this one,")
    total = sum(len(names) for names in held) + nodes
    if limits.nodes_per_client is not None and total > limits.nodes_per_client:
        raise limits.exceeded("nodes_per_client", total, limits.nodes_per_client,
                              f"the nodes {caller}'s open jobs would hold, with this one,")


async def off_loop(fn: Callable[..., T], *args: Any, timeout_s: float, what: str) -> T:
    """``fn(*args)`` on a thread, so that the head's loop keeps serving; at most ``timeout_s``.

    Raises:
        LimitExceeded: it ran longer (the thread finishes on its own; its result is dropped).
    """
    try:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout_s)
    except TimeoutError:
        raise LimitExceeded(
            f"{what} took more than {timeout_s:g}s (the limit compile_timeout_s); ask for fewer stages or "
            "micro-batches", details={"limit": "compile_timeout_s", "value": None, "allowed": timeout_s}) from None
