"""Rebuilding the learner at the run's current version after a restart: the newest checkpoint's weights and
optimizer state, then the steps recorded since it, replayed from their ingested results in training order
(coordinator.publish.checkpoints), so the learner continues exactly where the recorded run was.

Split from coordinator/roles/learner.py (issue 33).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.publish.checkpoints import CheckpointStore
from coordinator.publish.snapshots import SnapshotStore
from coordinator.roles.batches import Batches

logger = logging.getLogger(__name__)


async def start_folder(config: CoordinatorConfig, snapshots: SnapshotStore, current: int, checkpoint: int | None,
                       model_dir: Callable[[], Awaitable[Path]]) -> Path:
    """The folder the learner is built from: the current version's weights; for a LoRA run with a checkpoint,
    the base model (the run's shared base folder of snapshots, else model.path, from ``model_dir``) — a LoRA
    checkpoint holds the adapter only, which goes on top of the base, never on merged weights."""
    if config.learner.lora_rank > 0 and checkpoint is not None:
        base = snapshots.base_dir
        return base if (base / "config.json").exists() else await model_dir()
    return snapshots.folder(current)


async def restore(learner: Any, checkpoints: CheckpointStore, checkpoint: int | None, current: int,
                  batches: Batches, run: Callable[..., Awaitable[Any]]) -> None:
    """Bring ``learner`` (built from :func:`start_folder`) to ``current``, on the learner thread through ``run``.
    Run directories without a checkpoint resume from the published weights with a fresh optimizer (or the
    per-version optimizer state older releases wrote)."""
    if checkpoint is None:
        learner.model_version = current
        legacy = checkpoints.folder(current) / "optimizer.pt"
        if not await run(learner.load_optimizer, legacy) and current > 0:
            logger.warning("no checkpoint for version %d; continuing with a fresh optimizer", current)
        return
    info = checkpoints.info(checkpoint)
    if info.get("format") == 2:  # sharded: every rank reads its own shards
        await run(learner.load_sharded_checkpoint, checkpoints.folder(checkpoint), checkpoint,
                  int(info["world_size"]), bool(info.get("optimizer")))
    else:
        weights, optimizer = await run(checkpoints.load, checkpoint, learner.device)
        await run(learner.load_checkpoint, weights, optimizer, checkpoint)
        del weights, optimizer
    t0 = time.monotonic()
    for version, job_ids in batches.recorded_after(checkpoint, current):
        await run(learner.train_step, batches.of(version, job_ids).samples)
    assert learner.model_version == current, (learner.model_version, current)
    logger.info("restored the checkpoint of version %d and replayed %d steps in %.1fs", checkpoint,
                current - checkpoint, time.monotonic() - t0)
