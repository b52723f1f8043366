"""A training job's specification: what ``cluster.train(...)`` accepts, checked up front."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from schedulers.schedules import SCHEDULES
from transport.codecs import CODEC_NAMES

__all__ = ["PARTITION_METHODS", "JobSpec"]

PARTITION_METHODS = ("parameters", "uniform")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """The keyword arguments of ``cluster.train``; see the README for each."""

    model: str
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    loss: str = "torch.nn.functional:mse_loss"
    optimizer: tuple[str, dict[str, Any]] = ("torch.optim:SGD", {"lr": 0.01})
    pipeline_stages: int = 1
    tensor_parallel: int = 1
    data_parallel: int = 1
    schedule: str = "1f1b"
    micro_batches: int = 1
    virtual_stages: int | None = None
    partition_method: str = "parameters"
    activation_codec: str | list[str] = "none"
    gradient_codec: str | list[str] = "none"
    error_feedback: bool = False
    measure_codec_error: bool = True
    reduce_codec: str = "none"
    transport: str = "zmq"
    seed: int = 0
    data: str | None = None
    data_kwargs: dict[str, Any] = field(default_factory=dict)
    threads_per_stage: int | None = 1
    gradient_accumulation_fusion: bool = True
    keep_freed_memory: bool = True
    step_timeout_s: float = 600.0

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> JobSpec:
        """Builds and checks a spec.

        Raises:
            ValueError: an unknown key or a value that cannot work; the message says
                which and what would.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown train() argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "model" not in kwargs:
            raise ValueError("train() needs model='package.module:factory'")
        args = dict(kwargs)
        if "optimizer" in args:
            args["optimizer"] = _optimizer(args["optimizer"])
        spec = cls(**args)
        spec.check()
        return spec

    def check(self) -> None:
        for name in ("pipeline_stages", "tensor_parallel", "data_parallel", "micro_batches"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.partition_method not in PARTITION_METHODS:
            raise ValueError(f"partition_method must be one of {', '.join(PARTITION_METHODS)}")
        if self.step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        self.edge_codecs("activation_codec")
        self.edge_codecs("gradient_codec")
        if self.transport not in ("zmq", "dist"):
            raise ValueError(f"transport must be 'zmq' or 'dist', got {self.transport!r}")
        if self.reduce_codec not in CODEC_NAMES:
            raise ValueError(f"reduce_codec: unknown codec {self.reduce_codec!r}; choose from {', '.join(CODEC_NAMES)}")

    def edge_codecs(self, name: str) -> list[str]:
        """``activation_codec`` or ``gradient_codec`` as one codec per stage boundary.

        Raises:
            ValueError: an unknown codec, or a list whose length is not the number of boundaries.
        """
        value = getattr(self, name)
        edges = self.num_model_stages - 1
        codecs = [value] * edges if isinstance(value, str) else list(value)
        if len(codecs) != edges:
            raise ValueError(
                f"{name} lists {len(codecs)} codecs but the pipeline has {edges} stage boundaries "
                f"({self.num_model_stages} model stages); give one per boundary or a single name"
            )
        for codec in codecs:
            if codec not in CODEC_NAMES:
                raise ValueError(f"{name}: unknown codec {codec!r}; choose from {', '.join(CODEC_NAMES)}")
        return codecs

    @property
    def num_virtual_stages(self) -> int:
        if self.schedule == "interleaved":
            return self.virtual_stages or 2
        return 1

    @property
    def num_model_stages(self) -> int:
        return self.pipeline_stages * self.num_virtual_stages

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _optimizer(value: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(value, str):
        return (value, {})
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], dict):
        return (value[0], dict(value[1]))
    raise ValueError(f"optimizer must be 'package.module:Class' or (path, kwargs), got {value!r}")
