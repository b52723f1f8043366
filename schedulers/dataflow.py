"""What every action waits for, and an in-order executor of a whole schedule.

This is the one place that knows the dependency rules; validation, the timed
simulation and the grid layout all build on it, so they cannot disagree.

A schedule is ``dict[rank, list[Action]]``: each rank runs its list in order, one
action at a time. An action starts once its rank is free and everything it needs has
finished (for data from another rank: has *arrived*). Sends never block: a ``SEND``
hands the tensor to the link and returns, and the matching ``RECV`` waits for it.

A schedule is *lowered* once it holds any send or receive; then data crosses ranks
only through them. A compute-only schedule moves data between ranks implicitly, at
the same cost, so both forms of one schedule time the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from stages import Action, ActionKind, COMM_KINDS, Placement, stage_to_rank, TAIL_KINDS, transfer_partner

__all__ = [
    "Layout",
    "Position",
    "Schedule",
    "Timeline",
    "infer_layout",
    "link_destination",
    "play",
    "requirements",
]

# rank -> that rank's program, in execution order.
Schedule = dict[int, list[Action]]
# (rank, index in that rank's program): identifies one occurrence of an action.
Position = tuple[int, int]

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """The shape of a schedule, inferred from the actions it contains.

    Attributes:
        num_ranks: number of programs (stage actors).
        num_stages: number of model stages (``num_ranks * V`` when interleaved).
        num_microbatches: one more than the largest micro-batch index.
        lowered: whether the schedule carries explicit sends and receives.
        actions: every action present, for "is there an ``I`` for this?" questions.
        placement: how stages sit on ranks (:data:`stages.program.Placement`): ``v`` where
            the programs put them in a V (ZB-V, DualPipeV), else round-robin.
    """

    num_ranks: int
    num_stages: int
    num_microbatches: int
    lowered: bool
    actions: frozenset[Action] = field(repr=False)
    placement: Placement = "loop"

    def rank_of(self, stage: int) -> int:
        """The rank that owns ``stage``."""
        return stage_to_rank(stage, self.num_ranks, self.placement)

    def input_grad(self, stage: int, microbatch: int) -> Action:
        """The action that produces ``stage``'s input gradient: ``I`` if split, else ``B``."""
        split = Action(stage=stage, kind=_I, microbatch=microbatch)
        if split in self.actions:
            return split
        return Action(stage=stage, kind=_B, microbatch=microbatch)

    def crosses_ranks(self, stage: int, other: int) -> bool:
        """Whether data between two stages has to travel over a link."""
        return self.rank_of(stage) != self.rank_of(other)


def infer_layout(schedule: Schedule) -> Layout:
    """Read the number of ranks, stages and micro-batches off a schedule."""
    actions = frozenset(a for program in schedule.values() for a in program)
    work = [a for a in actions if a.kind not in TAIL_KINDS]
    num_ranks, num_stages = len(schedule), 1 + max((a.stage for a in work), default=-1)
    owners = {(a.stage, rank) for rank, program in schedule.items() for a in program if a.kind not in TAIL_KINDS}
    # V where the programs hold their stages in a V and not round-robin (they agree while
    # every rank holds one stage); a schedule that fits neither is validation's to refuse.
    v_shaped = num_stages > num_ranks > 0 and all(stage_to_rank(s, num_ranks, "v") == r for s, r in owners)
    return Layout(
        num_ranks=num_ranks,
        num_stages=num_stages,
        num_microbatches=1 + max((a.microbatch or 0 for a in work), default=-1),
        lowered=any(a.kind in COMM_KINDS for a in work),
        actions=actions,
        placement="v" if v_shaped else "loop",
    )


def requirements(action: Action, layout: Layout) -> list[Action]:
    """The actions that must have finished before ``action`` may start.

    Same-rank requirements must come earlier in that rank's program; cross-rank
    ones are waited for. The tail (barrier, reduce, step) orders only by program.
    """
    s, m, kind = action.stage, action.microbatch, action.kind
    if m is None:
        return []
    last = layout.num_stages - 1
    if kind is _F:
        if s == 0:
            return []  # the first stage reads the inputs
        if layout.lowered and layout.crosses_ranks(s, s - 1):
            return [Action(stage=s, kind=ActionKind.RECV_F, microbatch=m)]
        return [Action(stage=s - 1, kind=_F, microbatch=m)]
    if kind is _B or kind is _I:
        own = [Action(stage=s, kind=_F, microbatch=m)]
        if s == last:
            return own  # the last stage's F computed the loss
        if layout.lowered and layout.crosses_ranks(s, s + 1):
            return own + [Action(stage=s, kind=ActionKind.RECV_B, microbatch=m)]
        return own + [layout.input_grad(s + 1, m)]
    if kind is _W:
        return [Action(stage=s, kind=_I, microbatch=m)]
    if kind is ActionKind.SEND_F:
        return [Action(stage=s, kind=_F, microbatch=m)]
    if kind is ActionKind.SEND_B:
        return [layout.input_grad(s, m)]
    assert kind in (ActionKind.RECV_F, ActionKind.RECV_B), kind
    try:
        _, send = transfer_partner(action, layout.num_ranks)
    except ValueError:  # a receive on the first stage: nothing sends to it (validate says so)
        return []
    return [send]


def link_destination(action: Action, layout: Layout) -> int | None:
    """The rank that ``action``'s result travels to over a link, if any."""
    s, kind = action.stage, action.kind
    implicit = not layout.lowered  # compute-only: the compute itself feeds the link
    if kind is ActionKind.SEND_F or (implicit and kind is _F):
        if s + 1 < layout.num_stages and layout.crosses_ranks(s, s + 1):
            return layout.rank_of(s + 1)
    elif kind is ActionKind.SEND_B or (implicit and kind in (_B, _I)):
        if s > 0 and layout.crosses_ranks(s, s - 1):
            return layout.rank_of(s - 1)
    return None


@dataclass(slots=True, kw_only=True)
class Timeline:
    """What :func:`play` found: when each action ran, or where everything stuck.

    Attributes:
        start, end: per position, the action's start and end time.
        transfers: ``(producer position, destination rank, leaves, arrives)`` for
            every value that crossed a link, in the order it was sent.
        blocked: if the schedule deadlocked, each stuck rank's next position and the
            requirements it waits for (empty when everything ran).
    """

    start: dict[Position, float] = field(default_factory=dict)
    end: dict[Position, float] = field(default_factory=dict)
    transfers: list[tuple[Position, int, float, float]] = field(default_factory=list)
    blocked: list[tuple[Position, list[Action]]] = field(default_factory=list)


Duration = Callable[[Action], float]
# Link model: given the departure time, the link's free time and the action whose value
# it carries, (busy_until, arrival).
LinkTime = Callable[[float, float, Action], tuple[float, float]]


def _instant_link(leaves: float, free_at: float, action: Action) -> tuple[float, float]:
    return free_at, leaves


def play(
    schedule: Schedule,
    duration: Duration,
    link: LinkTime = _instant_link,
    *,
    force: bool = False,
    layout: Layout | None = None,
) -> Timeline:
    """Run every rank's program in order and record when each action runs.

    Args:
        schedule: the programs to run.
        duration: how long an action occupies its rank.
        link: how a value crosses a link; each directed link (source rank,
            destination rank) carries one value at a time, in the order sent.
        force: on a deadlock, keep going by starting the earliest stuck action as if
            its missing requirements were met (used to lay out broken schedules
            for display); otherwise stop and report the stuck actions.
        layout: the schedule's layout, if already inferred.

    Returns:
        The timeline; ``blocked`` is non-empty only if ``force`` is false and some
        rank could not finish.
    """
    layout = layout or infer_layout(schedule)
    ranks = sorted(schedule)
    first_seen: dict[Action, Position] = {}
    for rank in ranks:
        for index, action in enumerate(schedule[rank]):
            first_seen.setdefault(action, (rank, index))
    needs = {a: requirements(a, layout) for a in first_seen}
    # When an action's result is usable on its own rank, and where it is sent to.
    finished: dict[Action, float] = {}
    arrived: dict[Action, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    timeline = Timeline()
    clock = {rank: 0.0 for rank in ranks}
    cursor = {rank: 0 for rank in ranks}

    def usable(dep: Action, rank: int) -> float | None:
        here = layout.rank_of(dep.stage) == rank
        return finished.get(dep) if here else arrived.get(dep)

    def run(rank: int, deps: Iterable[Action]) -> None:
        index = cursor[rank]
        action = schedule[rank][index]
        times = (usable(d, rank) for d in deps)
        begin = max([clock[rank], *(t for t in times if t is not None)])
        finish = begin + duration(action)
        timeline.start[rank, index], timeline.end[rank, index] = begin, finish
        clock[rank], cursor[rank] = finish, index + 1
        if action in finished:
            return  # a duplicate (invalid schedule, laid out for display only)
        finished[action] = arrived[action] = finish
        destination = link_destination(action, layout)
        if destination is not None:
            key = (rank, destination)
            busy_until, arrived[action] = link(finish, link_free.get(key, 0.0), action)
            link_free[key] = busy_until
            timeline.transfers.append(((rank, index), destination, finish, arrived[action]))

    while any(cursor[r] < len(schedule[r]) for r in ranks):
        progressed = False
        for rank in ranks:
            while cursor[rank] < len(schedule[rank]):
                deps = needs[schedule[rank][cursor[rank]]]
                if any(usable(d, rank) is None for d in deps):
                    break
                run(rank, deps)
                progressed = True
        if progressed:
            continue
        stuck = [r for r in ranks if cursor[r] < len(schedule[r])]
        if not force:
            for r in stuck:
                action = schedule[r][cursor[r]]
                waiting = [d for d in needs[action] if usable(d, r) is None]
                timeline.blocked.append(((r, cursor[r]), waiting))
            return timeline
        rank = min(stuck, key=lambda r: (clock[r], r))
        run(rank, needs[schedule[rank][cursor[rank]]])
    return timeline
