"""Which optimizer states a job may hold in fewer bits, checked without torch (a job spec is checked
where torch is not imported: the head, a client)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

__all__ = ["STATE_PRECISIONS", "StatePrecision", "adam_arguments"]

StatePrecision = Literal["fp32", "bf16", "int8", "int4"]
STATE_PRECISIONS: tuple[str, ...] = get_args(StatePrecision)

_ADAMS = {"Adam": False, "AdamW": True}  # torch's class -> decoupled weight decay
_IGNORED = ("foreach", "fused", "capturable", "differentiable")  # how torch runs its own kernels
_TAKEN = ("lr", "betas", "eps", "weight_decay")


def adam_arguments(path: str, kwargs: Mapping[str, Any], states: str) -> dict[str, Any]:
    """The arguments of :class:`~stages.state.quantized_adam.QuantizedAdam` in place of torch's ``Adam``
    or ``AdamW`` (``path``, ``kwargs``), holding the moments in ``states``.

    Raises:
        ValueError: the optimizer is not torch's Adam or AdamW, or asks for what the
            quantized one does not do (``amsgrad``, ``maximize``, a keyword it does not take).
    """
    module, _, name = path.partition(":")
    if not (module == "torch.optim" or module.startswith("torch.optim.")) or name not in _ADAMS:
        raise ValueError(f"optimizer_states={states!r} holds Adam's moments in fewer bits: the optimizer must be "
                         f"torch.optim:Adam or torch.optim:AdamW, got {path!r}")
    kwargs = dict(kwargs)
    for key in ("amsgrad", "maximize"):
        if kwargs.pop(key, False):
            raise ValueError(f"optimizer_states={states!r}: {key}=True is not built for quantized moments; leave it "
                             f"out or use optimizer_states='fp32'")
    for key in _IGNORED:
        kwargs.pop(key, None)
    unknown = sorted(set(kwargs) - set(_TAKEN))
    if unknown:
        raise ValueError(f"optimizer_states={states!r}: {path} keywords {unknown} are not taken by the quantized "
                         f"Adam (it takes {list(_TAKEN)})")
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return {**kwargs, "decoupled": _ADAMS[name], "states": states}
