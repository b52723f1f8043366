"""actorpipe's examples: models, data factories and the training scripts that use them."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from stages.sections import SCHEDULE_NAMES


def refused(exc: ValueError) -> NoReturn:
    """Ends a training example whose job the cluster refused (more stages than the model has layers,
    more than the nodes): one line, ``error: ...``, exit code 2, as argparse does for a bad flag. The
    refusal's remote traceback would show only the head's insides."""
    print(f"error: {getattr(exc, 'message', exc)}", file=sys.stderr)
    raise SystemExit(2)


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (``--micro-batches 0`` is a usage error, not a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number above 0 (``--lr -1`` is a usage error, not the optimizer's traceback
    from a stage)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{value} is not above 0")
    return value


def training_parser(prog: str, description: str, *, steps: int, batch_size: int, lr: float,
                    layers_help: str) -> argparse.ArgumentParser:
    """The flags the training examples share: the pipeline, the batch, the model's size, the
    learning rate. A value the job would refuse after its cluster started (an unknown schedule,
    a count below one, a learning rate at or below 0) is a usage error here instead."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--stages", type=positive_int, default=2, help="pipeline stages (one worker node each)")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULE_NAMES, help="pipeline schedule")
    parser.add_argument("--micro-batches", type=positive_int, default=4, help="micro-batches per step")
    parser.add_argument("--steps", type=positive_int, default=steps, help="optimizer steps")
    parser.add_argument("--batch-size", type=positive_int, default=batch_size, help="sequences per global batch")
    parser.add_argument("--context", type=positive_int, default=64, help="characters per sequence")
    parser.add_argument("--layers", type=positive_int, default=4, help=layers_help)
    parser.add_argument("--dim", type=positive_int, default=128, help="model width")
    parser.add_argument("--lr", type=positive_float, default=lr, help="AdamW learning rate")
    return parser


def check_training_args(parser: argparse.ArgumentParser, args: argparse.Namespace, *, heads: int) -> None:
    """Usage errors for flags that do not fit together (exits with status 2, as argparse does)."""
    if args.batch_size % args.micro_batches != 0:
        parser.error(f"--batch-size ({args.batch_size}) must be divisible by --micro-batches ({args.micro_batches})")
    if args.dim % heads != 0:
        parser.error(f"--dim ({args.dim}) must be divisible by the {heads} attention heads")
