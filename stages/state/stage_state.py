"""One stage's state: its state dict, its part of a checkpoint, and the snapshots recovery rolls back to.

:class:`StageState` serves the stage actor's state endpoints over the layers it holds
(:class:`~stages.build.stage.BuiltStage`), always on the compute thread, between steps.
The formats live beside it: :mod:`stages.state.checkpoint` (versions and manifests),
:mod:`stages.state.stage_checkpoint` (a stage's tensors in them) and
:mod:`stages.state.snapshots` (in-memory copies).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from actors._errors import NotAllowed
from stages.build.stage import BuiltStage, Key
from stages.build.tensor_parallel import ShardSpec
from stages.comm import zero
from stages.comm.device_io import DeviceIO
from stages.compute.executor import StepExecutor
from stages.state import checkpoint, export, snapshots
from stages.state.snapshots import SnapshotShelf
from stages.state.stage_checkpoint import PreparedLoad, apply_load, prepare_load, whole_shape, write_stage

__all__ = ["StageState", "checked_held", "held_keys", "load_held", "state_of"]

T = TypeVar("T")


def held_keys(held: Mapping[int, nn.Module], key: Key, aliases: Mapping[str, list[str]] | None = None) -> list[str]:
    """The whole model's keys of the held layers' state, and (``aliases``) the other names of their tied tensors."""
    keys = [key(i, k) for i, layer in held.items() for k in layer.state_dict()]
    if aliases is None:
        return keys
    return list(dict.fromkeys(keys + [a for k in keys for a in aliases.get(k, [])]))


def state_of(held: Mapping[int, nn.Module], key: Key, io: DeviceIO | None = None) -> dict[str, torch.Tensor]:
    """The held layers' state under the whole model's keys, on the CPU (from a GPU: moved once, in pinned chunks)."""
    named = [(key(i, k), v) for i, layer in held.items() for k, v in layer.state_dict().items()]
    values = [v for _, v in named]
    return dict(zip([k for k, _ in named], io.copy_to_cpu(values) if io is not None else values))


def load_held(held: Mapping[int, nn.Module], state: Mapping[str, torch.Tensor], key: Key,
              aliases: Mapping[str, list[str]], io: DeviceIO | None = None) -> list[str]:
    """Checks every held layer's entries of ``state`` first (:func:`checked_held`), then loads them;
    returns the keys taken."""
    parts, taken = checked_held(held, state, key, aliases)
    if io is not None and io.staged:  # to the device at once, not one by one
        flat = [(i, k, v) for i, mine in parts.items() for k, v in mine.items()]
        for (i, k, _), moved in zip(flat, io.copy_to_device([v for _, _, v in flat])):
            parts[i][k] = moved
    for i, mine in parts.items():
        held[i].load_state_dict(mine, strict=True)
    return taken


def checked_held(held: Mapping[int, nn.Module], state: Mapping[str, torch.Tensor], key: Key,
                 aliases: Mapping[str, list[str]], specs: Mapping[str, ShardSpec] | None = None
                 ) -> tuple[dict[int, dict[str, torch.Tensor]], list[str]]:
    """Every held layer's entries of ``state``, checked, by layer under the layer's own keys; and the keys
    of ``state`` taken. Nothing is loaded. ``specs``: how tensor-parallel slices split, so that a shape
    is named as the whole model has it, not as this rank's slice.

    A key the state lacks is filled from another name of the same tensor (tied weights
    saved once, as ``save_pretrained`` does) when the state has that one. Errors name
    keys as the whole model has them.

    Raises:
        KeyError: a key missing for a held layer (``3.fc1.weight``), or unknown to all of them.
        ValueError: a tensor whose shape is not the parameter's.
    """
    parts: dict[int, dict[str, torch.Tensor]] = {}
    known: set[str] = set()
    for i, layer in held.items():
        own = layer.state_dict(keep_vars=True)
        same: dict[int, list[str]] = {}
        for k, v in own.items():
            same.setdefault(id(v), []).append(key(i, k))
        mine: dict[str, torch.Tensor] = {}
        missing = []
        for k, v in own.items():
            name = key(i, k)
            known.add(name)
            names = [name, *same[id(v)], *aliases.get(name, [])]
            known.update(names)
            given = next((state[a] for a in names if a in state), None)
            if given is None:
                missing.append(name)
                continue
            if not isinstance(given, torch.Tensor) or given.shape != v.shape:
                spec = (specs or {}).get(name)
                shape = tuple(whole_shape(given.shape, spec)) if isinstance(given, torch.Tensor) else \
                    type(given).__name__
                raise ValueError(f"{name}: expected shape {tuple(whole_shape(v.shape, spec))}, got {shape}")
            mine[k] = given
        if missing:
            raise KeyError(f"layer {i}: missing {missing[:10]}")
        parts[i] = mine
    unknown = [k for k in state if k not in known]
    if unknown:
        raise KeyError(f"keys this stage does not hold: {unknown[:10]}")
    return parts, [k for k in state if k in known]


class StageState:
    """A stage's state endpoints' work: state dicts, checkpoints and snapshots.

    Args:
        built: the stage's layers and how they are named.
        executor: runs the work on the compute thread; its model holds the optimizer and schedule.
        pipeline_rank, pipeline_stages: where this stage sits (a snapshot comes from another rank).
        job: the job's id: a save's staging directory is named by it, and a stage writes only into its own job's.
    """

    def __init__(self, built: BuiltStage, executor: StepExecutor, *, pipeline_rank: int,
                 pipeline_stages: int, job: str) -> None:
        self.built = built
        self.job = job
        self.executor = executor
        self.pipeline_rank = pipeline_rank
        self.pipeline_stages = pipeline_stages
        self.own = SnapshotShelf()  # this stage's newest states, by applied-step count
        self.kept: dict[int, SnapshotShelf] = {}  # a pipeline neighbour's, by its rank
        self._prepared: PreparedLoad | None = None  # a checked checkpoint part (see check)

    async def _compute(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.executor.compute(fn, *args)

    # -- state dicts --------------------------------------------------------------------

    async def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's share of the model's state, under the unpartitioned model's keys, on the CPU."""
        return await self._compute(state_of, self.built.held, self.built.key, self.executor.io)

    async def load_state_dict(self, state: Mapping[str, torch.Tensor], prepare: bool = False) -> list[str]:
        """Loads the entries this stage holds (see :func:`load_held`); snapshots before it are dropped.
        ``prepare``: checks them and keeps them for :meth:`apply` (``weights_only``) instead, as a
        checkpoint's load does, so a job applies a state dict only once every stage has found it good."""
        built = self.built
        if prepare:
            self._prepared = None
            parts, taken = await self._compute(checked_held, built.held, state, built.key, built.aliases,
                                               built.shard_spec_map())
            self._prepared = PreparedLoad(model=parts, optimizer_state={})
            return taken
        taken = await self._compute(load_held, built.held, state, built.key, built.aliases, self.executor.io)
        self.forget_snapshots()
        return taken

    def state_keys(self, aliases: bool = True) -> list[str]:
        """The whole model's keys this stage holds (and, with ``aliases``, its tied tensors' other names)."""
        return held_keys(self.built.held, self.built.key, self.built.aliases if aliases else None)

    def passed_over(self, keys: Sequence[str]) -> list[str]:
        """Of ``keys`` (another tool's file's, that no stage holds), those the model's ``from_pretrained``
        passes over: any its ``_keys_to_ignore_on_load_unexpected`` patterns are found in."""
        patterns = []
        for pattern in self.built.passed_over:
            with contextlib.suppress(re.error):
                patterns.append(re.compile(pattern))
        return [key for key in keys if any(p.search(key) for p in patterns)]

    # -- checkpoints (the format: stages.state.checkpoint) ------------------------------

    async def begin(self, directory: str, within: str | None = None) -> str:
        """As the job's coordinator: makes the job's staging directory for a save; returns it.

        Args:
            within: the subtree ``directory`` must stay in, links resolved (a client's), or None.
        """
        return await self._compute(functools.partial(checkpoint.begin_version, within=within), directory, self.job)

    async def write(self, staging: str, file: str, weights_only: bool = False) -> dict[str, Any]:
        """Writes this stage's tensors and optimizer state (``weights_only``: its weights alone) to
        ``staging/file`` (a staging directory of this stage's job); returns their manifest items."""
        checkpoint.check_staging(staging, file, job=self.job)
        built, model = self.built, self.executor.model
        # Replica 0 writes the weights; with ZeRO-1 every replica writes its shard's optimizer state.
        write = functools.partial(write_stage, key=built.key, model=built.data_rank == 0,
                                  optimizer_state=not weights_only, scheduler=model.lr_scheduler,
                                  io=self.executor.io)
        return await self._compute(write, staging, file, built.held, model.optimizer, built.shard_spec_map(),
                                   built.tensor_rank)

    async def commit(self, directory: str, staging: str, manifest: dict[str, Any], keep: int = 1,
                     spare: str | None = None) -> str:
        """As the coordinator: completes the save, keeping the newest ``keep`` versions (0: all) and
        ``spare``; returns the version."""
        return await self._compute(checkpoint.commit_version, directory, staging,
                                   checkpoint.Manifest.from_wire(manifest), self.job, keep, spare)

    # -- exports (the format: stages.state.export) -------------------------------------

    async def export_begin(self, directory: str, within: str | None = None) -> str:
        """As the coordinator: makes ``directory`` (new or empty) and the export's staging directory
        in it; returns the staging's path (``within``: as for :meth:`begin`)."""
        return await self._compute(functools.partial(export.begin_export, within=within), directory, self.job)

    async def export_write(self, staging: str, file: str, plan: dict[str, Any] | None,
                           format: str = "safetensors") -> dict[str, Any]:
        """Writes this pipeline stage's weights (as safetensors, each tied tensor once) to ``staging/file``:
        from memory, or (``plan``: the weights-only manifest of the tensor-parallel slices its ranks
        wrote into ``staging``) read back whole. Returns the file's names and sizes for the index."""
        checkpoint.check_staging(staging, job=self.job)
        built, io = self.built, self.executor.io
        manifest = checkpoint.Manifest.from_wire(plan) if plan is not None else None

        def write() -> dict[str, Any]:
            live = state_of(built.held, built.key)  # the tensors themselves, for their names and identities
            # Safetensors keep a tied tensor once; DCP keeps every name, as model.state_dict() gives them.
            names = list(live if format == "dcp" else export.unique_tensors(live, built.tied_primary))
            if manifest is None:
                state = state_of(built.held, built.key, io)
                tensors = {name: state[name] for name in names}
            else:
                tensors = {name: checkpoint.read_entry(staging, manifest.model[name], manifest.files, name)
                           for name in names}
            return export.write_export(staging, file, tensors, format)

        return await self._compute(write)

    async def export_commit(self, directory: str, staging: str, written: list[dict[str, Any]],
                            format: str = "safetensors") -> str:
        """As the coordinator: moves the stages' files into ``directory`` with the index and the model's
        config (a traced transformers model's), or DCP's merged metadata; returns ``directory``."""
        config = next((m.model_config for m in self.executor.model.modules.values()
                       if getattr(m, "model_config", None) is not None), None)
        return await self._compute(export.commit_export, directory, staging, written, config, format)

    async def manifest(self, directory: str, within: str | None = None) -> list[Any]:
        """As the coordinator: ``[version directory, manifest]`` of the checkpoint ``LATEST`` names
        (``within``: as for :meth:`begin`)."""
        version, manifest = await self._compute(functools.partial(checkpoint.read_manifest, within=within),
                                                directory)
        return [version, manifest.to_wire()]

    async def check(self, version: str, plan: dict[str, Any]) -> list[str]:
        """Load, phase one: reads and checks this stage's part and keeps it; returns every problem found."""
        self._prepared = None
        built, model = self.built, self.executor.model
        optimizer = model.optimizer
        owns = optimizer.owns if isinstance(optimizer, zero.ShardedOptimizer) else None  # ZeRO-1: the shard's
        prepare = functools.partial(prepare_load, key=built.key, owns=owns, scheduler=model.lr_scheduler,
                                    aliases=built.aliases)
        manifest = checkpoint.Manifest.from_wire(plan)
        prepared, problems = await self._compute(prepare, checkpoint.check_version(version, manifest.source),
                                                 manifest, built.held, built.shard_spec_map(), built.tensor_rank)
        self._prepared = None if problems else prepared
        return problems

    async def apply(self, weights_only: bool) -> None:
        """Load, phase two: copies what :meth:`check` prepared; snapshots taken before are dropped.

        Raises:
            CheckpointError: nothing prepared (problems were found, or :meth:`check` did not run).
        """
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            raise checkpoint.CheckpointError("nothing to apply: checkpoint_check found problems or did not run")
        model = self.executor.model
        await self._compute(functools.partial(apply_load, weights_only=bool(weights_only), key=self.built.key,
                                              scheduler=model.lr_scheduler, io=self.executor.io),
                            prepared, self.built.held, model.optimizer)
        self.forget_snapshots()

    def discard(self) -> None:
        """Load, abandoned: forgets what :meth:`check` read."""
        self._prepared = None

    # -- snapshots (stages.state.snapshots) ---------------------------------------------

    async def take_snapshot(self, index: int) -> dict[str, torch.Tensor] | None:
        """Keeps a copy of this stage's state after ``index`` applied steps; returns it, or None when
        this stage already has one of that index.

        Raises:
            ValueError: ``index`` not an int >= 0.
        """
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"snapshot takes a step count >= 0, got {index!r:.40}")
        if index in self.own:
            return None
        state = await self._compute(self._capture)
        self.own.put(index, state)
        return state

    def _capture(self) -> dict[str, torch.Tensor]:
        """A snapshot, on the host: from a GPU it would hold device memory twice over (two are kept) and
        block the loop when sent to the buddy."""
        model, io = self.executor.model, self.executor.io
        state = snapshots.capture(self.built.held, model.optimizer, model.lr_scheduler)
        if not io.staged:
            return state
        return dict(zip(state, io.copy_to_cpu(list(state.values()))))

    def keep(self, owner: Any, index: Any, state: Any) -> None:
        """Keeps pipeline rank ``owner``'s snapshot after ``index`` applied steps, to restore it elsewhere.

        Raises:
            NotAllowed: not another rank of this pipeline, a step count >= 0 and a map of tensors.
        """
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (owner, index))
        if not (ints and 0 <= owner < self.pipeline_stages and owner != self.pipeline_rank
                and index >= 0 and isinstance(state, dict)
                and all(isinstance(v, torch.Tensor) for v in state.values())):
            raise NotAllowed(f"a snapshot comes from another rank of this pipeline, for a step count >= 0, "
                             f"as tensors; got owner {str(owner)[:12]}, index {str(index)[:12]}")
        self.kept.setdefault(owner, SnapshotShelf()).put(index, state)

    def indices(self) -> dict[str, Any]:
        """The snapshot step counts this stage has: ``{"own": [...], "held": {"RANK": [...]}}``."""
        return {"own": self.own.indices(), "held": {str(owner): shelf.indices() for owner, shelf in self.kept.items()}}

    def held_snapshot(self, owner: int, index: int) -> dict[str, torch.Tensor]:
        """Pipeline rank ``owner``'s snapshot after ``index`` applied steps.

        Raises:
            KeyError: none of that rank or index.
        """
        shelf = self.kept.get(owner)
        if shelf is None:
            raise KeyError(f"rank {self.pipeline_rank} holds no snapshot of rank {owner}")
        return shelf.get(index)

    def own_snapshot(self, index: int) -> dict[str, torch.Tensor]:
        """This stage's own snapshot after ``index`` applied steps (KeyError: none)."""
        return self.own.get(index)

    async def restore(self, index: int, state: dict[str, torch.Tensor] | None, step: int) -> None:
        """Rolls back to the snapshot after ``index`` applied steps (or to ``state``), dropping step ``step``'s
        values and gradients first.

        Raises:
            KeyError: no own snapshot of ``index`` (and no ``state``).
            ValueError: ``state`` holds optimizer state of parameters another ZeRO-1 shard owns.
        """
        if state is None:
            state = self.own.get(index)
        model = self.executor.model
        zero.check_snapshot(model.optimizer, state)
        await self.executor.reset(step)
        await self._compute(snapshots.restore, self.built.held, model.optimizer, state, model.lr_scheduler)
        self.own.put(index, state)

    def forget_snapshots(self) -> None:
        """Drops every snapshot (they belong to another history)."""
        self.own = SnapshotShelf()
        self.kept = {}
