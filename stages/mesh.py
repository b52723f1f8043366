"""The pipeline x tensor x data mesh: which stage actor is which, and its groups.

Global ranks are ordered data-parallel outermost and tensor-parallel innermost (as
Megatron orders them), so a tensor-parallel group is a run of neighbouring ranks:

    rank = (d * num_pipeline + p) * num_tensor + t
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Coords", "Mesh"]


@dataclass(frozen=True, slots=True)
class Coords:
    """A stage actor's place in the mesh."""

    data: int
    pipeline: int
    tensor: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Mesh:
    """A mesh of ``pipeline * tensor * data`` stage actors."""

    pipeline: int = 1
    tensor: int = 1
    data: int = 1

    def __post_init__(self) -> None:
        for name in ("pipeline", "tensor", "data"):
            if getattr(self, name) < 1:
                raise ValueError(f"mesh {name} size must be >= 1, got {getattr(self, name)}")

    @property
    def size(self) -> int:
        return self.pipeline * self.tensor * self.data

    def rank(self, coords: Coords) -> int:
        return (coords.data * self.pipeline + coords.pipeline) * self.tensor + coords.tensor

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside a mesh of {self.size}")
        rest, tensor = divmod(rank, self.tensor)
        data, pipeline = divmod(rest, self.pipeline)
        return Coords(data=data, pipeline=pipeline, tensor=tensor)

    def pipeline_ranks(self, data: int, tensor: int) -> list[int]:
        """One pipeline replica's ranks, by pipeline stage."""
        return [self.rank(Coords(data, p, tensor)) for p in range(self.pipeline)]

    def tensor_groups(self) -> list[list[int]]:
        """Every tensor-parallel group (ranks that shard one stage), in a fixed order."""
        return [[self.rank(Coords(d, p, t)) for t in range(self.tensor)]
                for d in range(self.data) for p in range(self.pipeline)]

    def data_groups(self) -> list[list[int]]:
        """Every data-parallel group (the replicas of one shard), in a fixed order."""
        return [[self.rank(Coords(d, p, t)) for d in range(self.data)]
                for p in range(self.pipeline) for t in range(self.tensor)]

    def describe(self, rank: int) -> str:
        c = self.coords(rank)
        parts = [f"stage {c.pipeline}"]
        if self.tensor > 1:
            parts.append(f"tp {c.tensor}")
        if self.data > 1:
            parts.append(f"dp {c.data}")
        return " ".join(parts) if len(parts) > 1 else parts[0]
