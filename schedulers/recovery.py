"""How a job recovers from a lost node: respawn, restore from snapshots, form the groups again.

Functions of a :class:`~schedulers.job_core.JobCore` (``job``), which they change
through its methods; :func:`recover` is the entry point.
"""

from __future__ import annotations

import asyncio
import logging
import time

from actors import ActorRef, NodeLost, StageLost
from stages import Coords, StageActor
from stages.comm.parallel import root_cause

from schedulers import job_state
from schedulers.job_core import JobCore, Placer
from schedulers.events import JobRecovered
from schedulers.records import Recovery


__all__ = ["Placer", "may_recover", "recover", "stop_retired"]

log = logging.getLogger(__name__)


def may_recover(job: JobCore) -> bool:
    return job.placer is not None and job.restarts < job.spec.fault_tolerance.max_restarts


async def recover(job: JobCore, cause: NodeLost | StageLost) -> Recovery:
    """Replaces the job's lost stages on free nodes (a stage whose own process ended, on its node,
    which is still alive) and rolls every stage back to the newest
    snapshot they all have (or, when no copy of a lost rank survived, to the job's newest
    checkpoint); the caller then replays the steps since (see :meth:`~schedulers.control.JobController.step`).

    A lost rank's snapshot comes from the next pipeline rank, which it sent it to;
    the survivors restore their own. The parameters after the replay are those of
    a run without the fault (the data comes from the same batches or data steps).

    Raises:
        NodeLost: no free node, or no snapshot every stage has (e.g. a rank and the
            one keeping its snapshot were both lost); the job stays failed.
    """
    started = time.perf_counter()
    alive = await job.alive_nodes()
    size = job.mesh.size
    # A stage whose process ended (its node said so) on a node still alive is built again there.
    ended = [rank for rank, ref in enumerate(job.stages)
             if job.nodes[rank] in alive and job.runtime.lost(ref.address) is not None]
    lost = sorted({rank for rank, node in enumerate(job.nodes) if node not in alive} | set(ended))
    survivors = [rank for rank in range(size) if rank not in lost]

    def unrecoverable(why: str) -> NodeLost | StageLost:
        return type(cause)(f"{job.id} cannot recover from {cause.message.splitlines()[0]}: {why}",
                           details={**cause.details, "node": cause.node})

    # Whatever a survivor still runs (one that was cut off and came back included) stops first.
    await asyncio.gather(*(job.stages[r].endpoint(StageActor.abort_step, timeout=5).call(job.next_step - 1)
                           for r in survivors), return_exceptions=True)
    infos = await asyncio.gather(*(job.stages[r].endpoint(StageActor.snapshots, timeout=5).call()
                                   for r in survivors), return_exceptions=True)
    failed = [job.nodes[r] for r, info in zip(survivors, infos) if isinstance(info, BaseException)]
    if failed:
        raise unrecoverable(f"node {failed[0]} did not answer either")
    shelves = {r: info for r, info in zip(survivors, infos) if not isinstance(info, BaseException)}
    common = set.intersection(*(set(shelves[r]["own"]) for r in survivors)) if survivors else set()
    sources: dict[int, tuple[int, bool]] = {}  # lost rank -> (where its state comes from, a replica's own?)
    for rank in lost:
        source = _snapshot_source(job, rank, lost)
        if source is None:
            common = set()  # no copy of this rank survived: only a checkpoint can help
            break
        sources[rank] = source
        keeper, own = source
        held = shelves[keeper]["own"] if own else \
            shelves[keeper]["held"].get(str(job.mesh.coords(rank).pipeline), [])
        common &= set(held)
    usable = {i for i in common if _replayable(job, i)}
    checkpoint = job.last_checkpoint if not usable else None
    if not usable and (checkpoint is None or not _replayable(job, checkpoint[1])):
        zero = (f" (with zero_stage={job.spec.optimization.zero_stage} a replica's optimizer state is its own "
                "shard: another replica's snapshot cannot stand in for it)"
                ) if job.spec.optimization.zero_stage in (1, 2) and job.mesh.data > 1 else ""
        raise unrecoverable("no snapshot that every stage has, and no checkpoint of this job to go back to, "
                            f"with the batches since kept{zero}" if checkpoint is None else
                            f"no snapshot that every stage has, and the batches since its checkpoint "
                            f"{checkpoint[0].directory} (step {checkpoint[1]}) are no longer kept{zero}")
    target = max(usable) if usable else checkpoint[1] if checkpoint is not None else 0
    assert job.placer is not None
    homeless = [rank for rank in lost if rank not in ended]
    try:
        free = iter(await job.placer.free_nodes(len(homeless), set(job.nodes)) if homeless else [])
    except ValueError as exc:
        raise unrecoverable(str(exc)) from None
    chosen = [(job.nodes[rank], "") if rank in ended else next(free) for rank in lost]
    # A restart counts from here, where the job changes: a try that found no free node, or nothing to go
    # back to, changed nothing and used none up (with max_restarts=1 a spare started after it never helped).
    job.restarting()
    moved = {job.nodes[rank]: node for rank, (node, _) in zip(lost, chosen)}
    for rank, (node, identity) in zip(lost, chosen):
        job.moved(rank, node, identity)
    dist_config = None
    if job.rendezvous is not None:  # the process groups form again, with the new members
        rendezvous, dist_config = await job.placer.renew_rendezvous(job)
        job.renewed_rendezvous(rendezvous)
    # A new member blocks in its start until every member has joined the new groups: all at once.
    timeout = job.spec.fault_tolerance.step_timeout_s
    spawned = await asyncio.gather(
        *(job.placer.spawn(job, rank, node, dist_config) for rank, (node, _) in zip(lost, chosen)),
        *(job.stages[r].endpoint(StageActor.rejoin, timeout=timeout).call(dist_config or {})
          for r in (survivors if dist_config is not None else [])),
        return_exceptions=True)
    failures = [r for r in spawned if isinstance(r, BaseException)]
    if failures:
        raise unrecoverable(f"could not rebuild the lost stage(s): {root_cause(failures)}")
    for rank, ref in zip(lost, spawned):
        assert isinstance(ref, ActorRef)
        job.replaced(rank, ref)
    await asyncio.gather(*(
        ref.endpoint(StageActor.connect, timeout=30).call(
            [job.stages[r].to_wire() for r in job.mesh.pipeline_ranks(c.data, c.tensor)], job.identities,
            [member.to_wire() for member in job.stages], job.next_step - 1)
        for ref, c in ((ref, job.mesh.coords(g)) for g, ref in enumerate(job.stages))))
    if checkpoint is not None:  # every stage, the new ones too, from the job's newest checkpoint
        job.replays_from_factory(target)  # a data-factory job (see _replayable)
        await job_state.apply_checkpoint(job, checkpoint[0])
    else:
        for rank in lost:
            keeper, own = sources[rank]
            state = await (job.stages[keeper].endpoint(StageActor.own_snapshot, timeout=300).call(target) if own
                           else job.stages[keeper].endpoint(StageActor.held_snapshot, timeout=300).call(
                               job.mesh.coords(rank).pipeline, target))
            await job.stages[rank].endpoint(StageActor.restore_snapshot, timeout=300).call(target, state)
        await asyncio.gather(*(job.stages[r].endpoint(StageActor.restore_snapshot, timeout=300).call(target)
                               for r in survivors))
    job.rolled_back(target)
    event = JobRecovered(job=job.id, lost=sorted(moved), moved=moved, from_step=target,
                         replayed=job.steps_done - target,
                         from_checkpoint=checkpoint[0].directory if checkpoint is not None else None,
                         seconds=round(time.perf_counter() - started, 3),
                         restarts_left=job.spec.fault_tolerance.max_restarts - job.restarts)
    done = Recovery(lost=event.lost, moved=event.moved, from_step=event.from_step, replayed=event.replayed,
                    from_checkpoint=event.from_checkpoint, seconds=event.seconds, restarts_left=event.restarts_left)
    log.warning("%s recovered: %s", job.id, done)
    job.publish(event)
    return done


def _replayable(job: JobCore, start: int) -> bool:
    """Whether the steps from ``start`` to the job's last can run again: their batches are kept,
    or the job has only ever read its data factory (which gives any step again)."""
    kept = all(k in job.history for k in range(start, job.steps_done))
    return kept or (job.spec.training.data is not None and not job.driver_batches)


def _snapshot_source(job: JobCore, rank: int, lost: list[int]) -> tuple[int, bool] | None:
    """Where a lost rank's state comes from: a surviving data-parallel replica of it (its own
    snapshot is the same), else the next pipeline rank of its replica (which kept a copy).

    With ZeRO-1 a replica's optimizer state is its own shard: only the pipeline neighbour's
    copy will do (and with one pipeline stage, the job's newest checkpoint)."""
    mesh, c = job.mesh, job.mesh.coords(rank)
    replicas = [mesh.rank(Coords(data=d, pipeline=c.pipeline, tensor=c.tensor)) for d in range(mesh.data)]
    for replica in replicas if job.spec.optimization.zero_stage == 0 else []:
        if replica not in lost:
            return replica, True
    if mesh.pipeline > 1:
        keeper = mesh.rank(Coords(data=c.data, pipeline=(c.pipeline + 1) % mesh.pipeline, tensor=c.tensor))
        if keeper not in lost:
            return keeper, False
    return None


def stop_retired(job: JobCore, alive: set[str]) -> None:
    """Stops replaced stage actors whose node came back (best effort, in the background)."""
    for ref in job.returned(alive):
        job.runtime.spawn_task(_stop_retired_one(job, ref), name=f"stop retired {ref.name}")


async def _stop_retired_one(job: JobCore, ref: ActorRef) -> None:
    if job.placer is not None:
        await job.placer.stop([ref])

