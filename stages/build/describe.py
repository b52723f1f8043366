"""A worker's view of a model before a job is placed: its layers' sizes and times.

The scheduler partitions a job from what this actor measures, so that the head never
imports or calls a user's factory. The scheduler spawns one on a worker, asks, and
stops it; everything runs in a thread (the node keeps heartbeating) under the node's
own allow-list.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from actors._actor import Actor, endpoint
from actors._errors import ActorError, NotAllowed, contained
from actors._nodes import HEAD
from actors._registry import DEFAULT_ALLOW, EXAMPLE_FACTORIES, register_actor
from stages.build.layers import layer_parameter_counts, layer_times

__all__ = ["ModelInspector"]


@register_actor("model_inspector")
class ModelInspector(Actor):
    """Builds a job's model on a worker to describe it to the scheduler; never on the head."""

    async def on_start(self) -> None:
        if HEAD in self.runtime.actor_names():  # the head's own runtime: it hosts the head actor
            raise NotAllowed(f"{self._where()} is the head, which never imports user code; ask a worker")

    def _where(self) -> str:
        context = self.node_context
        return f"node {context.name}" if context is not None else "this process"

    @property
    def _allow(self) -> tuple[str, ...]:
        context = self.node_context
        return context.allow if context is not None else DEFAULT_ALLOW + EXAMPLE_FACTORIES  # in the driver's process

    @endpoint(roles=("head",))
    async def describe_model(self, path: str, kwargs: dict[str, Any], type_pattern: str | None = None,
                             whole: bool = False, trainable: bool = False) -> list[int]:
        """The parameter count of each layer of the model ``path`` builds from ``kwargs``
        (with ``type_pattern``: 1 for each layer whose class name matches it, else 0; ``whole``:
        one count, the whole model's, of any module; ``trainable``: of the parameters that
        require gradients alone).

        The model is built on the meta device (no memory for its parameters) in a
        thread; ``kwargs`` is as large as a message allows.

        Raises:
            NotAllowed: the allow-list refuses ``path`` (the message names this node).
            ValueError: ``path`` is not an import path.
            TypeError: ``kwargs`` is not a map, or the factory does not take it.
        """
        if not isinstance(kwargs, dict):
            raise TypeError(f"model kwargs must be a map, got {type(kwargs).__name__}")
        try:
            return await asyncio.to_thread(contained, functools.partial(
                layer_parameter_counts, path, kwargs, self._allow, type_pattern, whole=bool(whole),
                trainable=bool(trainable)))
        except NotAllowed as exc:
            raise NotAllowed(f"{self._where()} refused the model: {exc.message}") from None
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(f"{self._where()} cannot build the model: {exc}", name=exc.name) from None
        except Exception as exc:
            if not isinstance(exc, ActorError):
                exc.add_note(f"on {self._where()}, which the head asked to count the model's layers")
            raise

    @endpoint(roles=("head",))
    async def profile_model(self, path: str, kwargs: dict[str, Any], data: str | None, data_kwargs: dict[str, Any],
                            micro_batches: int, seed: int, example: Any = None,
                            micro_batch_size: int | None = None) -> list[int]:
        """Microseconds each layer of the model takes, forward and backward, on a sample micro-batch
        from the job's data factory, or on ``example`` (one micro-batch) without one
        (``partition_method="profile"``); like :meth:`describe_model`, in a thread, under
        this node's allow-list."""
        if not isinstance(kwargs, dict) or not isinstance(data_kwargs, dict):
            raise TypeError("model and data kwargs must be maps")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r:.40}")
        try:
            return await asyncio.to_thread(contained, functools.partial(
                layer_times, path, kwargs, self._allow, data, data_kwargs, micro_batches, int(seed), example=example,
                micro_batch_size=micro_batch_size if isinstance(micro_batch_size, int) else None))
        except NotAllowed as exc:
            raise NotAllowed(f"{self._where()} refused the model or data: {exc.message}") from None
