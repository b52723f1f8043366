"""A stage's schedule (stages/state/lr_scheduler.py): what may be loaded, clear errors, and state kept exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from actors import DEFAULT_ALLOW, NotAllowed, load_object
from stages.state import snapshots
from stages.state.lr_scheduler import (
    build_scheduler,
    check_state,
    decode_state,
    encode_state,
    load_schedule,
    load_state,
    scheduler_state,
)
from stages.state.lr import OneCycle, WarmupLR

pytestmark = pytest.mark.timeout(60)


def sgd(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=lr)


@pytest.mark.parametrize("allow", [(), ("examples",), DEFAULT_ALLOW])
def test_actorpipes_own_schedules_load_whatever_the_allow_list(allow: tuple[str, ...]) -> None:
    assert load_schedule("stages.state.lr:WarmupLR", allow) is WarmupLR
    assert load_schedule("stages.state.lr:OneCycle", allow) is OneCycle


@pytest.mark.parametrize(("path", "match"), [
    # Re-exported from torch: only the node's own allow-list admits those.
    ("stages.state.lr:LRScheduler", "is torch.optim.lr_scheduler.LRScheduler, defined outside"),
    ("stages.state.lr:Optimizer", "is torch.optim.optimizer.Optimizer, defined outside"),
    ("stages.state.lr:math", "reaches module math|names module math"),
    ("stages.state.lr:_per_group", "private or special name"),
    ("stages.state.lr:log", "not a function or class"),
    ("stages.state.lr:WarmupLR.get_lr", "not a learning-rate schedule"),
    ("actors.lrx:WarmupLR", "not on this node's allow-list"),
    ("stages.actor:StageActor", "not on this node's allow-list"),
    ("stages.state.lr_scheduler:build_scheduler", "not on this node's allow-list"),
])
def test_nothing_else_in_actorpipe_is_admitted(path: str, match: str) -> None:
    with pytest.raises(NotAllowed, match=match):
        load_schedule(path, ())


def test_the_admission_is_for_schedules_only_not_other_factories() -> None:
    with pytest.raises(NotAllowed, match="not on this node's allow-list"):
        load_object("stages.state.lr:WarmupLR", DEFAULT_ALLOW)  # as a model, loss or optimizer


def test_torchs_schedules_follow_the_nodes_allow_list() -> None:
    assert load_schedule("torch.optim.lr_scheduler:StepLR", DEFAULT_ALLOW) is torch.optim.lr_scheduler.StepLR
    with pytest.raises(NotAllowed, match="not on this node's allow-list"):
        load_schedule("torch.optim.lr_scheduler:StepLR", ("examples",))


@pytest.mark.parametrize(("spec", "match"), [
    (["stages.state.lr:WarmupLR", {"warmup_num_steps": -1}],
     r"lr_scheduler stages.state.lr:WarmupLR with \['warmup_num_steps'\]: ValueError: warmup_num_steps must be"),
    (["stages.state.lr:WarmupLR", {"warmup_steps": 10}], "lr_scheduler stages.state.lr:WarmupLR .*unexpected keyword"),
    (["torch.optim.lr_scheduler:StepLR", {}], "lr_scheduler torch.optim.lr_scheduler:StepLR .*step_size"),
    (["torch.optim.lr_scheduler:ReduceLROnPlateau", {}], "steps on a validation metric"),
    (["torch.optim:SGD", {"lr": 0.1}], "lr_scheduler torch.optim:SGD"),
])
def test_a_bad_schedule_is_refused_by_name(spec: list[Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_scheduler(spec, sgd(), DEFAULT_ALLOW)


def steps(opt: torch.optim.Optimizer, scheduler: Any, count: int) -> list[tuple[float, Any]]:
    seen = []
    for _ in range(count):
        opt.step()
        scheduler.step()
        group = opt.param_groups[0]
        seen.append((group["lr"], group.get("betas")))
    return seen


SCHEDULES = [
    pytest.param(["torch.optim.lr_scheduler:StepLR", {"step_size": 2, "gamma": 0.5}], "sgd", id="StepLR"),
    pytest.param(["torch.optim.lr_scheduler:OneCycleLR", {"max_lr": 0.5, "total_steps": 20}], "adam",
                 id="OneCycleLR"),
    pytest.param(["stages.state.lr:WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 4}], "sgd",
                 id="WarmupDecayLR"),
    pytest.param(["stages.state.lr:OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3}],
                 "adam", id="OneCycle-momentum"),
]


def optimizer(kind: str) -> torch.optim.Optimizer:
    params = [nn.Parameter(torch.zeros(2))]
    return torch.optim.Adam(params, lr=0.1, betas=(0.9, 0.999)) if kind == "adam" else torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize(("spec", "kind"), SCHEDULES)
def test_state_as_plain_data_continues_the_schedule_exactly(spec: list[Any], kind: str) -> None:
    opt = optimizer(kind)
    running = build_scheduler(spec, opt, DEFAULT_ALLOW)
    steps(opt, running, 5)
    state = decode_state(encode_state(scheduler_state(running)))  # as a snapshot carries it
    fresh_opt = optimizer(kind)
    fresh = build_scheduler(spec, fresh_opt, DEFAULT_ALLOW)
    load_state(fresh, state)
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert fresh_opt.param_groups[0].get("betas") == opt.param_groups[0].get("betas")
    assert steps(fresh_opt, fresh, 8) == steps(opt, running, 8)


def test_state_that_does_not_fit_changes_nothing() -> None:
    opt = sgd()
    scheduler = build_scheduler(["torch.optim.lr_scheduler:StepLR", {"step_size": 2}], opt, DEFAULT_ALLOW)
    good = scheduler_state(scheduler)
    bad_states = [
        ({**good, "scheduler": {**good["scheduler"], "optimizer": "x"}}, "'optimizer' is not part of StepLR"),
        ({**good, "scheduler": {**good["scheduler"], "last_epoch": "x"}}, "last_epoch is a str"),
        ({**good, "groups": []}, "state for 0 parameter groups, the optimizer has 1 (no_weight_decay makes two: "
                                 "resume with the setting the checkpoint was written with, or load its weights only)"),
        ({**good, "groups": [{"weight_decay": 1.0}]}, "param group 0 has no 'weight_decay' to set"),
        ({**good, "groups": [{"lr": float("nan")}]}, "param group 0 lr = nan"),
        ({"scheduler": {}}, "not a map of scheduler and groups"),
    ]
    for state, problem in bad_states:
        assert any(problem in p for p in check_state(scheduler, state)), (problem, check_state(scheduler, state))
        with pytest.raises(ValueError):
            load_state(scheduler, state)
        assert scheduler.state_dict() == good["scheduler"] and opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(ValueError, match="uint8 vector of JSON"):
        decode_state(torch.zeros(3))
    with pytest.raises(ValueError, match="not JSON"):
        decode_state(torch.tensor(list(b"{nope"), dtype=torch.uint8))


def test_a_snapshot_rolls_the_schedule_back_with_the_parameters() -> None:
    torch.manual_seed(0)
    held = {0: nn.Linear(4, 4), 1: nn.Linear(4, 4)}
    opt = torch.optim.SGD([p for layer in held.values() for p in layer.parameters()], lr=0.1, momentum=0.9)
    scheduler = WarmupLR(opt, warmup_max_lr=0.2, warmup_num_steps=6, warmup_type="linear")
    x = torch.randn(8, 4)

    def train(count: int) -> list[float]:
        rates = []
        for _ in range(count):
            held[1](held[0](x)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()
            rates.append(opt.param_groups[0]["lr"])
        return rates

    train(2)
    snapshot = snapshots.capture(held, opt, scheduler)
    want_rates = train(3)
    want = {f"{i}.{k}": v.clone() for i, layer in held.items() for k, v in layer.state_dict().items()}
    snapshots.restore(held, opt, snapshot, scheduler)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2 / 6)
    assert train(3) == want_rates
    got = {f"{i}.{k}": v for i, layer in held.items() for k, v in layer.state_dict().items()}
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="holds no learning-rate schedule"):
        snapshots.restore(held, opt, snapshots.capture(held, opt), scheduler)
