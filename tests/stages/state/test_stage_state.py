# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/state/test_stage_state.py
"""A stage's state (stages.state.stage_state) in one process: state dicts, checkpoints, snapshots.

Each is checked on a two-rank pipeline of parts (tests/stages/stage_parts.py): a state
dict loads back under the whole model's keys (tied weights under any of their names),
a checkpoint written by both ranks loads back exactly, all or nothing, and a snapshot
restores parameters and optimizer state exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from actors._errors import NotAllowed
from stages.build.stage import layer_key
from stages.state.checkpoint import CheckpointError, Manifest, merge_written
from stages.state.stage_state import held_keys, load_held, state_of
from tests.stages.stage_parts import MODEL_KWARGS, InProcessPipeline, stage_config

pytestmark = pytest.mark.timeout(60)

GPT = {"vocab_size": 16, "dim": 8, "layers": 2, "heads": 2, "context": 4, "tie_embeddings": True}


@pytest.fixture
def pipeline() -> Iterator[InProcessPipeline]:
    pipe = InProcessPipeline([stage_config(rank) for rank in range(2)])
    yield pipe
    pipe.close()


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, MODEL_KWARGS["dim"], generator=gen), torch.randn(8, MODEL_KWARGS["dim"], generator=gen)


def cloned(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def assert_equal(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


# -- state dicts ----------------------------------------------------------------------------


async def test_state_dicts_travel_under_the_whole_models_keys(pipeline: InProcessPipeline) -> None:
    first, last = (rank.state for rank in pipeline.ranks)
    assert first.state_keys() == [f"{layer}.{name}" for layer in (0, 1) for name in
                                  pipeline.ranks[0].built.held[layer].state_dict()]
    whole = cloned({**await first.state_dict(), **await last.state_dict()})
    await pipeline.step(0, *batch())
    assert any(not torch.equal(v, whole[k]) for k, v in pipeline.state().items())  # the step changed them
    # Each rank takes its part (the scheduler splits a whole state dict by each rank's keys).
    taken = await asyncio.gather(*(state.load_state_dict({k: whole[k] for k in state.state_keys()})
                                   for state in (first, last)))
    assert sorted(taken[0] + taken[1]) == sorted(whole)
    assert_equal(pipeline.state(), whole)


@pytest.mark.parametrize(("change", "error", "match"), [
    (lambda s: s.pop("0.norm.weight"), KeyError, "layer 0: missing \\[.0.norm.weight.\\]"),
    (lambda s: s.update({"9.nothing": torch.zeros(1)}), KeyError, "keys this stage does not hold: \\['9.nothing'\\]"),
    (lambda s: s.update({k: torch.zeros(99) for k in list(s)[:1]}), ValueError, "expected shape"),
])
async def test_a_bad_state_dict_loads_nothing(pipeline: InProcessPipeline, change: Any, error: type[Exception],
                                              match: str) -> None:
    state = pipeline.ranks[0].state
    before = cloned(await state.state_dict())
    bad = {k: torch.zeros_like(v) for k, v in before.items()}
    change(bad)
    with pytest.raises(error, match=match):
        await state.load_state_dict(bad)
    assert_equal(await state.state_dict(), before)


def test_a_tied_weight_loads_from_any_of_its_names() -> None:
    pipe = InProcessPipeline([stage_config(rank, model="examples.models:gpt", model_kwargs=GPT,
                                           bounds=[[0, 2], [2, 4]], loss="examples.models:lm_loss")
                              for rank in range(2)])
    try:
        first, last = pipe.ranks
        assert first.built.aliases and first.built.aliases == last.built.aliases
        (name, others), = [(k, v) for k, v in first.built.aliases.items() if k.startswith("0.")]
        assert name in held_keys(first.built.held, first.built.key, first.built.aliases)
        assert not set(others) & set(held_keys(first.built.held, first.built.key))  # held on the other rank
        # A state dict that gives the tied tensor only under the last rank's name fills the first rank's.
        whole = {**state_of(first.built.held, first.built.key), **state_of(last.built.held, last.built.key)}
        given = {k: torch.full_like(v, 0.5) for k, v in whole.items() if k != name}
        load_held(first.built.held, {k: v for k, v in given.items() if k in set(held_keys(
            first.built.held, first.built.key, first.built.aliases))}, first.built.key, first.built.aliases)
        assert torch.equal(state_of(first.built.held, first.built.key)[name], torch.full_like(whole[name], 0.5))
        # Only the lowest pipeline rank counts a tied parameter in the global norm.
        tied_param = first.built.tied.groups[0].param
        assert any(p is tied_param for p in first.built.norm_params)
        assert not any(p is last.built.tied.groups[0].param for p in last.built.norm_params)
    finally:
        pipe.close()


# -- checkpoints --------------------------------------------------------------------------


async def save(pipeline: InProcessPipeline, directory: str, step: int) -> str:
    first = pipeline.ranks[0].state
    staging = await first.begin(directory)
    written = await asyncio.gather(*(rank.state.write(staging, f"p{r}-t0.bin")
                                     for r, rank in enumerate(pipeline.ranks)))
    files, model, state = merge_written(list(written))
    manifest = Manifest(step=step, optimizer="torch.optim:SGD", files=files, model=model, optimizer_state=state)
    return await first.commit(directory, staging, manifest.to_wire())


async def test_a_checkpoint_of_both_ranks_loads_back_exactly(pipeline: InProcessPipeline, tmp_path: Path) -> None:
    await pipeline.step(0, *batch(0))  # momentum buffers exist
    saved = cloned(pipeline.state())
    await save(pipeline, str(tmp_path), 1)
    await pipeline.step(1, *batch(1))
    version, manifest = await pipeline.ranks[0].state.manifest(str(tmp_path))
    plans = [Manifest.from_wire(manifest).restrict(frozenset(rank.state.state_keys(aliases=False)), weights_only=False).to_wire()
             for rank in pipeline.ranks]
    problems = await asyncio.gather(*(rank.state.check(version, plan) for rank, plan in zip(pipeline.ranks, plans)))
    assert problems == [[], []]
    await asyncio.gather(*(rank.state.apply(weights_only=False) for rank in pipeline.ranks))
    assert_equal(pipeline.state(), saved)
    with pytest.raises(CheckpointError, match="nothing to apply"):
        await pipeline.ranks[0].state.apply(weights_only=False)  # phase one again first
    # A plan for the other rank's part finds problems, and then nothing applies.
    assert await pipeline.ranks[0].state.check(version, plans[1])
    with pytest.raises(CheckpointError, match="nothing to apply"):
        await pipeline.ranks[0].state.apply(weights_only=False)


# -- snapshots -----------------------------------------------------------------------------


async def test_a_snapshot_restores_parameters_and_optimizer_exactly(pipeline: InProcessPipeline) -> None:
    await pipeline.step(0, *batch(0))  # momentum buffers exist
    taken = await asyncio.gather(*(rank.state.take_snapshot(1) for rank in pipeline.ranks))
    assert all(t is not None for t in taken)
    assert await pipeline.ranks[0].state.take_snapshot(1) is None  # one per index
    saved = cloned(pipeline.state())
    first = await pipeline.step(1, *batch(1))
    after = cloned(pipeline.state())
    await asyncio.gather(*(rank.state.restore(1, None, 1) for rank in pipeline.ranks))
    assert_equal(pipeline.state(), saved)
    # The same step again from the restored state: the same result, so the momentum came back too.
    again = await pipeline.step(2, *batch(1))
    assert again.loss == first.loss
    assert_equal(pipeline.state(), after)
    assert pipeline.ranks[0].state.indices() == {"own": [1], "held": {}}


@pytest.mark.parametrize(("owner", "index", "snapshot"), [
    (0, 1, {"x": torch.zeros(1)}),  # its own rank
    (2, 1, {"x": torch.zeros(1)}),  # no such rank
    (1, -1, {"x": torch.zeros(1)}), (1, True, {}),  # not a step count
    (1, 1, {"x": 1.0}), (1, 1, [torch.zeros(1)]),  # not tensors
])
def test_keep_refuses_what_is_not_a_neighbours_snapshot(pipeline: InProcessPipeline, owner: Any, index: Any,
                                                        snapshot: Any) -> None:
    state = pipeline.ranks[0].state
    with pytest.raises(NotAllowed, match="a snapshot comes from another rank of this pipeline"):
        state.keep(owner, index, snapshot)
    state.keep(1, 3, {"x": torch.zeros(1)})
    assert state.indices() == {"own": [], "held": {"1": [3]}}
    assert torch.equal(state.held_snapshot(1, 3)["x"], torch.zeros(1))
    with pytest.raises(KeyError, match="no snapshot of step 2; have \\[3\\]"):
        state.held_snapshot(1, 2)
    with pytest.raises(KeyError, match="rank 0 holds no snapshot of rank 0"):
        state.held_snapshot(0, 3)


async def test_snapshot_refuses_a_bad_index_and_loading_forgets_every_snapshot(pipeline: InProcessPipeline) -> None:
    state = pipeline.ranks[0].state
    for index in (-1, True, "1"):
        with pytest.raises(ValueError, match="snapshot takes a step count >= 0"):
            await state.take_snapshot(index)  # type: ignore[arg-type]
    await state.take_snapshot(0)
    state.keep(1, 0, {"x": torch.zeros(1)})
    await state.load_state_dict(await state.state_dict())
    assert state.indices() == {"own": [], "held": {}}


def test_a_tensor_parallel_slice_of_the_wrong_shape_is_named_with_the_whole_models_shapes() -> None:
    """Found by review: with tensor_parallel=2, an (18, 8) tensor given for a (16, 8) weight was refused
    as 'expected shape (8, 8), got (9, 8)', the rank's slices; a state that does not split named no key."""
    from stages.build.tensor_parallel import ShardSpec, shard_state
    from stages.state.stage_state import checked_held

    layer = nn.Sequential(nn.Linear(8, 8))
    layer[0].weight = nn.Parameter(torch.zeros(8, 8))  # rank 0's half of a (16, 8) weight, split along dim 0
    specs = {"0.0.weight": ShardSpec(0, 2)}
    given = shard_state({"0.0.weight": torch.zeros(18, 8), "0.0.bias": torch.zeros(8)}, 0, 2, specs)
    with pytest.raises(ValueError, match=r"^0.0.weight: expected shape \(16, 8\), got \(18, 8\)$"):
        checked_held({0: layer}, given, layer_key, {}, specs)
    with pytest.raises(ValueError, match=r"^0.0.weight: cannot split"):
        shard_state({"0.0.weight": torch.zeros(15, 8)}, 0, 2, specs)
