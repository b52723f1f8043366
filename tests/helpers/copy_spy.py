"""What ``copy`` flag each message a ZeroMQ socket sent was given (the channel's zero-copy choice):
through ``send_multipart`` or the channel's own :func:`transport._sockets.send_nowait`."""

from __future__ import annotations

from typing import Any
from unittest import mock

import zmq

import transport.channel


class spy_on_copies:  # noqa: N801  (a context manager read as a phrase)
    """Inside: the ``copy`` flag of every message of ``min_bytes`` or more that a socket sent (not the
    tries that found no room, which raise ``zmq.Again``)."""

    def __init__(self, min_bytes: int = 0) -> None:
        self.min_bytes = min_bytes
        self.copies: list[bool] = []
        self._patches: list[Any] = []

    def __enter__(self) -> spy_on_copies:
        copies, min_bytes = self.copies, self.min_bytes

        def spying(original: Any) -> Any:
            def spy(socket: Any, frames: Any, *args: Any, copy: bool = True, **kwargs: Any) -> Any:
                sent = original(socket, frames, *args, copy=copy, **kwargs)
                if sum(memoryview(frame).nbytes for frame in frames) >= min_bytes:
                    copies.append(copy)
                return sent
            return spy

        self._patches = [mock.patch.object(zmq.Socket, "send_multipart", spying(zmq.Socket.send_multipart)),
                         mock.patch.object(transport.channel, "send_nowait", spying(transport.channel.send_nowait))]
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        for patch in self._patches:
            patch.stop()
