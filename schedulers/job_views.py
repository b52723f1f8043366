"""What a job shows of itself: where its stages are, the last step's trace, and the plan of its schedule.

Each asks the stages and reads the :class:`~schedulers.job_core.JobCore`; none changes the job.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from actors import ActorError, ActorRef, NodeLost
from stages import Action, ActionKind, ProgressReport, StageActor
from schedulers.hang import StageProgress, diagnose
from schedulers.job_core import JobCore
from schedulers.jobs import JobSpec
from schedulers.planning import advise
from schedulers.records import Plan, WhereReport
from schedulers.trace import StageRecord, estimate_offset, to_chrome_trace

__all__ = ["CLOCK_PROBES", "JobViews"]

CLOCK_PROBES = 5  # round trips per stage when estimating its clock offset
PROGRESS_TIMEOUT_S = 2.0  # a stage that holds its interpreter never answers: the report names it, and is not late


_COMPUTE_KINDS = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)

async def clock_offset(ref: ActorRef) -> tuple[float, float]:
    """A stage's clock offset from the head's, and the round trip it was measured with."""
    samples = []
    clock = ref.endpoint(StageActor.clock, timeout=5)
    for _ in range(CLOCK_PROBES):
        sent = time.time()
        remote = float(await clock.call())
        samples.append((sent, remote, time.time()))
    return estimate_offset(samples)


class JobViews:
    """A job's hang report, trace and plan (the plan of a fixed schedule kept per step)."""

    def __init__(self, job: JobCore) -> None:
        self.job = job
        self._advice: tuple[tuple[int, JobSpec], Plan] | None = None  # job.plan() of a fixed schedule, per step

    async def clock_offsets(self) -> list[float]:
        """Each stage's clock offset from the head's, by global rank."""
        return [offset for offset, _ in await asyncio.gather(*(clock_offset(ref) for ref in self.job.stages))]

    async def where(self) -> WhereReport:
        """Hang forensics: each stage's current action, what it waits for, and the marked grid."""
        text, lines, _, _ = await self.hang_report()
        return WhereReport(job=self.job.id, stepping=self.job.lock.locked(), report=text, lines=lines)

    async def hang_report(self) -> tuple[str, list[str], list[int], list[int]]:
        """Asks every stage where it is; returns the full report, its per-stage lines, the global ranks of
        the stages that did not answer (within :data:`PROGRESS_TIMEOUT_S`), and those of the stages
        computing an action of the step (forward, backward or a weight gradient: on their compute thread,
        which no abort stops)."""
        job = self.job

        async def progress(ref: ActorRef) -> ProgressReport | str:
            try:
                return await ref.endpoint(StageActor.progress, timeout=PROGRESS_TIMEOUT_S).call()
            except ActorError as exc:
                return f"{ref.name} did not answer ({exc.message})"

        answers = await asyncio.gather(*(progress(ref) for ref in job.stages))
        running = job.lock.locked()
        # The step whose answers are awaited: a run sends the next step's orders while its stages finish the
        # one before. The newest step sent, taken for it, marked every stage still on the one before as not
        # started (and dropped the marks); a stage already on the next has finished it: at its barrier.
        step = (job.next_step - 1 if job.collecting is None else job.collecting) if running else None
        replicas: dict[tuple[int, int], dict[int, StageProgress | str]] = {}
        for member, answer in enumerate(answers):
            c = job.mesh.coords(member)
            if isinstance(answer, str):
                replicas.setdefault((c.data, c.tensor), {})[c.pipeline] = answer
                continue
            past = step is not None and answer.step > step  # it finished that step: at its barrier
            replicas.setdefault((c.data, c.tensor), {})[c.pipeline] = StageProgress(
                rank=c.pipeline, current=None if past else answer.current,
                done=_at_barrier(job.programs[c.pipeline]) if past else answer.done,
                stale=step is not None and answer.step < step)
        lines: list[str] = []
        grids: list[tuple[bool, str]] = []
        for (data, tensor), found in sorted(replicas.items()):
            report = diagnose(job.programs, found, running=running)
            prefix = "" if len(replicas) == 1 else f"[dp {data} tp {tensor}] "
            lines += [prefix + line for line in report.lines]
            grids.append((report.settled, f"{prefix}programs, each stage's place marked >like this<:\n{report.grid}"))
        grid = next((g for settled, g in grids if not settled), grids[0][1] if grids else "")
        silent = [member for member, answer in enumerate(answers) if isinstance(answer, str)]
        busy = [member for member, answer in enumerate(answers) if not isinstance(answer, str)
                and answer.step == step and answer.current is not None
                and Action.parse(answer.current).kind in _COMPUTE_KINDS]
        return "\n".join([*lines, grid]), lines, silent, busy

    async def trace(self) -> dict[str, Any]:
        """The last step's measured timeline as Chrome/Perfetto trace JSON, on the head's clock.

        Raises:
            ValueError: the job has not finished a step yet.
            NodeLost: a node of the job is lost.
        """
        job = self.job
        reports, stats = job.last_reports, job.last_stats
        if not reports or stats is None:
            raise ValueError(f"{job.id} has not finished a step yet; run one ('run {job.id} 1'), then trace it")
        lost = await job.lost_member()  # at once, not each stage's clock call timed out
        if lost is not None:
            raise NodeLost(f"node {lost} of {job.id} was lost: its stages' clocks cannot be read for the trace",
                           details={"node": lost})
        clocks = await asyncio.gather(*(clock_offset(ref) for ref in job.stages))
        mesh = job.mesh
        records = [
            StageRecord(member=g, name=f"{mesh.describe(g)} ({job.nodes[g]})", pipeline_rank=mesh.coords(g).pipeline,
                        replica=(mesh.coords(g).data, mesh.coords(g).tensor), started_at=float(r.started_at),
                        offset_s=clocks[g][0], spans=r.spans)
            for g, r in enumerate(reports)
        ]
        title = f"{job.id} step {stats.step}"
        metadata = {"title": title, "job": job.id, "step": stats.step,
                    "schedule": stats.schedule, "micro_batches": stats.micro_batches,
                    "bubble_fraction": stats.bubble_fraction,
                    "clock_round_trips_s": {rec.name: rtt for rec, (_, rtt) in zip(records, clocks)}}
        return to_chrome_trace(records, num_ranks=mesh.pipeline, title=title, metadata=metadata,
                               placement=job.spec.parallelism.placement)

    async def plan(self) -> Plan:
        """The candidate schedules with their predicted step time and stash, the chosen one marked.

        With ``schedule="auto"``: the plan made from the timed probe step (none while the job
        still measures). With a fixed schedule: predicted from the last step, marking
        what auto would run.
        """
        job = self.job
        spec, stats, reports = job.spec, job.last_stats, job.last_reports
        if spec.parallelism.schedule == "auto":
            return job.auto.plan(job.id, spec)
        if stats is None or not reports:
            schedule = spec.parallelism.schedule
            return Plan(job=job.id, schedule=schedule, running=schedule, state="no_steps")
        if self._advice is None or self._advice[0] != (stats.step, spec):
            offsets = await self.clock_offsets()
            plan = await asyncio.to_thread(advise, job.id, spec, reports, job.mesh, offsets=offsets,
                                           step_time_s=stats.step_time_s, step=stats.step)
            self._advice = ((stats.step, spec), plan)  # asked again before the next step: the same answer
        return self._advice[1]


def _at_barrier(program: list[str]) -> int:
    """How many of ``program``'s actions a stage at its barrier has done."""
    return next((i for i, text in enumerate(program) if text.endswith("BARRIER")), len(program))
