# .venv/bin/python -m pytest -q -p no:cacheprovider tests/stages/compute/test_agreement.py
"""The stages' agreement on a step's decision (stages.compute.agreement), in one process.

Every member's ballot gets every vote and makes the same decision; the squared norm adds
data-parallel replica 0's shares in rank order, as the scheduler does; a vote is fenced
to the current step or the next, to the mesh, and to one per member. Past
ALL_TO_ALL_MAX members the votes go through the root, and the messages grow with the
mesh, not with its square.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from actors._errors import NotAllowed
from stages.compute.agreement import ALL_TO_ALL_MAX, ROOT, Ballot, decide_votes, vote_of
from stages.compute.tail import decide_step
from stages.mesh import Mesh
from stages.records import ReduceReport, StageReport, TailVote

pytestmark = pytest.mark.timeout(30)


def _vote(grad_sq: float, *, loss: bool = False, gradient: bool = False) -> TailVote:
    return TailVote(nonfinite_loss=loss, nonfinite_gradient=gradient, grad_sq=grad_sq)


def test_the_norm_adds_replica_zeros_shares_in_rank_order() -> None:
    mesh = Mesh(pipeline=2, data=2)  # ranks 0, 1: replica 0; ranks 2, 3: replica 1
    votes = [_vote(0.1), _vote(0.2), _vote(100.0), _vote(100.0)]
    decision = decide_votes(mesh, votes, loss_scale=1.0, fp16=False, scale_at_floor=False, max_norm=0.1)
    assert decision == decide_step(nonfinite_loss=False, nonfinite_gradient=False, grad_sq=0.0 + 0.1 + 0.2,
                                   max_norm=0.1)
    assert decision.apply and decision.clip < 1.0
    assert decision.grad_norm == math.sqrt(0.1 + 0.2)


@pytest.mark.parametrize(("votes", "fp16", "floor", "apply", "overflow"), [
    ([_vote(1.0), _vote(1.0, gradient=True)], False, False, False, False),
    ([_vote(1.0), _vote(1.0, gradient=True)], True, False, False, True),   # fp16: an overflow
    ([_vote(1.0), _vote(1.0, gradient=True)], True, True, False, False),   # at the floor: a real NaN
    ([_vote(1.0, loss=True), _vote(1.0, gradient=True)], True, False, False, False),  # a bad loss is never one
    ([_vote(1.0), _vote(2.0)], True, False, True, False),
])
def test_one_bad_value_anywhere_drops_the_step_everywhere(votes: list[TailVote], fp16: bool, floor: bool,
                                                         apply: bool, overflow: bool) -> None:
    decision = decide_votes(Mesh(pipeline=2), votes, loss_scale=8.0, fp16=fp16, scale_at_floor=floor, max_norm=0.0)
    assert (decision.apply, decision.overflow, decision.unscale) == (apply, overflow, 8.0)


def test_a_vote_says_what_its_stage_saw() -> None:
    assert vote_of(StageReport(status="done", losses=[1.0, float("nan")]), ReduceReport(grad_sq=2.0)) == \
        _vote(2.0, loss=True)
    assert vote_of(StageReport(status="done"), ReduceReport(nonfinite=["0.weight"], grad_sq=float("inf"))) == _vote(
        float("inf"), gradient=True)
    assert vote_of(StageReport(status="done", losses=[3.0, 4.0], items=[5, 7]), ReduceReport()).items == 12.0


def test_a_token_average_divides_by_the_items_of_every_replica_over_the_replicas() -> None:
    # pipeline 2 x data 2: the last stages (ranks 1 and 3) counted 30 and 10 items; tensor rank 0 only.
    mesh = Mesh(pipeline=2, data=2)
    votes = [TailVote(nonfinite_loss=False, nonfinite_gradient=False, grad_sq=4.0 if rank % 2 == 0 else 0.0,
                      items=[0.0, 30.0, 0.0, 10.0][rank]) for rank in range(4)]
    decision = decide_votes(mesh, votes, loss_scale=2.0, fp16=True, scale_at_floor=False, max_norm=0.0,
                            per_item=True)
    assert decision.unscale == 2.0 * 40.0 / 2  # the replicas' average already divided by 2
    assert decision.grad_norm == pytest.approx(2.0 / decision.unscale)
    plain = decide_votes(mesh, votes, loss_scale=2.0, fp16=True, scale_at_floor=False, max_norm=0.0)
    assert plain.unscale == 2.0


async def test_every_member_gathers_every_vote_and_decides_alike() -> None:
    mesh = Mesh(pipeline=3)
    ballots = [Ballot(mesh, rank) for rank in range(3)]
    current = 4

    def sender(to: Ballot):  # type: ignore[no-untyped-def]
        async def send(step: int, rank: int, vote: TailVote) -> None:
            await asyncio.sleep(0)
            to.receive(current, step, rank, vote)
        return send

    for ballot in ballots:
        ballot.connect([sender(other) for other in ballots])
    mine = [_vote(float(rank + 1), gradient=rank == 2) for rank in range(3)]
    gathered = await asyncio.gather(*(ballot.gather(4, vote) for ballot, vote in zip(ballots, mine)))
    assert all(votes == mine for votes in gathered)
    assert all(not ballot._votes for ballot in ballots)  # forgotten once used


async def test_a_vote_that_cannot_reach_one_member_still_reaches_the_others_and_the_failure_is_raised() -> None:
    mesh = Mesh(pipeline=3)
    ballots = [Ballot(mesh, rank) for rank in range(3)]
    reached: list[int] = []

    def sender(to: int):  # type: ignore[no-untyped-def]
        async def send(step: int, rank: int, vote: TailVote) -> None:
            if to == 1:
                raise ConnectionError("member 1 is gone")
            ballots[to].receive(4, step, rank, vote)
            reached.append(to)
        return send

    ballots[0].connect([sender(other) for other in range(3)])
    with pytest.raises(ConnectionError, match="member 1 is gone"):
        await ballots[0].gather(4, _vote(1.0))
    assert reached == [2] and ballots[2]._votes[4][0] == _vote(1.0)


def _connected(mesh: Mesh, current: int, sent: list[str]) -> list[Ballot]:
    """Every member's ballot, each reaching the others' in this process (after a turn of the loop);
    ``sent`` collects one entry per message."""
    ballots = [Ballot(mesh, rank) for rank in range(mesh.size)]

    def vote_to(to: Ballot):  # type: ignore[no-untyped-def]
        async def send(step: int, rank: int, vote: TailVote) -> None:
            sent.append("vote")
            await asyncio.sleep(0)
            to.receive(current, step, rank, vote)
        return send

    def tally_to(to: Ballot):  # type: ignore[no-untyped-def]
        async def send(step: int, votes: list[TailVote]) -> None:
            sent.append("tally")
            await asyncio.sleep(0)
            to.receive_tally(current, step, votes)
        return send

    for ballot in ballots:
        ballot.connect([vote_to(other) for other in ballots],
                       [tally_to(other) for other in ballots] if ballot.through_root else ())
    return ballots


@pytest.mark.parametrize("mesh", [Mesh(pipeline=ALL_TO_ALL_MAX), Mesh(pipeline=2, tensor=2, data=2), Mesh(pipeline=16)],
                         ids=lambda mesh: f"{mesh.size}members")
async def test_a_mesh_past_the_bound_votes_through_the_root_in_messages_that_grow_with_it(mesh: Mesh) -> None:
    sent: list[str] = []
    ballots = _connected(mesh, 4, sent)
    mine = [_vote(float(rank + 1), loss=rank == mesh.size - 1) for rank in range(mesh.size)]
    gathered = await asyncio.gather(*(ballot.gather(4, vote) for ballot, vote in zip(ballots, mine)))
    assert all(votes == mine for votes in gathered)  # every member decides from the same votes, in rank order
    assert all(not ballot._votes for ballot in ballots)
    n = mesh.size
    if n <= ALL_TO_ALL_MAX:
        assert sent == ["vote"] * (n * (n - 1))
    else:  # 14 messages for 8 members, not 56; 30 for 16, not 240
        assert sorted(sent) == ["tally"] * (n - 1) + ["vote"] * (n - 1)


async def test_through_the_root_a_member_takes_only_the_roots_tally_and_the_root_only_votes() -> None:
    mesh = Mesh(pipeline=ALL_TO_ALL_MAX + 1)
    member, root = Ballot(mesh, 1), Ballot(mesh, ROOT)
    assert member.through_root and root.through_root
    with pytest.raises(NotAllowed, match="votes through rank 0; rank 1 takes its tally"):
        member.receive(3, 3, 2, _vote(1.0))
    with pytest.raises(NotAllowed, match="takes votes, not a tally"):
        root.receive_tally(3, 3, [_vote(1.0)] * mesh.size)
    for step, votes, match in [(5, [_vote(1.0)] * mesh.size, "only this step's or the next's"),
                               (3, [_vote(1.0)] * (mesh.size - 1), "a tally of 4 votes for a mesh of 5")]:
        with pytest.raises(NotAllowed, match=match):
            member.receive_tally(3, step, votes)
    member.receive_tally(3, 4, [_vote(1.0)] * mesh.size)  # the next step's: a fast root
    with pytest.raises(NotAllowed, match="a second tally of step 4"):
        member.receive_tally(3, 4, [_vote(2.0)] * mesh.size)
    with pytest.raises(ValueError, match="expected 5 tally senders"):
        root.connect([member.gather] * mesh.size)  # type: ignore[list-item]


def test_votes_are_fenced_to_this_step_or_the_next_to_the_mesh_and_to_one_per_member() -> None:
    ballot = Ballot(Mesh(pipeline=2), 0)
    ballot.receive(3, 4, 1, _vote(1.0))  # the next step: a fast peer
    for step, rank, match in [(2, 1, "only this step's or the next's"), (5, 1, "only this step's or the next's"),
                              (3, 2, "outside a mesh of 2"), (3, -1, "outside a mesh of 2"),
                              (4, 1, "rank 1 voted twice on step 4"), (True, 0, "only this step's")]:
        with pytest.raises(NotAllowed, match=match):
            ballot.receive(3, step, rank, _vote(1.0))
    ballot.receive(5, 5, 1, _vote(1.0))
    assert set(ballot._votes) == {5}  # what an older step left is dropped


async def test_a_poisoned_step_fails_a_gather_short_of_votes_and_not_one_that_has_them_all() -> None:
    """A stream that may have lost a vote poisons the steps it could have been for: a gather that
    still lacks a vote fails at once with the stream's error instead of waiting for ever; one whose
    votes all came is unharmed, and a later step is not poisoned."""
    mesh = Mesh(pipeline=2)
    ballot = Ballot(mesh, 0)
    sent: list[int] = []

    async def send(step: int, rank: int, vote: TailVote) -> None:
        sent.append(step)

    ballot.connect([send, send])
    waiting = asyncio.ensure_future(ballot.gather(4, _vote(1.0)))
    await asyncio.sleep(0)
    ballot.receive(4, 5, 1, _vote(2.0))  # the other member is a step ahead already
    ballot.poison((4, 5), ConnectionError("lost on the way"))
    with pytest.raises(ConnectionError, match="lost on the way"):
        await waiting  # rank 1's vote on step 4 never came
    assert await ballot.gather(5, _vote(1.0)) == [_vote(1.0), _vote(2.0)]  # step 5's had come
    later = asyncio.ensure_future(ballot.gather(6, _vote(1.0)))
    ballot.receive(6, 6, 1, _vote(3.0))
    assert await later == [_vote(1.0), _vote(3.0)]
    assert not ballot._poisoned
