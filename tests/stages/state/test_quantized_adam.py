"""Adam's moments in fewer bits (stages/state/quantized_adam.py): the codes' error and bias, the
checkpoint round trip, and training that follows torch's AdamW.

Run: .venv/bin/python -m pytest tests/stages/state/test_quantized_adam.py -q
"""

from __future__ import annotations

import copy

from typing import Any

import pytest
import torch

from stages.sections import Optimization
from stages.state.quantized_adam import QuantizedAdam, checkpoint_state, decode, encode, encode_loaded, noise_shape
from stages.state.state_precision import adam_arguments
from stages.comm.zero import state_bytes

LEVELS = {(8, "exp_avg"): (127, 2), (8, "exp_avg_sq"): (255, 4), (4, "exp_avg"): (7, 2), (4, "exp_avg_sq"): (15, 4)}


def _moment(name: str, shape: tuple[int, ...] = (48, 300)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen) * torch.logspace(-5, 0, shape[-1])  # every scale in one row
    return x if name == "exp_avg" else x * x


@pytest.mark.parametrize(("bits", "name"), list(LEVELS))
def test_each_code_lies_within_one_level_step_of_the_value(bits: int, name: str) -> None:
    x = _moment(name)
    codes, maxima = encode(x, bits, name, 128, torch.rand(noise_shape(x, 128), generator=torch.Generator().manual_seed(1)))
    decoded = decode(codes, maxima, bits, name, x.shape)
    q, power = LEVELS[(bits, name)]
    # Neighbouring levels (k/q)**p * M are at most p * M / q apart: the widest step.
    widest = maxima.repeat_interleave(128)[:x.numel()].view_as(x) * power / q
    assert ((decoded - x).abs() <= widest * (1 + 1e-6)).all()
    assert decoded.shape == x.shape and decoded.dtype == torch.float32
    # Bytes: one code a byte (8 bits) or two (4 bits) over whole blocks, one float32 maximum a block.
    blocks = -(-x.numel() // 128)
    assert codes.numel() * codes.element_size() == blocks * 128 * bits // 8
    assert maxima.shape == (blocks,)


@pytest.mark.parametrize(("bits", "name"), list(LEVELS))
def test_stochastic_rounding_is_unbiased(bits: int, name: str) -> None:
    x = _moment(name, (8, 256))
    gen = torch.Generator().manual_seed(5)
    total = torch.zeros_like(x)
    draws = 400
    for _ in range(draws):
        codes, maxima = encode(x, bits, name, 128, torch.rand(noise_shape(x, 128), generator=gen))
        one = decode(codes, maxima, bits, name, x.shape)
        total += one
    single = (one - x).norm()
    bias = (total / draws - x).norm()
    # Unbiased: the mean's error shrinks as 1/sqrt(draws) of one draw's (0.05 here); rounding to the
    # nearest level would leave it at about one draw's.
    assert bias < 0.15 * single


def test_a_second_moment_that_is_not_zero_never_decodes_as_zero() -> None:
    x = torch.tensor([[1.0, 1e-30, 0.0, 1e-20] * 4])
    for bits in (8, 4):
        for noise in (torch.zeros(noise_shape(x, 16)), torch.full(noise_shape(x, 16), 0.999)):
            decoded = decode(*encode(x, bits, "exp_avg_sq", 16, noise), bits, "exp_avg_sq", x.shape)
            assert ((decoded > 0) == (x > 0)).all()


@pytest.mark.parametrize("shape", [(48, 300), (7,), (), (3, 5, 6)])
@pytest.mark.parametrize(("bits", "name"), list(LEVELS))
def test_decoded_values_encode_to_the_same_codes(bits: int, name: str, shape: tuple[int, ...]) -> None:
    """A checkpoint stores the moments decoded; loading encodes them again, to the bits they were."""
    x = _moment(name, shape) if shape and shape[-1] > 1 else torch.randn(shape).abs()
    codes, maxima = encode(x, bits, name, 128, torch.rand(noise_shape(x, 128)))
    decoded = decode(codes, maxima, bits, name, x.shape)
    again = encode(decoded, bits, name, 128, torch.full(noise_shape(x, 128), 0.5))
    assert torch.equal(again[0], codes) and torch.equal(again[1], maxima)


def _regression(optimizer: Any, steps: int) -> list[float]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    opt = optimizer(model.parameters())
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(256, 32, generator=gen)
    y = x[:, :4].sum(1, keepdim=True).sin()
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("states", ["bf16", "int8", "int4"])
def test_training_follows_torchs_adamw(states: str) -> None:
    reference = _regression(lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01), 150)
    quantized = _regression(lambda p: QuantizedAdam(p, lr=3e-3, weight_decay=0.01, decoupled=True, states=states), 150)
    assert quantized[0] == reference[0]
    # The first step's update is lr * sign(g) either way (m / sqrt(v) = g / |g|), up to the codes' error.
    assert quantized[1] == pytest.approx(reference[1], rel=0.02)
    assert quantized[-1] < 0.02 * quantized[0]  # it trains
    assert abs(quantized[40] - reference[40]) <= 0.1 * reference[40]


def _stepped(states: str, steps: int = 3) -> tuple[torch.nn.Module, QuantizedAdam]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.Linear(300, 3))
    optimizer = QuantizedAdam(model.parameters(), lr=0.01, states=states)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize(("states", "per_parameter"), [("bf16", 4.0), ("int8", 2.0), ("int4", 1.0)])
def test_the_state_takes_the_bytes_its_precision_says(states: str, per_parameter: float) -> None:
    model, optimizer = _stepped(states)
    params = sum(p.numel() for p in model.parameters())
    # The moments, plus one float32 maximum per block and the padding of each tensor's last block.
    assert per_parameter * params <= state_bytes(optimizer) <= 1.1 * per_parameter * params


@pytest.mark.parametrize("states", ["bf16", "int8", "int4"])
def test_a_checkpoints_float32_moments_load_back_to_the_same_bits(states: str) -> None:
    model, optimizer = _stepped(states)
    saved = {p: {k: v.clone() for k, v in checkpoint_state(optimizer, p).items()} for p in model.parameters()}
    weight = next(model.parameters())
    assert saved[weight]["exp_avg"].dtype == torch.float32 and saved[weight]["exp_avg"].shape == weight.shape
    held = {p: {k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()}
    optimizer.state.clear()
    for p, state in saved.items():
        optimizer.state[p] = state  # as a checkpoint load puts it
    encode_loaded(optimizer)
    for p in model.parameters():
        assert optimizer.state[p].keys() == held[p].keys()
        for key, value in held[p].items():
            assert torch.equal(optimizer.state[p][key], value), key


def test_torchs_adam_state_loads_into_the_quantized_one_and_back() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 300)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    adam.step()
    quantized = QuantizedAdam(model.parameters(), lr=0.01, states="int8")
    for p in model.parameters():
        quantized.state[p] = {k: v.clone() for k, v in adam.state[p].items()}
    encode_loaded(quantized)
    for p in model.parameters():
        back = checkpoint_state(quantized, p)
        assert back["exp_avg"].shape == p.shape
        torch.testing.assert_close(back["exp_avg"], adam.state[p]["exp_avg"], rtol=0.05, atol=1e-4)
        assert torch.equal(quantized.state[p]["step"], adam.state[p]["step"])


def test_the_same_seed_rounds_alike_and_a_parameters_seed_follows_it_into_any_optimizer() -> None:
    _, first = _stepped("int8")
    model, second = _stepped("int8")
    for a, b in zip(first.state.values(), second.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    # A parameter given the seed of its place elsewhere rounds as it did there.
    weight, bias = list(model.parameters())[2:]
    alone = QuantizedAdam([weight, bias], lr=0.01, states="int8", seeds={id(weight): 2, id(bias): 3})
    assert alone._index() == {id(weight): 2, id(bias): 3}


def test_only_adam_and_adamw_take_quantized_moments() -> None:
    assert adam_arguments("torch.optim:AdamW", {"lr": 0.1, "betas": [0.8, 0.9], "foreach": True}, "int8") == \
        {"lr": 0.1, "betas": (0.8, 0.9), "decoupled": True, "states": "int8"}
    assert adam_arguments("torch.optim.adam:Adam", {}, "bf16")["decoupled"] is False
    with pytest.raises(ValueError, match="must be torch.optim:Adam or torch.optim:AdamW, got 'torch.optim:SGD'"):
        Optimization(optimizer=("torch.optim:SGD", {"lr": 0.1}), optimizer_states="int8")
    with pytest.raises(ValueError, match="^optimization.optimizer_states: .*amsgrad=True is not built"):
        Optimization(optimizer=("torch.optim:Adam", {"amsgrad": True}), optimizer_states="int4")
    with pytest.raises(ValueError, match=r"keywords \['capturable_x'\] are not taken"):
        Optimization(optimizer=("torch.optim:Adam", {"capturable_x": 1}), optimizer_states="int4")
    with pytest.raises(ValueError, match="optimizer_states"):
        Optimization(optimizer=("torch.optim:Adam", {}), optimizer_states="int2")
    assert Optimization(optimizer="torch.optim:SGD").optimizer_states == "fp32"  # the default changes nothing


@pytest.mark.parametrize("states", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("shape", [(37, 300), (41, 250)], ids=["last-chunk-of-blocks", "last-chunk-shorter-than-a-block"])
def test_a_parameter_larger_than_a_chunk_is_stepped_a_chunk_at_a_time(states: str, shape: tuple[int, int],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The step holds a few chunks in float32, never the parameter: cut small, the first update (which no
    rounding of the moments reaches) is the same bits, and each chunk's moments decode to torch's.
    11,100 elements end in a chunk of 860, 10,250 in one of 10: shorter than a block, whose codes once
    got a block as narrow as itself (int8 and int4 failed at the first step)."""
    from stages.state import quantized_adam

    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(*shape, generator=gen)
    grad = torch.randn(*shape, generator=gen)
    results = {}
    for chunk in (1 << 18, 1024):
        monkeypatch.setattr(quantized_adam, "CHUNK", chunk)
        p = torch.nn.Parameter(weight.clone())
        p.grad = grad.clone()
        optimizer = QuantizedAdam([p], lr=0.01, weight_decay=0.1, decoupled=True, states=states)
        optimizer.step()
        results[chunk] = (p.detach().clone(), checkpoint_state(optimizer, p))
        optimizer.step()  # the moments decoded a chunk at a time, the last one too
        assert torch.isfinite(p).all()
    assert torch.equal(results[1024][0], results[1 << 18][0])
    reference = torch.nn.Parameter(weight.clone())
    reference.grad = grad.clone()
    adam = torch.optim.AdamW([reference], lr=0.01, weight_decay=0.1)
    adam.step()
    torch.testing.assert_close(results[1024][0], reference.detach(), rtol=0, atol=1e-6)
    for name in ("exp_avg", "exp_avg_sq"):
        expected = adam.state[reference][name]
        got = results[1024][1][name]
        assert (got - expected).norm() <= 0.2 * expected.norm()  # int4's steps are coarse; int8's and bf16's fine


@pytest.mark.parametrize("states", ["bf16", "int8", "int4"])
def test_a_parameter_that_is_not_contiguous_is_updated_in_place(states: str) -> None:
    # A channels_last convolution weight: the update went into a copy, and the weight never moved.
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(8, 3, 3, 3, generator=gen).to(memory_format=torch.channels_last)
    grad = torch.randn(8, 3, 3, 3, generator=gen)
    p, reference = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(weight.clone())
    p.grad, reference.grad = grad.clone(), grad.clone()
    assert not p.is_contiguous()
    QuantizedAdam([p], lr=0.01, states=states).step()
    torch.optim.Adam([reference], lr=0.01).step()
    assert not p.is_contiguous()  # still the same tensor, in its own layout
    torch.testing.assert_close(p.detach(), reference.detach(), rtol=0, atol=1e-6)  # the first step: lr * sign(g)


@pytest.mark.parametrize("states", ["bf16", "int8", "int4"])
def test_torchs_load_state_dict_keeps_the_codes_and_the_next_step_is_the_same(states: str) -> None:
    # torch's Optimizer.load_state_dict casts every state tensor to the parameter's dtype: the codes came
    # back float32 (int8: four times the bytes; int4: the next step failed in bitwise_and).
    gen = torch.Generator().manual_seed(6)
    weight, grads = torch.randn(300, generator=gen), [torch.randn(300, generator=gen) for _ in range(2)]
    p, q = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(weight.clone())
    first, second = QuantizedAdam([p], lr=0.01, states=states), QuantizedAdam([q], lr=0.01, states=states)
    p.grad = grads[0]
    first.step()
    q.data.copy_(p.data)
    second.load_state_dict(copy.deepcopy(first.state_dict()))  # as from a file: torch's shares what it can
    assert {k: v.dtype for k, v in second.state[q].items()} == {k: v.dtype for k, v in first.state[p].items()}
    p.grad, q.grad = grads[1].clone(), grads[1].clone()
    first.step()
    second.step()
    assert torch.equal(p.detach(), q.detach())


def test_a_recovery_snapshot_keeps_the_codes_and_a_replayed_step_rounds_the_same() -> None:
    """Recovery rolls a stage back to a snapshot (stages/state/snapshots.py) and replays the lost steps:
    the snapshot holds the codes as they are, and the replay draws the same rounding noise."""
    from stages.state import snapshots

    model, optimizer = _stepped("int8", steps=2)
    held = {0: model}
    shelf = snapshots.capture(held, optimizer)
    assert {key.rpartition("/")[2] for key in shelf if key.startswith("optim/")} == {
        "step", "exp_avg_codes", "exp_avg_max", "exp_avg_sq_codes", "exp_avg_sq_max"}

    def third_step() -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(99)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    first = third_step()
    codes = [state["exp_avg_codes"].clone() for state in optimizer.state.values()]
    snapshots.restore(held, optimizer, shelf)
    assert torch.equal(third_step()["0.weight"], first["0.weight"])
    assert all(torch.equal(a, state["exp_avg_codes"]) for a, state in zip(codes, optimizer.state.values()))
