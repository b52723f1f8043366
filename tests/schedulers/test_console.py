"""The console, driven as a person drives it: through a pseudo-terminal, against a LocalCluster.

One cluster (head + 2 nodes) serves the module from a background thread; each test
starts ``python -m schedulers.console --connect ADDRESS`` in a pty (pexpect) or, for
``--exec``, as a plain subprocess, and reads what it prints.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pexpect
import pytest

from prompt_toolkit.completion import CompleteEvent
from prompt_toolkit.document import Document
from rich.console import Console

from actors import Event, LocalCluster, NodeInfo, NodeJoined, NodeSilent
from schedulers.deepspeed.config import load_config
from schedulers.events import (
    CheckpointSaved, EarlyStopped, Evaluated, JobFailed, JobRecovered, RunFinished, RunProgress, SettingsApplied, StepFinished,
)
from schedulers.console.commands import execute, split_commands
from schedulers.console.render import event_line, job_detail, plan_lines, schedule_grid
from schedulers.console.repl import ConsoleCompleter
from schedulers.console.session import CommandError, Session
from schedulers.jobs import Checkpointing, Evaluation, JobSpec
from schedulers.records import Candidate, JobDescription, Plan, StepStats
from schedulers.schedules import build_schedule
from transport.loop import run

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "actorpipe>"  # the renderer moves the cursor instead of printing the trailing space
CPR_REQUEST = "\x1b[6n"

SMALL_CONFIG: dict[str, Any] = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,  # so 4 micro-batches
    "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
    "training": {"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 4, "dim": 16, "hidden": 32},
                 "data": "examples.data:regression_batches",
                 "data_kwargs": {"seq": 4, "dim": 16, "learnable": True}},
    "parallelism": {"pipeline_stages": 2, "schedule": "1f1b"},
}


class _ClusterThread:
    """A LocalCluster on its own event loop in a thread, so that the tests can block on pexpect."""

    def __init__(self) -> None:
        self.address = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="local-cluster", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        if not self._ready.wait(90) or self._error is not None:
            raise RuntimeError("the LocalCluster did not start") from self._error
        return self.address

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    def _serve(self) -> None:
        try:
            run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to the fixture
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        local = LocalCluster(nodes=2)
        async with local as cluster:
            # What a person would do with --allow: the hang test names a model under tests.helpers.
            await cluster.admit(["tests.helpers"])
            assert local.keys is not None
            # The consoles these tests start find the cluster's keys as a user's would.
            self.previous_keys = os.environ.get("ACTORPIPE_KEYS")
            os.environ["ACTORPIPE_KEYS"] = local.keys.directory
            self.address = cluster.head.address
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                if self.previous_keys is None:
                    os.environ.pop("ACTORPIPE_KEYS", None)
                else:
                    os.environ["ACTORPIPE_KEYS"] = self.previous_keys


@pytest.fixture(scope="module")
def head_address() -> Iterator[str]:
    with _ClusterThread() as address:
        yield address


class Terminal:
    """The console in a pseudo-terminal: type, and wait for text on the screen.

    What the console writes is read as a person sees it: escape sequences (colours,
    cursor moves) are dropped before matching, so ``schedule`` matches even when
    completion drew ``sched`` and ``ule`` separately. prompt_toolkit asks the
    terminal where its cursor is (CPR) each time it draws a prompt; a real terminal
    answers, and so does this one, so that the bottom bar (which needs the answer)
    is drawn as a person would see it.
    """

    def __init__(self, address: str, tmp_path: Path) -> None:
        env = {**os.environ, "TERM": "xterm", "NO_COLOR": "1", "COLUMNS": "200", "LINES": "50"}
        self.child = pexpect.spawn(
            sys.executable, ["-m", "schedulers.console", "--connect", address, "--history", str(tmp_path / "hist")],
            cwd=str(ROOT), env=env, dimensions=(50, 200), encoding="utf-8", timeout=60)
        self.raw = ""
        self.text = ""  # the screen's text so far, escapes removed
        self.pos = 0  # where the next expect starts looking
        self._answered = 0

    def expect(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        """Waits for ``pattern`` after the last match; returns the match."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.text, self.pos)
            if match is not None:
                self.pos = match.end()
                return match
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} did not appear; the screen ends with:\n{self.text[-3000:]}")
            try:
                self.raw += self.child.read_nonblocking(65536, timeout=0.2)
            except pexpect.TIMEOUT:
                continue
            while self._answered < self.raw.count(CPR_REQUEST):
                self.child.send("\x1b[50;1R")  # the cursor is on the bottom row
                self._answered += 1
            last = self.raw.rfind("\x1b")  # an escape cut in two by the read waits for its end
            complete = self.raw if last < 0 or _ESCAPES.match(self.raw, last) else self.raw[:last]
            self.text = _ESCAPES.sub("", complete)

    def command(self, line: str, *patterns: str) -> list[re.Match[str]]:
        """Types ``line``, waits for each pattern in turn, then for the next prompt."""
        self.child.sendline(line)
        matches = [self.expect(p) for p in patterns]
        self.expect(PROMPT)
        return matches

    def close(self, tmp_path: Path) -> None:
        (tmp_path / "screen.txt").write_text(self.text)  # what the screen showed, for a failure
        if self.child.isalive():
            self.child.terminate(force=True)


_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][A-Z0-9]|\x1b[=>]|\r")


def exec_console(address: str, script: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "schedulers.console", "--connect", address, "--history", "",
                           "--exec", script], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_session_at_the_prompt(head_address: str, tmp_path: Path) -> None:
    config = tmp_path / "small.json"
    config.write_text(json.dumps(SMALL_CONFIG))
    term = Terminal(head_address, tmp_path)
    try:
        term.expect(r"connected to .*: 2 nodes, 0 jobs")
        term.expect(PROMPT)
        term.command("help", r"set JOB KEY VALUE +change micro_batches, schedule", r"plot JOB FILE\.png")
        term.command("help run", r"run JOB N\s+take N steps")
        term.command("nodes", r"node0 +│ alive +│ cpu", r"node1 +│ alive +│ cpu")
        (submitted,) = term.command(f"submit {config}", r"submitted (job\d+): 1f1b, 4 micro-batches")
        job = submitted.group(1)

        # Tab completes the command, then the job's name.
        term.child.send("sched\t")
        term.expect("schedule")
        term.child.send(" \t")
        term.expect(job)
        term.command("", rf"{job}: 1f1b, 2 stages, 4 micro-batches", r"1: -\s+-\s+1RECV_F0")

        # A long run in the background: steps in the feed, a progress bar in the bottom bar.
        term.command(f"run {job} 2000", rf"{job}: running 2000 steps")
        term.expect(rf"{job} step \d+ \[\d+/2000\] 1f1b: loss \d")
        term.expect(rf"{job} \[[#-]+\] \d+/2000 loss")
        # The feed prints above a half-typed line without breaking it.
        term.child.send(f"status {job[:2]}")
        term.expect(rf"{job} step \d+ \[\d+/2000\]")
        term.expect(rf"{job} step \d+ \[\d+/2000\]")
        term.child.send(f"{job[2:]}\r")
        term.expect(rf"{job}: examples.models:residual_mlp \| schedule 1f1b")
        term.expect(PROMPT)
        term.command(f"pause {job}")
        paused_at = int(term.expect(rf"{job} paused before step (\d+)").group(1))
        term.command(f"set {job} activation_codec int8",
                     rf"{job}: activation_codec=int8 set; it applies at the next barrier")
        term.command(f"set {job} schedule gpipe", rf"{job}: schedule=gpipe set; it applies at the next barrier")
        term.command(f"status {job}", r"running \d+/2000 \(paused\)", r"pending until the next barrier: .*schedule=gpipe")
        term.command(f"resume {job}")
        term.expect(rf"{job}: now .*schedule=gpipe.*, from step {paused_at} on")
        term.expect(rf"{job} step {paused_at} \[\d+/2000\] gpipe: loss")  # the very next step ran gpipe
        term.command(f"stop {job}")
        term.expect(rf"{job} run stopped after \d+/2000 steps")
        # Forward only, on the data factory's next batch: the step's trace and the run's position stay.
        term.command(f"eval {job}", rf"{job}: eval loss \d[\d.e+-]* over \d+ samples in [\d.]+s")
        # The data factory's batch 0 is a batch (it was refused: STEP must be >= 1); a flag before ``last``
        # (it was taken for the job: no job 'last').
        term.command(f"eval {job} 0", rf"{job}: eval loss \d[\d.e+-]* over \d+ samples")
        term.command("status --actions last", rf"{job}: examples.models:residual_mlp \| schedule")

        gpipe_row = r"0: 0F0 +0SEND_F0 +0F1 +0SEND_F1 +0F2"  # every forward first: not 1F1B's order
        term.command(f"schedule {job}", rf"{job}: gpipe, 2 stages", gpipe_row)
        term.child.send("\x1b[A")  # history: the same command again
        term.expect(f"schedule {job}")
        term.command("", gpipe_row)
        _, edges = term.command(f"status {job}", r"loss \d+\.\d+, step time [\d.]+ s, [\d.]+ samples/s, bubble [\d.]+%",
                                r"bytes per edge: B 1->0 ([\d.]+) (KiB|B), F 0->1 ([\d.]+) (KiB|B)")
        # int8 activations since the barrier: the forward edge carries a quarter of the raw
        # gradient's tensor bytes, plus message headers that weigh on tensors this small.
        scale = {"B": 1, "KiB": 1024}
        gradient_bytes = float(edges.group(1)) * scale[edges.group(2)]
        activation_bytes = float(edges.group(3)) * scale[edges.group(4)]
        assert activation_bytes < 0.5 * gradient_bytes, edges.group(0)

        trace_path, png_path = tmp_path / "step.json", tmp_path / "step.png"
        # 42 spans: stage 1 splits each B into I and W; each stage's tail is three.
        term.command(f"trace {job} {trace_path}", r"wrote .*: step \d+, 2 tracks, 42 spans, 8 transfers")
        term.command(f"plot {job} {png_path}", rf"wrote {re.escape(str(png_path))}")
        # The console holds the client key: its checkpoints go to its own subtree of the head's root.
        [written] = term.command(f"checkpoint {job} ckpt",
                                 r"checkpoint of step \d+ written to (/\S+/client/ckpt)/v000001")
        checkpoint = Path(written.group(1))
        [exported] = term.command(f"export {job} model", rf"{job}: model written to (/\S+/client/model)")
        term.command(f"close {job}", rf"{job}: closed")
        term.child.sendline("quit")
        term.child.expect(pexpect.EOF, timeout=30)
        term.child.close()
        assert term.child.exitstatus == 0
    finally:
        term.close(tmp_path)

    _check_trace(json.loads(trace_path.read_text()), schedule="gpipe")
    _check_png(png_path)
    assert (checkpoint / "LATEST").read_text() == "v000001\n" and (checkpoint / "v000001" / "manifest.json").is_file()
    assert sorted(os.listdir(exported.group(1))) == ["model-00001-of-00002.safetensors",
                                                     "model-00002-of-00002.safetensors", "model.safetensors.index.json"]


def _check_trace(trace: dict[str, Any], *, schedule: str) -> None:
    """One track per stage, exactly the program's actions as spans then its tail, a flow per transfer."""
    events = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert sorted(tracks.values()) == ["stage 0 (node0)", "stage 1 (node1)"] or \
        sorted(tracks.values()) == ["stage 0 (node1)", "stage 1 (node0)"]
    programs = build_schedule(schedule, 2, 4, split=True)  # as jobs run by default
    for tid, name in tracks.items():
        rank = int(name.split()[1])
        expected = [str(a) for a in programs[rank] if a.kind.value not in ("BARRIER", "REDUCE", "STEP")]
        spans = sorted((e for e in events if e.get("ph") == "X" and e["tid"] == tid), key=lambda e: e["ts"])
        # in program order on the head's clock; then the tail as it ran: reduce, every stage's vote, step
        assert [e["name"] for e in spans] == expected + [f"{rank}REDUCE", f"{rank}BARRIER", f"{rank}STEP"]
        assert all(e["dur"] >= 0 and e["args"]["microbatch"] is not None for e in spans[:-3])
        assert {e["cat"] for e in spans[-3:]} == {"tail"} and spans[-3]["ts"] >= spans[-4]["ts"] + spans[-4]["dur"]
    flows = [e for e in events if e.get("ph") == "s"]
    assert len(flows) == 8 and {e["ph"] for e in events if e.get("cat") == "transfer"} == {"s", "f"}
    assert trace["otherData"]["schedule"] == schedule and set(trace["otherData"]["clock_offsets_s"]) == \
        set(tracks.values())


def _check_png(path: Path) -> None:
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        width, height = image.size
    assert width == 1000 and 150 <= height <= 500


@pytest.mark.slow
@pytest.mark.multiprocess
def test_exec_runs_a_script_of_commands_and_the_example_config(head_address: str, tmp_path: Path) -> None:
    trace_path = tmp_path / "gpt.json"
    done = exec_console(head_address, f"submit examples/gpt_config.json; run last 2; status last; "
                                      f"trace last {trace_path}; eval last; close last")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"submitted job\d+: 1f1b, 4 micro-batches", done.stdout)
    assert re.search(r"job\d+: ran 2/2 steps \(now at step 2\), loss \d", done.stdout)
    assert "examples.models:gpt | schedule 1f1b, 4 micro-batches" in done.stdout
    # the example's validation split (its evaluation section: 4 batches of 32), with its eval_metrics
    assert re.search(r"job\d+: eval loss [\d.]+, accuracy 0?\.\d+ over 128 samples in", done.stdout), done.stdout
    assert "evaluates itself every 100 steps on 4 batches of examples.data:char_batches" in done.stdout
    _check_trace(json.loads(trace_path.read_text()), schedule="1f1b")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_set_micro_batches_applies_at_the_barrier(head_address: str, tmp_path: Path) -> None:
    config = tmp_path / "small.json"
    config.write_text(json.dumps(SMALL_CONFIG))
    done = exec_console(head_address, f"submit {config}; run last 1; set last micro_batches 8; "
                                      "run last 1; status last; schedule last; close last")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"schedule 1f1b, 8 micro-batches", done.stdout)  # the job runs 8 now
    assert re.search(r"0: .*0F7", done.stdout)  # and its programs have micro-batch 7
    assert re.search(r"ran 1/1 steps \(now at step 2\), loss \d", done.stdout)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_submit_a_deepspeed_file_as_it_is_with_a_job_file(head_address: str, tmp_path: Path) -> None:
    ds, job = tmp_path / "ds_config.json", tmp_path / "job.json"
    ds.write_text("""{
      // DeepSpeed's file, unchanged: its switched-off blocks and logging keys are accepted
      "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
      "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
      "fp16": {"enabled": false}, "zero_optimization": {"stage": 0}, "gradient_clipping": 0,
      "steps_per_print": 10, "wall_clock_breakdown": false,
    }""")
    job.write_text(json.dumps({key: SMALL_CONFIG[key] for key in ("training", "parallelism")}))
    done = exec_console(head_address, f"submit {ds} --job {job}; run last 1; close last")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "note: steps_per_print: no effect here" in done.stdout
    assert re.search(r"submitted job\d+: 1f1b, 4 micro-batches", done.stdout)
    assert re.search(r"ran 1/1 steps \(now at step 1\), loss \d", done.stdout)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_exec_fails_at_the_first_command_that_fails(head_address: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**SMALL_CONFIG, "train_batch_size": 30, "gradient_accumulation_steps": 4}))
    scripts = {  # (unknown commands and bad usage are refused before any call: see the fast tests below)
        "missing job": "nodes; status nosuchjob; jobs",
        "bad config": f"submit {bad}",
    }
    with_threads: dict[str, subprocess.CompletedProcess[str]] = {}

    def go(name: str) -> None:
        with_threads[name] = exec_console(head_address, scripts[name])

    threads = [threading.Thread(target=go, args=(name,)) for name in scripts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    results = with_threads
    assert all(r.returncode == 1 for r in results.values()), {k: r.stdout for k, r in results.items()}
    missing = results["missing job"].stdout
    assert "node0" in missing and "error: no job 'nosuchjob'; running:" in missing
    assert "jobs" not in missing.split("error:")[1]  # nothing ran after the failure
    assert "train_batch_size: expected 8 = train_micro_batch_size_per_gpu (2) * gradient_accumulation_steps " \
           "(4) * data_parallel (1), got 30" in results["bad config"].stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_hung_step_reports_where_each_stage_is_stuck(head_address: str, tmp_path: Path) -> None:
    config = tmp_path / "stall.json"
    config.write_text(json.dumps({
        **SMALL_CONFIG, "step_timeout_s": 1.5,
        # Every forward sleeps 3 s: at the timeout stage 0 is still in its first one.
        "training": {**SMALL_CONFIG["training"], "model": "tests.helpers.models:stalling",
                     "model_kwargs": {"layers": 2, "dim": 16, "seconds": 3.0}},
    }))
    done = exec_console(head_address, f"submit {config}; run last 1")
    assert done.returncode == 1
    out = done.stdout
    assert "step timed out after 1.5s" in out
    assert "stage 1 waits at 1RECV_F0: stage 0 never reached 0SEND_F0 (stuck at 0F0)" in out
    assert "stage 0 is computing 0F0 (0 of 16 actions done)" in out
    assert re.search(r"0: >0F0< +0SEND_F0", out) and re.search(r"1: -\s+-\s+>1RECV_F0<", out)


# -- fast: no cluster --------------------------------------------------------------------


class _Offline:
    """Enough of a Session for what needs no cluster: job names for completion and ``last``."""

    def __init__(self, job_ids: list[str]) -> None:
        self.job_ids = job_ids
        self.last_submitted: str | None = None

    resolve_job = Session.resolve_job


class _FakeCluster:
    """Takes a job as the scheduler would, and keeps its spec."""

    def __init__(self, notices: list[str] | None = None) -> None:
        self.specs: list[Any] = []
        self.notices = notices or []

    async def train(self, spec: Any) -> Any:
        self.specs.append(spec)
        return types.SimpleNamespace(id="job7", nodes=["node0", "node1"], bounds=[[0, 2], [2, 4]],
                                     notices=self.notices)

    async def nodes(self) -> list[NodeInfo]:
        return [NodeInfo(name=f"node{i}", address=f"tcp://127.0.0.1:{5000 + i}", device=f"cuda:{i}", host="gpubox",
                         pid=100 + i, memory_bytes=2**30, last_heartbeat_age_s=0.2) for i in range(2)]


class _Submitting(_Offline):
    """A Session whose cluster takes jobs, printing to a string."""

    def __init__(self) -> None:
        super().__init__([])
        self.cluster = _FakeCluster()
        self.text = io.StringIO()
        self.out = Console(file=self.text, width=300)


def _deepspeed_and_job_files(tmp_path: Path) -> tuple[Path, Path]:
    ds, job = tmp_path / "ds.json", tmp_path / "job.json"
    ds.write_text('{"train_batch_size": 8, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, '
                  '"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10,}')
    training = SMALL_CONFIG["training"]
    job.write_text(json.dumps({"model": training["model"], "model_kwargs": training["model_kwargs"],
                               "pipeline_stages": 2}))
    return ds, job


@pytest.mark.parametrize("order", ["after", "before", "equals"])
def test_submit_takes_a_deepspeed_file_and_a_job_file(tmp_path: Path, order: str) -> None:
    ds, job = _deepspeed_and_job_files(tmp_path)
    words = {"after": [str(ds), "--job", str(job)], "before": ["--job", str(job), str(ds)],
             "equals": [str(ds), f"--job={job}"]}[order]
    session = _Submitting()
    asyncio.run(execute(session, ["submit", *words]))  # type: ignore[arg-type]
    assert session.cluster.specs == [load_config(ds, job=job).spec]
    spec = session.cluster.specs[0]
    assert spec.optimization.optimizer[0] == "torch.optim:AdamW"
    assert (spec.optimization.gradient_clipping, spec.parallelism.micro_batches) == (1.0, 4)
    out = session.text.getvalue()
    assert "note: steps_per_print: no effect here" in out
    assert "submitted job7: 1f1b, 4 micro-batches, stages on node0, node1" in out
    assert session.last_submitted == "job7"


def test_submit_prints_what_the_scheduler_warns_about_the_placement(tmp_path: Path) -> None:
    ds, job = _deepspeed_and_job_files(tmp_path)
    session = _Submitting()
    session.cluster.notices = ["node node1 shares cuda:0 on gpubox with this job's node0: ..."]
    asyncio.run(execute(session, ["submit", str(ds), "--job", str(job)]))  # type: ignore[arg-type]
    out = session.text.getvalue()
    assert "submitted job7" in out
    assert "warning: job7: node node1 shares cuda:0 on gpubox with this job's node0" in out


def test_nodes_shows_each_nodes_device() -> None:
    session = _Submitting()
    asyncio.run(execute(session, ["nodes"]))  # type: ignore[arg-type]
    rows = [line for line in session.text.getvalue().splitlines() if "node" in line and "│" in line]
    assert [re.split(r"\s*│\s*", row.strip("│ "))[:3] for row in rows] == [
        ["node0", "alive", "cuda:0"], ["node1", "alive", "cuda:1"]]


def test_submit_lists_every_problem_in_the_files_at_once(tmp_path: Path) -> None:
    ds, job = _deepspeed_and_job_files(tmp_path)
    ds.write_text('{"train_batch_size": 8, "optimizer": {"type": "Lamb"}, "fp16": {"enabled": true}, '
                  '"bf16": {"enabled": true}}')
    with pytest.raises(CommandError) as info:
        asyncio.run(execute(_Submitting(), ["submit", str(ds), "--job", str(job)]))  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(f"2 problems in {ds} with {job}:\n  bf16.enabled: ")
    assert "\n  optimizer.type: Lamb is not available here" in message


@pytest.mark.parametrize(("words", "message"), [
    (["submit", "ds.json", "--job"], "--job needs a file"),
    (["submit", "ds.json", "--jobs", "job.json"], "unknown option '--jobs'"),
    (["submit", "ds.json", "job.json"], r"usage: submit CONFIG.json \[--job JOB.json\]"),
    (["submit", "--job", "a.json", "--job=b.json"], "--job is given twice"),
    (["submit", "no/such/ds.json"], "^no/such/ds.json: No such file or directory$"),
])
def test_submit_with_wrong_arguments_says_how(words: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        asyncio.run(execute(_Submitting(), words))  # type: ignore[arg-type]


def test_a_file_that_does_not_parse_is_named_once(tmp_path: Path) -> None:
    """``submit README.md`` said "README.md: README.md: not valid JSON or hjson: ...";
    a missing file "x.json: [Errno 2] No such file or directory: 'x.json'"."""
    text = tmp_path / "notes.md"
    text.write_text('{"a": 1}\n{"b": 2}\n')
    with pytest.raises(CommandError) as info:
        asyncio.run(execute(_Submitting(), ["submit", str(text)]))  # type: ignore[arg-type]
    assert str(info.value).startswith(f"{text}: not valid JSON or hjson: ") and str(info.value).count(str(text)) == 1


@pytest.mark.parametrize(("line", "expected"), [
    ("jobs", [["jobs"]]),
    ("run job0 5; status job0 --actions", [["run", "job0", "5"], ["status", "job0", "--actions"]]),
    ("trace job0 'my trace.json';;quit;", [["trace", "job0", "my trace.json"], ["quit"]]),
    ("  ", []),
    # Found by review: shlex cut at any '#', so 'trace job0 /tmp/a#b.json' wrote /tmp/a. As in a shell, a '#'
    # starts a comment only at the start of a word, outside quotes.
    ("checkpoint job0 run#1; trace job0 /tmp/a#b.json", [["checkpoint", "job0", "run#1"],
                                                         ["trace", "job0", "/tmp/a#b.json"]]),
    ("jobs  # what runs;status", [["jobs"]]),
    ("trace job0 '# x.json' # the trace", [["trace", "job0", "# x.json"]]),
    ("status;#jobs", [["status"]]),
])
def test_lines_split_into_commands_like_a_shell(line: str, expected: list[list[str]]) -> None:
    assert split_commands(line) == expected


@pytest.mark.parametrize(("words", "message"), [
    (["frobnicate"], "unknown command 'frobnicate'; try 'help'"),
    (["run"], "usage: run JOB N"),
    (["set", "job0", "schedule"], "usage: set JOB KEY VALUE"),
    (["status", "job0", "--actions", "more"], r"usage: status \[JOB\] \[--actions\]"),
    (["run", "last", "5"], "'last' names the job this console submitted last, but it has submitted none"),
])
def test_wrong_commands_are_refused_before_anything_is_asked(words: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        asyncio.run(execute(_Offline([]), words))  # type: ignore[arg-type]


def test_a_command_that_fails_unforeseen_is_an_error_line_and_the_console_serves_on(tmp_path: Path) -> None:
    """Found by review: a number past what the wire carries ('run job0 99999999999999999999999') and a plot to a
    file matplotlib cannot write raised past the console's handlers: a traceback, and the interactive console
    ended. Numbers are bounded now, and any other failure of a command is an error line."""
    from schedulers.console import commands
    from schedulers.console.repl import run_line

    with pytest.raises(CommandError, match=r"N must be <= 1000000000000000, got 99999999999999999999999"):
        asyncio.run(execute(_Offline(["job0"]), ["run", "job0", "99999999999999999999999"]))  # type: ignore[arg-type]

    async def broken(session: Any, args: list[str]) -> None:
        raise ValueError("Format 'xyz' is not supported")

    saved = commands.COMMANDS["jobs"]
    commands.COMMANDS["jobs"] = dataclasses.replace(saved, handler=broken)
    try:
        with pytest.raises(CommandError, match="jobs failed: ValueError: Format 'xyz' is not supported"):
            asyncio.run(run_line(_Offline([]), "jobs; quit"))  # type: ignore[arg-type]
    finally:
        commands.COMMANDS["jobs"] = saved


def test_a_config_with_a_number_no_int_holds_is_a_config_error(tmp_path: Path) -> None:
    from schedulers.deepspeed.config import ConfigError

    config = tmp_path / "ds.json"
    config.write_text('{"train_batch_size": 1e999}')
    with pytest.raises(ConfigError, match="a number it cannot hold"):
        load_config(str(config))


def test_a_nan_loss_shows_as_nan_and_a_stopped_run_as_stopped() -> None:
    """Found by review: a NaN loss showed as '-', as no value does, and a run stopped after 390 of 3000 steps
    as 'finished'."""
    from schedulers.records import RunInfo

    spec = JobSpec.of(model="examples.models:residual_mlp", pipeline_stages=2, micro_batches=4)
    stats = StepStats(step=3, loss=float("nan"), step_time_s=0.1, bubble_fraction=0.0, bytes_sent=0)
    info = JobDescription(job="job0", spec=spec, bounds=[[0, 2], [2, 4]], mesh=[2, 1, 1], nodes=["node0", "node1"],
                          stages=[], steps=4, programs=[["0F0"], ["1F0"]], stepping=False, traced=True,
                          last_stats=stats, run=RunInfo(target=3000, first_step=0, done=390, active=False))
    lines = job_detail(info)
    assert any(line.startswith("step 3: loss nan,") for line in lines)
    assert any(line.startswith("run: ") and line.endswith("390/3000 stopped") for line in lines)
    finished = dataclasses.replace(info, run=RunInfo(target=3000, first_step=0, done=3000, active=False))
    assert any(line.endswith("3000/3000 finished") for line in job_detail(finished))


def test_stop_says_when_there_is_no_run_to_stop() -> None:
    """Found by review: 'stop JOB' on a run that had already failed said 'stopping after the step in progress'."""
    from schedulers.records import RunInfo

    spec = JobSpec.of(model="examples.models:residual_mlp", pipeline_stages=2, micro_batches=4)
    runs = {"job0": RunInfo(target=3000, first_step=0, done=12, active=False, error="step 12 failed"),
            "job1": RunInfo(target=3000, first_step=0, done=390, active=True, stopping=True), "job2": None}

    class Stoppable(_Submitting):
        async def job(self, job_id: str) -> Any:
            async def stop() -> JobDescription:
                return JobDescription(job=job_id, spec=spec, bounds=[[0, 2], [2, 4]], mesh=[2, 1, 1], nodes=["n0"],
                                      stages=[], steps=12, programs=[], stepping=False, traced=True,
                                      run=runs[job_id])
            return types.SimpleNamespace(stop=stop)

        reporting = Session.reporting

    session = Stoppable()
    session.job_ids = list(runs)
    for job_id in runs:
        asyncio.run(execute(session, ["stop", job_id]))  # type: ignore[arg-type]
    assert session.text.getvalue().splitlines() == [
        "job0: its run already failed after 12/3000 steps; nothing to stop",
        "job1: stopping after the step in progress", "job2: no run; nothing to stop"]


def test_an_unclosed_quote_is_refused() -> None:
    with pytest.raises(CommandError, match="No closing quotation"):
        split_commands("trace job0 'unclosed")


@pytest.mark.parametrize(("typed", "expected"), [
    ("", ["checkpoint", "close", "eval", "exit", "export", "help", "jobs", "nodes", "pause", "plot", "quit", "resume", "run",
          "schedule", "set", "status", "stop", "submit", "trace", "wait"]),
    ("sch", ["schedule"]),
    ("run job", ["job0", "job12"]),
    ("pause job1", ["job12"]),
    ("status ", ["job0", "job12", "--actions"]),
    ("status job0 ", ["--actions"]),
    ("set job0 ", ["micro_batches", "schedule", "activation_codec", "gradient_codec", "lr"]),
    ("set job0 schedule ", ["gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev", "auto"]),
    ("set job0 gradient_codec in", ["int8", "int4"]),
    ("help pa", ["pause"]),
    ("jobs; res", ["resume"]),
    ("run job0 5 ", []),
    ("submit ds.json ", ["--job"]),
])
def test_tab_completes_commands_jobs_keys_and_values(typed: str, expected: list[str]) -> None:
    completer = ConsoleCompleter(_Offline(["job0", "job12"]))  # type: ignore[arg-type]
    found = [c.text for c in completer.get_completions(Document(typed, len(typed)), CompleteEvent())]
    assert sorted(found) == sorted(expected)


def test_tab_completes_paths(tmp_path: Path) -> None:
    (tmp_path / "gpt_config.json").write_text("{}")
    completer = ConsoleCompleter(_Offline([]))  # type: ignore[arg-type]
    typed = f"submit {tmp_path}/gpt_"
    found = [c.text for c in completer.get_completions(Document(typed, len(typed)), CompleteEvent())]
    assert found == ["config.json"]


STEP = {"job": "job0", "step": 4, "loss": 1.5, "step_time_s": 0.0421, "bubble_fraction": 0.25, "schedule": "1f1b"}


@pytest.mark.parametrize(("event", "line"), [
    (NodeJoined(node="n2"), "+ node n2 joined"),
    (NodeSilent(node="n1", silent_s=2.31), "! node n1 lost (silent 2.3 s)"),
    (StepFinished(**STEP, run=RunProgress(done=5, target=10)), "job0 step 4 [5/10] 1f1b: loss 1.5000, 0.042 s, bubble 25%"),
    (StepFinished(**STEP, lr=[0.00025, 0.00025]), "job0 step 4 1f1b: loss 1.5000, 0.042 s, bubble 25%, lr 0.00025"),
    (StepFinished(**STEP, lr=[0.1, 0.01], skipped=True),
     "job0 step 4 1f1b: loss 1.5000, 0.042 s, bubble 25%, lr 0.1/0.01 (skipped: not finite, nothing applied)"),
    (JobFailed(job="job0", step=3, error="step failed: stage 1 at 1F2: boom"),
     "! job0 step 3 failed: step failed: stage 1 at 1F2: boom"),
    (SettingsApplied(job="job0", step=7, changes={"schedule": "gpipe"}), "job0: now schedule=gpipe, from step 7 on"),
    (RunFinished(job="job0", done=3, target=10, reason="stopped"), "job0 run stopped after 3/10 steps"),
    (JobRecovered(job="job0", lost=["node1"], moved={"node1": "spare0"}, from_step=3, replayed=1, from_checkpoint=None,
                  seconds=1.04, restarts_left=0),
     "* job0 recovered: node1 -> spare0; rolled back to step 3, replaying 1 in 1.0 s (0 restarts left)"),
    (CheckpointSaved(job="job0", step=500, version="/runs/gpt/v000002"),
     "job0 saved itself after step 500: /runs/gpt/v000002"),
    (CheckpointSaved(job="job0", step=600, version="/runs/gpt/v000003", best=True),
     "job0 saved itself after step 600: /runs/gpt/v000003 (its best evaluation so far: kept)"),
    (Evaluated(job="job0", step=500, loss=1.23456, items=256.0, batches=8, eval_time_s=0.412, periodic=True,
               validation=True, metrics={"accuracy": 0.53125}),
     "job0 evaluated on validation (8 batches) after step 500: loss 1.2346, accuracy 0.5312 (0.41 s)"),
    (Evaluated(job="job0", step=3, loss=2.0, items=8.0, batches=1, eval_time_s=0.05),
     "job0 evaluated on a batch after step 3: loss 2.0000 (0.05 s)"),
    (EarlyStopped(job="job0", step=900, metric="loss", best=1.25, best_step=600, patience=3),
     "job0 stops early after step 900: loss did not improve for 3 evaluations (best 1.25 after step 600)"),
    (Event(), None),  # a kind this console does not know
])
def test_events_print_as_one_line(event: Event, line: str | None) -> None:
    assert event_line(event) == line


def test_a_plans_candidates_line_up_in_columns_whatever_their_labels() -> None:
    # W batching's labels ("interleaved x4 +wbatch") are longer than the plain ones: the columns once
    # shifted by two characters on their rows.
    candidates = [Candidate(schedule="zero_bubble", predicted_step_s=1.753, bubble_fraction=0.099, stash=[2, 2],
                            stash_bytes=[40 << 20, 40 << 20], chosen=True),
                  Candidate(schedule="interleaved", virtual_stages=4, w_batching=True, predicted_step_s=1.86,
                            bubble_fraction=0.06, stash=[32, 32], stash_bytes=[160 << 20, 160 << 20], runnable=False),
                  Candidate(schedule="1f1b", predicted_step_s=12.5, bubble_fraction=0.125, stash=[2, 1],
                            stash_bytes=[40 << 20, 20 << 20])]
    lines = plan_lines(Plan(job="job0", schedule="auto", running="zero_bubble", state="planned",
                            candidates=candidates, chosen="zero_bubble"))
    header, rows = lines[1], lines[2:5]
    assert [row.split()[1 if row.startswith("*") else 0] for row in rows] == ["zero_bubble", "interleaved", "1f1b"]
    assert {row.index(" s ") + len(" s") for row in rows} == {header.index("predicted") + len("predicted")}
    assert {row.index("%") for row in rows} == {header.index("bubble") + len("bubble") - 1}


def test_a_jobs_detail_reads_its_settings_from_the_specs_sections() -> None:
    spec = JobSpec.of(model="examples.models:residual_mlp", pipeline_stages=2, micro_batches=4,
                      activation_codec="int8", precision="bf16", schedule="gpipe")
    stats = StepStats(step=0, loss=1.0, step_time_s=0.1, bubble_fraction=0.0, bytes_sent=0, grad_norm=0.5)
    info = JobDescription(job="job0", spec=spec, bounds=[[0, 2], [2, 4]], mesh=[2, 1, 1], nodes=["node0", "node1"],
                          stages=[], steps=1, programs=[["0F0"], ["1F0"]], stepping=False, traced=True,
                          last_stats=stats)
    first, *rest = job_detail(info)
    assert first.startswith("job0: examples.models:residual_mlp | schedule gpipe, 4 micro-batches | 2 stages")
    assert "codecs int8/none" in first
    assert any("precision bf16" in line for line in rest)
    assert not any("saves itself" in line for line in rest)
    assert schedule_grid(info).startswith("job0: gpipe, 2 stages, 4 micro-batches")
    saving = dataclasses.replace(info, spec=dataclasses.replace(spec, checkpointing=Checkpointing(
        checkpoint_dir="runs/gpt", checkpoint_every=500, keep_checkpoints=3)))
    assert "saves itself every 500 steps into runs/gpt, keeping the newest 3" in job_detail(saving)
    best = dataclasses.replace(info, spec=dataclasses.replace(
        spec, checkpointing=Checkpointing(checkpoint_dir="runs/gpt", checkpoint_every=500, keep_checkpoints=3,
                                          keep_best=True),
        evaluation=Evaluation(eval_data="examples.data:char_batches", eval_every=100)),
        best_checkpoint="/runs/gpt/v000002")
    assert job_detail(best)[-3:-1] == ["saves itself every 500 steps into runs/gpt, keeping the newest 3 and the best",
                                       "best checkpoint: /runs/gpt/v000002"]
    assert not any("evaluates itself" in line for line in rest)
    checking = dataclasses.replace(info, spec=dataclasses.replace(spec, evaluation=Evaluation(
        eval_data="examples.data:char_batches", eval_every=100, eval_batches=8)))
    assert "evaluates itself every 100 steps on 8 batches of examples.data:char_batches" in job_detail(checking)
    evaluated = dataclasses.replace(checking, last_eval=Evaluated(job="job0", step=300, loss=1.5, items=64.0, batches=8,
                                                                  eval_time_s=0.25, periodic=True, validation=True))
    assert job_detail(evaluated)[-1] == "last evaluated on validation (8 batches) after step 300: loss 1.5000 (0.25 s)"


def test_the_toolbar_names_the_heads_endpoint_without_its_key_and_shows_each_run() -> None:
    from schedulers.console.repl import _toolbar
    from schedulers.console.session import RunView

    key = "ab" * 32
    session = types.SimpleNamespace(
        address=f"ipc:///tmp/actorpipe-cluster-x/head|{key}|ipc:///tmp/actorpipe-cluster-x/head.bulk",
        num_nodes=2, job_ids=["job0"], runs={"job0": RunView(done=3, target=20, active=True, loss=0.25)})
    bar = _toolbar(session)  # type: ignore[arg-type]
    assert bar.startswith(" ipc:///tmp/actorpipe-cluster-x/head | 2 nodes | 1 jobs | job0 [")
    assert key not in bar and ".bulk" not in bar and "3/20 loss 0.250" in bar


async def test_the_console_says_why_it_cannot_reach_a_head_in_its_own_flags(tmp_path: Path) -> None:
    """It said "cannot reach the head at ADDRESS: no reply from head.nodes at ADDRESS|<key>|<bulk> within
    10.0s; is `python -m actors.node --head` running there?" whatever the cause."""
    from schedulers.console.session import open_session

    with pytest.raises(CommandError, match=r"^the head at tcp://127.0.0.1:1 is secure \(its address carries its "
                                           r"public key\): run the console with --keys DIR"):
        async with open_session(f"tcp://127.0.0.1:1|{'ab' * 32}", Console(), interactive=False, insecure=True):
            pass
    with pytest.raises(CommandError, match=r"^cannot reach the head: no reply from head.nodes at ipc://.* within "
                                           r"0.3s: nothing listens there: there is no socket file"):
        async with open_session(f"ipc://{tmp_path}/head", Console(), interactive=False, insecure=True, timeout=0.3):
            pass
