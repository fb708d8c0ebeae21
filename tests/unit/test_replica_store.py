"""A job's replica lease in the store (coordinator.store.job_rows.Jobs.lease_replica, issue 37) on SQLite and
PostgreSQL (conftest.store_target): two live leases on one job, the first result closes it, the other holder's is
credited (Results.credit_replica), never refused, never trained; the job is not reissued while its replica runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.core.leases import JobState, holds_lease
from coordinator.store.store import Store
from tests.unit.test_store import ALICE, BOB, T0, accept, lease, pending_ids, published, registered

CAROL = "c" * 32


@pytest.fixture()
def store(store_target: str | Path) -> Iterator[Store]:
    s = Store(store_target)
    published(s, 2)
    registered(s, ALICE, BOB, CAROL)
    yield s
    s.close()


def counts(store: Store, client: str) -> tuple[int, float, int]:
    row = store.clients.get(client)
    assert row is not None
    return int(row["accepted"]), float(row["credit"]), int(row["leased"])


def test_two_live_leases_on_one_job(store: Store) -> None:
    assert lease(store, "j0", "L0", ALICE)
    assert store.jobs.lease_replica("j0", "R0", BOB, T0 + 60, T0 + 1) == 0  # the first lease's version
    row = store.jobs.get("j0")
    assert row is not None and row.view.state is JobState.LEASED
    assert (row.view.lease_client, row.view.lease_id) == (ALICE, "L0")  # the primary stays where it was
    assert row.view.replica is not None and (row.view.replica.client, row.view.replica.lease_id) == (BOB, "R0")
    held = row.held_by(BOB, "R0")
    assert (held.view.lease_client, held.view.lease_id, held.view.version) == (BOB, "R0", 0)
    assert holds_lease(row.view, ALICE, "L0") and holds_lease(row.view, BOB, "R0")
    assert not holds_lease(row.view, CAROL, "R0")
    assert store.trust.leases_held(BOB, T0 + 2) == 1 and store.jobs.live_leases(T0 + 2) == 2
    # at most one replica per job; never to the first lease's own holder
    assert store.jobs.lease_replica("j0", "R1", CAROL, T0 + 60, T0 + 2) is None
    assert store.jobs.lease_replica("j1", "R2", CAROL, T0 + 60, T0 + 2) is None  # j1 is not leased
    assert lease(store, "j1", "L1", CAROL) and store.jobs.lease_replica("j1", "R3", CAROL, T0 + 60, T0 + 2) is None


def test_replica_first_then_the_first_holders_result_is_credited_not_trained(store: Store) -> None:
    assert lease(store, "j0", "L0", ALICE)
    assert store.jobs.lease_replica("j0", "R0", BOB, T0 + 60, T0 + 1) == 0
    assert accept(store, "j0", "R0", BOB, content_sha256="b" * 64, completions_sha256="t" * 64)
    row = store.jobs.get("j0")
    assert row is not None and row.view.state is JobState.DONE
    first = store.results.get("j0")
    assert first is not None and first["client_id"] == BOB and first["lease_id"] == "R0"
    assert pending_ids(store) == {"j0"}  # one trained result per job
    # the first holder's own result, later: credited, not a second result of the job
    assert store.results.credit_replica(job_id="j0", lease_id="L0", client_id=ALICE, version=0,
                                        content_sha256="a" * 64, completions_sha256="t" * 64, mean_reward=0.75,
                                        n_tokens=12, credit=12.0, now=T0 + 9)
    assert counts(store, ALICE)[:2] == (1, 12.0)
    credited = store.results.credited_replica("j0", ALICE)
    assert credited is not None and credited["content_sha256"] == "a" * 64
    assert pending_ids(store) == {"j0"} and len(store.results.summary()) == 1
    assert not store.results.credit_replica(job_id="j0", lease_id="L0", client_id=ALICE, version=0,  # once only
                                            content_sha256="d" * 64, completions_sha256=None, mean_reward=0.0,
                                            n_tokens=12, credit=12.0, now=T0 + 10)
    assert counts(store, ALICE)[:2] == (1, 12.0)
    lines = store.audit.lines(client_id=ALICE)
    assert [(x.outcome, x.reason) for x in lines] == [("accepted", "replica")]
    assert store.results.rejections() == []
    # the status page's totals count both "accepted" replies, as the clients do (the demo's summary compares them)
    totals = store.totals()
    assert (totals["accepted"], totals["replicas"]) == (2, 1)
    assert totals["accepted"] == sum(counts(store, c)[0] for c in (ALICE, BOB))


def test_first_lease_first_then_the_replica_is_refused_nothing(store: Store) -> None:
    assert lease(store, "j0", "L0", ALICE)
    assert store.jobs.lease_replica("j0", "R0", BOB, T0 + 60, T0 + 1) == 0
    assert store.jobs.still_held(T0 + 2) == []  # not done: its leases are the active job's
    assert accept(store, "j0", "L0", ALICE)
    # the replica's holder may still be computing it: its lease (and the version it needs) is still held
    (held,) = store.jobs.still_held(T0 + 9)
    assert (held.job_id, held.lease_client, held.lease_id, held.version) == ("j0", BOB, "R0", 0)
    assert store.jobs.still_held(T0 + 61) == []
    assert not accept(store, "j0", "R0", BOB)  # the job is done: the replica's is credited instead, never trained
    assert store.results.credit_replica(job_id="j0", lease_id="R0", client_id=BOB, version=0, content_sha256="b" * 64,
                                        completions_sha256=None, mean_reward=0.5, n_tokens=12, credit=12.0, now=T0 + 9)
    assert counts(store, BOB) == (1, 12.0, 1)
    assert store.trust.leases_held(BOB, T0 + 9) == 0  # a replica of a done job holds nothing


def test_no_reissue_while_the_replica_runs_and_release_of_either(store: Store) -> None:
    assert lease(store, "j0", "L0", ALICE, deadline=T0 + 10)
    assert store.jobs.lease_replica("j0", "R0", BOB, T0 + 60, T0 + 1) == 0
    assert not lease(store, "j0", "L1", CAROL, now=T0 + 20)  # the first lease ran out, the replica runs
    assert store.jobs.release("j0", "L0", ALICE)  # the first holder gives it up: the job opens…
    assert not lease(store, "j0", "L1", CAROL, now=T0 + 20)  # …and still waits for its replica
    assert accept(store, "j0", "R0", BOB)  # which closes it
    assert store.jobs.get("j0").view.state is JobState.DONE  # type: ignore[union-attr]


def test_releasing_the_replica_leaves_the_first_lease_and_counts_unreturned(store: Store) -> None:
    assert lease(store, "j0", "L0", ALICE)
    assert store.jobs.lease_replica("j0", "R0", BOB, T0 + 60, T0 + 1) == 0
    assert store.jobs.release("j0", "R0", BOB)
    row = store.jobs.get("j0")
    assert row is not None and row.view.replica is None and row.view.lease_client == ALICE
    assert store.trust.lease_counts(BOB) == (1, 1)
    assert store.jobs.lease_replica("j0", "R1", CAROL, T0 + 60, T0 + 2) == 0  # one at a time, again


def test_a_replica_that_ran_out_goes_when_the_job_is_reissued(store: Store) -> None:
    assert lease(store, "j0", "L0", ALICE, deadline=T0 + 10)
    assert store.jobs.lease_replica("j0", "R0", BOB, T0 + 12 - 1, T0 + 1) == 0
    assert lease(store, "j0", "L1", CAROL, now=T0 + 20)  # both ran out: reissued
    row = store.jobs.get("j0")
    assert row is not None and row.view.replica is None and row.view.lease_client == CAROL
    assert store.trust.lease_counts(BOB) == (1, 1) and store.trust.lease_counts(ALICE) == (1, 1)
    assert not accept(store, "j0", "R0", BOB)


def test_a_first_lease_a_replica_finished_still_counts_as_held_until_its_own_result(store: Store) -> None:
    """A claimant whose jobs replicas finish must not take one lease after another: its first lease counts against
    `limits.max_leases_per_client` until it returns its own result or runs out (test_adversaries' lease hoarder took
    10 jobs where 2 are allowed before this rule)."""
    assert lease(store, "j0", "L0", ALICE)  # deadline T0 + 60 (test_store's lease)
    assert store.jobs.lease_replica("j0", "R0", BOB, T0 + 60, T0 + 1) == 0
    assert accept(store, "j0", "R0", BOB, content_sha256="b" * 64, completions_sha256="t" * 64)
    assert store.trust.leases_held(ALICE, T0 + 2) == 1  # the job is done, but ALICE's lease has not come back
    assert store.trust.leases_held(BOB, T0 + 2) == 0  # BOB's replica returned
    assert store.results.credit_replica(job_id="j0", lease_id="L0", client_id=ALICE, version=0,
                                        content_sha256="a" * 64, completions_sha256="t" * 64, mean_reward=0.5,
                                        n_tokens=12, credit=12.0, now=T0 + 3)
    assert store.trust.leases_held(ALICE, T0 + 4) == 0  # its result came back (credited)
    assert lease(store, "j1", "L1", ALICE)
    assert store.jobs.lease_replica("j1", "R1", BOB, T0 + 60, T0 + 5) == 0
    assert accept(store, "j1", "R1", BOB, content_sha256="c" * 64, completions_sha256="u" * 64)
    assert store.trust.leases_held(ALICE, T0 + 6) == 1
    assert store.trust.leases_held(ALICE, T0 + 10_000) == 0  # until its lease runs out
