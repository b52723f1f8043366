"""Where a caller's checkpoint path lands: a client under its own subtree of the root, the admin anywhere."""

from __future__ import annotations

import pytest

from actors import NotAllowed
from schedulers.checkpoint_paths import CheckpointPath, client_subtree, resolve
from stages import CheckpointError

ROOT = "/srv/ckpt"

# (caller, directory as the driver sent it, the driver's cwd, where it lands, the subtree it must stay in)
RESOLVED = [
    ("client:alice", "run1", "/home/alice", "/srv/ckpt/alice/run1", "/srv/ckpt/alice"),
    ("client:alice", "a/../run1", None, "/srv/ckpt/alice/run1", "/srv/ckpt/alice"),
    ("client:alice", "/srv/ckpt/alice/run1", None, "/srv/ckpt/alice/run1", "/srv/ckpt/alice"),
    ("client:alice", "/srv/ckpt/alice/x/../run1", None, "/srv/ckpt/alice/run1", "/srv/ckpt/alice"),
    ("client:alice", ".", None, "/srv/ckpt/alice", "/srv/ckpt/alice"),
    ("client:alice.b@c", "run1", None, "/srv/ckpt/alice.b@c/run1", "/srv/ckpt/alice.b@c"),
    ("client:alice-2", "run1", None, "/srv/ckpt/alice-2/run1", "/srv/ckpt/alice-2"),  # a key file made by hand
    ("admin:admin", "/anywhere/run1", None, "/anywhere/run1", None),
    ("admin:admin", "run1", "/home/me", "/home/me/run1", None),
    ("admin:admin", "../run1", "/home/me", "/home/run1", None),
    ("local:", "/anywhere/run1", None, "/anywhere/run1", None),
    ("", "run1", "/home/me", "/home/me/run1", None),  # a runtime without keys
]


@pytest.mark.parametrize("caller, directory, cwd, directory_out, within", RESOLVED)
def test_a_path_lands_where_the_callers_key_may_keep_checkpoints(
    caller: str, directory: str, cwd: str | None, directory_out: str, within: str | None
) -> None:
    assert resolve(directory, cwd, caller=caller, root=ROOT) == CheckpointPath(directory=directory_out, within=within)


@pytest.mark.parametrize("directory", [
    "/srv/ckpt/alice/run1",  # another client's, absolute
    "../alice/run1",  # ... and relative
    "/srv/ckpt/bob/../alice/run1",
    "/srv/ckpt/bobby/run1",  # a name that starts like bob's is not bob's
    "/srv/ckpt",
    "..",
    "/tmp/run1",
])
def test_a_client_cannot_name_a_path_outside_its_own_subtree(directory: str) -> None:
    with pytest.raises(NotAllowed, match="is outside /srv/ckpt/bob, where the checkpoints of client:bob are kept"):
        resolve(directory, "/home/bob", caller="client:bob", root=ROOT)


@pytest.mark.parametrize("caller", ["client:..", "client:.", "client:", "client:a/b", "client:a b"])
def test_a_key_whose_name_is_no_directory_has_no_subtree(caller: str) -> None:
    with pytest.raises(NotAllowed, match="has no checkpoint directory of its own"):
        client_subtree(caller, ROOT)


@pytest.mark.parametrize("directory, cwd", [("run1", None), ("/a/../b", None), ("", "/x"), (7, None)])
def test_the_admins_path_must_be_absolute_and_normalized_or_come_with_the_drivers_directory(
    directory: object, cwd: str | None
) -> None:
    with pytest.raises(CheckpointError, match="checkpoint directory must be"):
        resolve(directory, cwd, caller="admin:admin", root=ROOT)
