# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/compute/test_executor.py
"""StepExecutor (stages.compute.executor) in one process, against plain autograd.

Several executors, one per pipeline rank, trade activations and input gradients
through an in-memory ``send`` that puts a detached copy straight into the peer's
inbox, as the stage actor's ``deliver`` endpoint does: no node processes, no sockets.
Every schedule trains a small model for a few steps and must equal one process
training the same model on the same global batches; each rank must run its program
in order with the stash the schedule implies; and a failing action must be named,
with nothing of its step applied once the executors are reset.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stages.compute import wgrad as _wgrad
from stages.build.layers import Chain
from stages.compute.executor import ActionFailed, Inbox, StageModel, StepExecutor, StepTrace
from stages.comm.boundary import Payload
from stages.program import Action, ActionKind, Placement, stage_to_rank
from stages.sections import V_SCHEDULES
from schedulers.schedules import SCHEDULES, build_schedule
from schedulers.simulate import simulate

pytestmark = pytest.mark.timeout(30)

DIM, HIDDEN, BLOCKS = 8, 16, 8  # 8 blocks: one per model stage at 4 ranks x 2 virtual stages
BATCH, SEQ, STEPS = 16, 2, 3
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
}
_K = ActionKind


# -- the model and the reference ------------------------------------------------------


class Block(nn.Module):
    """A residual MLP block: LayerNorm, Linear, GELU, Linear (the linears fusable)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(BLOCKS)))


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    return [(torch.randn(BATCH, SEQ, DIM, generator=gen), torch.randn(BATCH, SEQ, DIM, generator=gen))
            for _ in range(STEPS)]


def train_reference(optimizer: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, plain autograd, the whole global batch per step."""
    model = build_model()
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kwargs)
    losses = []
    for x, y in global_batches():
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def assert_same_state(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


# -- the cases --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    schedule: str
    num_ranks: int
    num_microbatches: int
    fusion: bool = True  # gradient_accumulation_fusion: fused linears, and B split into I, W
    optimizer: str = "adam"

    @property
    def num_virtual_stages(self) -> int:
        return 2 if self.schedule in ("interleaved", *V_SCHEDULES) else 1

    @property
    def placement(self) -> Placement:
        return "v" if self.schedule in V_SCHEDULES else "loop"

    def rank_of(self, stage: int) -> int:
        return stage_to_rank(stage, self.num_ranks, self.placement)

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.num_virtual_stages

    def programs(self) -> dict[int, list[Action]]:
        # As schedulers.job_core.compile_programs calls it.
        virtual = self.num_virtual_stages if self.schedule == "interleaved" else None
        return build_schedule(self.schedule, self.num_ranks, self.num_microbatches, virtual, split=self.fusion)

    def __str__(self) -> str:
        fusion = "" if self.fusion else "-nofusion"
        return f"{self.schedule}-{self.num_ranks}ranks-{self.num_microbatches}mb{fusion}-{self.optimizer}"


def accepted(case: Case) -> bool:
    try:
        case.programs()
    except ValueError:  # e.g. interleaved with micro-batches not a multiple of the ranks
        return False
    return True


_SHAPES = [
    Case(schedule=name, num_ranks=ranks, num_microbatches=micro, fusion=fusion)
    for name, ranks, micro, fusion in itertools.product(SCHEDULES, [2, 4], [4, 8], [True])
] + [
    # Plain autograd for the weight gradients: B unsplit, and zero-bubble's W walks the graph again.
    Case(schedule=name, num_ranks=ranks, num_microbatches=micro, fusion=False)
    for name, ranks, micro in [("gpipe", 2, 4), ("1f1b", 4, 8), ("interleaved", 2, 8),
                               ("zero_bubble", 2, 8), ("zero_bubble", 4, 4), ("zbv", 2, 8), ("dualpipev", 2, 4)]
]
SHAPES = [case for case in _SHAPES if accepted(case)]
TRAINING_CASES = [
    Case(schedule=c.schedule, num_ranks=c.num_ranks, num_microbatches=c.num_microbatches, fusion=c.fusion,
         optimizer=optimizer)
    for c in SHAPES for optimizer in OPTIMIZERS
]


# -- failures on purpose ------------------------------------------------------------------


class Tripwire:
    """Raises on the ``at``-th check after :meth:`arm` (then disarms); passes otherwise."""

    def __init__(self) -> None:
        self.at: int | None = None
        self.calls = 0

    def arm(self, at: int) -> None:
        self.at, self.calls = at, 0

    def check(self, where: str) -> None:
        if self.at is None:
            return
        self.calls += 1
        if self.calls == self.at:
            self.at = None
            raise RuntimeError(f"tripwire in {where}, call {self.calls}")


class TripForward(nn.Module):
    """Identity whose forward checks a tripwire."""

    def __init__(self, wire: Tripwire) -> None:
        super().__init__()
        self.wire = wire

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.wire.check("forward")
        return x


class _CheckInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, wire: Tripwire) -> torch.Tensor:
        ctx.wire = wire
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.wire.check("backward")
        return grad, None


class TripBackward(nn.Module):
    """Identity whose backward checks a tripwire."""

    def __init__(self, wire: Tripwire) -> None:
        super().__init__()
        self.wire = wire

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _CheckInBackward.apply(x, self.wire)
        return out


def tripping_loss(wire: Tripwire) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        wire.check("loss")
        return F.mse_loss(out, target)
    return loss


# -- executors wired in memory ---------------------------------------------------------------


class Pipeline:
    """One StepExecutor per rank, built as the stage actor builds them, sending in memory.

    ``checkpoint_every``: activation checkpointing, layers per segment (0: off); ``stash_codec``:
    the codec saved activations are held in (stages.compute.activations).
    """

    def __init__(self, case: Case, model: nn.Sequential, *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.mse_loss,
                 prepend: dict[int, nn.Module] | None = None, checkpoint_every: int = 0,
                 stash_codec: str = "none") -> None:
        self.case = case
        self.programs = case.programs()
        num_ranks, num_stages, m = case.num_ranks, case.num_stages, case.num_microbatches
        layers = list(model.children())
        bounds = [round(i * len(layers) / num_stages) for i in range(num_stages + 1)]
        self.stages = {r: [s for s in range(num_stages) if case.rank_of(s) == r] for r in range(num_ranks)}
        self.forwards: dict[int, list[int]] = {r: [] for r in range(num_ranks)}  # model stages, in compute order
        self.bytes_sent = [0] * num_ranks
        self.reduces = [0] * num_ranks
        self._threads: list[ThreadPoolExecutor] = []
        self.executors: list[StepExecutor] = []
        for rank, stages in self.stages.items():
            modules: dict[int, nn.Module] = {}
            for s in stages:
                extra = [prepend[s]] if prepend and s in prepend else []
                modules[s] = Chain(*extra, *layers[bounds[s]:bounds[s + 1]], checkpoint_every=checkpoint_every)
                modules[s].register_forward_pre_hook(functools.partial(self._record_forward, rank, s))
            weight_grads = None
            if case.fusion:
                weight_grads = _wgrad.WeightGradients()
                for module in modules.values():
                    _wgrad.install(module, weight_grads)
            cls, kwargs = OPTIMIZERS[case.optimizer]
            optimizer = cls([p for module in modules.values() for p in module.parameters()], **kwargs)
            stage_model = StageModel(modules=modules, num_stages=num_stages, loss_fn=loss_fn, optimizer=optimizer,
                                     device=torch.device("cpu"), weight_grads=weight_grads, stash_codec=stash_codec)
            thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rank{rank}-compute")
            self._threads.append(thread)
            inbox = Inbox(4 * m * len(stages) + 16)  # the stage actor's limit
            self.executors.append(StepExecutor(stage_model, inbox, self._send_from(rank), m, thread))

    def _record_forward(self, rank: int, stage: int, module: nn.Module, args: Any) -> None:
        self.forwards[rank].append(stage)

    def _send_from(self, rank: int) -> Callable[[int, Action, Payload], Any]:
        async def send(step: int, action: Action, value: Payload) -> int:
            assert self.case.rank_of(action.stage) == rank, f"rank {rank} sent for {action}"
            assert action.microbatch is not None
            forward = action.kind is _K.SEND_F
            target = action.stage + 1 if forward else action.stage - 1
            peer = self.executors[self.case.rank_of(target)]
            # A copy with no autograd history, as the wire would deliver it.
            copy = Payload([t.clone() for t in value.leaves], value.spec)
            peer.inbox.put((step, "F" if forward else "B", target, action.microbatch), copy)
            nbytes = value.nbytes
            self.bytes_sent[rank] += nbytes
            return nbytes
        return send

    async def run_to_barrier(self, step: int, x: torch.Tensor, y: torch.Tensor) -> list[StepTrace]:
        """Runs every rank's program up to its barrier, concurrently.

        Raises:
            ExceptionGroup: holding the ActionFailed; the other ranks were cancelled.
        """
        m, last = self.case.num_microbatches, self.case.num_stages - 1
        inputs, targets = list(x.chunk(m)), list(y.chunk(m))
        async with asyncio.timeout(20):  # a deadlock fails with a message, not the suite's timeout
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(executor.run(step, self.programs[rank],
                                                        inputs if 0 in self.stages[rank] else None,
                                                        targets if last in self.stages[rank] else None))
                         for rank, executor in enumerate(self.executors)]
        return [task.result() for task in tasks]

    async def release(self) -> None:
        """The barrier is released everywhere: each rank reduces and steps its optimizer."""
        async with asyncio.TaskGroup() as group:
            for rank, executor in enumerate(self.executors):
                group.create_task(executor.finish(self.programs[rank], functools.partial(self._reduce, rank)))

    async def _reduce(self, rank: int) -> None:
        self.reduces[rank] += 1

    async def reset(self, step: int) -> None:
        for executor in self.executors:
            await executor.reset(step)

    async def train_step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[StepTrace]]:
        traces = await self.run_to_barrier(step, x, y)
        await self.release()
        return self.loss(traces), traces

    def loss(self, traces: list[StepTrace]) -> float:
        """The step's loss: the mean over micro-batches, which only the last stage's rank reports."""
        last_rank = self.case.rank_of(self.case.num_stages - 1)
        for rank, trace in enumerate(traces):
            if rank != last_rank:
                assert trace.losses == {}, rank
        losses = traces[last_rank].losses
        assert sorted(losses) == list(range(self.case.num_microbatches))
        return sum(losses.values()) / len(losses)

    def close(self) -> None:
        for executor in self.executors:
            executor.close()
        for thread in self._threads:
            thread.shutdown(wait=True)  # no compute thread outlives the test


@asynccontextmanager
async def open_pipeline(case: Case, model: nn.Sequential, **kwargs: Any) -> AsyncIterator[Pipeline]:
    pipeline = Pipeline(case, model, **kwargs)
    try:
        yield pipeline
    finally:
        pipeline.close()


def before_barrier(program: list[Action]) -> list[Action]:
    return list(itertools.takewhile(lambda a: a.kind is not _K.BARRIER, program))


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", TRAINING_CASES, ids=str)
async def test_pipeline_training_equals_one_process(case: Case) -> None:
    expected_state, expected_losses = train_reference(case.optimizer)
    model = build_model()
    async with open_pipeline(case, model) as pipeline:
        losses = [(await pipeline.train_step(step, x, y))[0] for step, (x, y) in enumerate(global_batches())]
    assert_same_state(model, expected_state)
    assert losses == pytest.approx(expected_losses, rel=1e-5)


@pytest.mark.parametrize("case", SHAPES, ids=str)
async def test_each_rank_runs_its_program_in_order_with_the_scheduled_stash(case: Case) -> None:
    expected_stash = list(simulate(case.programs()).peak_stash)
    async with open_pipeline(case, build_model()) as pipeline:
        for step, (x, y) in enumerate(global_batches()[:2]):
            for log in pipeline.forwards.values():
                log.clear()
            pipeline.bytes_sent = [0] * case.num_ranks
            _, traces = await pipeline.train_step(step, x, y)
            for rank, (trace, executor) in enumerate(zip(traces, pipeline.executors)):
                body = before_barrier(pipeline.programs[rank])
                assert [name for name, _, _ in trace.spans] == [str(a) for a in body], f"rank {rank}"
                assert all(start <= end for _, start, end in trace.spans)
                assert all(a[2] <= b[1] for a, b in itertools.pairwise(trace.spans)), f"rank {rank} overlapped"
                # The modules themselves saw the forwards in the program's order.
                assert pipeline.forwards[rank] == [a.stage for a in body if a.kind is _K.F], f"rank {rank}"
                assert executor.done_actions == len(body) and executor.current is None
                assert sum(trace.bytes_sent.values()) == pipeline.bytes_sent[rank]
                sends = {f"{'F' if a.kind is _K.SEND_F else 'B'} {a.stage}->"
                         f"{a.stage + 1 if a.kind is _K.SEND_F else a.stage - 1}"
                         for a in body if a.kind in (_K.SEND_F, _K.SEND_B)}
                assert set(trace.bytes_sent) == sends, f"rank {rank}"
            assert [t.peak_stash for t in traces] == expected_stash
    assert pipeline.reduces == [2] * case.num_ranks


# docs/parallelism.md's table: 4 stages x 8 micro-batches, backward unsplit (the CLI's default).
README_STASH = """
gpipe        8 8 8 8
1f1b         4 3 2 1
interleaved  11 9 7 5
zero_bubble  4 4 4 4
"""
STASH_ROWS = [(row.split()[0], [int(n) for n in row.split()[1:]]) for row in README_STASH.strip().splitlines()]


@pytest.mark.parametrize("schedule,expected", STASH_ROWS, ids=[name for name, _ in STASH_ROWS])
async def test_peak_stash_is_the_readme_table(schedule: str, expected: list[int]) -> None:
    case = Case(schedule=schedule, num_ranks=4, num_microbatches=8, fusion=False)
    assert list(simulate(case.programs()).peak_stash) == expected
    x, y = global_batches()[0]
    async with open_pipeline(case, build_model()) as pipeline:
        traces = await pipeline.run_to_barrier(0, x, y)
        await pipeline.release()
    assert [t.peak_stash for t in traces] == expected


# Where a tripwire sits, on which of its calls it fires, and the action that must be named.
FAILURES = [
    # case                                                   where       stage  at  action
    (Case(schedule="1f1b", num_ranks=2, num_microbatches=4), "loss", 1, 3, "1F2"),
    (Case(schedule="gpipe", num_ranks=4, num_microbatches=8), "forward", 1, 2, "1F1"),
    (Case(schedule="interleaved", num_ranks=2, num_microbatches=4), "forward", 2, 1, "2F0"),
    (Case(schedule="zero_bubble", num_ranks=4, num_microbatches=8), "backward", 2, 1, "2I0"),
    (Case(schedule="interleaved", num_ranks=4, num_microbatches=8), "backward", 5, 1, "5I0"),
    (Case(schedule="1f1b", num_ranks=4, num_microbatches=4, fusion=False), "backward", 3, 1, "3B0"),
    (Case(schedule="zero_bubble", num_ranks=2, num_microbatches=4, fusion=False), "backward", 1, 1, "1I0"),
    (Case(schedule="gpipe", num_ranks=2, num_microbatches=4, optimizer="sgd_momentum"), "forward", 0, 4, "0F3"),
]


@pytest.mark.parametrize("case,where,stage,at,action", FAILURES, ids=[f"{c}-{w}-{a}" for c, w, _, _, a in FAILURES])
async def test_failed_action_is_named_and_nothing_of_its_step_is_applied(
    case: Case, where: str, stage: int, at: int, action: str
) -> None:
    expected_state, expected_losses = train_reference(case.optimizer)
    wire = Tripwire()
    kwargs: dict[str, Any] = {}
    if where == "loss":
        assert stage == case.num_stages - 1
        kwargs["loss_fn"] = tripping_loss(wire)
    else:
        kwargs["prepend"] = {stage: TripForward(wire) if where == "forward" else TripBackward(wire)}
    batches = global_batches()
    model = build_model()
    async with open_pipeline(case, model, **kwargs) as pipeline:
        losses = [(await pipeline.train_step(0, *batches[0]))[0]]
        wire.arm(at)
        with pytest.raises(ExceptionGroup) as raised:
            await pipeline.run_to_barrier(1, *batches[1])
        [failure] = raised.value.exceptions
        assert isinstance(failure, ActionFailed)
        assert str(failure.action) == action
        assert str(failure).startswith(f"{action}: RuntimeError: tripwire in {where}")
        assert isinstance(failure.cause, RuntimeError)
        # Every rank drops the step (the failed one itself, the others as aborted), and the
        # job goes on with the next step number, as the scheduler numbers them.
        await pipeline.reset(1)
        for step, (x, y) in enumerate(batches[1:], start=2):
            loss, traces = await pipeline.train_step(step, x, y)
            losses.append(loss)
            # Nothing of the failed step still held either: it would show as stash.
            assert [t.peak_stash for t in traces] == list(simulate(pipeline.programs).peak_stash)
    assert_same_state(model, expected_state)
    assert losses == pytest.approx(expected_losses, rel=1e-5)


async def test_an_aborted_step_forgets_a_run_of_batched_ws_it_cut_short() -> None:
    """reset drops every per-step container, the W batch in progress too: left over, it failed the
    next step's check that nothing is still held (or joined the next step's batch)."""
    case = Case(schedule="zero_bubble", num_ranks=2, num_microbatches=4)
    async with open_pipeline(case, build_model()) as pipeline:
        executor = pipeline.executors[0]
        executor._passes.w_batch.append(((0, 0), []))  # as a run of Ws cut short leaves it
        await executor.reset(0)
        assert executor._passes.w_batch == []
        (x, y), = global_batches()[:1]
        loss, *_ = await pipeline.train_step(1, x, y)
        assert loss == loss  # the next step runs whole (a finite loss, no "still held" failure)


@pytest.mark.parametrize("ranks,schedule,micro_batches", [(1, "1f1b", 2), (2, "1f1b", 4), (4, "1f1b", 3),
                                                          (2, "interleaved", 4), (4, "interleaved", 4),
                                                          (2, "zbv", 3), (4, "dualpipev", 8)])
async def test_forward_only_programs_evaluate_without_a_stash_or_a_gradient(ranks: int, schedule: str,
                                                                           micro_batches: int) -> None:
    """Every rank count, interleaved, in a V or not, any micro-batch count: the evaluation's programs run
    to their end without a deadlock, keep nothing for a backward, touch no gradient, and give the
    model's own loss per micro-batch and its outputs; the modules return to train mode."""
    from schedulers.schedules import forward_only

    model = build_model()
    x, y = global_batches()[0]
    case = Case(schedule=schedule, num_ranks=ranks, num_microbatches=micro_batches)
    programs = forward_only(ranks, micro_batches, case.num_virtual_stages, case.placement)
    async with open_pipeline(case, model) as pipeline:
        last = case.num_stages - 1
        inputs, targets = list(x.tensor_split(micro_batches)), list(y.tensor_split(micro_batches))
        async with asyncio.timeout(20):
            traces = await asyncio.gather(*(
                executor.run(0, programs[rank], inputs if 0 in pipeline.stages[rank] else None,
                             targets if last in pipeline.stages[rank] else None, evaluating=True, keep_outputs=True)
                for rank, executor in enumerate(pipeline.executors)))
        assert all(module.training for ex in pipeline.executors for module in ex.model.modules.values())
    assert all(p.grad is None for p in model.parameters())
    assert [t.peak_stash for t in traces] == [0] * ranks
    final = traces[case.rank_of(last)]
    with torch.no_grad():
        expected = [F.mse_loss(model(xs), ys).item() for xs, ys in zip(inputs, targets)]
        torch.testing.assert_close(torch.cat([final.outputs[m] for m in range(micro_batches)]), model(x))
    assert [final.losses[m] for m in range(micro_batches)] == pytest.approx(expected, rel=1e-6)
    assert [final.items[m] for m in range(micro_batches)] == [len(t) for t in targets]


async def test_spans_carry_the_labels_the_stage_gives_and_its_own_names_otherwise() -> None:
    """A stage passes the texts its program was parsed from as the spans' names (no name formatted per
    action); labels that do not match the program in length are not trusted."""
    from schedulers.schedules import forward_only

    case = Case(schedule="gpipe", num_ranks=2, num_microbatches=2)
    programs = forward_only(2, 2, case.num_virtual_stages, case.placement)
    x, y = global_batches()[0]
    inputs, targets = list(x.tensor_split(2)), list(y.tensor_split(2))
    async with open_pipeline(case, build_model()) as pipeline:
        for step, given in enumerate(([[f"~{a}" for a in programs[rank]] for rank in range(2)],
                                      [[] for _ in range(2)])):
            async with asyncio.timeout(20):
                traces = await asyncio.gather(*(
                    executor.run(step, programs[rank], inputs if rank == 0 else None, targets if rank == 1 else None,
                                 evaluating=True, labels=given[rank])
                    for rank, executor in enumerate(pipeline.executors)))
            for rank, trace in enumerate(traces):
                body = before_barrier(programs[rank])
                names = [f"~{a}" for a in body] if step == 0 else [str(a) for a in body]
                assert [name for name, _, _ in trace.spans] == names, f"step {step} rank {rank}"


async def test_a_poisoned_step_fails_each_wait_for_a_value_not_in_and_drops_what_comes_later() -> None:
    """A transfer that may have lost a value poisons the steps it could have been for: a RECV waiting
    now, and one that comes to wait later, raise the transfer's error; a value already in is still
    taken, one that comes after is dropped (its step fails), and an abort forgets the poison."""
    inbox = Inbox(16)
    value = Payload([torch.ones(2)], None)
    inbox.put((3, "F", 1, 0), value)
    waiting = asyncio.ensure_future(inbox.take((3, "F", 1, 1)))
    await asyncio.sleep(0)
    inbox.poison((3, 4), ConnectionError("lost on the way"))
    with pytest.raises(ConnectionError, match="lost on the way"):
        await waiting
    assert await inbox.take((3, "F", 1, 0)) is value  # in before the loss
    inbox.put((4, "B", 1, 0), value)  # its step fails: dropped, not "delivered twice"
    with pytest.raises(ConnectionError, match="lost on the way"):
        await inbox.take((4, "B", 1, 0))
    inbox.drop_step(4)  # the scheduler aborted the steps
    inbox.put((5, "F", 1, 0), value)
    assert await inbox.take((5, "F", 1, 0)) is value and not inbox._poisoned
