"""Model factories for tests, named by import path like any user's."""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Explode(nn.Module):
    """Raises on its ``at``-th forward call (counting from 1), passes through otherwise."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError(f"boom on call {self.calls}")
        return x


class Stall(nn.Module):
    """Sleeps on every forward: keeps a step busy long enough to act during it.

    With a ``gate`` (a file's path), it sleeps only while that file exists, so that a test
    slows down just the step it acts in and runs the others at full speed.
    """

    def __init__(self, seconds: float, gate: str | None = None) -> None:
        super().__init__()
        self.seconds = seconds
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None or os.path.exists(self.gate):
            time.sleep(self.seconds)
        return x


def linear_stack(layers: int = 4, dim: int = 8) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])


def exploding(layers: int = 4, dim: int = 8, explode_layer: int = 3, at: int = 2) -> nn.Sequential:
    """A linear stack whose layer ``explode_layer`` raises on its ``at``-th forward."""
    stack = [nn.Linear(dim, dim) for _ in range(layers)]
    stack[explode_layer] = nn.Sequential(nn.Linear(dim, dim), Explode(at))
    return nn.Sequential(*stack)


def stalling(layers: int = 2, dim: int = 8, seconds: float = 0.5, gate: str | None = None) -> nn.Sequential:
    """Linears that each sleep ``seconds`` per forward (only while the file ``gate`` exists, if given)."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), Stall(seconds, gate)) for _ in range(layers)])


@contextlib.contextmanager
def stalled(gate: Path) -> Iterator[None]:
    """Makes ``gate`` exist for the block: a :func:`stalling` model built with it sleeps in
    every forward inside the block and in none outside it."""
    gate.touch()
    try:
        yield
    finally:
        gate.unlink()


class RejectNonFinite(nn.Module):
    """Raises on an input with NaN or inf: a fault that only some data triggers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(x).all():
            raise ValueError("non-finite input")
        return x


def guarded(layers: int = 2, dim: int = 8) -> nn.Sequential:
    """A linear stack that refuses non-finite inputs in its last layer."""
    stack: list[nn.Module] = [nn.Linear(dim, dim) for _ in range(layers)]
    stack[-1] = nn.Sequential(RejectNonFinite(), stack[-1])
    return nn.Sequential(*stack)


class TwoLayerNet(nn.Module):
    """An ordinary nn.Module (not a Sequential): its forward is code, not a list of layers."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def two_layer_net(dim: int = 8) -> TwoLayerNet:
    return TwoLayerNet(dim)


def skewed_cnn(channels: int = 32, size: int = 16, classes: int = 10) -> nn.Sequential:
    """Convolutions that cost the compute, then one linear that holds most parameters."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(channels * size * size, classes),
    )


class Spin(nn.Module):
    """A linear whose forward also spends a fixed amount of CPU in a Python loop: a cost that
    a layer's CPU time measures alike on a quiet machine and a busy one."""

    def __init__(self, dim: int, iterations: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.iterations = iterations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.iterations):
            pass
        return self.linear(x)


def spin_chain(dim: int = 8, heavy: int = 4, iterations: int = 300_000, wide: int = 4096) -> nn.Sequential:
    """``heavy`` layers of equal, CPU-bound cost, then two wide linears that hold nearly every
    parameter and cost next to nothing: by parameters the split falls after the first wide one,
    by time in the middle of the heavy layers (by a margin of a whole layer's cost each side)."""
    return nn.Sequential(*(Spin(dim, iterations) for _ in range(heavy)), nn.Linear(dim, wide), nn.Linear(wide, dim))


def image_batches(batch_size: int = 16, size: int = 16, classes: int = 10) -> Any:
    """``batch(step)``: random images ``[B, 3, size, size]`` and regression targets ``[B, classes]``."""
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        return (torch.randn(batch_size, 3, size, size, generator=generator),
                torch.randn(batch_size, classes, generator=generator))
    return batch


# -- models that are not a plain chain of tensors (see docs/models.md) ---------------------------


class MaskedEmbed(nn.Module):
    """Takes the model's two inputs (token ids and an integer mask) and returns a dict."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, dim)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        return {"hidden": self.token(ids), "mask": mask, "scale": 0.5, "unused": None}


class MaskedBlock(nn.Module):
    """A dict in, a dict out: mixes tokens only where the integer mask is 1."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mix = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)

    def forward(self, state: dict[str, Any]) -> dict[str, Any]:
        hidden, mask = state["hidden"], state["mask"]
        keep = mask.unsqueeze(-1).to(hidden.dtype)
        mixed = torch.tanh(self.mix(hidden)) * keep * state["scale"] + hidden
        # A second activation that needs a gradient, beside the first: a tuple inside the dict.
        return {"hidden": mixed, "mask": mask, "scale": state["scale"], "extra": (self.gate(hidden), mask.sum())}


class MaskedHead(nn.Module):
    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.out = nn.Linear(dim, classes)

    def forward(self, state: dict[str, Any]) -> torch.Tensor:
        gate, _ = state["extra"]
        keep = state["mask"].unsqueeze(-1).to(state["hidden"].dtype)
        pooled = ((state["hidden"] + torch.sigmoid(gate)) * keep).sum(1) / keep.sum(1).clamp(min=1)
        return self.out(pooled)


def masked_blocks(blocks: int = 4, vocab: int = 32, dim: int = 16, classes: int = 4) -> nn.Sequential:
    """A Sequential whose layers pass dicts holding an integer mask, a constant and a tuple."""
    return nn.Sequential(MaskedEmbed(vocab, dim), *(MaskedBlock(dim) for _ in range(blocks)),
                         MaskedHead(dim, classes))


class FlattenCNN(nn.Module):
    """A CNN whose forward flattens before its classifier (as torchvision's ResNet does):
    ``nn.Sequential(*children())`` drops that step; tracing keeps it."""

    def __init__(self, channels: int = 8, size: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layer1 = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(channels * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.layer2(self.layer1(torch.relu(self.stem(x)))))
        return self.fc(torch.flatten(x, 1))


def flatten_cnn(channels: int = 8, size: int = 8, classes: int = 4) -> FlattenCNN:
    return FlattenCNN(channels, size, classes)


def bf16_mlp(dim: int = 8, layers: int = 4) -> nn.Sequential:
    """Linears built in bfloat16, as a model loaded with ``torch_dtype=torch.bfloat16`` is."""
    return nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers))).to(torch.bfloat16)


def partly_frozen_mlp(blocks: int = 8, dim: int = 16, hidden: int = 32, frozen: int = 1) -> nn.Sequential:
    """The reference workload with its first ``frozen`` blocks frozen (``requires_grad=False``), as a
    fine-tune keeps pretrained layers."""
    from examples.models import residual_mlp
    model = residual_mlp(blocks, dim, hidden)
    for block in model[:frozen]:
        block.requires_grad_(False)
    return model


def frozen_embedding_chain(vocab: int = 1000, dim: int = 16, layers: int = 4) -> nn.Sequential:
    """A large frozen embedding (pretrained, kept as it is) before small trainable Linears."""
    embedding = nn.Embedding(vocab, dim)
    embedding.weight.requires_grad_(False)
    return nn.Sequential(embedding, *(nn.Linear(dim, dim) for _ in range(layers)))


class CausalMix(nn.Module):
    """Mixes each position with the ones before it through a causal mask kept as a buffer, as
    nanoGPT's attention keeps its ``bias``: the forward computes with a buffer."""

    def __init__(self, dim: int, positions: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        steps = torch.arange(1, positions + 1, dtype=torch.float32)
        self.register_buffer("mask", torch.tril(torch.ones(positions, positions)) / steps[:, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        return x + self.fc(self.mask[:length, :length] @ x)


class CausalMixer(nn.Module):
    def __init__(self, dim: int, positions: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CausalMix(dim, positions) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def causal_mixer(dim: int = 8, positions: int = 8, blocks: int = 4) -> CausalMixer:
    """Blocks that each apply a causal-mask buffer, to cut at ``blocks.N`` (a model traced on the meta
    device computes with its real buffers)."""
    return CausalMixer(dim, positions, blocks)


class Untraceable(nn.Module):
    """Branches in Python on a tensor's value inside a named submodule: torch.export refuses it."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.first = nn.Linear(dim, dim)
        self.branchy = Branchy(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.branchy(self.first(x))


class Branchy(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.inner = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.inner(x)
        return x


def untraceable(dim: int = 8) -> Untraceable:
    return Untraceable(dim)


class _InfGradient(torch.autograd.Function):
    """Identity forward; in backward, an infinite gradient for ``weight`` alone (not the input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, poison: bool) -> torch.Tensor:
        ctx.poison = poison
        return x * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        grad_weight = torch.full((1,), float("inf")) if ctx.poison else grad.float().sum().reshape(1) * 0
        return grad, grad_weight, None


class OverflowWhenMarked(nn.Module):
    """Passes its input through; a batch whose first value is 1e4 gives this layer's own weight an
    infinite gradient (as an fp16 overflow would), on this stage only."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InfGradient.apply(x, self.weight, bool(x.flatten()[0].item() == 1e4))


def overflowing(layers: int = 4, dim: int = 8) -> nn.Sequential:
    """A linear stack whose first layer can be made to overflow (see :class:`OverflowWhenMarked`)."""
    return nn.Sequential(OverflowWhenMarked(), *(nn.Linear(dim, dim) for _ in range(layers)))


class Logits(nn.Module):
    """A Hugging Face causal LM wrapped, as users do, to return its logits alone."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def hf_logits(family: str, **kwargs: Any) -> Logits:
    """``examples.hf``'s ``family`` model from ``kwargs``, returning logits (split at ``lm.model.layers.N``)."""
    from examples import hf

    return Logits(getattr(hf, family)(**kwargs))


class FixedLength(nn.Module):
    """A model whose forward fixes its sequence length (a reshape to a constant shape), so that
    ``torch.export`` cannot keep that dimension dynamic: a traced stage runs only that length."""

    def __init__(self, dim: int = 8, length: int = 6) -> None:
        super().__init__()
        self.length = length
        self.first = nn.Linear(dim, dim)
        self.second = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x).reshape(-1, self.length, x.shape[-1])
        return self.second(x)


def fixed_length(dim: int = 8, length: int = 6) -> FixedLength:
    return FixedLength(dim, length)


def per_sample_loss(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """A loss a user forgot to reduce: one value a sample (whatever ``reduction`` says)."""
    return (output - target).pow(2).mean(dim=1)


def raising_model(**kwargs: object) -> nn.Sequential:
    """A model factory with a bug of the user's own."""
    raise RuntimeError("the user's model factory broke")


def raising_data(**kwargs: object) -> object:
    """A data factory with a bug of the user's own."""
    raise RuntimeError("the user's data factory broke")


def slow_data(seconds: float = 2.0, dim: int = 8) -> object:
    """A data factory that takes ``seconds`` to make (a dataset that loads as the stage builds)."""
    time.sleep(seconds)
    x, y = torch.zeros(8, 2, dim), torch.zeros(8, 2, dim)
    return lambda step: (x, y)


class RandomFeatures(nn.Module):
    """A fixed random projection (a buffer the constructor draws) before a trainable Linear."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("proj", torch.randn(dim, dim))
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x @ self.proj)


def random_features(dim: int = 4, layers: int = 2) -> nn.Sequential:
    """Layers whose constructors draw a buffer: with meta_init it is made for real, from the random state."""
    return nn.Sequential(*[RandomFeatures(dim) for _ in range(layers)])


def named_mlp(dim: int = 8) -> nn.Sequential:
    """An nn.Sequential with named children, as people often write one."""
    return nn.Sequential(OrderedDict(fc1=nn.Linear(dim, dim), act=nn.ReLU(), fc2=nn.Linear(dim, dim)))


class LineSearch(torch.optim.LBFGS):
    """A user's own L-BFGS: its step, too, needs a closure."""

