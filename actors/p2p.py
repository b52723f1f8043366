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
    """A tag unique among the transfers one step has in flight between two ranks (< 2**31).

    Only the current and the next step can be in flight (stages fence older ones), so
    the step counts modulo 16; ``frame`` numbers the frames of all of one value's tensors.
    """
    if stage >= 256 or microbatch >= 1024 or frame >= 128:
        raise ValueError("dist transport supports < 256 stages, < 1024 micro-batches and < 128 frames per "
                         "boundary value (about 40 tensors)")
    return ((((step % 16) * 2 + (kind == "B")) * 256 + stage) * 1024 + microbatch) * 128 + frame


class DistLink:
    """Posts and completes one stage actor's point-to-point transfers."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=2, thread_name_prefix="stage-p2p")
        self._sends: list[tuple[Any, Encoded]] = []

    def send(self, values: list[Encoded], dst: int, step: int, kind: str, stage: int,
             microbatch: int) -> dict[str, Any]:
        """Posts the frames of one value's encoded tensors to global rank ``dst``; returns the header
        to send alongside (one entry per tensor under ``leaves``)."""
        frame = 0
        leaves = []
        for encoded in values:
            for piece in encoded.frames:
                work = dist.isend(piece.contiguous(), dst, tag=transfer_tag(step, kind, stage, microbatch, frame))
                self._sends.append((work, encoded))  # the frames must live until the send completes
                frame += 1
            leaves.append({"codec": encoded.codec, "dtype": _DTYPE_NAMES[encoded.dtype], "shape": list(encoded.shape),
                           "params": dict(encoded.params), "sizes": [int(f.numel()) for f in encoded.frames]})
        return {"leaves": leaves}

    async def receive(self, header: dict[str, Any], src: int, step: int, kind: str, stage: int,
                      microbatch: int) -> list[torch.Tensor]:
        """Posts the receives a header announces and returns the decoded tensors once they complete."""
        posted = []
        frame = 0
        for leaf in header["leaves"]:
            codec = get_codec(leaf["codec"])
            dtype, shape, params = DTYPES[leaf["dtype"]], tuple(leaf["shape"]), leaf["params"]
            sizes = codec.frame_sizes(dtype, shape, params)
            if list(sizes) != list(leaf["sizes"]):
                raise ValueError(f"frame sizes {leaf['sizes']} do not fit {leaf['codec']} {list(shape)}")
            frames = tuple(torch.empty(n, dtype=torch.uint8) for n in sizes)
            works = []
            for f in frames:
                works.append(dist.irecv(f, src, tag=transfer_tag(step, kind, stage, microbatch, frame)))
                frame += 1
            posted.append((codec, Encoded(codec=leaf["codec"], dtype=dtype, shape=shape, params=params,
                                          frames=frames), works))
        loop = asyncio.get_running_loop()
        values = []
        for codec, encoded, works in posted:
            for work in works:
                assert work is not None  # None only for ranks outside the group
                await loop.run_in_executor(self._thread, work.wait)
            values.append(codec.decode(encoded))
        return values

    async def flush(self) -> None:
        """Waits until every posted send has completed (before the step's barrier)."""
        sends, self._sends = self._sends, []
        loop = asyncio.get_running_loop()
        for work, _ in sends:
            await loop.run_in_executor(self._thread, work.wait)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._sends.clear()  # a posted send holds its process group, and with it gloo's threads
