"""actorpipe's own keys in a config: the spec's sections and fields, flat or not, read strictly."""

from __future__ import annotations

from typing import Any

import pytest

from schedulers.deepspeed.checks import Translation
from schedulers.deepspeed.spec_keys import sectioned, translate_spec_keys

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("layer", "expected"), [
    ({"pipeline_stages": 2}, {"parallelism": {"pipeline_stages": 2}}),
    ({"parallelism": {"schedule": "gpipe"}, "pipeline_stages": 2},
     {"parallelism": {"schedule": "gpipe", "pipeline_stages": 2}}),
    ({"model": "a.b:c", "model_kwargs": {"x": 1}}, {"training": {"model": "a.b:c", "model_kwargs": {"x": 1}}}),
    # DeepSpeed's keys of the same name stay where keys.py reads them
    ({"gradient_clipping": 1.0}, {"gradient_clipping": 1.0}),
    ({"optimizer": {"type": "SGD"}}, {"optimizer": {"type": "SGD"}}),
    ({"optimizer": ["torch.optim:SGD", {}]}, {"optimization": {"optimizer": ["torch.optim:SGD", {}]}}),
    ({"tensor_parallel": {"autotp_size": 2}}, {"tensor_parallel": {"autotp_size": 2}}),
    ({"tensor_parallel": 2}, {"parallelism": {"tensor_parallel": 2}}),
    ({"activation_checkpointing": {}}, {"activation_checkpointing": {}}),
    ({"activation_checkpointing": 2}, {"runtime": {"activation_checkpointing": 2}}),
    ({"train_batch_size": 8, "pipeline": {"stages": 2}}, {"train_batch_size": 8, "pipeline": {"stages": 2}}),
])
def test_flat_fields_move_into_their_sections_and_deepspeeds_keys_stay(
    layer: dict[str, Any], expected: dict[str, Any]
) -> None:
    t = Translation()
    assert sectioned(t, layer) == expected
    assert t.problems == []


def test_a_field_given_flat_and_in_its_section_in_one_layer_is_a_problem() -> None:
    t = Translation()
    sectioned(t, {"seed": 1, "training": {"seed": 2}})
    assert [str(p) for p in t.problems] == ["seed: given twice, flat and as training.seed; give it once"]


def test_each_field_is_set_from_its_key_and_checked_there() -> None:
    t = Translation()
    translate_spec_keys(t, {"training": {"model": "a.b:c", "seed": "0"},
                            "parallelism": {"pipeline_stages": 2, "schedule": "2f2b", "seed": 1},
                            "runtime": {"threads": 2}})
    assert t.fields == {"model": "a.b:c", "pipeline_stages": 2}
    assert t.origins == {"model": "training.model", "pipeline_stages": "parallelism.pipeline_stages"}
    assert {p.key: p.message for p in t.problems} == {
        "training.seed": "expected an integer, got '0'",
        "parallelism.schedule": "expected one of gpipe, 1f1b, interleaved, zero_bubble, zbv, dualpipev, auto, got '2f2b'",
        "parallelism.seed": "seed belongs in training (or at the top, flat)",
        "runtime.threads": "unknown key; did you mean runtime.threads_per_stage?",
    }


def test_a_missing_model_is_a_problem_unless_a_wrong_one_was_named() -> None:
    t = Translation()
    translate_spec_keys(t, {"parallelism": {"pipeline_stages": 2}})
    assert [p.key for p in t.problems] == ["model"]
    t = Translation()
    translate_spec_keys(t, {"training": {"model": 7}})
    assert [p.key for p in t.problems] == ["training.model"]
