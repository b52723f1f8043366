"""ActorRef: the name of an actor anywhere in the cluster, and how callers reach it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actors._runtime import Runtime

__all__ = ["ActorRef"]


class ActorRef:
    """Names actor ``name`` in the runtime listening at ``address``.

    Two refs are equal when they name the same actor, whichever runtime made them.
    A ref crosses the wire as ``ref.to_wire()`` and comes back through
    ``runtime.ref(*data)``.
    """

    __slots__ = ("address", "name", "_runtime")

    def __init__(self, runtime: Runtime, address: str, name: str) -> None:
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

    def to_wire(self) -> list[str]:
        return [self.address, self.name]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and (self.address, self.name) == (other.address, other.name)

    def __hash__(self) -> int:
        return hash((self.address, self.name))

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r} @ {self.address})"
