"""Where a job's checkpoints may go: the operator's checkpoint root, one subtree per client key.

The head is started with a checkpoint root (``python -m actors.node --head
--checkpoint-root DIR``, default ``./checkpoints`` under its working directory;
``LocalCluster(checkpoint_root=...)``). A client key ``client:alice`` saves and loads
only under ``ROOT/alice/``: a relative path is taken there, an absolute one must lie
inside it, and anything else is :class:`~actors.NotAllowed`, before any node is asked.
The admin key, the head's own process and a cluster without keys (``--insecure``) may
name any absolute path, and a relative one is taken from the driver's working
directory, as before checkpoints were confined.

The head resolves a path as written (it need not see the filesystem); each node then
checks that the directory does not leave the subtree through a symbolic link
(:func:`stages.state.checkpoint.check_within`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from actors import NotAllowed, may_call
from stages import check_directory

__all__ = ["CheckpointPath", "client_subtree", "resolve"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointPath:
    """A checkpoint directory as the head resolved it for one caller."""

    directory: str
    """absolute and normalized: where every stage reads and writes"""
    within: str | None
    """the client's subtree of the checkpoint root, which ``directory`` must not leave on any node
    (links resolved); None: the admin's, anywhere"""


def client_subtree(caller: str, root: str) -> str | None:
    """The subtree of ``root`` that ``caller``'s checkpoints stay in (``ROOT/alice`` for ``client:alice``),
    or None for a caller that may use any path (the admin key, this process, a runtime without keys).

    Raises:
        NotAllowed: a key whose name cannot be a directory of its own (``..``).
    """
    if may_call(caller, frozenset()):
        return None
    name = caller.partition(":")[2]
    if not name or set(name) <= {"."} or not all(c.isalnum() or c in "_.@-" for c in name):
        raise NotAllowed(f"the key {caller[:60]!r} has no checkpoint directory of its own: its name must be "
                         "letters, digits, '_', '.', '@' or '-', and not dots alone (python -m actors.keys add)")
    return os.path.join(root, name)


def resolve(directory: Any, relative_to: Any, *, caller: str, root: str) -> CheckpointPath:
    """Where ``caller``'s ``directory`` is: see the module's docstring.

    Args:
        directory: the path as the driver named it: absolute, or relative.
        relative_to: the driver's working directory, for a relative ``directory`` of a caller
            that may use any path (a confined client's is taken under its subtree instead).
        root: the head's checkpoint root (absolute).

    Raises:
        NotAllowed: a client's path outside its own subtree; the message names that subtree.
        CheckpointError: not a path (or too long); a relative one without ``relative_to`` where it
            is needed, or an absolute one that is not normalized (the admin's).
    """
    if not isinstance(directory, str) or not directory or "\0" in directory:
        check_directory(directory)  # raises, saying what was wrong
    within = client_subtree(caller, root)
    if within is None:
        if not os.path.isabs(directory) and isinstance(relative_to, str):
            directory = os.path.normpath(os.path.join(check_directory(relative_to), directory))
        return CheckpointPath(directory=check_directory(directory), within=None)
    path = os.path.normpath(os.path.join(within, directory))  # an absolute directory stands alone
    if path != within and not path.startswith(within + os.sep):
        raise NotAllowed(f"{directory[:200]!r} is outside {within}, where the checkpoints of {caller[:60]} are "
                         "kept; name a path relative to it (e.g. 'run1') or inside it")
    return CheckpointPath(directory=check_directory(path), within=within)
