"""coordinator/store/store.py against a real SQLite database in tmp_path and a real PostgreSQL database (each test
runs on both: conftest.store_target)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.api.public_reads import ReplyCache
from coordinator.core.jobs import JobPlan, plan_job
from coordinator.core.leases import JobState
from coordinator.core.scheduling import Pending
from coordinator.store.db import IntegrityError, pg_ddl
from coordinator.store.hops import EVALUATE, EvaluateRequest
from coordinator.store.records import EvalRow, VersionRow
from coordinator.store.store import SCHEMA_VERSION, Store

T0 = 1000.0
ALICE = "a" * 32
BOB = "b" * 32
GROUP = 4


@pytest.fixture()
def db_path(store_target: str | Path) -> str | Path:
    return store_target


@pytest.fixture()
def store(db_path: str | Path) -> Iterator[Store]:
    s = Store(db_path)
    yield s
    s.close()


TABLES = ("versions", "jobs", "results", "steps", "clients")
KEYS = {"versions": "version", "jobs": "seq", "results": "job_id", "steps": "step", "clients": "client_id"}


def created(store: Store, n_jobs: int) -> list[JobPlan]:
    """Plan and create the next ``n_jobs`` jobs of the stream (j<seq>, two prompts each)."""
    plans = []
    for _ in range(n_jobs):
        plan = plan_job(0, store.jobs.next_seq(), 100, 2)
        store.jobs.create(plan, GROUP, T0)
        plans.append(plan)
    return plans


def published(store: Store, n_jobs: int = 3) -> list[JobPlan]:
    store.versions.publish_initial("m0", T0)
    return created(store, n_jobs)


def registered(store: Store, *clients: str) -> None:
    for c in clients:
        store.clients.register(c, c.encode()[:32], {"name": c}, T0)


def lease(store: Store, job_id: str, lease_id: str, client: str, deadline: float = T0 + 60, version: int = 0,
          now: float = T0) -> bool:
    return store.jobs.lease(job_id, lease_id, client, deadline, version, now)


def accept(store: Store, job_id: str, lease_id: str, client: str, **kw: Any) -> bool:
    args: dict[str, Any] = dict(job_id=job_id, lease_id=lease_id, client_id=client, version=0,
                                content_sha256="c" * 64, payload=b"payload", rewards=[1.0, 0.0, 1.0, 1.0],
                                n_tokens=12, credit=2.0, now=T0 + 5)
    return store.results.accept(**(args | kw))


def rows(store: Store, table: str) -> list[dict[str, Any]]:
    return [dict(r) for r in store.conn.execute(f"SELECT * FROM {table} ORDER BY {KEYS[table]}").fetchall()]


def snapshot(store: Store) -> dict[str, list[dict[str, Any]]]:
    return {t: rows(store, t) for t in TABLES}


def commit(store: Store, step: int, job_ids: list[str], new_version: int, **kw: Any) -> None:
    args: dict[str, Any] = dict(step=step, trained_version=new_version - 1, job_ids=job_ids, new_version=new_version,
                                manifest_sha=f"m{new_version}", mean_reward=0.75, metrics={"loss": 0.5},
                                now=T0 + 100 * new_version)
    store.steps.commit(**(args | kw))


def pending_ids(store: Store) -> set[str]:
    return {p.job_id for p in store.results.pending()}


# ---- clients and nonces ---------------------------------------------------------------------------------
def test_register_client_new_then_existing(store: Store) -> None:
    assert store.clients.register(ALICE, b"k" * 32, {"name": "one"}, T0) is True
    assert store.clients.register(ALICE, b"k" * 32, {"name": "two"}, T0 + 10) is False
    row = store.clients.get(ALICE)
    assert row is not None
    assert json.loads(row["profile"]) == {"name": "two"}
    assert row["registered_at"] == T0 and row["last_seen"] == T0 + 10
    assert bytes(row["public_key"]) == b"k" * 32
    assert store.clients.get(BOB) is None
    assert len(store.clients.all()) == 1


def test_ban(store: Store) -> None:
    registered(store, ALICE)
    assert store.clients.set_banned(ALICE, True)
    assert store.clients.get(ALICE)["banned"] == 1  # type: ignore[index]
    assert not store.clients.set_banned(BOB, True)


def test_remember_nonce_replay(store: Store) -> None:
    assert store.nonces.remember(b"n" * 16, T0 + 300) is True
    assert store.nonces.remember(b"n" * 16, T0 + 999) is False
    assert store.nonces.remember(b"m" * 16, T0 + 300) is True


def test_prune_nonces(store: Store) -> None:
    store.nonces.remember(b"old" * 6, T0)
    store.nonces.remember(b"new" * 6, T0 + 600)
    assert store.nonces.prune(T0 + 1) == 1
    assert store.nonces.remember(b"old" * 6, T0 + 900) is True  # forgotten, so no longer a replay
    assert store.nonces.remember(b"new" * 6, T0 + 900) is False


# ---- versions and jobs ----------------------------------------------------------------------------------
def test_publish_initial(store: Store) -> None:
    assert store.versions.current() is None
    store.versions.publish_initial("m0", T0)
    assert store.versions.current() == 0
    assert store.versions.manifest_sha(0) == "m0" and store.versions.manifest_sha(1) is None
    assert store.versions.all() == [VersionRow(version=0, manifest_sha256="m0", created_at=T0)]
    assert store.jobs.active() == []  # jobs are planned on demand, not with the version
    with pytest.raises(IntegrityError):
        store.versions.publish_initial("other", T0 + 1)
    assert store.versions.manifest_sha(0) == "m0"


def test_next_seq_and_create_job(store: Store) -> None:
    store.versions.publish_initial("m0", T0)
    assert store.jobs.next_seq() == 0
    plan = plan_job(0, 0, 100, 2)
    row = store.jobs.create(plan, GROUP, T0 + 1)
    assert store.jobs.next_seq() == 1
    assert row == store.jobs.get("j0")
    assert row.view.job_id == "j0" and row.view.state is JobState.OPEN
    assert row.view.version is None  # bound when leased
    assert row.view.created_at == T0 + 1
    assert (row.view.lease_id, row.view.lease_client, row.view.lease_deadline) == (None, None, None)
    assert row.prompt_ids == plan.prompt_ids and row.seed == plan.seed
    assert row.group_size == GROUP and row.issue_count == 0
    assert rows(store, "jobs")[0]["seq"] == 0


def test_create_jobs_form_a_stream(store: Store) -> None:
    plans = published(store, 4)
    assert [p.job_id for p in plans] == ["j0", "j1", "j2", "j3"]
    assert store.jobs.next_seq() == 4
    jobs = store.jobs.active()
    assert [j.view.job_id for j in jobs] == [p.job_id for p in plans]
    for job, plan in zip(jobs, plans, strict=True):
        assert job.prompt_ids == plan.prompt_ids and job.seed == plan.seed and job.view.version is None


def test_next_seq_follows_the_highest(store: Store) -> None:
    store.jobs.create(plan_job(0, 5, 100, 2), GROUP, T0)
    store.jobs.create(plan_job(0, 2, 100, 2), GROUP, T0)
    assert store.jobs.next_seq() == 6
    assert [j.view.job_id for j in store.jobs.active()] == ["j2", "j5"]  # ordered by seq, not insertion


def test_create_job_duplicate_seq_writes_nothing(store: Store) -> None:
    published(store, 2)
    before = snapshot(store)
    with pytest.raises(IntegrityError):
        store.jobs.create(plan_job(0, 1, 100, 2), GROUP, T0 + 9)  # same job id and seq
    with pytest.raises(IntegrityError):
        store.jobs.create(JobPlan("other", 1, (0, 1), 7), GROUP, T0 + 9)  # same seq, new id
    assert snapshot(store) == before
    assert store.jobs.next_seq() == 2


def test_active_jobs_excludes_done_only(store: Store) -> None:
    published(store, 4)
    registered(store, ALICE)
    lease(store, "j0", "L0", ALICE)
    assert accept(store, "j0", "L0", ALICE)
    lease(store, "j1", "L1", ALICE, deadline=T0 + 1)   # expired later on
    lease(store, "j2", "L2", ALICE, deadline=T0 + 1e6)  # live
    assert [j.view.job_id for j in store.jobs.active()] == ["j1", "j2", "j3"]


def test_lease_job_compare_and_set(store: Store) -> None:
    published(store)
    assert lease(store, "j0", "L1", ALICE, T0 + 60, version=0, now=T0) is True
    assert lease(store, "j0", "L2", BOB, T0 + 70, version=1, now=T0 + 10) is False  # live lease
    job = store.jobs.get("j0")
    assert job is not None
    assert job.view.state is JobState.LEASED
    assert (job.view.lease_id, job.view.lease_client, job.view.lease_deadline) == ("L1", ALICE, T0 + 60)
    assert job.view.version == 0  # the refused lease did not re-bind it
    assert job.issue_count == 1


def test_lease_job_binds_the_version(store: Store) -> None:
    published(store)
    assert lease(store, "j0", "L1", ALICE, version=3) is True
    assert lease(store, "j1", "L2", BOB, version=1) is True
    assert store.jobs.get("j0").view.version == 3  # type: ignore[union-attr]
    assert store.jobs.get("j1").view.version == 1  # type: ignore[union-attr]
    assert store.jobs.get("j2").view.version is None  # type: ignore[union-attr]


def test_lease_after_expiry_succeeds_counts_and_rebinds(store: Store) -> None:
    published(store)
    lease(store, "j0", "L1", ALICE, T0 + 60, version=0, now=T0)
    assert lease(store, "j0", "L2", BOB, T0 + 59.9 + 60, version=2, now=T0 + 59.9) is False
    assert store.jobs.get("j0").view.version == 0  # type: ignore[union-attr]
    # expired exactly at the deadline; the reissued job is generated with the version named now
    assert lease(store, "j0", "L2", BOB, T0 + 120, version=2, now=T0 + 60) is True
    job = store.jobs.get("j0")
    assert job is not None
    assert (job.view.lease_id, job.view.lease_client, job.view.lease_deadline) == ("L2", BOB, T0 + 120)
    assert job.view.version == 2
    assert job.issue_count == 2
    assert store.totals()["reissued_jobs"] == 1


def test_a_half_read_query_does_not_hide_the_light_connections_writes(store: Store) -> None:
    """Leases commit through the light connection; reads on the main one must see them at once, even when an
    earlier query on it was read only in part (a half-read SQLite cursor would keep a stale snapshot)."""
    published(store)
    first = store.conn.execute("SELECT job_id FROM jobs ORDER BY seq")
    assert first.fetchone() is not None  # more rows left unread
    assert lease(store, "j0", "L1", ALICE) is True
    assert store.conn.execute("SELECT SUM(issue_count) AS n FROM jobs").fetchone()["n"] == 1
    assert store.jobs.get("j0").view.lease_id == "L1"  # type: ignore[union-attr]


def test_changes_moves_with_a_lease_so_cached_read_models_are_rebuilt(store: Store) -> None:
    """/metrics and /v1/status replies are cached while ``Store.changes`` stands still: a lease (light
    connection) must move it, or a scrape right after a lease shows the jobs as they were before (CI, stop 28)."""
    published(store)
    cache = ReplyCache(ttl_s=60.0)
    build = lambda: str(store.conn.execute("SELECT SUM(issue_count) AS n FROM jobs").fetchone()["n"]).encode()  # noqa: E731
    assert cache.get("k", 0, store.changes, build) == b"0"
    before = store.changes
    assert lease(store, "j0", "L1", ALICE) is True
    assert store.changes > before
    cache._entries["k"] = dataclasses.replace(cache._entries["k"], build_s=0.0)  # rebuild as soon as data moved
    assert cache.get("k", 0, before, build) == b"0"  # a key that missed the lease: the stale reply, for 60 s
    assert cache.get("k", 0, store.changes, build) == b"1"


def test_lease_unknown_job(store: Store) -> None:
    published(store)
    before = snapshot(store)
    assert lease(store, "nope", "L1", ALICE) is False
    assert store.jobs.get("nope") is None
    assert snapshot(store) == before


def test_release_lease(store: Store) -> None:
    published(store)
    lease(store, "j0", "L1", ALICE, version=0)
    assert store.jobs.release("j0", "L1", BOB) is False   # not the holder
    assert store.jobs.release("j0", "L0", ALICE) is False  # not the lease
    assert store.jobs.release("j0", "L1", ALICE) is True
    job = store.jobs.get("j0")
    assert job is not None and job.view.state is JobState.OPEN and job.view.lease_deadline is None
    assert store.jobs.release("j0", "L1", ALICE) is False  # already released
    # the released job is immediately leasable again (re-bound), and the old lease can no longer be used
    assert lease(store, "j0", "L2", BOB, T0 + 100, version=1, now=T0 + 1) is True
    assert store.jobs.get("j0").view.version == 1  # type: ignore[union-attr]
    assert accept(store, "j0", "L1", ALICE) is False


def test_live_leases_counts_only_unexpired_leases(store: Store) -> None:
    published(store, 5)
    registered(store, ALICE)
    assert store.jobs.live_leases(T0) == 0
    lease(store, "j0", "L0", ALICE, deadline=T0 + 10)
    lease(store, "j1", "L1", ALICE, deadline=T0 + 20)
    lease(store, "j2", "L2", ALICE, deadline=T0 + 30)
    lease(store, "j3", "L3", ALICE, deadline=T0 + 30)
    assert store.jobs.live_leases(T0) == 4
    assert store.jobs.live_leases(T0 + 9.99) == 4
    assert store.jobs.live_leases(T0 + 10) == 3  # expires exactly at the deadline, like leases.lease_live
    assert store.jobs.live_leases(T0 + 20) == 2
    assert store.jobs.live_leases(T0 + 30) == 0
    # a done job and a released one hold no lease
    assert accept(store, "j2", "L2", ALICE)
    assert store.jobs.release("j3", "L3", ALICE)
    assert store.jobs.live_leases(T0) == 2
    # a reissued job counts once
    assert lease(store, "j0", "L9", ALICE, deadline=T0 + 50, now=T0 + 10)
    assert store.jobs.live_leases(T0 + 10) == 2  # j0 (new lease) and j1


def test_leases_ending_without_a_result_are_counted_per_client(store: Store) -> None:
    """What the selective-reporting rule reads: leases granted, and those that ended without a result from the
    client — released, or run out and reissued — but not one whose result was checked and refused for the
    coordinator's own failing (a reward that failed on it)."""
    published(store, 5)
    registered(store, ALICE, BOB)
    assert lease(store, "j0", "L0", ALICE) and accept(store, "j0", "L0", ALICE)  # returned
    assert lease(store, "j1", "L1", ALICE) and store.jobs.release("j1", "L1", ALICE)  # released: not returned
    assert lease(store, "j2", "L2", ALICE, deadline=T0 + 10)
    assert store.trust.lease_counts(ALICE) == (3, 1)  # j2's lease is still live
    assert lease(store, "j2", "L2b", BOB, now=T0 + 10)  # ran out, reissued: ALICE's lease ended without a result
    assert store.trust.lease_counts(ALICE) == (3, 2) and store.trust.lease_counts(BOB) == (1, 0)
    assert lease(store, "j3", "L3", ALICE)
    store.results.record_rejection(ALICE, "j3", "reward_failed", "no", "e" * 64, T0)
    assert store.jobs.release("j3", "L3", ALICE)  # checked, refused for the reward's fault, released: returned
    assert not store.jobs.release("j3", "L3", ALICE)  # a release that changes nothing counts nothing
    assert lease(store, "nope", "Lx", ALICE) is False  # a lease that was not granted counts nothing
    assert store.trust.lease_counts(ALICE) == (4, 2) and store.trust.lease_counts("c" * 32) == (0, 0)
    assert {c.client_id: (c.leased, c.unreturned) for c in store.clients.all()}[ALICE] == (4, 2)
    # each counted lease is noted as a drop, at the version it was bound to (j3's refused-and-released one is not)
    dropped = store.conn.execute("SELECT job_id, client_id, version FROM dropped ORDER BY job_id").fetchall()
    assert [tuple(r) for r in dropped] == [("j1", ALICE, 0), ("j2", ALICE, 0)]


def test_what_a_client_dropped_is_read_from_the_next_holders_result_at_that_version(store: Store) -> None:
    """The selective-reporting rule's second comparison: the rewards a client returned, and those of the jobs it
    dropped as another client returned them at the version it had held them (the same key there). A job dropped
    at one version and returned at another is a new sample, and not counted; dropping a job twice at the same
    version notes it once."""
    published(store, 5)
    registered(store, ALICE, BOB)
    assert lease(store, "j0", "L0", ALICE, version=1) and accept(store, "j0", "L0", ALICE, version=1)  # 0.75
    for job in ("j1", "j2"):
        assert lease(store, job, f"L{job}", ALICE, version=1) and store.jobs.release(job, f"L{job}", ALICE)
    assert lease(store, "j1", "Lj1b", ALICE, version=1) and store.jobs.release("j1", "Lj1b", ALICE)  # again
    assert lease(store, "j1", "Lj1c", BOB, version=1)
    assert accept(store, "j1", "Lj1c", BOB, version=1, rewards=[0.0, 0.0, 0.0, 1.0])  # what ALICE saw: 0.25
    assert lease(store, "j2", "Lj2b", BOB, version=2)
    assert accept(store, "j2", "Lj2b", BOB, version=2, rewards=[0.0] * 4)  # another version: another sample
    assert store.trust.reward_samples(ALICE) == ((1, 0.75, 0.5625), (1, 0.25, 0.0625))
    assert store.trust.lease_counts(ALICE) == (4, 3)
    assert store.trust.reward_samples(BOB) == ((2, 0.25, 0.0625), (0, 0.0, 0.0))


def test_a_refusal_the_client_can_cause_does_not_return_its_lease(store: Store) -> None:
    """An identity that sends a copy of its own earlier result (409 duplicate_result) to each job it wants to drop,
    or a result broken on purpose, and then releases the job, returned nothing that is trained: each of those
    leases counts as unreturned, released or run out, so the selective-reporting rule sees every one."""
    published(store, 5)
    registered(store, ALICE, BOB)
    assert lease(store, "j0", "L0", ALICE) and accept(store, "j0", "L0", ALICE)
    for job, reason in (("j1", "duplicate_result"), ("j2", "choice_mismatch"), ("j3", "lease_expired")):
        assert lease(store, job, f"L{job}", ALICE, deadline=T0 + 10)
        store.results.record_rejection(ALICE, job, reason, "no", "e" * 64, T0)
    assert store.jobs.release("j1", "Lj1", ALICE) and store.jobs.release("j2", "Lj2", ALICE)
    assert lease(store, "j3", "L3b", BOB, now=T0 + 10)  # ran out after its refusal, reissued
    assert store.trust.lease_counts(ALICE) == (4, 3) and store.trust.lease_counts(BOB) == (1, 0)
    # only the refused client's own refusal counts for it: BOB's lease on j3 is judged by BOB's
    store.results.record_rejection(BOB, "j3", "reward_failed", "no", "f" * 64, T0 + 11)
    assert store.jobs.release("j3", "L3b", BOB)
    assert store.trust.lease_counts(BOB) == (1, 0)


# ---- results --------------------------------------------------------------------------------------------
def test_accept_result_once(store: Store) -> None:
    published(store)
    registered(store, ALICE)
    lease(store, "j0", "L1", ALICE)
    assert accept(store, "j0", "L1", ALICE) is True
    job = store.jobs.get("j0")
    assert job is not None and job.view.state is JobState.DONE
    results = rows(store, "results")
    assert len(results) == 1
    assert results[0]["job_id"] == "j0" and results[0]["client_id"] == ALICE
    assert results[0]["mean_reward"] == pytest.approx(0.75)
    assert results[0]["ingested_step"] is None and results[0]["stale_at"] is None
    client = store.clients.get(ALICE)
    assert client is not None and client["accepted"] == 1 and client["credit"] == 2.0
    # a second accept for the same job (same lease, or anyone else's) is refused
    assert accept(store, "j0", "L1", ALICE) is False
    assert accept(store, "j0", "L1", ALICE, payload=b"other") is False
    assert len(rows(store, "results")) == 1
    assert store.clients.get(ALICE)["accepted"] == 1  # type: ignore[index]
    # ... and a done job can never be leased again
    assert lease(store, "j0", "L9", BOB, T0 + 1e6, now=T0 + 1e5) is False


def test_accept_with_stale_lease_writes_nothing(store: Store) -> None:
    published(store)
    registered(store, ALICE, BOB)
    lease(store, "j0", "L1", ALICE, T0 + 60, now=T0)
    lease(store, "j0", "L2", BOB, T0 + 200, version=1, now=T0 + 61)  # reissued after expiry
    before = {t: rows(store, t) for t in ("results", "jobs", "clients")}
    assert accept(store, "j0", "L1", ALICE) is False
    assert {t: rows(store, t) for t in ("results", "jobs", "clients")} == before
    assert accept(store, "j0", "L2", BOB, version=1) is True


def test_accept_requires_matching_client(store: Store) -> None:
    published(store)
    registered(store, ALICE, BOB)
    lease(store, "j0", "L1", ALICE)
    assert accept(store, "j0", "L1", BOB) is False
    assert rows(store, "results") == []
    assert accept(store, "j0", "L1", ALICE) is True


def test_accept_on_open_job_refused(store: Store) -> None:
    published(store)
    registered(store, ALICE)
    assert accept(store, "j0", "L1", ALICE) is False
    assert rows(store, "results") == []


def test_record_rejection(store: Store) -> None:
    registered(store, ALICE)
    store.results.record_rejection(ALICE, "j0", "shape_mismatch", "bad", None, T0)
    assert store.clients.get(ALICE)["rejected"] == 1  # type: ignore[index]
    assert store.results.rejections()[0].reason == "shape_mismatch"
    assert store.totals()["rejected"] == 1


def accepted_jobs(store: Store, *ks: int, version: int = 0, at: float = T0 + 5) -> list[str]:
    registered(store, ALICE)
    ids = []
    for k in ks:
        assert lease(store, f"j{k}", f"L{k}", ALICE, version=version)
        assert accept(store, f"j{k}", f"L{k}", ALICE, version=version, now=at + k)
        ids.append(f"j{k}")
    return ids


def test_pending(store: Store) -> None:
    published(store, 4)
    assert store.results.pending() == []
    accepted_jobs(store, 2, version=1, at=T0 + 20)
    accepted_jobs(store, 0, version=0, at=T0 + 10)
    lease(store, "j1", "L1", ALICE)  # leased, no result yet: not pending
    assert sorted(store.results.pending(), key=lambda p: p.job_id) == [Pending("j0", 0, T0 + 10),
                                                                       Pending("j2", 1, T0 + 22)]


def test_pending_excludes_ingested_and_stale(store: Store) -> None:
    published(store, 4)
    ids = accepted_jobs(store, 0, 1, 2, 3)
    assert pending_ids(store) == set(ids)
    commit(store, 1, ["j0", "j1"], 1)
    assert pending_ids(store) == {"j2", "j3"}
    store.results.mark_stale(["j3"], 3)
    assert pending_ids(store) == {"j2"}
    commit(store, 2, ["j2"], 2)
    assert store.results.pending() == []
    assert len(rows(store, "results")) == 4  # nothing is deleted: stale results stay credited


def test_result_rows_in_requested_order(store: Store) -> None:
    published(store, 3)
    registered(store, ALICE)
    for k in (0, 1, 2):
        lease(store, f"j{k}", f"L{k}", ALICE, version=k)
        accept(store, f"j{k}", f"L{k}", ALICE, version=k, rewards=[float(k), 1.0], payload=b"p%d" % k)
    got = store.results.rows(["j2", "j0"])
    assert [r.job_id for r in got] == ["j2", "j0"]
    assert [r.version for r in got] == [2, 0]
    assert got[0].rewards == [2.0, 1.0] and got[0].payload == b"p2" and got[0].client_id == ALICE


def test_mark_stale(store: Store) -> None:
    published(store, 3)
    ids = accepted_jobs(store, 0, 1, 2)
    commit(store, 1, ["j0"], 1)
    store.results.mark_stale(["j1", "j0"], 4)  # j0 was already trained on: it stays ingested, not stale
    by_id = {r["job_id"]: r for r in rows(store, "results")}
    assert by_id["j1"]["stale_at"] == 4 and by_id["j1"]["ingested_step"] is None
    assert by_id["j0"]["stale_at"] is None and by_id["j0"]["ingested_step"] == 1
    assert by_id["j2"]["stale_at"] is None
    assert store.totals()["too_stale"] == 1
    assert pending_ids(store) == {"j2"}
    # credit is kept
    assert store.clients.get(ALICE)["accepted"] == len(ids)  # type: ignore[index]


# ---- steps.commit ---------------------------------------------------------------------------------------
def test_commit_step_ingests_and_publishes(store: Store) -> None:
    published(store)
    ids = accepted_jobs(store, 0, 1, 2)
    jobs_before = rows(store, "jobs")
    commit(store, 1, ids, 1)
    assert store.versions.current() == 1 and store.versions.manifest_sha(1) == "m1"
    assert [r["ingested_step"] for r in rows(store, "results")] == [1, 1, 1]
    assert store.results.pending() == []
    assert rows(store, "jobs") == jobs_before  # a step creates no jobs any more
    steps = store.steps.all()
    assert len(steps) == 1 and steps[0].metrics == {"loss": 0.5} and steps[0].trained_version == 0


def test_commit_step_ingests_only_the_batch(store: Store) -> None:
    published(store, 4)
    accepted_jobs(store, 0, 1, 2, 3)
    commit(store, 1, ["j3", "j1"], 1)
    by_id = {r["job_id"]: r["ingested_step"] for r in rows(store, "results")}
    assert by_id == {"j0": None, "j1": 1, "j2": None, "j3": 1}
    assert pending_ids(store) == {"j0", "j2"}


def test_commit_step_ingests_exactly_once(store: Store) -> None:
    published(store)
    ids = accepted_jobs(store, 0, 1)
    commit(store, 1, ids, 1)
    before = snapshot(store)
    with pytest.raises(RuntimeError, match="still pending"):
        commit(store, 2, ids, 2)
    with pytest.raises(RuntimeError, match="still pending"):
        commit(store, 2, ["j0"], 2)
    assert snapshot(store) == before


def test_commit_step_refuses_a_repeated_job_id(store: Store) -> None:
    published(store)
    accepted_jobs(store, 0, 1)
    before = snapshot(store)
    with pytest.raises(RuntimeError, match="still pending"):
        commit(store, 1, ["j0", "j0"], 1)  # one result cannot fill two slots of a batch
    assert snapshot(store) == before


def test_commit_step_with_non_pending_result_rolls_back(store: Store) -> None:
    published(store)
    ids = accepted_jobs(store, 0, 1)
    before = snapshot(store)
    # j2 has no accepted result: the whole step must be refused, including the marks on j0/j1
    with pytest.raises(RuntimeError):
        commit(store, 1, [*ids, "j2"], 1)
    assert snapshot(store) == before
    assert store.versions.current() == 0
    assert pending_ids(store) == set(ids)
    # and a correct commit afterwards still works
    commit(store, 1, ids, 1)
    assert store.versions.current() == 1


def test_commit_step_refuses_a_stale_result(store: Store) -> None:
    published(store, 3)
    ids = accepted_jobs(store, 0, 1, 2)
    store.results.mark_stale(["j1"], 0)
    before = snapshot(store)
    with pytest.raises(RuntimeError, match="still pending"):
        commit(store, 1, ids, 1)
    assert snapshot(store) == before
    assert store.versions.current() == 0 and store.steps.all() == []
    assert pending_ids(store) == {"j0", "j2"}
    with pytest.raises(RuntimeError):
        commit(store, 1, ["j1"], 1)
    assert snapshot(store) == before
    commit(store, 1, ["j0", "j2"], 1)
    assert {r["job_id"]: (r["ingested_step"], r["stale_at"]) for r in rows(store, "results")} == {
        "j0": (1, None), "j1": (None, 0), "j2": (1, None)}


def test_commit_step_duplicate_version_rolls_back(store: Store) -> None:
    published(store)
    ids = accepted_jobs(store, 0)
    before = snapshot(store)
    with pytest.raises(IntegrityError):
        commit(store, 1, ids, 0)  # version 0 already exists
    assert snapshot(store) == before
    assert pending_ids(store) == {"j0"}
    assert store.steps.all() == []


def test_commit_step_duplicate_step_rolls_back(store: Store) -> None:
    published(store)
    accepted_jobs(store, 0, 1)
    commit(store, 1, ["j0"], 1)
    before = snapshot(store)
    with pytest.raises(IntegrityError):
        commit(store, 1, ["j1"], 2)  # step 1 already recorded
    assert snapshot(store) == before
    assert pending_ids(store) == {"j1"}


# ---- durability -----------------------------------------------------------------------------------------
def test_data_survives_reopen(db_path: str | Path) -> None:
    s = Store(db_path)
    published(s, 4)
    ids = accepted_jobs(s, 0, 1)
    accepted_jobs(s, 3)
    s.results.mark_stale(["j3"], 1)
    lease(s, "j2", "L2", BOB, T0 + 60, version=1, now=T0)
    commit(s, 1, ids, 1)
    s.nonces.remember(b"n" * 16, T0 + 300)
    s.set_meta("run_id", "run-xyz")
    s.evals.record(1, 0.5, 64, T0)
    s.close()

    s2 = Store(db_path)
    try:
        assert s2.versions.current() == 1
        assert s2.jobs.next_seq() == 4
        assert s2.get_meta("run_id") == "run-xyz" and s2.get_meta("absent") is None
        assert s2.clients.get(ALICE) is not None
        assert s2.nonces.remember(b"n" * 16, T0 + 300) is False
        job = s2.jobs.get("j2")
        assert job is not None and job.view.state is JobState.LEASED and job.view.lease_client == BOB
        assert job.view.version == 1
        assert [j.view.job_id for j in s2.jobs.active()] == ["j2"]
        assert s2.jobs.live_leases(T0) == 1
        assert {r.job_id: r.ingested_step for r in s2.results.summary()} == {"j0": 1, "j1": 1, "j3": None}
        assert s2.results.pending() == []
        assert s2.evals.all() == [EvalRow(version=1, accuracy=0.5, n=64, at=T0)]
        assert s2.totals() == {"accepted": 3, "rejected": 0, "reissued_jobs": 0, "too_stale": 1, "replicas": 0}
    finally:
        s2.close()


# ---- schema 6: replication retired ------------------------------------------------------------------------
# The spot-check era's layout, as schema 5 left it (the replicas table with its added columns; the work queue's
# 'replay' kind), written here literally: the release that reads it no longer has it anywhere else.
SCHEMA_5_REPLICAS = """CREATE TABLE replicas(
  replica_id TEXT PRIMARY KEY, job_id TEXT NOT NULL REFERENCES jobs(job_id), version INTEGER NOT NULL,
  original_client TEXT NOT NULL, original_class TEXT NOT NULL, created_at REAL NOT NULL,
  state TEXT NOT NULL CHECK(state IN ('open','leased','done')), lease_id TEXT, lease_client TEXT,
  lease_deadline REAL, issue_count INTEGER NOT NULL DEFAULT 0, outcome TEXT, hold INTEGER NOT NULL DEFAULT 0,
  judge TEXT NOT NULL DEFAULT 'peer', hold_until REAL, tried TEXT NOT NULL DEFAULT '', seq INTEGER)"""
SCHEMA_5_WORK = """CREATE TABLE work(
  id INTEGER PRIMARY KEY, kind TEXT NOT NULL CHECK(kind IN ('recompute','replay','evaluate')),
  version INTEGER NOT NULL, request BLOB NOT NULL, created_at REAL NOT NULL,
  state TEXT NOT NULL CHECK(state IN ('queued','claimed','done','failed')),
  worker TEXT, claim_until REAL, attempts INTEGER NOT NULL DEFAULT 0, answer BLOB, error TEXT,
  requester TEXT NOT NULL DEFAULT 'api')"""


def _as_schema_5(store: Store) -> None:
    """Turn a fresh store back into a schema-5 database in the middle of a run with spot-checks on: j0 accepted
    and held for a peer's judgement, a replay request and a recompute request queued; no lease counters and no
    token hashes yet."""
    conn = store.conn
    conn.execute(pg_ddl(SCHEMA_5_REPLICAS) if conn.postgres else SCHEMA_5_REPLICAS)
    for col in ("leased", "unreturned"):
        conn.execute(f"ALTER TABLE clients DROP COLUMN {col}")
    conn.execute("DROP INDEX results_by_completions")
    conn.execute("ALTER TABLE results DROP COLUMN completions_sha256")
    conn.execute("ALTER TABLE jobs DROP COLUMN lease_precision")  # schema 7
    conn.execute("DROP TABLE dropped")  # schema 8
    if conn.postgres:
        conn.execute("ALTER TABLE work DROP CONSTRAINT work_kind_check")
        conn.execute("ALTER TABLE work ADD CONSTRAINT work_kind_check CHECK(kind IN ('recompute','replay','evaluate'))")
        conn.execute("UPDATE meta SET value='5' WHERE key='schema_version'")
    else:
        conn.execute("DROP TABLE work")
        conn.execute(SCHEMA_5_WORK)
        conn.execute("CREATE INDEX work_by_state ON work(state, kind, id)")
        conn.execute("PRAGMA user_version=5")
    conn.execute("INSERT INTO replicas(replica_id, job_id, version, original_client, original_class, created_at, "
                 "state, hold, judge, hold_until, seq) VALUES('j9','j0',0,?,'torch/cpu',?,'open',1,'peer',?,9)",
                 (ALICE, T0, T0 + 300))
    conn.execute("INSERT INTO work(kind, version, request, created_at, state) VALUES('replay',0,?,?,'queued')",
                 (b"r", T0))
    conn.execute("INSERT INTO work(kind, version, request, created_at, state) VALUES('recompute',0,?,?,'queued')",
                 (b"c", T0))


def test_schema_5_loses_replicas_holds_and_replays_and_keeps_the_rest(db_path: str | Path) -> None:
    old = Store(db_path)
    published(old, 2)
    registered(old, ALICE)
    assert lease(old, "j0", "L0", ALICE) and accept(old, "j0", "L0", ALICE)
    _as_schema_5(old)
    assert old.schema_version() == 5 and old.conn.has_table("replicas")
    old.close()

    new = Store(db_path)
    try:
        assert new.schema_version() == SCHEMA_VERSION == 9
        assert not new.conn.has_table("replicas") and new.conn.has_table("dropped")
        assert new.conn.has_table("replica_leases") and new.conn.has_table("replica_results")  # schema 9
        assert new.trust.reward_samples(ALICE) == ((1, 0.75, 0.5625), (0, 0.0, 0.0))
        assert "lease_precision" in new.conn.columns("jobs") and new.jobs.get("j0").precision is None  # type: ignore[union-attr]
        assert {"leased", "unreturned"} <= new.conn.columns("clients") and new.trust.lease_counts(ALICE) == (0, 0)
        assert "completions_sha256" in new.conn.columns("results")
        assert new.results.with_tokens("c" * 64, "j1") is None  # j0, accepted before schema 6, has no hash: NULL
        assert pending_ids(new) == {"j0"}  # the held result is an ordinary pending one now
        assert new.jobs.next_seq() == 2  # the stream follows the jobs alone (the replica's j9 is gone with it)
        queued = [(r["kind"], bytes(r["request"])) for r in new.conn.execute("SELECT kind, request FROM work")]
        assert queued == [("recompute", b"c")]  # the replay request is gone, the recompute one kept
        with pytest.raises(IntegrityError):  # and the queue no longer takes replays
            new.conn.execute("INSERT INTO work(kind, version, request, created_at, state) "
                             "VALUES('replay',0,?,?,'queued')", (b"r", T0))
        item = new.work.submit(EVALUATE, 0, EvaluateRequest(), T0)
        assert new.work.item(item)["requester"] == "api"
    finally:
        new.close()
    again = Store(db_path)  # opening a schema-6 database again changes nothing
    try:
        assert again.schema_version() == SCHEMA_VERSION and pending_ids(again) == {"j0"}
        assert [r["kind"] for r in again.conn.execute("SELECT kind FROM work ORDER BY id")] == ["recompute", "evaluate"]
    finally:
        again.close()


def test_set_meta_overwrites(store: Store) -> None:
    store.set_meta("k", "1")
    store.set_meta("k", "2")
    assert store.get_meta("k") == "2"


def test_a_lost_postgresql_connection_is_reopened_between_transactions(pg_url: str) -> None:
    """A server restart or a dropped link costs the statement in flight at most, not the role: the next statement
    outside a transaction reconnects."""
    s, admin = Store(pg_url), Store(pg_url)
    try:
        pid = s.conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        admin.conn.execute("SELECT pg_terminate_backend(?)", (pid,))
        s.set_meta("after", "reconnect")  # BEGIN finds the connection gone: reconnects, then the transaction runs
        assert s.get_meta("after") == "reconnect"
        assert s.conn.execute("SELECT pg_backend_pid()").fetchone()[0] != pid
    finally:
        s.close()
        admin.close()


def test_commits_are_counted_and_sync_flushes_the_wal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API's flush compares commit counts to know whether a reply needs an fsync; sync() fsyncs the WAL,
    where SQLite (synchronous=NORMAL) left the commits unsynced. Light writes (leases, new jobs) are not counted."""
    import os

    store = Store(tmp_path / "run.sqlite")
    try:
        assert store.conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL: no fsync inside a commit
        before = store.commits
        store.get_meta("run_id")  # a read
        store.jobs.create_next(lambda seq: plan_job(0, seq, 100, 2), GROUP, T0)  # light connection
        assert store.commits == before
        store.set_meta("k", "v")
        assert store.commits == before + 1
        flushed: list[str] = []
        real = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
        store.sync()
        assert [Path(p).name for p in flushed] == ["run.sqlite-wal"]
    finally:
        store.close()
