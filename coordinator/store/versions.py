"""The policy versions the learner committed: each one's number and the hash of its signed manifest.

Version 0 is published once (:meth:`Versions.publish_initial`); every later version is inserted by the learner's
step, in the transaction that marks the batch trained (coordinator.store.training.Steps.commit), so the database
and the published versions never disagree.
"""

from __future__ import annotations

from coordinator.store.db import Db
from coordinator.store.records import VersionRow, from_row


class Versions:
    """The ``versions`` table, over the main connection."""

    def __init__(self, conn: Db) -> None:
        self._conn = conn

    def current(self) -> int | None:
        row = self._conn.execute("SELECT MAX(version) AS v FROM versions").fetchone()
        return None if row["v"] is None else int(row["v"])

    def manifest_sha(self, version: int) -> str | None:
        row = self._conn.execute("SELECT manifest_sha256 FROM versions WHERE version=?", (version,)).fetchone()
        return None if row is None else str(row["manifest_sha256"])

    def all(self) -> list[VersionRow]:
        return [from_row(VersionRow, r) for r in self._conn.execute("SELECT * FROM versions ORDER BY version").fetchall()]

    def publish_initial(self, manifest_sha: str, now: float) -> None:
        with self._conn.transaction():
            self._conn.execute("INSERT INTO versions(version, manifest_sha256, created_at) VALUES(0,?,?)",
                               (manifest_sha, now))
