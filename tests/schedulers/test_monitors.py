"""Training monitors (schedulers/monitors.py): what each step and evaluation writes, read back with each tool's reader.

The writers and :class:`Monitors` are tested in this process (no cluster): TensorBoard's
event files through TensorBoard's own ``EventAccumulator``, the CSV files with ``csv``,
a W&B offline run through its ``.wandb`` transaction log decoded with W&B's own
protobuf records. A few small jobs then check the head's job actor: every step of
``job.step`` and of a background ``job.run`` and every evaluation reach all three
tools, a DeepSpeedExamples-style config's ``tensorboard`` block writes where DeepSpeed
would, a client's monitors stay in its own subtree, and a failing monitor is reported
once while the job trains on.

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/schedulers/test_monitors.py
"""

from __future__ import annotations

import csv
import glob
import json
import os
import struct
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from actors import Cluster, Event, NotAllowed
from schedulers.deepspeed.config import load_config
from schedulers.events import JobClosed, MonitorFailed, RunFinished
from schedulers.jobs import CSVConfig, JobSpec, Monitoring, TensorBoardConfig, WandbConfig
from schedulers.monitors import (
    CsvWriter,
    MonitorTarget,
    Monitors,
    TensorBoardWriter,
    check_libraries,
    csv_file_name,
    evaluation_scalars,
    open_writer,
    resolve_monitors,
    step_scalars,
)
from schedulers.records import EvalResult, StepStats
from stages import CheckpointError
from tests.helpers.clients import TwoClients
from tests.helpers.events import feed, heard_until

pytestmark = pytest.mark.timeout(120)

DS_CONFIGS = Path(__file__).resolve().parent / "deepspeed" / "ds_configs"
MODEL = "examples.models:residual_mlp"
SMALL: dict[str, Any] = {"model": MODEL, "model_kwargs": {"blocks": 2, "dim": 8}, "pipeline_stages": 2,
                         "micro_batches": 2, "step_timeout_s": 120}


def stats(step: int, loss: float, **more: Any) -> StepStats:
    return StepStats(step=step, loss=loss, step_time_s=0.5, bubble_fraction=0.25, bytes_sent=30, **more)


def float32(value: float) -> float:
    """``value`` as TensorBoard keeps a scalar: a float32."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def tensorboard_scalars(directory: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in ``directory``'s event files, by tag: ``[(step, value), ...]``, read by TensorBoard itself."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def csv_rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def wandb_records(run_file: str) -> list[Any]:
    """The protobuf ``Record``s of a W&B offline run's ``.wandb`` file, as far as it is written.

    The file is W&B's transaction log (LevelDB's log format: 32 KiB blocks of records, each
    a 7-byte header ``crc32, length, type`` and a part of one protobuf ``Record``), read here
    with W&B's own protobuf classes: wandb has no offline reader in Python any more.
    """
    from wandb.proto import wandb_internal_pb2

    data = Path(run_file).read_bytes()
    if len(data) < 7:  # not even its header yet
        return []
    assert data[:4] == b":W&B", "not a W&B transaction log"
    block, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            position += left
            continue
        if position + 7 + length > len(data):  # a record its writer is still writing
            break
        part, position = data[position + 7:position + 7 + length], position + 7 + length
        pending = part if kind in (1, 2) else pending + part  # full, first | middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(run_file: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A finished W&B offline run's run record (project, group, entity, name) and its history rows.

    ``run.finish()`` returns once W&B's service has the run's exit, but that service (its own
    process) writes the file behind it: on a busy machine the file is still empty then. So
    this reads until the exit record is there (a deadline no busy machine reaches).
    """
    deadline = time.monotonic() + 120.0
    records = wandb_records(run_file)
    while not any(record.WhichOneof("record_type") == "exit" for record in records):
        assert time.monotonic() < deadline, f"W&B never wrote the run's exit record to {run_file}"
        time.sleep(0.05)
        records = wandb_records(run_file)
    run: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    for record in records:
        if record.WhichOneof("record_type") == "run":  # a later run record may update only some fields
            found = {"project": record.run.project, "group": record.run.run_group, "entity": record.run.entity,
                     "name": record.run.display_name}
            run.update({key: value for key, value in found.items() if value})
        elif record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return run, history


def target(kind: str, config: Any, path: Path, within: Path | None = None) -> MonitorTarget:
    return MonitorTarget(kind=kind, config=config, output_path=str(path),  # type: ignore[arg-type]
                         within=str(within) if within is not None else None)


# -- what is written -------------------------------------------------------------------------------


def test_a_step_writes_the_scalars_people_chart_by_name() -> None:
    step = stats(3, 2.5, lr=[0.1, 0.01], grad_norm=1.5, loss_scale=1024.0, samples=8, samples_per_s=16.0,
                 bytes_per_edge={"F 0->1": 10, "B 1->0": 20},
                 # Found by review: a lossless edge (as the stages report it, an error of 0.0) was charted too.
                 codec_stats={"F 0->1": {"codec": "int8", "rel_error": 0.004},
                              "B 1->0": {"codec": "none", "rel_error": 0.0}},
                 peak_rss_bytes=[100, 200], peak_stash_bytes=[7, 0])
    assert step_scalars(step) == {
        "Train/loss": 2.5, "Train/lr": 0.1, "Train/lr/group_1": 0.01, "Train/grad_norm": 1.5,
        "Train/loss_scale": 1024.0, "Train/samples_per_s": 16.0, "Train/step_time_s": 0.5,
        "Train/bubble_fraction": 0.25, "Train/bytes/B_1_to_0": 20.0, "Train/bytes/F_0_to_1": 10.0,
        "Train/rel_error/F_0_to_1": 0.004, "Train/peak_rss_bytes/rank_0": 100.0,
        "Train/peak_rss_bytes/rank_1": 200.0, "Train/peak_stash_bytes/rank_0": 7.0,
        "Train/peak_stash_bytes/rank_1": 0.0,
    }
    # what a step did not measure is left out, not written as 0
    assert set(step_scalars(stats(0, 1.0))) == {"Train/loss", "Train/step_time_s", "Train/bubble_fraction"}


@pytest.mark.parametrize(("tag", "name"), [
    ("Train/loss", "Train_loss.csv"),
    ("Train/bytes/F_0_to_1", "Train_bytes_F_0_to_1.csv"),
    ("Eval/loss", "Eval_loss.csv"),
])
def test_a_csv_file_is_named_as_deepspeeds_csv_monitor_names_it(tag: str, name: str) -> None:
    assert csv_file_name(tag) == name


def test_an_evaluations_loss_is_its_loss_whatever_its_metrics_are_named() -> None:
    # A metrics function that returns {"loss": ...} replaced the evaluation's loss in every monitor.
    result = EvalResult(loss=2.5, items=8.0, eval_time_s=0.1, metrics={"loss": 0.1, "accuracy": 0.9})
    assert evaluation_scalars(result) == {"Eval/loss": 2.5, "Eval/accuracy": 0.9}


def test_tensorboard_events_read_back_with_tensorboards_own_reader(tmp_path: Path) -> None:
    writer = TensorBoardWriter(str(tmp_path))
    losses = [2.0, 1.2345678901, 0.5]
    for step, loss in enumerate(losses):
        writer.write({"Train/loss": loss, "Train/bytes/F_0_to_1": 64.0}, step)
    writer.close()
    found = tensorboard_scalars(tmp_path)
    assert found["Train/loss"] == [(step, float32(loss)) for step, loss in enumerate(losses)]
    assert found["Train/bytes/F_0_to_1"] == [(0, 64.0), (1, 64.0), (2, 64.0)]


def test_csv_files_hold_one_scalar_each_and_a_second_writer_appends_without_a_header(tmp_path: Path) -> None:
    for steps in ((0, 1), (2,)):  # a second job of the same name appends
        writer = CsvWriter(str(tmp_path))
        for step in steps:
            writer.write({"Train/loss": 1.0 / (step + 1), "Train/lr": 0.1}, step)
        writer.close()
    assert sorted(os.listdir(tmp_path)) == ["Train_loss.csv", "Train_lr.csv"]
    assert csv_rows(tmp_path / "Train_loss.csv") == [["step", "loss"], ["0", "1.0"], ["1", "0.5"],
                                                      ["2", repr(1 / 3)]]
    assert float(csv_rows(tmp_path / "Train_loss.csv")[3][1]) == 1 / 3  # exact: the shortest repr round-trips


# -- the monitors of one job ------------------------------------------------------------------------


async def test_monitors_write_every_step_and_evaluation_then_flush_when_closed(tmp_path: Path) -> None:
    events: list[Event] = []
    monitors = Monitors([target("tensorboard", TensorBoardConfig(), tmp_path / "tb"),
                         target("csv_monitor", CSVConfig(job_name="run"), tmp_path / "csv")],
                        job="job7", publish=events.append)
    losses = [3.0, 2.0, 1.0]
    for step, loss in enumerate(losses, start=1):
        monitors.record_step(stats(step - 1, loss, lr=[0.1]), step)
    monitors.record_evaluation(EvalResult(loss=0.75, metrics={"accuracy": 0.5}), 3)
    await monitors.aclose()
    await monitors.aclose()  # twice is fine
    monitors.record_step(stats(4, 0.1), 5)  # after close: dropped, not raised
    scalars = tensorboard_scalars(tmp_path / "tb" / "job7")  # job_name: the job's id by default
    assert scalars["Train/loss"] == [(s, float32(loss)) for s, loss in enumerate(losses, start=1)]
    assert scalars["Eval/loss"] == [(3, 0.75)] and scalars["Eval/accuracy"] == [(3, 0.5)]  # eval_metrics too
    assert csv_rows(tmp_path / "csv" / "run" / "Train_loss.csv") == [["step", "loss"], ["1", "3.0"], ["2", "2.0"],
                                                                   ["3", "1.0"]]
    assert csv_rows(tmp_path / "csv" / "run" / "Eval_loss.csv") == [["step", "loss"], ["3", "0.75"]]
    assert events == [] and monitors.failures == {}


class _Recording:
    """A writer that keeps what it is given, and raises from its ``fail_at``-th write on (when set)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.steps: list[int] = []
        self.fail_at = fail_at
        self.closed = False

    def write(self, scalars: Mapping[str, float], step: int) -> None:
        if self.fail_at is not None and len(self.steps) >= self.fail_at:
            raise OSError(28, "No space left on device")
        self.steps.append(step)

    def close(self) -> None:
        self.closed = True


async def test_a_failing_monitor_is_reported_once_and_the_others_write_on(tmp_path: Path) -> None:
    writers = {"tensorboard": _Recording(fail_at=1), "csv_monitor": _Recording()}
    events: list[Event] = []
    monitors = Monitors([target(kind, TensorBoardConfig(), tmp_path) for kind in writers], job="job3",
                        publish=events.append, opener=lambda t, job: writers[t.kind])
    for step in range(4):
        monitors.record_step(stats(step, 1.0), step)
    await monitors.aclose()
    assert writers["csv_monitor"].steps == [0, 1, 2, 3] and writers["csv_monitor"].closed
    assert writers["tensorboard"].steps == [0] and writers["tensorboard"].closed  # off after its failure
    assert events == [MonitorFailed(job="job3", monitor="tensorboard",
                                    error="failed writing step 1: OSError: [Errno 28] No space left on device")]
    assert set(monitors.failures) == {"tensorboard"}


async def test_a_monitor_that_cannot_start_is_reported_once_and_training_goes_on(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file where the directory would go")
    events: list[Event] = []
    monitors = Monitors([target("csv_monitor", CSVConfig(job_name="x"), tmp_path / "taken")], job="job1",
                        publish=events.append)
    for step in range(3):
        monitors.record_step(stats(step, 1.0), step + 1)
    await monitors.aclose()
    assert [(e.monitor, e.error.split(":")[0]) for e in events if isinstance(e, MonitorFailed)] == \
        [("csv_monitor", "could not start")]
    assert len(events) == 1


def test_the_console_prints_a_failed_monitor_as_one_line() -> None:
    from schedulers.console.render import event_line

    event = MonitorFailed(job="job0", monitor="csv_monitor", error="could not start: FileExistsError: taken")
    assert event_line(event) == "! job0: monitor csv_monitor is off (could not start: FileExistsError: taken); " \
                                "training goes on"
    assert MonitorFailed.from_wire(event.to_wire()) == event


# -- where monitors may write ------------------------------------------------------------------------


@pytest.mark.parametrize(("caller", "output_path", "relative_to", "lands", "within"), [
    ("client:alice", "", None, "/srv/ckpt/alice", "/srv/ckpt/alice"),
    ("client:alice", "runs", "/home/alice", "/srv/ckpt/alice/runs", "/srv/ckpt/alice"),
    ("client:alice", "/srv/ckpt/alice/tb", None, "/srv/ckpt/alice/tb", "/srv/ckpt/alice"),
    ("admin:admin", "runs/", "/home/me", "/home/me/runs", None),
    ("admin:admin", "", "/home/me", "/home/me", None),
    ("admin:admin", "/var/log/tb", None, "/var/log/tb", None),
    ("", "runs", "/home/me", "/home/me/runs", None),  # a runtime without keys
])
def test_an_output_path_is_resolved_as_a_checkpoint_directory_is(
    caller: str, output_path: str, relative_to: str | None, lands: str, within: str | None,
) -> None:
    monitoring = Monitoring(tensorboard=TensorBoardConfig(output_path=output_path))
    (found,) = resolve_monitors(monitoring, caller=caller, root="/srv/ckpt", relative_to=relative_to)
    assert (found.kind, found.output_path, found.within) == ("tensorboard", lands, within)
    assert found.directory("job4") == os.path.join(lands, "job4")


@pytest.mark.parametrize("output_path", ["../bob", "/srv/ckpt/bob/tb", "/tmp/tb", "/srv/ckpt"])
def test_a_clients_output_path_outside_its_subtree_is_refused(output_path: str) -> None:
    monitoring = Monitoring(csv_monitor={"output_path": output_path})
    with pytest.raises(NotAllowed, match=r"^monitoring.csv_monitor.output_path: .* is outside /srv/ckpt/alice"):
        resolve_monitors(monitoring, caller="client:alice", root="/srv/ckpt", relative_to=None)


def test_an_admins_relative_output_path_needs_the_drivers_directory() -> None:
    with pytest.raises(ValueError, match="monitoring.wandb.output_path: .*absolute"):
        resolve_monitors(Monitoring(wandb=WandbConfig(output_path="runs")), caller="admin:admin", root="/srv",
                         relative_to=None)


def test_a_link_out_of_a_clients_subtree_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "alice").mkdir(parents=True)
    outside.mkdir()
    (root / "alice" / "runs").symlink_to(outside)
    (found,) = resolve_monitors(Monitoring(csv_monitor={"output_path": "runs"}), caller="client:alice",
                                root=str(root), relative_to=None)
    with pytest.raises(CheckpointError, match="is outside .*alice"):
        open_writer(found, "job0")
    assert list(outside.iterdir()) == []


def test_a_monitor_whose_library_the_head_lacks_is_refused_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    check_libraries(Monitoring(tensorboard={}, csv_monitor={}))
    with pytest.raises(ValueError, match=r"monitoring.wandb needs the wandb package .*pip install 'actorpipe\[monitor\]'"):
        check_libraries(Monitoring(tensorboard={}, wandb={}))


# -- the spec's monitoring section ----------------------------------------------------------------------


def test_monitors_are_given_as_records_or_dicts_and_travel_with_the_spec() -> None:
    spec = JobSpec.of(model=MODEL, tensorboard={"output_path": "runs", "job_name": "gpt"},
                      wandb=WandbConfig(project="p", team="t"))
    assert spec.monitoring == Monitoring(tensorboard=TensorBoardConfig(output_path="runs", job_name="gpt"),
                                         wandb=WandbConfig(project="p", team="t"))
    assert spec.monitoring.enabled and not JobSpec.of(model=MODEL).monitoring.enabled
    assert JobSpec.from_wire(spec.to_wire()) == spec
    assert JobSpec.of(model=MODEL, monitoring={"csv_monitor": {}}).get("csv_monitor") is not None


@pytest.mark.parametrize(("given", "error", "match"), [
    ({"tensorboard": {"output": "runs"}}, TypeError,
     "monitoring.tensorboard has no key 'output'; did you mean monitoring.tensorboard.output_path"),
    ({"tensorboard": True}, TypeError, "monitoring.tensorboard must be a TensorBoardConfig, a dict of its fields"),
    ({"csv_monitor": {"job_name": "a/b"}}, ValueError, "monitoring.csv_monitor.job_name must be 1 to 128"),
    ({"csv_monitor": {"job_name": ".."}}, ValueError, "monitoring.csv_monitor.job_name must be"),
    ({"wandb": {"project": ""}}, ValueError, "monitoring.wandb.project must be 1 to 128"),
    ({"wandb": {"team": 3}}, TypeError, "monitoring.wandb.team must be a string or None"),
    ({"tensorboard": {"output_path": 7}}, TypeError, "monitoring.tensorboard.output_path must be a directory path"),
])
def test_a_bad_monitor_is_refused_at_the_call_naming_its_field(given: dict[str, Any], error: type[Exception],
                                                                match: str) -> None:
    with pytest.raises(error, match=match):
        JobSpec.of(model=MODEL, **given)


# -- W&B, offline (its library starts a service process) ----------------------------------------------


def run_file(directory: Path) -> str:
    (found,) = glob.glob(str(directory / "wandb" / "offline-run-*" / "run-*.wandb"))
    return found


@pytest.mark.multiprocess
def test_a_wandb_run_is_written_offline_with_its_project_group_and_team(tmp_path: Path) -> None:
    (found,) = resolve_monitors(Monitoring(wandb={"project": "p", "group": "g", "team": "t",
                                                  "output_path": str(tmp_path)}),
                                caller="admin:admin", root="/srv", relative_to=None)
    writer = open_writer(found, "job5")
    for step, loss in enumerate([2.0, 1.0]):
        writer.write({"Train/loss": loss}, step)
    writer.write({"Eval/loss": 0.5}, 2)
    writer.close()
    run, history = wandb_history(run_file(tmp_path))
    assert run == {"project": "p", "group": "g", "entity": "t", "name": "job5"}, (run, history)
    assert [(row["_step"], row.get("Train/loss"), row.get("Eval/loss")) for row in history] == \
        [(0, 2.0, None), (1, 1.0, None), (2, None, 0.5)]


# -- jobs on a cluster ----------------------------------------------------------------------------------------

CLIENTS = TwoClients()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    """Two nodes; the driver holds the admin key, and alice a client key (checkpoints under ROOT/alice)."""
    async with CLIENTS.start(nodes=2, checkpoint_root=tmp_path_factory.mktemp("root")) as cluster:
        yield cluster


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 2, 8, generator=generator), torch.randn(4, 2, 8, generator=generator)


@pytest.mark.multiprocess
@pytest.mark.asyncio(loop_scope="module")
async def test_every_step_of_a_job_and_of_its_run_and_every_evaluation_reach_each_tool(
    cluster: Cluster, tmp_path: Path
) -> None:
    events = await feed(cluster, "monitored")
    job = await cluster.train(**SMALL, data="examples.data:regression_batches",
                              data_kwargs={"batch_size": 4, "seq": 2, "dim": 8}, activation_codec="int8",
                              tensorboard={"output_path": str(tmp_path / "tb")},
                              csv_monitor={"output_path": str(tmp_path / "csv"), "job_name": "small"},
                              wandb={"project": "tests", "output_path": str(tmp_path / "wandb")})
    try:
        stepped = [await job.step(), await job.step()]
        evaluation = await job.evaluate(*batch(1))
        await job.run(1)
        await heard_until(events, RunFinished, job.id)
        description = await job.describe()
        assert description.steps == 3 and description.last_stats is not None
    finally:
        await job.close()
    heard = await heard_until(events, JobClosed, job.id)
    assert not [e for e in heard if isinstance(e, MonitorFailed)]
    # x: the optimizer steps applied, this one included; the evaluation at the 2 applied before it
    losses = [(applied, s.loss) for applied, s in enumerate([*stepped, description.last_stats], start=1)]
    scalars = tensorboard_scalars(tmp_path / "tb" / job.id)
    assert scalars["Train/loss"] == [(step, float32(loss)) for step, loss in losses]
    assert scalars["Eval/loss"] == [(2, float32(evaluation.loss))]
    assert [step for step, _ in scalars["Train/rel_error/F_0_to_1"]] == [1, 2, 3]
    assert {"Train/lr", "Train/grad_norm", "Train/samples_per_s", "Train/bytes/F_0_to_1", "Train/bytes/B_1_to_0",
            "Train/peak_rss_bytes/rank_1", "Train/peak_stash_bytes/rank_0", "Train/bubble_fraction"} <= set(scalars)
    rows = csv_rows(tmp_path / "csv" / "small" / "Train_loss.csv")
    assert rows == [["step", "loss"], *([str(step), repr(loss)] for step, loss in losses)]
    _, history = wandb_history(run_file(tmp_path / "wandb"))
    assert [(row["_step"], row["Train/loss"]) for row in history if "Train/loss" in row] == losses


@pytest.mark.multiprocess
@pytest.mark.asyncio(loop_scope="module")
async def test_a_deepspeed_examples_configs_tensorboard_block_writes_where_deepspeed_would(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt2_fp16_zero1.json as it is: ``"tensorboard": {"enabled": true, "output_path": "runs/", "job_name": "gpt2"}``."""
    monkeypatch.chdir(tmp_path)  # DeepSpeed writes runs/gpt2 under the launching directory; the driver's here
    config = load_config(DS_CONFIGS / "gpt2_fp16_zero1.json", job=DS_CONFIGS / "gpt2_job.json")
    assert config.spec.monitoring.tensorboard == TensorBoardConfig(output_path="runs/", job_name="gpt2")
    job = await cluster.train(config.spec)
    try:
        stepped = [await job.step() for _ in range(2)]
    finally:
        await job.close()
    scalars = tensorboard_scalars(tmp_path / "runs" / "gpt2")
    assert scalars["Train/loss"] == [(s.step + 1, float32(s.loss)) for s in stepped]
    assert scalars["Train/loss_scale"] == [(s.step + 1, float32(s.loss_scale)) for s in stepped if s.loss_scale]
    assert [value for _, value in scalars["Train/lr"]] == [float32(s.lr[0]) for s in stepped]


@pytest.mark.multiprocess
@pytest.mark.asyncio(loop_scope="module")
async def test_a_clients_monitors_stay_in_its_subtree_and_one_that_fails_is_reported_once(
    cluster: Cluster
) -> None:
    root = CLIENTS.local.checkpoint_root
    assert root is not None
    async with CLIENTS.connect(cluster, "alice") as alice:
        with pytest.raises(NotAllowed, match="monitoring.tensorboard.output_path: '../bob' is outside"):
            await alice.train(**SMALL, tensorboard={"output_path": "../bob"})
        os.makedirs(os.path.join(root, "alice"), exist_ok=True)
        Path(root, "alice", "taken").write_text("a file where the csv directory would go")
        events = await feed(alice, "alice-feed")
        job = await alice.train(**SMALL, tensorboard={"output_path": "runs"},
                                csv_monitor={"output_path": "taken"})
        try:
            stepped = [await job.step(*batch(seed)) for seed in range(3)]  # training goes on
        finally:
            await job.close()
        heard = await heard_until(events, JobClosed, job.id)
    failed = [e for e in heard if isinstance(e, MonitorFailed)]
    assert [(e.monitor, e.error.split(":")[0]) for e in failed] == [("csv_monitor", "could not start")]
    scalars = tensorboard_scalars(Path(root, "alice", "runs", job.id))
    assert scalars["Train/loss"] == [(s.step + 1, float32(s.loss)) for s in stepped]
