"""Benchmarks: each a module run with ``python -m benchmarks.NAME``, its last printed line one JSON object."""

from __future__ import annotations

import argparse

__all__ = ["count"]


def count(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a count of rounds, trials or steps; 0 of them ended
    in a traceback after the work before it, an empty median)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return value
