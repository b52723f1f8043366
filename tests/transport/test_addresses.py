"""Addresses split in one place: every reader of ``tcp://HOST:PORT`` and ``ipc://PATH`` agrees on the parts."""

from __future__ import annotations

import socket

import pytest

from transport.addresses import (
    Address,
    advertised,
    bind_address,
    bulk_bind_address,
    is_local_address,
    is_loopback,
    url_host,
)
from transport.security import is_numeric_endpoint


@pytest.mark.parametrize(("text", "parts"), [
    ("tcp://127.0.0.1:5555", ("tcp", "127.0.0.1", "5555", "")),
    ("tcp://[fd13::2]:0", ("tcp", "[fd13::2]", "0", "")),
    ("tcp://[::]:*", ("tcp", "[::]", "*", "")),
    ("tcp://head.example:7000", ("tcp", "head.example", "7000", "")),
    ("tcp://head.example", ("tcp", "", "", "")),  # no port: no host either, so "needs a host and a port"
    ("ipc:///tmp/x/sock", ("ipc", "", "", "/tmp/x/sock")),
    ("ipc://", ("ipc", "", "", "")),
    ("ipc://a:b", ("ipc", "", "", "a:b")),  # a path is never split at a colon
    ("127.0.0.1:5555", ("", "", "", "")),
    ("udp://1.2.3.4:5", ("udp", "1.2.3.4", "5", "")),
])
def test_an_address_splits_into_its_scheme_host_port_and_path(text: str, parts: tuple[str, str, str, str]) -> None:
    where = Address.parse(text)
    assert (where.scheme, where.host, where.port, where.path) == parts


def test_a_socket_gets_an_ipv6_host_without_brackets_and_the_family_that_matches() -> None:
    v6, v4, name = Address.parse("tcp://[::1]:80"), Address.parse("tcp://10.0.0.1:80"), Address.parse("tcp://h:80")
    assert (v6.bare_host, v6.family) == ("::1", socket.AF_INET6)
    assert (v4.bare_host, v4.family) == ("10.0.0.1", socket.AF_INET)
    assert (name.bare_host, name.family) == ("h", socket.AF_INET)
    assert v6.port_number == 80 and Address.parse("tcp://[::1]:*").port_number is None
    assert Address.parse("tcp://[::1]:5").on_port(0) == "tcp://[::1]:0"  # the brackets stay where it is written


def test_a_bind_address_resolves_its_ephemeral_forms_and_keeps_the_loopback_rule() -> None:
    assert bind_address("tcp://127.0.0.1:0", allow_remote=False) == ("tcp://127.0.0.1:*", None)
    assert bind_address("tcp://[::1]:4000", allow_remote=False) == ("tcp://[::1]:4000", None)
    with pytest.raises(ValueError, match="not a loopback address"):
        bind_address("tcp://10.1.2.3:0", allow_remote=False)
    assert bind_address("tcp://10.1.2.3:0", allow_remote=True) == ("tcp://10.1.2.3:*", None)
    with pytest.raises(ValueError, match="needs a host and a port"):
        bind_address("tcp://localhost", allow_remote=False)
    with pytest.raises(ValueError, match="must look like"):
        bind_address("localhost:5", allow_remote=False)
    with pytest.raises(ValueError, match="unsupported transport 'udp'"):
        bind_address("udp://127.0.0.1:5", allow_remote=False)
    # Found by review: --bind tcp://127.0.0.1:70000 listened at port 4464 (70000 - 65536) without a word.
    for port in ("70000", "65536", "x1"):
        with pytest.raises(ValueError, match=f"'{port}' is not a TCP port"):
            bind_address(f"tcp://127.0.0.1:{port}", allow_remote=False)
    assert bind_address("tcp://127.0.0.1:65535", allow_remote=False) == ("tcp://127.0.0.1:65535", None)
    assert bind_address("ipc:///tmp/a", allow_remote=False) == ("ipc:///tmp/a", None)
    assert bulk_bind_address("tcp://[::1]:*") == "tcp://[::1]:*"
    assert bulk_bind_address("ipc:///tmp/a") == "ipc:///tmp/a.bulk"


def test_local_numeric_and_advertised_addresses_read_the_same_parts() -> None:
    assert is_local_address("tcp://[::1]:5|KEY") and is_local_address("ipc:///tmp/s")
    assert not is_local_address("tcp://10.0.0.1:5")
    assert is_loopback("[::1]") and is_loopback("localhost") and not is_loopback("example.org")
    assert is_numeric_endpoint("tcp://[fd00::1]:5") and is_numeric_endpoint("ipc:///tmp/s")
    assert not is_numeric_endpoint("tcp://head:5") and not is_numeric_endpoint("tcp://1.2.3.4:*")
    assert not is_numeric_endpoint("ipc://")
    assert advertised("tcp://127.0.0.1:5") == "tcp://127.0.0.1:5"  # only a wildcard is replaced
    wildcard = advertised("tcp://0.0.0.0:5")
    assert wildcard.endswith(":5") and (wildcard == "tcp://0.0.0.0:5" or Address.parse(wildcard).host != "0.0.0.0")
    assert url_host("fd00::2") == "[fd00::2]" and url_host("[fd00::2]") == "[fd00::2]" and url_host("h") == "h"
