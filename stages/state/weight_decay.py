"""Which parameters the optimizer's weight decay leaves alone: the job's ``no_weight_decay``.

Megatron-LM and Hugging Face's Trainer decay neither biases nor normalization layers'
weights; torch's optimizers decay every parameter they are given unless a second
parameter group says ``weight_decay=0``. A job's ``no_weight_decay`` names that group:
:data:`BIASES_AND_NORMS` (every parameter of fewer than two dimensions, Megatron's rule,
which the shapes decide alike on the meta device, in a traced graph and in a
tensor-parallel shard), or names as ``model.named_parameters()`` gives them, ``*`` a
wildcard. Every stage builds its optimizer with the same two groups, in that order
(either may be empty), so a learning-rate schedule's per-group values fit every stage.

:func:`parameter_groups` is the same rule for one process: the groups a torch optimizer
takes there train to the same bits as the job.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

__all__ = ["BIASES_AND_NORMS", "check_rule", "decays", "parameter_groups"]

BIASES_AND_NORMS = "biases_and_norms"
MAX_PATTERNS, MAX_PATTERN_CHARS = 256, 512  # what a spec may ask every stage to match every name against


class _Parameter(Protocol):
    """What the rule asks of a parameter (a stdlib-only leaf: the job spec checks the rule on the
    head, which imports no torch)."""

    def dim(self) -> int: ...


def check_rule(key: str, rule: Any) -> tuple[str, ...]:
    """``rule`` as the spec keeps it: ``()``, ``(BIASES_AND_NORMS,)`` or name patterns.

    Raises:
        ValueError: not the shorthand, nor a list of non-empty names.
    """
    if isinstance(rule, str):
        if rule != BIASES_AND_NORMS:
            raise ValueError(f"{key} must be {BIASES_AND_NORMS!r} or a list of parameter names (* a wildcard), "
                             f"got {rule!r:.60}; one pattern goes in a list: [{rule!r:.40}]")
        return (rule,)
    if not isinstance(rule, (list, tuple)) or not all(isinstance(name, str) and name for name in rule):
        raise ValueError(f"{key} must be {BIASES_AND_NORMS!r} or a list of parameter names (* a wildcard), "
                         f"got {rule!r:.60}")
    if len(rule) > MAX_PATTERNS or any(len(name) > MAX_PATTERN_CHARS for name in rule):
        raise ValueError(f"{key}: at most {MAX_PATTERNS} names of at most {MAX_PATTERN_CHARS} characters each")
    return tuple(rule)


def decays(names: Sequence[str], param: _Parameter, rule: Sequence[str]) -> bool:
    """Whether a parameter known by ``names`` (as the whole model names it: a tied one by each of its
    names) takes weight decay under ``rule``: not where any of its names matches."""
    if BIASES_AND_NORMS in rule and param.dim() < 2:
        return False
    patterns = [pattern for pattern in rule if pattern != BIASES_AND_NORMS]
    return not any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns for name in names)


def parameter_groups(named: Iterable[tuple[str, Any]], rule: Sequence[str]) -> list[dict[str, Any]]:
    """The parameter groups an optimizer takes for ``rule``: ``[{"params": decayed}, {"params": the rest,
    "weight_decay": 0.0}]``, or one group of every parameter without a rule.

    ``named`` gives a tied parameter under each of its names (in one process,
    ``model.named_parameters(remove_duplicate=False)``); each parameter goes in once, in the order
    it first comes.
    """
    names: dict[int, list[str]] = {}
    params: dict[int, Any] = {}
    for name, param in named:
        names.setdefault(id(param), []).append(name)
        params.setdefault(id(param), param)
    if not rule:
        return [{"params": list(params.values())}]
    decayed: list[Any] = []
    kept: list[Any] = []
    for key, param in params.items():
        (decayed if decays(names[key], param, rule) else kept).append(param)
    return [{"params": decayed}, {"params": kept, "weight_decay": 0.0}]
