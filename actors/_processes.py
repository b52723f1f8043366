"""One process per hosted actor: what a job's code does stays inside that job.

A worker node hosts each actor the head asks for (a stage, a model inspector) in a
process of its own, so that a job's factory, loss or model that exits, crashes in
native code, hangs holding the interpreter, or changes a process-wide setting
(``torch.set_num_threads``, seeds, the allocator) reaches no other job and not the
node, which keeps heartbeating and serving. A stage actor's process stops when it
is told to, and when its node goes, however the node goes.

The processes are forked from a *zygote*: a copy of the node made at start-up, once
torch and the actor classes are imported and before any thread, socket or GPU
context exists, which does nothing but fork. A hosted actor therefore starts in
milliseconds with everything imported, and inherits nothing a running node holds.

    node  --(seqpacket: spawn + the child's channel fd, kill)-->  zygote
    node  <--(seqpacket: pid, exit status)--------------------  zygote
    node  <--(stream, per actor: request, ready/failed, stop)--> hosted actor

Nothing here crosses a network: the channels are socket pairs between processes of
one user, and carry msgpack and the wire format (:mod:`transport.wire`), never pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import importlib
import itertools
import logging
import os
import signal
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from actors._actor import endpoint_table
from actors._context import NodeContext
from actors._errors import ActorLost, UnknownActor, error_from_wire, error_to_wire
from actors._forking import ForkLoop
from actors._registry import actor_class, registered_actors
from actors._runtime import open_runtime
from actors.plugins import load_plugin
from transport.addresses import Address
from transport.loop import run
from transport.wire import decode_message, encode_message

__all__ = ["ActorProcesses", "HostConfig", "describe_exit", "preloader", "start_zygote"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_LENGTH = struct.Struct("!I")
_MAX_CONTROL_BYTES = 64 * 1024  # a message between node and zygote (a pid, an exit status)
# A hosted actor told to stop that has not exited by then is killed: its job is closing, and
# nothing it holds needs more than closing its groups (a job's code that spins never would).
STOP_GRACE_S = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HostConfig:
    """How a hosted actor's runtime listens and speaks: the node's own settings (keys included)."""

    bind: str
    allow_remote: bool = False
    max_message_bytes: int
    security: dict[str, Any] = field(default_factory=dict)  # open_runtime's keys and ring; {} without keys
    device: str = "cpu"
    node: str = ""
    # Imports the zygote makes once, before it forks its first actor's process (the worker plugin's
    # ``preload`` and the node's ``--preload`` modules, see preloader: what each stage would otherwise
    # import itself, seconds each).
    preload: Callable[[], None] | None = None


def preloader(plugin: Callable[[], None] | None, modules: Sequence[str]) -> Callable[[], None] | None:
    """What the zygote runs once, before it forks its first actor's process: the worker plugin's
    ``preload``, then each of ``modules`` imported (a node's ``--preload``; gunicorn's preload, for
    the same reason). Every actor forked later starts with them imported: a Hugging Face model's
    stage, for one, spends about a second of CPU importing ``transformers.modeling_utils`` otherwise.

    A module that fails to import is logged and skipped (each actor imports what it needs itself,
    and says so if it cannot). A module whose import starts a thread is named in a warning: a
    thread does not survive a fork, and a lock it held stays held in every child.
    """
    if not modules:
        return plugin
    names = tuple(modules)

    def preload() -> None:
        if plugin is not None:
            plugin()
        for name in names:
            before = _thread_count()
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001  (a node serves on; the actor that needs it reports it)
                log.exception("--preload %s failed; each actor that needs it imports it itself", name)
                continue
            if _thread_count() > before:
                log.warning("--preload %s started a thread in the zygote; the actors forked from it do not have "
                            "that thread, and a lock it held stays held in them: preload modules that start none",
                            name)
    return preload


def _thread_count() -> int:
    """This process's threads as Linux counts them (native ones too); Python's own elsewhere."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def describe_exit(status: int) -> str:
    """``exited with code 3`` or ``killed by SIGSEGV`` for a wait status."""
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _die_with_parent() -> None:
    """Asks Linux to SIGKILL this process when the process that forked it ends (however it ends)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# -- the zygote (blocking: it forks and reaps, nothing else) --------------------------------


def start_zygote(config: HostConfig) -> socket.socket:
    """Forks the zygote; returns the node's end of its control channel.

    Call it before anything starts a thread, opens a ZeroMQ context or touches a GPU:
    every hosted actor is a copy of this process as it is now.
    """
    node_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # the zygote
        code = 1
        try:
            node_end.close()
            _die_with_parent()
            _zygote(zygote_end, config)
            code = 0
        except BaseException:  # noqa: BLE001  (nothing may return into the node's stack)
            log.exception("the actor zygote failed")
        finally:
            os._exit(code)
    zygote_end.close()
    node_end.setblocking(False)
    return node_end


def _zygote(channel: socket.socket, config: HostConfig) -> None:
    # The node's loop is not this process's: forget it, its signal handlers and its wake-up fd.
    asyncio.events._set_running_loop(None)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the node's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    loop = ForkLoop(channel, _MAX_CONTROL_BYTES)
    preload: Callable[[], None] | None = config.preload  # at the first spawn: a node that hosts nothing never pays
    tables_made = False
    try:
        # Until the node closes its end: it stops (its actors were stopped first).
        for message, fds in loop.requests():
            if message.get("op") == "spawn" and fds:
                if preload is not None:
                    run_preload, preload = preload, None
                    try:
                        run_preload()
                    except Exception:  # noqa: BLE001  (each actor imports what it needs itself, later)
                        log.exception("the actor zygote's preload failed")
                if not tables_made:  # each hosted class's endpoint table, made once here rather than in every child
                    tables_made = True
                    for class_name in registered_actors():
                        endpoint_table(actor_class(class_name))
                # What exists now is never collected in a child: a collection there would touch, and so
                # copy, every page of it (gc.collect() as a stage stops took most of a second).
                gc.freeze()
                if loop.fork(message) == 0:
                    _hosted_process(fds[0], config)  # never returns
                os.close(fds[0])
            elif message.get("op") == "kill" and message.get("pid") in loop.children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(message["pid"], signal.SIGKILL)
            else:
                for fd in fds:
                    os.close(fd)
    finally:
        loop.stop(signal.SIGKILL)


# -- a hosted actor's process -----------------------------------------------------------------


def _hosted_process(fd: int, config: HostConfig) -> None:
    """The life of one hosted actor's process; leaves with ``os._exit``, never by returning."""
    code = 70
    try:
        _die_with_parent()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        code = run(_host(socket.socket(fileno=fd), config))
    except BaseException:  # noqa: BLE001  (a job's code gone wrong: this process ends, nothing else)
        log.exception("a hosted actor's process failed")
    finally:
        logging.shutdown()
        os._exit(code)


async def _read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """One length-prefixed frame, or None at the end of the stream."""
    try:
        head = await reader.readexactly(_LENGTH.size)
        return await reader.readexactly(_LENGTH.unpack(head)[0])
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def _frame(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data


def _join_frames(frames: list[bytes]) -> bytes:
    """A wire message's frames as one frame: their count, their sizes, then their bytes."""
    return struct.pack(f"!{len(frames) + 1}I", len(frames), *(len(f) for f in frames)) + b"".join(frames)


def _split_frames(data: bytes) -> list[bytes]:
    (count,) = struct.unpack_from("!I", data)
    sizes = struct.unpack_from(f"!{count}I", data, _LENGTH.size)
    offset, frames = _LENGTH.size * (count + 1), []
    for size in sizes:
        frames.append(data[offset:offset + size])
        offset += size
    return frames


async def _host(sock: socket.socket, config: HostConfig) -> int:
    reader, writer = await asyncio.open_connection(sock=sock)
    request = await _read_frame(reader)
    if request is None:
        return 0
    spec = decode_message(_split_frames(request), max_bytes=config.max_message_bytes)
    name = spec["name"]
    worker = load_plugin("worker")  # pins this process to the node's device (the zygote touched no GPU)
    if worker is not None:
        worker.start(config.device)
    async with open_runtime(_child_bind(config.bind), allow_remote=config.allow_remote,
                            max_message_bytes=config.max_message_bytes, **config.security) as runtime:
        try:
            actor = actor_class(spec["class_name"])(**spec["kwargs"])
            actor.node_context = NodeContext(name=config.node, device=config.device, allow_list=list(spec["allow"]))
            await runtime.spawn(actor, name)
        except BaseException as exc:  # noqa: BLE001  (SystemExit and the like come back as errors too)
            writer.write(_frame(msgpack.packb({"failed": error_to_wire(exc)})))
            await writer.drain()
            return 0
        writer.write(_frame(msgpack.packb({"ready": runtime.address})))
        await writer.drain()
        while True:  # until the node says stop, or goes
            data = await _read_frame(reader)
            if data is None:
                return 0
            if msgpack.unpackb(data).get("op") == "stop":
                await runtime.stop_actor(name)
                return 0


def _child_bind(bind: str) -> str:
    """The node's bind address with any fixed port made ephemeral (the node holds that one); a node
    bound at ``ipc://PATH`` puts its children beside it (``PATH.PID``), where its cluster cleans up."""
    where = Address.parse(bind)
    if where.is_tcp:
        return where.on_port(0)
    if bind != "ipc://":
        return f"{bind}.{os.getpid()}"
    return "ipc://"


# -- the node's side ------------------------------------------------------------------------


@dataclass(slots=True)
class _Hosted:
    name: str
    pid: int
    address: str = ""
    writer: asyncio.StreamWriter | None = None
    stopping: bool = False
    exited: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class ActorProcesses:
    """The node's hosted actors, one process each, forked by the zygote.

    Args:
        channel: the node's end of the zygote's channel (:func:`start_zygote`).
        on_lost: called with (actor name, its address, what happened) when a hosted
            actor's process ends without being told to stop.
    """

    def __init__(self, channel: socket.socket, on_lost: Callable[[str, str, str], None] | None = None) -> None:
        self._channel = channel
        self.on_lost = on_lost
        self._ids = itertools.count(1)
        self._pids: dict[int, asyncio.Future[int]] = {}
        self._by_pid: dict[int, _Hosted] = {}
        self._actors: dict[str, _Hosted] = {}
        self._early_exits: dict[int, int] = {}  # pid -> status, for an exit reported before its pid was used
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        asyncio.get_running_loop().add_reader(channel.fileno(), self._on_zygote)

    def pids(self) -> dict[str, int]:
        """The hosted actors that run, by name, with their process ids."""
        return {name: hosted.pid for name, hosted in self._actors.items() if hosted.address}

    def addresses(self) -> list[str]:
        return [hosted.address for hosted in self._actors.values() if hosted.address]

    async def spawn(self, class_name: str, name: str, kwargs: dict[str, Any], allow: list[str], *,
                    max_message_bytes: int) -> str:
        """Starts actor ``class_name`` as ``name`` in a process of its own; returns its runtime's address.

        Raises:
            ValueError: a hosted actor already has the name.
            ActorLost: its process ended before the actor started (a crash in a factory).
            Exception: what the actor's ``on_start`` raised, rebuilt from the wire.
        """
        if self._closed:
            raise ActorLost("this node is stopping")
        if name in self._actors:
            raise ValueError(f"an actor named {name!r} already runs on this node")
        frames = [bytes(memoryview(f)) for f in encode_message(
            {"class_name": class_name, "name": name, "kwargs": kwargs, "allow": list(allow)},
            max_bytes=max_message_bytes)]
        ours, theirs = socket.socketpair()
        call_id = next(self._ids)
        loop = asyncio.get_running_loop()
        waiting: asyncio.Future[int] = loop.create_future()
        self._pids[call_id] = waiting
        try:
            socket.send_fds(self._channel, [msgpack.packb({"op": "spawn", "id": call_id})], [theirs.fileno()])
            theirs.close()
            pid = await waiting
        except OSError as exc:  # the zygote is gone
            theirs.close()
            ours.close()
            raise ActorLost(f"this node cannot start {name}: its process launcher is gone ({exc})") from None
        except BaseException:
            theirs.close()
            ours.close()  # a child forked meanwhile reads no request, and ends
            raise
        finally:
            self._pids.pop(call_id, None)
        hosted = _Hosted(name=name, pid=pid)
        self._actors[name] = hosted
        if pid in self._early_exits:
            hosted.exited.set_result(self._early_exits.pop(pid))
        else:
            self._by_pid[pid] = hosted
        try:
            reader, writer = await asyncio.open_connection(sock=ours)
            hosted.writer = writer
            writer.write(_frame(_join_frames(frames)))
            await writer.drain()
            reply = await _read_frame(reader)
            if reply is None:
                status = await hosted.exited
                raise ActorLost(f"{name}'s process {describe_exit(status)} while the actor started",
                                details={"actor": name, "pid": pid})
            answer = msgpack.unpackb(reply)
            if "failed" in answer:
                raise error_from_wire(answer["failed"])
            hosted.address = str(answer["ready"])
        except BaseException:
            self._actors.pop(name, None)
            hosted.stopping = True
            self._kill(hosted)
            raise
        task = loop.create_task(self._watch(hosted), name=f"watch {name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return hosted.address

    async def stop(self, name: str, grace: float = STOP_GRACE_S) -> None:
        """Stops hosted actor ``name`` (its ``on_stop`` runs) and waits for its process to end;
        kills it after ``grace`` seconds (a job's code that holds on).

        Raises:
            UnknownActor: no hosted actor has the name.
        """
        hosted = self._actors.pop(name, None)
        if hosted is None:
            raise UnknownActor(f"no actor named {name!r} on this node")
        hosted.stopping = True
        if hosted.writer is not None and not hosted.writer.is_closing():
            with contextlib.suppress(ConnectionError, OSError):
                hosted.writer.write(_frame(msgpack.packb({"op": "stop"})))
                await hosted.writer.drain()
        try:
            await asyncio.wait_for(asyncio.shield(hosted.exited), grace)
        except TimeoutError:
            log.warning("%s did not stop within %.0fs; killing its process %d", name, grace, hosted.pid)
            self._kill(hosted)
            await hosted.exited

    async def aclose(self) -> None:
        """Stops every hosted actor, then the zygote."""
        self._closed = True
        await asyncio.gather(*(self.stop(name) for name in list(self._actors)), return_exceptions=True)
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self._channel.fileno())
        self._channel.close()

    def _kill(self, hosted: _Hosted) -> None:
        if not hosted.exited.done():
            with contextlib.suppress(OSError):
                self._channel.send(msgpack.packb({"op": "kill", "pid": hosted.pid}))

    async def _watch(self, hosted: _Hosted) -> None:
        status = await hosted.exited
        if hosted.writer is not None:
            hosted.writer.close()
        if hosted.stopping:
            return
        self._actors.pop(hosted.name, None)
        what = describe_exit(status)
        log.warning("%s's process (%d) %s", hosted.name, hosted.pid, what)
        if self.on_lost is not None:
            self.on_lost(hosted.name, hosted.address, what)

    def _on_zygote(self) -> None:
        while True:
            try:
                data = self._channel.recv(_MAX_CONTROL_BYTES)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the zygote is gone: nothing more can start here
                asyncio.get_running_loop().remove_reader(self._channel.fileno())
                error = ActorLost("this node's process launcher (its zygote) ended")
                for waiting in self._pids.values():
                    if not waiting.done():
                        waiting.set_exception(error)
                return
            message = msgpack.unpackb(data)
            if message.get("op") == "pid":
                asked = self._pids.get(message.get("id"))
                if asked is not None and not asked.done():
                    asked.set_result(int(message["pid"]))
            elif message.get("op") == "exited":
                pid, status = int(message["pid"]), int(message["status"])
                hosted = self._by_pid.pop(pid, None)
                if hosted is None:
                    self._early_exits[pid] = status
                elif not hosted.exited.done():
                    hosted.exited.set_result(status)

