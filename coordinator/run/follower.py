"""A reading process's snapshot index kept in step with the versions the learner commits.

The learner publishes a snapshot folder, then commits its version in the store; the API, the verifiers and the p2p
peer read those folders from other processes (other hosts, over one PostgreSQL store), so each must index a
version's signed manifest before it serves, recomputes against or announces it, and forget the versions the
learner pruned. One follower says that once, for every reader.
"""

from __future__ import annotations

from coordinator.publish.snapshots import SnapshotStore
from coordinator.store.versions import Versions


class SnapshotFollower:
    """Index (``SnapshotStore.observe``) what the store says is committed: all of it on ``refresh``, only when
    something new is asked for on ``ensure`` and ``current``, so a steady reader costs one cheap query a look."""

    def __init__(self, snapshots: SnapshotStore, versions: Versions) -> None:
        self.snapshots = snapshots
        self.versions = versions
        self._seen: int | None = None

    def refresh(self) -> None:
        """Index the committed versions not indexed yet; forget the pruned ones."""
        self.snapshots.observe(v.version for v in self.versions.all())

    def ensure(self, version: int) -> None:
        """``version`` is about to be read: index it if it was published since the last look."""
        if self.snapshots.signed_manifest(version) is None:
            self.refresh()

    def current(self) -> int | None:
        """The newest committed version, indexed (the index is refreshed whenever it changed since the last call)."""
        current = self.versions.current()
        if current is not None and current != self._seen:
            self.refresh()
            self._seen = current
        return current
