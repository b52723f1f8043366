"""The event loop: uvloop where installed (it halves ZeroMQ round trips), asyncio otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["new_event_loop", "run", "uvloop_available"]

T = TypeVar("T")

try:
    import uvloop as _uvloop
except ImportError:  # not on this platform
    _uvloop = None  # type: ignore[assignment]


def uvloop_available() -> bool:
    return _uvloop is not None


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop, uvloop's when available."""
    return _uvloop.new_event_loop() if _uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """Runs ``main`` to completion on a fresh loop (uvloop's when available)."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
