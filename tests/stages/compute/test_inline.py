# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/compute/test_inline.py
"""The fast path (stages.compute.inline): short compute actions run on the loop's thread.

The policy is tested alone with the durations given to it (no clock); the executor's
use of it with real StepExecutors wired in memory (tests/stages/compute/test_executor.py's
Pipeline): training with the fast path must equal training without it bit for bit,
an action must not run inline while the compute thread is busy, compute another task
asks for mid-action must not pass for the action's, a long inline action must send its
kind back to the thread, back-to-back inline actions must still give the loop a turn,
and the loop's thread must compute with the compute thread's torch thread count. Two
LocalCluster jobs check that node processes take the fast path, except under tensor
parallelism.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stages.compute import inline as _inline
from stages.compute.inline import BAN_RUNS, CLEAN_RUNS, DEMOTE_S, INLINE_MAX_S, WARMUP_RUNS, InlinePolicy
from stages.comm.boundary import Payload
from stages.program import Action
from stages.records import ProgressReport
from examples.models import residual_mlp
from schedulers import LocalCluster
from tests.stages.compute.test_executor import Case, Pipeline, build_model, global_batches, open_pipeline

pytestmark = pytest.mark.timeout(60)

SHORT, LONG = INLINE_MAX_S / 4, DEMOTE_S * 2
KEY = ("F", 0)


# -- the policy alone ------------------------------------------------------------------------


def warmed(policy: InlinePolicy, key: Any = KEY, seconds: float = SHORT) -> InlinePolicy:
    for _ in range(WARMUP_RUNS):
        policy.record(key, seconds, inline=False)
    return policy


def test_first_runs_go_to_the_thread_then_short_ones_go_inline() -> None:
    policy = InlinePolicy()
    assert not policy.inline(KEY)  # never seen
    for _ in range(WARMUP_RUNS - 1):
        policy.record(KEY, SHORT, inline=False)
        assert not policy.inline(KEY)
    policy.record(KEY, SHORT, inline=False)
    assert policy.inline(KEY)
    assert not policy.inline(("F", 1))  # each kind learns on its own
    assert (policy.thread_runs, policy.inline_runs) == (WARMUP_RUNS, 0)


def test_a_slow_first_run_does_not_keep_a_short_kind_off_the_fast_path() -> None:
    policy = InlinePolicy()
    policy.record(KEY, 0.5, inline=False)  # lazy initialisation: imports, allocations, kernel choice
    for _ in range(WARMUP_RUNS - 1):
        policy.record(KEY, SHORT, inline=False)
    assert policy.inline(KEY) and policy.estimate(KEY) == SHORT


def test_a_kind_estimated_long_stays_on_the_thread() -> None:
    policy = warmed(InlinePolicy(), seconds=INLINE_MAX_S * 2)
    assert not policy.inline(KEY)
    # A kind that grows past the bound leaves the fast path without a demotion.
    policy = warmed(InlinePolicy())
    while policy.inline(KEY):
        policy.record(KEY, INLINE_MAX_S * 1.5, inline=True)
    assert policy.demotions == 0 and policy.inline_runs < 20


def test_a_long_inline_run_demotes_its_kind_longer_each_time() -> None:
    policy = warmed(warmed(InlinePolicy()), ("W", 0))
    for ban in (BAN_RUNS, 2 * BAN_RUNS, 4 * BAN_RUNS):
        assert policy.inline(KEY)
        policy.record(KEY, LONG, inline=True)
        thread_runs = 0
        while not policy.inline(KEY):  # banned, then the long run still weighs on the estimate
            policy.record(KEY, SHORT, inline=False)
            thread_runs += 1
            assert thread_runs < ban + 50
        assert thread_runs >= ban
        assert policy.inline(("W", 0))  # another kind is not affected
    assert policy.demotions == 3


def test_clean_inline_runs_forgive_earlier_demotions() -> None:
    policy = warmed(InlinePolicy())
    policy.record(KEY, LONG, inline=True)
    policy.record(KEY, LONG, inline=False)  # a thread run, however long, is not a demotion
    while not policy.inline(KEY):
        policy.record(KEY, SHORT, inline=False)
    for _ in range(CLEAN_RUNS):
        policy.record(KEY, SHORT, inline=True)
    policy.record(KEY, LONG, inline=True)
    assert policy.demotions == 2
    for _ in range(BAN_RUNS - 1):
        policy.record(KEY, SHORT, inline=False)
    assert not policy.inline(KEY)
    policy.record(KEY, SHORT, inline=False)
    assert policy.inline(KEY)  # the first ban's length again, not the second's


def test_a_zero_bound_turns_the_fast_path_off_and_negative_bounds_are_refused() -> None:
    assert not warmed(InlinePolicy(max_s=0.0), seconds=0.0).inline(KEY)
    with pytest.raises(ValueError, match="must be >= 0"):
        InlinePolicy(demote_s=-1.0)


# -- the executor ------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def keep_num_threads() -> Iterator[None]:
    """The fast path sets this thread's torch threads to the compute thread's: undone after each test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def eager(pipeline: Pipeline, **kwargs: Any) -> Pipeline:
    """Every executor takes any action inline once it has run twice (the bound is far above any run)."""
    for executor in pipeline.executors:
        executor.inline_policy = InlinePolicy(max_s=1.0, demote_s=5.0, **kwargs)
    return pipeline


async def train(case: Case, *, fast: bool, w_batching: bool = False, **kwargs: Any
                ) -> tuple[dict[str, torch.Tensor], list[float], list[int]]:
    """Trains ``case`` for the standard batches; returns the state, the losses, each rank's inline runs."""
    torch.manual_seed(7)  # dropout's masks
    async with open_pipeline(case, build_model(), **kwargs) as pipeline:
        for executor in pipeline.executors:
            executor.model.w_batching = w_batching
            if not fast:
                executor.inline_policy = InlinePolicy(max_s=0.0)
        if fast:
            eager(pipeline)
        losses = [(await pipeline.train_step(step, x, y))[0] for step, (x, y) in enumerate(global_batches())]
        state: dict[str, torch.Tensor] = {}
        for executor in pipeline.executors:
            for stage, module in executor.model.modules.items():
                state |= {f"{stage}.{k}": v.clone() for k, v in module.state_dict().items()}
        return state, losses, [e.inline_policy.inline_runs for e in pipeline.executors]


ONE_RANK = Case(schedule="gpipe", num_ranks=1, num_microbatches=4)
FAST_CASES = [
    pytest.param(Case(schedule="1f1b", num_ranks=2, num_microbatches=4), False, id="1f1b"),
    pytest.param(Case(schedule="zero_bubble", num_ranks=2, num_microbatches=8), True, id="zero_bubble-w_batching"),
    pytest.param(Case(schedule="interleaved", num_ranks=2, num_microbatches=4), False, id="interleaved"),
    pytest.param(Case(schedule="zero_bubble", num_ranks=2, num_microbatches=4, fusion=False), False,
                 id="zero_bubble-nofusion"),
]


@pytest.mark.parametrize("case,w_batching", FAST_CASES)
async def test_training_with_the_fast_path_equals_training_without_it_bit_for_bit(
        case: Case, w_batching: bool) -> None:
    slow_state, slow_losses, slow_inline = await train(case, fast=False, w_batching=w_batching)
    fast_state, fast_losses, fast_inline = await train(case, fast=True, w_batching=w_batching)
    assert slow_inline == [0] * case.num_ranks
    assert all(runs > 0 for runs in fast_inline), fast_inline
    assert fast_losses == slow_losses
    assert list(fast_state) == list(slow_state)
    for key, value in slow_state.items():
        assert torch.equal(fast_state[key], value), key


async def test_activation_checkpointing_recomputes_the_same_dropout_inline() -> None:
    # Dropout recomputed in the backward: the RNG state the checkpoint saved must give the
    # same mask whichever thread runs the recompute. One rank: executors in one process
    # share torch's generator, and two compute threads forking it at once draw in a racy
    # order (one executor per node process in a real job).
    kwargs: dict[str, Any] = {"checkpoint_every": 1, "prepend": {0: nn.Dropout(0.2)}}
    slow_state, slow_losses, _ = await train(ONE_RANK, fast=False, **kwargs)
    fast_state, fast_losses, fast_inline = await train(ONE_RANK, fast=True, **kwargs)
    assert fast_inline[0] > 0
    assert fast_losses == slow_losses
    for key, value in slow_state.items():
        assert torch.equal(fast_state[key], value), key


class ThreadNames(nn.Module):
    """Identity noting which thread runs each forward; ``seconds`` makes it take that long."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.seconds = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.names.append(threading.current_thread().name)
        if self.seconds:
            threading.Event().wait(self.seconds)  # a compute this long, not a wait for something
        return x


async def one_rank_step(pipeline: Pipeline, step: int) -> None:
    """One step of the one-rank pipeline, its program run by the executor's own ``run``."""
    executor, program = pipeline.executors[0], pipeline.programs[0]
    x, y = global_batches()[0]
    await executor.run(step, program, list(x.chunk(4)), list(y.chunk(4)))
    await executor.finish(program, no_reduction)


async def no_reduction() -> None:
    """One rank, one replica: nothing to reduce."""


async def test_nothing_runs_inline_while_the_compute_thread_is_busy() -> None:
    probe = ThreadNames()
    async with open_pipeline(ONE_RANK, build_model(), prepend={0: probe}) as pipeline:
        executor = eager(pipeline).executors[0]
        for step in range(2):
            await one_rank_step(pipeline, step)
        assert probe.names[-1] == threading.current_thread().name  # warmed up: inline
        release = threading.Event()
        blocker = asyncio.create_task(executor.compute(release.wait))  # e.g. a checkpoint's write
        stepping = asyncio.create_task(one_rank_step(pipeline, 2))
        await asyncio.sleep(0)  # one turn: the blocker is submitted, then the first forward decides
        release.set()
        await blocker
        await stepping
        assert probe.names[8].startswith("rank0-compute")  # step 2's first forward waited for the thread
        assert probe.names[-1] == threading.current_thread().name  # the rest, the thread idle again: inline


async def test_compute_cancelled_before_the_thread_reached_it_leaves_the_fast_path_open() -> None:
    probe = ThreadNames()
    async with open_pipeline(ONE_RANK, build_model(), prepend={0: probe}) as pipeline:
        executor = eager(pipeline).executors[0]
        for step in range(2):
            await one_rank_step(pipeline, step)
        release, ran = threading.Event(), []
        blocker = asyncio.create_task(executor.compute(release.wait))
        queued = asyncio.create_task(executor.compute(lambda: ran.append(True)))  # waits behind the blocker
        await asyncio.sleep(0)  # both submitted
        queued.cancel()  # taken back before the thread reached it: it never runs
        with pytest.raises(asyncio.CancelledError):
            await queued
        release.set()
        await blocker
        await one_rank_step(pipeline, 2)
        assert not ran
        assert probe.names[-1] == threading.current_thread().name  # the thread idle again: inline


async def test_compute_another_task_asks_for_during_an_action_is_not_the_actions() -> None:
    case = Case(schedule="1f1b", num_ranks=2, num_microbatches=4)
    async with open_pipeline(case, build_model()) as pipeline:
        executor = eager(pipeline).executors[0]
        ran_on: list[str] = []
        send = executor._send

        async def send_while_another_task_computes(step: int, action: Action, value: Payload) -> int:
            # Mid-SEND (its compute, an encode, not asked for: no codec), a checkpoint or a
            # check computes from another task: on the compute thread, never as the SEND's.
            await asyncio.create_task(executor.compute(lambda: ran_on.append(threading.current_thread().name)))
            return await send(step, action, value)

        executor._send = send_while_another_task_computes
        for step, (x, y) in enumerate(global_batches()):
            await pipeline.train_step(step, x, y)
        assert len(ran_on) == 4 * len(global_batches())
        assert all(name.startswith("rank0-compute") for name in ran_on), ran_on


async def test_a_long_inline_action_sends_its_kind_back_to_the_thread() -> None:
    probe = ThreadNames()
    async with open_pipeline(ONE_RANK, build_model(), prepend={0: probe}) as pipeline:
        executor = pipeline.executors[0]
        # Warming up, only a pause of seconds demotes: a loaded machine can stretch a tiny forward
        # past 50 ms (the full suite once did), which would send it to the thread before the test begins.
        executor.inline_policy = InlinePolicy(max_s=1.0, demote_s=5.0)
        for step in range(2):
            await one_rank_step(pipeline, step)
        loop_thread = threading.current_thread().name
        assert probe.names[-4:] == [loop_thread] * 4
        executor.inline_policy.demote_s = 0.05  # load only makes the 0.1 s forwards below longer
        probe.seconds = 0.1  # the model grew: forwards now take 0.1 s
        await one_rank_step(pipeline, 2)
        assert executor.inline_policy.demotions == 1
        # One long forward ran inline (the estimate said short); the rest went to the thread.
        assert probe.names[-4] == loop_thread
        assert all(name.startswith("rank0-compute") for name in probe.names[-3:])


async def test_back_to_back_inline_actions_give_the_loop_a_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    turns = 0

    async def ticker() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    async with open_pipeline(ONE_RANK, build_model()) as pipeline:
        eager(pipeline)
        for step in range(2):
            await one_rank_step(pipeline, step)
        executor = pipeline.executors[0]
        program = pipeline.programs[0]
        x, y = global_batches()[0]
        inputs, targets = list(x.chunk(4)), list(y.chunk(4))
        task = asyncio.create_task(ticker())
        try:
            await asyncio.sleep(0)
            counted = turns
            monkeypatch.setattr(_inline, "YIELD_AFTER_S", float("inf"))
            await executor.run(2, program, inputs, targets)  # every action inline, none yields
            assert turns == counted
            monkeypatch.setattr(_inline, "YIELD_AFTER_S", 0.0)
            await executor.run(3, program, inputs, targets)  # yields after each inline action
            assert turns - counted >= 8
        finally:
            task.cancel()
        await executor.apply(program, step=False)


async def test_the_loop_thread_computes_with_the_compute_threads_torch_threads() -> None:
    async with open_pipeline(ONE_RANK, build_model()) as pipeline:
        executor = eager(pipeline).executors[0]
        wanted = 1 if torch.get_num_threads() != 1 else 2
        await executor.compute(torch.set_num_threads, wanted)  # as the stage's threads_per_stage does
        for step in range(3):
            await one_rank_step(pipeline, step)
        assert executor.inline_policy.inline_runs > 0
        assert torch.get_num_threads() == wanted


# -- node processes ----------------------------------------------------------------------------


async def stage_progress(cluster: Any, job: Any) -> list[ProgressReport]:
    """Each stage actor's ``progress``, of ``job``."""
    [stages] = [j.stages for j in await cluster.jobs() if j.job == job.id]
    return [await cluster.runtime.ref(*ref).ask("progress", timeout=5) for ref in stages]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.multiprocess
async def test_node_processes_never_take_the_fast_path_under_tensor_parallelism() -> None:
    """Whether an action of a plain pipeline runs inline depends on how long it measured (a busy
    machine makes every action slow: this failed under load once), so that is not asserted
    here; the inline policy's choices are (above, in one process). What does not depend on timing:
    a tensor-parallel stage, whose actions wait on collectives, never runs one on the loop."""
    dims = {"blocks": 4, "dim": 4, "hidden": 4}  # tiny: every action well under the inline bound
    optimizer = ("torch.optim:SGD", {"lr": 0.05, "momentum": 0.9})
    gen = torch.Generator().manual_seed(1234)
    batches = [(torch.randn(16, 4, generator=gen), torch.randn(16, 4, generator=gen)) for _ in range(12)]
    torch.manual_seed(0)
    model = residual_mlp(**dims)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    expected_losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected_losses.append(loss.item())
    async with LocalCluster(nodes=2) as cluster:
        job = await cluster.train(model="examples.models:residual_mlp", model_kwargs=dims, optimizer=optimizer,
                                  loss="torch.nn.functional:mse_loss", pipeline_stages=2, schedule="1f1b",
                                  micro_batches=4, seed=0)
        try:
            losses = [(await job.step(x, y)).loss for x, y in batches]
            state = await job.state_dict()
            pipelined = await stage_progress(cluster, job)
        finally:
            await job.close()
        # Tensor-parallel layers all-reduce inside forward and backward: never on the loop.
        job = await cluster.train(model="examples.models:residual_mlp", model_kwargs=dims, optimizer=optimizer,
                                  loss="torch.nn.functional:mse_loss", tensor_parallel=2, micro_batches=4, seed=0)
        try:
            for x, y in batches[:3]:
                await job.step(x, y)
            sharded = await stage_progress(cluster, job)
        finally:
            await job.close()
    assert all(p.inline_actions + p.thread_actions > 0 for p in pipelined), pipelined
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    assert all(p.inline_actions == 0 and p.thread_actions > 0 for p in sharded), sharded
