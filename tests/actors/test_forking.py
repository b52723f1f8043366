"""The loop both fork servers run (actors._forking.ForkLoop), in this process."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from actors._forking import ForkLoop

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


@pytest.fixture
def loop_and_peer() -> Iterator[tuple[ForkLoop, socket.socket]]:
    """A ForkLoop on one end of a socket pair (the test's end is the other); the signal settings
    it takes are given back after."""
    previous_handler = signal.getsignal(signal.SIGCHLD)
    server_end, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    loop = ForkLoop(server_end, 1 << 16)
    previous_fd = signal.set_wakeup_fd(loop._wake_w)
    try:
        yield loop, peer
    finally:
        signal.set_wakeup_fd(previous_fd if previous_fd != loop._wake_w else -1)
        signal.signal(signal.SIGCHLD, previous_handler)
        for fd in (loop._wake_r, loop._wake_w):
            os.close(fd)
        server_end.close()
        peer.close()


def received(peer: socket.socket) -> dict[str, Any]:
    peer.settimeout(30)
    message = msgpack.unpackb(peer.recv(1 << 16))
    assert isinstance(message, dict)
    return message


def test_garbage_is_skipped_a_fork_is_reported_as_it_starts_and_ends_and_a_close_ends_the_loop(
    loop_and_peer: tuple[ForkLoop, socket.socket]
) -> None:
    loop, peer = loop_and_peer
    peer.send(b"\xc1 not msgpack")  # used to end the server with an unpacking error
    peer.send(msgpack.packb([1, 2]))  # not a map
    read_end, write_end = os.pipe()
    socket.send_fds(peer, [msgpack.packb({"op": "start", "id": 7})], [write_end])
    os.close(write_end)
    seen: list[tuple[dict[str, Any], int]] = []
    reports: list[dict[str, Any]] = []

    def the_other_end() -> None:
        reports.append(received(peer))  # the pid
        reports.append(received(peer))  # the child's end
        peer.shutdown(socket.SHUT_WR)  # then the loop ends

    other = threading.Thread(target=the_other_end)
    other.start()
    for message, fds in loop.requests():
        seen.append((message, len(fds)))
        if loop.fork(message) == 0:
            os._exit(3)  # the child: at once, touching nothing of pytest's
        for fd in fds:
            os.close(fd)
    other.join(30)
    os.close(read_end)
    assert seen == [({"op": "start", "id": 7}, 1)]
    pid = reports[0]["pid"]
    assert reports[0] == {"op": "pid", "id": 7, "pid": pid}
    assert reports[1]["op"] == "exited" and reports[1]["pid"] == pid
    assert os.waitstatus_to_exitcode(reports[1]["status"]) == 3
    assert loop.children == {}


def test_stop_signals_every_child_still_running(loop_and_peer: tuple[ForkLoop, socket.socket]) -> None:
    loop, peer = loop_and_peer
    pid = loop.fork({"id": 1})
    if pid == 0:
        signal.pause()  # until the stop's signal ends it
        os._exit(0)
    assert received(peer) == {"op": "pid", "id": 1, "pid": pid}
    loop.stop(signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
