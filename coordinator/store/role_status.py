"""What each role process reports for the others and the status page: one JSON object per role, kept in the
``meta`` table under ``role:<role>``.

A report is re-created by its role (it reports again), so it is written through the store's light connection,
which nobody syncs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from coordinator.store.db import Db


class RoleStatus:
    """The ``role:*`` rows of the ``meta`` table."""

    def __init__(self, conn: Db, light_conn: Db) -> None:
        self._conn = conn
        self._light = light_conn

    def set(self, role: str, status: Mapping[str, object]) -> None:
        """``status``: the role's own report (coordinator.run.records types what a reader reads of one); the store
        keeps it as JSON it does not look into, so its shape is each role's."""
        with self._light.transaction():
            self._light.execute("INSERT INTO meta(key,value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET "
                                "value=excluded.value", (f"role:{role}", json.dumps(status, default=str)))

    def get(self, role: str) -> dict[str, object] | None:
        row = self._conn.execute("SELECT value FROM meta WHERE key=?", (f"role:{role}",)).fetchone()
        return None if row is None else dict(json.loads(row["value"]))

    def all(self) -> dict[str, dict[str, object]]:
        rows = self._light.execute("SELECT key, value FROM meta WHERE key LIKE 'role:%' ORDER BY key").fetchall()
        return {str(r["key"])[5:]: json.loads(r["value"]) for r in rows}
