"""The life of a node process: open a runtime, host the head or node actor, stop on a signal."""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from actors._errors import ActorError
from actors._liveness import LivenessClient
from actors._reach import HeadUnreachable, check_can_answer, check_head_address, check_security_matches, why_no_answer
from actors._ref import ActorRef
from actors._nodes import HEAD, NODE, HeadActor, HeartbeatSettings, NodeActor, NodeInfo, node_info
from actors._registry import registered_actors
from actors.plugins import load_plugin
from actors._processes import ActorProcesses, HostConfig, preloader, start_zygote
from actors._runtime import open_runtime
from transport.wire import DEFAULT_MAX_MESSAGE_BYTES
from actors.keys import ClusterKeys
from transport.channel import BulkMode
from transport.security import join_address, shown, split_address

__all__ = ["ADMIT_TOKEN_ENV", "HeadConfig", "WorkerConfig", "serve_head", "serve_worker"]

log = logging.getLogger(__name__)


ADMIT_TOKEN_ENV = "ACTORPIPE_ADMIT_TOKEN"
ENCRYPTION_ENV = "ACTORPIPE_ENCRYPTION"


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadConfig:
    bind: str
    allow_remote: bool = False
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 2.0
    address_file: str | None = None
    allow: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()
    keys: str | None = None  # the cluster's key directory (made on first start); None: --insecure
    identity: str = "head"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # the largest message sent or taken (--max-message-bytes)
    limits: tuple[str, ...] = ()  # the operator's NAME=VALUE limits on jobs and clients (--limit), for the scheduler
    # Where clients' checkpoints go, each key in its own subtree (--checkpoint-root); relative: to the
    # working directory. The scheduler actor, which the head hosts, is built with it.
    checkpoint_root: str = "checkpoints"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    join: str  # the head's address; "" with join_file
    name: str
    # Or a file the head writes its address to (--join-file): the worker starts beside the head and
    # waits (up to head_timeout) for the file, so both import at once (a LocalCluster's nodes do).
    join_file: str | None = None
    device: str = "cpu"
    bind: str = "tcp://127.0.0.1:0"
    allow_remote: bool = False
    allow: tuple[str, ...] = ()
    head_timeout: float = 30.0
    keys: str | None = None  # the cluster's key directory; None: --insecure
    identity: str = "node"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # the largest message sent or taken (--max-message-bytes)
    # "process": each actor the head asks for runs in a process of its own, forked from a zygote
    # (a job's code that exits, crashes or hangs stays in its job: actors._processes); "thread":
    # in this process, as one job's node would (--isolation).
    isolation: str = "process"
    # A launcher's rank (actors.launchers): the head goes with the script's rank 0, so the node stops
    # once its liveness connection to the head has been closed for a few seconds, not after head_timeout.
    exit_with_head: bool = False
    # Modules imported once before the first hosted actor starts, so that every actor's process
    # starts with them (--preload; see actors._processes.preloader).
    preload: tuple[str, ...] = ()


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _write_atomically(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".addr-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def security(directory: str | None, identity: str, *, create: bool = False) -> dict[str, Any]:
    """``open_runtime`` keyword arguments for a member with ``identity`` in the key directory.

    Raises:
        KeyFileError: the directory is missing (and not to be made), unsafe, or lacks the key.
    """
    if directory is None:
        log.warning("running WITHOUT keys (--insecure): every peer that can reach this node's address may "
                    "use it; keep it on loopback or a trusted network")
        return {}
    keys = ClusterKeys.create(directory) if create else ClusterKeys(directory)
    return {"keys": keys.identity(identity), "ring": keys.ring, "bulk": bulk_mode()}


def bulk_mode() -> BulkMode:
    """How this process sends to other members: ``$ACTORPIPE_ENCRYPTION`` ``on`` (the default) or ``off``.

    Off, messages (activations, gradients, every call) travel authenticated but in the
    clear: for a trusted network only, and said in the log.

    Raises:
        ValueError: another value.
    """
    setting = os.environ.get(ENCRYPTION_ENV, "on").strip().lower()
    if setting not in ("on", "off"):
        raise ValueError(f"${ENCRYPTION_ENV} is {setting!r}: on (the default) or off")
    if setting == "on":
        return "encrypt"
    log.warning("%s=off: messages to other members travel in the CLEAR (authenticated, not encrypted); "
                "use this on a trusted network only", ENCRYPTION_ENV)
    return "authenticate"


def head_address(address: str, directory: str | None) -> str:
    """``--join ADDRESS`` completed with the head's public key from the key directory, when it has none."""
    if directory is None or split_address(address)[1] is not None:
        return address
    return join_address(address, ClusterKeys(directory).head_public())


async def serve_head(config: HeadConfig) -> None:
    """Runs the head node until SIGINT or SIGTERM.

    Raises:
        KeyFileError: the key directory (or a secret key in it) is open to other users;
            checked first, before anything listens.
    """
    secure = security(config.keys, config.identity, create=True)
    stop = _stop_on_signals()
    async with open_runtime(config.bind, allow_remote=config.allow_remote, max_message_bytes=config.max_message_bytes,
                            **secure) as runtime:
        head = HeadActor(heartbeat_interval=config.heartbeat_interval, heartbeat_timeout=config.heartbeat_timeout)
        await runtime.spawn(head, HEAD)
        # The head is also a node of sorts: its agent spawns the actors it hosts (the
        # scheduler, from a plugin module) with the head's own allow-list.
        agent = NodeActor(node_info("head", runtime.address, "cpu"), config.allow, stop,
                          os.environ.pop(ADMIT_TOKEN_ENV, ""))
        await runtime.spawn(agent, NODE)
        for module in config.plugins:
            importlib.import_module(module)
        if "scheduler" in registered_actors():
            await agent.spawn("scheduler", "scheduler", {"checkpoint_root": os.path.abspath(config.checkpoint_root),
                                                         "limits": list(config.limits)})
        else:
            log.warning("no scheduler on this head (plugins: %s): jobs cannot be created; install the "
                        "project (pip install -e .) so its 'head' entry point is found, or pass --plugin MODULE",
                        ", ".join(config.plugins) or "none")
        log.info("head listening at %s", runtime.address)
        print(f"actorpipe head listening at {runtime.address}", flush=True)
        if config.address_file:
            _write_atomically(config.address_file, runtime.address)
        await stop.wait()
        log.info("head stopping")


async def _read_join_file(path: str | None, timeout: float, stop: asyncio.Event) -> str:
    """The head's address from ``path`` once the head has written it ("" if stopped meanwhile).

    Raises:
        TimeoutError: no address within ``timeout`` seconds.
    """
    if not path:
        raise ValueError("a worker needs the head's address (--join) or the file it is written to (--join-file)")
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        try:
            with open(path) as f:
                address = f.read().strip()
            if address:  # the head writes it atomically: whole or not at all
                return address
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the head wrote no address to {path} within {timeout}s")
        await asyncio.sleep(0.02)
    return ""


async def serve_worker(config: WorkerConfig) -> None:
    """Runs a worker node: registers, heartbeats, and serves until told to stop.

    Raises:
        KeyFileError: the key directory is missing, lacks the key, or is open to other
            users; checked first, before anything is imported or listens.
        TimeoutError: the head could not be reached for ``head_timeout`` seconds.
        ValueError: ``device`` is not ``cpu`` or a GPU this process sees.
    """
    secure = security(config.keys, config.identity)
    # Before the runtime: the installed worker plugin registers the actors this node
    # hosts and pins this thread to the node's device.
    worker = load_plugin("worker")
    if config.isolation not in ("process", "thread"):
        raise ValueError(f"isolation is 'process' or 'thread', not {config.isolation!r}")
    # The zygote is forked now: everything is imported, and no thread, socket or GPU context exists yet.
    zygote = start_zygote(HostConfig(bind=config.bind, allow_remote=config.allow_remote,
                                     max_message_bytes=config.max_message_bytes, security=secure,
                                     device=config.device, node=config.name,
                                     preload=preloader(getattr(worker, "preload", None), config.preload)),
                          ) if config.isolation == "process" else None
    if zygote is None and (imports := preloader(None, config.preload)) is not None:
        imports()  # the actors run in this process: it imports them itself
    if worker is not None:
        worker.start(config.device)
    stop = _stop_on_signals()
    async with open_runtime(config.bind, allow_remote=config.allow_remote, max_message_bytes=config.max_message_bytes,
                            **secure) as runtime:
        info = node_info(config.name, runtime.address, config.device)
        agent = NodeActor(info, config.allow, stop, os.environ.pop(ADMIT_TOKEN_ENV, ""),
                          processes=ActorProcesses(zygote) if zygote is not None else None,
                          max_message_bytes=config.max_message_bytes)
        await runtime.spawn(agent, NODE)
        join = config.join or await _read_join_file(config.join_file, config.head_timeout, stop)
        if not join:
            return
        check_head_address(join)
        check_security_matches(join, config.keys is not None,
                               "start this node with --keys DIR (the cluster's key directory), not --insecure")
        await asyncio.to_thread(  # it may resolve the head's name: off the loop
            check_can_answer, join, runtime.address, "start this node with --bind tcp://ADDRESS:0 (an address of "
            "this machine the head reaches, or tcp://0.0.0.0:0) and --allow-remote")
        head = runtime.ref(head_address(join, config.keys), HEAD)
        settings = await _register(head, info, config.head_timeout, stop, secure=config.keys is not None)
        if settings is None:
            return
        agent.head = head
        liveness = _Liveness(runtime, config.name, _stopper(stop) if config.exit_with_head else None)
        liveness.renew(settings)
        runtime.spawn_task(_heartbeat(head, config, agent, liveness, settings.interval, stop), name="heartbeat")
        try:
            await stop.wait()
            log.info("node stopping")
            try:  # first: a node that says it leaves is not lost when its liveness connection then closes
                await head.endpoint(HeadActor.deregister, timeout=1.0).call(config.name)
            except (ActorError, OSError):
                pass
        finally:
            liveness.close()


async def _register(
    head: ActorRef, info: NodeInfo, head_timeout: float, stop: asyncio.Event, *, secure: bool
) -> HeartbeatSettings | None:
    """Registers with the head, retrying while it does not answer (it may be starting).

    Raises:
        HeadUnreachable: no answer for ``head_timeout`` seconds; says what a look at the address found.
    """
    deadline = time.monotonic() + head_timeout
    while not stop.is_set():
        try:
            settings = await head.endpoint(HeadActor.register, timeout=1.0).call(info)
            log.info("registered with the head at %s", head.address)
            return settings
        except ActorError as exc:
            if not isinstance(exc, TimeoutError):
                raise
            if time.monotonic() > deadline:
                why = await asyncio.to_thread(why_no_answer, head.address, secure, info.address)
                raise HeadUnreachable(f"the head at {shown(head.address)} did not answer this node "
                                   f"within {head_timeout:g}s: {why}") from None
            log.info("head at %s not answering yet; retrying", head.address)
    return None


class _Liveness:
    """The worker's liveness connection to the head (:mod:`actors._liveness`), made anew at each registration."""

    def __init__(self, runtime: Any, name: str, on_head_gone: Callable[[], None] | None = None) -> None:
        self._runtime = runtime
        self._name = name
        self._on_head_gone = on_head_gone
        self._client: LivenessClient | None = None

    def renew(self, settings: HeartbeatSettings) -> None:
        self.close()
        if settings.liveness:
            endpoint, server_public = split_address(settings.liveness)
            self._client = LivenessClient(self._runtime.context, endpoint, self._name, self._runtime.keys,
                                          server_public, self._on_head_gone)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _stopper(stop: asyncio.Event) -> Callable[[], None]:
    """Sets ``stop`` from another thread (the liveness client's), on the running loop."""
    loop = asyncio.get_running_loop()

    def gone() -> None:
        log.warning("a launched node stops with its head")
        loop.call_soon_threadsafe(stop.set)

    return gone


async def _heartbeat(
    head: ActorRef, config: WorkerConfig, agent: NodeActor, liveness: _Liveness, interval: float, stop: asyncio.Event
) -> None:
    last_ok = time.monotonic()
    while True:
        try:
            known = await head.endpoint(HeadActor.heartbeat, timeout=max(interval, 1.0)).call(config.name)
            last_ok = time.monotonic()
            if not known:
                log.warning("the head forgot this node (or declared it lost); registering again")
                settings = await head.endpoint(HeadActor.register, timeout=1.0).call(agent.info)
                interval = settings.interval
                liveness.renew(settings)
                await agent.tell_head_hosting()
        except ActorError as exc:
            if time.monotonic() - last_ok > config.head_timeout:
                log.error("head unreachable for %.0fs (%s); stopping", config.head_timeout, exc)
                stop.set()
                return
        await asyncio.sleep(interval)
