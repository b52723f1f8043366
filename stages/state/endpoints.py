"""A stage actor's endpoints for its state: state dicts, checkpoints and exports, and snapshots.

Mixed into :class:`~stages.actor.StageActor`, which gives them its parts (``_parts()``); the
work is :class:`~stages.state.stage_state.StageState`'s. Only the head calls them, except a
neighbour stage keeping its snapshot (:meth:`SnapshotEndpoints.keep_snapshot`); the head
resolves every path for the job's owner first (see docs/security.md).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from actors._actor import endpoint

__all__ = ["SnapshotEndpoints", "StateEndpoints"]


class StateEndpoints:
    """State dicts, checkpoint saves and loads, and exports of one stage."""

    def _parts(self) -> Any:
        raise NotImplementedError  # StageActor's

    @endpoint(roles=("head",))
    async def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's share of the model's state, under the unpartitioned model's keys."""
        return await self._parts().state.state_dict()

    @endpoint(roles=("head",))
    async def shard_specs(self) -> dict[str, list[int]]:
        """How this stage's tensor-parallel parameters are split: key -> [dim, world, num_fused]."""
        return dict(self._parts().built.specs)

    @endpoint(roles=("head",))
    async def load_state_dict(self, state: dict[str, torch.Tensor], prepare: bool = False) -> list[str]:
        """Loads the entries this stage holds; returns the keys it took (snapshots before it are dropped).
        ``prepare``: checks them and keeps them for :meth:`checkpoint_apply` (``weights_only``) instead."""
        return await self._parts().state.load_state_dict(state, bool(prepare))

    @endpoint(roles=("head",))
    async def state_keys(self, aliases: bool = True) -> list[str]:
        """The whole model's keys this stage holds and (``aliases``) its tied tensors' other names."""
        return self._parts().state.state_keys(bool(aliases))

    @endpoint(roles=("head",))
    async def passed_over(self, keys: list[str]) -> list[str]:
        """Of ``keys`` (a weights file's that no stage holds), those the model's ``from_pretrained`` passes
        over (Hugging Face's ``_keys_to_ignore_on_load_unexpected``)."""
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise TypeError("keys must be a list of str")
        return self._parts().state.passed_over(keys)

    @endpoint(roles=("head",))
    async def checkpoint_begin(self, directory: str, within: str | None = None) -> str:
        """As the job's coordinator: makes the job's staging directory in ``directory``; returns it.

        Only the head calls it, with a path it resolved for the job's owner; ``within`` is
        that client's subtree of the checkpoint root, which ``directory`` must not leave
        on this node either (links resolved), or None for the admin.
        """
        return await self._parts().state.begin(directory, within)

    @endpoint(roles=("head",))
    async def checkpoint_write(self, staging: str, file: str, weights_only: bool = False) -> dict[str, Any]:
        """Writes this stage's tensors and optimizer state (or its weights alone) to ``staging/file``;
        returns their manifest items."""
        return await self._parts().state.write(staging, file, bool(weights_only))

    @endpoint(roles=("head",))
    async def checkpoint_commit(self, directory: str, staging: str, manifest: dict[str, Any], keep: int = 1,
                                spare: str | None = None) -> str:
        """As the coordinator: completes the save (manifest, fsyncs, rename, pointer), keeping the newest
        ``keep`` versions (0: every one) and the version named ``spare``; returns the version."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be an int >= 0, got {str(keep)[:20]!r}")
        return await self._parts().state.commit(directory, staging, manifest, keep, spare)

    @endpoint(roles=("head",))
    async def checkpoint_manifest(self, directory: str, within: str | None = None) -> list[Any]:
        """As the coordinator: ``[version directory, manifest]`` of the checkpoint ``LATEST`` names
        (``within``: as for :meth:`checkpoint_begin`)."""
        return await self._parts().state.manifest(directory, within)

    @endpoint(roles=("head",))
    async def checkpoint_check(self, version: str, plan: dict[str, Any]) -> list[str]:
        """Load, phase one: reads and checks this stage's part (``plan``); returns every problem found."""
        return await self._parts().state.check(version, plan)

    @endpoint(roles=("head",))
    async def checkpoint_apply(self, weights_only: bool) -> None:
        """Load, phase two: copies what :meth:`checkpoint_check` prepared (step numbers go on rising)."""
        await self._parts().state.apply(weights_only)

    @endpoint(roles=("head",))
    async def export_begin(self, directory: str, within: str | None = None) -> str:
        """As the coordinator: makes the export's directory (new or empty) and its staging directory."""
        return await self._parts().state.export_begin(directory, within)

    @endpoint(roles=("head",))
    async def export_write(self, staging: str, file: str, plan: dict[str, Any] | None = None,
                           format: str = "safetensors") -> dict[str, Any]:
        """Writes this pipeline stage's weights under the model's own names to ``staging/file``."""
        return await self._parts().state.export_write(staging, file, plan, str(format))

    @endpoint(roles=("head",))
    async def export_commit(self, directory: str, staging: str, written: list[dict[str, Any]],
                            format: str = "safetensors") -> str:
        """As the coordinator: completes the export (the files, the index, the config; or DCP's metadata)."""
        return await self._parts().state.export_commit(directory, staging, written, str(format))

    @endpoint(roles=("head",))
    async def checkpoint_discard(self) -> None:
        """Load, abandoned (another stage found problems): forgets what :meth:`checkpoint_check` read."""
        self._parts().state.discard()


class SnapshotEndpoints:
    """In-memory snapshots for recovery: a stage's own, and the one its neighbour sends it to keep
    (the stage takes and sends them: ``StepOrder.snapshot``)."""

    _step: int  # the step the stage is in (StageActor's)

    def _parts(self) -> Any:
        raise NotImplementedError  # StageActor's

    def _refusing(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError  # StageActor's: refuses a caller that is not one of the job's nodes

    @endpoint(concurrent=True, roles=("node",))
    async def keep_snapshot(self, owner: int, index: int, state: dict[str, torch.Tensor]) -> None:
        """Keeps pipeline rank ``owner``'s snapshot after ``index`` applied steps, to restore it elsewhere."""
        with self._refusing():
            self._parts().state.keep(owner, index, state)

    @endpoint(concurrent=True, roles=("head",))
    async def snapshots(self) -> dict[str, Any]:
        """The snapshot step counts this stage has: ``{"own": [...], "held": {"RANK": [...]}}``."""
        return self._parts().state.indices()

    @endpoint(roles=("head",))
    async def held_snapshot(self, owner: int, index: int) -> dict[str, torch.Tensor]:
        """Pipeline rank ``owner``'s snapshot after ``index`` applied steps (for its replacement)."""
        return self._parts().state.held_snapshot(owner, index)

    @endpoint(roles=("head",))
    async def own_snapshot(self, index: int) -> dict[str, torch.Tensor]:
        """This stage's own snapshot after ``index`` applied steps (a lost replica's replacement restores it)."""
        return self._parts().state.own_snapshot(index)

    @endpoint(roles=("head",))
    async def restore_snapshot(self, index: int, state: dict[str, torch.Tensor] | None = None) -> None:
        """Rolls back to the snapshot after ``index`` applied steps (or to ``state``, a lost predecessor's):
        parameters and optimizer state exactly, nothing of any step in flight."""
        await self._parts().state.restore(index, state, self._step)
