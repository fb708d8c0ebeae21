"""The audit log's rows: one line for every result outcome (accepted, rejected, flagged), written inside the
transaction that makes the outcome durable, so the log never claims an outcome the store does not hold, nor misses
one it does. The other aggregates write through :meth:`Audit.write` on the shared main connection; the admin API
reads through :meth:`Audit.lines`."""

from __future__ import annotations

from coordinator.store.db import Db
from coordinator.store.records import AuditLine, from_row


class Audit:
    """The ``audit`` table, over the store's main connection."""

    def __init__(self, conn: Db) -> None:
        self._conn = conn

    def write(self, at: float, client_id: str, job_id: str | None, version: int | None, outcome: str,
              reason: str, content_sha256: str | None, detail: str = "") -> None:
        """One audit line; callers run it inside the transaction that makes the outcome durable."""
        self._conn.execute("INSERT INTO audit(at, client_id, job_id, version, outcome, reason, content_sha256, detail) "
                           "VALUES(?,?,?,?,?,?,?,?)", (at, client_id, job_id, version, outcome, reason,
                                                       content_sha256, detail[:2048]))

    def lines(self, *, client_id: str | None = None, job_id: str | None = None, outcome: str | None = None,
              reason: str | None = None, since: float | None = None, limit: int = 100) -> list[AuditLine]:
        """Audit lines matching every given filter, newest first (at most ``limit``, capped at 10,000)."""
        where: list[str] = []
        args: list[str | float] = []
        for col, val in (("client_id", client_id), ("job_id", job_id), ("outcome", outcome), ("reason", reason)):
            if val is not None:
                where.append(f"{col}=?")
                args.append(val)
        if since is not None:
            where.append("at>=?")
            args.append(since)
        sql = "SELECT * FROM audit" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id DESC LIMIT ?"
        return [from_row(AuditLine, r) for r in self._conn.execute(sql, (*args, max(1, min(limit, 10_000)))).fetchall()]
