"""The actor runtime: actors, refs, request/reply, nodes and clusters, and the stage actor.

Public names are re-exported here from private modules, lazily (PEP 562), so that a
leaf such as ``actors.program`` imports without pulling in torch and ZeroMQ. The
layer above (``schedulers/``) uses only these names.

``Job`` and ``StepStats`` moved to ``schedulers`` (the driver-facing job API sits
above the scheduler it talks to); ``actors.Job`` and ``actors.StepStats`` still
resolve, with a DeprecationWarning, through the installed job plugin.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Actor": "actors._actor",
    "LOCAL": "actors._actor",
    "current_caller": "actors._actor",
    "may_call": "actors._actor",
    "Host": "actors._actor",
    "endpoint": "actors._actor",
    "ActorError": "actors._errors",
    "ActorStopped": "actors._errors",
    "ActorTimeout": "actors._errors",
    "BadArguments": "actors._errors",
    "MailboxFull": "actors._errors",
    "NonFiniteError": "actors._errors",
    "NotAllowed": "actors._errors",
    "RemoteError": "actors._errors",
    "UnknownActor": "actors._errors",
    "UnknownEndpoint": "actors._errors",
    "ActorRef": "actors._ref",
    "load_object": "actors._registry",
    "register_actor": "actors._registry",
    "Runtime": "actors._runtime",
    "open_runtime": "actors._runtime",
    "StepFailed": "actors._errors",
    "NodeLost": "actors._errors",
    "HeadLost": "actors._errors",
    "error_from_wire": "actors._errors",
    "Endpoint": "actors._ref",
    "DEFAULT_ALLOW": "actors._registry",
    "BUILTIN_SCHEDULES": "actors._lr_scheduler",
    "actor_class": "actors._registry",
    "HEAD": "actors._nodes",
    "NODE": "actors._nodes",
    "HeadActor": "actors._nodes",
    "NodeActor": "actors._nodes",
    "batch_size": "actors.boundary",
    "split_batch": "actors.boundary",
    "CheckpointError": "actors.checkpoint",
    "Manifest": "actors.checkpoint",
    "check_directory": "actors.checkpoint",
    "layer_of": "actors.checkpoint",
    "merge_written": "actors.checkpoint",
    "ClusterKeys": "actors.keys",
    "KeyFileError": "actors.keys",
    "Cluster": "actors.cluster",
    "LocalCluster": "actors.cluster",
    "Coords": "actors.mesh",
    "Mesh": "actors.mesh",
    "backend_for": "actors.parallel",
    "Action": "actors.program",
    "ActionKind": "actors.program",
    "COMM_KINDS": "actors.program",
    "COMPUTE_KINDS": "actors.program",
    "TAIL_KINDS": "actors.program",
    "stage_to_rank": "actors.program",
    "transfer_partner": "actors.program",
    "FinishReport": "actors.records",
    "RecordError": "actors.records",
    "ReduceReport": "actors.records",
    "StageConfig": "actors.records",
    "StageReport": "actors.records",
    "WireRecord": "actors.records",
    "RendezvousActor": "actors.rendezvous",
    "StageActor": "actors.stage",
    "ShardSpec": "actors.tensor_parallel",
    "gather_tensor_parallel_state": "actors.tensor_parallel",
    "shard_state": "actors.tensor_parallel",
}
# Moved up a layer; resolved through the job plugin (see actors.plugins), with a warning.
_MOVED = {"Job": "Job", "StepStats": "StepStats"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None and name in _MOVED:
        import warnings

        from actors.plugins import job_api

        api = job_api()
        warnings.warn(f"actors.{name} moved to {api.__name__}.{name}; import it from there",
                      DeprecationWarning, stacklevel=2)
        return getattr(api, _MOVED[name])
    if module is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # explicit re-exports, for type checkers (the names resolve lazily above)
    from actors._actor import (
        Actor as Actor,
        Host as Host,
        LOCAL as LOCAL,
        current_caller as current_caller,
        endpoint as endpoint,
        may_call as may_call,
    )
    from actors._errors import (
        ActorError as ActorError,
        ActorStopped as ActorStopped,
        ActorTimeout as ActorTimeout,
        BadArguments as BadArguments,
        MailboxFull as MailboxFull,
        NonFiniteError as NonFiniteError,
        NotAllowed as NotAllowed,
        RemoteError as RemoteError,
        StepFailed as StepFailed,
        NodeLost as NodeLost,
        HeadLost as HeadLost,
        UnknownActor as UnknownActor,
        UnknownEndpoint as UnknownEndpoint,
        error_from_wire as error_from_wire,
    )
    from actors._nodes import (
        HEAD as HEAD,
        HeadActor as HeadActor,
        NODE as NODE,
        NodeActor as NodeActor,
    )
    from actors._ref import (
        ActorRef as ActorRef,
        Endpoint as Endpoint,
    )
    from actors._lr_scheduler import (
        BUILTIN_SCHEDULES as BUILTIN_SCHEDULES,
    )
    from actors._registry import (
        DEFAULT_ALLOW as DEFAULT_ALLOW,
        actor_class as actor_class,
        load_object as load_object,
        register_actor as register_actor,
    )
    from actors._runtime import (
        Runtime as Runtime,
        open_runtime as open_runtime,
    )
    from actors.boundary import (
        batch_size as batch_size,
        split_batch as split_batch,
    )
    from actors.checkpoint import (
        CheckpointError as CheckpointError,
        Manifest as Manifest,
        check_directory as check_directory,
        layer_of as layer_of,
        merge_written as merge_written,
    )
    from actors.cluster import (
        Cluster as Cluster,
        LocalCluster as LocalCluster,
    )
    from actors.keys import (
        ClusterKeys as ClusterKeys,
        KeyFileError as KeyFileError,
    )
    from actors.mesh import (
        Coords as Coords,
        Mesh as Mesh,
    )
    from actors.parallel import (
        backend_for as backend_for,
    )
    from actors.program import (
        Action as Action,
        ActionKind as ActionKind,
        COMM_KINDS as COMM_KINDS,
        COMPUTE_KINDS as COMPUTE_KINDS,
        TAIL_KINDS as TAIL_KINDS,
        stage_to_rank as stage_to_rank,
        transfer_partner as transfer_partner,
    )
    from actors.records import (
        FinishReport as FinishReport,
        RecordError as RecordError,
        StageConfig as StageConfig,
        ReduceReport as ReduceReport,
        StageReport as StageReport,
        WireRecord as WireRecord,
    )
    from actors.rendezvous import (
        RendezvousActor as RendezvousActor,
    )
    from actors.stage import (
        StageActor as StageActor,
    )
    from actors.tensor_parallel import (
        ShardSpec as ShardSpec,
        gather_tensor_parallel_state as gather_tensor_parallel_state,
        shard_state as shard_state,
    )
