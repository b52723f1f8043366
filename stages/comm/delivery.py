"""Moving one stage's boundary values: sending them to its pipeline neighbours, and taking theirs in.

:class:`Sender` encodes a value's tensors with the boundary's codec (with error feedback
on lossy gradient boundaries), and sends them to the neighbour as an actor message, or,
with ``transport="dist"``, posts them on the torch.distributed link and sends only the
header. :class:`Receiver` checks every delivery before anything of it is kept — a slot
this stage's programs have, in the current or next step, a well-formed value — and puts
it in the executor's inbox (with the link: posts the matching receive first).

Neither knows the actor: the neighbours' endpoints come in as typed callables
(:class:`PeerEndpoints`, made once at connect), and a refusal is a
:class:`~actors._errors.NotAllowed` the actor counts. With ``transport="stream"`` a
neighbour's ``deliver`` is a :class:`StreamPeer`'s: the same message, written by this
loop to a sealed stream the neighbour's loop reads (``transport.stream``), not an actor
message through ZeroMQ's I/O threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import torch

from actors._errors import NotAllowed
from stages.comm import boundary
from stages.comm.boundary import Payload
from stages.comm.device_io import DeviceIO
from stages.comm.p2p import DistLink
from stages.compute.executor import Inbox
from stages.mesh import Coords
from stages.program import Action, ActionKind
from stages.records import StageConfig
from transport.codecs import Encoded, ErrorFeedback, get_codec
from transport.sealed import SessionKey
from transport.stream import StreamBroken, StreamLink
from transport.wire import encode_message

__all__ = ["VALUE", "VOTE", "Compute", "DeliverHeaderTell", "DeliverTell", "PeerEndpoints", "Receiver", "Sender",
           "StreamPeer", "check_codecs"]

Key = tuple[int, str, int, int]  # step, kind ("F" or "B"), stage, micro-batch
Compute = Callable[..., Awaitable[Any]]  # runs fn(*args) on the stage's compute thread
# A neighbour's deliver / deliver_header endpoint, sent without waiting; returns the bytes sent.
DeliverTell = Callable[[int, str, int, int, list[torch.Tensor], Any], Awaitable[int]]
DeliverHeaderTell = Callable[[int, str, int, int, dict[str, Any]], Awaitable[int]]
# Another stage actor's open_stream endpoint: takes a session's opening and this stage actor's global
# rank, answers where its stream server listens.
OpenStream = Callable[[bytes, int], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class PeerEndpoints:
    """One pipeline rank's delivery endpoints, made once when the stage learns its peers."""

    deliver: DeliverTell
    deliver_header: DeliverHeaderTell


VALUE, VOTE = "value", "vote"  # what a streamed message is: its first item


class StreamPeer:
    """Another stage actor of the job, reached over a :class:`~transport.stream.StreamLink`
    (``transport="stream"``): its ``deliver`` for this stage's values, its ``vote`` for the tail's.

    The link opens at the first message: a fresh session key goes to the member in an actor
    call (its ``open_stream``, over CURVE on a secure cluster), which answers where to
    connect. A closed link fails the send that finds it closed with
    :class:`~transport.stream.StreamBroken` (and that send's step); the next send opens a
    fresh session, as does every link when the stage is connected again.

    Args:
        open_stream: the member's ``open_stream`` endpoint.
        rank: this (sending) stage actor's global rank: a member keeps one session per sender.
        encrypt: seal with AES-GCM (a secure cluster), else only authenticate (GMAC).
    """

    def __init__(self, open_stream: OpenStream, rank: int, *, encrypt: bool) -> None:
        self._open_stream = open_stream
        self._rank = rank
        self._encrypt = encrypt
        self._link: StreamLink | None = None
        self._opening = asyncio.Lock()
        self._closed = False

    async def deliver(self, step: int, kind: str, stage: int, microbatch: int, leaves: list[torch.Tensor],
                      spec: Any) -> int:
        """A :data:`DeliverTell`: one boundary value for the member's ``stage``."""
        return await self.send([VALUE, step, kind, stage, microbatch, leaves, spec])

    async def vote(self, step: int, rank: int, vote: Any) -> int:
        """A :data:`~stages.compute.agreement.SendVote`: stage actor ``rank``'s vote on ``step``."""
        return await self.send([VOTE, step, rank, vote])

    async def send(self, message: list[Any]) -> int:
        """Sends ``message`` (opening the link first if need be); returns the bytes put on the wire.

        Raises:
            StreamBroken: the link closed (the member is gone, or refused what came); this
                send's step fails with it, and the next send opens a fresh session.
        """
        link = self._link if self._link is not None else await self._open()
        try:
            return await link.send(encode_message(message))
        except StreamBroken:
            if self._link is link:
                self._link = None
                link.close()
            raise

    async def _open(self) -> StreamLink:
        async with self._opening:
            if self._link is None:
                key = SessionKey.new(encrypt=self._encrypt)
                link = await StreamLink.connect(await self._open_stream(key.open_message(), self._rank), key)
                if self._closed:  # connected again meanwhile: this link belongs to no one
                    link.close()
                    raise StreamBroken("the stage was connected to its peers again while this link opened")
                self._link = link
            return self._link

    def close(self) -> None:
        self._closed = True
        if self._link is not None:
            self._link.close()
            self._link = None


def check_codecs(config: StageConfig, activation_codec: list[str], gradient_codec: list[str]) -> None:
    """Raises ValueError unless each list names one known codec per stage boundary."""
    edges = config.num_stages - 1
    for codecs in (activation_codec, gradient_codec):
        if len(codecs) != edges:
            raise ValueError(f"expected one codec per boundary ({edges}), got {codecs}")
        for codec in codecs:
            get_codec(codec)  # fail now, not mid-step


class Sender:
    """Sends this stage's activations and input gradients to the neighbouring stages.

    Args:
        config: the stage's config: its codecs, ranks and mesh.
        compute: runs encoding on the compute thread (the executor's, so a short one runs inline).
        io: copies device tensors to host buffers for the wire.
        link: the torch.distributed link with ``transport="dist"``, else None.
    """

    def __init__(self, config: StageConfig, compute: Compute, io: DeviceIO, link: DistLink | None = None) -> None:
        check_codecs(config, list(config.activation_codec), list(config.gradient_codec))
        self.config = config
        self.mesh = config.mesh
        self.compute = compute
        self.io = io
        self.link = link
        self.peers: list[PeerEndpoints] = []  # by pipeline rank (see StageActor.connect)
        self.codecs = {"F": list(config.activation_codec), "B": list(config.gradient_codec)}
        # Gradient error feedback: one residual per boundary and micro-batch slot.
        self.feedback = {edge: ErrorFeedback(codec) for edge, codec in enumerate(self.codecs["B"])}
        self.edge_stats: dict[str, dict[str, Any]] = {}  # this step's, per edge and direction

    def set_codecs(self, activation_codec: list[str], gradient_codec: list[str]) -> None:
        """Changes the boundaries' codecs; a gradient boundary whose codec changes starts its feedback afresh.

        Raises:
            ValueError: not one known codec per boundary; nothing changed.
        """
        check_codecs(self.config, activation_codec, gradient_codec)
        for edge, codec in enumerate(gradient_codec):
            if codec != self.codecs["B"][edge]:
                self.feedback[edge] = ErrorFeedback(codec)
        self.codecs = {"F": list(activation_codec), "B": list(gradient_codec)}

    def forget_feedback(self) -> None:
        """Drops every residual (a dropped step's hold NaN, which would poison every later step)."""
        self.feedback = {edge: ErrorFeedback(codec) for edge, codec in enumerate(self.codecs["B"])}

    async def send(self, step: int, action: Action, value: Payload) -> int:
        """Sends ``value`` to the stage a SEND_F or SEND_B action names; returns the bytes put on the wire."""
        cfg = self.config
        forward = action.kind is ActionKind.SEND_F
        target_stage = action.stage + 1 if forward else action.stage - 1
        edge = min(action.stage, target_stage)
        tag = "F" if forward else "B"
        codec = self.codecs[tag][edge]
        assert action.microbatch is not None
        leaves: list[Any] = list(value.leaves)
        sq_err = 0.0
        if codec != "none" and any(t.is_floating_point() for t in leaves):
            # Quantize on the compute thread: the loop stays free to receive.
            leaves, sq_err = await self.compute(self.encode, forward, edge, action.microbatch, value.leaves, codec)
        target_rank = cfg.rank_of(target_stage)
        peer = self.peers[target_rank]
        if self.link is None:
            # On a GPU: the (encoded) tensors are copied to pinned host buffers on the copy stream while
            # compute goes on; only this send waits for the copy, on a thread of its own.
            host = self.io.to_host(leaves)
            await self.io.wait(host.event)
            nbytes = await peer.deliver(step, tag, target_stage, action.microbatch, host.values, value.spec)
        else:
            none = get_codec("none")
            encoded = [leaf if isinstance(leaf, Encoded) else none.encode(leaf) for leaf in leaves]
            me = self.mesh.coords(cfg.global_rank)
            dst = self.mesh.rank(Coords(me.data, target_rank, me.tensor))
            header = self.link.send(encoded, dst, step, tag, target_stage, action.microbatch)
            header["spec"] = value.spec
            nbytes = sum(e.nbytes for e in encoded) + await peer.deliver_header(
                step, tag, target_stage, action.microbatch, header)
        self._count(f"{tag} {action.stage}->{target_stage}", codec, nbytes, value, sq_err)
        return nbytes

    def _count(self, name: str, codec: str, nbytes: int, value: Payload, sq_err: float) -> None:
        stats = self.edge_stats.setdefault(name, {"codec": codec, "bytes": 0, "raw_bytes": 0,
                                                  "sq_err": 0.0, "sq_norm": 0.0})
        stats["bytes"] += nbytes
        stats["raw_bytes"] += value.nbytes
        stats["sq_err"] += sq_err
        if codec != "none" and self.config.communication.measure_codec_error:
            stats["sq_norm"] += sum(float(t.double().pow(2).sum()) for t in value.leaves if t.is_floating_point())

    def encode(self, forward: bool, edge: int, microbatch: int, leaves: list[torch.Tensor],
               codec: str) -> tuple[list[Any], float]:
        """Encodes one value's floating-point tensors for the wire (others travel exact); returns
        them and their squared error (0 unless measured)."""
        out: list[Any] = []
        sq_err = 0.0
        for index, value in enumerate(leaves):
            if not value.is_floating_point():
                out.append(value)
                continue
            if not forward and self.config.communication.error_feedback:
                encoded = self.feedback[edge].encode(value, stream=(microbatch, index))
            else:
                encoded = get_codec(codec).encode(value)
            out.append(encoded)
            if self.config.communication.measure_codec_error:
                decoded = get_codec(codec).decode(encoded).to(value.device)
                sq_err += float((decoded.double() - value.double()).pow(2).sum())
        return out, sq_err


class Receiver:
    """Takes the neighbours' values in: checks each, then puts it in the inbox the executor reads.

    Args:
        config: the stage's config: which stages it holds, and the ranks.
        inbox: the executor's inbox.
        spawn: starts a task the actor owns (a dist receive runs in one of its own).
        link: the torch.distributed link with ``transport="dist"``, else None.
    """

    def __init__(self, config: StageConfig, inbox: Inbox,
                 spawn: Callable[[Coroutine[Any, Any, None], str], Any], link: DistLink | None = None) -> None:
        self.config = config
        self.mesh = config.mesh
        self.held = frozenset(config.stages)  # a property that computes a list: once, not per value
        self.inbox = inbox
        self.spawn = spawn
        self.link = link

    def check_slot(self, current: int, num_microbatches: int, step: Any, kind: Any, stage: Any,
                   microbatch: Any) -> None:
        """Refuses a delivery for a step other than ``current`` or the next, or a slot no program has.

        An activation ("F") comes to a held stage with one before it, a gradient ("B")
        to a held stage with one after it; the micro-batch is one of the current step's
        (the next step may use up to 4x as many: micro_batches can change at the barrier).

        Raises:
            NotAllowed: not such a slot.
        """
        cfg = self.config
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (step, stage, microbatch))
        limit = num_microbatches * (1 if ints and step == current else 4)
        fits = ints and kind in ("F", "B") and stage in self.held and \
            (stage > 0 if kind == "F" else stage < cfg.num_stages - 1) and \
            step in (current, current + 1) and step >= 0 and 0 <= microbatch < limit
        if not fits:
            raise NotAllowed(
                f"rank {cfg.pipeline_rank} (step {current}, stages {cfg.stages}) expects no "
                f"{str(kind)[:4]!r} for stage {str(stage)[:12]}, micro-batch {str(microbatch)[:12]} "
                f"of step {str(step)[:12]}")

    def deliver(self, current: int, num_microbatches: int, step: int, kind: str, stage: int, microbatch: int,
                leaves: list[torch.Tensor], spec: Any) -> None:
        """Keeps a neighbour's value for ``(step, kind, stage, microbatch)``, once it is checked.

        Raises:
            NotAllowed: not a slot this stage expects (:meth:`check_slot`), or not a well-formed value.
        """
        self.check_slot(current, num_microbatches, step, kind, stage, microbatch)
        if not isinstance(leaves, list):
            raise NotAllowed(f"a delivery carries a list of tensors, got {type(leaves).__name__}")
        wrong = next((i for i, v in enumerate(leaves) if not isinstance(v, (torch.Tensor, Encoded))), None)
        if wrong is not None:
            raise NotAllowed(f"a delivery carries a list of tensors, got a {type(leaves[wrong]).__name__} at {wrong}")
        self.inbox.put((step, kind, stage, microbatch), payload(leaves, spec))

    def deliver_header(self, current: int, num_microbatches: int, step: int, kind: str, stage: int,
                       microbatch: int, header: dict[str, Any]) -> None:
        """A neighbour posted a value over torch.distributed: posts the matching receive, in a task of its own.

        Raises:
            NotAllowed: not a slot this stage expects, or not a well-formed header.
        """
        assert self.link is not None
        self.check_slot(current, num_microbatches, step, kind, stage, microbatch)
        me = self.mesh.coords(self.config.global_rank)
        source_stage = stage - 1 if kind == "F" else stage + 1
        src = self.mesh.rank(Coords(me.data, self.config.rank_of(source_stage), me.tensor))
        if not isinstance(header, dict) or not isinstance(header.get("leaves"), list):
            raise NotAllowed("a dist header is a map with the value's leaves")
        payload([torch.empty(0)] * len(header["leaves"]), header.get("spec"))
        key = (step, kind, stage, microbatch)
        self.spawn(self._receive_dist(key, header, src), f"p2p {key}")

    async def _receive_dist(self, key: Key, header: dict[str, Any], src: int) -> None:
        assert self.link is not None
        try:
            leaves = await self.link.receive(header, src, *key)
        except Exception as exc:
            self.inbox.fail(key, exc)
            return
        self.inbox.put(key, Payload(leaves, header["spec"]))


def payload(leaves: list[torch.Tensor], spec: Any) -> Payload:
    """A boundary value from its tensors and the spec that rebuilds it.

    Raises:
        NotAllowed: a spec that does not describe ``leaves`` (:func:`~stages.comm.boundary.check_spec`).
    """
    try:
        boundary.check_spec(spec, len(leaves))
    except ValueError as exc:
        raise NotAllowed(str(exc)) from None
    return Payload(leaves, spec)
