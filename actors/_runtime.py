"""One runtime per process: hosts actors and carries their calls, locally or over ZeroMQ.

Every message between runtimes is one wire message (see ``transport.wire``)::

    request  {"t": "req", "id": ID or None, "to": ACTOR, "m": METHOD, "a": ARGS, "k": KWARGS, "r": REPLY_ADDRESS or None}
    reply    {"t": "rep", "id": ID, "ok": true, "v": VALUE} | {"t": "rep", "id": ID, "ok": false, "e": ERROR}

A call to an actor in the same runtime never touches the network. The runtime owns
every task it starts and cancels them all in :meth:`Runtime.aclose`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from contextlib import asynccontextmanager
from typing import Any

import zmq

from actors._actor import INSECURE, LOCAL, Actor, Call, Mailbox, current_caller, current_reply_address
from actors._errors import (
    ActorError,
    ActorStopped,
    BadRecord,
    MessageLost,
    NotAllowed,
    UnknownActor,
    error_from_wire,
    error_to_wire,
    exit_error,
)
from actors._calls import PendingCalls
from actors._ref import ActorRef
from actors._senders import SenderPool, SenderPoolConfig, _is_numeric_address
from actors._key_names import LONGEST, KeyNames, key_name
from actors._streams import OPEN_KIND, RuntimeStreams
from transport.channel import BulkMode, Receiver, open_receiver, open_sender
from transport.security import Gate, Keypair, shown
from transport.wire import DEFAULT_MAX_MESSAGE_BYTES, WireError, decode_message, encode_message, excerpt

__all__ = ["Runtime", "open_runtime"]

log = logging.getLogger(__name__)


@asynccontextmanager
async def open_runtime(
    bind: str = "ipc://",
    *,
    allow_remote: bool = False,
    hwm: int = 256,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    keys: Keypair | None = None,
    ring: Callable[[], Mapping[bytes, str]] | None = None,
    sender_pool: SenderPoolConfig = SenderPoolConfig(),
    bulk: BulkMode = "encrypt",
    streams: bool = True,
) -> AsyncIterator[Runtime]:
    """Starts a runtime listening at ``bind`` and closes it, with all its actors, on exit.

    Args:
        keys: speak CURVE with this keypair (see :mod:`transport.security`): the
            receiver admits only the keys of ``ring``, every message carries its
            sender's name from the ring (``actors.current_caller()`` in an endpoint),
            and this runtime's address ends in its public key. Without keys every
            peer that can reach the address is trusted.
        ring: the admitted keys, public key -> ``role:name``; required with ``keys``.
        sender_pool: bounds on the sockets to other runtimes (see ``actors._senders``):
            how many stay open, how long an idle one lives, how long a reply may wait.
        bulk: with keys, how messages to other secure runtimes travel (see
            ``transport.channel.open_sender``): sealed with AES-GCM in a session opened
            over CURVE (``"encrypt"``), authenticated but in the clear (``"authenticate"``,
            for a trusted network), or all through CURVE (``"curve"``).
        streams: with keys, ``bulk="encrypt"`` and an ``ipc://`` address, messages to other
            such runtimes on this host go over a stream each loop drives itself (see
            ``actors._streams``), and this runtime takes theirs.
    """
    if (keys is None) != (ring is None):
        raise ValueError("open_runtime takes keys and ring together")
    context: zmq.Context[Any] = zmq.Context()
    gate = Gate(context, ring) if ring is not None else None
    try:
        receiver = open_receiver(
            bind, hwm=hwm, max_message_bytes=max_message_bytes, allow_remote=allow_remote, context=context,
            curve=keys,
        )
    except BaseException:
        if gate is not None:
            gate.stop()
        context.term()
        raise
    runtime = Runtime(receiver, context=context, hwm=hwm, max_message_bytes=max_message_bytes, keys=keys,
                      gate=gate, sender_pool=sender_pool, bulk=bulk, streams=streams)
    try:
        await runtime.streams.start()
        yield runtime
    finally:
        await runtime.aclose()


class OwnedTasks:
    """The tasks a runtime owns: each cancelled when it closes, and its failure logged, unless the task
    is ``awaited``: its caller waits for it and takes its outcome (a step's failure that the step's
    report carries is not an error of the runtime's)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str | None, context: contextvars.Context | None,
              eager_start: bool, awaited: bool) -> asyncio.Task[Any]:
        loop = asyncio.get_running_loop()
        task: asyncio.Task[Any] = (
            asyncio.Task(coro, loop=loop, name=name, context=context, eager_start=True)  # type: ignore[call-arg]
            if eager_start else loop.create_task(coro, name=name, context=context))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard if awaited else self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def cancel_all(self) -> None:
        """Cancels every task still running, and waits for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Runtime:
    """Hosts actors, routes calls, and owns the tasks and sockets that do so."""

    def __init__(
        self, receiver: Receiver, *, context: zmq.Context[Any], hwm: int, max_message_bytes: int,
        keys: Keypair | None = None, gate: Gate | None = None,
        sender_pool: SenderPoolConfig = SenderPoolConfig(), bulk: BulkMode = "encrypt", streams: bool = False,
    ) -> None:
        self._receiver = receiver
        self._started_round = (-1, -1)  # the reads (ZeroMQ's, the streams') whose first request started at once
        self.keys = keys  # this runtime's CURVE keypair (None: insecure)
        self._gate = gate
        self._key_names = KeyNames(gate)  # whose key each address carries: who may answer a call, or be answered
        self.context = context  # its sockets' zmq context (its CURVE gate admits the cluster's keys)
        self.max_message_bytes = max_message_bytes  # the largest message it takes
        self.encrypts = keys is not None and bulk != "authenticate"  # what it seals is encrypted
        self.address: str = receiver.address
        # Messages to and from runtimes on this host go on streams (see actors._streams): encrypted only.
        self.streams = RuntimeStreams(self.address, self._on_frames, max_bytes=max_message_bytes,
                                      enabled=streams and keys is not None and bulk == "encrypt",
                                      spawn_task=self.spawn_task)
        self._mailboxes: dict[str, Mailbox] = {}
        self._starting: set[str] = set()  # names whose actor is in on_start
        self._mailbox_tasks: dict[str, asyncio.Task[None]] = {}
        open_zmq = functools.partial(open_sender, hwm=hwm, max_message_bytes=max_message_bytes, linger_ms=500,
                                     context=context, curve=keys, bulk=bulk)
        self._senders = SenderPool(lambda address: self.streams.sender(open_zmq(address)), sender_pool,
                                   spawn_task=self.spawn_task)
        self._calls = PendingCalls()
        self._tasks = OwnedTasks()
        self.closed = False  # aclose has begun: no call leaves any more
        receiver.pump(self._on_frames)
        receiver.on_lost(self._messages_lost)

    # -- tasks ---------------------------------------------------------------------

    def spawn_task(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None,
                   context: contextvars.Context | None = None, eager_start: bool = False,
                   awaited: bool = False) -> asyncio.Task[Any]:
        """Starts a task this runtime owns (in ``context``, else a copy of the current one; see
        :class:`OwnedTasks`). ``eager_start`` (Python 3.12 on): it runs here until it first waits."""
        return self._tasks.spawn(coro, name=name, context=context, eager_start=eager_start, awaited=awaited)

    # -- actors --------------------------------------------------------------------

    async def spawn(self, actor: Actor, name: str) -> ActorRef:
        """Starts ``actor`` under ``name``: runs its ``on_start``, then its mailbox.

        Raises:
            ValueError: the name is taken.
            Exception: whatever ``on_start`` raised (the actor is not started).
        """
        if self.closed:
            raise ActorStopped(f"runtime at {shown(self.address)} is closed")
        if name in self._mailboxes or name in self._starting:
            raise ValueError(f"an actor named {name!r} already runs at {shown(self.address)}")
        actor.name, actor.runtime, actor.ref = name, self, ActorRef(self, self.address, name)
        self._starting.add(name)  # spawns may overlap (a node builds several jobs' stages at once)
        try:
            await actor.on_start()
        except Exception as exc:
            await actor.on_failure("on_start", exc)
            raise
        except (SystemExit, KeyboardInterrupt) as exc:  # a job's code on the loop: not the node's exit
            error = exit_error(exc, f"{type(actor).__name__}.on_start")
            await actor.on_failure("on_start", error)
            raise error from None
        finally:
            self._starting.discard(name)
        mailbox = Mailbox(actor, lambda coro, **how: self.spawn_task(coro, name=f"{name} call", **how))
        self._mailboxes[name] = mailbox
        self._mailbox_tasks[name] = self.spawn_task(mailbox.run(), name=f"mailbox {name}")
        return actor.ref

    async def stop_actor(self, name: str) -> None:
        """Stops actor ``name`` after its current message and runs its ``on_stop``."""
        mailbox = self._mailboxes.pop(name, None)
        if mailbox is None:
            raise UnknownActor(f"no actor named {name!r} at {shown(self.address)}")
        task = self._mailbox_tasks.pop(name)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await mailbox.stopped()
        try:
            await mailbox.actor.on_stop()
        except Exception:
            log.exception("%s.on_stop raised", name)

    def actor_names(self) -> list[str]:
        return list(self._mailboxes)

    def ref(self, address: str, name: str) -> ActorRef:
        """A ref to actor ``name`` in the runtime at ``address``."""
        return ActorRef(self, address, name)

    # -- calls ---------------------------------------------------------------------

    async def ask(
        self, ref: ActorRef, method: str, args: list[Any], kwargs: dict[str, Any], *, timeout: float | None
    ) -> Any:
        """Calls ``ref.method(*args, **kwargs)`` and returns its result (see ActorRef.ask)."""
        if self.closed:
            raise ActorStopped(f"runtime at {shown(self.address)} is closed")
        call_id, future = self._calls.open(ref.address, timeout, f"{ref.name}.{method}")
        try:
            if ref.address == self.address:
                self._deliver_local(ref.name, Call(method=method, args=args, kwargs=kwargs,
                                                   reply=_resolve_into(future)))
            else:
                request = encode_message(_request(call_id, ref.name, method, args, kwargs, self.address),
                                         max_bytes=self.max_message_bytes)
                if self._senders.send_now(ref.address, request) is None:  # no room now: wait, unless the call fails
                    await self._calls.send_unless_failed(call_id, future, self._senders.send_frames(ref.address,
                                                                                                    request))
            return await future
        finally:
            self._calls.close(call_id)

    async def tell(self, ref: ActorRef, method: str, args: list[Any], kwargs: dict[str, Any]) -> int:
        """Sends a call whose outcome nobody waits for; returns the bytes sent."""
        if ref.address == self.address:
            try:
                self._deliver_local(ref.name, Call(method=method, args=args, kwargs=kwargs, reply=None))
            except ActorError as exc:
                log.warning("tell %s.%s: %s", ref.name, method, exc)
            return 0
        self._calls.refuse(ref.address)
        return await self._send(ref.address, _request(None, ref.name, method, args, kwargs, None))

    def fail_calls_to(self, address: str, error: ActorError) -> int:
        """Fails every pending call to the runtime at ``address`` (it was lost); returns how many."""
        return self._calls.fail_calls_to(address, error)

    def mark_lost(self, address: str, error: ActorError) -> None:
        """The process at ``address`` ended for good (its node saw it go): its pending calls fail with
        ``error``, and so does every later call to it, at once instead of at its timeout."""
        self._calls.mark_lost(address, error)

    def lost(self, address: str) -> ActorError | None:
        """Why the process at ``address`` ended, when its node said so (:meth:`mark_lost`); else None."""
        return self._calls.lost(address)

    def caller_address(self) -> str:
        """The address of the runtime that made the call being served, checked to be the caller's own
        (see :func:`own_address`); a call from this process: this runtime's address.

        Raises:
            NotAllowed: a ``tell`` (no reply address), or an address that is not the caller's own.
        """
        caller = current_caller()
        return self.address if caller == LOCAL else own_address(caller, current_reply_address(), self._gate)

    def callers_own(self, address: str) -> bool:
        """Whether ``address`` carries the key of the caller being served (always, without keys, or for
        a call from this process)."""
        caller = current_caller()
        return caller == LOCAL or self._key_names.holds(address, caller)

    def _deliver_local(self, name: str, call: Call, *, start: bool = True) -> None:
        mailbox = self._mailboxes.get(name)
        if mailbox is None:
            # Which actors run here is this process's business (other clients' jobs among them):
            # the caller learns only that the name is unknown; the debug log here says what runs.
            log.debug("no actor named %s here; running: %s", excerpt(name), ", ".join(self._mailboxes) or "none")
            raise UnknownActor(f"no actor named {name!r} at {shown(self.address)}")
        mailbox.deliver(call, start=start)

    async def _send(self, address: str, message: dict[str, Any]) -> int:
        """Encodes and sends ``message``: at once when it can leave now, else waiting for room."""
        frames = encode_message(message, max_bytes=self.max_message_bytes)
        sent = self._senders.send_now(address, frames)
        return sent if sent is not None else await self._senders.send_frames(address, frames)

    # -- the receive side ------------------------------------------------------------

    def _on_frames(self, frames: list[Any]) -> None:
        """Decodes and dispatches one message, from the receiver's reader callback."""
        bad_records: list[WireError] = []
        try:
            message = decode_message(frames, max_bytes=self.max_message_bytes, bad_records=bad_records)
        except WireError as exc:
            log.warning("dropped a malformed message: %s", exc)
            return
        # Who sent it: the name the key ring gives its CURVE key (the gate set it at the handshake).
        caller = str(frames[0].get("User-Id")) if self.keys is not None else INSECURE
        try:
            if bad_records:
                self._refuse_bad_records(message, bad_records, caller)
            else:
                self._dispatch(message, caller)
        except Exception:  # a bug here must not stop the runtime from serving
            log.exception("could not dispatch a message")

    def _messages_lost(self, member: str, why: str) -> None:
        """A message ``member`` sent here over ZeroMQ may have been lost (:meth:`Receiver.on_lost`): the calls
        waiting on its replies fail with :class:`MessageLost` now, and every actor here hears of it."""
        log.warning("a message from %s may have been lost on the way: %s", excerpt(member, 80), excerpt(why, 200))
        self._calls.fail_calls_where(lambda address: key_name(address, self._gate) == member,
                                     functools.partial(_reply_lost, member, why))
        for name, mailbox in list(self._mailboxes.items()):
            try:
                mailbox.actor.on_messages_lost(member, why)
            except Exception:
                log.exception("%s.on_messages_lost raised", name)

    def _refuse_bad_records(self, message: Any, bad_records: list[WireError], caller: str) -> None:
        """Answers a message whose records could not be rebuilt with a typed error, where someone waits."""
        reasons = "; ".join(excerpt(str(exc), 300) for exc in bad_records[:3])
        error = BadRecord(f"{len(bad_records)} record(s) could not be rebuilt at {shown(self.address)}: {reasons}")
        kind = message.get("t") if isinstance(message, dict) else None
        if kind == "rep":
            future = self._key_names.answered(self._calls, message, caller)
            if future is not None:
                future.set_exception(BadRecord(f"the reply's {error.message}"))
                return
        elif kind == "req" and (route := self._key_names.route(message, caller)) is not None:
            log.warning("refused a request to %s.%s: %s", excerpt(message.get("to")), excerpt(message.get("m")),
                        excerpt(error.message, 300))
            self.spawn_task(_remote_replier(self._senders, self.max_message_bytes, *route)(False, error))
            return
        log.warning("dropped a message: %s", excerpt(error.message, 300))

    def _dispatch(self, message: Any, caller: str = INSECURE) -> None:
        kind = message.get("t") if isinstance(message, dict) else None
        if kind == "rep":
            self._on_reply(message, caller)
        elif kind == "req":
            self._on_request(message, caller)
        elif kind == OPEN_KIND and caller not in (INSECURE, LOCAL):
            self.streams.open(message.get("o"), caller)
        else:
            log.warning("dropped a message that is neither request nor reply: %s", excerpt(message, 200))

    def _on_reply(self, message: dict[str, Any], caller: str) -> None:
        if (future := self._key_names.answered(self._calls, message, caller)) is None:
            return
        if message.get("ok") is True:
            future.set_result(message.get("v"))
        else:
            future.set_exception(error_from_wire(message.get("e")))

    def _on_request(self, message: dict[str, Any], caller: str = INSECURE) -> None:
        route = self._key_names.route(message, caller)
        if route is None and message.get("r") is not None:
            return  # a reply address that is not the caller's, or no well-formed one: nobody to answer
        reply = _remote_replier(self._senders, self.max_message_bytes, *route) if route is not None else None
        name: Any = message.get("to")
        method: Any = message.get("m")
        args, kwargs = message.get("a", []), message.get("k", {})
        if not _well_formed(name, method, args, kwargs):
            log.warning("dropped a malformed request: %s", excerpt(message, 200))
            if reply is not None:
                self.spawn_task(reply(False, ActorError(
                    f"malformed request: needs to, m, a, k, with names of at most {LONGEST} characters")))
            return
        # Only the first request of a read starts at once: a burst is read whole (see docs/nodes.md).
        rounds = (self._receiver.rounds, self.streams.rounds)
        start, self._started_round = rounds != self._started_round, rounds
        try:
            self._deliver_local(name, Call(method=method, args=args, kwargs=kwargs, reply=reply, caller=caller,
                                           reply_to=route[0] if route is not None else None), start=start)
        except ActorError as exc:
            log.warning("request %s.%s from %s: %s", excerpt(name), excerpt(method), excerpt(message.get("r")),
                        excerpt(exc.message, 200))
            if reply is not None:
                self.spawn_task(reply(False, exc))

    # -- shutdown ------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stops every actor, cancels every task, closes every socket; idempotent."""
        if self.closed:
            return
        self.closed = True
        for name in list(self._mailboxes):
            await self.stop_actor(name)
        await self._receiver.aclose()
        self.streams.close()
        self._calls.fail_all(lambda: ActorStopped(f"runtime at {shown(self.address)} closed before the reply"))
        await self._tasks.cancel_all()
        await self._senders.aclose()
        if self._gate is not None:
            self._gate.stop()
        self.context.term()

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _remote_replier(senders: SenderPool, max_bytes: int, address: str, call_id: int) -> Any:
    """How a request's answer goes back to ``address`` (its caller's, checked) under ``call_id``.

    The actor does not wait for its caller: a reply that cannot leave at once goes from a
    task, and is dropped if the caller does not take it within the pool's reply timeout (the
    caller may be gone, or never was).
    """
    async def reply(ok: bool, value: Any) -> None:
        message = {"t": "rep", "id": call_id, "ok": ok}
        message["v" if ok else "e"] = value if ok else error_to_wire(value)
        try:
            frames = encode_message(message, max_bytes=max_bytes)
        except (TypeError, ValueError) as exc:  # the result cannot travel
            err = {"t": "rep", "id": call_id, "ok": False, "e": error_to_wire(exc)}
            frames = encode_message(err, max_bytes=max_bytes)
        await senders.reply(address, frames)

    return reply


def _well_formed(name: Any, method: Any, args: Any, kwargs: Any) -> bool:
    """Whether a request names an actor and a method, short enough, with a list and a map of arguments."""
    return (isinstance(name, str) and len(name) <= LONGEST and isinstance(method, str) and len(method) <= LONGEST
            and isinstance(args, list) and isinstance(kwargs, dict)
            and all(isinstance(k, str) and len(k) <= LONGEST for k in kwargs))


def _request(
    call_id: int | None, name: str, method: str, args: list[Any], kwargs: dict[str, Any], reply_to: str | None
) -> dict[str, Any]:
    return {"t": "req", "id": call_id, "to": name, "m": method, "a": args, "k": kwargs, "r": reply_to}


def _resolve_into(future: asyncio.Future[Any]) -> Any:
    async def reply(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value if isinstance(value, ActorError) else _as_remote(value))

    return reply


def _as_remote(exc: BaseException) -> ActorError:
    """A local endpoint's exception, shaped like a remote one so callers see one type."""
    return error_from_wire(error_to_wire(exc))


def _reply_lost(member: str, why: str, address: str) -> MessageLost:
    """The error of a call to ``address`` whose reply may have been lost on the way from ``member``."""
    return MessageLost(f"a message from {shown(address)} ({member}) may have been lost on the way, the call's "
                       f"reply among them: {why}", details={"member": member})


def own_address(caller: str, address: str | None, gate: Gate | None) -> str:
    """``address``, the one ``caller``'s request named for its reply, once it is the caller's own.

    It must be a numeric ``tcp://`` or an ``ipc://`` address (no name to look up), and,
    with keys (``gate``), carry the caller's own public key: whatever connects there must
    prove it holds that key, so nothing sent there reaches anyone else. Without keys
    every peer is trusted, and the reply address is taken as it is.

    Raises:
        NotAllowed: no address (a ``tell``), or one that is not the caller's own.
    """
    if address is None:
        raise NotAllowed(f"{caller[:60]!r} sent no reply address (a tell): call it, from the runtime that "
                         "is to be reached")
    if not _is_numeric_address(address) or (gate is not None and key_name(address, gate) != caller):
        raise NotAllowed(f"{caller[:60]!r} called from {excerpt(address, 120)}, which is not its own address: "
                         "a subscriber is reached only at the address of the runtime that called, and that "
                         "address must carry the caller's own key")
    return address
