"""A session key whose seals lose one bit of their last frame's tag on the way: tampering in transit."""

from __future__ import annotations

from typing import Any

from transport.sealed import SessionKey


class TamperedKey:
    """Stands in for a sender's :class:`~transport.sealed.SessionKey` (a stream link's or a bulk link's
    ``key``): every message it seals arrives with one bit of its last tag flipped, so the receiver
    refuses it as it would a message altered on the wire. ``key`` is the real one, to put back."""

    def __init__(self, key: SessionKey) -> None:
        self.key = key

    def __getattr__(self, name: str) -> Any:
        return getattr(self.key, name)

    def seal(self, seq: int, frames: list[Any], **kwargs: Any) -> list[Any]:
        sealed = [bytearray(memoryview(f).cast("B")) for f in self.key.seal(seq, frames, **kwargs)]
        sealed[-1][-1] ^= 1
        return sealed
