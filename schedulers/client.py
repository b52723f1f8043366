"""The driver's job API: ``cluster.train(...)`` and the :class:`Job` handle it returns.

Example::

    from schedulers import JobSpec, LocalCluster

    async with LocalCluster(nodes=2) as cluster:
        job = await cluster.train(model="examples.models:residual_mlp", pipeline_stages=2, micro_batches=4)
        # or sections: cluster.train(JobSpec(training=Training(model=...), parallelism=Parallelism(...)))
        stats = await job.step(inputs, targets)
        await job.close()

This module is the one client of the scheduler actor and of the job actors it spawns:
the console, the examples and the benchmarks all go through :class:`Job`. Every call
is typed against the actor's endpoint (``ref.endpoint(JobActor.step)``) and every
answer comes back as a record of :mod:`schedulers.records`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import secrets
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

import actors
from actors import ActorError, ActorRef, ActorTimeout, Endpoint, UnknownActor
from stages import CheckpointError
from stages.state.export import FORMATS as EXPORT_FORMATS
from schedulers.jobs import SECTIONS, JobSpec
from schedulers.placement import PlacementWarning
from schedulers.records import EvalResult, JobDescription, JobInfo, Plan, RunInfo, SettingChange, StepStats, WhereReport
from schedulers.job_actor import JobActor
from schedulers.scheduler import SchedulerActor

__all__ = ["SCHEDULER", "CheckpointError", "Cluster", "Job", "LocalCluster"]

SCHEDULER = "scheduler"  # the scheduler actor's name in the head's runtime

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class Cluster(actors.Cluster):
    """A driver's connection to a head node, with the job API (``train``, ``jobs``, ``job``)."""

    @property
    def scheduler(self) -> ActorRef:
        """The scheduler actor on the head."""
        return self.runtime.ref(self.head.address, SCHEDULER)

    def call(
        self, method: Callable[Concatenate[SchedulerActor, P], Awaitable[R]], *, timeout: float | None = 60.0
    ) -> Endpoint[P, R]:
        """A typed handle on one of the scheduler's endpoints: ``await cluster.call(SchedulerActor.jobs).call()``.

        Raises:
            HeadLost: the head is known to be gone.
            ActorStopped: this connection was closed.
        """
        self.check_head()
        return self.scheduler.endpoint(method, timeout=timeout)

    async def train(self, spec: JobSpec | None = None, /, **kwargs: Any) -> Job:
        """Starts a training job; returns its handle.

        Takes a :class:`~schedulers.jobs.JobSpec`, or keyword arguments: its fields by
        their flat names (``micro_batches=8``), its sections (``parallelism=Parallelism(...)``
        or a dict), or both (see docs/jobspec.md's table, generated from the spec's fields).
        A factory is an import path or the function or class itself. Every argument is
        checked here, before anything is sent.

        Raises:
            TypeError: an unknown argument (with the nearest known one) or one of the wrong type.
            ValueError: a value out of range, or one that does not fit the others.
            RemoteError: the scheduler refused the job (e.g. too few nodes, or ranks of an
                NCCL job that would share a GPU), with why; one that was a ``ValueError`` or
                ``TypeError`` there is one here too (``except ValueError`` catches it).
            NotAllowed: a factory outside the nodes' allow-list, or a client's ``checkpoint_dir`` (or
                monitor ``output_path``) outside its subtree of the checkpoint root.
            CheckpointError: with ``resume_from_checkpoint``, a checkpoint in ``checkpoint_dir`` that does
                not load (every problem listed); no job is left.

        Warns:
            PlacementWarning: stage actors share a GPU because every GPU is taken, or
                the job mixes CPU and GPU nodes; ``Job.notices`` keeps the messages.
        """
        if spec is None:
            spec = JobSpec.from_kwargs(kwargs)
        elif kwargs:
            raise TypeError(f"train() takes a JobSpec or keyword arguments, not both (got {', '.join(kwargs)})")
        elif not isinstance(spec, JobSpec):
            raise TypeError(f"train() takes a JobSpec, got {type(spec).__name__}")
        else:
            spec.check_schedule()  # here, at the call, as from_kwargs does
        await self.admit(spec.factory_modules)
        # the working directory: where the head takes an admin's relative monitor output_path and
        # checkpoint_dir from
        relative_to = os.getcwd() if spec.monitoring.enabled or spec.checkpointing.checkpoint_dir is not None else None
        ticket = secrets.token_hex(16)  # what abandon_job names this creation by (schedulers.creations)
        try:
            # A job that resumes loads its checkpoint as it is made: each stage's share has 900 s on the head.
            timeout = 1500 if spec.checkpointing.resume_from_checkpoint else 600
            with _checkpoint_errors():
                info = await self.call(SchedulerActor.create_job, timeout=timeout).call(spec, relative_to, ticket)
        except (asyncio.CancelledError, ActorTimeout):
            # The caller gave up on the job (Ctrl-C, wait_for, the timeout): no one would hold it, so it ends.
            self.last_word(self._abandon(ticket), name="abandon a job's creation")
            raise
        for notice in info.notices:
            warnings.warn(f"{info.job}: {notice}", PlacementWarning, stacklevel=2)
        return Job(self, info, spec)

    async def _abandon(self, ticket: str) -> None:
        try:
            await self.call(SchedulerActor.abandon_job, timeout=60).call(ticket)
        except ActorError as exc:
            log.info("could not abandon a job's creation: %s", exc)

    async def jobs(self) -> list[JobDescription]:
        """Every job on the cluster."""
        return await self.call(SchedulerActor.jobs).call()

    async def subscribe(self, sink: ActorRef) -> None:
        """Sends the head's node events and the scheduler's job events (:mod:`schedulers.events`) to
        ``sink``, an :class:`~actors.EventSink` in this connection's runtime: the events of every job
        this key may see (a client's own jobs; every job for the admin key).

        Raises:
            ValueError: ``sink`` lives in another runtime.
            TooManySubscribers: this key holds as many subscriptions as the head or scheduler takes.
        """
        await super().subscribe(sink)
        try:
            await self.call(SchedulerActor.subscribe, timeout=10).call(sink.name)
        except BaseException:
            with contextlib.suppress(ActorError):
                await super().unsubscribe(sink)
            raise

    async def unsubscribe(self, sink: ActorRef) -> None:
        """Stops the events :meth:`subscribe` started."""
        await super().unsubscribe(sink)
        await self.call(SchedulerActor.unsubscribe, timeout=2).call(sink.name)

    async def job(self, job_id: str) -> Job:
        """A handle on a job that is already running (e.g. one the console did not start).

        Raises:
            RemoteError: no such job (the message lists the running ones).
            NotAllowed: another client's job.
        """
        info = await self.call(SchedulerActor.job).call(job_id)
        description = await self.runtime.ref(*info.actor).endpoint(JobActor.describe, timeout=60).call()
        return Job(self, info, description.spec)


def _as_sent(directory: str | os.PathLike[str]) -> tuple[str, str | None]:
    """A checkpoint path as the head takes it: an absolute one normalized, a relative one as it is with
    this driver's working directory beside it (the head takes a client's under its own subtree instead)."""
    path = os.fspath(directory)
    return (os.path.abspath(path), None) if os.path.isabs(path) else (path, os.getcwd())


@contextlib.contextmanager
def _checkpoint_errors() -> Iterator[None]:
    """A checkpoint problem raised on the head or a stage arrives as :class:`CheckpointError` here."""
    try:
        yield
    except ActorError as exc:
        if not exc.raised(CheckpointError):
            raise
        raise CheckpointError.from_message(exc.message) from exc


def _train_signature() -> inspect.Signature:
    """``train(spec=None, /, *, model, ..., training=None, ...)``: what ``help(cluster.train)`` shows.

    Every field by its flat name, then every section; derived from the spec.
    """
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
                  inspect.Parameter("spec", inspect.Parameter.POSITIONAL_ONLY, default=None,
                                    annotation="JobSpec | None")]
    for section in SECTIONS.values():
        for name, param in inspect.signature(section).parameters.items():
            parameters.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY,
                                            default=None if name == "model" else param.default))
    for name, section in SECTIONS.items():
        parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                            annotation=f"{section.__name__} | dict[str, Any] | None"))
    return inspect.Signature(parameters, return_annotation="Job")


Cluster.train.__signature__ = _train_signature()  # type: ignore[attr-defined]


class LocalCluster(actors.LocalCluster):
    """A head and ``nodes`` workers on this machine (see :class:`actors.LocalCluster`), with the job API."""

    cluster_class = Cluster

    async def __aenter__(self) -> Cluster:
        cluster = await super().__aenter__()
        assert isinstance(cluster, Cluster)
        return cluster


class _JobEndpoint(Endpoint[P, R]):
    """An endpoint of a job's actor: a call to a job that is gone says so by the job's name."""

    __slots__ = ("job",)

    def __init__(self, ref: ActorRef, method: str, timeout: float | None, job: str) -> None:
        super().__init__(ref, method, timeout)
        self.job = job

    async def call(self, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await super().call(*args, **kwargs)
        except UnknownActor:
            raise UnknownActor(f"job {self.job!r} is closed: its actor is no longer on the head (this client "
                               f"or another closed it, or the head was restarted)") from None


class Job:
    """A job running on a cluster: every method is a call to the job's actor on the head
    (:class:`~schedulers.job_actor.JobActor`).

    Attributes:
        id: the job's name on the cluster (``job0``).
        bounds: each model stage's ``[first, end)`` layers.
        nodes: each stage actor's node, by global rank.
        spec: the job's specification as it was started.
        notices: what the scheduler warned about its placement (see :class:`~schedulers.records.JobInfo`).
        creation_s: seconds per phase of the job's creation on the head (``JobInfo.creation_s``).
        resumed_from: the checkpoint version the job loaded as it started
            (``checkpointing.resume_from_checkpoint``), or None: it started from its seed.
        resumed_step: the step that checkpoint was saved at (0 without one).
        ref: the job's actor on the head.
    """

    def __init__(self, cluster: Cluster, info: JobInfo, spec: JobSpec) -> None:
        self.cluster = cluster
        self.id = info.job
        self.bounds = info.bounds
        self.nodes = info.nodes
        self.spec = spec
        self.notices = list(info.notices)
        self.creation_s = dict(info.creation_s)  # where the job's creation went on the head, per phase
        self.resumed_from, self.resumed_step = info.resumed_from, info.resumed_step
        address, name = info.actor
        self.ref = cluster.runtime.ref(address, name)

    def _call(
        self, method: Callable[Concatenate[JobActor, P], Awaitable[R]], timeout: float | None = 60.0
    ) -> Endpoint[P, R]:
        """A typed handle on one of the job actor's endpoints.

        Raises:
            HeadLost: the head is known to be gone.
            ActorStopped: this connection to the cluster was closed.
        """
        self.cluster.check_head()
        endpoint = self.ref.endpoint(method, timeout=timeout)
        return _JobEndpoint(endpoint.ref, endpoint.method, endpoint.timeout, self.id)

    # -- training --------------------------------------------------------------------

    async def step(self, inputs: Any = None, targets: Any = None) -> StepStats:
        """One optimizer step on a global batch, split into the job's micro-batches.

        ``inputs`` is a tensor, a tuple of tensors (the model's positional arguments) or a
        dict of them (its keyword arguments); every tensor has the samples along its first
        dim. ``targets`` likewise, as the loss function takes them. Without arguments the
        stages read the batch from the job's data factory.

        Raises:
            StepFailed: a stage failed, a node was lost or the step timed out; the
                step was not applied anywhere.
            RemoteError: a batch that does not split into the job's micro-batches.
            CheckpointError: the save ``checkpointing.checkpoint_every`` makes after this step
                failed (the step was applied).
        """
        if (inputs is None) != (targets is None):
            raise ValueError("step() takes both inputs and targets, or neither (to read the data factory)")
        # A step after which the job saves itself waits for the save too (each stage's share is bounded on the head).
        timeout = None if self.spec.checkpointing.checkpoint_every else self.spec.fault_tolerance.step_timeout_s + 60.0
        try:
            with _checkpoint_errors():
                return await self._call(JobActor.step, timeout).call(inputs, targets)
        except asyncio.CancelledError:
            # The driver gave up on the step: the scheduler and every stage stop it too.
            self.cluster.last_word(self._cancel_step(), name=f"cancel {self.id} step")
            raise

    async def evaluate(self, inputs: Any = None, targets: Any = None, *, outputs: bool = False,
                       data_step: int | None = None) -> EvalResult:
        """The model's loss on a batch, forward only (DeepSpeed's ``eval_batch``, torch's ``schedule.eval``).

        The batch splits as :meth:`step` splits it, over the job's micro-batches and replicas,
        and runs through every stage under ``torch.no_grad`` with the modules in eval mode
        (dropout off); nothing is stashed, no gradient or optimizer state changes, and the data
        position stays, so it fits between any two steps. Without a batch: the job's validation
        data where it has one (``evaluation.eval_data``, its ``eval_batches`` batches, the loss
        over them all), else the data factory's next batch (the one the next step still trains
        on); with ``data_step``, the data factory's batch ``data_step``.

        Args:
            outputs: also return the last stage's outputs for the whole batch (on the CPU).

        Raises:
            StepFailed: a stage failed, a node was lost or it timed out; nothing changed.
            RemoteError: a batch that does not split into the job's micro-batches.
        """
        if (inputs is None) != (targets is None):
            raise ValueError("evaluate() takes both inputs and targets, or neither (to read the data factory)")
        timeout = self.spec.fault_tolerance.step_timeout_s + 60.0
        try:
            return await self._call(JobActor.evaluate, timeout).call(inputs, targets, outputs, data_step)
        except asyncio.CancelledError:  # as for a step: the scheduler and every stage stop it too
            self.cluster.last_word(self._cancel_step(), name=f"cancel {self.id} evaluation")
            raise

    async def _cancel_step(self) -> None:
        try:
            await self._call(JobActor.cancel_step, 5.0).call()
        except ActorError as exc:
            log.info("could not cancel %s's step or evaluation: %s", self.id, exc)

    async def run(self, num_steps: int) -> RunInfo:
        """Starts ``num_steps`` steps from the job's data factory in the background (see :meth:`describe`)."""
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"run() needs a number of steps >= 1, got {num_steps!r:.40}")
        return await self._call(JobActor.run).call(num_steps)

    async def wait(self) -> RunInfo | None:
        """Waits for the run going on (:meth:`run`) to end, however it ends (done, stopped, failed, or
        the job closed), and returns its :class:`RunInfo`; the last run's at once if none is going on,
        None if the job never ran. ``info.error`` says why a run failed; ``info.done`` how far it got."""
        return await self._call(JobActor.wait, timeout=None).call()

    async def pause(self) -> JobDescription:
        """Holds the run at the next accumulation barrier (the step in progress finishes)."""
        return await self._call(JobActor.pause).call()

    async def resume(self) -> JobDescription:
        """Lets a paused run go on."""
        return await self._call(JobActor.resume).call()

    async def stop(self) -> JobDescription:
        """Ends the run after the steps in flight (the job stays; :meth:`close` ends it)."""
        return await self._call(JobActor.stop).call()

    async def set(self, key: str, value: Any) -> SettingChange:
        """Changes a setting of the running job from the next barrier on.

        ``key`` is one of ``micro_batches``, ``schedule``, ``activation_codec``,
        ``gradient_codec`` and ``lr`` (not for a job whose rate follows its ``lr_scheduler``).
        Weights and optimizer state are kept. ``schedule="auto"`` measures the stages again
        on the next two steps and then runs the schedule it plans (see :meth:`plan`), as
        does any change to a job with ``schedule="auto"``.

        Raises:
            RemoteError: the key cannot change or the value does not fit (nothing changes).
        """
        return await self._call(JobActor.set).call(key, value)

    # -- looking at it -----------------------------------------------------------------

    async def describe(self) -> JobDescription:
        """Spec, layout, programs, run progress and the last step's statistics."""
        return await self._call(JobActor.describe).call()

    async def plan(self) -> Plan:
        """The candidate schedules with their predicted step time and stash, the chosen one marked.

        With ``schedule="auto"``, the plan the job runs (``state="measuring"`` until its
        timed probe step is done), and the last step's measured time against the
        prediction. With a fixed schedule, the candidates predicted from the last step,
        marking the one auto would run (``state="advice"``).
        """
        return await self._call(JobActor.plan).call()

    async def where(self) -> WhereReport:
        """Where each stage is in its program now, naming any send or receive that never matched."""
        return await self._call(JobActor.where).call()

    async def trace(self, path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """The last step's measured timeline as Chrome/Perfetto trace JSON (on the head's clock).

        Args:
            path: also write it there.
        """
        trace = await self._call(JobActor.trace).call()
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace

    # -- state -------------------------------------------------------------------------

    async def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state, with the unpartitioned model's keys, gathered in memory.

        Each stage's share travels as one message, so a stage holding more than the
        message limit (1 GiB by default) cannot send it: raise the limit
        (``LocalCluster(max_message_bytes=...)``, ``--max-message-bytes`` on every node,
        ``Cluster.connect(..., max_message_bytes=...)``) or use :meth:`save`, which
        sends no tensors at all.
        """
        return await self._call(JobActor.state_dict, 600).call()

    async def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads a whole-model state (as :meth:`state_dict` returns) into the stages, all or nothing.

        Raises:
            TypeError: ``state`` is not a map of names to tensors (checked here, before anything is sent).
            KeyError, ValueError: a key no stage holds, one a held layer needs that is missing, or a shape
                that is not the model's (nothing changed).
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"load_state_dict takes a map of names to tensors (a state_dict), not a "
                            f"{type(state).__name__}")
        wrong = next(((k, v) for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)),
                     None)
        if wrong is not None:
            raise TypeError(f"load_state_dict takes names (str) to tensors; {str(wrong[0])[:60]!r} is a "
                            f"{type(wrong[0]).__name__} to a {type(wrong[1]).__name__}")
        await self._call(JobActor.load_state_dict, 600).call({k: v.detach().cpu() for k, v in state.items()})

    async def save(self, directory: str | os.PathLike[str]) -> str:
        """Writes a checkpoint to ``directory``: weights, optimizer state, learning-rate schedule and step count.

        Every stage writes its own file straight into ``directory`` at once (nothing big
        passes through the head or this driver), each tensor with a crc32, everything
        fsynced; ``directory/LATEST`` then switches to the new version atomically, so a
        crash at any instant leaves the previous checkpoint or the new one, whole. Older
        versions go then: all of them, or in the job's ``checkpoint_dir`` all but the newest
        ``keep_checkpoints``.

        Where: a client key's checkpoints stay in its own subtree of the head's
        checkpoint root (``ROOT/alice`` for the key ``alice``; ``--checkpoint-root`` on
        the head): a relative ``directory`` is taken there, an absolute one must lie
        inside it. The admin key (a ``LocalCluster``'s driver) saves anywhere, a
        relative path from this driver's working directory. Every node writes there
        itself: on several machines it must be on a filesystem they all mount at the
        same path.

        Returns:
            The new version's directory (``.../directory/v000003``), as the nodes see it.

        Raises:
            NotAllowed: a client's ``directory`` outside its own subtree (the message names it).
            CheckpointError: ``directory`` holds something that is not a checkpoint, or a
                node cannot write there (named, with why).
        """
        with _checkpoint_errors():
            return await self._call(JobActor.save, None).call(*_as_sent(directory))

    async def export(self, directory: str | os.PathLike[str], *, format: str = "safetensors") -> str:
        """Writes the model's weights as a model directory that ``from_pretrained`` and
        ``load_state_dict(strict=True)`` load: safetensors files under the model's own names
        (one per pipeline stage, with Hugging Face's index), each tied tensor once, and the
        model's ``config.json`` when it has one (a traced transformers model).

        Every pipeline stage writes its own file (nothing passes through the head or this
        driver, and no process holds the whole model); ``directory`` must be new or empty,
        and is taken where :meth:`save` takes a checkpoint directory.

        Args:
            format: ``"safetensors"``, or ``"dcp"``: a ``torch.distributed.checkpoint``
                directory of the weights (``dcp.load`` reads it at any world size, and
                :meth:`load` loads one into any layout).

        Returns:
            The directory, as the nodes see it.

        Raises:
            NotAllowed: a client's ``directory`` outside its own subtree.
            CheckpointError: ``directory`` is not empty, or a node cannot write there.
            ValueError: another ``format``, before anything is sent.
        """
        format = _export_format(format)  # before anything is sent
        with _checkpoint_errors():
            return await self._call(JobActor.export, None).call(*_as_sent(directory), format)

    async def load(self, directory: str | os.PathLike[str], *, weights_only: bool = False) -> int:
        """Loads the checkpoint :meth:`save` wrote to ``directory``, all or nothing.

        Every stage first checks its part (every key, shape, dtype and checksum) and
        only when nothing is wrong anywhere does any stage apply it. The job's layout
        may differ from the one that saved (stage count, schedule, tensor- and
        data-parallel degree). Training then goes on exactly as it would have from the
        save: the optimizer state, the learning-rate schedule and the step count are
        restored too (the job must use the checkpoint's ``lr_scheduler`` class).

        Args:
            weights_only: take the parameters alone; the optimizer state, the schedule
                and the step count stay (e.g. to fine-tune with another optimizer).

        Returns:
            The step the checkpoint was saved at.

        Raises:
            NotAllowed: a client's ``directory`` outside its own subtree (as for :meth:`save`).
            CheckpointError: every problem found (missing or extra keys, wrong shapes or
                dtypes, checksum mismatches naming the file and key, not a checkpoint);
                the job's weights and optimizer are unchanged.
        """
        path, relative_to = _as_sent(directory)
        with _checkpoint_errors():
            return await self._call(JobActor.load, None).call(path, bool(weights_only), relative_to)

    async def close(self) -> None:
        """Stops the job's run, its stage actors and its actor; closing twice is fine."""
        try:
            await self._call(JobActor.close).call()
        except UnknownActor:  # closed already: its actor is gone
            pass

    async def __aenter__(self) -> Job:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _export_format(format: Any) -> str:
    """``Job.export``'s format, checked at the call, before anything is sent.

    Raises:
        ValueError: not one the stages write.
    """
    if not isinstance(format, str) or format not in EXPORT_FORMATS:
        raise ValueError(f"export writes {' or '.join(EXPORT_FORMATS)}, not {str(format)[:40]!r}")
    return format
