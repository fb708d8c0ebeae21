"""The job stream's rows: each job's plan, its lease (a compare-and-set on the row) and its release.

(Named for the rows: the rules that plan a job and judge a lease are coordinator.core.jobs and
coordinator.core.leases.) Leases, releases and the jobs a lease's path creates go through the store's light
connection, which nobody syncs: they are reply-path state that can be re-created (coordinator.store.store, and
:meth:`Jobs.lease`). A job is closed by its accepted result, in the result's transaction
(coordinator.store.results.Results.accept).

A job's first lease is on its row; a second lease, its replica (coordinator.core.leases.Replica: issue 37), is a row of
``replica_leases``, at most one per job, written through the same light connection (:meth:`Jobs.lease_replica`). A job
is not reissued while its replica runs; the replica's row stays once the job is done, so that the holder whose
result comes second is still known for what it is (coordinator.api.intake).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace

from coordinator.core.jobs import JobPlan
from coordinator.core.leases import JobState, LeaseView, Replica, held_by
from coordinator.core.trust import RETURNS_RESULT
from coordinator.store.db import Db, Row

OPEN, LEASED, DONE = JobState.OPEN, JobState.LEASED, JobState.DONE  # spelled into the statements below
#: A job's row with its replica's (NULL columns: none).
JOB_SELECT = ("SELECT jobs.*, r.lease_id AS replica_lease, r.client_id AS replica_client, r.deadline AS replica_deadline, "
              "r.version AS replica_version, r.precision AS replica_precision FROM jobs "
              "LEFT JOIN replica_leases r ON r.job_id=jobs.job_id")
#: No replica of the job in the statement's ``jobs`` row runs at ``?``: the job may be reissued.
NO_LIVE_REPLICA = "NOT EXISTS (SELECT 1 FROM replica_leases r WHERE r.job_id=jobs.job_id AND r.deadline>?)"

#: The job stream's lock (Db.lock): one writer at a time draws the next sequence number and inserts its job.
JOB_STREAM = "echo-swarm:job-stream"


@dataclass(frozen=True)
class JobRow:
    view: LeaseView
    prompt_ids: tuple[int, ...]
    seed: int
    group_size: int
    issue_count: int
    precision: str | None = None  # the precision the current lease named (None: the run's default)
    replica_precision: str | None = None  # the precision the replica's lease named

    def held_by(self, client_id: str, lease_id: str) -> JobRow:
        """The row as ``client_id``'s lease sees it (coordinator.core.leases.held_by): a replica's holder finds its
        own lease, version and precision where the first lease's are."""
        r = self.view.replica
        if r is None or r.client != client_id or r.lease_id != lease_id:
            return self
        return replace(self, view=held_by(self.view, client_id, lease_id), precision=self.replica_precision)


class Jobs:
    """The ``jobs`` table, and the lease counters a lease moves on the ``clients`` table (read by the
    selective-reporting rule, coordinator.core.reporting)."""

    def __init__(self, conn: Db, light_conn: Db) -> None:
        self._conn = conn
        self._light = light_conn

    def next_seq(self, db: Db | None = None) -> int:
        """The next number of the job stream."""
        row = (db or self._conn).execute("SELECT MAX(seq) AS j FROM jobs").fetchone()
        return (-1 if row["j"] is None else int(row["j"])) + 1

    def create_next(self, plan: Callable[[int], JobPlan], group_size: int, now: float) -> JobRow:
        """Draw the next number of the job stream and insert the job ``plan(seq)`` makes of it, in one
        transaction under the job stream's lock: API processes sharing a PostgreSQL database never draw the
        same number.

        Through the light connection, as a lease (it happens on a lease's path): a new job is re-creatable. A
        power loss that forgets it forgets its lease too, and the same number is drawn and planned again; a
        result for it is only ever accepted after the job's row, and its sync covers both."""
        with self._light.transaction():
            self._light.lock(JOB_STREAM)
            made = plan(self.next_seq(self._light))
            self._insert(made, group_size, now, self._light)
        row = self.get(made.job_id)
        assert row is not None
        return row

    def create(self, plan: JobPlan, group_size: int, now: float) -> JobRow:
        with self._conn.transaction():
            self._insert(plan, group_size, now)
        row = self.get(plan.job_id)
        assert row is not None
        return row

    def _insert(self, plan: JobPlan, group_size: int, now: float, db: Db | None = None) -> None:
        (db or self._conn).execute(
            "INSERT INTO jobs(job_id, seq, prompt_ids, seed, group_size, created_at, state) VALUES(?,?,?,?,?,?,?)",
            (plan.job_id, plan.seq, json.dumps(list(plan.prompt_ids)), plan.seed, group_size, now, OPEN))

    @staticmethod
    def _job(row: Row) -> JobRow:
        version = None if row["version"] is None else int(row["version"])
        replica = None if row["replica_lease"] is None else Replica(
            row["replica_lease"], row["replica_client"], float(row["replica_deadline"]), int(row["replica_version"]))
        view = LeaseView(row["job_id"], JobState(row["state"]), version, float(row["created_at"]),
                         row["lease_id"], row["lease_client"], row["lease_deadline"], replica=replica)
        return JobRow(view, tuple(json.loads(row["prompt_ids"])), int(row["seed"]), int(row["group_size"]),
                      int(row["issue_count"]), row["lease_precision"], row["replica_precision"])

    def get(self, job_id: str) -> JobRow | None:
        row = self._conn.execute(f"{JOB_SELECT} WHERE jobs.job_id=?", (job_id,)).fetchone()
        return None if row is None else self._job(row)

    def active(self) -> list[JobRow]:
        """Jobs not yet done (open, leased, or leased with an expired lease), oldest first."""
        rows = self._conn.execute(f"{JOB_SELECT} WHERE jobs.state != '{DONE}' ORDER BY jobs.seq")
        return [self._job(r) for r in rows.fetchall()]

    def lease(self, job_id: str, lease_id: str, client_id: str, deadline: float, version: int, now: float,
              precision: str | None = None) -> bool:
        """Compare-and-set: lease the job (bound to ``version``, to be computed in ``precision``) only if it is open
        or its lease has expired, and no replica of it runs (one that ran out is counted unreturned and goes).

        Through the no-fsync connection: a lease is reply-path state a client waits on, and an fsync there queues
        behind the publisher's multi-gigabyte writes. A kill -9 keeps it exactly; the next sync (an accepted result, a
        step) makes it power-safe; a power loss before that forgets the lease, and the job is
        issued again."""
        with self._light.transaction():
            before = self._light.execute("SELECT state, lease_client, version FROM jobs WHERE job_id=?",
                                         (job_id,)).fetchone()
            cur = self._light.execute(
                f"UPDATE jobs SET state='{LEASED}', lease_id=?, lease_client=?, lease_deadline=?, version=?, "
                "lease_precision=?, issue_count=issue_count+1 WHERE job_id=(SELECT job_id FROM jobs WHERE job_id=? "
                f"AND (state='{OPEN}' OR (state='{LEASED}' AND lease_deadline<=?)) AND {NO_LIVE_REPLICA}"
                f"{self._light.skip_locked})",
                (lease_id, client_id, deadline, version, precision, job_id, now, now),
            )
            if cur.rowcount != 1:
                return False
            self._light.execute("UPDATE clients SET leased=leased+1 WHERE client_id=?", (client_id,))
            if before is not None and before["state"] == LEASED and before["lease_client"]:
                self._count_unreturned(self._light, str(before["lease_client"]), job_id,  # it ran out
                                       before["version"])
            gone = self._light.execute("DELETE FROM replica_leases WHERE job_id=? RETURNING client_id, version",
                                       (job_id,)).fetchone()
            if gone is not None:  # a replica that ran out
                self._count_unreturned(self._light, str(gone["client_id"]), job_id, gone["version"])
            return True

    def lease_replica(self, job_id: str, lease_id: str, client_id: str, deadline: float, now: float,
                      precision: str | None = None) -> int | None:
        """Compare-and-set: give ``client_id`` a second lease on the job (core.scheduling.choose_replica), bound to
        the version its first lease is bound to, only while that first lease is live and another client's and no
        replica of it runs. Returns that version, or None if the job changed meanwhile. Through the light
        connection, as :meth:`lease`: a replica forgotten by a power loss only means its result is refused
        ``not_lease_holder`` (the job itself still has its first holder)."""
        with self._light.transaction():
            row = self._light.execute(
                f"SELECT version FROM jobs WHERE job_id=? AND state='{LEASED}' AND lease_deadline>? "
                f"AND lease_client!=? AND version IS NOT NULL AND {NO_LIVE_REPLICA}{self._light.skip_locked}",
                (job_id, now, client_id, now)).fetchone()
            if row is None:
                return None
            version = int(row["version"])
            self._light.execute("DELETE FROM replica_leases WHERE job_id=?", (job_id,))
            self._light.execute("INSERT INTO replica_leases(job_id, lease_id, client_id, deadline, version, precision) "
                                "VALUES(?,?,?,?,?,?)", (job_id, lease_id, client_id, deadline, version, precision))
            self._light.execute("UPDATE clients SET leased=leased+1 WHERE client_id=?", (client_id,))
            return version

    @staticmethod
    def _count_unreturned(db: Db, client_id: str, job_id: str, version: int | None) -> None:
        """A lease of ``client_id`` on ``job_id`` at ``version`` ended without its result: counted, and the job
        noted as dropped by it (the selective-reporting rule later reads what the job scored when another client
        returned it at that version: the sample this one saw), unless the client did send one that was checked
        and refused for no fault of its own (core.trust.RETURNS_RESULT: a reward that failed). Any other refusal —
        a copy of an earlier result, a late or broken one — returned nothing that is trained, and counting it as a
        return would let a client hide the leases it abandons."""
        marks = ",".join("?" * len(RETURNS_RESULT))
        returned = (f"EXISTS (SELECT 1 FROM rejections WHERE rejections.client_id=? AND rejections.job_id=? AND "
                    f"reason IN ({marks}))")
        args = (client_id, job_id, *sorted(r.value for r in RETURNS_RESULT))
        if db.execute(f"SELECT 1 WHERE {returned}", args).fetchone() is not None:
            return
        db.execute("UPDATE clients SET unreturned=unreturned+1 WHERE client_id=?", (client_id,))
        if version is not None:
            db.execute("INSERT INTO dropped(job_id, client_id, version) VALUES(?,?,?) ON CONFLICT DO NOTHING",
                       (job_id, client_id, version))

    def release(self, job_id: str, lease_id: str, client_id: str) -> bool:
        """End the client's lease on a job that is not done: its first lease (the job opens, to be reissued once no
        replica of it runs) or its replica (the row goes; the job's first lease is untouched)."""
        with self._light.transaction():  # as lease: a forgotten release only means the lease runs out
            row = self._light.execute(
                f"UPDATE jobs SET state='{OPEN}', lease_deadline=NULL WHERE job_id=? AND lease_id=? AND lease_client=? "
                f"AND state='{LEASED}' RETURNING version", (job_id, lease_id, client_id)).fetchone()
            if row is None:
                row = self._light.execute(
                    "DELETE FROM replica_leases WHERE job_id=? AND lease_id=? AND client_id=? AND EXISTS (SELECT 1 "
                    f"FROM jobs WHERE jobs.job_id=replica_leases.job_id AND jobs.state!='{DONE}') RETURNING version",
                    (job_id, lease_id, client_id)).fetchone()
            if row is None:
                return False
            self._count_unreturned(self._light, client_id, job_id, row["version"])
            return True

    def still_held(self, now: float) -> list[LeaseView]:
        """The leases still running on done jobs that had a replica, other than the one whose result closed the job
        (as leased views, one per lease): that holder may still be computing the job, its result is credited when it
        comes (docs/protocol.md §5), and it needs the job's version kept meanwhile (core.leases.kept_versions) — an
        honest newcomer whose job a replica returned first must still be able to fetch it, return it and so be
        measured. A replica is given after its job's first lease with the same timeout, so a live lease on such a
        job means a live replica row: the index on its deadline finds them."""
        rows = self._conn.execute(
            "SELECT j.job_id, j.created_at, j.version, j.lease_id, j.lease_client, j.lease_deadline, r.lease_id AS "
            "r_lease, r.client_id AS r_client, r.deadline AS r_deadline, r.version AS r_version, res.lease_id AS "
            f"closed_by FROM replica_leases r JOIN jobs j ON j.job_id=r.job_id JOIN results res ON res.job_id=r.job_id "
            f"WHERE r.deadline > ? AND j.state='{DONE}'", (now,)).fetchall()
        views = []
        for row in rows:
            for lease, client, deadline, version in (
                    (row["lease_id"], row["lease_client"], row["lease_deadline"], row["version"]),
                    (row["r_lease"], row["r_client"], row["r_deadline"], row["r_version"])):
                if lease != row["closed_by"] and deadline is not None and float(deadline) > now and version is not None:
                    views.append(LeaseView(row["job_id"], LEASED, int(version), float(row["created_at"]), lease,
                                           client, float(deadline)))
        return views

    def live_leases(self, now: float) -> int:
        """Live leases, a job's replica counted as one more."""
        row = self._conn.execute(f"SELECT COUNT(*) AS n FROM jobs WHERE state='{LEASED}' AND lease_deadline > ?",
                                 (now,)).fetchone()
        return int(row["n"]) + self.live_replicas(now)

    def live_replicas(self, now: float) -> int:
        """Replica leases running on jobs not yet done."""
        row = self._conn.execute(f"SELECT COUNT(*) AS n FROM replica_leases r JOIN jobs ON jobs.job_id=r.job_id "
                                 f"WHERE jobs.state!='{DONE}' AND r.deadline > ?", (now,)).fetchone()
        return int(row["n"])
