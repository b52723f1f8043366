# Run: python -m benchmarks.gpu            (or: make gpu-check; --device cpu runs the same checks on the CPU)
"""One command for a GPU machine: does actorpipe train on the GPU exactly, and what do the copies cost?

On a machine with CUDA (within about 5 minutes with one GPU):

1. ``zmq_fp32`` / ``zmq_bf16``: a 2-stage 1F1B job, both stages on ``cuda:0``, over the
   ZeroMQ path (activations and gradients cross device->pinned host->device through
   ``stages.comm.device_io``), trained ``--steps`` steps on the reference workload
   (docs/design.md: 8 residual MLP blocks of width 512, a [64, 32, 512] batch in 8
   micro-batches, MSE, SGD lr 0.01, seed 0), against one process on the same GPU doing
   the same arithmetic (the same micro-batches in order; in bf16 the same autocast,
   the boundary cast to bf16). Every parameter must satisfy, element by element,
   ``|pipeline - one process| <= atol + rtol * |one process|`` (``torch.testing``'s
   rule): float32 ``rtol=1e-5, atol=1e-6``, as the test suite holds the CPU to; bf16
   ``rtol=1e-2, atol=5e-4``, the stated tolerance (bf16 GEMMs may pick other kernels
   per process, and LayerNorm biases, which start at zero, differ in their last bits).
   ``tolerance_used`` is the largest ``|diff| / (atol + rtol * |one process|)``: <= 1
   passes; ``max_rel_diff`` the largest ``|diff| / |one process|`` over elements with
   ``|one process| >= 1e-3``.
   ``zmq_fp16``: the same in fp16 with its dynamic loss scale (bf16's bound: a power-of-two
   scale changes no bit unless a value under- or overflows). ``zmq_int8_wire``: float32 with
   activations and gradients int8 on the wire, a lossy codec, held to a loose bound
   (``rtol=1e-2, atol=1e-3``: three steps of lr 0.01 move a weight by about 1e-3).
   ``zmq_compiled``: float32 with ``torch_compile=True`` (inductor, Triton's kernels), held
   to ``rtol=1e-4, atol=1e-5`` (fused kernels round in their own order).
2. ``nccl_fp32``, with two GPUs or more: the same job with its stages on ``cuda:0`` and
   ``cuda:1`` over ``transport="dist"`` (NCCL), same bound. With one GPU,
   ``shared_gpu_refused``: a data-parallel job of two ranks on ``cuda:0`` must be refused
   before it starts, with the scheduler's ValueError that names NCCL (NCCL would fail or
   hang later).
3. ``int8_gbps``: the int8 codec's encode+decode on the GPU, float32 bytes in per second
   (64 MiB tensors).
4. ``decode_on_device``: one micro-batch's int8-coded activation of the reference workload
   ([8, 32, 512], 512 KiB in float32) as a GPU's process receives it (the wire keeps lossy
   values encoded there, ``transport.wire.keep_lossy_encoded``): ``h2d_bytes_ratio``, the
   bytes that cross to the GPU over float32's; ``decode_on_device_speedup``, the time to
   decode on the host and copy float32 over the time to copy the frames and decode on the
   GPU; ``ok`` when both give the host decode's bits.
5. ``hidden_copy_share``: the share of device->host copy time hidden behind compute.
   Measured in this process with one :class:`~stages.comm.device_io.DeviceIO`: ``compute_s``
   is a run of matmuls alone, ``copy_s`` the device->host copies of 8 activations
   alone (launched and waited for as a stage sends them), ``both_s`` the two interleaved
   as a stage does (matmuls, then a send's copy, and so on); the share is
   ``(compute_s + copy_s - both_s) / copy_s``, clipped to [0, 1]: 1 when the copies
   cost no time at all beside compute, 0 when they add their whole time.

The last line printed is one JSON object; ``"ok"`` says whether every check passed
(exit status 1 when not). Without CUDA it says so in that line
(``{"cuda": false, "reason": ...}``) and exits 0; ``--device cpu`` runs checks 1 and 3
on the CPU instead, on a smaller workload (the test suite does, so that the comparison
itself is tested).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from actors import RemoteError
from stages.comm.device_io import DeviceIO
from examples.models import residual_mlp
from schedulers import LocalCluster
from transport.codecs import decode, get_codec
from transport.loop import run

REFERENCE = {"blocks": 8, "dim": 512, "batch": (64, 32, 512), "micro_batches": 8}
SMALL = {"blocks": 4, "dim": 32, "batch": (16, 4, 32), "micro_batches": 4}  # the CPU dry run's
TOLERANCE = {"fp32": (1e-5, 1e-6), "bf16": (1e-2, 5e-4), "fp16": (1e-2, 5e-4), "lossy": (1e-2, 1e-3),
             "compiled": (1e-4, 1e-5)}  # rtol, atol
LR = 0.01


def batches(shape: Sequence[int], steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(*shape, generator=generator), torch.randn(*shape, generator=generator))
            for _ in range(steps)]


def one_process(size: dict[str, Any], data: list[tuple[torch.Tensor, torch.Tensor]], device: str, precision: str,
                cuts: Sequence[int]) -> dict[str, torch.Tensor]:
    """The parameters after training in one process on ``device``, micro-batch by micro-batch as the pipeline
    does (in bf16: the same autocast, each stage boundary cast to bf16 as the pipeline sends it)."""
    torch.manual_seed(0)
    model = residual_mlp(blocks=size["blocks"], dim=size["dim"]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = (lambda: torch.autocast(torch.device(device).type, dtype=dtype)) if dtype is not None \
        else contextlib.nullcontext
    m = size["micro_batches"]
    for x, y in data:
        optimizer.zero_grad()
        for xm, ym in zip(x.to(device).chunk(m), y.to(device).chunk(m)):
            h = xm
            for index, layer in enumerate(model):
                if index in cuts and dtype is not None:
                    h = h.to(dtype)
                with autocast():
                    h = layer(h)
            with autocast():
                loss = torch.nn.functional.mse_loss(h, ym).float()
            (loss / m).backward()
        optimizer.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def distance(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float, atol: float
             ) -> dict[str, float]:
    """How far ``state`` is from ``expected`` (see the module docstring): ``tolerance_used`` (<= 1 passes),
    ``max_rel_diff`` and ``max_abs_diff``."""
    if list(state) != list(expected):
        raise ValueError(f"the pipeline's keys differ from one process's: {sorted(set(state) ^ set(expected))[:5]}")
    used = rel = absolute = 0.0
    for key, want in expected.items():
        if not want.numel():
            continue
        want = want.double()
        diff = (state[key].double() - want).abs()
        used = max(used, float((diff / (atol + rtol * want.abs())).max()))
        absolute = max(absolute, float(diff.max()))
        large = want.abs() >= 1e-3
        if bool(large.any()):
            rel = max(rel, float((diff[large] / want.abs()[large]).max()))
    return {"tolerance_used": used, "max_rel_diff": rel, "max_abs_diff": absolute}


def open_cluster(devices: Sequence[str]) -> LocalCluster:
    """A LocalCluster with one node per entry of ``devices`` (a GPU named twice is shared on purpose)."""
    return LocalCluster(devices=list(devices))


class Case(NamedTuple):
    """One comparison: a 2-stage job trained with ``options`` against one process in ``precision``,
    held to ``TOLERANCE[bound]``."""
    name: str
    precision: str
    bound: str
    options: dict[str, Any]


def case(name: str, precision: str = "fp32", bound: str | None = None, **options: Any) -> Case:
    return Case(name, precision, bound or precision, {"transport": "zmq", **options})


async def compare(size: dict[str, Any], devices: Sequence[str], cases: Sequence[Case], steps: int) -> dict[str, Any]:
    """Trains each case as a 2-stage job on ``devices`` and compares it with one process on ``devices[0]``."""
    data = batches(size["batch"], steps)
    results: dict[str, Any] = {}
    async with open_cluster(devices) as cluster:
        for name, precision, bound, options in cases:
            started = time.perf_counter()
            try:
                job = await cluster.train(
                    model="examples.models:residual_mlp", model_kwargs={"blocks": size["blocks"], "dim": size["dim"]},
                    loss="torch.nn.functional:mse_loss", optimizer=("torch.optim:SGD", {"lr": LR}),
                    pipeline_stages=2, schedule="1f1b", micro_batches=size["micro_batches"], seed=0,
                    precision=precision, **options)
                try:
                    step_s = []
                    for x, y in data:
                        stats = await job.step(x, y)
                        step_s.append(stats.step_time_s)
                    state = await job.state_dict()
                    cuts = [first for first, _ in job.bounds[1:]]
                finally:
                    await job.close()
                rtol, atol = TOLERANCE[bound]
                found = distance(state, one_process(size, data, devices[0], precision, cuts), rtol, atol)
                results[name] = {"ok": found["tolerance_used"] <= 1.0, **found, "rtol": rtol, "atol": atol,
                                 "step_s": round(min(step_s), 4), "devices": list(devices)}
            except Exception as exc:  # one failing case must not hide the others
                results[name] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            results[name]["wall_s"] = round(time.perf_counter() - started, 1)
            print(f"{name:>18}: {results[name]}", flush=True)  # kept should a later case crash the run
    return results


async def shared_gpu_refused(device: str) -> dict[str, Any]:
    """A data-parallel job of two ranks on one GPU must be refused at ``train`` with NCCL's reason."""
    started = time.perf_counter()
    async with open_cluster([device, device]) as cluster:
        try:
            job = await cluster.train(model="examples.models:residual_mlp", model_kwargs={"blocks": 2, "dim": 32},
                                      loss="torch.nn.functional:mse_loss", optimizer=("torch.optim:SGD", {"lr": LR}),
                                      pipeline_stages=1, data_parallel=2, micro_batches=2, seed=0)
        except RemoteError as exc:  # the scheduler's ValueError, as a client hears it
            said = str(exc)
            return {"ok": said.startswith("ValueError") and "NCCL" in said, "error": said[:300],
                    "wall_s": round(time.perf_counter() - started, 1)}
        await job.close()
    return {"ok": False, "error": "the job started", "wall_s": round(time.perf_counter() - started, 1)}


def codec_gbps(device: str, numel: int, repeats: int = 10) -> float:
    """int8 encode+decode of a float32 tensor on ``device``: input bytes per second, in GB/s."""
    codec = get_codec("int8")
    x = torch.randn(numel, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(2):
        codec.decode(codec.encode(x))
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        codec.decode(codec.encode(x))
    sync()
    return round(numel * 4 * repeats / (time.perf_counter() - started) / 1e9, 2)


def hidden_copy_share(device: str) -> dict[str, float]:
    """The share of device->host copy time hidden behind compute (see the module docstring)."""
    io = DeviceIO(device)
    weight = torch.randn(4096, 4096, device=device)
    activations = [torch.randn(8, 1024, 1024, device=device) for _ in range(8)]  # 32 MiB each

    def compute() -> None:
        for _ in range(4):
            weight @ weight

    def send(activation: torch.Tensor) -> Any:
        return io.to_host([activation]).event

    def timed(with_compute: bool, with_copies: bool) -> float:
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        events = []
        for activation in activations:
            if with_compute:
                compute()
            if with_copies:
                events.append(send(activation))
        for event in events:
            event.synchronize()
        torch.cuda.synchronize(device)
        return time.perf_counter() - started

    for with_compute, with_copies in ((True, True), (True, True)):  # warm-up: kernels, pinned buffers
        timed(with_compute, with_copies)
    compute_s, copy_s, both_s = (min(timed(c, k) for _ in range(3)) for c, k in ((True, False), (False, True),
                                                                                   (True, True)))
    io.close()
    share = min(1.0, max(0.0, (compute_s + copy_s - both_s) / copy_s))
    return {"hidden_copy_share": round(share, 3), "compute_s": round(compute_s, 4), "copy_s": round(copy_s, 4),
            "both_s": round(both_s, 4), "pool_allocations": io.pool.allocations, "pool_reuses": io.pool.reuses}


def decode_on_device(device: str, repeats: int = 50) -> dict[str, Any]:
    """One micro-batch's activation of the reference workload ([8, 32, 512] float32, 512 KiB) int8-coded,
    as the wire keeps it in a GPU's process: its frames cross to ``device`` and are decoded there,
    against decoded on the host and crossing as float32 (see the module docstring)."""
    io = DeviceIO(device)
    encoded = get_codec("int8").encode(torch.randn(8, 32, 512, generator=torch.Generator().manual_seed(2)))
    on_host = decode(encoded)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(received: Any) -> tuple[float, torch.Tensor]:
        """Seconds per ``io.to_device(received())`` (the host's decode, where it does one, counted)."""
        out = io.to_device(received())[0]
        sync()
        started = time.perf_counter()
        for _ in range(repeats):
            out = io.to_device(received())[0]
        sync()
        return (time.perf_counter() - started) / repeats, out

    kept_s, kept = timed(lambda: [encoded])
    host_s, moved = timed(lambda: [decode(encoded)])
    io.close()
    return {"ok": torch.equal(kept.cpu(), on_host) and torch.equal(moved.cpu(), on_host),
            "h2d_bytes_ratio": round(encoded.nbytes / on_host.nbytes, 4),
            "decode_on_device_speedup": round(host_s / kept_s, 3), "kept_us": round(kept_s * 1e6, 1),
            "decoded_on_host_us": round(host_s * 1e6, 1)}


def measure(device: str, steps: int) -> dict[str, Any]:
    exact = [case("zmq_fp32"), case("zmq_bf16", "bf16")]
    if device == "cpu":
        result: dict[str, Any] = {"cuda": torch.cuda.is_available(), "device": "cpu", "dry_run": True}
        result.update(run(compare(SMALL, ["cpu", "cpu"], exact, steps)))
        result["int8_gbps"] = codec_gbps("cpu", 1 << 20, repeats=3)
        result["hidden_copy_share"] = None  # nothing is copied on the CPU
    else:
        gpus = torch.cuda.device_count()
        result = {"cuda": True, "device": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__}
        more = [case("zmq_fp16", "fp16"),
                case("zmq_int8_wire", bound="lossy", activation_codec="int8", gradient_codec="int8"),
                case("zmq_compiled", bound="compiled", torch_compile=True)]
        result.update(run(compare(REFERENCE, ["cuda:0", "cuda:0"], exact + more, steps)))
        if gpus >= 2:
            result.update(run(compare(REFERENCE, ["cuda:0", "cuda:1"], [case("nccl_fp32", transport="dist")], steps)))
        else:
            result["shared_gpu_refused"] = run(shared_gpu_refused("cuda:0"))
        result["int8_gbps"] = codec_gbps("cuda:0", 16 << 20)
        result["decode_on_device"] = decode_on_device("cuda:0")
        result.update(hidden_copy_share("cuda:0"))
    checks = [value["ok"] for value in result.values() if isinstance(value, dict) and "ok" in value]
    result["ok"] = bool(checks) and all(checks)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto",
                        help="auto: the GPUs (or only a note where there is none); cpu: the dry run on the CPU")
    parser.add_argument("--steps", type=int, default=3, help="training steps per comparison")
    args = parser.parse_args(argv)
    if args.device == "auto" and not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (python -m benchmarks.gpu --device cpu runs the dry run)")
        print(json.dumps({"cuda": False, "reason": "torch.cuda.is_available() is False", "torch": torch.__version__,
                          "ok": True}))
        return 0
    started = time.perf_counter()
    result = measure("cpu" if args.device == "cpu" else "cuda", args.steps)
    result["total_s"] = round(time.perf_counter() - started, 1)
    for key, value in result.items():
        print(f"{key:>18}: {value}")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
