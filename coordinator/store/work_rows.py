"""The work queue's rows: verification and evaluation requests between role processes.

(Named for the rows: the queue's protocol — ask, wait, answer — is coordinator.run.workqueue.) The queue is
transient: requesters resend after a restart, so every write goes through the store's light connection, which
nobody syncs. Several verifier workers claim at once; each skips the rows another is claiming (FOR UPDATE SKIP
LOCKED on PostgreSQL).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from coordinator.store.db import Db, Row

WorkKind = Literal["recompute", "evaluate"]


class WorkState(StrEnum):
    """Where a request of the queue is: written and waiting (``queued``), taken by a worker until its claim runs
    out (``claimed``), answered (``done``) or failed with a message (``failed``) — then deleted by its requester.
    The table's CHECK constraint, every statement here and the requesters' reads name these."""

    QUEUED = "queued"
    CLAIMED = "claimed"
    DONE = "done"
    FAILED = "failed"


QUEUED, CLAIMED = WorkState.QUEUED, WorkState.CLAIMED  # spelled into the statements below


class WorkRows:
    """The ``work`` table: written through the light connection; the idle poll of :meth:`claim` reads through the
    main one and takes no write lock."""

    def __init__(self, conn: Db, light_conn: Db) -> None:
        self._conn = conn
        self._light = light_conn

    def submit(self, kind: WorkKind, version: int, request: bytes, now: float, requester: str = "api") -> int:
        with self._light.transaction():
            row = self._light.execute("INSERT INTO work(kind, version, request, created_at, state, requester) "
                                      "VALUES(?,?,?,?,?,?) RETURNING id",
                                      (kind, version, request, now, QUEUED, requester)).fetchone()
        return int(row[0])

    def claim(self, worker: str, kinds: tuple[str, ...], limit: int, until: float, now: float) -> list[Row]:
        """Claim up to ``limit`` queued items (or items whose claim ran out: a worker that died), oldest first."""
        marks = ",".join("?" * len(kinds))
        waiting = (f"SELECT id FROM work WHERE kind IN ({marks}) AND (state='{QUEUED}' OR (state='{CLAIMED}' AND "
                   f"claim_until < ?)) ORDER BY id LIMIT ?")
        if not self._conn.execute(waiting, (*kinds, now, 1)).fetchone():
            return []  # the common case, polled often: no write lock taken
        with self._light.transaction():  # several verifier workers claim at once: each skips what another is claiming
            rows = self._light.execute(waiting + self._light.skip_locked, (*kinds, now, limit)).fetchall()
            ids = [int(r["id"]) for r in rows]
            self._light.executemany(f"UPDATE work SET state='{CLAIMED}', worker=?, claim_until=?, "
                                    f"attempts=attempts+1 WHERE id=?", [(worker, until, i) for i in ids])
        if not ids:
            return []
        return self._light.execute(f"SELECT * FROM work WHERE id IN ({','.join('?' * len(ids))}) ORDER BY id",
                                   ids).fetchall()

    def renew(self, worker: str, ids: list[int], until: float) -> None:
        with self._light.transaction():
            self._light.executemany(f"UPDATE work SET claim_until=? WHERE id=? AND worker=? AND state='{CLAIMED}'",
                                    [(until, i, worker) for i in ids])

    def unclaim(self, worker: str) -> int:
        """A restarted worker hands back what its previous life had claimed, without waiting for the claims to
        run out."""
        with self._light.transaction():
            cur = self._light.execute(f"UPDATE work SET state='{QUEUED}', worker=NULL, claim_until=NULL "
                                      f"WHERE worker=? AND state='{CLAIMED}'", (worker,))
        return cur.rowcount

    def finish(self, item_id: int, worker: str, answer: bytes | None, error: str | None = None) -> bool:
        """Record an answer (or a failure) — only by the worker that holds the claim."""
        with self._light.transaction():
            cur = self._light.execute(f"UPDATE work SET state=?, answer=?, error=? WHERE id=? AND worker=? AND "
                                      f"state='{CLAIMED}'", (WorkState.FAILED if error is not None else WorkState.DONE,
                                                             answer, error, item_id, worker))
        return cur.rowcount == 1

    def item(self, item_id: int) -> Row | None:
        return self._light.execute("SELECT * FROM work WHERE id=?", (item_id,)).fetchone()

    def delete(self, item_ids: list[int]) -> None:
        with self._light.transaction():
            self._light.executemany("DELETE FROM work WHERE id=?", [(i,) for i in item_ids])

    def drop(self, kinds: tuple[str, ...], requester: str | None = None) -> int:
        """Forget every item of these kinds (of ``requester``, if given): their requester restarted and no longer
        waits for them."""
        who, args = ("", kinds) if requester is None else (" AND requester=?", (*kinds, requester))
        with self._light.transaction():
            cur = self._light.execute(f"DELETE FROM work WHERE kind IN ({','.join('?' * len(kinds))}){who}", args)
        return cur.rowcount

    def versions(self, kind: WorkKind) -> set[int]:
        """The versions that requests of ``kind`` not yet deleted by their requester or worker are about."""
        rows = self._light.execute("SELECT DISTINCT version FROM work WHERE kind=?", (kind,)).fetchall()
        return {int(r["version"]) for r in rows}

    def counts(self) -> dict[str, int]:
        rows = self._light.execute("SELECT state, COUNT(*) AS n FROM work GROUP BY state").fetchall()
        return {str(r["state"]): int(r["n"]) for r in rows}
