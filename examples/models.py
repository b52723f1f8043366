"""Model factories the examples and benchmarks name by import path (``"examples.models:gpt"``).

Every factory returns an ``nn.Sequential`` whose children are the layers a pipeline
may cut between: each child takes one tensor and returns one tensor, because a stage
passes exactly one activation to the next.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stages.build.layer_specs import LayerSpec

__all__ = ["residual_mlp", "residual_mlp_layers", "linear_stack", "gpt", "lm_loss", "token_accuracy", "generate"]


# --- the reference workload ---------------------------------------------------------


class ResidualMLPBlock(nn.Module):
    """``x + fc2(GELU(fc1(LayerNorm(x))))``: one block of the reference workload."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def residual_mlp(blocks: int = 8, dim: int = 512, hidden: int | None = None) -> nn.Sequential:
    """The reference workload: ``blocks`` residual MLP blocks on inputs ``[batch, seq, dim]``.

    Args:
        blocks: how many blocks (pipeline-partitionable children).
        dim: the model width.
        hidden: the MLP's inner width; 4 * dim when None.
    """
    if blocks < 1 or dim < 1:
        raise ValueError(f"residual_mlp needs blocks >= 1 and dim >= 1, got blocks={blocks}, dim={dim}")
    hidden = 4 * dim if hidden is None else hidden
    return nn.Sequential(*(ResidualMLPBlock(dim, hidden) for _ in range(blocks)))


def residual_mlp_layers(blocks: int = 8, dim: int = 512, hidden: int | None = None) -> list[LayerSpec]:
    """The reference workload as layer specs: each stage builds only the blocks it holds, each
    block under its own seed (``stages.layered_model(specs, seed)`` builds the same weights in
    one process)."""
    if blocks < 1 or dim < 1:
        raise ValueError(f"residual_mlp_layers needs blocks >= 1 and dim >= 1, got blocks={blocks}, dim={dim}")
    hidden = 4 * dim if hidden is None else hidden
    return [LayerSpec(ResidualMLPBlock, dim, hidden) for _ in range(blocks)]


def linear_stack(layers: int = 24, dim: int = 2048, specs: bool = False) -> nn.Sequential | list[LayerSpec]:
    """``layers`` bias-carrying ``Linear(dim, dim)``: 24 of 2048 are 100.7M parameters (384 MiB in fp32),
    the model ``benchmarks.memory`` trains over 8 stages; ``specs``: as layer specs."""
    if specs:
        return [LayerSpec(nn.Linear, dim, dim) for _ in range(layers)]
    return nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))


# --- a small character-level GPT ----------------------------------------------------


class Embedding(nn.Module):
    """Token plus learned position embeddings: ``[B, T]`` int64 ids to ``[B, T, dim]``."""

    def __init__(self, vocab_size: int, dim: int, context: int) -> None:
        super().__init__()
        self.context = context  # read by generate() to crop the prompt
        self.token = nn.Embedding(vocab_size, dim)
        self.position = nn.Embedding(context, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[-1]
        if length > self.context:
            raise ValueError(f"sequence of {length} tokens is longer than the model's context of {self.context}")
        positions = torch.arange(length, device=ids.device)
        return self.token(ids) + self.position(positions)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=-1)
        # [B, T, dim] -> [B, heads, T, dim / heads], the layout SDPA expects.
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(batch, length, dim))


class TransformerBlock(nn.Module):
    """A pre-LayerNorm transformer block: attention and a 4x MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def _init_gpt_weights(module: nn.Module) -> None:
    # GPT-2's initialisation: PyTorch's default N(0, 1) embeddings make a small model
    # start far from the uniform prediction and train noticeably slower.
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def gpt(
    vocab_size: int = 128,
    dim: int = 128,
    layers: int = 4,
    heads: int = 4,
    context: int = 128,
    dropout: float = 0.0,
    tie_embeddings: bool = False,
) -> nn.Sequential:
    """A small GPT as ``Sequential(Embedding, TransformerBlock * layers, Head)``.

    Input ``[B, T]`` int64 token ids (T <= context); output logits ``[B, T, vocab_size]``.

    Args:
        vocab_size: number of token ids (128 for the byte-level character vocabulary).
        dim: model width; must be divisible by ``heads``.
        layers: transformer blocks (pipeline-partitionable children between embedding and head).
        heads: attention heads per block.
        context: longest sequence the position embedding covers.
        dropout: residual and attention dropout; 0 keeps training deterministic.
        tie_embeddings: the head's projection is the token embedding's weight, as in
            GPT-2 (split across pipeline stages, their gradients are summed: see
            ``stages.build.tied``).
    """
    if layers < 1:
        raise ValueError(f"gpt needs layers >= 1, got {layers}")
    blocks = [TransformerBlock(dim, heads, dropout) for _ in range(layers)]
    model = nn.Sequential(Embedding(vocab_size, dim, context), *blocks, Head(dim, vocab_size))
    model.apply(_init_gpt_weights)
    # GPT-2 scales the projections into the residual stream by depth, so the
    # residual's variance does not grow with the number of layers.
    for block in blocks:
        for proj in (block.attn.proj, block.mlp[2]):
            assert isinstance(proj, nn.Linear)
            nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * layers))
    if tie_embeddings:
        head = model[-1]
        embedding = model[0]
        assert isinstance(head, Head) and isinstance(embedding, Embedding)
        head.out.weight = embedding.token.weight
    return model


def token_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The share of next tokens the model ranks first (an evaluation metric: ``eval_metrics``)."""
    return {"accuracy": (logits.argmax(-1) == targets).float().mean()}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean",
            ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy of ``[B, T, V]`` logits against ``[B, T]`` target ids (``ignore_index`` left out):
    their mean, or with ``reduction="sum"`` their sum (``loss_averaging="tokens"``)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction,
                           ignore_index=ignore_index)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 20,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Samples ``max_new_tokens`` tokens after ``prompt_ids`` from a whole (unpartitioned) GPT.

    Args:
        model: a model built by ``gpt``; its first child's ``context`` bounds the window.
        prompt_ids: ``[T]`` or ``[B, T]`` int64 ids; at least one token.
        max_new_tokens: how many tokens to append.
        temperature: divides the logits; lower is more conservative.
        top_k: sample only among the k most likely tokens; all when None.
        generator: the random stream to sample from (the global one when None).

    Returns:
        The prompt followed by the new tokens, with the prompt's shape but a longer last dim.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    squeeze = prompt_ids.dim() == 1
    ids = prompt_ids.unsqueeze(0) if squeeze else prompt_ids
    if ids.shape[-1] == 0:
        raise ValueError("generate needs a prompt of at least one token")
    context = getattr(model[0], "context", None) if isinstance(model, nn.Sequential) else None
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            window = ids if context is None else ids[:, -context:]
            logits = model(window)[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    finally:
        model.train(was_training)
    return ids.squeeze(0) if squeeze else ids
