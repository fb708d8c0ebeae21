"""coordinator/store.py against a real SQLite database in tmp_path."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.core.jobs import JobPlan, plan_jobs
from coordinator.core.leases import JobState
from coordinator.store import Store

T0 = 1000.0
ALICE = "a" * 32
BOB = "b" * 32
GROUP = 4


@pytest.fixture()
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "run" / "coordinator.sqlite"


@pytest.fixture()
def store(db_path: Path) -> Iterator[Store]:
    db_path.parent.mkdir(parents=True, exist_ok=True)
    s = Store(db_path)
    yield s
    s.close()


def published(store: Store, n_jobs: int = 3) -> list[JobPlan]:
    plans = plan_jobs(0, 0, 100, 2 * n_jobs, 2)
    store.publish_initial("m0", plans, GROUP, T0)
    return plans


def registered(store: Store, *clients: str) -> None:
    for c in clients:
        store.register_client(c, c.encode()[:32], {"name": c}, T0)


def accept(store: Store, job_id: str, lease_id: str, client: str, **kw: Any) -> bool:
    args: dict[str, Any] = dict(job_id=job_id, lease_id=lease_id, client_id=client, version=0,
                                content_sha256="c" * 64, payload=b"payload", rewards=[1.0, 0.0, 1.0, 1.0],
                                n_tokens=12, credit=2.0, now=T0 + 5)
    return store.accept_result(**(args | kw))


def rows(store: Store, table: str) -> list[dict[str, Any]]:
    return [dict(r) for r in store.conn.execute(f"SELECT * FROM {table} ORDER BY rowid").fetchall()]


def commit(store: Store, step: int, job_ids: list[str], new_version: int, **kw: Any) -> list[JobPlan]:
    plans = plan_jobs(0, new_version, 100, 4, 2)
    args: dict[str, Any] = dict(step=step, trained_version=new_version - 1, job_ids=job_ids, new_version=new_version,
                                manifest_sha=f"m{new_version}", mean_reward=0.75, metrics={"loss": 0.5},
                                plans=plans, group_size=GROUP, now=T0 + 100 * new_version)
    store.commit_step(**(args | kw))
    return plans


# ---- clients and nonces ---------------------------------------------------------------------------------
def test_register_client_new_then_existing(store: Store) -> None:
    assert store.register_client(ALICE, b"k" * 32, {"name": "one"}, T0) is True
    assert store.register_client(ALICE, b"k" * 32, {"name": "two"}, T0 + 10) is False
    row = store.get_client(ALICE)
    assert row is not None
    assert json.loads(row["profile"]) == {"name": "two"}
    assert row["registered_at"] == T0 and row["last_seen"] == T0 + 10
    assert bytes(row["public_key"]) == b"k" * 32
    assert store.get_client(BOB) is None
    assert len(store.clients()) == 1


def test_ban(store: Store) -> None:
    registered(store, ALICE)
    assert store.set_banned(ALICE, True)
    assert store.get_client(ALICE)["banned"] == 1  # type: ignore[index]
    assert not store.set_banned(BOB, True)


def test_remember_nonce_replay(store: Store) -> None:
    assert store.remember_nonce(b"n" * 16, T0 + 300) is True
    assert store.remember_nonce(b"n" * 16, T0 + 999) is False
    assert store.remember_nonce(b"m" * 16, T0 + 300) is True


def test_prune_nonces(store: Store) -> None:
    store.remember_nonce(b"old" * 6, T0)
    store.remember_nonce(b"new" * 6, T0 + 600)
    assert store.prune_nonces(T0 + 1) == 1
    assert store.remember_nonce(b"old" * 6, T0 + 900) is True  # forgotten, so no longer a replay
    assert store.remember_nonce(b"new" * 6, T0 + 900) is False


# ---- versions and jobs ----------------------------------------------------------------------------------
def test_publish_initial(store: Store) -> None:
    assert store.current_version() is None
    plans = published(store)
    assert store.current_version() == 0
    assert store.manifest_sha(0) == "m0" and store.manifest_sha(1) is None
    jobs = store.jobs_for_version(0)
    assert [j.view.job_id for j in jobs] == [p.job_id for p in plans]
    for job, plan in zip(jobs, plans, strict=True):
        assert job.view.state is JobState.OPEN and job.view.version == 0 and job.view.created_at == T0
        assert job.prompt_ids == plan.prompt_ids and job.seed == plan.seed
        assert job.group_size == GROUP and job.issue_count == 0


def test_lease_job_compare_and_set(store: Store) -> None:
    published(store)
    assert store.lease_job("v0-j0", "L1", ALICE, T0 + 60, T0) is True
    assert store.lease_job("v0-j0", "L2", BOB, T0 + 70, T0 + 10) is False  # live lease
    job = store.get_job("v0-j0")
    assert job is not None
    assert job.view.state is JobState.LEASED
    assert (job.view.lease_id, job.view.lease_client, job.view.lease_deadline) == ("L1", ALICE, T0 + 60)
    assert job.issue_count == 1


def test_lease_after_expiry_succeeds_and_counts(store: Store) -> None:
    published(store)
    store.lease_job("v0-j0", "L1", ALICE, T0 + 60, T0)
    assert store.lease_job("v0-j0", "L2", BOB, T0 + 59.9 + 60, T0 + 59.9) is False
    assert store.lease_job("v0-j0", "L2", BOB, T0 + 120, T0 + 60) is True  # expired exactly at the deadline
    job = store.get_job("v0-j0")
    assert job is not None
    assert (job.view.lease_id, job.view.lease_client) == ("L2", BOB)
    assert job.issue_count == 2
    assert store.totals()["reissued_jobs"] == 1


def test_lease_unknown_job(store: Store) -> None:
    published(store)
    assert store.lease_job("nope", "L1", ALICE, T0 + 60, T0) is False
    assert store.get_job("nope") is None


def test_release_lease(store: Store) -> None:
    published(store)
    store.lease_job("v0-j0", "L1", ALICE, T0 + 60, T0)
    assert store.release_lease("v0-j0", "L1", BOB) is False   # not the holder
    assert store.release_lease("v0-j0", "L0", ALICE) is False  # not the lease
    assert store.release_lease("v0-j0", "L1", ALICE) is True
    job = store.get_job("v0-j0")
    assert job is not None and job.view.state is JobState.OPEN and job.view.lease_deadline is None
    assert store.release_lease("v0-j0", "L1", ALICE) is False  # already released
    # the released job is immediately leasable again, and the old lease can no longer be used
    assert store.lease_job("v0-j0", "L2", BOB, T0 + 100, T0 + 1) is True
    assert accept(store, "v0-j0", "L1", ALICE) is False


# ---- results --------------------------------------------------------------------------------------------
def test_accept_result_once(store: Store) -> None:
    published(store)
    registered(store, ALICE)
    store.lease_job("v0-j0", "L1", ALICE, T0 + 60, T0)
    assert accept(store, "v0-j0", "L1", ALICE) is True
    job = store.get_job("v0-j0")
    assert job is not None and job.view.state is JobState.DONE
    results = rows(store, "results")
    assert len(results) == 1
    assert results[0]["job_id"] == "v0-j0" and results[0]["client_id"] == ALICE
    assert results[0]["mean_reward"] == pytest.approx(0.75)
    assert results[0]["ingested_step"] is None
    client = store.get_client(ALICE)
    assert client is not None and client["accepted"] == 1 and client["credit"] == 2.0
    # a second accept for the same job (same lease, or anyone else's) is refused
    assert accept(store, "v0-j0", "L1", ALICE) is False
    assert accept(store, "v0-j0", "L1", ALICE, payload=b"other") is False
    assert len(rows(store, "results")) == 1
    assert store.get_client(ALICE)["accepted"] == 1  # type: ignore[index]
    # ... and a done job can never be leased again
    assert store.lease_job("v0-j0", "L9", BOB, T0 + 1e6, T0 + 1e5) is False


def test_accept_with_stale_lease_writes_nothing(store: Store) -> None:
    published(store)
    registered(store, ALICE, BOB)
    store.lease_job("v0-j0", "L1", ALICE, T0 + 60, T0)
    store.lease_job("v0-j0", "L2", BOB, T0 + 200, T0 + 61)  # reissued after expiry
    before = {t: rows(store, t) for t in ("results", "jobs", "clients")}
    assert accept(store, "v0-j0", "L1", ALICE) is False
    assert {t: rows(store, t) for t in ("results", "jobs", "clients")} == before
    assert accept(store, "v0-j0", "L2", BOB) is True


def test_accept_requires_matching_client(store: Store) -> None:
    published(store)
    registered(store, ALICE, BOB)
    store.lease_job("v0-j0", "L1", ALICE, T0 + 60, T0)
    assert accept(store, "v0-j0", "L1", BOB) is False
    assert rows(store, "results") == []
    assert accept(store, "v0-j0", "L1", ALICE) is True


def test_accept_on_open_job_refused(store: Store) -> None:
    published(store)
    registered(store, ALICE)
    assert accept(store, "v0-j0", "L1", ALICE) is False
    assert rows(store, "results") == []


def test_record_rejection(store: Store) -> None:
    registered(store, ALICE)
    store.record_rejection(ALICE, "v0-j0", "shape_mismatch", "bad", None, T0)
    assert store.get_client(ALICE)["rejected"] == 1  # type: ignore[index]
    assert store.rejections()[0]["reason"] == "shape_mismatch"
    assert store.totals()["rejected"] == 1


def test_pending_results(store: Store) -> None:
    published(store)
    registered(store, ALICE)
    for k in (2, 0):
        store.lease_job(f"v0-j{k}", f"L{k}", ALICE, T0 + 60, T0)
        accept(store, f"v0-j{k}", f"L{k}", ALICE, rewards=[float(k), 1.0])
    pending = store.pending_results(0)
    assert [r.job_id for r in pending] == ["v0-j0", "v0-j2"]
    assert pending[1].rewards == [2.0, 1.0] and pending[1].payload == b"payload"
    assert store.count_pending(0) == 2 and store.count_pending(1) == 0


# ---- commit_step ----------------------------------------------------------------------------------------
def accepted_jobs(store: Store, *ks: int) -> list[str]:
    registered(store, ALICE)
    ids = []
    for k in ks:
        store.lease_job(f"v0-j{k}", f"L{k}", ALICE, T0 + 60, T0)
        assert accept(store, f"v0-j{k}", f"L{k}", ALICE)
        ids.append(f"v0-j{k}")
    return ids


def test_commit_step_ingests_and_publishes(store: Store) -> None:
    published(store)
    ids = accepted_jobs(store, 0, 1, 2)
    plans = commit(store, 1, ids, 1)
    assert store.current_version() == 1 and store.manifest_sha(1) == "m1"
    assert [r["ingested_step"] for r in rows(store, "results")] == [1, 1, 1]
    assert store.count_pending(0) == 0
    assert [j.view.job_id for j in store.jobs_for_version(1)] == [p.job_id for p in plans]
    assert all(j.view.state is JobState.OPEN for j in store.jobs_for_version(1))
    steps = store.steps()
    assert len(steps) == 1 and steps[0]["metrics"] == {"loss": 0.5} and steps[0]["trained_version"] == 0


def test_commit_step_ingests_exactly_once(store: Store) -> None:
    published(store)
    ids = accepted_jobs(store, 0, 1)
    commit(store, 1, ids, 1)
    before = {t: rows(store, t) for t in ("versions", "jobs", "results", "steps")}
    with pytest.raises(RuntimeError, match="still pending"):
        commit(store, 2, ids, 2)
    assert {t: rows(store, t) for t in ("versions", "jobs", "results", "steps")} == before


def test_commit_step_with_non_pending_result_rolls_back(store: Store) -> None:
    published(store)
    ids = accepted_jobs(store, 0, 1)
    before = {t: rows(store, t) for t in ("versions", "jobs", "results", "steps")}
    # v0-j2 has no accepted result: the whole step must be refused, including the marks on v0-j0/j1
    with pytest.raises(RuntimeError):
        commit(store, 1, [*ids, "v0-j2"], 1)
    assert {t: rows(store, t) for t in ("versions", "jobs", "results", "steps")} == before
    assert store.current_version() == 0
    assert store.jobs_for_version(1) == []
    assert store.count_pending(0) == 2
    # and a correct commit afterwards still works
    commit(store, 1, ids, 1)
    assert store.current_version() == 1


def test_commit_step_duplicate_version_rolls_back(store: Store) -> None:
    published(store)
    ids = accepted_jobs(store, 0)
    with pytest.raises(sqlite3.IntegrityError):
        commit(store, 1, ids, 0)  # version 0 already exists
    assert store.count_pending(0) == 1
    assert store.steps() == []


# ---- durability -----------------------------------------------------------------------------------------
def test_data_survives_reopen(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    s = Store(db_path)
    published(s)
    ids = accepted_jobs(s, 0, 1)
    s.lease_job("v0-j2", "L2", BOB, T0 + 60, T0)
    commit(s, 1, ids, 1)
    s.remember_nonce(b"n" * 16, T0 + 300)
    s.set_meta("run_id", "run-xyz")
    s.record_eval(1, 0.5, 64, T0)
    s.close()

    s2 = Store(db_path)
    try:
        assert s2.current_version() == 1
        assert s2.get_meta("run_id") == "run-xyz" and s2.get_meta("absent") is None
        assert s2.get_client(ALICE) is not None
        assert s2.remember_nonce(b"n" * 16, T0 + 300) is False
        job = s2.get_job("v0-j2")
        assert job is not None and job.view.state is JobState.LEASED and job.view.lease_client == BOB
        assert [r["ingested_step"] for r in s2.results_summary()] == [1, 1]
        assert len(s2.jobs_for_version(1)) == 2
        assert s2.evals() == [{"version": 1, "accuracy": 0.5, "n": 64, "at": T0}]
        assert s2.totals() == {"accepted": 2, "rejected": 0, "reissued_jobs": 0}
    finally:
        s2.close()


def test_set_meta_overwrites(store: Store) -> None:
    store.set_meta("k", "1")
    store.set_meta("k", "2")
    assert store.get_meta("k") == "2"
