"""What each role process reports for the others and the status page: one JSON object per role, kept in the
``meta`` table under ``role:<role>``.

A report is re-created by its role (it reports again), so it is written through the store's light connection,
which nobody syncs.
"""

from __future__ import annotations

import json

from coordinator.store.db import Db
from coordinator.store.hops import RoleReport


class RoleStatus:
    """The ``role:*`` rows of the ``meta`` table."""

    def __init__(self, conn: Db, light_conn: Db) -> None:
        self._conn = conn
        self._light = light_conn

    def set(self, role: str, report: RoleReport) -> None:
        """``report``: the role's own record (coordinator.run.records), never a dict built by hand: the store keeps
        its JSON without looking into it, so the record's type is the only check of its shape."""
        if not isinstance(report, RoleReport):
            raise TypeError(f"a role report is a record of coordinator.run.records, not a {type(report).__name__}")
        with self._light.transaction():
            self._light.execute("INSERT INTO meta(key,value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET "
                                "value=excluded.value", (f"role:{role}", report.to_json()))

    def get(self, role: str) -> dict[str, object] | None:
        row = self._conn.execute("SELECT value FROM meta WHERE key=?", (f"role:{role}",)).fetchone()
        return None if row is None else dict(json.loads(row["value"]))

    def all(self) -> dict[str, dict[str, object]]:
        rows = self._light.execute("SELECT key, value FROM meta WHERE key LIKE 'role:%' ORDER BY key").fetchall()
        return {str(r["key"])[5:]: json.loads(r["value"]) for r in rows}
