"""A reading process (API, verifier, p2p peer) indexes what the learner committed through one follower: a version is
readable here as soon as the store commits it, and not before, and a pruned one is forgotten."""

from __future__ import annotations

from pathlib import Path

from coordinator.publish.snapshots import SnapshotStore
from coordinator.run.follower import SnapshotFollower
from coordinator.store.store import Store
from shared import crypto


def _write(tag: bytes):  # type: ignore[no-untyped-def]
    def write(folder: Path) -> None:
        (folder / "config.json").write_bytes(b"{}")
        (folder / "model.safetensors").write_bytes(tag)

    return write


def test_a_version_is_indexed_once_committed_and_forgotten_once_pruned(tmp_path: Path) -> None:
    key = crypto.generate_key()
    writer = SnapshotStore(tmp_path / "snapshots", key, "run1")  # the learner's publisher
    reader = SnapshotStore(tmp_path / "snapshots", key, "run1")  # another process's view of the same folder
    store = Store(tmp_path / "coordinator.sqlite")
    try:
        follower = SnapshotFollower(reader, store.versions)
        assert follower.current() is None
        writer.publish(0, _write(b"v0"), now=1.0)
        follower.ensure(0)
        assert reader.signed_manifest(0) is None  # published but not committed: not the run's yet
        store.versions.publish_initial("sha-v0", 1.0)
        assert follower.current() == 0 and reader.signed_manifest(0) is not None

        writer.publish(1, _write(b"v1"), now=2.0)
        store.steps.commit(step=0, trained_version=0, job_ids=[], new_version=1, manifest_sha="sha-v1",
                              mean_reward=0.0, metrics={}, now=2.0)
        follower.ensure(1)  # a result names v1 before this process's next look
        assert reader.signed_manifest(1) is not None

        writer.prune({1})
        follower.refresh()
        assert reader.signed_manifest(0) is None and reader.signed_manifest(1) is not None
    finally:
        store.close()
