"""The trust boundary's state and gates, next to the Store: adaptive trust per (client, backend class),
spot-check replicas, rate limits and the registration gate.

The rules are pure (:mod:`coordinator.core.trust`, :mod:`coordinator.core.ratelimit`,
:mod:`coordinator.core.replicas`); this module only keeps their state (SQLite tables created on the
Store's connection, buckets in memory) and turns their decisions into typed refusals.

Rate-limit buckets live in memory on purpose: a restart grants everyone a fresh burst, which is harmless,
and a request refused for its rate writes nothing anywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import sqlite3
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.core.leases import JobState, LeaseView
from coordinator.core.ratelimit import Limiter, Rate
from coordinator.core.trust import TrustPolicy, TrustState, on_invalid, on_valid, quarantined
from coordinator.store import Store
from shared.errors import ProtocolError, Reason

logger = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS trust(
  client_id TEXT NOT NULL, backend_class TEXT NOT NULL, consecutive_valid INTEGER NOT NULL DEFAULT 0,
  consecutive_invalid INTEGER NOT NULL DEFAULT 0, quarantines INTEGER NOT NULL DEFAULT 0,
  quarantined_until REAL NOT NULL DEFAULT 0, valid_total INTEGER NOT NULL DEFAULT 0,
  invalid_total INTEGER NOT NULL DEFAULT 0, PRIMARY KEY(client_id, backend_class));
"""  # the replicas table is in coordinator.store: Store.pending() must see which results are held
REPLICA_SUFFIX = "-r"


@dataclass(frozen=True)
class ReplicaRow:
    replica_id: str
    job_id: str
    version: int
    original_client: str
    original_class: str
    view: LeaseView


def replica_id_for(job_id: str) -> str:
    return job_id[: 64 - len(REPLICA_SUFFIX)] + REPLICA_SUFFIX


class Guard:
    def __init__(self, config: CoordinatorConfig, store: Store) -> None:
        self.config = config
        self.store = store
        self.conn: sqlite3.Connection = store.conn
        self.conn.executescript(SCHEMA)
        t = config.trust
        self.policy = TrustPolicy(t.trusted_after, t.min_replication_rate, t.quarantine_after, t.quarantine_s)
        lim = config.limits
        self.per_identity = Limiter(Rate(lim.per_identity_rps, lim.per_identity_burst))
        self.per_address = Limiter(Rate(lim.per_address_rps, lim.per_address_burst))
        self._seen: OrderedDict[str, float] = OrderedDict()
        self.registrations = Limiter(Rate(lim.registrations_per_address_per_min / 60.0, lim.registration_burst))

    # -- rate limits and registration ---------------------------------------------------------------------
    @staticmethod
    def _limited(wait: float, who: str) -> None:
        if wait > 0:
            after = "much later" if math.isinf(wait) else f"in {max(1, math.ceil(wait))}s"
            raise ProtocolError(Reason.RATE_LIMITED, f"too many requests from {who}; slow down and retry {after}")

    def check_address(self, address: str, now: float) -> None:
        self._limited(self.per_address.check(address, now), f"address {address}")

    def check_identity(self, client_id: str, now: float) -> None:
        self._limited(self.per_identity.check(client_id, now), f"client {client_id[:8]}")

    def check_registration(self, address: str, invite: str, now: float, is_new: bool) -> None:
        """Invite gate (private swarms), then the per-address budget for *new* identities."""
        reg = self.config.registration
        if reg.mode == "invite":
            digest = hashlib.sha256(invite.encode()).hexdigest()
            if not any(hmac.compare_digest(digest, h) for h in reg.invite_sha256):
                raise ProtocolError(Reason.REGISTRATION_CLOSED,
                                    "this swarm is private: registering needs a valid invite token from its "
                                    "operator" + (" (the one given is not valid)" if invite else ""))
        if is_new:
            self._limited(self.registrations.check(address, now), f"address {address} (new identities)")

    # -- trust --------------------------------------------------------------------------------------------
    def trust(self, client_id: str, backend_class: str) -> TrustState:
        row = self.conn.execute("SELECT * FROM trust WHERE client_id=? AND backend_class=?",
                                (client_id, backend_class)).fetchone()
        if row is None:
            return TrustState()
        return TrustState(int(row["consecutive_valid"]), int(row["consecutive_invalid"]), int(row["quarantines"]),
                          float(row["quarantined_until"]))

    def _put(self, client_id: str, backend_class: str, state: TrustState, valid: bool) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            self.conn.execute(
                "INSERT INTO trust(client_id, backend_class) VALUES(?,?) ON CONFLICT DO NOTHING",
                (client_id, backend_class))
            self.conn.execute(
                "UPDATE trust SET consecutive_valid=?, consecutive_invalid=?, quarantines=?, quarantined_until=?, "
                f"{'valid_total=valid_total+1' if valid else 'invalid_total=invalid_total+1'} "
                "WHERE client_id=? AND backend_class=?",
                (state.consecutive_valid, state.consecutive_invalid, state.quarantines, state.quarantined_until,
                 client_id, backend_class))
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    def record_valid(self, client_id: str, backend_class: str) -> TrustState:
        state = on_valid(self.trust(client_id, backend_class))
        self._put(client_id, backend_class, state, True)
        return state

    def record_invalid(self, client_id: str, backend_class: str, now: float) -> TrustState:
        before = self.trust(client_id, backend_class)
        state = on_invalid(before, now, self.policy)
        self._put(client_id, backend_class, state, False)
        if state.quarantines > before.quarantines:
            logger.warning("client %s (%s) quarantined until %.0f after %d invalid results in a row",
                           client_id[:8], backend_class, state.quarantined_until, self.policy.quarantine_after)
        return state

    def check_quarantine(self, client_id: str, backend_class: str, now: float) -> None:
        state = self.trust(client_id, backend_class)
        if quarantined(state, now):
            raise ProtocolError(
                Reason.QUARANTINED,
                f"this client's {backend_class} results were refused {self.policy.quarantine_after} times in a row, "
                f"so it gets no work for {state.quarantined_until - now:.0f}s more. Check that echo-swarm is "
                f"unmodified and up to date and that the hardware is healthy (see the refusal reasons it logged)")

    def standings(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM trust ORDER BY client_id, backend_class")]

    # -- spot-check replicas ------------------------------------------------------------------------------
    def add_replica(self, job_id: str, version: int, original_client: str, original_class: str, now: float,
                    hold: bool) -> None:
        """Queue a replay of ``job_id``; ``hold`` keeps the original out of training until it is judged."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            self.conn.execute(
                "INSERT OR IGNORE INTO replicas(replica_id, job_id, version, original_client, original_class, "
                "created_at, state, hold) VALUES(?,?,?,?,?,?,'open',?)",
                (replica_id_for(job_id), job_id, version, original_client, original_class, now, int(hold)))
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    @staticmethod
    def _replica(row: sqlite3.Row) -> ReplicaRow:
        view = LeaseView(row["replica_id"], JobState(row["state"]), int(row["version"]), float(row["created_at"]),
                         row["lease_id"], row["lease_client"], row["lease_deadline"])
        return ReplicaRow(row["replica_id"], row["job_id"], int(row["version"]), row["original_client"],
                          row["original_class"], view)

    def get_replica(self, replica_id: str) -> ReplicaRow | None:
        row = self.conn.execute("SELECT * FROM replicas WHERE replica_id=?", (replica_id,)).fetchone()
        return None if row is None else self._replica(row)

    def expire_replicas(self, oldest_version: int, now: float, hold_s: float) -> int:
        """Replicas whose version can no longer be verified are closed as 'unverified'; a held original whose
        replay nobody took within ``hold_s`` seconds is released to training (its replica stays queued).
        Returns how many held results were released."""
        due = self.conn.execute("SELECT COUNT(*) AS n FROM replicas WHERE state!='done' AND (version<? OR "
                                "(hold=1 AND created_at<=?))", (oldest_version, now - hold_s)).fetchone()
        if not due["n"]:  # the common case, on every lease: no write transaction
            return 0
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            n = self.conn.execute("UPDATE replicas SET state='done', outcome='unverified' WHERE state!='done' AND "
                                  "version<?", (oldest_version,)).rowcount
            n += self.conn.execute("UPDATE replicas SET hold=0 WHERE hold=1 AND state!='done' AND created_at<=?",
                                   (now - hold_s,)).rowcount
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        return n

    def has_valid_work(self, client_id: str) -> bool:
        """Has ``client_id`` had at least one result judged valid (any backend class)?"""
        return self.conn.execute("SELECT 1 FROM trust WHERE client_id=? AND valid_total > 0 LIMIT 1",
                                 (client_id,)).fetchone() is not None

    def lease_replica(self, client_id: str, lease_id: str, deadline: float, now: float) -> ReplicaRow | None:
        """Lease the oldest open (or expired) replica that someone other than ``client_id`` produced."""
        if self.conn.execute("SELECT 1 FROM replicas WHERE state!='done' LIMIT 1").fetchone() is None:
            return None  # the common case on every lease: no write lock taken
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            row = self.conn.execute(
                "SELECT * FROM replicas WHERE original_client!=? AND (state='open' OR (state='leased' AND "
                "lease_deadline<=?)) ORDER BY created_at LIMIT 1", (client_id, now)).fetchone()
            if row is None:
                self.conn.execute("COMMIT")
                return None
            self.conn.execute("UPDATE replicas SET state='leased', lease_id=?, lease_client=?, lease_deadline=?, "
                              "issue_count=issue_count+1 WHERE replica_id=?",
                              (lease_id, client_id, deadline, row["replica_id"]))
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        got = self.get_replica(row["replica_id"])
        return got

    def release_replica(self, replica_id: str, lease_id: str, client_id: str) -> bool:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            n = self.conn.execute("UPDATE replicas SET state='open', lease_deadline=NULL WHERE replica_id=? AND "
                                  "lease_id=? AND lease_client=? AND state='leased'",
                                  (replica_id, lease_id, client_id)).rowcount
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        return n == 1

    def close_replica(self, replica: ReplicaRow, lease_id: str, client_id: str, outcome: str, content_sha: str,
                      credit: float, now: float, original_invalid: bool, detail: str, in_training: bool = False
                      ) -> bool:
        """One transaction: the replica is done with ``outcome``; the replaying client is credited; if the
        original was the outlier it is taken out of training (when not trained on yet: the job reopens) and
        its credit revoked (``in_training``: the learner already holds it in the step it is computing, so it
        stays and is marked as invalidated after training). False if the replica's lease changed meanwhile."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            if self.conn.execute("UPDATE replicas SET state='done', outcome=? WHERE replica_id=? AND lease_id=? AND "
                                 "lease_client=? AND state='leased'",
                                 (outcome, replica.replica_id, lease_id, client_id)).rowcount != 1:
                self.conn.execute("ROLLBACK")
                return False
            # credit for the replay; clients.accepted keeps counting result rows (replays are not trained on)
            self.conn.execute("UPDATE clients SET credit=credit+?, last_seen=? WHERE client_id=?",
                              (credit, now, client_id))
            self.store.audit_write(now, client_id, replica.replica_id, replica.version, "replica_accepted", outcome,
                                   content_sha, detail)
            if original_invalid:
                orig = self.conn.execute("SELECT n_tokens, ingested_step, content_sha256 FROM results WHERE job_id=?",
                                         (replica.job_id,)).fetchone()
                if orig is not None:
                    removed = orig["ingested_step"] is None and not in_training
                    if removed:
                        self.conn.execute("DELETE FROM results WHERE job_id=?", (replica.job_id,))
                        self.conn.execute("UPDATE jobs SET state='open', lease_deadline=NULL WHERE job_id=?",
                                          (replica.job_id,))
                    outcome_orig = "invalidated" if removed else "invalidated_after_training"
                    self.conn.execute("UPDATE clients SET credit=credit-?, accepted=accepted-? WHERE client_id=?",
                                      (float(orig["n_tokens"]), int(removed), replica.original_client))
                    self.store.audit_write(now, replica.original_client, replica.job_id, replica.version, outcome_orig,
                                           Reason.REPLICA_MISMATCH.value, orig["content_sha256"], detail)
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        return True

    def leases_held(self, client_id: str, now: float) -> int:
        """Live (unexpired) leases of one client, on jobs and on replicas."""
        jobs = self.conn.execute("SELECT COUNT(*) AS n FROM jobs WHERE state='leased' AND lease_client=? AND "
                                 "lease_deadline>?", (client_id, now)).fetchone()["n"]
        reps = self.conn.execute("SELECT COUNT(*) AS n FROM replicas WHERE state='leased' AND lease_client=? AND "
                                 "lease_deadline>?", (client_id, now)).fetchone()["n"]
        return int(jobs) + int(reps)

    def held_count(self) -> int:
        row = self.conn.execute("SELECT COUNT(*) AS n FROM replicas WHERE hold=1 AND state!='done'").fetchone()
        return int(row["n"])

    def seen(self, client_id: str, now: float) -> None:
        """Note a client's signed request (in memory): who could take a replica right now."""
        self._seen[client_id] = now
        self._seen.move_to_end(client_id)
        while len(self._seen) > 100_000:
            self._seen.popitem(last=False)

    def others_active(self, client_id: str, now: float, window_s: float) -> bool:
        """Is any other client active (a request within ``window_s``)? If not, nobody could replay its job."""
        for other, at in reversed(self._seen.items()):
            if at < now - window_s:
                return False
            if other != client_id:
                return True
        return False

    def replicas_summary(self) -> dict[str, int]:
        rows = self.conn.execute("SELECT COALESCE(outcome, state) AS k, COUNT(*) AS n FROM replicas GROUP BY k")
        return {str(r["k"]): int(r["n"]) for r in rows}
