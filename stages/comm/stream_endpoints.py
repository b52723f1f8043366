"""A stage actor's side of its streams (``communication.transport = "stream"``), and of values lost on the way.

Mixed into :class:`~stages.actor.StageActor`, which gives it its config, runtime, parts,
ballot and refusal counting: the ``open_stream`` endpoint another stage actor opens its
session through, the links made when the stage is connected, and what the stage takes
from its stream server (values, as ``deliver`` takes them; votes, as ``vote`` does).
The streams themselves: :mod:`stages.comm.streams` and ``transport.stream``. A value
or vote lost on the way, on a stream or over ZeroMQ (``on_messages_lost``), fails the
step that waits for it at once.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

from actors._actor import Host, current_caller, endpoint
from actors._errors import MessageLost, NotAllowed
from actors._ref import ActorRef
from stages.comm.delivery import VALUE, VOTE, StreamPeer
from stages.comm.streams import StageStreams
from stages.compute.agreement import Ballot
from stages.records import StageConfig
from transport.stream import StreamBroken

__all__ = ["StreamEndpoints"]

log = logging.getLogger(__name__)


class StreamEndpoints:
    """``open_stream``, and the stage's stream ends (``_streams``, made at the first need)."""

    config: StageConfig
    runtime: Host
    refused_calls: int
    ballot: Ballot
    parts: Any
    _step: int
    _in_step: bool  # inside run_step, for step _step
    _lost_in_step: tuple[str, str, type[Exception]] | None  # a loss during it (source, why, kind), for run_step
    _peer_identities: frozenset[str]  # the job's nodes' keys
    _streams: StageStreams | None

    def _parts(self) -> Any:
        raise NotImplementedError  # StageActor's

    def _refusing(self) -> AbstractContextManager[None]:
        raise NotImplementedError  # StageActor's

    def _take_vote(self, step: int, rank: int, vote: Any) -> None:
        raise NotImplementedError  # StageActor's

    @endpoint(concurrent=True, roles=("node",))
    async def open_stream(self, opening: bytes, rank: int) -> str:
        """Stage actor ``rank``'s (global rank) session for its values and votes over a stream
        (``transport="stream"``): answers where the stream server listens.
        NotAllowed: not a stage of this job, or the job sends its values otherwise."""
        with self._refusing():
            if self.config.communication.transport != "stream" or isinstance(rank, bool) or not isinstance(rank, int):
                raise NotAllowed(f"stage {self.config.pipeline_rank} of job {self.config.job} takes no stream "
                                 f"(transport {self.config.communication.transport!r}) from rank {str(rank)[:12]}")
            endpoint_address = self.runtime.address.partition("|")[0]
            return await self._stream_ends().open(endpoint_address, opening, f"{current_caller()}/{rank}")

    def _connect_streams(self) -> StageStreams | None:
        """With ``transport="stream"``, the stage's stream ends with every link closed (it is being
        connected: its links start from new sessions); else None."""
        if self.config.communication.transport != "stream":
            return None
        streams = self._stream_ends()
        streams.reset(self.config.global_rank, encrypt=self.runtime.encrypts)
        return streams

    @staticmethod
    def _stream_peer(streams: StageStreams, ref: ActorRef) -> StreamPeer:
        """The link to the stage actor ``ref`` names (one per actor, for its values and votes alike)."""
        return streams.peer((ref.address, ref.name), ref.endpoint(StreamEndpoints.open_stream).call)

    def _stream_ends(self) -> StageStreams:
        if self._streams is None:
            self._streams = StageStreams(self._take_streamed, max_bytes=self.runtime.max_message_bytes,
                                         lost=self._stream_lost)
        return self._streams

    def _close_streams(self) -> None:
        if self._streams is not None:
            self._streams.close()

    def _take_streamed(self, message: Any) -> None:
        """A message another stage's stream link brought: a value, taken as ``deliver`` takes one,
        or a vote, as ``vote`` takes one; a refusal is counted."""
        try:
            kind = message[0] if isinstance(message, list) and message else None
            if kind == VALUE and len(message) == 7:
                parts = self._parts()
                parts.receiver.deliver(self._step, parts.executor.num_microbatches, *message[1:])
            elif kind == VOTE and len(message) == 4:
                self._take_vote(*message[1:])
            else:
                raise NotAllowed(f"a streamed message is [{VALUE!r}, step, kind, stage, micro-batch, leaves, spec] "
                                 f"or [{VOTE!r}, step, rank, vote]")
        except NotAllowed:
            self.refused_calls += 1
            raise

    def on_messages_lost(self, member: str, why: str) -> None:
        """A message from ``member`` may have been lost over ZeroMQ (the runtime's receiver said so):
        where that is one of this job's nodes and the stage's values or votes travel as actor
        messages (``transport`` other than ``"stream"``, whose losses its streams tell), it may
        have been one this step waits for, which fails now, as for a stream's loss."""
        if self.config.communication.transport != "stream" and member in self._peer_identities:
            self._values_lost(f"the ZeroMQ session from {member}", why, MessageLost)

    def _stream_lost(self, sender: str, why: str) -> None:
        """``sender``'s stream may have lost a message on the way (``StreamServer``'s ``on_lost``)."""
        self._values_lost(f"the stream from {sender}", why)

    def _values_lost(self, source: str, why: str, kind: type[Exception] = StreamBroken) -> None:
        """``source`` (a stream, or a node's messages over ZeroMQ) may have lost a message on the way:
        a value or a vote that will never come, of the step running here, or, between steps, of the
        next one. That step fails where it waits for one that is not in, at once and saying why,
        instead of at the step's timeout; the scheduler then aborts it on every stage, as for any
        failure (a step sent ahead of it goes with it).

        A loss during a step that then ends well was of the next step's (every message of this one
        came): ``run_step`` poisons the next step then. One that ends badly takes the next step's
        with it (a step sent ahead of it runs nothing), and the step after is a new one."""
        if self._in_step:
            self._lost_in_step = (source, why, kind)
        self._poison_lost(self._step if self._in_step else self._step + 1, source, why, kind)

    def _poison_lost(self, step: int, source: str, why: str, kind: type[Exception] = StreamBroken) -> None:
        error = kind(f"{source} may have lost a value or vote of step {step}: {why}")
        log.warning("%s", error)
        if self.parts is not None:
            self.parts.executor.inbox.poison((step,), error)
        self.ballot.poison((step,), error)
