# Run: python -m examples.train_hf   (a transformers GPT-2 over 2 pipeline stages; about a minute on 2 CPU cores)
"""Trains a Hugging Face ``transformers`` GPT-2, as the library builds it, over a pipeline.

The model is ``GPT2LMHeadModel`` from a ``GPT2Config`` (nothing is downloaded), with its
default tied embeddings. Nothing adapts it: the job names the factory and where the
second stage begins (``split_points=["transformer.h.2"]``); each stage traces the model
with torch's pipelining front end on the data factory's first micro-batch and keeps its
half (for that micro-batch's shape alone, ``dynamic_shapes=False``: every batch here has
the same length, and such a trace costs each stage about half the time). The tied
embedding lives on both stages and stays one tensor in effect: the stages sum its
gradients before every step. The job evaluates itself on the validation split every
``--eval-every`` steps (the Trainer's ``eval_steps``) and once more at the end. Then the
state is gathered under GPT-2's own names and loaded into a fresh ``GPT2LMHeadModel``
with ``strict=True``, which measures the validation loss by itself on the same batches:
the two agree. The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import torch

from examples import check_training_args, refused, training_parser
from examples.data import char_batches
from examples.hf import gpt2
from examples.models import lm_loss


HEADS = 4  # GPT-2's attention heads here: --dim must be a multiple
VAL_BATCHES = 4  # the validation set: the validation split's first batches


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = training_parser("python -m examples.train_hf", __doc__.splitlines()[0], steps=150, batch_size=16,
                             lr=2e-3, layers_help="GPT-2 blocks (at least one a stage)")
    parser.add_argument("--eval-every", type=int, default=50, metavar="N",
                        help="the job evaluates on the validation split every N steps (0: only at the end)")
    args = parser.parse_args(argv)
    check_training_args(parser, args, heads=HEADS)
    if args.eval_every < 0:
        parser.error(f"--eval-every must be 0 or more, got {args.eval_every}")
    stages = model_stages(args)
    if args.layers < stages:
        how = f"--stages {args.stages}" + (f" x 2 with --schedule {args.schedule}" if stages > args.stages else "")
        parser.error(f"--layers ({args.layers}) must be at least the model stages ({stages}: {how}): each stage "
                     "begins at a block")
    return args


def model_stages(args: argparse.Namespace) -> int:
    """How many model stages the job cuts GPT-2 into: two per rank with an interleaved or V-shaped schedule."""
    return args.stages * (2 if args.schedule in ("interleaved", "zbv", "dualpipev") else 1)


async def train(args: argparse.Namespace) -> dict[str, Any]:
    from actors import LocalCluster

    model_kwargs = {"layers": args.layers, "dim": args.dim, "heads": HEADS, "vocab": 128, "positions": args.context}
    data_kwargs = {"batch_size": args.batch_size, "context": args.context}
    stages = model_stages(args)  # each begins at a block (interleaved, zbv and dualpipev: two a rank)
    split_points = [f"transformer.h.{args.layers * s // stages}" for s in range(1, stages)]
    started = time.perf_counter()
    async with LocalCluster(nodes=args.stages) as cluster:
        try:
            job = await cluster.train(
                model="examples.hf:gpt2", model_kwargs=model_kwargs, split_points=split_points,
                loss="examples.models:lm_loss", optimizer=("torch.optim:AdamW", {"lr": args.lr}),
                no_weight_decay="biases_and_norms",  # as Hugging Face's Trainer leaves them
                pipeline_stages=args.stages, schedule=args.schedule, micro_batches=args.micro_batches,
                data="examples.data:char_batches", data_kwargs=data_kwargs,
                eval_data="examples.data:char_batches", eval_data_kwargs={**data_kwargs, "split": "val"},
                eval_every=args.eval_every, eval_batches=VAL_BATCHES,
                dynamic_shapes=False)  # every batch is --context characters long: traced for that one shape, faster
        except ValueError as exc:  # settings the cluster refused: as a bad flag
            refused(exc)
        try:
            losses = []
            for index in range(args.steps):
                stats = await job.step()
                losses.append(stats.loss)
                if stats.eval_loss is not None:
                    print(f"step {index:4d}  loss {stats.loss:.3f}  validation {stats.eval_loss:.3f}", flush=True)
                elif index % 25 == 0 or index == args.steps - 1:
                    print(f"step {index:4d}  loss {stats.loss:.3f}  tied {stats.tied}", flush=True)
            evaluated = await job.evaluate()  # the validation split, as the job evaluates itself
            state = await job.state_dict()
        finally:
            await job.close()
    model = gpt2(**model_kwargs)
    model.load_state_dict(state, strict=True)  # GPT-2's own keys: the gathered state is the model's
    model.eval()
    val = char_batches(**data_kwargs, split="val")
    with torch.no_grad():
        val_loss = sum(float(lm_loss(model(val(i)[0]).logits, val(i)[1])) for i in range(VAL_BATCHES)) / VAL_BATCHES
    return {"first_loss": losses[0], "final_loss": losses[-1], "val_loss": val_loss, "job_val_loss": evaluated.loss,
            "tied": stats.tied, "keys": len(state), "wall_s": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> None:
    result = asyncio.run(train(parse_args(argv)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
