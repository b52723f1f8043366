"""A job's state: read and loaded whole, and checkpointed by its stages themselves.

Functions of a :class:`~schedulers.job_core.JobCore` (``job``), which they hold through
its :meth:`~schedulers.job_core.JobCore.operation` and change through its methods; the
checkpoint format is :mod:`stages.state.checkpoint` and :mod:`stages.state.manifest`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from actors import ActorError, ActorRef
from stages import (
    check_directory,
    CheckpointError,
    Coords,
    gather_tensor_parallel_state,
    Manifest,
    merge_written,
    Mesh,
    shard_state,
    ShardSpec,
    StageActor,
)
from stages.state.export import FORMATS, file_name
from stages.state.manifest import DCP, SAFETENSORS, NoCheckpoint
from schedulers.checkpoint_paths import CheckpointPath
from schedulers.job_core import JobCore
from schedulers.stepping import key_order


__all__ = ["apply_checkpoint", "export", "load", "load_state_dict", "state_dict", "write_checkpoint"]

log = logging.getLogger(__name__)

CHECKPOINT_TIMEOUT_S = 900.0  # one stage's share of a save or load: gigabytes, fsynced


def _shard_file(mesh: Mesh, rank: int) -> str:
    """The file a writer's tensors go to: named by its pipeline and tensor rank (``p1-t0.safetensors``),
    and its data-parallel replica unless 0 (``p1-t0-d1.safetensors``: a ZeRO-1 optimizer shard)."""
    c = mesh.coords(rank)
    return f"p{c.pipeline}-t{c.tensor}{f'-d{c.data}' if c.data else ''}.safetensors"


def _reason(exc: BaseException) -> str:
    """An error's message for a list of problems: a remote one without its traceback."""
    return exc.message if isinstance(exc, ActorError) else f"{type(exc).__name__}: {exc}"


async def state_dict(job: JobCore) -> dict[str, torch.Tensor]:
    """The whole model's state, gathered from the stages, under the unpartitioned keys.

    Tensor-parallel shards are put back together; data-parallel replica 0 speaks for all.
    """
    mesh = job.mesh
    async with job.operation():
        specs = await _shard_specs(job)
        state: dict[str, torch.Tensor] = {}
        for p in range(mesh.pipeline):
            shards = await asyncio.gather(*(
                job.stages[mesh.rank(Coords(0, p, t))].endpoint(StageActor.state_dict, timeout=300).call()
                for t in range(mesh.tensor)))
            state.update(gather_tensor_parallel_state(list(shards), specs) if mesh.tensor > 1 else shards[0])
    return dict(sorted(state.items(), key=lambda kv: key_order(kv[0])))


async def load_state_dict(job: JobCore, state: dict[str, torch.Tensor]) -> None:
    """Loads a whole-model state into every member; every key must be taken. All or nothing, as a
    checkpoint's load: every stage checks its part first, and none applies it unless all found it good.

    Raises:
        KeyError: keys no stage holds, or a key a held layer needs that ``state`` lacks.
        ValueError: a tensor of another shape than the model's (named with the whole model's shapes).
    """
    mesh = job.mesh
    async with job.operation(repairs=True):
        specs = await _shard_specs(job)
        held = await _held_keys(job)
        missing = set(state) - frozenset().union(*held)
        if missing:
            raise KeyError(f"keys no stage holds: {sorted(missing)[:10]}")

        def part(rank: int) -> dict[str, torch.Tensor]:
            c = mesh.coords(rank)
            mine = {k: v for k, v in state.items() if k in held[c.pipeline]}
            return shard_state(mine, c.tensor, mesh.tensor, specs) if mesh.tensor > 1 else mine

        parts = {g: part(g) for g in range(mesh.size)}  # a tensor that does not split: refused before any call
        checked = await asyncio.gather(*(
            ref.endpoint(StageActor.load_state_dict, timeout=300).call(parts[g], True)
            for g, ref in enumerate(job.stages)), return_exceptions=True)
        refused = next((r for r in checked if isinstance(r, BaseException)), None)
        if refused is not None:
            await _discard_loads(job)
            raise refused
        await asyncio.gather(*(ref.endpoint(StageActor.checkpoint_apply, timeout=300).call(True)
                               for ref in job.stages))
        job.restarted_history()  # every stage holds the same state again, from elsewhere


async def _held_keys(job: JobCore, aliases: bool = True) -> list[frozenset[str]]:
    """Per pipeline rank, the keys of the whole model's state its stages hold (tied tensors: on several),
    and with ``aliases`` the other names a state dict may give their tied tensors under."""
    keys = await asyncio.gather(*(
        job.stages[job.mesh.rank(Coords(0, p, 0))].endpoint(StageActor.state_keys, timeout=60).call(aliases)
        for p in range(job.mesh.pipeline)))
    return [frozenset(k) for k in keys]

# -- checkpoints (the format: stages.state.checkpoint) -------------------------------------------


async def write_checkpoint(job: JobCore, path: CheckpointPath, keep: int = 1, spare: str | None = None,
                           evaluations: dict[str, Any] | None = None) -> str:
    """Writes a checkpoint of the weights, optimizer state, learning-rate schedule and step count; returns
    the new version's path. The caller holds the job (:meth:`JobCore.operation`: ``job.save``, or a step
    or a run that saves itself after a step). The newest ``keep`` versions in the directory stay (0:
    every one), and the version named ``spare`` (the job's best: ``checkpointing.keep_best``);
    ``evaluations``: how the job's own evaluations stand, for a resume (the manifest's ``job.evaluations``).

    Data-parallel replica 0 of every (pipeline, tensor) coordinate writes its own file
    straight into ``path.directory``, in parallel; nothing big passes through the head (with
    ZeRO-1 every other replica writes its shard's optimizer state too, so the manifest
    holds every parameter's state once, as an unsharded job's does). The
    first stage actor makes the job's staging directory (inside ``path.within``, links
    resolved, for a client) and, once every file is fsynced, switches ``LATEST`` to the
    new version atomically.

    Raises:
        CheckpointError: a relative path, a directory that holds something else or leads
            out of the client's subtree, or a node that cannot write there (named, with why).
    """
    directory = check_directory(path.directory)
    mesh = job.mesh
    coordinator = [0]
    [staging] = await _on_stages(job, coordinator, "save", lambda g: job.stages[g].endpoint(
        StageActor.checkpoint_begin, timeout=CHECKPOINT_TIMEOUT_S).call(directory, path.within))
    writers = [g for g in range(mesh.size) if mesh.coords(g).data == 0 or job.spec.optimization.zero_stage in (1, 2)]
    written = await _on_stages(job, writers, "save", lambda g: job.stages[g].endpoint(
        StageActor.checkpoint_write, timeout=CHECKPOINT_TIMEOUT_S).call(staging, _shard_file(mesh, g)))
    files, model, state = merge_written(written)
    # Every stage steps the same schedule: the first writer's state speaks for all.
    schedule = written[0].get("lr_scheduler")
    manifest = Manifest(step=job.applied, optimizer=job.spec.optimization.optimizer[0], files=files, model=model,
                        optimizer_state=state,
                        lr_scheduler=None if schedule is None or job.spec.optimization.lr_scheduler is None else
                        {"path": job.spec.optimization.lr_scheduler[0], "state": schedule},
                        job={"id": job.id, "spec": _described(job.spec.to_wire()), "bounds": job.bounds,
                             "mesh": [mesh.pipeline, mesh.tensor, mesh.data],
                             "data_position": job.data.at(job.applied),
                             **({"loss_scaler": job.scaler.state_dict()} if job.scaler is not None else {}),
                             **({"evaluations": evaluations} if evaluations else {})})
    [version] = await _on_stages(job, coordinator, "save", lambda g: job.stages[g].endpoint(
        StageActor.checkpoint_commit, timeout=CHECKPOINT_TIMEOUT_S).call(directory, staging,
                                                                          manifest.to_wire(), keep, spare))
    job.saved(path, manifest.step)  # what a recovery falls back to
    return str(version)


async def export(job: JobCore, path: CheckpointPath, format: str = "safetensors") -> str:
    """Writes the model's weights as a model directory ``from_pretrained`` loads, or (``format="dcp"``)
    a ``torch.distributed.checkpoint`` directory (see :mod:`stages.state.export`); returns its path.

    Each pipeline stage's first actor writes its own file, at once; with tensor
    parallelism every rank first writes its slices into the export's staging directory
    (weights only), which that actor then reads back whole: nothing passes through the
    head, and no process holds more than one stage's weights.

    Raises:
        CheckpointError: a directory that is not new or empty, or a node that cannot write there.
        ValueError: another format.
    """
    if format not in FORMATS:
        raise ValueError(f"export writes {' or '.join(FORMATS)}, not {str(format)[:40]!r}")
    directory = check_directory(path.directory)
    mesh = job.mesh
    first = [mesh.rank(Coords(0, p, 0)) for p in range(mesh.pipeline)]
    async with job.operation():
        [staging] = await _on_stages(job, [0], "export", lambda g: job.stages[g].endpoint(
            StageActor.export_begin, timeout=CHECKPOINT_TIMEOUT_S).call(directory, path.within))
        plans: dict[int, Any] = {}
        if mesh.tensor > 1:
            slices = [g for g in range(mesh.size) if mesh.coords(g).data == 0]
            written = await _on_stages(job, slices, "export", lambda g: job.stages[g].endpoint(
                StageActor.checkpoint_write, timeout=CHECKPOINT_TIMEOUT_S).call(staging, _shard_file(mesh, g), True))
            files, model, _ = merge_written(written)
            whole = Manifest(step=job.applied, optimizer="", files=files, model=model, optimizer_state={})
            held = await _held_keys(job, aliases=False)
            plans = {g: whole.restrict(held[mesh.coords(g).pipeline], weights_only=True).to_wire() for g in first}
        stages = await _on_stages(job, first, "export", lambda g: job.stages[g].endpoint(
            StageActor.export_write, timeout=CHECKPOINT_TIMEOUT_S).call(
                staging, file_name(mesh.coords(g).pipeline, mesh.pipeline, format), plans.get(g), format))
        [done] = await _on_stages(job, [0], "export", lambda g: job.stages[g].endpoint(
            StageActor.export_commit, timeout=CHECKPOINT_TIMEOUT_S).call(directory, staging, stages, format))
    return str(done)


async def load(job: JobCore, path: CheckpointPath, weights_only: bool = False) -> int:
    """Loads the checkpoint in ``path.directory`` into every member, all or nothing; returns its step.

    Phase one: every stage actor reads its part and checks every key, shape, dtype
    and checksum, while the head checks that every tensor of the checkpoint is
    taken by some stage. Only when no one found a problem does phase two copy, on
    every stage. The layout may differ from the saved one: keys are the model's own.

    Args:
        weights_only: load the parameters only; the optimizer state, the learning-rate
            schedule and the step count stay as they are (e.g. to fine-tune with another
            optimizer). Otherwise the schedule goes on where it was saved; a checkpoint
            without one (or from before schedules were kept) leaves the job's as it is.

    Raises:
        CheckpointError: every problem found, on every stage; nothing was applied.
    """
    check_directory(path.directory)
    async with job.operation(repairs=True):
        version, step, whole = await _apply(job, path, weights_only)
        if whole:  # the data factory goes on from the checkpoint's step
            job.loaded(step)
        job.restarted_history()
        if whole:  # what a recovery goes back to now: this version, not an older save of the job's own
            job.saved(dataclasses.replace(path, directory=version), step)
    return step


async def resume(job: JobCore, path: CheckpointPath) -> tuple[str, int, dict[str, Any]] | None:
    """Loads the newest checkpoint in ``path.directory`` as :func:`load` does (``checkpointing.
    resume_from_checkpoint``), where there is one: its version, step and the manifest's record of the
    job that wrote it (``job``); None where the directory holds none (or does not exist yet), and the
    job starts from its seed.

    Raises:
        CheckpointError: a checkpoint that is there but does not load (nothing was applied).
    """
    directory = check_directory(path.directory)
    try:
        found = await job.stages[0].endpoint(StageActor.checkpoint_manifest, timeout=CHECKPOINT_TIMEOUT_S).call(
            directory, path.within)
    except ActorError as exc:
        if exc.raised(NoCheckpoint):
            return None
        raise CheckpointError(f"{job.id} cannot resume from {directory}", [_reason(exc)]) from None
    # That version, not the directory's newest again: a save that moved LATEST meanwhile would otherwise
    # give the job another version's weights than the record of its evaluations read here.
    version, written = str(found[0]), Manifest.from_wire(found[1]).job
    step = await load(job, dataclasses.replace(path, directory=version))
    return version, step, written if isinstance(written, dict) else {}


async def apply_checkpoint(job: JobCore, path: CheckpointPath, weights_only: bool = False) -> int:
    """:func:`load`'s two phases, for a caller that holds the job (a recovery too); returns the step.

    Every stage drops its snapshots and takes one at the next step; the job's data
    position and kept batches are the caller's to set.
    """
    _, step, _ = await _apply(job, path, weights_only)
    return step


async def _apply(job: JobCore, path: CheckpointPath, weights_only: bool) -> tuple[str, int, bool]:
    """:func:`apply_checkpoint`: the version loaded, its step, and whether more than the weights were loaded
    (a directory of safetensors files holds the weights alone: the job's optimizer, schedule and step stay)."""
    directory = path.directory
    [found] = await _on_stages(job, [0], "load", lambda g: job.stages[g].endpoint(
        StageActor.checkpoint_manifest, timeout=CHECKPOINT_TIMEOUT_S).call(directory, path.within))
    version, manifest = str(found[0]), Manifest.from_wire(found[1])
    # A weights directory's links are read through for the admin alone, as the head decides (not the node).
    manifest = dataclasses.replace(manifest, links=manifest.source == SAFETENSORS and path.within is None)
    weights_only = weights_only or manifest.source in (SAFETENSORS, DCP)
    # Another tool's files may keep a tied tensor under one of its names: each holder gets it by any.
    held = await _held_keys(job, aliases=manifest.source in (SAFETENSORS, DCP))
    if manifest.source == SAFETENSORS:  # a base model's files into the model with a head, or back
        every = frozenset().union(*held)
        left = sorted(manifest.left_unplaced(every))
        passed = frozenset(await job.stages[0].endpoint(StageActor.passed_over, timeout=60).call(left)) if left \
            else frozenset()
        before = len(manifest.model)
        manifest, moved = manifest.under_base_prefix(every, passed)
        if moved:
            log.info("%s: %s's keys read with %s prefix %r, as from_pretrained does", job.id, directory,
                     "the" if moved[0] == "+" else "without the", moved[1:])
        if len(manifest.model) < before:
            log.info("%s: %d of %s's keys passed over, as the model's from_pretrained passes them over (%s)",
                     job.id, before - len(manifest.model), directory, ", ".join(sorted(passed)[:4]))
    problems = _unplaced(job, manifest, weights_only, held)
    plans = {g: manifest.restrict(held[job.mesh.coords(g).pipeline], weights_only=weights_only).to_wire()
             for g in range(job.mesh.size)}
    answers = await _on_stages(job, list(plans), "load", lambda g: job.stages[g].endpoint(
        StageActor.checkpoint_check, timeout=CHECKPOINT_TIMEOUT_S).call(version, plans[g]), discard=True)
    problems += sorted({p for answer in answers for p in answer})
    if problems:
        await _discard_loads(job)
        raise CheckpointError(f"{directory} was not loaded (nothing changed): {len(problems)} problem(s)",
                              problems)
    await _on_stages(job, list(plans), "load", lambda g: job.stages[g].endpoint(
        StageActor.checkpoint_apply, timeout=CHECKPOINT_TIMEOUT_S).call(weights_only))
    job.checkpoint_applied()
    saved_scale = manifest.job.get("loss_scaler")
    if job.scaler is not None and not weights_only and isinstance(saved_scale, dict):
        try:  # fp16: the loss scale goes on from where it was
            job.scaler.load_state_dict(saved_scale)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("%s: the checkpoint's loss scale is unreadable (%s); keeping the current one", job.id, exc)
    if not weights_only:  # a dataset goes on where the saved job's stream stood, whatever its layout was
        saved_position = manifest.job.get("data_position")
        per_step = job.mesh.data * job.spec.parallelism.micro_batches
        job.data.restart(manifest.step, saved_position if type(saved_position) is int and saved_position >= 0
                         else manifest.step * per_step, per_step)  # a checkpoint from before positions were kept
    return version, manifest.step, not weights_only


def _described(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec for the manifest (JSON): an example batch by its tensors' shapes and dtypes, not their values."""
    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return f"tensor {list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
        if isinstance(value, dict):
            return {k: describe(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [describe(v) for v in value]
        return value
    parallelism = spec.get("parallelism", {})
    return {**spec, "parallelism": {**parallelism, "example_inputs": describe(parallelism.get("example_inputs"))}}


def _unplaced(job: JobCore, manifest: Manifest, weights_only: bool, held: list[frozenset[str]]) -> list[str]:
    """What the head sees wrong before reading a byte: keys no stage holds, another optimizer."""
    every = frozenset().union(*held)
    keys = list(manifest.model) + ([] if weights_only else list(manifest.optimizer_state))
    problems = [f"{key}: in the checkpoint but no stage holds it in this model"
                for key in sorted(set(keys)) if key not in every]
    if not weights_only and manifest.optimizer_state and manifest.optimizer != job.spec.optimization.optimizer[0]:
        problems.append(f"the checkpoint holds {manifest.optimizer} state but this job uses "
                        f"{job.spec.optimization.optimizer[0]}; load with weights_only=True to take the weights alone")
    saved = manifest.lr_scheduler
    ours = job.spec.optimization.lr_scheduler[0] if job.spec.optimization.lr_scheduler is not None else None
    if not weights_only and saved is not None and saved["path"] != ours:
        problems.append(f"the checkpoint goes on with the learning-rate schedule {saved['path'][:120]} but this job "
                        f"{'uses ' + ours if ours else 'has none'}; start the job with that lr_scheduler to continue "
                        "it, or load with weights_only=True to take the weights alone")
    return problems


async def _discard_loads(job: JobCore) -> None:
    async def discard(ref: ActorRef) -> None:
        try:
            await ref.endpoint(StageActor.checkpoint_discard, timeout=10).call()
        except ActorError as exc:
            log.info("discarding a checked load on %s: %s", ref.name, exc)

    await asyncio.gather(*(discard(ref) for ref in job.stages))


async def _on_stages(
    job: JobCore, ranks: list[int], what: str, call: Callable[[int], Awaitable[Any]], *, discard: bool = False
) -> list[Any]:
    """``call(rank)`` for every global rank in ``ranks`` at once; their answers, in order.

    Raises:
        CheckpointError: one or more failed; each is named with its node and why.
    """
    results = await asyncio.gather(*(call(g) for g in ranks), return_exceptions=True)
    failed = [f"{job.mesh.describe(g)} on node {job.nodes[g]}: {_reason(r)}"
              for g, r in zip(ranks, results) if isinstance(r, BaseException)]
    if failed:
        if discard:
            await _discard_loads(job)
        raise CheckpointError(f"the {what} failed on {len(failed)} stage actor(s)"
                              f"{' (nothing changed)' if discard else ''}", failed)
    return list(results)


async def _shard_specs(job: JobCore) -> dict[str, ShardSpec]:
    if job.mesh.tensor == 1:
        return {}
    parts = await asyncio.gather(*(
        job.stages[job.mesh.rank(Coords(0, p, 0))].endpoint(StageActor.shard_specs, timeout=60).call()
        for p in range(job.mesh.pipeline)))
    return {key: ShardSpec(*spec) for part in parts for key, spec in part.items()}

