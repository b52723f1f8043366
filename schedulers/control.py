"""The scheduler's job controls: runs, pause and resume, settings changed at the barrier, events.

These are the parts of the scheduler actor that the console drives. A *run* is N
steps the scheduler takes on its own from the job's data factory, in a task it owns;
``pause`` holds the run before its next step (after the current step's barrier and
optimizer step), ``resume`` lets it go on. ``set`` checks a new setting at once and
applies it before the next step begins, so the stages never see a half-changed job
and keep their weights and optimizer state. Subscribers hear every event as
``on_event(event)``, like the head's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from actors._actor import Actor, endpoint
from actors._errors import ActorError, NotAllowed, StepFailed
from actors._registry import actor_class
from actors._runtime import Runtime
from actors._ref import ActorRef
from schedulers.hang import StageProgress, diagnose
from schedulers.jobs import JobSpec
from schedulers.schedules import build_schedule
from schedulers.trace import StageRecord, estimate_offset, to_chrome_trace

if TYPE_CHECKING:
    from schedulers.scheduler import _Job

__all__ = ["SETTABLE", "ControlEndpoints", "JobControl", "RunState", "Subscribers", "compile_programs",
           "plan_setting"]

log = logging.getLogger(__name__)

# What `set JOB KEY VALUE` may change on a running job.
SETTABLE = ("micro_batches", "schedule", "activation_codec", "gradient_codec")
CODEC_ENDPOINT = "set_codecs"  # the stage endpoint a codec change needs (stage.set_codecs(activation_codec, gradient_codec))
CLOCK_PROBES = 5  # round trips per stage when estimating its clock offset


@dataclass(slots=True)
class RunState:
    """A run of ``target`` steps the scheduler takes from the job's data factory."""

    target: int
    first_step: int
    done: int = 0
    stop: bool = False
    finished: bool = False
    error: str | None = None
    task: asyncio.Task[Any] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set by resume and stop

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "first_step": self.first_step, "done": self.done,
                "active": not self.finished, "stopping": self.stop, "error": self.error}


@dataclass(slots=True)
class JobControl:
    """Per-job state behind the console's controls.

    Attributes:
        stage_micro_batches: the micro-batch count the stage actors were built with;
            a different count travels with each step as ``run_step(num_microbatches=...)``.
        paused: a run holds before its next step while set.
        pending: settings to apply before the next step, as text the user gave.
        pending_spec: the job's spec once ``pending`` is applied.
        run: the current or last run.
        last_stats: the last step's statistics (with ``samples``, the global batch size, when known).
    """

    stage_micro_batches: int
    paused: bool = False
    pending: dict[str, Any] = field(default_factory=dict)
    pending_spec: JobSpec | None = None
    run: RunState | None = None
    last_stats: dict[str, Any] | None = None

    @property
    def running(self) -> bool:
        return self.run is not None and not self.run.finished

    def to_dict(self) -> dict[str, Any]:
        return {"paused": self.paused, "pending": dict(self.pending),
                "run": self.run.to_dict() if self.run else None, "last_stats": self.last_stats}


class Subscribers:
    """Actors that asked for events; one that stops taking them is dropped."""

    def __init__(self) -> None:
        self._actors: set[tuple[str, str]] = set()

    def add(self, address: str, actor: str) -> None:
        self._actors.add((address, actor))

    def discard(self, address: str, actor: str) -> None:
        self._actors.discard((address, actor))

    def publish(self, runtime: Runtime, event: dict[str, Any]) -> None:
        """Tells every subscriber ``event`` (with the head's time) without waiting for them."""
        event = {**event, "time": time.time()}
        for address, actor in list(self._actors):
            runtime.spawn_task(self._notify(runtime, address, actor, event), name="scheduler notify")

    async def _notify(self, runtime: Runtime, address: str, actor: str, event: dict[str, Any]) -> None:
        try:
            await asyncio.wait_for(runtime.ref(address, actor).tell("on_event", event), 2.0)
        except Exception:  # noqa: BLE001 - gone, slow or closing: a subscriber never breaks the scheduler
            log.info("dropping subscriber %s at %s: it does not take events", actor, address)
            self.discard(address, actor)


def compile_programs(spec: JobSpec) -> dict[int, list[str]]:
    """The programs ``spec`` runs, one per pipeline rank, as action text.

    Raises:
        ValueError: the schedule cannot take these sizes.
    """
    schedule = build_schedule(spec.schedule, spec.pipeline_stages, spec.micro_batches,
                              spec.num_virtual_stages if spec.schedule == "interleaved" else None,
                              split=spec.gradient_accumulation_fusion)
    return {rank: [str(a) for a in program] for rank, program in schedule.items()}


def plan_setting(spec: JobSpec, key: str, value: Any, *, codecs_settable: bool) -> JobSpec:
    """The spec a running job would have after ``set key value``, checked now.

    Args:
        spec: the job's spec, with any earlier pending settings applied.
        key: one of :data:`SETTABLE`.
        value: the new value; text is parsed (``"8"``, ``"gpipe"``, ``"int8"`` or ``"int8,none"``).
        codecs_settable: whether the stage actors can change codecs (have ``set_codecs``).

    Raises:
        ValueError: an unknown key, a value that does not parse or fit the job
            (the message says which and what would), or a change the stages cannot make yet.
    """
    if key not in SETTABLE:
        raise ValueError(f"cannot set {key!r} on a running job; settable: {', '.join(SETTABLE)}")
    if key == "micro_batches":
        value = _parse_int(key, value)
        batch = spec.data_kwargs.get("batch_size")
        if isinstance(batch, int) and batch % (value * spec.data_parallel):
            raise ValueError(
                f"micro_batches={value}: the data factory's batch_size {batch} does not split into "
                f"{value} micro-batches x data_parallel {spec.data_parallel}; pick a divisor of "
                f"{batch // spec.data_parallel}")
    elif key == "schedule":
        value = str(value)
        if (value == "interleaved") != (spec.schedule == "interleaved"):
            raise ValueError(
                f"schedule={value}: switching between interleaved and one-stage-per-rank schedules "
                "re-partitions the model; start a new job with that schedule instead")
    else:
        value = value.split(",") if isinstance(value, str) and "," in value else value
        if not codecs_settable:
            raise ValueError(
                f"{key}: changing a codec on a running job is not supported yet (the stage actors have no "
                f"{CODEC_ENDPOINT} endpoint); start a new job with {key}={value!r}")
    new = dataclasses.replace(spec, **{key: value})
    new.check()
    compile_programs(new)  # e.g. interleaved needs micro_batches to be a multiple of the stages
    return new


def _parse_int(key: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be an integer >= 1, got {value!r}") from None
    if number < 1 or isinstance(value, bool):
        raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
    return number


class ControlEndpoints(Actor):
    """The scheduler's endpoints for consoles; :class:`~schedulers.scheduler.SchedulerActor` mixes them in.

    Events (``on_event`` to every subscriber): ``job_created``, ``job_closed``,
    ``step_finished`` (loss, time, bubble, run progress), ``job_failed`` (the step's
    error), ``run_started``, ``run_finished``, ``job_paused``, ``job_resumed``,
    ``setting_pending``, ``settings_applied``, ``setting_rejected``.
    """

    _subscribers: Subscribers

    # -- provided by the scheduler ----------------------------------------------------

    def _job(self, job_id: str) -> _Job:
        raise NotImplementedError

    async def step(self, job_id: str, inputs: torch.Tensor | None = None,
                   targets: torch.Tensor | None = None) -> dict[str, Any]:
        raise NotImplementedError

    # -- events -----------------------------------------------------------------------

    def _publish(self, event: dict[str, Any]) -> None:
        self._subscribers.publish(self.runtime, event)

    @endpoint
    async def subscribe(self, address: str, actor: str) -> None:
        """Sends every later job event to ``actor.on_event(event)`` at ``address``."""
        self._subscribers.add(address, actor)

    @endpoint
    async def unsubscribe(self, address: str, actor: str) -> None:
        self._subscribers.discard(address, actor)

    # -- queries ----------------------------------------------------------------------

    @endpoint(concurrent=True)
    async def describe(self, job_id: str) -> dict[str, Any]:
        """Everything the console shows about a job: spec, layout, programs, run, last step."""
        job = self._job(job_id)
        return {
            "job": job.id, "spec": job.spec.to_dict(), "bounds": job.bounds, "nodes": job.nodes,
            "mesh": [job.mesh.pipeline, job.mesh.tensor, job.mesh.data], "steps": job.next_step,
            "programs": [job.programs[rank] for rank in sorted(job.programs)], "stepping": job.lock.locked(),
            "traced": bool(job.last_trace), **job.control.to_dict(),
        }

    @endpoint(concurrent=True)
    async def where(self, job_id: str) -> dict[str, Any]:
        """Hang forensics: each stage's current action, what it waits for, and the marked grid."""
        job = self._job(job_id)
        text, lines = await self._hang_report(job)
        return {"job": job.id, "stepping": job.lock.locked(), "report": text, "lines": lines}

    async def _hang_report(self, job: _Job) -> tuple[str, list[str]]:
        """Asks every stage where it is; returns the full report and its per-stage lines."""
        async def progress(ref: ActorRef) -> dict[str, Any] | str:
            try:
                answer: dict[str, Any] = await ref.ask("progress", timeout=5)
                return answer
            except ActorError as exc:
                return f"{ref.name} did not answer ({exc.message})"

        answers = await asyncio.gather(*(progress(ref) for ref in job.stages))
        running = job.lock.locked()
        step = job.next_step - 1 if running else None
        replicas: dict[tuple[int, int], dict[int, StageProgress | str]] = {}
        for member, answer in enumerate(answers):
            c = job.mesh.coords(member)
            replicas.setdefault((c.data, c.tensor), {})[c.pipeline] = answer if isinstance(answer, str) else \
                StageProgress(rank=c.pipeline, current=answer.get("current"), done=int(answer.get("done", 0)),
                              stale=step is not None and answer.get("step", step) != step)
        lines: list[str] = []
        grids: list[tuple[bool, str]] = []
        for (data, tensor), found in sorted(replicas.items()):
            report = diagnose(job.programs, found, running=running)
            prefix = "" if len(replicas) == 1 else f"[dp {data} tp {tensor}] "
            lines += [prefix + line for line in report.lines]
            grids.append((report.settled, f"{prefix}programs, each stage's place marked >like this<:\n{report.grid}"))
        grid = next((g for settled, g in grids if not settled), grids[0][1] if grids else "")
        return "\n".join([*lines, grid]), lines

    # -- runs, pause and resume ---------------------------------------------------------

    @endpoint(concurrent=True)
    async def run(self, job_id: str, num_steps: int) -> dict[str, Any]:
        """Starts ``num_steps`` steps from the job's data factory, in the background.

        Raises:
            ValueError: no data factory, a bad count, or a run already going.
        """
        job = self._job(job_id)
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"run needs a number of steps >= 1, got {num_steps!r}")
        if job.spec.data is None:
            raise ValueError(f"{job_id} has no data factory to run from; start it with data='pkg.mod:factory' "
                             "(or drive it with job.step(inputs, targets))")
        control = job.control
        if control.running:
            assert control.run is not None
            raise ValueError(f"{job_id} is already running ({control.run.done}/{control.run.target} steps); "
                             f"wait for it or stop it first")
        state = control.run = RunState(target=num_steps, first_step=job.next_step)
        state.task = self.runtime.spawn_task(self._run_steps(job, state), name=f"{job_id} run")
        self._publish({"type": "run_started", "job": job.id, "steps": num_steps, "paused": control.paused})
        return state.to_dict()

    async def _run_steps(self, job: _Job, state: RunState) -> None:
        reason = "cancelled"
        try:
            while state.done < state.target and not state.stop:
                if job.control.paused:
                    self._publish({"type": "job_paused", "job": job.id, "step": job.next_step})
                    while job.control.paused and not state.stop:
                        state.wake.clear()
                        await state.wake.wait()
                    if state.stop:
                        break
                    self._publish({"type": "job_resumed", "job": job.id, "step": job.next_step})
                await self.step(job.id)
                state.done += 1
            reason = "done" if state.done == state.target else "stopped"
        except Exception as exc:  # noqa: BLE001 - a run reports whatever ended it
            state.error = str(exc) if isinstance(exc, ActorError) else f"{type(exc).__name__}: {exc}"
            reason = "failed"
        finally:
            state.finished = True
            self._publish({"type": "run_finished", "job": job.id, "done": state.done, "target": state.target,
                           "reason": reason, "error": state.error})

    @endpoint(concurrent=True)
    async def pause(self, job_id: str) -> dict[str, Any]:
        """Holds the job's run before its next step (the current one finishes, optimizer step included)."""
        job = self._job(job_id)
        job.control.paused = True
        if not job.control.running:
            self._publish({"type": "job_paused", "job": job.id, "step": job.next_step})
        return job.control.to_dict()

    @endpoint(concurrent=True)
    async def resume(self, job_id: str) -> dict[str, Any]:
        """Lets a paused run go on."""
        job = self._job(job_id)
        job.control.paused = False
        if job.control.run is not None:
            job.control.run.wake.set()
        if not job.control.running:
            self._publish({"type": "job_resumed", "job": job.id, "step": job.next_step})
        return job.control.to_dict()

    @endpoint(concurrent=True)
    async def stop_run(self, job_id: str) -> dict[str, Any]:
        """Ends the job's run after its current step (and out of a pause)."""
        job = self._job(job_id)
        if job.control.run is not None:
            job.control.run.stop = True
            job.control.run.wake.set()
        return job.control.to_dict()

    def _cancel_run(self, job: _Job) -> None:
        """Called when the job closes: its run ends at once."""
        if job.control.run is not None and job.control.run.task is not None:
            job.control.run.task.cancel()

    # -- settings, applied at the barrier ---------------------------------------------------

    @endpoint(concurrent=True)
    async def set_option(self, job_id: str, key: str, value: Any) -> dict[str, Any]:
        """Changes ``key`` (micro_batches, schedule, activation_codec, gradient_codec) from the next step on.

        Raises:
            ValueError: the key cannot change, or the value does not fit; nothing changes.
        """
        job = self._job(job_id)
        try:
            stage_endpoints = actor_class("stage").endpoints()
        except NotAllowed:
            stage_endpoints = {}
        base = job.control.pending_spec or job.spec
        new = plan_setting(base, key, value, codecs_settable=CODEC_ENDPOINT in stage_endpoints)
        job.control.pending_spec = new
        job.control.pending[key] = getattr(new, key)
        self._publish({"type": "setting_pending", "job": job.id, "key": key, "value": getattr(new, key)})
        return {"job": job.id, "key": key, "value": getattr(new, key), "stepping": job.lock.locked(),
                "next_step": job.next_step}

    async def _apply_pending(self, job: _Job) -> None:
        """Before a step, under the job's lock: the pending settings take effect."""
        control, new = job.control, job.control.pending_spec
        if new is None:
            return
        changes = dict(control.pending)
        control.pending.clear()
        control.pending_spec = None
        if "activation_codec" in changes or "gradient_codec" in changes:
            try:
                await asyncio.gather(*(ref.ask(CODEC_ENDPOINT, activation_codec=new.edge_codecs("activation_codec"),
                                               gradient_codec=new.edge_codecs("gradient_codec"), timeout=30)
                                       for ref in job.stages))
            except ActorError as exc:
                self._publish({"type": "setting_rejected", "job": job.id, "key": "codecs",
                               "error": f"the stages refused the new codecs: {exc}"})
                return
        job.spec = new
        job.programs = compile_programs(new)
        self._publish({"type": "settings_applied", "job": job.id, "step": job.next_step, "changes": changes})

    def _step_kwargs(self, job: _Job) -> dict[str, Any]:
        """What every run_step call carries beyond the batch: a micro-batch count the stages were not built with."""
        if job.spec.micro_batches == job.control.stage_micro_batches:
            return {}
        return {"num_microbatches": job.spec.micro_batches}

    def _step_failed(self, job: _Job, step: int, failure: StepFailed) -> StepFailed:
        """Publishes a failed step; a micro-batch count the stages refused is undone, and said so."""
        old, new = job.control.stage_micro_batches, job.spec.micro_batches
        if old != new and "num_microbatches" in failure.cause:
            message = (f"micro_batches={new} was not applied: the stage actors do not take "
                       f"run_step(num_microbatches=...) yet ({failure.cause}); the job keeps micro_batches={old} "
                       "and can go on")
            job.spec = dataclasses.replace(job.spec, micro_batches=old)
            job.programs = compile_programs(job.spec)
            self._publish({"type": "setting_rejected", "job": job.id, "key": "micro_batches", "error": message})
            failure = StepFailed(message, details={**failure.details, "cause": message})
        self._publish({"type": "job_failed", "job": job.id, "step": step, "error": str(failure)})
        return failure

    def _step_finished(self, job: _Job, stats: dict[str, Any], samples: int | None) -> None:
        elapsed = stats["step_time_s"]
        stats["samples"] = samples
        stats["samples_per_s"] = samples / elapsed if samples and elapsed > 0 else None
        job.control.last_stats = {**stats, "schedule": job.spec.schedule, "micro_batches": job.spec.micro_batches}
        run = job.control.run
        progress = None
        if run is not None and not run.finished and stats["step"] >= run.first_step:
            progress = {"done": stats["step"] - run.first_step + 1, "target": run.target}
        self._publish({"type": "step_finished", "job": job.id, "step": stats["step"], "loss": stats["loss"],
                       "step_time_s": elapsed, "bubble_fraction": stats["bubble_fraction"],
                       "samples_per_s": stats["samples_per_s"], "schedule": job.spec.schedule, "run": progress})

    # -- traces -----------------------------------------------------------------------------

    @endpoint(concurrent=True)
    async def trace(self, job_id: str) -> dict[str, Any]:
        """The last step's measured timeline as Chrome/Perfetto trace JSON, on the head's clock.

        Raises:
            ValueError: the job has not finished a step yet.
        """
        job = self._job(job_id)
        results, stats = job.last_trace, job.control.last_stats or {}
        if not results:
            raise ValueError(f"{job_id} has not finished a step yet; run one ('run {job_id} 1'), then trace it")
        clocks = await asyncio.gather(*(self._clock_offset(ref) for ref in job.stages))
        mesh = job.mesh
        records = [
            StageRecord(member=g, name=f"{mesh.describe(g)} ({job.nodes[g]})", pipeline_rank=mesh.coords(g).pipeline,
                        replica=(mesh.coords(g).data, mesh.coords(g).tensor), started_at=float(r["started_at"]),
                        offset_s=clocks[g][0], spans=r["spans"])
            for g, r in enumerate(results)
        ]
        step = stats.get("step")
        metadata = {"title": f"{job.id} step {step}", "job": job.id, "step": step,
                    "schedule": stats.get("schedule"), "micro_batches": stats.get("micro_batches"),
                    "bubble_fraction": stats.get("bubble_fraction"),
                    "clock_round_trips_s": {rec.name: rtt for rec, (_, rtt) in zip(records, clocks)}}
        return to_chrome_trace(records, num_ranks=mesh.pipeline, title=f"{job.id} step {step}", metadata=metadata)

    async def _clock_offset(self, ref: ActorRef) -> tuple[float, float]:
        samples = []
        for _ in range(CLOCK_PROBES):
            sent = time.time()
            remote = float(await ref.ask("clock", timeout=5))
            samples.append((sent, remote, time.time()))
        return estimate_offset(samples)
