"""Training monitors on the head: each step's scalars and each evaluation's loss, to TensorBoard, W&B and CSV.

A job's ``monitoring`` section (:class:`~stages.sections.Monitoring`) names the tools;
the head's job actor writes them, never a stage: :class:`Monitors` takes every
:class:`~schedulers.records.StepStats` a step returns (``job.step`` and the steps of a
background ``job.run``) and every :class:`~schedulers.records.EvalResult`. What is
written, as DeepSpeed's monitors write it but named for what actorpipe measures:

=====================================  =====================================================
``Train/loss``                         the step's loss
``Train/lr`` (``Train/lr/group_N``)    the learning rate (of parameter group N, N >= 1)
``Train/grad_norm``                    the global gradient norm, before clipping
``Train/loss_scale``                   fp16's loss scale
``Train/samples_per_s``                samples a second, when the batch size is known
``Train/step_time_s``                  the step's wall time
``Train/bubble_fraction``              the share of stage time spent idle
``Train/bytes/F_0_to_1``               bytes on the wire per edge and direction
``Train/rel_error/F_0_to_1``           the codec's relative error per edge and direction
``Train/peak_rss_bytes/rank_N``        each stage actor's peak resident memory (global rank N)
``Train/peak_stash_bytes/rank_N``      each stage actor's peak bytes held for backward
``Eval/loss``                          an evaluation's loss
``Eval/NAME``                          each of its ``eval_metrics``
=====================================  =====================================================

The step axis is the number of optimizer steps the job has applied, this one included
(DeepSpeed's ``global_steps``; a step skipped for a non-finite value counts, as an fp16
overflow counts in DeepSpeed): 1, 2, 3, ... An evaluation is written at the number of
steps applied before it, so it shares its x with the training loss of the step before it,
as DeepSpeed's ``eval_loss`` shares its samples axis. ``StepStats.step`` is not used: it
numbers attempts, and an evaluation or a failed step takes a number too.

Paths: a monitor's ``output_path`` is resolved as a checkpoint directory is
(:func:`schedulers.checkpoint_paths.resolve`): a client's stays in its own subtree of
the head's checkpoint root, which the head checks again, links resolved, before it
makes the directory. The writing happens on one thread of the job's own, in order, so
that the head's event loop never waits for a disk or for W&B. A monitor that fails
(its library missing, a full disk, a path that is a file) is reported once, as a log
warning and a :class:`~schedulers.events.MonitorFailed` event, and is off from then on;
training goes on. :meth:`Monitors.aclose` flushes and closes every writer when the job
closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import csv
import importlib.util
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from actors import Event, NotAllowed
from stages.monitor_configs import MonitorConfig, WandbConfig
from stages.sections import Monitoring
from stages.state.checkpoint import check_within
from schedulers.checkpoint_paths import resolve
from schedulers.events import MonitorFailed
from schedulers.records import EvalResult, StepStats

__all__ = [
    "CLOSE_TIMEOUT_S",
    "CsvWriter",
    "MetricWriter",
    "MonitorKind",
    "MonitorTarget",
    "Monitors",
    "TensorBoardWriter",
    "WandbWriter",
    "check_libraries",
    "csv_file_name",
    "evaluation_scalars",
    "open_writer",
    "resolve_monitors",
    "step_scalars",
]

log = logging.getLogger(__name__)

MonitorKind = Literal["tensorboard", "wandb", "csv_monitor"]
CLOSE_TIMEOUT_S = 60.0  # how long closing a job waits for its monitors to flush (W&B's finish takes seconds)
_LIBRARIES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}
_EXTRA = "pip install 'actorpipe[monitor]'"


# -- what is written ------------------------------------------------------------------------


def _label(name: str) -> str:
    """An edge (``F 0->1``) or other name as one tag component every tool takes (``F_0_to_1``)."""
    return re.sub(r"[^\w.-]+", "_", name.replace("->", " to ")).strip("_") or "_"


def step_scalars(stats: StepStats) -> dict[str, float]:
    """The scalars one step writes, by tag (see the module's table); a figure the step did not measure is left out."""
    scalars: dict[str, float] = {"Train/loss": stats.loss}
    if stats.lr:
        scalars["Train/lr"] = stats.lr[0]
        for group, rate in enumerate(stats.lr[1:], start=1):
            scalars[f"Train/lr/group_{group}"] = rate
    for name in ("grad_norm", "loss_scale", "samples_per_s"):
        value = getattr(stats, name)
        if value is not None:
            scalars[f"Train/{name}"] = value
    scalars["Train/step_time_s"] = stats.step_time_s
    scalars["Train/bubble_fraction"] = stats.bubble_fraction
    for edge, sent in sorted(stats.bytes_per_edge.items()):
        scalars[f"Train/bytes/{_label(edge)}"] = sent
    for edge, codec in sorted(stats.codec_stats.items()):
        error = codec.get("rel_error")
        if codec.get("codec") == "none":  # a lossless edge has no codec error to chart
            continue
        if isinstance(error, (int, float)) and not isinstance(error, bool):
            scalars[f"Train/rel_error/{_label(edge)}"] = error
    for name in ("peak_rss_bytes", "peak_stash_bytes"):
        for rank, value in enumerate(getattr(stats, name)):
            scalars[f"Train/{name}/rank_{rank}"] = value
    return {tag: float(value) for tag, value in scalars.items()}


def evaluation_scalars(result: EvalResult) -> dict[str, float]:
    """The scalars one evaluation writes: each of the job's ``eval_metrics``, and its loss (a metric the
    job's function names ``loss`` does not take its place, as in Hugging Face's Trainer)."""
    scalars = {f"Eval/{name}": float(value) for name, value in result.metrics.items()}
    scalars["Eval/loss"] = float(result.loss)
    return scalars


def csv_file_name(tag: str) -> str:
    """The CSV file a tag goes to, as DeepSpeed's csv_monitor names it: ``Train/loss`` -> ``Train_loss.csv``."""
    return re.sub(r"[^\w.-]", "_", tag) + ".csv"


# -- the writers ------------------------------------------------------------------------------


class MetricWriter(Protocol):
    """One tool's writer: called on the job's monitor thread only, one call at a time."""

    def write(self, scalars: Mapping[str, float], step: int) -> None:
        """Writes ``scalars`` (tag -> value) at ``step``, flushed when it returns."""

    def close(self) -> None:
        """Flushes and closes; nothing is written after."""


class TensorBoardWriter:
    """TensorBoard event files in ``directory``, by torch's ``SummaryWriter`` (needs ``tensorboard``)."""

    def __init__(self, directory: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when a job asks for it

        self._writer = SummaryWriter(log_dir=directory)

    def write(self, scalars: Mapping[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class CsvWriter:
    """One CSV file per tag in ``directory`` (``csv_file_name``): a ``step,NAME`` header, then a row per write.

    NAME is the tag's last component, as DeepSpeed's csv_monitor heads its files. A file
    that is there already (the same job name again) is appended to, without a second header.
    """

    def __init__(self, directory: str) -> None:
        self._directory = directory

    def write(self, scalars: Mapping[str, float], step: int) -> None:
        for tag, value in scalars.items():
            path = os.path.join(self._directory, csv_file_name(tag))
            # O_NOFOLLOW: a link planted in the directory cannot send a row elsewhere
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "a", newline="") as f:
                out = csv.writer(f)
                if os.fstat(fd).st_size == 0:
                    out.writerow(["step", tag.rpartition("/")[2]])
                out.writerow([step, value])

    def close(self) -> None:
        pass  # every write closed its files


class WandbWriter:
    """A Weights & Biases run, offline, under ``directory/wandb/`` (needs ``wandb``); ``wandb sync`` uploads it."""

    def __init__(self, directory: str, config: WandbConfig, name: str) -> None:
        import wandb  # only when a job asks for it

        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, disable_git=True, save_code=False)
        # mode="offline": no account and no network; reinit="create_new": each job its own run in one head
        self._run = wandb.init(mode="offline", dir=directory, project=config.project, group=config.group,
                               entity=config.team, name=name, reinit="create_new", settings=settings)

    def write(self, scalars: Mapping[str, float], step: int) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


# -- where they write ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitorTarget:
    """One monitor of a job, its output path resolved for the client that created the job."""

    kind: MonitorKind
    config: MonitorConfig
    output_path: str
    """absolute and normalized: the resolved ``output_path``"""
    within: str | None
    """the client's subtree of the checkpoint root, which nothing written may leave (links resolved); None: the admin's"""

    def directory(self, job: str) -> str:
        """Where the writer writes: ``output_path/job_name`` (the job's id without one); W&B's ``dir`` is ``output_path``."""
        if isinstance(self.config, WandbConfig):
            return self.output_path
        return os.path.join(self.output_path, self.config.job_name or job)


def _configured(monitoring: Monitoring) -> list[tuple[MonitorKind, MonitorConfig]]:
    kinds: tuple[MonitorKind, ...] = ("tensorboard", "wandb", "csv_monitor")
    return [(kind, config) for kind in kinds if (config := getattr(monitoring, kind)) is not None]


def check_libraries(monitoring: Monitoring) -> None:
    """Refuses a monitor whose library this process (the head) cannot import, before any work for the job.

    Raises:
        ValueError: names the monitor, the package and the extra that installs it.
    """
    for kind, _ in _configured(monitoring):
        package = _LIBRARIES.get(kind)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ValueError(f"monitoring.{kind} needs the {package} package where the head runs, and it is not "
                             f"installed there: {_EXTRA} (or pip install {package}), or leave monitoring.{kind} out")


def resolve_monitors(monitoring: Monitoring, *, caller: str, root: str, relative_to: str | None) -> list[MonitorTarget]:
    """Each configured monitor with its ``output_path`` resolved as a checkpoint directory is, for ``caller``.

    Raises:
        NotAllowed: a client's path outside its own subtree of the checkpoint root.
        ValueError: a path that cannot be resolved (an admin's relative path without ``relative_to``).
    """
    targets: list[MonitorTarget] = []
    for kind, config in _configured(monitoring):
        key = f"monitoring.{kind}.output_path"
        try:
            path = resolve(config.output_path or ".", relative_to, caller=caller, root=root)
        except NotAllowed as exc:
            raise NotAllowed(f"{key}: {exc.message}") from None
        except ValueError as exc:  # CheckpointError: not a usable path
            raise ValueError(f"{key}: {exc}") from None
        targets.append(MonitorTarget(kind=kind, config=config, output_path=path.directory, within=path.within))
    return targets


def _make_directory(directory: str, within: str | None) -> None:
    """Makes ``directory``, which must stay inside ``within`` (links resolved), before and after.

    Raises:
        CheckpointError: it leaves ``within``.
        OSError: it cannot be made (e.g. a file is in the way).
    """
    if within is not None:
        check_within(directory, within)
    os.makedirs(directory, exist_ok=True)
    if within is not None:
        check_within(directory, within)


def open_writer(target: MonitorTarget, job: str) -> MetricWriter:
    """The writer of ``target`` for job ``job``, its directory made.

    Raises:
        ImportError: the tool's library is missing (the message names the extra).
        OSError, CheckpointError: the directory cannot be made, or leaves the client's subtree.
    """
    directory = target.directory(job)
    _make_directory(directory, target.within)
    if target.kind == "csv_monitor":
        return CsvWriter(directory)
    try:
        if target.kind == "wandb":
            assert isinstance(target.config, WandbConfig)
            return WandbWriter(directory, target.config, job)
        return TensorBoardWriter(directory)
    except ImportError as exc:
        raise ImportError(f"{exc}; {_EXTRA} where the head runs") from exc


# -- one job's monitors ---------------------------------------------------------------------------


class Monitors:
    """One job's monitors: written on a thread of their own, in order; a failing one is reported once and dropped.

    Made on the head's event loop (the job's controller holds it). :meth:`record_step` and
    :meth:`record_evaluation` return at once; :meth:`aclose` waits for everything queued.

    Args:
        targets: the job's monitors (:func:`resolve_monitors`).
        job: the job's id: the default ``job_name`` and the W&B run's name.
        publish: the job's event channel; a failure is published as :class:`MonitorFailed`.
        opener: makes a target's writer (:func:`open_writer`; tests pass their own).
    """

    def __init__(self, targets: Sequence[MonitorTarget], *, job: str, publish: Callable[[Event], None],
                 opener: Callable[[MonitorTarget, str], MetricWriter] = open_writer) -> None:
        self.job = job
        self.failures: dict[str, str] = {}
        """each monitor that failed -> why (on the loop, as it is reported)"""
        self._publish = publish
        self._opener = opener
        self._loop = asyncio.get_running_loop()
        self._writers: dict[str, MetricWriter] = {}  # the monitor thread's alone
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{job}-monitors")
        self._closed = False
        for target in targets:
            self._executor.submit(self._open, target)

    def record_step(self, stats: StepStats, step: int) -> None:
        """Queues the step's scalars (:func:`step_scalars`) at ``step``: the steps applied, this one included."""
        if not self._closed:
            self._executor.submit(self._write, step_scalars(stats), step)

    def record_evaluation(self, result: EvalResult, step: int) -> None:
        """Queues an evaluation's loss at ``step``: the steps applied before it."""
        if not self._closed:
            self._executor.submit(self._write, evaluation_scalars(result), step)

    async def aclose(self) -> None:
        """Writes what is queued, then flushes and closes every writer (at most :data:`CLOSE_TIMEOUT_S`); twice is fine."""
        if self._closed:
            return
        self._closed = True
        done = self._executor.submit(self._close_all)
        self._executor.shutdown(wait=False)
        try:
            await asyncio.wait_for(asyncio.wrap_future(done), CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.warning("%s: the monitors did not close within %.0f s; what they hold may be lost",
                        self.job, CLOSE_TIMEOUT_S)

    # -- on the monitor thread --------------------------------------------------------------------

    def _open(self, target: MonitorTarget) -> None:
        try:
            self._writers[target.kind] = self._opener(target, self.job)
        except Exception as exc:  # noqa: BLE001 - any failure turns the monitor off, never the job
            self._failed(target.kind, exc, "could not start")

    def _write(self, scalars: Mapping[str, float], step: int) -> None:
        for kind, writer in list(self._writers.items()):
            try:
                writer.write(scalars, step)
            except Exception as exc:  # noqa: BLE001
                del self._writers[kind]
                self._close_quietly(kind, writer)
                self._failed(kind, exc, f"failed writing step {step}")

    def _close_all(self) -> None:
        for kind, writer in list(self._writers.items()):
            del self._writers[kind]
            try:
                writer.close()
            except Exception as exc:  # noqa: BLE001
                self._failed(kind, exc, "failed closing")

    def _close_quietly(self, kind: str, writer: MetricWriter) -> None:
        try:
            writer.close()
        except Exception as exc:  # noqa: BLE001 - it failed already; this is only what it still held
            log.debug("%s: monitor %s did not close after failing: %s", self.job, kind, exc)

    def _failed(self, kind: str, exc: BaseException, what: str) -> None:
        error = f"{what}: {type(exc).__name__}: {str(exc)[:300]}"
        log.warning("%s: monitor %s is off (%s); training goes on", self.job, kind, error)
        try:
            self._loop.call_soon_threadsafe(self._report, kind, error)
        except RuntimeError:  # the loop is closed: the log line is all there is
            pass

    # -- on the loop ------------------------------------------------------------------------------

    def _report(self, kind: str, error: str) -> None:
        if kind in self.failures:
            return
        self.failures[kind] = error
        self._publish(MonitorFailed(job=self.job, monitor=kind, error=error))
