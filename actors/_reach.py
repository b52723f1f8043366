"""Why a head did not answer: what a driver or a worker can find out for itself, for its error.

A call that gets no answer says only that it waited; ZeroMQ keeps retrying a refused
connection and drops a refused CURVE handshake in silence. When the first call to a
head times out, :func:`why_no_answer` looks once at the address: whether anything
listens there at all (an ``ipc://`` socket file, a TCP port that accepts), and if
something does, what makes a head stay silent to this process (its key not in the
head's ring, or no key for a secure head). :func:`check_security_matches` refuses at
once what cannot work: no keys for an address that carries the head's public key.
"""

from __future__ import annotations

import os
import socket

from actors._errors import ActorTimeout
from transport.addresses import Address, is_local_address, is_own_address, route_source, url_host
from transport.security import split_address

__all__ = ["HeadUnreachable", "SecurityMismatch", "check_can_answer", "check_head_address", "check_security_matches",
           "why_no_answer"]

# How long a look at a TCP address may wait for the connection to be accepted.
PROBE_TIMEOUT_S = 2.0


class SecurityMismatch(ValueError):
    """A process without keys asked to reach a head whose address carries its public key."""


class HeadUnreachable(ActorTimeout):
    """The head did not answer in time; the message says what a look at its address found."""


def check_head_address(address: str) -> None:
    """Refuses, at once, an address no head can listen at (libzmq refuses it at the first call, as
    ``Invalid argument``, or, past the last port, a probe of it fails with ``OverflowError``).

    Raises:
        ValueError: not ``tcp://HOST:PORT`` (a port of 1-65535) or ``ipc://PATH``; says which part.
    """
    endpoint, _ = split_address(address)
    where = Address.parse(endpoint)
    why = None
    if not (where.is_tcp or where.is_ipc):
        why = "it is not tcp://HOST:PORT or ipc://PATH"
    elif where.is_ipc and not where.path:
        why = "it names no socket file"
    elif where.is_tcp and not where.host:
        why = "it needs a host and a port"
    elif where.is_tcp and not 0 < (where.port_number or 0) < 65536:
        why = f"{where.port!r:.20} is not a TCP port (1-65535)"
    if why is not None:
        raise ValueError(f"the head's address {endpoint!r:.120} cannot be reached: {why}; give the address the "
                         "head printed (actorpipe head listening at ...) or its --address-file")


def check_can_answer(address: str, own: str, fix: str) -> None:
    """Refuses, at once, to call a head on another machine from a process it cannot answer: one that
    listens at ``own`` on loopback (or ``ipc://``), where the head's answer would go to its own
    machine, and the call would wait in silence until it timed out. ``fix`` says how to listen
    elsewhere (the driver's arguments or the node's flags).

    A head whose address is loopback, or an address of this machine, is answered at loopback.

    Raises:
        ValueError: the head is elsewhere and ``own`` is loopback; the message names this
            machine's address toward the head.
    """
    endpoint, own_endpoint = split_address(address)[0], split_address(own)[0]
    where = Address.parse(endpoint)
    if not where.is_tcp or is_local_address(endpoint) or not is_local_address(own_endpoint):
        return
    host = where.host
    if is_own_address(host) is not False:  # this machine's, or not resolved yet: nothing to say now
        return
    toward = route_source(host)
    here = f" (this machine's address toward it is {url_host(toward)})" if toward else ""
    raise ValueError(f"the head at {endpoint} is on another machine, and this process listens at "
                     f"{own_endpoint}, on loopback, where the head's answers cannot reach it: {fix}{here}")


def check_security_matches(address: str, secure: bool, fix: str) -> None:
    """Refuses to reach a secure head without keys (its address carries its public key); ``fix``
    says how to give this process its keys (the driver's arguments or the node's flags).

    Raises:
        SecurityMismatch: ``secure`` is False and ``address`` names a CURVE key.
    """
    endpoint, key = split_address(address)
    if key is not None and not secure:
        raise SecurityMismatch(f"the head at {endpoint} is secure (its address carries its public key), and this "
                               f"process has no keys: {fix}, or start the head with --insecure")


def why_no_answer(address: str, secure: bool, own: str = "") -> str:
    """One sentence on why the head at ``address`` may not have answered (``secure``: this process speaks
    CURVE; ``own``: where this process listens, which the head's answers must reach)."""
    endpoint, _ = split_address(address)
    listening = _listens(endpoint)
    if listening is not None:
        return listening
    if secure:
        causes = ("a head whose ring does not hold this process's key refuses its handshake without a word (is "
                  "keys= the cluster's key directory, and identity= one of its keys?)")
    else:
        causes = "a secure head (one started without --insecure) refuses a process without keys"
    own_endpoint = split_address(own)[0]
    if own_endpoint.startswith("tcp://") and not is_local_address(own_endpoint):
        causes += (f", or its answers cannot reach this process at {own_endpoint} (a firewall, NAT, or an address "
                   "on a network the head has no route to: bind one the head reaches)")
    return f"something listens there but did not answer: {causes}, or it is not an actorpipe head, or it is too busy " \
           "to answer in time"


def _listens(endpoint: str) -> str | None:
    """None where something accepts a connection at ``endpoint``, else why nothing does."""
    where = Address.parse(endpoint)
    if where.is_ipc:
        if not os.path.exists(where.path):
            return (f"nothing listens there: there is no socket file at {where.path} (is the head running, at "
                    "this address?)")
        family: int = socket.AF_UNIX
        target: str | tuple[str, int] = where.path
    elif where.is_tcp:
        if where.port_number is None:
            return None  # a name ZeroMQ resolves its own way: no verdict
        family, target = where.family, (where.bare_host, where.port_number)
    else:
        return None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(target)
        except (ConnectionRefusedError, FileNotFoundError):
            return f"nothing listens there: {endpoint} refused the connection (is the head running, at this address?)"
        except OSError as exc:
            return f"{endpoint} could not be reached: {exc.strerror or exc} (a host that is down, or a firewall)"
    return None
