"""What crosses a stage boundary: any tree of tensors, flattened for the wire and checked on arrival."""

from __future__ import annotations

import pytest
import torch

from stages.comm.boundary import Payload, batch_size, check_spec, grad_leaves, pack, split_batch, unpack


def test_a_tree_of_tensors_constants_and_none_round_trips_with_its_gradient_marks() -> None:
    hidden = torch.randn(2, 3, requires_grad=True) * 2  # needs a gradient
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])  # integer: never
    tree = {"hidden": hidden, "extra": (mask, None, 0.5, "tag"), "list": [torch.ones(1)]}
    payload = pack(tree)
    assert [t.requires_grad for t in payload.leaves] == [False, False, False]  # detached for the wire
    assert payload.nbytes == 6 * 4 + 6 * 8 + 4
    back = unpack(payload, as_leaves=True)
    assert set(back) == {"hidden", "extra", "list"} and isinstance(back["extra"], tuple)
    assert back["extra"][1:] == (None, 0.5, "tag") and torch.equal(back["extra"][0], mask)
    assert back["hidden"].requires_grad and back["hidden"].is_leaf  # collects the gradient to send back
    assert not back["list"][0].requires_grad and isinstance(back["list"], list)
    assert grad_leaves(back) == [back["hidden"]]
    assert not unpack(payload)["hidden"].requires_grad  # without as_leaves: plain values


def test_what_cannot_cross_is_named_with_its_path() -> None:
    with pytest.raises(TypeError, match=r"\['state'\]\[1\] is a object"):
        pack({"state": [torch.ones(1), object()]})
    with pytest.raises(TypeError, match="string keys"):
        pack({1: torch.ones(1)})


@pytest.mark.parametrize(("spec", "leaves", "reason"), [
    ({"x": []}, 0, "not one of"),
    (1, 2, "describes 1 tensors but 2 came"),
    (2, 1, "marks a tensor with 2"),
    ([1], 1, "not a one-entry map"),
    ({"d": [[1, 1]]}, 1, "short string key"),
    ({"c": [1, 2]}, 0, "constant"),
    ({"t": [{"t": []}] * 5000}, 0, "more than 4096 nodes"),
])
def test_a_spec_from_the_wire_is_checked_before_anything_is_built(spec: object, leaves: int, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        check_spec(spec, leaves)
    check_spec(pack({"a": (torch.ones(1), None)}).spec, 1)


def test_deep_nesting_is_refused_on_both_ends() -> None:
    tree: object = torch.ones(1)
    spec: object = 0
    for _ in range(40):
        tree, spec = [tree], {"l": [spec]}
    with pytest.raises(TypeError, match="deeper than"):
        pack(tree)
    with pytest.raises(ValueError, match="levels"):
        check_spec(spec, 1)


def test_batches_split_along_their_first_dim_whatever_their_shape() -> None:
    ids, mask = torch.arange(12).reshape(6, 2), torch.ones(6, 2, dtype=torch.bool)
    parts = split_batch({"input_ids": ids, "attention_mask": mask}, 3, "inputs")
    assert [set(p) for p in parts] == [{"input_ids", "attention_mask"}] * 3
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), ids)
    assert [batch_size(p) for p in parts] == [2, 2, 2]
    pairs = split_batch((ids, mask), 2, "inputs")
    assert isinstance(pairs[0], tuple) and pairs[1][0].shape == (3, 2)
    with pytest.raises(ValueError, match="different batch sizes"):
        split_batch((ids, mask[:3]), 3, "inputs")
    # A batch that does not divide evenly is cut as tensor_split cuts it (a short last batch trains).
    uneven = split_batch((ids, mask), 4, "inputs")
    assert [batch_size(p) for p in uneven] == [2, 2, 1, 1]
    assert torch.equal(torch.cat([p[0] for p in uneven]), ids)
    with pytest.raises(ValueError, match="do not fill 7 parts of at least one sample"):
        split_batch((ids, mask), 7, "inputs")
    with pytest.raises(TypeError, match="must be a tensor"):
        split_batch([1, 2], 1, "inputs")
    assert isinstance(Payload([], None), Payload)
