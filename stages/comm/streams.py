"""A stage's ends of its stream links (``communication.transport = "stream"``).

The server takes the neighbours' values (each neighbour opens its own session through the
stage's ``open_stream`` endpoint); the links carry this stage's values to theirs, one
:class:`~stages.comm.delivery.StreamDeliver` per pipeline rank, made afresh each time the
stage is connected (a recovery's links start from new sessions). Protocol and security:
``transport.stream``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from stages.comm.delivery import OpenStream, StreamDeliver
from transport.stream import StreamServer
from transport.wire import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["StageStreams"]


class StageStreams:
    """Args:
        take: called with each value message a neighbour's link brings (see
            :meth:`stages.comm.delivery.Receiver.deliver`); what it raises is counted there.
        max_bytes: the largest message the server takes.
    """

    def __init__(self, take: Callable[[Any], None], *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.server = StreamServer(take, max_bytes=max_bytes)
        self.links: list[StreamDeliver] = []

    def connect(self, open_streams: Sequence[OpenStream], rank: int, *, encrypt: bool) -> list[StreamDeliver]:
        """The deliver endpoints of the pipeline ranks whose ``open_stream`` endpoints are
        ``open_streams`` (by rank), for pipeline rank ``rank``; the links made before are closed."""
        self.close_links()
        self.links = [StreamDeliver(open_stream, rank, encrypt=encrypt) for open_stream in open_streams]
        return self.links

    async def open(self, runtime_endpoint: str, opening: Any, sender: str) -> str:
        """Opens ``sender``'s session on the server (started beside ``runtime_endpoint`` at the first);
        returns the server's address."""
        address = await self.server.start(runtime_endpoint)
        self.server.open(opening, sender)
        return address

    def close_links(self) -> None:
        for link in self.links:
            link.close()
        self.links = []

    def close(self) -> None:
        self.close_links()
        self.server.close()
