"""What the learner records: its steps (each one's trained version, mean reward and metrics) and the held-out
evaluations of the versions it made.

A step is one transaction across aggregates (:meth:`Steps.commit`): its batch's results are marked ingested and the
new version and the step's row are inserted, or none of it — a result is trained on by exactly one step, and the
database and the published versions never disagree. The reads are the status page's, /metrics' and the learner's
own on restart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from coordinator.store.db import Db
from coordinator.store.records import EvalRow, LastStep, StepRow, from_row


class Steps:
    """The ``steps`` table (and, inside a step's transaction, the ``results`` it ingests and the ``versions`` row
    it makes), over the main connection."""

    def __init__(self, conn: Db) -> None:
        self._conn = conn

    def commit(self, *, step: int, trained_version: int, job_ids: list[str], new_version: int,
               manifest_sha: str, mean_reward: float, metrics: Mapping[str, object], now: float) -> None:
        """One transaction: the batch is ingested and the new version exists — or neither. ``metrics``: the
        learner's open set of figures, only encoded here (as JSON)."""
        with self._conn.transaction():
            marked = self._conn.executemany(
                "UPDATE results SET ingested_step=? WHERE job_id=? AND ingested_step IS NULL AND stale_at IS NULL",
                [(step, j) for j in job_ids])
            if marked != len(job_ids):
                raise RuntimeError(f"step {step}: {marked} of {len(job_ids)} results were still pending")
            self._conn.execute("INSERT INTO versions(version, manifest_sha256, created_at) VALUES(?,?,?)",
                               (new_version, manifest_sha, now))
            self._conn.execute("INSERT INTO steps(step, trained_version, mean_reward, metrics, at) VALUES(?,?,?,?,?)",
                               (step, trained_version, mean_reward, json.dumps(metrics), now))

    def all(self) -> list[StepRow]:
        rows = self._conn.execute("SELECT * FROM steps ORDER BY step").fetchall()
        return [StepRow(step=r["step"], trained_version=r["trained_version"], mean_reward=r["mean_reward"],
                        metrics=json.loads(r["metrics"]), at=r["at"]) for r in rows]

    def last(self) -> LastStep | None:
        """The newest step's number, mean reward and time, or None before the first."""
        row = self._conn.execute("SELECT step, mean_reward, at FROM steps ORDER BY step DESC LIMIT 1").fetchone()
        return None if row is None else from_row(LastStep, row)

    def reward_curve(self) -> list[float]:
        """Every step's mean rollout reward, in step order."""
        return [float(r[0]) for r in self._conn.execute("SELECT mean_reward FROM steps ORDER BY step").fetchall()]

    def durations_after(self, step: int) -> list[tuple[int, float]]:
        """(step, its ``step_s`` metric: 0 where not recorded) of every step after ``step``, in order (what a
        scrape has not counted yet)."""
        rows = self._conn.execute("SELECT step, metrics FROM steps WHERE step > ? ORDER BY step", (step,)).fetchall()
        return [(int(r["step"]), float(json.loads(r["metrics"]).get("step_s", 0.0))) for r in rows]


class Evals:
    """The ``evals`` table: one held-out evaluation per version (a later one replaces it), over the main
    connection."""

    def __init__(self, conn: Db) -> None:
        self._conn = conn

    def record(self, version: int, accuracy: float, n: int, now: float) -> None:
        with self._conn.transaction():
            self._conn.execute("INSERT INTO evals(version, accuracy, n, at) VALUES(?,?,?,?) ON CONFLICT(version) DO "
                               "UPDATE SET accuracy=excluded.accuracy, n=excluded.n, at=excluded.at",
                               (version, accuracy, n, now))

    def all(self) -> list[EvalRow]:
        return [from_row(EvalRow, r) for r in self._conn.execute("SELECT * FROM evals ORDER BY version").fetchall()]
