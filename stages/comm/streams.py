"""A stage's ends of its stream links (``communication.transport = "stream"``).

The server takes the other stage actors' messages (each opens its own session through
the stage's ``open_stream`` endpoint): their values and their votes on the step's tail.
The links carry this stage's to theirs, one :class:`~stages.comm.delivery.StreamPeer`
per stage actor it sends to (a pipeline neighbour, a member of the job's ballot, or
both), made afresh each time the stage is connected (a recovery's links start from new
sessions). Protocol and security: ``transport.stream``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from stages.comm.delivery import OpenStream, StreamPeer
from transport.stream import StreamServer
from transport.wire import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["StageStreams"]


class StageStreams:
    """Args:
        take: called with each message another stage's link brings (a value or a vote: see
            :class:`~stages.comm.delivery.StreamPeer`); what it raises is counted there.
        max_bytes: the largest message the server takes.
        lost: called with a sender and why, where its stream may have lost a message on the way
            (the server's ``on_lost``).
    """

    def __init__(self, take: Callable[[Any], None], *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 lost: Callable[[str, str], None] | None = None) -> None:
        self.server = StreamServer(take, max_bytes=max_bytes, on_lost=lost)
        self.links: dict[Hashable, StreamPeer] = {}
        self._rank = -1
        self._encrypt = True

    def reset(self, rank: int, *, encrypt: bool) -> None:
        """Closes every link: the stage, global rank ``rank``, is connected afresh."""
        self.close_links()
        self._rank, self._encrypt = rank, encrypt

    def peer(self, key: Hashable, open_stream: OpenStream) -> StreamPeer:
        """The stage actor ``key`` names (one link each, whatever it is sent), whose ``open_stream``
        endpoint is ``open_stream``."""
        peer = self.links.get(key)
        if peer is None:
            peer = self.links[key] = StreamPeer(open_stream, self._rank, encrypt=self._encrypt)
        return peer

    async def open(self, runtime_endpoint: str, opening: Any, sender: str) -> str:
        """Opens ``sender``'s session on the server (started beside ``runtime_endpoint`` at the first);
        returns the server's address."""
        address = await self.server.start(runtime_endpoint)
        self.server.open(opening, sender)
        return address

    def close_links(self) -> None:
        for link in self.links.values():
            link.close()
        self.links = {}

    def close(self) -> None:
        self.close_links()
        self.server.close()
