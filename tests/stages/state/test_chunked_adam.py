"""stages/state/chunked_adam.py: torch's Adam and AdamW to the bit, with temporaries of a slice."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from stages.state.chunked_adam import CHUNK, ChunkedAdam, ChunkedAdamW, chunked

SHAPES = [(2 * CHUNK + 777,), (1000, 700), (10,), (CHUNK,), (3, 5, CHUNK // 7)]


def parameters(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for shape in SHAPES]


def train(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], steps: int = 4
          ) -> tuple[list[torch.Tensor], dict[str, Any]]:
    params = parameters(0)
    optimizer = cls(params, **kwargs)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator) * 0.1
        optimizer.step()
    return [p.detach() for p in params], copy.deepcopy(optimizer.state_dict())


@pytest.mark.parametrize(("torch_cls", "ours"), [(torch.optim.Adam, ChunkedAdam), (torch.optim.AdamW, ChunkedAdamW)])
@pytest.mark.parametrize("kwargs", [{}, {"lr": 0.1, "weight_decay": 0.1}, {"amsgrad": True, "betas": (0.8, 0.9)},
                                    {"maximize": True, "eps": 1e-3}])
def test_the_chunked_step_is_torch_s_to_the_bit(torch_cls: type[torch.optim.Optimizer],
                                                 ours: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> None:
    expected, expected_state = train(torch_cls, kwargs)
    got, state = train(ours, kwargs)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert state["param_groups"] == expected_state["param_groups"]
    for index, values in expected_state["state"].items():
        assert set(state["state"][index]) == set(values)
        for key, value in values.items():
            assert torch.equal(state["state"][index][key], value), (index, key)


def test_its_state_dict_is_torch_s_both_ways() -> None:
    params = parameters(0)
    ours = ChunkedAdam(params, lr=0.01)
    for p in params:
        p.grad = torch.ones_like(p)
    ours.step()
    theirs = torch.optim.Adam(parameters(0), lr=0.01)
    theirs.load_state_dict(ours.state_dict())
    assert isinstance(ours, torch.optim.Adam)
    assert float(theirs.state_dict()["state"][0]["step"]) == 1.0


def test_a_step_holds_slices_not_parameters() -> None:
    # The largest temporary a step makes: at most a slice's bytes, where torch's step makes the parameter's.
    param = torch.nn.Parameter(torch.zeros(8 * CHUNK))
    param.grad = torch.ones_like(param)
    sizes: list[int] = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and getattr(func, "__name__", "").rstrip("_") in ("sqrt", "div", "truediv",
                                                                                           "__truediv__"):
                sizes.append(out.numel())
            return out

    for cls, bound in ((torch.optim.Adam, 8 * CHUNK), (ChunkedAdam, CHUNK)):
        sizes.clear()
        optimizer = cls([param], lr=0.01)
        with Watch():
            optimizer.step()
        assert sizes and max(sizes) == bound, (cls, sizes[:4])


def test_the_stage_takes_it_only_where_torch_would_run_its_single_tensor_step() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert chunked(torch.optim.Adam, {"lr": 1.0}, cpu) is ChunkedAdam
    assert chunked(torch.optim.AdamW, {}, cpu) is ChunkedAdamW
    assert chunked(torch.optim.Adam, {}, meta) is torch.optim.Adam  # not CPU
    for flag in ("foreach", "fused", "capturable", "differentiable"):
        assert chunked(torch.optim.Adam, {flag: True}, cpu) is torch.optim.Adam
    assert chunked(torch.optim.SGD, {}, cpu) is torch.optim.SGD
