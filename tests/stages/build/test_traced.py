"""Any nn.Module split at named points (see docs/models.md): routing, tied copies, names, and refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stages.build.tied import tied_groups
from stages.build.traced import TracingError, trace_stages
from examples.hf import gpt2, llama
from tests.helpers.models import flatten_cnn, untraceable

pytest.importorskip("transformers")  # installed by the test setup (the [hf] extra)


def _run(stages: list[torch.nn.Module], batch: object) -> object:
    value = stages[0](**batch) if isinstance(batch, dict) else stages[0](batch)
    for stage in stages[1:]:
        value = stage(value)
    return value


def test_a_gpt2_split_in_three_passes_the_mask_on_and_computes_what_the_model_does() -> None:
    torch.manual_seed(0)
    model = gpt2(layers=3, dim=32, heads=2, vocab=64)
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 5:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    stages = trace_stages(model, ["transformer.h.1", "transformer.h.2"], batch, "examples.hf:gpt2")
    first = stages[0](**batch)
    # The mask stage 0 derives is needed by every later block: stage 1 passes it on to stage 2 (with
    # the batch's sizes, as plain ints: the stages are traced for any batch size and length).
    masks = [t for t in first if isinstance(t, torch.Tensor) and t.dtype == torch.bool]
    assert len(masks) == 1 and masks[0].shape[-2:] == (8, 8)
    assert any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in stages[1](first))
    assert torch.equal(_run(stages, batch), model(**batch).logits)
    # Another batch size and length, another padding: the same graphs compute what the model does.
    ids, mask = torch.randint(0, 64, (3, 11)), torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    other = {"input_ids": ids, "attention_mask": mask}
    torch.testing.assert_close(_run(stages, other), model(**other).logits, rtol=1e-5, atol=1e-6)
    # Each stage keeps the original names; together they are the model's state dict.
    keys = [k for s in stages for k in s.module.state_dict()]
    assert set(keys) == set(model.state_dict())
    # Tracing copied the tied embedding into the first and last stages: one tensor again.
    assert stages[0].module.get_parameter("transformer.wte.weight") is stages[2].module.get_parameter("lm_head.weight")
    assert tied_groups([s.module for s in stages]) == [
        ["0.transformer.wte.weight", "0.lm_head.weight", "2.lm_head.weight"]]


def test_a_llama_keeps_its_non_persistent_buffers_out_of_the_state() -> None:
    torch.manual_seed(0)
    model = llama(layers=2, dim=32, heads=2, kv_heads=1, vocab=64)
    ids = torch.randint(0, 64, (2, 8))
    stages = trace_stages(model, ["model.layers.1"], ids, "examples.hf:llama")
    assert torch.equal(_run(stages, ids), model(ids).logits)
    keys = {k for s in stages for k in s.module.state_dict()}
    assert keys == set(model.state_dict()) and not any("inv_freq" in k for k in keys)
    # Rotary cos/sin cross the boundary beside the hidden states (several activations).
    assert len(stages[0](ids)) >= 3


def test_a_cnn_that_flattens_in_forward_keeps_the_flatten() -> None:
    torch.manual_seed(0)
    model = flatten_cnn()
    x = torch.randn(2, 3, 8, 8)
    stages = trace_stages(model, ["layer2"], x, "tests.helpers.models:flatten_cnn")
    assert torch.equal(_run(stages, x), model(x))


def test_split_points_that_do_not_fit_are_refused_with_what_would() -> None:
    model = gpt2(layers=2, dim=32, heads=2, vocab=64)
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(TracingError, match=r"not a module of m; did you mean 'transformer.h.1'"):
        trace_stages(model, ["transformer.h1"], ids, "m")
    with pytest.raises(TracingError, match="repeat"):
        trace_stages(model, ["transformer.h.1", "transformer.h.1"], ids, "m")


class _CalledTwice(torch.nn.Module):
    """A block the forward calls before and after the split point (a shared, reused layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.c(self.b(self.a(x))))


def test_a_module_called_in_two_stages_is_refused_not_trained_as_two_copies() -> None:
    # Split at c, stage 1 got torch's copy of a's parameters (a@1.weight): the two stages trained two
    # copies of one weight, and the gathered state had keys the model lacks.
    with pytest.raises(TracingError, match="stage 1 calls 'a' again after an earlier stage called it"):
        trace_stages(_CalledTwice(), ["c"], torch.randn(2, 4), "reuse")


def test_an_untraceable_model_names_the_module_and_what_to_do() -> None:
    with pytest.raises(TracingError) as caught:
        trace_stages(untraceable(), ["branchy"], torch.randn(2, 8), "tests.helpers.models:untraceable")
    message = str(caught.value)
    assert "could not trace tests.helpers.models:untraceable in module branchy (Branchy.forward)" in message
    assert "What to do" in message and "nn.Sequential" in message


def test_a_dimension_the_trace_fixed_is_refused_before_the_step_with_what_to_do() -> None:
    """Batch size and length stay dynamic where the model lets them; a length it reshapes to is not,
    and a micro-batch of another length is refused by name, not failed inside the graph."""
    from stages.build.traced import check_batch
    from tests.helpers.models import fixed_length

    model = fixed_length(dim=8, length=6)
    stages = trace_stages(model, ["second"], torch.randn(4, 6, 8), "tests.helpers.models:fixed_length")
    check_batch(stages[0], [torch.randn(3, 6, 8), torch.randn(5, 6, 8)])  # other batch sizes run
    x = torch.randn(3, 6, 8)
    assert torch.allclose(_run(stages, x), model(x))
    with pytest.raises(ValueError, match=r"input 'x' has 7 at dim 1 .* fixed that dimension at 6.*pad to it"):
        check_batch(stages[0], [torch.randn(3, 6, 8), torch.randn(3, 7, 8)])
    free = trace_stages(gpt2(layers=2, dim=32, heads=2, vocab=64), ["transformer.h.1"],
                        torch.randint(0, 64, (2, 8)), "m")
    check_batch(free[0], [torch.randint(0, 64, (3, 5)), torch.randint(0, 64, (1, 11))])  # any length


def test_a_static_trace_computes_the_examples_shapes_and_refuses_others_naming_the_setting() -> None:
    """``dynamic_shapes=False`` (the job's): traced for the example's shapes alone, as torch's pipeline()
    does; the graphs compute what the model does on that shape, every dimension is fixed, and a
    micro-batch of another batch size or length is refused before the step, naming the setting."""
    from stages.build.traced import check_batch

    torch.manual_seed(0)
    model = gpt2(layers=2, dim=32, heads=2, vocab=64)
    ids = torch.randint(0, 64, (2, 8))
    stages = trace_stages(model, ["transformer.h.1"], ids, "examples.hf:gpt2", dynamic=False)
    assert all(stage.static for stage in stages)
    assert list(stages[0].fixed.values()) == [[(0, 2), (1, 8)]]  # the ids' both dimensions
    check_batch(stages[0], [torch.randint(0, 64, (2, 8))])
    other = torch.randint(0, 64, (2, 8))
    assert torch.equal(_run(stages, other), model(other).logits)
    for shape in ((2, 9), (3, 8)):
        with pytest.raises(ValueError, match=r"has shape \(%d, %d\), but the job traced its model for the "
                                             r"example's shapes alone \(dynamic_shapes=False\).*dynamic_shapes=True"
                                             % shape):
            check_batch(stages[0], [torch.randint(0, 64, shape)])
    # The default, on the same model object, traced again.
    dynamic = trace_stages(model, ["transformer.h.1"], ids, "examples.hf:gpt2")
    assert not dynamic[0].static and not dynamic[0].fixed
    check_batch(dynamic[0], [torch.randint(0, 64, (3, 11))])


def test_a_model_whose_dynamic_trace_fails_is_traced_for_the_examples_shapes_and_stays_callable(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback when export cannot keep the shapes dynamic: torch's front end wraps each split
    point's forward in place and leaves it so, and a second trace wrapped the wrapper, which then
    recursed until Python's limit (RecursionError, reported as an untraceable model). Now each split
    point's forward is the module's own again after every trace, so the fallback traces, and the
    model itself still computes as before."""
    from contextlib import contextmanager
    from torch.distributed.pipelining import _IR

    from stages.build import traced

    @contextmanager
    def dynamic_fails():  # type: ignore[no-untyped-def]
        original = _IR.Pipe._trace_with_export

        def export(*args: object, **kwargs: object) -> object:
            raise RuntimeError("Constraints violated: this model's shapes cannot all vary")

        _IR.Pipe._trace_with_export = staticmethod(export)  # type: ignore[assignment]
        try:
            yield
        finally:
            _IR.Pipe._trace_with_export = original  # type: ignore[method-assign]

    monkeypatch.setattr(traced, "_dynamic_export", dynamic_fails)
    torch.manual_seed(0)
    model = gpt2(layers=2, dim=32, heads=2, vocab=64)
    ids = torch.randint(0, 64, (2, 8))
    stages = trace_stages(model, ["transformer.h.1"], ids, "examples.hf:gpt2")
    assert torch.equal(_run(stages, ids), model(ids).logits)
    assert "forward" not in vars(model.transformer.h[1]) and "_orig_forward" not in vars(model.transformer.h[1])


class _ModeDependent(nn.Module):
    """Dropout, attention dropout and batch norm: what computes otherwise in training and in evaluation."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3))
        self.qkv = nn.Linear(8, 24)
        self.b = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(2, 5, 2, 4).transpose(1, 2) for t in self.qkv(self.a(x)).split(8, -1))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2 if self.training else 0.0, is_causal=True)
        return self.b(y.transpose(1, 2).reshape(2, 5, 8))


def test_a_traced_stage_in_eval_mode_computes_as_the_model_in_eval_mode_and_trains_as_traced_after() -> None:
    """Found by review: the trace wrote dropout's, attention dropout's and batch norm's training flags into the
    graph, so job.evaluate on a model cut at split_points still dropped (two evaluations of one batch gave
    4.1712 and 4.1793, one process in eval mode 4.1828) and batch norm took the batch's statistics and
    moved its running ones."""
    torch.manual_seed(0)
    model = _ModeDependent()
    x = torch.randn(2, 5, 8)
    stages = trace_stages(model, ["qkv"], x, "mode_dependent", dynamic=False)
    statistics = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "batches" in k}
    for stage in stages:
        stage.eval()
    out = stages[1](stages[0](x))
    assert torch.equal(out, stages[1](stages[0](x)))  # nothing drawn: the same twice
    model.eval()
    assert torch.equal(out, model(x))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in statistics.items())  # left as they were
    for stage in stages:
        stage.train()
    torch.manual_seed(5)
    first = stages[1](stages[0](x))
    torch.manual_seed(5)
    model.train()
    assert torch.equal(first, model(x))  # training again: dropout and the batch's statistics, as traced
    assert not torch.equal(first, out)
