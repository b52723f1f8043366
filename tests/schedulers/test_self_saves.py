# .venv/bin/python -m pytest -q -p no:cacheprovider tests/schedulers/test_self_saves.py
"""A job's own saves (schedulers.self_saves), on a stand-in for the job: when they come, once each,
how many versions they keep, and what a failed one leaves. The saves themselves (job_state) are
tests/schedulers/test_runs.py's, on nodes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from schedulers import job_state
from schedulers.checkpoint_paths import CheckpointPath
from schedulers.events import CheckpointSaved
from schedulers.jobs import JobSpec
from schedulers.self_saves import SelfSaves

MODEL = "examples.models:residual_mlp"
OWN = CheckpointPath(directory="/ckpt/run", within=None)


@dataclass
class Job:
    """What SelfSaves reads of a job: its spec, id, applied steps, and where its events go."""

    spec: JobSpec
    id: str = "job0"
    applied: int = 0
    loads: int = 0  # whole checkpoints loaded (JobCore.loaded)
    events: list[Any] = field(default_factory=list)

    def publish(self, event: Any) -> None:
        self.events.append(event)

    async def lost_member(self) -> str | None:  # every member is there (a lost one: tests/schedulers/test_recovery.py)
        return None


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str, int]]:
    """Every save job_state.write_checkpoint was asked for: (applied, directory, keep); one whose directory is
    ``/full`` fails as a full disk would."""
    calls: list[tuple[int, str, int]] = []

    async def save(job: Job, path: CheckpointPath, keep: int = 1, spare: str | None = None,
                   evaluations: dict[str, Any] | None = None) -> str:
        await asyncio.sleep(0)  # a save takes its time: another may ask meanwhile
        if path.directory == "/full":
            raise OSError(28, "No space left on device")
        calls.append((job.applied, path.directory, keep))
        return f"{path.directory}/v{len(calls):06d}"

    monkeypatch.setattr(job_state, "write_checkpoint", save)
    return calls


async def test_a_job_saves_after_every_nth_applied_step_once_however_many_ask(saved: list[Any]) -> None:
    job = Job(JobSpec.of(model=MODEL, checkpoint_dir="run", checkpoint_every=2, keep_checkpoints=3))
    saves = SelfSaves(job, OWN)  # type: ignore[arg-type]
    for applied in range(1, 6):
        job.applied = applied
        assert saves.save_point(applied) == (applied % 2 == 0)
        await saves.save_if_due()
    assert saved == [(2, "/ckpt/run", 3), (4, "/ckpt/run", 3)]
    assert not saves.save_point(4)  # taken
    job.applied = 6
    await asyncio.gather(saves.save_if_due(), saves.save_if_due())  # a driven step and a run, at once
    assert [step for step, _, _ in saved] == [2, 4, 6]
    assert [(e.step, e.version) for e in job.events if isinstance(e, CheckpointSaved)] == [
        (2, "/ckpt/run/v000001"), (4, "/ckpt/run/v000002"), (6, "/ckpt/run/v000003")]
    # keep_checkpoints holds in the job's own directory, a save elsewhere keeps its newest only
    assert saves.save_args(OWN) == (3, None, None)  # no evaluations to record
    assert saves.save_args(CheckpointPath(directory="/elsewhere", within=None)) == (1, None, None)


async def test_a_failed_save_raises_and_is_not_taken_as_done_and_no_directory_saves_nothing(
        saved: list[Any]) -> None:
    job = Job(JobSpec.of(model=MODEL, checkpoint_dir="full", checkpoint_every=1), applied=1)
    full = SelfSaves(job, CheckpointPath(directory="/full", within=None))  # type: ignore[arg-type]
    with pytest.raises(OSError, match="No space left"):
        await full.save_if_due()
    assert full.save_point(1) and job.events == []  # not done: nothing said
    off = SelfSaves(Job(JobSpec.of(model=MODEL), applied=4), None)  # type: ignore[arg-type]
    await off.save_if_due()
    assert not off.save_point(4) and saved == [] and await off.resume() is None
