"""The actor runtime: actors, refs, request/reply, supervision, nodes and clusters.

Generic and torch-free: nothing here knows about models or training. The stage actor
and all it does live in :mod:`stages`; the scheduler and the job API in
:mod:`schedulers`. Public names are re-exported here from private modules, lazily
(PEP 562), so that a leaf imports without pulling in ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from actors._lazy import lazy_exports as lazy_exports

_EXPORTS = {
    "lazy_exports": "actors._lazy",
    "Actor": "actors._actor",
    "current_caller": "actors._actor",
    "endpoint": "actors._actor",
    "Host": "actors._actor",
    "LOCAL": "actors._actor",
    "may_call": "actors._actor",
    "may_see": "actors._actor",
    "sees_all": "actors._actor",
    "ActorError": "actors._errors",
    "ActorLost": "actors._errors",
    "ActorStopped": "actors._errors",
    "ActorTimeout": "actors._errors",
    "BadArguments": "actors._errors",
    "BadRecord": "actors._errors",
    "error_from_wire": "actors._errors",
    "names_type": "actors._errors",
    "HeadLost": "actors._errors",
    "MessageLost": "actors._errors",
    "HeadUnreachable": "actors._reach",
    "SecurityMismatch": "actors._reach",
    "LimitExceeded": "actors._errors",
    "MailboxFull": "actors._errors",
    "NodeLost": "actors._errors",
    "NonFiniteError": "actors._errors",
    "NotAllowed": "actors._errors",
    "RemoteError": "actors._errors",
    "StageLost": "actors._errors",
    "StepFailed": "actors._errors",
    "TooManySubscribers": "actors._errors",
    "UnknownActor": "actors._errors",
    "UnknownEndpoint": "actors._errors",
    "UserCodeExit": "actors._errors",
    "contained": "actors._errors",
    "EventSink": "actors._subscribers",
    "HEAD": "actors._nodes",
    "HeadActor": "actors._nodes",
    "NODE": "actors._nodes",
    "NodeActor": "actors._nodes",
    "NodeDescription": "actors._nodes",
    "NodeInfo": "actors._nodes",
    "Event": "actors.events",
    "NodeJoined": "actors.events",
    "NodeLeft": "actors.events",
    "NodeSilent": "actors.events",
    "ActorRef": "actors._ref",
    "Endpoint": "actors._ref",
    "actor_class": "actors._registry",
    "DEFAULT_ALLOW": "actors._registry",
    "EXAMPLE_FACTORIES": "actors._registry",
    "load_object": "actors._registry",
    "register_actor": "actors._registry",
    "Subscribers": "actors._subscribers",
    "open_runtime": "actors._runtime",
    "Runtime": "actors._runtime",
    "Cluster": "actors.cluster",
    "LocalCluster": "actors.cluster",
    "ClusterKeys": "actors.keys",
    "KeyFileError": "actors.keys",
    "RecordError": "actors.records",
    "WireRecord": "actors.records",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # explicit re-exports, for type checkers (the names resolve lazily above)
    from actors._actor import (
        Actor as Actor,
        current_caller as current_caller,
        endpoint as endpoint,
        Host as Host,
        LOCAL as LOCAL,
        may_call as may_call,
        may_see as may_see,
        sees_all as sees_all,
    )
    from actors._errors import (
        ActorError as ActorError,
        ActorLost as ActorLost,
        ActorStopped as ActorStopped,
        ActorTimeout as ActorTimeout,
        BadArguments as BadArguments,
        BadRecord as BadRecord,
        error_from_wire as error_from_wire,
        names_type as names_type,
        HeadLost as HeadLost,
        MessageLost as MessageLost,
        LimitExceeded as LimitExceeded,
        MailboxFull as MailboxFull,
        NodeLost as NodeLost,
        NonFiniteError as NonFiniteError,
        NotAllowed as NotAllowed,
        RemoteError as RemoteError,
        StageLost as StageLost,
        StepFailed as StepFailed,
        TooManySubscribers as TooManySubscribers,
        UnknownActor as UnknownActor,
        UnknownEndpoint as UnknownEndpoint,
        UserCodeExit as UserCodeExit,
        contained as contained,
    )
    from actors._reach import HeadUnreachable as HeadUnreachable, SecurityMismatch as SecurityMismatch
    from actors._nodes import (
        HEAD as HEAD,
        HeadActor as HeadActor,
        NODE as NODE,
        NodeActor as NodeActor,
        NodeDescription as NodeDescription,
        NodeInfo as NodeInfo,
    )
    from actors.events import (
        Event as Event,
        NodeJoined as NodeJoined,
        NodeLeft as NodeLeft,
        NodeSilent as NodeSilent,
    )
    from actors._ref import (
        ActorRef as ActorRef,
        Endpoint as Endpoint,
    )
    from actors._registry import (
        actor_class as actor_class,
        DEFAULT_ALLOW as DEFAULT_ALLOW,
        EXAMPLE_FACTORIES as EXAMPLE_FACTORIES,
        load_object as load_object,
        register_actor as register_actor,
    )
    from actors._subscribers import (
        EventSink as EventSink,
        Subscribers as Subscribers,
    )
    from actors._runtime import (
        open_runtime as open_runtime,
        Runtime as Runtime,
    )
    from actors.cluster import (
        Cluster as Cluster,
        LocalCluster as LocalCluster,
    )
    from actors.keys import (
        ClusterKeys as ClusterKeys,
        KeyFileError as KeyFileError,
    )
    from actors.records import (
        RecordError as RecordError,
        WireRecord as WireRecord,
    )
