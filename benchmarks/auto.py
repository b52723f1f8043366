# Run: python -m benchmarks.auto            (add --steps 4 --rounds 2 for a quick look)
"""schedule="auto" against every manual schedule, on the reference workload at 2 stages.

Peers, each a ``LocalCluster`` of 2 nodes training the reference workload (docs/design.md),
all up at once and timed in rotated rounds of one step each (``benchmarks.pipeline.run_rounds``), so
that the machine's noise hits every peer alike:
- actorpipe ``schedule="auto"``: its first three (warm-up) steps run zero-bubble and time
  the stages (the second with W batching); the plan then picks a schedule, which the
  timed steps run;
- actorpipe ``gpipe``, ``1f1b`` and ``zero_bubble``, each also with ``w_batching=True``
  (``1f1b_wbatch`` ...: the candidates auto may run), and ``interleaved`` with 2
  virtual stages (which it only advises: it re-partitions).

Reports:
- ``auto_vs_best_manual_2stages``: auto's samples/s over the best manual peer's;
  ``auto_vs_best_runnable_2stages`` the same over the candidates auto may run;
- ``prediction_error_2stages``: the median over auto's timed steps of
  ``|step_time_s - predicted_step_s| / predicted_step_s`` (``StepStats``), and the signed
  median as ``prediction_bias_2stages``;
- ``prediction_error_by_schedule``: for every peer whose schedule the plan predicted, the
  plan's prediction over that peer's median ``StepStats.step_time_s`` (``measured_step_s``),
  minus 1 (how well the simulator ranks the schedules it did not run);
- ``auto_max_rel_diff_vs_chosen``: auto's trained parameters against the manual peer
  of the schedule it chose (every peer trains the same batch the same number of steps).

samples/s is 64 / the driver's median step time. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
from typing import Any

from benchmarks._torch_pipelining import BATCH_SHAPE, NUM_MICROBATCHES
from benchmarks.pipeline import ActorpipePeer, max_rel_diff, run_rounds
from transport.loop import run

BATCH_SIZE = BATCH_SHAPE[0]
# (schedule, virtual stages, W batching)
MANUAL = (("gpipe", None, False), ("1f1b", None, False), ("zero_bubble", None, False), ("gpipe", None, True),
          ("1f1b", None, True), ("zero_bubble", None, True), ("interleaved", 2, False))
RUNNABLE = ("gpipe", "1f1b", "zero_bubble")  # on auto's one-stage-per-rank partition


def peer_name(label: str) -> str:
    """A candidate's label as a peer's name: ``zero_bubble +wbatch`` -> ``zero_bubble_wbatch``."""
    return label.replace(" +", "_").replace(" ", "_")


class RecordingPeer(ActorpipePeer):
    """An :class:`ActorpipePeer` that keeps every step's ``StepStats`` (and, after the run, the plan)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stats: list[Any] = []
        self.plan: Any = None

    async def run(self, num_steps: int) -> list[float]:
        times: list[float] = []
        for _ in range(num_steps):
            times += await super().run(1)
            self.stats.append(self.last_stats)
        return times

    async def finish(self) -> list[int]:
        self.plan = await self.job.plan()
        return await super().finish()


def make_peers() -> list[RecordingPeer]:
    peers = [RecordingPeer(num_stages=2, schedule="auto", name="auto")]
    for schedule, virtual, batched in MANUAL:
        options: dict[str, Any] = {"virtual_stages": virtual} if virtual else {}
        if batched:
            options["w_batching"] = True
        name = peer_name(schedule + (f" x{virtual}" if virtual else "") + (" +wbatch" if batched else ""))
        peers.append(RecordingPeer(num_stages=2, schedule=schedule, name=name, options=options))
    return peers


def samples_per_s(times: list[float]) -> float:
    return BATCH_SIZE / statistics.median(times)


def summarize(peers: list[RecordingPeer], times: dict[str, list[float]], warmup: int) -> dict[str, Any]:
    auto, manual = peers[0], peers[1:]
    rate = {peer.name: samples_per_s(times[peer.name]) for peer in peers}
    best = max(manual, key=lambda p: rate[p.name])
    best_runnable = max((p for p in manual if p.schedule in RUNNABLE), key=lambda p: rate[p.name])
    timed = auto.stats[warmup:]
    errors = [s.prediction_error for s in timed if s.prediction_error is not None]
    plan = auto.plan
    chosen = peer_name(plan.chosen) if plan is not None and plan.chosen else None
    predicted = {peer_name(c.label): c.predicted_step_s for c in plan.candidates} if plan else {}
    measured = {peer.name: statistics.median(s.step_time_s for s in peer.stats[warmup:]) for peer in peers}
    by_schedule = {peer.name: round(predicted[peer.name] / measured[peer.name] - 1, 3)
                   for peer in manual if peer.name in predicted}
    chosen_peer = next((p for p in manual if p.name == chosen), None)
    auto_state, chosen_state = auto.trained_state(), chosen_peer.trained_state() if chosen_peer else None
    return {
        "auto_vs_best_manual_2stages": round(rate["auto"] / rate[best.name], 3),
        "auto_vs_best_runnable_2stages": round(rate["auto"] / rate[best_runnable.name], 3),
        "prediction_error_2stages": round(statistics.median(abs(e) for e in errors), 3) if errors else None,
        "prediction_bias_2stages": round(statistics.median(errors), 3) if errors else None,
        "prediction_error_by_schedule": by_schedule,
        "auto_chose": chosen,
        "auto_ran": sorted({s.schedule for s in timed}),
        "best_manual": best.name,
        "plan_predicted_step_s": {k: round(v, 4) for k, v in predicted.items()},
        "measured_step_s": {k: round(v, 4) for k, v in measured.items()},  # StepStats.step_time_s, median
        "samples_per_s": {name: round(value, 2) for name, value in rate.items()},
        "median_step_ms": {peer.name: round(statistics.median(times[peer.name]) * 1e3, 1) for peer in peers},
        "auto_max_rel_diff_vs_chosen": float(f"{max_rel_diff(auto_state, chosen_state):.2g}")
        if auto_state is not None and chosen_state is not None else None,
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    peers = make_peers()
    async with contextlib.AsyncExitStack() as stack:
        for peer in peers:
            stack.push_async_callback(peer.aclose)
            print(f"starting {peer.name}", flush=True)
            await peer.start()
        times = await run_rounds(peers, warmup=args.warmup, steps=args.steps, rounds=args.rounds)
        for peer in peers:
            await peer.finish()
        summary = summarize(peers, times, args.warmup)  # before the peers close: they drop their trained state
    print()
    plan = peers[0].plan
    for c in plan.candidates if plan is not None else []:
        print(f"{'*' if c.chosen else ' '} {c.label:<16} predicted {c.predicted_step_s * 1e3:8.1f} ms"
              + ("" if c.runnable else "  (advice: re-partitions)"))
    print(f"\n{'peer':<16} {'samples/s':>9} {'median ms':>9}")
    for peer in peers:
        print(f"{peer.name:<16} {summary['samples_per_s'][peer.name]:>9.1f} {summary['median_step_ms'][peer.name]:>9.1f}")
    print()
    for key in ("auto_vs_best_manual_2stages", "auto_vs_best_runnable_2stages", "prediction_error_2stages",
                "prediction_bias_2stages"):
        print(f"{key:<32} {summary[key]}")
    return summary


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="timed steps per peer")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps per peer first (auto plans after its third)")
    parser.add_argument("--rounds", type=int, default=16, help="rotated rounds the timed steps are split into")
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1 or args.warmup < 3:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 3 (auto's probe steps)")
    return args


def main() -> None:
    args = parse_args()
    summary = run(measure(args))
    print(json.dumps({"workload": f"reference, 2 stages, {NUM_MICROBATCHES} micro-batches", **summary}))


if __name__ == "__main__":
    main()
