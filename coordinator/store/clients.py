"""The volunteers' identities: the ``clients`` table's registrations, refreshes, bans and the removal of idle
identities (a registration flood must not grow the store without bound, issue 24).

The counters other aggregates keep on a client's row move inside their own transactions: accepted results and
credit with the result (coordinator.store.results), refusals with the rejection, leases granted and unreturned
with the lease (coordinator.store.job_rows); the trust boundary reads its inputs through
coordinator.store.trust_rows.
"""

from __future__ import annotations

import json
from typing import Any

from coordinator.core.leases import JobState
from coordinator.store.db import Db, Row
from coordinator.store.records import ClientRow


class Clients:
    """The ``clients`` table (and, when an identity is removed, its ``trust`` rows), over the main connection."""

    def __init__(self, conn: Db) -> None:
        self._conn = conn

    def register(self, client_id: str, public_key: bytes, profile: dict[str, Any], now: float, *,
                 backend_class: str | None = None, address: str | None = None) -> bool:
        """Insert or refresh a client. Returns True if it is new. The profile's self-benchmark (tokens/s, if
        reported) is also kept in its own column, ``benchmark_tokens_per_s``, for the scheduler.
        ``backend_class`` is pinned by the first registration that gives one (a refresh never changes it);
        ``address`` is the first registration's remote address, ``last_address`` the latest one's."""
        bench = profile.get("benchmark_tokens_per_s")
        with self._conn.transaction():
            cur = self._conn.execute(
                "INSERT INTO clients(client_id, public_key, profile, registered_at, last_seen, "
                "benchmark_tokens_per_s, backend_class, address, last_address) VALUES(?,?,?,?,?,?,?,?,?) "
                "ON CONFLICT DO NOTHING",
                (client_id, public_key, json.dumps(profile), now, now, bench, backend_class, address, address),
            )
            if cur.rowcount == 0:
                self._conn.execute("UPDATE clients SET profile=?, last_seen=?, benchmark_tokens_per_s=?, "
                                   "backend_class=COALESCE(backend_class, ?), address=COALESCE(address, ?), "
                                   "last_address=COALESCE(?, last_address) WHERE client_id=?",
                                   (json.dumps(profile), now, bench, backend_class, address, address, client_id))
                return False
            return True

    def expire_idle(self, keep: int, now: float, spare: str = "") -> list[str]:
        """Remove the identities that never had a result accepted, oldest last seen first, until at most ``keep``
        remain (registration.max_idle_identities; issue 24): a registration flood then grows the store by nothing.
        Banned, quarantined and lease-holding identities are kept, and ``spare`` (the one just registered). Their
        trust rows go with them; the audit log
        stays. Returns the removed ids (the API forgets them in memory too)."""
        idle = "accepted=0 AND banned=0"
        with self._conn.transaction():
            (count,), = self._conn.execute(f"SELECT COUNT(*) FROM clients WHERE {idle}").fetchall()
            if count <= keep:
                return []
            rows = self._conn.execute(
                f"SELECT client_id FROM clients WHERE {idle} AND client_id != ? AND client_id NOT IN (SELECT "
                f"lease_client FROM jobs WHERE state='{JobState.LEASED}' AND lease_client IS NOT NULL) AND client_id NOT IN "
                "(SELECT client_id FROM trust WHERE quarantined_until > ?) ORDER BY last_seen, registered_at LIMIT ?",
                (spare, now, count - keep)).fetchall()
            gone = [str(r["client_id"]) for r in rows]
            for cid in gone:
                self._conn.execute("DELETE FROM trust WHERE client_id=?", (cid,))
                self._conn.execute("DELETE FROM clients WHERE client_id=?", (cid,))
            return gone

    def count(self) -> int:
        (n,), = self._conn.execute("SELECT COUNT(*) FROM clients").fetchall()
        return int(n)

    def get(self, client_id: str) -> Row | None:
        return self._conn.execute("SELECT * FROM clients WHERE client_id=?", (client_id,)).fetchone()

    def set_banned(self, client_id: str, banned: bool) -> bool:
        with self._conn.transaction():
            return self._conn.execute("UPDATE clients SET banned=? WHERE client_id=?",
                                      (int(banned), client_id)).rowcount == 1

    def all(self) -> list[ClientRow]:
        rows = self._conn.execute("SELECT client_id, profile, registered_at, last_seen, accepted, rejected, credit, "
                                  "banned, benchmark_tokens_per_s, leased, unreturned FROM clients "
                                  "ORDER BY credit DESC, registered_at").fetchall()
        return [ClientRow(**(dict(r) | {"profile": json.loads(r["profile"])})) for r in rows]
