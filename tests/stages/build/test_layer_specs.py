"""A model given as layer specs: a stage builds only its own layers, each under its own seed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from actors._registry import DEFAULT_ALLOW, EXAMPLE_FACTORIES
from examples.models import ResidualMLPBlock, residual_mlp_layers
from stages import LayerSpec, layered_model
from stages.build.layer_specs import build_specs, layer_seed
from stages.build.layers import build_layers, layer_parameter_counts
from tests.stages.stage_parts import stage_config

ALLOW = DEFAULT_ALLOW + EXAMPLE_FACTORIES
KWARGS = {"blocks": 4, "dim": 8, "hidden": 16}


def test_each_layer_has_a_seed_of_its_own_that_depends_on_the_job_seed() -> None:
    seeds = {layer_seed(seed, index) for seed in range(4) for index in range(64)}
    assert len(seeds) == 4 * 64  # seed 0 layer 1 is not seed 1 layer 0
    assert layer_seed(7, 3) == layer_seed(7, 3) and 0 <= layer_seed(7, 3) < 2**63


def test_held_layers_are_built_for_real_and_the_rest_on_meta_with_the_weights_one_process_gets() -> None:
    specs = residual_mlp_layers(**KWARGS)
    whole = layered_model(specs, seed=11)
    before = torch.random.get_rng_state()
    layers = build_specs(specs, 11, held={1, 3})
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's random state is untouched
    for index, layer in enumerate(layers):
        params = list(layer.parameters())
        if index in (1, 3):
            assert all(not p.is_meta for p in params)
            for mine, reference in zip(params, whole[index].parameters()):
                assert torch.equal(mine, reference)  # bit for bit, whatever else was built before it
        else:
            assert all(p.is_meta for p in params)
    # Another seed, other weights; the same seed in another layout, the same weights.
    assert not torch.equal(layered_model(specs, seed=12)[1].fc1.weight, whole[1].fc1.weight)
    assert torch.equal(build_specs(specs, 11, held={1})[1].fc1.weight, whole[1].fc1.weight)


def test_a_stage_builds_only_the_layers_it_holds() -> None:
    config = stage_config(1, model="examples.models:residual_mlp_layers", model_kwargs=dict(KWARGS), seed=5)
    assert config.bounds == [[0, 2], [2, 4]]
    layers = build_layers(config, ALLOW)
    whole = layered_model(residual_mlp_layers(**KWARGS), seed=5)
    assert [all(p.is_meta for p in layer.parameters()) for layer in layers] == [True, True, False, False]
    for index in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(layers[index].parameters(), whole[index].parameters()))


def test_the_inspector_counts_layer_specs_on_the_meta_device() -> None:
    counts = layer_parameter_counts("examples.models:residual_mlp_layers", dict(KWARGS), ALLOW)
    block = sum(p.numel() for p in ResidualMLPBlock(8, 16).parameters())
    assert counts == [block] * 4
    assert layer_parameter_counts("examples.models:residual_mlp_layers", dict(KWARGS), ALLOW, whole=True) == [4 * block]
    frozen = "tests.helpers.models:frozen_embedding_chain"
    assert layer_parameter_counts(frozen, {}, ALLOW + ("tests.helpers.models",)) == [16_000, *[272] * 4]
    assert layer_parameter_counts(frozen, {}, ALLOW + ("tests.helpers.models",), trainable=True) == [0, *[272] * 4]


def test_a_spec_that_does_not_build_a_module_is_refused() -> None:
    with pytest.raises(TypeError, match="takes a module class or a function"):
        LayerSpec(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"LayerSpec\(.*\) built a int, not an nn.Module"):
        LayerSpec(lambda: 3).build()  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="non-empty list of LayerSpec"):
        layered_model([nn.Linear(2, 2)], seed=0)  # type: ignore[list-item]
