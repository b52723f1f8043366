# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/comm/test_overlap.py
"""The data-parallel reduction during backward (stages.comm.overlap), in one process.

The buckets, the views and the plan are checked as data; then in-memory executors
(tests/stages/compute/test_executor.py's ``Pipeline``) run every schedule with the reduction
attached to a stand-in all-reduce: two identical replicas, so the sum is twice the
bucket and the average is the bucket itself. Each step must train to the same bits as
executors without it, no gradient may change once its bucket is on the wire, and
buckets must go on the wire during backward, in index order.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stages.compute.executor import ActionFailed, StepExecutor
from stages.comm.overlap import LateGradientWrite, OverlappedReduction, backward_order, plan_reduction
from stages.comm.parallel import bucket_layout
from stages.program import Action, ActionKind
from schedulers.schedules import build_schedule
from tests.stages.compute.test_executor import OPTIMIZERS, DIM, Case, Pipeline, build_model, global_batches, open_pipeline

pytestmark = pytest.mark.timeout(60)

_K = ActionKind


# -- buckets, order, plan ------------------------------------------------------------------


@pytest.mark.parametrize(("numels", "dtypes", "bucket_bytes", "expected"), [
    ([4, 4, 4], None, 32, [[0, 1], [2]]),  # 16 + 16 bytes fill a bucket
    ([4, 4, 4], None, 31, [[0], [1], [2]]),
    ([20, 1, 1], None, 16, [[0], [1, 2]]),  # a parameter larger than a bucket goes alone
    ([1, 1, 1], ["f32", "f16", "f16"], 1 << 10, [[0], [1, 2]]),  # one dtype a bucket
    ([3], None, 4, [[0]]),
])
def test_buckets_pack_parameters_in_order(numels: list[int], dtypes: list[str] | None, bucket_bytes: int,
                                          expected: list[list[int]]) -> None:
    kinds = {"f32": torch.float32, "f16": torch.float16}
    params = [torch.zeros(n, dtype=kinds[dtypes[i]] if dtypes else torch.float32) for i, n in enumerate(numels)]
    assert bucket_layout(params, bucket_bytes) == expected


def test_backward_order_is_the_last_stage_first_each_last_layer_first() -> None:
    shared = nn.Linear(2, 2)
    modules = {0: nn.Sequential(shared, nn.Linear(2, 3)), 2: nn.Sequential(nn.Linear(3, 2), shared)}
    order = backward_order(modules)
    first, second, third = modules[0][1], modules[2][0], shared
    # Stage 2's own layer first; the shared one where stage 0's backward, the last to write it, finishes it.
    assert [id(p) for p in order] == [id(p) for p in (second.bias, second.weight, first.bias, first.weight,
                                                      third.bias, third.weight)]


def program(text: str) -> list[Action]:
    return [Action.parse(t) for t in text.split()]


Sources = list[frozenset[tuple[int, Literal["autograd", "fused"]]]]
ZERO_BUBBLE = "0F0 0I0 0F1 0I1 0W0 0W1 0BARRIER 0REDUCE 0STEP"  # W0 after I1, as zero-bubble puts it


@pytest.mark.parametrize(("text", "fused", "batched", "armed", "settled", "counted"), [
    # 1F1B: a B writes everything; parameter 0 autograd, 1 fused, 2 shared by two ways, 3 frozen.
    # A fused one's writes are bounded by its uses in the forward of the same micro-batch.
    ("0F0 0F1 0B0 0B1 0BARRIER 0REDUCE 0STEP", True, False,
     {"0B1": [(0, "autograd", None), (1, "fused", (0, 1))]}, {"0B1": [0, 1, 2]}, {(0, 1)}),
    # Zero-bubble with fused linears: the last I finishes autograd's, the last W the fused ones.
    (ZERO_BUBBLE, True, False,
     {"0I1": [(0, "autograd", None)], "0W1": [(1, "fused", (0, 1))]}, {"0I1": [0], "0W1": [1, 2]}, {(0, 1)}),
    # Without fused linears I writes no parameter: W walks the graph for all of them.
    (ZERO_BUBBLE, False, False,
     {"0W1": [(0, "autograd", None)]}, {"0W1": [0]}, set()),
    # W batching: a run of Ws writes at its last; there each GEMM group writes once.
    ("0F0 0I0 0F1 0I1 0W1 0W0 0BARRIER 0REDUCE 0STEP", True, True,
     {"0I1": [(0, "autograd", None)], "0W0": [(1, "fused", None)]}, {"0I1": [0], "0W0": [1, 2]}, set()),
])
def test_the_plan_arms_each_parameters_last_write(text: str, fused: bool, batched: bool, armed: dict[str, Any],
                                                   settled: dict[str, Any], counted: set[tuple[int, int]]) -> None:
    sources: Sources = [frozenset({(0, "autograd")}), frozenset({(0, "fused")}),
                        frozenset({(0, "autograd"), (0, "fused")}), frozenset()]
    if not fused:
        sources = [frozenset({(0, "autograd")}), frozenset(), frozenset(), frozenset()]
    plan = plan_reduction(program(text), sources, fused, batched)
    assert {str(a): list(v) for a, v in plan.armed.items()} == armed
    assert {str(a): list(v) for a, v in plan.settled.items()} == settled
    assert plan.untouched == ((3,) if fused else (1, 2, 3))
    assert plan.counted == counted


def test_interleaved_stages_settle_at_their_own_last_backward() -> None:
    text = "0F0 2F0 2B0 0F1 2F1 0B0 2B1 0B1 0BARRIER 0REDUCE 0STEP"
    sources: Sources = [frozenset({(2, "autograd")}), frozenset({(0, "autograd")}),
                        frozenset({(0, "autograd"), (2, "autograd")})]
    plan = plan_reduction(program(text), sources, fused=False)
    assert {str(a): list(v) for a, v in plan.settled.items()} == {"2B1": [0], "0B1": [1, 2]}
    assert {str(a): list(v) for a, v in plan.armed.items()} == {"2B1": [(0, "autograd", None)],
                                                                 "0B1": [(1, "autograd", None)]}


def test_with_w_batching_a_stages_weights_are_final_where_its_run_of_ws_ends() -> None:
    # Interleaved: stage 2's last W is not the run's last; its GEMMs run in 0W1, with stage 0's.
    text = "0F0 2F0 2I0 0I0 0F1 2F1 2I1 0I1 2W0 2W1 0W0 0W1 0BARRIER 0REDUCE 0STEP"
    sources: Sources = [frozenset({(2, "fused")}), frozenset({(0, "fused")}), frozenset({(2, "autograd")})]
    plan = plan_reduction(program(text), sources, fused=True, batched_w=True)
    assert {str(a): list(v) for a, v in plan.settled.items()} == {"0W1": [0, 1], "2I1": [2]}
    unbatched = plan_reduction(program(text), sources, fused=True)
    assert {str(a): list(v) for a, v in unbatched.settled.items()} == {"2W1": [0], "0W1": [1], "2I1": [2]}


# -- the stand-in all-reduce ------------------------------------------------------------------


class TwoReplicas:
    """An average over two identical replicas (the sum, twice the bucket, halved), checking at
    ``wait`` that nothing wrote to the bucket after it went on the wire; records what ran when
    each bucket started."""

    def __init__(self) -> None:
        self.executor: StepExecutor | None = None
        self.started: list[tuple[int, str | None]] = []  # (bucket's data pointer, action running)
        self.waited = 0

    def __call__(self, flat: torch.Tensor) -> Any:
        current = self.executor.current if self.executor is not None else None
        self.started.append((flat.data_ptr(), None if current is None else str(current)))
        return _Sum(self, flat, flat.clone())


class _Sum:
    def __init__(self, owner: TwoReplicas, flat: torch.Tensor, sent: torch.Tensor) -> None:
        self.owner, self.flat, self.sent = owner, flat, sent

    def wait(self) -> None:
        bits = torch.equal(self.flat.view(torch.int32), self.sent.view(torch.int32))  # NaN included
        assert bits, "a gradient changed after its bucket went on the wire"
        self.flat.mul_(2).div_(2)
        self.owner.waited += 1


def batch_w(pipeline: Pipeline) -> None:
    """W batching: programs whose Ws wait for the tail, where each run of them runs together."""
    case = pipeline.case
    pipeline.programs = build_schedule(case.schedule, case.num_ranks, case.num_microbatches,
                                       case.num_virtual_stages if case.schedule == "interleaved" else None,
                                       split=True, batch_w=True)
    for executor in pipeline.executors:
        executor.model.w_batching = True


def attach(pipeline: Pipeline, bucket_bytes: int, *, w_batching: bool = False) -> list[TwoReplicas]:
    """Gives every executor of ``pipeline`` an overlapped reduction over two stand-in replicas."""
    if w_batching:
        batch_w(pipeline)
    replicas = []
    for executor in pipeline.executors:
        model = executor.model
        names = {id(p): [f"{s}.{n}"] for s, m in model.modules.items() for n, p in m.named_parameters()}
        stand_in = TwoReplicas()
        stand_in.executor = executor
        executor.overlap = OverlappedReduction(backward_order(model.modules), model.modules, names,
                                               bucket_bytes=bucket_bytes, reduce=stand_in,
                                               weight_grads=model.weight_grads, w_batching=w_batching)
        replicas.append(stand_in)
    return replicas


async def overlapped_step(pipeline: Pipeline, step: int, x: torch.Tensor, y: torch.Tensor) -> list[list[str]]:
    """One step with the reduction at the barrier; returns each rank's non-finite findings."""
    for rank, executor in enumerate(pipeline.executors):
        await executor.begin(pipeline.programs[rank])
    await pipeline.run_to_barrier(step, x, y)
    found: list[list[str]] = []
    for rank, executor in enumerate(pipeline.executors):
        overlap = executor.overlap
        assert overlap is not None

        async def finish(executor: StepExecutor = executor, overlap: OverlappedReduction = overlap) -> None:
            found.append(await executor.compute(overlap.finish))

        await executor.finish(pipeline.programs[rank], finish)
    return found


def test_gradients_are_views_of_their_bucket_again_after_set_to_none() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = backward_order({0: model})
    overlap = OverlappedReduction(params, {0: model}, {}, bucket_bytes=40, reduce=TwoReplicas())
    assert [len(m) for m in overlap.layout] == [2, 1, 1]  # 2 + 8 floats, then 4, then 12
    text = program("0F0 0B0 0BARRIER 0REDUCE 0STEP")
    for _ in range(2):
        overlap.begin(text)
        for bucket, members in enumerate(overlap.layout):
            for i in members:
                grad = params[i].grad
                assert grad is not None and torch.equal(grad, torch.zeros_like(params[i]))
                assert grad.untyped_storage().data_ptr() == overlap.flats[bucket].untyped_storage().data_ptr()
        model(torch.ones(5, 3)).sum().backward()  # accumulates in place, into the buckets
        assert all(bool(flat.abs().sum() > 0) for flat in overlap.flats)
        overlap.abandon()
        torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=True)
        assert all(p.grad is None for p in params)
    overlap.begin(text)  # waits for the abandoned step's sums, then zeroes the buckets again
    assert all(torch.equal(flat, torch.zeros_like(flat)) for flat in overlap.flats)


def test_a_program_without_a_reduce_leaves_the_gradients_alone() -> None:
    model = nn.Linear(3, 2)
    overlap = OverlappedReduction(backward_order({0: model}), {0: model}, {}, bucket_bytes=8,
                                  reduce=TwoReplicas())
    overlap.begin(program("0F0 0B0 0BARRIER 0STEP"))
    assert not overlap.active and model.weight.grad is None


# -- whole steps, every schedule -------------------------------------------------------------------


CASES = [pytest.param(Case(schedule=s, num_ranks=2, num_microbatches=4, fusion=f, optimizer="sgd_momentum"), False,
                      id=f"{s}{'' if f else '-nofusion'}")
         for s in ("1f1b", "gpipe", "zero_bubble", "interleaved") for f in (True, False)] + [
    pytest.param(Case(schedule=s, num_ranks=2, num_microbatches=4, optimizer="sgd_momentum"), True,
                 id=f"{s}-w_batching") for s in ("1f1b", "zero_bubble", "interleaved")]


@pytest.mark.parametrize(("case", "w_batching"), CASES)
async def test_overlapped_steps_train_to_the_bits_of_the_reduction_after_the_barrier(case: Case,
                                                                                      w_batching: bool) -> None:
    plain, overlapped = build_model(), build_model()
    async with open_pipeline(case, plain) as reference, open_pipeline(case, overlapped) as pipeline:
        if w_batching:
            batch_w(reference)
        # About two blocks a bucket: several per rank.
        replicas = attach(pipeline, bucket_bytes=2 << 10, w_batching=w_batching)
        for step, (x, y) in enumerate(global_batches()):
            await reference.train_step(step, x, y)
            assert await overlapped_step(pipeline, step, x, y) == [[] for _ in pipeline.executors]
    for key, value in plain.state_dict().items():
        assert torch.equal(overlapped.state_dict()[key], value), key
    for executor, stand_in in zip(pipeline.executors, replicas):
        assert executor.overlap is not None
        num_buckets = len(executor.overlap.flats)
        assert num_buckets > 1 and stand_in.waited == len(stand_in.started) == num_buckets * len(global_batches())
        flats = [flat.data_ptr() for flat in executor.overlap.flats]
        per_step = [stand_in.started[i:i + num_buckets] for i in range(0, len(stand_in.started), num_buckets)]
        for started in per_step:
            assert [pointer for pointer, _ in started] == flats  # in index order
            # The first bucket went on the wire while a backward action still ran.
            action = started[0][1]
            assert action is not None and Action.parse(action).kind in (_K.B, _K.I, _K.W), started


async def test_a_failed_step_still_starts_every_bucket_and_the_next_step_is_exact() -> None:
    case = Case(schedule="1f1b", num_ranks=2, num_microbatches=4, optimizer="sgd_momentum")
    plain, overlapped = build_model(), build_model()
    async with open_pipeline(case, plain) as reference, open_pipeline(case, overlapped) as pipeline:
        replicas = attach(pipeline, bucket_bytes=2 << 10)
        batches = global_batches()
        for rank, executor in enumerate(pipeline.executors):
            await executor.begin(pipeline.programs[rank])
        bad = torch.full_like(batches[0][1], float("nan"))  # a target of the wrong shape fails the step
        with pytest.raises(ExceptionGroup):
            await pipeline.run_to_barrier(0, batches[0][0], bad[..., :1])
        await pipeline.reset(0)
        for executor, stand_in in zip(pipeline.executors, replicas):
            assert executor.overlap is not None and len(stand_in.started) == len(executor.overlap.flats)
        for step, (x, y) in enumerate(batches, start=1):
            await reference.train_step(step, x, y)
            await overlapped_step(pipeline, step, x, y)
    for key, value in plain.state_dict().items():
        assert torch.equal(overlapped.state_dict()[key], value), key


async def test_a_nonfinite_gradient_is_named_before_the_sum_spreads_it() -> None:
    case = Case(schedule="1f1b", num_ranks=2, num_microbatches=4, optimizer="sgd_momentum")
    async with open_pipeline(case, build_model()) as pipeline:
        attach(pipeline, bucket_bytes=2 << 10)
        x, y = global_batches()[0]
        x = x.clone()
        x[0, 0, 0] = float("nan")
        found = await overlapped_step(pipeline, 0, x, y)
    assert found[0] and found[1]  # both ranks' gradients hold the NaN
    assert all("weight" in name or "bias" in name for names in found for name in names)


class SharedFunctionally(nn.Module):
    """A fused linear whose weight a plain ``F.linear`` uses too: its gradient is written once by
    the fused GEMM and once more by autograd, which no module structure shows."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(self.linear(x), self.linear.weight)


async def test_a_gradient_written_after_its_bucket_started_fails_the_step_once() -> None:
    case = Case(schedule="gpipe", num_ranks=1, num_microbatches=2, optimizer="sgd_momentum")
    torch.manual_seed(0)
    model = nn.Sequential(SharedFunctionally(), SharedFunctionally())
    async with open_pipeline(case, model) as pipeline:
        attach(pipeline, bucket_bytes=4)  # a bucket per parameter: each starts at once
        (x, y), *rest = global_batches()
        with pytest.raises(ExceptionGroup) as caught:
            await overlapped_step(pipeline, 0, x, y)
        failure = caught.value.exceptions[0]
        assert isinstance(failure, ActionFailed) and isinstance(failure.cause, LateGradientWrite)
        assert "linear.weight" in str(failure.cause) and "overlap_reduce=False" in str(failure.cause)
        await pipeline.reset(0)
        # Later steps reduce that gradient at the barrier, and train as without the overlap.
        expected = _one_process_step(model, *rest[0])
        await overlapped_step(pipeline, 1, *rest[0])
    for key, value in expected.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-6)


def _one_process_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parameters after one SGD-with-momentum step of a copy of ``model`` (unfused) on (x, y)."""
    copied = copy.deepcopy(model)
    for sub in copied.modules():  # a deep copy keeps the fused forward bound to the original
        vars(sub).pop("forward", None)
    cls, kwargs = OPTIMIZERS["sgd_momentum"]
    F.mse_loss(copied(x), y).backward()
    cls(copied.parameters(), **kwargs).step()
    return copied.state_dict()



class _Done:
    def wait(self) -> None:
        return None


def test_a_parameter_outliving_its_reduction_does_not_keep_it_or_its_group() -> None:
    # The reduction holds the data-parallel group (through ``reduce``); its parameter hooks
    # once held it strongly through autograd's C++ hook lists, a cycle the collector cannot
    # see, so every stopped job left its gloo threads and sockets behind.
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    params = backward_order({0: model})
    reduction = OverlappedReduction(params, {0: model}, {}, bucket_bytes=1 << 20, reduce=lambda flat: _Done())
    gone = weakref.ref(reduction)
    model(torch.randn(3, 4)).sum().backward()  # the hooks run (inactive: no step began) and stay harmless
    del reduction
    gc.collect()
    assert gone() is None, "the parameters' hooks keep the reduction (and its process group) alive"
    model(torch.randn(3, 4)).sum().backward()  # a hook of a collected reduction does nothing


def test_closing_a_reduction_removes_its_hooks_and_its_way_to_reduce() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    params = backward_order({0: model})
    reduction = OverlappedReduction(params, {0: model}, {}, bucket_bytes=1 << 20, reduce=lambda flat: _Done())
    assert all(p._backward_hooks and p._post_accumulate_grad_hooks for p in model.parameters())
    reduction.close()
    assert not any(p._backward_hooks or p._post_accumulate_grad_hooks for p in model.parameters())
    assert reduction.flats == [] and reduction.params == []
