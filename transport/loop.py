"""The event loop: uvloop where installed (it halves ZeroMQ round trips), asyncio otherwise."""

from __future__ import annotations

import asyncio
import signal
import threading
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
    """Runs ``main`` to completion on a fresh loop (uvloop's when available).

    The process's SIGINT and SIGTERM handlers are as they were afterwards: uvloop's loop, once
    closed, left the ones ``main`` added (``loop.add_signal_handler``, as a node's serve does)
    pointing at itself, so a later Ctrl-C in a process that goes on (a test, a notebook) met a
    closed loop."""
    kept = {sig: signal.getsignal(sig) for sig in _SIGNALS} if _main_thread() else {}
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(main)
    finally:
        for sig, handler in kept.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
