"""The stage actor and all it does: one slice of a model, trained by the programs it is sent.

Rooms, one concern each:

- :mod:`stages.program`, :mod:`stages.mesh`, :mod:`stages.records`: the instruction set
  a stage executes, the layout of a job's stage actors, and the records the scheduler
  and the stages exchange. Pure and torch-free: the scheduler imports them cheaply.
- :mod:`stages.actor`: the :class:`StageActor`, a layer of endpoints over the parts below.
- :mod:`stages.compute`: the step executor, the step's tail after the barrier
  (:mod:`stages.compute.tail`: check, reduce, decide, step), W (weight-gradient)
  handling, activation checkpointing, and the inline fast path.
- :mod:`stages.build`: building a stage (:func:`stages.build.stage.build_stage`: one
  frozen result), its layers (sequential or traced), tied parameters, tensor-parallel shards.
- :mod:`stages.comm`: moving tensors between stages and replicas: sending and taking in
  boundary values (:mod:`stages.comm.delivery`), device copies, ``torch.distributed``
  links and groups (:mod:`stages.comm.groups`), the overlapped reduction, ZeRO-1.
- :mod:`stages.state`: a stage's state dicts, checkpoint parts and snapshots
  (:mod:`stages.state.stage_state`), checkpoints on disk, learning-rate schedules.

Public names are re-exported here lazily (PEP 562), so ``stages.program`` imports
without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from actors._lazy import lazy_exports

_EXPORTS = {
    "StageActor": "stages.actor",
    "LayerSpec": "stages.build.layer_specs",
    "layered_model": "stages.build.layer_specs",
    "meta_initialized": "stages.build.meta_init",
    "MetaInitError": "stages.build.meta_init",
    "gather_tensor_parallel_state": "stages.build.tensor_parallel",
    "shard_state": "stages.build.tensor_parallel",
    "ShardSpec": "stages.build.tensor_parallel",
    "batch_size": "stages.comm.boundary",
    "split_batch": "stages.comm.boundary",
    "backend_for": "stages.comm.parallel",
    "RendezvousActor": "stages.comm.rendezvous",
    "Coords": "stages.mesh",
    "Mesh": "stages.mesh",
    "Action": "stages.program",
    "ActionKind": "stages.program",
    "COMM_KINDS": "stages.program",
    "COMPUTE_KINDS": "stages.program",
    "Placement": "stages.program",
    "PLACEMENTS": "stages.program",
    "stage_to_rank": "stages.program",
    "TAIL_KINDS": "stages.program",
    "transfer_partner": "stages.program",
    "FinishReport": "stages.records",
    "ReduceReport": "stages.records",
    "StageConfig": "stages.records",
    "StageReport": "stages.records",
    "ProgressReport": "stages.records",
    "StepOrder": "stages.records",
    "check_directory": "stages.state.checkpoint",
    "CheckpointError": "stages.state.checkpoint",
    "is_version": "stages.state.checkpoint",
    "layer_of": "stages.state.checkpoint",
    "Manifest": "stages.state.checkpoint",
    "merge_written": "stages.state.checkpoint",
    "BUILTIN_SCHEDULES": "stages.state.lr_scheduler",
    "parameter_groups": "stages.state.weight_decay",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # explicit re-exports, for type checkers (the names resolve lazily above)
    from stages.actor import (
        StageActor as StageActor,
    )
    from stages.build.layer_specs import (
        LayerSpec as LayerSpec,
        layered_model as layered_model,
    )
    from stages.build.meta_init import (
        MetaInitError as MetaInitError,
        meta_initialized as meta_initialized,
    )
    from stages.build.tensor_parallel import (
        gather_tensor_parallel_state as gather_tensor_parallel_state,
        shard_state as shard_state,
        ShardSpec as ShardSpec,
    )
    from stages.comm.boundary import (
        batch_size as batch_size,
        split_batch as split_batch,
    )
    from stages.comm.parallel import (
        backend_for as backend_for,
    )
    from stages.comm.rendezvous import (
        RendezvousActor as RendezvousActor,
    )
    from stages.mesh import (
        Coords as Coords,
        Mesh as Mesh,
    )
    from stages.program import (
        Action as Action,
        ActionKind as ActionKind,
        COMM_KINDS as COMM_KINDS,
        COMPUTE_KINDS as COMPUTE_KINDS,
        Placement as Placement,
        PLACEMENTS as PLACEMENTS,
        stage_to_rank as stage_to_rank,
        TAIL_KINDS as TAIL_KINDS,
        transfer_partner as transfer_partner,
    )
    from stages.records import (
        FinishReport as FinishReport,
        ReduceReport as ReduceReport,
        StageConfig as StageConfig,
        StageReport as StageReport,
        ProgressReport as ProgressReport,
        StepOrder as StepOrder,
    )
    from stages.state.checkpoint import (
        check_directory as check_directory,
        CheckpointError as CheckpointError,
        is_version as is_version,
        layer_of as layer_of,
        Manifest as Manifest,
        merge_written as merge_written,
    )
    from stages.state.lr_scheduler import (
        BUILTIN_SCHEDULES as BUILTIN_SCHEDULES,
    )
    from stages.state.weight_decay import (
        parameter_groups as parameter_groups,
    )
