"""The scheduler actor, on the head node: places jobs, and spawns one job actor per job.

Creating a job places one stage actor per node of the mesh, partitions the model from
the layer sizes the first of those nodes measures (the head never imports user code),
starts the ``torch.distributed`` rendezvous when the mesh needs one, and wires the
stages to their pipeline peers; from then on the job's own actor
(:class:`~schedulers.job_actor.JobActor`, with its
:class:`~schedulers.control.JobController`) owns the job, and every operation on it
is a call to that actor. The scheduler keeps what is cluster-wide: creating jobs,
listing them, finding one by id, and the event subscribers (each hears only the
events of jobs its key may see: a client its own, the admin key all; see
:mod:`actors._subscribers`).
:class:`~schedulers.client.Cluster` calls it (typed, through ``ref.endpoint(SchedulerActor.method)``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from actors import (
    HEAD,
    NODE,
    Actor,
    ActorError,
    ActorRef,
    Event,
    HeadActor,
    Host,
    NodeActor,
    NodeInfo,
    NotAllowed,
    Subscribers,
    current_caller,
    endpoint,
    may_call,
    register_actor,
)
from stages import backend_for, RendezvousActor, StageActor
from stages.build.describe import ModelInspector
from schedulers.checkpoint_paths import CheckpointPath, resolve
from schedulers.control import JobController
from schedulers.creations import Creations, checked_ticket
from schedulers.stage_hosts import StageHosts
from schedulers.job_actor import JobActor, may_act_on
from schedulers.job_core import JobCore, Placer, compile_programs
from schedulers.jobs import JobSpec, stage_config
from schedulers.limits import Limits, check_client, check_spec, off_loop, parse_limits
from schedulers.monitors import MonitorTarget, Monitors, check_libraries, resolve_monitors
from schedulers.partition import partition_by_parameters, partition_uniform
from schedulers.placement import Placement, choose_nodes, gpu_of
from schedulers.events import JobClosed, JobCreated
from schedulers.records import JobDescription, JobInfo
from transport.addresses import is_local_address

__all__ = ["SchedulerActor"]

log = logging.getLogger(__name__)


def _needs_communicator(spec: JobSpec) -> bool:
    """Whether the job's ranks form a torch.distributed group (tensor or data parallel, or the dist transport)."""
    p = spec.parallelism
    return p.tensor_parallel > 1 or p.data_parallel > 1 or spec.communication.transport == "dist"


async def partition(runtime: Host, spec: JobSpec, node: NodeInfo, limits: Limits,
                    names: Iterator[int]) -> list[list[int]]:
    """Stage bounds for ``spec``'s model, from layer sizes that ``node`` (a worker) measures.

    The head never imports or calls a user's factory: the worker builds the model
    on the meta device, under its own allow-list, and returns parameter counts
    (checked against the operator's ``parameters`` limit). ``names`` numbers the
    model inspectors it spawns.
    """
    if spec.parallelism.split_points is not None:  # one traced stage module per model stage, as the user cut it
        if limits.parameters is not None:
            (size,) = await inspect_model(runtime, spec, node, None, f"inspect-{next(names)}", profile=False, whole=True)
            if size > limits.parameters:
                raise limits.exceeded("parameters", size, limits.parameters, f"the parameters of {spec.training.model}")
        return [[i, i + 1] for i in range(spec.num_model_stages)]
    method = spec.parallelism.partition_method
    pattern = method.removeprefix("type:") if method.startswith("type:") else None
    # Balanced by the parameters that train (DeepSpeed's "parameters"): a frozen embedding weighs nothing.
    counts = await inspect_model(runtime, spec, node, pattern, f"inspect-{next(names)}",
                                 trainable=method == "parameters")
    if limits.parameters is not None:
        # The model's size as the worker counts it on the meta device, before any stage builds it: every
        # parameter, frozen ones too.
        sizes = counts if method == "uniform" else \
            await inspect_model(runtime, spec, node, None, f"inspect-{next(names)}", profile=False)
        if sum(sizes) > limits.parameters:
            raise limits.exceeded("parameters", sum(sizes), limits.parameters, f"the parameters of {spec.training.model}")
    p = spec.parallelism
    if len(counts) < spec.num_model_stages:
        virtual = p.num_virtual_stages
        per_rank = f" x {virtual} virtual stages each ({p.schedule})" if virtual > 1 else ""
        fixes = ([f"at most {len(counts) // virtual} pipeline stages"] if len(counts) >= virtual else []) + \
            (["a schedule without virtual stages (1f1b)"] if virtual > 1 else [])
        raise ValueError(f"{spec.training.model} has {len(counts)} layers, too few for {spec.num_model_stages} model "
                         f"stages ({p.key('pipeline_stages')}={p.pipeline_stages}{per_rank}): every stage needs a "
                         f"layer; use {' or '.join(fixes)}")
    if pattern is not None and sum(counts) < spec.num_model_stages:
        raise ValueError(f"partition_method={method!r} matches {sum(counts)} of the model's "
                         f"{len(counts)} layers, fewer than its {spec.num_model_stages} stages; match the "
                         "class of its repeated block (e.g. 'type:block')")
    if method == "uniform":
        bounds = partition_uniform(len(counts), spec.num_model_stages)
    else:
        # Exact balancing is O(stages x layers log layers): off the loop for very deep models.
        bounds = await asyncio.to_thread(partition_by_parameters, counts, spec.num_model_stages)
    return [list(b) for b in bounds]


async def inspect_model(runtime: Host, spec: JobSpec, node: NodeInfo, pattern: str | None, name: str, *,
                        profile: bool | None = None, whole: bool = False, trainable: bool = False) -> list[int]:
    """Each layer's parameter count (``trainable``: of the parameters that require gradients; or
    time, to partition by profile), measured by a model inspector spawned as ``name`` on ``node``
    for this question and stopped after it."""
    agent = runtime.ref(node.address, NODE)
    address, _ = await agent.endpoint(NodeActor.spawn, timeout=60).call("model_inspector", name, {})
    inspector = runtime.ref(address, name)
    t, p = spec.training, spec.parallelism
    try:
        if p.partition_method == "profile" if profile is None else profile:
            return await inspector.endpoint(ModelInspector.profile_model, timeout=600).call(
                t.model, dict(t.model_kwargs), t.data, dict(t.data_kwargs),
                p.micro_batches * p.data_parallel, t.seed, p.example_inputs, t.micro_batch_size)
        return await inspector.endpoint(ModelInspector.describe_model, timeout=300).call(
            t.model, dict(t.model_kwargs), pattern, whole, trainable)
    finally:
        try:
            await agent.endpoint(NodeActor.stop_actor, timeout=10).call(name)
        except ActorError as exc:
            log.warning("could not stop model inspector %s on %s: %s", name, node.name, exc)


class _Phases:
    """Seconds each phase of a job's creation took, in order (``JobInfo.creation_s``)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(now - self._last, 4)
        self._last = now


async def open_rendezvous(
    runtime: Host, job_id: str, spec: JobSpec, nodes: list[NodeInfo]
) -> tuple[str | None, dict[str, Any] | None]:
    """The job's torch.distributed rendezvous, for a mesh that needs collectives.

    It is an actor on the head (:class:`~stages.comm.rendezvous.RendezvousActor`) that
    serves only the keys of the job's nodes, over the cluster's own authenticated
    channel: nothing new listens anywhere. Returns its name and the stages' ``dist``
    config, whose backend follows the nodes' devices (:func:`~stages.comm.parallel.backend_for`).

    Raises:
        ValueError: the nodes mix CPUs and GPUs, or two would share a GPU (NCCL refuses it).
    """
    if not _needs_communicator(spec):
        return None, None
    # Before anything starts: a mixed or GPU-sharing job is refused here. (The stage
    # package still reads nodes as maps.)
    backend = backend_for([node.to_wire() for node in nodes])
    name = f"{job_id}.rendezvous"
    members = {n.identity for n in nodes} - {""}
    timeout_s = spec.fault_tolerance.step_timeout_s
    await runtime.spawn(RendezvousActor(members, timeout_s=timeout_s, job=job_id), name)
    loopback = all(is_local_address(n.address) for n in nodes)
    return name, {"rendezvous": [runtime.address, name], "backend": backend,
                  "timeout_s": timeout_s, "loopback": loopback}


@register_actor("scheduler")
class SchedulerActor(Actor):
    """Places jobs on nodes and runs them, one :class:`~schedulers.job_actor.JobActor` per job.

    Events (``on_event`` to the subscribers that may see the job, records of
    :mod:`schedulers.events`): ``JobCreated``, ``JobClosed``, and each job's (see
    :class:`~schedulers.control.JobController`).
    """

    def __init__(self, checkpoint_root: str = "checkpoints",
                 limits: dict[str, Any] | list[str] | None = None) -> None:
        """
        Args:
            checkpoint_root: the directory a client's checkpoints stay under, each key in its own
                subtree (``ROOT/alice``); relative: to the head's working directory. The head's
                ``--checkpoint-root`` (see :mod:`schedulers.checkpoint_paths`).
            limits: the operator's limits (``--limit NAME=VALUE`` on the head, see
                :mod:`schedulers.limits`): checked before any work is done for a job.
        """
        self.checkpoint_root = os.path.abspath(checkpoint_root)
        self.limits = parse_limits(limits or {})
        self._jobs: dict[str, JobActor] = {}
        # Jobs being created (concurrently): their owner and nodes, counted as the open jobs are.
        self._building: dict[str, tuple[str, list[str]]] = {}
        self._hosts = StageHosts(lambda: self.runtime, self._alive)  # the stage actors, through their nodes' agents
        self._placing = asyncio.Lock()
        self._ids = itertools.count()
        self._inspections = itertools.count()
        self._subscribers = Subscribers("scheduler")
        self._creations = Creations()  # by the callers' tickets: a caller that gives up ends its job

    def _publisher(self, owner: str) -> Callable[[Event], None]:
        """Publishes the events of a job that ``owner``'s key created, to those who may see that job."""
        def publish(event: Event) -> None:
            self._subscribers.publish(self.runtime, event, owner=owner)
        return publish

    # -- jobs ------------------------------------------------------------------------------

    # Concurrent: one client's job may take long to build (its data factory, a large model);
    # another's is placed and built meanwhile. Placement itself is one at a time.
    @endpoint(concurrent=True, roles=("client",))
    async def create_job(self, job_spec: JobSpec, relative_to: str | None = None, ticket: str = "") -> JobInfo:
        """Places ``job_spec``'s stage actors and builds them (the spec was checked as it arrived).

        Args:
            relative_to: the driver's working directory: where an admin's relative monitor
                ``output_path`` is taken from (a client's is taken under its checkpoint subtree).
            ticket: the caller's name for this creation, which :meth:`abandon_job` takes (see
                :mod:`schedulers.creations`).

        Returns:
            The job's id, layout, nodes and placement notices.

        Raises:
            TypeError, ValueError: a bad spec or ticket, too few nodes for the job, or a monitor whose
                library the head lacks.
            NotAllowed: a factory outside the allow-list (the message names the node that refused it),
                or a client's monitor ``output_path`` outside its subtree of the checkpoint root.
            LimitExceeded: past the operator's limits (checked first, before any work).
        """
        caller, ticket = current_caller(), checked_ticket(ticket)
        with self._creations.running(ticket, caller):
            info = await self._create(job_spec, relative_to)
        self._creations.made(ticket, caller, info.job)
        return info

    @endpoint(concurrent=True, roles=("client",))
    async def abandon_job(self, ticket: str) -> None:
        """The caller gave up on its creation ``ticket`` (a ``train()`` cancelled or timed out): the
        creation stops, stopping the stage actors it spawned, or the job it made is closed."""
        made = self._creations.abandon(checked_ticket(ticket), current_caller())
        job = self._jobs.get(made) if made is not None else None
        if job is not None:
            log.info("%s: its creator gave up waiting for it; closing it", job.id)
            await job.ref.endpoint(JobActor.close, timeout=60).call()

    async def _create(self, job_spec: JobSpec, relative_to: str | None) -> JobInfo:
        check_spec(job_spec, self.limits)
        self._check_client(job_spec)
        check_libraries(job_spec.monitoring)
        directory = job_spec.checkpointing.checkpoint_dir
        try:  # where the head will write for this caller: refused before any work, as a checkpoint path is
            monitors = resolve_monitors(job_spec.monitoring, caller=current_caller(), root=self.checkpoint_root,
                                        relative_to=relative_to)
            checkpoints = None if directory is None else resolve(directory, relative_to, caller=current_caller(),
                                                                 root=self.checkpoint_root)
        except NotAllowed:
            self.refused_calls += 1
            raise
        clock = _Phases()
        # Compiled once, off the loop: the job's controller finds it compiled (schedulers.job_core).
        await off_loop(compile_programs, job_spec, timeout_s=self.limits.compile_timeout_s,
                       what="compiling the job's schedule")
        clock.done("compile")
        async with self._placing:  # each placement sees the nodes of every job placed before it
            self._check_client(job_spec)  # again: others may have been placed meanwhile
            nodes, notices = await self._place(job_spec)
            job_id = f"job{next(self._ids)}"
            self._building[job_id] = (current_caller(), [n.name for n in nodes])
        clock.done("place")
        try:
            info = await self._build_job(job_id, job_spec, nodes, notices, clock, monitors, checkpoints)
        finally:
            del self._building[job_id]
        return dataclasses.replace(info, creation_s=clock.phases)

    async def _build_job(self, job_id: str, job_spec: JobSpec, nodes: list[NodeInfo], notices: list[str],
                         clock: _Phases, monitors: list[MonitorTarget], checkpoints: CheckpointPath | None) -> JobInfo:
        """Partitions, spawns and connects the stages of a placed job, resumes it from its last
        checkpoint where its spec says so, and starts its job actor."""
        mesh = job_spec.mesh
        bounds = await partition(self.runtime, job_spec, nodes[0], self.limits, self._inspections)
        clock.done("partition")
        for notice in notices:
            log.warning("%s: %s", job_id, notice)
        rendezvous, dist_config = await open_rendezvous(self.runtime, job_id, job_spec, nodes)
        clock.done("rendezvous")
        stages: list[ActorRef] = []
        writers = None
        try:
            stages = await self._hosts.spawn_job(job_id, job_spec, bounds, nodes, dist_config)
            clock.done("spawn")
            identities = sorted({n.identity for n in nodes} - {""})
            await asyncio.gather(*(
                ref.endpoint(StageActor.connect, timeout=30).call(
                    [stages[r].to_wire() for r in mesh.pipeline_ranks(c.data, c.tensor)], identities,
                    [member.to_wire() for member in stages])
                for ref, c in ((ref, mesh.coords(g)) for g, ref in enumerate(stages))
            ))
            clock.done("connect")
            names = [n.name for n in nodes]
            owner = current_caller()
            writers = Monitors(monitors, job=job_id, publish=self._publisher(owner)) if monitors else None
            controller = JobController(
                runtime=self.runtime, job_id=job_id, spec=job_spec, stages=stages, nodes=names, bounds=bounds,
                publish=self._publisher(owner), alive_nodes=self._alive_nodes, rendezvous=rendezvous,
                owner=owner, identities=identities, limits=self.limits, monitors=writers, checkpoints=checkpoints,
                placer=Placer(free_nodes=self._free_nodes, spawn=self._respawn,
                              renew_rendezvous=self._renew_rendezvous, stop=self._hosts.stop))
            resumed = await controller.saves.resume()
            if job_spec.checkpointing.resume_from_checkpoint:
                clock.done("resume")
            job = JobActor(controller, stop_stages=self._hosts.stop, closed=self._job_closed,
                           checkpoint_root=self.checkpoint_root)
            await self.runtime.spawn(job, f"{job_id}.control")
        except BaseException:  # failed, or its caller gave up (abandon_job): what it made goes, whole
            await asyncio.shield(self._unbuild(stages, rendezvous, writers))
            raise
        self._jobs[job_id] = job
        log.info("%s: %s on %s", job_id, job_spec.parallelism.schedule, ", ".join(names))
        self._publisher(owner)(JobCreated(job=job_id, nodes=names))
        clock.done("actor")
        info = self._info(job, notices)
        return info if resumed is None else dataclasses.replace(info, resumed_from=resumed[0], resumed_step=resumed[1])

    def _check_client(self, spec: JobSpec) -> None:
        """The operator's limits on what the calling client holds, with ``spec`` (its open jobs and
        those being built, and their nodes)."""
        caller = current_caller()
        if may_call(caller, frozenset()):  # the admin and this process are not a client
            return
        held = [job.nodes for job in self._jobs.values() if job.owner == caller]
        held += [names for owner, names in self._building.values() if owner == caller]
        check_client(self.limits, caller, held, spec.mesh.size)

    async def _nodes(self) -> list[NodeInfo]:
        return await self.runtime.ref(self.runtime.address, HEAD).endpoint(HeadActor.nodes).call()

    async def _alive(self) -> list[NodeInfo]:
        return [n for n in await self._nodes() if n.alive]

    async def _alive_nodes(self) -> set[str]:
        return {n.name for n in await self._alive()}

    async def _place(self, spec: JobSpec) -> Placement:
        """The job's nodes by global rank (see :func:`~schedulers.placement.choose_nodes`) and its notices.

        Raises:
            ValueError: too few alive nodes, or ranks that would share a GPU in an NCCL communicator.
        """
        mesh = spec.mesh
        alive = await self._alive()
        if len(alive) < mesh.size:
            raise ValueError(
                f"this job needs {mesh.size} nodes ({mesh.pipeline} pipeline x {mesh.tensor} tensor x "
                f"{mesh.data} data, one stage actor each) but the cluster has {len(alive)} alive; "
                "start more nodes or shrink the mesh"
            )
        busy = {name: job.id for job in self._jobs.values() for name in job.nodes}
        busy.update({name: job_id for job_id, (_, names) in self._building.items() for name in names})
        return choose_nodes(alive, busy, mesh.size, exclusive_gpus=_needs_communicator(spec))

    async def _unbuild(self, stages: list[ActorRef], rendezvous: str | None, writers: Monitors | None) -> None:
        """Undoes a creation that failed or was abandoned: its stage actors, rendezvous and monitors."""
        await self._hosts.stop(stages)
        if rendezvous is not None:
            await self.runtime.stop_actor(rendezvous)
        if writers is not None:
            await writers.aclose()

    async def _free_nodes(self, count: int, taken: set[str]) -> list[tuple[str, str]]:
        """``count`` alive nodes that no job uses and that are not in ``taken`` (spares): those on a GPU
        no busy node computes on first, then by name.

        Raises:
            ValueError: too few.
        """
        busy = taken | {name for job in self._jobs.values() for name in job.nodes}
        alive = await self._alive()
        used = {gpu_of(n) for n in alive if n.name in busy} - {None}  # a lost node's GPU is free again
        free = sorted((n for n in alive if n.name not in busy), key=lambda n: (gpu_of(n) in used, n.name))
        if len(free) < count:
            raise ValueError(f"no alive node is free ({len(free)} of {count} needed); start a spare "
                             "(LocalCluster(spares=...) or another python -m actors.node --join)")
        return [(n.name, n.identity) for n in free[:count]]

    async def _respawn(self, job: JobCore, rank: int, node_name: str,
                       dist: dict[str, Any] | None) -> ActorRef:
        """Job ``job``'s rank ``rank`` built afresh on node ``node_name`` (a recovery)."""
        node = next(n for n in await self._nodes() if n.name == node_name)
        config = stage_config(job.spec, job=job.id, global_rank=rank, bounds=job.bounds, dist=dist)
        return await self._hosts.spawn(node, f"{job.id}.rank{rank}.restart{job.restarts}", config)

    async def _renew_rendezvous(self, job: JobCore) -> tuple[str, dict[str, Any]]:
        """A fresh rendezvous for ``job``'s members as they are now; the old one stops."""
        if job.rendezvous is not None:
            await self.runtime.stop_actor(job.rendezvous)
        by_name = {n.name: n for n in await self._nodes()}
        name, config = await open_rendezvous(self.runtime, f"{job.id}.r{job.restarts}", job.spec,
                                             [by_name[node] for node in job.nodes])
        assert name is not None and config is not None
        return name, config

    async def _job_closed(self, job_id: str) -> None:
        """A job actor closed its job: the scheduler forgets it and stops the actor."""
        job = self._jobs.pop(job_id, None)
        if job is not None:
            await self.runtime.stop_actor(job.name)
            self._publisher(job.owner)(JobClosed(job=job_id))

    @endpoint(concurrent=True, roles=("client",))
    async def jobs(self) -> list[JobDescription]:
        """Every job the caller may see (its own; all for the admin)."""
        return [job.controller.describe() for job in self._jobs.values() if may_act_on(job.owner)]

    @endpoint(concurrent=True, roles=("client",))
    async def job(self, job_id: str) -> JobInfo:
        """The job ``job_id`` (with its actor's address), if the caller owns it (or holds the admin key).

        Raises:
            KeyError: no such job (the caller's own jobs are listed).
            NotAllowed: another client's job.
        """
        job = self._jobs.get(job_id)
        if job is None:
            mine = [j.id for j in self._jobs.values() if may_act_on(j.owner)]
            raise KeyError(f"no job {str(job_id)[:40]!r}; running: {', '.join(mine) or 'none'}")
        if not may_act_on(job.owner):
            self.refused_calls += 1
            raise NotAllowed(f"{job_id} belongs to {job.owner}; only its owner or the admin key may act on it")
        return self._info(job)

    @staticmethod
    def _info(job: JobActor, notices: list[str] | None = None) -> JobInfo:
        c = job.controller.core
        return JobInfo(job=c.id, bounds=c.bounds, nodes=list(c.nodes), actor=job.ref.to_wire(),
                       notices=notices or [])

    # -- events ---------------------------------------------------------------------------------

    @endpoint(roles=("client",))
    async def subscribe(self, actor: str) -> None:
        """Sends every later event of the jobs the caller may see (its own; all for the admin key)
        to ``actor.on_event(event)`` (an :class:`~actors.EventSink`) in the calling runtime.

        Raises:
            NotAllowed: the call came from an address that is not the caller's own.
            TooManySubscribers: the caller's key (or the scheduler) holds as many as it may.
        """
        self._subscribers.add(self.runtime, actor)

    @endpoint(roles=("client",))
    async def unsubscribe(self, actor: str) -> None:
        """Stops the events :meth:`subscribe` started for ``actor`` of the calling runtime."""
        self._subscribers.remove(self.runtime, actor)
