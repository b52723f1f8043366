"""Policy over the actor runtime: schedules as data, the scheduler actor, and the driver's job API.

The job API is re-exported here, lazily (PEP 562), so that pure modules such as
``schedulers.schedules`` import without torch or ZeroMQ::

    from schedulers import JobSpec, LocalCluster

    async with LocalCluster(nodes=2) as cluster:
        job = await cluster.train(model="examples.models:residual_mlp", pipeline_stages=2)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from actors import lazy_exports

_EXPORTS = {
    "Cluster": "schedulers.client",
    "Job": "schedulers.client",
    "LocalCluster": "schedulers.client",
    "JobSpec": "schedulers.jobs",
    "Training": "schedulers.jobs",
    "Parallelism": "schedulers.jobs",
    "Optimization": "schedulers.jobs",
    "MixedPrecision": "schedulers.jobs",
    "Communication": "schedulers.jobs",
    "Runtime": "schedulers.jobs",
    "FaultTolerance": "schedulers.jobs",
    "Monitoring": "schedulers.jobs",
    "TensorBoardConfig": "schedulers.jobs",
    "WandbConfig": "schedulers.jobs",
    "CSVConfig": "schedulers.jobs",
    "EvalResult": "schedulers.records",
    "JobDescription": "schedulers.records",
    "JobInfo": "schedulers.records",
    "Plan": "schedulers.records",
    "Candidate": "schedulers.records",
    "RunInfo": "schedulers.records",
    "Recovery": "schedulers.records",
    "SettingChange": "schedulers.records",
    "StepStats": "schedulers.records",
    "WhereReport": "schedulers.records",
    "PlacementWarning": "schedulers.placement",
    "ConfigError": "schedulers.deepspeed.config",
    "load_config": "schedulers.deepspeed.config",
    "TranslatedConfig": "schedulers.deepspeed.config",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # explicit re-exports, for type checkers (the names resolve lazily above)
    from schedulers.client import (
        Cluster as Cluster,
        Job as Job,
        LocalCluster as LocalCluster,
    )
    from schedulers.deepspeed.config import (
        ConfigError as ConfigError,
        TranslatedConfig as TranslatedConfig,
        load_config as load_config,
    )
    from schedulers.jobs import (
        CSVConfig as CSVConfig,
        Communication as Communication,
        FaultTolerance as FaultTolerance,
        JobSpec as JobSpec,
        MixedPrecision as MixedPrecision,
        Monitoring as Monitoring,
        Optimization as Optimization,
        Parallelism as Parallelism,
        Runtime as Runtime,
        TensorBoardConfig as TensorBoardConfig,
        Training as Training,
        WandbConfig as WandbConfig,
    )
    from schedulers.placement import (
        PlacementWarning as PlacementWarning,
    )
    from schedulers.records import (
        Candidate as Candidate,
        EvalResult as EvalResult,
        JobDescription as JobDescription,
        JobInfo as JobInfo,
        Plan as Plan,
        RunInfo as RunInfo,
        SettingChange as SettingChange,
        StepStats as StepStats,
        Recovery as Recovery,
        WhereReport as WhereReport,
    )
