"""Tests for examples/data.py.

Run: .venv/bin/python -m pytest -q tests/examples/test_data.py
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.data import char_batches, char_corpus, decode, encode, regression_batches

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
SMALL = 50_000  # corpus bytes for the fast cases


def test_corpus_is_nonempty_ascii_python() -> None:
    corpus = char_corpus(SMALL)
    assert len(corpus) == SMALL
    assert corpus.isascii()
    assert "def " in corpus and "import " in corpus


def test_corpus_is_a_prefix_of_a_longer_corpus() -> None:
    assert char_corpus(2 * SMALL).startswith(char_corpus(SMALL))


def test_corpus_rejects_a_nonpositive_size() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        char_corpus(0)


@pytest.mark.parametrize("text", ["", "def f(x):\n\treturn x + 1\n", "caf\u00e9 \u2192 ok"])
def test_encode_decode_round_trip(text: str) -> None:
    ids = encode(text)
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert all(0 <= i < 128 for i in ids.tolist())
    assert decode(ids) == text.encode("ascii", errors="replace").decode("ascii")


@pytest.mark.parametrize("split", ["train", "val"])
def test_char_batches_shapes_and_dtypes(split: str) -> None:
    inputs, targets = char_batches(batch_size=5, context=24, max_bytes=SMALL, split=split)(0)
    assert inputs.shape == targets.shape == (5, 24)
    assert inputs.dtype == targets.dtype == torch.int64
    assert int(inputs.min()) >= 0 and int(inputs.max()) < 128


def test_char_batches_targets_are_inputs_shifted_by_one_in_the_corpus() -> None:
    corpus = char_corpus(SMALL)
    train_text = corpus[: int(0.9 * len(corpus))]
    inputs, targets = char_batches(batch_size=8, context=32, max_bytes=SMALL)(3)
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
    for row_in, row_out in zip(inputs, targets):
        window = decode(row_in) + decode(row_out[-1:])
        assert window in train_text


def test_char_batches_val_windows_come_from_the_last_tenth() -> None:
    corpus = char_corpus(SMALL)
    val_text = corpus[int(0.9 * len(corpus)) :]
    inputs, targets = char_batches(batch_size=8, context=32, max_bytes=SMALL, split="val")(0)
    for row_in, row_out in zip(inputs, targets):
        assert decode(row_in) + decode(row_out[-1:]) in val_text


def test_char_batches_are_deterministic_per_step_and_differ_across_steps() -> None:
    a = char_batches(batch_size=4, context=16, max_bytes=SMALL)
    b = char_batches(batch_size=4, context=16, max_bytes=SMALL)
    for step in (0, 1, 17):
        for x, y in zip(a(step), b(step)):
            assert torch.equal(x, y)
    assert not torch.equal(a(0)[0], a(1)[0])
    assert not torch.equal(a(0)[0], char_batches(batch_size=4, context=16, max_bytes=SMALL, seed=1)(0)[0])


def test_char_batches_do_not_touch_the_global_random_state() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    char_batches(batch_size=4, context=16, max_bytes=SMALL)(5)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.multiprocess
def test_char_batches_are_the_same_in_another_process() -> None:
    code = (
        "from examples.data import char_batches;"
        f"x, y = char_batches(batch_size=4, context=16, max_bytes={SMALL})(11);"
        "print(x.tolist(), y.tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60)
    x, y = char_batches(batch_size=4, context=16, max_bytes=SMALL)(11)
    assert out.stdout.strip() == f"{x.tolist()} {y.tolist()}"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split": "test"}, "split"),
        ({"batch_size": 0}, "batch_size"),
        ({"context": 10_000, "max_bytes": 1000}, "context"),
    ],
)
def test_char_batches_reject_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        char_batches(**{"max_bytes": SMALL, **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize("learnable", [False, True])
def test_regression_batches_shapes_and_determinism(learnable: bool) -> None:
    batch = regression_batches(batch_size=4, seq=3, dim=8, learnable=learnable)
    inputs, targets = batch(2)
    assert inputs.shape == targets.shape == (4, 3, 8)
    assert inputs.dtype == targets.dtype == torch.float32
    again = regression_batches(batch_size=4, seq=3, dim=8, learnable=learnable)(2)
    assert torch.equal(inputs, again[0]) and torch.equal(targets, again[1])
    assert not torch.equal(inputs, batch(3)[0])


def test_regression_defaults_are_the_reference_shape() -> None:
    inputs, targets = regression_batches()(0)
    assert inputs.shape == targets.shape == (64, 32, 512)


def test_regression_learnable_targets_are_a_fixed_linear_map_plus_small_noise() -> None:
    batch = regression_batches(batch_size=16, seq=8, dim=16, learnable=True)
    inputs = torch.cat([batch(s)[0].reshape(-1, 16) for s in range(4)])
    targets = torch.cat([batch(s)[1].reshape(-1, 16) for s in range(4)])
    weight = torch.linalg.lstsq(inputs, targets).solution  # one map explains every step
    residual = targets - inputs @ weight
    assert residual.std() < 0.02 < targets.std()


def test_regression_random_targets_are_not_predictable() -> None:
    batch = regression_batches(batch_size=16, seq=8, dim=16)
    inputs = torch.cat([batch(s)[0].reshape(-1, 16) for s in range(4)])
    targets = torch.cat([batch(s)[1].reshape(-1, 16) for s in range(4)])
    residual = targets - inputs @ torch.linalg.lstsq(inputs, targets).solution
    assert residual.std() > 0.5 * targets.std()
