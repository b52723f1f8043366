"""The loop both of this project's fork servers run: one that forks on request and says when a child ends.

A ``LocalCluster``'s fork server (:mod:`actors._forkserver`) forks node processes for its driver,
and a node's zygote (:mod:`actors._processes`) forks the processes that host its jobs' actors.
Both are blocking, single-threaded processes that read requests from a Unix socket (msgpack, with
at most one file descriptor passed along), fork, and report each child's pid as it starts and its
wait status as it ends (``{"op": "pid" | "exited", ...}``). :class:`ForkLoop` is that loop; what
a request means is each server's own.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
from collections.abc import Iterator
from typing import Any

import msgpack

__all__ = ["ForkLoop"]


class ForkLoop:
    """Requests off ``channel`` and the ends of the children forked for them.

    Made in the server's process (it takes SIGCHLD and the signal wake-up fd); iterate
    :meth:`requests`, :meth:`fork` for the ones that start a child, and leave through
    :meth:`stop`, which signals every child still running.
    """

    def __init__(self, channel: socket.socket, max_bytes: int) -> None:
        self.channel = channel
        self.max_bytes = max_bytes
        self.children: dict[int, Any] = {}  # pid -> the id of the request that started it
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self._wake_w)

    def requests(self) -> Iterator[tuple[dict[str, Any], list[int]]]:
        """Each request (a msgpack map; anything else is skipped) with the descriptors passed
        along, until the other end closes the channel; a child that ended meanwhile is reaped
        and reported first."""
        channel = self.channel.fileno()
        while True:
            ready, _, _ = select.select([channel, self._wake_r], [], [])
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 512):
                        pass
                self._reap()
            if channel not in ready:
                continue
            data, fds, _, _ = socket.recv_fds(self.channel, self.max_bytes, 1)
            if not data:  # the other end closed (or its process exited)
                return
            try:
                message = msgpack.unpackb(data)
            except (ValueError, msgpack.UnpackException):
                message = None
            if not isinstance(message, dict):
                for fd in fds:
                    os.close(fd)
                continue
            yield message, fds

    def fork(self, request: dict[str, Any]) -> int:
        """Forks for ``request``: 0 in the child (which leaves the loop's descriptors behind), the
        child's pid in this process, where the pid is sent back on the channel."""
        pid = os.fork()
        if pid == 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self.channel.close()
            return 0
        self.children[pid] = request.get("id")
        self.send({"op": "pid", "id": request.get("id"), "pid": pid})
        return pid

    def send(self, message: dict[str, Any]) -> None:
        self.channel.send(msgpack.packb(message))

    def stop(self, sig: int) -> None:
        """Sends ``sig`` to every child still running."""
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.pop(pid, None)
            with contextlib.suppress(OSError):  # the other end may be gone: the loop ends on its next read
                self.send({"op": "exited", "pid": pid, "status": status})
