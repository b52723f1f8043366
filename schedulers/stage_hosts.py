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

# A stage whose spawn is stopped before its node has forked its process is not known there yet:
# the stop is tried again, this often, this many times.
ABORT_RETRY_S = 0.5
ABORT_TRIES = 6


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

        A creation cancelled meanwhile (its caller gave up) stops the stages still building and
        what was built before it ends, and so does one whose stage failed to build: the others
        may be waiting for it (the members of a process group wait for each other, up to the
        job's step timeout).

        Raises:
            the first stage's failure to build (the others are stopped).
        """
        names = [f"{job_id}.rank{rank}" for rank in range(len(nodes))]
        tasks = [asyncio.ensure_future(self.spawn(node, name, stage_config(spec, job=job_id, global_rank=rank,
                                                                           bounds=bounds, dist=dist_config)))
                 for rank, (node, name) in enumerate(zip(nodes, names))]
        spawning = asyncio.gather(*tasks, return_exceptions=True)

        def in_flight() -> list[tuple[NodeInfo, str]]:
            return [(node, name) for task, node, name in zip(tasks, nodes, names) if not task.done()]

        try:
            await asyncio.shield(asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION))
        except asyncio.CancelledError:
            await asyncio.shield(self._abort(in_flight(), spawning))
            raise
        failed = [e for t in tasks if t.done() and (e := t.exception()) is not None]
        if not failed:
            return [t.result() for t in tasks]
        spawns = in_flight()
        aborted = {name for _, name in spawns}
        await asyncio.shield(self._abort(spawns, spawning))
        late = [r for r, name in zip(await spawning, names)
                if isinstance(r, BaseException) and name not in aborted and r not in failed]
        raise root_cause(failed + late)

    async def _abort(self, spawns: list[tuple[NodeInfo, str]], spawning: asyncio.Future[list[Any]]) -> None:
        """Stops the stage actors still being built (``spawns``: node and name), then waits for every
        spawn to end and stops what was built."""
        runtime = self._runtime()

        async def abort(node: NodeInfo, name: str) -> None:
            for _ in range(ABORT_TRIES):  # the node learns the name once its process is forked
                try:
                    await runtime.ref(node.address, NODE).endpoint(NodeActor.stop_actor, timeout=10).call(name)
                    return
                except ActorError as exc:
                    log.info("could not stop %s while it was built (%s); trying again", name, exc)
                    await asyncio.sleep(ABORT_RETRY_S)

        await asyncio.gather(*(abort(node, name) for node, name in spawns))
        await self.stop([r for r in await spawning if isinstance(r, ActorRef)])

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
