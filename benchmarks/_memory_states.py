"""benchmarks.memory's ``states`` part: a stage's training state in bytes per parameter, the stash in
fewer bits, and what each lossy setting costs the GPT example's loss.

**Bytes per parameter.** The reference workload (8 residual MLP blocks of width 512, AdamW)
on 2 pipeline stages x 2 data-parallel replicas, one 4-node ``LocalCluster`` for every
setting: fp32 Adam's moments, bf16, int8 and int4 ones, each without ZeRO and with ZeRO-1
and ZeRO-2. Two steps each; the second step's ``StepStats`` count from the tensors what
each stage held when its first optimizer step ran: ``parameter_bytes``, ``gradient_bytes``
(with ZeRO-2 only its runs'; with ZeRO-1 the buckets stay whole) and
``optimizer_state_bytes``. ``state_bytes_per_param_<setting>_dp2`` is the largest over the
stages of their sum over the stage's parameter count (fp32 Adam: 4 + 4 + 8 = 16).

**Stash.** The reference workload on 2 stages, 1F1B, 8 micro-batches, SGD, once per
``stash_codec``: ``stash_ratio_<codec>`` is the stages' ``peak_stash_bytes`` with the
codec over without.

**Loss.** The GPT example (``examples/train_gpt.py``'s model and data: 4 blocks of width
128, AdamW lr 1e-3, 2 stages, 4 micro-batches of 8 sequences) trained ``--loss-steps``
(300) steps with fp32 Adam and with each lossy setting, each from the same weights on
the same batches. A setting's final loss is the mean of its last 30 steps' losses (one
step's loss is one batch's: the mean over 30 evens out which batch came last);
``loss_delta_pct_<setting>`` is its difference from fp32 Adam's in percent of it and
``max_loss_delta_pct`` the largest.

DeepSpeed's pipeline engine is the peer (docs/benchmarks.md); when ``deepspeed`` is not
installed (it is not a dependency) the summary says so instead of measuring it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
from typing import Any

import torch

from benchmarks._torch_pipelining import BATCH_SHAPE, NUM_BLOCKS, NUM_MICROBATCHES, reference_batch

# name -> job options; every one on 2 pipeline stages x 2 replicas.
STATE_SETTINGS: dict[str, dict[str, Any]] = {
    f"{states}{zero}": {"optimizer_states": states, **({"zero_stage": int(zero[-1])} if zero else {})}
    for states in ("fp32", "bf16", "int8", "int4") for zero in ("", "_zero1", "_zero2")}
STASH_CODECS = ("bf16", "fp8", "int8")
# name -> job options of the GPT runs whose final loss is compared with fp32 Adam's.
LOSS_SETTINGS: dict[str, dict[str, Any]] = {
    "fp32": {}, "bf16_states": {"optimizer_states": "bf16"}, "int8_states": {"optimizer_states": "int8"},
    "int4_states": {"optimizer_states": "int4"}, "int8_stash": {"stash_codec": "int8"},
    "bf16_stash": {"stash_codec": "bf16"}}
LOSS_TAIL = 30


async def state_bytes() -> dict[str, Any]:
    """``state_bytes_per_param_<setting>_dp2`` for every setting of :data:`STATE_SETTINGS`."""
    from schedulers import LocalCluster

    inputs, targets = reference_batch()
    summary: dict[str, Any] = {}
    async with LocalCluster(nodes=4) as cluster:
        for name, options in STATE_SETTINGS.items():
            async with await cluster.train(
                    model="examples.models:residual_mlp", model_kwargs={"blocks": NUM_BLOCKS, "dim": BATCH_SHAPE[-1]},
                    loss="torch.nn.functional:mse_loss", optimizer=("torch.optim:AdamW", {"lr": 1e-3}),
                    pipeline_stages=2, data_parallel=2, schedule="1f1b", micro_batches=NUM_MICROBATCHES // 2,
                    seed=0, **options) as job:
                await job.step(inputs, targets)
                stats = await job.step(inputs, targets)
            per_stage = [(p + g + s) / (p / 4) for p, g, s in
                         zip(stats.parameter_bytes, stats.gradient_bytes, stats.optimizer_state_bytes)]
            summary[f"state_bytes_per_param_{name}_dp2"] = round(max(per_stage), 3)
            parts = [round(max(values) / (min(stats.parameter_bytes) / 4), 3) for values in
                     (stats.parameter_bytes, stats.gradient_bytes, stats.optimizer_state_bytes)]
            print(f"{name:<12} bytes per parameter, largest stage: {max(per_stage):6.3f}"
                  f"  (parameters {parts[0]}, gradients {parts[1]}, optimizer state {parts[2]})")
    return summary


async def stash() -> dict[str, Any]:
    """``stash_ratio_<codec>``: the stages' peak stash with each codec over without."""
    from schedulers import LocalCluster

    inputs, targets = reference_batch()
    peaks: dict[str, int] = {}
    async with LocalCluster(nodes=2) as cluster:
        for codec in ("none", *STASH_CODECS):
            async with await cluster.train(
                    model="examples.models:residual_mlp", model_kwargs={"blocks": NUM_BLOCKS, "dim": BATCH_SHAPE[-1]},
                    loss="torch.nn.functional:mse_loss", optimizer=("torch.optim:SGD", {"lr": 0.01}),
                    pipeline_stages=2, schedule="1f1b", micro_batches=NUM_MICROBATCHES, seed=0,
                    stash_codec=codec) as job:
                stats = await job.step(inputs, targets)
            peaks[codec] = sum(stats.peak_stash_bytes)
            print(f"stash_codec={codec:<5} peak stash, both stages: {peaks[codec] / 2**20:7.2f} MiB")
    return {f"stash_ratio_{codec}": round(peaks[codec] / peaks["none"], 4) for codec in STASH_CODECS}


async def losses(steps: int) -> dict[str, Any]:
    """The GPT example's final loss per setting of :data:`LOSS_SETTINGS`, and each one's difference from fp32's."""
    from examples.data import char_batches
    from examples.models import gpt, lm_loss
    from schedulers import LocalCluster

    tails: dict[str, float] = {}
    async with LocalCluster(nodes=2) as cluster:
        for name, options in LOSS_SETTINGS.items():
            async with await cluster.train(
                    model=gpt, model_kwargs={"vocab_size": 128, "dim": 128, "layers": 4, "heads": 4, "context": 64},
                    loss=lm_loss, optimizer=(torch.optim.AdamW, {"lr": 1e-3}), pipeline_stages=2, schedule="1f1b",
                    micro_batches=4, seed=0, data=char_batches,
                    data_kwargs={"batch_size": 32, "context": 64, "split": "train", "seed": 0}, **options) as job:
                trace = [(await job.step()).loss for _ in range(steps)]
            tails[name] = statistics.fmean(trace[-LOSS_TAIL:])
            print(f"GPT {name:<12} loss after {steps} steps (mean of the last {LOSS_TAIL}): {tails[name]:.4f}")
    summary: dict[str, Any] = {f"final_loss_{name}": round(tail, 4) for name, tail in tails.items()}
    deltas = {name: abs(tail - tails["fp32"]) / tails["fp32"] * 100 for name, tail in tails.items() if name != "fp32"}
    summary.update({f"loss_delta_pct_{name}": round(delta, 3) for name, delta in deltas.items()})
    summary["max_loss_delta_pct"] = round(max(deltas.values()), 3)
    summary["loss_steps"] = steps
    return summary


def deepspeed_peer(stages: int, layers: int, dim: int) -> dict[str, Any]:
    """DeepSpeed's pipeline engine on the slices part's model, when it is installed (it is no dependency).

    ``stages`` processes of :mod:`benchmarks._deepspeed_peer` (gloo, one per stage, the layers
    given as ``LayerSpec``s) train two steps with SGD and with Adam, once with ``dim``-wide
    layers and once 4 wide (the idle run, as actorpipe's): each stage's added peak RSS in
    slices of the model, ``deepspeed_added_peak_slices_{sgd,adam}_<stages>stages`` the largest.
    """
    if importlib.util.find_spec("deepspeed") is None:
        print("deepspeed is not installed: its pipeline engine was not measured")
        return {"deepspeed": "not installed"}
    slice_bytes = layers * (dim * dim + dim) * 4 / stages
    summary: dict[str, Any] = {}
    for optimizer in ("sgd", "adam"):
        try:
            idle, full = (_deepspeed_peaks(stages, layers, width, optimizer) for width in (4, dim))
        except RuntimeError as exc:
            print(f"DeepSpeed's pipeline engine did not run: {exc}")
            summary["deepspeed"] = f"failed: {str(exc)[-300:]}"
            return summary
        added = [round((peak - base) / slice_bytes, 2) for peak, base in zip(full, idle)]
        print(f"deepspeed {optimizer:>4} layer specs  added peak per stage, in slices: "
              + " / ".join(f"{a:.1f}" for a in added))
        summary[f"deepspeed_added_peak_slices_{optimizer}_{stages}stages"] = max(added)
        summary[f"deepspeed_added_peak_slices_{optimizer}_{stages}stages_per_stage"] = added
    summary["deepspeed"] = importlib.metadata.version("deepspeed")
    return summary


def _deepspeed_peaks(stages: int, layers: int, dim: int, optimizer: str,
                     module: str = "benchmarks._deepspeed_peer") -> list[int]:
    """Each stage's peak RSS (stage order) after two steps of DeepSpeed's engine (``module``, one
    process per rank, each printing its stage and peak as the last line of its output).

    Raises:
        RuntimeError: a rank failed or ran past 10 minutes (its output's tail says why).
    """
    with socket.socket() as probe:  # a free port for torch.distributed's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", module, "--dim", str(dim), "--layers", str(layers),
               "--optimizer", optimizer]
    ranks = []
    for rank in range(stages):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(stages),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"}
        ranks.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for process in ranks:
            out, _ = process.communicate(timeout=600)
            outputs.append(out)
            if process.returncode != 0:
                raise RuntimeError(f"rank {len(outputs) - 1} exited with {process.returncode}: {out[-2000:]}")
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError("a rank ran past 10 minutes") from exc
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    peaks = {}
    for out in outputs:
        found = json.loads(out.strip().splitlines()[-1])
        peaks[found["stage"]] = found["peak_rss_bytes"]
    return [peaks[stage] for stage in range(stages)]
