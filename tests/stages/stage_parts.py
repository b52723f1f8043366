"""A pipeline of stages assembled from their parts in one process, as the stage actor assembles them.

Each rank is :func:`~stages.build.stage.build_stage`'s result, a StepExecutor, a Sender
whose neighbours' ``deliver`` puts what the wire delivers (``transport.wire``'s encoding,
as bytes, and its decoding) into the peer's Receiver, a StepTail
whose tied sums go to the peer's TiedSync, and a StageState. :meth:`InProcessPipeline.step`
runs one step as the scheduler drives it: every rank to its barrier, then every rank's
reduction, one decision from the reports (:func:`~stages.compute.tail.decide_step`),
then every rank's finish. No actors, no sockets, no node processes.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from actors._registry import DEFAULT_ALLOW, EXAMPLE_FACTORIES
from schedulers.schedules import build_schedule
from stages.actor import inbox_limit
from stages.build.stage import BuiltStage, build_stage
from stages.comm.delivery import PeerEndpoints, Receiver, Sender
from stages.comm.device_io import DeviceIO
from stages.compute.executor import Inbox, StepExecutor, StepTrace
from stages.compute.tail import StepDecision, StepTail, decide_step
from stages.program import Action
from stages.records import FinishReport, ReduceReport, StageConfig
from stages.sections import FIELDS, SECTIONS
from stages.state.stage_state import StageState
from transport.wire import decode_message, encode_message

MODEL_KWARGS = {"blocks": 4, "dim": 8, "hidden": 16}


def stage_config(rank: int, num_ranks: int = 2, **overrides: Any) -> StageConfig:
    """Rank ``rank``'s config for ``examples.models:residual_mlp`` cut in ``num_ranks`` even stages.

    ``overrides`` are spec fields by their flat names (routed to their sections), or ``bounds``.
    Every ``nn.Linear`` is fused (``fusion_min_weight_elements=0``) unless an override says otherwise:
    these small layers would otherwise keep plain autograd, and the fused path is what most tests here test.
    """
    model_kwargs = overrides.pop("model_kwargs", dict(MODEL_KWARGS))
    blocks = int(model_kwargs.get("blocks", 0))
    cuts = [round(i * blocks / num_ranks) for i in range(num_ranks + 1)]  # unless overrides give bounds
    bounds = overrides.pop("bounds", [[cuts[i], cuts[i + 1]] for i in range(num_ranks)])
    fields: dict[str, Any] = {
        "model": "examples.models:residual_mlp", "model_kwargs": model_kwargs, "pipeline_stages": num_ranks,
        "optimizer": ("torch.optim:SGD", {"lr": 0.05, "momentum": 0.9}), "micro_batches": 2,
        "threads_per_stage": None, "keep_freed_memory": False, "fusion_min_weight_elements": 0, **overrides,
    }
    sections: dict[str, dict[str, Any]] = {}
    for name, value in fields.items():
        sections.setdefault(FIELDS[name], {})[name] = value
    sections.pop("fault_tolerance", None)
    return StageConfig(job="test", global_rank=rank, bounds=bounds,
                       **{name: SECTIONS[name](**values) for name, values in sections.items()})


@dataclass
class Rank:
    """One rank's parts, as StageActor.on_start puts them together."""

    config: StageConfig
    built: BuiltStage
    executor: StepExecutor
    sender: Sender
    receiver: Receiver
    tail: StepTail
    state: StageState
    step: int = -1
    received: list[tuple[int, str, int, int]] = field(default_factory=list)


@dataclass
class StepResult:
    traces: list[StepTrace]
    reduced: list[ReduceReport]
    decision: StepDecision
    finished: list[FinishReport]

    @property
    def loss(self) -> float:
        losses = [loss for trace in self.traces for loss in trace.losses.values()]
        return sum(losses) / len(losses)


class InProcessPipeline:
    """One rank per config, wired in memory (see the module docstring)."""

    def __init__(self, configs: list[StageConfig], schedule: str = "1f1b") -> None:
        self.configs = configs
        self.programs = build_schedule(schedule, len(configs), configs[0].micro_batches)
        self.ranks: list[Rank] = []
        self._threads: list[ThreadPoolExecutor] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        for config in configs:
            self.ranks.append(self._assemble(config))
        for rank in self.ranks:
            rank.sender.peers[:] = [PeerEndpoints(deliver=self._deliver_to(r), deliver_header=self._no_header)
                                    for r in range(len(configs))]

    def _assemble(self, config: StageConfig) -> Rank:
        device = torch.device("cpu")
        built = build_stage(config, DEFAULT_ALLOW + EXAMPLE_FACTORIES, device)
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rank{config.pipeline_rank}-compute")
        self._threads.append(thread)
        io = DeviceIO(device)
        sender = Sender(config, lambda fn, *args: executor.compute(fn, *args), io)
        executor = StepExecutor(built.model, Inbox(inbox_limit(config, config.micro_batches)), sender.send,
                                config.micro_batches, thread, overlap=built.overlap, io=io)
        receiver = Receiver(config, executor.inbox, self._spawn)
        tail = StepTail(config, built, executor, None, self._send_tied_from(config.pipeline_rank),
                        on_drop=sender.forget_feedback)
        state = StageState(built, executor, pipeline_rank=config.pipeline_rank,
                           pipeline_stages=config.pipeline_stages, job=config.job)
        return Rank(config, built, executor, sender, receiver, tail, state)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _deliver_to(self, target: int) -> Any:
        async def deliver(step: int, kind: str, stage: int, microbatch: int, leaves: list[torch.Tensor],
                          spec: Any) -> int:
            rank = self.ranks[target]
            rank.received.append((step, kind, stage, microbatch))
            # Through the wire's own encoding and decoding, as bytes a peer would receive.
            frames = [bytes(memoryview(frame)) for frame in encode_message(leaves)]  # type: ignore[arg-type]
            rank.receiver.deliver(rank.step, rank.executor.num_microbatches, step, kind, stage, microbatch,
                                  decode_message(frames), spec)
            return sum(len(frame) for frame in frames[1:])
        return deliver

    async def _no_header(self, *args: Any) -> int:
        raise AssertionError("transport='dist' is not wired in process")

    def _send_tied_from(self, source: int) -> Any:
        async def send(rank: int, step: int, name: str, grad: torch.Tensor) -> None:
            peer = self.ranks[rank]
            peer.built.tied.receive(step, peer.step, name, source, grad.clone())
        return send

    def program(self, rank: int) -> list[Action]:
        return list(self.programs[rank])

    async def step(self, step: int, x: torch.Tensor, y: torch.Tensor, *, max_norm: float = 0.0) -> StepResult:
        """One step as the scheduler drives it (run to the barrier, reduce, decide, finish)."""
        m, last = self.configs[0].micro_batches, len(self.ranks) - 1
        inputs, targets = list(x.chunk(m)), list(y.chunk(m))
        async with asyncio.timeout(20):  # a deadlock fails with a message, not the suite's timeout
            for r, rank in enumerate(self.ranks):
                rank.step = step
                await rank.executor.begin(self.program(r))
            traces = await asyncio.gather(*(
                rank.executor.run(step, self.program(r), inputs if r == 0 else None, targets if r == last else None)
                for r, rank in enumerate(self.ranks)))
            reduced = await asyncio.gather(*(rank.tail.reduce(step, self.program(r))
                                             for r, rank in enumerate(self.ranks)))
            decision = decide_step(
                nonfinite_loss=any(not math.isfinite(v) for t in traces for v in t.losses.values()),
                nonfinite_gradient=any(r.nonfinite for r in reduced), grad_sq=sum(r.grad_sq for r in reduced),
                max_norm=max_norm)
            finished = await asyncio.gather(*(
                rank.tail.finish(self.program(r), apply=decision.apply, unscale=decision.unscale, clip=decision.clip)
                for r, rank in enumerate(self.ranks)))
        return StepResult(list(traces), list(reduced), decision, list(finished))

    def state(self) -> dict[str, torch.Tensor]:
        """The whole model's state, every rank's share under the whole model's keys."""
        whole: dict[str, torch.Tensor] = {}
        for rank in self.ranks:
            for i, layer in rank.built.held.items():
                whole.update({rank.built.key(i, k): v for k, v in layer.state_dict().items()})
        return whole

    def close(self) -> None:
        for rank in self.ranks:
            rank.executor.close()
        for thread in self._threads:
            thread.shutdown(wait=True)  # no compute thread outlives the test
