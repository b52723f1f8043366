"""DeepSpeed's schedules (stages/state/lr.py) give DeepSpeed's learning rates, step for step.

Each expected value is worked out by hand from the formulas in DeepSpeed's
``deepspeed/runtime/lr_schedules.py``, at DeepSpeed iteration ``i = k - 1`` after
``k`` optimizer steps (``k = 0``: as the constructor leaves it).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from stages.state.lr import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

pytestmark = pytest.mark.timeout(60)


def optimizer(kind: str = "sgd", lr: float = 0.1, groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return torch.optim.Adam(params, lr=lr) if kind == "adam" else torch.optim.SGD(params, lr=lr)


def rates(scheduler_cls: type, kwargs: dict[str, Any], steps: int, kind: str = "sgd",
          key: str = "lr") -> list[Any]:
    """The first group's ``key`` after 0, 1, ..., ``steps`` optimizer steps."""
    opt = optimizer(kind)
    scheduler = scheduler_cls(opt, **kwargs)
    seen = [opt.param_groups[0][key]]
    for _ in range(steps):
        opt.step()
        scheduler.step()
        seen.append(opt.param_groups[0][key])
    return seen


LOG5 = math.log(5)
COS_SIXTH = (1 + math.cos(math.pi / 6)) / 2

CASES = [
    pytest.param(WarmupLR, {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 5},
                 {0: 0.01, 1: 0.01, 2: 0.01 + 0.09 * math.log(2) / LOG5, 4: 0.01 + 0.09 * math.log(4) / LOG5,
                  5: 0.1, 6: 0.1, 9: 0.1}, id="warmup-log"),
    pytest.param(WarmupLR, {"warmup_max_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"},
                 {0: 0.0, 1: 0.0, 2: 0.025, 3: 0.05, 4: 0.075, 5: 0.1, 8: 0.1}, id="warmup-linear"),
    # No warmup_max_lr: the optimizer's own lr (0.1); DeepSpeed's is 0.001 whatever that lr (its issue #7303).
    pytest.param(WarmupLR, {"warmup_num_steps": 4, "warmup_type": "linear"}, {3: 0.05, 5: 0.1},
                 id="warmup-max-is-optimizer-lr"),
    # warmup_num_steps below 2 becomes 2.
    pytest.param(WarmupLR, {"warmup_max_lr": 0.1, "warmup_num_steps": 1, "warmup_type": "linear"},
                 {1: 0.0, 2: 0.05, 3: 0.1}, id="warmup-at-least-two-steps"),
    pytest.param(WarmupDecayLR, {"total_num_steps": 10, "warmup_max_lr": 0.1, "warmup_num_steps": 4,
                                 "warmup_type": "linear"},
                 {2: 0.025, 5: 0.1, 6: 0.1 * 5 / 6, 10: 0.1 / 6, 11: 0.0, 12: 0.0}, id="warmup-decay"),
    pytest.param(WarmupDecayLR, {"total_num_steps": 10, "warmup_num_steps": 5},
                 {2: 0.001 * math.log(2) / LOG5, 5: 0.001, 6: 0.001 * 5 / 5}, id="warmup-decay-defaults"),
    pytest.param(WarmupCosineLR, {"total_num_steps": 10, "warmup_min_ratio": 0.1, "warmup_num_steps": 4,
                                  "cos_min_ratio": 0.01, "warmup_type": "linear"},
                 {0: 0.0, 1: 0.01, 3: 0.1 * (0.1 + 0.5 * 0.9), 5: 0.1 * (0.01 + 0.99 * COS_SIXTH),
                  10: 0.1 * 0.01, 12: 0.1 * 0.01}, id="warmup-cosine-linear"),
    pytest.param(WarmupCosineLR, {"total_num_steps": 10, "warmup_min_ratio": 0.1, "warmup_num_steps": 4,
                                  "cos_min_ratio": 0.01},
                 {1: 0.01, 2: 0.1 * (0.1 + 0.5 * 0.9), 3: 0.1 * (0.1 + math.log(3) / math.log(4) * 0.9), 4: 0.1},
                 id="warmup-cosine-log"),
    pytest.param(OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4},
                 {0: 0.01, 1: 0.0325, 3: 0.0775, 4: 0.1, 5: 0.0775, 7: 0.0325, 8: 0.01, 9: 0.01, 12: 0.01},
                 id="one-cycle"),
    pytest.param(OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
                            "decay_lr_rate": 0.5, "decay_step_size": 2},
                 {8: 0.01, 9: 0.01 / 1.25, 11: 0.01 / 1.75}, id="one-cycle-decay"),
    pytest.param(OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 2,
                            "cycle_second_step_size": 6},
                 {1: 0.055, 2: 0.1, 5: 0.1 - 0.09 * 0.5, 8: 0.01}, id="one-cycle-asymmetric"),
    pytest.param(OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
                            "cycle_first_stair_count": 2},
                 {1: 0.01, 2: 0.055, 3: 0.055, 4: 0.1, 5: 0.055, 7: 0.01}, id="one-cycle-stairs"),
]


@pytest.mark.parametrize(("scheduler_cls", "kwargs", "expected"), CASES)
def test_learning_rates_follow_deepspeeds_formulas(scheduler_cls: type, kwargs: dict[str, Any],
                                                   expected: dict[int, float]) -> None:
    seen = rates(scheduler_cls, kwargs, max(expected))
    assert {k: seen[k] for k in expected} == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_one_cycle_cycles_adams_first_beta_inversely_to_the_rate() -> None:
    kwargs = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
              "decay_mom_rate": 0.1, "decay_step_size": 2}
    betas = rates(OneCycle, kwargs, 9, kind="adam", key="betas")
    # DeepSpeed's constructor sets cycle_min_mom (0.8), and its fixed second beta 0.99.
    assert betas[0] == (0.8, 0.99)
    assert [b[0] for b in betas[1:6]] == pytest.approx([0.875, 0.85, 0.825, 0.8, 0.825])
    assert betas[9][0] == pytest.approx(0.9 * 1.05) and betas[9][1] == 0.99
    # SGD has no betas: DeepSpeed turns cycle_momentum off, and so does OneCycle.
    opt = optimizer("sgd")
    assert not OneCycle(opt, 0.01, 0.1).cycle_momentum and "betas" not in opt.param_groups[0]


@pytest.mark.parametrize("scheduler_cls", [WarmupLR, WarmupDecayLR, WarmupCosineLR])
def test_no_warm_up_is_deepspeeds_shortest_one(scheduler_cls: type) -> None:
    # warmup_num_steps=0 is how Hugging Face's integration says "no warm-up"; DeepSpeed takes max(2, it).
    extra = {} if scheduler_cls is WarmupLR else {"total_num_steps": 10}
    none, shortest = ({"warmup_num_steps": steps, "warmup_type": "linear", **extra} for steps in (0, 2))
    assert rates(scheduler_cls, none, 6) == rates(scheduler_cls, shortest, 6)


def test_one_value_per_parameter_group() -> None:
    opt = optimizer(groups=2)
    scheduler = WarmupLR(opt, warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.2], warmup_num_steps=2,
                         warmup_type="linear")
    for _ in range(3):
        opt.step()
        scheduler.step()
    assert scheduler.get_last_lr() == [0.1, 0.2]


@pytest.mark.parametrize(("scheduler_cls", "kwargs", "match"), [
    (WarmupLR, {"warmup_num_steps": -1}, "warmup_num_steps must be an integer >= 0"),
    (WarmupLR, {"warmup_num_steps": 2.5}, "warmup_num_steps must be an integer >= 0"),
    (WarmupLR, {"warmup_type": "cosine"}, "warmup_type must be 'log' or 'linear'"),
    (WarmupLR, {"warmup_max_lr": "high"}, "warmup_max_lr must be a finite number"),
    (WarmupLR, {"warmup_min_lr": [0.0, 0.1]}, r"warmup_min_lr: expected one value per parameter group \(1\)"),
    (WarmupLR, {"last_batch_iteration": 10}, "load a checkpoint"),
    (WarmupDecayLR, {"total_num_steps": 0}, "total_num_steps must be a positive integer"),
    (WarmupCosineLR, {"total_num_steps": 10, "cos_min_ratio": float("nan")}, "cos_min_ratio must be a finite"),
    (OneCycle, {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 0},
     "cycle_first_step_size must be positive"),
    (OneCycle, {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_stair_count": -1},
     "cycle_first_stair_count must be an integer >= 0"),
])
def test_bad_values_are_refused_by_name(scheduler_cls: type, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        scheduler_cls(optimizer(), **kwargs)


def test_state_dict_resumes_the_schedule_exactly() -> None:
    kwargs = {"total_num_steps": 20, "warmup_num_steps": 5}
    first = optimizer()
    running = WarmupCosineLR(first, **kwargs)
    for _ in range(7):
        first.step()
        running.step()
    resumed_opt = optimizer()
    resumed = WarmupCosineLR(resumed_opt, **kwargs)
    resumed.load_state_dict(running.state_dict())
    for _ in range(5):
        for opt, scheduler in ((first, running), (resumed_opt, resumed)):
            opt.step()
            scheduler.step()
        assert resumed.get_last_lr() == running.get_last_lr()


def test_a_resumed_schedule_takes_its_position_and_keeps_its_new_settings() -> None:
    """Found by review: a WarmupDecayLR of 20 steps saved after 10 and loaded into one of 40 (a run extended, as
    DeepSpeed users do) took the saved total back: the rate after step 11 was 0.006667 where DeepSpeed's is
    0.008571. DeepSpeed's schedules restore only last_batch_iteration, and so do these now."""
    first = optimizer()
    running = WarmupDecayLR(first, total_num_steps=20, warmup_num_steps=5, warmup_max_lr=0.01)
    for _ in range(10):
        first.step()
        running.step()
    resumed_opt, fresh_opt = optimizer(), optimizer()
    resumed = WarmupDecayLR(resumed_opt, total_num_steps=40, warmup_num_steps=5, warmup_max_lr=0.01)
    resumed.load_state_dict(running.state_dict())
    longer = WarmupDecayLR(fresh_opt, total_num_steps=40, warmup_num_steps=5, warmup_max_lr=0.01)
    for _ in range(10):
        fresh_opt.step()
        longer.step()
    assert resumed.total_num_steps == 40 and resumed.last_epoch == running.last_epoch
    for _ in range(5):
        for opt, scheduler in ((resumed_opt, resumed), (fresh_opt, longer)):
            opt.step()
            scheduler.step()
        assert resumed.get_last_lr() == longer.get_last_lr()
    assert resumed.get_last_lr()[0] == pytest.approx(0.01 * (40 - 14) / (40 - 5))  # DeepSpeed: iteration 14 of 40
