"""Liveness a busy machine cannot fake: a node is lost when its connection to the head closes.

Heartbeats sent by actor messages ride the event loops at both ends: a loop busy building
a model, a saturated machine or a long collection pause delays them, and a head that counts
their silence calls a healthy node dead. So each worker also holds one connection of its
own to the head's *liveness* socket, and the judgement is left to libzmq's I/O threads,
which hold no Python lock:

- the head's ROUTER asks every connection for a ZMTP heartbeat each ``interval`` and, with
  ``ROUTER_NOTIFY``, hears the moment a connection ends; the worker's libzmq answers the
  heartbeats itself, whatever its Python threads are doing;
- a worker whose process ended closes its connection at once (the kernel closes the
  socket): the head knows within milliseconds, by a signal that no timing decides;
- a worker that is alive but silent (stopped, frozen, cut off) stops answering; after
  ``timeout`` seconds without an answer libzmq drops its connection, and the head knows
  then. Only a stopped process or a cut network reaches that timeout: a busy one answers.

A connection counts only once the worker has said, over CURVE, which node it is (its first
message carries its name; the head checks the key it came with against the node's). Each
end runs in a daemon thread of its own, polling its one socket. A head that closes says so
on each connection first (:data:`_BYE`), so a node that stops with its head (a launched one)
stops at once rather than once the connection has stayed closed for :data:`HEAD_GONE_S`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from transport.channel import reach
from transport.security import Keypair, configure_client, configure_server

__all__ = ["HEAD_GONE_S", "MAX_SILENCE_S", "LivenessClient", "LivenessServer", "check_silence"]

log = logging.getLogger(__name__)

_POLL_MS = 100
_HELLO = b"node"
_BYE = b"head closes"  # the head's only message on a connection: it is closing (over CURVE: from its key)
_BYE_LINGER_MS = 500  # how long a closing head's socket keeps trying to hand its bye over
# A launched worker's head is gone when its liveness connection stays closed this long (libzmq
# reconnects by itself across a blip; a head that exited or was killed never comes back).
HEAD_GONE_S = 3.0
# The longest silence a liveness connection can wait out: libzmq keeps a heartbeat's time to live in
# tenths of a second in 16 bits (6553.5 s), and refused a longer one only as a node registered.
MAX_SILENCE_S = 6553.0


def check_silence(name: str, seconds: float) -> None:
    """Refuses a silence no heartbeat can wait out (:data:`MAX_SILENCE_S`), or one that is not a finite
    number of seconds above 0.

    Raises:
        ValueError: naming ``name`` and what would work.
    """
    if not 0 < seconds <= MAX_SILENCE_S:
        raise ValueError(f"{name} must be seconds > 0 and <= {MAX_SILENCE_S:g} (libzmq's heartbeats wait at most "
                         f"that long), got {seconds!r}")
# How long closing a liveness end waits for its thread (which closes its sockets as it ends).
JOIN_S = 5.0


class LivenessServer:
    """The head's end: one socket per node, watched by a thread, that tells of its connection closing.

    Each node gets a PAIR of its own (libzmq without its draft API cannot name the peer whose
    connection a shared socket lost): bound at an ephemeral port (or ``ipc`` path) that only
    its registration's answer gives out, taking one connection, whose first message must
    name the node and come with the node's key.

    Args:
        context: the head runtime's context (its ZAP gate admits the cluster's keys).
        host: where to bind each node's socket: ``tcp://HOST`` (an ephemeral port each) or the
            head's own ``ipc://PATH`` (``PATH.live0``, ``PATH.live1``...: beside it, where whoever
            made its folder cleans up).
        keys: the head's keypair (CURVE server), or None on an insecure cluster.
        on_closed: called, from the thread, with a node's name once its proven connection ended.
        interval, timeout: seconds between ZMTP heartbeats, and without an answer before a
            connection is dropped (then ``on_closed``).
    """

    def __init__(self, context: zmq.Context[Any], host: str, keys: Keypair | None,
                 on_closed: Callable[[str], object], *, interval: float, timeout: float) -> None:
        self._context = context
        # Each node's socket at an ephemeral port of this host, or at a path of its own beside the head's.
        self._host = host
        self._count = itertools.count()
        self._keys = keys
        self._on_closed = on_closed
        self._interval_ms = max(1, int(interval * 1000))
        self._timeout_ms = max(1, int(timeout * 1000))
        self._lock = threading.Lock()
        self._added: list[tuple[str, str, zmq.Socket[Any], zmq.Socket[Any]]] = []  # for the thread to take
        self._removed: list[str] = []
        self.verified: set[str] = set()  # names whose connection proved its node's key (tests read it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="liveness", daemon=True)
        self._thread.start()

    def watch(self, name: str, identity: str) -> str:
        """A socket for node ``name`` (holding key ``identity``; "" on an insecure cluster), replacing
        any it had; returns the endpoint the node connects to."""
        socket: zmq.Socket[Any] = self._context.socket(zmq.PAIR)
        try:
            if self._keys is not None:
                configure_server(socket, self._keys)
            socket.setsockopt(zmq.HEARTBEAT_IVL, self._interval_ms)
            socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._timeout_ms)
            socket.setsockopt(zmq.HEARTBEAT_TTL, self._timeout_ms)
            socket.setsockopt(zmq.MAXMSGSIZE, 1024)
            socket.setsockopt(zmq.LINGER, 0)
        except BaseException:
            socket.close(linger=0)  # else the context's end waits for it forever
            raise
        address = f"{self._host}.live{next(self._count)}" if self._host.startswith("ipc://") else f"{self._host}:0"
        reach(socket, address)
        socket.bind(address)
        endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        with self._lock:
            self._removed.append(name)
            self._added.append((name, identity, socket, monitor))
        return endpoint

    def forget(self, name: str) -> None:
        """Stops watching node ``name`` (it left)."""
        with self._lock:
            self._removed.append(name)

    def close(self) -> None:
        """Stops the thread, which closes every socket."""
        self._stop.set()
        self._thread.join(timeout=JOIN_S)
        with self._lock:  # sockets made after the thread's last look: closed here, or the context never ends
            added, self._added = self._added, []
        for _, _, socket, monitor in added:
            _close(socket, monitor)

    def _serve(self) -> None:
        watched: dict[str, tuple[str, zmq.Socket[Any], zmq.Socket[Any]]] = {}
        try:
            while not self._stop.is_set():
                self._take_changes(watched)
                poller = zmq.Poller()
                for _, socket, monitor in watched.values():
                    poller.register(socket, zmq.POLLIN)
                    poller.register(monitor, zmq.POLLIN)
                if not watched:
                    time.sleep(_POLL_MS / 1000)
                    continue
                try:
                    ready = dict(poller.poll(_POLL_MS))
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.ETERM:  # the context is ending: it waits for these sockets to close
                        return
                    log.warning("liveness: %s", exc)
                    continue
                for name, (identity, socket, monitor) in list(watched.items()):
                    try:
                        if socket in ready:
                            self._hello(name, identity, socket.recv(copy=False))
                        if monitor in ready:
                            monitor.recv_multipart()
                            if name in self.verified:
                                self.verified.discard(name)
                                self._on_closed(name)
                    except Exception:  # one node's trouble must not end liveness for the others
                        log.exception("liveness: node %s", name)
        finally:
            self._take_changes(watched)  # and those made since the last look
            for name, (_, socket, monitor) in watched.items():
                linger = 0
                if name in self.verified and self._stop.is_set():  # closing: tell each node
                    with contextlib.suppress(zmq.ZMQError):
                        socket.send(_BYE, zmq.NOBLOCK)
                        linger = _BYE_LINGER_MS
                _close(socket, monitor, linger)

    def _take_changes(self, watched: dict[str, tuple[str, zmq.Socket[Any], zmq.Socket[Any]]]) -> None:
        with self._lock:
            removed, added, self._removed, self._added = self._removed, self._added, [], []
        for name in removed:
            old = watched.pop(name, None)
            if old is not None:
                self.verified.discard(name)
                _close(old[1], old[2])
        for name, identity, socket, monitor in added:
            watched[name] = (identity, socket, monitor)

    def _hello(self, name: str, identity: str, frame: zmq.Frame) -> None:
        caller = str(frame.get("User-Id")) if self._keys is not None else ""
        if frame.bytes == _HELLO + b" " + name.encode() and caller == identity:
            self.verified.add(name)
        else:
            log.warning("liveness: node %s's socket got a hello from another key or name", name[:60])


def _close(socket: zmq.Socket[Any], monitor: zmq.Socket[Any], linger_ms: int = 0) -> None:
    with contextlib.suppress(zmq.ZMQError):  # ETERM: the context is ending, and closing the socket ends its monitor
        socket.disable_monitor()
    monitor.close(linger=0)
    socket.close(linger=linger_ms)


class LivenessClient:
    """A worker's end: one PAIR connected to the socket the head made for this node.

    It says its name once; libzmq answers the head's heartbeats from then on. A thread
    keeps it (and says the name again after a reconnect, which libzmq makes by itself).

    A driver watches its head the same way, with ``silent_timeout`` set: a PUSH connected
    to the head runtime's own (PULL) socket says nothing, and its libzmq asks for a ZMTP heartbeat
    every half second, which the head's libzmq answers whatever its Python threads are
    doing; ``silent_timeout`` seconds without an answer (a stopped head, a cut network)
    drop the connection, as a head process that ends closes it at once.

    Args:
        context: the worker runtime's context.
        endpoint: the head's liveness endpoint.
        name: the node's name, which its first message says.
        keys, server_public: the worker's keypair and the head's public key (CURVE), or None.
        on_head_gone: called once, from the thread, when the connection has stayed closed for
            :data:`HEAD_GONE_S` (the head's process is gone); None: nothing is called.
        silent_timeout: a driver's watch (see above), dropped after this many seconds without
            a heartbeat answered; None: a worker's liveness connection (the head asks).
    """

    def __init__(self, context: zmq.Context[Any], endpoint: str, name: str, keys: Keypair | None,
                 server_public: bytes | None, on_head_gone: Callable[[], None] | None = None, *,
                 silent_timeout: float | None = None) -> None:
        if silent_timeout is not None:
            check_silence("head_timeout", silent_timeout)
        self._socket: zmq.Socket[Any] = context.socket(zmq.PAIR if silent_timeout is None else zmq.PUSH)
        socket = self._socket
        if keys is not None and server_public is not None:
            configure_client(socket, keys, server_public)
        socket.setsockopt(zmq.LINGER, 0)
        if silent_timeout is not None:
            socket.setsockopt(zmq.HEARTBEAT_IVL, 500)
            socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(silent_timeout * 1000)))
            # Heartbeats start once a handshake is done: a head stopped while one was under way (the
            # watch's first, or one after a reconnect) answered nothing for libzmq's handshake limit,
            # 30 s, before the connection dropped. The same silence bounds the handshake.
            socket.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(silent_timeout * 1000)))
        # A refused connect (CONNECT_RETRIED: nothing listens at the head's port any more) closes
        # as a dropped connection does: a head killed before the watch's first handshake left
        # no connection to drop, and was never lost.
        self._monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                                  | zmq.EVENT_CONNECT_RETRIED)
        reach(socket, endpoint)
        socket.connect(endpoint)
        self._name = name.encode() if silent_timeout is None else None  # a driver's watch says nothing
        self._on_head_gone = on_head_gone
        self.handshaken = threading.Event()  # set at the first handshake done (a connection heartbeats are on)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="liveness", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops the thread, which closes the sockets as it ends: a socket is used by one thread only, and
        one stuck (in ``on_head_gone``, or starved on a busy machine) past the wait closes them later."""
        self._stop.set()
        self._thread.join(timeout=JOIN_S)
        if self._thread.is_alive():
            log.warning("the liveness thread did not end within %.0fs; it closes its sockets when it does", JOIN_S)

    def _close_sockets(self) -> None:
        if not self._socket.closed:
            _close(self._socket, self._monitor)

    def _serve(self) -> None:
        try:
            self._watch()
        finally:
            self._close_sockets()  # here, on the thread that polls them (the context waits for them)

    def _watch(self) -> None:
        poller = zmq.Poller()
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._socket, zmq.POLLIN)
        closed_at: float | None = None  # when the connection last closed, until it is made again
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(_POLL_MS))
                if self._monitor in ready:
                    event = recv_monitor_message(self._monitor)["event"]
                    if event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED):
                        closed_at = closed_at if closed_at is not None else time.monotonic()
                    else:
                        closed_at = None
                        self.handshaken.set()
                        if self._name is not None:  # each (re)connection says who
                            self._socket.send(_HELLO + b" " + self._name, zmq.NOBLOCK)
                if closed_at is not None and self._on_head_gone is not None and \
                        time.monotonic() - closed_at > HEAD_GONE_S:
                    log.warning("the head's connection closed %.0fs ago and was not made again: the head is gone",
                                time.monotonic() - closed_at)
                    self._on_head_gone()
                    self._on_head_gone = None
                if self._socket in ready and self._socket.recv_multipart() == [_BYE] and \
                        self._on_head_gone is not None:  # the head said it closes: no reconnection to wait for
                    log.info("the head closes")
                    self._on_head_gone()
                    self._on_head_gone = None
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:  # the context is ending (its runtime closed before this watch):
                    return                  # it waits for these sockets, which _serve closes
                if self._stop.is_set():
                    return
                log.debug("liveness: %s", exc)
                time.sleep(_POLL_MS / 1000)
