"""Tests for examples/models.py.

Run: .venv/bin/python -m pytest -q tests/examples/test_models.py
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.models import generate, gpt, lm_loss, residual_mlp

pytestmark = pytest.mark.timeout(60)

SMALL_GPT = {"vocab_size": 128, "dim": 32, "layers": 2, "heads": 4, "context": 16}


def _param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_residual_mlp_is_the_reference_workload() -> None:
    model = residual_mlp()
    assert isinstance(model, nn.Sequential) and len(model) == 8
    per_block = 2 * 512 + (512 * 2048 + 2048) + (2048 * 512 + 512)  # LayerNorm, fc1, fc2
    assert _param_count(model) == 8 * per_block == 16_805_888
    x = torch.randn(2, 4, 512)
    assert model(x).shape == (2, 4, 512)


@pytest.mark.parametrize(
    ("blocks", "dim", "hidden", "params_per_block"),
    [
        (3, 16, None, 2 * 16 + (16 * 64 + 64) + (64 * 16 + 16)),
        (2, 8, 5, 2 * 8 + (8 * 5 + 5) + (5 * 8 + 8)),
    ],
)
def test_residual_mlp_sizes(blocks: int, dim: int, hidden: int | None, params_per_block: int) -> None:
    model = residual_mlp(blocks=blocks, dim=dim, hidden=hidden)
    assert len(model) == blocks
    assert _param_count(model) == blocks * params_per_block
    assert model(torch.randn(3, 2, dim)).shape == (3, 2, dim)


def test_residual_mlp_block_is_residual() -> None:
    torch.manual_seed(0)
    block = residual_mlp(blocks=1, dim=8)[0]
    nn.init.zeros_(block.fc2.weight)
    nn.init.zeros_(block.fc2.bias)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(block(x), x)


def test_gpt_is_a_sequential_of_one_tensor_layers() -> None:
    torch.manual_seed(0)
    model = gpt(**SMALL_GPT)
    assert isinstance(model, nn.Sequential) and len(model) == 2 + SMALL_GPT["layers"]
    ids = torch.randint(128, (3, 10))
    hidden = model[0](ids)
    assert hidden.shape == (3, 10, 32) and hidden.dtype == torch.float32
    for layer in model[1:-1]:
        hidden = layer(hidden)
        assert hidden.shape == (3, 10, 32)
    logits = model[-1](hidden)
    assert logits.shape == (3, 10, 128)
    torch.testing.assert_close(model(ids), logits)


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    model = gpt(**SMALL_GPT)
    ids = torch.randint(128, (2, 12))
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 128
    before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_gpt_rejects_sequences_longer_than_its_context() -> None:
    model = gpt(**SMALL_GPT)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_gpt_rejects_dim_not_divisible_by_heads() -> None:
    with pytest.raises(ValueError, match="divisible"):
        gpt(dim=30, heads=4)


def test_gpt_is_deterministic_under_manual_seed() -> None:
    torch.manual_seed(123)
    first = gpt(**SMALL_GPT).state_dict()
    torch.manual_seed(123)
    second = gpt(**SMALL_GPT).state_dict()
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=0)
    torch.manual_seed(124)
    third = gpt(**SMALL_GPT).state_dict()
    assert not torch.equal(first["0.token.weight"], third["0.token.weight"])


def test_gpt_starts_near_the_uniform_prediction() -> None:
    # A fresh model should be unsure: its loss close to ln(vocab), not far above it.
    torch.manual_seed(0)
    model = gpt(**SMALL_GPT)
    ids = torch.randint(128, (4, 16))
    loss = lm_loss(model(ids), torch.randint(128, (4, 16)))
    assert abs(loss.item() - torch.log(torch.tensor(128.0)).item()) < 0.2


def test_lm_loss_is_flattened_cross_entropy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(11, (3, 5))
    expected = F.cross_entropy(logits.reshape(15, 11), targets.reshape(15))
    torch.testing.assert_close(lm_loss(logits, targets), expected)
    assert lm_loss(logits, targets).dim() == 0


@pytest.mark.parametrize("top_k", [None, 1, 5])
def test_generate_appends_max_new_tokens(top_k: int | None) -> None:
    torch.manual_seed(0)
    model = gpt(**SMALL_GPT)
    prompt = torch.tensor([1, 2, 3])
    out = generate(model, prompt, max_new_tokens=20, top_k=top_k)  # past the context of 16: crops
    assert out.shape == (23,) and out.dtype == torch.int64
    assert torch.equal(out[:3], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < 128
    assert model.training  # the mode is restored


def test_generate_keeps_a_batch_dimension_and_is_reproducible() -> None:
    torch.manual_seed(0)
    model = gpt(**SMALL_GPT)
    prompt = torch.tensor([[1, 2], [3, 4]])
    first = generate(model, prompt, 5, generator=torch.Generator().manual_seed(7))
    second = generate(model, prompt, 5, generator=torch.Generator().manual_seed(7))
    assert first.shape == (2, 7)
    assert torch.equal(first, second)


def test_generate_with_top_k_one_is_greedy() -> None:
    torch.manual_seed(0)
    model = gpt(**SMALL_GPT)
    prompt = torch.tensor([5, 6, 7])
    out = generate(model, prompt, 1, top_k=1)
    assert out[-1].item() == model(prompt[None])[0, -1].argmax().item()


def test_generate_works_on_a_loaded_state_dict() -> None:
    torch.manual_seed(0)
    trained = gpt(**SMALL_GPT)
    fresh = gpt(**SMALL_GPT)
    fresh.load_state_dict(trained.state_dict())
    prompt = torch.tensor([9, 8])
    a = generate(trained, prompt, 6, generator=torch.Generator().manual_seed(1))
    b = generate(fresh, prompt, 6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
