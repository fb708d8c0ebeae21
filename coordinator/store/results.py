"""Accepted results and refused ones: the ``results`` and ``rejections`` tables.

An accepted result is a compare-and-set on its job's lease, recorded in one transaction with the job's closing, the
client's counters and credit and its audit line (:meth:`Results.accept`); a job therefore has at most one accepted
result (``results.job_id`` is the primary key). The learner reads what is pending, sets aside what is too stale
(:meth:`Results.mark_stale`), and marks the rest trained in its step's transaction
(coordinator.store.training.Steps.commit).

A job with a replica (coordinator.core.leases.Replica) has two holders: the first result accepted closes it as
above; the other holder's, when it comes and passes its checks, is credited in ``replica_results``
(:meth:`Results.credit_replica`) — never trained, never refused for having come second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from coordinator.core.leases import JobState
from coordinator.core.scheduling import Pending
from coordinator.store.audit import Audit
from coordinator.store.db import Db, Row
from coordinator.store.records import Rejection, ResultSummary, from_row


@dataclass(frozen=True)
class ResultRow:
    job_id: str
    client_id: str
    version: int
    payload: bytes
    rewards: list[float]


class _Abort(Exception):
    """Raised inside a transaction to roll it back."""


class Results:
    """The ``results`` and ``rejections`` tables, over the main connection; an outcome's audit line goes through
    ``audit`` in the same transaction."""

    def __init__(self, conn: Db, audit: Audit) -> None:
        self._conn = conn
        self._audit = audit

    def accept(self, *, job_id: str, lease_id: str, client_id: str, version: int, content_sha256: str,
               payload: bytes, rewards: list[float], n_tokens: int, credit: float, now: float,
               completions_sha256: str | None = None) -> bool:
        """Durably record an accepted result, closing the job. False if the lease changed meanwhile.
        ``completions_sha256``: the content hash of its tokens (shared.hashing.tokens_sha256), for
        :meth:`with_tokens`."""
        try:
            self._accept(job_id, lease_id, client_id, version, content_sha256, payload, rewards, n_tokens, credit, now,
                         completions_sha256)
        except _Abort:
            return False
        return True

    def _accept(self, job_id: str, lease_id: str, client_id: str, version: int, content_sha256: str, payload: bytes,
                rewards: list[float], n_tokens: int, credit: float, now: float, completions_sha256: str | None
                ) -> None:
        with self._conn.transaction():
            cur = self._conn.execute(  # the job's first lease, or its replica (even if the first was released)
                f"UPDATE jobs SET state='{JobState.DONE}' WHERE job_id=? AND ((lease_id=? AND lease_client=? "
                f"AND state='{JobState.LEASED}') OR (state!='{JobState.DONE}' AND EXISTS (SELECT 1 FROM replica_leases r "
                "WHERE r.job_id=jobs.job_id AND r.lease_id=? AND r.client_id=?)))",
                (job_id, lease_id, client_id, lease_id, client_id))
            if cur.rowcount != 1:
                raise _Abort
            self._conn.execute(
                "INSERT INTO results(job_id, client_id, lease_id, version, received_at, content_sha256, payload, "
                "rewards, mean_reward, n_tokens, completions_sha256) VALUES(?,?,?,?,?,?,?,?,?,?,?)",
                (job_id, client_id, lease_id, version, now, content_sha256, payload, json.dumps(rewards),
                 sum(rewards) / max(1, len(rewards)), n_tokens, completions_sha256))
            self._conn.execute("UPDATE clients SET accepted=accepted+1, credit=credit+?, last_seen=? WHERE client_id=?",
                               (credit, now, client_id))
            self._audit.write(now, client_id, job_id, version, "accepted", "ok", content_sha256)

    def get(self, job_id: str) -> Row | None:
        """The accepted result of ``job_id`` (its client, lease, content hash, tokens' hash, mean reward and
        tokens), or None."""
        return self._conn.execute("SELECT client_id, lease_id, content_sha256, completions_sha256, mean_reward, "
                                  "n_tokens FROM results WHERE job_id=?", (job_id,)).fetchone()

    def credit_replica(self, *, job_id: str, lease_id: str, client_id: str, version: int, content_sha256: str,
                       completions_sha256: str | None, mean_reward: float, n_tokens: int, credit: float,
                       now: float) -> bool:
        """Durably credit the result of a job's other holder, the job's first result being accepted already: the
        client's counters and credit move as for an accepted result, the audit line says ``accepted`` for reason
        ``replica``, and nothing is trained. False if this client's result for the job was credited already."""
        with self._conn.transaction():
            cur = self._conn.execute(
                "INSERT INTO replica_results(job_id, client_id, lease_id, version, received_at, content_sha256, "
                "completions_sha256, mean_reward, n_tokens, credit) VALUES(?,?,?,?,?,?,?,?,?,?) ON CONFLICT DO NOTHING",
                (job_id, client_id, lease_id, version, now, content_sha256, completions_sha256, mean_reward, n_tokens,
                 credit))
            if cur.rowcount != 1:
                return False
            self._conn.execute("UPDATE clients SET accepted=accepted+1, credit=credit+?, last_seen=? WHERE client_id=?",
                               (credit, now, client_id))
            self._audit.write(now, client_id, job_id, version, "accepted", "replica", content_sha256,
                              "credited, not trained: the job's result from its other holder was accepted first")
        return True

    def credited_replica(self, job_id: str, client_id: str) -> Row | None:
        """This client's credited result of a job whose other holder's was trained (:meth:`credit_replica`): its
        content hash, mean reward, tokens and credit; or None."""
        return self._conn.execute("SELECT content_sha256, mean_reward, n_tokens, credit FROM replica_results "
                                  "WHERE job_id=? AND client_id=?", (job_id, client_id)).fetchone()

    def with_tokens(self, completions_sha256: str, other_than: str) -> str | None:
        """The job id of an accepted result, of another job than ``other_than``, whose tokens have this content
        hash (coordinator.core.duplicates), or None."""
        row = self._conn.execute("SELECT job_id FROM results WHERE completions_sha256=? AND job_id!=? LIMIT 1",
                                 (completions_sha256, other_than)).fetchone()
        return None if row is None else str(row["job_id"])

    def record_rejection(self, client_id: str, job_id: str | None, reason: str, message: str,
                         content_sha256: str | None, now: float, version: int | None = None) -> None:
        with self._conn.transaction():
            self._conn.execute("INSERT INTO rejections(client_id, job_id, reason, message, content_sha256, at) "
                               "VALUES(?,?,?,?,?,?)", (client_id, job_id, reason, message, content_sha256, now))
            self._conn.execute("UPDATE clients SET rejected=rejected+1 WHERE client_id=?", (client_id,))
            self._audit.write(now, client_id, job_id, version, "rejected", reason, content_sha256, message)

    def refused_jobs(self, client_id: str, job_ids: list[str]) -> frozenset[str]:
        """Which of ``job_ids`` this client already had a result refused for (reissue them to someone else)."""
        if not job_ids:
            return frozenset()
        marks = ",".join("?" * len(job_ids))
        rows = self._conn.execute(f"SELECT DISTINCT job_id FROM rejections WHERE client_id=? AND job_id IN ({marks})",
                                  (client_id, *job_ids)).fetchall()
        return frozenset(r["job_id"] for r in rows)

    def pending(self) -> list[Pending]:
        """Accepted results neither trained on nor set aside as too stale."""
        rows = self._conn.execute("SELECT job_id, version, received_at FROM results WHERE ingested_step IS NULL "
                                  "AND stale_at IS NULL").fetchall()
        return [Pending(r["job_id"], int(r["version"]), float(r["received_at"])) for r in rows]

    def rows(self, job_ids: list[str]) -> list[ResultRow]:
        marks = ",".join("?" * len(job_ids))
        rows = self._conn.execute(f"SELECT job_id, client_id, version, payload, rewards FROM results WHERE job_id IN "
                                  f"({marks})", job_ids).fetchall()
        by_id = {r["job_id"]: r for r in rows}
        return [ResultRow(j, by_id[j]["client_id"], int(by_id[j]["version"]), bytes(by_id[j]["payload"]),
                          json.loads(by_id[j]["rewards"])) for j in job_ids]

    def mark_stale(self, job_ids: list[str], at_version: int) -> None:
        """Set results aside that are older than the staleness bound: credited, never trained on."""
        with self._conn.transaction():
            self._conn.executemany("UPDATE results SET stale_at=? WHERE job_id=? AND ingested_step IS NULL",
                                   [(at_version, j) for j in job_ids])

    def summary(self) -> list[ResultSummary]:
        rows = self._conn.execute("SELECT job_id, client_id, version, content_sha256, mean_reward, ingested_step "
                                  "FROM results ORDER BY received_at").fetchall()
        return [from_row(ResultSummary, r) for r in rows]

    def rejections(self, limit: int = 100) -> list[Rejection]:
        rows = self._conn.execute("SELECT * FROM rejections ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [from_row(Rejection, r) for r in rows]
