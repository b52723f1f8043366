# Run: python -m examples.train_hf   (a transformers GPT-2 over 2 pipeline stages; about a minute on 2 CPU cores)
"""Trains a Hugging Face ``transformers`` GPT-2, as the library builds it, over a pipeline.

The model is ``GPT2LMHeadModel`` from a ``GPT2Config`` (nothing is downloaded), with its
default tied embeddings. Nothing adapts it: the job names the factory and where the
second stage begins (``split_points=["transformer.h.2"]``); each stage traces the model
with torch's pipelining front end on the data factory's first micro-batch and keeps its
half (for that micro-batch's shape alone, ``dynamic_shapes=False``: every batch here has
the same length, and such a trace costs each stage about half the time). The tied
embedding lives on both stages and stays one tensor in effect: the stages sum its
gradients before every step. At the end the state is gathered under
GPT-2's own names and loaded into a fresh ``GPT2LMHeadModel`` with ``strict=True``, which
then measures the validation loss by itself. The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import torch

from examples import positive_int
from examples.data import char_batches
from examples.hf import gpt2
from examples.models import lm_loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.train_hf", description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=positive_int, default=2, help="pipeline stages (one worker node each)")
    parser.add_argument("--schedule", default="1f1b", help="pipeline schedule (gpipe, 1f1b, zero_bubble)")
    parser.add_argument("--micro-batches", type=positive_int, default=4, help="micro-batches per step")
    parser.add_argument("--steps", type=positive_int, default=150, help="optimizer steps")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="sequences per global batch")
    parser.add_argument("--context", type=positive_int, default=64, help="characters per sequence")
    parser.add_argument("--layers", type=positive_int, default=4, help="GPT-2 blocks")
    parser.add_argument("--dim", type=positive_int, default=128, help="model width")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")
    return parser.parse_args(argv)


async def train(args: argparse.Namespace) -> dict[str, Any]:
    from actors import LocalCluster

    model_kwargs = {"layers": args.layers, "dim": args.dim, "heads": 4, "vocab": 128, "positions": args.context}
    data_kwargs = {"batch_size": args.batch_size, "context": args.context}
    step = args.layers // args.stages
    split_points = [f"transformer.h.{step * s}" for s in range(1, args.stages)]
    started = time.perf_counter()
    async with LocalCluster(nodes=args.stages) as cluster:
        job = await cluster.train(
            model="examples.hf:gpt2", model_kwargs=model_kwargs, split_points=split_points,
            loss="examples.models:lm_loss", optimizer=("torch.optim:AdamW", {"lr": args.lr}),
            pipeline_stages=args.stages, schedule=args.schedule, micro_batches=args.micro_batches,
            data="examples.data:char_batches", data_kwargs=data_kwargs,
            dynamic_shapes=False)  # every batch is --context characters long: traced for that one shape, faster
        try:
            losses = []
            for index in range(args.steps):
                stats = await job.step()
                losses.append(stats.loss)
                if index % 25 == 0 or index == args.steps - 1:
                    print(f"step {index:4d}  loss {stats.loss:.3f}  tied {stats.tied}", flush=True)
            state = await job.state_dict()
        finally:
            await job.close()
    model = gpt2(**model_kwargs)
    model.load_state_dict(state, strict=True)  # GPT-2's own keys: the gathered state is the model's
    model.eval()
    val = char_batches(**data_kwargs, split="val")
    with torch.no_grad():
        val_loss = sum(float(lm_loss(model(val(i)[0]).logits, val(i)[1])) for i in range(4)) / 4
    return {"first_loss": losses[0], "final_loss": losses[-1], "val_loss": val_loss,
            "tied": stats.tied, "keys": len(state), "wall_s": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> None:
    result = asyncio.run(train(parse_args(argv)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
