"""Moving tensors between a stage's device and the host without stalling its compute.

Run its tests with: `.venv/bin/python -m pytest -q tests/stages/comm/test_device_io.py`

On a CUDA device a stage launches its kernels on the device's default stream, its
*compute* stream (no thread of a stage sets another). Whatever crosses to or from the
host goes on a second, *copy*, stream, through pinned host buffers that a
:class:`PinnedPool` hands out again and again:

- out (:meth:`DeviceIO.to_host`): an event recorded on the compute stream after the
  kernels that made the tensors (a codec's included: frames are encoded on the device,
  so only their bytes cross PCIe); the copy stream waits for it and copies
  device->host, ``non_blocking``, into pooled pinned buffers, then records a *copied*
  event. The caller waits for that event off the event loop and off the compute
  thread (:meth:`DeviceIO.wait`) and only then hands the host views to ZeroMQ. The
  compute stream never waits for a copy, so compute goes on while it runs.
- in (:meth:`DeviceIO.to_device`): host bytes are staged into a pooled pinned buffer and
  copied host->device ``non_blocking`` on the copy stream; the compute stream waits on
  the copy's event, so the kernel that consumes the tensor runs after it without the
  host waiting for anything.
- bulk (:meth:`DeviceIO.copy_to_cpu`, :meth:`DeviceIO.copy_to_device`): state dicts and
  checkpoints move through pinned chunks, two in flight, with one host sync per chunk
  instead of one per tensor.

On the CPU all of it does nothing: streams are no-ops whose events are always
complete, and tensors stay where they are (zero-copy, as before). The CUDA calls go
through a small :class:`StreamBackend`, so tests run the CUDA path's logic on the CPU
with fakes that record which stream waited for what, in which order.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, ContextManager, Protocol

import torch

from stages.comm.pinned import PinnedPool
from transport.codecs import Encoded, decode

__all__ = ["DeviceIO", "DeviceStreams", "HostCopy", "PinnedPool", "StreamBackend", "backend_for", "io_for"]

DEFAULT_CHUNK_BYTES = 16 << 20


class StreamBackend(Protocol):
    """The stream, event and pinned-memory calls :class:`DeviceIO` makes, so fakes can stand in for CUDA."""

    staged: bool  # whether tensors of this device cross to the host through pooled buffers
    pinned: bool  # whether those buffers are page-locked

    def current_stream(self) -> Any: ...
    def new_stream(self) -> Any: ...
    def new_event(self) -> Any: ...
    def use_stream(self, stream: Any) -> ContextManager[Any]: ...
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...


class _DoneEvent:
    """An event that has always completed: the CPU's, where work is done when the call returns."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _NoStream:
    """A stream on which everything has already happened."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


class _CpuBackend:
    """No streams, no pinning: CPU tensors are already on the host (and so are meta tensors)."""

    staged = False
    pinned = False

    def current_stream(self) -> Any:
        return _NoStream()

    def new_stream(self) -> Any:
        return _NoStream()

    def new_event(self) -> Any:
        return _DoneEvent()

    def use_stream(self, stream: Any) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass


class _CudaBackend:
    """torch.cuda's streams and events on one device."""

    staged = True
    pinned = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def use_stream(self, stream: Any) -> ContextManager[Any]:
        return torch.cuda.stream(stream)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


def backend_for(device: torch.device | str) -> StreamBackend:
    """CUDA's streams for a CUDA device; no-ops for every other one."""
    device = torch.device(device)
    return _CudaBackend(device) if device.type == "cuda" else _CpuBackend()


class DeviceStreams:
    """A device's compute stream (where its kernels run) and a side stream for copies.

    Args:
        device: the stage's device.
        backend: the calls to make; :func:`backend_for` the device's when None.
    """

    def __init__(self, device: torch.device | str, backend: StreamBackend | None = None) -> None:
        self.device = torch.device(device)
        self.backend = backend if backend is not None else backend_for(self.device)
        # Taken here, on the thread that builds the stage: the default stream, which the
        # compute thread launches on too (it never sets another).
        self.compute = self.backend.current_stream()
        self.copy = self.backend.new_stream()

    def record(self, stream: Any = None) -> Any:
        """An event that completes once everything launched so far on ``stream`` (compute) has run."""
        event = self.backend.new_event()
        event.record(self.compute if stream is None else stream)
        return event

    def wait(self, event: Any, stream: Any = None) -> None:
        """Makes ``stream`` (compute) run nothing launched from now on before ``event`` completes.

        The host does not wait: the stream does.
        """
        (self.compute if stream is None else stream).wait_event(event)

    def copying(self) -> ContextManager[Any]:
        """Launches what runs in it on the copy stream."""
        return self.backend.use_stream(self.copy)


@dataclass(frozen=True, slots=True)
class HostCopy:
    """Values on their way to the host: usable once ``event`` has completed (see :meth:`DeviceIO.wait`)."""

    values: list[Any]  # tensors and Encoded, as given, with host tensors and frames
    event: Any


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class DeviceIO:
    """One device's streams and pinned pool, and the copies that use them (see the module docstring).

    Args:
        device: the stage's device.
        backend: the stream calls; CUDA's on a CUDA device, no-ops elsewhere.
        pool: the host buffers; a new :class:`PinnedPool` (pinned where the backend pins) when None.
        chunk_bytes: the size of the chunks bulk copies move through.
    """

    def __init__(self, device: torch.device | str, *, backend: StreamBackend | None = None,
                 pool: PinnedPool | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.device = torch.device(device)
        self.backend = backend if backend is not None else backend_for(self.device)
        self.streams = DeviceStreams(self.device, self.backend)
        self.pool = pool if pool is not None else PinnedPool(pinned=self.backend.pinned)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._waiter: ThreadPoolExecutor | None = None
        self._waiter_lock = threading.Lock()

    @property
    def staged(self) -> bool:
        """Whether this device's tensors cross to the host through copies (CUDA), not as they are (CPU)."""
        return self.backend.staged

    def _leaves_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is copied on its way to the host: one on this device, when staged (a tensor on
        another device, which no stage makes, goes by a plain ``.cpu()``).

        (A staging backend on the CPU, which only tests' fakes are, copies CPU tensors
        too, so that the CUDA path's logic runs with real values.)
        """
        return self.staged and (tensor.device == self.device or tensor.device.type == "cpu" == self.device.type)

    def _on_device(self, value: Any) -> bool:
        if isinstance(value, Encoded):
            return any(frame.device.type != "cpu" or self._leaves_host(frame) for frame in value.frames)
        return isinstance(value, torch.Tensor) and (value.device.type != "cpu" or self._leaves_host(value))

    # -- boundary values: one micro-batch's tensors ----------------------------------------------------

    def to_host(self, values: Sequence[Any]) -> HostCopy:
        """Starts copying ``values`` (tensors, and :class:`~transport.codecs.Encoded` whose frames are on the
        device) into pooled host buffers, after everything launched on the compute stream so far.

        Returns at once. The host tensors may be read once :meth:`wait` has seen the
        returned event; their buffers go back to the pool when nothing references them
        any more. Values already on the host are passed through as they are.
        """
        values = list(values)
        if not any(self._on_device(v) for v in values):
            return HostCopy(values, _DoneEvent())
        streams = self.streams
        produced = streams.record()  # after the kernels that made the values (and encoded them)
        streams.wait(produced, streams.copy)
        buffers: list[torch.Tensor] = []
        out: list[Any] = []
        with streams.copying():
            for value in values:
                if isinstance(value, Encoded):
                    frames = tuple(self._copy_out(frame, buffers) for frame in value.frames)
                    out.append(replace(value, frames=frames))
                elif isinstance(value, torch.Tensor):
                    out.append(self._copy_out(value, buffers))
                else:
                    out.append(value)
            copied = streams.record(streams.copy)
        for buffer in buffers:
            self.pool.release(buffer, after=copied)
        return HostCopy(out, copied)

    def _copy_out(self, tensor: torch.Tensor, buffers: list[torch.Tensor]) -> torch.Tensor:
        """Launches (on the copy stream) ``tensor``'s copy into a pooled buffer; returns the host view."""
        if not self._leaves_host(tensor):
            return tensor if tensor.device.type == "cpu" else tensor.cpu()
        nbytes = tensor.numel() * tensor.element_size()
        buffer = self.pool.acquire(nbytes)
        buffers.append(buffer)
        if nbytes:
            buffer.copy_(_flat_bytes(tensor), non_blocking=True)
        # The compute thread may drop the tensor before the copy has run: keep its memory
        # from being handed to another kernel until the copy stream is past this point.
        self.backend.record_stream(tensor, self.streams.copy)
        return buffer.view(tensor.dtype).view(tensor.shape)

    async def wait(self, event: Any) -> None:
        """Returns once ``event`` has completed, waiting on a thread of its own (never on the loop,
        nor on the compute thread, which goes on launching kernels meanwhile)."""
        if event.query():
            return
        with self._waiter_lock:
            if self._waiter is None:
                self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.device}-copy-wait")
            waiter = self._waiter
        await asyncio.get_running_loop().run_in_executor(waiter, event.synchronize)

    def to_device(self, values: Sequence[torch.Tensor | Encoded]) -> list[torch.Tensor]:
        """``values`` on this device: host tensors are staged in pooled pinned buffers and copied on the copy
        stream; the compute stream waits for the copies (the host does not).

        Tensors already on the device are passed through; on the CPU every tensor is. An
        :class:`~transport.codecs.Encoded` (a lossy value as the wire kept it,
        :func:`transport.wire.keep_lossy_encoded`) crosses as its frames and is decoded here,
        on the compute stream after its copy: only the encoded bytes cross.
        """
        if not any(isinstance(value, Encoded) for value in values):
            return self._tensors_to_device(values)  # type: ignore[arg-type]
        pieces = [list(value.frames) if isinstance(value, Encoded) else [value] for value in values]
        moved = iter(self._tensors_to_device([tensor for piece in pieces for tensor in piece]))
        out = []
        for value, piece in zip(values, pieces):
            here = [next(moved) for _ in piece]
            out.append(decode(replace(value, frames=tuple(here))) if isinstance(value, Encoded) else here[0])
        return out

    def _tensors_to_device(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        tensors = list(tensors)
        if not self.staged:
            return tensors
        staged: list[tuple[int, torch.Tensor]] = []
        for i, tensor in enumerate(tensors):
            if tensor.device.type != "cpu":
                if tensor.device != self.device:  # another device: let torch route it
                    tensors[i] = tensor.to(self.device)
                continue
            buffer = self.pool.acquire(tensor.numel() * tensor.element_size())
            if buffer.numel():
                buffer.copy_(_flat_bytes(tensor))  # host to pinned host, before the copy is launched
            staged.append((i, buffer))
        if not staged:
            return tensors
        streams = self.streams
        with streams.copying():
            for i, buffer in staged:
                tensors[i] = self._copy_in(tensors[i], buffer)
            copied = streams.record(streams.copy)
        for _, buffer in staged:
            self.pool.release(buffer, after=copied)
        streams.wait(copied)  # the consumer's kernels come after the copies
        return tensors

    def _copy_in(self, host: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        # Allocated on the copy stream, so no compute-stream kernel still reading a recycled
        # block can see it written; record_stream keeps the compute stream's uses safe in turn.
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        if buffer.numel():
            out.reshape(-1).view(torch.uint8).copy_(buffer, non_blocking=True)
        self.backend.record_stream(out, self.streams.compute)
        return out

    # -- bulk: state dicts, checkpoints ---------------------------------------------------------------------

    def copy_to_cpu(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` on the CPU, in ordinary (pageable) memory, each moved once.

        Device tensors travel in pinned chunks of ``chunk_bytes``, two in flight: while
        the host copies one chunk out, the next one crosses. One host sync per chunk.
        CPU tensors come back as ``tensor.detach().cpu()`` does: the same memory.
        """
        tensors = [t.detach() for t in tensors]
        moving = [i for i, t in enumerate(tensors) if self._leaves_host(t)]
        if not moving:
            return [t.cpu() for t in tensors]
        out = [t.cpu() for t in tensors]  # those moving: replaced below
        for i in moving:
            out[i] = torch.empty(tensors[i].shape, dtype=tensors[i].dtype)
        sources = {i: _flat_bytes(tensors[i]) for i in moving}  # a non-contiguous one: copied on compute first
        streams = self.streams
        streams.wait(streams.record(), streams.copy)
        flying: deque[tuple[torch.Tensor, Any, list[tuple[torch.Tensor, int, torch.Tensor]]]] = deque()
        for pieces in self._chunks([(sources[i], out[i].reshape(-1).view(torch.uint8)) for i in moving]):
            if len(flying) == 2:
                self._land(*flying.popleft())
            buffer = self.pool.acquire(sum(n for _, n, _ in pieces))
            offset = 0
            with streams.copying():
                for source, n, _ in pieces:
                    buffer[offset:offset + n].copy_(source, non_blocking=True)
                    offset += n
                event = streams.record(streams.copy)
            flying.append((buffer, event, pieces))
        while flying:  # every copy has run once the last chunk has landed: no record_stream needed
            self._land(*flying.popleft())
        return out

    def _land(self, buffer: torch.Tensor, event: Any, pieces: list[tuple[torch.Tensor, int, torch.Tensor]]) -> None:
        event.synchronize()
        offset = 0
        for _, n, target in pieces:
            target.copy_(buffer[offset:offset + n])
            offset += n
        self.pool.release(buffer)

    def copy_to_device(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` on this device, each moved once, through pinned chunks (two in flight); the compute
        stream waits for the last copy, the host only for a chunk's buffer to be free again.

        On the CPU, ``tensor.to(device)`` (the same tensor).
        """
        tensors = list(tensors)
        moving = [i for i, t in enumerate(tensors) if self.staged and t.device.type == "cpu"]
        out = [t if i in moving else t.to(self.device) for i, t in enumerate(tensors)]
        if not moving:
            return out
        streams = self.streams
        with streams.copying():
            for i in moving:
                out[i] = torch.empty(tensors[i].shape, dtype=tensors[i].dtype, device=self.device)
                self.backend.record_stream(out[i], streams.compute)
        flying: deque[Any] = deque()  # the events of the chunks in flight
        event: Any = None
        for pieces in self._chunks([(_flat_bytes(tensors[i]), out[i].reshape(-1).view(torch.uint8)) for i in moving]):
            if len(flying) == 2:
                flying.popleft().synchronize()  # its buffer is free again: two chunks of pinned memory at most
            buffer = self.pool.acquire(sum(n for _, n, _ in pieces))
            offset = 0
            for source, n, _ in pieces:
                buffer[offset:offset + n].copy_(source)
                offset += n
            offset = 0
            with streams.copying():
                for _, n, target in pieces:
                    target.copy_(buffer[offset:offset + n], non_blocking=True)
                    offset += n
                event = streams.record(streams.copy)
            self.pool.release(buffer, after=event)
            del buffer
            flying.append(event)
        streams.wait(event)
        return out

    def _chunks(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> Iterator[list[tuple[torch.Tensor, int, torch.Tensor]]]:
        """Cuts the byte ranges ``(source, target)`` into chunks of at most ``chunk_bytes``:
        each a list of ``(source piece, its length, target piece)``; a large tensor spans several."""
        chunk: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        room = self.chunk_bytes
        for source, target in pairs:
            offset, size = 0, source.numel()
            while offset < size:
                n = min(room, size - offset)
                chunk.append((source[offset:offset + n], n, target[offset:offset + n]))
                offset += n
                room -= n
                if room == 0:
                    yield chunk
                    chunk, room = [], self.chunk_bytes
        if chunk:
            yield chunk

    def close(self) -> None:
        """Stops the waiting thread (a wait in progress finishes on its own) and drops the free buffers."""
        with self._waiter_lock:
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.shutdown(wait=False, cancel_futures=True)
        self.pool.trim()


_SHARED: dict[torch.device, DeviceIO] = {}
_SHARED_LOCK = threading.Lock()


def io_for(device: torch.device | str) -> DeviceIO:
    """This process's shared :class:`DeviceIO` for ``device`` (for code that is handed no stage's own)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _SHARED_LOCK:
        io = _SHARED.get(device)
        if io is None:
            io = _SHARED[device] = DeviceIO(device)
        return io


def copy_to_cpu(tensors: Sequence[torch.Tensor], io: DeviceIO | None = None) -> list[torch.Tensor]:
    """``tensors`` on the CPU, each moved once (see :meth:`DeviceIO.copy_to_cpu`); on the CPU, as they are.

    Args:
        io: the device's; the shared one of the first device tensor's device when None.
    """
    if io is None:
        device = next((t.device for t in tensors if t.device.type == "cuda"), None)
        if device is None:
            return [t.detach().cpu() for t in tensors]
        io = io_for(device)
    return io.copy_to_cpu(tensors)
