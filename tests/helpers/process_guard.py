"""A pytest plugin: a test that starts a process must carry the ``multiprocess`` mark.

`make test-fast` runs ``-m "not multiprocess"``, so an unmarked test that starts a
node, a cluster or a subprocess would make the quick tier slow without anyone
noticing. While an unmarked test runs (its setup, call and teardown, module and
session fixtures it sets up included), the points processes start from refuse:

- ``subprocess.Popen`` (and so ``subprocess.run``, ``os.popen``, a ``LocalCluster``'s
  nodes, asyncio's default loop, the netns helpers);
- ``asyncio.create_subprocess_exec`` / ``_shell`` (uvloop spawns without ``Popen``);
- ``multiprocessing``'s ``Process.start`` (torch.multiprocessing, pools, executors);
- ``os.fork``, ``os.forkpty`` (pexpect), ``os.posix_spawn[p]``, ``os.system``;
- ``LocalCluster``'s node start (``actors.cluster.LocalCluster._launch``), named as such.

The refusal is ``pytest.fail`` (a BaseException, so ``except Exception`` in the code
under test does not hide it), and a refusal that something swallowed anyway still
fails the test's report. Collection is not a test: a module may start a process
at import. The one process an unmarked test may start is the C compiler that
``transport._native`` runs once per machine (its exact command: the kernel source in
and a shared library out); the plugin also builds those kernels at session start, so
unmarked tests find them cached, and loads matplotlib's font list there (on a fresh
machine matplotlib builds it by running ``fc-list``).

Run its tests with: `.venv/bin/python -m pytest -q tests/test_process_guard.py`
"""
from __future__ import annotations

import asyncio
import asyncio.subprocess
import contextlib
import functools
import inspect
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = ["MARK", "ProcessGuard", "check_start", "expect_refusal"]

MARK = "multiprocess"


@dataclass(slots=True)
class ProcessGuard:
    """One pytest session's view: the test now running and the refusals it got."""

    item: pytest.Item | None = None
    refusals: list[str] = field(default_factory=list)
    num_reported: int = 0  # refusals already turned into a failed report


# The innermost session decides (pytester runs a session inside a test's session).
_guards: list[ProcessGuard] = []
_undo: list[Callable[[], None]] = []


def check_start(what: str, argv: object = None) -> None:
    """Fail the running test if it is not marked ``multiprocess`` and ``what`` is no compile.

    Args:
        what: the start point, as the message names it ("subprocess.Popen").
        argv: the command, where the start point has one.

    Raises:
        pytest.fail.Exception: the running test is not marked ``multiprocess``.
    """
    __tracebackhide__ = True
    if not _guards:
        return
    guard = _guards[-1]
    item = guard.item
    if item is None or item.get_closest_marker(MARK) is not None or _is_native_compile(argv):
        return
    command = f" ({_excerpt(argv)})" if argv is not None else ""
    message = (
        f"{item.nodeid} starts a process through {what}{command} but is not marked {MARK}: "
        f"mark it @pytest.mark.{MARK} (or add pytest.mark.{MARK} to the module's pytestmark), "
        f"so that `make test-fast` (-m \"not {MARK}\") leaves it out"
    )
    guard.refusals.append(message)
    pytest.fail(message)


@contextlib.contextmanager
def expect_refusal() -> Iterator[None]:
    """For the guard's own tests: the block must be refused, and that refusal fails nothing.

    Raises:
        pytest.fail.Exception: the block started no process through a guarded point.
    """
    guard = _guards[-1]
    before = len(guard.refusals)
    with pytest.raises(pytest.fail.Exception, match=f"is not marked {MARK}: mark it @pytest.mark.{MARK}"):
        yield
    del guard.refusals[before:]


def _is_native_compile(argv: object) -> bool:
    """Whether ``argv`` is transport._native's compile: its C source in, a library out."""
    if not isinstance(argv, (list, tuple)):
        return False
    from transport import _native

    words = [os.fspath(word) if isinstance(word, (str, os.PathLike)) else word for word in argv]
    return str(_native._SOURCE) in words and "-shared" in words and "-o" in words


def _excerpt(argv: object) -> str:
    if isinstance(argv, (list, tuple)):
        text = " ".join(str(word) for word in argv[:6]) + (" ..." if len(argv) > 6 else "")
    else:
        text = str(argv)
    return repr(text[:120])


def _command_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    return kwargs.get("args", args[0] if args else None)


def _patch(owner: object, name: str, what: str, argv_of: Callable[..., object] | None = None) -> None:
    original = getattr(owner, name, None)
    if original is None:
        return

    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def guarded_async(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            check_start(what, argv_of(args, kwargs) if argv_of else None)
            return await original(*args, **kwargs)

        replacement: Any = guarded_async
    else:
        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            check_start(what, argv_of(args, kwargs) if argv_of else None)
            return original(*args, **kwargs)

        replacement = guarded
    setattr(owner, name, replacement)
    _undo.append(lambda: setattr(owner, name, original))


def _install() -> None:
    from actors.cluster import LocalCluster

    # Popen's __init__ takes self first: the command is the second positional argument.
    _patch(subprocess.Popen, "__init__", "subprocess.Popen", lambda a, k: _command_of(a[1:], k))
    for owner in (asyncio, asyncio.subprocess):
        _patch(owner, "create_subprocess_exec", "asyncio.create_subprocess_exec", lambda a, k: list(a))
        _patch(owner, "create_subprocess_shell", "asyncio.create_subprocess_shell", lambda a, k: _command_of(a, k))
    _patch(multiprocessing.process.BaseProcess, "start", "multiprocessing's Process.start")
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        _patch(os, name, f"os.{name}")
    _patch(LocalCluster, "_launch", "LocalCluster's node start", lambda a, k: a[2] if len(a) > 2 else None)


def _uninstall() -> None:
    while _undo:
        _undo.pop()()


def pytest_configure(config: pytest.Config) -> None:
    if not _guards:
        _install()
    _guards.append(ProcessGuard())


def pytest_unconfigure(config: pytest.Config) -> None:
    if _guards:
        _guards.pop()
    if not _guards:
        _uninstall()


def pytest_sessionstart(session: pytest.Session) -> None:
    # Built (or found cached) before any test runs: the codecs' tests then find the
    # kernels loaded, and a worker that builds them concurrently waits on its file lock.
    from transport import _native

    _native.blockquant()
    # Likewise matplotlib's font list: where none is cached yet (a fresh machine), the first
    # use builds it by running fc-list, which the guard refused to the trace's plot test.
    import matplotlib.font_manager  # noqa: F401


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    guard = _guards[-1]
    guard.item, guard.refusals, guard.num_reported = item, [], 0
    try:
        return (yield)
    finally:
        guard.item = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    guard = _guards[-1]
    if guard.item is item and len(guard.refusals) > guard.num_reported:
        # A refusal the code under test caught (or one in another thread): still a failure.
        if report.passed:
            report.outcome = "failed"
            report.longrepr = "\n".join(guard.refusals[guard.num_reported:])
        guard.num_reported = len(guard.refusals)
    return report
