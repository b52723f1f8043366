"""What a driver or a node says when the head does not answer (actors._reach): nothing listens at
the address, or something does and stays silent, and what to check then."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import pytest

from actors import Cluster, HeadUnreachable, SecurityMismatch
from actors._reach import check_can_answer, check_head_address, check_security_matches, why_no_answer
from transport.addresses import is_own_address, route_source

KEY = "ab" * 32  # a public key part of an address: 64 hex digits

pytestmark = pytest.mark.timeout(60)


def test_an_ipc_address_without_its_socket_file_is_nothing_listening(tmp_path: Path) -> None:
    assert why_no_answer(f"ipc://{tmp_path}/head", secure=True) == \
        f"nothing listens there: there is no socket file at {tmp_path}/head (is the head running, at this address?)"


def test_a_refused_tcp_port_is_nothing_listening() -> None:
    with socket.socket() as probe:  # a port nothing listens at once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert "nothing listens there: tcp://127.0.0.1:%d refused the connection" % port in \
        why_no_answer(f"tcp://127.0.0.1:{port}|{KEY}", secure=True)


@pytest.mark.parametrize(("secure", "says"), [
    (True, "a head whose ring does not hold this process's key refuses its handshake"),
    (False, "a secure head (one started without --insecure) refuses a process without keys"),
])
def test_something_that_listens_and_stays_silent_is_told_apart(tmp_path: Path, secure: bool, says: str) -> None:
    with socket.socket() as tcp, socket.socket(socket.AF_UNIX) as unix:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        unix.bind(str(tmp_path / "head"))
        unix.listen()
        for address in (f"tcp://127.0.0.1:{tcp.getsockname()[1]}", f"ipc://{tmp_path}/head"):
            assert why_no_answer(address, secure).startswith(f"something listens there but did not answer: {says}")
            # Listening beyond loopback, the answers' way back is a cause too; on loopback it is not.
            assert "its answers cannot reach this process at tcp://10.1.2.3:7 (a firewall" in \
                why_no_answer(address, secure, f"tcp://10.1.2.3:7|{KEY}")
            assert "its answers" not in why_no_answer(address, secure, "tcp://127.0.0.1:7")


def test_no_keys_for_an_address_that_carries_the_heads_key_is_refused_at_once() -> None:
    check_security_matches(f"tcp://127.0.0.1:5555|{KEY}", True, "give keys")
    check_security_matches("tcp://127.0.0.1:5555", False, "give keys")
    with pytest.raises(SecurityMismatch, match="the head at tcp://127.0.0.1:5555 is secure .* no keys: give keys, or "
                                               "start the head with --insecure"):
        check_security_matches(f"tcp://127.0.0.1:5555|{KEY}", False, "give keys")


async def test_a_driver_that_reaches_nothing_says_so(tmp_path: Path) -> None:
    with pytest.raises(HeadUnreachable, match=r"no reply from head.nodes at ipc://.* within 0.5s: nothing listens "
                                              r"there: there is no socket file"):
        await Cluster.connect(f"ipc://{tmp_path}/head", insecure=True, timeout=0.5)


async def test_a_closed_connection_says_so_before_any_call() -> None:
    """A job's call after its cluster's block ended said "runtime at ipc://.../driver is closed"."""
    import contextlib

    from actors import HEAD, ActorStopped, open_runtime

    stack = contextlib.AsyncExitStack()
    runtime = await stack.enter_async_context(open_runtime("tcp://127.0.0.1:0"))
    cluster = Cluster(runtime, runtime.ref("tcp://127.0.0.1:1", HEAD), stack)
    cluster.check_head()  # open: nothing to say
    await stack.aclose()
    with pytest.raises(ActorStopped, match=r"^this connection to the cluster is closed \(cluster.close\(\), or the "
                                           r"end of its async with\)"):
        cluster.check_head()


@pytest.mark.parametrize(("address", "why"), [
    ("foo", "it is not tcp://HOST:PORT or ipc://PATH"),
    ("127.0.0.1:5555", "it is not tcp://HOST:PORT or ipc://PATH"),
    ("udp://127.0.0.1:5555", "it is not tcp://HOST:PORT or ipc://PATH"),
    ("tcp://127.0.0.1", "it needs a host and a port"),
    ("tcp://:5555", "it needs a host and a port"),
    ("tcp://127.0.0.1:99999", "'99999' is not a TCP port"),
    ("tcp://127.0.0.1:0", "'0' is not a TCP port"),
    ("ipc://", "it names no socket file"),
])
async def test_an_address_no_head_can_listen_at_is_refused_at_once(address: str, why: str) -> None:
    """Cluster.connect("foo") hung for ever (the socket libzmq refused stayed open, and the runtime's
    close waited for it in Context.term); tcp://...:99999 failed after the timeout with OverflowError."""
    for ok in ("tcp://127.0.0.1:5555", f"tcp://[::1]:5555|{KEY}", "ipc:///tmp/x/head", "tcp://head-0.train:29400"):
        check_head_address(ok)
    with pytest.raises(ValueError, match=f"the head's address .* cannot be reached: {re.escape(why)}"):
        check_head_address(address)
    with pytest.raises(ValueError, match=re.escape(why)):
        await asyncio.wait_for(Cluster.connect(address, insecure=True, timeout=30), 20)


def test_a_loopback_process_calling_a_head_on_another_machine_is_refused_with_the_address_to_use() -> None:
    """The two-host case runs across network namespaces (tests/actors/test_remote.py); here the decision."""
    own = route_source("192.0.2.1")  # this machine's address on its default route (TEST-NET-1 is not ours)
    assert own is not None and is_own_address(own) and is_own_address("localhost")
    assert is_own_address("192.0.2.1") is False and is_own_address("no-such-host.invalid") is None
    for head in ("tcp://127.0.0.1:5555", "tcp://[::1]:5555", f"tcp://{own}:5555", "ipc:///tmp/x/head",
                 "tcp://no-such-host.invalid:5555"):  # loopback, this machine's own, or not known yet
        check_can_answer(head, "tcp://127.0.0.1:0", "fix")
    check_can_answer("tcp://192.0.2.1:5555", f"tcp://{own}:0", "fix")  # listening where the head reaches
    with pytest.raises(ValueError, match=rf"the head at tcp://192.0.2.1:5555 is on another machine, and this process "
                                         rf"listens at ipc:///x, .*: fix \(this machine's address toward it is {own}\)"):
        check_can_answer(f"tcp://192.0.2.1:5555|{KEY}", "ipc:///x", "fix")


def test_a_sender_to_an_address_libzmq_refuses_leaves_no_socket_open() -> None:
    import threading

    import zmq

    from transport.channel import open_sender

    context: zmq.Context[object] = zmq.Context()
    with pytest.raises(zmq.ZMQError) as refused:  # kept, as a caller keeps it: its traceback holds the sender
        open_sender("foo", context=context)
    ended = threading.Thread(target=context.term, daemon=True)  # waits for every socket of the context
    ended.start()
    ended.join(timeout=10)
    assert not ended.is_alive(), "Context.term waits for a socket the failed sender left open"
    assert "Invalid argument" in str(refused.value)
