# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/compute/test_activations.py
"""Activation checkpointing and stash measurement (stages.compute.activations), in one process.

The in-memory pipeline of tests/stages/compute/test_executor.py runs every schedule with and
without checkpointing: the parameters must come out bit for bit the same, and the
bytes a rank holds between forward and backward must drop. (Its ranks share one
process's RNG from several threads, so dropout is tested here on one module, and
across stage processes in tests/schedulers/test_activation_checkpointing.py.)
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stages.compute import activations as _activations
from stages.build.layers import Chain
from schedulers.schedules import SCHEDULES
from tests.stages.compute.test_executor import Block, Case, accepted, build_model, global_batches, open_pipeline

pytestmark = pytest.mark.timeout(60)


# -- checkpointed: the same values and gradients, less kept ---------------------------


class Pair(nn.Module):
    """Takes a tree (a tuple and a keyword dict) and returns one: a boundary value's shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor], *, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        a, b = pair
        return F.dropout(self.fc(a) * b + extra["bias"], 0.5)


def _grads_of(recompute: bool) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    torch.manual_seed(0)
    module = Pair()
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    extra = {"bias": torch.randn(4, requires_grad=True)}
    torch.manual_seed(7)  # the dropout mask
    with _activations.SavedActivations({}) as saved:
        out = (_activations.checkpointed(module, (a, b), extra=extra) if recompute
               else module((a, b), extra=extra))
    torch.manual_seed(99)  # whatever the RNG does meanwhile, the recompute replays the forward's
    out.square().sum().backward()
    grads = [t.grad for t in (a, extra["bias"], module.fc.weight, module.fc.bias)]
    assert all(g is not None for g in grads)
    return out.detach(), grads, sum(saved.storages.values())  # type: ignore[misc]


def test_checkpointed_tree_arguments_give_the_same_values_and_gradients_and_keep_only_the_arguments() -> None:
    out, grads, kept = _grads_of(recompute=False)
    out_ck, grads_ck, kept_ck = _grads_of(recompute=True)
    assert torch.equal(out, out_ck)
    assert all(torch.equal(g, h) for g, h in zip(grads, grads_ck))
    # Kept with checkpointing: a, b and the bias, nested in the tuple and the dict (3*4 + 3*4 + 4 floats).
    assert kept_ck == (12 + 12 + 4) * 4
    assert kept > kept_ck  # without: also fc's output, the product and the dropout mask


def test_saved_activations_count_a_storage_once_and_leave_out_the_resident() -> None:
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    resident = _activations.storages([weight])
    with _activations.SavedActivations(resident) as saved:
        h = x @ weight  # saves x and weight
        y = h.view(2, 16).sin().sum() + h.sin().sum()  # saves h twice: as a view and as itself, one storage
    y.sum().backward()
    assert sum(saved.storages.values()) == x.numel() * 4 + h.numel() * 4
    assert _activations.union_bytes([saved.storages, saved.storages]) == sum(saved.storages.values())


@pytest.mark.parametrize(("setting", "every"), [(False, 0), (True, 1), (1, 1), (3, 3)])
def test_checkpoint_interval(setting: bool | int, every: int) -> None:
    assert _activations.checkpoint_interval(setting) == every


def test_a_chain_checkpoints_each_run_of_layers_and_keeps_their_inputs() -> None:
    torch.manual_seed(0)
    layers = [Block() for _ in range(4)]
    x = torch.randn(2, 3, 8, requires_grad=True)
    for every, kept_inputs in [(1, 4), (2, 2), (3, 2), (4, 1)]:
        with _activations.SavedActivations({}) as saved:
            Chain(*layers, checkpoint_every=every)(x)
        assert sum(saved.storages.values()) == kept_inputs * x.numel() * 4, every


# -- the executor: every schedule, bit for bit ----------------------------------------


async def train(case: Case, model: nn.Sequential, every: int) -> tuple[list[float], list[int], list[int]]:
    """Three steps; the losses, and each rank's peak stash bytes and count in the last step."""
    async with open_pipeline(case, model, checkpoint_every=every) as pipeline:
        losses = []
        for step, (x, y) in enumerate(global_batches()):
            loss, traces = await pipeline.train_step(step, x, y)
            losses.append(loss)
    return losses, [t.peak_stash_bytes for t in traces], [t.peak_stash for t in traces]


CASES = [case for case in (
    Case(schedule=name, num_ranks=ranks, num_microbatches=4, fusion=fusion)
    for name, ranks, fusion in itertools.product(SCHEDULES, [2, 4], [True, False])) if accepted(case)]


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=str)
async def test_checkpointing_trains_bit_for_bit_as_without_and_holds_less(case: Case, every: int) -> None:
    plain_model, model = build_model(), build_model()
    expected_losses, plain_bytes, plain_stash = await train(case, plain_model, every=0)
    losses, held_bytes, stash = await train(case, model, every=every)
    for (name, expected), value in zip(plain_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(value, expected), name
    assert losses == expected_losses
    assert stash == plain_stash  # the same micro-batches are held, each by less
    assert all(0 < held < plain for held, plain in zip(held_bytes, plain_bytes)), (held_bytes, plain_bytes)


async def test_whole_stage_checkpoints_hold_their_boundary_values_only() -> None:
    """1F1B, 2 ranks of 4 blocks each, backward unsplit: a held micro-batch keeps rank 0's
    output (its input is the step's batch, which lives anyway), and rank 1's input, its
    output (which the loss saves) and the loss."""
    case = Case(schedule="1f1b", num_ranks=2, num_microbatches=4, fusion=False)
    _, held_bytes, stash = await train(case, build_model(), every=4)
    activation = global_batches()[0][0][:4].numel() * 4  # one micro-batch's boundary value
    assert held_bytes == [stash[0] * activation, stash[1] * (2 * activation + 4)]
