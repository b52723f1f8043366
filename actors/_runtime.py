"""One runtime per process: hosts actors and carries their calls, locally or over ZeroMQ.

Every message between runtimes is one wire message (see ``transport.wire``)::

    request  {"t": "req", "id": ID or None, "to": ACTOR, "m": METHOD, "a": ARGS, "k": KWARGS, "r": REPLY_ADDRESS or None}
    reply    {"t": "rep", "id": ID, "ok": true, "v": VALUE} | {"t": "rep", "id": ID, "ok": false, "e": ERROR}

A call to an actor in the same runtime never touches the network. The runtime owns
every task it starts and cancels them all in :meth:`Runtime.aclose`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import zmq

from actors._actor import Actor, Call, Mailbox
from actors._errors import (
    ActorError,
    ActorStopped,
    ActorTimeout,
    UnknownActor,
    error_from_wire,
    error_to_wire,
)
from actors._ref import ActorRef
from transport.channel import ChannelClosed, Receiver, Sender, open_receiver, open_sender
from transport.wire import DEFAULT_MAX_MESSAGE_BYTES, WireError, decode_message

__all__ = ["Runtime", "open_runtime"]

log = logging.getLogger(__name__)


@asynccontextmanager
async def open_runtime(
    bind: str = "ipc://",
    *,
    allow_remote: bool = False,
    hwm: int = 256,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> AsyncIterator[Runtime]:
    """Starts a runtime listening at ``bind`` and closes it, with all its actors, on exit."""
    context: zmq.Context[Any] = zmq.Context()
    receiver = open_receiver(
        bind, hwm=hwm, max_message_bytes=max_message_bytes, allow_remote=allow_remote, context=context
    )
    runtime = Runtime(receiver, context=context, hwm=hwm, max_message_bytes=max_message_bytes)
    try:
        yield runtime
    finally:
        await runtime.aclose()


class Runtime:
    """Hosts actors, routes calls, and owns the tasks and sockets that do so."""

    def __init__(
        self, receiver: Receiver, *, context: zmq.Context[Any], hwm: int, max_message_bytes: int
    ) -> None:
        self._receiver = receiver
        self._context = context
        self._hwm = hwm
        self._max_message_bytes = max_message_bytes
        self.address: str = receiver.address
        self._mailboxes: dict[str, Mailbox] = {}
        self._mailbox_tasks: dict[str, asyncio.Task[None]] = {}
        self._senders: dict[str, Sender] = {}
        self._pending: dict[int, tuple[asyncio.Future[Any], str]] = {}
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        receiver.pump(self._on_frames)

    # -- tasks ---------------------------------------------------------------------

    def spawn_task(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        """Starts a task this runtime owns: cancelled on close, its failure logged."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    # -- actors --------------------------------------------------------------------

    async def spawn(self, actor: Actor, name: str) -> ActorRef:
        """Starts ``actor`` under ``name``: runs its ``on_start``, then its mailbox.

        Raises:
            ValueError: the name is taken.
            Exception: whatever ``on_start`` raised (the actor is not started).
        """
        if self._closed:
            raise ActorStopped(f"runtime at {self.address} is closed")
        if name in self._mailboxes:
            raise ValueError(f"an actor named {name!r} already runs at {self.address}")
        actor.name, actor.runtime, actor.ref = name, self, ActorRef(self, self.address, name)
        try:
            await actor.on_start()
        except Exception as exc:
            await actor.on_failure("on_start", exc)
            raise
        mailbox = Mailbox(actor, lambda coro: self.spawn_task(coro, name=f"{name} concurrent call"))  # type: ignore[arg-type]
        self._mailboxes[name] = mailbox
        self._mailbox_tasks[name] = self.spawn_task(mailbox.run(), name=f"mailbox {name}")
        return actor.ref

    async def stop_actor(self, name: str) -> None:
        """Stops actor ``name`` after its current message and runs its ``on_stop``."""
        mailbox = self._mailboxes.pop(name, None)
        if mailbox is None:
            raise UnknownActor(f"no actor named {name!r} at {self.address}")
        task = self._mailbox_tasks.pop(name)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
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
        if self._closed:
            raise ActorStopped(f"runtime at {self.address} is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        call_id = next(self._ids)
        self._pending[call_id] = (future, ref.address)
        timer = asyncio.timeout(timeout)
        try:
            async with timer:
                if ref.address == self.address:
                    self._deliver_local(ref.name, Call(method=method, args=args, kwargs=kwargs,
                                                       reply=_resolve_into(future)))
                else:
                    await self._send(ref.address, _request(call_id, ref.name, method, args, kwargs, self.address))
                return await future
        except TimeoutError:
            if not timer.expired():
                raise  # the remote's own ActorTimeout (it waited for something): reported as the remote's
            raise ActorTimeout(
                f"no reply from {ref.name}.{method} at {ref.address} within {timeout}s"
            ) from None
        finally:
            self._pending.pop(call_id, None)

    async def tell(self, ref: ActorRef, method: str, args: list[Any], kwargs: dict[str, Any]) -> int:
        """Sends a call whose outcome nobody waits for; returns the bytes sent."""
        if ref.address == self.address:
            try:
                self._deliver_local(ref.name, Call(method=method, args=args, kwargs=kwargs, reply=None))
            except ActorError as exc:
                log.warning("tell %s.%s: %s", ref.name, method, exc)
            return 0
        return await self._send(ref.address, _request(None, ref.name, method, args, kwargs, None))

    def fail_calls_to(self, address: str, error: ActorError) -> int:
        """Fails every pending call to the runtime at ``address`` (it was lost); returns how many."""
        failed = 0
        for future, target in list(self._pending.values()):
            if target == address and not future.done():
                future.set_exception(error)
                failed += 1
        return failed

    def _deliver_local(self, name: str, call: Call) -> None:
        mailbox = self._mailboxes.get(name)
        if mailbox is None:
            raise UnknownActor(
                f"no actor named {name!r} at {self.address}; running: {', '.join(self._mailboxes) or 'none'}"
            )
        mailbox.deliver(call)

    async def _send(self, address: str, message: dict[str, Any]) -> int:
        sender = self._senders.get(address)
        if sender is None:
            sender = open_sender(
                address,
                hwm=self._hwm,
                max_message_bytes=self._max_message_bytes,
                linger_ms=500,
                context=self._context,
            )
            self._senders[address] = sender
        return await sender.send(message)

    # -- the receive side ------------------------------------------------------------

    def _on_frames(self, frames: list[Any]) -> None:
        """Decodes and dispatches one message, from the receiver's reader callback."""
        try:
            message = decode_message(frames, max_bytes=self._max_message_bytes)
        except WireError as exc:
            log.warning("dropped a malformed message: %s", exc)
            return
        try:
            self._dispatch(message)
        except Exception:  # a bug here must not stop the runtime from serving
            log.exception("could not dispatch a message")

    def _dispatch(self, message: Any) -> None:
        kind = message.get("t") if isinstance(message, dict) else None
        if kind == "rep":
            self._on_reply(message)
        elif kind == "req":
            self._on_request(message)
        else:
            log.warning("dropped a message that is neither request nor reply: %.200r", message)

    def _on_reply(self, message: dict[str, Any]) -> None:
        entry = self._pending.get(message.get("id"))  # type: ignore[arg-type]
        if entry is None or entry[0].done():
            log.debug("reply %r came after its caller stopped waiting", message.get("id"))
            return
        future = entry[0]
        if message.get("ok") is True:
            future.set_result(message.get("v"))
        else:
            future.set_exception(error_from_wire(message.get("e")))

    def _on_request(self, message: dict[str, Any]) -> None:
        call_id, reply_to = message.get("id"), message.get("r")
        name, method = message.get("to"), message.get("m")
        args, kwargs = message.get("a", []), message.get("k", {})
        reply = None
        if isinstance(reply_to, str) and isinstance(call_id, int):
            reply = self._remote_replier(reply_to, call_id)
        if not (isinstance(name, str) and isinstance(method, str) and isinstance(args, list)
                and isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
            log.warning("dropped a malformed request: %.200r", message)
            if reply is not None:
                self.spawn_task(reply(False, ActorError("malformed request: needs to, m, a, k")))
            return
        try:
            self._deliver_local(name, Call(method=method, args=args, kwargs=kwargs, reply=reply))
        except ActorError as exc:
            log.warning("request %s.%s from %s: %s", name, method, reply_to, exc.message)
            if reply is not None:
                self.spawn_task(reply(False, exc))

    def _remote_replier(self, address: str, call_id: int) -> Any:
        async def reply(ok: bool, value: Any) -> None:
            message = {"t": "rep", "id": call_id, "ok": ok}
            message["v" if ok else "e"] = value if ok else error_to_wire(value)
            try:
                await self._send(address, message)
            except (TypeError, ValueError) as exc:  # the result cannot travel
                err = {"t": "rep", "id": call_id, "ok": False, "e": error_to_wire(exc)}
                await self._send(address, err)
            except ChannelClosed:
                log.debug("runtime closed before reply %d to %s left", call_id, address)

        return reply

    # -- shutdown ------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stops every actor, cancels every task, closes every socket; idempotent."""
        if self._closed:
            return
        self._closed = True
        for name in list(self._mailboxes):
            await self.stop_actor(name)
        await self._receiver.aclose()
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(ActorStopped(f"runtime at {self.address} closed before the reply"))
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sender in self._senders.values():
            await sender.aclose()
        self._senders.clear()
        self._context.term()

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


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


