"""Tests for actors/keys.py: every role refuses key material that other users may read, in one process.

Each case loosens one path of a fresh key directory and starts a role on it the way
its entry point does (``serve_head``, ``serve_worker``, ``Cluster.connect``, the
``python -m actors.node`` and ``python -m actors.keys`` command lines): the start fails
before anything listens, naming the path and the ``chmod`` that fixes it, and the mode
is left as it was (the head used to tighten a loose directory silently and start).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from actors import Cluster, ClusterKeys, KeyFileError
from actors._serve import HeadConfig, WorkerConfig, serve_head, serve_worker
from actors.keys import main as keys_main
from actors.node import main as node_main

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def keys(tmp_path: Path) -> ClusterKeys:
    """A fresh key directory with the default keys and a client ``alice``."""
    made = ClusterKeys.create(tmp_path / "keys")
    made.add("client", "alice")
    return made


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# What is loosened (relative to the key directory), to which mode, and the command that fixes it.
LOOSE = [
    ("", 0o755, "chmod 700"),
    ("", 0o750, "chmod 700"),
    ("", 0o701, "chmod 700"),
    ("authorized", 0o777, "chmod 700"),
    ("head.key_secret", 0o644, "chmod 600"),
    ("node.key_secret", 0o640, "chmod 600"),
    ("alice.key_secret", 0o604, "chmod 600"),
]


def start_head(directory: str) -> Awaitable[None]:
    return serve_head(HeadConfig(bind="tcp://127.0.0.1:0", keys=directory))


def start_worker(directory: str) -> Awaitable[None]:
    return serve_worker(WorkerConfig(join="tcp://127.0.0.1:1", name="w", keys=directory))


async def start_client(directory: str) -> None:
    await Cluster.connect("tcp://127.0.0.1:1", keys=directory, identity="alice")


ROLES: dict[str, Callable[[str], Awaitable[None]]] = {
    "head": start_head, "node": start_worker, "client": start_client,
}


@pytest.mark.parametrize("role", sorted(ROLES))
@pytest.mark.parametrize(("entry", "loose", "fix"), LOOSE)
async def test_every_role_refuses_keys_open_to_other_users_and_says_how_to_fix_it(
    keys: ClusterKeys, role: str, entry: str, loose: int, fix: str
) -> None:
    path = os.path.join(keys.directory, entry) if entry else keys.directory
    os.chmod(path, loose)
    with pytest.raises(KeyFileError) as refused:
        await ROLES[role](keys.directory)
    assert f"{path} is open to other users (mode {loose:03o}); fix it with: {fix} {path}" in str(refused.value)
    assert mode(path) == loose  # refused, not silently tightened
    os.chmod(path, 0o700 if fix == "chmod 700" else 0o600)
    keys.check_private()  # the command it gave is the whole fix


def test_the_command_lines_refuse_loose_keys_with_one_line(keys: ClusterKeys, capsys: pytest.CaptureFixture[str]) -> None:
    os.chmod(keys.directory, 0o755)
    for argv in (["--head", "--bind", "tcp://127.0.0.1:0", "--keys", keys.directory],
                 ["--join", "tcp://127.0.0.1:1", "--keys", keys.directory]):
        assert node_main(argv) == 2
        assert f"error: key directory {keys.directory} is open to other users" in capsys.readouterr().err
    assert keys_main(["add", keys.directory, "client", "bob"]) == 2
    assert f"chmod 700 {keys.directory}" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(keys.directory, "bob.key_secret"))
    assert mode(keys.directory) == 0o755


@pytest.fixture
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077], indirect=True)
def test_a_new_key_directory_is_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    keys = ClusterKeys.create(tmp_path / "deep" / "keys")  # a missing parent is made too
    keys.add("client", "alice")
    assert mode(keys.directory) == 0o700 and mode(os.path.join(keys.directory, "authorized")) == 0o700
    for root, _, files in os.walk(keys.directory):
        for name in files:
            assert mode(os.path.join(root, name)) == 0o600, name
    keys.check_private()
    assert keys.identity("alice").public in keys.ring()


def test_an_existing_private_directory_is_used_as_it_is(keys: ClusterKeys) -> None:
    secret = os.path.join(keys.directory, "head.key_secret")
    head = keys.identity("head")
    os.chmod(secret, 0o400)  # tighter than 0600 is fine, and kept
    again = ClusterKeys.create(keys.directory)
    assert again.identity("head") == head and mode(secret) == 0o400  # nothing was remade or changed


# -- the head's ring of admitted keys, read while keys are being admitted -------------------------


def test_a_ring_read_while_a_key_is_being_written_still_admits_it_after(keys: ClusterKeys,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The head reloads its ring on every handshake, whatever else is going on: one read between
    # the key file's creation and its content (CI, 2026-12-04) cached a ring without the new
    # client, and the directory's time did not move again, so that client was refused for good.
    import transport.security as security

    head = ClusterKeys(keys.directory)  # the head's own view of the directory
    real_open = os.open
    seen_during: list[int] = []

    def open_then_read(path: str, flags: int, mode: int = 0o777) -> int:
        fd = real_open(path, flags, mode)
        seen_during.append(len(head.ring()))  # a handshake, right after the file was made
        return fd

    monkeypatch.setattr(security.os, "open", open_then_read)
    bob = keys.add("client", "bob")
    monkeypatch.undo()
    assert seen_during
    assert head.ring().get(bob.public) == "client:bob"


def test_a_key_admitted_within_the_tick_of_a_read_is_read_next_time(keys: ClusterKeys) -> None:
    authorized = os.path.join(keys.directory, "authorized")
    head = ClusterKeys(keys.directory)
    before = os.stat(authorized)
    assert len(head.ring()) == 5  # the default identities and alice
    bob = keys.add("client", "bob")
    # As if both changes fell in one tick of the filesystem's clock: the time the read saw.
    os.utime(authorized, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert head.ring().get(bob.public) == "client:bob"


def test_a_ring_whose_directory_has_been_still_is_not_read_again(keys: ClusterKeys,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import actors.keys as keys_module

    authorized = os.path.join(keys.directory, "authorized")
    still = os.stat(authorized).st_mtime_ns - 60 * 10**9  # last changed a minute ago
    os.utime(authorized, ns=(still, still))
    head = ClusterKeys(keys.directory)
    listed: list[str] = []
    real_listdir = os.listdir
    monkeypatch.setattr(keys_module.os, "listdir", lambda path: listed.append(path) or real_listdir(path))
    first = head.ring()
    assert head.ring() == first and head.ring() is first
    assert listed == [authorized]  # read once, then kept


def test_adding_a_key_under_a_name_the_directory_holds_is_refused_and_the_old_key_stays(
    keys: ClusterKeys, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: ``add DIR client head`` overwrote the head's secret with a client key (the head then
    started as a client), and ``add DIR node admin`` lost the admin key."""
    head = keys.identity("head").public
    for role, name in (("client", "head"), ("node", "admin"), ("node", "client")):
        assert keys_main(["add", keys.directory, role, name]) == 2
        assert f"holds a key named {name!r} already" in capsys.readouterr().err
    assert keys.identity("head").public == head
    assert not os.path.exists(os.path.join(keys.directory, "authorized", "client-head.key"))
    alice = keys.identity("alice").public  # the fixture's client
    with pytest.raises(KeyFileError, match="holds a key named 'alice' already"):
        keys.add("node", "alice")
    assert keys.identity("alice").public == alice
