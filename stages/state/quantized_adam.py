"""Adam and AdamW with their two moments held in fewer bits: bf16, 8-bit or 4-bit, block-wise.

fp32 Adam keeps 8 bytes of state per parameter, twice the parameter itself; held in
8 bits the moments take 2 bytes and a little (4 bits: 1), which is what a stage of a
model too large for one process needs most. A job selects it with
``optimization.optimizer_states`` (``bf16``, ``int8``, ``int4``; ``fp32`` is torch's
own Adam, exact), with ``torch.optim:Adam`` or ``AdamW`` as the optimizer.

**Why not torchao.** torchao's ``AdamW8bit`` / ``AdamW4bit`` run on CPU with torch
2.13, but only through ``torch.compile`` of every parameter shape: 28 s of compile in
each stage process the first time on this 2-core machine (3 s with the cache warm),
a C++ toolchain on every node, and state tensors of its own subclasses that the
checkpoint and snapshot formats would each have to learn. The arithmetic is small,
so it is written here in eager torch, and the state stays plain tensors.

**The numbers.** Each moment is split into blocks of ``block`` consecutive elements; each
block keeps its absolute maximum ``M`` (float32) and a code per element:

- the first moment ``m`` (signed): ``code = q * sign(m) * sqrt(|m| / M)``, decoded
  ``sign(code) * (code / q)**2 * M``, with ``q`` = 127 (int8) or 7 (int4);
- the second moment ``v`` (never negative): ``code = q * (v / M) ** (1/4)``, decoded
  ``(code / q)**4 * M``, with ``q`` = 255 (8-bit) or 15 (4-bit).

The power maps (the square root for ``m``, its square root again for ``v``) give small
values finer steps, as the dynamic maps of bitsandbytes and torchao do: the smallest
``v`` an 8-bit code holds apart from 0 is ``M / 255**4``. Every code is rounded
stochastically between its two neighbouring levels, with the probability that makes
the decoded value unbiased: a moment that changes by less than a step each iteration
(``v`` moves 0.1% a step with ``beta2 = 0.999``) still moves on average, instead of
sticking where rounding to the nearest level would hold it. A ``v`` that is not 0 never
rounds to 0 (its code is at least 1), so no element divides by ``eps`` alone. ``bf16``
keeps both moments as bfloat16, rounded stochastically the same way.

The noise comes from a generator seeded by the step and the parameter (by its name in
the model: the same in every layout), so a step replayed from a snapshot (recovery) or a checkpoint computes the
same codes again. Each step decodes one parameter's moments to float32, applies torch's
Adam (or AdamW) update to them and the parameter, and encodes them again: the extra
memory is two float32 copies of the largest parameter, for the moment.

**Checkpoints** hold the moments decoded, as float32 ``exp_avg`` / ``exp_avg_sq`` of
the parameter's shape (:func:`checkpoint_state`), so a checkpoint is one format for
every state precision and every tensor-parallel layout; loading encodes them again
(:func:`encode_loaded`), which gives back the same codes and block maxima exactly.
Snapshots for recovery keep the codes as they are.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from stages.state.state_precision import adam_arguments

__all__ = ["QuantizedAdam", "checkpoint_state", "decode", "encode", "encode_loaded", "noise_shape", "replacing"]

_MOMENTS = ("exp_avg", "exp_avg_sq")
# (largest code, power of the map, signed) for each moment, by bits.
_LEVELS = {8: {"exp_avg": (127, 2, True), "exp_avg_sq": (255, 4, False)},
           4: {"exp_avg": (7, 2, True), "exp_avg_sq": (15, 4, False)}}
_BITS = {"int8": 8, "int4": 4}
DEFAULT_BLOCK = {"int8": 256, "int4": 128}
# A value this close to a level (in steps) is on it: decoding then encoding gives the same code.
_SNAP = 1e-4
# Elements one step decodes, updates and encodes at once (a whole number of blocks): the float32
# temporaries of a step are a few of these, not a few of the largest parameter.
CHUNK = 1 << 18


def _width(numel: int, block: int) -> int:
    """Elements per block for a tensor of ``numel``: ``block``, or the tensor (rounded up to even) if smaller."""
    return min(block, max(numel + numel % 2, 2))


def noise_shape(x: torch.Tensor, block: int) -> tuple[int, int]:
    """The shape of the noise :func:`encode` takes for a tensor like ``x``: blocks by block width."""
    width = _width(x.numel(), block)
    return (-(-x.numel() // width), width)


def encode(x: torch.Tensor, bits: int, moment: str, block: int, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and block maxima of ``x`` (a moment: ``exp_avg`` or ``exp_avg_sq``), flat.

    ``noise``: uniform in [0, 1), one per element of the zero-padded blocks (:func:`noise_shape`).
    Codes: int8 (8 bits, ``exp_avg``), uint8 (8 bits, ``exp_avg_sq``), or uint8 two codes a
    byte (4 bits; ``exp_avg``'s each + 8), over the padded blocks. Maxima: float32, one a block.
    """
    q, power, signed = _LEVELS[bits][moment]
    count, width = noise_shape(x, block)
    flat = x.reshape(-1).float()
    if count * width != flat.numel():
        flat = torch.nn.functional.pad(flat, (0, count * width - flat.numel()))
    blocks = flat.view(count, width)
    magnitude = blocks.abs()
    top = magnitude.amax(dim=1, keepdim=True)
    y = magnitude / top.clamp_min(torch.finfo(torch.float32).tiny)
    level = y.pow(1.0 / power).mul_(q)
    near = level.round()
    level = torch.where((level - near).abs_() < _SNAP, near, level)
    low = level.floor_().clamp_(max=q - 1)
    # The chance of the upper level that makes the decoded value unbiased.
    low_value, high_value = (low / q).pow_(power), ((low + 1) / q).pow_(power)
    chance = ((y - low_value) / (high_value - low_value)).clamp_(0, 1)
    codes = low + (noise.view_as(chance) < chance)
    if signed:
        codes = codes.copysign_(blocks)
    else:
        codes = torch.where((codes == 0) & (y > 0), torch.ones_like(codes), codes)  # v > 0 never decodes as 0
    codes = codes.view(-1)
    if bits == 8:
        packed = codes.to(torch.int8 if signed else torch.uint8)
    else:
        nibbles = (codes + 8 if signed else codes).to(torch.uint8)
        packed = nibbles[0::2] | (nibbles[1::2] << 4)
    return packed, top.view(-1)


def decode(codes: torch.Tensor, maxima: torch.Tensor, bits: int, moment: str, shape: torch.Size) -> torch.Tensor:
    """The float32 moment of ``shape`` that :func:`encode` gave ``codes`` and ``maxima`` for."""
    q, power, signed = _LEVELS[bits][moment]
    if bits == 8:
        values = codes.float()
    else:
        both = torch.stack((codes & 0x0F, codes >> 4), dim=1).view(-1).float()
        values = both - 8 if signed else both
    blocks = values.view(maxima.numel(), -1)
    decoded = (blocks.abs() / q).pow_(power).mul_(maxima.unsqueeze(1))
    if signed:
        decoded = decoded.copysign_(blocks)
    return decoded.view(-1)[:math.prod(shape)].reshape(shape)


def _round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (float32) as bfloat16, rounded up or down with the chance that keeps it unbiased."""
    bits = x.contiguous().view(torch.int32)
    dither = torch.randint(0, 1 << 16, x.shape, generator=generator, device=x.device, dtype=torch.int32)
    finite = torch.isfinite(x)
    rounded = torch.where(finite, (bits + dither) & ~0xFFFF, bits)  # inf and NaN keep their bits
    return rounded.view(torch.float32).to(torch.bfloat16)


class QuantizedAdam(torch.optim.Optimizer):
    """torch's Adam (``decoupled=False``) or AdamW, with ``exp_avg`` and ``exp_avg_sq`` in ``states``.

    Args:
        params, lr, betas, eps, weight_decay: as torch's ``Adam`` / ``AdamW`` take them.
        decoupled: AdamW's decoupled weight decay (``p *= 1 - lr * weight_decay``); else
            Adam's L2 term added to the gradient.
        states: ``bf16``, ``int8`` or ``int4``.
        block: elements per block of the 8- and 4-bit codes (default 256 for int8, 128 for int4).
        seeds: a number per parameter (by ``id``) that seeds its rounding noise with the step:
            a stage gives one from the parameter's name in the whole model, so that every
            layout (pipeline stages, ZeRO shards) rounds a parameter alike and trains to the
            same bits; a parameter without one uses its place in this optimizer.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, decoupled: bool = False,
                 states: str = "int8", block: int | None = None, seeds: Mapping[int, int] | None = None) -> None:
        if states not in ("bf16", "int8", "int4"):
            raise ValueError(f"states must be bf16, int8 or int4, got {states!r}")
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise ValueError(f"lr, eps and weight_decay must not be negative, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        block = DEFAULT_BLOCK.get(states, 256) if block is None else block
        if type(block) is not int or block < 2 or block % 2:
            raise ValueError(f"block must be an even int >= 2, got {block!r}")
        self.states = states
        self.block = block
        self._seeds = dict(seeds or {})
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "decoupled": decoupled})

    @property
    def bits(self) -> int | None:
        return _BITS.get(self.states)

    def _index(self) -> dict[int, int]:
        """Each parameter's seed: the one it was given, else its place in this optimizer."""
        places = (p for group in self.param_groups for p in group["params"])
        return {id(p): self._seeds.get(id(p), i) for i, p in enumerate(places)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, with the codes kept as codes: torch casts every state tensor but ``step`` to its
        parameter's dtype, and float32 codes took four times the memory (int8) or failed the next step
        (int4). They are whole numbers (and bf16 moments bfloat16 values), so they cast back exactly."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for name in _MOMENTS:
                if self.bits is None and name in state:
                    state[name] = state[name].to(torch.bfloat16)  # bf16 moments: bfloat16 values, exactly
                if f"{name}_codes" in state:
                    dtype = torch.int8 if self.bits == 8 and name == "exp_avg" else torch.uint8
                    state[f"{name}_codes"] = state[f"{name}_codes"].to(dtype)
                    state[f"{name}_max"] = state[f"{name}_max"].float()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = self._index()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("QuantizedAdam does not take sparse gradients")
                self._step_one(p, group, beta1, beta2, index[id(p)])
        return loss

    def _step_one(self, p: torch.Tensor, group: Mapping[str, Any], beta1: float, beta2: float, seed: int) -> None:
        """One parameter's update, :data:`CHUNK` elements at a time: what it holds besides the codes
        is a few float32 chunks, whatever the parameter's size."""
        state = self.state[p]
        if "exp_avg" in state and (self.bits is not None or state["exp_avg"].dtype != torch.bfloat16):
            self._encode_state(p, state)  # float32 moments a checkpoint gave back
        if not state.get("step"):
            self._allocate(p, state)
        step = state["step"] = state.get("step", torch.tensor(0.0)) + 1
        count = float(step)
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        step_size, correction2 = lr / (1 - beta1 ** count), math.sqrt(1 - beta2 ** count)
        # A view of the parameter; a copy of one that is not contiguous (a channels_last weight), copied back
        # below (its update went into a temporary before, and the weight never moved).
        contiguous = p.is_contiguous()
        flat = p.detach().reshape(-1) if contiguous else p.detach().contiguous().view(-1)
        grads = p.grad.detach().reshape(-1)  # type: ignore[union-attr]
        generators = [torch.Generator(device=p.device).manual_seed(((int(count) * 1_000_003 + seed) * 2 + which)
                                                                    % (1 << 63)) for which in (0, 1)]
        chunk = self._chunk(p.numel())
        for start in range(0, p.numel(), chunk):
            end = min(start + chunk, p.numel())
            m, v = self._chunk_moments(p, state, start, end)
            grad = grads[start:end].float()
            work = flat[start:end].float() if p.dtype != torch.float32 else flat[start:end]
            if weight_decay:
                if group["decoupled"]:
                    work.mul_(1 - lr * weight_decay)
                else:
                    grad = grad.add(work, alpha=weight_decay)
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denominator = (v.sqrt() / correction2).add_(eps)
            work.addcdiv_(m, denominator, value=-step_size)
            if p.dtype != torch.float32:
                flat[start:end].copy_(work)
            self._chunk_store(p, state, m, v, start, end, generators)
        if not contiguous:
            p.detach().copy_(flat.view(p.shape))

    def _chunk(self, numel: int) -> int:
        """Elements a step works on at once: :data:`CHUNK`, a whole number of blocks."""
        width = _width(numel, self.block)
        return max(width, CHUNK // width * width)

    def _allocate(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        """Zero moments for ``p``'s first step, in their precision."""
        if self.bits is None:
            for name in _MOMENTS:
                state[name] = torch.zeros(p.shape, dtype=torch.bfloat16, device=p.device)
            return
        self._encode_into(p, state, lambda start, end: [torch.zeros(end - start, device=p.device)] * 2)

    def _encode_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        """Float32 moments (a checkpoint's) encoded in this optimizer's precision; the codes and maxima
        they were decoded from, exactly (bf16: the same bfloat16)."""
        m, v = state.pop("exp_avg").reshape(-1), state.pop("exp_avg_sq").reshape(-1)
        if self.bits is None:
            state["exp_avg"], state["exp_avg_sq"] = (t.reshape(p.shape).to(torch.bfloat16) for t in (m, v))
            return
        self._encode_into(p, state, lambda start, end: [m[start:end].float(), v[start:end].float()])

    def _encode_into(self, p: torch.Tensor, state: dict[str, Any],
                     values: Callable[[int, int], list[torch.Tensor]]) -> None:
        """Codes and maxima for both moments, encoded a chunk at a time from ``values(start, end)``."""
        assert self.bits is not None
        numel, width = p.numel(), _width(p.numel(), self.block)
        count = -(-numel // width)
        for name in _MOMENTS:
            dtype = torch.int8 if self.bits == 8 and name == "exp_avg" else torch.uint8
            state[f"{name}_codes"] = torch.empty(count * width * self.bits // 8, dtype=dtype, device=p.device)
            state[f"{name}_max"] = torch.empty(count, dtype=torch.float32, device=p.device)
        chunk = self._chunk(numel)
        for start in range(0, numel, chunk):
            end = min(start + chunk, numel)
            codes, blocks = self._slices(numel, start, end)
            for name, value in zip(_MOMENTS, values(start, end)):
                value = self._in_blocks(numel, value)
                # On a level already (zeros, or decoded values): an even chance keeps each on its own level.
                even = torch.full(noise_shape(value, self.block), 0.5, device=p.device)
                state[f"{name}_codes"][codes], state[f"{name}_max"][blocks] = encode(value, self.bits, name,
                                                                                     self.block, even)

    def _in_blocks(self, numel: int, value: torch.Tensor) -> torch.Tensor:
        """A chunk of a parameter of ``numel`` elements, zero-padded to one block of the parameter's width
        where it is shorter (a large parameter's last chunk): :func:`encode` takes a tensor's block width
        from its size, and a short last chunk would get a narrower one than its codes' slice holds (as
        the whole parameter, its last block is zero-padded alike)."""
        width = _width(numel, self.block)
        return value if value.numel() >= width else torch.nn.functional.pad(value, (0, width - value.numel()))

    def _slices(self, numel: int, start: int, end: int) -> tuple[slice, slice]:
        """The codes and the maxima of elements ``[start, end)`` (``start`` on a block boundary)."""
        assert self.bits is not None
        width = _width(numel, self.block)
        blocks = slice(start // width, -(-end // width))
        last = blocks.stop * width if end == numel else end
        per_byte = 8 // self.bits
        return slice(start // per_byte, -(-last // per_byte)), blocks

    def _chunk_moments(self, p: torch.Tensor, state: dict[str, Any], start: int,
                       end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Both moments of elements ``[start, end)`` as float32."""
        if self.bits is None:
            return tuple(state[name].reshape(-1)[start:end].float() for name in _MOMENTS)  # type: ignore[return-value]
        codes, blocks = self._slices(p.numel(), start, end)
        return tuple(decode(state[f"{name}_codes"][codes], state[f"{name}_max"][blocks], self.bits, name,  # type: ignore[return-value]
                            torch.Size([end - start])) for name in _MOMENTS)

    def _chunk_store(self, p: torch.Tensor, state: dict[str, Any], m: torch.Tensor, v: torch.Tensor, start: int,
                     end: int, generators: list[torch.Generator]) -> None:
        for name, value, generator in zip(_MOMENTS, (m, v), generators):
            if self.bits is None:
                state[name].reshape(-1)[start:end] = _round_bf16(value, generator)
                continue
            value = self._in_blocks(p.numel(), value)
            noise = torch.rand(noise_shape(value, self.block), generator=generator, device=p.device)
            codes, blocks = self._slices(p.numel(), start, end)
            state[f"{name}_codes"][codes], state[f"{name}_max"][blocks] = encode(value, self.bits, name, self.block,
                                                                                 noise)

    def _moments(self, p: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Both moments as float32 of ``p``'s shape (for a checkpoint)."""
        if "exp_avg_codes" in state:
            assert self.bits is not None
            return tuple(decode(state[f"{name}_codes"], state[f"{name}_max"], self.bits, name, p.shape)  # type: ignore[return-value]
                         for name in _MOMENTS)
        return state["exp_avg"].float().clone(), state["exp_avg_sq"].float().clone()

    def decoded(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """``p``'s state with the moments as float32 of ``p``'s shape (empty before its first step)."""
        state = self.state.get(p, {})
        if not state:
            return {}
        m, v = self._moments(p, state)
        return {"step": state["step"], "exp_avg": m, "exp_avg_sq": v}

    def encode_loaded(self) -> None:
        """Encodes moments a checkpoint loaded as float32 (:func:`checkpoint_state`) in this optimizer's
        precision: the codes and maxima they were decoded from, exactly (bf16: the same bfloat16)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "exp_avg" in state and (self.bits is not None or state["exp_avg"].dtype != torch.bfloat16):
                    self._encode_state(p, state)


def _base(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that keeps the state (a ZeRO-sharded optimizer's inner one)."""
    return getattr(optimizer, "inner", optimizer)


def checkpoint_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
    """``param``'s optimizer state as a checkpoint stores it: a :class:`QuantizedAdam`'s moments
    decoded to float32 of the parameter's shape (so a checkpoint reads back into any state
    precision and tensor-parallel layout), anything else as it is."""
    base = _base(optimizer)
    if isinstance(base, QuantizedAdam):
        return base.decoded(param)
    return dict(optimizer.state.get(param, {}))


def encode_loaded(optimizer: torch.optim.Optimizer) -> None:
    """After a checkpoint's state went into ``optimizer.state``: a :class:`QuantizedAdam` encodes it."""
    base = _base(optimizer)
    if isinstance(base, QuantizedAdam):
        base.encode_loaded()


def replacing(path: str, kwargs: Mapping[str, Any], states: str,
              names: Mapping[int, str] | None = None) -> tuple[type[QuantizedAdam], dict[str, Any]]:
    """:class:`QuantizedAdam` and its arguments in place of torch's ``Adam`` / ``AdamW`` (``path``,
    ``kwargs``), holding the moments in ``states`` (see :func:`~stages.state.state_precision.adam_arguments`);
    ``names``: each parameter's name in the whole model (by ``id``), its rounding noise's seed."""
    seeds = {i: zlib.crc32(name.encode()) for i, name in (names or {}).items()}
    return QuantizedAdam, {**adam_arguments(path, kwargs, states), "seeds": seeds}
