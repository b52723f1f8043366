"""The scheduler actor: job placement, data paths, checkpoints, and failures that name their cause."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from actors import ActorStopped, Cluster, LocalCluster, NotAllowed, RemoteError, StepFailed, UnknownActor
from examples.data import regression_batches
from examples.models import residual_mlp
from schedulers.job_actor import JobActor
from tests.helpers.models import image_batches
from tests.helpers.import_marker import IMPORT_LOG_ENV

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.asyncio(loop_scope="module")]

SMALL = {"blocks": 4, "dim": 16, "hidden": 32}


_KEYS: list[str] = []  # the module cluster's key directory


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster() -> AsyncIterator[Cluster]:
    local = LocalCluster(nodes=2)
    async with local as cluster:
        assert local.keys is not None
        _KEYS[:] = [local.keys.directory]
        yield cluster


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, 16, generator=gen), torch.randn(8, 4, 16, generator=gen)


async def test_stage_that_raises_fails_the_step_with_stage_action_and_cause(cluster: Cluster) -> None:
    job = await cluster.train(model="tests.helpers.models:exploding", model_kwargs={"at": 3},
                              pipeline_stages=2, micro_batches=4, schedule="1f1b")
    try:
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        before = await job.state_dict()
        with pytest.raises(StepFailed) as info:
            await job.step(x, y)  # layer 3 lives on stage 1 and raises on its third forward: 1F2
        error = info.value
        assert error.stage == 1 and error.action == "1F2"
        assert "RuntimeError: boom on call 3" in error.cause
        assert "boom on call 3" in str(error) and "helpers/models.py" in error.remote_traceback
        after = await job.state_dict()
        for key in before:  # nothing was applied anywhere
            assert torch.equal(before[key], after[key])
        stats = await job.step(x, y)  # the job goes on: the next step works
        assert stats.step == 1 and stats.loss > 0
    finally:
        await job.close()


async def test_each_job_has_an_actor_that_closing_the_job_stops(cluster: Cluster) -> None:
    job = await cluster.train(model="examples.models:residual_mlp", model_kwargs=SMALL, pipeline_stages=2,
                              micro_batches=4)
    assert job.ref.name == f"{job.id}.control" and job.ref.address == cluster.head.address
    again = await cluster.job(job.id)  # found by id: the same actor
    assert again.ref == job.ref and again.spec == job.spec and again.nodes == job.nodes
    assert (await again.step(*batch())).step == 0
    await job.close()
    with pytest.raises(UnknownActor, match=f"no actor named '{job.id}.control'"):
        await job.ref.endpoint(JobActor.describe, timeout=10).call()
    await job.close()  # twice is fine
    with pytest.raises(UnknownActor, match=f"job '{job.id}' is closed: its actor is no longer on the head"):
        await again.step(*batch())  # not the actor's name at an address of keys and sockets
    assert job.id not in [d.job for d in await cluster.jobs()]
    with pytest.raises(RemoteError, match=f"no job '{job.id}'"):
        await cluster.job(job.id)


async def test_a_step_in_flight_when_its_job_closes_fails_at_once(cluster: Cluster) -> None:
    """Found by a driver that closed a job from one task while another awaited ``job.step``: the close
    cancelled the step on the head, no answer came back, and the step waited out its timeout
    (``step_timeout_s`` + 60 s: 11 minutes by default). It now fails as soon as the job closes."""
    job = await cluster.train(model="tests.helpers.models:stalling", model_kwargs={"seconds": 1.0},
                              pipeline_stages=2, micro_batches=2)
    step = asyncio.ensure_future(job.step(torch.randn(4, 8), torch.randn(4, 8)))
    while not (await job.describe()).stepping:  # the stages sleep a second in every forward
        await asyncio.sleep(0.01)
    await job.close()
    with pytest.raises(ActorStopped, match="JobActor.step on '.*' was cancelled before it answered"):
        await step


async def test_stages_can_read_their_own_data(cluster: Cluster) -> None:
    data_kwargs = {"batch_size": 8, "seq": 4, "dim": 16, "seed": 3}
    job = await cluster.train(model="examples.models:residual_mlp", model_kwargs=SMALL,
                              optimizer=("torch.optim:SGD", {"lr": 0.1}), pipeline_stages=2, micro_batches=4,
                              data="examples.data:regression_batches", data_kwargs=data_kwargs)
    try:
        losses = [(await job.step()).loss for _ in range(2)]
        state = await job.state_dict()
    finally:
        await job.close()
    torch.manual_seed(0)
    model = residual_mlp(**SMALL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    read = regression_batches(**data_kwargs)
    expected = []
    for step in range(2):
        x, y = read(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)


async def test_load_state_dict_save_and_load(cluster: Cluster, tmp_path: object) -> None:
    job = await cluster.train(model="examples.models:residual_mlp", model_kwargs=SMALL, pipeline_stages=2,
                              micro_batches=2, seed=1)
    try:
        torch.manual_seed(7)
        other = residual_mlp(**SMALL).state_dict()
        await job.load_state_dict(other)
        loaded = await job.state_dict()
        assert all(torch.equal(loaded[k], other[k]) for k in other)
        directory = f"{tmp_path}/ckpt"
        await job.save(directory)
        assert sorted(os.listdir(directory)) == ["LATEST", "v000001"]
        await job.step(*batch())
        await job.save(directory)  # replaces it atomically
        assert sorted(os.listdir(directory)) == ["LATEST", "v000002"]  # no staging left behind
        trained = await job.state_dict()
        await job.load_state_dict(other)
        await job.load(directory)
        restored = await job.state_dict()
        assert all(torch.equal(restored[k], trained[k]) for k in trained)
        with pytest.raises(RemoteError, match="keys no stage holds"):
            await job.load_state_dict({**other, "99.weight": torch.zeros(1)})
        # Found by review: AttributeError ('str' object has no attribute 'detach'), from inside the client.
        with pytest.raises(TypeError, match="takes a map of names to tensors"):
            await job.load_state_dict(None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="'0.norm.weight' is a str to a str"):
            await job.load_state_dict({**other, "0.norm.weight": "b"})  # type: ignore[dict-item]
        # Load errors name keys as the whole model has them: layer index first.
        restored = await job.state_dict()
        wrong = next(k for k in other if k.startswith("3.") and k.endswith("weight") and other[k].dim() == 2)
        with pytest.raises(RemoteError, match=f"{re.escape(wrong)}: expected shape"):
            await job.load_state_dict({**other, wrong: torch.zeros(1, 1)})
        with pytest.raises(RemoteError, match=f"layer 3: missing \\['{re.escape(wrong)}'\\]"):
            await job.load_state_dict({k: v for k, v in other.items() if k != wrong})
        # All or nothing: a key of the last stage refused, and the first stage, whose part was good, took
        # nothing either (it took its part before, found by review).
        moved = {k: v + 1 for k, v in other.items()}
        with pytest.raises(RemoteError, match=f"{re.escape(wrong)}: expected shape"):
            await job.load_state_dict({**moved, wrong: torch.zeros(1, 1)})
        after = await job.state_dict()
        assert all(torch.equal(v, restored[k]) for k, v in after.items())
    finally:
        await job.close()


async def test_batch_that_does_not_split_is_a_clear_error(cluster: Cluster) -> None:
    job = await cluster.train(model="examples.models:residual_mlp", model_kwargs=SMALL, pipeline_stages=2,
                              micro_batches=3)
    try:
        x, y = batch()
        with pytest.raises(RemoteError, match="a batch of 2 samples cannot give 3 micro-batches"):
            await job.step(x[:2], y[:2])
        with pytest.raises(RemoteError, match=r"step\(\) needs inputs and targets"):
            await job.step()
        with pytest.raises(RemoteError, match=r"evaluate\(\) needs inputs and targets"):  # it said step()
            await job.evaluate()
        # A float64 batch for a float32 model: torch says only "mixed dtype"; the step's error says which.
        with pytest.raises(StepFailed, match=r"stage 0 at 0F0: .*\(the batch's floating tensors are float64 and "
                                             r"the first stage's parameters float32: cast the batch "
                                             r"\(inputs\.to\(torch\.float32\)\)"):
            await job.step(x.double(), y)
        # Targets of another length failed at the last micro-batch's loss; now before anything runs.
        with pytest.raises(ValueError, match="inputs hold 8 samples and targets 7"):
            await job.step(x, y[:7])
        assert (await job.step(x, y)).loss > 0  # and the job goes on
        # Found by review: a batch refused at the head used up a step number the stages never heard of, and
        # a stage takes deliveries for its current step or the next: the next step's activations could be
        # refused, and it waited out step_timeout_s (7 times in 12). No number is used up now.
        before = (await job.step(x, y)).step
        for _ in range(3):
            with pytest.raises(RemoteError, match="cannot give 3 micro-batches"):
                await job.step(x[:2], y[:2])
        assert (await job.step(x, y)).step == before + 1
    finally:
        await job.close()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"pipeline_stages": 3}, "needs 3 nodes .* has 2 alive"),
        # The spec's own name, not the partitioner's num_stages; with each rank's virtual stages counted.
        ({"pipeline_stages": 2, "model_kwargs": {"blocks": 1}},
         r"has 1 layers, too few for 2 model stages \(parallelism.pipeline_stages=2\).*use at most 1 pipeline stages$"),
        ({"pipeline_stages": 2, "schedule": "interleaved", "micro_batches": 2, "model_kwargs": {"blocks": 3}},
         r"3 layers, too few for 4 model stages \(parallelism.pipeline_stages=2 x 2 virtual stages each "
         r"\(interleaved\)\).*use at most 1 pipeline stages or a schedule without virtual"),
    ],
)
async def test_jobs_the_cluster_cannot_hold_are_refused_with_a_clear_error(cluster: Cluster, kwargs: dict, match: str) -> None:
    spec = {"model": "examples.models:residual_mlp", "model_kwargs": SMALL, "pipeline_stages": 1, **kwargs}
    with pytest.raises(ValueError, match=match) as refused:  # a ValueError at the head: one here too
        await cluster.train(**spec)
    assert isinstance(refused.value, RemoteError) and refused.value.remote_type == "ValueError"


async def test_factory_outside_the_allow_list_is_refused_with_how_to_admit_it(cluster: Cluster) -> None:
    # A client of the cluster without the LocalCluster's admission token: as on a hand-started cluster.
    async with Cluster.connect(cluster.head.address, keys=_KEYS[0]) as stranger:
        # The allow-list is checked before anything is imported, so the module need not exist.
        with pytest.raises(NotAllowed, match="start the node with --allow tests.not_admitted"):
            await stranger.train(model="tests.not_admitted:linear_stack", pipeline_stages=1)
        with pytest.raises(NotAllowed, match="--allow os"):
            await stranger.train(model="os:system", pipeline_stages=1)


async def test_a_factory_path_that_escapes_the_allow_list_is_refused_before_anything_runs(
    cluster: Cluster, tmp_path: Path
) -> None:
    marker = tmp_path / "marker.txt"
    jobs_before = await cluster.jobs()
    # The probe's bypass: torch.nn is admitted, and the path walks from it to os.system.
    with pytest.raises(NotAllowed, match=r"node node\d refused the model: .*may not pass through modules"):
        await cluster.train(model="torch.nn:functional.torch.os.system",
                            model_kwargs={"command": f"touch {marker}"}, pipeline_stages=1)
    assert not marker.exists()
    assert await cluster.jobs() == jobs_before


async def test_a_factory_the_nodes_cannot_import_names_the_node_its_folder_and_pythonpath(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Importable by the driver (its sys.path has tmp_path) but not from the nodes' working directory.
    (tmp_path / "driver_only_models.py").write_text("import torch\ndef mlp():\n    return torch.nn.Sequential("
                                                     "torch.nn.Linear(4, 4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RemoteError) as refused:
        await cluster.train(model="driver_only_models:mlp", pipeline_stages=1)
    assert refused.value.remote_type == "ModuleNotFoundError"
    message = refused.value.message
    assert re.search(r"node node\d cannot build the model: .*No module named 'driver_only_models'", message)
    assert f"this process runs in {os.getcwd()} with PYTHONPATH=" in message and "add that folder to PYTHONPATH" \
        in message


@pytest.mark.parametrize(("settings", "raised", "where"), [
    ({"model": "tests.helpers.models:raising_model"}, "RuntimeError: the user's model factory broke",
     r"\(in the model factory tests\.helpers\.models:raising_model; on node node\d, which the head asked to count "
     r"the model's layers\)$"),
    ({"data": "tests.helpers.models:raising_data"}, "RuntimeError: the user's data factory broke",
     r"\(in the data factory tests\.helpers\.models:raising_data; building stage \d of job job\d+ on node node\d "
     r"\(a worker\)\)$"),
    ({"optimizer": ("torch.optim:SGD", {"lrr": 0.1})}, "TypeError: SGD.__init__() got an unexpected keyword argument",
     r"\(in the optimizer torch\.optim:SGD with \{'lrr': 0\.1\}; building stage \d of job job\d+ on node node\d "
     r"\(a worker\)\)$"),
], ids=["model", "data", "optimizer"])
async def test_an_error_in_the_jobs_own_code_names_the_callable_and_where_it_ran(
        cluster: Cluster, settings: dict[str, Any], raised: str, where: str) -> None:
    jobs_before = await cluster.jobs()
    with pytest.raises(RemoteError) as refused:
        await cluster.train(**{"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 2, "dim": 8},
                               "micro_batches": 2, "pipeline_stages": 2, **settings})
    assert f"{refused.value.remote_type}: {refused.value.message}".startswith(raised), refused.value
    assert re.search(where, refused.value.message), refused.value.message
    assert await cluster.jobs() == jobs_before


async def test_a_model_that_is_not_a_sequential_is_refused_with_what_to_do(cluster: Cluster) -> None:
    with pytest.raises(RemoteError) as refused:
        await cluster.train(model="tests.helpers.models:two_layer_net", pipeline_stages=2)
    assert refused.value.remote_type == "TypeError"
    assert "built a TwoLayerNet, not an nn.Sequential, a list of layers or of LayerSpec" in refused.value.message
    assert "Return nn.Sequential(...)" in refused.value.message


async def test_type_partitioning_balances_the_layers_of_a_class(cluster: Cluster) -> None:
    gpt = {"model": "examples.models:gpt", "model_kwargs": {"dim": 16, "layers": 4, "heads": 2, "context": 8},
           "loss": "examples.models:lm_loss", "pipeline_stages": 2, "micro_batches": 2}
    # Embedding, 4 transformer blocks, head: two blocks a stage, whatever the embedding and head weigh.
    job = await cluster.train(**gpt, partition_method="type:transformerblock")
    try:
        assert job.bounds == [[0, 3], [3, 6]]
    finally:
        await job.close()
    with pytest.raises(RemoteError, match="matches 0 of the model's 6 layers"):
        await cluster.train(**gpt, partition_method="type:^Conv")
    with pytest.raises(ValueError, match="not a regular expression"):
        await cluster.train(**gpt, partition_method="type:(")


async def test_parameter_partitioning_counts_the_parameters_that_train_as_deepspeed_does(cluster: Cluster) -> None:
    # A 16,000-parameter frozen embedding, then four 272-parameter Linears: counted whole, the embedding
    # alone made a stage; it trains nothing, so it weighs nothing.
    job = await cluster.train(model="tests.helpers.models:frozen_embedding_chain", pipeline_stages=2,
                              micro_batches=2, partition_method="parameters")
    try:
        assert job.bounds == [[0, 3], [3, 5]]
    finally:
        await job.close()


async def test_profile_partitioning_balances_compute_where_parameter_counts_do_not(cluster: Cluster) -> None:
    spin = {"model": "tests.helpers.models:spin_chain", "data": "examples.data:regression_batches",
            "data_kwargs": {"batch_size": 8, "seq": 2, "dim": 8}, "pipeline_stages": 2, "micro_batches": 2}
    bounds = {}
    for method in ("parameters", "profile"):
        job = await cluster.train(**spin, partition_method=method)
        try:
            stats = await job.step()
            bounds[method] = job.bounds
            assert len(stats.busy_s) == 2
        finally:
            await job.close()
    # Four layers of equal CPU cost (a Python loop), then two wide linears with nearly every parameter.
    assert bounds["parameters"] == [[0, 5], [5, 6]]
    # By the CPU time each layer spends, two heavy layers a stage. Moving the split takes one heavy layer
    # measured at twice another's (the fastest of five runs each): not what a busy machine does to CPU time.
    assert 1 <= bounds["profile"][0][1] <= 3
    cnn = {"model": "tests.helpers.models:skewed_cnn", "pipeline_stages": 2, "micro_batches": 2}
    # A job fed by the driver profiles on the micro-batch it gives, without a data factory.
    sample = image_batches()(0)[0][:8]
    job = await cluster.train(**cnn, partition_method="profile", example_inputs=sample)
    try:
        assert 1 <= job.bounds[0][1] <= 9  # any split: what it measures, a busy machine moves (see above)
    finally:
        await job.close()
    with pytest.raises(ValueError, match="profile' times each layer on a sample micro-batch"):
        await cluster.train(model="tests.helpers.models:skewed_cnn", pipeline_stages=2, partition_method="profile")


async def test_the_head_never_imports_the_model_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "imports.log"
    monkeypatch.setenv(IMPORT_LOG_ENV, str(log))  # before the cluster starts: its processes inherit it
    lc = LocalCluster(nodes=2)
    async with lc as cluster:
        job = await cluster.train(model="tests.helpers.import_marker:linear_stack", model_kwargs={"layers": 4},
                                  pipeline_stages=2, micro_batches=2, partition_method="parameters")
        try:
            assert job.bounds == [[0, 2], [2, 4]]
            await job.step(torch.randn(4, 16), torch.randn(4, 16))
        finally:
            await job.close()
        importers = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
        head = lc.processes["head"].pid
        # Each node started a session of its own: the processes it hosts its stages in are in its group.
        assert head not in {pid for pid, _ in importers} and head not in {group for _, group in importers}
        assert {lc.processes["node0"].pid, lc.processes["node1"].pid} <= {group for _, group in importers}


async def test_a_preloaded_module_is_imported_once_by_the_zygote_and_never_by_a_stage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without --preload each job's stage process imports its model's module itself (one line a job,
    # as the test above shows); with it, the node's zygote imports it once and forks every stage with it.
    log = tmp_path / "imports.log"
    monkeypatch.setenv(IMPORT_LOG_ENV, str(log))
    lc = LocalCluster(nodes=1, preload=["tests.helpers.import_marker"])
    async with lc as cluster:
        for _ in range(2):
            job = await cluster.train(model="tests.helpers.import_marker:linear_stack", model_kwargs={"layers": 2},
                                      micro_batches=2)
            try:
                await job.step(torch.randn(4, 16), torch.randn(4, 16))
            finally:
                await job.close()
        importers = [int(line.split()[0]) for line in log.read_text().splitlines()]
        assert len(importers) == 1, importers
        # The one importer is the zygote: the node's child, alive after both jobs' stages are gone.
        with open(f"/proc/{importers[0]}/stat") as stat:
            parent = int(stat.read().rpartition(")")[2].split()[1])
        assert parent == lc.processes["node0"].pid


async def test_node_lost_mid_step_fails_the_step_promptly() -> None:
    lc = LocalCluster(nodes=2, heartbeat_timeout=1.0)
    async with lc as cluster:
        job = await cluster.train(model="tests.helpers.models:stalling", model_kwargs={"seconds": 0.5},
                                  pipeline_stages=2, micro_batches=8, schedule="gpipe")
        victim = lc.processes[job.nodes[1]].pid
        step = asyncio.ensure_future(job.step(torch.randn(8, 8), torch.randn(8, 8)))
        await asyncio.sleep(1.0)
        started = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(StepFailed) as info:
            await asyncio.wait_for(step, 30)
        assert time.monotonic() - started < 10
        assert info.value.stage == 1 and "lost" in info.value.cause


async def test_stages_answer_control_calls_while_they_compute(cluster: Cluster) -> None:
    job = await cluster.train(model="tests.helpers.models:stalling", model_kwargs={"seconds": 0.3},
                              pipeline_stages=2, micro_batches=4, schedule="gpipe")
    try:
        step = asyncio.ensure_future(job.step(torch.randn(8, 8), torch.randn(8, 8)))
        await asyncio.sleep(0.5)
        stage0 = cluster.runtime.ref(*(await cluster.jobs())[0].stages[0])
        started = time.monotonic()
        progress = await stage0.ask("progress", timeout=5)
        assert time.monotonic() - started < 0.25  # answered between two 0.3 s forwards
        assert progress.current is not None and not step.done()
        assert all(n.alive for n in await cluster.nodes())
        await step
    finally:
        await job.close()


async def test_failure_in_one_replica_fails_the_step_everywhere_and_names_it(cluster: Cluster) -> None:
    job = await cluster.train(model="tests.helpers.models:guarded", pipeline_stages=1, data_parallel=2,
                              micro_batches=2, optimizer=("torch.optim:SGD", {"lr": 0.1}))
    try:
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        before = await job.state_dict()
        bad = x.clone()
        bad[6] = float("nan")  # in the second half: replica 1's shard, its micro-batch 1
        with pytest.raises(StepFailed, match="stage 0 dp 1 at 0F1: ValueError: non-finite input") as info:
            await job.step(bad, y)
        assert info.value.details["data"] == 1 and info.value.action == "0F1"
        after = await job.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # no replica stepped
        await job.step(x, y)  # both replicas carry on in step
    finally:
        await job.close()


def _descendants() -> set[int]:
    """This process's descendants (the cluster's head, nodes and their stage processes), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):  # ended meanwhile
                continue
            parents.setdefault(parent, []).append(int(entry))
    found, todo = set(), [os.getpid()]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


async def _until_gone(cluster: Cluster, jobs: set[str], processes: set[int]) -> tuple[set[str], set[int]]:
    """The cluster's jobs and processes once they are back to ``jobs`` and ``processes`` (or after a minute)."""
    for _ in range(600):
        now = {j.job for j in await cluster.jobs()}, _descendants()
        if now == (jobs, processes):
            break
        await asyncio.sleep(0.1)
    return now


def _gated(tmp_path: Path) -> dict[str, Any]:
    """A job whose stages build until the test opens ``tmp_path/gate`` (their data factory waits for it)."""
    return {"model": "examples.models:residual_mlp", "model_kwargs": {"blocks": 2, "dim": 8}, "pipeline_stages": 2,
            "micro_batches": 2, "data": "tests.helpers.user_code:gated_data",
            "data_kwargs": {"started": str(tmp_path / "started"), "gate": str(tmp_path / "gate")}}


async def _building(creating: asyncio.Future[Any], tmp_path: Path, processes: set[int]) -> None:
    """Waits until the job ``creating`` creates has its stage actors building on the nodes."""
    while not (tmp_path / "started").exists() and not creating.done():
        await asyncio.sleep(0.02)
    assert not creating.done() and _descendants() - processes  # the stages' processes, forked, building


async def test_a_creation_its_caller_gave_up_on_leaves_no_job_and_no_stage(cluster: Cluster, tmp_path: Path) -> None:
    """A train() cancelled (Ctrl-C, wait_for, its timeout) left its job built and running on the head,
    holding its nodes, with no handle to close it by."""
    jobs, processes = {j.job for j in await cluster.jobs()}, _descendants()
    creating = asyncio.ensure_future(cluster.train(**_gated(tmp_path)))
    await _building(creating, tmp_path, processes)
    creating.cancel()  # as asyncio.wait_for does
    with pytest.raises(asyncio.CancelledError):
        await creating
    (tmp_path / "gate").touch()  # the nodes finish building those stages: then they are stopped
    assert await _until_gone(cluster, jobs, processes) == (jobs, processes)
    async with await cluster.train(**_gated(tmp_path)) as job:  # the nodes serve on (the gate is open)
        assert (await job.step()).loss >= 0


async def test_a_creation_given_up_on_stops_the_stages_still_building(cluster: Cluster, tmp_path: Path) -> None:
    """A train() cancelled while its stages built waited for them to finish building (as long as their
    data factory took: here until the gate opens, two minutes at most) before it stopped them, holding
    the nodes meanwhile. They are now stopped as they build."""
    jobs, processes = {j.job for j in await cluster.jobs()}, _descendants()
    creating = asyncio.ensure_future(cluster.train(**_gated(tmp_path)))
    await _building(creating, tmp_path, processes)
    creating.cancel()
    with pytest.raises(asyncio.CancelledError):
        await creating
    try:
        assert await _until_gone(cluster, jobs, processes) == (jobs, processes)  # the gate still shut
    finally:
        (tmp_path / "gate").touch()


async def test_a_stage_that_fails_to_build_stops_the_ones_still_building(cluster: Cluster, tmp_path: Path) -> None:
    """One stage failed at once while another still built (as a rank of a process group waits for a peer
    that failed: tests/actors/test_remote.py has gloo so, across two hosts): the creation waited for
    it, up to its spawn timeout of 300 s, before it said what failed. The stages still building are
    now stopped as soon as one fails, and the failure is reported then."""
    jobs, processes = {j.job for j in await cluster.jobs()}, _descendants()
    marker = tmp_path / "calls"  # call 1: the head's inspection; 2 fails at once; 3 builds until calls.gate exists
    creating = cluster.train(model="tests.helpers.user_code:nth_build_fails", pipeline_stages=2, micro_batches=2,
                             model_kwargs={"marker": str(marker), "fail_at": 2, "block_at": 3, "blocks": 2, "dim": 8})
    with pytest.raises(RemoteError, match="this stage's model could not be built"):
        await asyncio.wait_for(creating, 60)
    assert (tmp_path / "calls.3").exists() and not (tmp_path / "calls.gate").exists()  # stopped while it built
    assert await _until_gone(cluster, jobs, processes) == (jobs, processes)


async def test_a_driver_that_leaves_while_its_job_is_created_leaves_no_job(cluster: Cluster, tmp_path: Path) -> None:
    """As a script's Ctrl-C: its creation cancelled and its connection closed at once; the word to the
    head that ends the creation goes out as the connection closes (Cluster.last_word)."""
    await cluster.admit(["tests.helpers"])  # another connection's job is built from them
    jobs, processes = {j.job for j in await cluster.jobs()}, _descendants()
    leaving = await Cluster.connect(cluster.head.address, keys=_KEYS[0], identity="admin")
    creating = asyncio.ensure_future(leaving.train(**_gated(tmp_path)))
    await _building(creating, tmp_path, processes)
    creating.cancel()
    with pytest.raises(asyncio.CancelledError):
        await creating
    await leaving.close()
    (tmp_path / "gate").touch()
    assert await _until_gone(cluster, jobs, processes) == (jobs, processes)
