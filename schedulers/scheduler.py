"""The scheduler actor, on the head node: places jobs, compiles programs, drives steps.

For each step it sends every stage actor its program (and the micro-batches the
first and last stage need), waits at the accumulation barrier for all of them,
then releases the optimizer step. It is never in the per-action path: activations
and gradients go directly between stage actors. A stage that fails, a node that is
lost or a step that outlives its timeout fails the step everywhere with a
:class:`~actors.StepFailed` that names the stage, the action and the cause.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from actors._actor import Actor, endpoint
from actors._errors import ActorError, StepFailed, error_from_wire
from actors._nodes import HEAD, NODE
from actors._ref import ActorRef
from actors._registry import DEFAULT_ALLOW, load_object, register_actor
from actors.mesh import Coords, Mesh
from actors.program import stage_to_rank
from actors.tensor_parallel import ShardSpec, gather_tensor_parallel_state, shard_state
from schedulers.control import ControlEndpoints, JobControl, Subscribers, compile_programs
from schedulers.jobs import JobSpec
from schedulers.partition import partition_by_parameters, partition_uniform

__all__ = ["SchedulerActor"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    id: str
    spec: JobSpec
    mesh: Mesh
    stages: list[ActorRef]  # by global rank in the mesh
    nodes: list[str]  # by global rank
    bounds: list[list[int]]
    programs: dict[int, list[str]]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    next_step: int = 0
    last_trace: list[dict[str, Any]] = field(default_factory=list)
    store: Any = None  # the torch.distributed rendezvous this job's stages use, if any
    control: JobControl = field(default_factory=lambda: JobControl(stage_micro_batches=0))  # the console's controls


@register_actor("scheduler")
class SchedulerActor(ControlEndpoints, Actor):
    """Places jobs on nodes and runs their steps (and, from :class:`ControlEndpoints`, the console's controls)."""

    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._ids = itertools.count()
        self._subscribers = Subscribers()

    def _allow(self) -> tuple[str, ...]:
        context = self.node_context
        return context.allow if context is not None else DEFAULT_ALLOW

    @endpoint
    async def create_job(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Validates ``spec``, places its stage actors and builds them; returns the job's layout.

        Raises:
            ValueError: a bad spec, or too few nodes for the job.
            NotAllowed: a factory outside the allow-list.
        """
        job_spec = JobSpec.from_kwargs(spec)
        mesh = Mesh(pipeline=job_spec.pipeline_stages, tensor=job_spec.tensor_parallel, data=job_spec.data_parallel)
        # Importing the factory can take seconds: off the loop, so heartbeats go on.
        bounds = await asyncio.to_thread(self._partition, job_spec)
        nodes = await self._place(mesh)
        job_id = f"job{next(self._ids)}"
        programs = compile_programs(job_spec)
        store, dist_config = self._rendezvous(job_spec, mesh)
        stages = await self._spawn_stages(job_id, job_spec, mesh, bounds, nodes, dist_config)
        await asyncio.gather(*(
            ref.ask("connect", [stages[r].to_wire() for r in mesh.pipeline_ranks(c.data, c.tensor)], timeout=30)
            for ref, c in ((ref, mesh.coords(g)) for g, ref in enumerate(stages))
        ))
        self._jobs[job_id] = _Job(id=job_id, spec=job_spec, mesh=mesh, stages=stages,
                                  nodes=[n["name"] for n in nodes], bounds=bounds, programs=programs, store=store,
                                  control=JobControl(stage_micro_batches=job_spec.micro_batches))
        log.info("%s: %s on %s", job_id, job_spec.schedule, ", ".join(n["name"] for n in nodes))
        self._publish({"type": "job_created", "job": job_id, "nodes": [n["name"] for n in nodes]})
        return {"job": job_id, "bounds": bounds, "nodes": [n["name"] for n in nodes]}

    def _rendezvous(self, spec: JobSpec, mesh: Mesh) -> tuple[Any, dict[str, Any] | None]:
        """A torch.distributed store on the head for a job whose mesh needs collectives."""
        if mesh.tensor == 1 and mesh.data == 1 and spec.transport == "zmq":
            return None, None
        host = self.runtime.address.removeprefix("tcp://").rpartition(":")[0] if \
            self.runtime.address.startswith("tcp://") else "127.0.0.1"
        timeout = datetime.timedelta(seconds=spec.step_timeout_s)
        store = dist.TCPStore(host, 0, world_size=mesh.size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        return store, {"store": f"{host}:{store.port}", "backend": "gloo", "timeout_s": spec.step_timeout_s}

    def _partition(self, spec: JobSpec) -> list[list[int]]:
        factory = load_object(spec.model, self._allow())
        with torch.device("meta"):  # count layers and parameters without allocating them
            model = factory(**spec.model_kwargs)
        layers = list(model.children()) if isinstance(model, torch.nn.Sequential) else list(model)
        if spec.partition_method == "uniform":
            bounds = partition_uniform(len(layers), spec.num_model_stages)
        else:
            bounds = partition_by_parameters(layers, spec.num_model_stages)
        return [list(b) for b in bounds]

    async def _place(self, mesh: Mesh) -> list[dict[str, Any]]:
        head = self.runtime.ref(self.runtime.address, HEAD)
        alive = sorted((n for n in await head.ask("nodes") if n["state"] == "alive"), key=lambda n: n["name"])
        busy = {name for job in self._jobs.values() for name in job.nodes}
        alive.sort(key=lambda n: n["name"] in busy)  # free nodes first, then shared ones
        if len(alive) < mesh.size:
            raise ValueError(
                f"this job needs {mesh.size} nodes ({mesh.pipeline} pipeline x {mesh.tensor} tensor x "
                f"{mesh.data} data, one stage actor each) but the cluster has {len(alive)} alive; "
                "start more nodes or shrink the mesh"
            )
        return alive[:mesh.size]

    async def _spawn_stages(
        self, job_id: str, spec: JobSpec, mesh: Mesh, bounds: list[list[int]], nodes: list[dict[str, Any]],
        dist_config: dict[str, Any] | None,
    ) -> list[ActorRef]:
        async def spawn(rank: int, node: dict[str, Any]) -> ActorRef:
            config = {
                "job": job_id, "rank": mesh.coords(rank).pipeline, "num_ranks": spec.pipeline_stages,
                "mesh": [mesh.pipeline, mesh.tensor, mesh.data], "global_rank": rank, "dist": dist_config,
                "bounds": bounds,
                "model": spec.model, "model_kwargs": spec.model_kwargs, "loss": spec.loss,
                "optimizer": list(spec.optimizer), "num_microbatches": spec.micro_batches, "seed": spec.seed,
                "activation_codec": spec.edge_codecs("activation_codec"),
                "gradient_codec": spec.edge_codecs("gradient_codec"),
                "error_feedback": spec.error_feedback, "measure_codec_error": spec.measure_codec_error,
                "reduce_codec": spec.reduce_codec, "transport": spec.transport,
                "data": spec.data, "data_kwargs": spec.data_kwargs, "threads": spec.threads_per_stage,
                "gradient_accumulation_fusion": spec.gradient_accumulation_fusion,
                "keep_freed_memory": spec.keep_freed_memory,
            }
            agent = self.runtime.ref(node["address"], NODE)
            address, name = await agent.ask("spawn", "stage", f"{job_id}.rank{rank}", config, timeout=300)
            return self.runtime.ref(address, name)

        results = await asyncio.gather(*(spawn(r, n) for r, n in enumerate(nodes)), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self._stop_stages([r for r in results if isinstance(r, ActorRef)])
            raise failed[0]
        return [r for r in results if isinstance(r, ActorRef)]

    async def _stop_stages(self, stages: list[ActorRef]) -> None:
        async def stop(ref: ActorRef) -> None:
            try:
                await self.runtime.ref(ref.address, NODE).ask("stop_actor", ref.name, timeout=10)
            except ActorError as exc:
                log.info("could not stop %s: %s", ref.name, exc)

        await asyncio.gather(*(stop(ref) for ref in stages))

    # -- steps ---------------------------------------------------------------------------

    @endpoint(concurrent=True)
    async def step(
        self, job_id: str, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """Runs one optimizer step of ``job_id`` on a global batch (or the job's data factory).

        Raises:
            ValueError: a batch that does not split into the job's micro-batches.
            StepFailed: a stage failed, a node was lost or the step timed out.
        """
        job = self._job(job_id)
        async with job.lock:
            await self._apply_pending(job)  # settings changed with set_option take effect here, between steps
            step = job.next_step
            job.next_step += 1
            calls = self._step_calls(job, step, inputs, targets)
            for call in calls.values():
                call.update(self._step_kwargs(job))
            started = time.perf_counter()
            try:
                results = await self._run_to_barrier(job, step, calls)
                reduced_bytes = await self._release(job, step)
            except StepFailed as failure:
                raise self._step_failed(job, step, failure) from None
            elapsed = time.perf_counter() - started
        job.last_trace = results
        # One loss per replica: the last stage's first tensor-parallel shard reports it.
        reporters = [r for g, r in enumerate(results) if job.mesh.coords(g).tensor == 0]
        stats = {**_step_stats(step, results, reporters, elapsed), "reduce_bytes": reduced_bytes}
        samples = inputs.shape[0] if inputs is not None else job.spec.data_kwargs.get("batch_size")
        self._step_finished(job, stats, samples if isinstance(samples, int) else None)
        return stats

    def _step_calls(
        self, job: _Job, step: int, inputs: torch.Tensor | None, targets: torch.Tensor | None
    ) -> dict[int, dict[str, Any]]:
        spec, mesh = job.spec, job.mesh
        first, last = stage_to_rank(0, mesh.pipeline), stage_to_rank(spec.num_model_stages - 1, mesh.pipeline)
        calls: dict[int, dict[str, Any]] = {rank: {} for rank in range(mesh.size)}
        if inputs is None and targets is None:
            if spec.data is None:
                raise ValueError("step() needs inputs and targets, or a job started with data='pkg.mod:factory'")
            for rank, call in calls.items():
                call["data_step"] = step
                call["data_shard"] = [mesh.coords(rank).data, mesh.data]
            return calls
        if inputs is None or targets is None:
            raise ValueError("step() takes both inputs and targets, or neither (to read the data factory)")
        # Each data-parallel replica trains on its own shard of the global batch.
        input_shards = _split(inputs, mesh.data, "inputs", "data_parallel")
        target_shards = _split(targets, mesh.data, "targets", "data_parallel")
        for rank, call in calls.items():
            c = mesh.coords(rank)
            if c.pipeline == first:
                call["inputs"] = _split(input_shards[c.data], spec.micro_batches, "inputs")
            if c.pipeline == last:
                call["targets"] = _split(target_shards[c.data], spec.micro_batches, "targets")
        return calls

    async def _run_to_barrier(self, job: _Job, step: int, calls: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
        tasks = {
            rank: asyncio.ensure_future(job.stages[rank].ask(
                "run_step", step, job.programs[job.mesh.coords(rank).pipeline], **kwargs))
            for rank, kwargs in calls.items()
        }
        loop = asyncio.get_running_loop()
        deadline = loop.time() + job.spec.step_timeout_s
        try:
            pending: set[asyncio.Future[Any]] = set(tasks.values())
            failure: StepFailed | None = None
            while pending and failure is None:
                done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()),
                                                   return_when=asyncio.FIRST_COMPLETED)
                failure = self._first_failure(job, tasks) if done else await self._timeout_failure(job)
            results = [] if failure else [tasks[rank].result() for rank in sorted(tasks)]
            if failure is None and not all(r["ok"] for r in results):
                failure = StepFailed("step aborted on request", details={"stage": None, "action": None,
                                                                          "cause": "aborted"})
            if failure is not None:
                await self._abort(job, step, tasks)
                raise failure
            return results
        finally:
            for task in tasks.values():
                task.cancel()

    def _first_failure(self, job: _Job, tasks: Mapping[int, asyncio.Future[Any]]) -> StepFailed | None:
        for rank, task in tasks.items():
            if not task.done():
                continue
            exc = task.exception()
            if exc is not None:
                cause = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ActorError) else \
                    f"{exc.remote_type}: {exc.message}"
                return _failed(job.mesh, rank, None, cause)
            result = task.result()
            if not result["ok"] and not result.get("aborted"):
                error = error_from_wire(result["error"])
                return _failed(job.mesh, rank, result["action"], f"{error.remote_type}: {error.message}",
                               error.remote_traceback)
        return None

    async def _timeout_failure(self, job: _Job) -> StepFailed:
        # Hang forensics: where each stage is, which send or receive never matched, the marked grid.
        report, lines = await self._hang_report(job)
        return StepFailed(
            f"step timed out after {job.spec.step_timeout_s}s:\n{report}",
            details={"stage": None, "action": None, "cause": "timeout", "where": lines},
        )

    async def _abort(self, job: _Job, step: int, tasks: Mapping[int, asyncio.Future[Any]]) -> None:
        async def abort(ref: ActorRef) -> None:
            try:
                await ref.ask("abort_step", step, timeout=5)
            except ActorError as exc:
                log.info("abort of %s: %s", ref.name, exc)

        alive = await self._alive_nodes()
        reachable = [rank for rank, node in enumerate(job.nodes) if node in alive]
        await asyncio.gather(*(abort(job.stages[rank]) for rank in reachable))
        waiting = [tasks[rank] for rank in reachable if rank in tasks]
        if waiting:
            await asyncio.wait(waiting, timeout=5)

    async def _alive_nodes(self) -> set[str]:
        head = self.runtime.ref(self.runtime.address, HEAD)
        return {n["name"] for n in await head.ask("nodes") if n["state"] == "alive"}

    async def _release(self, job: _Job, step: int) -> int:
        """Releases the barrier everywhere; returns the bytes the data-parallel reduction sent."""
        results = await asyncio.gather(*(ref.ask("finish_step", step, timeout=job.spec.step_timeout_s)
                                         for ref in job.stages), return_exceptions=True)
        for rank, result in enumerate(results):
            if isinstance(result, BaseException):
                raise _failed(job.mesh, rank, "REDUCE/STEP", f"{type(result).__name__}: {result}")
        return sum(r for r in results if isinstance(r, int))

    # -- state and life -------------------------------------------------------------------

    @endpoint(concurrent=True)
    async def state_dict(self, job_id: str) -> dict[str, torch.Tensor]:
        """The whole model's state, gathered from the stages, under the unpartitioned keys.

        Tensor-parallel shards are put back together; data-parallel replica 0 speaks for all.
        """
        job = self._job(job_id)
        mesh = job.mesh
        async with job.lock:
            specs = await self._shard_specs(job)
            state: dict[str, torch.Tensor] = {}
            for p in range(mesh.pipeline):
                shards = await asyncio.gather(*(job.stages[mesh.rank(Coords(0, p, t))].ask("state_dict", timeout=300)
                                                for t in range(mesh.tensor)))
                state.update(gather_tensor_parallel_state(list(shards), specs) if mesh.tensor > 1 else shards[0])
        return dict(sorted(state.items(), key=lambda kv: _key_order(kv[0])))

    @endpoint(concurrent=True)
    async def load_state_dict(self, job_id: str, state: dict[str, torch.Tensor]) -> None:
        """Loads a whole-model state into every member; every key must be taken."""
        job = self._job(job_id)
        mesh = job.mesh
        async with job.lock:
            specs = await self._shard_specs(job)

            def part(rank: int) -> dict[str, torch.Tensor]:
                c = mesh.coords(rank)
                held = {str(i) for s, (first, end) in enumerate(job.bounds)
                        if stage_to_rank(s, mesh.pipeline) == c.pipeline for i in range(first, end)}
                mine = {k: v for k, v in state.items() if k.partition(".")[0] in held}
                return shard_state(mine, c.tensor, mesh.tensor, specs) if mesh.tensor > 1 else mine

            taken = await asyncio.gather(*(ref.ask("load_state_dict", part(g), timeout=300)
                                           for g, ref in enumerate(job.stages)))
        missing = set(state) - {k for keys in taken for k in keys}
        if missing:
            raise KeyError(f"keys no stage holds: {sorted(missing)[:10]}")

    async def _shard_specs(self, job: _Job) -> dict[str, ShardSpec]:
        if job.mesh.tensor == 1:
            return {}
        parts = await asyncio.gather(*(job.stages[job.mesh.rank(Coords(0, p, 0))].ask("shard_specs", timeout=60)
                                       for p in range(job.mesh.pipeline)))
        return {key: ShardSpec(*spec) for part in parts for key, spec in part.items()}

    @endpoint(concurrent=True)
    async def close_job(self, job_id: str) -> None:
        job = self._jobs.pop(job_id, None)
        if job is not None:
            self._cancel_run(job)
            async with job.lock:
                await self._stop_stages(job.stages)
            job.store = None  # the rendezvous server goes with its last reference
            self._publish({"type": "job_closed", "job": job_id})

    @endpoint(concurrent=True)
    async def jobs(self) -> list[dict[str, Any]]:
        return [{"job": j.id, "nodes": j.nodes, "steps": j.next_step, "schedule": j.spec.schedule,
                 "stages": [ref.to_wire() for ref in j.stages],
                 "mesh": [j.mesh.pipeline, j.mesh.tensor, j.mesh.data]} for j in self._jobs.values()]

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise KeyError(f"no job {job_id!r}; running: {', '.join(self._jobs) or 'none'}")
        return job


def _split(batch: torch.Tensor, parts: int, what: str, name: str = "micro_batches") -> list[torch.Tensor]:
    if batch.dim() == 0 or batch.shape[0] % parts:
        raise ValueError(
            f"{what} of shape {tuple(batch.shape)} do not split into {parts} equal parts; "
            f"the batch size must be a multiple of {name}"
            + (" times data_parallel" if name == "micro_batches" else " (times micro_batches)")
        )
    return list(batch.chunk(parts))


def _failed(mesh: Mesh, rank: int, action: str | None, cause: str, traceback: str = "") -> StepFailed:
    where = mesh.describe(rank) + (f" at {action}" if action else "")
    coords = mesh.coords(rank)
    return StepFailed(f"step failed: {where}: {cause}", remote_traceback=traceback,
                      details={"stage": coords.pipeline, "member": rank, "tensor": coords.tensor,
                               "data": coords.data, "action": action, "cause": cause})


def _key_order(key: str) -> int:
    """Layer index of a state key; the sort is stable, so each layer keeps its own order."""
    head = key.partition(".")[0]
    return int(head) if head.isdigit() else 1 << 30


def _step_stats(
    step: int, results: list[dict[str, Any]], reporters: list[dict[str, Any]], elapsed: float
) -> dict[str, Any]:
    losses = [loss for r in reporters for loss in r["losses"]]
    span = max(r["elapsed_s"] for r in results)
    busy = sum(r["busy_s"] for r in results)
    bytes_per_edge: dict[str, int] = {}
    for r in results:
        for edge, n in r["bytes_sent"].items():
            bytes_per_edge[edge] = bytes_per_edge.get(edge, 0) + n
    return {
        "step": step,
        "loss": sum(losses) / len(losses) if losses else float("nan"),
        "step_time_s": elapsed,
        "bubble_fraction": max(0.0, 1.0 - busy / (len(results) * span)) if span > 0 else 0.0,
        "bytes_sent": sum(bytes_per_edge.values()),
        "bytes_per_edge": bytes_per_edge,
        "peak_stash": [r["peak_stash"] for r in results],
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in results],
        "busy_s": [r["busy_s"] for r in results],
        "codec_stats": _codec_stats(results),
    }


def _codec_stats(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per edge and direction: codec, bytes on the wire vs raw, and the relative error sent."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        for edge, e in r.get("codec_stats", {}).items():
            out[edge] = {
                "codec": e["codec"],
                "bytes": e["bytes"],
                "raw_bytes": e["raw_bytes"],
                "ratio": e["bytes"] / e["raw_bytes"] if e["raw_bytes"] else 1.0,
                "rel_error": (e["sq_err"] / e["sq_norm"]) ** 0.5 if e["sq_norm"] > 0 else 0.0,
            }
    return dict(sorted(out.items()))
