"""ActorRef: the name of an actor anywhere in the cluster, and how callers reach it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

__all__ = ["ActorRef", "Caller", "Endpoint"]

P = ParamSpec("P")
R = TypeVar("R")
ENDPOINT_ATTR = "__actor_endpoint__"  # set on a method by actors._actor.endpoint


class Caller(Protocol):
    """What a ref sends its calls through (the runtime that made it)."""

    async def ask(
        self, ref: ActorRef, method: str, args: list[Any], kwargs: dict[str, Any], *, timeout: float | None
    ) -> Any: ...

    async def tell(self, ref: ActorRef, method: str, args: list[Any], kwargs: dict[str, Any]) -> int: ...


class ActorRef:
    """Names actor ``name`` in the runtime listening at ``address``.

    Two refs are equal when they name the same actor, whichever runtime made them.
    A ref crosses the wire as ``ref.to_wire()`` and comes back through
    ``runtime.ref(*data)``.
    """

    __slots__ = ("address", "name", "_runtime")

    def __init__(self, runtime: Caller, address: str, name: str) -> None:
        self.address = address
        self.name = name
        self._runtime = runtime

    async def ask(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Calls endpoint ``method`` and waits for its result.

        Args:
            timeout: seconds to wait for the reply; None waits as long as it takes.
                (``timeout`` is this call's own; an endpoint argument of that name
                must be passed positionally.)

        Raises:
            ActorTimeout: no reply within ``timeout``.
            RemoteError: the endpoint raised; it carries the remote type and traceback.
            UnknownActor, UnknownEndpoint, BadArguments, MailboxFull, ActorStopped.
        """
        return await self._runtime.ask(self, method, list(args), kwargs, timeout=timeout)

    async def tell(self, method: str, *args: Any, **kwargs: Any) -> int:
        """Sends a call without waiting for its outcome (waits only for room to send).

        Returns:
            The bytes that went on the wire (0 for an actor in this process).
        """
        return await self._runtime.tell(self, method, list(args), kwargs)

    def endpoint(
        self, method: Callable[Concatenate[Any, P], Awaitable[R]], *, timeout: float | None = None
    ) -> Endpoint[P, R]:
        """A typed handle on one of the actor's endpoints, named by the method itself.

        ``await ref.endpoint(Counter.add, timeout=5).call(2)`` is the call :meth:`ask`
        makes with the name ``add``, with the arguments and the result checked by the
        type checker against ``Counter.add``'s signature, and no method name in a string.
        Library code calls endpoints this way only (``tests/test_layers.py`` checks it).

        Raises:
            TypeError: ``method`` is not marked with ``@endpoint``.
        """
        if getattr(method, ENDPOINT_ATTR, None) is None:
            raise TypeError(f"{getattr(method, '__qualname__', method)!r} is not an @endpoint")
        return Endpoint(self, method.__name__, timeout)

    def to_wire(self) -> list[str]:
        return [self.address, self.name]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and (self.address, self.name) == (other.address, other.name)

    def __hash__(self) -> int:
        return hash((self.address, self.name))

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r} @ {self.address})"


class Endpoint(Generic[P, R]):
    """One endpoint of the actor a ref names, typed by the method it was made from."""

    __slots__ = ("ref", "method", "timeout")

    def __init__(self, ref: ActorRef, method: str, timeout: float | None) -> None:
        self.ref = ref
        self.method = method
        self.timeout = timeout

    async def call(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Calls the endpoint and waits for its result (see :meth:`ActorRef.ask`)."""
        result: R = await self.ref._runtime.ask(self.ref, self.method, list(args), kwargs, timeout=self.timeout)
        return result

    async def tell(self, *args: P.args, **kwargs: P.kwargs) -> int:
        """Sends the call without waiting for its outcome; returns the bytes sent."""
        return await self.ref._runtime.tell(self.ref, self.method, list(args), kwargs)

    def __repr__(self) -> str:
        return f"Endpoint({self.ref!r}.{self.method})"
