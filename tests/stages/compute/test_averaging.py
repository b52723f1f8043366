"""How micro-batch losses average (stages.compute.averaging), without processes."""

from __future__ import annotations

import pytest
import torch

from examples.models import lm_loss
from stages.comm.boundary import split_batch
from stages.compute.averaging import (
    check_summable, count_items, loss_of, sample_weights, shard_batch, shard_replicas, split_sizes, step_loss,
)


def test_an_even_split_has_no_weights_and_an_uneven_one_weighs_by_samples() -> None:
    assert sample_weights([[2, 2], [2, 2]]) is None
    weights = sample_weights([[2, 2], [2, 1]])  # 7 samples over 2 replicas: R * n / B
    assert weights == [[4 / 7, 4 / 7], [4 / 7, 2 / 7]]
    # The replicas' average of their weighted sums is the mean over all seven samples.
    losses = [[1.0, 2.0], [3.0, 4.0]]
    per_replica = [sum(w * loss for w, loss in zip(ws, ls)) for ws, ls in zip(weights, losses)]
    assert sum(per_replica) / 2 == pytest.approx((2 * 1 + 2 * 2 + 2 * 3 + 1 * 4) / 7)


def test_a_global_batch_shards_in_order_and_refuses_too_few_samples() -> None:
    x, y = torch.arange(7).float().unsqueeze(1), torch.arange(7).float().unsqueeze(1)
    inputs, targets, weights = shard_batch(x, y, 2, 2)
    assert [[t.flatten().tolist() for t in shard] for shard in inputs] == [[[0, 1], [2, 3]], [[4, 5], [6]]]
    assert weights is not None and len(weights[1]) == 2
    with pytest.raises(ValueError, match="a batch of 3 samples cannot give 4 micro-batches"):
        shard_batch(x[:3], y[:3], 2, 2)
    # 7 inputs and 6 targets were cut apart (4 + 3 against 3 + 3) and failed at a later micro-batch's loss.
    with pytest.raises(ValueError, match="inputs hold 7 samples and targets 6: .* their first dims must be equal"):
        shard_batch(x, y[:6], 1, 2)
    with pytest.raises(ValueError, match="inputs hold 7 samples and targets 8"):
        shard_replicas(x, {"t": torch.zeros(8, 2)}, 2, 2)


@pytest.mark.parametrize(("samples", "replicas", "micro"), [(64, 1, 8), (37, 2, 4), (10, 3, 3), (9, 1, 9), (50, 2, 7)])
def test_a_replicas_whole_share_cuts_on_its_stage_into_the_micro_batches_the_head_would_send(
        samples: int, replicas: int, micro: int) -> None:
    x = torch.randn(samples, 3)
    y = {"t": torch.arange(samples * 2.0).view(samples, 2)}
    inputs, targets, weights = shard_batch(x, y, replicas, micro)
    shares_in, shares_out, share_weights = shard_replicas(x, y, replicas, micro)
    assert share_weights == weights  # from the sizes alone, the same as from the cut micro-batches
    for r in range(replicas):
        for cut, sent in ((split_batch(shares_in[r], micro, "inputs", aligned=True), inputs[r]),
                          (split_batch(shares_out[r], micro, "targets", aligned=True), targets[r])):
            assert len(cut) == len(sent) == micro
            for a, b in zip(cut, sent):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert split_sizes(10, 3) == [4, 3, 3] and split_sizes(9, 9) == [1] * 9
    with pytest.raises(ValueError, match="a batch of 3 samples cannot give 4 micro-batches"):
        shard_replicas(x[:3], {"t": y["t"][:3]}, 2, 2)


def test_a_cut_share_is_aligned_as_a_received_tensor_is() -> None:
    # 3 float32 features: a row is 12 bytes. Of 3 parts of 10 rows (4, 3, 3) the second starts 48 bytes
    # in, aligned: a view; the third 84 bytes in, off a 16-byte boundary: copied.
    share = torch.arange(30.0).view(10, 3)
    parts = split_batch(share, 3, "inputs", aligned=True)
    assert all(p.data_ptr() % 16 == 0 for p in parts)
    assert parts[0].data_ptr() == share.data_ptr()  # the first starts where the share does: no copy
    assert parts[1].untyped_storage().data_ptr() == share.untyped_storage().data_ptr()
    assert parts[2].untyped_storage().data_ptr() != share.untyped_storage().data_ptr()
    assert torch.equal(torch.cat(parts), share)
    plain = split_batch(share, 3, "inputs")
    assert plain[2].data_ptr() % 16 and plain[2].untyped_storage().data_ptr() == share.untyped_storage().data_ptr()


def test_tokens_count_what_is_not_ignored_and_average_over_them() -> None:
    y = torch.tensor([[1, 2, -100], [3, -100, -100]])
    assert int(count_items(y, -100)) == 3
    assert int(count_items(torch.zeros(2, 3), -100)) == 6  # floating-point targets: every element
    assert step_loss([6.0, 3.0], [2.0, 1.0], tokens=True) == 3.0
    assert step_loss([1.0, 4.0], [3.0, 1.0], tokens=False) == pytest.approx(7 / 4)  # sample-weighted
    assert step_loss([1.0, 4.0], [2.0, 2.0], tokens=False) == 2.5


def test_a_token_average_needs_a_loss_that_can_sum() -> None:
    check_summable(lm_loss, "examples.models:lm_loss")
    check_summable(torch.nn.functional.cross_entropy, "torch.nn.functional:cross_entropy")

    def mean_only(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).abs().mean()

    with pytest.raises(ValueError, match="takes no 'reduction' keyword"):
        check_summable(mean_only, "mine:mean_only")


@pytest.mark.parametrize("tokens", [False, True])
def test_a_loss_that_is_not_one_number_is_named_before_backward(tokens: bool) -> None:
    from tests.helpers.models import per_sample_loss

    out, target = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"the loss function tests\.helpers\.models:per_sample_loss returned a "
                                         r"tensor of shape \(4,\)" + (r' with reduction="sum"' if tokens else ":")):
        loss_of(per_sample_loss, out, target, tokens)
    with pytest.raises(TypeError, match=r"returned a float: a loss is one number per micro-batch, a tensor"):
        loss_of(lambda o, t: 1.5, out, target, False)
    # One element passes, whatever its dims, as backward takes it.
    loss = loss_of(lambda o, t: (o - t).pow(2).mean().reshape(1, 1), out, target, False)
    assert loss.dtype == torch.float32 and loss.numel() == 1


def test_a_loss_that_fails_on_what_the_model_gave_says_which_loss_and_what_it_was_given() -> None:
    # A model whose last module returns a tuple: torch's mse_loss says only "'tuple' object has no
    # attribute 'size'", which names neither the loss nor the output's shape.
    out, target = (torch.randn(4, 3), torch.randn(4, 3)), torch.randn(4, 3)
    with pytest.raises(AttributeError) as caught:
        loss_of(torch.nn.functional.mse_loss, out, target, False)
    assert caught.value.__notes__ == [
        "in the loss function torch.nn.functional:mse_loss, called with the model's output "
        "(tensor(float32, [4, 3]), tensor(float32, [4, 3])) and the targets tensor(float32, [4, 3])"]
