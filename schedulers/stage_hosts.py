"""The scheduler's stage actors on its nodes: each spawned by its node's agent, which alone stops it.

A worker hosts each stage in a process of its own, at an address of its own; the node agent
that spawned it is the one that stops it (or kills it, when a job's code holds on), so the
agent of every stage is kept here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from actors import NODE, ActorError, ActorRef, Host, NodeActor, NodeInfo
from stages import StageConfig
from stages.comm.parallel import root_cause
from schedulers.jobs import JobSpec, stage_config

__all__ = ["StageHosts"]

log = logging.getLogger(__name__)


class StageHosts:
    """Spawns and stops stage actors through their nodes' agents.

    Args:
        runtime: the head's runtime (called: the scheduler's, once it is spawned).
        alive: the nodes alive now.
    """

    def __init__(self, runtime: Callable[[], Host], alive: Callable[[], Awaitable[list[NodeInfo]]]) -> None:
        self._runtime = runtime
        self._alive = alive
        self._agents: dict[ActorRef, str] = {}  # each stage actor's node agent (its address)

    async def spawn(self, node: NodeInfo, name: str, config: StageConfig) -> ActorRef:
        """A stage actor built on ``node`` from ``config``'s fields as keyword arguments (StageActor(**config))."""
        runtime = self._runtime()
        agent = runtime.ref(node.address, NODE).endpoint(NodeActor.spawn, timeout=300)
        address, spawned = await agent.call("stage", name, config.to_wire())
        stage = runtime.ref(address, spawned)
        self._agents[stage] = node.address  # who stops it
        return stage

    async def spawn_job(self, job_id: str, spec: JobSpec, bounds: list[list[int]], nodes: list[NodeInfo],
                        dist_config: dict[str, Any] | None) -> list[ActorRef]:
        """Every stage actor of job ``job_id``, one on each of ``nodes`` (by global rank), all or none.

        A creation cancelled meanwhile (its caller gave up) waits for the spawns in flight, which
        the nodes finish regardless, and stops what they made before it ends.

        Raises:
            the first stage's failure to build (the others are stopped).
        """
        spawning = asyncio.gather(*(
            self.spawn(node, f"{job_id}.rank{rank}",
                       stage_config(spec, job=job_id, global_rank=rank, bounds=bounds, dist=dist_config))
            for rank, node in enumerate(nodes)), return_exceptions=True)
        try:
            results = await asyncio.shield(spawning)
        except asyncio.CancelledError:
            await asyncio.shield(self.stop([r for r in await spawning if isinstance(r, ActorRef)]))
            raise
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.stop([r for r in results if isinstance(r, ActorRef)])
            raise root_cause(failed)
        return [r for r in results if isinstance(r, ActorRef)]

    async def stop(self, stages: list[ActorRef]) -> None:
        """Stops stage actors on the nodes still alive, each within a few seconds (a lost node's go with it)."""
        if not stages:
            return
        runtime = self._runtime()
        alive = {n.address for n in await self._alive()}
        agents = {ref: self._agents.pop(ref, ref.address) for ref in stages}

        async def stop(ref: ActorRef) -> None:
            try:  # the agent's grace for a stage that holds on (actors._processes), and a margin
                await runtime.ref(agents[ref], NODE).endpoint(NodeActor.stop_actor, timeout=5).call(ref.name)
            except ActorError as exc:
                log.info("could not stop %s: %s", ref.name, exc)

        await asyncio.gather(*(stop(ref) for ref in stages if agents[ref] in alive))
