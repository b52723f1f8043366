"""A cluster's keys: who may connect, under which role, and the keypair each member uses.

Run: python -m actors.keys init DIR            # what the head does on first start
     python -m actors.keys add DIR client alice  # a new client key, admitted
     python -m actors.keys revoke DIR client-alice

A key directory (mode 0700, files 0600) holds::

    head.key_secret      the head's keypair (its address carries the public half)
    node.key_secret      the default keypair of worker nodes
    admin.key_secret     the admin's keypair: may do anything, and shut nodes down
    client.key_secret    the default keypair of drivers and consoles
    authorized/ROLE-NAME.key   the public keys admitted, one file each

A member is admitted when its public key is in ``authorized/``, as SSH admits
authorized keys; the file name gives its role (``head``, ``node``, ``client`` or
``admin``) and name. Adding or removing a file there takes effect at the next
connection, without a restart: that is how keys are rotated (add the new key, move
the members to it, remove the old one).
"""

from __future__ import annotations

import argparse
import os
import shlex
import stat
import sys
import threading
import time
from collections.abc import Mapping

from transport.security import Keypair, read_public_key, write_public_key

__all__ = ["DEFAULT_KEYS", "ROLES", "ClusterKeys", "KeyFileError"]

ROLES = ("head", "node", "client", "admin")
DEFAULT_KEYS = os.path.join(os.path.expanduser("~"), ".config", "actorpipe", "keys")
_DEFAULT_IDENTITIES = ("head", "node", "admin", "client")
# A key ring read within this many seconds of its directory's last change is read again on the next
# handshake (see ClusterKeys.ring): 2 s covers the coarsest common timestamps (FAT's).
RACY_S = 2.0


class KeyFileError(ValueError):
    """A key directory that is missing, unsafe, or lacks the key asked for."""


class ClusterKeys:
    """A cluster's key directory; see the module docstring for its layout."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        self._authorized = os.path.join(self.directory, "authorized")
        self._lock = threading.Lock()
        self._ring: dict[bytes, str] = {}
        self._ring_stamp: tuple[float, int] | None = None
        self._ring_read_at = 0.0  # wall time of the last read, on the filesystem's clock

    @classmethod
    def create(cls, directory: str | os.PathLike[str]) -> ClusterKeys:
        """Makes the directory and the default keypairs that are missing; admits them.

        A directory that exists keeps its mode: one open to other users is refused,
        never silently tightened (its keys may have been read already, and a copy on
        another machine would stay loose).

        Raises:
            KeyFileError: the directory, ``authorized/`` or a secret key file in it is open
                to other users (the message gives the ``chmod`` that fixes it).
        """
        keys = cls(directory)
        _make_private_directory(keys.directory)
        _make_private_directory(keys._authorized)
        keys.check_private()
        for role in _DEFAULT_IDENTITIES:
            if not os.path.exists(keys._secret_path(role)):
                keys.add(role, role)
        return keys

    def check_private(self) -> None:
        """Refuses key material that other users may read or write, as ssh refuses a loose ``~/.ssh``.

        Checked: the directory and ``authorized/`` (mode 0700 or tighter: whoever may
        write ``authorized/`` admits any key) and every ``*.key_secret`` file in the
        directory (0600 or tighter). Every role checks at start, before it uses a key.

        Raises:
            KeyFileError: no such directory, or a path open to other users; the message
                names the path and the ``chmod`` that fixes it.
        """
        if not os.path.isdir(self.directory):
            raise KeyFileError(f"no key directory at {self.directory}; the head makes one on first start "
                            "(python -m actors.node --head --keys DIR) or run python -m actors.keys init DIR")
        _check_mode(self.directory, "key directory", 0o700)
        if os.path.isdir(self._authorized):
            _check_mode(self._authorized, "directory of admitted keys", 0o700)
        for entry in sorted(os.listdir(self.directory)):
            if entry.endswith(".key_secret"):
                _check_mode(os.path.join(self.directory, entry), "secret key file", 0o600)

    def add(self, role: str, name: str, keypair: Keypair | None = None) -> Keypair:
        """Makes (or stores) the keypair ``name`` with ``role`` and admits its public key.

        The default identities (``head``, ``node``, ``admin``, ``client``) are saved
        in the directory itself; any other's secret half is saved there too (mode
        0600), to be handed to its owner.

        Raises:
            KeyFileError: an unknown role or a bad name, a name whose key the directory holds
                already (the head's, the admin's or anyone's: its secret would be lost, and
                its files would then hold a key of another role), or the directory is unsafe
                (see :meth:`check_private`).
        """
        if role not in ROLES:
            raise KeyFileError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        if not name or not all(c.isalnum() or c in "_.@" for c in name):
            raise KeyFileError(f"a key name is letters, digits, '_', '.' or '@'; got {name[:40]!r}")
        self.check_private()
        if os.path.exists(self._secret_path(name)):
            raise KeyFileError(f"{self.directory} holds a key named {name!r} already; pick another name (to replace "
                               "a key, add the new one under a new name and revoke the old)")
        keypair = keypair or Keypair.generate()
        keypair.save(self.directory, name)
        write_public_key(os.path.join(self._authorized, f"{role}-{name}.key"), keypair.public)
        return keypair

    def revoke(self, entry: str) -> None:
        """Stops admitting ``ROLE-NAME`` (its file in ``authorized/``); takes effect at the next connection."""
        path = os.path.join(self._authorized, f"{entry}.key")
        if not os.path.exists(path):
            raise KeyFileError(f"no admitted key {entry!r} in {self._authorized}")
        os.remove(path)

    def identity(self, name: str) -> Keypair:
        """The keypair saved as ``name`` (e.g. ``node``, ``client``, ``admin``).

        Raises:
            KeyFileError: the directory is unsafe or has no such key.
        """
        self.check_private()
        path = self._secret_path(name)
        if not os.path.exists(path):
            raise KeyFileError(f"no key {name!r} in {self.directory} (expected {path})")
        return Keypair.load(path)

    def head_public(self) -> bytes:
        """The head's public key (what a ``--join`` address without a key is completed with)."""
        return read_public_key(os.path.join(self.directory, "head.key"))

    def ring(self) -> Mapping[bytes, str]:
        """The admitted keys, public key -> ``role:name``; re-read when ``authorized/`` changes.

        A directory's modification time moves in the kernel's coarse ticks (milliseconds,
        or seconds on some filesystems): a key admitted within the tick of a read leaves the
        time as that read saw it. So a ring read less than :data:`RACY_S` after the time it
        saw is read again next time, as git treats a file changed within its index's second.
        """
        try:
            info = os.stat(self._authorized)
            stamp = (info.st_mtime, info.st_ino)
        except OSError:
            return {}
        with self._lock:
            if stamp != self._ring_stamp or self._ring_read_at - stamp[0] < RACY_S:
                read_at = time.time()
                ring: dict[bytes, str] = {}
                for entry in sorted(os.listdir(self._authorized)):
                    role, dash, name = entry.removesuffix(".key").partition("-")
                    if not entry.endswith(".key") or not dash or role not in ROLES:
                        continue
                    try:
                        ring[read_public_key(os.path.join(self._authorized, entry))] = f"{role}:{name}"
                    except (OSError, ValueError):
                        continue
                self._ring, self._ring_stamp, self._ring_read_at = ring, stamp, read_at
            return self._ring

    def _secret_path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.key_secret")


def _make_private_directory(path: str) -> None:
    """Makes ``path`` with mode 0700 if it is missing; one that exists is left as it is (and judged)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):
            raise KeyFileError(f"{path} is a file, not a key directory: give --keys a directory (one "
                               "'python -m actors.keys init DIR' made, or a new path)") from None
        return
    os.chmod(path, 0o700)  # just made, so ours: exactly 0700 whatever the umask


def _check_mode(path: str, what: str, most: int) -> None:
    """Raises KeyFileError when ``path`` grants anything beyond ``most`` (0700 or 0600) to group or others."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise KeyFileError(f"{what} {path} is open to other users (mode {mode:03o}); fix it with: "
                           f"chmod {most:o} {shlex.quote(path)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.keys", description="Manage a cluster's keys.")
    commands = parser.add_subparsers(dest="command", required=True)
    init = commands.add_parser("init", help="make a key directory with the default keys")
    init.add_argument("directory")
    add = commands.add_parser("add", help="make and admit a new key")
    add.add_argument("directory")
    add.add_argument("role", choices=ROLES)
    add.add_argument("name")
    revoke = commands.add_parser("revoke", help="stop admitting a key (ROLE-NAME)")
    revoke.add_argument("directory")
    revoke.add_argument("entry")
    listing = commands.add_parser("list", help="the admitted keys")
    listing.add_argument("directory")
    args = parser.parse_args(argv)
    try:
        if args.command == "init":
            ClusterKeys.create(args.directory)
        elif args.command == "add":
            ClusterKeys(args.directory).add(args.role, args.name)
            print(f"{args.directory}/{args.name}.key_secret: give it to its owner (it is admitted as "
                  f"{args.role}:{args.name})")
        elif args.command == "revoke":
            ClusterKeys(args.directory).revoke(args.entry)
        for public, name in ClusterKeys(args.directory).ring().items():
            print(f"{name:24} {public.decode()}")
    except KeyFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
