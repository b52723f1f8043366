"""CURVE channels: only admitted keys get a byte through, and each message says whose key sent it."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq

from transport.channel import Receiver, open_receiver, open_sender
from transport.security import Gate, Keypair, bulk_endpoint, join_address, read_public_key, split_address

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def secure() -> AsyncIterator[tuple[Receiver, Gate, Keypair, Keypair, zmq.Context[object]]]:
    server, member = Keypair.generate(), Keypair.generate()
    context: zmq.Context[object] = zmq.Context()
    gate = Gate(context, lambda: {member.public: "node:n0"})
    receiver = open_receiver("tcp://127.0.0.1:0", context=context, curve=server)
    try:
        yield receiver, gate, server, member, context
    finally:
        await receiver.aclose()
        gate.stop()
        context.term()


@pytest.mark.parametrize("bulk", ["encrypt", "curve"])
async def test_an_admitted_key_gets_through_and_is_named(secure: tuple, bulk: str) -> None:
    receiver, _, _, member, _ = secure
    async with open_sender(receiver.address, curve=member, bulk=bulk) as sender:  # type: ignore[arg-type]
        # A sealed session opens while the receiver reads: read while sending.
        received = asyncio.ensure_future(receiver.receive_frames())
        await sender.send({"x": 1}, timeout=5)
        frames = await asyncio.wait_for(received, 5)
    assert frames[0].get("User-Id") == "node:n0"


@pytest.mark.parametrize("who", ["stranger", "plaintext"])
async def test_a_peer_without_an_admitted_key_never_reaches_the_decoder(secure: tuple, who: str) -> None:
    receiver, gate, _, _, _ = secure
    endpoint, _ = split_address(receiver.address)
    sender = open_sender(receiver.address, curve=Keypair.generate()) if who == "stranger" else open_sender(endpoint)
    async with sender:
        with pytest.raises(TimeoutError):  # IMMEDIATE: no handshake, no connected peer, no room
            await sender.send({"x": 1}, timeout=1.0)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(receiver.receive_frames(), 0.3)
    assert receiver.statistics().messages == 0
    if who == "stranger":
        assert gate.refused >= 1


@pytest.mark.parametrize("with_bulk", [False, True])
async def test_a_listener_that_cannot_prove_the_key_in_the_address_gets_nothing(secure: tuple,
                                                                                with_bulk: bool) -> None:
    receiver, _, _, member, _ = secure
    endpoint, _ = split_address(receiver.address)
    # With the receiver's real bulk socket: the session's key goes only to the key's holder.
    impostor = join_address(endpoint, Keypair.generate().public, bulk_endpoint(receiver.address) if with_bulk else None)
    async with open_sender(impostor, curve=member) as sender:
        with pytest.raises(TimeoutError):
            await sender.send({"x": 1}, timeout=1.0)
    assert receiver.statistics().messages == 0


def test_addresses_carry_the_key_and_split_back() -> None:
    keys = Keypair.generate()
    address = join_address("tcp://127.0.0.1:5555", keys.public)
    assert address.startswith("tcp://127.0.0.1:5555|") and len(address.split("|")[1]) == 64
    assert split_address(address) == ("tcp://127.0.0.1:5555", keys.public)
    assert split_address("ipc:///tmp/x/sock") == ("ipc:///tmp/x/sock", None)
    with pytest.raises(ValueError, match="64 hex digits"):
        split_address("tcp://127.0.0.1:1|zz")
    with pytest.raises(ValueError, match="carries no CURVE key"):
        open_sender("tcp://127.0.0.1:1", curve=keys)


def test_key_files_are_private_and_load_back(tmp_path: Path) -> None:
    keys = Keypair.generate()
    public_path, secret_path = keys.save(tmp_path, "node0")
    for path in (public_path, secret_path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Keypair.load(secret_path) == keys
    assert read_public_key(public_path) == keys.public
    with pytest.raises(ValueError, match="holds no secret key"):
        Keypair.load(public_path)
    assert keys.secret.decode() not in repr(keys)
