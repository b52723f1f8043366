# python -m schedulers.schedules --schedule 1f1b --stages 4 --micro-batches 8
"""Pipeline schedules as data: generators, lowering passes, and a command-line view.

A generator is a pure function of the number of stages (ranks), micro-batches and,
for interleaving, virtual stages per rank. It returns a *compute-only* schedule,
``dict[rank, list[Action]]`` of F/B (or F/I/W) actions. Passes turn that into what a
stage actor executes: :func:`add_send_recv` inserts the transfers and
:func:`add_step_tail` the barrier, gradient reduction and optimizer step.
:func:`build_schedule` does all of it by name, so one executor runs every schedule.

The command line prints a schedule's grid, its simulated makespan and its bubble
fraction (unit costs ``F=1, B=2`` unless told otherwise)::

    python -m schedulers.schedules --schedule interleaved --stages 4 --micro-batches 8
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from stages import Action, ActionKind, Placement, stage_to_rank, TAIL_KINDS
from stages.sections import V_SCHEDULES
from schedulers.dataflow import Schedule, infer_layout
from schedulers.grid import format_grid, parse_grid
from schedulers.simulate import Costs, simulate, to_ascii, to_chrome_trace

__all__ = [
    "SCHEDULES",
    "add_send_recv",
    "add_step_tail",
    "split_backward",
    "build_schedule",
    "dualpipe_v",
    "format_grid",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "main",
    "one_f_one_b",
    "parse_grid",
    "zero_bubble_h1",
    "zero_bubble_v",
]

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def _act(stage: int, kind: ActionKind, microbatch: int | None = None) -> Action:
    return Action(stage=stage, kind=kind, microbatch=microbatch)


def _check_sizes(name: str, num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"{name} needs num_stages >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"{name} needs num_microbatches >= 1, got {num_microbatches}")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe (fill-drain): every forward, then every backward.

    Stage ``s`` holds all ``num_microbatches`` activations at the turn. Bubble with
    uniform costs: ``(p-1)/(m+p-1)``.

    Raises:
        ValueError: a count is below 1.
    """
    _check_sizes("gpipe", num_stages, num_microbatches)
    micros = range(num_microbatches)
    return {
        s: [_act(s, _F, m) for m in micros] + [_act(s, _B, m) for m in micros]
        for s in range(num_stages)
    }


def _one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """1F1B's order on one stage as ("F"|"B", micro-batch) pairs."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("F", m) for m in range(warmup)]
    for m in range(num_microbatches - warmup):
        order += [("F", warmup + m), ("B", m)]
    order += [("B", m) for m in range(num_microbatches - warmup, num_microbatches)]
    return order


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush; DeepSpeed's TrainSchedule, Megatron's default).

    Stage ``s`` runs ``p-s-1`` warm-up forwards, then alternates one forward and one
    backward, then drains the backwards. Same bubble as GPipe, ``(p-1)/(m+p-1)``
    with uniform costs, but stage ``s`` holds at most ``p-s`` activations.

    Raises:
        ValueError: a count is below 1.
    """
    _check_sizes("1F1B", num_stages, num_microbatches)
    kinds = {"F": _F, "B": _B}
    return {
        s: [_act(s, kinds[k], m) for k, m in _one_f_one_b_order(s, num_stages, num_microbatches)]
        for s in range(num_stages)
    }


def interleaved_1f1b(
    num_stages: int, num_microbatches: int, num_virtual_stages: int = 2
) -> Schedule:
    """Interleaved 1F1B (Megatron's virtual pipeline stages).

    Each of the ``num_stages`` ranks holds ``num_virtual_stages`` (``V``) model stages:
    model stage ``s`` is on rank ``s % num_stages``. Micro-batches advance in groups of
    ``num_stages`` through each of a rank's chunks in turn; the warm-up is longer
    than 1F1B's, and the bubble shrinks by a factor of about ``V``. With ``V == 1``
    this is :func:`one_f_one_b`.

    Raises:
        ValueError: a count is below 1, or ``num_microbatches`` is not a multiple of
            ``num_stages`` (which the grouping needs).
    """
    _check_sizes("interleaved 1F1B", num_stages, num_microbatches)
    if num_virtual_stages < 1:
        raise ValueError(
            f"interleaved 1F1B needs num_virtual_stages >= 1, got {num_virtual_stages}"
        )
    if num_virtual_stages == 1:
        return one_f_one_b(num_stages, num_microbatches)
    if num_microbatches % num_stages:
        below = num_microbatches - num_microbatches % num_stages
        options = [n for n in (below, below + num_stages, below + 2 * num_stages) if n > 0]
        raise ValueError(
            "interleaved 1F1B needs num_microbatches to be a multiple of num_stages "
            f"({num_stages}); got {num_microbatches}, try "
            + " or ".join(str(n) for n in options[:2])
        )
    p, v = num_stages, num_virtual_stages
    total = v * num_microbatches  # forwards (and backwards) per rank

    def unit(rank: int, k: int, forward: bool) -> Action:
        # The k-th forward (or backward) on a rank: groups of p micro-batches sweep
        # the rank's chunks, first to last for forwards and last to first backwards.
        chunk = (k // p) % v
        micro = (k // (p * v)) * p + k % p
        if forward:
            return _act(chunk * p + rank, _F, micro)
        return _act((v - 1 - chunk) * p + rank, _B, micro)

    schedule: Schedule = {}
    for rank in range(p):
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
        program = [unit(rank, k, True) for k in range(warmup)]
        for k in range(total - warmup):
            program += [unit(rank, warmup + k, True), unit(rank, k, False)]
        program += [unit(rank, k, False) for k in range(total - warmup, total)]
        schedule[rank] = program
    return schedule


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 from "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241).

    Backward is split into ``I`` (input gradient, which the previous stage waits for)
    and ``W`` (weight gradient, which nobody waits for). Forwards and ``I`` follow
    1F1B's order; stage ``s`` defers its ``W`` by ``s`` micro-batches and drains them
    at the end, where 1F1B's cool-down would leave it idle. Every stage then holds at
    most ``p`` activations (1F1B's peak, now on every stage) and, with
    ``F = I = W``, the bubble is about a third of 1F1B's: ``(p-1)/(3m+p-1)`` for
    ``m >= p``.

    Raises:
        ValueError: a count is below 1.
    """
    _check_sizes("zero-bubble H1", num_stages, num_microbatches)
    schedule: Schedule = {}
    for s in range(num_stages):
        program: list[Action] = []
        pending: list[int] = []  # micro-batches whose W is still to run
        for kind, m in _one_f_one_b_order(s, num_stages, num_microbatches):
            if kind == "F":
                program.append(_act(s, _F, m))
                continue
            program.append(_act(s, _I, m))
            pending.append(m)
            if len(pending) > s:
                program.append(_act(s, _W, pending.pop(0)))
        program += [_act(s, _W, m) for m in pending]
        schedule[s] = program
    return schedule


class _VProgram:
    """One rank's program of a V-shaped schedule, written a phase at a time.

    The rank holds two model stages: ``down`` (its stage on the way down the V, ``rank``)
    and ``up`` (on the way back, ``2p - 1 - rank``). Each (stage, kind) takes its
    micro-batches in order, so an action names only its stage and kind and the program
    counts; a ``B`` counts as that micro-batch's ``I`` and ``W``. ``take_w`` runs the
    oldest weight gradient whose ``I`` has run and whose ``W`` has not.
    """

    def __init__(self, rank: int, num_ranks: int) -> None:
        self.down, self.up = rank, 2 * num_ranks - 1 - rank
        self.program: list[Action] = []
        self._next: dict[tuple[int, ActionKind], int] = {}
        self._weights: list[Action] = []  # W owed, oldest first

    def count(self, stage: int, kind: ActionKind) -> int:
        return self._next.get((stage, kind), 0)

    def run(self, stage: int, kind: ActionKind) -> None:
        if kind is _W:
            self.take_w(stage)
            return
        counted = _I if kind is _B else kind
        micro = self.count(stage, counted)
        self._next[stage, counted] = micro + 1
        self.program.append(_act(stage, kind, micro))
        if kind is _I:  # a B computes its W itself
            self._weights.append(_act(stage, _W, micro))

    def take_w(self, stage: int | None = None) -> bool:
        """Runs the oldest owed ``W`` (of ``stage``, if given); False: none was owed."""
        owed = [w for w in self._weights if stage is None or w.stage == stage]
        if owed:
            self._weights.remove(owed[0])
            self.program.append(owed[0])
        return bool(owed)

    def finish(self, num_microbatches: int) -> list[Action]:
        """The program with every action past the last real micro-batch dropped."""
        return [a for a in self.program if a.microbatch is None or a.microbatch < num_microbatches]


def zero_bubble_v(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V from "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241, section 6).

    Each of the ``num_stages`` ranks holds two model stages in a V (rank ``r``: stages ``r``
    and ``2p-1-r``; see :func:`stages.program.stage_to_rank`), so rank 0 runs the first
    and the last, and a micro-batch turns round on rank ``p-1`` without a transfer.
    Backward is split into ``I`` and ``W``; the warm-up fills the V, the steady state runs
    ``F I W`` on each of a rank's stages in turn, and the cool-down runs the input
    gradients first and the weight gradients where the ranks would wait. With equal
    ``F``, ``I`` and ``W`` costs the bubble is near zero once ``m >= 2p``, with 1F1B's
    peak activation memory. Built as if ``max(m, 2p-1)`` micro-batches ran, then the
    extra ones dropped, so any ``m`` works.

    Raises:
        ValueError: a count is below 1.
    """
    _check_sizes("ZB-V", num_stages, num_microbatches)
    p, total = num_stages, max(num_microbatches, 2 * num_stages - 1)
    schedule: Schedule = {}
    for rank in range(p):
        v = _VProgram(rank, p)
        down, up = v.down, v.up
        for _ in range(2 * (p - rank) - 1):  # fill the way down
            v.run(down, _F)
        for _ in range(rank):
            v.run(up, _F)
            v.run(down, _F)
        for _ in range(p - rank):  # the first micro-batches turn round
            for kind in (_F, _I, _W):
                v.run(up, kind)
        while v.count(up, _F) < v.count(down, _F) or v.count(down, _F) < total:
            if v.count(down, _F) < total:
                v.run(down, _F)
            for stage, kinds in ((down, (_I, _W)), (up, (_F, _I, _W))):
                for kind in kinds:
                    v.run(stage, kind)
        for _ in range(rank):  # drain: input gradients first, for the ranks above
            v.run(down, _I)
            v.run(up, _I)
        for _ in range(p - rank):
            v.run(down, _I)
            v.take_w(down)
        while v.take_w(up):
            pass
        while v.take_w(down):
            pass
        schedule[rank] = v.finish(num_microbatches)
    return schedule


def dualpipe_v(num_stages: int, num_microbatches: int) -> Schedule:
    """DualPipeV, DeepSeek's V-shaped DualPipe (arXiv 2412.19437; the "cut in half" variant).

    Placement as :func:`zero_bubble_v`. After a warm-up down and back up the V, each rank's
    steady state pairs a forward of one of its stages with a full backward of the other
    (``F down, B up, F up, B down``): the pairs DualPipe overlaps with their transfers on a
    GPU. The tail splits the last backwards into ``I`` and ``W`` so that the weight
    gradients fill the cool-down. Needs ``m >= 2p`` micro-batches.

    Raises:
        ValueError: a count is below 1, or fewer micro-batches than model stages.
    """
    _check_sizes("DualPipeV", num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least as many micro-batches as model stages ({2 * p} for "
                         f"{p} ranks), got {m}")
    schedule: Schedule = {}
    for rank in range(p):
        v = _VProgram(rank, p)
        down, up = v.down, v.up
        for _ in range(2 * (p - rank - 1)):
            v.run(down, _F)
        for _ in range(rank + 1):
            v.run(down, _F)
            v.run(up, _F)
        for _ in range(p - rank - 1):
            v.run(up, _I)
            v.take_w()
            v.run(up, _F)
        for _ in range(m - 2 * p + rank + 1):  # the steady state: F and B of the two stages, paired
            for stage, other in ((down, up), (up, down)):
                v.run(stage, _F)
                v.run(other, _B)
        for _ in range(p - rank - 1):
            v.run(up, _B)
            v.run(up, _F)
            v.run(down, _B)
        # The last backwards: whole, then split from half-way (the up stage first on odd ranks).
        split = False
        for i in range(rank + 1):
            for stage, parity in ((up, 1), (down, 0)):
                split = split or (i == (rank + 1) // 2 and rank % 2 == parity)
                v.run(stage, _I if split else _B)
        for _ in range(p - rank - 1):
            v.take_w()
            v.run(down, _I if split else _B)
        for _ in range(rank + 1):
            v.take_w()
        schedule[rank] = v.finish(m)
    return schedule


Generator = Callable[..., Schedule]
SCHEDULES: dict[str, Generator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zero_bubble": zero_bubble_h1,
    "zbv": zero_bubble_v,
    "dualpipev": dualpipe_v,
}


def add_send_recv(schedule: Schedule) -> Schedule:
    """Lower a compute-only schedule: insert the sends and receives between ranks.

    A send follows the compute that produces the value (``sSEND_Fm`` after ``sFm``,
    ``sSEND_Bm`` after ``sBm`` or ``sIm``); the receive comes right before the compute
    that needs it (the executor posts receives early; ``RECV`` means "wait until it
    has arrived"). Neighbouring stages on the same rank hand values over locally,
    and the first and last stage read inputs and compute the loss themselves.
    """
    layout = infer_layout(schedule)
    last = layout.num_stages - 1

    def crosses(stage: int, other: int) -> bool:
        return 0 <= other <= last and layout.crosses_ranks(stage, other)

    lowered: Schedule = {}
    for rank, program in schedule.items():
        out: list[Action] = []
        for a in program:
            s, m = a.stage, a.microbatch
            if a.kind is _F and crosses(s, s - 1):
                out.append(_act(s, ActionKind.RECV_F, m))
            if a.kind in (_B, _I) and crosses(s, s + 1):
                out.append(_act(s, ActionKind.RECV_B, m))
            out.append(a)
            if a.kind is _F and crosses(s, s + 1):
                out.append(_act(s, ActionKind.SEND_F, m))
            if a.kind in (_B, _I) and crosses(s, s - 1):
                out.append(_act(s, ActionKind.SEND_B, m))
        lowered[rank] = out
    return lowered


def split_backward(schedule: Schedule) -> Schedule:
    """Split each ``B`` whose input gradient goes to another rank into ``I`` then ``W``.

    The order of the schedule stays as it is (1F1B stays 1F1B); only the upstream stage
    gets its gradient sooner, since :func:`add_send_recv` then sends it right after
    ``I``, before the weight GEMMs of ``W`` run. On two stages of 1F1B this takes ``W``
    off the warm-up wait and the cool-down tail. A stage whose input comes from its own
    rank (or the first stage, which sends nothing) keeps its ``B``. Run it before
    :func:`add_send_recv`.
    """
    layout = infer_layout(schedule)
    split: Schedule = {}
    for rank, program in schedule.items():
        out: list[Action] = []
        for a in program:
            if a.kind is _B and a.stage > 0 and layout.crosses_ranks(a.stage, a.stage - 1):
                out += [_act(a.stage, _I, a.microbatch), _act(a.stage, _W, a.microbatch)]
            else:
                out.append(a)
        split[rank] = out
    return split


def defer_weight_grads(schedule: Schedule) -> Schedule:
    """W batching: every ``B`` becomes ``I``, and every ``W`` moves to the end of its rank's
    compute, in order, where the executor runs each weight's as one GEMM over all of the
    step's micro-batches (a larger K than one micro-batch's, as one process's batch has).

    ``W`` depends on nothing another rank waits for, so moving it later never blocks a
    peer; what it costs is memory: each linear's input and output gradient stay held for
    every micro-batch until the tail. Run it before :func:`add_send_recv`.
    """
    deferred: Schedule = {}
    for rank, program in schedule.items():
        out: list[Action] = []
        tail: list[Action] = []
        for a in program:
            if a.kind is _B:
                out.append(_act(a.stage, _I, a.microbatch))
                tail.append(_act(a.stage, _W, a.microbatch))
            elif a.kind is _W:
                tail.append(a)
            else:
                out.append(a)
        deferred[rank] = out + tail
    return deferred


def add_step_tail(schedule: Schedule) -> Schedule:
    """Append the accumulation barrier, gradient reduction and optimizer step to
    every rank's program (the tail actions carry the rank's first stage, ``rank``)."""
    return {
        rank: [*program, *(_act(rank, kind) for kind in TAIL_KINDS)]
        for rank, program in schedule.items()
    }


def build_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_virtual_stages: int | None = None,
    *,
    split: bool = False,
    batch_w: bool = False,
) -> Schedule:
    """Generate schedule ``name`` and lower it into programs ready to execute.

    Args:
        name: a key of :data:`SCHEDULES`.
        num_stages: pipeline ranks (stage actors).
        num_microbatches: micro-batches per optimizer step.
        num_virtual_stages: model stages per rank; ``"interleaved"`` takes more than
            one (default 2), ``"zbv"`` and ``"dualpipev"`` hold two in a V.
        split: split a backward whose input gradient leaves the rank into ``I`` and ``W``.
        batch_w: W batching (:func:`defer_weight_grads`).

    Raises:
        ValueError: unknown name, or arguments the schedule cannot take.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name == "interleaved":
        compute = interleaved_1f1b(num_stages, num_microbatches, 2 if num_virtual_stages is None else num_virtual_stages)
    else:
        if num_virtual_stages not in (None, 2 if name in V_SCHEDULES else 1):
            raise ValueError(
                f"schedule {name!r} holds two model stages per rank, in a V; num_virtual_stages="
                f"{num_virtual_stages} does not apply" if name in V_SCHEDULES else
                f"schedule {name!r} runs one stage per rank; use 'interleaved' for "
                f"num_virtual_stages={num_virtual_stages}")
        compute = SCHEDULES[name](num_stages, num_microbatches)
    if split:
        compute = split_backward(compute)
    if batch_w:
        compute = defer_weight_grads(compute)
    return add_step_tail(add_send_recv(compute))


def forward_only(num_stages: int, num_microbatches: int, num_virtual_stages: int = 1,
                 placement: Placement = "loop") -> Schedule:
    """An evaluation's programs (``job.evaluate``): every micro-batch forward through every stage, with
    the transfers and no tail. Each rank takes its micro-batches in order, and within one its stages
    in order (interleaved: stage ``r`` then ``r + num_stages``; in a V, ``r`` then ``2p - 1 - r``), so
    each forward waits only for one that comes before it in that order: no rank waits on another in
    a cycle."""
    _check_sizes("forward_only", num_stages, num_microbatches)
    total = num_stages * num_virtual_stages
    held = {rank: [s for s in range(total) if stage_to_rank(s, num_stages, placement) == rank]
            for rank in range(num_stages)}
    compute: Schedule = {rank: [_act(stage, _F, m) for m in range(num_microbatches) for stage in held[rank]]
                         for rank in range(num_stages)}
    return add_send_recv(compute)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m schedulers.schedules",
        description="Print a pipeline schedule, its simulated makespan and its bubble fraction.",
    )
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--stages", type=int, default=4, help="pipeline ranks")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    parser.add_argument(
        "--virtual-stages", type=int, default=None,
        help="model stages per rank: interleaved (default 2); zbv and dualpipev hold 2"
    )
    parser.add_argument("--forward", type=float, default=1.0, help="F cost")
    parser.add_argument("--backward", type=float, default=2.0, help="B cost")
    parser.add_argument("--input-grad", type=float, default=1.0, help="I cost (zero_bubble)")
    parser.add_argument("--weight-grad", type=float, default=1.0, help="W cost (zero_bubble)")
    parser.add_argument("--latency", type=float, default=0.0, help="link latency, seconds")
    parser.add_argument("--bandwidth", type=float, default=float("inf"), help="link bytes/second")
    parser.add_argument("--activation-bytes", type=float, default=0.0)
    parser.add_argument("--codec-ratio", type=float, default=1.0, help="encoded / raw size")
    parser.add_argument(
        "--split-backward", action="store_true",
        help="split B into I, W where the input gradient leaves the rank (as jobs run with "
        "gradient_accumulation_fusion)",
    )
    parser.add_argument(
        "--lowered", action="store_true", help="print sends, receives and the step tail"
    )
    parser.add_argument("--width", type=_columns, default=72, help="ASCII chart width (columns, >= 1)")
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace JSON")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [o for action in parser._actions for o in action.option_strings]
        near = difflib.get_close_matches(unknown[0].partition("=")[0], flags, n=1)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}" + (f"; did you mean {near[0]}?" if near else ""))
    try:
        args.costs = Costs(
            forward=args.forward,
            backward=args.backward,
            input_grad=args.input_grad,
            weight_grad=args.weight_grad,
            latency_s=args.latency,
            bandwidth=args.bandwidth,
            activation_bytes=args.activation_bytes,
            codec_ratio=args.codec_ratio,
        )
        args.program = build_schedule(
            args.schedule, args.stages, args.micro_batches, args.virtual_stages,
            split=args.split_backward,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _columns(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, build, simulate, print; returns the exit status."""
    args = _parse_args(argv)
    lowered = args.program
    shown = lowered if args.lowered else _compute_only(lowered)
    result = simulate(lowered, args.costs)
    print(f"{args.schedule}: {args.stages} stages x {args.micro_batches} micro-batches")
    print(format_grid(shown))
    print(to_ascii(result, width=args.width))
    print(f"makespan: {result.makespan:g}")
    print(f"peak_stash: {' '.join(str(n) for n in result.peak_stash)}")
    print(f"bubble_fraction: {result.bubble_fraction:.4f}")
    if args.trace:
        with open(args.trace, "w", encoding="utf-8") as f:
            json.dump(to_chrome_trace(result), f)
        print(f"trace: {args.trace}")
    return 0


def _compute_only(schedule: Schedule) -> Schedule:
    keep = (_F, _B, _I, _W)
    return {rank: [a for a in program if a.kind in keep] for rank, program in schedule.items()}


if __name__ == "__main__":
    sys.exit(main())
