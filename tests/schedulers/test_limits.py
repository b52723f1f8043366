"""Tests for schedulers/limits.py: the operator's limits, parsed and checked before any work."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors import LimitExceeded
from schedulers import JobSpec
from schedulers.limits import Limits, check_client, check_spec, off_loop, parse_limits

SPEC = {"model": "examples.models:residual_mlp", "pipeline_stages": 2, "micro_batches": 4}


def test_limits_parse_from_the_command_line_and_none_lifts_one() -> None:
    limits = parse_limits(["micro_batches=8", "parameters=1e9", "jobs_per_client=none"])
    assert (limits.micro_batches, limits.parameters, limits.jobs_per_client) == (8, 1e9, None)
    assert limits.threads_per_stage == Limits().threads_per_stage  # the rest keep their defaults
    assert parse_limits({"max_restarts": 3}).max_restarts == 3


@pytest.mark.parametrize(("items", "message"), [
    (["micro_batch=8"], "unknown limit 'micro_batch'; limits: micro_batches"),
    (["micro_batches"], "NAME=VALUE"),
    (["micro_batches=many"], "not a number"),
    (["micro_batches=0"], "must be a positive number"),
    (["step_timeout_s=inf"], "must be a positive number"),
])
def test_a_bad_limit_is_refused_naming_it(items: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_limits(items)


@pytest.mark.parametrize(("change", "limit"), [
    ({"micro_batches": 9}, "micro_batches"),
    ({"schedule": "interleaved", "virtual_stages": 4}, "scheduled_actions"),
    ({"threads_per_stage": 65}, "threads_per_stage"),
    ({"step_timeout_s": 3601}, "step_timeout_s"),
    ({"max_restarts": 4}, "max_restarts"),
])
def test_a_spec_past_a_limit_names_it(change: dict[str, object], limit: str) -> None:
    limits = Limits(micro_batches=8, scheduled_actions=2 * 2 * 4 * 3, threads_per_stage=64, step_timeout_s=3600,
                    max_restarts=3)
    check_spec(JobSpec.of(**SPEC), limits)  # within every limit
    with pytest.raises(LimitExceeded, match=f"limit {limit}=") as caught:
        check_spec(JobSpec.of(**SPEC).replace(**change), limits)
    assert caught.value.limit == limit and caught.value.value is not None


async def test_work_off_the_loop_keeps_the_loop_turning_and_is_bounded() -> None:
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.ensure_future(tick())
    try:
        assert await off_loop(sum, range(10), timeout_s=10, what="adding") == 45
        with pytest.raises(LimitExceeded, match="waiting took more than 0.2s"):
            await off_loop(time.sleep, 1.0, timeout_s=0.2, what="waiting")
        assert ticks > 1  # the loop went on while the thread slept
    finally:
        ticker.cancel()


def test_a_client_is_bounded_in_jobs_and_nodes_it_holds() -> None:
    limits = Limits(jobs_per_client=3, nodes_per_client=4)
    check_client(limits, "client:alice", [["n0", "n1"]], 2)  # 2 jobs, 4 nodes: at both limits
    with pytest.raises(LimitExceeded, match="limit nodes_per_client=4") as caught:
        check_client(limits, "client:alice", [["n0", "n1"]], 3)
    assert caught.value.value == 5
    with pytest.raises(LimitExceeded, match="the open jobs of client:alice, with this one, is 4"):
        check_client(limits, "client:alice", [["n0"], ["n1"], ["n2"]], 1)
