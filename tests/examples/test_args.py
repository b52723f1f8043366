"""The training examples' flags: a value the job would refuse once its cluster had started is a usage
error at once (each of these used to start the nodes, then end in a traceback from a stage or the spec)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from examples import train_gpt, train_hf

SCRIPTS = {"train_gpt": train_gpt.parse_args, "train_hf": train_hf.parse_args}


def refused(parse: Callable[[list[str]], Any], argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        parse(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("argv,says", [
    (["--schedule", "foo"], "argument --schedule: invalid choice: 'foo'"),
    (["--lr", "-1"], "argument --lr: -1.0 is not above 0"),
    (["--lr", "nan"], "argument --lr: nan is not above 0"),
    (["--dim", "66"], "--dim (66) must be divisible by the 4 attention heads"),
    (["--batch-size", "10", "--micro-batches", "4"], "--batch-size (10) must be divisible by --micro-batches (4)"),
])
def test_flags_the_job_would_refuse_are_usage_errors(script: str, argv: list[str], says: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert says in refused(SCRIPTS[script], argv, capsys)


def test_train_gpt_checks_the_width_against_its_own_heads(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--dim (64) must be divisible by the 3 attention heads" in refused(
        train_gpt.parse_args, ["--dim", "64", "--heads", "3"], capsys)
    assert train_gpt.parse_args(["--dim", "66", "--heads", "3"]).heads == 3


def test_train_hf_needs_a_block_for_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--layers (2) must be at least the model stages (3: --stages 3)" in refused(
        train_hf.parse_args, ["--layers", "2", "--stages", "3"], capsys)
    # Found by review: an interleaved or V-shaped schedule cuts two model stages a rank, and the split points
    # were made for one: every such job was refused once its cluster had started.
    assert "--layers (3) must be at least the model stages (4: --stages 2 x 2 with --schedule zbv)" in refused(
        train_hf.parse_args, ["--layers", "3", "--stages", "2", "--schedule", "zbv"], capsys)
    assert train_hf.model_stages(train_hf.parse_args(["--layers", "4", "--schedule", "dualpipev"])) == 4


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_schedule_the_spec_knows_is_a_choice(script: str) -> None:
    for name in ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev", "auto"):
        assert SCRIPTS[script](["--schedule", name]).schedule == name
