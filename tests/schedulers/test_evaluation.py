"""Evaluation, loss averaging and uneven batches, end to end against one process.

``job.evaluate`` runs the forward-only programs on every schedule and mesh and must give
the model's own forward in eval mode (dropout off), change nothing of the training
state or the data position, and fit between any two steps. ``loss_averaging`` decides
how micro-batch losses add up: ``samples`` (sample-weighted means, so a short last batch
trains as one process would) and ``tokens`` (every token's loss over the counted tokens of
the global batch, across micro-batches and replicas).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors import Cluster, NodeLost, StepFailed
from examples.models import gpt, lm_loss, residual_mlp
from schedulers.evaluation import evaluation_failed

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.asyncio(loop_scope="package")]

GPT = {"vocab_size": 64, "dim": 16, "layers": 4, "heads": 2, "context": 8}
MLP = {"blocks": 4, "dim": 8, "hidden": 16}
SGD = ("torch.optim:SGD", {"lr": 0.1, "momentum": 0.9})


def _tokens(batch: int, seq: int, seed: int, pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, GPT["vocab_size"], (batch, seq), generator=gen)
    y = torch.randint(0, GPT["vocab_size"], (batch, seq), generator=gen)
    if pad:  # right padding of a different length per row: each row keeps 1..seq targets
        keep = torch.randint(1, seq + 1, (batch, 1), generator=gen)
        y = torch.where(torch.arange(seq) < keep, y, torch.full_like(y, -100))
    return x, y


@pytest.mark.parametrize("schedule,pipeline,tensor,data,transport", [
    pytest.param("gpipe", 2, 1, 1, "zmq", id="gpipe-pp2"),
    pytest.param("1f1b", 4, 1, 1, "zmq", id="1f1b-pp4"),
    pytest.param("interleaved", 2, 1, 1, "zmq", id="interleaved-pp2"),
    pytest.param("zero_bubble", 2, 1, 2, "dist", id="zero_bubble-pp2-dp2-dist"),
    pytest.param("1f1b", 2, 2, 1, "zmq", id="1f1b-pp2-tp2"),
])
async def test_evaluate_is_the_models_own_forward_in_eval_mode(
    cluster: Cluster, schedule: str, pipeline: int, tensor: int, data: int, transport: str
) -> None:
    torch.manual_seed(0)
    model = gpt(**GPT, dropout=0.2).eval()  # dropout: a forward in train mode would differ
    x, y = _tokens(8, GPT["context"], seed=1)
    with torch.no_grad():
        logits = model(x)
    expected = lm_loss(logits, y).item()
    job = await cluster.train(model="examples.models:gpt", model_kwargs={**GPT, "dropout": 0.2},
                              loss="examples.models:lm_loss", optimizer=SGD, pipeline_stages=pipeline,
                              tensor_parallel=tensor, data_parallel=data, schedule=schedule, micro_batches=2,
                              seed=0, transport=transport)
    try:
        before = await job.state_dict()
        result = await job.evaluate(x, y, outputs=True)
        again = await job.evaluate(x, y)
        after = await job.state_dict()
        described = await job.describe()
    finally:
        await job.close()
    assert result.loss == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(result.outputs, logits, rtol=1e-5, atol=1e-5)
    assert again.loss == result.loss and again.outputs is None  # eval mode each time: no dropout draw
    assert result.items == 8 and result.bytes_sent > 0
    assert described.steps == 0
    for key, value in before.items():
        assert torch.equal(after[key], value), key


async def test_an_evaluation_between_steps_changes_nothing_of_training(cluster: Cluster) -> None:
    """Adam's state, the parameters and the data position are the same with or without an
    evaluation in between: two steps equal one process's, and the evaluation equals its forward."""
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 4, MLP["dim"], generator=gen), torch.randn(8, 4, MLP["dim"], generator=gen))
               for _ in range(2)]
    torch.manual_seed(0)
    model = residual_mlp(**MLP)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    expected_eval = None
    for index, (x, y) in enumerate(batches):
        if index == 1:
            with torch.no_grad():
                expected_eval = F.mse_loss(model(x), y).item()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    job = await cluster.train(model="examples.models:residual_mlp", model_kwargs=MLP, loss="torch.nn.functional:mse_loss",
                              optimizer=("torch.optim:Adam", {"lr": 0.01}), pipeline_stages=2, data_parallel=2,
                              schedule="1f1b", micro_batches=2, seed=0)
    try:
        await job.step(*batches[0])
        evaluated = await job.evaluate(*batches[1])
        await job.step(*batches[1])
        state = await job.state_dict()
    finally:
        await job.close()
    assert evaluated.loss == pytest.approx(expected_eval, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


async def test_an_evaluation_of_the_data_factory_leaves_its_position(cluster: Cluster) -> None:
    """``evaluate()`` reads the next step's batch without taking it: the step after it trains on that
    very batch (its loss, from the same parameters, is the evaluation's); ``data_step`` names another."""
    job = await cluster.train(model="examples.models:gpt", model_kwargs={**GPT, "vocab_size": 128},
                              loss="examples.models:lm_loss", optimizer=SGD, pipeline_stages=2, schedule="1f1b",
                              micro_batches=2, seed=0, data="examples.data:char_batches",
                              data_kwargs={"batch_size": 4, "context": GPT["context"], "max_bytes": 20_000})
    try:
        await job.step()
        upcoming = await job.evaluate()
        other = await job.evaluate(data_step=7)
        stats = await job.step()
        after = await job.describe()
    finally:
        await job.close()
    assert stats.loss == pytest.approx(upcoming.loss, rel=1e-6)
    assert other.loss != upcoming.loss
    assert after.steps == 2


def _averaged(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, parts: int, tokens: bool) -> torch.Tensor:
    """One process's loss under each averaging: every token's over the counted tokens, or the mean of
    the ``parts`` micro-batches' means (even parts here)."""
    if tokens:
        return lm_loss(model(x), y)
    return sum(lm_loss(model(xs), ys) for xs, ys in zip(x.chunk(parts), y.chunk(parts))) / parts


@pytest.mark.parametrize("averaging", ["tokens", "samples"])
async def test_losses_average_over_tokens_or_samples_as_one_process(cluster: Cluster, averaging: str) -> None:
    """Right-padded targets (``-100``) spread unevenly over 2 replicas x 2 micro-batches: ``tokens``
    trains as one process's cross-entropy over the whole batch (Hugging Face's ``num_items_in_batch``),
    ``samples`` as the mean of the four micro-batch means; the two differ on this batch."""
    batches = [_tokens(8, GPT["context"], seed=10 + step, pad=True) for step in range(2)]
    torch.manual_seed(0)
    model = gpt(**GPT)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches:
        loss = _averaged(model, x, y, 4, averaging == "tokens")
        with torch.no_grad():
            other = _averaged(model, x, y, 4, averaging != "tokens")
        assert abs(loss.item() - other.item()) > 5e-5 * loss.item()  # 5x the tolerance: the averaging shows
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    job = await cluster.train(model="examples.models:gpt", model_kwargs=GPT, loss="examples.models:lm_loss",
                              optimizer=SGD, pipeline_stages=2, data_parallel=2, schedule="1f1b", micro_batches=2,
                              seed=0, loss_averaging=averaging)
    try:
        stats = [await job.step(x, y) for x, y in batches]
        state = await job.state_dict()
        evaluated = await job.evaluate(*batches[0])
    finally:
        await job.close()
    assert [s.loss for s in stats] == pytest.approx(losses, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    with torch.no_grad():
        assert evaluated.loss == pytest.approx(_averaged(model, *batches[0], 4, averaging == "tokens").item(), rel=1e-5)
    if averaging == "tokens":
        assert evaluated.items == float((batches[0][1] != -100).sum())


@pytest.mark.parametrize("size", [7, 10])
async def test_a_short_last_batch_trains_as_one_process(cluster: Cluster, size: int) -> None:
    """A batch that does not divide into 2 replicas x 2 micro-batches is cut as tensor_split cuts it
    (7: 2+2 | 2+1) and each micro-batch's mean counts by its samples: one process's mean."""
    gen = torch.Generator().manual_seed(size)
    batches = [(torch.randn(16, 4, MLP["dim"], generator=gen), torch.randn(16, 4, MLP["dim"], generator=gen)),
               (torch.randn(size, 4, MLP["dim"], generator=gen), torch.randn(size, 4, MLP["dim"], generator=gen))]
    torch.manual_seed(0)
    model = residual_mlp(**MLP)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    job = await cluster.train(model="examples.models:residual_mlp", model_kwargs=MLP, loss="torch.nn.functional:mse_loss",
                              optimizer=("torch.optim:SGD", {"lr": 0.05, "momentum": 0.9}), pipeline_stages=2,
                              data_parallel=2, schedule="1f1b", micro_batches=2, seed=0)
    try:
        stats = [await job.step(x, y) for x, y in batches]
        state = await job.state_dict()
        with pytest.raises(Exception, match=r"a batch of 3 samples cannot give 4 micro-batches"):
            await job.step(torch.randn(3, 4, MLP["dim"]), torch.randn(3, 4, MLP["dim"]))
    finally:
        await job.close()
    assert [s.loss for s in stats] == pytest.approx(losses, rel=1e-5)
    assert stats[1].samples == size
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


async def test_a_shape_a_traced_model_cannot_run_is_refused_at_step_and_the_job_goes_on(cluster: Cluster) -> None:
    """tests.helpers.models:fixed_length reshapes to a constant length, so its trace fixes it: a batch
    of another length is refused before any action runs, naming the input, the dimension and what to
    do; nothing of it is applied and the next step (and evaluation) of the right length trains on."""
    job = await cluster.train(model="tests.helpers.models:fixed_length", model_kwargs={"dim": 8, "length": 6},
                              split_points=["second"], example_inputs=torch.randn(2, 6, 8), pipeline_stages=2,
                              micro_batches=2, optimizer=("torch.optim:SGD", {"lr": 0.1}), seed=0)
    try:
        before = await job.state_dict()
        with pytest.raises(StepFailed, match=r"stage 0.*input 'x' has 7 at dim 1 .*fixed that dimension at 6"):
            await job.step(torch.randn(4, 7, 8), torch.randn(4, 7, 8))
        assert all(torch.equal(value, before[key]) for key, value in (await job.state_dict()).items())
        stats = await job.step(torch.randn(6, 6, 8), torch.randn(6, 6, 8))  # another batch size runs
        evaluated = await job.evaluate(torch.randn(4, 6, 8), torch.randn(4, 6, 8))
    finally:
        await job.close()
    assert stats.samples == 6 and evaluated.items == 4


async def test_a_failed_evaluation_says_so_and_keeps_the_failures_type() -> None:  # async: the module runs on its loop
    lost = evaluation_failed(NodeLost("step failed: stage 1: node n2 was lost", remote_traceback="tb",
                                      details={"stage": 1, "node": "n2"}))
    assert type(lost) is NodeLost and lost.node == "n2" and lost.stage == 1 and lost.remote_traceback == "tb"
    assert lost.message == "evaluation failed: stage 1: node n2 was lost"
    timed_out = evaluation_failed(StepFailed("step timed out after 5s:\n...", details={"cause": "timeout"}))
    assert timed_out.message.startswith("evaluation timed out after 5s") and timed_out.cause == "timeout"
    assert evaluation_failed(StepFailed("job1 cannot go on: ...")).message == "job1 cannot go on: ..."
