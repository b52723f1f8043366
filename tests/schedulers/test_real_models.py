"""Models nobody here wrote go in unchanged (see docs/models.md): Hugging Face GPT-2 and LLaMA split at
named points, a CNN that flattens in forward, and a Sequential whose blocks pass dicts with
an integer mask; each trains as one process does, and its state keeps the model's own names."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from actors import Cluster, RemoteError, StepFailed
from stages import meta_initialized, split_batch
from stages.build.layers import Chain
from examples import hf
from examples.models import lm_loss
from tests.helpers import models as helpers

pytest.importorskip("transformers")  # the test setup installs it (the [hf] extra)
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]

SEQ, VOCAB, BATCH, MICRO = 8, 64, 8, 4
SMALL = {"dim": 32, "heads": 2, "vocab": VOCAB, "positions": 16}
LR = 0.1


def lm_batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)) for _ in range(steps)]


def one_process(factory: Callable[..., torch.nn.Module], kwargs: dict[str, Any],
                batches: list[tuple[Any, torch.Tensor]], loss: Callable[[Any, torch.Tensor], torch.Tensor],
                call: Callable[[torch.nn.Module, Any], Any]) -> tuple[torch.nn.Module, list[float]]:
    """The reference: the same model from the same seed, SGD on the whole batch in one process."""
    torch.manual_seed(0)
    model = factory(**kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for inputs, targets in batches:
        optimizer.zero_grad()
        value = loss(call(model, inputs), targets)
        value.backward()
        optimizer.step()
        losses.append(float(value.detach()))
    return model, losses


def assert_close_state(state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = model.state_dict()
    assert set(state) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


async def train_steps(job: Any, batches: list[tuple[Any, Any]]) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """Steps ``job`` through ``batches`` and gathers its state; the job is closed either way."""
    try:
        stats = [await job.step(x, y) for x, y in batches]
        return stats, await job.state_dict()
    finally:
        await job.close()


def logits(model: torch.nn.Module, inputs: Any) -> torch.Tensor:
    return (model(**inputs) if isinstance(inputs, dict) else model(inputs)).logits


def split_points(family: str, model_stages: int, layers: int) -> list[str]:
    block = {"gpt2": "transformer.h", "gpt_neox": "gpt_neox.layers", "bert": "bert.encoder.layer"}.get(
        family, "model.layers")
    step = layers // model_stages
    return [f"{block}.{step * s}" for s in range(1, model_stages)]


# Each schedule tied and untied, at 2 and at 4 stages, and each (tie, stages) pair under two
# schedules; llama at both stage counts. That every schedule runs any split model alike is the
# executor's, tested in one process over the whole product (tests/stages/compute/test_executor.py).
# Traced for the batches' one shape (each stage's trace takes half the time of the default, dynamic
# one), but for GPT-2 tied under GPipe at 2 stages: the dynamic trace's own tests are below (a new
# sequence length every step, left padding, BERT's mask) and it costs a 4-stage job seconds of CPU.
HF_CASES = [
    *[("gpt2", True, schedule, stages) for schedule, stages in
      [("gpipe", 2), ("1f1b", 4), ("interleaved", 2), ("zero_bubble", 4)]],
    *[("gpt2", False, schedule, stages) for schedule, stages in
      [("gpipe", 4), ("1f1b", 2), ("interleaved", 4), ("zero_bubble", 2)]],
    ("llama", True, "gpipe", 4), ("llama", True, "1f1b", 2),
]


@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.parametrize(("family", "tie", "schedule", "stages"), HF_CASES,
                         ids=[f"{f}-{'tied' if t else 'untied'}-{s}-{n}stages" for f, t, s, n in HF_CASES])
async def test_hugging_face_models_train_split_at_named_points_as_one_process(
    cluster: Cluster, family: str, tie: bool, schedule: str, stages: int
) -> None:
    model_stages = stages * (2 if schedule == "interleaved" else 1)
    layers = max(4, model_stages)
    kwargs = {**SMALL, "layers": layers, "tie": tie, **({"kv_heads": 1} if family == "llama" else {})}
    factory = getattr(hf, family)
    batches = lm_batches()
    reference, losses = one_process(factory, kwargs, batches, lm_loss, logits)
    job = await cluster.train(model=f"examples.hf:{family}", model_kwargs=kwargs, loss="examples.models:lm_loss",
                              optimizer=("torch.optim:SGD", {"lr": LR}), pipeline_stages=stages, schedule=schedule,
                              micro_batches=MICRO, split_points=split_points(family, model_stages, layers),
                              example_inputs=batches[0][0][:BATCH // MICRO],
                              dynamic_shapes=(family, tie, schedule, stages) == ("gpt2", True, "gpipe", 2))
    stats, state = await train_steps(job, batches)
    assert [s.loss for s in stats] == pytest.approx(losses, rel=1e-5)
    assert_close_state(state, reference)
    embedding = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
    if tie:
        assert stats[-1].tied == [[embedding, "lm_head.weight"]]  # named as the model names them
        assert torch.equal(state[embedding], state["lm_head.weight"])  # the copies kept the same bits
    else:
        assert stats[-1].tied == []
    # The gathered state is the original model's: it loads strictly into a fresh one.
    factory(**kwargs).load_state_dict(state, strict=True)


async def train_as_one_process(cluster: Cluster, family: str, kwargs: dict[str, Any],
                               batches: list[tuple[Any, torch.Tensor]], *, stages: int = 2, schedule: str = "1f1b",
                               build: Callable[..., torch.nn.Module] | None = None, **options: Any) -> list[Any]:
    """``family`` (an ``examples.hf`` factory) split at named points and trained on ``batches`` with SGD,
    checked equal to one process (``build``: the reference's factory, the family's own by default);
    returns the job's step stats."""
    factory = getattr(hf, family)
    reference, losses = one_process(build or factory, kwargs, batches, lm_loss, logits)
    job = await cluster.train(model=f"examples.hf:{family}", model_kwargs=kwargs, loss="examples.models:lm_loss",
                              optimizer=("torch.optim:SGD", {"lr": LR}), pipeline_stages=stages, schedule=schedule,
                              micro_batches=MICRO, split_points=split_points(family, stages, 4),
                              example_inputs=split_batch(batches[0][0], MICRO, "inputs")[0], **options)
    stats, state = await train_steps(job, batches)
    assert [s.loss for s in stats] == pytest.approx(losses, rel=1e-5)
    assert_close_state(state, reference)
    return stats


# Each family once, at 4 stages (a middle stage both receives and sends; every boundary of a 2-stage
# split is one of these), under 1F1B and GPipe by turns: what a family can break is its split and its
# blocks' signatures, which any one schedule shows; every schedule running any split model alike is the
# executor's, tested in one process. LLaMA's are HF_CASES' (2 and 4 stages); BERT, an encoder with a
# padding mask, in its own test below.
FAMILY_CASES = [(family, ("1f1b", "gpipe")[index % 2], 4)
                for index, family in enumerate(("qwen2", "mistral", "gemma", "phi", "gpt_neox"))]
BERT_CASES = [("1f1b", 4), ("gpipe", 2)]


@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.parametrize(("family", "schedule", "stages"), FAMILY_CASES,
                         ids=[f"{f}-{s}-{n}stages" for f, s, n in FAMILY_CASES])
async def test_the_families_people_fine_tune_train_split_at_named_points_as_one_process(
    cluster: Cluster, family: str, schedule: str, stages: int
) -> None:
    kwargs = {**SMALL, "layers": 4, **({"kv_heads": 1} if family in ("qwen2", "mistral", "gemma") else {})}
    # Traced for the batches' one shape (what a family can break shows in either trace, and this one costs
    # each stage half the time); the default, dynamic trace has its own tests below.
    await train_as_one_process(cluster, family, kwargs, lm_batches(), stages=stages, schedule=schedule,
                               dynamic_shapes=False)


@pytest.mark.asyncio(loop_scope="package")
async def test_a_job_traced_for_one_shape_trains_as_one_process_and_refuses_another_before_its_step(
    cluster: Cluster
) -> None:
    """``dynamic_shapes=False``: each stage traces for the example's shapes alone (as torch's pipeline()
    does); a batch of another length is refused before any action runs, naming the setting, nothing of
    it is applied, and the job trains on with batches of its shape."""
    kwargs = {**SMALL, "layers": 4, "kv_heads": 1}
    batches = lm_batches(3)
    reference, losses = one_process(hf.qwen2, kwargs, batches, lm_loss, logits)
    job = await cluster.train(model="examples.hf:qwen2", model_kwargs=kwargs, loss="examples.models:lm_loss",
                              optimizer=("torch.optim:SGD", {"lr": LR}), pipeline_stages=2, micro_batches=MICRO,
                              split_points=split_points("qwen2", 2, 4), dynamic_shapes=False,
                              example_inputs=split_batch(batches[0][0], MICRO, "inputs")[0])
    try:
        stats = [await job.step(*batches[0])]
        before = await job.state_dict()
        longer = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
        with pytest.raises(StepFailed, match=r"stage 0.*input 'input_ids' has shape \(2, 9\), but the job traced "
                                             r"its model for the example's shapes alone \(dynamic_shapes=False\)"):
            await job.step(longer, longer)
        assert all(torch.equal(value, before[key]) for key, value in (await job.state_dict()).items())
        stats += [await job.step(x, y) for x, y in batches[1:]]
        state = await job.state_dict()
    finally:
        await job.close()
    assert [s.loss for s in stats] == pytest.approx(losses, rel=1e-5)
    assert_close_state(state, reference)


def masked_lm_batches(steps: int = 2) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """BERT's: right-padded ids with their attention mask, a third of the real tokens to predict and
    every other target -100 (padding included)."""
    generator = torch.Generator().manual_seed(13)
    batches = []
    for _ in range(steps):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
        mask = (torch.arange(SEQ) < torch.randint(2, SEQ + 1, (BATCH, 1), generator=generator)).long()
        chosen = (torch.rand(BATCH, SEQ, generator=generator) < 0.35) & mask.bool()
        targets = torch.where(chosen, torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator), -100)
        batches.append(({"input_ids": ids * mask, "attention_mask": mask}, targets))
    return batches


@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.parametrize(("schedule", "stages"), BERT_CASES, ids=[f"{s}-{n}stages" for s, n in BERT_CASES])
async def test_a_bert_encoder_with_a_padding_mask_trains_split_at_named_points_as_one_process(
    cluster: Cluster, schedule: str, stages: int
) -> None:
    """BertForMaskedLM: bidirectional attention over a padding mask that crosses every boundary, the
    masked-LM targets -100 wherever nothing is predicted; token-averaged, as one process's loss is."""
    await train_as_one_process(cluster, "bert", {**SMALL, "layers": 4}, masked_lm_batches(), stages=stages,
                               schedule=schedule, loss_averaging="tokens")


@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.parametrize(("family", "transport"), [("qwen2", "zmq"), ("llama", "zmq"), ("qwen2", "dist")])
async def test_a_traced_model_trains_a_new_sequence_length_every_step_as_one_process(
    cluster: Cluster, family: str, transport: str
) -> None:
    """Traced with every input dimension dynamic, the stages run any batch size and length: the defect
    this guards against was a stage graph fixed to the example's length (Qwen2's grouped keys then failed to
    expand at 0F0 on the first longer batch)."""
    kwargs = {**SMALL, "layers": 4, "kv_heads": 2, "heads": 4}
    generator = torch.Generator().manual_seed(11)
    batches = [(torch.randint(0, VOCAB, (BATCH, length), generator=generator),
                torch.randint(0, VOCAB, (BATCH, length), generator=generator)) for length in (8, 12, 5)]
    await train_as_one_process(cluster, family, kwargs, batches, transport=transport)


@pytest.mark.asyncio(loop_scope="package")
async def test_left_padded_batches_of_new_lengths_train_a_traced_model_with_codecs_on(cluster: Cluster) -> None:
    """Qwen2 traced once, then fed a new length every step, left-padded under an attention mask (the
    targets -100 on the padding), with int8 activations and gradients on the wire: every step runs,
    each boundary carries int8, and the losses stay within the codec's error of one process's."""
    kwargs = {**SMALL, "layers": 4, "kv_heads": 1}
    generator = torch.Generator().manual_seed(17)
    batches = []
    for length in (8, 11, 6):
        ids = torch.randint(1, VOCAB, (BATCH, length), generator=generator)
        mask = (torch.arange(length) >= torch.randint(0, length - 1, (BATCH, 1), generator=generator)).long()
        targets = torch.where(mask.bool(), torch.randint(1, VOCAB, (BATCH, length), generator=generator), -100)
        batches.append(({"input_ids": ids * mask, "attention_mask": mask}, targets))
    _, losses = one_process(hf.qwen2, kwargs, batches, lm_loss, logits)
    job = await cluster.train(model="examples.hf:qwen2", model_kwargs=kwargs, loss="examples.models:lm_loss",
                              optimizer=("torch.optim:SGD", {"lr": LR}), pipeline_stages=2, micro_batches=MICRO,
                              split_points=split_points("qwen2", 2, 4), loss_averaging="tokens",
                              example_inputs=split_batch(batches[0][0], MICRO, "inputs")[0],
                              activation_codec="int8", gradient_codec="int8")
    stats, _ = await train_steps(job, batches)
    assert [s.loss for s in stats] == pytest.approx(losses, rel=0.02)
    assert all(s.codec_stats["F 0->1"]["codec"] == "int8" and s.codec_stats["B 1->0"]["codec"] == "int8"
               for s in stats)


@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.parametrize("family", ["gpt2", "llama"])
async def test_meta_init_traces_on_the_meta_device_and_each_stage_makes_only_its_own_weights(
    cluster: Cluster, family: str
) -> None:
    """meta_init: the model's parameters on the meta device, traced there; each stage initializes
    its own with the model's _init_weights under seeds of the modules' names, as one process does."""
    kwargs = {**SMALL, "layers": 4, "tie": True, **({"kv_heads": 1} if family == "llama" else {})}
    factory = getattr(hf, family)
    stats = await train_as_one_process(cluster, family, kwargs, lm_batches(), meta_init=True,
                                       build=lambda **kw: meta_initialized(factory, kw, seed=0),
                                       dynamic_shapes=family == "llama")  # GPT-2 traced on meta for one shape
    assert len(stats[-1].tied) == 1  # the tied head: its copies still one parameter, summed across stages


@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.parametrize("saved_by", ["the_model_with_its_head", "the_base_model"])
async def test_a_meta_init_job_loads_hugging_face_safetensors_with_the_tied_head_under_the_embeddings_name(
    cluster: Cluster, tmp_path: Any, saved_by: str
) -> None:
    """As people have a pretrained model: safetensors shards and their index, the tied head stored once
    under the embedding's name. No process builds the whole model; each stage reads its own tensors.
    The base model's files (``wte.weight``, as the Hub holds ``gpt2``) load into the model with a head
    (``transformer.wte.weight``) as ``from_pretrained`` loads them, and, found by review, with each block's
    causal mask (``h.N.attn.bias``), which the Hub's file keeps and from_pretrained passes over (the model's
    ``_keys_to_ignore_on_load_unexpected``): one such key had every key refused."""
    from safetensors.torch import save_file
    import json
    kwargs = {**SMALL, "layers": 4, "tie": True}
    torch.manual_seed(123)
    pretrained = hf.gpt2(**kwargs)
    if saved_by == "the_base_model":
        weights = {k: v.contiguous() for k, v in pretrained.transformer.state_dict().items()}
        mask = torch.tril(torch.ones(SMALL["positions"], SMALL["positions"])).view(1, 1, *[SMALL["positions"]] * 2)
        weights.update({f"h.{i}.attn.bias": mask.clone() for i in range(kwargs["layers"])})
    else:
        weights = {k: v.contiguous() for k, v in pretrained.state_dict().items() if k != "lm_head.weight"}
    keys = sorted(weights)
    index = {}
    for n, part in enumerate((keys[::2], keys[1::2])):
        name = f"model-0000{n + 1}-of-00002.safetensors"
        save_file({k: weights[k] for k in part}, str(tmp_path / name))
        index.update(dict.fromkeys(part, name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    job = await cluster.train(model="examples.hf:gpt2", model_kwargs=kwargs, loss="examples.models:lm_loss",
                              pipeline_stages=2, micro_batches=2, split_points=["transformer.h.2"], meta_init=True,
                              example_inputs=lm_batches()[0][0][:4], dynamic_shapes=False)
    try:
        assert await job.load(str(tmp_path)) == 0
        assert_close_state(await job.state_dict(), pretrained)  # the head on stage 1 took the embedding's
        await job.step(*lm_batches()[0])
    finally:
        await job.close()


@pytest.mark.asyncio(loop_scope="package")
async def test_a_traced_job_loads_saved_pretrained_weights_and_checkpoints_under_the_models_names(
    cluster: Cluster, tmp_path: Any
) -> None:
    kwargs = {**SMALL, "layers": 4}
    torch.manual_seed(123)
    pretrained = hf.gpt2(**kwargs)
    # Saved as save_pretrained does: the tied head once, under the embedding's name.
    weights = {k: v for k, v in pretrained.state_dict().items() if k != "lm_head.weight"}
    spec = dict(model="examples.hf:gpt2", model_kwargs=kwargs, loss="examples.models:lm_loss",
                pipeline_stages=2, micro_batches=2, split_points=["transformer.h.2"],
                example_inputs=lm_batches()[0][0][:4], transport="dist", dynamic_shapes=False)  # one shape: faster
    job = await cluster.train(**spec)
    try:
        await job.load_state_dict(weights)
        assert_close_state(await job.state_dict(), pretrained)
        await job.step(*lm_batches()[0])
        version = await job.save(str(tmp_path))
        trained = await job.state_dict()
    finally:
        await job.close()
    manifest = open(os.path.join(version, "manifest.json")).read()
    assert '"transformer.h.3.mlp.c_fc.weight"' in manifest and '"1.' not in manifest
    again = await cluster.train(**spec)
    try:
        await again.load(str(tmp_path))
        restored = await again.state_dict()
    finally:
        await again.close()
    assert set(restored) == set(trained) and all(torch.equal(restored[k], trained[k]) for k in trained)


def masked_batches(steps: int = 2) -> list[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 32, (BATCH, SEQ), generator=generator)
        mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.3).long()
        out.append(((ids, mask), torch.randn(BATCH, 4, generator=generator)))
    return out


MASKED_CASES = [(schedule, transport) for transport in ("zmq", "dist")
                for schedule in ("gpipe", "1f1b", "interleaved", "zero_bubble")]


@pytest.mark.asyncio(loop_scope="package")
@pytest.mark.parametrize(("schedule", "transport"), MASKED_CASES)
async def test_blocks_that_pass_dicts_with_an_integer_mask_train_as_one_process(
    cluster: Cluster, schedule: str, transport: str
) -> None:
    batches = masked_batches()
    reference, losses = one_process(helpers.masked_blocks, {}, batches, torch.nn.functional.mse_loss,
                                    lambda model, inputs: Chain(*model)(*inputs))
    job = await cluster.train(model="tests.helpers.models:masked_blocks", optimizer=("torch.optim:SGD", {"lr": LR}),
                              pipeline_stages=2, schedule=schedule, micro_batches=MICRO, transport=transport)
    stats, state = await train_steps(job, batches)  # each batch's inputs: (ids, mask)
    assert [s.loss for s in stats] == pytest.approx(losses, rel=1e-5)
    assert_close_state(state, reference)


@pytest.mark.asyncio(loop_scope="package")
async def test_a_lossy_codec_quantizes_the_activations_and_leaves_the_mask_exact(cluster: Cluster) -> None:
    batches = masked_batches(1)
    job = await cluster.train(model="tests.helpers.models:masked_blocks", pipeline_stages=2, micro_batches=2,
                              activation_codec="int8")
    try:
        stats = await job.step(*batches[0])
    finally:
        await job.close()
    edge = stats.bytes_per_edge["F 0->1"]
    # Per micro-batch: hidden and gate [4, 8, 16] float32 in int8 (plus scales), the int64 mask and its
    # sum exact (4*8*8 + 8 bytes): well under the raw bytes, well over the float bytes / 4.
    raw = 2 * (2 * 4 * SEQ * 16 * 4 + 4 * SEQ * 8 + 8)
    assert stats.loss == stats.loss and 2 * (2 * 4 * SEQ * 16 + 4 * SEQ * 8) <= edge < raw * 0.6


@pytest.mark.asyncio(loop_scope="package")
async def test_a_cnn_that_flattens_in_forward_trains_split_at_its_blocks(cluster: Cluster) -> None:
    generator = torch.Generator().manual_seed(5)
    batches = [(torch.randn(BATCH, 3, 8, 8, generator=generator), torch.randn(BATCH, 4, generator=generator))
               for _ in range(2)]
    reference, losses = one_process(helpers.flatten_cnn, {}, batches, torch.nn.functional.mse_loss,
                                    lambda model, inputs: model(inputs))
    job = await cluster.train(model="tests.helpers.models:flatten_cnn", optimizer=("torch.optim:SGD", {"lr": LR}),
                              pipeline_stages=2, micro_batches=MICRO, split_points=["layer2"],
                              example_inputs=batches[0][0][:2])
    stats, state = await train_steps(job, batches)
    assert [s.loss for s in stats] == pytest.approx(losses, rel=1e-5)
    assert_close_state(state, reference)
    helpers.flatten_cnn().load_state_dict(state, strict=True)


@pytest.mark.asyncio(loop_scope="package")
async def test_a_meta_init_model_whose_forward_applies_a_buffer_traces_on_meta_and_trains_with_the_real_one(
    cluster: Cluster
) -> None:
    """A causal mask kept as a buffer (nanoGPT's attention): the trace on the meta device met a real
    tensor and failed; each stage now computes with its blocks' real masks."""
    generator = torch.Generator().manual_seed(5)
    batches = [(torch.randn(BATCH, SEQ, 8, generator=generator), torch.randn(BATCH, SEQ, 8, generator=generator))
               for _ in range(2)]
    reference, losses = one_process(lambda: meta_initialized(helpers.causal_mixer, {}, seed=0), {}, batches,
                                    torch.nn.functional.mse_loss, lambda model, inputs: model(inputs))
    job = await cluster.train(model="tests.helpers.models:causal_mixer", optimizer=("torch.optim:SGD", {"lr": LR}),
                              pipeline_stages=2, micro_batches=MICRO, split_points=["blocks.2"], meta_init=True,
                              example_inputs=batches[0][0][:2], dynamic_shapes=False)
    stats, state = await train_steps(job, batches)
    assert [s.loss for s in stats] == pytest.approx(losses, rel=1e-5)
    assert_close_state(state, reference)  # the masks among it: the real ones, on both stages
    assert torch.equal(state["blocks.3.mask"], helpers.causal_mixer().blocks[3].mask)


@pytest.mark.asyncio(loop_scope="package")
async def test_models_that_cannot_be_split_as_given_say_what_to_do(cluster: Cluster) -> None:
    with pytest.raises(RemoteError, match=r"built a GPT2LMHeadModel, not an nn.Sequential.*split_points="):
        await cluster.train(model="examples.hf:gpt2", pipeline_stages=2)
    with pytest.raises(RemoteError, match=r"(?s)in module branchy \(Branchy.forward\).*What to do"):
        await cluster.train(model="tests.helpers.models:untraceable", pipeline_stages=2, split_points=["branchy"],
                            example_inputs=torch.randn(2, 8))
    with pytest.raises(RemoteError, match=r"did you mean 'transformer.h.1'"):
        await cluster.train(model="examples.hf:gpt2", pipeline_stages=2, split_points=["transformer.h1"],
                            example_inputs=torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="example_inputs=<one micro-batch"):
        await cluster.train(model="examples.hf:gpt2", pipeline_stages=2, split_points=["transformer.h.1"])
    with pytest.raises(ValueError, match="split_points names 2 modules; 2 model stages"):
        await cluster.train(model="examples.hf:gpt2", pipeline_stages=2, split_points=["a", "b"],
                            example_inputs=torch.zeros(2, 8, dtype=torch.long))
    assert [j for j in await cluster.jobs()] == []
