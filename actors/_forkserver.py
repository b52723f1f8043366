"""A ``LocalCluster``'s node processes, forked from one process that imported everything once.

Each ``python -m actors.node`` spends about two seconds of CPU importing torch and the
runtime before it does anything; a cluster of a head and two workers spent seven, and a
driver that starts clusters one after another (a test suite, a sweep, a notebook) paid
them every time. A :class:`ForkServer` is a process started once per driver
(``python -m actors._forkserver``) that makes those imports, then forks a node for each
request: ``actors.node.main`` runs in the child with the arguments, environment, working
directory and stderr the driver gives, exactly as the command would. Nothing there has
started a thread, a ZeroMQ context or a GPU context when it forks (it checks), as for the
zygote a worker forks its stages from (:mod:`actors._processes`).

    driver  --(seqpacket: start + argv, env, cwd and the stderr fd)-->  fork server
    driver  <--(seqpacket: pid, exit status)----------------------------  fork server

A child runs in a session of its own (a terminal's Ctrl-C is the driver's) and gets
SIGTERM when the fork server ends; the fork server ends when the driver's end of the
channel closes, which the kernel does when the driver exits however it exits, and then
sends SIGTERM to every node it forked. The channel carries msgpack between two
processes of one user, never pickle.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from actors._forking import ForkLoop

__all__ = ["ForkServer", "ForkedProcess", "fork_server"]

log = logging.getLogger(__name__)

_MAX_CONTROL_BYTES = 1 << 20  # a start request: argv and the environment
_PR_SET_PDEATHSIG = 1


class ForkedProcess:
    """A node the fork server forked, with the part of :class:`subprocess.Popen` a cluster uses.

    ``pid`` waits for the fork server's answer the first time it is read (the fork server
    may still be importing); ``returncode`` is the exit code, or minus the signal that
    ended it, once :meth:`poll` or :meth:`wait` saw it end.
    """

    def __init__(self, server: ForkServer, request: int) -> None:
        self._server = server
        self._request = request
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self._server.pid_of(self._request)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self._request, timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, once the process ended.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        if self.returncode is None:
            self.returncode = self._server.exit_code(self._request, timeout=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(["actors.node", str(self._request)], timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet, so the pid is still this process's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The driver's end: starts the fork server process and asks it for nodes.

    Thread-safe: a cluster polls its processes from its loop and reaps them from a thread.
    """

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "actors._forkserver", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C is the driver's; the server ends with it
        )
        theirs.close()
        self._channel = ours
        self._lock = threading.Lock()
        self._next = 0
        self._pids: dict[int, int] = {}  # request -> pid
        self._failed: dict[int, str] = {}  # request -> why it could not fork
        self._exits: dict[int, int] = {}  # request -> exit code
        self._by_pid: dict[int, int] = {}  # pid -> request

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def start(self, argv: Sequence[str], env: Mapping[str, str], module: str = "actors.node") -> ForkedProcess:
        """Forks ``python -m MODULE ARGV`` with ``env``, this process's working directory and stderr.

        The child runs ``MODULE.main(argv)`` (imported there if the server has not) and exits
        with what it returns.
        """
        with self._lock:
            request, self._next = self._next, self._next + 1
            message = msgpack.packb({"op": "start", "id": request, "module": module, "argv": list(argv),
                                     "env": dict(env), "cwd": os.getcwd()})
            socket.send_fds(self._channel, [message], [sys.stderr.fileno()])
        return ForkedProcess(self, request)

    def pid_of(self, request: int) -> int:
        deadline = time.monotonic() + 120.0  # the server's imports, on a machine as busy as it gets
        while True:
            with self._lock:
                if request in self._pids:
                    return self._pids[request]
                if request in self._failed:
                    raise RuntimeError(f"the fork server could not start a node: {self._failed[request]}")
                left = deadline - time.monotonic()
                if left <= 0 or not self._read(min(left, 0.1)) and not self.alive:
                    raise RuntimeError(f"the fork server (pid {self._process.pid}) ended or did not answer; "
                                       "see its output above")

    def exit_code(self, request: int, timeout: float | None) -> int | None:
        """Request ``request``'s exit code; None if it still runs after ``timeout`` seconds (None: however long)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if request in self._exits:
                    return self._exits[request]
                if request in self._failed:
                    return 1
                if not self.alive and not self._read(0.0):  # its children got SIGTERM as it ended
                    return -signal.SIGTERM
                left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                if left <= 0:
                    self._read(0.0)
                    return self._exits.get(request)
                self._read(left)

    def _read(self, timeout: float) -> bool:
        """Takes what the server sent within ``timeout`` seconds (under the lock); whether anything came."""
        got = False
        while select.select([self._channel], [], [], timeout)[0]:
            data = self._channel.recv(_MAX_CONTROL_BYTES)
            if not data:
                return got
            got, timeout = True, 0.0
            message = msgpack.unpackb(data)
            request = message.get("id")
            if message.get("op") == "pid":
                self._pids[request] = message["pid"]
                self._by_pid[message["pid"]] = request
            elif message.get("op") == "failed":
                self._failed[request] = str(message.get("error"))
            elif message.get("op") == "exited" and message.get("pid") in self._by_pid:
                self._exits[self._by_pid.pop(message["pid"])] = os.waitstatus_to_exitcode(message["status"])
        return got

    def close(self) -> None:
        """Ends the fork server (it sends SIGTERM to the nodes it forked that still run)."""
        with contextlib.suppress(OSError):
            self._channel.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=5.0)
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


_server: ForkServer | None = None
_server_lock = threading.Lock()


def fork_server() -> ForkServer:
    """This driver's fork server, started at the first call (and again if it ended)."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive:
            _server = ForkServer()
        return _server


# -- the fork server process (blocking: it forks and reaps, nothing else) --------------------------


def _serve(channel: socket.socket) -> None:
    # What a node imports before it does anything, and what its zygote imports before its first
    # stage (the worker plug-in's preload: torch._dynamo, 1.5 s of CPU), so that each fork starts with it.
    importlib.import_module("actors.node")
    from actors._processes import _thread_count
    from actors.plugins import head_modules, load_plugin
    for module in head_modules():
        importlib.import_module(module)
    if (preload := getattr(load_plugin("worker"), "preload", None)) is not None:
        preload()
    gc.collect()
    threads = _thread_count()  # torch's import starts one native thread of its own, which no fork copies
    gc.freeze()  # never collected in a child: a collection there would copy every page it touches
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loop = ForkLoop(channel, _MAX_CONTROL_BYTES)
    try:
        for message, fds in loop.requests():  # until the driver closes its end or exits
            if message.get("op") != "start" or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                continue
            if (now := _thread_count()) > threads:  # a fork would copy a lock some thread holds
                os.close(fds[0])
                loop.send({"op": "failed", "id": message.get("id"),
                           "error": f"the fork server runs {now} threads, not {threads}"})
                continue
            if loop.fork(message) == 0:
                _node(message, fds[0])  # never returns
            os.close(fds[0])
    finally:
        loop.stop(signal.SIGTERM)


def _node(message: dict[str, Any], stderr: int) -> None:
    """The life of one forked node; leaves with ``os._exit``, never by returning."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        os.dup2(stderr, 2)
        os.close(stderr)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(message["env"])
        tempfile.tempdir = None  # cached by the server's imports (torch._dynamo's): derived from TMPDIR again
        os.chdir(message["cwd"])
        # As `python -m` starts: the working directory first, then PYTHONPATH, then the rest.
        extra = [message["cwd"], *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        sys.path[:] = [*dict.fromkeys(extra), *(p for p in sys.path[1:] if p not in extra)]
        program = importlib.import_module(message["module"])
        sys.argv = [program.__file__ or message["module"], *message["argv"]]
        result = program.main(list(message["argv"]))
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (nothing may return into the fork server's stack)
        traceback.print_exc()
    finally:
        # As `python -m actors.node` leaves: a compute thread may still sit in a native call.
        logging.shutdown()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
