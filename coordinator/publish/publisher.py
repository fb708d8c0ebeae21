"""The publisher role: writes each new policy version (and, when due, a learner checkpoint) off the learner's
critical path.

The learner hands over a :class:`Publication` right after its optimizer step: the version's weights in the publish
dtype (a CPU copy, taking it *is* the dtype conversion; or, for a bf16 learner on the CPU publishing bf16, its live
weights, which its next optimizer update does not change until they are written, coordinator.engine.learner), and
optionally a checkpoint as references to its live tensors (its next optimizer step waits until they are written,
see :class:`coordinator.publish.checkpoints.CheckpointState`). One worker thread then writes the checkpoint first
(so the learner is released early), then the snapshot — ``model.safetensors`` first, from the weights (settled,
coordinator.publish.weights_file), then the other files, GGUF (read back from ``model.safetensors``), sha256, fsync,
signed manifest last (coordinator.publish.snapshots) — while the learner already computes the next step. The weights
are released as soon as ``model.safetensors`` is written (``SnapshotFiles.release``), and the learner takes its next
copy only after that, so at most one copy is ever in flight (the learner's peak memory is its training state plus
one snapshot in the publish dtype, or none with live weights, docs/benchmarks.md).

Publications complete in submission order. A version becomes leasable only when the caller records it in the
database after the returned future resolves; until then it exists only as files that a restart removes. The
unit depends on nothing but the snapshot and checkpoint folders, so it can move into its own process.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from coordinator.memory import release_free_heap
from coordinator.publish.checkpoints import CheckpointState, CheckpointStore
from coordinator.publish.snapshots import SnapshotFiles, SnapshotStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Publication:
    version: int
    files: SnapshotFiles
    created_at: float
    checkpoint: CheckpointState | None = None


@dataclass(frozen=True)
class Published:
    version: int
    manifest_sha: str
    publish_s: float  # snapshot writing, hashing, fsync and manifest (background)
    checkpoint_s: float  # checkpoint writing (background; 0 when none was due)
    checkpoint_bytes: int
    snapshot_bytes: int  # bytes of this version's own folder (shared base files not counted)


class Publisher:
    """A single background thread that publishes versions in order."""

    def __init__(self, snapshots: SnapshotStore, checkpoints: CheckpointStore) -> None:
        self.snapshots = snapshots
        self.checkpoints = checkpoints
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publisher")

    def submit(self, pub: Publication) -> Future[Published]:
        """Queue a publication; the future resolves when its files and manifest are durable."""
        return self._executor.submit(self._publish, pub)

    def _publish(self, pub: Publication) -> Published:
        ck_s, ck_bytes = 0.0, 0
        try:
            if pub.checkpoint is not None:
                ck_s, ck_bytes = self.checkpoints.write(pub.checkpoint, pub.created_at)
            t0 = time.monotonic()
            sha = self.snapshots.publish(pub.version, pub.files, pub.created_at)
        finally:
            pub.files.release()  # the learner's next hand-over waits for this, even after a failure
            release_free_heap()  # this thread's arena keeps nothing the learner thread could reuse (coordinator.memory)
        publish_s = time.monotonic() - t0
        folder = self.snapshots.folder(pub.version)
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        logger.debug("published version %d in %.2fs (%d bytes), checkpoint %.2fs", pub.version, publish_s, size,
                     ck_s)
        return Published(pub.version, sha, publish_s, ck_s, ck_bytes, size)

    def close(self) -> None:
        """Finish what was queued (so nothing is left half-written by a clean stop), then stop the thread."""
        self._executor.shutdown(wait=True)
