"""``no_weight_decay``: which parameters a job's optimizer leaves out of weight decay (stages.state.weight_decay)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stages import parameter_groups
from stages.comm.zero import ShardedOptimizer
from stages.sections import Optimization
from stages.state.weight_decay import BIASES_AND_NORMS, check_rule


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.block = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(x))))


def names_of(groups: list[dict[str, object]], model: nn.Module) -> list[list[str]]:
    name = {id(p): n for n, p in model.named_parameters()}
    return [[name[id(p)] for p in group["params"]] for group in groups]  # type: ignore[attr-defined]


def test_the_spec_keeps_the_shorthand_or_a_list_of_names_and_refuses_the_rest() -> None:
    assert Optimization().no_weight_decay == ()
    assert Optimization(no_weight_decay="biases_and_norms").no_weight_decay == (BIASES_AND_NORMS,)
    assert Optimization(no_weight_decay=["*.bias", "norm.*"]).no_weight_decay == ("*.bias", "norm.*")
    with pytest.raises(ValueError, match=r"optimization.no_weight_decay must be 'biases_and_norms' or a list .*"
                                         r"one pattern goes in a list: \['\*.bias'\]"):
        Optimization(no_weight_decay="*.bias")
    for bad in (["*.bias", ""], [3], 7, ["*"] * 257, ["x" * 513]):
        with pytest.raises(ValueError, match="optimization.no_weight_decay(: at most 256| must be)"):
            check_rule("optimization.no_weight_decay", bad)


def test_biases_and_norms_leaves_out_every_parameter_of_fewer_than_two_dimensions() -> None:
    model = TiedLM()
    groups = parameter_groups(model.named_parameters(remove_duplicate=False), (BIASES_AND_NORMS,))
    assert names_of(groups, model) == [["embed.weight", "block.weight"], ["block.bias", "norm.weight", "norm.bias"]]
    assert [set(g) - {"params"} for g in groups] == [set(), {"weight_decay"}] and groups[1]["weight_decay"] == 0.0
    # No rule: one group of every parameter, the tied one once.
    assert names_of(parameter_groups(model.named_parameters(remove_duplicate=False), ()), model) == [
        ["embed.weight", "block.weight", "block.bias", "norm.weight", "norm.bias"]]


def test_a_name_pattern_matches_a_tied_parameter_under_any_of_its_names() -> None:
    model = TiedLM()
    # The tied weight is "embed.weight" in named_parameters(); a stage may know it as "head.weight".
    groups = parameter_groups(model.named_parameters(remove_duplicate=False), ("head.*", "*.bias"))
    assert names_of(groups, model) == [["block.weight", "norm.weight"], ["embed.weight", "block.bias", "norm.bias"]]


def test_the_groups_train_as_torch_trains_them_and_only_the_decayed_ones_shrink() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(parameter_groups(model.named_parameters(remove_duplicate=False),
                                                   (BIASES_AND_NORMS,)), lr=0.1, weight_decay=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # nothing but the decay moves a parameter
    optimizer.step()
    for name, p in model.named_parameters():
        if p.dim() < 2:
            assert torch.equal(p, start[name]), name
        else:
            assert torch.equal(p, start[name] * (1 - 0.1 * 0.5)), name


def test_a_sharded_optimizer_keeps_the_groups_paired_with_its_shard_of_each() -> None:
    model = TiedLM()
    params = list(model.parameters())
    groups = parameter_groups(model.named_parameters(remove_duplicate=False), (BIASES_AND_NORMS,))
    # Shard 1 owns the block's parameters only: its share of the decayed group is one tensor.
    owners = {id(p): int(p is model.block.weight or p is model.block.bias) for p in params}
    sharded = ShardedOptimizer(groups, torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.5}, shard=1, ranks=[0, 1],
                               group=lambda: None, bucket_bytes=1 << 20, owners=owners)
    assert [len(g["params"]) for g in sharded.param_groups] == [2, 3]
    assert [g["params"] for g in sharded.inner.param_groups] == [[model.block.weight], [model.block.bias]]
    assert [g["weight_decay"] for g in sharded.inner.param_groups] == [0.5, 0.0]
    # A schedule sets the outer groups; the step hands each group's settings to its own inner group.
    sharded.param_groups[0]["lr"], sharded.param_groups[1]["lr"] = 0.2, 0.3
    sharded._hand_settings_in()
    assert [g["lr"] for g in sharded.inner.param_groups] == [0.2, 0.3]


@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_moments_in_fewer_bits_keep_each_groups_weight_decay(states: str) -> None:
    from stages.state.quantized_adam import QuantizedAdam

    torch.manual_seed(0)
    model = TiedLM()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = QuantizedAdam(parameter_groups(model.named_parameters(remove_duplicate=False), (BIASES_AND_NORMS,)),
                              lr=0.1, weight_decay=0.5, decoupled=True, states=states)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, start[name] if p.dim() < 2 else start[name] * (1 - 0.1 * 0.5)), name
