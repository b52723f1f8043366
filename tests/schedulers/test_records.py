"""Tests for schedulers/records.py and schedulers/events.py: what the scheduler answers travels as itself."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from actors import NodeInfo, NodeJoined, WireRecord
from schedulers.events import JobRecovered, RunProgress, SettingPending, StepFinished
from schedulers.jobs import JobSpec
from schedulers.records import (
    Candidate, JobDescription, JobInfo, MeasuredCosts, Plan, Recovery, RunInfo, SettingChange, StepStats, WhereReport,
)
from transport.wire import WireError, decode_message, encode_message

SPEC = JobSpec.of(model="examples.models:residual_mlp", pipeline_stages=2, micro_batches=4,
                  partition_method="profile", example_inputs=torch.arange(8.0).reshape(2, 4),
                  optimizer=("torch.optim:Adam", {"lr": 1e-3}))
STATS = StepStats(step=3, loss=0.5, step_time_s=0.01, bubble_fraction=0.2, bytes_sent=10,
                  bytes_per_edge={"F 0->1": 5}, recovery=Recovery(lost=["n1"], moved={"n1": "spare0"}, from_step=2, replayed=1), lr=[1e-3])
COSTS = MeasuredCosts(forward=[0.1, 0.2], backward=[0.2, 0.4], input_grad=[0.1, 0.2], weight_grad=[0.1, 0.2],
                      stash_bytes=[1.0, 2.0])  # bandwidth: inf, which msgpack carries as a float
RECORDS = [
    STATS,
    JobInfo(job="job0", bounds=[[0, 2], [2, 4]], nodes=["n0", "n1"], actor=["tcp://a", "job0.control"],
            notices=["shared"]),
    JobDescription(job="job0", spec=SPEC, bounds=[[0, 2], [2, 4]], nodes=["n0", "n1"], mesh=[2, 1, 1],
                   stages=[["tcp://a", "job0.rank0"]], steps=4, programs=[["0F0"]], stepping=False, traced=True,
                   run=RunInfo(target=10, first_step=0, done=4), last_stats=STATS, pending={"micro_batches": 8}),
    SettingChange(job="job0", key="schedule", value="gpipe", stepping=True, next_step=5),
    WhereReport(job="job0", stepping=True, report="grid", lines=["a", "b"]),
    Plan(job="job0", schedule="auto", running="1f1b", state="planned", costs=COSTS, chosen="1f1b",
         candidates=[Candidate(schedule="1f1b", predicted_step_s=0.5, bubble_fraction=0.1, stash=[2, 1],
                               stash_bytes=[20, 10], chosen=True)]),
    NodeInfo(name="n0", address="tcp://a", device="cuda:0", pid=1, host="box", memory_bytes=1, state="lost"),
    NodeJoined(node="n0", time=1.5),
    StepFinished(job="job0", step=3, loss=0.5, step_time_s=0.01, bubble_fraction=0.2,
                 run=RunProgress(done=4, target=10)),
    SettingPending(job="job0", key="activation_codec", value=["int8", "none"]),
    JobRecovered(job="job0", lost=["n1"], moved={"n1": "spare0"}, from_step=2, replayed=1, from_checkpoint=None,
                 seconds=0.5, restarts_left=1),
]


def roundtrip(payload: object) -> object:
    return decode_message([bytes(memoryview(f)) for f in encode_message(payload)])


def same(a: object, b: object) -> bool:
    """Equal, with tensors compared by value (a JobSpec's example_inputs)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, JobSpec):
        return isinstance(b, JobSpec) and same(a.to_wire(), b.to_wire())
    if isinstance(a, WireRecord):
        return type(a) is type(b) and same(a.wire_fields(), b.wire_fields())  # type: ignore[union-attr]
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_the_scheduler_sends_arrives_as_itself(record: WireRecord) -> None:
    out = roundtrip({"v": record})
    assert isinstance(out, dict) and type(out["v"]) is type(record)
    assert same(out["v"], record)


def test_a_spec_travels_checked_with_its_tensors_as_frames() -> None:
    frames = encode_message(SPEC)
    assert len(frames) == 2  # the header, and example_inputs as a raw frame
    out = roundtrip(SPEC)
    assert isinstance(out, JobSpec) and same(out, SPEC)
    bad = SPEC.to_wire()
    bad["parallelism"]["micro_batches"] = 0  # JobSpec's own checks run on arrival
    with pytest.raises(WireError, match="record JobSpec: ValueError: .*micro_batches"):
        decode_message(encode_message([msgpack.ExtType(2, b"JobSpec"), bad]))


def test_a_record_from_a_newer_scheduler_is_refused_not_half_read() -> None:
    fields = {**JobInfo(job="job0", bounds=[], nodes=[], actor=[]).wire_fields(), "shard": 3}
    with pytest.raises(WireError, match=r"record JobInfo: RecordError: JobInfo: unknown key\(s\) shard"):
        decode_message(encode_message([msgpack.ExtType(2, b"JobInfo"), fields]))
