"""The job stream's rows: each job's plan, its lease (a compare-and-set on the row) and its release.

(Named for the rows: the rules that plan a job and judge a lease are coordinator.core.jobs and
coordinator.core.leases.) Leases, releases and the jobs a lease's path creates go through the store's light
connection, which nobody syncs: they are reply-path state that can be re-created (coordinator.store.store, and
:meth:`Jobs.lease`). A job is closed by its accepted result, in the result's transaction
(coordinator.store.results.Results.accept).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.core.jobs import JobPlan
from coordinator.core.leases import JobState, LeaseView
from coordinator.core.trust import RETURNS_RESULT
from coordinator.store.db import Db, Row

OPEN, LEASED, DONE = JobState.OPEN, JobState.LEASED, JobState.DONE  # spelled into the statements below

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
        view = LeaseView(row["job_id"], JobState(row["state"]), version, float(row["created_at"]),
                         row["lease_id"], row["lease_client"], row["lease_deadline"])
        return JobRow(view, tuple(json.loads(row["prompt_ids"])), int(row["seed"]), int(row["group_size"]),
                      int(row["issue_count"]), row["lease_precision"])

    def get(self, job_id: str) -> JobRow | None:
        row = self._conn.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return None if row is None else self._job(row)

    def active(self) -> list[JobRow]:
        """Jobs not yet done (open, leased, or leased with an expired lease), oldest first."""
        rows = self._conn.execute(f"SELECT * FROM jobs WHERE state != '{DONE}' ORDER BY seq")
        return [self._job(r) for r in rows.fetchall()]

    def lease(self, job_id: str, lease_id: str, client_id: str, deadline: float, version: int, now: float,
              precision: str | None = None) -> bool:
        """Compare-and-set: lease the job (bound to ``version``, to be computed in ``precision``) only if it is open
        or its lease has expired.

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
                f"AND (state='{OPEN}' OR (state='{LEASED}' AND lease_deadline<=?)){self._light.skip_locked})",
                (lease_id, client_id, deadline, version, precision, job_id, now),
            )
            if cur.rowcount != 1:
                return False
            self._light.execute("UPDATE clients SET leased=leased+1 WHERE client_id=?", (client_id,))
            if before is not None and before["state"] == LEASED and before["lease_client"]:
                self._count_unreturned(self._light, str(before["lease_client"]), job_id,  # it ran out
                                       before["version"])
            return True

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
        with self._light.transaction():  # as lease: a forgotten release only means the lease runs out
            row = self._light.execute(
                f"UPDATE jobs SET state='{OPEN}', lease_deadline=NULL WHERE job_id=? AND lease_id=? AND lease_client=? "
                f"AND state='{LEASED}' RETURNING version", (job_id, lease_id, client_id)).fetchone()
            if row is None:
                return False
            self._count_unreturned(self._light, client_id, job_id, row["version"])
            return True

    def live_leases(self, now: float) -> int:
        row = self._conn.execute(f"SELECT COUNT(*) AS n FROM jobs WHERE state='{LEASED}' AND lease_deadline > ?",
                                 (now,)).fetchone()
        return int(row["n"])
