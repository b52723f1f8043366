"""CURVE for channels: keypairs, self-certifying addresses, and the ZAP gate that admits only known keys.

Every secure runtime has one keypair. Its receiver is a CURVE *server* with that
keypair, and its address carries the public key (``tcp://127.0.0.1:5555|<hex key>``),
so whoever connects knows which key the listener must prove it holds: an address is
self-certifying, as an SSH host key pinned in ``known_hosts``. Its senders are CURVE
*clients* with the same keypair. A receiver's :class:`Gate` (a ZAP authenticator in
its own thread) admits a client only if its public key is on the key ring, and tags
every message from it with the ring's name for that key (ZeroMQ's ``User-Id``), so
the layer above can say who called. A peer without an admitted key fails the
handshake: none of its bytes reach the decoder.
"""

from __future__ import annotations

import binascii
import contextlib
import ipaddress
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from transport.addresses import Address

__all__ = ["KEY_SEPARATOR", "ZAP_DOMAIN", "Gate", "Keypair", "bulk_endpoint", "is_numeric_endpoint", "join_address", "read_public_key", "shown",
           "split_address", "write_public_key"]

log = logging.getLogger(__name__)

KEY_SEPARATOR = "|"
ZAP_DOMAIN = "actorpipe"


@dataclass(frozen=True, slots=True)
class Keypair:
    """A CURVE keypair, both halves Z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> Keypair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Keypair:
        """Reads a ``.key_secret`` file (the format :meth:`save` and ``zmq.auth`` write).

        Raises:
            ValueError: the file holds no secret key.
            OSError: the file cannot be read.
        """
        public, secret = _read_key_file(path)
        if secret is None:
            raise ValueError(f"{os.fspath(path)} holds no secret key")
        return cls(public, secret)

    def save(self, directory: str | os.PathLike[str], name: str) -> tuple[str, str]:
        """Writes ``name.key`` (public) and ``name.key_secret`` (both halves), mode 0600.

        Returns:
            The two paths.
        """
        public_path = os.path.join(directory, f"{name}.key")
        secret_path = os.path.join(directory, f"{name}.key_secret")
        _write_private(public_path, _key_file(self.public, None))
        _write_private(secret_path, _key_file(self.public, self.secret))
        return public_path, secret_path

    @property
    def hex(self) -> str:
        """The public key as 64 hex digits (how addresses carry it)."""
        return binascii.hexlify(z85.decode(self.public)).decode()

    def __repr__(self) -> str:  # never print the secret
        return f"Keypair(public={self.public.decode()!r})"


def read_public_key(path: str | os.PathLike[str]) -> bytes:
    """The Z85 public key of a ``.key`` or ``.key_secret`` file."""
    return _read_key_file(path)[0]


def write_public_key(path: str | os.PathLike[str], public: bytes) -> None:
    """Writes a ``.key`` file with only the public half (mode 0600)."""
    _write_private(os.fspath(path), _key_file(public, None))


def join_address(endpoint: str, public: bytes, bulk: str | None = None) -> str:
    """``tcp://host:port``, a Z85 public key and any bulk endpoint -> ``tcp://host:port|<hex>[|<bulk>]``.

    The bulk endpoint is where a secure receiver takes sealed messages (``transport.sealed``).
    """
    address = f"{endpoint}{KEY_SEPARATOR}{binascii.hexlify(z85.decode(public)).decode()}"
    return address if bulk is None else f"{address}{KEY_SEPARATOR}{bulk}"


def split_address(address: str) -> tuple[str, bytes | None]:
    """``tcp://host:port|<hex>[|<bulk>]`` -> (``tcp://host:port``, Z85 key); no key part -> (address, None).

    Raises:
        ValueError: a key part that is not 64 hex digits, or a bulk part that is not a
            numeric ``tcp://IP:PORT`` or an ``ipc://PATH``.
    """
    endpoint, separator, rest = address.partition(KEY_SEPARATOR)
    if not separator:
        return address, None
    key, _, bulk = rest.partition(KEY_SEPARATOR)
    try:
        raw = binascii.unhexlify(key)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"the key part of address {address[:120]!r} must be 64 hex digits")
    if bulk and not is_numeric_endpoint(bulk):
        # libzmq would resolve a host name with a blocking lookup on its I/O thread.
        raise ValueError(f"the bulk part of address {address[:160]!r} must be tcp://IP:PORT or ipc://PATH")
    return endpoint, z85.encode(raw)


def shown(address: str) -> str:
    """An address as a message shows it: its endpoint, without the key and bulk parts (64 hex digits
    and a second endpoint that tell a reader nothing to act on)."""
    return address.partition(KEY_SEPARATOR)[0]


def bulk_endpoint(address: str) -> str | None:
    """The bulk endpoint an address carries after its key, or None (see :func:`split_address`).

    Raises:
        ValueError: a malformed address.
    """
    split_address(address)
    parts = address.split(KEY_SEPARATOR, 2)
    return parts[2] if len(parts) == 3 and parts[2] else None


def is_numeric_endpoint(endpoint: str) -> bool:
    """True for ``ipc://PATH`` and ``tcp://IP:PORT`` (no host name: resolving one would block)."""
    where = Address.parse(endpoint)
    if where.is_ipc:
        return bool(where.path)
    if not where.is_tcp or where.port_number is None:
        return False
    try:
        ipaddress.ip_address(where.bare_host)
    except ValueError:
        return False
    return True


class Gate:
    """The ZAP authenticator of one ZeroMQ context: admits the keys of a key ring, names them.

    Args:
        context: the context whose CURVE servers this gate answers for.
        ring: a callable returning the current ring, Z85 public key -> name (e.g.
            ``"node:node0"``); called on every handshake, so a ring that reloads
            itself from disk lets keys be added and revoked without a restart.
    """

    def __init__(self, context: zmq.Context[Any], ring: Callable[[], Mapping[bytes, str]]) -> None:
        self._ring = ring
        self._lock = threading.Lock()
        self.refused = 0  # handshakes refused, for tests and statistics
        gate = self

        class _Authenticator(ThreadAuthenticator):
            def curve_user_id(self, client_public_key: bytes) -> str:
                return gate.name_of(z85.encode(client_public_key)) or ""

        self._auth = _Authenticator(context, log=logging.getLogger(f"{__name__}.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)

    def name_of(self, public: bytes) -> str | None:
        return self._ring().get(public)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP's question: may the client with Z85 public ``key`` connect?"""
        allowed = self.name_of(key) is not None
        if not allowed:
            with self._lock:
                self.refused += 1
            log.warning("refused a CURVE handshake from an unknown key %s", key[:12].decode(errors="replace"))
        return allowed

    def stop(self) -> None:
        self._auth.stop()


def configure_server(socket: zmq.Socket[Any], keys: Keypair) -> None:
    """Makes a socket that binds a CURVE server with ``keys``, gated by its context's :class:`Gate`."""
    socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


def configure_client(socket: zmq.Socket[Any], keys: Keypair, server_public: bytes) -> None:
    """Makes a socket that connects a CURVE client with ``keys``, to a server proving ``server_public``."""
    socket.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


# -- key files ------------------------------------------------------------------------


def _key_file(public: bytes, secret: bytes | None) -> str:
    lines = ["#   ZeroMQ CURVE certificate (actorpipe)", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _read_key_file(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    public = secret = None
    with open(path) as f:
        for line in f:
            name, _, value = line.strip().partition("=")
            value = value.strip().strip('"')
            if name.strip() == "public-key":
                public = value.encode()
            elif name.strip() == "secret-key":
                secret = value.encode()
    if public is None or len(public) != 40:
        raise ValueError(f"{os.fspath(path)} holds no CURVE public key")
    if secret is not None and len(secret) != 40:
        raise ValueError(f"{os.fspath(path)} holds a malformed secret key")
    return public, secret


def _write_private(path: str, text: str) -> None:
    """Writes ``path`` (mode 0600) whole or not at all: a reader listing its directory meanwhile (a head
    reloading its admitted keys on a handshake) sees the old file or the new one, never a part."""
    partial = f"{path}.{os.getpid()}.partial"  # no ".key" ending: a key ring skips it
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(partial, 0o600)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise
