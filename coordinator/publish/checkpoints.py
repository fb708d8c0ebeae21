"""Learner checkpoints: the trainable weights (training dtype) and the optimizer state at one version.

Written every ``learner.checkpoint_every_steps`` steps or ``learner.checkpoint_every_s`` seconds, not every
version (at 0.5 B parameters the optimizer state is 4 GB: saving it per version cost 7 s of every step). A
restart loads the newest checkpoint at or below the current version and *replays* the steps since then from
the results the database recorded for them (each step's ingested results, in the order they were trained),
so the learner resumes with the weights and optimizer moments it had, not with stale moments.

Layout: ``checkpoints/vNNNNNN/{weights.safetensors, optimizer.pt, checkpoint.json}``, written into a hidden
temporary folder and renamed; ``checkpoint.json`` is written last, so a folder without it is incomplete.
Only the newest complete checkpoint at or below the current version is kept (disk: one learner state).

A learner on FSDP ranks (coordinator.engine.fsdp) writes a *sharded* checkpoint instead: every rank writes its shards
with torch.distributed.checkpoint into the hidden folder at hand-over time, and the publisher completes it the same
way (``checkpoint.json`` with ``"format": 2``, the world size and whether optimizer state is in it; then the
rename). It resumes only on as many ranks (:meth:`CheckpointStore.info` says how many).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from coordinator.publish.snapshots import fsync_dir

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "weights.safetensors"
OPTIMIZER_FILE = "optimizer.pt"  # also the name coordinator.api.ops_actions copies into an export
INFO_FILE = "checkpoint.json"


class CheckpointInfo(TypedDict):
    """A checkpoint's ``checkpoint.json``: format 1 (one device: weights and optimizer files) or 2 (FSDP shards,
    written by ``world_size`` ranks, with the optimizer's state where ``optimizer``)."""

    version: int
    created_at: float
    format: int
    world_size: NotRequired[int]
    optimizer: NotRequired[bool]


@dataclass(frozen=True, slots=True)
class ShardedCheckpoint:
    """An FSDP checkpoint whose ranks already wrote (and synced) their shards into ``dir``."""

    dir: str
    world_size: int
    optimizer: bool  # whether the shards hold the optimizer's state


@dataclass(frozen=True)
class CheckpointState:
    """What a checkpoint holds, as references into the learner's live tensors: the learner does not update
    them until ``release()`` is called (its next optimizer step waits for it), so no copy is needed."""

    version: int
    weights: dict[str, Tensor]  # trainable parameters by name (peft names for LoRA: adapter only)
    optimizer: dict[str, Any]  # torch optimizer state_dict(): torch's own open shape (its typing says the same)
    release: Any  # callable: the learner may update these tensors again
    sharded: ShardedCheckpoint | None = None  # FSDP: the staging folder the ranks already wrote


class CheckpointStore:
    """The ``checkpoints/`` folder of a run."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def folder(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def write(self, state: CheckpointState, now: float) -> tuple[float, int]:
        """Write ``state`` atomically; returns (seconds, bytes). Calls ``state.release()`` when the learner's
        tensors have been read, even on failure."""
        import torch
        from safetensors.torch import save_file

        t0 = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        info: CheckpointInfo = {"version": state.version, "created_at": now, "format": 1}
        if state.sharded is not None:  # the ranks wrote (and synced) their shards already
            tmp = Path(state.sharded.dir)
            info["format"], info["world_size"], info["optimizer"] = 2, state.sharded.world_size, state.sharded.optimizer
        else:
            tmp = self.staging(state.version)
            tmp.mkdir()
        try:
            if state.sharded is None:
                try:
                    save_file({k: v.detach().contiguous() for k, v in state.weights.items()},
                              str(tmp / WEIGHTS_FILE))
                    torch.save(state.optimizer, tmp / OPTIMIZER_FILE)
                finally:
                    state.release()
                for name in (WEIGHTS_FILE, OPTIMIZER_FILE):
                    with open(tmp / name, "rb") as fh:
                        os.fsync(fh.fileno())
            with open(tmp / INFO_FILE, "w") as fh:
                json.dump(info, fh)
                fh.flush()
                os.fsync(fh.fileno())
            fsync_dir(tmp)
            final = self.folder(state.version)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        size = sum(p.stat().st_size for p in final.iterdir() if p.is_file())
        return time.monotonic() - t0, size

    def staging(self, version: int) -> Path:
        """A fresh hidden folder name for writing the checkpoint of ``version`` (removed at startup if left)."""
        return self.root / f".tmp-v{version}-{uuid.uuid4().hex[:8]}"

    def info(self, version: int) -> CheckpointInfo:
        """A complete checkpoint's ``checkpoint.json``: format 1 (one device) or 2 (sharded, with world_size)."""
        info: CheckpointInfo = json.loads((self.folder(version) / INFO_FILE).read_text())
        return info

    def _complete(self) -> list[int]:
        if not self.root.exists():
            return []
        out = []
        for entry in self.root.iterdir():
            name = entry.name
            if name.startswith("v") and name[1:].isdigit() and (entry / INFO_FILE).exists():
                out.append(int(name[1:]))
        return sorted(out)

    def latest(self, at_most: int) -> int | None:
        """The newest complete checkpoint's version that is ≤ ``at_most`` (the current published version)."""
        ok = [v for v in self._complete() if v <= at_most]
        return ok[-1] if ok else None

    def load(self, version: int, device: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """(weights, optimizer state) of a complete checkpoint."""
        import torch
        from safetensors.torch import load_file

        folder = self.folder(version)
        weights = load_file(str(folder / WEIGHTS_FILE), device=device)
        optimizer = torch.load(folder / OPTIMIZER_FILE, weights_only=True, map_location=device)
        return weights, optimizer

    def prune(self, current: int, *, startup: bool = False) -> None:
        """Keep only the newest complete checkpoint ≤ ``current``; remove older ones and anything above
        ``current`` (a checkpoint of a version the database never recorded). Hidden temporary folders (a write
        in progress, or one a crash interrupted) are removed only at ``startup``."""
        if not self.root.exists():
            return
        keep = self.latest(current)
        for entry in self.root.iterdir():
            name = entry.name
            if name.startswith("."):
                if startup:
                    shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
                continue
            version = int(name[1:]) if name.startswith("v") and name[1:].isdigit() else None
            if keep is not None and version == keep:
                continue
            if version is not None and keep is None and version == current and (entry / OPTIMIZER_FILE).exists():
                continue  # a run directory from before checkpoints: its per-version optimizer state
            logger.debug("removing checkpoint folder %s", entry)
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)

    def disk_bytes(self) -> int:
        if not self.root.exists():
            return 0
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())
