"""The errors an actor call can raise at the caller, and how they cross the wire.

Errors travel as data (a kind, the remote type name, message and traceback text),
never as pickled objects. The caller rebuilds only the classes named in
:data:`ERROR_KINDS`; anything else arrives as :class:`RemoteError`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = [
    "ActorError",
    "ActorStopped",
    "ActorTimeout",
    "BUILTIN_KINDS",
    "BadArguments",
    "BadRecord",
    "HeadLost",
    "LimitExceeded",
    "MailboxFull",
    "NodeLost",
    "NonFiniteError",
    "NotAllowed",
    "RemoteError",
    "StepFailed",
    "TooManySubscribers",
    "UnknownActor",
    "UnknownEndpoint",
    "UserCodeExit",
    "builtin_base",
    "calling",
    "contained",
    "error_from_wire",
    "exit_error",
    "names_type",
    "error_to_wire",
    "remote_error_class",
]


class ActorError(Exception):
    """Base of every error an actor call raises at the caller.

    Attributes:
        remote_type: the qualified type name of the exception on the remote side.
        remote_traceback: the remote traceback as text ('' when raised locally).
    """

    def __init__(
        self,
        message: str,
        *,
        remote_type: str = "",
        remote_traceback: str = "",
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.remote_type = remote_type or type(self).__name__
        self.remote_traceback = remote_traceback
        self.details: dict[str, Any] = details or {}  # plain data; travels with the error

    def __str__(self) -> str:
        if not self.remote_traceback:
            return self.message
        return f"{self.message}\n--- remote traceback ---\n{self.remote_traceback.rstrip()}"

    def raised(self, *types: type[BaseException]) -> bool:
        """Whether the remote side raised one of ``types``: :func:`names_type` on :attr:`remote_type`."""
        return names_type(self.remote_type, *types)


def names_type(qualified: str, *types: type[BaseException]) -> bool:
    """Whether ``qualified`` (an error's type as it travels: ``"transport.stream.StreamBroken"``, or the
    head of a failure's ``cause``, ``"StreamBroken: ..."``) names one of ``types``, by class name: the
    remote side's module path need not be this process's."""
    name = qualified.partition(":")[0].rpartition(".")[2]
    return any(name == cls.__name__ for cls in types)


class RemoteError(ActorError):
    """An endpoint raised; ``remote_type`` names the original exception's type.

    Where that type is, or derives from, one of Python's own (:data:`BUILTIN_KINDS`: ``ValueError``,
    ``TypeError``, ``KeyError``, ``RuntimeError``, ``FileNotFoundError``...), the error is also an
    instance of that builtin (:func:`remote_error_class`), so ``except ValueError`` catches a
    remote ``ValueError`` as it would a local one; ``except RemoteError`` still catches it too.
    """

    def __str__(self) -> str:
        head = f"{self.remote_type}: {self.message}"
        if not self.remote_traceback:
            return head
        return f"{head}\n--- remote traceback ---\n{self.remote_traceback.rstrip()}"


class UnknownActor(ActorError):
    """No actor of that name lives at that address."""


class UnknownEndpoint(ActorError):
    """The actor has no endpoint of that name."""


class BadArguments(ActorError, TypeError):
    """The arguments do not bind to the endpoint's signature."""


class BadRecord(ActorError, ValueError):
    """A record in a call or its reply that the receiver cannot rebuild.

    Its name is registered to no class there (the module that defines it is not
    imported, or the two sides run different versions), or its fields do not fit
    the class (an unknown key, a required one missing). The call did not run.
    """


class ActorTimeout(ActorError, TimeoutError):
    """No reply came within the timeout."""


class ActorStopped(ActorError):
    """The actor (or the runtime hosting it) stopped before it replied."""


class MailboxFull(ActorError):
    """The actor's mailbox is at its bound; retry later or send less at once."""


class NotAllowed(ActorError, PermissionError):
    """An import path or actor class the node does not admit."""


class LimitExceeded(NotAllowed):
    """A request past a limit the operator set (``python -m actors.node --head --limit NAME=VALUE``):
    ``limit`` names it, ``value`` is what was asked and ``allowed`` the most the cluster takes."""

    @property
    def limit(self) -> str:
        return str(self.details.get("limit", ""))

    @property
    def value(self) -> Any:
        return self.details.get("value")

    @property
    def allowed(self) -> Any:
        return self.details.get("allowed")


class UserCodeExit(ActorError):
    """A job's own code (a model, data or loss factory, a module it imports) called ``sys.exit``
    or raised ``KeyboardInterrupt``: the call fails with this, and the node goes on serving."""


def contained(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, with a ``SystemExit`` or ``KeyboardInterrupt`` it raises turned into :class:`UserCodeExit`.

    Every place a node runs a job's code (building a stage, a step's compute, inspecting a
    model, importing a factory) runs it through this, on whichever thread: left alone,
    such an exception ends the event loop that serves every job on the node. (The node's
    own SIGINT and SIGTERM are loop signal handlers, never a ``KeyboardInterrupt``.)
    """
    try:
        return fn(*args)
    except (SystemExit, KeyboardInterrupt) as exc:
        raise exit_error(exc, getattr(fn, "__qualname__", None) or type(fn).__name__) from None


@contextlib.contextmanager
def calling(what: str) -> Iterator[None]:
    """Notes ``what`` (``"in the model factory pkg.mod:fn"``) on an exception the job's code raises
    inside the block, so that its caller learns which of the job's callables raised, and where: the
    note joins the message at the caller (:func:`error_to_wire`) as it joins a local traceback."""
    try:
        yield
    except Exception as exc:
        if not isinstance(exc, ActorError):
            exc.add_note(what)
        raise


def exit_error(exc: SystemExit | KeyboardInterrupt, where: str) -> UserCodeExit:
    """The :class:`UserCodeExit` for ``exc``, raised by a job's code in ``where``: the function that raised it,
    named from its traceback (``where``, the call that ran the job's code, names a wrapper: ``partial``)."""
    last = exc.__traceback__
    while last is not None and last.tb_next is not None:
        last = last.tb_next
    if last is not None:
        code = last.tb_frame.f_code
        where = f"{getattr(code, 'co_qualname', code.co_name)} ({os.path.basename(code.co_filename)}:{last.tb_lineno})"
    if isinstance(exc, SystemExit):
        return UserCodeExit(f"the job's code called sys.exit({exc.code!r}) in {where}; a factory, data source or "
                            "loss must return or raise an exception, never exit the process")
    return UserCodeExit(f"the job's code raised KeyboardInterrupt in {where}; nothing interrupted it: raise an "
                        "ordinary exception instead")
class TooManySubscribers(ActorError):
    """A publisher holds as many subscriptions as it takes, from this key or in all.

    Unsubscribe one (``Cluster.unsubscribe``, or close a connection); a subscriber
    that stops taking events is dropped at the next event it misses.
    """


class StepFailed(ActorError):
    """A training step failed; nothing was applied. ``stage``, ``action`` and ``cause`` say where and why."""

    @property
    def stage(self) -> int | None:
        return self.details.get("stage")

    @property
    def action(self) -> str | None:
        return self.details.get("action")

    @property
    def cause(self) -> str:
        return str(self.details.get("cause", ""))


class NodeLost(StepFailed):
    """A node of the job stopped answering (killed, stopped, cut off): ``node`` names it.

    Raised by a step the node was part of, and at once by every later call on the job
    (step, state, checkpoint) until the job recovers (``max_restarts``) or is closed.
    """

    @property
    def node(self) -> str:
        return str(self.details.get("node", ""))


class ActorLost(ActorError):
    """The process that hosted an actor ended without being told to (it exited, crashed or was
    killed): every pending and later call to it fails with this at once. ``details`` name the
    node and the actor where known; the message says how the process ended."""


class MessageLost(ActorError):
    """A message from the runtime a call went to may have been lost on the way (a sealed message
    refused on its session's own connection: tampered with or damaged; or one that never came),
    so the call's reply may never come: it fails at once, saying why, instead of at its timeout.
    The call may have run there."""


class StageLost(StepFailed):
    """A stage actor's own process ended (``exited with code 3``, ``killed by SIGSEGV``): its
    job's code exited or crashed there. Its node and every other job go on; this job cannot
    (every later call says so): close it and create it again, from a checkpoint.
    ``node`` names the node that hosted it."""

    @property
    def node(self) -> str:
        return str(self.details.get("node", ""))


class HeadLost(ActorStopped):
    """The driver lost the head: its process ended or it stopped answering pings."""
class NonFiniteError(StepFailed):
    """A loss or gradient of the step was NaN or infinite, so no stage stepped its optimizer.

    Raised with ``on_nonfinite="raise"``; ``nonfinite`` lists every finding (which stage
    and replica, and whether it was the loss or which parameter's gradient). The
    gradients were dropped, so the job can take its next step.
    """

    @property
    def nonfinite(self) -> list[str]:
        found = self.details.get("nonfinite")
        return [str(f) for f in found] if isinstance(found, list) else []


ERROR_KINDS: dict[str, type[ActorError]] = {
    cls.__name__: cls
    for cls in (
        RemoteError,
        UnknownActor,
        UnknownEndpoint,
        BadArguments,
        BadRecord,
        ActorTimeout,
        ActorStopped,
        MailboxFull,
        NotAllowed,
        LimitExceeded,
        UserCodeExit,
        TooManySubscribers,
        StepFailed,
        NodeLost,
        ActorLost,
        MessageLost,
        StageLost,
        HeadLost,
        NonFiniteError,
    )
}


# The builtin exception types a RemoteError may also be (see RemoteError): rebuilt by name, from
# this table alone; each takes one message argument. Nothing else a peer names is instantiated.
BUILTIN_KINDS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        ValueError, TypeError, KeyError, IndexError, LookupError, AttributeError, RuntimeError,
        NotImplementedError, AssertionError, ArithmeticError, ZeroDivisionError, OverflowError,
        ImportError, ModuleNotFoundError, OSError, FileNotFoundError, FileExistsError,
        IsADirectoryError, NotADirectoryError, PermissionError, MemoryError,
    )
}
_REMOTE_CLASSES: dict[str, type[RemoteError]] = {}


@functools.cache
def _wire_kinds() -> dict[str, type[Exception]]:
    """The wire's own errors a RemoteError may also be, by the remote type's name (``except MessageTooLarge``
    catches a reply too large for the limit, as the docs promise, wherever it was refused)."""
    from transport.wire import MessageTooLarge, WireError  # here: this module is imported before the wire's
    return {f"{cls.__module__}.{cls.__qualname__}": cls for cls in (MessageTooLarge, WireError)}


def remote_error_class(builtin: str, remote_type: str = "") -> type[RemoteError]:
    """The :class:`RemoteError` that is also the wire's error named ``remote_type`` (:func:`_wire_kinds`), or
    else the builtin exception type named ``builtin`` (a name of :data:`BUILTIN_KINDS`); RemoteError itself
    for any other name. Only these tables' classes are made: nothing else a peer names is instantiated."""
    base = _wire_kinds().get(remote_type) or BUILTIN_KINDS.get(builtin)
    if base is None:
        return RemoteError
    name = base.__name__
    cls = _REMOTE_CLASSES.get(name)
    if cls is None:
        cls = type(f"Remote{name}", (RemoteError, base), {"__module__": __name__, "__doc__": (
            f"A remote {name} (or a subclass of it): a :class:`RemoteError` that ``except {name}`` catches.")})
        _REMOTE_CLASSES[name] = cls
    return cls


def builtin_base(exc: BaseException) -> str:
    """The name of the first of ``exc``'s classes (itself, then its bases) in :data:`BUILTIN_KINDS`;
    '' where none is."""
    return next((cls.__name__ for cls in type(exc).__mro__ if BUILTIN_KINDS.get(cls.__name__) is cls), "")


def error_to_wire(exc: BaseException) -> dict[str, Any]:
    """Describes ``exc`` as msgpack-able data."""
    if isinstance(exc, ActorError):
        # The runtime's own errors (unknown endpoint, bad arguments…) say all there is
        # to say; their traceback would only show the runtime's insides.
        kind, remote_type, message = type(exc).__name__, exc.remote_type, exc.message
        text = exc.remote_traceback
    else:
        kind = "RemoteError"
        remote_type = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
        notes = getattr(exc, "__notes__", None)  # where it came from (see calling)
        message = str(exc) + (f" ({'; '.join(map(str, notes))})" if isinstance(notes, list) and notes else "")
        text = "".join(traceback.format_exception(exc))
    if kind not in ERROR_KINDS:
        kind = "RemoteError"
    details = exc.details if isinstance(exc, ActorError) else {}
    wire = {"kind": kind, "type": remote_type, "message": message, "traceback": text, "details": details}
    if kind == "RemoteError" and (builtin := builtin_base(exc)):
        wire["builtin"] = builtin
    return wire


def error_from_wire(data: Any) -> ActorError:
    """Rebuilds an error sent by :func:`error_to_wire`; anything odd becomes RemoteError.

    A remote :class:`ActorTimeout` says it was the remote's: its message is prefixed
    ``remote timeout:``, so a caller never mistakes it for its own call timing out.
    """
    if not isinstance(data, dict):
        return RemoteError(f"malformed error reply: {_excerpt(data)}")
    cls = ERROR_KINDS.get(str(data.get("kind")), RemoteError)
    if cls is RemoteError:
        cls = remote_error_class(str(data.get("builtin", "")), str(data.get("type", "")))
    details = data.get("details")
    message = str(data.get("message", ""))
    if cls is ActorTimeout and not message.startswith("remote timeout: "):
        message = "remote timeout: " + message
    return cls(
        message,
        remote_type=str(data.get("type", "")),
        remote_traceback=str(data.get("traceback", "")),
        details=details if isinstance(details, dict) else None,
    )


def _excerpt(value: object) -> str:
    """At most 200 characters of an untrusted value, cut before it is escaped (see ``transport.wire.excerpt``)."""
    from transport.wire import excerpt  # here: the errors module is imported before the wire's codecs
    return excerpt(value, 200)
