"""When a stage's compute action may run on the event loop's thread instead of its compute thread.

A stage actor computes on one worker thread so that a long forward never keeps its
event loop from answering heartbeats and receiving neighbours' values. Handing an
action to that thread and back costs two thread wake-ups and a loop wake-up (50-70 µs
on a busy two-core machine), and while the thread computes, the loop's own Python
work passes the GIL back and forth with it; for a model whose actions take well
under a millisecond that is much of the step (``benchmarks.overhead``).
So an action that is *known* to be short runs inline, on the loop's thread, and every
other one on the compute thread as before.

"Known short" is learnt per kind of action (the executor's key: action kind, model
stage and whatever else splits a kind into runs of different cost), from the wall
time of its earlier runs, wherever they ran:

- the first :data:`WARMUP_RUNS` runs of a kind go to the thread (the first pays for
  lazy initialisation and says nothing about the rest);
- a kind whose smoothed estimate is under :data:`INLINE_MAX_S` may run inline;
- an inline run that took longer than :data:`DEMOTE_S` (its shapes grew, it hit a
  slow path, it synchronised with a device) sends its kind back to the thread for
  :data:`BAN_RUNS` runs, twice as many after each further long run, so that a kind
  that is sometimes long cannot block the loop often; :data:`CLEAN_RUNS` inline runs
  in a row without a long one forgive the earlier ones (a busy machine that
  pre-empted a short action is not the action's fault).

:class:`InlinePolicy` is that bookkeeping alone (no clock, no threads); the
:class:`ComputeDispatcher` times the runs and adds the other conditions: the compute
thread is idle (the loop and the thread never touch the model at once), the loop's
thread computes with the compute thread's torch settings, and back-to-back inline
runs still give the loop a turn every :data:`YIELD_AFTER_S`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from actors._errors import contained

__all__ = ["BAN_RUNS", "CLEAN_RUNS", "DEMOTE_S", "INLINE_MAX_S", "WARMUP_RUNS", "YIELD_AFTER_S",
           "ComputeDispatcher", "InlinePolicy"]

T = TypeVar("T")

# An action estimated under this runs inline. Measured on a busy two-core machine, the
# actions of benchmarks.overhead's near-empty model take 0.2-0.6 ms each (Python: the
# fused linears' autograd functions, the saved-activation accounting, boundary packing),
# so a bound of 0.1-0.2 ms would leave exactly the actions this is for on the thread.
# Below a millisecond an action is mostly Python holding the GIL, which the compute
# thread could not overlap with the loop's own Python work anyway (the two would pass
# the GIL back and forth instead); what the loop does meanwhile (a delivery, a
# heartbeat) waits at most this long, 2000x under the heartbeat budget.
INLINE_MAX_S = 1e-3
# An inline run longer than this demotes its kind: 10x the inline bound (a loaded
# machine's scheduling noise mostly stays under it) and 200x under the 2 s heartbeat budget.
DEMOTE_S = 10e-3
WARMUP_RUNS = 2
BAN_RUNS = 32  # thread runs after the first demotion; doubles with each further one
CLEAN_RUNS = 1024  # inline runs in a row without a long one, after which demotions are forgiven
SMOOTHING = 0.25  # weight of the newest run in the estimate
# Inline runs back to back never give the loop a turn (an arrived value is taken without
# one); after this much inline compute the dispatcher yields once, so that heartbeats and
# neighbours' messages wait at most about this long.
YIELD_AFTER_S = 2e-3


@dataclass(slots=True)
class _Kind:
    runs: int = 0
    estimate_s: float = 0.0
    demotions: int = 0
    banned_runs: int = 0  # thread runs still owed for the last demotion
    clean_runs: int = 0  # inline runs since the last long one


class InlinePolicy:
    """Learns per kind of action how long it takes, and says when it may run inline.

    Args:
        max_s: the estimate under which a kind runs inline (0 turns the fast path off).
        demote_s: an inline run longer than this sends its kind back to the thread.
        warmup_runs: runs of a kind that go to the thread before it may run inline.
        ban_runs: thread runs a first demotion costs (doubling with each further one).
        clean_runs: inline runs in a row, none long, after which demotions are forgiven.

    Raises:
        ValueError: a negative bound or count.
    """

    def __init__(self, *, max_s: float = INLINE_MAX_S, demote_s: float = DEMOTE_S, warmup_runs: int = WARMUP_RUNS,
                 ban_runs: int = BAN_RUNS, clean_runs: int = CLEAN_RUNS) -> None:
        if min(max_s, demote_s, warmup_runs, ban_runs, clean_runs) < 0:
            raise ValueError(f"inline policy bounds must be >= 0, got max_s={max_s}, demote_s={demote_s}, "
                             f"warmup_runs={warmup_runs}, ban_runs={ban_runs}, clean_runs={clean_runs}")
        self.max_s = max_s
        self.demote_s = demote_s
        self.warmup_runs = warmup_runs
        self.ban_runs = ban_runs
        self.clean_runs = clean_runs
        self._kinds: dict[Hashable, _Kind] = {}
        self.inline_runs = 0  # for tests and the stage's progress
        self.thread_runs = 0
        self.demotions = 0

    def inline(self, key: Hashable) -> bool:
        """Whether the next run of ``key`` may run inline (if the compute thread is idle)."""
        kind = self._kinds.get(key)
        return (kind is not None and kind.runs >= self.warmup_runs and kind.banned_runs == 0
                and kind.estimate_s < self.max_s)

    def record(self, key: Hashable, seconds: float, *, inline: bool) -> None:
        """Notes that a run of ``key`` took ``seconds`` (wall time of the function alone)."""
        kind = self._kinds.setdefault(key, _Kind())
        if kind.runs < max(1, self.warmup_runs):
            kind.estimate_s = seconds  # the last warm-up run's, not the first's lazy initialisation
        else:
            kind.estimate_s += SMOOTHING * (seconds - kind.estimate_s)
        kind.runs += 1
        if not inline:
            self.thread_runs += 1
            kind.banned_runs = max(0, kind.banned_runs - 1)
            return
        self.inline_runs += 1
        if seconds <= self.demote_s:
            kind.clean_runs += 1
            if kind.clean_runs >= self.clean_runs:
                kind.demotions = 0
            return
        kind.banned_runs = self.ban_runs << min(kind.demotions, 20)
        kind.demotions += 1
        kind.clean_runs = 0
        self.demotions += 1

    def estimate(self, key: Hashable) -> float | None:
        """The smoothed seconds a run of ``key`` takes; None before its first run."""
        kind = self._kinds.get(key)
        return None if kind is None else kind.estimate_s


class ComputeDispatcher:
    """Runs a stage's compute on its one compute thread, or inline where the policy allows.

    Args:
        thread: the one-worker pool; submissions run in order.
        policy: what says which kinds are short.
        device: the stage's device (an inline run on CUDA makes it current on the loop's thread).
    """

    def __init__(self, thread: ThreadPoolExecutor, policy: InlinePolicy, device: torch.device) -> None:
        self.policy = policy
        self._thread = thread
        self._device = device
        self._cuda = device.type == "cuda"
        # The thread is idle once it has finished all it was given: each count has one writer (the
        # loop's thread submits, the compute thread finishes), so comparing them needs no lock.
        self._submitted = 0
        self._finished = 0
        self._thread_num_threads: int | None = None  # torch's intra-op threads on the compute thread
        self._unyielded_s = 0.0  # inline compute since the loop last had a turn

    async def submit(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the compute thread."""
        future = self._thread.submit(self._counted, fn, args)
        self._submitted += 1
        self._unyielded_s = 0.0  # awaiting it gives the loop its turn
        try:
            return await asyncio.wrap_future(future)
        finally:
            if future.cancelled():  # taken back before it ran (the caller was cancelled): it never will
                self._finished += 1

    async def run(self, key: Hashable, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a run of kind ``key``: inline if it is known short and the thread is idle,
        else on the compute thread; timed either way, for the policy."""
        # Inline only once a run on the thread has shown the thread's torch settings to copy.
        if self.policy.inline(key) and self._thread_idle() and self._thread_num_threads is not None:
            value = self._run_inline(key, fn, args)
            if self._unyielded_s > YIELD_AFTER_S:
                self._unyielded_s = 0.0
                await asyncio.sleep(0)
            return value
        timed = _Timed(fn, args)
        value = await self.submit(timed)
        self._thread_num_threads = timed.num_threads
        self.policy.record(key, timed.seconds, inline=False)
        return value

    def _counted(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        try:
            return contained(fn, *args)  # a job's sys.exit must not end the node
        finally:
            self._finished += 1

    def _thread_idle(self) -> bool:
        # One worker runs submissions in order: once the last has finished (or was taken back), all have.
        return self._finished == self._submitted

    def _run_inline(self, key: Hashable, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        # torch.set_num_threads is per thread (OpenMP): a stage's threads_per_stage was set on
        # the compute thread, and a reduction split over another thread count sums in another order.
        if torch.get_num_threads() != self._thread_num_threads:
            assert self._thread_num_threads is not None
            torch.set_num_threads(self._thread_num_threads)
        start = time.perf_counter()
        try:
            if self._cuda:  # the current CUDA device is per thread too
                with torch.cuda.device(self._device):
                    return contained(fn, *args)
            return contained(fn, *args)
        finally:
            seconds = time.perf_counter() - start
            self._unyielded_s += seconds
            self.policy.record(key, seconds, inline=True)


class _Timed:
    """``fn(*args)`` for the compute thread, noting its wall time and the thread's torch settings."""

    __slots__ = ("args", "fn", "num_threads", "seconds")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.seconds = 0.0
        self.num_threads: int | None = None

    def __call__(self) -> Any:
        self.num_threads = torch.get_num_threads()
        start = time.perf_counter()
        try:
            return self.fn(*self.args)
        finally:
            self.seconds = time.perf_counter() - start
