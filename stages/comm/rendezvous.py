"""A torch.distributed rendezvous served over the authenticated actor channel.

torch.distributed's process groups meet through a key-value store. Its ``TCPStore``
speaks plaintext to anyone who reaches its port: on a cluster started with
``--allow-remote`` every machine on the network could read and write a job's
rendezvous. Here the store is an actor on the head (:class:`RendezvousActor`), so
every store operation travels as an actor call over the cluster's CURVE channel and
only the keys of the job's own nodes are served; each stage joins through
:class:`ActorStore`, a ``torch.distributed.Store`` whose operations are those calls.

The store only carries the handshake (addresses, unique ids, barriers): a job makes a
few hundred operations when it starts and none per step. The collective traffic that
follows (gloo, NCCL) is not authenticated, as in every torch.distributed job.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

from actors._actor import Actor, caller_among, current_caller, endpoint
from actors._errors import ActorError, NotAllowed
from actors._ref import ActorRef

__all__ = ["ActorStore", "RendezvousActor", "StoreLimits"]

log = logging.getLogger(__name__)


class StoreLimits:
    """What one job's store holds at most: a member cannot fill the head's memory."""

    max_keys = 65_536
    max_key_chars = 1_024
    max_value_bytes = 4 << 20
    max_total_bytes = 64 << 20


class RendezvousActor(Actor):
    """One job's key-value store, for its members only.

    The operations and their meaning are ``torch.distributed.Store``'s: ``get`` and
    ``wait`` wait (up to the job's timeout) for keys that are not there yet, ``add``
    keeps a decimal counter, ``compare_set`` swaps only on a match. A call from a key
    that is not one of the job's nodes is refused with :class:`~actors.NotAllowed` and
    counted; stopping the actor wakes every waiting call with an error at once.
    """

    def __init__(self, members: Iterable[str], *, timeout_s: float, job: str = "") -> None:
        self._members = frozenset(m for m in members if m)
        self._timeout_s = float(timeout_s)
        self._job = job
        self._data: dict[str, bytes] = {}
        self._bytes = 0
        self._changed = asyncio.Event()  # replaced on every change: waiters wake and look again
        self._closed = False

    async def on_stop(self) -> None:
        self._closed = True
        self._changed.set()

    # -- checks ------------------------------------------------------------------------

    def _admit(self) -> None:
        if not caller_among(self._members):
            self.refused_calls += 1
            raise NotAllowed(f"{current_caller()[:60]!r} holds no key of {self._job or 'this job'}'s nodes; "
                             "only its members use its rendezvous")

    def _key(self, key: Any) -> str:
        if not isinstance(key, str) or not key or len(key) > StoreLimits.max_key_chars:
            raise ValueError(f"a store key is a non-empty string of at most {StoreLimits.max_key_chars} "
                             f"characters, got {type(key).__name__}")
        return key

    def _value(self, value: Any) -> bytes:
        if isinstance(value, str):
            value = value.encode()
        if not isinstance(value, (bytes, bytearray)):
            raise ValueError(f"a store value is bytes, got {type(value).__name__}")
        if len(value) > StoreLimits.max_value_bytes:
            raise ValueError(f"a store value holds at most {StoreLimits.max_value_bytes} bytes, got {len(value)}")
        return bytes(value)

    def _put(self, key: str, value: bytes) -> None:
        old = self._data.get(key)
        grown = len(value) - (len(old) if old is not None else 0)
        if old is None and len(self._data) >= StoreLimits.max_keys:
            raise ValueError(f"the rendezvous of {self._job or 'this job'} holds {StoreLimits.max_keys} keys already")
        if self._bytes + grown > StoreLimits.max_total_bytes:
            raise ValueError(f"the rendezvous of {self._job or 'this job'} holds at most "
                             f"{StoreLimits.max_total_bytes} bytes")
        self._data[key] = value
        self._bytes += grown
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until_present(self, keys: list[str], timeout_s: float | None) -> None:
        limit = self._timeout_s if timeout_s is None else min(float(timeout_s), self._timeout_s)
        deadline = asyncio.get_running_loop().time() + max(0.0, limit)
        while True:
            if self._closed:
                raise ActorError(f"the rendezvous of {self._job or 'this job'} was closed (the job ended)")
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise TimeoutError(f"rendezvous keys {', '.join(repr(k[:80]) for k in missing[:3])} were not set "
                                   f"within {limit:g}s: a member of {self._job or 'the job'} did not join")
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass

    # -- torch.distributed.Store's operations ------------------------------------------

    @endpoint(concurrent=True, roles=("node",))
    async def set(self, key: str, value: bytes) -> None:
        self._admit()
        self._put(self._key(key), self._value(value))

    @endpoint(concurrent=True, roles=("node",))
    async def get(self, key: str, timeout_s: float | None = None) -> bytes:
        self._admit()
        key = self._key(key)
        await self._until_present([key], timeout_s)
        return self._data[key]

    @endpoint(concurrent=True, roles=("node",))
    async def add(self, key: str, amount: int) -> int:
        self._admit()
        key = self._key(key)
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise ValueError(f"add takes an integer, got {type(amount).__name__}")
        try:
            value = int(self._data.get(key, b"0")) + amount
        except ValueError:
            raise ValueError(f"key {key[:80]!r} does not hold a counter") from None
        self._put(key, str(value).encode())
        return value

    @endpoint(concurrent=True, roles=("node",))
    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self._admit()
        key, expected, desired = self._key(key), self._value(expected), self._value(desired)
        current = self._data.get(key)
        if (current is None and not expected) or current == expected:
            self._put(key, desired)
            return desired
        return expected if current is None else current

    @endpoint(concurrent=True, roles=("node",))
    async def append(self, key: str, value: bytes) -> None:
        self._admit()
        key = self._key(key)
        self._put(key, self._data.get(key, b"") + self._value(value))

    @endpoint(concurrent=True, roles=("node",))
    async def wait(self, keys: list[str], timeout_s: float | None = None) -> None:
        self._admit()
        await self._until_present(self._keys(keys), timeout_s)

    @endpoint(concurrent=True, roles=("node",))
    async def check(self, keys: list[str]) -> bool:
        self._admit()
        return all(k in self._data for k in self._keys(keys))

    @endpoint(concurrent=True, roles=("node",))
    async def multi_get(self, keys: list[str]) -> list[bytes]:
        self._admit()
        wanted = self._keys(keys)
        await self._until_present(wanted, None)
        return [self._data[k] for k in wanted]

    @endpoint(concurrent=True, roles=("node",))
    async def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._admit()
        wanted = self._keys(keys)
        if not isinstance(values, list) or len(values) != len(wanted):
            raise ValueError("multi_set takes as many values as keys")
        for key, value in zip(wanted, values):
            self._put(key, self._value(value))

    @endpoint(concurrent=True, roles=("node",))
    async def delete_key(self, key: str) -> bool:
        self._admit()
        old = self._data.pop(self._key(key), None)
        if old is None:
            return False
        self._bytes -= len(old)
        return True

    @endpoint(concurrent=True, roles=("node",))
    async def num_keys(self) -> int:
        self._admit()
        return len(self._data)

    def _keys(self, keys: Any) -> list[str]:
        if not isinstance(keys, list) or len(keys) > StoreLimits.max_keys:
            raise ValueError(f"keys come as a list of at most {StoreLimits.max_keys}")
        return [self._key(k) for k in keys]


class ActorStore(dist.Store):
    """A ``torch.distributed.Store`` whose every operation is a call to a :class:`RendezvousActor`.

    torch calls a store from its own threads and blocks on the answer; the calls are
    run on ``loop`` (the node's event loop, which must not be the calling thread's).
    """

    def __init__(self, ref: ActorRef, loop: asyncio.AbstractEventLoop, timeout: datetime.timedelta) -> None:
        super().__init__()
        self._ref = ref
        self._loop = loop
        self._timeout_s = timeout.total_seconds()

    def _call(self, method: Any, *args: Any, waits: bool = False) -> Any:
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise RuntimeError("ActorStore is called from its own event loop's thread, where it would deadlock; "
                               "join process groups from another thread")
        # A waiting operation may take the store's whole timeout on the head; allow for the trip.
        timeout = self._timeout_s + 30 if waits else 60.0
        call = self._ref.endpoint(method, timeout=timeout).call(*args)
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    def set(self, key: str, value: bytes | str) -> None:
        self._call(RendezvousActor.set, key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        return bytes(self._call(RendezvousActor.get, key, None, waits=True))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(RendezvousActor.add, key, int(amount)))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return bytes(self._call(RendezvousActor.compare_set, key, _as_bytes(expected), _as_bytes(desired)))

    def append(self, key: str, value: bytes | str) -> None:
        self._call(RendezvousActor.append, key, _as_bytes(value))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = None if timeout is None else timeout.total_seconds()
        self._call(RendezvousActor.wait, list(keys), seconds, waits=True)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call(RendezvousActor.check, list(keys)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [bytes(v) for v in self._call(RendezvousActor.multi_get, list(keys), waits=True)]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        self._call(RendezvousActor.multi_set, list(keys), [_as_bytes(v) for v in values])

    def delete_key(self, key: str) -> bool:
        return bool(self._call(RendezvousActor.delete_key, key))

    def num_keys(self) -> int:
        return int(self._call(RendezvousActor.num_keys))


def _as_bytes(value: bytes | str | Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
