"""Megatron-style tensor parallelism: parallel linears, a vocabulary-parallel embedding and
cross-entropy, and a helper that shards a model's MLP and attention blocks.

The ranks of a tensor-parallel group run the same layers on the same (replicated)
activations, each holding a slice of the big weights. A column-parallel linear (output
features split) feeds a row-parallel one (input features split), so an MLP or an
attention block costs one all-reduce forward and one backward, and every activation
between blocks is whole on every rank.

Every rank builds the whole model from the same seed; ``shard_for_tensor_parallel``
then keeps that rank's slices, so the sharded model computes the same function, with
the same gradients, as the whole one. ``tp_shard_specs``, ``gather_tensor_parallel_state``
and ``shard_state`` translate between per-rank state dicts and the whole model's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from transport.wire import excerpt

__all__ = [
    "ColumnParallelLinear", "ParallelCausalSelfAttention", "ParallelLMLoss", "RowParallelLinear", "ShardSpec",
    "VocabParallelEmbedding", "copy_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "gather_tensor", "gather_tensor_parallel_state", "reduce_from_tensor_parallel_region",
    "shard_for_tensor_parallel", "shard_state", "shard_tensor", "tp_shard_specs", "vocab_parallel_cross_entropy",
]

log = logging.getLogger(__name__)

Group = dist.ProcessGroup | None  # None: the default group, as in torch.distributed


# --- how a whole tensor maps onto per-rank shards ----------------------------------


class ShardSpec(NamedTuple):
    """How one parameter is split over a tensor-parallel group.

    ``num_fused`` equal projections may sit side by side along ``dim`` (3 for a fused
    q/k/v); each is split separately, so a rank holds the same heads of q, k and v.
    """

    dim: int
    world: int
    num_fused: int = 1


def shard_tensor(full: torch.Tensor, rank: int, spec: ShardSpec) -> torch.Tensor:
    """Returns rank ``rank``'s slice of ``full`` (a new tensor, not a view).

    Raises:
        ValueError: the size along ``spec.dim`` does not split evenly.
    """
    size = full.shape[spec.dim]
    if size % (spec.num_fused * spec.world) != 0:
        raise ValueError(f"cannot split size {size} along dim {spec.dim} into {spec.num_fused} x {spec.world} parts")
    blocks = full.split(size // spec.num_fused, dim=spec.dim)
    return torch.cat([block.chunk(spec.world, dim=spec.dim)[rank] for block in blocks], dim=spec.dim)


def gather_tensor(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Rebuilds the whole tensor from every rank's slice, in rank order (inverse of ``shard_tensor``)."""
    if len(shards) != spec.world:
        raise ValueError(f"expected {spec.world} shards, one per rank, got {len(shards)}")
    per_rank = [s.chunk(spec.num_fused, dim=spec.dim) for s in shards]
    return torch.cat([part for block in range(spec.num_fused) for part in (p[block] for p in per_rank)], dim=spec.dim)


# --- collectives as autograd functions -----------------------------------------------


def _all_reduce(tensor: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    # A contiguous copy: NCCL needs contiguous buffers, and the input may be saved for
    # backward or read by another branch of the graph.
    out = tensor.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, rank: int, spec: ShardSpec) -> torch.Tensor:
        ctx.rank, ctx.spec = rank, spec
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(spec.world)]
        dist.all_gather(parts, x, group=group)
        return gather_tensor(parts, spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # The gathered output is replicated, so every rank holds the whole gradient already.
        return shard_tensor(grad, ctx.rank, ctx.spec), None, None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduces the gradient backward (a replicated input to split work)."""
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduces (sums) forward; identity backward (partial results to a replicated output)."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group, rank: int, spec: ShardSpec) -> torch.Tensor:
    """All-gathers shards along ``spec.dim`` forward; keeps this rank's slice of the gradient backward."""
    return _GatherFromRegion.apply(x, group, rank, spec)


# --- layers --------------------------------------------------------------------------


def _place(group: Group, rank: int | None, world: int | None) -> tuple[int, int]:
    """This process's (rank, world) in ``group``, unless both are given."""
    if rank is None or world is None:
        return dist.get_rank(group), dist.get_world_size(group)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
    return rank, world


def _check_split(what: str, size: int, world: int, unit: int = 1) -> None:
    """Raises a ValueError naming the degrees that would work unless ``size / unit`` splits ``world`` ways."""
    if size % (unit * world) != 0:
        work = ", ".join(str(d) for d in range(1, size // unit + 1) if size % (unit * d) == 0)
        raise ValueError(f"cannot split {what} ({size}) over {world} tensor-parallel ranks; "
                         f"degrees that would work: {work}")


def _init_like_linear(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    # nn.Linear's default (kaiming-uniform with a=sqrt(5)) reduces to U(-1/sqrt(fan_in), +),
    # with the whole layer's fan-in, not the shard's.
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)


def _take(full: torch.Tensor, rank: int, spec: ShardSpec | None) -> nn.Parameter:
    data = full.detach().clone() if spec is None else shard_tensor(full.detach(), rank, spec)
    return nn.Parameter(data, requires_grad=full.requires_grad)


class _Sharded(nn.Module):
    """A layer holding one rank's slices; ``specs`` says which parameters are split, and how.

    ``rank``/``world`` default to this process's place in ``group``. Fresh shards are drawn
    like the unsharded layer's; ``from_*`` copy a whole layer's values instead, building on
    the meta device so they draw nothing and later RNG draws match an unsharded run.
    """

    def __init__(self, group: Group, rank: int | None, world: int | None) -> None:
        super().__init__()
        self.group = group
        self.rank, self.world = _place(group, rank, world)
        self.specs: dict[str, ShardSpec] = {}

    def shard_specs(self) -> dict[str, ShardSpec]:
        """This layer's split parameters, by local name; the others are replicated."""
        return {name: spec for name, spec in self.specs.items() if getattr(self, name) is not None}

    def extra_repr(self) -> str:
        local = ", ".join(f"{name}={tuple(p.shape)}" for name, p in self.named_parameters(recurse=False))
        return f"rank {self.rank} of {self.world}: {local}"

    def _copy_slices(self, whole: nn.Module) -> Any:
        for name, param in whole.named_parameters(recurse=False):
            setattr(self, name, _take(param, self.rank, self.specs.get(name)))
        return self


class ColumnParallelLinear(_Sharded):
    """``y = x @ W.T + b`` with W's output rows (and b) split over the group.

    The input is replicated (its gradient is all-reduced backward); the output stays
    split along its last dim unless ``gather_output``. ``num_fused``: see ``ShardSpec``.
    """

    def __init__(
        self, in_features: int, out_features: int, group: Group, *, bias: bool = True, gather_output: bool = False,
        num_fused: int = 1, rank: int | None = None, world: int | None = None,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group, rank, world)
        _check_split("output features", out_features, self.world, num_fused)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.num_fused = gather_output, num_fused
        self.specs = {"weight": ShardSpec(0, self.world, num_fused), "bias": ShardSpec(0, self.world, num_fused)}
        self.weight = nn.Parameter(torch.empty(out_features // self.world, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features // self.world, device=device, dtype=dtype)) if bias else None
        _init_like_linear(self.weight, self.bias, in_features)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group: Group, *, rank: int, world: int, gather_output: bool = False, num_fused: int = 1
    ) -> ColumnParallelLinear:
        """Rank ``rank``'s shard of ``linear``, holding a copy of its slice of the weights."""
        return cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None, device="meta",
                   gather_output=gather_output, num_fused=num_fused, rank=rank, world=world)._copy_slices(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.group, self.rank, ShardSpec(-1, self.world, self.num_fused))
        return y



class RowParallelLinear(_Sharded):
    """``y = x @ W.T + b`` with W's input columns split over the group.

    The input arrives split along its last dim (a column-parallel layer's output); the
    partial products are all-reduced, then the replicated bias is added once.
    """

    def __init__(
        self, in_features: int, out_features: int, group: Group, *, bias: bool = True, rank: int | None = None,
        world: int | None = None, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group, rank, world)
        _check_split("input features", in_features, self.world)
        self.in_features, self.out_features = in_features, out_features
        self.specs = {"weight": ShardSpec(1, self.world)}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.world, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        _init_like_linear(self.weight, self.bias, in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, *, rank: int, world: int) -> RowParallelLinear:
        """Rank ``rank``'s shard of ``linear``, holding a copy of its slice of the weights."""
        return cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None, device="meta",
                   rank=rank, world=world)._copy_slices(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias



class VocabParallelEmbedding(_Sharded):
    """An embedding table whose rows (token ids) are split over the group.

    Each rank looks up the ids in its own range and zeroes the rest; the all-reduce
    then adds the one non-zero row each id has.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, group: Group, *, rank: int | None = None,
        world: int | None = None, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group, rank, world)
        _check_split("vocabulary size", num_embeddings, self.world)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_local = num_embeddings // self.world
        self.specs = {"weight": ShardSpec(0, self.world)}
        self.weight = nn.Parameter(torch.empty(self.num_local, embedding_dim, device=device, dtype=dtype))
        nn.init.normal_(self.weight)

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, group: Group, *, rank: int, world: int
    ) -> VocabParallelEmbedding:
        """Rank ``rank``'s shard of ``embedding``, holding a copy of its rows."""
        return cls(embedding.num_embeddings, embedding.embedding_dim, group, rank=rank, world=world,
                   device="meta")._copy_slices(embedding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start = self.rank * self.num_local
        outside = (ids < start) | (ids >= start + self.num_local)
        rows = F.embedding((ids - start).masked_fill(outside, 0), self.weight)
        return reduce_from_tensor_parallel_region(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group)



class ParallelCausalSelfAttention(nn.Module):
    """Causal multi-head self-attention with the heads split over the group.

    ``qkv`` is column-parallel (q, k and v each split by heads) and ``proj``
    row-parallel, so each rank attends with ``heads / world`` whole heads.
    """

    def __init__(
        self, dim: int, heads: int, group: Group, *, dropout: float = 0.0, rank: int | None = None,
        world: int | None = None, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        rank, world = _place(group, rank, world)
        _check_split("attention heads", heads, world)
        if dim % heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads, self.local_heads, self.dropout = heads, heads // world, dropout
        place: dict[str, Any] = {"rank": rank, "world": world, "device": device, "dtype": dtype}
        self.qkv = ColumnParallelLinear(dim, 3 * dim, group, num_fused=3, **place)
        self.proj = RowParallelLinear(dim, dim, group, **place)

    @classmethod
    def from_attention(
        cls, attention: nn.Module, group: Group, *, rank: int, world: int
    ) -> ParallelCausalSelfAttention:
        """Rank ``rank``'s shard of a module with ``qkv`` (d -> 3d), ``proj`` (d -> d), ``heads``, ``dropout``."""
        qkv, proj = attention.qkv, attention.proj
        assert isinstance(qkv, nn.Linear) and isinstance(proj, nn.Linear)
        heads, dropout = getattr(attention, "heads"), float(getattr(attention, "dropout", 0.0))
        layer = cls(qkv.in_features, heads, group, dropout=dropout, rank=rank, world=world, device="meta")
        layer.qkv = ColumnParallelLinear.from_linear(qkv, group, rank=rank, world=world, num_fused=3)
        layer.proj = RowParallelLinear.from_linear(proj, group, rank=rank, world=world)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        local_dim = self.qkv.weight.shape[0] // 3
        q, k, v = self.qkv(x).split(local_dim, dim=-1)
        q, k, v = (t.view(batch, length, self.local_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, local_dim))


# --- the vocabulary-parallel cross-entropy -------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: Group, ignore_index: int) -> torch.Tensor:
        num_local = logits.shape[-1]
        flat = logits.reshape(-1, num_local).float()  # half-precision exps overflow
        ids = targets.reshape(-1)
        if ids.shape[0] != flat.shape[0]:
            raise ValueError(f"{flat.shape[0]} rows of logits but {ids.shape[0]} targets")
        # Subtract the global max so no rank's exp overflows; it cancels in the softmax.
        shifted = flat - _all_reduce(flat.max(dim=-1).values, group, dist.ReduceOp.MAX).unsqueeze(-1)
        start = dist.get_rank(group) * num_local
        mine = (ids >= start) & (ids < start + num_local)
        local_ids = (ids - start).masked_fill(~mine, 0)
        target_logit = shifted.gather(1, local_ids.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        exp = shifted.exp_()
        # One all-reduce for both sums: each token's exp-sum and its (single owner's) target logit.
        sums = _all_reduce(torch.stack([exp.sum(dim=-1), target_logit]), group)
        valid = ids != ignore_index
        count = valid.sum()
        loss = ((sums[0].log() - sums[1]) * valid).sum() / count
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_ids, mine, valid, count)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_ids, mine, valid, count = ctx.saved_tensors
        # d(mean CE)/d(logit) = (softmax - one_hot(target)) / count, for counted tokens.
        result = softmax.clone()
        rows = torch.arange(result.shape[0], device=result.device)
        result[rows, local_ids] -= mine.to(result.dtype)
        result *= (valid.to(result.dtype) * (grad.float() / count)).unsqueeze(-1)
        return result.view(ctx.logits_shape).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, targets: torch.Tensor, group: Group, *, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over tokens, with the logits' vocabulary split over ``group``.

    Equals ``F.cross_entropy(whole_logits.reshape(-1, V), targets.reshape(-1))`` with the
    same gradient, without gathering the ``[..., V]`` logits: two all-reduces of one or
    two numbers per token (the max; then the exp-sum and the target logit, fused).

    Args:
        logits_shard: ``[..., V / world]``, this rank's contiguous slice of the vocabulary
            (rank r holds ids ``[r * V / world, (r + 1) * V / world)``).
        targets: ``[...]`` int64 ids into the whole vocabulary, the same on every rank.
        group: the tensor-parallel group.
        ignore_index: targets equal to it are left out of the loss and its mean.
    """
    return _VocabParallelCrossEntropy.apply(logits_shard, targets, group, ignore_index)


class ParallelLMLoss:
    """``loss(output, target)`` for a model whose head keeps its logits vocabulary-parallel."""

    __slots__ = ("group", "ignore_index")

    def __init__(self, group: Group, *, ignore_index: int = -100) -> None:
        self.group, self.ignore_index = group, ignore_index

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(output, target, self.group, ignore_index=self.ignore_index)


# --- sharding a whole model ----------------------------------------------------------

# Modules that act on each feature alone, so they commute with splitting the features.
_ELEMENTWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.LeakyReLU, nn.ELU, nn.Dropout, nn.Identity)


def _is_causal_attention(m: nn.Module) -> bool:
    # By field names (examples.models.CausalSelfAttention's layout) and, since the
    # replacement is causal, a class name that says so: a bidirectional attention with
    # the same fields stays replicated rather than silently changing the math. And by what
    # it computes: the replacement's math, unsharded, must give the module's own output.
    qkv, proj = getattr(m, "qkv", None), getattr(m, "proj", None)
    heads = getattr(m, "heads", None)
    return ("causal" in type(m).__name__.lower() and isinstance(heads, int) and heads > 0
            and isinstance(qkv, nn.Linear) and isinstance(proj, nn.Linear)
            and qkv.out_features == 3 * qkv.in_features and proj.in_features == proj.out_features == qkv.in_features
            and qkv.in_features % heads == 0 and _computes_as_parallel_attention(m, qkv, proj, heads))


def _computes_as_parallel_attention(m: nn.Module, qkv: nn.Linear, proj: nn.Linear, heads: int) -> bool:
    """Whether ``m`` computes what :class:`ParallelCausalSelfAttention` does (``qkv``'s output as
    ``[q | k | v]`` blocks, each split by heads, causal SDPA at its default scale, then ``proj``),
    tried on a small input in eval mode (no dropout). Another layout of the fused projection (per head,
    as GPT-NeoX keeps it), another scale, rotary positions or a mask of its own: it stays replicated
    (with a notice), where replacing it would silently compute something else."""
    if any(p.is_meta for p in m.parameters()):
        return True  # nothing to try it on: the fields and the name decide
    dim = qkv.in_features
    x = torch.randn(2, 5, dim, generator=torch.Generator().manual_seed(0)).to(qkv.weight)
    was_training = m.training
    try:
        m.eval()
        with torch.no_grad():
            own = m(x)
            q, k, v = (t.view(2, 5, heads, -1).transpose(1, 2) for t in F.linear(x, qkv.weight, qkv.bias).split(dim, -1))
            expected = proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, dim))
        same = isinstance(own, torch.Tensor) and own.shape == expected.shape and torch.allclose(
            own, expected, rtol=1e-3, atol=1e-4)
    except Exception as exc:  # noqa: BLE001 - a forward that wants more than x is no plain self-attention
        log.info("tensor parallelism leaves %s replicated: its forward did not run on one input (%s)",
                 type(m).__name__, excerpt(str(exc), 120))
        return False
    finally:
        m.train(was_training)
    if not same:
        log.info("tensor parallelism leaves %s replicated: it computes other than a causal attention over "
                 "[q | k | v] blocks of qkv (another layout, scale or positions)", type(m).__name__)
    return same


def _is_mlp_sequential(m: nn.Module) -> bool:
    """``Sequential(Linear(d, h), <elementwise>..., Linear(h, d'))``."""
    if not isinstance(m, nn.Sequential) or len(m) < 2:
        return False
    first, *middle, last = list(m)
    return (isinstance(first, nn.Linear) and isinstance(last, nn.Linear) and first.out_features == last.in_features
            and all(isinstance(x, _ELEMENTWISE) for x in middle))


def _is_mlp_block(m: nn.Module) -> bool:
    """A block with ``fc1`` and ``fc2`` linears, else only elementwise modules and a pre-norm."""
    fc1, fc2 = getattr(m, "fc1", None), getattr(m, "fc2", None)
    if not (isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear) and fc1.out_features == fc2.in_features):
        return False
    others = [c for name, c in m.named_children() if name not in ("fc1", "fc2")]
    return all(isinstance(c, _ELEMENTWISE) or (isinstance(c, nn.LayerNorm) and c.normalized_shape == (fc1.in_features,))
               for c in others)


def _is_plain_embedding(m: Any) -> bool:
    return (isinstance(m, nn.Embedding) and m.padding_idx is None and m.max_norm is None
            and not m.sparse and not m.scale_grad_by_freq)


def _is_head(m: nn.Module) -> bool:
    """A module ending in a linear, after only norms and elementwise modules (the GPT's ``Head``)."""
    children = list(m.children())
    return (bool(children) and isinstance(children[-1], nn.Linear)
            and all(isinstance(c, (nn.LayerNorm, *_ELEMENTWISE)) for c in children[:-1]))


def _find_shardable(model: nn.Sequential) -> list[tuple[nn.Module, str, str]]:
    """(owner, attribute, kind) of every module ``shard_for_tensor_parallel`` replaces."""
    found: list[tuple[nn.Module, str, str]] = []
    last = len(list(model.children())) - 1

    def visit(owner: nn.Module, name: str, module: nn.Module, index: int | None) -> None:
        if isinstance(module, _Sharded | ParallelCausalSelfAttention):
            return
        if _is_causal_attention(module):
            found.append((owner, name, "attention"))
        elif _is_mlp_block(module):
            found.extend([(module, "fc1", "column"), (module, "fc2", "row")])
        elif isinstance(module, nn.Sequential) and _is_mlp_sequential(module):
            found.extend([(module, "0", "column"), (module, str(len(module) - 1), "row")])
        elif index == 0 and _is_plain_embedding(module):
            found.append((owner, name, "vocab"))
        elif index == 0 and _is_plain_embedding(getattr(module, "token", None)):
            found.append((module, "token", "vocab"))
        elif index == last and isinstance(module, nn.Linear):
            found.append((owner, name, "head"))
        elif index == last and _is_head(module):
            found.append((module, list(module._modules)[-1], "head"))
        else:
            for child_name, child in module.named_children():
                visit(module, child_name, child, None)

    for index, (name, child) in enumerate(model.named_children()):
        visit(model, name, child, index)
    return found


def shard_for_tensor_parallel(
    model: nn.Sequential, rank: int, world: int, group: Group, *, parallel_logits: bool = False
) -> nn.Sequential:
    """Shards ``model`` in place for tensor-parallel rank ``rank`` of ``world``; returns it.

    Every rank builds the whole model from the same seed first; the parallel modules that
    replace the ones recognised below hold copies of this rank's slices of their weights,
    under the same names, so state-dict keys stay the whole model's:

    - an MLP, as a block with ``fc1``/``fc2`` (the reference workload's) or a
      ``Sequential(Linear, GELU, Linear)`` (the GPT's): column- then row-parallel;
    - a causal self-attention with ``qkv``/``proj``/``heads``: ``ParallelCausalSelfAttention``;
    - the first child's ``token`` embedding (or a first child that is an embedding):
      ``VocabParallelEmbedding``;
    - the last child's final linear (the LM head): column-parallel, gathering its output,
      or, with ``parallel_logits``, keeping it split for ``ParallelLMLoss``.

    Everything else (LayerNorms, position embeddings, row-parallel biases) stays
    replicated. Exact only without dropout: ranks do not coordinate their RNG streams.

    Raises:
        ValueError: ``rank``/``world`` out of range, or a recognised module that does not
            split evenly (e.g. heads not divisible by ``world``); the model is then unchanged.
    """
    _place(group, rank, world)
    if world == 1:
        return model
    build: dict[str, Callable[[Any], nn.Module]] = {
        "attention": lambda m: ParallelCausalSelfAttention.from_attention(m, group, rank=rank, world=world),
        "column": lambda m: ColumnParallelLinear.from_linear(m, group, rank=rank, world=world),
        "row": lambda m: RowParallelLinear.from_linear(m, group, rank=rank, world=world),
        "vocab": lambda m: VocabParallelEmbedding.from_embedding(m, group, rank=rank, world=world),
        "head": lambda m: ColumnParallelLinear.from_linear(
            m, group, rank=rank, world=world, gather_output=not parallel_logits),
    }
    # Every replacement is built before any is installed: an error leaves the model whole.
    swaps = [(owner, attr, build[kind](getattr(owner, attr))) for owner, attr, kind in _find_shardable(model)]
    for owner, attr, replacement in swaps:
        setattr(owner, attr, replacement)
    return model


# --- state dicts ---------------------------------------------------------------------


def tp_shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """The split parameters of a sharded model, by state-dict key; every other key is replicated."""
    specs: dict[str, ShardSpec] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, _Sharded):
            for local, spec in module.shard_specs().items():
                specs[f"{prefix}.{local}" if prefix else local] = spec
    return specs


def gather_tensor_parallel_state(
    states: list[dict[str, torch.Tensor]], specs: dict[str, ShardSpec]
) -> dict[str, torch.Tensor]:
    """The whole model's state dict (its keys and shapes) from every rank's, in rank order.

    Replicated entries are taken from rank 0.

    Raises:
        ValueError: no states, ranks with different keys, or a count that is not the spec's world.
    """
    if not states:
        raise ValueError("need one state dict per tensor-parallel rank, got none")
    keys = list(states[0])
    for rank, state in enumerate(states[1:], start=1):
        if set(state) != set(keys):
            differ = sorted(set(state) ^ set(keys))
            raise ValueError(f"rank {rank}'s state has different keys from rank 0's: {differ}")
    return {key: gather_tensor([s[key] for s in states], specs[key]) if key in specs else states[0][key] for key in keys}


def shard_state(
    full_state: dict[str, torch.Tensor], rank: int, world: int, specs: dict[str, ShardSpec]
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state dict, ready for ``load_state_dict``, from the whole model's.

    Raises:
        ValueError: ``world`` differs from a spec's, or a tensor does not split evenly.
    """
    for key, spec in specs.items():
        if spec.world != world:
            raise ValueError(f"{key} is split over {spec.world} ranks, not {world}")
    shards: dict[str, torch.Tensor] = {}
    for key, value in full_state.items():
        try:
            shards[key] = shard_tensor(value, rank, specs[key]) if key in specs else value
        except ValueError as exc:  # a whole tensor of another shape: say which
            raise ValueError(f"{key}: {exc}") from None
    return shards
