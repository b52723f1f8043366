"""meta_init (stages/build/meta_init.py): parameters on the meta device, each made real by its
module's own initializer under a seed of its name, the same in any layout.

Run: .venv/bin/python -m pytest tests/stages/build/test_meta_init.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from examples.models import gpt
from stages.build.meta_init import (
    MetaInitError,
    buffers_on_meta,
    materialize,
    meta_initialized,
    meta_values,
    module_seed,
    on_meta,
    parameters_on_meta,
    restore_buffers,
    retarget,
)
from stages.build.traced import trace_stages

KWARGS = {"vocab_size": 64, "dim": 16, "layers": 3, "heads": 2, "context": 8, "tie_embeddings": True}


class Scaled(nn.Module):
    """A module whose parameter no initializer it has sets."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("steps", torch.arange(4))


def test_parameters_go_to_the_meta_device_and_buffers_stay_real() -> None:
    with parameters_on_meta():
        model = Scaled()
        linear = nn.Linear(3, 2)
    assert model.scale.is_meta and linear.weight.is_meta and linear.bias.is_meta
    assert torch.equal(model.steps, torch.arange(4))  # what a forward computes with besides the weights
    assert not nn.Linear(3, 2).weight.is_meta  # only inside


def test_each_stage_makes_the_weights_one_process_makes_and_tied_ones_stay_one() -> None:
    reference = meta_initialized(gpt, KWARGS, seed=5)
    with parameters_on_meta():
        model = gpt(**KWARGS)
    head = f"{KWARGS['layers'] + 1}.out.weight"
    # Each "stage" makes only its own layers: 0-1, then 2-4 (the tied head's is the embedding's).
    for held in ([0, 1], [2, 3, 4]):
        wanted = [f"{i}.{name}" for i in held for name, _ in model[i].named_parameters(remove_duplicate=False)]
        materialize(model, meta_values(model, 5, wanted))
    state = model.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key], value), key
    assert model[0].token.weight is model[KWARGS["layers"] + 1].out.weight  # one tensor, both names
    assert torch.equal(state[head], state["0.token.weight"])
    # A module's seed is its name's: another seed, other weights; the same, the same.
    assert module_seed(5, "1.attn.qkv") != module_seed(5, "2.attn.qkv") != module_seed(6, "2.attn.qkv")
    assert not torch.equal(meta_initialized(gpt, KWARGS, seed=6).state_dict()["1.attn.qkv.weight"],
                           state["1.attn.qkv.weight"])


def test_a_stage_that_holds_the_head_alone_still_ties_it_to_the_embedding_it_does_not_hold() -> None:
    with parameters_on_meta():
        model = gpt(**KWARGS)
    last = KWARGS["layers"] + 1
    wanted = [f"{last}.{name}" for name, _ in model[last].named_parameters()]
    materialize(model, meta_values(model, 0, wanted))
    assert model[last].out.weight is model[0].token.weight and not model[0].token.weight.is_meta
    assert model[0].position.weight.is_meta  # the rest of layer 0 is another stage's


def test_a_model_traced_on_the_meta_device_computes_as_one_process_once_made_real() -> None:
    with parameters_on_meta():
        model = gpt(**KWARGS)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    stages = trace_stages(model, ["2"], on_meta(tokens), "gpt")
    for stage in stages:
        names = [name for name, _ in stage.module.named_parameters(remove_duplicate=False)]
        materialize(stage.module, meta_values(model, 0, names), also=[s.module for s in stages])
        retarget(stage, torch.device("cpu"))  # the trace made its position ids on the meta device
    assert torch.equal(stages[1](stages[0](tokens)), meta_initialized(gpt, KWARGS, seed=0)(tokens))


def test_a_model_that_computes_with_buffers_traces_on_meta_and_each_stage_takes_back_the_real_ones() -> None:
    from tests.helpers.models import causal_mixer
    with parameters_on_meta():
        model = causal_mixer()
    model.blocks[3].mask = model.blocks[1].mask  # one buffer under two names, in two stages
    masks = [block.mask for block in model.blocks]
    x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(1))
    with buffers_on_meta(model) as real:
        assert all(block.mask.is_meta for block in model.blocks) and model.blocks[3].mask is model.blocks[1].mask
        stages = trace_stages(model, ["blocks.2"], on_meta(x), "causal_mixer", dynamic=False)
    assert [block.mask for block in model.blocks] == masks  # the model holds its own again
    for stage in stages:
        names = [name for name, _ in stage.module.named_parameters(remove_duplicate=False)]
        materialize(stage.module, meta_values(model, 0, names), also=[s.module for s in stages])
        restore_buffers(stage.module, real)
    held = [dict(stage.module.named_buffers(remove_duplicate=False)) for stage in stages]
    assert held[0]["blocks.0.mask"] is masks[0] and held[1]["blocks.2.mask"] is masks[2]
    assert held[0]["blocks.3.mask"] is masks[1] is held[1]["blocks.3.mask"]  # the trace names a shared one once
    reference = meta_initialized(causal_mixer, {}, seed=0)
    reference.blocks[3].mask = reference.blocks[1].mask
    assert torch.equal(stages[1](stages[0](x)), reference(x))
    stray = nn.Module()
    stray.register_buffer("made", torch.empty(2, device="meta"))  # a constant the trace made on meta
    with pytest.raises(MetaInitError, match=r"made: the trace on the meta device made this tensor"):
        restore_buffers(stray, real)


def test_a_module_nothing_can_initialize_is_named() -> None:
    with parameters_on_meta():
        model = nn.Sequential(nn.Linear(4, 4), Scaled())
    with pytest.raises(MetaInitError, match=r"module 1 \(Scaled\) owns parameters \['scale'\] and has no "
                                            r"reset_parameters"):
        meta_values(model, 0)
    assert set(meta_values(model, 0, ["0.weight", "0.bias"])) == {"0.weight", "0.bias"}  # the rest is fine

    class Partial(Scaled):
        def reset_parameters(self) -> None:
            pass  # sets nothing: the parameter would start as garbage

    with parameters_on_meta():
        partial = nn.Sequential(Partial())
    with pytest.raises(MetaInitError, match=r"initializing module 0 \(Partial\) left \['scale'\] unset"):
        meta_values(partial, 0)



def test_what_the_factory_draws_for_real_is_the_stages_whatever_the_callers_random_state() -> None:
    # Only parameters go to the meta device: a buffer the constructor draws is made as usual, from the
    # random state. Each stage seeds it before calling the factory; meta_initialized did not, so its
    # buffers followed whatever the caller had drawn before.
    from actors._registry import DEFAULT_ALLOW
    from stages.build.layers import build_layers
    from tests.helpers.models import random_features
    from tests.stages.stage_parts import stage_config

    torch.manual_seed(1234)
    reference = meta_initialized(random_features, {"dim": 4}, seed=3)
    after = torch.rand(1)
    torch.manual_seed(1234)
    assert torch.equal(torch.rand(1), after)  # the caller's random state is left as it was
    for rank in (0, 1):
        config = stage_config(rank, model="tests.helpers.models:random_features", model_kwargs={"dim": 4}, seed=3,
                              meta_init=True, bounds=[[0, 1], [1, 2]])
        layer = build_layers(config, DEFAULT_ALLOW + ("tests.helpers",))[rank]
        assert torch.equal(layer.proj, reference[rank].proj) and torch.equal(layer.fc.weight, reference[rank].fc.weight)



def test_a_sequential_with_named_children_is_made_as_its_stages_make_it() -> None:
    # A stage takes a Sequential's children by position ("0", "2": its seeds and its keys); the reference
    # kept the names ("fc1", "fc2"), so every weight differed from the job's and its keys did too.
    from actors._registry import DEFAULT_ALLOW
    from stages.build.layers import build_layers
    from tests.helpers.models import named_mlp
    from tests.stages.stage_parts import stage_config

    reference = meta_initialized(named_mlp, {"dim": 8}, seed=3)
    assert list(reference.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for rank, held in ((0, [0, 1]), (1, [2])):
        config = stage_config(rank, model="tests.helpers.models:named_mlp", model_kwargs={"dim": 8}, seed=3,
                              meta_init=True, bounds=[[0, 2], [2, 3]])
        layers = build_layers(config, DEFAULT_ALLOW + ("tests.helpers",))
        for i in held:
            for key, value in layers[i].state_dict().items():
                assert torch.equal(value, reference.state_dict()[f"{i}.{key}"]), f"{i}.{key}"
