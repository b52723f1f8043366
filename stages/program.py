"""The stage actor's instruction set: pipeline actions and their text form.

A *program* is the ordered list of :class:`Action` one stage actor (one rank) runs
for one training step. Schedules (``schedulers/``) are written in this instruction
set; the stage actor executes it. This module is a leaf: standard library only, so
that ``actors/`` can import it without importing any scheduling policy.

Every action prints in a compact form and parses back::

    1F3          stage 1, forward, micro-batch 3
    1B3          stage 1, full backward (input and weight gradients)
    1I3  1W3     the two halves of a split backward: input gradient, weight gradient
    1SEND_F3     stage 1 sends its output activation of micro-batch 3 to stage 2
    2RECV_F3     stage 2 waits for that activation to have arrived
    2SEND_B3     stage 2 sends its input gradient of micro-batch 3 to stage 1
    1RECV_B3     stage 1 waits for that gradient to have arrived
    0BARRIER     gradient-accumulation barrier (no micro-batch)
    0REDUCE      data-parallel gradient reduction
    0STEP        optimizer step

``stage`` is always the *model* stage (the virtual stage when a rank holds several);
:func:`stage_to_rank` says which rank owns it under a :data:`Placement` (round-robin
``"loop"``, or the V shape of ZB-V and DualPipeV), and :func:`transfer_partner` which
action on which rank is the other end of a send or receive.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "PLACEMENTS",
    "TAIL_KINDS",
    "Action",
    "ActionKind",
    "Placement",
    "Program",
    "stage_to_rank",
    "transfer_partner",
]


class ActionKind(enum.Enum):
    """What an action does; the value is its text in an action's compact form."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the upstream name for the input-gradient half of B
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    BARRIER = "BARRIER"
    REDUCE = "REDUCE"
    STEP = "STEP"


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
# The other end of each transfer: its kind and its stage relative to this one.
# Activations travel to the next stage, input gradients to the previous one.
_PARTNERS = {
    ActionKind.SEND_F: (ActionKind.RECV_F, +1),
    ActionKind.RECV_F: (ActionKind.SEND_F, -1),
    ActionKind.SEND_B: (ActionKind.RECV_B, -1),
    ActionKind.RECV_B: (ActionKind.SEND_B, +1),
}
COMM_KINDS = frozenset(_PARTNERS)
# The per-step tail every rank ends with, in this order; these have no micro-batch.
TAIL_KINDS = (ActionKind.BARRIER, ActionKind.REDUCE, ActionKind.STEP)

# Longest names first so that "BARRIER" is not read as "B" + garbage.
_KIND_PATTERN = "|".join(
    sorted((re.escape(kind.value) for kind in ActionKind), key=len, reverse=True)
)
_ACTION_RE = re.compile(rf"(\d+)({_KIND_PATTERN})(\d+)?")


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """One instruction of a stage actor's program.

    Attributes:
        stage: the model stage the action belongs to (virtual stage when interleaved).
        kind: what to do.
        microbatch: the micro-batch index; ``None`` exactly for the tail kinds
            (``BARRIER``, ``REDUCE``, ``STEP``).
    """

    stage: int
    kind: ActionKind
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ValueError(f"stage must be >= 0, got {self.stage}")
        if self.kind in TAIL_KINDS:
            if self.microbatch is not None:
                raise ValueError(f"{self.kind.value} takes no micro-batch, got {self.microbatch}")
        elif self.microbatch is None or self.microbatch < 0:
            raise ValueError(
                f"{self.kind.value} needs a micro-batch index >= 0, got {self.microbatch}"
            )

    def __str__(self) -> str:
        micro = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{micro}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact form (``1F3``, ``0SEND_B2``, ``0STEP``) back into an action.

        Raises:
            ValueError: ``text`` is not an action; the message quotes it.
        """
        if cls is Action and type(text) is str:
            return _parse_known(text)
        return cls._parse(text)

    @classmethod
    def _parse(cls, text: str) -> Action:
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(
                f"not an action: {text!r} (expected e.g. '1F3', '0SEND_B2' or '0STEP')"
            )
        stage, kind, micro = match.groups()
        try:
            return cls(
                stage=int(stage),
                kind=ActionKind(kind),
                microbatch=None if micro is None else int(micro),
            )
        except ValueError as exc:
            raise ValueError(f"not an action: {text!r} ({exc})") from None


@functools.lru_cache(maxsize=1 << 15)
def _parse_known(text: str) -> Action:
    """:meth:`Action.parse`, remembered: a stage parses its whole program at every step (a
    2-stage, 64-micro-batch 1F1B rank's 323 actions took 0.6 ms), and an action is immutable.
    An error is not remembered; the size bounds what a long run of new texts can hold."""
    return Action._parse(text)


# One rank's instruction list for one training step.
Program = list[Action]


Placement = Literal["loop", "v"]
"""How model stages sit on ranks when a rank holds several: ``loop`` (round-robin, Megatron's
interleaving) or ``v`` (there and back: ZB-V's and DualPipeV's V shape). Names as torch's
pipelining calls them."""
PLACEMENTS: tuple[str, ...] = get_args(Placement)


def stage_to_rank(stage: int, num_ranks: int, placement: Placement = "loop") -> int:
    """The rank that owns model ``stage``.

    Without interleaving (as many stages as ranks) rank ``r`` runs stage ``r``. With
    ``V`` virtual stages per rank there are ``num_ranks * V`` model stages, in chunks of
    ``num_ranks``. ``loop``: stage ``s`` lives on rank ``s % num_ranks`` (Megatron's
    placement), so neighbouring stages are on neighbouring ranks and the last rank sends
    on to the first. ``v``: every other chunk runs back up the ranks, so with 4 ranks
    stages 0-3 are on ranks 0-3 and stages 4-7 on ranks 3-0: rank 3 hands stage 3's
    output to stage 4 in memory, and rank 0 holds both the first and the last stage.

    Raises:
        ValueError: ``num_ranks`` < 1, ``stage`` < 0, or an unknown placement.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if stage < 0:
        raise ValueError(f"stage must be >= 0, got {stage}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    chunk, position = divmod(stage, num_ranks)
    if placement == "v" and chunk % 2:
        return num_ranks - 1 - position
    return position


def transfer_partner(action: Action, num_ranks: int, placement: Placement = "loop") -> tuple[int, Action]:
    """The other end of a send or receive, and the rank that runs it.

    ``sSEND_Fm`` pairs with ``(s+1)RECV_Fm`` (the activation goes to the next stage)
    and ``sSEND_Bm`` with ``(s-1)RECV_Bm`` (the input gradient goes to the previous
    one), either way round; the partner runs on :func:`stage_to_rank` of its stage.
    With 4 ranks, ``1SEND_F3`` pairs with ``2RECV_F3`` on rank 2, and ``4RECV_B0``
    with ``5SEND_B0`` on rank 1. Whether a partner past the last stage exists is the
    caller's to check: only the schedule knows its number of stages.

    Returns:
        ``(rank, action)`` of the partner.

    Raises:
        ValueError: ``action`` is not a send or receive, its partner would come
            before stage 0, or ``num_ranks`` < 1.
    """
    if action.kind not in _PARTNERS:
        raise ValueError(f"{action} is not a send or receive, so it has no partner")
    kind, offset = _PARTNERS[action.kind]
    stage = action.stage + offset
    if stage < 0:
        raise ValueError(f"{action} has no partner: no stage comes before stage 0")
    partner = Action(stage=stage, kind=kind, microbatch=action.microbatch)
    return stage_to_rank(stage, num_ranks, placement), partner
