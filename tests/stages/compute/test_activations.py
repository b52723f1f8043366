# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/compute/test_activations.py
"""Activation checkpointing and stash measurement (stages.compute.activations), in one process.

The in-memory pipeline of tests/stages/compute/test_executor.py runs every schedule with and
without checkpointing: the parameters must come out bit for bit the same, and the
bytes a rank holds between forward and backward must drop. (Its ranks share one
process's RNG from several threads, so dropout is tested here on one module, and
across stage processes in tests/schedulers/test_activation_checkpointing.py.)

A stash codec (``stash_codec``): each saved tensor comes back within the codec's documented
error, parameters and the batch never change, and the gradients of a Linear+GELU stack move
within the bound (element by element) and the expected error (in norm) that this error
implies, with and without checkpointing; the stage lets go of its boundary values; and the
in-memory pipeline and a pipeline of stages built from a job's config train with it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from stages.comm.device_io import DeviceIO
from stages.compute import activations as _activations
from stages.compute import passes as _passes
from stages.compute import wgrad as _wgrad
from stages.build.layers import Chain
from transport.codecs import CodecError
from schedulers.schedules import SCHEDULES
from tests.stages.compute.test_executor import Block, Case, accepted, build_model, global_batches, open_pipeline
from tests.stages.stage_parts import InProcessPipeline, stage_config

pytestmark = pytest.mark.timeout(60)


# -- checkpointed: the same values and gradients, less kept ---------------------------


class Pair(nn.Module):
    """Takes a tree (a tuple and a keyword dict) and returns one: a boundary value's shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor], *, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        a, b = pair
        return F.dropout(self.fc(a) * b + extra["bias"], 0.5)


def _grads_of(recompute: bool) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    torch.manual_seed(0)
    module = Pair()
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    extra = {"bias": torch.randn(4, requires_grad=True)}
    torch.manual_seed(7)  # the dropout mask
    with _activations.SavedActivations({}) as saved:
        out = (_activations.checkpointed(module, (a, b), extra=extra) if recompute
               else module((a, b), extra=extra))
    torch.manual_seed(99)  # whatever the RNG does meanwhile, the recompute replays the forward's
    out.square().sum().backward()
    grads = [t.grad for t in (a, extra["bias"], module.fc.weight, module.fc.bias)]
    assert all(g is not None for g in grads)
    return out.detach(), grads, sum(saved.storages.values())  # type: ignore[misc]


def test_checkpointed_tree_arguments_give_the_same_values_and_gradients_and_keep_only_the_arguments() -> None:
    out, grads, kept = _grads_of(recompute=False)
    out_ck, grads_ck, kept_ck = _grads_of(recompute=True)
    assert torch.equal(out, out_ck)
    assert all(torch.equal(g, h) for g, h in zip(grads, grads_ck))
    # Kept with checkpointing: a, b and the bias, nested in the tuple and the dict (3*4 + 3*4 + 4 floats).
    assert kept_ck == (12 + 12 + 4) * 4
    assert kept > kept_ck  # without: also fc's output, the product and the dropout mask


@pytest.mark.parametrize("traced", [False, True])
def test_a_recompute_leaves_batchnorms_running_statistics_as_the_forward_left_them(traced: bool) -> None:
    """Found by review: checkpointing ran the forward again in backward, in training mode, so BatchNorm
    counted every batch twice (num_batches_tracked 8 for 4 forwards, other running means and variances).
    Two micro-batches' forwards, then their backwards (as 1F1B interleaves them), against no recompute;
    a model cut at split_points keeps its norms as graph modules of their own."""
    from stages.build.traced import trace_stages

    def model() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8))

    inputs = [torch.randn(6, 4, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    states = []
    for every in (0, 1):
        if traced:
            stage = trace_stages(model(), ["3"], inputs[0], "bn", dynamic=False)[1]
            first = model()[:3]  # the first three layers, eager, before the traced stage
            segments = [lambda x, f=first: f(x), (lambda x: _activations.checkpointed(stage.module, x,
                                                                                    modules=[stage.module]))
                        if every else stage.module]
            run = lambda x: segments[1](segments[0](x))  # noqa: E731
            held: nn.Module = nn.ModuleList([first, stage.module])
        else:
            chain = Chain(*model(), checkpoint_every=every * 2)
            run, held = chain, chain
        outs = [run(x) for x in inputs]
        for out in outs:
            (out[0] if isinstance(out, tuple) else out).square().sum().backward()
        states.append({k: v.clone() for k, v in held.state_dict().items()})
    plain, recomputed = states
    assert any(k.endswith("num_batches_tracked") for k in plain)
    for key, value in plain.items():
        assert torch.equal(recomputed[key], value), key


def test_a_split_backward_recomputes_a_batchnorm_segment_twice_and_keeps_its_statistics() -> None:
    """Found by review: zero-bubble without fused linears walks a checkpointed segment's graph twice (I: the
    input's gradient, then W: the weights'), and the context that keeps BatchNorm's running statistics could
    be entered once, so every such step failed at W ('_GeneratorContextManager' object has no attribute
    'args'). Both walks give one backward's gradients, and the statistics stay as the forward left them."""
    def model() -> nn.Module:
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.GELU())

    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    plain = model()
    plain(x).square().sum().backward()
    split = model()
    inputs = x.clone().requires_grad_()
    out = _activations.checkpointed(split, inputs, modules=[split])
    grad = 2 * out.detach()
    torch.autograd.grad(out, inputs, grad, retain_graph=True)  # I
    torch.autograd.backward(out, grad, inputs=list(split.parameters()))  # W: the second recompute
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    for key, value in plain.state_dict().items():
        assert torch.equal(split.state_dict()[key], value), key


def test_saved_activations_count_a_storage_once_and_leave_out_the_resident() -> None:
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    resident = _activations.storages([weight])
    with _activations.SavedActivations(resident) as saved:
        h = x @ weight  # saves x and weight
        y = h.view(2, 16).sin().sum() + h.sin().sum()  # saves h twice: as a view and as itself, one storage
    y.sum().backward()
    assert sum(saved.storages.values()) == x.numel() * 4 + h.numel() * 4
    assert _activations.union_bytes([saved.storages, saved.storages]) == sum(saved.storages.values())


@pytest.mark.parametrize(("setting", "every"), [(False, 0), (True, 1), (1, 1), (3, 3)])
def test_checkpoint_interval(setting: bool | int, every: int) -> None:
    assert _activations.checkpoint_interval(setting) == every


def test_a_chain_checkpoints_each_run_of_layers_and_keeps_their_inputs() -> None:
    torch.manual_seed(0)
    layers = [Block() for _ in range(4)]
    x = torch.randn(2, 3, 8, requires_grad=True)
    for every, kept_inputs in [(1, 4), (2, 2), (3, 2), (4, 1)]:
        with _activations.SavedActivations({}) as saved:
            Chain(*layers, checkpoint_every=every)(x)
        assert sum(saved.storages.values()) == kept_inputs * x.numel() * 4, every


# -- the executor: every schedule, bit for bit ----------------------------------------


async def train(case: Case, model: nn.Sequential, every: int) -> tuple[list[float], list[int], list[int]]:
    """Three steps; the losses, and each rank's peak stash bytes and count in the last step."""
    async with open_pipeline(case, model, checkpoint_every=every) as pipeline:
        losses = []
        for step, (x, y) in enumerate(global_batches()):
            loss, traces = await pipeline.train_step(step, x, y)
            losses.append(loss)
    return losses, [t.peak_stash_bytes for t in traces], [t.peak_stash for t in traces]


CASES = [case for case in (
    Case(schedule=name, num_ranks=ranks, num_microbatches=4, fusion=fusion)
    for name, ranks, fusion in itertools.product(SCHEDULES, [2, 4], [True, False])) if accepted(case)]


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=str)
async def test_checkpointing_trains_bit_for_bit_as_without_and_holds_less(case: Case, every: int) -> None:
    plain_model, model = build_model(), build_model()
    expected_losses, plain_bytes, plain_stash = await train(case, plain_model, every=0)
    losses, held_bytes, stash = await train(case, model, every=every)
    for (name, expected), value in zip(plain_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(value, expected), name
    assert losses == expected_losses
    assert stash == plain_stash  # the same micro-batches are held, each by less
    assert all(0 < held < plain for held, plain in zip(held_bytes, plain_bytes)), (held_bytes, plain_bytes)


async def test_whole_stage_checkpoints_hold_their_boundary_values_only() -> None:
    """1F1B, 2 ranks of 4 blocks each, backward unsplit: a held micro-batch keeps rank 0's
    output (its input is the step's batch, which lives anyway), and rank 1's input, its
    output (which the loss saves) and the loss."""
    case = Case(schedule="1f1b", num_ranks=2, num_microbatches=4, fusion=False)
    _, held_bytes, stash = await train(case, build_model(), every=4)
    activation = global_batches()[0][0][:4].numel() * 4  # one micro-batch's boundary value
    assert held_bytes == [stash[0] * activation, stash[1] * (2 * activation + 4)]


# -- a stash codec: what autograd saves, held in fewer bits -------------------------------

WIDTH, ROWS = 512, 64  # saved tensors of 32768 elements: far above MIN_ELEMENTS_TO_ENCODE
# |GELU''(h)| = φ(h) |2 - h²| is largest at h = 0: 2 φ(0) = sqrt(2 / π). It bounds how far
# GELU'(h), which GELU's backward computes from its saved input, moves when h does.
GELU_CURVATURE = math.sqrt(2 / math.pi)
# Higham's γ_K: a float32 dot product of K terms is off by at most K 2**-24 of the sum of
# the terms' magnitudes. K is at most WIDTH here; each of the two runs rounds on its own.
ROUNDING = 2 * WIDTH * 2**-24


def _per_block(tensor: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], block: int = 256) -> torch.Tensor:
    """``fn`` of each 256-element block's absmax (the codecs' default block), for each element of ``tensor``."""
    flat = tensor.detach().double().reshape(-1)
    absmax = F.pad(flat, (0, -flat.numel() % block)).view(-1, block).abs().amax(dim=1)
    return fn(absmax).repeat_interleave(block)[:flat.numel()].view(tensor.shape)


# Each codec's documented per-element error (transport/codecs.py), as a bound for every
# element of a tensor. The block codecs' scale is absmax / qmax, and four float32 roundings
# (the scale, its reciprocal, the scaled value, the decoded product) add at most 2**-24 of
# absmax each.
ERROR_BOUNDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "bf16": lambda t: t.detach().double().abs() * 2**-8,
    "int8": lambda t: _per_block(t, lambda absmax: absmax / 254 + absmax * 2**-22),
    "int4": lambda t: _per_block(t, lambda absmax: absmax / 14 + absmax * 2**-22),
    # e4m3: 2**-4 of the value for normals, 2**-10 of the scale (absmax / 448) below them.
    "fp8": lambda t: torch.maximum(t.detach().double().abs() * 2**-4,
                                   _per_block(t, lambda absmax: absmax / 448 * 2**-10 + absmax * 2**-22)),
}


@pytest.mark.parametrize("codec", sorted(ERROR_BOUNDS))
def test_each_saved_tensor_comes_back_within_the_codecs_error(codec: str) -> None:
    torch.manual_seed(0)
    h = torch.randn(ROWS, WIDTH, requires_grad=True) * torch.logspace(-3, 3, WIDTH)  # values of every scale
    with _activations.SavedActivations({}, codec):
        y = F.gelu(h)
    back = y.grad_fn._saved_self  # type: ignore[union-attr]  # unpacked: decoded
    assert back.dtype == h.dtype and back.shape == h.shape
    assert bool(((back.double() - h.detach().double()).abs() <= ERROR_BOUNDS[codec](h)).all())
    assert not torch.equal(back, h.detach())  # it was encoded


def test_a_stash_codec_leaves_parameters_the_batch_small_and_integer_tensors_as_they_are() -> None:
    torch.manual_seed(0)
    linear, table = nn.Linear(WIDTH, WIDTH), torch.randn(4096, 8, requires_grad=True)
    batch, small = torch.randn(ROWS, WIDTH), torch.randn(8, 8, requires_grad=True)
    indices = torch.randint(0, 4096, (4096,))
    with _activations.SavedActivations(_activations.storages([*linear.parameters(), batch, table]), "int8"):
        y = linear(batch)
        y2 = linear(y)
        z = F.embedding(indices, table)
        s = small.sin()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = linear(y)  # autocast saves a bfloat16 copy of the weight: still the parameter
    assert torch.equal(y.grad_fn._saved_mat1, batch)  # type: ignore[union-attr]
    assert torch.equal(y2.grad_fn._saved_mat2, linear.weight.t())  # type: ignore[union-attr]
    assert not torch.equal(y2.grad_fn._saved_mat1, y)  # type: ignore[union-attr]  # an activation: encoded
    assert torch.equal(z.grad_fn._saved_indices, indices)  # type: ignore[union-attr]
    assert torch.equal(s.grad_fn._saved_self, small)  # type: ignore[union-attr]
    assert torch.equal(cast.grad_fn._saved_mat2, linear.weight.to(torch.bfloat16).t())  # type: ignore[union-attr]
    assert not torch.equal(cast.grad_fn._saved_mat1, y.to(torch.bfloat16))  # type: ignore[union-attr]  # an activation


def test_a_fused_linear_under_autocast_saves_its_weight_itself_which_no_codec_encodes() -> None:
    """stages.compute.wgrad's linear casts the weight again in backward instead of saving its cast:
    what it saves is its input's copy in the compute dtype (encoded) and the parameter (resident)."""
    torch.manual_seed(0)
    linear = nn.Linear(WIDTH, WIDTH)
    _wgrad.install(linear, _wgrad.WeightGradients())
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with _activations.SavedActivations(_activations.storages(linear.parameters()), "int8") as saved:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = linear(x)
    assert sum(saved.storages.values()) == x.numel() + 4 * x.numel() // 256  # the input, in int8
    y.float().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the input gradient uses the weight as autocast casts it
        expected = torch.ones(ROWS, WIDTH, dtype=torch.bfloat16) @ linear.weight.to(torch.bfloat16)
    assert x.grad is not None and torch.equal(x.grad, expected.float())


def test_a_stash_codec_counts_the_encoded_bytes_and_encodes_a_tensor_saved_twice_once() -> None:
    weight = torch.randn(WIDTH, WIDTH, requires_grad=True)
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with _activations.SavedActivations(_activations.storages([weight]), "int8") as saved:
        h = x @ weight  # saves x
        y = h.view(WIDTH, ROWS).sin().sum() + h.sin().sum()  # saves h twice: the same elements, two shapes
    int8_bytes = x.numel() + 4 * x.numel() // 256  # a byte a value, a float32 scale per block
    assert sum(saved.storages.values()) == 2 * int8_bytes
    y.backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


def linear_gelu_stack(num_layers: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(layer for _ in range(num_layers) for layer in (nn.Linear(WIDTH, WIDTH), nn.GELU())))


def gradients_with(model: nn.Sequential, x: torch.Tensor, grad_out: torch.Tensor, codec: str, every: int = 0
                   ) -> tuple[list[torch.Tensor], int]:
    """The input's and every parameter's gradient when ``model(x)`` gets ``grad_out``, and the bytes kept."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()  # a stage's boundary input: not resident, so encoded
    with _activations.SavedActivations(_activations.storages(model.parameters()), codec) as saved:
        out = _activations.run_segments(list(model), every, x) if every else model(x)
    out.backward(grad_out)
    grads = [x.grad, *(p.grad for p in model.parameters())]
    assert all(g is not None for g in grads)
    return grads, sum(saved.storages.values())  # type: ignore[return-value]


def _forward_values(model: nn.Sequential, x: torch.Tensor
                    ) -> list[tuple[nn.Linear, torch.Tensor, torch.Tensor]]:
    """Each Linear+GELU of ``model`` with its input ``a`` and the GELU's input ``h``, in float64."""
    linears = [layer for layer in model if isinstance(layer, nn.Linear)]
    inputs, pre = [x.double()], []
    with torch.no_grad():
        for linear in linears:
            pre.append(F.linear(inputs[-1], linear.weight.double(), linear.bias.double()))
            inputs.append(F.gelu(pre[-1]))
    return list(zip(linears, inputs, pre))


def _gelu_slope_and_curvature(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GELU'(h) = Φ(h) + h φ(h) and GELU''(h) = φ(h) (2 - h²)."""
    density = torch.exp(-h**2 / 2) / math.sqrt(2 * math.pi)
    return 0.5 * (1 + torch.erf(h / math.sqrt(2))) + h * density, density * (2 - h**2)


# How the gradients of :func:`gradients_with` depend on what is saved. Per layer ``h = W a + b``,
# ``a' = GELU(h)``, with ``u`` the gradient coming into the GELU: ``δ = GELU'(h) u``,
# ``dW = δᵀ a``, ``db = Σ δ``, and ``u`` for the layer below is ``δ W``. Saved: ``a`` and ``h``,
# each off by at most the codec's ``B`` of it per element; with ``recomputed`` (each Linear+GELU
# checkpointed) ``h`` is recomputed from the decoded ``a`` instead, off by ``ΔaWᵀ``.


def gradient_error_bounds(model: nn.Sequential, x: torch.Tensor, grad_out: torch.Tensor,
                          bound: Callable[[torch.Tensor], torch.Tensor], recomputed: bool = False
                          ) -> list[torch.Tensor]:
    """Per element, the most each gradient can move: the codec's error carried through the backward
    in magnitudes (no cancellation assumed).

    With ``U`` the bound on ``u``'s error, ``δ``'s is at most ``D = c B(h) (|u| + U) + |GELU'(h)| U``
    (``c``: :data:`GELU_CURVATURE`); ``dW``'s at most ``Dᵀ (|a| + B(a)) + |δ|ᵀ B(a)``, the next
    ``U`` is ``D |W|``. Each product also gets both runs' float32 rounding (:data:`ROUNDING`).
    """
    u, u_error = grad_out.double(), torch.zeros_like(grad_out, dtype=torch.float64)
    bounds: list[torch.Tensor] = []
    for linear, a, h in reversed(_forward_values(model, x)):
        weight = linear.weight.detach().double()
        a_error = bound(a.float())
        h_error = a_error @ weight.abs().t() if recomputed else bound(h.float())
        slope, _ = _gelu_slope_and_curvature(h)
        delta = slope * u
        delta_error = GELU_CURVATURE * h_error * (u.abs() + u_error) + slope.abs() * u_error \
            + ROUNDING * slope.abs() * (u.abs() + u_error)
        delta_size, a_size = delta.abs() + delta_error, a.abs() + a_error
        weight_error = delta_error.t() @ a_size + delta.abs().t() @ a_error + ROUNDING * delta_size.t() @ a_size
        bias_error = delta_error.sum(0) + ROUNDING * delta_size.sum(0)
        bounds[:0] = [weight_error, bias_error]
        u, u_error = delta @ weight, delta_error @ weight.abs() + ROUNDING * delta_size @ weight.abs()
    return [u_error, *bounds]


def gradient_error_variances(model: nn.Sequential, x: torch.Tensor, grad_out: torch.Tensor,
                             bound: Callable[[torch.Tensor], torch.Tensor], recomputed: bool = False
                             ) -> list[torch.Tensor]:
    """Per element, the expected squared error of each gradient when every saved value's error is
    independent, of mean 0 (round to nearest) and of variance at most ``B²`` (its bound): the same
    backward to first order, variances adding where :func:`gradient_error_bounds` adds magnitudes.

    ``var Δδ = GELU''(h)² var Δh u² + GELU'(h)² var Δu``, ``var ΔdW = (var Δδ)ᵀ a² + (δ²)ᵀ var Δa``,
    and ``var Δu`` below is ``(var Δδ) W²``. A rounding error spread evenly over ``±B`` has variance
    ``B²/3``, so the measured error should come out near ``1/√3`` of what this predicts.
    """
    u, u_variance = grad_out.double(), torch.zeros_like(grad_out, dtype=torch.float64)
    variances: list[torch.Tensor] = []
    for linear, a, h in reversed(_forward_values(model, x)):
        weight = linear.weight.detach().double()
        a_variance = bound(a.float()) ** 2
        h_variance = a_variance @ (weight**2).t() if recomputed else bound(h.float()) ** 2
        slope, curvature = _gelu_slope_and_curvature(h)
        delta = slope * u
        delta_variance = curvature**2 * h_variance * u**2 + slope**2 * u_variance
        variances[:0] = [delta_variance.t() @ a**2 + (delta**2).t() @ a_variance, delta_variance.sum(0)]
        u, u_variance = delta @ weight, delta_variance @ weight**2
    return [u_variance, *variances]


@pytest.mark.parametrize(("codec", "every", "most_bytes"), [
    ("int8", 0, 0.3), ("bf16", 0, 0.51), ("fp8", 0, 0.3), ("int8", 2, 0.3),
])
def test_gradients_move_within_what_the_codecs_error_implies_and_the_stash_shrinks(
        codec: str, every: int, most_bytes: float) -> None:
    """Three Linear(512)+GELU layers, 64 rows: every gradient element stays inside the bound
    :func:`gradient_error_bounds` derives from the codec's per-element error; each gradient's
    relative error (the norm of the error over the gradient's, as the wire's ``rel_error``) is at
    most the root of what :func:`gradient_error_variances` expects; and the stash is ``most_bytes``
    of float32's or less. ``every=2`` checkpoints each Linear+GELU: then only each pair's input is
    kept (encoded), and the GELU's input is recomputed from it.

    Measured here: int8 about 1e-2 of each gradient (0.58 of the expected bound, the 1/√3 of
    evenly spread rounding), bf16 about 2e-3, fp8 about 3e-2; 0.254 of the bytes with int8 and fp8,
    0.5 with bf16.
    """
    model = linear_gelu_stack()
    gen = torch.Generator().manual_seed(1)
    x, grad_out = torch.randn(ROWS, WIDTH, generator=gen), torch.randn(ROWS, WIDTH, generator=gen)
    exact, plain_bytes = gradients_with(model, x, grad_out, "none", every)
    grads, held_bytes = gradients_with(model, x, grad_out, codec, every)
    bounds = gradient_error_bounds(model, x, grad_out, ERROR_BOUNDS[codec], recomputed=every == 2)
    variances = gradient_error_variances(model, x, grad_out, ERROR_BOUNDS[codec], recomputed=every == 2)
    for index, (g, e, bound, variance) in enumerate(zip(grads, exact, bounds, variances)):
        error = g.double() - e.double()
        assert bool((error.abs() <= bound).all()), (index, float((error.abs() - bound).max()))
        relative, expected = float(error.norm() / e.double().norm()), float(variance.sum().sqrt() / e.double().norm())
        assert 0 < relative <= expected, (index, relative, expected)
    assert held_bytes <= most_bytes * plain_bytes, (held_bytes, plain_bytes)


def test_checkpointing_every_layer_with_a_codec_gives_the_codecs_gradients_bit_for_bit() -> None:
    """Each layer its own segment keeps exactly what the layer saves (its input): encoded the same,
    the recompute's saves are the decoded values, so nothing differs."""
    model = linear_gelu_stack()
    gen = torch.Generator().manual_seed(1)
    x, grad_out = torch.randn(ROWS, WIDTH, generator=gen), torch.randn(ROWS, WIDTH, generator=gen)
    plain, plain_bytes = gradients_with(model, x, grad_out, "int8")
    checkpointed, held_bytes = gradients_with(model, x, grad_out, "int8", every=1)
    assert all(torch.equal(g, h) for g, h in zip(plain, checkpointed))
    assert held_bytes == plain_bytes


def _stage_passes(codec: str, fusion: bool = False) -> _passes.StagePasses:
    """Model stage 1 of 3 (the middle one: a boundary input and an output to send), two Linear+GELU."""
    module = linear_gelu_stack(2)
    weight_grads = None
    if fusion:
        weight_grads = _wgrad.WeightGradients()
        _wgrad.install(module, weight_grads)
    model = _passes.StageModel(modules={1: module}, num_stages=3, loss_fn=F.mse_loss,
                               optimizer=torch.optim.SGD(module.parameters(), lr=0.1), device=torch.device("cpu"),
                               weight_grads=weight_grads, stash_codec=codec)
    passes = _passes.StagePasses(model, DeviceIO("cpu"), None)
    passes.start_step(None, None, loss_scale=1.0, num_microbatches=1)
    return passes


@pytest.mark.parametrize("split", [False, True], ids=["B", "I-then-W"])
@pytest.mark.parametrize("fusion", [False, True], ids=["autograd", "fused"])
def test_a_stash_codec_lets_go_of_the_boundary_values_and_backward_is_unchanged(split: bool, fusion: bool) -> None:
    """With a codec, the stage's received input and its output are freed once the output is sent
    (backward needs them only as places in the graph); the gradients are those of plain autograd
    with the same codec, bit for bit. Without one both live until the backward, as before."""
    gen = torch.Generator().manual_seed(1)
    x, grad_out = torch.randn(ROWS, WIDTH, generator=gen), torch.randn(ROWS, WIDTH, generator=gen)
    expected, _ = gradients_with(linear_gelu_stack(2), x, grad_out, "int8")
    for codec in ("none", "int8"):
        passes = _stage_passes(codec, fusion)
        received = x.clone().requires_grad_()
        input_storage = StorageWeakRef(received.untyped_storage())
        passes.forward_held(1, 0, received, None)
        sent = passes.values.pop(("F", 1, 0))
        output_storage = StorageWeakRef(sent.leaves[0].untyped_storage())
        del received, sent  # the receive and the send are done with them
        assert (input_storage.expired(), output_storage.expired()) == (codec != "none",) * 2, codec
        grad_in = passes.backward(1, 0, [grad_out], input_only=split)
        if split:
            passes.weight_backward(1, 0)
        assert grad_in is not None and grad_in[0] is not None
        if codec == "int8":
            grads = [p.grad for p in passes.model.modules[1].parameters()]
            assert torch.equal(grad_in[0], expected[0])
            if split and fusion:
                # Between a fused I and its W the linears' output gradients wait encoded too (the inputs
                # encode back to their codes): the weight gradients move by int8's error of them, about
                # 1 / 254 of a block's largest value per element, a few thousandths in norm.
                assert all(g is not None and (g - e).norm() <= 1e-2 * e.norm() for g, e in zip(grads, expected[1:]))
            else:
                assert all(g is not None and torch.equal(g, e) for g, e in zip(grads, expected[1:]))
        assert passes.leftover() == [] and passes.held == {}


def squared_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per sample, summed over its features: gradients large enough for SGD to move in a few steps."""
    return F.mse_loss(out, target, reduction="sum") / len(out)


@pytest.mark.parametrize(("case", "most_bytes"), [
    # 1F1B's last rank peaks between a fused I and its W: there the linears' inputs and output
    # gradients wait, both encoded.
    (Case(schedule="1f1b", num_ranks=2, num_microbatches=4, optimizer="sgd_momentum"), (0.3, 0.3)),
    (Case(schedule="zero_bubble", num_ranks=2, num_microbatches=4, fusion=False, optimizer="sgd_momentum"),
     (0.3, 0.3)),
    (Case(schedule="interleaved", num_ranks=2, num_microbatches=4, optimizer="sgd_momentum"), (0.3, 0.3)),
], ids=lambda value: str(value) if isinstance(value, Case) else "")
async def test_a_pipeline_trains_with_an_int8_stash_in_fewer_bytes(case: Case, most_bytes: tuple[float, float]) -> None:
    """The in-memory pipeline of test_executor: the first step's loss is exact (the forward does not
    change), the loss falls, and each rank holds at most ``most_bytes`` of what it holds without."""
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(4 * 16, WIDTH, generator=gen), torch.randn(4 * 16, WIDTH, generator=gen)

    async def train(codec: str) -> tuple[list[float], list[int]]:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(4)))
        async with open_pipeline(case, model, stash_codec=codec, loss_fn=squared_error) as pipeline:
            losses = []
            for step in range(4):
                loss, traces = await pipeline.train_step(step, x, y)
                losses.append(loss)
        return losses, [t.peak_stash_bytes for t in traces]

    plain_losses, plain_bytes = await train("none")
    losses, held_bytes = await train("int8")
    assert losses[0] == plain_losses[0]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0]
    assert all(0 < held <= most * plain for held, plain, most in zip(held_bytes, plain_bytes, most_bytes)), \
        (held_bytes, plain_bytes)


async def test_a_job_with_an_int8_stash_codec_trains_through_the_stages_it_builds() -> None:
    """``stash_codec`` in a job's runtime section reaches every stage (stages.build.stage) of a
    pipeline of parts, built and stepped as the stage actors and the scheduler do: the first
    step's loss is exact, the loss falls as without, and each stage holds 0.3 of the bytes or
    fewer (0.24 here: LayerNorm, Linear and GELU inputs of 2048 and 8192 elements, in int8)."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 128, generator=gen), torch.randn(32, 128, generator=gen)

    async def train(codec: str) -> tuple[list[float], list[int]]:
        pipeline = InProcessPipeline([stage_config(rank, stash_codec=codec,
                                                   model_kwargs={"blocks": 4, "dim": 128, "hidden": 512})
                                      for rank in range(2)])
        try:
            assert [rank.built.model.stash_codec for rank in pipeline.ranks] == [codec, codec]
            results = [await pipeline.step(step, x, y) for step in range(4)]
        finally:
            pipeline.close()
        return [r.loss for r in results], [t.peak_stash_bytes for t in results[-1].traces]

    plain_losses, plain_bytes = await train("none")
    losses, held_bytes = await train("int8")
    assert losses[0] == plain_losses[0]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0]
    assert all(0 < held <= 0.3 * plain for held, plain in zip(held_bytes, plain_bytes)), (held_bytes, plain_bytes)


def test_an_unknown_stash_codec_is_refused_by_name() -> None:
    with pytest.raises(CodecError, match="unknown codec 'int9'; known codecs: none, fp16, bf16, int8, fp8, int4"):
        _activations.SavedActivations({}, "int9")


def test_the_saved_tensor_hooks_stay_out_of_torch_compile() -> None:
    """Found by review: dynamo traced the stage's saved-tensor hooks into every compiled layer and recompiled
    them as the storages they had guarded on moved: 27 recompiles over 12 batch shapes, twice up to the recompile
    limit. The hooks are eager code of the stage's bookkeeping, kept out of compiled graphs."""
    saved = _activations.SavedActivations(set())
    assert saved._hooks.pack_hook._torchdynamo_disable and saved._hooks.unpack_hook._torchdynamo_disable
