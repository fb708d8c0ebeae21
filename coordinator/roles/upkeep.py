"""The learner role's housekeeping around each step: when a checkpoint is due, what the verifiers spent meanwhile,
which files the run directory may drop, and the held-out evaluations it asks for.

Split from coordinator/roles/learner.py (issue 33): none of it decides what is trained; all of it reads or bounds
what training leaves behind, through the store and the run directory.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from coordinator.config import CoordinatorConfig
from coordinator.core.leases import kept_versions
from coordinator.publish.checkpoints import CheckpointStore
from coordinator.publish.snapshots import SnapshotStore
from coordinator.run.names import VERIFIER_PREFIX
from coordinator.run.records import VerifierTotals
from coordinator.run.workqueue import Bell
from coordinator.store.hops import EVALUATE, EvaluateRequest
from coordinator.store.store import Store

logger = logging.getLogger(__name__)


class Upkeep:
    def __init__(self, config: CoordinatorConfig, store: Store, bell: Bell, snapshots: SnapshotStore,
                 checkpoints: CheckpointStore, clock: Callable[[], float]) -> None:
        self.config = config
        self.store = store
        self.bell = bell
        self.snapshots = snapshots
        self.checkpoints = checkpoints
        self.clock = clock
        self._checkpoint_version = 0  # the version of the newest checkpoint, and when it was taken (monotonic)
        self._checkpoint_at = time.monotonic()
        self._verify_s_seen = self._eval_s_seen = 0.0

    def checkpointed(self, version: int) -> None:
        """A checkpoint of ``version`` was taken now (or found at start-up)."""
        self._checkpoint_version, self._checkpoint_at = version, time.monotonic()

    def checkpoint_due(self, new_version: int) -> bool:
        cfg = self.config.learner
        return (new_version >= cfg.max_steps
                or (cfg.checkpoint_every_steps > 0
                    and new_version - self._checkpoint_version >= cfg.checkpoint_every_steps)
                or (cfg.checkpoint_every_s > 0
                    and time.monotonic() - self._checkpoint_at >= cfg.checkpoint_every_s))

    def verifier_seconds(self) -> tuple[float, float]:
        """Seconds the verifiers spent recomputing and evaluating since the last call, as they report them
        (verification runs in the verifiers, off the learner: a step's metrics say what it cost meanwhile)."""
        statuses = [VerifierTotals.model_validate(s) for name, s in self.store.role_status.all().items()
                    if name.startswith(VERIFIER_PREFIX)]
        verify, evaluate = sum(s.recompute_s for s in statuses), sum(s.eval_s for s in statuses)
        spent = max(0.0, verify - self._verify_s_seen), max(0.0, evaluate - self._eval_s_seen)
        self._verify_s_seen, self._eval_s_seen = verify, evaluate
        return spent

    def prune(self, current: int, run_dir: Path) -> None:
        """Bound the run directory: keep_last versions (and those under a live lease or waiting for their held-out
        evaluation), the newest checkpoint, keep_exports exports."""
        now = self.clock()
        leases = [j.view for j in self.store.jobs.active()] + self.store.jobs.still_held(now)  # (a replicated job's)
        keep = kept_versions(current, self.config.snapshots.keep_last, leases, now, self.store.work.versions(EVALUATE))
        self.snapshots.prune(keep)
        self.checkpoints.prune(current)
        exports = run_dir / "exports"
        if exports.exists():
            done = sorted(p for p in exports.iterdir() if p.is_dir() and not p.name.endswith(".partial"))
            for old in done[: max(0, len(done) - self.config.snapshots.keep_exports)]:
                logger.info("removing old export %s (snapshots.keep_exports)", old)
                shutil.rmtree(old, ignore_errors=True)

    def evaluate(self, version: int) -> None:
        """Ask the verifiers for a held-out evaluation of a published version (off the learner); the first
        verifier records it when done."""
        self.store.work.submit(EVALUATE, version, EvaluateRequest(), time.time())
        self.bell.ring()
