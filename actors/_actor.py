"""The actor base class, the ``@endpoint`` marker and the per-actor mailbox loop.

An actor handles one message at a time, in arrival order, in its own task; an
endpoint marked ``concurrent=True`` runs in a task of its own as soon as it arrives
(for queries that must be answered while a long call runs, such as a status probe).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import sys
import types
import typing
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, Union, overload

from actors._errors import (ActorError, ActorStopped, BadArguments, MailboxFull, NotAllowed, UnknownEndpoint,
                            exit_error)
from actors._ref import ENDPOINT_ATTR, ActorRef
from transport.records import RECORD_NAMES


__all__ = ["Actor", "endpoint"]

log = logging.getLogger(__name__)
# From Python 3.12 a call starts at once as an eager task (asyncio.Task(..., eager_start=True));
# before, only an endpoint marked taskless_start starts on the deliverer's stack (Mailbox._start).
EAGER_TASKS = sys.version_info >= (3, 12)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
DEFAULT_MAILBOX_SIZE = 4096
_ENDPOINT_ATTR = ENDPOINT_ATTR


LOCAL = "local:"  # the caller of a call from the same process
INSECURE = ""  # the caller of a call through a runtime without keys (every caller is trusted)
_caller: contextvars.ContextVar[str] = contextvars.ContextVar("actorpipe_caller", default=LOCAL)
_reply_to: contextvars.ContextVar[str | None] = contextvars.ContextVar("actorpipe_reply_to", default=None)


def current_caller() -> str:
    """Who made the call an endpoint is serving: ``role:name`` from the caller's admitted key.

    ``local:`` for a call from this process, ``""`` through a runtime without keys.
    """
    return _caller.get()


def current_reply_address() -> str | None:
    """Where the reply to the call an endpoint is serving goes: the address its request named.

    None for a call from this process and for a ``tell``. The caller chose it, so it
    proves nothing by itself: :meth:`Host.caller_address` checks it against the
    caller's key.
    """
    return _reply_to.get()


def caller_role(caller: str) -> str:
    """The role part of a caller (``node`` of ``node:node0``)."""
    return caller.partition(":")[0]


def caller_among(members: frozenset[str]) -> bool:
    """Whether the caller holds one of ``members``' keys (``role:name``), e.g. a job's nodes'.

    No members: anyone admitted. The admin key, the process itself and any caller of a
    runtime without keys always pass, as for :func:`may_call`.
    """
    caller = current_caller()
    return not members or caller in members or may_call(caller, frozenset())


def may_call(caller: str, roles: frozenset[str] | None) -> bool:
    """Whether ``caller`` may call an endpoint open to ``roles`` (None: any admitted member).

    The admin key and the process itself may call anything; so may anyone through a
    runtime without keys (``--insecure``).
    """
    if roles is None or caller in (LOCAL, INSECURE):
        return True
    role = caller_role(caller)
    return role == "admin" or role in roles


def may_see(viewer: str, owner: str) -> bool:
    """Whether ``viewer`` may see what ``owner``'s key owns (a job, its events): the owner itself,
    or a caller that may act on everything (admin, the process itself, anyone without keys)."""
    return viewer == owner or may_call(viewer, frozenset())


def sees_all(caller: str) -> bool:
    """Whether ``caller`` gets the operator's view of a node (its pid, actors, allow-list, folder):
    the head's key, and whoever :func:`may_see` everything."""
    return may_call(caller, frozenset({"head"}))


@dataclass(frozen=True, slots=True, kw_only=True)
class _EndpointInfo:
    concurrent: bool
    roles: frozenset[str] | None
    taskless_start: bool = False


@overload
def endpoint(fn: F, /) -> F: ...


@overload
def endpoint(*, concurrent: bool = False, roles: Iterable[str] | None = None,
             taskless_start: bool = False) -> Callable[[F], F]: ...


def endpoint(fn: F | None = None, /, *, concurrent: bool = False, roles: Iterable[str] | None = None,
             taskless_start: bool = False) -> Any:
    """Marks an async method as callable from anywhere in the cluster.

    The method keeps its type, so callers can name it: ``ref.endpoint(Cls.method)``.

    Args:
        concurrent: run each call at once (until it first waits; then in its own task)
            instead of queueing it behind the actor's other messages.
        roles: the roles whose keys may call it (``head``, ``node``, ``client``);
            the admin key may call anything. None: any admitted member. A caller
            outside them gets :class:`~actors.NotAllowed` and the endpoint never runs.
        taskless_start: its code up to its first wait needs no task of its own (it uses
            no ``asyncio.timeout``, ``TaskGroup`` or ``current_task`` there). Before
            Python 3.12 such a call may then start on the stack that delivers it and
            become a task only if it waits (a ping saves a task and a turn of the loop,
            10 µs of a round trip); any other call starts in a task. From Python 3.12
            every call starts at once as an eager task, and this changes nothing.
    """
    allowed = frozenset(roles) if roles is not None else None

    def mark(f: F) -> F:
        if not inspect.iscoroutinefunction(f):
            raise TypeError(f"@endpoint {f.__qualname__} must be an async def")
        setattr(f, _ENDPOINT_ATTR, _EndpointInfo(concurrent=concurrent, roles=allowed, taskless_start=taskless_start))
        return f  # type: ignore[return-value]

    return mark(fn) if fn is not None else mark


class Host(Protocol):
    """What an actor may ask of the runtime that hosts it (``self.runtime``)."""

    address: str
    context: Any  # the zmq context of its sockets
    keys: Any  # its CURVE keypair, or None
    closed: bool  # it is closing: it answers none of the calls it was running (see Mailbox)
    max_message_bytes: int  # the largest message it takes
    encrypts: bool  # what it seals is encrypted: keys, and encryption not turned off (bulk="authenticate")

    def ref(self, address: str, name: str) -> ActorRef: ...

    def spawn_task(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None,
                   awaited: bool = False) -> asyncio.Task[Any]: ...

    async def spawn(self, actor: Actor, name: str) -> ActorRef: ...

    async def stop_actor(self, name: str) -> None: ...

    def actor_names(self) -> list[str]: ...

    def fail_calls_to(self, address: str, error: ActorError) -> int: ...

    def mark_lost(self, address: str, error: ActorError) -> None: ...

    def lost(self, address: str) -> ActorError | None: ...

    def caller_address(self) -> str:
        """The address of the runtime that made the call being served, checked to be the caller's own.

        What a publisher sends events to: never an address a caller merely names.

        Raises:
            NotAllowed: the call named no reply address (a ``tell``), or one that is not
                the caller's own (see :meth:`Runtime.caller_address <actors.Runtime.caller_address>`).
        """
        ...

    def callers_own(self, address: str) -> bool:
        """Whether ``address`` carries the key of the caller being served (always, without keys, or for
        a call from this process)."""
        ...


@dataclass(slots=True, kw_only=True)
class Call:
    """One delivered request: the method to run and where its outcome goes."""

    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    reply: Callable[[bool, Any], Awaitable[None]] | None  # None for tell
    caller: str = LOCAL  # role:name of the key that sent it (see current_caller)
    reply_to: str | None = None  # the address the request named for its reply (see current_reply_address)


class Actor:
    """Base class: subclass it and mark async methods with :func:`endpoint`.

    Hooks, all optional: :meth:`on_start` before the first message, :meth:`on_stop`
    after the last, :meth:`on_failure` when an endpoint raised (the error also goes
    back to the caller, and the actor keeps serving), :meth:`on_messages_lost` when
    a message to this process may have been lost on the way.
    """

    mailbox_size: int = DEFAULT_MAILBOX_SIZE

    # Set by the runtime when the actor is spawned.
    name: str
    runtime: Host
    ref: ActorRef
    # Set by a node's agent when it spawns the actor: the node's device and allow-list.
    node_context: Any = None
    refused_calls: int = 0  # calls refused because of the caller's role

    async def on_start(self) -> None:
        """Runs before the actor takes its first message; raising aborts the spawn."""

    async def on_stop(self) -> None:
        """Runs once the actor has stopped taking messages."""

    async def on_failure(self, method: str, error: BaseException) -> None:
        """Runs when endpoint ``method`` raised ``error``."""
        log.debug("%s.%s raised %r", self.name, method, error)

    def on_messages_lost(self, member: str, why: str) -> None:
        """Runs, on the loop, when a message that ``member`` (its key's name, ``role:name``) sent to
        this process may have been lost on the way (a sealed message refused on its session's own
        connection, or a gap in the session's numbers): an actor that waits for a message from
        ``member`` that is not a reply (a tell) can fail that wait now instead of at its timeout.
        The runtime fails the calls waiting on ``member``'s replies itself."""

    @classmethod
    def endpoints(cls) -> dict[str, bool]:
        """The endpoint names of this class, each with whether it is concurrent."""
        found: dict[str, bool] = {}
        for attr in dir(cls):
            info = getattr(getattr(cls, attr, None), _ENDPOINT_ATTR, None)
            if isinstance(info, _EndpointInfo):
                found[attr] = info.concurrent
        return found


def _record_parameters(method: Callable[..., Any]) -> dict[str, tuple[type, ...]]:
    """The parameters of ``method`` annotated with a record class (or ``Record | None``): what each must be.

    A record that crosses the wire arrives as its class (see :mod:`actors.records`),
    so an argument of another type is the caller's mistake (or an attack): the
    mailbox refuses it with BadArguments before the endpoint runs. Annotations that
    do not resolve at run time (names imported for type checkers only) are not checked.
    """
    try:
        hints = typing.get_type_hints(method)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve here: nothing to check
        return {}
    checked: dict[str, tuple[type, ...]] = {}
    for name, hint in hints.items():
        options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is Union \
            else (hint,)
        classes = tuple(o for o in options if isinstance(o, type) and o in RECORD_NAMES)
        if name != "return" and classes and all(o in classes or o is type(None) for o in options):
            checked[name] = classes + ((type(None),) if type(None) in options else ())
    return checked


def _check_records(arguments: dict[str, Any], records: dict[str, tuple[type, ...]]) -> None:
    for name, classes in records.items():
        if name in arguments and not isinstance(arguments[name], classes):
            raise TypeError(f"{name} must be {' or '.join(c.__name__ for c in classes)}, "
                            f"not {type(arguments[name]).__name__}")


class _PositionalPlan:
    """How to check a call made with positional arguments only, without ``Signature.bind``
    (3.5 µs a call): their count, and the record parameters among them."""

    __slots__ = ("least", "most", "records")

    def __init__(self, least: int, most: int, records: list[tuple[int, str, tuple[type, ...]]]) -> None:
        self.least, self.most, self.records = least, most, records

    @classmethod
    def of(cls, signature: inspect.Signature, records: dict[str, tuple[type, ...]]) -> _PositionalPlan | None:
        """None for a signature with ``*args`` or a keyword-only parameter without a default
        (``Signature.bind`` decides those calls)."""
        least = most = 0
        checked: list[tuple[int, str, tuple[type, ...]]] = []
        for parameter in signature.parameters.values():
            if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                if parameter.name in records:
                    checked.append((most, parameter.name, records[parameter.name]))
                most += 1
                least = most if parameter.default is parameter.empty else least
            elif parameter.kind is parameter.VAR_POSITIONAL or parameter.default is parameter.empty \
                    and parameter.kind is parameter.KEYWORD_ONLY:
                return None
        return cls(least, most, checked)

    def takes(self, args: list[Any]) -> bool:
        """Whether ``args`` bind (True), or bind needs to say why not (False).

        Raises:
            TypeError: a record parameter given a value of another type (as :func:`_check_records`).
        """
        if not self.least <= len(args) <= self.most:
            return False
        for index, name, classes in self.records:
            if index < len(args) and not isinstance(args[index], classes):
                _check_records({name: args[index]}, {name: classes})
        return True


@dataclass(frozen=True, slots=True)
class EndpointTable:
    """What a mailbox checks calls against, per endpoint of one actor class.

    Made once per class (:func:`endpoint_table`): ``typing.get_type_hints`` and
    ``inspect.signature`` over the stage actor's endpoints cost 18 ms, once in every
    actor's process when each mailbox made its own; a node's zygote makes the tables of
    the classes it hosts before it forks, so that no hosted process pays it.
    """

    concurrent: dict[str, bool]  # endpoint -> whether it runs concurrently
    starts_in_place: dict[str, bool]  # endpoint -> whether a call may start on the deliverer's stack
    signatures: dict[str, inspect.Signature]  # as a bound method's (without self)
    roles: dict[str, frozenset[str] | None]
    records: dict[str, dict[str, tuple[type, ...]]]  # see _record_parameters
    positional: dict[str, _PositionalPlan | None]


_TABLES: dict[type, EndpointTable] = {}


def endpoint_table(cls: type[Actor]) -> EndpointTable:
    """``cls``'s :class:`EndpointTable`, made at the first call for it."""
    table = _TABLES.get(cls)
    if table is None:
        table = _TABLES[cls] = _make_table(cls)
    return table


def _make_table(cls: type[Actor]) -> EndpointTable:
    concurrent = cls.endpoints()
    functions = {name: getattr(cls, name) for name in concurrent}
    signatures = {name: _bound_signature(function) for name, function in functions.items()}
    records = {name: _record_parameters(function) for name, function in functions.items()}
    return EndpointTable(
        concurrent=concurrent,
        starts_in_place={name: EAGER_TASKS or getattr(function, _ENDPOINT_ATTR).taskless_start
                         for name, function in functions.items()},
        signatures=signatures,
        roles={name: getattr(function, _ENDPOINT_ATTR).roles for name, function in functions.items()},
        records=records, positional={name: _PositionalPlan.of(signatures[name], records[name]) for name in concurrent})


def _bound_signature(function: Callable[..., Any]) -> inspect.Signature:
    """The signature of ``function`` bound to an instance, as ``inspect.signature`` gives a bound
    method's: the first parameter (``self``) dropped."""
    signature = inspect.signature(function)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


@types.coroutine
def _passed_on(waiting_on: Any) -> Any:
    """Yields ``waiting_on`` to the task running the caller and returns what the task sends back."""
    return (yield waiting_on)


async def _resumed(coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
    """``coro``, already run up to its first wait on ``waiting_on``, going on as a task would run it:
    the task waits on what ``coro`` waits on, and passes in what the task is sent or thrown.

    A native coroutine, not a generator: from Python 3.12 on a task takes nothing else."""
    while True:
        try:
            sent = await _passed_on(waiting_on)
        except BaseException as exc:  # noqa: BLE001 - the task's cancellation, passed on
            try:
                waiting_on = coro.throw(exc)
            except StopIteration:
                return
        else:
            try:
                waiting_on = coro.send(sent)
            except StopIteration:
                return


class Mailbox:
    """Runs one actor's calls: sequential ones in order, concurrent ones at once.

    A call starts the moment it is delivered where it may (a concurrent endpoint's, or a sequential
    one's while the actor has nothing running or waiting): from Python 3.12 as an eager task, which
    runs at once until it first waits. Before 3.12 only an endpoint marked ``taskless_start`` starts
    so, on the deliverer's stack, and only what remains becomes a task: a call that needs no wait
    (a ping, a status, an answer sent at once) then costs no task and no turn of the loop (10 µs of
    a 216 µs round trip between two processes, measured). Any other call starts in a task, where
    ``asyncio.timeout``, ``TaskGroup`` and ``current_task`` see the call's own.
    """

    def __init__(self, actor: Actor, spawn_task: Callable[..., asyncio.Task[None]]) -> None:
        self.actor = actor
        table = endpoint_table(type(actor))
        self._endpoints = table.concurrent
        self._in_place = table.starts_in_place
        self._signatures = table.signatures
        self._roles = table.roles
        self._records = table.records
        self._positional = table.positional
        self._queue: asyncio.Queue[Call] = asyncio.Queue(actor.mailbox_size)
        self._spawn_task = spawn_task
        self._parked = False  # the run loop waits for the queue (nothing sequential runs there)
        self._started: asyncio.Task[None] | None = None  # a sequential call started at delivery, still running
        self._starting = False  # a sequential call runs on the deliverer's stack right now

    def deliver(self, call: Call, *, start: bool = True) -> None:
        """Queues ``call`` or starts it (concurrent endpoints); ``start``: it may start at once, on this
        stack (else a concurrent call starts as a task, and a sequential one queues).

        Raises:
            UnknownEndpoint: no such endpoint (checked here, so the caller hears at once).
            NotAllowed: the caller's role may not call this endpoint (counted in
                ``actor.refused_calls``).
            MailboxFull: the mailbox is at its bound.
        """
        concurrent = self._endpoints.get(call.method)
        if concurrent is None:
            known = ", ".join(sorted(self._endpoints)) or "none"
            raise UnknownEndpoint(
                f"actor {self.actor.name!r} ({type(self.actor).__name__}) has no endpoint "
                f"{call.method[:60]!r}; its endpoints: {known}"
            )
        roles = self._roles[call.method]
        if not may_call(call.caller, roles):
            self.actor.refused_calls += 1
            raise NotAllowed(
                f"{call.caller[:60]!r} may not call {type(self.actor).__name__}.{call.method}: it is open to "
                f"{', '.join(sorted(roles or ()))} (and admin) keys"
            )
        start = start and self._in_place[call.method]
        if concurrent:
            if start:
                self._start(call)
            else:
                self._spawn_task(self.run_call(call))
            return
        if start and self._parked and self._started is None and not self._starting and self._queue.empty():
            self._starting = True  # a call this one makes to its own actor as it starts queues behind it
            try:
                self._started = self._start(call)
            finally:
                self._starting = False
            if self._started is not None:
                self._started.add_done_callback(self._started_done)
            return
        try:
            self._queue.put_nowait(call)
        except asyncio.QueueFull:
            raise MailboxFull(
                f"actor {self.actor.name!r} has {self._queue.qsize()} messages waiting"
            ) from None

    def _start(self, call: Call) -> asyncio.Task[None] | None:
        """Runs ``call`` now until it first waits, in a context of its own; the task that runs the
        rest, or None where it ended without waiting.

        From Python 3.12 on, an eager task does this, and the call's first step runs as that task
        (``asyncio.timeout`` and ``wait_for`` there need it). Before 3.12 (a ``taskless_start``
        endpoint's call only) the step runs here, outside any task of its own, and what remains
        goes on in a task."""
        context = contextvars.copy_context()
        coro = self.run_call(call)
        if EAGER_TASKS:
            task = self._spawn_task(coro, context=context, eager_start=True)
            return None if task.done() else task
        try:
            waiting_on = context.run(coro.send, None)
        except StopIteration:
            return None
        except (Exception, asyncio.CancelledError):  # as a task's failure would be: logged; the actor goes on
            log.exception("%s.%s failed as it started", self.actor.name, call.method)
            return None
        return self._spawn_task(_resumed(coro, waiting_on), context=context)

    def _started_done(self, task: asyncio.Task[None]) -> None:
        if self._started is task:
            self._started = None

    async def run(self) -> None:
        """Takes messages one by one until cancelled (a call started at delivery first ends)."""
        try:
            while True:
                self._parked = True
                try:
                    call = await self._queue.get()
                finally:
                    self._parked = False
                if self._started is not None:
                    await asyncio.wait([self._started])
                await self.run_call(call)
        finally:
            if self._started is not None:  # stopped: the call in progress ends with the actor
                self._started.cancel()
            while not self._queue.empty():  # and the calls still waiting are answered, not left to time out
                self._answer_stopped(self._queue.get_nowait(), "was not run: the actor stopped first")

    def _answer_stopped(self, call: Call, what: str) -> None:
        """Tells ``call``'s caller (if it waits for an answer) that the call ended unanswered: ``what``.

        Not while the hosting runtime closes (its process ending, its node lost): a remote caller
        learns that from its liveness, which names the cause (a lost node, a lost stage), and an
        answer would race it with a vaguer one (a head would fail a step it can recover)."""
        if call.reply is not None and not self.actor.runtime.closed:
            self._spawn_task(call.reply(False, ActorStopped(
                f"{type(self.actor).__name__}.{call.method} on {self.actor.name!r} {what}")))

    async def stopped(self) -> None:
        """Waits for a call started at delivery to end, once the run loop was cancelled."""
        if self._started is not None:
            await asyncio.gather(self._started, return_exceptions=True)

    async def run_call(self, call: Call) -> None:
        _caller.set(call.caller)  # this call's context (a call started at once has a copy of its own)
        _reply_to.set(call.reply_to)
        method = getattr(self.actor, call.method)
        signature = self._signatures[call.method]
        plan = self._positional[call.method]
        try:
            if not call.kwargs and plan is not None and plan.takes(call.args):
                args, kwargs = call.args, call.kwargs  # what bind would make of them, checked in a tenth of its time
            else:
                bound = signature.bind(*call.args, **call.kwargs)
                _check_records(bound.arguments, self._records[call.method])
                args, kwargs = list(bound.args), bound.kwargs
        except TypeError as exc:
            log.warning("%s.%s: bad arguments: %s", self.actor.name, call.method, exc)
            error = BadArguments(f"{type(self.actor).__name__}.{call.method}{signature}: {exc}")
            if call.reply is not None:
                await call.reply(False, error)
            return
        try:
            result = await method(*args, **kwargs)
        except asyncio.CancelledError:
            # Cancelled where it ran (the actor stopping, or an owner cancelling the work the call was
            # doing): the caller hears so now rather than at its timeout. A caller that cancelled the
            # call itself is gone, and its answer is dropped.
            self._answer_stopped(call, "was cancelled before it answered")
            raise
        except Exception as exc:
            await self._fail(call, exc)
            return
        except (SystemExit, KeyboardInterrupt) as exc:  # a job's code run on the loop: not the node's exit
            await self._fail(call, exit_error(exc, f"{type(self.actor).__name__}.{call.method}"))
            return
        if call.reply is not None:
            await call.reply(True, result)

    async def _fail(self, call: Call, exc: Exception) -> None:
        if call.reply is None and isinstance(exc, ActorError):  # a typed refusal: one short line
            log.warning("%s.%s (told) refused: %.200s", self.actor.name, call.method, exc)
        elif call.reply is None:
            log.error("%s.%s (told, no one to answer) raised", self.actor.name, call.method, exc_info=exc)
        try:
            await self.actor.on_failure(call.method, exc)
        except Exception:
            log.exception("%s.on_failure raised", self.actor.name)
        if call.reply is not None:
            await call.reply(False, exc)
