"""The driver's view of a cluster: ``Cluster.connect`` to a running head, or ``LocalCluster``.

This is the generic part (nodes, spawning actors, events). The job API (``train``,
``jobs``) is added by the installed ``cluster`` plugin (see :mod:`actors.plugins`):
``Cluster.connect`` and ``LocalCluster`` build their connection as that subclass.

Example::

    from actors.probe import ProbeActor

    async with LocalCluster(nodes=2) as cluster:
        ref = await cluster.spawn("node0", "probe", "p")
        assert await ref.endpoint(ProbeActor.echo).call(42) == 42
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Coroutine, Generator, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from actors import launchers
from actors._forkserver import ForkedProcess, fork_server
from actors._errors import ActorError, ActorStopped, ActorTimeout, HeadLost, NotAllowed
from actors._liveness import HEAD_GONE_S, LivenessClient, check_silence
from actors._reach import HeadUnreachable, check_can_answer, check_head_address, check_security_matches, why_no_answer
from actors._nodes import HEAD, NODE, SILENT_TIMEOUT_S, HeadActor, NodeActor, NodeInfo
from actors._subscribers import EventSink
from actors.events import Event
from actors._serve import ADMIT_TOKEN_ENV, head_address, security
from actors.devices import DeviceSpec, node_devices, visible_gpu_count
from actors.keys import DEFAULT_KEYS, ClusterKeys
from actors._registry import EXAMPLE_FACTORIES
from actors._ref import ActorRef
from actors._runtime import Runtime, open_runtime
from actors.plugins import GROUP, load_plugin
from transport.security import shown, split_address
from transport.wire import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["Cluster", "LocalCluster"]

log = logging.getLogger(__name__)

# The longest close() waits for the driver's last words to the head (Cluster.last_word).
LAST_WORDS_S = 5.0

NodeProcess = subprocess.Popen[bytes] | ForkedProcess  # a LocalCluster's head or node, started either way

C = TypeVar("C", bound="Cluster")


# What Cluster.events() is woken with when no event will come any more.
_NO_MORE_EVENTS: Event = Event()


class Cluster:
    """A driver's connection to a head node; close it with ``close()`` or ``async with``."""

    def __init__(self, runtime: Runtime, head: ActorRef, stack: contextlib.AsyncExitStack) -> None:
        self.runtime = runtime
        self.head = head
        self._stack = stack
        self._events: asyncio.Queue[Event] | None = None
        self._sinks: dict[str, ActorRef] = {}  # subscribed, by name: unsubscribed on close
        self._admit_token = ""  # set by LocalCluster, which may admit a job's factories
        self.head_lost: HeadLost | None = None  # set once the head is gone (see watch_head)
        self.head_process: NodeProcess | None = None  # LocalCluster's head: watched directly
        self._last_words: set[asyncio.Task[Any]] = set()  # calls close() lets finish (see last_word)

    # A LocalCluster's head process is looked at this often (its exit is known at the next look).
    PROCESS_POLL_S = 0.25

    async def watch_head(self, silent_timeout: float = SILENT_TIMEOUT_S) -> None:
        """Starts watching the head: once it is lost every pending and later call to it
        fails with :class:`~actors.HeadLost` instead of waiting out its timeout.

        Busy is not dead: the watch is a connection of its own to the head's socket whose
        heartbeats both ends' libzmq threads answer (:class:`actors._liveness.LivenessClient`),
        so a head whose loop is busy (gathering a large ``state_dict``, a saturated machine)
        is never lost. A head process that ends closes the connection, known within
        :data:`~actors._liveness.HEAD_GONE_S` (a ``LocalCluster``'s at once, from the process);
        one that is alive but answers no heartbeat (stopped, cut off) is lost after
        ``silent_timeout`` seconds and that. Returns once the watch's first handshake is done (heartbeats
        start there), or ``silent_timeout`` passed without it (the watch then loses the head).
        """
        loop = asyncio.get_running_loop()

        def gone() -> None:
            loop.call_soon_threadsafe(self._lose_head, f"its connection closed (its process ended, or it answered "
                                      f"no heartbeat for {silent_timeout:g}s) and was not made again within "
                                      f"{HEAD_GONE_S:g}s")

        endpoint, server_public = split_address(self.head.address)
        watch = LivenessClient(self.runtime.context, endpoint, "", self.runtime.keys, server_public, gone,
                               silent_timeout=silent_timeout)
        self._stack.callback(watch.close)
        await asyncio.to_thread(watch.handshaken.wait, silent_timeout)

    def watch_process(self, process: NodeProcess) -> None:
        """A ``LocalCluster``'s head process: its exit loses the head at the next look."""
        self.head_process = process
        self.runtime.spawn_task(self._watch_process(process), name="head process watch")

    async def _watch_process(self, process: NodeProcess) -> None:
        while self.head_lost is None:
            await asyncio.sleep(self.PROCESS_POLL_S)
            if process.poll() is not None:
                self._lose_head(f"its process exited with {process.returncode}")

    def _lose_head(self, why: str) -> None:
        if self.head_lost is not None:
            return
        self.head_lost = HeadLost(f"lost the head at {shown(self.head.address)}: {why}")
        log.warning("%s", self.head_lost)
        self.runtime.fail_calls_to(self.head.address, self.head_lost)
        self._end_events()

    def _end_events(self) -> None:
        """Wakes :meth:`events` for good: the head is lost (it raises that) or this connection closed (it ends)."""
        if self._events is not None:
            if self._events.full():
                self._events.get_nowait()
            self._events.put_nowait(_NO_MORE_EVENTS)

    def check_head(self) -> None:
        """Raises at once what a call to the head would meet: :class:`~actors.HeadLost` when the head is
        known to be gone, :class:`~actors.ActorStopped` when this connection was closed."""
        if self.head_lost is not None:
            raise HeadLost(self.head_lost.message)
        if self.runtime.closed:
            raise ActorStopped("this connection to the cluster is closed (cluster.close(), or the end of its "
                               "async with), and nothing reaches the head from it any more: a LocalCluster's "
                               "jobs ended with it; on a cluster started by hand they go on, and "
                               "Cluster.connect reaches them again")

    async def admit(self, modules: Iterable[str]) -> None:
        """Lets every live node (and the head) import factories from ``modules``.

        Only a :class:`LocalCluster`'s own connection can: it holds the token its nodes
        were started with. On a cluster started by hand this does nothing; start its
        nodes with ``--allow PREFIX`` instead. A node that joined a LocalCluster by hand
        holds no token and refuses: it keeps the allow-list it was started with, so a
        job placed there builds whatever that list admits (and fails with
        :class:`~actors.NotAllowed` naming the factory otherwise).
        """
        if not self._admit_token:
            return
        prefixes = sorted(set(module_names(modules, "modules")))
        nodes = [n for n in await self.nodes() if n.alive]
        agents = [self.node_ref(n) for n in nodes] + [self.runtime.ref(self.head.address, NODE)]
        answers = await asyncio.gather(*(agent.endpoint(NodeActor.admit, timeout=30).call(self._admit_token, prefixes)
                                         for agent in agents), return_exceptions=True)
        for agent, answer in zip(agents, answers):
            if isinstance(answer, NotAllowed):
                log.info("%s keeps its own allow-list: %s", agent.address, answer.message)
            elif isinstance(answer, BaseException):
                raise answer

    @classmethod
    def connect(
        cls: type[C], address: str | None = None, *, bind: str = "tcp://127.0.0.1:0", allow_remote: bool = False,
        timeout: float = 10.0, keys: str | os.PathLike[str] | None = None, identity: str = "client",
        insecure: bool = False, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        head_timeout: float = SILENT_TIMEOUT_S,
    ) -> _Connecting[C]:
        """Attaches to the head at ``address``; use as ``await`` or ``async with``.

        Without ``address``, under torchrun, srun or a Kubernetes Indexed Job: the head the
        launcher's variables name (see :mod:`actors.launchers`).

        ``actors.Cluster.connect`` builds the installed plugin's subclass (with the job
        API); a subclass's ``connect`` builds that subclass.

        Args:
            bind: where this driver listens for replies; it must be reachable from the
                head (the default suits a head on this machine).
            allow_remote: permit a ``bind`` address that is not loopback.
            timeout: seconds to wait for the head to answer.
            keys: the cluster's key directory (default: ``$ACTORPIPE_KEYS`` or
                ``~/.config/actorpipe/keys``, as the head's).
            identity: which keypair in it this driver uses (``client``, ``admin``, or a
                name added with ``python -m actors.keys add``).
            insecure: connect without keys, to a head started with ``--insecure``.
            max_message_bytes: the largest message this driver sends or takes (the
                nodes' ``--max-message-bytes``; e.g. to gather a big ``state_dict``).
            head_timeout: seconds a head that is alive but answers no heartbeat (stopped, cut
                off) stays this driver's head; a busy head answers (its libzmq does), and one
                whose process ended is known within 3 s whatever this says (:meth:`watch_head`).

        Raises:
            HeadUnreachable: (an ``ActorTimeout``) the head did not answer within ``timeout``; the message says whether
                anything listens at ``address`` and, if something does, what to check (a head
                that does not admit this driver's key never answers: its handshake is refused).
            SecurityMismatch: (a ``ValueError``) ``insecure`` with an address that carries the head's public key.
            KeyFileError: the key directory is missing, unsafe, or lacks ``identity``.
        """
        target: type[C] = cluster_class() if cls is Cluster else cls  # type: ignore[assignment]
        if address is None:
            role = launchers.from_environment()
            if role is None:
                raise ValueError("connect() needs the head's address, or a launcher's variables that name it "
                                 "(torchrun, srun, a Kubernetes Indexed Job)")
            address = role.head_address
        directory = None if insecure else os.fspath(keys or os.environ.get("ACTORPIPE_KEYS", DEFAULT_KEYS))
        check_silence("head_timeout", head_timeout)  # inf hung: the watch's socket refused it, and was left open
        return _Connecting(target, address, bind, timeout, allow_remote, directory, identity, max_message_bytes,
                           head_timeout)

    async def nodes(self) -> list[NodeInfo]:
        """Every node the head knows: name, address, device, pid, host, memory, state.

        Raises:
            HeadLost: the head is known to be gone (at once, as every call to it: it waited out 10 s).
            ActorStopped: this connection is closed.
        """
        self.check_head()
        return await self.head.endpoint(HeadActor.nodes, timeout=10.0).call()

    async def wait_for_nodes(self, count: int, *, timeout: float = 60.0) -> list[NodeInfo]:
        """Waits until ``count`` nodes are alive; returns them."""
        deadline = time.monotonic() + timeout
        while True:
            alive = [n for n in await self.nodes() if n.alive]
            if len(alive) >= count:
                return alive
            if time.monotonic() > deadline:
                raise ActorTimeout(f"{len(alive)} of {count} nodes joined within {timeout}s")
            await asyncio.sleep(0.05)

    def node_ref(self, node: NodeInfo) -> ActorRef:
        """The node actor of a node listed by :meth:`nodes`."""
        return self.runtime.ref(node.address, NODE)

    async def spawn(self, node_name: str, class_name: str, actor_name: str, **kwargs: Any) -> ActorRef:
        """Starts a registered actor class on a node; returns a ref to it."""
        node = next((n for n in await self.nodes() if n.name == node_name and n.alive), None)
        if node is None:
            raise ValueError(f"no live node named {node_name!r}")
        address, name = await self.node_ref(node).endpoint(NodeActor.spawn, timeout=60.0).call(
            class_name, actor_name, kwargs)
        return self.runtime.ref(address, name)

    async def events(self) -> AsyncIterator[Event]:
        """Yields the head's events (:class:`~actors.NodeJoined`, ``NodeLeft``, ``NodeSilent``) from now on;
        ends when this connection closes.

        Raises:
            HeadLost: the head was lost (a loop over the events waited for ever).
            ActorStopped: the connection was closed before.
        """
        self.check_head()
        if self._events is None:
            queue: asyncio.Queue[Event] = asyncio.Queue(1024)

            def keep(event: Event) -> None:
                if queue.full():  # keep the newest: a driver that stopped reading lost only old news
                    queue.get_nowait()
                queue.put_nowait(event)

            self._events = queue
            sink = await self.runtime.spawn(EventSink(keep), "events")
            await Cluster.subscribe(self, sink)  # the head's node events only, whatever a subclass adds
        while True:
            event = await self._events.get()
            if event is _NO_MORE_EVENTS:
                self._end_events()  # for any other reader of the same events
                if self.head_lost is not None:
                    raise HeadLost(self.head_lost.message)
                return
            yield event

    async def subscribe(self, sink: ActorRef) -> None:
        """Sends the head's node events to ``sink``, an :class:`~actors.EventSink` in this connection's
        runtime (``await cluster.runtime.spawn(EventSink(handler), name)``), until :meth:`unsubscribe` or close.

        The head reaches a subscriber only at the address of the runtime that subscribed.

        Raises:
            ValueError: ``sink`` lives in another runtime.
            TooManySubscribers: this key holds as many subscriptions as the head takes from one key.
        """
        self.check_head()
        if sink.address != self.runtime.address:
            raise ValueError(f"subscribe takes an EventSink of this connection's runtime ({self.runtime.address}), "
                             f"not one at {sink.address}: the head sends events only to the runtime that subscribed")
        await self.head.endpoint(HeadActor.subscribe, timeout=10.0).call(sink.name)
        self._sinks[sink.name] = sink

    async def unsubscribe(self, sink: ActorRef) -> None:
        """Stops the events :meth:`subscribe` started."""
        self._sinks.pop(sink.name, None)
        await self.head.endpoint(HeadActor.unsubscribe, timeout=2.0).call(sink.name)

    def last_word(self, call: Coroutine[Any, Any, Any], *, name: str) -> None:
        """Sends ``call`` (to the head) from a task of its own, which :meth:`close` lets finish (for at most
        :data:`LAST_WORDS_S`): what a driver that gives up on a call tells the head (stop that step, end
        that job's creation) still reaches it when the driver is leaving (Ctrl-C ends the script)."""
        task = self.runtime.spawn_task(call, name=name)
        self._last_words.add(task)
        task.add_done_callback(self._last_words.discard)

    async def close(self) -> None:
        """Ends this connection's subscriptions (so its key's count drops at once) and closes its runtime,
        once the last words to the head are said (see :meth:`last_word`)."""
        if self.head_lost is None:
            if self._last_words:
                await asyncio.wait(set(self._last_words), timeout=LAST_WORDS_S)
            for sink in list(self._sinks.values()):
                with contextlib.suppress(ActorError):
                    await self.unsubscribe(sink)
        self._end_events()
        await self._stack.aclose()

    async def __aenter__(self) -> Cluster:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def cluster_class() -> type[Cluster]:
    """The class a driver's connection is built as: the installed ``cluster`` plugin's, or :class:`Cluster`."""
    cls = load_plugin("cluster")
    if cls is None:
        return Cluster
    if not (isinstance(cls, type) and issubclass(cls, Cluster)):
        raise TypeError(f"the {GROUP} 'cluster' plugin {cls!r} is not a subclass of actors.Cluster")
    return cls


class _Connecting(Generic[C]):
    """``Cluster.connect(...)``: awaitable, and an async context manager."""

    def __init__(self, cls: type[C], address: str, bind: str, timeout: float, allow_remote: bool,
                 keys: str | None, identity: str, max_message_bytes: int, head_timeout: float = SILENT_TIMEOUT_S) -> None:
        self._cls = cls
        self._head_timeout = head_timeout
        self._args = (address, bind, timeout)
        self._allow_remote = allow_remote
        self._keys = keys
        self._identity = identity
        self._max_message_bytes = max_message_bytes
        self._cluster: C | None = None

    async def _open(self) -> C:
        address, bind, timeout = self._args
        check_head_address(address)
        check_security_matches(address, self._keys is not None,
                               "connect with keys= (the cluster's key directory) and identity=, not insecure=True")
        await asyncio.to_thread(  # it may resolve the head's name: off the loop
            check_can_answer, address, bind, "connect with bind='tcp://ADDRESS:0' (an address of this machine the "
            "head reaches) and allow_remote=True (the console: --bind tcp://ADDRESS:0 --allow-remote)")
        secure = security(self._keys, self._identity)
        stack = contextlib.AsyncExitStack()
        try:
            runtime = await stack.enter_async_context(open_runtime(
                bind, allow_remote=self._allow_remote, max_message_bytes=self._max_message_bytes, **secure))
            head = runtime.ref(head_address(address, self._keys), HEAD)
            try:
                await head.endpoint(HeadActor.nodes, timeout=timeout).call()
            except ActorTimeout as exc:
                why = await asyncio.to_thread(why_no_answer, head.address, self._keys is not None, runtime.address)
                raise HeadUnreachable(f"{exc.message}: {why}") from None
        except BaseException:
            await stack.aclose()
            raise
        cluster = self._cls(runtime, head, stack)
        try:
            await cluster.watch_head(self._head_timeout)
        except BaseException:  # cancelled while the watch shook hands
            await stack.aclose()
            raise
        return cluster

    def __await__(self) -> Generator[Any, None, C]:
        return self._open().__await__()

    async def __aenter__(self) -> C:
        self._cluster = await self._open()
        return self._cluster

    async def __aexit__(self, *exc_info: object) -> None:
        if self._cluster is not None:
            await self._cluster.close()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM if the driver dies, so no node outlives it."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalCluster:
    """A head and ``nodes`` workers as subprocesses on this machine, for the life of a block.

    Args:
        nodes: how many worker nodes to start (``node0`` ...); by default one per
            visible GPU, or 2 on CPU (see ``devices``).
        spares: how many more to start as spares (``spare0`` ...): jobs are placed on
            the ``node`` ones first, and a job with ``max_restarts`` moves a lost stage
            to a free one.
        devices: where the nodes compute. ``"auto"``: one node per visible GPU
            (``cuda:0`` ... ``cuda:N-1``; ``nodes=K`` takes the first K, and more nodes
            than GPUs take them in turn), or ``nodes`` CPU nodes on a machine without
            one. ``"cpu"``: ``nodes`` CPU nodes. A list (``["cuda:0", "cuda:1"]``): one
            node per entry, each ``"cpu"`` or ``"cuda:K"``; a GPU named twice is shared
            on purpose. Spares continue the same turn. A GPU node is started with
            ``--device cuda:K`` and pins itself to that GPU. See :mod:`actors.devices`.
        allow: module prefixes the workers admit (``--allow``) besides torch's (``DEFAULT_ALLOW``):
            ``["mypkg", "other.models"]``, or one as a string.
        limits: the head's limits on jobs and clients by name (``--limit NAME=VALUE``; None lifts
            one): ``{"micro_batches": 1024, "jobs_per_client": 2}``; see ``schedulers.limits``.
        examples: admit the examples' factory modules too (``EXAMPLE_FACTORIES``: models, data and
            Hugging Face models, never the example scripts), for the demo.
        heartbeat_timeout: seconds a node that is alive but answers nothing (stopped, frozen, cut off)
            stays a member (see ``actors._liveness``); one whose process ends is lost at once.
        startup_timeout: seconds to wait for every node to register.
        log_level: the nodes' logging level (default WARNING: quiet).
        insecure: start every process without keys (``--insecure``); by default the
            cluster gets keys of its own in a private temporary directory: each node
            its own ``node`` key, the driver the ``admin`` key.
        max_message_bytes: the largest message any process of the cluster (head,
            nodes, driver) sends or takes; the default is 1 GiB.
        checkpoint_root: the head's ``--checkpoint-root``: the directory that client keys
            added to ``keys`` save under, each in its own subtree (``ROOT/alice``). By
            default a directory in the cluster's private temporary directory, removed
            with it on exit: pass one to keep those checkpoints. The driver holds the
            admin key and saves wherever it names.
        isolation: the workers' ``--isolation``: ``"process"`` (each stage actor in a process of
            its own, so that a job's code that exits, crashes or hangs stays in its job) or
            ``"thread"`` (every job's stages in their node's process).
        preload: modules every worker imports once, before its first stage starts (``--preload``),
            so that each stage's process starts with them: ``["transformers.modeling_utils"]``
            saves each Hugging Face stage about a second of start-up.
        fork_nodes: fork the head and the nodes from one process per driver that imported torch
            and the runtime once (:mod:`actors._forkserver`): a cluster starts in a fraction of a
            second after the first, instead of two seconds of imports per process. False: each
            is ``python -m actors.node`` (the default off Linux).

    Attributes:
        devices: each node's device by name (``{"node0": "cuda:0", ...}``), as started.
        keys: the cluster's :class:`~actors.keys.ClusterKeys` while it runs (None when
            insecure); ``Cluster.connect(address, keys=local.keys.directory)`` attaches
            another driver.
        checkpoint_root: the head's checkpoint root (absolute), once the cluster started
            (before, the one passed, or None).

    On exit, whether the block finished, raised or was cancelled (Ctrl-C), every
    process is stopped (SIGTERM, then SIGKILL after a grace period) and waited for.
    """

    cluster_class: type[Cluster] | None = None  # None: the installed plugin's (see actors.plugins)

    def __init__(
        self,
        nodes: int | None = None,
        *,
        spares: int = 0,
        devices: DeviceSpec = "auto",
        allow: Iterable[str] = (),
        examples: bool = True,
        limits: Mapping[str, float | int | None] | None = None,
        heartbeat_timeout: float = 10.0,
        startup_timeout: float = 60.0,
        log_level: str = "WARNING",
        insecure: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        checkpoint_root: str | os.PathLike[str] | None = None,
        isolation: str = "process",
        preload: Iterable[str] = (),
        fork_nodes: bool = sys.platform == "linux",
    ) -> None:
        if isolation not in ("process", "thread"):
            raise ValueError(f"isolation is 'process' or 'thread', not {isolation!r:.40}")
        self.isolation = isolation
        self.fork_nodes = fork_nodes
        self.preload = module_names(preload, "preload")
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be an int >= 1, got {max_message_bytes!r:.40}")
        # Resolved here, before any process starts: a GPU this machine lacks fails now.
        num_gpus = visible_gpu_count() if devices != "cpu" else 0
        placed = node_devices(devices, nodes, spares, num_gpus)
        self.max_message_bytes = max_message_bytes
        self.num_nodes = len(placed) - spares
        self.num_spares = spares
        self.devices = dict(zip(self._node_names(), placed))
        if devices == "auto" and num_gpus and self.num_nodes > num_gpus:
            log.warning("LocalCluster(nodes=%d) on %d GPU(s): nodes share GPUs in turn (%s); pass nodes=%d for one "
                        "node per GPU, or devices='cpu'", self.num_nodes, num_gpus, ", ".join(placed), num_gpus)
        self.allow = (*EXAMPLE_FACTORIES, *module_names(allow, "allow")) if examples else module_names(allow, "allow")
        self.limits = {name: "none" if value is None else value for name, value in (limits or {}).items()}
        check_silence("heartbeat_timeout", heartbeat_timeout)
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        self.log_level = log_level
        self.processes: dict[str, NodeProcess] = {}
        self.address = ""
        self._tempdir: str | None = None
        self._binds: dict[str, str] = {}
        self._cluster: Cluster | None = None
        self._admit_token = secrets.token_hex(16)
        self.insecure = insecure
        self.keys: ClusterKeys | None = None
        self._own_checkpoint_root = checkpoint_root is None
        self.checkpoint_root = os.path.abspath(checkpoint_root) if checkpoint_root is not None else None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values()]

    async def __aenter__(self) -> Cluster:
        try:
            return await self._start()
        except BaseException:
            await self._stop()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop()

    async def _start(self) -> Cluster:
        remove_orphaned_tempdirs()
        self._tempdir = tempfile.mkdtemp(prefix=_TEMPDIR_PREFIX)
        _write_owner(self._tempdir)
        address_file = os.path.join(self._tempdir, "head.address")
        root = os.path.join(self._tempdir, "checkpoints") if self._own_checkpoint_root else self.checkpoint_root
        self.checkpoint_root = root
        if self.insecure:
            secure: list[str] = ["--insecure"]
        else:
            self.keys = ClusterKeys.create(os.path.join(self._tempdir, "keys"))
            for name in self._node_names():
                self.keys.add("node", name)
            secure = ["--keys", self.keys.directory]
        limits = [arg for name, value in self.limits.items() for arg in ("--limit", f"{name}={value}")]
        self._binds = local_binds(self._tempdir, ["head", "driver", *self._node_names()])
        self._launch("head", ["--head", "--bind", self._binds["head"], "--address-file", address_file,
                              "--heartbeat-timeout", str(self.heartbeat_timeout), "--checkpoint-root", str(root),
                              *limits, *secure])
        for name in self._node_names():  # beside the head: each imports while the others do
            self._launch(name, self._worker_args(name, secure, address_file))
        self.address = await self._wait_for_file(address_file)
        cls = self.cluster_class or cluster_class()
        auth: dict[str, Any] = {"insecure": True} if self.keys is None else {"keys": self.keys.directory,
                                                                              "identity": "admin"}
        self._cluster = await cls.connect(self.address, bind=self._binds["driver"],
                                          max_message_bytes=self.max_message_bytes, **auth)
        self._cluster._admit_token = self._admit_token
        self._cluster.watch_process(self.processes["head"])
        deadline = time.monotonic() + self.startup_timeout
        while len([n for n in await self._cluster.nodes() if n.alive]) < len(self._node_names()):
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every node registered within {self.startup_timeout}s")
            await asyncio.sleep(0.05)
        return self._cluster

    def _worker_args(self, name: str, secure: Sequence[str], address_file: str) -> list[str]:
        """``python -m actors.node`` arguments for worker ``name``: joins the head (whose address it reads
        from the head's ``address_file`` once written), on its device."""
        allow = [arg for prefix in self.allow for arg in ("--allow", prefix)]
        identity = [] if self.insecure else ["--identity", name]
        preload = [arg for module in self.preload for arg in ("--preload", module)]
        bind = ["--bind", self._binds[name]] if name in self._binds else []  # else the node's own default
        return ["--join-file", address_file, "--name", name, *bind, "--device", self.devices[name], *allow, *secure,
                *identity, "--isolation", self.isolation, *preload]

    def _node_names(self) -> list[str]:
        return [f"node{i}" for i in range(self.num_nodes)] + [f"spare{i}" for i in range(self.num_spares)]

    def _launch(self, name: str, args: Sequence[str]) -> None:
        command = [sys.executable, "-m", "actors.node", *args, "--log-level", self.log_level,
                   "--max-message-bytes", str(self.max_message_bytes)]
        env = {**os.environ, ADMIT_TOKEN_ENV: self._admit_token}
        if self.fork_nodes:
            self.processes[name] = fork_server().start(command[3:], env)
            return
        self.processes[name] = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            # A terminal's Ctrl-C reaches the driver only; the driver then stops the nodes.
            start_new_session=True,
        )

    def _check_alive(self) -> None:
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up; see its log above")

    async def _wait_for_file(self, path: str) -> str:
        deadline = time.monotonic() + self.startup_timeout
        while not os.path.exists(path):
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the head did not start within {self.startup_timeout}s")
            await asyncio.sleep(0.02)
        with open(path) as f:
            return f.read().strip()

    async def _stop(self) -> None:
        # Shielded: a Ctrl-C that cancelled the driver must not cut the clean-up short.
        await asyncio.shield(self._stop_unshielded())

    async def _stop_unshielded(self) -> None:
        if self._cluster is not None:
            cluster, self._cluster = self._cluster, None
            with contextlib.suppress(Exception):
                await cluster.close()
        workers = [p for name, p in self.processes.items() if name != "head"]
        head = [p for name, p in self.processes.items() if name == "head"]
        for group in (workers, head):  # workers first, so they can say goodbye to the head
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(_reap, group, 5.0)
        self.processes.clear()
        if self._tempdir is not None:
            shutil.rmtree(self._tempdir, ignore_errors=True)
            self._tempdir = None
            self.keys = None
            if self._own_checkpoint_root:
                self.checkpoint_root = None


_TEMPDIR_PREFIX = "actorpipe-cluster-"
_OWNER_FILE = "owner"  # "PID START_TIME" of the driver that made the folder
# A Unix socket's path holds at most 107 bytes on Linux and 103 on macOS (sun_path); a node's
# children bind at PATH.PID, and each runtime its bulk socket at its path + ".bulk" and its stream
# socket at its path + ".stream" (a liveness socket at PATH.liveN).
_IPC_PATH_MAX = 103 - len(".4194304.stream")


def module_names(value: str | Iterable[str], what: str) -> tuple[str, ...]:
    """Module names (or prefixes) given as one string or several: ``allow="mypkg"`` is the one
    prefix, where ``tuple("mypkg")`` would be five one-letter ones that admit nothing.

    Raises:
        TypeError: an element that is not a non-empty string.
    """
    names = (value,) if isinstance(value, str) else tuple(value)
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{what} takes module names (a string, or a list of them), got {name!r:.60} in {value!r:.80}")
    return names


def local_binds(tempdir: str, names: Sequence[str]) -> dict[str, str]:
    """Where each process of a local cluster listens: a Unix socket in the cluster's folder, which
    the cluster removes however its processes end (a Unix socket costs less per message than TCP
    on loopback: 222-225 against 244-287 us a secure round trip, measured); TCP on loopback
    where the folder's path is too long for one (a Unix socket's path holds 103 bytes on macOS)."""
    paths = {name: os.path.join(tempdir, name) for name in names}
    if max(len(os.fsencode(path)) for path in paths.values()) > _IPC_PATH_MAX:
        return {name: "tcp://127.0.0.1:0" for name in names}
    return {name: f"ipc://{path}" for name, path in paths.items()}


def _process_start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), or None if there is none.

    A pid alone may have been reused by the time we look; pid and start time together
    name one process for good.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces and parentheses
    return fields[19] if len(fields) > 19 else None  # field 22 of stat; the first two are cut off


def _write_owner(directory: str) -> None:
    pid = os.getpid()
    with open(os.path.join(directory, _OWNER_FILE), "w") as f:
        f.write(f"{pid} {_process_start_time(pid) or ''}")


def _owner_is_gone(directory: str) -> bool:
    """Whether the driver recorded in ``directory`` has exited (False when it cannot tell)."""
    try:
        with open(os.path.join(directory, _OWNER_FILE)) as f:
            pid_text, _, started = f.read().partition(" ")
        pid = int(pid_text)
    except (OSError, ValueError):
        return False  # no owner recorded (or a folder being made right now): not ours to judge
    now = _process_start_time(pid)
    if now is None:
        return sys.platform == "linux"  # no /proc entry: that process has exited
    return bool(started) and now != started  # the pid now names another process


def remove_orphaned_tempdirs(parent: str | None = None) -> list[str]:
    """Removes the ``actorpipe-cluster-*`` folders of drivers that were killed (their keys, addresses).

    A driver killed by SIGKILL cannot clean up after itself; the next ``LocalCluster``
    does, but only for folders of this user whose recorded owner process is gone, so a
    cluster that still runs keeps its keys.

    Returns:
        The folders removed.
    """
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(_TEMPDIR_PREFIX)]
    except OSError:
        return []
    for name in names:
        path = os.path.join(parent, name)
        try:
            mine = os.lstat(path).st_uid == os.getuid() and os.path.isdir(path) and not os.path.islink(path)
        except OSError:
            continue
        if mine and _owner_is_gone(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.info("removed %s, left by a driver that is gone", path)
    return removed


def _reap(processes: list[NodeProcess], grace: float) -> None:
    deadline = time.monotonic() + grace
    for proc in processes:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.0fs; killing it", proc.pid, grace)
            proc.kill()
            proc.wait()
