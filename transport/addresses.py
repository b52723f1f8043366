"""Addresses: ``tcp://HOST:PORT`` and ``ipc://PATH``, split in one place, and what follows from them.

Every part of the project that reads an address (a channel's bind, a stream server's, the head's
reach checks, a data-parallel group's interface, the key ring's numeric check) splits it with
:meth:`Address.parse`, so an IPv6 literal keeps its brackets where an address is written
(:attr:`Address.host`) and loses them where a socket takes it (:attr:`Address.bare_host`), the
same way everywhere. Nothing here imports ZeroMQ or torch.
"""

from __future__ import annotations

import ipaddress
import os
import socket as net
import tempfile
from dataclasses import dataclass

__all__ = ["Address", "advertised", "bind_address", "bulk_bind_address", "is_local_address", "is_loopback",
           "is_own_address", "route_source", "url_host"]


@dataclass(frozen=True, slots=True)
class Address:
    """One address, split once (a key part, ``|KEY``, is :func:`transport.security.split_address`'s to cut).

    ``scheme`` is what comes before ``://`` (``""`` without one); for ``tcp``, ``host`` is as written
    (an IPv6 literal in its brackets) and ``port`` as written (``"0"``, ``"*"``, ``"5555"``), both
    ``""`` without a colon; for ``ipc``, ``path`` is the socket file (``""``: ``ipc://``, a fresh one).
    """

    scheme: str
    host: str = ""
    port: str = ""
    path: str = ""

    @classmethod
    def parse(cls, text: str) -> Address:
        """``text`` split into its parts; never raises (the caller says what it needs, and why)."""
        scheme, separator, rest = text.partition("://")
        if not separator:
            return cls(scheme="")
        if scheme == "ipc":
            return cls(scheme=scheme, path=rest)
        host, colon, port = rest.rpartition(":")
        return cls(scheme=scheme, host=host, port=port) if colon else cls(scheme=scheme)

    @property
    def is_tcp(self) -> bool:
        return self.scheme == "tcp"

    @property
    def is_ipc(self) -> bool:
        return self.scheme == "ipc"

    @property
    def bare_host(self) -> str:
        """The host as a socket or :mod:`ipaddress` takes it: an IPv6 literal without its brackets."""
        return self.host[1:-1] if self.host.startswith("[") and self.host.endswith("]") else self.host

    @property
    def family(self) -> net.AddressFamily:
        """The socket family of a TCP address's host (a name counts as IPv4, as ZeroMQ's default is)."""
        return net.AF_INET6 if ":" in self.bare_host else net.AF_INET

    @property
    def port_number(self) -> int | None:
        """The TCP port as a number; None where it is not one (``*``, a name, nothing)."""
        return int(self.port) if self.port.isdigit() else None

    def on_port(self, port: int | str) -> str:
        """This TCP address's host on ``port``: ``tcp://HOST:PORT``."""
        return f"tcp://{self.host}:{port}"


def bulk_bind_address(bind_address: str) -> str:
    """Where a receiver bound at ``bind_address`` binds its bulk socket: the same host, any port."""
    where = Address.parse(bind_address)
    return f"ipc://{where.path}.bulk" if where.is_ipc else where.on_port("*")


def bind_address(address: str, *, allow_remote: bool) -> tuple[str, str | None]:
    """Returns the address to bind (ephemeral forms resolved) and any temp folder made."""
    where = Address.parse(address)
    if not where.scheme:
        raise ValueError(f"address {address!r} must look like tcp://HOST:PORT or ipc://PATH")
    if where.is_ipc:
        if where.path:
            return address, None
        tempdir = tempfile.mkdtemp(prefix="actorpipe-")
        return f"ipc://{os.path.join(tempdir, 'sock')}", tempdir
    if not where.is_tcp:
        raise ValueError(f"unsupported transport {where.scheme!r} in {address!r}: use tcp:// or ipc://")
    if not where.host:
        raise ValueError(f"address {address!r} needs a host and a port (port 0 for any free one)")
    if where.port != "*" and (where.port_number is None or not 0 <= where.port_number < 65536):  # 70000: 4464
        raise ValueError(f"address {address!r}: {where.port!r:.20} is not a TCP port (0 for any free one, "
                         "or 1-65535)")
    if not allow_remote and not is_loopback(where.host):
        raise ValueError(
            f"refusing to bind {address!r}: it is not a loopback address; pass allow_remote=True "
            "(a node: --allow-remote; with CURVE keys, the default for a cluster) to listen beyond this machine"
        )
    return where.on_port("*" if where.port == "0" else where.port), None


def is_local_address(address: str) -> bool:
    """Whether a runtime's ``address`` (with or without its key part) is reachable only
    from this machine: ``ipc://`` or TCP on a loopback address."""
    where = Address.parse(address.partition("|")[0])
    return where.is_ipc or (where.is_tcp and is_loopback(where.host))


def url_host(host: str) -> str:
    """``host`` as it goes in a ``tcp://`` address: an IPv6 literal in brackets (``fd00::2`` ->
    ``[fd00::2]``), a name or an IPv4 address as it is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def advertised(endpoint: str) -> str:
    """``endpoint`` (a bound socket's ``LAST_ENDPOINT``) as peers are told to reach it.

    A socket bound to every address (``tcp://0.0.0.0:P``, ``tcp://*:P``, ``tcp://[::]:P``) names
    itself by the wildcard, which no other machine can connect to: a head bound so told its
    workers to answer it at ``0.0.0.0``. This host's address on its default route stands in (the
    one other machines most likely reach it by; the socket still listens on every address);
    with no default route the endpoint stays as it is.
    """
    where = Address.parse(endpoint)
    if not where.is_tcp or where.host not in ("0.0.0.0", "*", "[::]"):
        return endpoint
    # Documentation addresses (RFC 3849, RFC 5737): only a default route leads there.
    for outside in ("2001:db8::1", "192.0.2.1") if where.host == "[::]" else ("192.0.2.1",):
        source = route_source(outside)
        if source is not None:
            return f"tcp://{url_host(source)}:{where.port}"
    return endpoint


def route_source(host: str, port: int = 9) -> str | None:
    """The address this host sends from toward ``host`` (a name, or an address, bracketed or not): the
    kernel's choice of route, read from a UDP socket "connected" there, which sends nothing. None
    where ``host`` does not resolve or no route leads to it."""
    try:
        family, _, _, _, target = net.getaddrinfo(host.strip("[]"), port, type=net.SOCK_DGRAM)[0]
        with net.socket(family, net.SOCK_DGRAM) as probe:
            probe.connect(target)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def is_own_address(host: str) -> bool | None:
    """Whether ``host`` (a name or an address) is an address of this machine: one a socket here can
    bind. None where it does not resolve."""
    try:
        found = net.getaddrinfo(host.strip("[]"), None, type=net.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, address in found:
        try:
            with net.socket(family, net.SOCK_DGRAM) as probe:
                probe.bind((address[0], 0, *address[2:]))
            return True
        except OSError:
            continue
    return False


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
