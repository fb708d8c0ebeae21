"""The trust boundary's rows: what coordinator.api.guard reads and writes to decide whom it trusts.

(Named for the rows: the rules are coordinator.core.trust and coordinator.core.reporting, applied by the guard.)
Its own table is ``trust`` (one row per identity and backend class: consecutive valid and invalid results,
quarantines); its other inputs are read from the tables that own them — the lease counters and pinned backend class
on ``clients``, the live leases on ``jobs``, the reward groups on ``results`` — and a lowering of trust that is no
refusal is an ``audit`` line (outcome core.reporting.FLAGGED).
"""

from __future__ import annotations

from coordinator.core.leases import JobState
from coordinator.core.reporting import FLAGGED
from coordinator.store.audit import Audit
from coordinator.store.db import Db, Row
from coordinator.store.records import TrustStanding, from_row


class TrustRows:
    """The guard's reads and writes, over the main connection; a flag's audit line goes through ``audit``."""

    def __init__(self, conn: Db, audit: Audit) -> None:
        self._conn = conn
        self._audit = audit

    def row(self, client_id: str, bclass: str) -> Row | None:
        return self._conn.execute("SELECT * FROM trust WHERE client_id=? AND backend_class=?",
                                  (client_id, bclass)).fetchone()

    def put(self, client_id: str, bclass: str, consecutive_valid: int, consecutive_invalid: int,
            quarantines: int, quarantined_until: float, valid: bool) -> None:
        with self._conn.transaction():
            self._conn.execute("INSERT INTO trust(client_id, backend_class) VALUES(?,?) ON CONFLICT DO NOTHING",
                               (client_id, bclass))
            self._conn.execute(
                "UPDATE trust SET consecutive_valid=?, consecutive_invalid=?, quarantines=?, quarantined_until=?, "
                f"{'valid_total=valid_total+1' if valid else 'invalid_total=invalid_total+1'} "
                "WHERE client_id=? AND backend_class=?",
                (consecutive_valid, consecutive_invalid, quarantines, quarantined_until, client_id, bclass))

    def quarantined_until(self, client_id: str) -> float:
        row = self._conn.execute("SELECT MAX(quarantined_until) AS q FROM trust WHERE client_id=?",
                                 (client_id,)).fetchone()
        return float(row["q"] or 0.0)

    def reward_groups(self, client_id: str) -> list[tuple[str, int, int, float, float]]:
        """(client, version, results, sum and sum of squares of their mean rewards) for every identity, at each
        version ``client_id`` has results at: the selective-reporting rule's input (core.reporting.VersionGroup)."""
        rows = self._conn.execute(
            "SELECT client_id, version, COUNT(*) AS n, SUM(mean_reward) AS s, SUM(mean_reward*mean_reward) AS q "
            "FROM results WHERE version IN (SELECT DISTINCT version FROM results WHERE client_id=?) "
            "GROUP BY client_id, version", (client_id,)).fetchall()
        return [(str(r["client_id"]), int(r["version"]), int(r["n"]), float(r["s"]), float(r["q"])) for r in rows]

    def reward_samples(self, client_id: str) -> tuple[tuple[int, float, float], tuple[int, float, float]]:
        """(results, sum and sum of squares of their mean rewards) of what ``client_id`` returned, and of the jobs
        it dropped (:meth:`dropped_rewards`): the selective-reporting rule's second comparison
        (core.reporting.Sample)."""
        mine = self._conn.execute("SELECT COUNT(*) AS n, SUM(mean_reward) AS s, SUM(mean_reward*mean_reward) AS q "
                                  "FROM results WHERE client_id=?", (client_id,)).fetchone()
        returned = (int(mine["n"]), float(mine["s"] or 0.0), float(mine["q"] or 0.0))
        return returned, self.dropped_rewards(client_id).get(client_id, (0, 0.0, 0.0))

    def dropped_rewards(self, client_id: str | None = None) -> dict[str, tuple[int, float, float]]:
        """Per client (one, or every one): (jobs, sum and sum of squares of their mean rewards) of the jobs it
        dropped, as another client returned them at the version it had held them — the same key there: the same
        tokens, the same reward it saw."""
        where, args = ("WHERE d.client_id=? ", (client_id,)) if client_id is not None else ("", ())
        rows = self._conn.execute(
            "SELECT d.client_id, COUNT(*) AS n, SUM(r.mean_reward) AS s, SUM(r.mean_reward*r.mean_reward) AS q "
            "FROM dropped d JOIN results r ON r.job_id=d.job_id AND r.version=d.version AND r.client_id<>d.client_id "
            f"{where}GROUP BY d.client_id", args).fetchall()
        return {str(r["client_id"]): (int(r["n"]), float(r["s"]), float(r["q"])) for r in rows}

    def lease_counts(self, client_id: str) -> tuple[int, int]:
        """(leases granted, leases that ended without a result) of one identity."""
        row = self._conn.execute("SELECT leased, unreturned FROM clients WHERE client_id=?", (client_id,)).fetchone()
        return (0, 0) if row is None else (int(row["leased"]), int(row["unreturned"]))

    def record_flag(self, client_id: str, now: float, reason: str, detail: str) -> None:
        """An audit line for a lowering of trust that is no refusal (outcome core.reporting.FLAGGED)."""
        with self._conn.transaction():
            self._audit.write(now, client_id, None, None, FLAGGED, reason, None, detail)

    def flag_count(self, client_id: str, reason: str) -> int:
        row = self._conn.execute("SELECT COUNT(*) AS n FROM audit WHERE client_id=? AND outcome=? AND reason=?",
                                 (client_id, FLAGGED, reason)).fetchone()
        return int(row["n"])

    def last_flag(self, client_id: str, reason: str) -> float | None:
        row = self._conn.execute("SELECT MAX(at) AS at FROM audit WHERE client_id=? AND outcome=? AND reason=?",
                                 (client_id, FLAGGED, reason)).fetchone()
        return None if row is None or row["at"] is None else float(row["at"])

    def standings(self) -> list[TrustStanding]:
        return [from_row(TrustStanding, r) for r in self._conn.execute("SELECT * FROM trust ORDER BY client_id, backend_class")]

    def client_class_row(self, client_id: str) -> Row | None:
        return self._conn.execute("SELECT backend_class, profile FROM clients WHERE client_id=?",
                                  (client_id,)).fetchone()

    def leases_held(self, client_id: str, now: float) -> int:
        """Live (unexpired) leases of one client that have not returned their result: its first leases — on a job
        its replica's holder finished too, until this client's own result comes back (else a claimant whose jobs
        replicas finish could take one lease after another, `limits.max_leases_per_client` notwithstanding) — and
        its replicas of jobs not yet done."""
        row = self._conn.execute(
            f"SELECT COUNT(*) AS n FROM jobs WHERE lease_client=? AND lease_deadline>? AND (state='{JobState.LEASED}' "
            f"OR (state='{JobState.DONE}' AND NOT EXISTS (SELECT 1 FROM results r WHERE r.job_id=jobs.job_id AND "
            "r.lease_id=jobs.lease_id) AND NOT EXISTS (SELECT 1 FROM replica_results q WHERE q.job_id=jobs.job_id "
            "AND q.lease_id=jobs.lease_id)))", (client_id, now)).fetchone()
        replicas = self._conn.execute(f"SELECT COUNT(*) AS n FROM replica_leases r JOIN jobs ON jobs.job_id=r.job_id "
                                      f"WHERE r.client_id=? AND r.deadline>? AND jobs.state!='{JobState.DONE}'",
                                      (client_id, now)).fetchone()
        return int(row["n"]) + int(replicas["n"])
