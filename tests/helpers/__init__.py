"""Helpers the tests share."""
from __future__ import annotations

import os


def pythonpath(first: str) -> str:
    """A child process's PYTHONPATH: ``first``, then this process's own, so that the child finds
    the project and whatever the parent found through its path (packages installed beside
    the interpreter's, as on a machine that keeps them on PYTHONPATH)."""
    return os.pathsep.join(filter(None, [first, os.environ.get("PYTHONPATH")]))
