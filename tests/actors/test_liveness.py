"""Liveness (actors._liveness): a process that ends is known by its connection closing, a stopped one
only after the silence timeout, and a busy one never.

Each case runs the worker's end in a child process and watches the head's end here. No
assertion is on a duration: a death is told apart from silence by making the silence
timeout far longer than the test waits, so only the closing connection can explain it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import zmq

from actors._liveness import LivenessServer
from tests.helpers import pythonpath

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

_WORKER = """
import sys, time, zmq
from actors._liveness import LivenessClient
client = LivenessClient(zmq.Context(), sys.argv[1], sys.argv[2], None, None)
if sys.argv[3] == "busy":  # a loop that holds the interpreter, as a model build or a collection pause does
    while True:
        sum(i * i for i in range(10_000))
time.sleep(600)
"""


@contextmanager
def head(timeout: float) -> Iterator[tuple[LivenessServer, list[str]]]:
    closed: list[str] = []
    context: zmq.Context[object] = zmq.Context()
    server = LivenessServer(context, "tcp://127.0.0.1", None, closed.append, interval=0.1, timeout=timeout)
    try:
        yield server, closed
    finally:
        server.close()
        context.term()


@contextmanager
def worker(endpoint: str, name: str, mode: str = "idle") -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen([sys.executable, "-c", _WORKER, endpoint, name, mode], cwd=os.getcwd(),
                             env={**os.environ, "PYTHONPATH": pythonpath(os.getcwd())})
    try:
        yield child
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        child.wait()


def until(condition: Callable[[], bool], seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_process_that_ends_is_known_by_its_connection_closing() -> None:
    with head(timeout=600) as (server, closed):  # silence alone would take ten minutes
        endpoint = server.watch("node1", "")
        with worker(endpoint, "node1") as child:
            assert until(lambda: "node1" in server.verified)
            os.kill(child.pid, signal.SIGKILL)
            assert until(lambda: closed == ["node1"])


def test_a_stopped_process_is_lost_after_the_timeout_and_proves_itself_again_when_it_goes_on() -> None:
    with head(timeout=1.0) as (server, closed):
        endpoint = server.watch("node1", "")
        with worker(endpoint, "node1") as child:
            assert until(lambda: "node1" in server.verified)
            os.kill(child.pid, signal.SIGSTOP)
            assert until(lambda: closed == ["node1"])  # it answered nothing for the timeout
            os.kill(child.pid, signal.SIGCONT)
            assert until(lambda: "node1" in server.verified)  # reconnected, said its name again


def test_a_process_whose_interpreter_is_busy_stays_alive() -> None:
    """The worker's Python never lets go (a tight loop); libzmq's own threads answer the heartbeats."""
    with head(timeout=2.0) as (server, closed):
        endpoint = server.watch("node1", "")
        with worker(endpoint, "node1", "busy"):
            assert until(lambda: "node1" in server.verified)
            time.sleep(6)  # three timeouts' worth of a busy interpreter
            assert closed == [] and "node1" in server.verified


def test_a_connection_that_names_another_node_proves_nothing() -> None:
    with head(timeout=600) as (server, closed):
        endpoint = server.watch("node1", "")
        with worker(endpoint, "node2") as child:  # at node1's socket, saying it is node2
            time.sleep(1)
            assert "node1" not in server.verified
            os.kill(child.pid, signal.SIGKILL)
            time.sleep(1)
            assert closed == []  # an unproven connection's end loses no node


def test_a_head_that_ended_before_the_watchs_first_handshake_is_lost_too() -> None:
    """A driver's watch made as the head is killed never completed a handshake, so no connection
    closes: its connects are refused instead (nothing listens at the port), and that is the same news.
    Found in the suite on two workers: a head killed right after a driver connected was never lost."""
    import socket as sockets

    from actors._liveness import LivenessClient

    with sockets.socket() as probe:  # a port nothing listens at once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    gone: list[bool] = []
    context: zmq.Context[object] = zmq.Context()
    client = LivenessClient(context, f"tcp://127.0.0.1:{port}", "", None, None, lambda: gone.append(True),
                            silent_timeout=600.0)
    try:
        assert until(lambda: bool(gone), seconds=60), "a head nobody listens for was never lost"
    finally:
        client.close()
        context.term()


def test_a_head_that_stops_during_the_watchs_handshake_is_lost_after_the_silent_timeout() -> None:
    """Heartbeats start after the handshake, so a head stopped while a driver's watch was shaking hands
    (its first, or one after a reconnect) was lost only after libzmq's 30 s handshake limit: found as
    a suite test that stopped the head right after a second driver connected, lost in 30 s instead of 6.
    A socket that accepts the connection and never speaks stands in for the stopped head."""
    import socket as sockets

    from actors._liveness import HEAD_GONE_S, LivenessClient

    with sockets.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)  # the kernel accepts the connection; nobody answers the greeting
        gone: list[float] = []
        context: zmq.Context[object] = zmq.Context()
        started = time.monotonic()
        client = LivenessClient(context, f"tcp://127.0.0.1:{mute.getsockname()[1]}", "", None, None,
                                lambda: gone.append(time.monotonic() - started), silent_timeout=1.0)
        try:
            # 1 s of silence and HEAD_GONE_S without a new connection; libzmq's own limit alone took 33 s.
            assert until(lambda: bool(gone), seconds=25), "a head silent through the handshake was not lost"
            assert gone[0] >= 1.0 + HEAD_GONE_S  # silent that long, not sooner
        finally:
            client.close()
            context.term()


def test_a_head_that_closes_tells_its_nodes_which_stop_without_waiting_for_a_reconnection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A launched node stops with its head: it waited until the closed connection had stayed closed for
    HEAD_GONE_S (3 s at the end of every torchrun job), as for a head that died. A head that closes
    now says so first; here HEAD_GONE_S is longer than the test, so only that word can stop the node.
    A head that goes without a word (killed) is still known by its connection."""
    import actors._liveness as liveness
    from actors._liveness import LivenessClient

    monkeypatch.setattr(liveness, "HEAD_GONE_S", 600.0)
    context: zmq.Context[object] = zmq.Context()
    server = LivenessServer(context, "tcp://127.0.0.1", None, lambda name: None, interval=0.1, timeout=600)
    gone: list[bool] = []
    client = LivenessClient(context, server.watch("node1", ""), "node1", None, None, lambda: gone.append(True))
    try:
        assert until(lambda: "node1" in server.verified)
        server.close()
        assert until(lambda: bool(gone)), "the node never heard that its head closes"
    finally:
        client.close()
        context.term()


def test_a_context_that_ends_before_its_watches_are_closed_ends_them() -> None:
    """Ending the context (``zmq.Context.term``) waits for every socket made in it; a watch's thread
    that kept polling on ETERM kept its sockets open, and the ending waited for ever. Found as a
    driver script that raised while its cluster was open: ``asyncio.run`` closed the runtime (its
    async generator) before the cluster's watch, and the script hung instead of exiting."""
    import threading

    from actors._liveness import LivenessClient

    context: zmq.Context[object] = zmq.Context()
    server = LivenessServer(context, "tcp://127.0.0.1", None, lambda name: None, interval=0.1, timeout=600)
    endpoint = server.watch("node1", "")
    client = LivenessClient(context, endpoint, "node1", None, None)
    assert until(lambda: "node1" in server.verified)
    server.watch("node2", "")  # made after the thread's last look, too
    ending = threading.Thread(target=context.term, daemon=True)
    ending.start()
    ending.join(timeout=60)
    assert not ending.is_alive(), "the context waited for the watches' sockets"
    client.close()  # after the context ended: nothing left to close, and no error
    server.close()


def test_a_watch_whose_thread_is_held_up_leaves_its_sockets_to_that_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() closed the sockets from the caller's thread once its wait for the watch's thread ran
    out, while that thread (held in on_head_gone, or starved on a busy machine) would poll them
    again: a socket used by two threads at once is how libzmq asserts. The thread closes its own."""
    import socket as sockets
    import threading

    import actors._liveness as liveness
    from actors._liveness import LivenessClient

    monkeypatch.setattr(liveness, "HEAD_GONE_S", 0.0)
    monkeypatch.setattr(liveness, "JOIN_S", 0.2)
    with sockets.socket() as probe:  # a port nothing listens at: the head is gone at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    held, release = threading.Event(), threading.Event()

    def gone() -> None:
        held.set()
        release.wait(60)  # the watch's thread, held up

    context: zmq.Context[object] = zmq.Context()
    client = LivenessClient(context, f"tcp://127.0.0.1:{port}", "", None, None, gone, silent_timeout=600.0)
    assert held.wait(60), "the head nobody listens for was never lost"
    client.close()  # waits 0.2 s for the thread, in vain
    assert not client._socket.closed, "close() closed a socket its watch's thread still holds"
    release.set()
    ending = threading.Thread(target=context.term, daemon=True)  # waits for every socket: the thread's close
    ending.start()
    ending.join(timeout=60)
    assert not ending.is_alive() and client._socket.closed
