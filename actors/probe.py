"""The probe actor: every node can host it, for health checks, benchmarks and tests."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from actors._actor import Actor, endpoint
from actors._registry import register_actor

__all__ = ["ProbeActor"]


@register_actor("probe")
class ProbeActor(Actor):
    """Answers pings, echoes, raises on request and records the order of its calls."""

    def __init__(self, label: str = "") -> None:
        self.label = label
        self.log: list[Any] = []

    @endpoint(taskless_start=True)
    async def echo(self, value: Any) -> Any:
        return value

    @endpoint(taskless_start=True)
    async def ping(self) -> None:
        return None

    @endpoint
    async def whoami(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "label": self.label, "name": self.name}

    @endpoint
    async def fail(self, message: str) -> None:
        raise RuntimeError(message)

    @endpoint
    async def record(self, value: Any) -> None:
        self.log.append(value)

    @endpoint
    async def recorded(self) -> list[Any]:
        return list(self.log)

    @endpoint
    async def sleep(self, seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    @endpoint(concurrent=True)
    async def status(self) -> dict[str, Any]:
        """Answers at once, even while a sequential call (say ``sleep``) runs."""
        return {"recorded": len(self.log)}

    @endpoint
    async def ping_peer(self, address: str, name: str, count: int, in_flight: int = 1) -> dict[str, Any]:
        """Measures calls from here to the probe ``name`` at ``address``.

        Returns:
            ``rtts_s``: each call's round trip (``in_flight == 1``), and ``elapsed_s``
            for all ``count`` calls with ``in_flight`` outstanding at a time.
        """
        ping = self.runtime.ref(address, name).endpoint(ProbeActor.ping, timeout=30)
        rtts: list[float] = []

        async def one() -> None:
            start = time.perf_counter()
            await ping.call()
            rtts.append(time.perf_counter() - start)

        async def lane(calls: int) -> None:
            for _ in range(calls):
                await one()

        # in_flight lanes of sequential calls keep that many outstanding at all times.
        lanes = [count // in_flight + (i < count % in_flight) for i in range(max(1, in_flight))]
        start = time.perf_counter()
        await asyncio.gather(*(lane(calls) for calls in lanes))
        return {"rtts_s": rtts if in_flight <= 1 else [], "elapsed_s": time.perf_counter() - start}
