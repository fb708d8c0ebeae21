"""The work queue's rows: verification and evaluation requests between role processes.

(Named for the rows: the queue's protocol — ask, wait, answer — is coordinator.run.workqueue.) The queue is
transient: requesters resend after a restart, so every write goes through the store's light connection, which
nobody syncs. Several verifier workers claim at once; each skips the rows another is claiming (FOR UPDATE SKIP
LOCKED on PostgreSQL).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Any

from coordinator.store.db import Db, Row
from coordinator.store.hops import Hop, Req, WorkKind


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

    def submit(self, kind: WorkKind[Req, Any], version: int, request: Req, now: float, requester: str = "api") -> int:
        """Queue ``request``, which must be the record ``kind`` names (coordinator.store.hops): never a dict or
        bytes built by hand, so the worker's decode cannot meet a shape its kind does not declare."""
        if type(request) is not kind.request:
            raise TypeError(f"the {kind.name} kind takes a {kind.request.__name__}, not a {type(request).__name__}")
        with self._light.transaction():
            row = self._light.execute("INSERT INTO work(kind, version, request, created_at, state, requester) "
                                      "VALUES(?,?,?,?,?,?) RETURNING id",
                                      (kind.name, version, request.encode(), now, QUEUED, requester)).fetchone()
        return int(row[0])

    def claim(self, worker: str, kinds: Iterable[WorkKind[Any, Any]], limit: int, until: float, now: float
              ) -> list[Row]:
        """Claim up to ``limit`` queued items (or items whose claim ran out: a worker that died), oldest first; a
        row's ``request`` decodes as its kind's record (coordinator.store.hops.work_kind)."""
        names = [k.name for k in kinds]
        marks = ",".join("?" * len(names))
        waiting = (f"SELECT id FROM work WHERE kind IN ({marks}) AND (state='{QUEUED}' OR (state='{CLAIMED}' AND "
                   f"claim_until < ?)) ORDER BY id LIMIT ?")
        if not self._conn.execute(waiting, (*names, now, 1)).fetchone():
            return []  # the common case, polled often: no write lock taken
        with self._light.transaction():  # several verifier workers claim at once: each skips what another is claiming
            rows = self._light.execute(waiting + self._light.skip_locked, (*names, now, limit)).fetchall()
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

    def finish(self, item_id: int, worker: str, answer: Hop | None, error: str | None = None) -> bool:
        """Record an answer (or a failure) — only by the worker that holds the claim. ``answer``: the record the
        item's kind answers with (coordinator.store.hops), None with an ``error``."""
        if answer is not None and not isinstance(answer, Hop):
            raise TypeError(f"a work answer is a record of coordinator.store.hops, not a {type(answer).__name__}")
        with self._light.transaction():
            cur = self._light.execute(f"UPDATE work SET state=?, answer=?, error=? WHERE id=? AND worker=? AND "
                                      f"state='{CLAIMED}'", (WorkState.FAILED if error is not None else WorkState.DONE,
                                                             None if answer is None else answer.encode(), error,
                                                             item_id, worker))
        return cur.rowcount == 1

    def item(self, item_id: int) -> Row | None:
        return self._light.execute("SELECT * FROM work WHERE id=?", (item_id,)).fetchone()

    def delete(self, item_ids: list[int]) -> None:
        with self._light.transaction():
            self._light.executemany("DELETE FROM work WHERE id=?", [(i,) for i in item_ids])

    def drop(self, kinds: Iterable[WorkKind[Any, Any]], requester: str | None = None) -> int:
        """Forget every item of these kinds (of ``requester``, if given): their requester restarted and no longer
        waits for them."""
        names = [k.name for k in kinds]
        who, args = ("", names) if requester is None else (" AND requester=?", [*names, requester])
        with self._light.transaction():
            cur = self._light.execute(f"DELETE FROM work WHERE kind IN ({','.join('?' * len(names))}){who}", args)
        return cur.rowcount

    def versions(self, kind: WorkKind[Any, Any]) -> set[int]:
        """The versions that requests of ``kind`` not yet deleted by their requester or worker are about."""
        rows = self._light.execute("SELECT DISTINCT version FROM work WHERE kind=?", (kind.name,)).fetchall()
        return {int(r["version"]) for r in rows}

    def counts(self) -> dict[str, int]:
        rows = self._light.execute("SELECT state, COUNT(*) AS n FROM work GROUP BY state").fetchall()
        return {str(r["state"]): int(r["n"]) for r in rows}
