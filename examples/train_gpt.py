# Run: python -m examples.train_gpt   (2 pipeline stages, 1F1B, 4 micro-batches; about 1.5 min on 2 CPU cores)
#      python -m examples.train_gpt --single-process   (the same training in this process, no cluster)
#      python -m examples.train_gpt --checkpoint-every 100 --resume   (saves itself; stopped, it goes on from there)
"""Trains a small character-level GPT on the Python standard library's sources, pipelined.

Starts a LocalCluster (a head and one worker node per pipeline stage, on this machine),
cuts the GPT into ``--stages`` stages and trains it with the 1F1B schedule; each stage
reads its own data (the first stage the inputs, the last the targets) from
``examples.data:char_batches``. At the end it gathers the model, measures the
validation loss, prints a sample of generated Python, and saves the loss curve to
``OUT/loss.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import torch
from tqdm import tqdm

from examples import check_training_args, positive_int, refused, training_parser
from examples.data import char_batches, decode, encode
from examples.models import generate, gpt, lm_loss, token_accuracy
from stages import parameter_groups

PROMPT = "def "
# AdamW's weight decay on the weight matrices and embeddings only, as GPT training (and Megatron,
# Hugging Face's Trainer) does: biases and the layer norms' weights stay undecayed.
NO_WEIGHT_DECAY = ("biases_and_norms",)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; defaults finish in a few minutes on 2 CPU cores."""
    parser = training_parser("python -m examples.train_gpt", __doc__.splitlines()[0], steps=600, batch_size=32,
                             lr=1e-3, layers_help="transformer blocks")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and data seed")
    parser.add_argument("--eval-batches", type=positive_int, default=8,
                        help="validation batches at the end (and at each --eval-every)")
    parser.add_argument("--eval-every", type=int, default=100, metavar="N",
                        help="evaluate on the validation batches every N steps (pipelined: the job does, "
                             "evaluation.eval_every; 0: only at the end)")
    parser.add_argument("--sample-tokens", type=int, default=300, help="characters to generate at the end")
    parser.add_argument("--out", default="out/gpt", help="folder for loss.png (and checkpoints/)")
    parser.add_argument("--single-process", action="store_true", help="train in this process with plain PyTorch")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="the job saves itself into OUT/checkpoints every N steps (0: never)")
    parser.add_argument("--resume", action="store_true",
                        help="go on from the last checkpoint in OUT/checkpoints, if there is one")
    args = parser.parse_args(argv)
    check_training_args(parser, args, heads=args.heads)
    for flag in ("checkpoint_every", "eval_every"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be 0 or more, got {getattr(args, flag)}")
    if args.single_process and (args.checkpoint_every or args.resume):
        parser.error("--checkpoint-every and --resume are the pipelined job's: leave out --single-process")
    return args


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"vocab_size": 128, "dim": args.dim, "layers": args.layers, "heads": args.heads, "context": args.context}


def data_kwargs(args: argparse.Namespace, split: str = "train") -> dict[str, Any]:
    return {"batch_size": args.batch_size, "context": args.context, "split": split, "seed": args.seed}


async def train(args: argparse.Namespace) -> dict[str, Any]:
    """Trains the GPT for ``args.steps`` steps.

    Returns:
        ``{"losses": [...], "step_times_s": [...], "wall_s": float, "state": state_dict}``.
    """
    start = time.perf_counter()
    if args.single_process:
        history = _train_single_process(args)
    else:
        history = await _train_pipelined(args)
    history["wall_s"] = time.perf_counter() - start
    return history


def _progress(args: argparse.Namespace) -> tqdm:
    return tqdm(total=args.steps, desc="train", unit="step", dynamic_ncols=True)


def _log(bar: tqdm, step: int, loss: float, steps: int, validation: tuple[float, float] | None = None) -> None:
    bar.set_postfix(loss=f"{loss:.3f}")
    bar.update(1)
    # A line every tenth of the run keeps the descent readable once the bar is gone; each evaluation has its own.
    if validation is not None:
        bar.write(f"step {step:4d}  loss {loss:.4f}  validation {validation[0]:.4f}, accuracy {validation[1]:.1%}")
    elif step % max(1, steps // 10) == 0 or step == steps - 1:
        bar.write(f"step {step:4d}  loss {loss:.4f}")


async def _train_pipelined(args: argparse.Namespace) -> dict[str, Any]:
    from schedulers import LocalCluster

    losses: list[float] = []
    step_times: list[float] = []
    bubbles: list[float] = []
    evaluated: list[tuple[int, float, float]] = []  # (steps applied, validation loss, accuracy): the job's own
    async with LocalCluster(nodes=args.stages) as cluster:
        # Factories by themselves (their import paths are derived: nodes import them by path).
        try:
            job = await cluster.train(
                model=gpt,
                model_kwargs=model_kwargs(args),
                loss=lm_loss,
                optimizer=(torch.optim.AdamW, {"lr": args.lr}),
                no_weight_decay=NO_WEIGHT_DECAY,
                pipeline_stages=args.stages,
                schedule=args.schedule,
                micro_batches=args.micro_batches,
                seed=args.seed,
                data=char_batches,
                data_kwargs=data_kwargs(args),
                **_checkpointing(args),
                **_evaluation(args),
            )
        except ValueError as exc:  # settings the cluster refused (e.g. more stages than layers): as a bad flag
            refused(exc)
        first = min(job.resumed_step, args.steps)
        if job.resumed_from is not None:
            print(f"resumed from {job.resumed_from} at step {job.resumed_step}")
        try:
            with _progress(args) as bar:
                bar.update(first)
                for step in range(first, args.steps):
                    stats = await job.step()
                    losses.append(stats.loss)
                    step_times.append(stats.step_time_s)
                    bubbles.append(stats.bubble_fraction)
                    if stats.eval_loss is not None:
                        evaluated.append((step + 1, stats.eval_loss, stats.eval_metrics["accuracy"]))
                    _log(bar, step, stats.loss, args.steps, evaluated[-1][1:] if stats.eval_loss is not None else None)
            state = await job.state_dict()
        finally:
            await job.close()
    return {"losses": losses, "step_times_s": step_times, "bubble_fractions": bubbles, "state": state,
            "first_step": first, "evaluated": evaluated}


def _checkpointing(args: argparse.Namespace) -> dict[str, Any]:
    """The job's own saves and resume (its ``checkpointing`` section), in ``OUT/checkpoints``."""
    if not args.checkpoint_every and not args.resume:
        return {}
    return {"checkpoint_dir": os.path.join(args.out, "checkpoints"), "checkpoint_every": args.checkpoint_every,
            "resume_from_checkpoint": args.resume}


def _evaluation(args: argparse.Namespace) -> dict[str, Any]:
    """The job's own evaluations (its ``evaluation`` section) on the validation split, every ``--eval-every`` steps."""
    if not args.eval_every:
        return {}
    return {"eval_data": char_batches, "eval_data_kwargs": data_kwargs(args, split="val"),
            "eval_every": args.eval_every, "eval_batches": args.eval_batches, "eval_metrics": token_accuracy}


def _train_single_process(args: argparse.Namespace) -> dict[str, Any]:
    # One thread, like each stage process: the comparison with the pipeline is fair.
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = gpt(**model_kwargs(args))
    optimizer = torch.optim.AdamW(parameter_groups(model.named_parameters(remove_duplicate=False), NO_WEIGHT_DECAY),
                                  lr=args.lr)
    batch = char_batches(**data_kwargs(args))
    losses: list[float] = []
    step_times: list[float] = []
    evaluated: list[tuple[int, float, float]] = []
    with _progress(args) as bar:
        for step in range(args.steps):
            began = time.perf_counter()
            inputs, targets = batch(step)
            loss = lm_loss(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step_times.append(time.perf_counter() - began)
            losses.append(loss.item())
            validation = None
            if args.eval_every and (step + 1) % args.eval_every == 0:
                validation = evaluate(model, args)
                evaluated.append((step + 1, *validation))
                model.train()
            _log(bar, step, losses[-1], args.steps, validation)
    return {"losses": losses, "step_times_s": step_times, "state": model.state_dict(), "evaluated": evaluated}


@torch.no_grad()
def evaluate(model: torch.nn.Module, args: argparse.Namespace) -> tuple[float, float]:
    """Mean loss and next-character accuracy over ``args.eval_batches`` batches of the validation split."""
    batch = char_batches(**data_kwargs(args, split="val"))
    model.eval()
    logits = [(model(inputs), targets) for inputs, targets in map(batch, range(args.eval_batches))]
    losses = [lm_loss(out, targets).item() for out, targets in logits]
    right = [token_accuracy(out, targets)["accuracy"].item() for out, targets in logits]
    return sum(losses) / len(losses), sum(right) / len(right)


def plot_losses(losses: list[float], val_loss: float, path: str, first_step: int = 0,
                evaluated: list[tuple[int, float, float]] | None = None) -> None:
    """Saves the training loss per step (from ``first_step``), the validation loss at each evaluation
    (``evaluated``: steps applied, loss, accuracy) and at the end, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(first_step, first_step + len(losses)), losses, lw=1, label="train (global batch)")
    if evaluated:
        ax.plot([at for at, *_ in evaluated], [loss for _, loss, _ in evaluated], "o-", color="tab:orange", ms=3, lw=1,
                label="validation (every --eval-every)")
    ax.axhline(val_loss, color="tab:orange", ls="--", lw=1, label=f"validation at the end: {val_loss:.3f}")
    ax.axhline(math.log(128), color="gray", ls=":", lw=1, label="uniform guess: ln 128")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title("character-level GPT on the Python standard library")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from transport.loop import run

    args = parse_args(argv)
    how = "in this process" if args.single_process else (
        f"on {args.stages} stages, {args.schedule}, {args.micro_batches} micro-batches")
    print(f"training a {args.layers}-layer, {args.dim}-wide GPT for {args.steps} steps {how}")
    history = run(train(args))
    losses = history["losses"]

    model = gpt(**model_kwargs(args))
    model.load_state_dict(history["state"])
    val_loss, val_accuracy = evaluate(model, args)
    trained = f"train loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "no step left to train"
    print(f"{trained}, validation loss {val_loss:.3f} (accuracy {val_accuracy:.1%}), {history['wall_s']:.0f} s")
    if history.get("bubble_fractions"):
        step_times, bubbles = history["step_times_s"], history["bubble_fractions"]
        print(f"mean step {sum(step_times) / len(step_times):.3f} s, mean bubble {sum(bubbles) / len(bubbles):.0%}")

    sample = generate(model, encode(PROMPT), args.sample_tokens, generator=torch.Generator().manual_seed(args.seed))
    print(f"--- sample ---\n{decode(sample)}\n--- end of sample ---")

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "loss.png")
    plot_losses(losses, val_loss, path, history.get("first_step", 0), history.get("evaluated"))
    print(f"loss curve: {path}")


if __name__ == "__main__":
    main()
