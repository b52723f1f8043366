"""What ``copy`` flag each message a ZeroMQ socket sent was given (the channel's zero-copy choice)."""

from __future__ import annotations

from typing import Any
from unittest import mock

import zmq


class spy_on_copies:  # noqa: N801  (a context manager read as a phrase)
    """Inside: the ``copy`` flag of every message of ``min_bytes`` or more that a socket sent (not the
    tries that found no room, which raise ``zmq.Again``)."""

    def __init__(self, min_bytes: int = 0) -> None:
        self.min_bytes = min_bytes
        self.copies: list[bool] = []
        self._patch: Any = None

    def __enter__(self) -> spy_on_copies:
        original = zmq.Socket.send_multipart
        copies, min_bytes = self.copies, self.min_bytes

        def spy(socket: Any, frames: Any, *args: Any, copy: bool = True, **kwargs: Any) -> Any:
            sent = original(socket, frames, *args, copy=copy, **kwargs)
            if sum(memoryview(frame).nbytes for frame in frames) >= min_bytes:
                copies.append(copy)
            return sent

        self._patch = mock.patch.object(zmq.Socket, "send_multipart", spy)
        self._patch.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._patch.stop()
