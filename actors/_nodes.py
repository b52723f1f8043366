"""The head actor (membership, heartbeats, events) and the worker's node actor (spawning).

What each tells whom: the head's node events go to every subscriber (they are about
the cluster's members, never about a job); a node describes itself and checks an
import path for anyone admitted, but only the head's and the admin key (and the
process itself) hear its pid, the actors it hosts (other clients' jobs among them),
its allow-list and its folder (:func:`~actors.sees_all`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from actors._actor import Actor, current_caller, endpoint, sees_all
from actors._context import NodeContext
from actors._errors import (ActorError, ActorLost, NodeLost, NotAllowed, builtin_base, contained,
                            remote_error_class)
from actors._liveness import LivenessServer, check_silence
from actors._registry import actor_class, load_object, registered_actors
from actors._subscribers import EventSink, Subscribers
from actors.events import Event, NodeJoined, NodeLeft, NodeSilent
from actors.records import WireRecord
from transport.addresses import Address
from transport.security import join_address, split_address
from transport.wire import excerpt

if TYPE_CHECKING:
    from actors._processes import ActorProcesses
    from actors._ref import ActorRef

__all__ = ["HEAD", "NODE", "EventSink", "HeadActor", "HeartbeatSettings", "NodeActor", "NodeContext",
           "NodeDescription", "NodeInfo", "node_info"]

log = logging.getLogger(__name__)

HEAD = "head"  # the head actor's name in the head node's runtime
MAX_HOSTED = 4096  # the actor processes a node may tell the head it hosts
NODE = "node"  # the node actor's name in every worker's runtime


NodeState = Literal["alive", "lost", "left"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeInfo(WireRecord):
    """A node as the head knows it: what the worker told it when it registered, and how it is doing.

    Attributes:
        state: ``alive``, ``lost`` (no heartbeat within the timeout) or ``left`` (it said it stops).
        last_heartbeat_age_s: seconds since its last heartbeat, when the head was asked.
        identity: ``role:name`` of the key it registered with (``""`` without keys).
        pid: the worker's process id; 0 in :meth:`HeadActor.nodes`' answer to a client
            (a process on someone's machine is the operator's business).
    """

    name: str
    address: str
    device: str
    pid: int
    host: str
    memory_bytes: int
    state: NodeState = "alive"
    last_heartbeat_age_s: float = 0.0
    identity: str = ""

    @property
    def alive(self) -> bool:
        return self.state == "alive"


@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatSettings(WireRecord):
    """What the head asks of a worker that registers: a heartbeat every ``interval`` s, lost after ``timeout`` s."""

    interval: float
    timeout: float
    liveness: str = ""
    """The endpoint of the socket the head watches this node's connection on (:mod:`actors._liveness`),
    with the head's key; "" from a head without one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeDescription(WireRecord):
    """What a node's agent says of itself (:meth:`NodeActor.describe`).

    Everyone admitted hears the first five fields. The rest are the operator's
    view, for the head's and the admin key only (:func:`~actors.sees_all`); a client
    gets None there: they would name other clients' jobs (``actors``), a process
    (``pid``) and how the node is set up (``allow``, ``working_directory``).

    Attributes:
        registry: the actor classes the node may spawn.
        num_actors: how many actors it hosts now (its agent included).
        actors: their names.
        allow: the module prefixes its factories may come from.
        working_directory: where it runs (what a factory's module is imported relative to).
        processes: the actors it hosts in processes of their own, by name, with their pids.
    """

    name: str
    device: str
    memory_bytes: int
    registry: list[str]
    num_actors: int
    pid: int | None = None
    host: str | None = None
    address: str | None = None
    actors: list[str] | None = None
    allow: list[str] | None = None
    working_directory: str | None = None
    processes: dict[str, int] | None = None


def _import_failure(node: str, exc: Exception, reveal: bool) -> Exception:
    """What a caller hears of a path that did not load: the operator the error with its
    traceback; anyone else its type and message only (a traceback shows the node's files)."""
    if reveal and isinstance(exc, ModuleNotFoundError):
        return ModuleNotFoundError(f"node {node}: {exc}", name=exc.name)
    return remote_error_class(builtin_base(exc))(f"node {node}: {str(exc)[:300]}", remote_type=type(exc).__name__)


def node_info(name: str, address: str, device: str) -> NodeInfo:
    """Describes this process as a node."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 0
    return NodeInfo(
        name=name, address=address, device=device, pid=os.getpid(), host=socket.gethostname(), memory_bytes=memory
    )


# How long a node that is alive but does not answer (stopped, frozen, cut off) stays a member.
# Its connection's heartbeats are answered by libzmq's own threads, which neither a saturated
# machine, a busy event loop nor a long garbage collection holds up: only a stopped process, a
# frozen machine or a cut network goes this long without an answer. A process that ends is
# known at once, whatever this says (its connection closes).
SILENT_TIMEOUT_S = 10.0


class HeadActor(Actor):
    """Keeps the membership list, notices lost nodes, and tells subscribers.

    A node is lost the moment its liveness connection closes (:mod:`actors._liveness`): its
    process ended, or it answered no heartbeat for ``heartbeat_timeout`` seconds. A node whose
    liveness connection never proved itself is lost after that long without an actor heartbeat.
    """

    def __init__(self, *, heartbeat_interval: float = 0.5, heartbeat_timeout: float = SILENT_TIMEOUT_S) -> None:
        if not heartbeat_interval > 0:  # 0 made the watch below spin on a whole core
            raise ValueError(f"heartbeat interval must be > 0 seconds, got {heartbeat_interval!r}")
        check_silence("heartbeat timeout", heartbeat_timeout)
        if heartbeat_timeout <= heartbeat_interval:
            raise ValueError(
                f"heartbeat timeout ({heartbeat_timeout}s) must exceed the interval ({heartbeat_interval}s)"
            )
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self._nodes: dict[str, NodeInfo] = {}
        self._last_seen: dict[str, float] = {}
        self._hosted: dict[str, list[str]] = {}  # node -> the addresses of the actor processes it hosts
        self._subscribers = Subscribers("head")
        self._liveness: LivenessServer | None = None

    async def on_start(self) -> None:
        self.runtime.spawn_task(self._watch(), name="heartbeat watch")
        loop = asyncio.get_running_loop()
        endpoint = split_address(self.runtime.address)[0]
        where = Address.parse(endpoint)
        host = f"tcp://{where.host}" if where.is_tcp else endpoint  # ipc: beside the head's
        self._liveness = LivenessServer(self.runtime.context, host, self.runtime.keys,
                                        lambda name: loop.call_soon_threadsafe(self._connection_closed, name),
                                        interval=self.heartbeat_interval, timeout=self.heartbeat_timeout)

    async def on_stop(self) -> None:
        if self._liveness is not None:
            self._liveness.close()

    @endpoint(roles=("node",))
    async def register(self, info: NodeInfo) -> HeartbeatSettings:
        """A worker joins (or re-joins); returns the heartbeat settings it must keep.

        Raises:
            ValueError: ``info`` is not a NodeInfo of sound fields, or a live node has its name.
        """
        kinds = {"name": str, "address": str, "device": str, "pid": int, "host": str, "memory_bytes": int}
        if not isinstance(info, NodeInfo) or any(
                not isinstance(getattr(info, k), t) or isinstance(getattr(info, k), bool) for k, t in kinds.items()):
            raise ValueError(f"register needs a NodeInfo with {', '.join(f'{k}: {t.__name__}' for k, t in kinds.items())}; "
                             f"got {excerpt(info, 200)}")
        if any(len(getattr(info, k)) > 256 for k in ("name", "address", "device", "host")):
            raise ValueError("register: name, address, device and host are at most 256 characters")
        # The head decides the state and the identity (the key the worker holds), never the worker.
        node = replace(info, state="alive", last_heartbeat_age_s=0.0, identity=current_caller())
        if not self.runtime.callers_own(node.address):
            raise NotAllowed(f"register: {excerpt(node.address, 120)} does not carry this node's own key; a node "
                             "registers the address it listens at")
        previous = self._nodes.get(node.name)
        if previous is not None and previous.state == "alive" and previous.identity != node.identity:
            raise NotAllowed(f"a live node is already named {node.name!r}, under another key; pick another --name")
        if previous is not None and previous.state == "alive" and previous.pid != node.pid:
            raise ValueError(f"a live node is already named {node.name!r} (pid {previous.pid}); pick another --name")
        keys = self.runtime.keys
        liveness = ""
        if self._liveness is not None:  # first: a node whose watch cannot be made has not joined
            endpoint = self._liveness.watch(node.name, node.identity if keys is not None else "")
            liveness = join_address(endpoint, keys.public) if keys is not None else endpoint
        self._nodes[node.name] = node
        self._last_seen[node.name] = time.monotonic()
        log.info("node %s joined from %s (%s, pid %d)", excerpt(node.name), excerpt(node.host),
                 excerpt(node.device), node.pid)
        self._publish(NodeJoined(node=node.name))
        return HeartbeatSettings(interval=self.heartbeat_interval, timeout=self.heartbeat_timeout, liveness=liveness)

    @endpoint(roles=("node",), taskless_start=True)
    async def heartbeat(self, name: str) -> bool:
        """Returns False when the head does not know ``name`` (it must register again).

        Raises:
            NotAllowed: ``name`` is another key's node (no node keeps another alive).
        """
        node = self._nodes.get(name)
        if node is None or node.state != "alive":
            return False
        if node.identity != current_caller():
            raise NotAllowed(f"no live node {excerpt(name)} registered with this key")
        self._last_seen[name] = time.monotonic()
        return True

    @endpoint(roles=("node",))
    async def deregister(self, name: str) -> None:
        """Node ``name`` leaves.

        Raises:
            NotAllowed: ``name`` is another key's node.
        """
        node = self._nodes.get(name)
        if node is not None and node.state == "alive":
            self._member(name)
            self._nodes[name] = replace(node, state="left")
            if self._liveness is not None:
                self._liveness.forget(name)
            log.info("node %s left", name)
            self._publish(NodeLeft(node=name))

    @endpoint(roles=("node",))
    async def hosting(self, name: str, addresses: list[str]) -> None:
        """Node ``name`` hosts actors in these processes of its own (see :mod:`actors._processes`):
        when the node is lost, calls to them fail with ``NodeLost`` as calls to the node do.

        Raises:
            NotAllowed: ``name`` is not a live node registered with the caller's key.
            ValueError: not a list of at most :data:`MAX_HOSTED` addresses.
        """
        self._member(name)
        if (not isinstance(addresses, list) or len(addresses) > MAX_HOSTED
                or any(not isinstance(a, str) or len(a) > 256 for a in addresses)):
            raise ValueError(f"hosting takes a list of at most {MAX_HOSTED} addresses of at most 256 characters")
        foreign = [a for a in addresses if not self.runtime.callers_own(a)]
        if foreign:  # another runtime's: its calls would fail as the node's own processes' do when it says so
            raise NotAllowed(f"hosting: {excerpt(foreign[0], 120)} does not carry this node's own key; a node hosts "
                             "actors only in processes of its own")
        self._hosted[name] = list(addresses)

    @endpoint(roles=("node",))
    async def actor_lost(self, name: str, address: str, actor: str, how: str) -> None:
        """Node ``name`` saw the process of its hosted ``actor`` end untold (``how``: ``killed by
        SIGSEGV``): every call to ``address``, pending or later, fails with :class:`ActorLost`.

        Raises:
            NotAllowed: ``name`` is not a live node registered with the caller's key.
            ValueError: the node did not say it hosts ``address``.
        """
        self._member(name)
        if not all(isinstance(v, str) for v in (address, actor, how)):
            raise ValueError("actor_lost takes the address, the actor's name and how it ended as strings")
        hosted = self._hosted.get(name, [])
        if address not in hosted:
            raise ValueError(f"node {name} hosts no actor process at {excerpt(address)}")
        hosted.remove(address)
        actor, how = actor[:120], how[:120]
        log.warning("node %s: %s's process %s", name, actor, how)
        self.runtime.mark_lost(address, ActorLost(f"{actor} on node {name}: its process {how}",
                                                  details={"node": name, "actor": actor, "how": how}))

    def _member(self, name: str) -> NodeInfo:
        node = self._nodes.get(name)
        if node is None or node.state != "alive" or node.identity != current_caller():
            raise NotAllowed(f"no live node {excerpt(name)} registered with this key")
        return node

    @endpoint(concurrent=True)
    async def nodes(self) -> list[NodeInfo]:
        """Every node the head knows, with its state and the age of its last heartbeat (a client's: pid 0)."""
        now = time.monotonic()
        operator = sees_all(current_caller())
        return [replace(node, last_heartbeat_age_s=round(now - self._last_seen[name], 3),
                        pid=node.pid if operator else 0)
                for name, node in self._nodes.items()]

    @endpoint(concurrent=True, taskless_start=True)
    async def ping(self) -> float:
        """The head's clock: a driver's liveness probe (any member may ask)."""
        return time.time()

    @endpoint(roles=("client",))
    async def subscribe(self, actor: str) -> None:
        """Sends every later node event to ``actor.on_event(event)`` (an :class:`EventSink`) in the
        calling runtime, at its own address (see :mod:`actors._subscribers`).

        Raises:
            NotAllowed: the call came from an address that is not the caller's own.
            TooManySubscribers: the caller's key (or the head) holds as many as it may.
        """
        self._subscribers.add(self.runtime, actor)

    @endpoint(roles=("client",))
    async def unsubscribe(self, actor: str) -> None:
        """Stops the events :meth:`subscribe` started for ``actor`` of the calling runtime."""
        self._subscribers.remove(self.runtime, actor)

    async def _watch(self) -> None:
        tick = min(self.heartbeat_interval, self.heartbeat_timeout / 8)
        while True:
            before = time.monotonic()
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - before > tick + self.heartbeat_interval:
                # This loop itself stalled (a busy machine, a long call): heartbeats
                # that arrived meanwhile are still queued, so silence proves nothing.
                stall = now - before - tick
                self._last_seen = {name: seen + stall for name, seen in self._last_seen.items()}
                continue
            proven = self._liveness.verified if self._liveness is not None else set()
            for name, node in list(self._nodes.items()):
                silent = now - self._last_seen[name]
                # A node whose liveness connection stands is alive, however late its actor heartbeats are.
                if node.state == "alive" and silent > self.heartbeat_timeout and name not in proven:
                    self._lose(name, f"no heartbeat for {silent:.1f}s", silent)

    def _connection_closed(self, name: str) -> None:
        """Node ``name``'s liveness connection ended: its process is gone, or it answered nothing for
        ``heartbeat_timeout`` seconds (libzmq dropped it)."""
        node = self._nodes.get(name)
        if node is not None and node.state == "alive":
            self._lose(name, "its connection to the head closed (its process ended, or it answered no "
                             f"heartbeat for {self.heartbeat_timeout:g}s)", time.monotonic() - self._last_seen[name])

    def _lose(self, name: str, why: str, silent: float) -> None:
        node = self._nodes[name]
        self._nodes[name] = replace(node, state="lost")
        log.warning("node %s lost: %s", name, why)
        for address in [node.address, *self._hosted.pop(name, [])]:
            self.runtime.fail_calls_to(address, NodeLost(f"node {name} was lost: {why}", details={"node": name}))
        self._publish(NodeSilent(node=name, silent_s=round(silent, 3)))

    def _publish(self, event: Event) -> None:
        """Tells every subscriber: a node event is about the cluster's members, which every key may know."""
        self._subscribers.publish(self.runtime, event)


class NodeActor(Actor):
    """A worker's agent: spawns registered actor classes on the head's request."""

    def __init__(self, info: NodeInfo, allow: tuple[str, ...], stop: asyncio.Event, admit_token: str = "",
                 processes: ActorProcesses | None = None, max_message_bytes: int = 0) -> None:
        """
        Args:
            processes: host each spawned actor in a process of its own (a worker's default, see
                :mod:`actors._processes`); None: in this process (the head's agent, ``--isolation
                thread``).
        """
        self.info = info
        self.allow = list(allow)
        self._stop = stop
        self._admit_token = admit_token
        self._processes = processes
        self._max_message_bytes = max_message_bytes
        self.head: ActorRef | None = None  # told of the processes it hosts (set once registered)
        if processes is not None:
            processes.on_lost = self._lost

    async def on_stop(self) -> None:
        if self._processes is not None:
            await self._processes.aclose()

    # Concurrent: a stage builds its model in on_start (seconds, or as long as a job's data
    # factory takes); the agent answers every other job's spawn and stop meanwhile.
    @endpoint(concurrent=True, roles=("head",))
    async def spawn(self, class_name: str, actor_name: str, kwargs: dict[str, Any]) -> list[str]:
        """Builds actor ``class_name`` (from the registry) as ``actor_name``; returns its ref."""
        cls = actor_class(class_name)  # an unknown class is refused here, before any process starts
        if self._processes is not None:
            address = await self._processes.spawn(class_name, actor_name, kwargs, self.allow,
                                                  max_message_bytes=self._max_message_bytes)
            await self.tell_head_hosting()
            return [address, actor_name]
        actor = cls(**kwargs)
        actor.node_context = NodeContext(name=self.info.name, device=self.info.device, allow_list=self.allow)
        ref = await self.runtime.spawn(actor, actor_name)
        return ref.to_wire()

    @endpoint(concurrent=True, roles=("head",))
    async def stop_actor(self, actor_name: str) -> None:
        """Stops actor ``actor_name``: a hosted one's process ends with it (killed after a grace,
        when a job's code holds on)."""
        if self._processes is not None and actor_name not in self.runtime.actor_names():
            await self._processes.stop(actor_name)
            await self.tell_head_hosting()
            return
        await self.runtime.stop_actor(actor_name)

    async def tell_head_hosting(self) -> None:
        """Tells the head the addresses of the processes this node hosts actors in (best effort: a head
        that does not hear it only fails calls to them at their timeout, should this node be lost)."""
        if self.head is None or self._processes is None:
            return
        try:
            await self.head.endpoint(HeadActor.hosting, timeout=10).call(self.info.name, self._processes.addresses())
        except ActorError as exc:
            log.warning("could not tell the head which actor processes this node hosts: %s", exc)

    def _lost(self, actor: str, address: str, how: str) -> None:
        """A hosted actor's process ended untold: the head fails every call to it at once."""
        if self.head is None:
            return
        head = self.head.endpoint(HeadActor.actor_lost, timeout=10)

        async def tell() -> None:
            try:
                await head.call(self.info.name, address, actor, how)
            except ActorError as exc:
                log.warning("could not tell the head that %s's process %s: %s", actor, how, exc)

        self.runtime.spawn_task(tell(), name=f"{actor} lost")

    def hosted_names(self) -> list[str]:
        return list(self._processes.pids()) if self._processes is not None else []

    @endpoint(concurrent=True)
    async def describe(self) -> NodeDescription:
        """This node: its name, device, memory and what it may spawn; the operator's view
        (pid, host, address, actors, allow-list, folder) only for the head's and admin key."""
        actors = self.runtime.actor_names() + self.hosted_names()
        public = NodeDescription(name=self.info.name, device=self.info.device, memory_bytes=self.info.memory_bytes,
                                 registry=registered_actors(), num_actors=len(actors))
        if not sees_all(current_caller()):
            return public
        return replace(public, pid=self.info.pid, host=self.info.host, address=self.info.address, actors=actors,
                       allow=list(self.allow), working_directory=os.getcwd(),
                       processes=self._processes.pids() if self._processes is not None else {})

    @endpoint
    async def check_import(self, path: str) -> str:
        """Resolves ``path`` against this node's allow-list; returns where the factory is defined.

        A client hears whether the path imports and is admitted, and why not, but
        not the allow-list nor the node's folder and ``PYTHONPATH`` (the head's and
        admin key do, to fix a node's set-up).

        Raises:
            NotAllowed: the allow-list refuses ``path`` (the message names this node), or
                this is the head, which never imports user code.
            ValueError: ``path`` is not an import path.
            ModuleNotFoundError: the module does not import on this node.
        """
        self._refuse_user_code_on_head()
        reveal = sees_all(current_caller())
        try:
            obj = contained(lambda: load_object(path, self.allow, reveal=reveal))  # importing runs its code
        except NotAllowed as exc:
            raise NotAllowed(f"node {self.info.name} refused it: {exc.message}") from None
        except ModuleNotFoundError as exc:
            raise _import_failure(self.info.name, exc, reveal) from None
        except Exception as exc:
            if reveal:
                raise
            raise _import_failure(self.info.name, exc, reveal) from None
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"

    def _refuse_user_code_on_head(self) -> None:
        if HEAD in self.runtime.actor_names():  # the head's own agent: it hosts the head actor
            raise NotAllowed(f"node {self.info.name} is the head, which never imports user code; ask a worker")

    @endpoint
    async def admit(self, token: str, prefixes: list[str]) -> list[str]:
        """Adds module prefixes to the allow-list, for the holder of the node's admission token.

        A LocalCluster starts its nodes with a fresh token (in the environment, not on
        the command line) so that it can admit the factories a job names; a node
        started by hand has none and admits nothing this way.

        Raises:
            NotAllowed: no token, or the wrong one.
        """
        if not self._admit_token or not hmac.compare_digest(token, self._admit_token):
            raise NotAllowed(f"node {self.info.name} does not admit prefixes on request; start it with --allow")
        self.allow.extend(p for p in prefixes if p not in self.allow)  # in place: contexts share it
        return list(self.allow)

    @endpoint(roles=())
    async def shutdown(self) -> None:
        """Stops this node process cleanly (after replying)."""
        asyncio.get_running_loop().call_soon(self._stop.set)
