"""Stage-to-stage tensors over torch.distributed point-to-point (gloo on CPU, NCCL on GPU).

The bulk bytes travel by ``isend``/``irecv`` on the job's process group; a small
actor message carries what the receiver needs to post its receive (codec, dtype,
shape, codec params, frame sizes), so any tensor, quantized or not, can travel
without the receiver knowing its shape in advance. Sends and receives are posted
asynchronously; completion is awaited on a communication thread, never on the loop
or the compute thread, so transfers overlap compute.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from transport.codecs import Encoded, get_codec
from transport.wire import DTYPES

__all__ = ["DistLink", "transfer_tag"]

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def transfer_tag(step: int, kind: str, stage: int, microbatch: int, frame: int) -> int:
    """A tag unique among the transfers one step has in flight between two ranks (< 2**31)."""
    if stage >= 256 or microbatch >= 1024 or frame >= 8:
        raise ValueError("dist transport supports < 256 stages, < 1024 micro-batches and < 8 frames per tensor")
    return ((((step % 256) * 2 + (kind == "B")) * 256 + stage) * 1024 + microbatch) * 8 + frame


class DistLink:
    """Posts and completes one stage actor's point-to-point transfers."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=2, thread_name_prefix="stage-p2p")
        self._sends: list[tuple[Any, Encoded]] = []

    def send(self, encoded: Encoded, dst: int, step: int, kind: str, stage: int, microbatch: int) -> dict[str, Any]:
        """Posts the encoded tensor's frames to global rank ``dst``; returns the header to send alongside."""
        for k, frame in enumerate(encoded.frames):
            work = dist.isend(frame.contiguous(), dst, tag=transfer_tag(step, kind, stage, microbatch, k))
            self._sends.append((work, encoded))  # the frames must live until the send completes
        return {"codec": encoded.codec, "dtype": _DTYPE_NAMES[encoded.dtype], "shape": list(encoded.shape),
                "params": dict(encoded.params), "sizes": [int(f.numel()) for f in encoded.frames]}

    async def receive(self, header: dict[str, Any], src: int, step: int, kind: str, stage: int,
                      microbatch: int) -> torch.Tensor:
        """Posts the receives a header announces and returns the decoded tensor once they complete."""
        codec = get_codec(header["codec"])
        dtype, shape, params = DTYPES[header["dtype"]], tuple(header["shape"]), header["params"]
        sizes = codec.frame_sizes(dtype, shape, params)
        if list(sizes) != list(header["sizes"]):
            raise ValueError(f"frame sizes {header['sizes']} do not fit {header['codec']} {list(shape)}")
        frames = tuple(torch.empty(n, dtype=torch.uint8) for n in sizes)
        works = [dist.irecv(f, src, tag=transfer_tag(step, kind, stage, microbatch, k)) for k, f in enumerate(frames)]
        loop = asyncio.get_running_loop()
        for work in works:
            assert work is not None  # None only for ranks outside the group
            await loop.run_in_executor(self._thread, work.wait)
        return codec.decode(Encoded(codec=header["codec"], dtype=dtype, shape=shape, params=params, frames=frames))

    async def flush(self) -> None:
        """Waits until every posted send has completed (before the step's barrier)."""
        sends, self._sends = self._sends, []
        loop = asyncio.get_running_loop()
        for work, _ in sends:
            await loop.run_in_executor(self._thread, work.wait)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._sends.clear()  # a posted send holds its process group, and with it gloo's threads
