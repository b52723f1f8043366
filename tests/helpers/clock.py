"""A clock that moves only when a test moves it, for code that takes a ``clock`` callable."""

from __future__ import annotations


class ManualClock:
    """Returns ``now``; the test sets or advances it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
