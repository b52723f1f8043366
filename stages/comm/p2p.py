"""Stage-to-stage tensors over torch.distributed point-to-point (gloo on CPU, NCCL on GPU).

The bulk bytes travel by ``batch_isend_irecv`` (all frames of one value in one batch)
on the two-rank group of their direction (:func:`stages.comm.parallel.pipeline_pairs`); a
small actor message carries what the receiver needs to post its receive (codec, dtype,
shape, codec params, frame sizes, and the value's number on its route), so any tensor,
quantized or not, can travel without the receiver knowing its shape in advance.
Receive buffers are allocated on the stage's device and frames stay there.

How a transfer's completion is awaited is the one thing that differs between the
backends, and a :class:`Waiter` decides it:

- gloo (:class:`ThreadWaiter`): a work completes on the host, so a communication
  thread blocks on it, never the loop or the compute thread.
- NCCL (:class:`StreamWaiter`): ``work.wait()`` makes the *current CUDA stream* wait
  for the transfer and returns at once, so it is called with the compute stream
  current; the host never blocks, and every kernel the consumer queues after it runs
  after the data has landed. Operations are posted with the compute stream current
  too: NCCL's stream then waits for the kernels that produced the frames.

NCCL ignores tags and matches the sends and receives of a communicator in the order
they are posted, while headers travel as actor messages that may overtake each other;
on NCCL the receiver therefore posts each route's receives in the order of the
sender's posts (:class:`InOrder`). gloo matches by tag and posts at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
import torch.distributed as dist

from transport.codecs import Encoded, get_codec
from transport.wire import DTYPES

__all__ = ["DistLink", "InOrder", "LinkBroken", "PeerClosed", "StreamWaiter", "ThreadWaiter", "Waiter",
           "naming_a_closed_peer", "open_link", "transfer_tag"]

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_AHEAD = 1 << 16  # values a route's header may run ahead of the next receive to post


def transfer_tag(step: int, kind: str, stage: int, microbatch: int, frame: int) -> int:
    """A tag unique among the transfers one step has in flight between two ranks (< 2**31).

    Only the current and the next step can be in flight (stages fence older ones), so
    the step counts modulo 16; ``frame`` numbers the frames of all of one value's tensors.
    """
    if stage >= 256 or microbatch >= 1024 or frame >= 128:
        raise ValueError("dist transport supports < 256 stages, < 1024 micro-batches and < 128 frames per "
                         "boundary value (about 40 tensors)")
    return ((((step % 16) * 2 + (kind == "B")) * 256 + stage) * 1024 + microbatch) * 128 + frame


class Work(Protocol):
    """A transfer in flight (``torch.distributed``'s ``Work``)."""

    def wait(self) -> Any: ...


class Waiter(Protocol):
    """How a link posts its transfers and learns that they are done."""

    def posting(self) -> AbstractContextManager[Any]:
        """The context to post operations and allocate buffers in."""
        ...

    async def wait(self, works: Sequence[Work]) -> None:
        """Returns once ``works``' buffers may be used (read after a receive, reused after a send)."""
        ...

    def close(self) -> None: ...


class PeerClosed(RuntimeError):
    """gloo found its connection to the other rank closed: most often, that rank's process ended.

    gloo says so only in its error's text (a ``RuntimeError`` reading "Connection closed by
    peer"); this type lets the head tell a lost neighbour from a stage's own failure, as it
    does for a sealed stream's :class:`~transport.stream.StreamBroken`.
    """


# How gloo's TCP pair words a connection the other side closed or reset.
_GLOO_CLOSED = ("Connection closed by peer", "Connection reset by peer")


@contextlib.contextmanager
def naming_a_closed_peer() -> Iterator[None]:
    """Raises gloo's error for a connection the other rank closed as :class:`PeerClosed`; gloo raises it
    when a transfer is posted to a rank already gone, or waited on while it goes."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, PeerClosed) or not any(words in str(exc) for words in _GLOO_CLOSED):
            raise
        raise PeerClosed(f"the other rank's connection closed (its process ended?): {exc}") from exc


class ThreadWaiter:
    """gloo's: a work completes on the host, so a communication thread blocks on each."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=2, thread_name_prefix="stage-p2p")

    def posting(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    async def wait(self, works: Sequence[Work]) -> None:
        loop = asyncio.get_running_loop()
        with naming_a_closed_peer():
            for work in works:
                await loop.run_in_executor(self._thread, work.wait)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class StreamWaiter:
    """NCCL's: each work is waited on ``stream`` (the stage's compute stream), never on the host.

    Args:
        stream: the stream the stage computes on: what consumes received tensors and
            produced the frames to send.
        use: makes a stream current (``torch.cuda.stream``); a test passes a fake.
    """

    def __init__(self, stream: Any, use: Callable[[Any], AbstractContextManager[Any]] | None = None) -> None:
        self.stream = stream
        self._use = use if use is not None else torch.cuda.stream

    def posting(self) -> AbstractContextManager[Any]:
        # Buffers allocated here belong to the compute stream, which the works are waited
        # on: the caching allocator reuses them only behind the transfer.
        return self._use(self.stream)

    async def wait(self, works: Sequence[Work]) -> None:
        with self._use(self.stream):
            for work in works:
                work.wait()  # NCCL: the current stream waits for the work's end event; the host goes on

    def close(self) -> None:
        pass


class LinkBroken(RuntimeError):
    """A route lost a value on NCCL, where later values would pair with the wrong receives."""


class InOrder:
    """Lets one route's receives be posted in the order their sends were (values numbered from 0).

    A header that overtook an earlier one waits for that one's receive to be posted.
    """

    def __init__(self) -> None:
        self._next = 0
        self._turns: dict[int, asyncio.Future[None]] = {}
        self._broken: str | None = None

    async def turn(self, seq: object) -> int:
        """Waits until value ``seq`` is next to post; the caller posts it, then :meth:`advance`.

        Raises:
            LinkBroken: the route is broken, or ``seq`` is not a number still to come.
        """
        if self._broken is not None:
            raise LinkBroken(self._broken)
        if not isinstance(seq, int) or isinstance(seq, bool) or not self._next <= seq < self._next + _MAX_AHEAD \
                or seq in self._turns:
            self.fail(f"a value numbered {str(seq)[:20]} came where {self._next} or one of the following ones "
                      "was expected, each once")
            raise LinkBroken(self._broken)
        if seq != self._next:
            turn = self._turns[seq] = asyncio.get_running_loop().create_future()
            try:
                await turn
            except asyncio.CancelledError:  # its send is posted: no later receive could pair right
                self.fail(f"the receive of value {seq} was cancelled")
                raise
            finally:
                self._turns.pop(seq, None)
            if self._broken is not None:
                raise LinkBroken(self._broken)
        return seq

    def advance(self, seq: int) -> None:
        """Value ``seq``'s receive is posted: the next may go."""
        self._next = seq + 1
        turn = self._turns.get(self._next)
        if turn is not None and not turn.done():
            turn.set_result(None)

    def fail(self, reason: str) -> None:
        """Breaks the route: every receive waiting on it, and every later one, fails with ``reason``."""
        self._broken = f"{reason}; NCCL pairs a route's sends and receives in order, so this route is out of step " \
                       "until the job's process groups form again"
        for turn in self._turns.values():
            if not turn.done():
                turn.set_result(None)


class DistLink:
    """Posts and completes one stage actor's point-to-point transfers.

    Args:
        device: the stage's device: receive buffers are allocated there and frames to
            send are moved there (a no-op when a codec produced them on it).
        pairs: ``(sender, receiver)`` global ranks -> the two-rank group of that direction
            (:attr:`stages.comm.parallel.ProcessGroups.pairs`); a pair not in it uses the default group.
        waiter: :class:`ThreadWaiter` (gloo) or :class:`StreamWaiter` (NCCL).
        ordered: post each route's receives in the order of its sends (NCCL, which ignores tags).
        rank: this stage actor's global rank.
    """

    def __init__(self, *, device: torch.device, pairs: Mapping[tuple[int, int], Any], waiter: Waiter,
                 ordered: bool, rank: int) -> None:
        self.device = device
        self.rank = rank
        self._waiter = waiter
        self._ordered = ordered
        self._sends: list[tuple[Sequence[Work], tuple[torch.Tensor, ...]]] = []
        self.rebind(pairs)

    def rebind(self, pairs: Mapping[tuple[int, int], Any]) -> None:
        """Uses new groups (the job's process groups were formed again); numbering starts afresh."""
        self._pairs = dict(pairs)
        self._sent: dict[int, int] = {}  # destination rank -> values posted to it
        self._gates: dict[int, InOrder] = {}  # source rank -> its receives' order
        self._sends.clear()

    def send(self, values: list[Encoded], dst: int, step: int, kind: str, stage: int,
             microbatch: int) -> dict[str, Any]:
        """Posts the frames of one value's encoded tensors to global rank ``dst``, in one batch; returns
        the header to send alongside (one entry per tensor under ``leaves``, the value's number as ``seq``)."""
        frames: list[torch.Tensor] = []
        leaves = []
        for encoded in values:
            frames.extend(encoded.frames)
            leaves.append({"codec": encoded.codec, "dtype": _DTYPE_NAMES[encoded.dtype], "shape": list(encoded.shape),
                           "params": dict(encoded.params), "sizes": [int(f.numel()) for f in encoded.frames]})
        group = self._pairs.get((self.rank, dst))
        with self._waiter.posting():
            # The frames must live until the send completes: kept until flush.
            pieces = tuple(f.to(self.device).contiguous() for f in frames)
            ops = [dist.P2POp(dist.isend, piece, dst, group=group,
                              tag=transfer_tag(step, kind, stage, microbatch, index))
                   for index, piece in enumerate(pieces)]
            with naming_a_closed_peer():
                works = dist.batch_isend_irecv(ops) if ops else []
        self._sends.append((works, pieces))
        seq = self._sent.get(dst, 0)
        self._sent[dst] = seq + 1
        return {"leaves": leaves, "seq": seq}

    async def receive(self, header: dict[str, Any], src: int, step: int, kind: str, stage: int,
                      microbatch: int) -> list[torch.Tensor]:
        """Posts the receives a header announces and returns the decoded tensors once they may be used.

        Raises:
            ValueError: the header's frame sizes do not fit its codec, dtype and shape.
            LinkBroken: on NCCL, the route from ``src`` lost a value (its header was refused).
        """
        gate = self._gates.setdefault(src, InOrder()) if self._ordered else None
        try:
            sizes = [_checked_sizes(leaf) for leaf in header["leaves"]]
        except (ValueError, KeyError, TypeError) as exc:
            if gate is not None:  # its send is posted and would pair with the next value's receive
                gate.fail(f"the link from rank {src} lost a value ({exc}); the job's step must start again")
            raise
        seq = await gate.turn(header.get("seq")) if gate is not None else 0
        group = self._pairs.get((src, self.rank))
        posted = []
        try:
            with self._waiter.posting():
                frame = 0
                ops = []
                for leaf, leaf_sizes in zip(header["leaves"], sizes):
                    buffers = tuple(torch.empty(n, dtype=torch.uint8, device=self.device) for n in leaf_sizes)
                    for buffer in buffers:
                        ops.append(dist.P2POp(dist.irecv, buffer, src, group=group,
                                              tag=transfer_tag(step, kind, stage, microbatch, frame)))
                        frame += 1
                    posted.append(Encoded(codec=leaf["codec"], dtype=DTYPES[leaf["dtype"]], shape=tuple(leaf["shape"]),
                                          params=leaf["params"], frames=buffers))
                with naming_a_closed_peer():
                    works = dist.batch_isend_irecv(ops) if ops else []
        except BaseException as exc:
            if gate is not None:  # posted or not, no later receive can be sure to pair with its own send
                gate.fail(f"posting the receive of value {seq} from rank {src} failed ({exc!r:.200})")
            raise
        if gate is not None:
            gate.advance(seq)
        await self._waiter.wait(works)
        with self._waiter.posting():  # decoding kernels go on the stream that waited
            return [get_codec(encoded.codec).decode(encoded) for encoded in posted]

    async def flush(self) -> None:
        """Waits until every posted send is done with its frames (before the step's barrier); on NCCL
        the compute stream waits, the host does not."""
        sends, self._sends = self._sends, []
        await self._waiter.wait([work for works, _ in sends for work in works])

    def close(self) -> None:
        self._waiter.close()
        self._sends.clear()  # a posted send holds its process group, and with it gloo's threads
        self._pairs.clear()


def _checked_sizes(leaf: dict[str, Any]) -> list[int]:
    """The frame sizes a header's leaf announces, checked against its codec, dtype and shape."""
    codec = get_codec(leaf["codec"])
    sizes = list(codec.frame_sizes(DTYPES[leaf["dtype"]], tuple(leaf["shape"]), leaf["params"]))
    if sizes != list(leaf["sizes"]):
        raise ValueError(f"frame sizes {leaf['sizes']} do not fit {leaf['codec']} {list(leaf['shape'])}")
    return sizes


def open_link(device: torch.device, pairs: Mapping[tuple[int, int], Any], rank: int) -> DistLink:
    """The link for a stage on ``device``; call it on the stage's compute thread.

    On a GPU the transfers go over NCCL and are waited on the compute thread's current
    stream (the one consumers run on); on a CPU over gloo, waited on a thread.
    """
    if device.type == "cuda":
        waiter: Waiter = StreamWaiter(torch.cuda.current_stream(device))
        return DistLink(device=device, pairs=pairs, waiter=waiter, ordered=True, rank=rank)
    return DistLink(device=device, pairs=pairs, waiter=ThreadWaiter(), ordered=False, rank=rank)
