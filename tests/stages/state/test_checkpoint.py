"""The checkpoint format and its directory switch: kill windows, refusals of bad manifests and paths.

A save is the stage side's ``write_stage`` for two stages, then ``commit_version``,
exactly as the controller runs them, in one process. The kill-window tests fork a
writer and end it with ``os._exit`` at each named step of a save (or SIGKILL it at
random instants), then load as a stage would: the result is the old checkpoint or
the new one, never missing and never mixed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from stages.state import checkpoint as ck
from stages.state.stage_checkpoint import apply_load, prepare_load, write_stage

pytestmark = pytest.mark.timeout(120)

KILLED = 17


def stages(value: float) -> dict[int, nn.Module]:
    """Two one-layer stages whose every weight is ``value``, with SGD momentum state of the same value."""
    layers: dict[int, nn.Module] = {}
    for i in range(2):
        layer = nn.Linear(32, 32)
        with torch.no_grad():
            for p in layer.parameters():
                p.fill_(value)
        layers[i] = layer
    return layers


def optimizer_of(layers: dict[int, nn.Module], value: float) -> torch.optim.Optimizer:
    opt = torch.optim.SGD([p for layer in layers.values() for p in layer.parameters()], lr=0.1, momentum=0.9)
    for p in opt.param_groups[0]["params"]:
        opt.state[p]["momentum_buffer"] = torch.full_like(p, value)
    return opt


def write(staging: str, value: int) -> ck.Manifest:
    """Every stage's file of a save of ``value`` into ``staging``, and the manifest of them."""
    written = []
    for i, layer in stages(float(value)).items():
        opt = optimizer_of({i: layer}, float(value))
        written.append(write_stage(staging, f"p{i}-t0.safetensors", {i: layer}, opt, {}, 0))
    files, model, state = ck.merge_written(written)
    return ck.Manifest(step=value, optimizer="torch.optim:SGD", files=files, model=model, optimizer_state=state)


def save(directory: str, value: int, job: str = "job0") -> str:
    """One save as the controller runs it: begin, every stage writes, commit."""
    staging = ck.begin_version(directory, job)
    return ck.commit_version(directory, staging, write(staging, value), job)


def held_keys(layers: dict[int, torch.nn.Module]) -> frozenset[str]:
    """The whole-model keys a stage holding ``layers`` reads (as StageActor.state_keys gives them)."""
    return frozenset(f"{i}.{k}" for i, layer in layers.items() for k in layer.state_dict())


def load(directory: str) -> int:
    """Loads as the stages would (checks, then applies); returns the one value every tensor holds.

    Raises:
        CheckpointError: no checkpoint, or a bad one.
    """
    version, manifest = ck.read_manifest(directory)
    layers = stages(-1.0)
    opt = optimizer_of(layers, -1.0)
    prepared, problems = prepare_load(version, manifest.restrict(held_keys(layers), weights_only=False), layers, {}, 0)
    assert problems == []
    apply_load(prepared, layers, opt, weights_only=False)
    values = {float(v.flatten()[0]) for layer in layers.values() for v in layer.state_dict().values()}
    values |= {float(s["momentum_buffer"].flatten()[0]) for s in opt.state.values()}
    assert len(values) == 1, f"a mixed checkpoint: {values}"
    assert values == {float(manifest.step)}, "the manifest is of another save than the data"
    return manifest.step


def in_child(work: Callable[[], None]) -> int:
    """Runs ``work`` in a forked process; returns its exit status (the child never returns into pytest)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            work()
        except BaseException:  # noqa: BLE001 - any failure is reported through the status
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def kill_at(point: str, nth: int) -> Callable[[str], None]:
    seen = {"n": 0}

    def reached(name: str) -> None:
        if name == point:
            seen["n"] += 1
            if seen["n"] == nth:
                os._exit(KILLED)

    return reached


# (point, its n-th arrival, what a load finds afterwards: the old save or the new one)
WINDOWS = [
    ("staged", 1, "old"),
    ("tensor_written", 1, "old"),  # the first stage's file, half written
    ("tensor_written", 6, "old"),  # the second stage's file, half written (4 tensors each)
    ("manifest_written", 1, "old"),
    ("renamed", 1, "old"),  # the new version is complete, the pointer not moved yet
    ("pointer_written", 1, "old"),  # LATEST.tmp written, not yet in place
    ("pointed", 1, "new"),  # the pointer moved; the old version is still there
    ("old_removed", 1, "new"),
]


@pytest.mark.parametrize("point, nth, expected", WINDOWS, ids=[f"{p}-{n}" for p, n, _ in WINDOWS])
@pytest.mark.multiprocess
def test_a_save_killed_at_any_step_leaves_the_old_or_the_new_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str, nth: int, expected: str
) -> None:
    directory = str(tmp_path / "ckpt")
    save(directory, 1)

    def killed_save() -> None:
        monkeypatch.setattr(ck, "_reached", kill_at(point, nth))
        save(directory, 2)

    assert in_child(killed_save) == KILLED  # it did stop at that point
    assert load(directory) == (1 if expected == "old" else 2)
    renamed = point in ("renamed", "pointer_written", "pointed", "old_removed")  # v000002 exists: the next is 3
    assert save(directory, 3) == f"{directory}/v{3 if renamed else 2:06d}"
    assert load(directory) == 3
    left = sorted(os.listdir(directory))
    assert len(left) == 2 and left[0] == "LATEST" and left[1].startswith("v")  # leftovers gone


@pytest.mark.parametrize("point", ["staged", "tensor_written", "manifest_written", "renamed", "pointer_written"])
@pytest.mark.multiprocess
def test_a_killed_first_save_is_no_checkpoint_and_the_next_save_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    directory = str(tmp_path / "ckpt")

    def killed_save() -> None:
        monkeypatch.setattr(ck, "_reached", kill_at(point, 1))
        save(directory, 1)

    assert in_child(killed_save) == KILLED
    with pytest.raises(ck.CheckpointError, match="no actorpipe checkpoint at"):
        load(directory)
    save(directory, 2)
    assert load(directory) == 2


@pytest.mark.multiprocess
def test_sigkill_at_random_instants_never_leaves_a_missing_or_mixed_checkpoint(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    save(directory, 1)
    rng = random.Random(0)
    last = 1
    for round_ in range(8):
        first = 1000 * (round_ + 1)

        def save_forever(first: int = first) -> None:
            value = first
            while True:
                save(directory, value)
                value += 1

        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                save_forever()
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.01, 0.3))  # the kill instant, not a wait for anything
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        value = load(directory)
        assert value == last or value >= first, (value, last, first)
        last = value
    assert last > 1000  # some save completed between kills


def test_foreign_weights_in_another_float_dtype_are_cast_and_our_own_are_refused(tmp_path: Path) -> None:
    # A bf16 save_pretrained directory (most hub checkpoints) into a float32 model: every tensor was refused
    # ("dtype bfloat16 in the checkpoint, float32 in this model") where from_pretrained(dtype=...) casts.
    from safetensors.torch import save_file

    layers = stages(0.0)
    weights = {f"{i}.{k}": torch.randn(v.shape).to(torch.bfloat16) for i, layer in layers.items()
               for k, v in layer.state_dict().items()}
    save_file(weights, str(tmp_path / "model.safetensors"))
    version, manifest = ck.read_manifest(str(tmp_path))
    prepared, problems = prepare_load(version, manifest.restrict(held_keys(layers), weights_only=True), layers, {}, 0)
    assert problems == []
    for i, held in prepared.model.items():
        for k, value in held.items():
            assert value.dtype == torch.float32 and torch.equal(value, weights[f"{i}.{k}"].float())
    # This project's own checkpoint holds what the job held: another dtype there is a problem.
    ours = save(str(tmp_path / "ckpt"), 1)
    _, manifest = ck.read_manifest(str(tmp_path / "ckpt"))
    halves = {i: layer.to(torch.bfloat16) for i, layer in stages(0.0).items()}
    _, problems = prepare_load(ours, manifest.restrict(held_keys(halves), weights_only=True), halves, {}, 0)
    assert problems and all("dtype float32 in the checkpoint, bfloat16 in this model" in p for p in problems)


def test_a_flipped_byte_names_the_file_and_the_key(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    version = save(directory, 1)
    _, manifest = ck.read_manifest(directory)
    part = manifest.model["1.bias"].parts[0]
    path = Path(version) / part.file
    data = bytearray(path.read_bytes())
    data[part.offset + 5] ^= 0x01
    path.write_bytes(bytes(data))
    layers = stages(0.0)
    _, problems = prepare_load(version, manifest.restrict(held_keys({1: layers[1]}), weights_only=False), {1: layers[1]}, {}, 0)
    assert len(problems) == 1 and problems[0].startswith(f"{path}, 1.bias: checksum mismatch")
    path.write_bytes(bytes(data[:-4]))  # truncated
    _, problems = prepare_load(version, manifest.restrict(held_keys({1: layers[1]}), weights_only=False), {1: layers[1]}, {}, 0)
    assert any("truncated" in p for p in problems)


BAD_MANIFESTS = [
    (lambda m: m.update(format="other"), "not an actorpipe-checkpoint manifest"),
    (lambda m: m.update(version=99), "format version 99"),
    (lambda m: m["files"].update({"../../etc/passwd": 1}), "files: expected a map"),
    (lambda m: m["model"]["0.weight"]["parts"][0].update(file="/etc/passwd"), "is not a shard file name"),
    (lambda m: m["model"]["0.weight"]["parts"][0].update(offset=-1), "expected a list of integers >= 0"),
    (lambda m: m["model"]["0.weight"].update(dtype="object"), "unknown dtype"),
    (lambda m: m["model"]["0.weight"].update(shard=[0, 2, 1]), r"expected 2 part\(s\)"),
    (lambda m: m.update(lr_scheduler={"path": 1, "state": {}}), "lr_scheduler: expected null or a map"),
]


@pytest.mark.parametrize("damage, message", BAD_MANIFESTS)
def test_a_malformed_manifest_is_refused_before_any_file_is_opened(
    tmp_path: Path, damage: Callable[[dict[str, object]], None], message: str
) -> None:
    directory = str(tmp_path / "ckpt")
    version = save(directory, 1)
    path = Path(version) / "manifest.json"
    manifest = json.loads(path.read_text())
    damage(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(ck.CheckpointError, match=message):
        ck.read_manifest(directory)


def test_a_pointer_that_names_no_version_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    save(str(directory), 1)
    (directory / "LATEST").write_text("../../etc\n")
    with pytest.raises(ck.CheckpointError, match="no actorpipe checkpoint at") as info:
        ck.read_manifest(str(directory))
    assert "etc" not in str(info.value)  # the pointer's bytes are not repeated


def test_what_is_not_a_checkpoint_is_refused_without_telling_what_the_directory_holds(tmp_path: Path) -> None:
    """Whatever a directory holds or lacks, a load hears one message, and a save refused names no file."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "files").mkdir()
    for name in ("id_ed25519", "notes.txt", "payroll.csv"):
        (tmp_path / "files" / name).write_text("private")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "model.pt").write_bytes(b"an unversioned checkpoint")
    (tmp_path / "pointer").mkdir()
    (tmp_path / "pointer" / "LATEST").write_text("hunter2-secret\n")
    summaries = set()
    for name in ("missing", "empty", "files", "old", "pointer"):
        with pytest.raises(ck.CheckpointError) as info:
            ck.read_manifest(str(tmp_path / name))
        summaries.add(info.value.summary.replace(name, "DIR"))
        assert not any(word in str(info.value) for word in ("id_ed25519", "notes.txt", "payroll", "hunter2")), name
        assert "model.pt" in str(info.value)  # the hint is always there: it tells nothing about the directory
    assert summaries == {f"no actorpipe checkpoint at {tmp_path}/DIR"}
    for name in ("missing", "empty", "files", "old", "pointer"):  # what a job that resumes takes as "from the seed"
        with pytest.raises(ck.NoCheckpoint):
            ck.read_manifest(str(tmp_path / name))
    with pytest.raises(ck.CheckpointError, match="is not an actorpipe checkpoint directory") as info:
        ck.begin_version(str(tmp_path / "files"), "job0")
    assert not any(word in str(info.value) for word in ("id_ed25519", "notes.txt", "payroll"))
    assert sorted(os.listdir(tmp_path / "files")) == ["id_ed25519", "notes.txt", "payroll.csv"]


def test_a_save_removes_only_its_own_jobs_staging_directories(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    other = ck.begin_version(directory, "job1")  # another job's save, in progress
    killed = ck.begin_version(directory, "job0")  # this job's save, killed before its commit
    staging = ck.begin_version(directory, "job0")
    assert os.path.isdir(other) and not os.path.exists(killed)
    assert os.path.basename(staging).startswith(".staging-job0-")
    ck.commit_version(directory, staging, write(staging, 1), "job0")
    assert os.path.isdir(other)  # the other job's save goes on
    ck.commit_version(directory, other, write(other, 2), "job1")
    assert load(directory) == 2
    assert sorted(os.listdir(directory)) == ["LATEST", "v000002"]


def test_a_save_keeps_the_newest_versions_it_is_told_to_and_zero_keeps_every_one(tmp_path: Path) -> None:
    """``keep``: the newest versions a commit leaves (its own among them), as torchtitan's keep_latest_k."""
    directory = str(tmp_path / "ckpt")

    def commit(value: int, keep: int) -> list[str]:
        staging = ck.begin_version(directory, "job0")
        ck.commit_version(directory, staging, write(staging, value), "job0", keep)
        return sorted(os.listdir(directory))

    assert commit(1, 3) == ["LATEST", "v000001"]
    assert commit(2, 3) == ["LATEST", "v000001", "v000002"]
    assert commit(3, 3) == ["LATEST", "v000001", "v000002", "v000003"]
    assert commit(4, 3) == ["LATEST", "v000002", "v000003", "v000004"]
    assert commit(5, 0) == ["LATEST", "v000002", "v000003", "v000004", "v000005"]
    assert commit(6, 2) == ["LATEST", "v000005", "v000006"]
    assert load(directory) == 6 and load(f"{directory}/v000005") == 5  # a kept version loads by its path
    assert commit(7, 1) == ["LATEST", "v000007"]


def test_the_spare_version_outlives_the_rotation_and_a_spare_that_is_no_version_is_refused(tmp_path: Path) -> None:
    """``spare``: the version saved at the job's best evaluation (``keep_best``) stays whatever ``keep`` says,
    without counting among the newest it keeps; once another is the spare, the rotation takes it."""
    directory = str(tmp_path / "ckpt")

    def commit(value: int, spare: str | None) -> list[str]:
        staging = ck.begin_version(directory, "job0")
        ck.commit_version(directory, staging, write(staging, value), "job0", 1, spare)
        return sorted(os.listdir(directory))

    assert commit(1, None) == ["LATEST", "v000001"]
    assert commit(2, "v000001") == ["LATEST", "v000001", "v000002"]
    assert commit(3, "v000001") == ["LATEST", "v000001", "v000003"]
    assert load(f"{directory}/v000001") == 1 and load(directory) == 3
    assert commit(4, "v000003") == ["LATEST", "v000003", "v000004"]
    staging = ck.begin_version(directory, "job0")
    manifest = write(staging, 5)
    for wrong in ("../v000001", "LATEST", 3):
        with pytest.raises(ValueError, match="spare must name a version"):
            ck.commit_version(directory, staging, manifest, "job0", 1, wrong)  # type: ignore[arg-type]
    assert [n for n in sorted(os.listdir(directory)) if not n.startswith(".")] == ["LATEST", "v000003", "v000004"]


def test_two_jobs_saving_to_one_directory_at_once_both_complete_and_the_later_commit_is_latest(
    tmp_path: Path
) -> None:
    """The version number is taken at the commit: two saves begun together do not collide."""
    directory = str(tmp_path / "ckpt")
    save(directory, 1)
    first, second = ck.begin_version(directory, "job1"), ck.begin_version(directory, "job2")
    manifests = write(first, 2), write(second, 3)
    assert ck.commit_version(directory, second, manifests[1], "job2") == f"{directory}/v000002"
    assert load(directory) == 3
    assert ck.commit_version(directory, first, manifests[0], "job1") == f"{directory}/v000003"
    assert load(directory) == 2
    assert sorted(os.listdir(directory)) == ["LATEST", "v000003"]


def test_a_stage_writes_and_commits_only_into_its_own_jobs_staging_directory(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    staging = ck.begin_version(directory, "job1")
    with pytest.raises(ck.CheckpointError, match="not this job's staging directory"):
        ck.check_staging(staging, "p0-t0.bin", job="job10")
    manifest = write(staging, 1)
    with pytest.raises(ck.CheckpointError, match="not this job's staging directory"):
        ck.commit_version(directory, staging, manifest, "job0")
    with pytest.raises(ck.CheckpointError, match="is not a job id"):
        ck.begin_version(directory, "../job0")
    assert ck.commit_version(directory, staging, manifest, "job1") == f"{directory}/v000001"


def test_a_link_out_of_the_clients_subtree_is_refused_on_the_node(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    (root / "alice").mkdir(parents=True)
    elsewhere.mkdir()
    save(str(elsewhere / "ckpt"), 1)
    (root / "alice" / "link").symlink_to(elsewhere)
    within = str(root / "alice")
    for attempt in (lambda: ck.begin_version(f"{within}/link/ckpt", "job0", within=within),
                    lambda: ck.read_manifest(f"{within}/link/ckpt", within=within),
                    lambda: ck.read_manifest(f"{root}/bob", within=within)):
        with pytest.raises(ck.CheckpointError, match=f"is outside {within} \\(links resolved\\)") as info:
            attempt()
        assert "elsewhere" not in str(info.value)  # where the link leads is not told
    assert sorted(os.listdir(elsewhere / "ckpt")) == ["LATEST", "v000001"]
    # A subtree that is itself a link (the operator's choice) is the subtree.
    (root / "carol").symlink_to(elsewhere)
    assert ck.read_manifest(f"{root}/carol/ckpt", within=f"{root}/carol")[1].step == 1
    assert save(f"{within}/run", 2) == f"{within}/run/v000001"


@pytest.mark.parametrize("path", ["relative/dir", "/a/../b", "/a//b", "", "/a\0b", 7])
def test_directories_must_be_absolute_and_normalized(path: object) -> None:
    with pytest.raises(ck.CheckpointError, match="checkpoint directory must be"):
        ck.check_directory(path)


def test_a_staging_directory_this_node_cannot_see_names_the_shared_filesystem(tmp_path: Path) -> None:
    with pytest.raises(ck.CheckpointError, match="must be on a filesystem every node mounts"):
        ck.write_tensors(str(tmp_path / ".staging-v000001-abcd" / "p0-t0.safetensors"), {"0.weight": torch.zeros(2)})


def test_an_error_rebuilt_from_its_message_keeps_its_problems() -> None:
    error = ck.CheckpointError("2 problems", ["a: missing", "b: shape [1] in the checkpoint, [2] in this model"])
    again = ck.CheckpointError.from_message(str(error))
    assert again.summary == "2 problems" and again.problems == error.problems and str(again) == str(error)


STEP_LR = "torch.optim.lr_scheduler:StepLR"


def step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def save_scheduled(directory: str) -> tuple[torch.optim.Optimizer, LRScheduler]:
    """Saves two stages after 3 steps of StepLR (lr 0.1, 0.1, 0.05 -> 0.05); returns the live optimizer and schedule."""
    layers = stages(1.0)
    opt = optimizer_of(layers, 1.0)
    scheduler = step_lr(opt)
    for _ in range(3):
        opt.step()
        scheduler.step()
    staging = ck.begin_version(directory, "job0")
    answer = write_stage(staging, "p0-t0.safetensors", layers, opt, {}, 0, scheduler=scheduler)
    files, model, state = ck.merge_written([answer])
    schedule = {"path": STEP_LR, "state": answer["lr_scheduler"]}
    ck.commit_version(directory, staging, ck.Manifest(step=3, optimizer="torch.optim:SGD", files=files, model=model,
                                                      optimizer_state=state, lr_scheduler=schedule), "job0")
    return opt, scheduler


def load_scheduled(directory: str, *, weights_only: bool) -> tuple[torch.optim.Optimizer, LRScheduler]:
    version, manifest = ck.read_manifest(directory)
    layers = stages(-1.0)
    opt = optimizer_of(layers, -1.0)
    scheduler = step_lr(opt)
    prepared, problems = prepare_load(version, manifest.restrict(held_keys(layers), weights_only=weights_only),
                                      layers, {}, 0, scheduler=scheduler)
    assert problems == []
    apply_load(prepared, layers, opt, weights_only=weights_only, scheduler=scheduler)
    return opt, scheduler


def test_a_checkpoint_resumes_the_learning_rate_schedule_exactly(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    saved_opt, saved = save_scheduled(directory)
    opt, scheduler = load_scheduled(directory, weights_only=False)
    assert opt.param_groups[0]["lr"] == 0.05 and scheduler.last_epoch == 3
    for _ in range(4):  # StepLR multiplies the group's lr: it goes on from the restored one
        for o, s in ((saved_opt, saved), (opt, scheduler)):
            o.step()
            s.step()
        assert opt.param_groups[0]["lr"] == saved_opt.param_groups[0]["lr"]
    assert opt.param_groups[0]["lr"] == 0.0125


def test_weights_only_and_old_manifests_leave_the_schedule_as_it_is(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    save_scheduled(directory)
    opt, scheduler = load_scheduled(directory, weights_only=True)
    assert opt.param_groups[0]["lr"] == 0.1 and scheduler.last_epoch == 0
    # A manifest written before schedules were kept has no lr_scheduler key at all.
    path = Path(ck.read_manifest(directory)[0]) / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["lr_scheduler"]
    path.write_text(json.dumps(manifest))
    assert ck.read_manifest(directory)[1].lr_scheduler is None
    opt, scheduler = load_scheduled(directory, weights_only=False)
    assert opt.param_groups[0]["lr"] == 0.1 and scheduler.last_epoch == 0
    assert all(float(s["momentum_buffer"].flatten()[0]) == 1.0 for s in opt.state.values())  # the rest loaded


def test_a_schedule_state_of_another_kind_is_a_problem_before_anything_is_applied(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    save_scheduled(directory)
    version, manifest = ck.read_manifest(directory)
    layers = stages(-1.0)
    opt = optimizer_of(layers, -1.0)
    other = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    _, problems = prepare_load(version, manifest.restrict(held_keys(layers), weights_only=False), layers, {}, 0,
                               scheduler=other)
    assert any("'step_size' is not part of ExponentialLR's state" in p for p in problems), problems


# -- the files are safetensors; older raw shards still load ------------------------------------------

BEFORE = Path(__file__).parent / "data" / "before_safetensors"  # written by the raw-.bin writer, value 5


def test_a_checkpoint_written_before_shards_were_safetensors_still_loads() -> None:
    assert sorted(os.listdir(BEFORE / "v000001")) == ["manifest.json", "p0-t0.bin", "p1-t0.bin"]
    assert load(str(BEFORE)) == 5


def test_every_shard_is_a_safetensors_file_that_safetensors_reads_with_an_index_beside_it(tmp_path: Path) -> None:
    from safetensors import safe_open

    version = Path(save(str(tmp_path / "ckpt"), 3))
    assert sorted(os.listdir(version)) == ["manifest.json", "model.safetensors.index.json",
                                           "p0-t0.safetensors", "p1-t0.safetensors"]
    for i in range(2):
        with safe_open(str(version / f"p{i}-t0.safetensors"), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert set(f.keys()) == {f"{i}.weight", f"{i}.bias", f"{i}.weight/momentum_buffer", f"{i}.bias/momentum_buffer"}
            assert all(torch.equal(f.get_tensor(k), torch.full_like(f.get_tensor(k), 3.0)) for k in f.keys())
    index = json.loads((version / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {f"{i}.{n}": f"p{i}-t0.safetensors" for i in range(2) for n in ("weight", "bias")}
    assert index["metadata"]["total_size"] == 2 * (32 * 32 + 32) * 4 and index["metadata"]["step"] == 3


def test_a_load_maps_the_files_copy_on_write_so_training_on_never_changes_the_checkpoint(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    save(directory, 4)
    version, manifest = ck.read_manifest(directory)
    layers = stages(-1.0)
    opt = optimizer_of(layers, -1.0)
    prepared, problems = prepare_load(version, manifest.restrict(held_keys(layers), weights_only=False), layers, {}, 0)
    assert problems == []
    apply_load(prepared, layers, opt, weights_only=False)
    for state in opt.state.values():  # the optimizer's state is the loaded tensors themselves: change them in place
        state["momentum_buffer"].mul_(10)
    assert load(directory) == 4


def test_tensors_of_mixed_sizes_each_begin_at_a_multiple_of_their_own(tmp_path: Path) -> None:
    staging = Path(ck.begin_version(str(tmp_path / "ckpt"), "job0"))
    tensors = {"a": torch.ones(3, dtype=torch.float16), "b": torch.arange(5, dtype=torch.int64),
               "c": torch.ones(3, dtype=torch.bool), "d": torch.full((7,), 2.0)}
    _, parts = ck.write_tensors(str(staging / "p0-t0.safetensors"), tensors)
    for name, tensor in tensors.items():
        assert parts[name].offset % tensor.element_size() == 0
        entry = ck.TensorEntry(shape=list(tensor.shape), dtype=ck.dtype_name(tensor.dtype), shard=None, parts=[parts[name]])
        size = (staging / "p0-t0.safetensors").stat().st_size
        assert torch.equal(ck.read_entry(str(staging), entry, {"p0-t0.safetensors": size}, name), tensor)


def test_a_version_directory_loads_as_itself_not_as_a_directory_of_safetensors_weights(tmp_path: Path) -> None:
    """What job.save returns is the version's path: loading it takes that version, optimizer state and all."""
    version = save(str(tmp_path / "ckpt"), 7)  # beside its manifest: safetensors files and their index
    found, manifest = ck.read_manifest(version)
    assert found == version and manifest.source == ck.FORMAT and manifest.optimizer_state
    assert load(version) == 7


def test_base_model_keys_move_under_the_one_prefix_that_places_them_all_and_nothing_else_moves() -> None:
    entry = ck.TensorEntry(shape=[2], dtype="float32", shard=None,
                           parts=[ck.TensorPart(file="model.safetensors", offset=0, nbytes=8, shape=[2], crc32=None)])

    def files(*keys: str) -> ck.Manifest:
        return ck.Manifest(step=0, optimizer="", files={"model.safetensors": 8}, model=dict.fromkeys(keys, entry),
                           optimizer_state={}, source=ck.SAFETENSORS)

    head = frozenset({"transformer.wte.weight", "transformer.h.0.w", "lm_head.weight"})
    moved, how = files("wte.weight", "h.0.w").under_base_prefix(head)
    assert how == "+transformer." and set(moved.model) == {"transformer.wte.weight", "transformer.h.0.w"}
    moved, how = files("transformer.wte.weight", "transformer.h.0.w").under_base_prefix(frozenset({"wte.weight",
                                                                                                    "h.0.w"}))
    assert how == "-transformer." and set(moved.model) == {"wte.weight", "h.0.w"}
    placed = files("transformer.wte.weight")
    assert placed.under_base_prefix(head) == (placed, "")  # nothing to move
    partly = files("wte.weight", "other.w")  # one prefix must place every key
    assert partly.under_base_prefix(head) == (partly, "")
    both = frozenset({"a.x", "b.x"})  # two prefixes would: which is meant is not known
    assert files("x").under_base_prefix(both) == (files("x"), "")
    collide = files("wte.weight", "transformer.wte.weight", "h.0.w")  # a renamed key the files hold as it is
    assert collide.under_base_prefix(head | {"h.0.w"}) == (collide, "")
    # Keys the model's from_pretrained passes over (the Hub's gpt2 keeps h.N.attn.bias) are left out, and only
    # where no prefix places them: h.0.attn.c_attn.bias matches the pattern 'attn.bias' too, and is placed.
    hub = files("wte.weight", "h.0.attn.bias", "h.0.attn.c_attn.bias")
    model = frozenset({"transformer.wte.weight", "transformer.h.0.attn.c_attn.bias", "lm_head.weight"})
    assert hub.left_unplaced(model) == {"wte.weight", "h.0.attn.bias", "h.0.attn.c_attn.bias"}
    assert hub.under_base_prefix(model) == (hub, "")
    moved, how = hub.under_base_prefix(model, frozenset({"h.0.attn.bias", "h.0.attn.c_attn.bias"}))
    assert how == "+transformer." and set(moved.model) == {"transformer.wte.weight", "transformer.h.0.attn.c_attn.bias"}
    extra = files("transformer.wte.weight", "h.0.attn.bias")  # as it is, but for a key passed over
    assert extra.under_base_prefix(model, frozenset({"h.0.attn.bias"}))[0].model.keys() == {"transformer.wte.weight"}
