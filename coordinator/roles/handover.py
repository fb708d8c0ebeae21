"""On the learner's thread: one optimizer step, then the hand-over of the new weights (and a checkpoint) to the
publisher — with one copy of the weights in flight at most.

Split from coordinator/roles/learner.py (issue 33): the role's event loop decides when a step runs and records it;
this is the part that runs on the torch thread and holds the previous hand-over until the publisher wrote it.
"""

from __future__ import annotations

import time
from typing import Any

from coordinator.config import SnapshotConfig
from coordinator.publish.checkpoints import CheckpointState, CheckpointStore
from coordinator.publish.snapshots import SnapshotFiles


class HandOver:
    def __init__(self, snapshots: SnapshotConfig, checkpoints: CheckpointStore, sharded: bool) -> None:
        self.snapshots = snapshots
        self.checkpoints = checkpoints
        self.sharded = sharded  # FSDP ranks: a checkpoint is staged where every rank writes its shards
        # the last hand-over's files: the next copy of the weights is taken only once the publisher has written them
        self._handed_over: SnapshotFiles | None = None

    def files(self, learner: Any, checkpoint: bool) -> tuple[SnapshotFiles, CheckpointState | None]:
        """What the publisher needs to write this version (and a checkpoint). Waits until the previous version's
        weights are written, which frees its copy: one copy of the weights in flight. (With live weights handed
        over, Learner.snapshot_files, the optimizer step before this already waited for it.)"""
        if self._handed_over is not None:
            self._handed_over.written.wait()
        files = learner.snapshot_files(self.snapshots.dtype)
        try:
            state = None
            if checkpoint:
                staging = self.checkpoints.staging(learner.model_version) if self.sharded else None
                state = learner.checkpoint_state(staging)
        except BaseException:
            files.release()
            raise
        self._handed_over = files
        return files, state

    def learn(self, learner: Any, samples: list[Any], checkpoint: bool
              ) -> tuple[dict[str, Any], SnapshotFiles, CheckpointState | None]:
        """One optimizer step, then the hand-over to the publisher."""
        metrics: dict[str, Any] = learner.train_step(samples)
        t0 = time.monotonic()
        files, state = self.files(learner, checkpoint)
        # the weight copy in the publish dtype, and any wait for the previous version's files to be written
        metrics["handover_s"] = time.monotonic() - t0
        return metrics, files, state
